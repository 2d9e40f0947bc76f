"""Gradient collectives per optimizer step: stock Lightning against lightning_accum, DDP and FSDP2, factors 1, 4, 16.

    python benchmarks/communication.py                 # prints a Markdown table, writes communication.json
    python benchmarks/communication.py --out results/
    python benchmarks/communication.py --timing        # the FSDP2 collective check's cost: communication_timing.json

Runs on 2 CPU processes with gloo (Lightning launches the second process itself) and trains a 4-layer MLP, each
Linear layer its own FSDP2 unit, for one epoch of 32 micro-steps per rank. Stock means Lightning's own strategy with
``Trainer(accumulate_grad_batches=k)``; ours means the accumulation strategy (``gradient_sync="last"``, and
``"every"`` for FSDP2) with ``AccumulationScheduler({0: k})``. DDP all-reduces are counted with a DDP communication
hook (one call per gradient bucket); FSDP2 reduce-scatters and all-gathers with torch.profiler
(``c10d::_reduce_scatter_base_``, ``c10d::_allgather_base_``). The counts are the same on every machine: they
depend on the model and the factor, not on speed.

``--timing`` times the same FSDP2 model instead, factor 3, ``--steps`` optimizer steps per fit: stock
``ModelParallelStrategy``, and ``ModelParallelAccumulationStrategy(gradient_sync="last")`` with
``check_collectives=False``, with the default (the ranks agree before every FSDP2 collective of the first 3 windows,
then the check steps aside) and with ``"always"``. Every configuration fits once per round, in an order rotated every
round, for ``--rounds`` rounds after a warm-up round; each ratio is taken round by round, and its median and range
reported. Per fit, on rank 0: the training loop's time, and the median and the fastest window after the third (where
the default check has stepped aside; a burst of other work on the machine hits these less than the total).
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ratio, rotated_rounds  # noqa: E402

from lightning_accum import (  # noqa: E402
    AccumulationScheduler,
    DDPAccumulationStrategy,
    ModelParallelAccumulationStrategy,
)
from lightning_accum.distributed.sync import CHECKED_WINDOWS  # noqa: E402

WIDTH, LAYERS, MICRO_BATCH, MICRO_STEPS = 64, 4, 4, 32
FACTORS = (1, 4, 16)
TIMING_FACTOR = 3
TIMED = {  # name: check_collectives, or None for stock ModelParallelStrategy
    "stock": None,
    "check_collectives=False": False,
    "default (3 windows)": True,
    '"always"': "always",
}


class MLP(pl.LightningModule):
    def __init__(self, shard: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(LAYERS)))
        self.shard = shard

    def configure_model(self) -> None:
        if self.shard:
            from lightning_accum.compat.torch import fully_shard

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


class LoopTimer(pl.Callback):
    """When the training loop starts, when each window ends (after its optimizer step) and when the loop ends."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start, self.window_ends = time.perf_counter(), []

    def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
        if trainer.global_step > len(self.window_ends):
            self.window_ends.append(time.perf_counter())

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.end = time.perf_counter()


def timed_fit(name: str, steps: int) -> dict[str, float]:
    """One fit of ``steps`` optimizer steps: the training loop's seconds, those after the third window, and the median
    and the fastest window after the third (less touched by bursts of the machine's other work than the total)."""
    timer = LoopTimer()
    check = TIMED[name]
    mesh = {"data_parallel_size": 2, "tensor_parallel_size": 1}
    if check is None:
        strategy: ModelParallelStrategy = ModelParallelStrategy(**mesh)
        callbacks: list[pl.Callback] = [timer]
    else:
        strategy = ModelParallelAccumulationStrategy(gradient_sync="last", check_collectives=check, **mesh)
        callbacks = [AccumulationScheduler({0: TIMING_FACTOR}, log_metrics=False), timer]
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **({"accumulate_grad_batches": TIMING_FACTOR} if check is None else {}),
    )
    samples = 2 * MICRO_BATCH * TIMING_FACTOR * steps
    data = TensorDataset(torch.randn(samples, WIDTH, generator=torch.Generator().manual_seed(0)))
    trainer.fit(MLP(shard=True), DataLoader(data, batch_size=MICRO_BATCH))
    assert len(timer.window_ends) == steps
    ends = timer.window_ends[CHECKED_WINDOWS - 1 :]  # from the end of the last checked window on
    windows = [later - earlier for earlier, later in itertools.pairwise(ends)]
    return {
        "loop": timer.end - timer.start,
        "after": timer.end - ends[0],
        "window": statistics.median(windows),
        "fastest": min(windows),
    }


def timing(rounds: int, steps: int) -> dict[str, Any]:
    """Every configuration once per round, rotated; the ratios round by round (rank 0's clock)."""
    names = list(TIMED)
    fits: dict[str, list[dict[str, float]]] = {name: [] for name in names}

    def measure(name: str) -> float:
        fits[name].append(timed_fit(name, steps))
        return fits[name][-1]["loop"]

    rotated_rounds(measure, names, 1)  # warm-up: first fits pay for imports, the process group and the guard's group
    fits = {name: [] for name in names}
    rotated_rounds(measure, names, rounds)
    times = {
        key: {name: [fit[key] for fit in fits[name]] for name in names}
        for key in ("loop", "after", "window", "fastest")
    }
    rows = [
        {
            "configuration": name,
            **{f"{key}_s": statistics.median(times[key][name]) for key in times},
            **{f"{key}_vs_off": ratio(times[key], name, "check_collectives=False") for key in times},
            "window_vs_stock": ratio(times["window"], name, "stock"),
        }
        for name in names
    ]
    return {"rounds": rounds, "steps": steps, "factor": TIMING_FACTOR, "rows": rows, "times": times}


def timing_table(result: dict[str, Any]) -> str:
    def cell(r: dict[str, float]) -> str:
        return f"{r['median']:.3f} ({r['min']:.3f} to {r['max']:.3f})"

    lines = [
        '| FSDP2, `gradient_sync="last"` | training loop (s) | ratio to `False` | window after the 3rd, median (ms)'
        " | ratio to `False` | ratio to stock | fastest window after the 3rd (ms) | ratio to `False` |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['configuration']} | {row['loop_s']:.2f} | {cell(row['loop_vs_off'])}"
            f" | {1000 * row['window_s']:.1f} | {cell(row['window_vs_off'])} | {cell(row['window_vs_stock'])}"
            f" | {1000 * row['fastest_s']:.1f} | {cell(row['fastest_vs_off'])} |"
        )
    return "\n".join(lines)


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
    parser.add_argument("--timing", action="store_true", help="time the FSDP2 collective check instead of counting")
    parser.add_argument("--rounds", type=int, default=9, help="timed rounds (--timing)")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per fit (--timing)")
    args = parser.parse_args()
    if args.timing:
        result = timing(args.rounds, args.steps)
        if torch.distributed.get_rank() == 0:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "communication_timing.json").write_text(json.dumps(result, indent=2))
            print(f"\n{timing_table(result)}\n\nwrote {args.out / 'communication_timing.json'}")
        return
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
