"""Time per micro-step: AccumulationScheduler (all logging on) against stock Lightning at the same factor.

    python benchmarks/overhead.py                  # prints a table, writes overhead.json

Both train the same MLP (4 layers of width 1024, micro-batch 64) with factor 4 in one process, in alternating rounds
after a warm-up, with a CSVLogger each, so that drift of the machine hits both alike. Stock is
``Trainer(accumulate_grad_batches=4)``; ours is ``AccumulationScheduler({0: 4})`` with its per-step ``accum/...``
metrics, memory probe and progress-bar values. The ratio is taken round by round (ours / stock) and its median
reported with its range. Target: at most 1.02.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
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
        loss = self.net(x).pow(2).mean()
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-4)


def seconds_per_micro_step(ours: bool, steps: int, log_dir: str) -> float:
    data = TensorDataset(torch.randn(MICRO_BATCH * FACTOR * steps, WIDTH, generator=torch.Generator().manual_seed(0)))
    extra: dict[str, Any] = (
        {"callbacks": [AccumulationScheduler({0: FACTOR})]} if ours else {"accumulate_grad_batches": FACTOR}
    )
    trainer = pl.Trainer(
        accelerator="auto",
        devices=1,
        max_epochs=1,
        logger=CSVLogger(log_dir),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **extra,
    )
    start = time.perf_counter()
    trainer.fit(MLP(), DataLoader(data, batch_size=MICRO_BATCH))
    return (time.perf_counter() - start) / (steps * FACTOR)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per round")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as log_dir:
        seconds_per_micro_step(True, 2, log_dir)  # warm-up
        times: dict[str, list[float]] = {"stock": [], "ours": []}
        for _ in range(args.rounds):
            for label in ("stock", "ours"):
                times[label].append(seconds_per_micro_step(label == "ours", args.steps, log_dir))
    ratios = [b / a for a, b in zip(times["stock"], times["ours"], strict=True)]
    ratio = statistics.median(ratios)
    stock, ours = statistics.median(times["stock"]), statistics.median(times["ours"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "overhead.json").write_text(json.dumps({"ratio": ratio, "ratios": ratios, "rounds": times}, indent=2))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(
        f"\n| device | stock (ms/micro-step) | ours (ms/micro-step) | ratio ours/stock (median of rounds) | range |\n"
        f"| --- | ---: | ---: | ---: | --- |\n| {device} | {stock * 1e3:.2f} | {ours * 1e3:.2f} | {ratio:.3f} |"
        f" {min(ratios):.3f} to {max(ratios):.3f} |\n\nwrote {args.out / 'overhead.json'}"
    )


if __name__ == "__main__":
    main()
