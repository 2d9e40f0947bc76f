"""Progress bar (always on): the train bar counts the micro-batches the epoch will really run, under the schedule.

Lightning sizes the train bar as the epoch's batches, or, without ``max_epochs``, as the optimizer steps left,
counting each as one batch: under accumulation the bar overruns (``10/9`` ... ``16/?``) or stops short of 100% when
``max_steps`` falls in the middle of an epoch. At each epoch's start, at the first window of an epoch resumed in its
middle, and whenever adaptive growth raises the factor, this feature computes how many micro-batches the epoch will
run (to its end or to ``max_steps``, whichever comes first, with the schedule's factor at each window) and asks for
that total (``ctx.run.set_progress_total``), so every epoch's bar shows the total it ends at
before its first batch and counts to exactly 100%.

Reads ``ctx.plan.schedule`` and ``ctx.factor_floor``.
"""

from __future__ import annotations

from typing_extensions import override

from lightning_accum.core.events import Context, Feature
from lightning_accum.core.schedule import run_epoch


class ProgressBar(Feature):
    """Set the train progress bar's total to the micro-batches the epoch will run."""

    name = "progress_bar"

    def __init__(self) -> None:
        self._sized: tuple[int, int] | None = None  # (epoch, factor floor) the bar was last sized for
        self._shown = False  # whether this fit shows one of Lightning's bars

    @override
    def fit_start(self, ctx: Context) -> None:
        self._sized, self._shown = None, ctx.run.has_progress_bar

    @property
    @override
    def idle(self) -> bool:
        return not self._shown

    @override
    def epoch_started(self, ctx: Context) -> None:
        self._size(ctx, first=0)

    @override
    def window_opened(self, ctx: Context) -> None:
        if (ctx.run.epoch, ctx.factor_floor) != self._sized:  # an epoch resumed in its middle, or the factor grew
            self._size(ctx, first=ctx.batch_idx)

    def _size(self, ctx: Context, first: int) -> None:
        """Size the bar for the rest of the epoch from its batch ``first``, at the position the context holds."""
        batches = ctx.run.batches_per_epoch
        if ctx.plan.schedule is None or batches == float("inf"):
            return
        self._sized = (ctx.run.epoch, ctx.factor_floor)
        left, _, _ = run_epoch(
            ctx.plan.schedule,
            int(batches),
            epoch=ctx.run.epoch,
            first_batch=first,
            steps=ctx.optimizer_steps,
            samples=ctx.samples_seen,
            max_steps=ctx.run.max_steps,
            samples_per_micro_step=ctx.samples_per_micro_step,
            min_factor=ctx.factor_floor,
        )
        ctx.run.set_progress_total(first + left)
