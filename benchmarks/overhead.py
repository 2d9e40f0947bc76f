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
import sys
import tempfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loggers import CSVLogger

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import FACTOR, alternate, device, fit_seconds  # noqa: E402

from lightning_accum import AccumulationScheduler  # noqa: E402


def micro_step_seconds(ours: bool, steps: int, log_dir: str) -> float:
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
    return fit_seconds(trainer, steps, log_loss=True) / (steps * FACTOR)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per round")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as log_dir:
        result = alternate(lambda ours: micro_step_seconds(ours, args.steps, log_dir), args.rounds)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "overhead.json").write_text(json.dumps(result, indent=2))
    ratios = result["ratios"]
    print(
        f"\n| device | stock (ms/micro-step) | ours (ms/micro-step) | ratio ours/stock (median of rounds) | range |\n"
        f"| --- | ---: | ---: | ---: | --- |\n| {device()} | {result['baseline'] * 1e3:.2f} |"
        f" {result['candidate'] * 1e3:.2f} | {result['ratio']:.3f} | {min(ratios):.3f} to {max(ratios):.3f} |"
        f"\n\nwrote {args.out / 'overhead.json'}"
    )


if __name__ == "__main__":
    main()
