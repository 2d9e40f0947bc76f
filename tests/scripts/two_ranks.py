"""Train the tiny regression model on 2 CPU processes (gloo), as a user would, and record what happened.

    python tests/scripts/two_ranks.py ddp,fsdp2 OUT_DIR     # DDP's configurations, then FSDP2's
    python tests/scripts/two_ranks.py fsdp1 OUT_DIR         # needs 2 CUDA devices (Lightning's FSDPStrategy)
    python tests/scripts/two_ranks.py ddp disagree OUT_DIR  # only the configurations whose names start so
    LIGHTNING_NAMESPACE=pytorch_lightning python tests/scripts/two_ranks.py ddp,fsdp2 last_k3 OUT_DIR

With ``LIGHTNING_NAMESPACE=pytorch_lightning`` the script is written as a user of the standalone package writes it:
``import pytorch_lightning as pl``, its strategies, and lightning_accum's from ``lightning_accum.pytorch_lightning``
(the callback and ``ManualAccumulation`` imported from ``lightning_accum`` as always).

Lightning launches the second process itself (devices=2). One launch runs several configurations one after another,
each with a fresh Trainer and model, for each backend named (a process costs seconds of imports): stock Lightning,
the accumulation strategy with gradient_sync "last" and "every", a factor schedule, and manual optimization with
ManualAccumulation. For each, every rank writes ``OUT_DIR/<backend>/<name>.rank<r>.json``: the gradient collectives
it issued (DDP: calls of a counting comm hook, with the bucket index; FSDP2: ``c10d::_reduce_scatter_base_`` events of
torch.profiler), the optimizer steps, the micro-steps, and (rank 0) the final full weights.
"""

from __future__ import annotations

import collections
import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lightning_accum import ManualAccumulation  # noqa: E402

# the callback from the module LIGHTNING_ACCUM_CALLBACK names: lightning_accum (as imported today) by default, or
# lightning_accum.pytorch_lightning (what pytorch_lightning before 2.6 needs: it checks callbacks against its Callback)
AccumulationScheduler = importlib.import_module(
    os.environ.get("LIGHTNING_ACCUM_CALLBACK", "lightning_accum")
).AccumulationScheduler

if os.environ.get("LIGHTNING_NAMESPACE") == "pytorch_lightning":
    import pytorch_lightning as pl
    from pytorch_lightning.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy

    from lightning_accum.pytorch_lightning import (
        DDPAccumulationStrategy,
        FSDPAccumulationStrategy,
        ModelParallelAccumulationStrategy,
    )
else:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy

    from lightning_accum import DDPAccumulationStrategy, FSDPAccumulationStrategy, ModelParallelAccumulationStrategy
from tests.helpers import DictDataset, make_tokens, token_loss  # noqa: E402

NUM_SAMPLES, MICRO_BATCH, LR = 64, 4, 0.1  # 2 ranks x 4 = 8 samples per micro-step, 8 micro-steps per epoch
ALLREDUCE_BUCKETS: list[int] = []


def make_data(num_samples: int = NUM_SAMPLES) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(num_samples, 5, generator=generator)
    y = x @ torch.randn(5, 1, generator=generator) + 0.3 * torch.randn(num_samples, 1, generator=generator)
    return x, y


def make_net() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1))


class Regression(pl.LightningModule):
    def __init__(
        self,
        shard: bool,
        manual: ManualAccumulation | None = None,
        cut_at: tuple[int, int] | None = None,
        misuse: bool = False,
    ) -> None:
        super().__init__()
        self.net = make_net()
        self.shard = shard
        self.manual = manual
        self.cut_at = cut_at
        self.misuse = misuse
        self.lr = LR
        self.automatic_optimization = manual is None
        self.oom_above: int | None = None  # rank 1 runs out of memory above this many rows

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        # returning -1 ends the epoch here, leaving the window in progress unfinished
        return -1 if (self.current_epoch, batch_idx) == self.cut_at else None

    def configure_model(self) -> None:
        if self.shard:
            from lightning_accum.compat.torch import fully_shard

            mesh = self.device_mesh["data_parallel"]
            fully_shard(self.net[0], mesh=mesh)
            fully_shard(self.net[2], mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def loss(self, batch: Any) -> torch.Tensor:
        if isinstance(batch, dict):  # token data: the mean over this micro-batch's loss-bearing tokens
            return token_loss(self.net, batch["features"], batch["labels"])
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        rows = len(batch[0]) if isinstance(batch, (list, tuple)) else None
        if self.oom_above is not None and int(os.environ.get("LOCAL_RANK", 0)) == 1 and (rows or 0) > self.oom_above:
            raise torch.OutOfMemoryError(f"CUDA out of memory (simulated on rank 1 for {rows} rows)")
        if self.manual is None:
            return self.loss(batch)
        optimizer = self.optimizers()
        with self.manual.micro_step(self) as micro:
            if self.misuse and micro.should_step:  # the window's last backward without its reduction
                with self.trainer.strategy.block_backward_sync():
                    self.manual_backward(micro.scale(self.loss(batch)))
            else:
                self.manual_backward(micro.scale(self.loss(batch)))
        if micro.should_step:
            optimizer.step()
            optimizer.zero_grad()
        return None

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def nan_at_batch_1_on_rank_1(batch: Any) -> torch.Tensor:
    """A `count_items` that counts samples, and returns NaN for rank 1's micro-batch 1 (ranks disagree)."""
    first_of_batch_1 = make_data()[0][32 + MICRO_BATCH, 0].item()  # rank 1's data starts at sample 32 (`halves`)
    bad = int(os.environ.get("LOCAL_RANK", 0)) == 1 and batch[0][0, 0].item() == first_of_batch_1
    return torch.tensor(float("nan") if bad else float(len(batch[0])))


def halves(data: Any, rank: int, sizes: tuple[int, int] = (32, 32), batch_sizes: tuple[int, int] = (4, 4)) -> Any:
    """Rank r's own data: ``sizes[r]`` samples from its half of ``data``, in order, in batches of ``batch_sizes[r]``."""
    start = rank * len(data) // 2
    return torch.utils.data.Subset(data, range(start, start + sizes[rank])), batch_sizes[rank]


def tokens_without_loss_on_rank_1(data: Any, rank: int) -> Any:
    """Token data whose first window (3 micro-batches of 4) bears no loss on rank 1: only rank 0 counts tokens."""
    tokens = make_tokens(NUM_SAMPLES)
    tokens["labels"][32:44] = -100
    return halves(DictDataset(tokens), rank)


def counting_allreduce_hook(process_group, bucket):  # noqa: ANN001, ANN201 (DDP checks real annotations)
    ALLREDUCE_BUCKETS.append(bucket.index())
    return default_hooks.allreduce_hook(process_group, bucket)


class CountAllReduces(pl.Callback):
    """Lightning registers `ddp_comm_hook` only on CUDA, so register the counting hook on the DDP module here."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.strategy.model.register_comm_hook(None, counting_allreduce_hook)


class CountReduceScatters(pl.Callback):
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        self.profiler.__enter__()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.profiler.__exit__(None, None, None)
        names = collections.Counter(event.name for event in self.profiler.events())
        self.reduce_scatters = names["c10d::_reduce_scatter_base_"]
        self.all_gathers = names["c10d::_allgather_base_"]

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if hasattr(self, "profiler"):
            self.on_train_end(trainer, pl_module)
        else:  # raised before training started
            self.reduce_scatters = self.all_gathers = 0


class Measurements(pl.Callback):
    """Listed after the scheduler: each measured window's two noise-scale sums, by the optimizer step it ends in."""

    def __init__(self) -> None:
        self.by_step: dict[int, list[float]] = {}
        self._last: Any = None

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        scheduler = next(c for c in trainer.callbacks if isinstance(c, AccumulationScheduler))  # type: ignore[attr-defined]
        measurement = scheduler.features["noise_scale"].measurement
        if measurement is not None and measurement is not self._last:
            self.by_step[trainer.global_step + 1] = [measurement.small_sq, measurement.big_sq]
        self._last = measurement


class KeepsGradients(pl.Callback):
    """Keeps every ``p.grad`` at each ``on_before_optimizer_step``, with a copy of its values then."""

    def __init__(self) -> None:
        self.kept: list[tuple[torch.Tensor, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.kept += [(p.grad, p.grad.clone()) for p in pl_module.parameters() if p.grad is not None]


def full_weights(module: nn.Module) -> dict[str, list[float]]:
    weights = {}
    for name, param in module.named_parameters():
        tensor = param.full_tensor() if hasattr(param, "full_tensor") else param  # DTensor under FSDP2
        weights[name] = tensor.detach().flatten().cpu().tolist()
    return weights


def run(backend: str, name: str, mode: str, out: Path, **options: Any) -> None:
    ALLREDUCE_BUCKETS.clear()
    callbacks: list[pl.Callback] = []
    trainer_args: dict[str, Any] = {}
    manual = ManualAccumulation(options["factor"]) if mode == "manual" else None
    if mode == "stock":
        trainer_args["accumulate_grad_batches"] = options["factor"]
    elif mode == "ours":
        callbacks.append(
            AccumulationScheduler(
                options["scheduling"],
                unit=options.get("unit", "epoch"),
                normalize_by=options.get("normalize_by", "micro_batch"),
                noise_scale=options.get("noise_scale", False),
                noise_scale_decay=options.get("noise_scale_decay", 0.99),
                noise_scale_interval=options.get("noise_scale_interval", 10),
                adaptive=options.get("adaptive", False),
                # ranks that disagree on purpose: rank 1 would grow at once to the maximum; rank zero's decision rules
                adaptive_target=64.0 if options.get("rank1_target") and int(os.environ.get("LOCAL_RANK", 0)) else 1.0,
                adaptive_max_factor=32,
                micro_batch_size=options.get("micro_batch_size"),
                count_items=nan_at_batch_1_on_rank_1 if options.get("bad_count") else None,
            )
        )
    measurements, keeps = Measurements(), KeepsGradients()
    if options.get("noise_scale"):
        callbacks += [measurements, keeps]
    sync = options.get("gradient_sync", "last")
    if backend == "ddp":
        callbacks.append(CountAllReduces())
        strategy = DDPStrategy() if mode == "stock" else DDPAccumulationStrategy(gradient_sync=sync)
    elif backend == "fsdp1":
        counter = CountReduceScatters()
        callbacks.append(counter)
        wrap = {"auto_wrap_policy": {nn.Linear}}
        strategy = FSDPStrategy(**wrap) if mode == "stock" else FSDPAccumulationStrategy(gradient_sync=sync, **wrap)
    else:
        counter = CountReduceScatters()
        callbacks.append(counter)
        mesh = {"data_parallel_size": 2, "tensor_parallel_size": 1}
        strategy = (
            ModelParallelStrategy(**mesh)
            if mode == "stock"
            else ModelParallelAccumulationStrategy(gradient_sync=sync, **mesh)
        )
    trainer = pl.Trainer(
        accelerator="cuda" if backend == "fsdp1" else "cpu",
        devices=2,
        strategy=strategy,
        max_epochs=options.get("epochs", 2),
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler="per_rank" not in options,
        **trainer_args,
    )
    model = Regression(
        shard=backend == "fsdp2", manual=manual, cut_at=options.get("cut_at"), misuse=options.get("misuse", False)
    )
    model.lr = options.get("lr", LR)
    model.oom_above = options.get("oom_above")
    batch_size = options.get("batch_size", MICRO_BATCH)
    if options.get("normalize_by") == "token" or options.get("tokens"):
        data: Any = DictDataset(make_tokens(NUM_SAMPLES))
    else:
        data = TensorDataset(*make_data(options.get("num_samples", NUM_SAMPLES)))
    if "per_rank" in options:  # each rank its own data, as the config says (no DistributedSampler)
        rank = int(os.environ.get("LOCAL_RANK", 0))
        data, batch_size = options["per_rank"](data, rank)
    record: dict[str, Any] = {}
    try:
        trainer.fit(model, DataLoader(data, batch_size=batch_size))
    except (RuntimeError, ValueError) as error:  # the same check fails on every rank: no rank is left waiting
        record["raised"] = str(error)
    record |= {
        "optimizer_steps": trainer.global_step,
        "micro_steps": trainer.fit_loop.epoch_loop.total_batch_idx + 1,
        "world_size": trainer.world_size,
        "trainer_class": f"{type(trainer).__module__}.{type(trainer).__name__}",
        "strategy_class": f"{type(trainer.strategy).__module__}.{type(trainer.strategy).__name__}",
        "callback_classes": [f"{type(c).__module__}.{type(c).__name__}" for c in callbacks],
    }
    scheduler = next((c for c in trainer.callbacks if isinstance(c, AccumulationScheduler)), None)
    features = scheduler.features if scheduler is not None else {}
    if "noise_scale" in features:
        estimate = features["noise_scale"].estimate
        record |= {
            "noise_scale": estimate.noise_scale,
            "noise_grad_sq": estimate.grad_sq,
            "noise_trace": estimate.trace,
        }
        record["measurements"] = measurements.by_step
        record["kept_gradients"] = len(keeps.kept)
        record["kept_gradients_overwritten"] = sum(not torch.equal(kept, values) for kept, values in keeps.kept)
    if "adaptive" in features:
        record["adaptive_factor"] = features["adaptive"].factor
    if scheduler is not None and "micro_batch_size_found" in scheduler.state_dict():
        record["micro_batch_size_found"] = scheduler.state_dict()["micro_batch_size_found"]
    if backend == "ddp":
        record["allreduce_buckets"] = list(ALLREDUCE_BUCKETS)
    else:
        record["reduce_scatters"] = counter.reduce_scatters
        record["all_gathers"] = counter.all_gathers
    if backend == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(trainer.strategy.model):
            weights = full_weights(model.net)
    else:
        weights = full_weights(model.net)  # a collective under FSDP2: every rank takes part
    record["weights"] = weights
    (out / f"{name}.rank{trainer.global_rank}.json").write_text(json.dumps(record))


NOISE_FROZEN_K4 = {
    "mode": "ours",
    "scheduling": {0: 4},
    "noise_scale": True,
    "lr": 0.0,
    "num_samples": 1024,
    "epochs": 3,
}
NOISE_SUMS = {"noise_scale": True, "noise_scale_decay": 0.0, "noise_scale_interval": 2}
ADAPTIVE = {
    "mode": "ours",
    "scheduling": {0: 2},
    "noise_scale": True,
    "noise_scale_decay": 0.9,
    "noise_scale_interval": 2,
    "adaptive": True,
    "lr": 0.05,
    "num_samples": 512,
    "epochs": 6,
}
CONFIGS = {
    "stock_k4": {"mode": "stock", "factor": 4},
    "last_k3": {"mode": "ours", "scheduling": {0: 3}},
    "every_k3": {"mode": "ours", "scheduling": {0: 3}, "gradient_sync": "every"},
    "reduce_scatter_k3": {"mode": "ours", "scheduling": {0: 3}, "gradient_sync": "reduce_scatter"},
    # epoch 0 ends at batch 4, one micro-step into its second window: that window is dropped with its gradients
    "last_cut": {"mode": "ours", "scheduling": {0: 3}, "cut_at": (0, 4)},
    "manual_cut": {"mode": "manual", "factor": 3, "cut_at": (0, 4)},
    # a frozen model (lr 0) on 1024 samples: the noise-scale estimate against the exact value
    "noise_frozen_k4": NOISE_FROZEN_K4,
    # the same with DDP reducing on every micro-step: the micro-batch gradients the estimate squares are the same
    "noise_frozen_k4_every": {**NOISE_FROZEN_K4, "gradient_sync": "every"},
    # every other window measured: its two sums against plain PyTorch's, over both ranks' micro-batches (the ranks'
    # own sums differ: every rank must hold the same estimate); kept gradients keep their values
    "noise_sums_k3": {"mode": "ours", "scheduling": {0: 3}, **NOISE_SUMS},
    "noise_sums_sample_ragged": {
        "mode": "ours",
        "scheduling": {0: 3},
        "normalize_by": "sample",
        "num_samples": 60,
        **NOISE_SUMS,
    },
    "noise_sums_token": {"mode": "ours", "scheduling": {0: 3}, "normalize_by": "token", **NOISE_SUMS},
    # the noise scale grows as the model converges: the factor grows, by rank zero's decision on every rank
    "adaptive_k2": ADAPTIVE,
    # the same, with rank 1's callback built with another target: every rank still takes rank zero's decisions
    "adaptive_disagree_k2": {**ADAPTIVE, "rank1_target": True},
    # last: a manual training_step that runs its window's last backward without the reduction must not step
    "misuse_last_step": {"mode": "manual", "factor": 3, "misuse": True},
    "last_step_schedule": {"mode": "ours", "scheduling": {0: 2, 3: 4}, "unit": "step"},
    "manual_k3": {"mode": "manual", "factor": 3},
    # 30 samples a rank: micro-batches 4 x 7 and a last one of 2, windows 3 3 2
    "sample_ragged_k3": {"mode": "ours", "scheduling": {0: 3}, "normalize_by": "sample", "num_samples": 60},
    # sequences with 0 to 6 loss-bearing tokens: every micro-batch, on each rank, holds a different number
    "token_k3": {"mode": "ours", "scheduling": {0: 3}, "normalize_by": "token"},
    # loader batches of 16 split into micro-batches of 5 (5 5 5 1); and found automatically when rank 1 alone runs
    # out of memory above 5 rows: both ranks settle at 4
    "split_m5": {"mode": "ours", "scheduling": {0: 2}, "micro_batch_size": 5, "batch_size": 16},
    "auto_oom_rank1": {
        "mode": "ours",
        "scheduling": {0: 2},
        "micro_batch_size": "auto",
        "batch_size": 16,
        "oom_above": 5,
    },
    # a schedule keyed by the loss-bearing tokens of both ranks: the same windows on both
    "token_unit": {"mode": "ours", "scheduling": {0: 1, 30: 3, 200: 2}, "unit": "token", "tokens": True},
    # the ranks disagree on purpose (each its own data, no DistributedSampler): an error on every rank, or the same
    # training on both
    "disagree_length": {"mode": "ours", "scheduling": {0: 3}, "per_rank": lambda d, r: halves(d, r, (32, 24))},
    "disagree_micro_batch": {
        "mode": "ours",
        "scheduling": {0: 1, 32: 2},
        "unit": "sample",
        "per_rank": lambda d, r: halves(d, r, (32, 16), (4, 2)),
    },
    "disagree_micro_batch_given": {
        "mode": "ours",
        "scheduling": {0: 1, 32: 2},
        "unit": "sample",
        "micro_batch_size": 4,
        "per_rank": lambda d, r: halves(d, r, (32, 16), (4, 2)),
    },
    "disagree_tokens": {
        "mode": "ours",
        "scheduling": {0: 3},
        "normalize_by": "token",
        "per_rank": tokens_without_loss_on_rank_1,
    },
    "disagree_bad_count": {
        "mode": "ours",
        "scheduling": {0: 3},
        "normalize_by": "sample",
        "bad_count": True,
        "per_rank": halves,
    },
}


def main() -> None:
    backends, root, only = sys.argv[1].split(","), Path(sys.argv[-1]), sys.argv[2:-1]
    for backend in backends:
        out = root / backend
        out.mkdir(parents=True, exist_ok=True)
        for name, options in CONFIGS.items():
            if not only or any(name.startswith(prefix) for prefix in only):
                run(backend, name, out=out, **options)
    # every record is written: leave without the interpreter's C++ teardown, which torch 2.13 can abort on a loaded
    # machine after gloo runs ("terminate called without an active exception"; see fsdp1_sync.py)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
