"""Progress bar (always on): the train bar counts the micro-batches the epoch will really run, under the schedule.

Lightning sizes the train bar as the epoch's batches, or, without ``max_epochs``, as the optimizer steps left,
counting each as one batch: under accumulation the bar overruns (``10/9`` ... ``16/?``) or stops short of 100% when
``max_steps`` falls in the middle of an epoch. At the epoch's first window, and whenever adaptive growth raises the
factor, this feature computes how many micro-batches the epoch will run (to its end or to ``max_steps``, whichever
comes first, with the schedule's factor at each window) and gives that total to Lightning's ``TQDMProgressBar`` or
``RichProgressBar``, so every epoch's bar ends at exactly 100%. Other progress bars are left alone.

Reads ``ctx.schedule`` and ``ctx.factor_floor``.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from typing_extensions import override

from lightning_accum.events import Context, Feature
from lightning_accum.schedule import run_epoch


class ProgressBar(Feature):
    """Set the train progress bar's total to the micro-batches the epoch will run."""

    name = "progress_bar"

    def __init__(self) -> None:
        self._sized: tuple[int, int] | None = None  # (epoch, factor floor) the bar was last sized for
        self._bar: TQDMProgressBar | RichProgressBar | None = None  # this fit's, if it is one of Lightning's

    @override
    def fit_start(self, ctx: Context) -> None:
        self._sized = None
        bar = getattr(ctx.trainer, "progress_bar_callback", None)
        self._bar = bar if isinstance(bar, (TQDMProgressBar, RichProgressBar)) else None

    @property
    @override
    def idle(self) -> bool:
        return self._bar is None

    @override
    def window_opened(self, ctx: Context) -> None:
        trainer, bar = ctx.trainer, self._bar
        if ctx.schedule is None or bar is None:
            return
        if (trainer.current_epoch, ctx.factor_floor) == self._sized:
            return
        self._sized = (trainer.current_epoch, ctx.factor_floor)
        batches = trainer.num_training_batches
        if batches == float("inf"):
            return
        first = trainer.fit_loop.epoch_loop.batch_idx
        left, _, _ = run_epoch(
            ctx.schedule,
            int(batches),
            epoch=trainer.current_epoch,
            first_batch=first,
            steps=ctx.optimizer_steps,
            samples=ctx.samples_seen,
            max_steps=trainer.max_steps,
            samples_per_micro_step=ctx.samples_per_micro_step,
            min_factor=ctx.factor_floor,
        )
        _set_total(bar, first + left)

    @override
    def fit_end(self, ctx: Context) -> None:
        self._bar = None


def _set_total(bar: Any, total: int) -> None:
    if isinstance(bar, TQDMProgressBar):
        if bar._train_progress_bar is not None:  # public `train_progress_bar` raises before the epoch starts
            bar.train_progress_bar.total = total
    elif bar.progress is not None and getattr(bar, "train_progress_bar_id", None) is not None:
        bar.progress.update(bar.train_progress_bar_id, total=total)
