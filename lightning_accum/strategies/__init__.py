"""Lightning strategies that reduce gradients once per accumulation window: the mixin, its three classes, DeepSpeed.

The strategy decides nothing: it asks the window the callback connects (``connect_window``) whether a micro-step ends
it, and with no callback follows ``trainer.accumulate_grad_batches``.

May import: Lightning's Trainer package, :mod:`lightning_accum.distributed`, :mod:`lightning_accum.core` and
:mod:`lightning_accum.compat`; never a shell or a feature.
"""

from lightning_accum.strategies.ddp import DDPAccumulationStrategy
from lightning_accum.strategies.deepspeed import DeepSpeedAccumulationStrategy
from lightning_accum.strategies.fsdp import FSDPAccumulationStrategy
from lightning_accum.strategies.mixin import AccumulationStrategyMixin
from lightning_accum.strategies.model_parallel import ModelParallelAccumulationStrategy

__all__ = [
    "AccumulationStrategyMixin",
    "DDPAccumulationStrategy",
    "DeepSpeedAccumulationStrategy",
    "FSDPAccumulationStrategy",
    "ModelParallelAccumulationStrategy",
]
