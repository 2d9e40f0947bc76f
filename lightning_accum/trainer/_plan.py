"""The fit's plan, read from the Trainer: what a micro-batch holds, where the run is and where it will end.

Lightning glue. :func:`fit_plan` reads the Trainer once, at ``on_train_start``, into a
:class:`~lightning_accum.core.fit.FitPlan` (the ranks agree on the micro-batch size there); the arithmetic is
:mod:`lightning_accum.core.schedule`'s. Before the fit starts (``estimated_stepping_batches`` from
``configure_optimizers``, a tuner running the loop) :func:`count_steps` and :func:`factor_before_training` answer from
the Trainer as it stands.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader

from lightning_accum.compat.lightning import trainer_names
from lightning_accum.core.fit import FitPlan, sampler_ranks
from lightning_accum.core.schedule import ScheduleSpec, planned
from lightning_accum.trainer._checks import check_splitting
from lightning_accum.trainer._ranks import agree_on_batches


def fit_plan(
    trainer: pl.Trainer,
    spec: ScheduleSpec,
    size: int | None,
    auto: bool,
    weighs_items: bool,
    restored: bool,
    names: Any,
) -> FitPlan:
    """The facts of this fit, read from ``trainer`` once; the one place the micro-batch size is decided.

    Args:
        trainer: The Trainer at ``on_train_start``.
        spec: The callback's schedule arguments.
        size: The callback's ``micro_batch_size`` (``None``: the loader's; ``"auto"`` starts there too).
        auto: ``micro_batch_size="auto"``.
        weighs_items: Item weighting is on (``normalize_by="sample"`` or ``"token"``).
        restored: The callback's state was loaded from the checkpoint the fit resumes.
        names: The Lightning names of the Trainer's namespace (found at ``setup``: ``TrainerRun.names``).

    Raises:
        ValueError: On every rank, if the ranks disagree on their loaders, or splitting cannot run (naming why).
    """
    loader = loader_batch_size(trainer)
    split = auto or (size is not None and size < (loader or 0))
    given = None if split else spec.micro_batch_size  # with splitting, the loader's batch is what counts
    micro_batch_size = agree_on_batches(trainer, given or loader, given)  # the same on every rank, one schedule
    if split:
        check_splitting(trainer, auto, weighs_items)
    world, batches, step = trainer.world_size, trainer.num_training_batches, trainer.global_step
    schedule, per_micro_step, counted = spec.build(micro_batch_size, world), (micro_batch_size or 0) * world, None
    if trainer.ckpt_path is not None and not restored and step > 0:  # a checkpoint without the callback's state
        done = int(getattr(trainer.fit_loop.epoch_loop.batch_progress.total, "processed", 0))  # a _ProcessedTracker
        counted = (done, done * per_micro_step)  # what the loop has done counts for the schedule
        rank_zero_warn(
            f"AccumulationScheduler: the checkpoint {str(trainer.ckpt_path)!r} holds no AccumulationScheduler state"
            f" (it was written without this callback); counting the {done} micro-batches the loop has done"
            f" ({counted[1]} samples) for the schedule, while the LR-scaling base and warmup, the noise-scale"
            " estimate and adaptive growth start afresh"
        )
    steps, samples = planned(schedule, batches, trainer.max_epochs, trainer.max_steps, per_micro_step)
    return FitPlan(
        micro_batch_size,
        world,
        loader,
        sampler_ranks(trainer.strategy),
        batches,
        splitting=split and not auto,  # "auto" splits only after an out-of-memory error
        schedule=schedule,
        planned_steps=steps,
        planned_samples=samples,
        epoch=trainer.current_epoch,
        optimizer_steps=step,
        resumed=step > 0 or trainer.ckpt_path is not None,
        counted=counted,
        names=names,
    )


def loader_batch_size(trainer: pl.Trainer) -> int | None:
    """The train dataloader's ``batch_size`` (``None`` when it has none, e.g. a loader of ready-made batches)."""
    loader = trainer.train_dataloader
    if not isinstance(loader, DataLoader):
        return None
    size = loader.batch_size or getattr(loader.batch_sampler, "batch_size", None)
    return size if isinstance(size, int) and size > 0 else None


def count_steps(trainer: pl.Trainer, spec: ScheduleSpec) -> int | float:
    """The optimizer steps of the run under ``spec``, before its start: from the loader's micro-batch size."""
    if trainer.max_epochs == -1 and trainer.max_steps == -1:
        return float("inf")
    if trainer.train_dataloader is None:
        trainer.fit_loop.setup_data()
    world, batches = trainer.world_size, trainer.num_training_batches
    if batches == float("inf"):  # no schedule to build: the run ends at max_steps
        return float("inf") if trainer.max_steps == -1 else trainer.max_steps
    size = spec.micro_batch_size if spec.micro_batch_size is not None else loader_batch_size(trainer)
    return planned(spec.build(size, world), batches, trainer.max_epochs, trainer.max_steps, (size or 0) * world)[0]


def position(trainer: pl.Trainer, samples_seen: int, tokens_seen: int = 0) -> dict[str, int]:
    """Where the run is, in each unit a schedule can be keyed by."""
    return {"epoch": trainer.current_epoch, "step": trainer.global_step, "sample": samples_seen, "token": tokens_seen}


def factor_before_training(trainer: pl.Trainer, spec: ScheduleSpec, samples_seen: int) -> int:
    """The first window's factor, for what runs the loop before the windows take charge (a tuner)."""
    factor = spec.factor_before_loading(position(trainer, samples_seen), trainer.world_size)
    if factor is not None:
        return factor
    finder = trainer_names(trainer).LearningRateFinder
    if any(isinstance(callback, finder) for callback in trainer.callbacks):  # type: ignore[attr-defined]
        raise ValueError(
            f"`lr_find` runs before AccumulationScheduler can read the micro-batch size from the train dataloader, so"
            f" it cannot accumulate to `target_batch_size={spec.target_batch_size}`: pass `micro_batch_size` to"
            " AccumulationScheduler"
        )
    return 1  # a batch-size search: its trials measure memory, and the size it finds sets the factor
