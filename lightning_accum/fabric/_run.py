"""FabricRun: the features' read-only view of a Lightning Fabric loop, and the actions they may ask of it.

The Fabric shell's counterpart of ``lightning_accum.trainer._run.TrainerRun``: the features
(:mod:`lightning_accum.features`) see a Fabric run through the same :class:`~lightning_accum.core.events.Run` interface
as a Trainer's. What Fabric has no notion of (LR schedulers it steps, a progress bar) answers as the base class does.

Lightning glue: it reads the Fabric's strategy, its loggers and its precision plugin; the model's data-parallel
wrapper is the module Fabric's strategy wrapped (``_FabricModule._forward_module``, pinned by
``tests/test_fabric_sync.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_accum.compat.lightning import fabric_names
from lightning_accum.core.events import DataParallel, Run
from lightning_accum.distributed.sync import fsdp2_modules
from lightning_accum.distributed.zero import config_stage


class FabricRun(Run):
    """What the features may know of a Fabric loop and ask of it.

    Args:
        fabric: The run's Fabric.
        forward_module: The module Fabric's strategy wrapped the model in (``DistributedDataParallel``, FSDP1's
            wrapper, the module itself under FSDP2, a ``DeepSpeedEngine``).
        gradient_sync: The accumulator's policy for non-final micro-steps.
        log_every_n_steps: Optimizer steps between two logged steps.
        epoch: Returns the epoch in progress (calls of ``Accumulator.batches``).
        batches_per_epoch: Returns the loader's length in the epoch in progress (``inf`` when unknown).
        max_steps: Returns the ``max_steps`` of the epoch in progress (``-1``: none).
        lr_schedulers: ``(scheduler, interval, frequency)`` of the schedulers the features move (the Accumulator's
            ``lr_scheduler``).
    """

    def __init__(
        self,
        fabric: Fabric,
        forward_module: nn.Module,
        gradient_sync: str,
        log_every_n_steps: int,
        epoch: Callable[[], int],
        batches_per_epoch: Callable[[], float],
        max_steps: Callable[[], int],
        lr_schedulers: list[tuple[Any, str, int]] | None = None,
    ) -> None:
        self._fabric = fabric
        self._forward = forward_module
        self._gradient_sync = gradient_sync
        self._log_every = log_every_n_steps
        self._epoch, self._batches, self._max_steps = epoch, batches_per_epoch, max_steps
        self._lr_schedulers = lr_schedulers or []

    @property
    def owner(self) -> str:  # noqa: D102 (Run's)
        return "Accumulator"

    @property
    def names(self) -> Any:  # noqa: D102
        return fabric_names(self._fabric)

    @property
    def epoch(self) -> int:  # noqa: D102 (Run's)
        return self._epoch()

    @property
    def batches_per_epoch(self) -> float:  # noqa: D102
        return self._batches()

    @property
    def max_steps(self) -> int:  # noqa: D102
        return self._max_steps()

    @property
    def log_every_n_steps(self) -> int:  # noqa: D102
        return self._log_every

    @property
    def lr_schedulers(self) -> list[tuple[Any, str, int]]:  # noqa: D102
        return self._lr_schedulers

    @property
    def loggers(self) -> list[Any]:  # noqa: D102
        # Fabric's own loggers: the metrics feature logs through each (on rank zero), and writes the dashboard's
        # Custom Scalars layout and the summary to a TensorBoardLogger among them, as under the Trainer
        return list(self._fabric.loggers)

    @property
    def data_parallel(self) -> DataParallel:  # noqa: D102
        names = fabric_names(self._fabric)
        return DataParallel(
            wrapper=wrapper_of(self._fabric, self._forward),
            strategy=type(self._fabric.strategy).__name__,
            gradient_sync=self._gradient_sync,
            static_graph=bool(getattr(self._forward, "static_graph", False)),
            shards_parameters=isinstance(self._fabric.strategy, (names.FSDPStrategy, names.ModelParallelStrategy)),
            zero_stage=config_stage(getattr(self._fabric.strategy, "config", None))
            if isinstance(self._fabric.strategy, names.DeepSpeedStrategy)
            else None,
        )

    def loss_scale(self) -> float | None:  # noqa: D102
        scaler = getattr(self._fabric.strategy.precision, "scaler", None)
        return float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else None

    def print(self, text: str) -> None:  # noqa: D102
        self._fabric.print(text)  # rank zero only

    def reduce_gradients_elsewhere(self, elsewhere: bool) -> None:  # noqa: D102
        from torch.nn.parallel import DistributedDataParallel

        if isinstance(self._forward, DistributedDataParallel):
            self._forward.require_backward_grad_sync = not elsewhere

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:  # noqa: D102
        torch.distributed.all_reduce(tensor, group=getattr(self._forward, "process_group", None))


def wrapper_of(fabric: Fabric, forward_module: nn.Module) -> str:
    """What reduces the model's gradients under ``fabric``'s strategy (``DataParallel.wrapper``'s values)."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(fabric.strategy, fabric_names(fabric).DeepSpeedStrategy):
        return "deepspeed"
    if isinstance(forward_module, DistributedDataParallel):
        return "ddp"
    if isinstance(forward_module, FullyShardedDataParallel):
        return "fsdp1"
    if fsdp2_modules(forward_module):
        return "fsdp2"
    return "none"
