"""How far the noise-scale estimate is from the exact B_simple, and how often its bound holds, at factor 1 and 2.

    python benchmarks/noise_estimate.py                 # prints a table, writes noise_estimate.json

A frozen model (learning rate 0, so every step samples the same gradient distribution) is trained with
``AccumulationScheduler(noise_scale=True, adaptive=True)`` for ``--steps`` optimizer steps, ``--repeats`` times, each
on its own shuffle of the data. After each run the callback's estimate is compared with the exact B_simple of the
model on the whole data set, computed from every per-sample gradient (``torch.func``), and so is the bound adaptive
growth acts on (the one-sided 90% lower bound, ``accum/noise_scale_low``). Micro-batches of 8 samples: at factor 1 a
measured window is run as two halves of 4 (two gradients), at factor 2 as two micro-batches of 8. Every window
measured (``noise_scale_interval=1``) and the default (every 10th), with the default ``noise_scale_decay`` (0.95).
The adaptive factor is capped at the starting one, so that the batch stays the same throughout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import Frozen  # noqa: E402

from lightning_accum import AccumulationScheduler  # noqa: E402
from lightning_accum.core.adaptive import AdaptiveFactor  # noqa: E402
from tests.helpers import exact_noise_scale  # noqa: E402  (every per-sample gradient of the data set, torch.func)

SAMPLES, FEATURES, MICRO_BATCH = 4096, 16, 8


def make_problem() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A small MLP at initialisation on a noisy linear target: B_simple about 36 samples, a few micro-batches."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    y = x @ torch.randn(FEATURES, 1, generator=generator) + 2.0 * torch.randn(SAMPLES, 1, generator=generator)
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, 1)), x, y


def one_run(net: nn.Module, x: torch.Tensor, y: torch.Tensor, factor: int, interval: int, steps: int, seed: int):
    callback = AccumulationScheduler(
        {0: factor}, noise_scale=True, noise_scale_interval=interval, adaptive=True, adaptive_max_factor=factor
    )
    loader = DataLoader(
        TensorDataset(x, y), batch_size=MICRO_BATCH, shuffle=True, generator=torch.Generator().manual_seed(seed)
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Frozen(net), loader)
    estimate = callback.features["noise_scale"].estimate  # type: ignore[attr-defined]
    bounds = AdaptiveFactor(confidence=0.9).bounds(estimate)  # the bound adaptive growth acts on, target 1
    return estimate.noise_scale, None if bounds is None else bounds[0], estimate.measurements


def summarize(values: list[float | None], lows: list[float | None], exact: float) -> dict[str, Any]:
    ratios = sorted(v / exact for v in values if v is not None)
    deciles = statistics.quantiles(ratios, n=10) if len(ratios) > 1 else [float("nan")] * 9
    held = [low <= exact for low in lows if low is not None]
    return {
        "median": statistics.median(ratios) if ratios else None,
        "p10": deciles[0],
        "p90": deciles[-1],
        "no_estimate": sum(v is None for v in values) / len(values),
        "bound_holds": sum(held) / len(held) if held else None,
        "no_bound": sum(low is None for low in lows) / len(lows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    net, x, y = make_problem()
    exact = exact_noise_scale(net, x, y)
    rows = []
    for factor in (1, 2):
        for interval in (1, 10):
            runs = [one_run(net, x, y, factor, interval, args.steps, seed) for seed in range(args.repeats)]
            row = {
                "factor": factor,
                "interval": interval,
                **summarize([r[0] for r in runs], [r[1] for r in runs], exact),
            }
            row["measurements"] = statistics.median(r[2] for r in runs)
            rows.append(row)
            print(row, flush=True)
    result = {"exact": exact, "steps": args.steps, "repeats": args.repeats, "micro_batch": MICRO_BATCH, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "noise_estimate.json").write_text(json.dumps(result, indent=2))
    print(
        f"exact B_simple {exact:.1f} samples; {args.steps} steps of micro-batches of {MICRO_BATCH}, {args.repeats} runs"
    )
    print(
        "| factor | windows measured | measurements behind it | median / exact | 10th to 90th percentile |"
        " no estimate | no bound yet | 90% lower bound below exact |"
    )
    print("| ---: | --- | ---: | ---: | --- | ---: | ---: | ---: |")
    for row in rows:
        every = "every one" if row["interval"] == 1 else f"every {row['interval']}th"
        held = "n/a" if row["bound_holds"] is None else f"{row['bound_holds']:.0%}"
        print(
            f"| {row['factor']} | {every} | {row['measurements']:.1f} | {row['median']:.2f} |"
            f" {row['p10']:.2f} to {row['p90']:.2f} | {row['no_estimate']:.0%} | {row['no_bound']:.0%} | {held} |"
        )


if __name__ == "__main__":
    main()
