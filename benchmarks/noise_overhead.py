"""What the noise-scale estimate costs: time per optimizer step with noise_scale on against off, in one process.

    python benchmarks/noise_overhead.py                # prints a table, writes noise_overhead.json

A model where backward dominates (an MLP of 4 layers of width 1024 on micro-batches of 64, factor 4) is trained with
``AccumulationScheduler({0: 4}, noise_scale=...)`` in alternating rounds, on and off, after a warm-up, so that drift
of the machine hits both alike; the ratio is taken round by round (on / off) and its median reported with its
range, since a 2-core machine's round times drift by 20%. Both runs log nothing, so the difference
is the parameter hooks (one squared norm per gradient and micro-batch) and the once-per-step reduction.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accum import AccumulationScheduler

WIDTH, LAYERS, MICRO_BATCH, FACTOR = 1024, 4, 64, 4


class MLP(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(LAYERS)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self.net(x).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-4)


def round_seconds(noise: bool, steps: int) -> float:
    data = TensorDataset(torch.randn(MICRO_BATCH * FACTOR * steps, WIDTH, generator=torch.Generator().manual_seed(0)))
    trainer = pl.Trainer(
        accelerator="auto",
        devices=1,
        max_epochs=1,
        callbacks=[AccumulationScheduler({0: FACTOR}, noise_scale=noise, log_metrics=False)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = MLP()
    start = time.perf_counter()
    trainer.fit(model, DataLoader(data, batch_size=MICRO_BATCH))
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per round")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    round_seconds(True, 2)  # warm-up
    times: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(args.rounds):
        for label, noise in (("off", False), ("on", True)):
            times[label].append(round_seconds(noise, args.steps))
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    ratios = [b / a for a, b in zip(times["off"], times["on"], strict=True)]
    ratio = statistics.median(ratios)
    row = {"seconds_per_step_off": off, "seconds_per_step_on": on, "ratio": ratio, "ratios": ratios, "rounds": times}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "noise_overhead.json").write_text(json.dumps(row, indent=2))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(
        f"\n| device | noise_scale off (s/step) | on (s/step) | ratio on/off (median of rounds) | range |\n"
        f"| --- | ---: | ---: | ---: | --- |\n| {device} | {off:.4f} | {on:.4f} | {ratio:.3f} |"
        f" {min(ratios):.3f} to {max(ratios):.3f} |\n\nwrote {args.out / 'noise_overhead.json'}"
    )


if __name__ == "__main__":
    main()
