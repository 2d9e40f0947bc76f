"""Seesaw (``seesaw=True``): wherever the LR schedule would halve the LR, double the batch instead.

At ``FIT_START`` it reads the shape of the run's :class:`~lightning_accum.SampleDrivenLR` (stepping it ahead and back,
:meth:`~lightning_accum.SampleDrivenLR.planned_lrs`) and turns it into a factor schedule keyed by the samples or
tokens that scheduler moves by (:func:`~lightning_accum.core.seesaw.seesaw_schedule`): the schedule's one factor,
doubled at each halving of the LR below its peak, up to ``max_factor``; the LR rule (``lr_scaling``) then gives back its
share of each halving (``sqrt(2)`` under ``"sqrt"``, all of it under ``"linear"``). Every rank takes rank zero's factor
schedule, which is kept in the checkpoint, so a resumed run goes on with the factors it started with. At each
``WINDOW_OPENING`` it raises ``ctx.factor`` to the schedule's factor at the run's position; with the noise scale on,
it warns once when that batch outgrows the measured noise scale's upper bound (90% confident, once three measurements
stand behind it), where Seesaw's trade no longer holds.

Reads ``ctx.run.lr_schedulers`` (attached by the sample-driven schedules, registered before it), ``ctx.plan.schedule``,
``ctx.samples_seen``, ``ctx.tokens_seen``, ``ctx.plan.planned_samples``, ``ctx.samples_per_micro_step``, ``ctx.noise``
and ``ctx.lr_cap_factor`` (published by LR scaling, registered before it); replaces ``ctx.plan`` at ``FIT_START``
(its planned steps at Seesaw's factors) and raises ``ctx.factor`` at ``WINDOW_OPENING``; adds its line to
``ctx.summary``.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_accum.core.adaptive import MIN_MEASUREMENTS
from lightning_accum.core.events import Context, Feature
from lightning_accum.core.noise import NoiseScaleEstimate
from lightning_accum.core.sample_driven_lr import SampleDrivenLR
from lightning_accum.core.schedule import Schedule, plan_run
from lightning_accum.core.seesaw import planned_steps, seesaw_schedule, steps_ratio

WARN_CONFIDENCE = 0.9
"""The one-sided confidence that the batch outgrew the noise scale before Seesaw warns of it."""


class Seesaw(Feature):
    """Grow the factor where the LR schedule decays: one doubling for each halving of the LR, up to ``max_factor``.

    Args:
        max_factor: The largest factor; past it the LR schedule goes on as given.
        rule: The run's LR rule (``lr_scaling``), for what the summary says of the LR.

    Example::

        >>> import torch
        >>> from lightning_accum import SampleDrivenLR
        >>> from lightning_accum.core.events import Context, Event, Features, Run
        >>> optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
        >>> cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=100)
        >>> driven = SampleDrivenLR(cosine, steps=100, total=6400)
        >>> driven.attach(lambda: 0.0, steps=100, total=6400)  # as the sample-driven schedules do at FIT_START
        >>> class Scheduled(Run):
        ...     lr_schedulers = [(driven, "step", 1)]
        >>> ctx = Context(micro_batch_size=32, run=Scheduled(), schedule=Schedule.constant(1))
        >>> Features([Seesaw(max_factor=8)]).dispatch(Event.FIT_START, ctx)
        >>> ctx.summary[0].split(" (at")[0]
        'seesaw: factor 1 -> 2 at 50% of the samples, -> 4 at 67%, -> 8 at 77%'
        >>> ctx.summary[0].split("; ")[1]
        '0.64 x the optimizer steps of factor 1 throughout'
    """

    name = "seesaw"

    def __init__(self, max_factor: int = 8, rule: str = "sqrt") -> None:
        self.max_factor, self.rule = max_factor, rule
        self.schedule: Schedule | None = None  # the factors, from the first fit start of the run (checkpointed)
        self.planned_steps: float | None = None  # the optimizer steps of the latest fit at those factors
        self.fitting = False  # from the fit's start to its end: planned_steps is this fit's
        self._warned = False  # whether this fit was told that the batch outgrew the noise scale

    @override
    def reset(self) -> None:
        self.schedule, self.planned_steps = None, None

    @override
    def fit_start(self, ctx: Context) -> None:
        self._warned, self.fitting = False, True
        driven = _driven(ctx)
        if self.schedule is None:  # a new run; a resumed one keeps the factors its checkpoint holds
            assert driven.steps is not None, "attached by the sample-driven schedules"
            assert driven.total is not None, "attached by the sample-driven schedules"
            base = _base_factor(ctx, self.max_factor)
            lrs, most = driven.planned_lrs(), self.max_factor
            schedule = seesaw_schedule(lrs, driven.steps, driven.total, driven.unit, base, most, driven.taken)
            points = ctx.broadcast([list(point) for point in schedule.points])  # rank zero's, should the ranks differ
            self.schedule = Schedule(tuple((int(p), int(f)) for p, f in points), schedule.unit)
        if 0 < ctx.run.max_steps <= ctx.plan.planned_steps:
            rank_zero_warn(
                f"{ctx.run.owner}: seesaw=True in a run bounded by `max_steps`: its larger batches consume the samples"
                " the LR schedule is spread over before max_steps, and the schedule then holds its last value. Bound"
                " the run by its data instead (epochs, `limit_train_batches`; in Fabric `max_samples`, `max_tokens`)"
            )
        self.planned_steps = _planned_steps(ctx, self.schedule, driven)
        if self.planned_steps is not None:  # the plan at Seesaw's factors, for the features after it
            ctx.plan = replace(ctx.plan, planned_steps=self.planned_steps)
        ctx.summary.append(_summary(self.schedule, driven, self.rule, self.planned_steps))
        cap = ctx.lr_cap_factor
        if cap is not None and self.rule != "none" and self.schedule.max_factor > cap:
            rank_zero_warn(
                f"{ctx.run.owner}: Seesaw's factor reaches {self.schedule.max_factor}, but lr_scale_max stops the LR"
                f" rule's scale at factor {cap}: past it the rule no longer gives back its share of each halving, and"
                f" each doubling of the batch adds to the schedule's decay. Raise lr_scale_max, or give"
                f" seesaw_max_factor={cap}"
            )
        if self.rule == "none":
            rank_zero_warn(
                f"{ctx.run.owner}: seesaw=True with lr_scaling='none' doubles the batch where the LR schedule halves"
                " the LR and still halves it: give lr_scaling='sqrt' (Adam) or 'linear' (SGD), whose rule gives back"
                " its share of each halving"
            )

    @override
    def window_opening(self, ctx: Context) -> None:
        assert self.schedule is not None, "set at fit start"
        position = ctx.tokens_seen if self.schedule.unit == "token" else ctx.samples_seen
        ctx.factor = max(ctx.factor, self.schedule.factor_at(int(position)))
        reading = ctx.noise
        if self._warned or reading is None:
            return
        per_factor, high = reading.items / max(1, reading.micro_steps), _upper_bound(reading.estimate)
        if high is not None and ctx.factor * per_factor > high:
            self._warned = True
            unit = "tokens" if self.schedule.unit == "token" else "samples"
            rank_zero_warn(
                f"{ctx.run.owner}: Seesaw's batch at factor {ctx.factor} ({ctx.factor * per_factor:.0f} {unit})"
                f" outgrows the measured noise scale (at most {high:.0f}, {WARN_CONFIDENCE:.0%} confident) from"
                f" optimizer step {ctx.optimizer_steps}: past the critical batch a doubled batch no longer stands for a"
                " halved LR (Meterez et al. 2025), and the run may lose to its LR schedule as given."
                f" seesaw_max_factor={self.max_factor}; the noise scale calls for at most"
                f" {max(1, math.floor(high / per_factor))}"
            )

    @override
    def fit_end(self, ctx: Context) -> None:
        self.fitting = False  # a next fit sizes its LR schedule with its own steps

    @override
    def state_dict(self) -> dict[str, Any]:
        if self.schedule is None:
            return {}
        return {"points": [list(point) for point in self.schedule.points], "unit": self.schedule.unit}

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        points = state.get("points")
        self.schedule = None if not points else Schedule(tuple((int(p), int(f)) for p, f in points), state["unit"])


def _upper_bound(estimate: NoiseScaleEstimate) -> float | None:
    """The noise scale's upper bound at :data:`WARN_CONFIDENCE`, once the estimate stands on enough measurements.

    ``None`` before :data:`~lightning_accum.core.adaptive.MIN_MEASUREMENTS` measurements, where the bound is infinite
    (the gradient may be 0) and where the measurements contradict each other: nothing to warn on.
    """
    if estimate.measurements < MIN_MEASUREMENTS:
        return None
    bounds = estimate.interval(WARN_CONFIDENCE)
    if bounds is None or not 0 < bounds[1] < math.inf:
        return None
    return bounds[1]


def _driven(ctx: Context) -> SampleDrivenLR:
    """The run's one :class:`SampleDrivenLR`, whose shape Seesaw reads.

    Raises:
        ValueError: If there is none, or more than one.
    """
    driven = [scheduler for scheduler, _, _ in ctx.run.lr_schedulers if isinstance(scheduler, SampleDrivenLR)]
    where = "the Accumulator's lr_scheduler" if ctx.run.owner == "Accumulator" else "configure_optimizers"
    if not driven:
        raise ValueError(
            f"{ctx.run.owner}(seesaw=True) doubles the batch where the LR schedule halves the LR, and reads that"
            f" schedule from a SampleDrivenLR: wrap the LR scheduler in {where} in lightning_accum.SampleDrivenLR"
            " (the factor then moves with the samples or tokens consumed, as the schedule does)"
        )
    if len(driven) > 1:
        raise ValueError(
            f"{ctx.run.owner}(seesaw=True) reads one LR schedule, but {where} gives {len(driven)} SampleDrivenLR"
        )
    return driven[0]


def _base_factor(ctx: Context, max_factor: int) -> int:
    """The schedule's one factor, which Seesaw doubles.

    Raises:
        ValueError: If the schedule changes its factor, or its factor is above ``max_factor``.
    """
    schedule = ctx.plan.schedule if ctx.plan.schedule is not None else Schedule.constant(1)
    if schedule.min_factor != schedule.max_factor:
        raise ValueError(
            f"{ctx.run.owner}(seesaw=True) sets the factor from the LR schedule, starting from one factor, but the"
            f" accumulation schedule changes it ({dict(schedule.points)}): give one factor (scheduling={{0: f}} or"
            " target_batch_size without a ramp)"
        )
    base = schedule.max_factor
    if base > max_factor:
        raise ValueError(
            f"`seesaw_max_factor={max_factor}` is below the schedule's factor {base}: Seesaw only grows the factor;"
            f" give seesaw_max_factor >= {base}"
        )
    return base


def _planned_steps(ctx: Context, schedule: Schedule, driven: SampleDrivenLR) -> float | None:
    """The optimizer steps of the fit at Seesaw's factors (an estimate for tokens; ``None`` where it has no end)."""
    per_micro_step, batches = ctx.samples_per_micro_step, ctx.run.batches_per_epoch
    base = schedule.points[0][1]
    if schedule.unit == "sample" and per_micro_step and ctx.plan.planned_samples < math.inf:
        if batches < math.inf:  # the Trainer's epochs: windows never span one
            epochs = math.ceil(ctx.plan.planned_samples / (batches * per_micro_step))
            return plan_run(schedule, int(batches), epochs, ctx.run.max_steps, per_micro_step)[0]
        return planned_steps(schedule, ctx.plan.planned_samples, per_micro_step)
    if ctx.plan.planned_steps < math.inf:  # tokens a micro-step holds are not known ahead: micro-steps of equal tokens
        assert driven.total is not None, "attached"
        return round(ctx.plan.planned_steps * steps_ratio(schedule, driven.total, base))
    return None


def _summary(schedule: Schedule, driven: SampleDrivenLR, rule: str, steps: float | None) -> str:
    """The run's summary line: where the factor doubles, what the LR rule gives back, the steps it saves."""
    assert driven.total is not None, "attached"
    unit = "tokens" if schedule.unit == "token" else "samples"
    (_, first), *later = schedule.points
    changes = ", ".join(
        f"-> {factor} at {position / driven.total:.0%}" + (f" of the {unit}" if i == 0 else "")
        for i, (position, factor) in enumerate(later)
    )
    gives = {"sqrt": "the LR falls by sqrt(2) instead of 2", "linear": "the LR holds instead of halving"}.get(
        rule, "the LR halves too (lr_scaling='none')"
    )
    ratio = steps_ratio(schedule, driven.total, first)
    planned = f", {steps:.0f} planned" if steps is not None else ""
    return (
        f"seesaw: factor {first} {changes or '(the LR schedule never halves)'} (at each doubling {gives});"
        f" {ratio:.2f} x the optimizer steps of factor {first} throughout{planned}"
    )
