"""Lightning strategies that reduce gradients once per accumulation window: the mixin, its three classes, DeepSpeed."""

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
