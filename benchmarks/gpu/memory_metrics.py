"""The ``accum/memory_*`` metrics of one run, read back from its TensorBoard event file, against ``torch.cuda``.

    python benchmarks/gpu/memory_metrics.py --out DIR [--dry]

An MLP (4 x Linear(1024, 1024), micro-batch 256, factor 2) trains 6 optimizer steps with a TensorBoardLogger and
``log_every_n_steps=1``. A callback after ``AccumulationScheduler`` reads ``torch.cuda.memory_allocated``,
``memory_reserved`` and ``max_memory_allocated`` at the end of every window, where the callback logs; the event file's
values must be the same, in MiB. The user's own peak measurement of the fit (``reset_peak_memory_stats`` before it,
``max_memory_allocated`` after) must still hold the fit's highest peak: the callback never resets it. Without CUDA
(``--dry`` on a CPU) the same is done for ``accum/memory_rss_mb`` against the resident memory (to 1 MiB: the two reads
are a few allocations apart).
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.data import DataLoader, TensorDataset

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # harness, common
import lightning.pytorch as pl  # noqa: E402
from common import MLP, WIDTH  # noqa: E402
from harness import MIB, Report, arguments, quiet, trainer  # noqa: E402

from lightning_accum import AccumulationScheduler  # noqa: E402
from lightning_accum.core.monitor import resident_bytes  # noqa: E402

FACTOR, STEPS = 2, 6


def readings() -> dict[str, float]:
    """What ``torch.cuda`` (or, without CUDA, the process) says now, under the metrics' names, in MiB."""
    if torch.cuda.is_available():
        return {
            "accum/memory_allocated_mb": torch.cuda.memory_allocated() / MIB,
            "accum/memory_reserved_mb": torch.cuda.memory_reserved() / MIB,
            "accum/memory_peak_mb": torch.cuda.max_memory_allocated() / MIB,
        }
    return {"accum/memory_rss_mb": resident_bytes() / MIB}


class Truth(pl.Callback):
    """The readings at the end of every window, keyed by the optimizer step the callback logs them under."""

    def __init__(self) -> None:
        self.by_step: dict[int, dict[str, float]] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *_: Any) -> None:
        if trainer.global_step not in self.by_step:  # the first batch end after a step: the window's last
            self.by_step[trainer.global_step] = readings()


def main(argv: Sequence[str] | None = None) -> None:
    args = arguments(argv, __doc__.split("\n")[0])
    quiet()
    cuda = torch.cuda.is_available()
    micro = 16 if args.dry else 256
    report = Report(
        args.out,
        "memory_metrics",
        "The `accum/memory_*` metrics against `torch.cuda`",
        f"MLP 4 x Linear({WIDTH}, {WIDTH}), micro-batch {micro}, factor {FACTOR}, {STEPS} optimizer steps,"
        " `log_every_n_steps=1`; the event file's values against the readings at the end of each window."
        + ("" if cuda else " No CUDA: `accum/memory_rss_mb` against the resident memory."),
    )
    report.table("metrics", ["metric", "steps", "max abs difference (MiB)", "first", "last", "verdict"])
    tolerance = 0.01 if cuda else 1.0  # float32 in the event file; without CUDA, two reads a few allocations apart
    truth = Truth()
    data = TensorDataset(torch.randn(micro * FACTOR * STEPS, WIDTH, generator=torch.Generator().manual_seed(0)))
    with tempfile.TemporaryDirectory() as logs:
        logger = TensorBoardLogger(logs, name="run", version=0)
        callbacks = [AccumulationScheduler({0: FACTOR}), truth]
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        trainer(max_epochs=1, logger=logger, log_every_n_steps=1, callbacks=callbacks).fit(
            MLP(), DataLoader(data, batch_size=micro)
        )
        users_peak = torch.cuda.max_memory_allocated() / MIB if cuda else None
        events = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0})
        events.Reload()
        for tag in readings():
            logged = {event.step: event.value for event in events.Scalars(tag)}
            steps = sorted(set(logged) & set(truth.by_step))
            difference = max(abs(logged[step] - truth.by_step[step][tag]) for step in steps)
            good = difference <= tolerance and len(steps) == STEPS
            report.row(
                "metrics",
                [
                    tag,
                    str(len(steps)),
                    f"{difference:.4f}",
                    f"{logged[steps[0]]:.1f}",
                    f"{logged[steps[-1]]:.1f}",
                    "agrees" if good else "DISAGREES",
                ],
                metric=tag,
                steps=len(steps),
                difference=difference,
                logged=logged,
                passed=good,
            )
        if cuda:
            highest = max(event.value for event in events.Scalars("accum/memory_peak_mb"))
            assert users_peak is not None
            report.check(
                "the user's own peak of the fit (`reset_peak_memory_stats` before, `max_memory_allocated` after)",
                f">= the highest logged peak, {highest:.1f} MiB",
                f"{users_peak:.1f} MiB",
                users_peak >= highest - tolerance,
            )
    report.finish()


if __name__ == "__main__":
    main()
