"""Gradient collectives per optimizer step: stock Lightning against lightning_accum, DDP and FSDP2, factors 1, 4, 16.

    python benchmarks/communication.py                 # prints a Markdown table, writes communication.json
    python benchmarks/communication.py --out results/

Runs on 2 CPU processes with gloo (Lightning launches the second process itself) and trains a 4-layer MLP, each
Linear layer its own FSDP2 unit, for one epoch of 32 micro-steps per rank. Stock means Lightning's own strategy with
``Trainer(accumulate_grad_batches=k)``; ours means the accumulation strategy (``gradient_sync="last"``, and
``"every"`` for FSDP2) with ``AccumulationScheduler({0: k})``. DDP all-reduces are counted with a DDP communication
hook (one call per gradient bucket); FSDP2 reduce-scatters and all-gathers with torch.profiler
(``c10d::_reduce_scatter_base_``, ``c10d::_allgather_base_``). The counts are the same on every machine: they
depend on the model and the factor, not on speed.
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DataLoader, TensorDataset

from lightning_accum import AccumulationScheduler, DDPAccumulationStrategy, ModelParallelAccumulationStrategy

WIDTH, LAYERS, MICRO_BATCH, MICRO_STEPS = 64, 4, 4, 32
FACTORS = (1, 4, 16)


class MLP(pl.LightningModule):
    def __init__(self, shard: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(LAYERS)))
        self.shard = shard

    def configure_model(self) -> None:
        if self.shard:
            from torch.distributed.fsdp import fully_shard

            for block in self.net:
                fully_shard(block, mesh=self.device_mesh["data_parallel"])
            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self.net(x).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class CollectiveCounter(pl.Callback):
    """Counts DDP all-reduce calls (a comm hook) and FSDP collectives (torch.profiler) during ``fit``."""

    def __init__(self) -> None:
        self.all_reduces = 0
        self.events: collections.Counter[str] = collections.Counter()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if isinstance(trainer.strategy.model, torch.nn.parallel.DistributedDataParallel):

            def hook(process_group, bucket):  # noqa: ANN001, ANN202 (DDP checks real annotations)
                self.all_reduces += 1
                return default_hooks.allreduce_hook(process_group, bucket)

            trainer.strategy.model.register_comm_hook(None, hook)
        self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        self.profiler.__enter__()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.profiler.__exit__(None, None, None)
        self.events.update(event.name for event in self.profiler.events())


def measure(backend: str, variant: str, factor: int) -> dict[str, Any]:
    counter = CollectiveCounter()
    callbacks: list[pl.Callback] = [counter]
    extra: dict[str, Any] = {}
    if variant == "stock":
        extra["accumulate_grad_batches"] = factor
        mesh = {"data_parallel_size": 2, "tensor_parallel_size": 1}
        strategy = DDPStrategy() if backend == "DDP" else ModelParallelStrategy(**mesh)
    else:
        callbacks.append(AccumulationScheduler({0: factor}, log_metrics=False))
        sync = "every" if variant == "ours, every" else "last"
        strategy = (
            DDPAccumulationStrategy(gradient_sync=sync)
            if backend == "DDP"
            else ModelParallelAccumulationStrategy(gradient_sync=sync, data_parallel_size=2, tensor_parallel_size=1)
        )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=1,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **extra,
    )
    data = TensorDataset(torch.randn(2 * MICRO_BATCH * MICRO_STEPS, WIDTH, generator=torch.Generator().manual_seed(0)))
    trainer.fit(MLP(shard=backend == "FSDP2"), DataLoader(data, batch_size=MICRO_BATCH))
    steps = trainer.global_step
    row = {"backend": backend, "variant": variant, "factor": factor, "optimizer_steps": steps}
    if backend == "DDP":
        row["all_reduces_per_step"] = counter.all_reduces / steps
    else:
        row["reduce_scatters_per_step"] = counter.events["c10d::_reduce_scatter_base_"] / steps
        row["all_gathers_per_step"] = counter.events["c10d::_allgather_base_"] / steps
    return row


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| backend | factor | stock Lightning | lightning_accum (`last`) | lightning_accum (`every`) | collective |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for backend, key, label in (
        ("DDP", "all_reduces_per_step", "all-reduce calls (buckets) per optimizer step"),
        ("FSDP2", "reduce_scatters_per_step", "reduce-scatters per optimizer step"),
        ("FSDP2", "all_gathers_per_step", "all-gathers per optimizer step"),
    ):
        for factor in FACTORS:
            cells = {r["variant"]: r[key] for r in rows if r["backend"] == backend and r["factor"] == factor}
            every = f"{cells['ours, every']:g}" if "ours, every" in cells else "-"
            lines.append(f"| {backend} | {factor} | {cells['stock']:g} | {cells['ours, last']:g} | {every} | {label} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    rows = []
    for backend in ("DDP", "FSDP2"):
        variants = ("stock", "ours, last") + (("ours, every",) if backend == "FSDP2" else ())
        for factor in FACTORS:
            rows += [measure(backend, variant, factor) for variant in variants]
    if torch.distributed.get_rank() == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "communication.json").write_text(json.dumps(rows, indent=2))
        print(f"\n{table(rows)}\n\nwrote {args.out / 'communication.json'}")


if __name__ == "__main__":
    main()
