"""DeepSpeedAccumulationStrategy: DeepSpeed ZeRO 1-3 with the accumulation windows the callback decides.

Stock Lightning copies ``accumulate_grad_batches`` once into DeepSpeed's ``gradient_accumulation_steps`` and lets
DeepSpeed count micro-steps (``handles_gradient_accumulation``), so a run gets one fixed factor, and each loss is
divided twice: by Lightning's automatic loop and again by ``DeepSpeedEngine.backward``. This strategy uses DeepSpeed's
*unmanaged* accumulation instead (``managed_gradient_accumulation: false``, ``gradient_accumulation_steps: 1``):
``engine.backward`` only accumulates, and every ``engine.step()`` is one optimizer step over however many micro-batches
came before it. Lightning's loop (routed to the :class:`~lightning_accum.AccumulationScheduler`'s windows) decides
where a window ends, as for every other strategy, and divides each loss once, by the window's size.

Unmanaged accumulation keeps DeepSpeed's own machinery right: its loss scaler, gradient clipping and bf16/fp16
handling run once per optimizer step on the window's gradient, ``global_steps`` counts optimizer steps (it equals
Lightning's ``global_step``), ``global_samples`` counts the micro-batches really backpropagated, and an LR scheduler
DeepSpeed owns steps once per optimizer step. The boundary API (``set_gradient_accumulation_boundary``) was not
chosen: with it DeepSpeed still divides by a fixed ``gradient_accumulation_steps`` and adds a fixed
``train_batch_size`` to ``global_samples`` whatever the window's size.

On CPU (for testing, with gloo) the three checks Lightning's ``DeepSpeedStrategy`` makes for CUDA are skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from lightning.pytorch.strategies import DeepSpeedStrategy
from torch.optim import Optimizer

from lightning_accum.compat.lightning import trainer_names
from lightning_accum.distributed.zero import (
    FoldedScale,
    config_stage,
    drop_window,
    initialize_on_rank,
    unmanaged_config,
    updating_optimizer,
)

__all__ = ["DeepSpeedAccumulationMixin", "DeepSpeedAccumulationStrategy", "updating_optimizer", "zero_stage"]


class _DeepSpeedOnCPU:
    """Lightning's ``DeepSpeedStrategy`` (mixed in before it) without its three refusals of CPU, for tests.

    Lightning checks for a CUDA accelerator in ``setup_environment`` and for CUDA device indices in
    ``setup_distributed``, and passes ``root_device.index`` (None on CPU) as DeepSpeed's ``device_rank``; on CUDA
    nothing changes. DeepSpeed runs on CPU with gloo. Lightning's names come from the strategy's own namespace.
    """

    def setup_environment(self) -> None:
        """Lightning's set-up, without its refusal of CPU (DeepSpeed runs on CPU with gloo, for testing)."""
        strategy: Any = self
        names = trainer_names(self)
        if isinstance(strategy.accelerator, names.CUDAAccelerator):
            super().setup_environment()  # type: ignore[misc]
        else:
            names.DDPStrategy.setup_environment(strategy)

    def setup_distributed(self) -> None:
        """Lightning's set-up; on CPU without its check that devices are CUDA indices."""
        strategy: Any = self
        names = trainer_names(self)
        if isinstance(strategy.accelerator, names.CUDAAccelerator):
            super().setup_distributed()  # type: ignore[misc]
            return
        names.reset_seed()
        strategy.set_world_ranks()
        strategy._init_deepspeed_distributed()

    def _setup_model_and_optimizer(
        self, model: torch.nn.Module, optimizer: Optimizer | None, lr_scheduler: Any = None
    ) -> tuple[Any, Any]:
        with self._device_rank():
            return super()._setup_model_and_optimizer(model, optimizer, lr_scheduler)  # type: ignore[misc]

    def _initialize_deepspeed_inference(self, model: torch.nn.Module) -> None:
        with self._device_rank():
            super()._initialize_deepspeed_inference(model)  # type: ignore[misc]

    def _device_rank(self) -> AbstractContextManager:
        """On CPU, give ``deepspeed.initialize`` the local rank where Lightning passes ``root_device.index`` (None)."""
        strategy: Any = self
        return initialize_on_rank(strategy.local_rank if strategy.root_device.index is None else None)


class DeepSpeedAccumulationMixin(_DeepSpeedOnCPU):
    """What :class:`DeepSpeedAccumulationStrategy` adds to a Lightning ``DeepSpeedStrategy``, for either namespace.

    Mixed in before ``lightning.pytorch``'s ``DeepSpeedStrategy`` it is :class:`DeepSpeedAccumulationStrategy`;
    before ``pytorch_lightning``'s, :class:`lightning_accum.pytorch_lightning.DeepSpeedAccumulationStrategy`.
    """

    _scale: FoldedScale  # the window's scale, for the step in progress

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        strategy: Any = self
        strategy.config = unmanaged_config(  # Lightning keeps the user's dict, and changes it: a copy
            strategy.config,
            overlap_asked="config" in kwargs or bool(kwargs.get("overlap_comm")),
            owner=f"with {trainer_names(self).home}.DeepSpeedAccumulationStrategy the AccumulationScheduler",
            arguments="AccumulationScheduler",
        )
        self._scale = FoldedScale()  # the window's scale, for the step in progress

    @property
    def handles_gradient_accumulation(self) -> bool:
        """``False``: Lightning's loop (and so the ``AccumulationScheduler``) decides where windows end."""
        return False

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage of the DeepSpeed config (0 without ``zero_optimization``)."""
        strategy: Any = self
        return zero_stage(strategy)

    def _format_batch_size_and_grad_accum_config(self) -> None:
        super()._format_batch_size_and_grad_accum_config()  # type: ignore[misc]  # one step per step()
        strategy: Any = self
        assert strategy.config is not None, "__init__ set it"
        strategy.config["gradient_accumulation_steps"] = 1

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Nothing to block: unmanaged accumulation reduces in ``step()`` (stages 0-1) or per backward (stages 2-3).

        Lightning's own version enters ``DeepSpeedEngine.no_sync()``, which ZeRO stages 2 and 3 refuse.
        """
        yield

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Backpropagate through DeepSpeed, which accumulates without dividing (the loop divided the loss once)."""
        return super().backward(closure_loss, optimizer, *args, scale_wrt_gas=False, **kwargs)  # type: ignore[misc]

    def scale_window_gradients(self, optimizer: Any, scale: float) -> None:
        """Multiply the window's gradient by ``scale`` in the optimizer step about to run, before DeepSpeed clips it.

        ZeRO's optimizers divide the gradient by their loss scale just before clipping and the update, so the scale
        is folded into that divisor for this step only (and any change DeepSpeed's dynamic scaler makes is kept).
        Without ZeRO, the local gradients are scaled before DeepSpeed all-reduces them.

        Raises:
            ValueError: If the optimizer's loss scale is one DeepSpeed does not let the caller set.
        """
        module = getattr(self, "lightning_module", None)
        assert module is not None, "set up before the first step"
        self._scale.fold(optimizer, scale, module.parameters())

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """DeepSpeed's step, with the optimizer's loss scale given back after it."""
        with self._scale.step():
            return super().optimizer_step(optimizer, closure, model, **kwargs)  # type: ignore[misc]

    def drop_unreduced_gradients(self) -> None:
        """Forget the gradient of a window abandoned before its end (an epoch cut short, a fit that raised).

        Under ZeRO stage 2 DeepSpeed keeps each backward's reduced gradient in its partitions until ``step()``, and
        ``zero_grad`` does not reach them: they are dropped as DeepSpeed drops them itself after an overflow.
        """
        optimizers = getattr(self, "optimizers", None)
        if optimizers:
            drop_window(optimizers[0])


class DeepSpeedAccumulationStrategy(DeepSpeedAccumulationMixin, DeepSpeedStrategy):
    """``DeepSpeedStrategy`` whose optimizer steps fall where the ``AccumulationScheduler``'s windows end.

    Takes every argument of Lightning's ``DeepSpeedStrategy`` (``stage``, ``config``, offloading, ...). The callback
    owns the accumulation: a DeepSpeed config must not set ``gradient_accumulation_steps`` or ``train_batch_size``
    (give ``AccumulationScheduler`` a ``scheduling`` or a ``target_batch_size``). ZeRO stages 1-3 are supported;
    under stages 0 and 1 ``overlap_comm`` is off (DeepSpeed's unmanaged accumulation reduces those stages' gradients
    in ``step()``, where there is no backward to overlap with). Without an ``AccumulationScheduler`` it accumulates as
    ``Trainer(accumulate_grad_batches=k)`` says, dividing each loss once.

    Raises:
        ValueError: If the DeepSpeed config sets ``gradient_accumulation_steps`` or ``train_batch_size``, or turns
            ``managed_gradient_accumulation`` on, or asks for ``overlap_comm`` under ZeRO stage 0 or 1.

    Example::

        Trainer(devices=8, precision="bf16-mixed", strategy=DeepSpeedAccumulationStrategy(stage=2),
                callbacks=[AccumulationScheduler(target_batch_size=1024, normalize_by="token")])

    In YAML::

        trainer:
          strategy:
            class_path: lightning_accum.DeepSpeedAccumulationStrategy
            init_args: {stage: 3, offload_optimizer: true}
    """


def zero_stage(strategy: DeepSpeedStrategy) -> int:
    """The ZeRO stage of a DeepSpeed strategy's config (0 without ``zero_optimization``)."""
    return config_stage(strategy.config)
