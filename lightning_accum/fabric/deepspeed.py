"""DeepSpeedAccumulationStrategy for Fabric: DeepSpeed ZeRO whose every step is one window of the Accumulator.

Fabric's ``DeepSpeedStrategy`` leaves accumulation to DeepSpeed's config: with the default
``gradient_accumulation_steps`` of 1 every backward is a boundary, and a loop that sets it and also divides the loss
gets it divided twice. This strategy configures DeepSpeed's *unmanaged* accumulation
(:func:`lightning_accum.distributed.zero.unmanaged_config`, as the Trainer's
``lightning_accum.DeepSpeedAccumulationStrategy``): ``engine.backward`` only accumulates, and every ``optimizer.step()``
is one optimizer step over the window :class:`~lightning_accum.fabric.Accumulator` decided, whose scale (a window
weighed by its tokens) is folded into ZeRO's loss scale for that step
(:class:`~lightning_accum.distributed.zero.FoldedScale`). Gradient clipping comes from the DeepSpeed config
(``gradient_clipping``), as Fabric refuses ``clip_gradients`` under DeepSpeed.

On CPU (for testing, with gloo) the checks Fabric's ``DeepSpeedStrategy`` makes for CUDA are skipped.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.strategies import DeepSpeedStrategy

from lightning_accum.compat.lightning import fabric_names
from lightning_accum.distributed.zero import FoldedScale, initialize_on_rank, unmanaged_config


class _DeepSpeedOnCPU:
    """Fabric's ``DeepSpeedStrategy`` (mixed in before it) without its refusals of CPU (DeepSpeed runs there with gloo).

    Fabric checks for a CUDA accelerator in ``setup_environment`` and for CUDA device indices in
    ``_setup_distributed``, and passes ``root_device.index`` (None on CPU) as DeepSpeed's ``device_rank``; on CUDA
    nothing changes. Fabric's names come from the strategy's own namespace (``lightning.fabric`` or
    ``lightning_fabric``).
    """

    def setup_environment(self) -> None:
        """Fabric's set-up, without its refusal of CPU."""
        strategy: Any = self
        names = fabric_names(self)
        if isinstance(strategy.accelerator, names.CUDAAccelerator):
            super().setup_environment()  # type: ignore[misc]
        else:
            names.DDPStrategy.setup_environment(strategy)

    def _setup_distributed(self) -> None:
        strategy: Any = self
        names = fabric_names(self)
        if isinstance(strategy.accelerator, names.CUDAAccelerator):
            super()._setup_distributed()  # type: ignore[misc]
            return
        names.reset_seed()
        strategy._set_world_ranks()
        strategy._init_deepspeed_distributed()
        if not strategy._config_initialized:
            strategy._format_config()
            strategy._config_initialized = True

    def _initialize_engine(self, model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        # Lightning 2.6 passes (model, optimizer, scheduler) and takes 3 values back; 2.5 (model, optimizer) and 2
        strategy: Any = self
        with initialize_on_rank(strategy.local_rank if strategy.root_device.index is None else None):
            return super()._initialize_engine(model, *args, **kwargs)  # type: ignore[misc]


class DeepSpeedAccumulationMixin(_DeepSpeedOnCPU):
    """What :class:`DeepSpeedAccumulationStrategy` adds to a Fabric ``DeepSpeedStrategy``, for either namespace.

    Mixed in before ``lightning.fabric``'s ``DeepSpeedStrategy`` it is
    :class:`lightning_accum.fabric.DeepSpeedAccumulationStrategy`; before ``lightning_fabric``'s,
    :class:`lightning_accum.lightning_fabric.DeepSpeedAccumulationStrategy`.
    """

    _scale: FoldedScale  # the window's scale, for the step in progress

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        strategy: Any = self
        strategy.config = unmanaged_config(  # Lightning keeps the user's dict, and changes it: a copy
            strategy.config,
            overlap_asked="config" in kwargs or bool(kwargs.get("overlap_comm")),
            owner=f"with {fabric_names(self).home}.DeepSpeedAccumulationStrategy the Accumulator",
            arguments="Accumulator",
        )
        self._scale = FoldedScale()  # the window's scale, for the step in progress

    def _format_config(self) -> None:
        super()._format_config()  # type: ignore[misc]
        strategy: Any = self
        assert strategy.config is not None, "__init__ set it"
        strategy.config["gradient_accumulation_steps"] = 1

    def scale_window_gradients(self, optimizer: Any, scale: float | torch.Tensor) -> None:
        """Multiply the window's gradient by ``scale`` in the optimizer step about to run, before DeepSpeed clips it."""
        strategy: Any = self
        assert strategy.model is not None, "set up before the first step"
        self._scale.fold(optimizer, scale, strategy.model.module.parameters())

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """The engine's step (Fabric steps ZeRO's optimizer alone), with the loss scale given back after it.

        Under unmanaged accumulation ``engine.step()`` is the window's boundary: it finalizes the gradients the
        backwards accumulated (and reduces them under ZeRO stages 0 and 1) before ZeRO's optimizer steps.
        """
        strategy: Any = self
        with self._scale.step():
            return super().optimizer_step(strategy.model, **kwargs)  # type: ignore[misc]


class DeepSpeedAccumulationStrategy(DeepSpeedAccumulationMixin, DeepSpeedStrategy):
    """Fabric's ``DeepSpeedStrategy`` whose optimizer steps fall where the :class:`Accumulator`'s windows end.

    Takes every argument of Fabric's ``DeepSpeedStrategy`` (``stage``, ``config``, offloading, ...). The Accumulator
    owns the accumulation: a DeepSpeed config must not set ``gradient_accumulation_steps`` or ``train_batch_size``.
    Under ZeRO stages 0 and 1 ``overlap_comm`` is off (unmanaged accumulation reduces those stages' gradients in
    ``step()``).

    Raises:
        ValueError: If the DeepSpeed config sets ``gradient_accumulation_steps`` or ``train_batch_size``, turns
            ``managed_gradient_accumulation`` on, or asks for ``overlap_comm`` under ZeRO stage 0 or 1.

    Example::

        fabric = Fabric(devices=8, precision="bf16-true", strategy=DeepSpeedAccumulationStrategy(stage=2))
        fabric.launch()
        model, optimizer = fabric.setup(model, optimizer)
        accumulator = Accumulator(fabric, model, optimizer, target_batch_size=1024, normalize_by="token")
    """
