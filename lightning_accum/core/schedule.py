"""Accumulation schedules: which factor applies at which position.

This module owns the arithmetic of *how many micro-batches make one optimizer step*: validating a user's schedule,
looking up the factor at a position (an epoch, an optimizer step or a number of samples), turning a target global
batch size or a Megatron-style batch-size ramp into factors, and counting the optimizer steps a finite run will take.

It is pure: it imports no Lightning and holds no Trainer state, so every rule here is tested without a Trainer.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, get_args

Unit = Literal["epoch", "step", "sample", "token"]
UNITS: tuple[str, ...] = get_args(Unit)


def check_int(name: str, value: object, minimum: int) -> int:
    """Return ``value`` if it is an integer of at least ``minimum``; raise a message naming ``name`` otherwise.

    Raises:
        TypeError: If ``value`` is not an ``int`` (``bool`` is refused too).
        ValueError: If ``value`` is below ``minimum``.

    Example::

        >>> check_int("factor", 4, minimum=1)
        4
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{name}` must be an integer, got {value!r} of type {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"`{name}` must be an integer >= {minimum}, got {value!r}")
    return value


def check_bool(name: str, value: object) -> bool:
    """Return ``value`` if it is a ``bool``; raise a message naming ``name`` otherwise.

    Raises:
        TypeError: If ``value`` is not a ``bool``.

    Example::

        >>> check_bool("noise_scale", True)
        True
    """
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be a bool, got {value!r}")
    return value


def check_unit(unit: object) -> Unit:
    """Return ``unit`` if it is one of :data:`UNITS`.

    Raises:
        ValueError: If ``unit`` is not ``'epoch'``, ``'step'``, ``'sample'`` or ``'token'``.

    Example::

        >>> check_unit("step")
        'step'
    """
    if unit not in UNITS:
        allowed = ", ".join(repr(u) for u in UNITS[:-1]) + f" or {UNITS[-1]!r}"
        raise ValueError(f"`unit` must be one of {allowed}, got {unit!r}")
    return unit  # type: ignore[return-value]


@dataclass(frozen=True)
class Schedule:
    """A piecewise-constant accumulation factor over epochs, optimizer steps or samples.

    Args:
        points: ``(position, factor)`` pairs sorted by position; the first position is 0.
        unit: What the positions count: ``"epoch"``, ``"step"`` (optimizer steps), ``"sample"`` (samples consumed
            by all ranks together) or ``"token"`` (loss-bearing tokens consumed by all ranks together).

    Example::

        >>> s = Schedule.from_mapping({2: 4, 5: 8}, unit="epoch")
        >>> [s.factor_at(e) for e in range(7)]
        [1, 1, 4, 4, 4, 8, 8]
    """

    points: tuple[tuple[int, int], ...]
    unit: Unit = "epoch"

    @classmethod
    def from_mapping(cls, scheduling: Mapping[int, int], unit: str = "epoch", name: str = "scheduling") -> Schedule:
        """Validate a ``{position: factor}`` mapping and build a schedule from a copy of it.

        Positions before the first key use factor 1, as in Lightning's ``GradientAccumulationScheduler``.

        Raises:
            TypeError: If ``scheduling`` is not a mapping, or a key or factor is not an integer.
            ValueError: If it is empty, a key is negative or a factor is below 1.
        """
        if not isinstance(scheduling, Mapping):
            raise TypeError(
                f"`{name}` must be a dict of {{position: factor}}, got {scheduling!r} of type"
                f" {type(scheduling).__name__}"
            )
        if not scheduling:
            raise ValueError(
                f"`{name}` must not be empty: give at least one {{position: factor}} pair, e.g. {{0: 4}}; got {{}}"
            )
        points = {}
        for key, factor in scheduling.items():
            check_int(f"{name} key {key!r}", key, minimum=0)
            check_int(f"{name}[{key!r}] (the factor)", factor, minimum=1)
            points[key] = factor
        points.setdefault(0, 1)
        return cls(points=tuple(sorted(points.items())), unit=check_unit(unit))

    @classmethod
    def constant(cls, factor: int, unit: Unit = "step") -> Schedule:
        """A schedule with one factor everywhere (``unit="token"``: a run that counts tokens, for what reads them).

        Example::

            >>> Schedule.constant(4).factor_at(10**9)
            4
        """
        return cls(points=((0, check_int("factor", factor, minimum=1)),), unit=unit)

    def factor_at(self, position: int) -> int:
        """The factor in force at ``position`` (counted in :attr:`unit`)."""
        index = bisect.bisect_right(self.points, position, key=lambda point: point[0]) - 1
        return self.points[index][1]

    def next_change(self, position: int) -> int | None:
        """The first position after ``position`` where the factor may change, or ``None`` if it never does."""
        index = bisect.bisect_right(self.points, position, key=lambda point: point[0])
        return self.points[index][0] if index < len(self.points) else None

    @property
    def max_factor(self) -> int:
        """The largest factor the schedule ever uses."""
        return max(factor for _, factor in self.points)

    @property
    def min_factor(self) -> int:
        """The smallest factor the schedule ever uses."""
        return min(factor for _, factor in self.points)


def nearest_valid_batch_sizes(batch_size: int, multiple: int) -> tuple[int, ...]:
    """The multiples of ``multiple`` just below and above ``batch_size`` (the one below only if it is positive).

    Example::

        >>> nearest_valid_batch_sizes(100, 8 * 16)
        (128,)
        >>> nearest_valid_batch_sizes(100, 16)
        (96, 112)
    """
    below = batch_size // multiple * multiple
    above = below if below == batch_size else below + multiple
    return tuple(sorted({size for size in (below, above) if size > 0}))


def factor_for_batch_size(
    batch_size: int, micro_batch_size: int, world_size: int, name: str = "target_batch_size"
) -> int:
    """The accumulation factor that makes ``micro_batch_size x factor x world_size == batch_size``.

    Raises:
        ValueError: If ``batch_size`` is not a multiple of ``micro_batch_size x world_size``; the message shows the
            numbers and the nearest valid batch sizes.

    Example::

        >>> factor_for_batch_size(256, micro_batch_size=8, world_size=4)
        8
    """
    per_micro_step = micro_batch_size * world_size
    if batch_size % per_micro_step:
        nearest = " or ".join(str(size) for size in nearest_valid_batch_sizes(batch_size, per_micro_step))
        raise ValueError(
            f"`{name}={batch_size}` is not a multiple of micro_batch_size x world_size ="
            f" {micro_batch_size} x {world_size} = {per_micro_step}, so no whole accumulation factor reaches it"
            f" ({batch_size} != {micro_batch_size} x factor x {world_size}). Nearest valid: {nearest}."
        )
    return batch_size // per_micro_step


@dataclass(frozen=True)
class BatchSizeRamp:
    """A linear ramp of the global batch size, as Megatron's ``--rampup-batch-size <start> <increment> <samples>``.

    The global batch starts at ``start`` and grows by ``increment`` each time another
    ``samples / ((target - start) / increment)`` samples have been consumed, reaching ``target`` after ``samples``.

    Args:
        start: The first global batch size, in samples.
        increment: How much the global batch grows at each stage, in samples.
        samples: Samples consumed (all ranks together) over which the ramp runs.
        target: The final global batch size.

    Raises:
        TypeError: If an argument is not an integer.
        ValueError: If an argument is below 1, ``start >= target``, or ``target - start`` is not a multiple of
            ``increment``.

    Example::

        >>> BatchSizeRamp(start=32, increment=32, samples=300, target=128).stages()
        [(0, 32), (100, 64), (200, 96), (300, 128)]
    """

    start: int
    increment: int
    samples: int
    target: int

    def __post_init__(self) -> None:
        for field in ("start", "increment", "samples", "target"):
            name = {"start": "ramp_start_batch_size", "target": "target_batch_size"}.get(field, f"ramp_{field}")
            check_int(name, getattr(self, field), minimum=1)
        if self.start >= self.target:
            raise ValueError(
                f"`ramp_start_batch_size={self.start}` must be smaller than `target_batch_size={self.target}`"
            )
        if (self.target - self.start) % self.increment:
            raise ValueError(
                f"`ramp_increment={self.increment}` must divide target_batch_size - ramp_start_batch_size ="
                f" {self.target} - {self.start} = {self.target - self.start}"
            )

    def stages(self) -> list[tuple[int, int]]:
        """``(samples consumed, global batch size)`` at which each stage of the ramp begins."""
        increments = (self.target - self.start) // self.increment
        return [
            (math.ceil(i * self.samples / increments), self.start + i * self.increment) for i in range(increments + 1)
        ]


def build_schedule(
    scheduling: Mapping[int, int] | None,
    unit: str,
    target_batch_size: int | None,
    ramp: BatchSizeRamp | None,
    micro_batch_size: int | None,
    world_size: int,
) -> Schedule:
    """The schedule that a set of user arguments describes, once the micro-batch size and world size are known.

    ``scheduling`` gives factors directly; ``target_batch_size`` (with an optional ``ramp``) gives global batch sizes,
    turned into factors with :func:`factor_for_batch_size`. With neither, the factor is 1.

    Raises:
        ValueError: If a batch size does not divide, or one is needed and ``micro_batch_size`` is unknown.

    Example::

        >>> build_schedule(None, "epoch", 64, None, micro_batch_size=4, world_size=2).factor_at(0)
        8
    """
    if scheduling is not None:
        return Schedule.from_mapping(scheduling, unit)
    counted: Unit = "token" if unit == "token" else "step"  # a token run's constant factor still counts its tokens
    if target_batch_size is None:
        return Schedule.constant(1, counted)
    if micro_batch_size is None:
        raise ValueError(
            f"`target_batch_size={target_batch_size}` needs the micro-batch size, which could not be read from the"
            " train dataloader's `batch_size`: pass `micro_batch_size`"
        )
    if ramp is None:
        return Schedule.constant(factor_for_batch_size(target_batch_size, micro_batch_size, world_size), counted)
    points, invalid = [], []
    for samples, batch_size in ramp.stages():
        try:
            points.append((samples, factor_for_batch_size(batch_size, micro_batch_size, world_size)))
        except ValueError:
            invalid.append(batch_size)
    if invalid:
        per_micro_step = micro_batch_size * world_size
        raise ValueError(
            f"The batch-size ramp (ramp_start_batch_size={ramp.start}, ramp_increment={ramp.increment},"
            f" target_batch_size={ramp.target}) passes through global batch sizes {invalid} that are not multiples of"
            f" micro_batch_size x world_size = {micro_batch_size} x {world_size} = {per_micro_step}: choose"
            f" ramp_start_batch_size and ramp_increment as multiples of {per_micro_step}"
        )
    return Schedule(points=tuple(points), unit="token" if unit == "token" else "sample")


@dataclass(frozen=True)
class ScheduleSpec:
    """The schedule a user asked for, validated, before the run's micro-batch size and world size are known.

    :meth:`from_args` checks the callback's arguments; :meth:`build` turns them into a :class:`Schedule`.

    Example::

        >>> spec = ScheduleSpec.from_args(target_batch_size=64)
        >>> spec.build(micro_batch_size=4, world_size=2).factor_at(0)
        8
    """

    scheduling: dict[int, int] | None = None
    unit: Unit = "epoch"
    target_batch_size: int | None = None
    ramp: BatchSizeRamp | None = None
    micro_batch_size: int | None = None

    @classmethod
    def from_args(
        cls,
        scheduling: Mapping[int, int] | None = None,
        unit: str = "epoch",
        target_batch_size: int | None = None,
        ramp_start_batch_size: int | None = None,
        ramp_increment: int | None = None,
        ramp_samples: int | None = None,
        micro_batch_size: int | None = None,
    ) -> ScheduleSpec:
        """Validate the callback's schedule arguments (copying ``scheduling``, never changing it).

        Raises:
            TypeError: If a value has the wrong type.
            ValueError: If a value is out of range, both ``scheduling`` and ``target_batch_size`` are given, or a
                ramp is incomplete.
        """
        checked_unit = check_unit(unit)
        points = None
        if scheduling is not None:
            if target_batch_size is not None:
                raise ValueError(
                    f"Give either `scheduling` (factors) or `target_batch_size` (a global batch), not both:"
                    f" got scheduling={scheduling!r} and target_batch_size={target_batch_size!r}"
                )
            points = dict(Schedule.from_mapping(scheduling, checked_unit).points)
        if target_batch_size is not None:
            check_int("target_batch_size", target_batch_size, minimum=1)
        given = {"ramp_start_batch_size": ramp_start_batch_size, "ramp_increment": ramp_increment}
        given["ramp_samples"] = ramp_samples
        ramp = None
        if any(value is not None for value in given.values()):
            missing = [name for name, value in given.items() if value is None]
            if missing:
                raise ValueError(f"A batch-size ramp needs all of {list(given)}; missing {missing} (got {given})")
            if target_batch_size is None:
                raise ValueError(f"A batch-size ramp needs `target_batch_size`, the size it ramps to (got {given})")
            ramp = BatchSizeRamp(ramp_start_batch_size, ramp_increment, ramp_samples, target_batch_size)  # type: ignore[arg-type]
        if micro_batch_size is not None:
            check_int("micro_batch_size", micro_batch_size, 1)
        return cls(points, checked_unit, target_batch_size, ramp, micro_batch_size)

    def factor_before_loading(self, position: Mapping[str, int], world_size: int) -> int | None:
        """The factor at ``position`` if it is known before the train dataloader is loaded, else ``None``.

        ``position`` maps each unit to a position; ``None`` comes back when the factor needs the loader's batch size (a
        target or ramp without ``micro_batch_size``).

        Example::

            >>> ScheduleSpec.from_args({0: 2, 10: 4}, unit="step").factor_before_loading({"step": 12}, world_size=1)
            4
        """
        if self.scheduling is not None:
            schedule = Schedule.from_mapping(self.scheduling, self.unit)
        elif self.target_batch_size is not None and self.micro_batch_size is None:
            return None
        else:
            schedule = self.build(self.micro_batch_size, world_size)
        return schedule.factor_at(position[schedule.unit])

    def build(self, micro_batch_size: int | None, world_size: int) -> Schedule:
        """The schedule for a run with this micro-batch size (per rank) and world size.

        Raises:
            ValueError: If the schedule needs the micro-batch size and it is unknown, or a batch size does not divide.
        """
        if self.unit == "sample" and self.scheduling is not None and micro_batch_size is None:
            raise ValueError(
                "`unit='sample'` counts samples, but the micro-batch size could not be read from the train"
                " dataloader's `batch_size`: pass `micro_batch_size`"
            )
        return build_schedule(
            self.scheduling, self.unit, self.target_batch_size, self.ramp, micro_batch_size, world_size
        )


def run_epoch(
    schedule: Schedule,
    batches_per_epoch: int,
    epoch: int = 0,
    first_batch: int = 0,
    steps: int = 0,
    samples: int = 0,
    max_steps: int = -1,
    samples_per_micro_step: int = 1,
    min_factor: int = 1,
    tokens: int = 0,
) -> tuple[int, int, int]:
    """The windows of one epoch from ``first_batch`` on, until the epoch's end or ``max_steps``.

    Windows never span an epoch boundary: the last window of an epoch may be incomplete and still steps. A factor
    change takes effect at the first window that starts at or after its position. The factor is at least
    ``min_factor`` (the floor adaptive growth has reached).

    Args:
        schedule: The accumulation schedule.
        batches_per_epoch: Micro-batches per epoch on each rank.
        epoch: The epoch.
        first_batch: The micro-batch of the epoch where the first window opens.
        steps: Optimizer steps taken before it.
        samples: Samples consumed (all ranks) before it.
        max_steps: Optimizer steps after which training stops; -1 for no limit.
        samples_per_micro_step: Samples all ranks consume together in one micro-step (micro-batch x world size).
        min_factor: The smallest factor a window may have.
        tokens: Loss-bearing tokens consumed (all ranks) before it, for a token-keyed schedule.

    Returns:
        ``(micro-batches, optimizer steps, samples)`` of the epoch from ``first_batch`` on.

    Example::

        >>> run_epoch(Schedule.from_mapping({0: 2, 3: 4}, unit="step"), batches_per_epoch=20, max_steps=5)
        (14, 5, 14)
    """
    batch, taken_steps, taken_samples = first_batch, 0, 0
    while batch < batches_per_epoch and (max_steps < 0 or steps + taken_steps < max_steps):
        step, sample = steps + taken_steps, samples + taken_samples
        # tokens per batch are not known ahead: a token-keyed factor is held at the one in force at ``tokens``
        position = {"epoch": epoch, "step": step, "sample": sample, "token": tokens}[schedule.unit]
        factor = max(schedule.factor_at(position), min_factor)
        left = batches_per_epoch - batch
        windows = math.ceil(left / factor)  # the rest of the epoch, last window possibly incomplete
        change = schedule.next_change(position)
        if change is not None and schedule.unit == "step":
            windows = min(windows, change - step)
        elif change is not None and schedule.unit == "sample":
            windows = min(windows, math.ceil((change - sample) / (factor * samples_per_micro_step)))
        if max_steps >= 0:
            windows = min(windows, max_steps - step)
        used = min(windows * factor, left)
        batch += used
        taken_steps += windows
        taken_samples += used * samples_per_micro_step
    return batch - first_batch, taken_steps, taken_samples


def count_optimizer_steps(
    schedule: Schedule,
    batches_per_epoch: int,
    max_epochs: int,
    max_steps: int = -1,
    samples_per_micro_step: int = 1,
) -> int:
    """The number of optimizer steps a finite run takes under ``schedule``, from the start of training.

    See :func:`plan_run`, which also counts the samples.

    Example::

        >>> count_optimizer_steps(Schedule.constant(4), batches_per_epoch=10, max_epochs=3)
        9
    """
    return plan_run(schedule, batches_per_epoch, max_epochs, max_steps, samples_per_micro_step)[0]


def planned(
    schedule: Schedule, batches_per_epoch: float, max_epochs: int | None, max_steps: int, samples_per_micro_step: int
) -> tuple[float, float]:
    """``(optimizer steps, samples of all ranks)`` a fit plans under ``schedule``, ``inf`` where it has no end.

    Args:
        schedule: The fit's schedule.
        batches_per_epoch: Loader batches of an epoch on one rank (``inf``: endless).
        max_epochs: Epochs to train (``-1``: no limit; ``None``, the Trainer's before it resolves it, counts as ``-1``
            only once ``max_steps`` bounds the run).
        max_steps: Optimizer steps after which training stops (``-1``: no limit).
        samples_per_micro_step: Samples all ranks consume together in one micro-step.

    Example::

        >>> planned(Schedule.constant(4), 10, max_epochs=3, max_steps=-1, samples_per_micro_step=8)
        (9, 240)
        >>> planned(Schedule.constant(4), math.inf, max_epochs=3, max_steps=100, samples_per_micro_step=8)
        (100, inf)
    """
    if max_epochs == -1 and max_steps == -1:
        return math.inf, math.inf
    if batches_per_epoch == math.inf:
        return (math.inf if max_steps == -1 else max_steps), math.inf
    epochs = max_epochs if max_epochs is not None else -1
    return plan_run(schedule, int(batches_per_epoch), epochs, max_steps, samples_per_micro_step)


def plan_run(
    schedule: Schedule,
    batches_per_epoch: int,
    max_epochs: int,
    max_steps: int = -1,
    samples_per_micro_step: int = 1,
) -> tuple[int, int]:
    """``(optimizer steps, samples)`` of a finite run under ``schedule``, from the start of training.

    Windows never span an epoch boundary: the last window of an epoch may be incomplete and still steps. A factor
    change takes effect at the first window that starts at or after its position.

    Args:
        schedule: The accumulation schedule.
        batches_per_epoch: Micro-batches per epoch on each rank.
        max_epochs: Epochs to train; -1 for no limit (then ``max_steps`` must be set).
        max_steps: Optimizer steps after which training stops; -1 for no limit.
        samples_per_micro_step: Samples all ranks consume together in one micro-step (micro-batch x world size).

    Raises:
        ValueError: If neither ``max_epochs`` nor ``max_steps`` bounds the run.

    Example::

        >>> plan_run(Schedule.constant(4), batches_per_epoch=10, max_epochs=3, samples_per_micro_step=8)
        (9, 240)
    """
    if max_epochs < 0 and max_steps < 0:
        raise ValueError("count_optimizer_steps needs a finite `max_epochs` or `max_steps`")
    if batches_per_epoch <= 0:
        return 0, 0
    steps = samples = epoch = 0
    while (max_epochs < 0 or epoch < max_epochs) and (max_steps < 0 or steps < max_steps):
        _, epoch_steps, epoch_samples = run_epoch(
            schedule, batches_per_epoch, epoch, 0, steps, samples, max_steps, samples_per_micro_step
        )
        steps, samples, epoch = steps + epoch_steps, samples + epoch_samples, epoch + 1
    return steps, samples


@dataclass(frozen=True)
class Budget:
    """Where a loop stops: after the window that reaches its optimizer steps, samples or tokens, whichever comes first.

    Samples and tokens are all ranks' together, over the whole run; ``None``: no bound on that count.

    Example::

        >>> budget = Budget.checked(max_steps=None, max_samples=None, max_tokens=1000, counts_tokens=True)
        >>> budget.spent(steps=3, samples=96, tokens=999), budget.spent(steps=4, samples=128, tokens=1012)
        (False, True)
    """

    steps: int | None = None
    samples: int | None = None
    tokens: int | None = None

    @classmethod
    def checked(cls, max_steps: object, max_samples: object, max_tokens: object, counts_tokens: bool) -> Budget:
        """The budget of these arguments, each checked (an integer >= 0, or None) and named if wrong.

        Raises:
            TypeError, ValueError: If an argument is not an integer >= 0 or None; if ``max_tokens`` is given where no
                tokens are counted (``counts_tokens``: the run counts them, ``unit="token"``).
        """
        if max_tokens is not None and not counts_tokens:
            raise ValueError(
                f"`max_tokens={max_tokens!r}` stops at the loss-bearing tokens the run counts, and this one counts"
                " none: give the Accumulator unit='token' (a token-keyed schedule, `scheduling={0: factor}` for a"
                " fixed one), or use `max_samples`"
            )
        steps, samples, tokens = (
            None if value is None else check_int(name, value, minimum=0)
            for name, value in (("max_steps", max_steps), ("max_samples", max_samples), ("max_tokens", max_tokens))
        )
        return cls(steps, samples, tokens)

    def check_counted(self, samples_per_micro_step: int) -> None:
        """Refuse a sample budget where the samples are not counted (the micro-batch size is unknown).

        Raises:
            ValueError: If ``samples`` is set and ``samples_per_micro_step`` is 0: the budget would never be reached.
        """
        if self.samples is not None and not samples_per_micro_step:
            raise ValueError(
                f"`max_samples={self.samples}` counts samples as micro-batch x ranks, but the micro-batch size could"
                " not be read from the iterable (it has no `batch_size`): pass `micro_batch_size` to the Accumulator"
            )

    def spent(self, steps: int, samples: int, tokens: int) -> bool:
        """Whether the run has reached any of its bounds."""
        pairs = ((self.steps, steps), (self.samples, samples), (self.tokens, tokens))
        return any(limit is not None and count >= limit for limit, count in pairs)
