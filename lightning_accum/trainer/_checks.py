"""What the coordinator refuses or warns about before the first batch, from the Trainer it is given.

Every check runs on every rank alike (the conditions are the same everywhere), so a refusal never leaves a rank
waiting in a collective. Lightning glue: reads the Trainer, the strategy and the LightningModule; changes nothing.
"""

from __future__ import annotations

import sys
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_accum.compat.lightning import TRAINER_PACKAGES, trainer_names
from lightning_accum.compat.torch import has_fsdp2_mechanics, require_fsdp2
from lightning_accum.core.adaptive import check_needs_noise_scale
from lightning_accum.core.events import takes_dataloader_iter
from lightning_accum.core.fit import FitPlan
from lightning_accum.distributed.sync import fsdp2_modules
from lightning_accum.strategies.mixin import AccumulationStrategyMixin


def check_arguments(adaptive: object, noise_scale: object, micro_batch_size: object) -> None:
    """Refuse arguments that only make sense together, or a ``micro_batch_size`` string other than ``"auto"``."""
    check_needs_noise_scale(adaptive, noise_scale)
    if isinstance(micro_batch_size, str) and micro_batch_size != "auto":
        raise ValueError(f"`micro_batch_size` must be an integer >= 1, 'auto' or None, got {micro_batch_size!r}")


def check_trainer(trainer: pl.Trainer, pl_module: pl.LightningModule, callback: Any, kind: type | None = None) -> None:
    """Raise before the first batch when the Trainer cannot run ``callback`` (an ``AccumulationScheduler``).

    ``kind``: the class whose instances (of either namespace) count as a second accumulation callback; by default
    ``callback``'s own.
    """
    names = trainer_names(trainer)
    if trainer.accumulate_grad_batches != 1:
        raise ValueError(
            f"AccumulationScheduler sets the factor itself: remove `Trainer(accumulate_grad_batches="
            f"{trainer.accumulate_grad_batches})` or give the factor as AccumulationScheduler(scheduling={{0:"
            f" {trainer.accumulate_grad_batches}}})"
        )
    if trainer.strategy.handles_gradient_accumulation:
        instead = (
            f"use {names.home}.DeepSpeedAccumulationStrategy (same arguments)"
            if isinstance(trainer.strategy, names.DeepSpeedStrategy)
            else "use its own accumulation setting instead"
        )
        raise ValueError(
            f"`{type(trainer.strategy).__name__}` accumulates gradients by itself with one fixed factor, so"
            f" AccumulationScheduler cannot control its windows: {instead}"
        )
    if not pl_module.automatic_optimization:
        raise ValueError(
            "AccumulationScheduler drives automatic optimization; with `automatic_optimization = False` call"
            " `manual_backward` and `optimizer.step()` yourself at the window boundaries"
        )
    # Lightning's own accumulation callback, of each namespace loaded (one not imported cannot be attached)
    loaded = (sys.modules.get(f"{package}.callbacks") for package in TRAINER_PACKAGES)
    stock = tuple(module.GradientAccumulationScheduler for module in loaded if module is not None)
    for other in trainer.callbacks:  # type: ignore[attr-defined]
        if other is not callback and isinstance(other, (kind or type(callback), *stock)):
            raise ValueError(
                f"Only one accumulation callback may be attached: found {type(other).__name__} beside this"
                " AccumulationScheduler"
            )
    if (  # below the FSDP2 floor check_fsdp2 refuses the FSDP2 model instead
        isinstance(trainer.strategy, names.ModelParallelStrategy)
        and not isinstance(trainer.strategy, AccumulationStrategyMixin)
        and has_fsdp2_mechanics()
    ):
        rank_zero_warn(
            "AccumulationScheduler: ModelParallelStrategy reduce-scatters FSDP2 gradients on every micro-step;"
            f" use {names.home}.ModelParallelAccumulationStrategy to reduce once per optimizer step"
        )


def check_fsdp2(trainer: pl.Trainer) -> None:
    """Refuse a model with ``fully_shard`` units on a torch older than the FSDP2 mechanics' floor (``on_fit_start``).

    The window's FSDP2 gradients are read and reduced through FSDP2 state that is tested exact only from
    ``lightning_accum.compat.torch.FSDP2_FLOOR`` on.
    """
    if fsdp2_modules(trainer.strategy.model):
        require_fsdp2(
            "AccumulationScheduler on a model with `fully_shard` (FSDP2) units",
            "remove the callback and give stock ModelParallelStrategy `Trainer(accumulate_grad_batches=k)` (FSDP2"
            f" then reduce-scatters on every micro-step), or train the model with {trainer_names(trainer).home}."
            "DDPAccumulationStrategy or FSDPAccumulationStrategy (FSDP1)",
        )


def check_splitting(trainer: pl.Trainer, auto: bool, weighs_items: bool) -> None:
    """Refuse what splitting cannot do (``auto``: ``micro_batch_size="auto"``; ``weighs_items``: item weighting)."""
    if takes_dataloader_iter(trainer.lightning_module):
        raise ValueError(
            "micro_batch_size splits the batch handed to `training_step`, but `training_step(self, dataloader_iter)`"
            " fetches its own: use `training_step(self, batch, batch_idx)` or no micro_batch_size"
        )
    if auto and fsdp2_modules(trainer.strategy.model):
        raise ValueError(
            "micro_batch_size='auto' cannot retry a batch under FSDP2: a rank out of memory would leave the other ranks"
            " waiting in a parameter all-gather. Give an integer micro_batch_size (find it with `lightning-accum plan"
            " --probe`)"
        )
    if auto and trainer.world_size > 1 and weighs_items:
        raise ValueError(
            "micro_batch_size='auto' with normalize_by='sample' or 'token' on several ranks is not supported: the"
            " weighting's first all-reduce would meet another rank's out-of-memory check. Give an integer"
            " micro_batch_size, or normalize_by='micro_batch'"
        )


def warn_at_fit_start(trainer: pl.Trainer, plan: FitPlan, grows: bool, splits: bool = False) -> None:
    """Warn about what the Trainer does under the ``plan``'s schedule; say how many optimizer steps the run takes.

    At most that many where adaptive growth ``grows`` the factor; ``splits``: loader batches are split.
    """
    schedule, module = plan.schedule, trainer.lightning_module
    assert schedule is not None, "the plan holds the schedule"
    if schedule.max_factor > 1 or grows or splits:
        _warn_about_batch_norm(module)
    batches = plan.batches_per_epoch
    if schedule.max_factor > batches:
        rank_zero_warn(
            f"AccumulationScheduler: the schedule reaches factor {schedule.max_factor}, more than an epoch's {batches}"
            f" batches, and a window never spans epochs: such windows hold {batches} micro-batches, and LR scaling"
            " and the logs use that. Use a smaller factor, or more batches per epoch"
        )
    if schedule.max_factor == 1 and not grows:
        return
    steps, is_overridden = plan.planned_steps, trainer_names(module).is_overridden
    overridden = [name for name in ("optimizer_step", "optimizer_zero_grad") if is_overridden(name, module)]
    if overridden:
        hooks = " and ".join(f"`LightningModule.{name}`" for name in overridden)
        rank_zero_warn(
            f"AccumulationScheduler: {hooks} {'is' if len(overridden) == 1 else 'are'} overridden; under"
            " accumulation they run once per optimizer step (once per window of micro-batches), not on every batch"
        )
    if not grows and steps == _stepping_batches(trainer):  # the Trainer's own figure is right (a constant factor)
        return
    plan.names.rank_zero_info(
        f"AccumulationScheduler: this run takes{' at most' if grows else ''} {steps} optimizer steps;"
        " `trainer.estimated_stepping_batches` does not know the schedule: size LR schedules with"
        " `lightning_accum.estimated_stepping_batches(trainer)`."
    )


def _warn_about_batch_norm(module: torch.nn.Module) -> None:
    """BatchNorm layers in training normalize each micro-batch by its own statistics: not what a big batch does."""
    names = [
        name or type(layer).__name__
        for name, layer in module.named_modules()
        if isinstance(layer, _BatchNorm) and not isinstance(layer, torch.nn.SyncBatchNorm) and layer.training
    ]
    if names:
        shown = ", ".join(f"`{name}`" for name in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        rank_zero_warn(
            f"AccumulationScheduler: the model's BatchNorm layers ({shown}) normalize each micro-batch with its own"
            " mean and variance, so a window of several micro-batches does not train as one big batch would"
            " (BatchNorm statistics do not add up). Use micro-batches large enough for stable statistics, GroupNorm or"
            " LayerNorm instead, or freeze the BatchNorm layers (`.eval()` on them in `on_train_epoch_start`)"
        )


def _stepping_batches(trainer: pl.Trainer) -> float | None:
    """``trainer.estimated_stepping_batches``, or ``None`` where Lightning cannot say (it raises for some loaders)."""
    try:
        return float(trainer.estimated_stepping_batches)
    except Exception:  # noqa: BLE001 (Lightning raises MisconfigurationException, ValueError, ...)
        return None
