"""Sample-driven LR schedules (always on, idle without one): move each :class:`~lightning_accum.SampleDrivenLR`.

At ``FIT_START`` it attaches every :class:`~lightning_accum.SampleDrivenLR` among the Trainer's LR schedulers to the
samples (or tokens) consumed, with the run's planned steps and samples for what the wrapper's constructor left out;
after each optimizer step (``WINDOW_CLOSED``, once the counters include the window) it moves them there; at
``FIT_END`` it lets them step on their own again.

Reads ``ctx.run.lr_schedulers``, ``ctx.plan.schedule`` (its unit), ``ctx.samples_per_micro_step``,
``ctx.plan.planned_steps``, ``ctx.plan.planned_samples``, ``ctx.samples_seen`` and ``ctx.tokens_seen`` (published by the
token count).
"""

from __future__ import annotations

from typing_extensions import override

from lightning_accum.core.events import Context, Feature
from lightning_accum.core.sample_driven_lr import SampleDrivenLR


class SampleDrivenSchedules(Feature):
    """Move the run's :class:`~lightning_accum.SampleDrivenLR` schedulers by what the run has consumed."""

    name = "sample_driven_lr"

    def __init__(self) -> None:
        self._schedulers: list[SampleDrivenLR] = []

    @property
    @override
    def idle(self) -> bool:
        return not self._schedulers

    @override
    def fit_start(self, ctx: Context) -> None:
        self._schedulers = []
        for scheduler, interval, frequency in ctx.run.lr_schedulers:
            if not isinstance(scheduler, SampleDrivenLR):
                continue
            _check(scheduler, interval, frequency, ctx)

            def consumed(unit: str = scheduler.unit) -> float:
                return float(ctx.tokens_seen if unit == "token" else ctx.samples_seen)

            scheduler.attach(consumed, steps=ctx.plan.planned_steps, total=ctx.plan.planned_samples)
            self._schedulers.append(scheduler)

    @override
    def window_closed(self, ctx: Context) -> None:
        for scheduler in self._schedulers:
            scheduler.advance()

    @override
    def fit_end(self, ctx: Context) -> None:
        for scheduler in self._schedulers:
            scheduler.detach()
        self._schedulers = []


def _check(scheduler: SampleDrivenLR, interval: str, frequency: int, ctx: Context) -> None:
    """Refuse what would move ``scheduler`` by the wrong measure, before the first step."""
    if scheduler.unit == "token" and (ctx.plan.schedule is None or ctx.plan.schedule.unit != "token"):
        raise ValueError(
            f"SampleDrivenLR(unit='token') moves by the tokens {ctx.run.owner} counts: give {ctx.run.owner}"
            " unit='token' (a token-keyed schedule), or use SampleDrivenLR(unit='sample')"
        )
    if scheduler.unit == "sample" and not ctx.samples_per_micro_step:
        raise ValueError(
            "SampleDrivenLR moves by samples, counted as micro-batch x world size, but the micro-batch size could not"
            f" be read from the train dataloader's `batch_size`: pass `micro_batch_size` to {ctx.run.owner}"
        )
    unknown = "this run's samples are not known up front (no max_epochs or max_steps, or a loader without a length)"
    if scheduler.total is None and ctx.plan.planned_samples == float("inf"):
        raise ValueError(f"SampleDrivenLR spreads its schedule over the run's samples, but {unknown}: pass `total`")
    if scheduler.steps is None and ctx.plan.planned_steps == float("inf"):
        raise ValueError(f"SampleDrivenLR is sized in the run's optimizer steps, but {unknown}: pass `steps`")
    if scheduler.steps is None and (interval != "step" or frequency != 1):
        raise ValueError(
            f"SampleDrivenLR is sized by default in the run's optimizer steps, but its scheduler config has"
            f" interval={interval!r}, frequency={frequency}: pass `steps` (the steps the scheduler is sized for),"
            " or configure it with interval 'step' and frequency 1"
        )
