"""lightning_accum: exact, scheduled and visible gradient accumulation for PyTorch Lightning."""

from lightning_accum.compat import versions as _versions

_versions.check_installed()  # an unsupported lightning or torch is refused here, not deep inside a fit

from lightning_accum.__about__ import __version__  # noqa: E402
from lightning_accum.core.sample_driven_lr import SampleDrivenLR  # noqa: E402
from lightning_accum.distributed.coupled import all_gather_with_grad, cached  # noqa: E402
from lightning_accum.strategies import (  # noqa: E402
    AccumulationStrategyMixin,
    DDPAccumulationStrategy,
    DeepSpeedAccumulationStrategy,
    FSDPAccumulationStrategy,
    ModelParallelAccumulationStrategy,
)
from lightning_accum.trainer import _instantiate  # noqa: E402
from lightning_accum.trainer.callback import AccumulationScheduler, estimated_stepping_batches  # noqa: E402
from lightning_accum.trainer.manual import ManualAccumulation, MicroStep  # noqa: E402

_instantiate.register(AccumulationScheduler)  # plain LightningCLI: a refused value ends in one line, exit 2

__all__ = [
    "AccumulationScheduler",
    "AccumulationStrategyMixin",
    "DDPAccumulationStrategy",
    "DeepSpeedAccumulationStrategy",
    "FSDPAccumulationStrategy",
    "ManualAccumulation",
    "MicroStep",
    "ModelParallelAccumulationStrategy",
    "SampleDrivenLR",
    "__version__",
    "all_gather_with_grad",
    "cached",
    "estimated_stepping_batches",
]
