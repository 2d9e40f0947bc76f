"""Where the run is, and where it will end: the Trainer's position in each unit a schedule can be keyed by.

Lightning glue: reads the Trainer (epoch, global step, the train dataloader's ``batch_size``, its limits) for the
coordinator; the arithmetic is :mod:`lightning_accum.schedule`'s.
"""

from __future__ import annotations

import lightning.pytorch as pl
from torch.utils.data import DataLoader

from lightning_accum._lightning import trainer_names
from lightning_accum.events import Context
from lightning_accum.schedule import Schedule, ScheduleSpec, plan_run


def loader_batch_size(trainer: pl.Trainer) -> int | None:
    """The train dataloader's ``batch_size`` (``None`` when it has none, e.g. a loader of ready-made batches)."""
    loader = trainer.train_dataloader
    if not isinstance(loader, DataLoader):
        return None
    size = loader.batch_size or getattr(loader.batch_sampler, "batch_size", None)
    return size if isinstance(size, int) and size > 0 else None


def count_steps(trainer: pl.Trainer, spec: ScheduleSpec, micro_batch_size: int | None) -> int | float:
    """The optimizer steps of the run under ``spec``, from ``micro_batch_size`` (or the loader's, when ``None``)."""
    return plan(trainer, spec, micro_batch_size)[0]


def plan(trainer: pl.Trainer, spec: ScheduleSpec, micro_batch_size: int | None) -> tuple[float, float]:
    """``(optimizer steps, samples of all ranks)`` of the run under ``spec`` (``inf`` where it has no end)."""
    if trainer.max_epochs == -1 and trainer.max_steps == -1:
        return float("inf"), float("inf")
    if trainer.train_dataloader is None:
        trainer.fit_loop.setup_data()
    batches = trainer.num_training_batches
    if batches == float("inf"):
        return (float("inf") if trainer.max_steps == -1 else trainer.max_steps), float("inf")
    if micro_batch_size is None:
        micro_batch_size = spec.micro_batch_size if spec.micro_batch_size is not None else loader_batch_size(trainer)
    return plan_run(
        spec.build(micro_batch_size, trainer.world_size),
        batches_per_epoch=int(batches),
        max_epochs=trainer.max_epochs if trainer.max_epochs is not None else -1,
        max_steps=trainer.max_steps,
        samples_per_micro_step=(micro_batch_size or 0) * trainer.world_size,
    )


def position(trainer: pl.Trainer, samples_seen: int, tokens_seen: int = 0) -> dict[str, int]:
    """Where the run is, in each unit a schedule can be keyed by."""
    return {"epoch": trainer.current_epoch, "step": trainer.global_step, "sample": samples_seen, "token": tokens_seen}


def scheduled_factor(trainer: pl.Trainer, schedule: Schedule | None, ctx: Context) -> int:
    """The factor ``schedule`` gives at the run's position (epoch, optimizer step, or ``ctx``'s samples or tokens)."""
    assert schedule is not None, "on_train_start builds the schedule"
    return schedule.factor_at(position(trainer, ctx.samples_seen, ctx.tokens_seen)[schedule.unit])


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
