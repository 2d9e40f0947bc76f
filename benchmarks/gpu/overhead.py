"""The callback's cost on the device, next to stock Lightning, while kernels run asynchronously.

    python benchmarks/gpu/overhead.py --out DIR [--dry]

Two models at factor 4, each with a CSVLogger (``log_every_n_steps=10``) and its loss logged: the MLP of the CPU
benchmarks (4 x Linear(1024, 1024), micro-batch 64: so small that a GPU waits on Python, the worst case for any
per-step cost) and GPT-2 small in ``bf16-mixed`` (micro-batch 8 x 256 tokens: compute-bound). Configurations: stock
``Trainer(accumulate_grad_batches=4)``; ``AccumulationScheduler({0: 4})`` with every feature on (its metrics, sample
weighting, linear LR scaling, the noise scale with its default sampling); the same without the noise scale; and with
the noise scale measured on every window. Each configuration runs once per round, in an order rotated every round,
after one warm-up fit of each; time per micro-step from the third window to the end of the fit, with
``torch.cuda.synchronize()`` at those two points only. Ratios are taken round by round; median and range.
"""

from __future__ import annotations

import copy
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parents[1] / "examples")]  # harness, common, byte_lm
import lightning.pytorch as pl  # noqa: E402
from common import MICRO_BATCH, MLP, WIDTH, ratio, rotated_rounds  # noqa: E402
from harness import Clock, Report, arguments, byte_tokens, gpt2, quiet, release, trainer  # noqa: E402

from lightning_accum import AccumulationScheduler  # noqa: E402

FACTOR, SKIPPED = 4, 8  # the first two windows are not timed: hooks registered, buffers allocated once per fit
ALL = {"normalize_by": "sample", "lr_scaling": "linear", "noise_scale": True}
CONFIGS: dict[str, dict[str, Any] | None] = {
    "stock": None,
    "all features": ALL,
    "all but the noise scale": {**ALL, "noise_scale": False},
    "all, noise scale on every window": {**ALL, "noise_scale_interval": 1},
}
RATIOS = {  # shown: (candidate, baseline)
    "all features / stock": ("all features", "stock"),
    "all but the noise scale / stock": ("all but the noise scale", "stock"),
    "noise scale, default sampling / off": ("all features", "all but the noise scale"),
    "noise scale, every window / off": ("all, noise scale on every window", "all but the noise scale"),
}


class LanguageModel(pl.LightningModule):
    def __init__(self, template: nn.Module) -> None:
        super().__init__()
        self.model = copy.deepcopy(template)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        loss = self.model(input_ids=tokens, labels=tokens).loss
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def seconds_per_micro_step(
    module: Callable[[], pl.LightningModule], loader: DataLoader, options: dict[str, Any] | None, precision: str
) -> float:
    clock = Clock(first_timed_batch=SKIPPED)
    callbacks: list[pl.Callback] = [clock]
    extra: dict[str, Any] = {"accumulate_grad_batches": FACTOR}
    if options is not None:
        callbacks.insert(0, AccumulationScheduler({0: FACTOR}, **options))
        extra = {}
    with tempfile.TemporaryDirectory() as logs:
        fit = trainer(
            max_epochs=1,
            precision=precision,
            logger=CSVLogger(logs),
            log_every_n_steps=10,
            callbacks=callbacks,
            **extra,
        )
        fit.fit(module(), loader)
    del fit
    release()
    return clock.seconds / (len(loader) - SKIPPED)


def measure(
    report: Report,
    name: str,
    module: Callable[[], pl.LightningModule],
    loader: DataLoader,
    precision: str,
    rounds: int,
    deadline: float,
) -> None:
    def one(config: str) -> float:
        return seconds_per_micro_step(module, loader, CONFIGS[config], precision)

    for config in CONFIGS:  # warm-up: kernels chosen, caches filled, for every configuration alike
        one(config)
    times = rotated_rounds(one, list(CONFIGS), rounds, deadline)
    stock_ms = statistics.median(times["stock"]) * 1e3
    for shown, (candidate, baseline) in RATIOS.items():
        versus = ratio(times, candidate, baseline)
        report.row(
            "ratios",
            [
                name,
                shown,
                f"{versus['median']:.3f}",
                f"{versus['min']:.3f} to {versus['max']:.3f}",
                str(len(times["stock"])),
                f"{stock_ms:.2f}",
            ],
            model=name,
            ratio=shown,
            rounds=len(times["stock"]),
            stock_ms=stock_ms,
            times=times,
            **versus,
        )


def main(argv: Sequence[str] | None = None) -> None:
    args = arguments(argv, __doc__.split("\n")[0])
    quiet()
    rounds = 2 if args.dry else 7
    mlp_steps, lm_steps, lm_micro, lm_length = (4, 3, 2, 32) if args.dry else (30, 12, 8, 256)
    report = Report(
        args.out,
        "overhead",
        "The callback's cost against stock Lightning",
        f"Factor 4, a CSVLogger each (`log_every_n_steps=10`, the loss logged). MLP: 4 x Linear({WIDTH}, {WIDTH}),"
        f" micro-batch {MICRO_BATCH}, {mlp_steps} optimizer steps, fp32. GPT-2 small: micro-batch {lm_micro} x"
        f" {lm_length} tokens, `bf16-mixed`, {lm_steps} optimizer steps. Every configuration once per round in rotated"
        " order after a warm-up fit of each; time per micro-step from the third window on, synchronised at the two"
        " timing points only; ratios round by round.",
    )
    report.table("ratios", ["model", "ratio", "median", "range", "rounds", "stock (ms/micro-step)"])
    # the MLP gets the larger share of the budget's first half: it is cheap; GPT-2 small gets what is left
    halfway = time.monotonic() + (args.deadline - time.monotonic()) * 0.4
    samples = MICRO_BATCH * FACTOR * mlp_steps
    data = torch.randn(samples, WIDTH, generator=torch.Generator().manual_seed(0))
    mlp_loader = DataLoader(TensorDataset(data), batch_size=MICRO_BATCH)
    measure(report, "MLP", lambda: MLP(log_loss=True), mlp_loader, "32-true", rounds, halfway)
    template = gpt2(args.dry)
    lm_loader = DataLoader(TensorDataset(byte_tokens(lm_micro * FACTOR * lm_steps, lm_length)), batch_size=lm_micro)
    measure(report, "GPT-2 small", lambda: LanguageModel(template), lm_loader, "bf16-mixed", rounds, args.deadline)
    report.finish()


if __name__ == "__main__":
    main()
