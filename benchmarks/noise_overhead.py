"""What the noise-scale estimate costs: time per optimizer step with noise_scale on against off, in one process.

    python benchmarks/noise_overhead.py                # prints a table, writes noise_overhead.json

A model where backward dominates (an MLP of 4 layers of width 1024 on micro-batches of 64, factor 4) is trained with
``AccumulationScheduler({0: 4}, noise_scale=...)`` in alternating rounds, on and off, after a warm-up, so that drift
of the machine hits both alike; the ratio is taken round by round (on / off) and its median reported with its
range, since a 2-core machine's round times drift by 20%. Both runs log nothing, so the difference is the noise
scale's default sampling: on every 10th window, the parameter hooks (one squared norm per gradient and micro-batch)
and the once-per-step reduction; nothing on the others.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import lightning.pytorch as pl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import FACTOR, alternate, device, fit_seconds  # noqa: E402

from lightning_accum import AccumulationScheduler  # noqa: E402


def step_seconds(noise: bool, steps: int) -> float:
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
    return fit_seconds(trainer, steps) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per round")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    result = alternate(lambda noise: step_seconds(noise, args.steps), args.rounds)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "noise_overhead.json").write_text(json.dumps(result, indent=2))
    ratios = result["ratios"]
    print(
        f"\n| device | noise_scale off (s/step) | on (s/step) | ratio on/off (median of rounds) | range |\n"
        f"| --- | ---: | ---: | ---: | --- |\n| {device()} | {result['baseline']:.4f} | {result['candidate']:.4f} |"
        f" {result['ratio']:.3f} | {min(ratios):.3f} to {max(ratios):.3f} |\n\nwrote {args.out / 'noise_overhead.json'}"
    )


if __name__ == "__main__":
    main()
