"""Adaptive growth (``adaptive=True``): double the factor when the measured noise scale says a larger batch pays.

Every ``interval`` optimizer steps, at a window boundary, rank zero asks the policy
(:class:`~lightning_accum.adaptive.AdaptiveFactor`) whether ``target x noise scale`` has reached twice the effective
batch often enough; its answer is broadcast, so every rank opens the next window with the same factor. The factor is
then the larger of the schedule's and the grown one.

Reads ``ctx.noise_scale`` and ``ctx.noise_batch`` (published by the noise scale) when a window closes and keeps them,
so a resumed run decides from the same values; raises ``ctx.factor`` at ``WINDOW_OPENING`` and ``FIT_START``.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_accum.adaptive import AdaptiveFactor
from lightning_accum.events import Context, Feature


class AdaptiveGrowth(Feature):
    """Grow the accumulation factor from the noise scale, never above ``max_factor``, never down.

    Args:
        target: The wanted effective batch as a multiple of the noise scale.
        max_factor: The largest factor growth may reach.
        interval: Optimizer steps between two checks.
        patience: Consecutive checks that must call for growth before the factor doubles.

    Raises:
        TypeError: If an integer argument is not an integer.
        ValueError: If ``target`` is not a positive number, or an integer argument is below 1.

    Example::

        >>> from lightning_accum.events import Context, Event, Features
        >>> growth = AdaptiveGrowth(target=1.0, max_factor=8, interval=1, patience=1)
        >>> features, ctx = Features([growth]), Context(factor=2)
        >>> ctx.noise_scale, ctx.noise_batch = 100.0, (16.0, 2)  # the window of 2 held 16 samples
        >>> features.dispatch(Event.WINDOW_CLOSED, ctx)
        >>> ctx.optimizer_steps = 1; features.dispatch(Event.WINDOW_OPENING, ctx); ctx.factor
        4
    """

    name = "adaptive"

    def __init__(self, target: float = 1.0, max_factor: int = 64, interval: int = 50, patience: int = 2) -> None:
        self._policy = AdaptiveFactor(target, max_factor, interval, patience)
        self.factor = 0  # 0 until growth raises the factor above the schedule's
        self._checked_at = -1
        self._noise_scale: float | None = None  # the estimate after the latest step
        self._noise_batch: tuple[float, int] | None = None  # (items, micro-batches) of the latest measured step

    @override
    def reset(self) -> None:
        self.factor, self._checked_at, self._noise_scale, self._noise_batch = 0, -1, None, None

    @override
    def fit_start(self, ctx: Context) -> None:
        ctx.factor = max(ctx.factor, self.factor)
        if ctx.factor == 1 and ctx.world_size == 1:
            rank_zero_warn(
                "AccumulationScheduler: adaptive accumulation starts from factor 1 on one process, where a step has a"
                " single micro-batch gradient and the noise scale cannot be measured: start from a factor of 2"
            )

    @override
    def window_opening(self, ctx: Context) -> None:
        step = ctx.optimizer_steps
        if self._policy.due(step) and step != self._checked_at:
            self._checked_at = step
            self._check(ctx, current=max(ctx.factor, self.factor))
        ctx.factor, ctx.factor_floor = max(ctx.factor, self.factor), max(1, self.factor)

    def _check(self, ctx: Context, current: int) -> None:
        # the batch the next windows would have, in the noise scale's own unit (samples or tokens, as measured)
        big, micro_steps = self._noise_batch if self._noise_batch is not None else (0.0, 1)
        proposal = current
        if ctx.is_global_zero:
            proposal = self._policy.propose(current, big * current / micro_steps, self._noise_scale)
        proposal = int(ctx.broadcast(proposal))  # every rank takes rank zero's decision
        if proposal > current:
            self.factor = proposal
            rank_zero_info(
                f"AccumulationScheduler: the noise scale ({self._noise_scale or 0:.4g}) calls for a larger batch:"
                f" factor {current} -> {proposal} from optimizer step {ctx.optimizer_steps}"
            )

    @override
    def window_closed(self, ctx: Context) -> None:
        self._noise_scale, self._noise_batch = ctx.noise_scale, ctx.noise_batch

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "factor": self.factor,
            "checked_at": self._checked_at,
            "noise_scale": self._noise_scale,
            "noise_batch": None if self._noise_batch is None else list(self._noise_batch),
            **self._policy.state_dict(),
        }

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.factor = int(state.get("factor", 0))
        self._checked_at = int(state.get("checked_at", -1))
        scale, batch = state.get("noise_scale"), state.get("noise_batch")
        self._noise_scale = None if scale is None else float(scale)
        self._noise_batch = None if batch is None else (float(batch[0]), int(batch[1]))
        self._policy.load_state_dict(state)
