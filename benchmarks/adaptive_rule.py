"""How often adaptive growth overshoots the factor a frozen model's exact noise scale calls for, in real fits.

    python benchmarks/adaptive_rule.py                  # prints a table, writes adaptive_rule.json
    PYTHONPATH=/path/to/other/checkout python benchmarks/adaptive_rule.py --label before   # another version's rule

A frozen model (learning rate 0: every window samples the same gradient distribution) whose exact B_simple, from
every per-sample gradient, is 48.5 samples: on micro-batches of 8 it calls for factor 6 (a batch of 48; 7 would be
56). ``--runs`` shuffles (16) of 3 epochs of 4,096 samples with ``AccumulationScheduler(noise_scale=True,
adaptive=True)`` from factor 1, every window measured (``noise_scale_interval=1``) and the default sampling (every
10th); with and without ``adaptive_shrink``. Beside it, the two cases with a known answer, on 1,024 samples of a
linear model: noise only (at the least-squares fit of its data: no batch is too large, growth must reach
``adaptive_max_factor``) and no noise (every sample the same: growth must never start). Reported: the final factors,
how many runs end above the factor called for, the worst final batch over the noise scale, and the optimizer step at
which each run first reached 5.
"""

from __future__ import annotations

import argparse
import json
import math
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
from tests.helpers import exact_noise_scale  # noqa: E402  (every per-sample gradient of the data set, torch.func)

MICRO, SAMPLES = 8, 4096


def frozen_problem() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The MLP of tests/test_adaptive.py at initialisation, on a noisy linear target: B_simple 48.5 samples."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 16, generator=generator)
    y = x @ torch.randn(16, 1, generator=generator) + 2.85 * torch.randn(SAMPLES, 1, generator=generator)
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1)), x, y


class FirstReached(pl.Callback):
    """The optimizer step at which the factor first reached ``factor``."""

    def __init__(self, factor: int) -> None:
        self.factor, self.step = factor, None

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, *_: Any) -> None:
        if self.step is None and trainer.accumulate_grad_batches >= self.factor:
            self.step = trainer.global_step


def one_run(
    net: nn.Module, x: torch.Tensor, y: torch.Tensor, seed: int, epochs: int = 3, **options: Any
) -> tuple[int, int | None]:
    callback = AccumulationScheduler(noise_scale=True, adaptive=True, log_metrics=False, **options)
    reached = FirstReached(5)
    loader = DataLoader(
        TensorDataset(x, y), batch_size=MICRO, shuffle=True, generator=torch.Generator().manual_seed(seed)
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=epochs,
        callbacks=[callback, reached],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Frozen(net), loader)
    return max(1, callback.features["adaptive"].factor), reached.step  # type: ignore[attr-defined]


def known_answers(max_factor: int) -> dict[str, list[int]]:
    """Noise only (a least-squares fit: |G|^2 = 0) and no noise (one sample repeated), 4 shuffles each.

    1,024 samples a epoch: 8 epochs of noise only (the windows grow rarer as the factor grows), 3 of no noise.
    """
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 5, generator=generator)
    y = x @ torch.randn(5, 1, generator=generator) + torch.randn(1024, 1, generator=generator)
    solution = torch.linalg.lstsq(torch.cat([x, torch.ones(1024, 1)], 1), y).solution
    fitted = nn.Linear(5, 1)
    fitted.weight.data, fitted.bias.data = solution[:5].T.clone(), solution[5].clone()
    same_x, same_y = x[:1].expand(1024, 5).contiguous(), y[:1].expand(1024, 1).contiguous()
    options = {"noise_scale_interval": 1, "adaptive_max_factor": max_factor}
    return {
        "noise only": [one_run(fitted, x, y, seed, epochs=8, **options)[0] for seed in range(4)],
        "no noise": [one_run(nn.Linear(5, 1), same_x, same_y, seed, **options)[0] for seed in range(4)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=16)
    parser.add_argument("--label", default="this checkout")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    net, x, y = frozen_problem()
    exact = exact_noise_scale(net, x, y)
    called = math.floor(exact / MICRO)
    rows = []
    print(f"exact B_simple {exact:.1f} samples: factor {called} called for on micro-batches of {MICRO}", flush=True)
    for interval in (1, 10):
        for shrink in (False, True):
            runs = [
                one_run(net, x, y, seed, noise_scale_interval=interval, adaptive_shrink=shrink)
                for seed in range(args.runs)
            ]
            finals = sorted(final for final, _ in runs)
            reached = [step for _, step in runs if step is not None]
            row = {
                "interval": interval,
                "shrink": shrink,
                "finals": finals,
                "above": sum(final > called for final in finals),
                "worst_batch_over_noise_scale": max(finals) * MICRO / exact,
                "reached_5": len(reached),
                "median_step_reaching_5": statistics.median(reached) if reached else None,
            }
            rows.append(row)
            print(row, flush=True)
    answers = known_answers(max_factor=16)
    print(f"known answers (adaptive_max_factor=16): {answers}", flush=True)
    result = {"label": args.label, "exact": exact, "called": called, "rows": rows, "known_answers": answers}
    args.out.mkdir(parents=True, exist_ok=True)
    name = "adaptive_rule.json" if args.label == "this checkout" else f"adaptive_rule_{args.label}.json"
    (args.out / name).write_text(json.dumps(result, indent=2))
    print(
        f"\n| {args.label}: sampling | shrink | runs above factor {called} | worst batch / noise scale |"
        " reached 5 | median step reaching 5 | final factors |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | --- |")
    for row in rows:
        every = "every window" if row["interval"] == 1 else "every 10th"
        print(
            f"| {every} | {row['shrink']} | {row['above']} of {args.runs} | {row['worst_batch_over_noise_scale']:.2f} |"
            f" {row['reached_5']} of {args.runs} | {row['median_step_reaching_5']} | {row['finals']} |"
        )


if __name__ == "__main__":
    main()
