"""Train a tiny regression model with FSDP2 HSDP on 4 CPU processes (gloo), as a user would, and record what happened.

    python tests/scripts/hsdp.py OUT_DIR

Lightning launches the other 3 processes itself (``devices=4``). Its ``ModelParallelStrategy`` builds a
("data_parallel", "tensor_parallel") mesh of 4 x 1, so every rank is a data-parallel rank with its own shuffling
DistributedSampler; ``configure_model`` then builds a 2-D ("replicate", "shard") mesh of 2 replicas x 2 shards and
applies ``fully_shard`` on it (FSDP2 on a 2-D mesh is HSDP: reduce-scatter inside the shard group, all-reduce of the
shards across the replicate group). Each Linear layer is its own FSDP2 unit; the root (which holds no parameter of its
own) is wrapped too.

One launch trains once per ``gradient_sync`` ("last", "every", "reduce_scatter"), each with a fresh Trainer and
model: SGD, ``AccumulationScheduler({0: 4})``, one epoch of ``WINDOWS`` windows. Every rank writes
``OUT_DIR/<gradient_sync>.rank<r>.json``: for each optimizer step, the reduce-scatters, all-reduces and all-gathers it
issued, by process group (counted by wrapping ``torch.distributed.reduce_scatter_single``, ``all_reduce`` and
``all_gather_single``, the functions FSDP2 calls), the totals of torch.profiler's ``c10d::`` events as a cross-check,
the micro-steps, the optimizer steps, the FSDP2 units that hold parameters, and (rank 0) the final full weights
(``full_tensor()`` of the DTensor parameters, a collective every rank takes part in).
"""

from __future__ import annotations

import collections
import functools
import inspect
import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lightning_accum import AccumulationScheduler, ModelParallelAccumulationStrategy  # noqa: E402
from lightning_accum.distributed.sync import GradientSync  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import two_ranks  # noqa: E402

WORLD_SIZE, REPLICAS, SHARDS = 4, 2, 2
FACTOR, WINDOWS, MICRO_BATCH, LR = 4, 3, 2, 0.1  # per rank: 3 windows x 4 micro-steps x 2 samples
NUM_SAMPLES = WORLD_SIZE * WINDOWS * FACTOR * MICRO_BATCH  # 96: one epoch is exactly WINDOWS windows
SYNCS: tuple[GradientSync, ...] = ("last", "every", "reduce_scatter")
# what FSDP2 (torch 2.13, _fsdp_collectives.py) calls: DefaultReduceScatter -> dist.reduce_scatter_single, the HSDP
# all-reduce -> dist.all_reduce, DefaultAllGather -> dist.all_gather_single (looked up on torch.distributed per call)
# (torch 2.12 and older: dist.reduce_scatter_tensor and dist.all_gather_into_tensor, the same collectives)
COUNTED = {
    "reduce_scatter": "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor",
    "all_reduce": "all_reduce",
    "all_gather": "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor",
}
PROFILER_EVENTS = {
    "reduce_scatter": "c10d::_reduce_scatter_base_",
    "all_reduce": "c10d::allreduce_",
    "all_gather": "c10d::_allgather_base_",
}


def make_data(num_samples: int = NUM_SAMPLES) -> tuple[torch.Tensor, torch.Tensor]:
    return two_ranks.make_data(num_samples)  # the regression data of the 2-process tests


def make_net() -> nn.Sequential:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 1))


_MESH: Any = None


def hsdp_mesh() -> Any:
    """The ("replicate", "shard") mesh, built once per process (the process group outlives each Trainer)."""
    global _MESH
    if _MESH is None:
        from torch.distributed.device_mesh import init_device_mesh

        _MESH = init_device_mesh("cpu", (REPLICAS, SHARDS), mesh_dim_names=("replicate", "shard"))
    return _MESH


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()

    def configure_model(self) -> None:
        from lightning_accum.compat.torch import fully_shard

        mesh = hsdp_mesh()
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


class CountCollectives(pl.Callback):
    """Counts each collective call during training by kind, process group and optimizer step (window)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, str, str]] = []  # (optimizer step it belongs to, kind, group)
        self.micro_steps = 0
        self.profiled: dict[str, int] = {}
        self._originals: dict[str, Any] = {}
        self._trainer: pl.Trainer | None = None

    def _group_name(self, group: Any) -> str:
        mesh = hsdp_mesh()
        if group is None or group is dist.group.WORLD:
            return "world"
        if group is mesh.get_group("replicate"):
            return "replicate"
        if group is mesh.get_group("shard"):
            return "shard"
        return f"other(size {group.size()})"

    def _wrap(self, kind: str, original: Any) -> Any:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            group = signature.bind(*args, **kwargs).arguments.get("group")
            assert self._trainer is not None
            self.calls.append((self._trainer.global_step, kind, self._group_name(group)))
            return original(*args, **kwargs)

        return counted

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._trainer = trainer
        for kind, name in COUNTED.items():
            self._originals[name] = getattr(dist, name)
            setattr(dist, name, self._wrap(kind, self._originals[name]))
        self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        self.profiler.__enter__()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.micro_steps += 1

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.stop()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.stop()

    def stop(self) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)
        self._originals.clear()
        if hasattr(self, "profiler") and not self.profiled:
            self.profiler.__exit__(None, None, None)
            names = collections.Counter(event.name for event in self.profiler.events())
            self.profiled = {kind: names[event] for kind, event in PROFILER_EVENTS.items()}

    def per_step(self, steps: int) -> list[dict[str, dict[str, int]]]:
        """``[step][kind][group]``: the calls of each optimizer step, then one entry for the calls after the last."""
        table: list[dict[str, dict[str, int]]] = [{kind: {} for kind in COUNTED} for _ in range(steps + 1)]
        for step, kind, group in self.calls:
            counts = table[step][kind]
            counts[group] = counts.get(group, 0) + 1
        return table


def fsdp2_units(module: nn.Module) -> int:
    """The FSDP2 parameter groups under ``module``: one per ``fully_shard`` module that manages parameters of its own
    (each reduce-scatters, and on HSDP all-reduces, its gradients in one collective)."""
    from lightning_accum.compat.torch import fsdp_module_type
    from lightning_accum.distributed.sync import param_groups_of

    units = 0
    for sub in module.modules():
        if isinstance(sub, fsdp_module_type()):
            state = sub._get_fsdp_state()
            units += len(param_groups_of(state))  # as lightning_accum/distributed/sync.py reads them, on any torch
    return units


full_weights = two_ranks.full_weights  # full_tensor() of each DTensor parameter


def run(sync: GradientSync, out: Path) -> None:
    counter = CountCollectives()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=WORLD_SIZE,
        strategy=ModelParallelAccumulationStrategy(
            data_parallel_size=WORLD_SIZE, tensor_parallel_size=1, gradient_sync=sync
        ),
        max_epochs=1,
        callbacks=[AccumulationScheduler({0: FACTOR}), counter],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Regression()
    trainer.fit(model, DataLoader(TensorDataset(*make_data()), batch_size=MICRO_BATCH))
    mesh = hsdp_mesh()
    record: dict[str, Any] = {
        "gradient_sync": sync,
        "world_size": trainer.world_size,
        "mesh": {name: mesh[name].size() for name in ("replicate", "shard")},
        "optimizer_steps": trainer.global_step,
        "micro_steps": counter.micro_steps,
        "units": fsdp2_units(model.net),
        "per_step": counter.per_step(trainer.global_step),  # the last entry: after the last optimizer step
        "profiled": counter.profiled,
    }
    weights = full_weights(model.net)  # a collective: every rank takes part
    if trainer.global_rank == 0:
        record["weights"] = weights
    (out / f"{sync}.rank{trainer.global_rank}.json").write_text(json.dumps(record))


def main() -> None:
    out = Path(sys.argv[-1])
    out.mkdir(parents=True, exist_ok=True)
    for sync in SYNCS:
        run(sync, out)
    # every record is written: leave without the interpreter's C++ teardown, which torch 2.13 can abort on a loaded
    # machine after gloo runs (see two_ranks.py)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
