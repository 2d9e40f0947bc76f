"""What the Accumulator takes of a Fabric run: the model and optimizer it set up, its data-parallel group, a loader.

And where the run's strategy keeps a window's gradient, to scale it or to drop it.

Lightning glue. A model or optimizer that this Fabric did not set up is refused before any weight changes; the module
the strategy wrapped (``DistributedDataParallel``, FSDP1's wrapper, the FSDP2 module, a ``DeepSpeedEngine``) is
Fabric's private ``_FabricModule._forward_module`` and the wrapper's strategy its ``_strategy`` (no public accessor;
``tests/test_fabric_sync.py`` pins both).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch
from lightning.fabric import Fabric

from lightning_accum.compat.lightning import fabric_names, is_fabric
from lightning_accum.core.fit import FitPlan, sampler_ranks
from lightning_accum.core.precision import scale_in_place
from lightning_accum.core.schedule import Schedule, ScheduleSpec
from lightning_accum.distributed.sync import drop_fsdp2_pending_gradients
from lightning_accum.distributed.zero import drop_window, updating_optimizer
from lightning_accum.fabric._ranks import agree_on_loaders
from lightning_accum.fabric.deepspeed import DeepSpeedAccumulationMixin


def set_up_model(fabric: Fabric, model: Any) -> tuple[Any, torch.nn.Module]:
    """The ``_FabricModule`` and the module its strategy wrapped; refuse a model this Fabric did not set up."""
    if not is_fabric(fabric):
        raise TypeError(
            f"`fabric` must be a lightning.fabric.Fabric or a lightning_fabric.Fabric, got {type(fabric).__name__}"
        )
    unwrapped = getattr(model, "_orig_mod", model)  # a model compiled after fabric.setup
    if not fabric_names(fabric).is_wrapped(model) or getattr(unwrapped, "_strategy", None) is not fabric.strategy:
        raise TypeError(
            f"`model` must be the module this Fabric set up (`model, optimizer = fabric.setup(model, optimizer)`),"
            f" got a {type(model).__name__} it did not set up"
        )
    return unwrapped, getattr(unwrapped._forward_module, "_orig_mod", unwrapped._forward_module)


def set_up_optimizer(fabric: Fabric, optimizer: Any) -> tuple[Any, torch.optim.Optimizer]:
    """``(what the strategy steps, the torch optimizer that updates the weights)``; refuse another Fabric's."""
    names = fabric_names(fabric)
    if not names.is_wrapped(optimizer) or getattr(optimizer, "_strategy", None) is not fabric.strategy:
        raise TypeError(
            f"`optimizer` must be the optimizer this Fabric set up (`model, optimizer = fabric.setup(model,"
            f" optimizer)`), got a {type(optimizer).__name__} it did not set up"
        )
    wrapped = optimizer.optimizer
    strategy = fabric.strategy
    if isinstance(strategy, names.DeepSpeedStrategy):
        engine = strategy.model
        managed, steps = engine.managed_gradient_accumulation(), engine.gradient_accumulation_steps()
        if not isinstance(strategy, DeepSpeedAccumulationMixin) or managed or steps != 1:
            raise ValueError(
                f"The DeepSpeed engine of {type(strategy).__name__} accumulates by itself"
                f" (managed_gradient_accumulation={managed}, gradient_accumulation_steps={steps}), so its steps"
                " cannot follow the Accumulator's windows: create the Fabric with"
                f" strategy={names.home}.DeepSpeedAccumulationStrategy(...) (the same arguments)"
            )
    return wrapped, updating_optimizer(wrapped)


def data_parallel(fabric: Fabric) -> tuple[Any, int]:
    """The process group over which gradients and counts are reduced, and its size (tensor-parallel ranks apart)."""
    strategy = fabric.strategy
    if isinstance(strategy, fabric_names(fabric).ModelParallelStrategy):
        mesh = strategy.device_mesh["data_parallel"]
        return mesh.get_group(), mesh.size()
    return None, fabric.world_size


def loader_batch_size(iterable: Any) -> int | None:
    """The loader's ``batch_size`` (a DataLoader, or Fabric's wrapper of one); ``None`` for other iterables."""
    sampler = getattr(iterable, "batch_sampler", None)
    size = getattr(iterable, "batch_size", None) or getattr(sampler, "batch_size", None)
    return size if isinstance(size, int) and size > 0 else None


def scale_window(fabric: Fabric, wrapped: Any, optimizer: torch.optim.Optimizer, scale: float | torch.Tensor) -> None:
    """Multiply the window's gradient by ``scale``: ``.grad``, or under DeepSpeed ZeRO's own buffers."""
    strategy = fabric.strategy
    if isinstance(strategy, DeepSpeedAccumulationMixin):  # ZeRO holds the window's gradient, not `.grad`
        strategy.scale_window_gradients(wrapped, scale)
    else:
        groups = optimizer.param_groups
        scale_in_place([p.grad for group in groups for p in group["params"] if p.grad is not None], scale)


def drop_pending(fabric: Fabric, wrapped: Any, forward_module: torch.nn.Module) -> None:
    """Drop what the strategy kept of a window left before its end for its reduction (ZeRO's, FSDP2's)."""
    if isinstance(fabric.strategy, fabric_names(fabric).DeepSpeedStrategy):
        drop_window(wrapped)
    else:
        drop_fsdp2_pending_gradients(forward_module)


def fit_plan(
    fabric: Fabric, iterable: Any, spec: ScheduleSpec, plan: FitPlan | None, world_size: int, start: tuple[int, int]
) -> FitPlan:
    """The facts of the fit at its first epoch (no ``plan`` yet), or ``plan`` with those of a later epoch's iterable.

    The ranks agree on the micro-batch size and the length of ``iterable`` (:func:`agree_on_loaders`); the schedule is
    built once, at the first epoch, from the size they share on ``world_size`` data-parallel ranks. ``start``: the
    epoch and the optimizer steps the fit starts at.

    Raises:
        ValueError: On every rank, if the ranks' loaders differ in length or in batch size.
    """
    rows, sized = loader_batch_size(iterable), hasattr(iterable, "__len__")
    length = len(iterable) if sized else None
    size = agree_on_loaders(fabric, spec.micro_batch_size or rows, length, given=spec.micro_batch_size)
    batches = math.inf if length is None else float(length)
    if plan is not None:  # a later epoch: its iterable's sizes, the fit's schedule
        return replace(plan, micro_batch_size=size, loader_batch_size=rows, batches_per_epoch=batches)
    epoch, steps = start
    return FitPlan(
        size,
        world_size,
        rows,
        sampler_ranks(fabric.strategy),
        batches,
        schedule=spec.build(size, world_size),
        epoch=epoch,
        optimizer_steps=steps,
        resumed=steps > 0,
        names=fabric_names(fabric),
    )


def plan_epoch(
    iterable: Any, spec: ScheduleSpec, schedule: Schedule | None, micro_batch_size: int | None, world_size: int
) -> tuple[Schedule, int, int]:
    """The run's schedule, the batches of an epoch of ``iterable`` and the samples of a micro-step (all ranks).

    Raises:
        TypeError: If ``iterable`` has no length.
    """
    if not hasattr(iterable, "__len__"):
        raise TypeError(f"Counting steps needs a sized iterable (a DataLoader), got {type(iterable).__name__}")
    size = micro_batch_size or spec.micro_batch_size or loader_batch_size(iterable)
    schedule = schedule or spec.build(size, world_size)
    return schedule, len(iterable), (size or 0) * world_size
