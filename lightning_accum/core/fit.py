"""The fit's plan: the facts of a fit, found once at its start by the shell that runs it, read by everything else.

A shell (the Trainer's :class:`~lightning_accum.AccumulationScheduler` at ``on_train_start``, the Fabric
:class:`~lightning_accum.fabric.Accumulator` at its loop's first :meth:`~lightning_accum.fabric.Accumulator.batches`)
reads its run once: the micro-batch size the ranks agreed on, the ranks, the loader's batches per epoch, the schedule
built from them, the steps and samples the fit plans, and where it starts. It hands the :class:`FitPlan` to the
:class:`~lightning_accum.core.events.Context` (``ctx.plan``), where the window events, the features and the checks
read it; nobody asks the Trainer or the Fabric for these facts again.

Pure: no Lightning import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lightning_accum.core.schedule import Schedule


@dataclass(frozen=True)
class FitPlan:
    """What a fit is: its sizes, its schedule, its length and where it starts. Frozen: built once, then read.

    The defaults describe a fit of one process that knows nothing yet (a feature's own tests, before the fit starts).

    Attributes:
        micro_batch_size: Samples in a rank's micro-batch, the same on every rank (the ranks agreed on it before the
            plan was made), or ``None`` when unknown (a loader without ``batch_size``).
        world_size: The data-parallel ranks the schedule was built for (``ctx.world_size``, known from ``SETUP``).
        loader_batch_size: Rows in a loader batch (``None``: unknown); above ``micro_batch_size`` when ``splitting``.
        data_ranks: ``(ranks, rank)`` among which the loader's sampler deals its samples (a ``DistributedSampler``'s
            ``num_replicas`` and ``rank``; tensor-parallel ranks share one share).
        batches_per_epoch: Loader batches of an epoch on one rank, ``inf`` when unknown or endless. The Trainer may
            reload its loaders later; the window reads the loop's own count each time it opens.
        splitting: Whether each loader batch is split into micro-batches of ``micro_batch_size`` rows (a fixed size
            below the loader's): a window of one loader batch still runs several backwards. ``"auto"``, which cuts a
            batch only after an out-of-memory error, is not splitting here.
        schedule: The factor at each position, built from ``micro_batch_size`` and ``world_size``.
        planned_steps: The optimizer steps the fit takes at the factors known up front (``inf`` without an end).
        planned_samples: The samples (all ranks) it consumes at those factors (``inf`` likewise).
        epoch: The epoch the fit starts in.
        optimizer_steps: The optimizer steps taken before the fit starts (a resumed run's).
        resumed: Whether the fit resumes a run (the Trainer: a checkpoint, or optimizer steps already taken; Fabric:
            optimizer steps already taken): what a new run learns afresh, a resumed one keeps.
        counted: ``(micro-steps, samples)`` of a resumed checkpoint that holds no state of lightning_accum's, counted
            from the loop's own batches; ``None`` otherwise.
        names: The Lightning names of the fit's namespace (:mod:`lightning_accum.compat.lightning`), or ``None``.

    Example::

        >>> plan = FitPlan(micro_batch_size=8, world_size=2, schedule=Schedule.constant(4))
        >>> plan.schedule.factor_at(0), plan.planned_steps
        (4, inf)
    """

    micro_batch_size: int | None = None
    world_size: int = 1
    loader_batch_size: int | None = None
    data_ranks: tuple[int, int] = (1, 0)
    batches_per_epoch: float = math.inf
    splitting: bool = False
    schedule: Schedule | None = None
    planned_steps: float = math.inf
    planned_samples: float = math.inf
    epoch: int = 0
    optimizer_steps: int = 0
    resumed: bool = False
    counted: tuple[int, int] | None = None
    names: Any = None


def sampler_ranks(strategy: Any) -> tuple[int, int]:
    """``(ranks, rank)`` among which ``strategy`` deals a loader's samples (its ``distributed_sampler_kwargs``)."""
    kwargs = getattr(strategy, "distributed_sampler_kwargs", None) or {}
    return int(kwargs.get("num_replicas", 1)), int(kwargs.get("rank", 0))
