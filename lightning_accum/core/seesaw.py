"""Batch sizes read off an LR schedule: Seesaw's, and the bound a fixed budget puts on growing the batch.

An LR schedule that decays trades noise for progress; so does a growing batch. Meterez et al. 2025 (*Seesaw*, arXiv
2510.14717) make the trade exact: wherever a schedule would halve the learning rate, double the batch instead and let
the LR fall by what the optimizer's LR rule gives back for a doubled batch (by ``sqrt(2)`` for Adam's square-root
rule, not at all for SGD's linear rule); on language models it matches the schedule's loss at equal data in fewer
steps, as long as the batch stays under the critical batch. In this package the LR rule
(:mod:`lightning_accum.core.scaling`) already multiplies the LR by ``sqrt(factor)`` or ``factor``, so Seesaw is a factor
schedule: ``base x 2**k`` where the schedule's LR stands ``k`` halvings below its peak so far.

The same reading bounds adaptive growth on a fixed budget: past the warmup, a batch ``r`` times the first costs ``r``
times the data per step, which pays only where the schedule would have cut the LR by ``r`` anyway, so the factor is
held to ``base x`` the peak LR over the current one (:func:`growth_bound`).

Pure: no Lightning import. The positions are in the unit the :class:`~lightning_accum.SampleDrivenLR` moves by
(samples or tokens): its scheduler stands at step ``j`` once ``j x total / steps`` have been consumed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from lightning_accum.core.schedule import Schedule, Unit, check_bool, check_int

_EPS = 1e-9  # a schedule that lands on exactly half its peak (cosine at mid-way) counts as halved


def decay_ratios(lrs: Sequence[float]) -> list[float]:
    """The peak LR so far over the LR at each step (1 while it rises; ``inf`` where it is 0).

    Example::

        >>> decay_ratios([0.5, 1.0, 0.5, 0.25, 0.0])
        [1.0, 1.0, 2.0, 4.0, inf]
    """
    ratios, peak = [], 0.0
    for lr in lrs:
        peak = max(peak, lr)
        ratios.append(peak / lr if lr > 0 else (math.inf if peak > 0 else 1.0))
    return ratios


def _schedule(
    lrs: Sequence[float], steps: int, total: float, unit: Unit, factor: Callable[[float], int], start: int = 0
) -> Schedule:
    """The factor ``factor(ratio)`` at each scheduler step ``start + j`` of ``lrs``, as positions in ``unit``."""
    points: dict[int, int] = {}
    previous = None
    for j, ratio in enumerate(decay_ratios(lrs)):
        value = factor(ratio)
        if value != previous:
            points[math.ceil((start + j) * total / steps) if j else 0] = value
            previous = value
    return Schedule(points=tuple(sorted(points.items())), unit=unit)


def seesaw_schedule(
    lrs: Sequence[float], steps: int, total: float, unit: Unit, base: int, max_factor: int, start: int = 0
) -> Schedule:
    """Seesaw's factors: ``base x 2**k`` where the LR is ``k`` halvings below its peak so far, at most ``max_factor``.

    Args:
        lrs: The schedule's LR at each of its steps (:meth:`~lightning_accum.SampleDrivenLR.planned_lrs`).
        steps: The steps the schedule is spread over.
        total: The samples (or tokens) those steps span.
        unit: ``"sample"`` or ``"token"``.
        base: The factor before the first halving.
        max_factor: The largest factor; past it the schedule's LR goes on falling as given.
        start: The scheduler step ``lrs[0]`` stands at.

    Example::

        >>> lrs = [1.0, 0.9, 0.5, 0.3, 0.2, 0.1, 0.05]  # a decay over 6 steps, spread over 600 samples
        >>> seesaw_schedule(lrs, steps=6, total=600, unit="sample", base=1, max_factor=8).points
        ((0, 1), (200, 2), (400, 4), (500, 8))
    """
    return _schedule(
        lrs, steps, total, unit, lambda ratio: min(max_factor, base * 2 ** _halvings(ratio, max_factor)), start
    )


def _halvings(ratio: float, most: int) -> int:
    """Whole halvings in ``ratio`` (an LR of 0: as many as take a factor past ``most``)."""
    return most.bit_length() if math.isinf(ratio) else math.floor(math.log2(ratio) + _EPS)


def growth_bound(
    lrs: Sequence[float], steps: int, total: float, unit: Unit, base: int, max_factor: int, start: int = 0
) -> Schedule:
    """The largest factor growth may reach on a fixed budget: ``base x`` the peak LR so far over the current LR.

    Arguments as :func:`seesaw_schedule`'s.

    Example::

        >>> lrs = [1.0, 0.9, 0.5, 0.3, 0.2, 0.1, 0.05]
        >>> growth_bound(lrs, steps=6, total=600, unit="sample", base=1, max_factor=16).points
        ((0, 1), (200, 2), (300, 3), (400, 5), (500, 10), (600, 16))
    """
    return _schedule(
        lrs,
        steps,
        total,
        unit,
        lambda ratio: max_factor if math.isinf(ratio) else min(max_factor, math.floor(base * ratio + _EPS)),
        start,
    )


def planned_steps(schedule: Schedule, total: float, per_micro_step: int) -> int:
    """The optimizer steps it takes to consume ``total`` at ``per_micro_step`` a micro-step, factors by ``schedule``.

    A window opens with the factor in force where it starts, as the coordinator opens them (no epoch boundaries).

    Example::

        >>> planned_steps(Schedule(((0, 1), (200, 2), (400, 4)), unit="sample"), total=600, per_micro_step=10)
        35
    """
    steps, position = 0, 0
    while position < total:
        position += schedule.factor_at(position) * per_micro_step
        steps += 1
    return steps


def steps_ratio(schedule: Schedule, total: float, base: int) -> float:
    """The optimizer steps under ``schedule`` over those at ``base`` throughout, for micro-steps of equal size.

    Example::

        >>> steps_ratio(Schedule(((0, 1), (50, 2)), unit="token"), total=100, base=1)
        0.75
    """
    starts = [position for position, _ in schedule.points if position < total]
    ends = [*starts[1:], total]
    return sum(
        (end - begin) / total * base / schedule.factor_at(begin) for begin, end in zip(starts, ends, strict=True)
    )


def check_seesaw(seesaw: object, max_factor: object, adaptive: object) -> bool:
    """Whether Seesaw is on, its arguments checked.

    Raises:
        TypeError: If ``seesaw`` is not a bool, or ``seesaw_max_factor`` not an integer.
        ValueError: If ``seesaw_max_factor`` is below 2, or Seesaw is asked for together with adaptive growth (two
            rules would set one factor), naming the arguments.

    Example::

        >>> check_seesaw(True, 8, adaptive=False)
        True
    """
    on = check_bool("seesaw", seesaw)
    check_int("seesaw_max_factor", max_factor, minimum=2)
    if on and adaptive is True:
        raise ValueError(
            "`seesaw=True` sets the factor from the LR schedule and `adaptive=True` from the noise scale: choose one"
            " (adaptive growth is held to the LR schedule's bound on its own; keep noise_scale=True beside Seesaw to"
            " be warned when its batch outgrows the noise scale)"
        )
    return on
