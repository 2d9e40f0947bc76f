"""Adaptive accumulation: the factor the measured noise scale calls for, once the evidence is there.

McCandlish, Kaplan, Amodei et al. 2018 find that training is most efficient (in both steps and samples) near the
critical batch ``B_crit``, which the simple noise scale ``B_simple`` estimates, and that the noise scale grows as the
loss falls. The batch this policy aims for is ``target x B_simple``. It acts on one-sided confidence bounds of the
estimate (:meth:`~lightning_accum.core.noise.NoiseScaleEstimate.interval`), never on the estimate alone, and it keeps
its error rate over the whole run, not per decision:

- **Evidence per measured window** (``NoiseReading.evidence``): the measured windows' moving averages, decaying per
  measured window (not per optimizer step, as the logged noise scale's do), so that a decision stands on the same
  number of measurements however sparsely windows are measured.
- **Fresh evidence for each change** (:func:`ready`): after the factor changes, the next decision waits until the
  windows measured since make up half the averages' effective count (and at least :data:`MIN_MEASUREMENTS`): two
  changes never read the same excursion of the averages.
- **Alpha spending** (:func:`look`, :func:`spent_confidence`): while the factor holds, the averages renew themselves
  every ``measurements`` measured windows; the ``k``-th such renewal since the last change is tested at
  ``1 - alpha / (k (k + 1))`` (``alpha = 1 - confidence``), so that over all the tests made at one factor the chance
  that noise alone moves it is at most ``alpha`` (a Bonferroni sum over independent looks), instead of ``alpha`` at
  every look.
- **At most a doubling per change**: a bound computed from the noisiest evidence (windows of one loader batch in two
  halves) can overshoot by far; a doubling needs fresh evidence at the new factor before the next.

Then it grows to the largest factor whose batch is at most ``target x`` the *lower* bound (up to twice the current
factor, never above ``max_factor``), and with ``shrink`` comes down to the smallest factor whose batch is at least
``target x`` the *upper* bound (never below ``floor``, the schedule's factor); between the bounds it holds.
Pure: no Lightning import; the callback asks it after each measured window, on rank zero, and broadcasts the answer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_accum.core.noise import NoiseScaleEstimate
from lightning_accum.core.schedule import check_bool, check_int

FREE_SHARE = 0.1
"""The largest batch, as a share of the noise scale's lower bound, that growth may reach past the LR schedule's bound
(:func:`budget_bound`): McCandlish et al.'s examples per unit of progress at batch ``B`` are ``1 + B / B_noise``
times the fewest, so such a batch spends at most a tenth more of a fixed budget."""

MIN_MEASUREMENTS = 3.0
"""The effective number of measured windows (:attr:`NoiseScaleEstimate.measurements`) a decision needs."""


def most_measurements(decay: float) -> float:
    """The effective number of measured windows moving averages of ``decay`` per window hold at most.

    ``(1 + decay) / (1 - decay)``: Kish's count of the weights ``(1 - decay) decay^i``.

    Example::

        >>> round(most_measurements(0.95), 2), round(most_measurements(0.5), 2)
        (39.0, 3.0)
    """
    return (1 + decay) / (1 - decay)


def check_needs_noise_scale(adaptive: object, noise_scale: object) -> None:
    """Refuse ``adaptive=True`` without ``noise_scale=True``, whose estimate it acts on.

    Raises:
        TypeError: If ``adaptive`` is not a bool.
        ValueError: If ``adaptive`` is on and ``noise_scale`` is not ``True``, naming both.
    """
    if check_bool("adaptive", adaptive) and noise_scale is not True:
        raise ValueError(
            f"`adaptive=True` grows the factor from the measured noise scale: set noise_scale=True as well (got"
            f" noise_scale={noise_scale!r})"
        )


def check_evidence(decay: float) -> None:
    """Refuse a ``noise_scale_decay`` whose averages could never hold the evidence a decision needs.

    Raises:
        ValueError: If ``most_measurements(decay)`` is below ``MIN_MEASUREMENTS + 0.5``, naming the decay.
    """
    most = most_measurements(decay)
    if most >= MIN_MEASUREMENTS + 0.5:
        return
    least = (MIN_MEASUREMENTS - 0.5) / (MIN_MEASUREMENTS + 1.5)  # (1 + d) / (1 - d) >= MIN + 0.5
    raise ValueError(
        f"`adaptive=True` decides once {MIN_MEASUREMENTS:g} measured windows' worth of evidence stand behind the noise"
        f" scale, but noise_scale_decay={decay!r} keeps at most {most:.2f}: raise noise_scale_decay to {least:.2f} or"
        " more (0.95, the default, keeps 39)"
    )


def budget_bound(lr_bound: int, low: float, batch_per_factor: float) -> int:
    """The largest factor growth may reach on a fixed budget.

    The LR schedule's bound (``lr_bound``: the first factor times its peak LR over its current LR, where a larger
    batch stands for the decay the schedule makes anyway), or past it a batch of at most :data:`FREE_SHARE` of the
    noise scale's lower bound ``low``, which costs at most a tenth more examples whatever the schedule.

    Example::

        >>> budget_bound(lr_bound=1, low=1000.0, batch_per_factor=8.0)  # far below the noise scale: 12 x 8 <= 100
        12
        >>> budget_bound(lr_bound=2, low=3000.0, batch_per_factor=512.0)  # an LM's tokens: the schedule's bound
        2
    """
    return max(lr_bound, math.floor(FREE_SHARE * low / batch_per_factor))


def ready(fresh: int, measurements: float) -> bool:
    """Whether a decision may be taken on averages of ``measurements`` effective windows, ``fresh`` of them new.

    ``fresh`` (the windows measured since the factor last changed) must make up half the averages' effective count,
    and both must be at least :data:`MIN_MEASUREMENTS`.

    Example::

        >>> ready(fresh=3, measurements=4.0), ready(fresh=10, measurements=39.0), ready(fresh=20, measurements=39.0)
        (True, False, True)
    """
    return measurements >= MIN_MEASUREMENTS and fresh >= max(MIN_MEASUREMENTS, measurements / 2)


def look(fresh: int, measurements: float) -> int:
    """Which renewal of the averages since the factor last changed a test is: 1 until ``fresh`` windows fill them.

    Example::

        >>> look(fresh=20, measurements=39.0), look(fresh=40, measurements=39.0), look(fresh=118, measurements=39.0)
        (1, 2, 4)
    """
    return 1 + max(0, fresh - 1) // max(1, math.ceil(measurements))


def spent_confidence(confidence: float, look: int) -> float:
    """The confidence of the ``look``-th test at one factor: ``1 - alpha / (look (look + 1))``.

    ``alpha = 1 - confidence``; the ``alpha / (k (k + 1))`` add up to ``alpha`` over every look, however many.

    Example::

        >>> spent_confidence(0.9, 1), round(spent_confidence(0.9, 3), 5)
        (0.95, 0.99167)
    """
    return 1.0 - (1.0 - confidence) / (look * (look + 1))


@dataclass(frozen=True)
class Decision:
    """What the policy decided, and on what.

    Attributes:
        factor: The factor to use from now on.
        called: The factor the bounds call for (``factor`` but where a doubling at a time holds growth back).
        low: The wanted batch's lower bound (``target x`` the noise scale's), at ``confidence``.
        high: Its upper bound (``math.inf`` while ``|G|^2`` may be 0).
        confidence: The one-sided confidence both bounds were taken at (the spent one).
        held: The largest factor something besides the evidence allowed (the LR schedule's bound), or ``None``.
    """

    factor: int
    called: int
    low: float
    high: float
    confidence: float
    held: int | None = None


class AdaptiveFactor:
    """Decide the accumulation factor from the noise scale and the evidence behind it.

    Args:
        target: The wanted effective batch as a multiple of the noise scale (``B* = target x B_simple``).
        max_factor: The largest factor the policy may reach.
        confidence: The one-sided confidence of the first test at a factor, in ``[0.5, 1)``; later tests at the
            same factor spend ``1 - confidence`` over their looks (:func:`spent_confidence`). Higher waits for more
            evidence (fewer changes on noise, later growth).
        shrink: Whether the factor may come down when the upper bound falls below the current batch.

    Raises:
        TypeError: If ``max_factor`` is not an integer.
        ValueError: If ``target`` is not a positive finite number, ``max_factor`` is below 1, or ``confidence`` is
            not a number in ``[0.5, 1)``.

    Example::

        >>> from lightning_accum.core.noise import NoiseScaleEstimate
        >>> policy = AdaptiveFactor(target=1.0, max_factor=16, confidence=0.9)
        >>> sure = NoiseScaleEstimate(1.0, 100.0, 100.0, 8.0, grad_sq_var=1e-4, trace_var=1.0, covariance=0.0)
        >>> policy.propose(factor=2, batch_per_factor=8.0, estimate=sure)  # 98 to 102 calls for 12: at most double
        4
        >>> policy.propose(factor=8, batch_per_factor=8.0, estimate=sure)  # from 8, 12 is within a doubling
        12
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

    def bounds(self, estimate: NoiseScaleEstimate | None, look: int = 1) -> tuple[float, float, float] | None:
        """The wanted batch's bounds (``target x`` the noise scale's) and their confidence at ``look``.

        ``None`` while the evidence is too thin.
        """
        if estimate is None or estimate.measurements < MIN_MEASUREMENTS:
            return None
        confidence = spent_confidence(self.confidence, look)
        interval = estimate.interval(confidence)
        if interval is None:
            return None
        return self.target * interval[0], self.target * interval[1], confidence

    def decide(
        self, factor: int, batch_per_factor: float, estimate: NoiseScaleEstimate | None, floor: int = 1, look: int = 1
    ) -> Decision | None:
        """The factor to use from now on, with the bounds it was decided on (``None``: no bounds to act on).

        Args:
            factor: The factor in force.
            batch_per_factor: The effective batch one unit of factor holds, in the noise scale's unit (samples or
                tokens over all ranks per micro-step).
            estimate: The evidence (``NoiseReading.evidence``), or ``None``.
            floor: The smallest factor allowed (the schedule's).
            look: The test's place among those at this factor (:func:`look`), for the spent confidence.
        """
        wanted = self.bounds(estimate, look)
        if wanted is None or batch_per_factor <= 0:
            return None
        low, high, confidence = wanted
        chosen = called = factor
        grown = min(self.max_factor, math.floor(low / batch_per_factor))
        if grown > factor:
            chosen, called = min(grown, 2 * factor), grown
        elif self.shrink and high < math.inf:
            chosen = called = min(factor, max(floor, 1, math.ceil(high / batch_per_factor)))
        return Decision(chosen, called, low, high, confidence)

    def propose(
        self, factor: int, batch_per_factor: float, estimate: NoiseScaleEstimate | None, floor: int = 1, look: int = 1
    ) -> int:
        """:meth:`decide`'s factor (the factor in force when there is nothing to act on)."""
        decision = self.decide(factor, batch_per_factor, estimate, floor, look)
        return factor if decision is None else decision.factor
