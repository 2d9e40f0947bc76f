"""Batch growth on 2 CPU processes (gloo), in both shells, as a user runs them: adaptive growth from factor 1 in
reduced precision, and Seesaw with ranks whose LR schedules disagree.

    python tests/scripts/growth_ranks.py OUT_DIR

For each backend (DDP, and FSDP2 with ``fully_shard`` on each layer and the root, where this torch runs it) and each
precision (bf16-true, bf16-mixed): a Trainer fit under the strategy's accumulation class, then a Fabric loop through
the Accumulator under Fabric's own strategy, each with a fresh model and optimizer. Every window is measured and the
target is high, so the factor grows from 1 within the run. Each rank trains ``tests.helpers.make_net()`` by SGD on
its own half of the data (no sampler: micro-step j of rank r holds rows ``r x SAMPLES / 2 + 8j ...``) and writes
``OUT_DIR/<shell>_<backend>_<precision>.rank<r>.json``: the window sizes it stepped on and the full weights.
tests/test_adaptive_precision.py replays those windows in a plain loop over both halves.

Then ``seesaw_disagree`` (DDP, float32): a Trainer fit with ``seesaw=True`` whose StepLR halves the LR every quarter
of the samples on rank 0 and every half on rank 1 (a user's bug): every rank must take rank zero's factors
(tests/test_seesaw.py).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy, ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from fabric_common import leave  # noqa: E402

import lightning_accum  # noqa: E402
from lightning_accum import AccumulationScheduler, DDPAccumulationStrategy, ModelParallelAccumulationStrategy  # noqa: E402
from lightning_accum.compat.torch import fully_shard  # noqa: E402
from lightning_accum.fabric import Accumulator  # noqa: E402
from tests.helpers import BACKENDS, make_data, make_net, mse  # noqa: E402

BATCH, SAMPLES, LR = 8, 480, 0.05  # each rank: 30 loader batches of 8 rows
GROWTH = {"noise_scale": True, "noise_scale_interval": 1, "adaptive": True, "adaptive_target": 8.0}
PRECISIONS = ("bf16-true", "bf16-mixed")


def shard(model: nn.Module, mesh: Any) -> nn.Module:
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh["data_parallel"])
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def full_weights(model: nn.Module) -> list[list[float]]:
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    return [p.detach().float().flatten().tolist() for p in full]


def rank_loader(rank: int) -> DataLoader:
    x, y = make_data(SAMPLES, seed=6)
    half = slice(rank * SAMPLES // 2, (rank + 1) * SAMPLES // 2)
    return DataLoader(TensorDataset(x[half], y[half]), batch_size=BATCH)


class Module(pl.LightningModule):
    def __init__(self, sharded: bool) -> None:
        super().__init__()
        self.net, self.sharded = make_net(), sharded

    def configure_model(self) -> None:
        if self.sharded:
            shard(self.net, self.device_mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return mse(self.net(x).float(), y.float())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


class HalvingModule(Module):
    """AdamW under a StepLR moved by samples that halves every ``quarters`` quarters of the steps."""

    def __init__(self, quarters: int) -> None:
        super().__init__(sharded=False)
        self.quarters = quarters

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=LR)
        steps = int(lightning_accum.estimated_stepping_batches(self.trainer))
        halving = torch.optim.lr_scheduler.StepLR(optimizer, step_size=steps * self.quarters // 4, gamma=0.5)
        return [optimizer], [{"scheduler": lightning_accum.SampleDrivenLR(halving), "interval": "step"}]


class Windows(pl.Callback):
    def __init__(self, scheduler: AccumulationScheduler) -> None:
        self.scheduler, self.sizes = scheduler, []

    def on_before_optimizer_step(self, *_: Any) -> None:
        self.sizes.append(self.scheduler.factor)


def trainer_run(out: Path, backend: str, precision: str) -> None:
    sharded = backend == "fsdp2"
    strategy: Any = (
        ModelParallelAccumulationStrategy(data_parallel_size=2, tensor_parallel_size=1)
        if sharded
        else DDPAccumulationStrategy()
    )
    fit(
        out / f"trainer_{backend}_{precision}",
        AccumulationScheduler({0: 1}, **GROWTH),
        strategy,
        precision,
        Module(sharded),
    )


def fit(name: Path, callback: AccumulationScheduler, strategy: Any, precision: str, module: Module) -> None:
    """A one-epoch fit on 2 ranks, each on its own half: ``<name>.rank<r>.json`` holds its windows and weights."""
    windows = Windows(callback)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        precision=precision,  # type: ignore[arg-type]
        max_epochs=1,
        callbacks=[callback, windows],
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, rank_loader(trainer.global_rank))
    record = {"windows": windows.sizes, "weights": full_weights(module.net)}
    Path(f"{name}.rank{trainer.global_rank}.json").write_text(json.dumps(record))


def seesaw_run(out: Path) -> None:
    rank = int(os.environ.get("LOCAL_RANK", 0))  # the launcher's, before the Trainer sets it up
    callback = AccumulationScheduler(seesaw=True, lr_scaling="sqrt")
    fit(out / "seesaw_disagree", callback, DDPAccumulationStrategy(), "32-true", HalvingModule(1 if rank == 0 else 2))


def fabric_run(out: Path, backend: str, precision: str) -> None:
    strategy: Any = (
        ModelParallelStrategy(parallelize_fn=shard, data_parallel_size=2, tensor_parallel_size=1)
        if backend == "fsdp2"
        else DDPStrategy()
    )
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, precision=precision)  # type: ignore[arg-type]
    fabric.launch()
    net = make_net()
    model = fabric.setup_module(net)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=LR))
    accumulator = Accumulator(fabric, model, optimizer, log_metrics=False, **GROWTH)
    sizes = []
    for batch in accumulator.batches(rank_loader(fabric.global_rank)):
        inputs, targets = batch
        with accumulator.micro_step(batch) as micro:
            micro.backward(mse(model(inputs).float(), targets.float()))
        if micro.should_step:
            sizes.append(accumulator.factor)
            optimizer.step()
            optimizer.zero_grad()
    accumulator.close()
    record = {"windows": sizes, "weights": full_weights(model)}
    (out / f"fabric_{backend}_{precision}.rank{fabric.global_rank}.json").write_text(json.dumps(record))


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for backend in BACKENDS:  # FSDP2 where lightning_accum runs it on this torch
        for precision in PRECISIONS:
            trainer_run(out, backend, precision)
    seesaw_run(out)
    for backend in BACKENDS:
        for precision in PRECISIONS:
            fabric_run(out, backend, precision)
    leave()


if __name__ == "__main__":
    main()
