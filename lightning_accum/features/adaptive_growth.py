"""Adaptive growth (``adaptive=True``): the factor follows the measured noise scale once the evidence is there.

After each measured window, at the next window's opening, once enough fresh evidence stands behind the estimate
(:func:`~lightning_accum.core.adaptive.ready`), rank zero asks the policy
(:class:`~lightning_accum.core.adaptive.AdaptiveFactor`) for the factor the evidence calls for: it grows, at most
doubling, to the largest factor whose batch is at most ``target x`` the noise scale's lower confidence bound, and (with
``shrink``) comes down to the smallest one at least ``target x`` its upper bound, the confidence spent over the tests
made at one factor. Its answer is broadcast, so every rank opens the window with the same factor. The factor in force is
the larger of the schedule's and the adaptive one.

Reads ``ctx.noise`` (published by the noise scale, which checkpoints the evidence it comes from), at ``FIT_START``
``ctx.run.max_steps``, ``ctx.run.lr_schedulers`` and ``ctx.plan.planned_steps`` (to warn a run bounded by ``max_steps``
whose LR schedule is moved by samples), and at ``WINDOW_OPENING`` ``ctx.lr_cap_factor`` (published by LR scaling,
registered after it, at ``FIT_START``); raises ``ctx.factor`` and publishes ``ctx.factor_floor`` at ``FIT_START`` and
``WINDOW_OPENING``; adds its line to ``ctx.summary`` and its bounds to ``ctx.metrics``.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_accum.core.adaptive import AdaptiveFactor, Decision, budget_bound, look, ready
from lightning_accum.core.events import Context, Feature
from lightning_accum.core.sample_driven_lr import SampleDrivenLR
from lightning_accum.core.schedule import Schedule, check_bool
from lightning_accum.core.seesaw import growth_bound


class AdaptiveGrowth(Feature):
    """Set the accumulation factor from the noise scale and the evidence behind it, within ``max_factor``.

    Logs ``accum/noise_scale_low`` and ``accum/noise_scale_high``: the bounds the next decision acts on (at the
    confidence it spends), once enough measurements stand behind the estimate (the upper one only while it is finite).

    Args:
        target: The wanted effective batch as a multiple of the noise scale.
        max_factor: The largest factor growth may reach.
        confidence: The one-sided confidence of the first test at a factor, in ``[0.5, 1)``; later tests at the same
            factor spend ``1 - confidence`` between them.
        shrink: Whether the factor may come down again (never below the schedule's).
        lr_bound: Hold the factor, where the run has one :class:`~lightning_accum.SampleDrivenLR`, to the first
            window's factor times the LR schedule's peak so far over its current LR
            (:func:`~lightning_accum.core.seesaw.growth_bound`), never past the factor where ``lr_scale_max`` stops the
            LR rule (``ctx.lr_cap_factor``), or beyond to a batch of at most a tenth of the noise scale
            (:func:`~lightning_accum.core.adaptive.budget_bound`): on a fixed budget a larger batch pays where the
            schedule would have lowered the LR as much and the rule raises it with the batch, or where it costs at most
            a tenth more examples. A run at a constant LR is not held: growth is its only decay.

    Raises:
        TypeError: If ``max_factor`` is not an integer, or ``shrink`` or ``lr_bound`` not a bool.
        ValueError: If ``target`` is not a positive finite number, ``max_factor`` is below 1 or ``confidence`` is not
            a number in ``[0.5, 1)``.

    Example::

        >>> from lightning_accum.core.events import Context, Event, Features
        >>> from lightning_accum.core.noise import NoiseReading, NoiseScaleEstimate
        >>> growth = AdaptiveGrowth(target=1.0, max_factor=16)
        >>> features, ctx = Features([growth]), Context(factor=2)
        >>> estimate = NoiseScaleEstimate(1.0, 100.0, 100.0, 8.0, grad_sq_var=1e-4, trace_var=1.0, covariance=0.0)
        >>> for step in range(1, 5):  # four measured windows of 2 micro-batches, 16 samples each
        ...     ctx.noise, ctx.optimizer_steps = NoiseReading(estimate, 16.0, 2, step, evidence=estimate), step
        ...     features.dispatch(Event.WINDOW_OPENING, ctx)
        >>> ctx.factor  # a noise scale of 98 to 102 calls for 12: from 2, at most a doubling at a time
        4
    """

    name = "adaptive"

    def __init__(
        self,
        target: float = 1.0,
        max_factor: int = 64,
        confidence: float = 0.9,
        shrink: bool = False,
        lr_bound: bool = True,
    ) -> None:
        if not isinstance(shrink, bool):
            raise TypeError(f"`adaptive_shrink` must be a bool, got {shrink!r}")
        self.policy = AdaptiveFactor(target, max_factor, confidence, shrink)  # the decision rule, read-only
        self.lr_bound = check_bool("adaptive_lr_bound", lr_bound)
        self.bound: Schedule | None = None  # the LR schedule's bound on the factor, from the run's first window
        self.factor = 0  # 0 until the policy has set one
        self._decided_at = 0  # the optimizer step of the measured window the latest decision read
        self._fresh = 0  # windows measured since the factor last changed: the evidence a decision may use
        self._world = 0  # the ranks the factor was reached on (0: not yet known)

    @override
    def reset(self) -> None:
        self.factor, self._decided_at, self._fresh, self._world, self.bound = 0, 0, 0, 0, None

    @override
    def fit_start(self, ctx: Context) -> None:
        if self.factor and self._world and self._world != ctx.world_size:  # resumed on another number of ranks
            self.factor = _carried(ctx, self.factor, self._world, self.policy.max_factor)
        self._world = ctx.world_size
        self._apply(ctx)
        if 0 < ctx.run.max_steps <= ctx.plan.planned_steps and any(
            isinstance(s, SampleDrivenLR) for s, _, _ in ctx.run.lr_schedulers
        ):
            fabric = ctx.run.owner == "Accumulator"
            bound = "`batches(max_samples=...)` or `max_tokens`" if fabric else "epochs or `limit_train_batches`"
            rank_zero_warn(
                f"{ctx.run.owner}: adaptive growth in a run bounded by `max_steps`: the samples such a run consumes"
                " grow with its factor, so SampleDrivenLR, spread over the samples at the starting factor, ends early"
                f" and holds its last value. Bound the run by {bound} instead"
            )
        shrinks = ", shrinking too" if self.policy.shrink else ""
        bounded = ""
        if self.lr_bound and sum(isinstance(s, SampleDrivenLR) for s, _, _ in ctx.run.lr_schedulers) == 1:
            bounded = (
                ", held to the first factor x the LR schedule's peak over its current LR (never past where"
                " lr_scale_max stops the LR rule), or past it to a tenth of the noise scale"
            )
        ctx.summary.append(
            f"adaptive: batch up to {self.policy.target:g} x the noise scale's lower bound (confidence"
            f" {self.policy.confidence:.0%} at a factor's first test, spent over its later ones), at most doubling,"
            f" factor <= {self.policy.max_factor}{shrinks}{bounded}"
        )

    def _read_bound(self, ctx: Context) -> None:
        """The LR schedule's bound, read at the run's first window (the schedule attached, none of it taken)."""
        driven = [s for s, _, _ in ctx.run.lr_schedulers if isinstance(s, SampleDrivenLR) and s.attached]
        if len(driven) != 1:  # no budget to read (or two schedules, which may disagree): the noise scale alone
            return
        (scheduler,) = driven
        assert scheduler.steps is not None, "attached"
        assert scheduler.total is not None, "attached"
        lrs, base = scheduler.planned_lrs(), max(1, ctx.factor)
        self.bound = growth_bound(
            lrs, scheduler.steps, scheduler.total, scheduler.unit, base, self.policy.max_factor, start=scheduler.taken
        )

    @override
    def window_opening(self, ctx: Context) -> None:
        if self.lr_bound and self.bound is None and ctx.optimizer_steps == 0:
            self._read_bound(ctx)
        reading = ctx.noise
        if reading is not None and reading.step > self._decided_at:  # a window was measured since the last decision
            self._decided_at, self._fresh = reading.step, self._fresh + 1
            scheduled = ctx.factor
            current = max(scheduled, self.factor)
            proposal, decision = current, None
            evidence = reading.evidence
            if ctx.is_global_zero and evidence is not None and ready(self._fresh, evidence.measurements):
                per_factor = reading.items / max(1, reading.micro_steps)
                moment = look(self._fresh, evidence.measurements)
                decision = self.policy.decide(current, per_factor, evidence, floor=scheduled, look=moment)
                proposal = current if decision is None else decision.factor
                if decision is not None:  # the budget may hold growth back
                    held = budget_bound(self._bound_at(ctx), decision.low / self.policy.target, per_factor)
                    if proposal > held:
                        proposal = max(current, held)
                        decision = replace(decision, factor=proposal, held=held)
            proposal = int(ctx.broadcast(proposal))  # every rank takes rank zero's decision
            if proposal != current:
                self.factor, self._fresh = proposal, 0
                if decision is not None:
                    ctx.run.print(_decision_line(ctx, current, decision, per_factor, self.policy.target))
        self._apply(ctx)

    def _bound_at(self, ctx: Context) -> int:
        """The largest factor the LR schedule allows at the run's position, never past the LR cap.

        Past ``lr_scale_max`` the rule no longer raises the LR with the batch, so growth there lowers the LR per
        sample on top of the schedule's own decay: only the noise scale's free share
        (:func:`~lightning_accum.core.adaptive.budget_bound`) may take the factor further. Where no bound was read
        (``bound`` is ``None``: no ``SampleDrivenLR`` or two of them, or ``lr_bound=False``), nothing but ``max_factor``
        bounds it: at a constant rate growth past the cap is the run's only decay, which the noise scale calls for once
        the steps are mostly noise.
        """
        if self.bound is None:
            return self.policy.max_factor
        bound = self.bound.factor_at(ctx.tokens_seen if self.bound.unit == "token" else ctx.samples_seen)
        return bound if ctx.lr_cap_factor is None else min(bound, ctx.lr_cap_factor)

    def _apply(self, ctx: Context) -> None:
        ctx.factor, ctx.factor_floor = max(ctx.factor, self.factor), max(1, self.factor)

    @override
    def window_closed(self, ctx: Context) -> None:
        evidence = ctx.noise.evidence if ctx.noise is not None else None
        wanted = self.policy.bounds(evidence, look(self._fresh, evidence.measurements) if evidence else 1)
        if wanted is None:
            return
        ctx.metrics["accum/noise_scale_low"] = wanted[0] / self.policy.target
        if wanted[1] < math.inf:
            ctx.metrics["accum/noise_scale_high"] = wanted[1] / self.policy.target

    @override
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "factor": self.factor,
            "decided_at": self._decided_at,
            "fresh": self._fresh,
            "world_size": self._world,
        }
        if self.bound is not None:
            state["bound"] = {"points": [list(point) for point in self.bound.points], "unit": self.bound.unit}
        return state

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.factor = int(state.get("factor", 0))
        self._decided_at = int(state.get("decided_at", state.get("checked_at", 0)))
        self._fresh = int(state.get("fresh", 0))
        self._world = int(state.get("world_size", 0))  # 0: written before it was kept, taken as this run's
        bound = state.get("bound")
        self.bound = None if not bound else Schedule(tuple((int(p), int(f)) for p, f in bound["points"]), bound["unit"])


def _carried(ctx: Context, factor: int, world: int, max_factor: int) -> int:
    """The factor that keeps, on ``ctx.world_size`` ranks, the global batch ``factor`` reached on ``world``.

    It may exceed ``max_factor`` on fewer ranks (the batch is kept; growth stops there).

    Raises:
        ValueError: Where that batch is no whole factor on these ranks, naming the nearest.
    """
    micro, batch = ctx.plan.micro_batch_size or 1, factor * world
    if batch % ctx.world_size:
        near = max(1, round(batch / ctx.world_size))
        raise ValueError(
            f"{ctx.run.owner}: adaptive growth had reached factor {factor} on {world} process(es), a global batch of"
            f" {batch * micro} samples, which {ctx.world_size} processes cannot hold in whole micro-batches"
            f" ({batch} micro-batches over {ctx.world_size}); the nearest whole factor is {near} (a global batch of"
            f" {near * ctx.world_size * micro}). Resume on a number of processes that divides {batch}"
        )
    above = f", above adaptive_max_factor={max_factor}" if batch // ctx.world_size > max_factor else ""
    ctx.run.print(
        f"{ctx.run.owner}: adaptive growth resumed on {ctx.world_size} process(es) from a checkpoint written on"
        f" {world}: factor {factor} -> {batch // ctx.world_size} keeps the global batch of {batch * micro} samples"
        + above
    )
    return batch // ctx.world_size


def _decision_line(ctx: Context, current: int, decision: Decision, per_factor: float, target: float) -> str:
    """The console line of a change: what changed and from when, the bound that called for it, and the knobs."""
    if decision.factor > current:
        bound = f"at least {decision.low / target:.4g}"
        calls = f"calls for factor {decision.called}"
        if decision.held is not None and decision.held < min(decision.called, 2 * current):
            calls += (
                f", held to {decision.held} by the budget (the LR schedule's peak over its current LR, within the LR"
                " cap where set, or a batch of at most a tenth of the noise scale)"
            )
        elif decision.called > decision.factor:
            calls += ", taken a doubling at a time, each on fresh evidence"
    else:
        bound, calls = f"at most {decision.high / target:.4g}", f"calls for no more than factor {decision.factor}"
    return (
        f"{ctx.run.owner}: factor {current} -> {decision.factor} (batch {current * per_factor:.0f} ->"
        f" {decision.factor * per_factor:.0f}) from optimizer step {ctx.optimizer_steps}: the noise scale is {bound}"
        f" ({decision.confidence:.1%} confident), and adaptive_target={target:g} x that {calls}"
    )
