"""Adaptive accumulation: the factor the measured noise scale calls for, once the evidence is there.

McCandlish, Kaplan, Amodei et al. 2018 find that training is most efficient (in both steps and samples) near the
critical batch ``B_crit``, which the simple noise scale ``B_simple`` estimates, and that the noise scale grows as the
loss falls. The batch this policy aims for is ``target x B_simple``. It acts on a one-sided confidence bound of the
estimate (:meth:`~lightning_accum.noise.NoiseScaleEstimate.interval`), never on the estimate alone:

- it grows to the largest factor whose batch is at most ``target x`` the *lower* bound, as soon as that is above the
  current factor (any factor, not only the double), never above ``max_factor``;
- with ``shrink``, it shrinks to the smallest factor whose batch is at least ``target x`` the *upper* bound, as soon
  as that is below the current factor, never below ``floor`` (the schedule's factor);
- between the two bounds it holds: the width of the interval is the hysteresis, wide while few measurements stand
  behind the estimate and narrowing as they accumulate, so noise alone rarely moves the factor.

It decides only from an estimate of at least :data:`MIN_MEASUREMENTS` effective measurements. Pure: no Lightning
import; the callback asks it after each measured window, on rank zero, and broadcasts the answer.
"""

from __future__ import annotations

import math

from lightning_accum.noise import NoiseScaleEstimate
from lightning_accum.schedule import check_int

MIN_MEASUREMENTS = 3.0
"""The effective number of measured windows (:attr:`NoiseScaleEstimate.measurements`) a decision needs."""


def most_measurements(decay: float, interval: int) -> float:
    """The effective number of measurements the noise scale's averages hold at most.

    Measuring every ``interval``-th window with ``decay`` per step: ``(1 + decay^interval) / (1 - decay^interval)``.

    Example::

        >>> round(most_measurements(0.95, 10), 2), round(most_measurements(0.9, 10), 2)
        (3.98, 2.07)
    """
    kept = decay**interval
    return (1 + kept) / (1 - kept)


def check_evidence(decay: float, interval: int) -> None:
    """Refuse a noise scale that could never hold the evidence adaptive growth needs (a margin above its minimum).

    Raises:
        ValueError: If ``most_measurements(decay, interval)`` is below ``MIN_MEASUREMENTS + 0.5``, naming both.
    """
    most = most_measurements(decay, interval)
    if most >= MIN_MEASUREMENTS + 0.5:
        return
    # the most windows between measurements with (1 + d^k) / (1 - d^k) >= MIN + 0.5: d^k >= (MIN - 0.5) / (MIN + 1.5)
    shortest = math.floor(math.log((MIN_MEASUREMENTS - 0.5) / (MIN_MEASUREMENTS + 1.5), decay)) if decay else 0
    fix = f"lower noise_scale_interval to {shortest} or less, or " if shortest >= 1 else ""
    raise ValueError(
        f"`adaptive=True` decides once {MIN_MEASUREMENTS:g} measured windows' worth of evidence stand behind the noise"
        f" scale, but noise_scale_decay={decay!r} with noise_scale_interval={interval!r} keeps at most {most:.2f}:"
        f" {fix}raise noise_scale_decay (windows whose step is logged are measured too, but the interval decides here)"
    )


class AdaptiveFactor:
    """Decide the accumulation factor from the noise scale and the evidence behind it.

    Args:
        target: The wanted effective batch as a multiple of the noise scale (``B* = target x B_simple``).
        max_factor: The largest factor the policy may reach.
        confidence: The one-sided confidence of the bound a change acts on, in ``[0.5, 1)``: higher waits for more
            evidence (fewer changes on noise, later growth).
        shrink: Whether the factor may come down when the upper bound falls below the current batch.

    Raises:
        TypeError: If ``max_factor`` is not an integer.
        ValueError: If ``target`` is not a positive finite number, ``max_factor`` is below 1, or ``confidence`` is
            not a number in ``[0.5, 1)``.

    Example::

        >>> from lightning_accum.noise import NoiseScaleEstimate
        >>> policy = AdaptiveFactor(target=1.0, max_factor=16, confidence=0.9)
        >>> sure = NoiseScaleEstimate(1.0, 100.0, 100.0, 8.0, grad_sq_var=1e-4, trace_var=1.0, covariance=0.0)
        >>> policy.propose(factor=2, batch_per_factor=8.0, estimate=sure)  # 98 to 102: batches up to 96
        12
        >>> vague = NoiseScaleEstimate(1.0, 100.0, 100.0, 8.0, grad_sq_var=0.25, trace_var=400.0, covariance=0.0)
        >>> policy.propose(factor=2, batch_per_factor=8.0, estimate=vague)  # lower bound 53.0: 6 x 8 fits below it
        6
    """

    def __init__(
        self, target: float = 1.0, max_factor: int = 64, confidence: float = 0.9, shrink: bool = False
    ) -> None:
        if isinstance(target, bool) or not isinstance(target, (int, float)) or not 0 < target < math.inf:
            raise ValueError(f"`adaptive_target` must be a positive finite number, got {target!r}")
        valid = isinstance(confidence, (int, float)) and not isinstance(confidence, bool)
        if not valid or not 0.5 <= confidence < 1.0:
            raise ValueError(f"`adaptive_confidence` must be a number in [0.5, 1), got {confidence!r}")
        self.target = float(target)
        self.max_factor = check_int("adaptive_max_factor", max_factor, minimum=1)
        self.confidence = float(confidence)
        self.shrink = shrink

    def bounds(self, estimate: NoiseScaleEstimate | None) -> tuple[float, float] | None:
        """The wanted batch's bounds, ``target x`` the noise scale's, or ``None`` while the evidence is too thin."""
        if estimate is None or estimate.measurements < MIN_MEASUREMENTS:
            return None
        interval = estimate.interval(self.confidence)
        if interval is None:
            return None
        return self.target * interval[0], self.target * interval[1]

    def propose(self, factor: int, batch_per_factor: float, estimate: NoiseScaleEstimate | None, floor: int = 1) -> int:
        """The factor to use from now on.

        Args:
            factor: The factor in force.
            batch_per_factor: The effective batch one unit of factor holds, in the noise scale's unit (samples or
                tokens over all ranks per micro-step).
            estimate: The latest estimate, or ``None``.
            floor: The smallest factor allowed (the schedule's).
        """
        wanted = self.bounds(estimate)
        if wanted is None or batch_per_factor <= 0:
            return factor
        low, high = wanted
        grown = min(self.max_factor, math.floor(low / batch_per_factor))
        if grown > factor:
            return grown
        if self.shrink and high < math.inf:
            shrunk = max(floor, 1, math.ceil(high / batch_per_factor))
            if shrunk < factor:
                return shrunk
        return factor
