"""Adaptive growth (``adaptive=True``): the factor follows the measured noise scale once the evidence is there.

After each measured window, at the next window's opening, rank zero asks the policy
(:class:`~lightning_accum.adaptive.AdaptiveFactor`) for the factor the estimate calls for: it grows to the largest
factor whose batch is at most ``target x`` the noise scale's lower confidence bound, and (with ``shrink``) comes down
to the smallest one at least ``target x`` its upper bound. Its answer is broadcast, so every rank opens the window
with the same factor. The factor in force is the larger of the schedule's and the adaptive one.

Reads ``ctx.noise`` (published by the noise scale, which checkpoints the estimate it comes from), and at ``FIT_START``
``ctx.run.max_steps``, ``ctx.run.lr_schedulers`` and ``ctx.planned_steps`` (to warn a run bounded by ``max_steps``
whose LR schedule is moved by samples); raises ``ctx.factor`` and publishes ``ctx.factor_floor`` at ``FIT_START`` and
``WINDOW_OPENING``; adds its line to ``ctx.summary`` and its bounds to ``ctx.metrics``.
"""

from __future__ import annotations

import math
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_accum.adaptive import AdaptiveFactor
from lightning_accum.events import Context, Feature
from lightning_accum.sample_driven_lr import SampleDrivenLR


class AdaptiveGrowth(Feature):
    """Set the accumulation factor from the noise scale and the evidence behind it, within ``max_factor``.

    Logs ``accum/noise_scale_low`` and ``accum/noise_scale_high``: the bounds (at ``confidence``) the decisions act on,
    once enough measurements stand behind the estimate (the upper one only while it is finite).

    Args:
        target: The wanted effective batch as a multiple of the noise scale.
        max_factor: The largest factor growth may reach.
        confidence: The one-sided confidence of the bound a change acts on, in ``[0.5, 1)``.
        shrink: Whether the factor may come down again (never below the schedule's).

    Raises:
        TypeError: If ``max_factor`` is not an integer or ``shrink`` not a bool.
        ValueError: If ``target`` is not a positive finite number, ``max_factor`` is below 1 or ``confidence`` is not
            a number in ``[0.5, 1)``.

    Example::

        >>> from lightning_accum.events import Context, Event, Features
        >>> from lightning_accum.noise import NoiseReading, NoiseScaleEstimate
        >>> growth = AdaptiveGrowth(target=1.0, max_factor=16)
        >>> features, ctx = Features([growth]), Context(factor=2)
        >>> estimate = NoiseScaleEstimate(1.0, 100.0, 100.0, 8.0, grad_sq_var=1e-4, trace_var=1.0, covariance=0.0)
        >>> ctx.noise = NoiseReading(estimate, items=16.0, micro_steps=2, step=1)  # a window of 2 held 16 samples
        >>> ctx.optimizer_steps = 1; features.dispatch(Event.WINDOW_OPENING, ctx); ctx.factor
        12
    """

    name = "adaptive"

    def __init__(
        self, target: float = 1.0, max_factor: int = 64, confidence: float = 0.9, shrink: bool = False
    ) -> None:
        if not isinstance(shrink, bool):
            raise TypeError(f"`adaptive_shrink` must be a bool, got {shrink!r}")
        self.policy = AdaptiveFactor(target, max_factor, confidence, shrink)  # the decision rule, read-only
        self.factor = 0  # 0 until the policy has set one
        self._decided_at = 0  # the optimizer step of the measured window the latest decision read

    @override
    def reset(self) -> None:
        self.factor, self._decided_at = 0, 0

    @override
    def fit_start(self, ctx: Context) -> None:
        self._apply(ctx)
        if 0 < ctx.run.max_steps <= ctx.planned_steps and any(
            isinstance(s, SampleDrivenLR) for s, _, _ in ctx.run.lr_schedulers
        ):
            rank_zero_warn(
                "AccumulationScheduler: adaptive growth in a run bounded by `max_steps`: the samples such a run"
                " consumes grow with its factor, so SampleDrivenLR, spread over the samples at the starting factor,"
                " ends early and holds its last value. Bound the run by epochs or `limit_train_batches` instead"
            )
        shrinks = ", shrinking too" if self.policy.shrink else ""
        ctx.summary.append(
            f"adaptive: batch up to {self.policy.target:g} x the noise scale's {self.policy.confidence:.0%} lower"
            f" bound, factor <= {self.policy.max_factor}{shrinks}"
        )

    @override
    def window_opening(self, ctx: Context) -> None:
        reading = ctx.noise
        if reading is not None and reading.step > self._decided_at:  # a window was measured since the last decision
            self._decided_at = reading.step
            scheduled = ctx.factor
            current = max(scheduled, self.factor)
            proposal = current
            if ctx.is_global_zero:
                per_factor = reading.items / max(1, reading.micro_steps)
                proposal = self.policy.propose(current, per_factor, reading.estimate, floor=scheduled)
            proposal = int(ctx.broadcast(proposal))  # every rank takes rank zero's decision
            if proposal != current:
                self.factor = proposal
                scale = reading.estimate.noise_scale
                rank_zero_info(
                    f"AccumulationScheduler: the noise scale ({scale if scale is not None else math.inf:.4g}, from"
                    f" {reading.estimate.measurements:.1f} measurements) calls for factor {current} -> {proposal} from"
                    f" optimizer step {ctx.optimizer_steps}"
                )
        self._apply(ctx)

    def _apply(self, ctx: Context) -> None:
        ctx.factor, ctx.factor_floor = max(ctx.factor, self.factor), max(1, self.factor)

    @override
    def window_closed(self, ctx: Context) -> None:
        wanted = self.policy.bounds(ctx.noise.estimate if ctx.noise is not None else None)
        if wanted is None:
            return
        ctx.metrics["accum/noise_scale_low"] = wanted[0] / self.policy.target
        if wanted[1] < math.inf:
            ctx.metrics["accum/noise_scale_high"] = wanted[1] / self.policy.target

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"factor": self.factor, "decided_at": self._decided_at}

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.factor = int(state.get("factor", 0))
        self._decided_at = int(state.get("decided_at", state.get("checked_at", 0)))
