"""lightning_accum for the standalone ``pytorch_lightning`` package: the same names, one import line changed.

``pip install lightning`` installs ``pytorch_lightning`` beside ``lightning.pytorch``; the two hold separate class
hierarchies, and a ``pytorch_lightning.Trainer`` takes only strategies (and LightningCLI only callbacks and parser
classes) of its own. Code written against ``pytorch_lightning`` changes one import line::

    import pytorch_lightning as pl
    from lightning_accum.pytorch_lightning import AccumulationScheduler, DDPAccumulationStrategy

    trainer = pl.Trainer(devices=2, strategy=DDPAccumulationStrategy(), callbacks=[AccumulationScheduler({0: 4})])

Every public name of :mod:`lightning_accum` is here. The classes that subclass a Trainer class are
``pytorch_lightning``'s twins of :mod:`lightning_accum`'s, with the same arguments and behaviour: the four accumulation
strategies, :class:`AccumulationArgumentParser`, and :class:`AccumulationScheduler` (a ``pytorch_lightning``
``Callback`` as well, as LightningCLI's ``trainer.callbacks`` asks). Everything else is the very object
:mod:`lightning_accum` exports: it takes Lightning's names from the Trainer it is attached to
(:mod:`lightning_accum.compat.lightning`), so ``lightning_accum.AccumulationScheduler`` itself also trains under a
``pytorch_lightning.Trainer``. Importing this module refuses a ``pytorch_lightning`` release outside the supported
range (``ImportError``, both versions named).
"""

from __future__ import annotations

from lightning_accum.compat.lightning import names_of_trainer_package

names_of_trainer_package("pytorch_lightning")  # imports it, and refuses an unsupported release

# The twins below join lightning_accum's classes, typed with lightning.pytorch's Trainer, to pytorch_lightning's
# bases, typed with its own: the same classes under two names, which the type checker cannot see (type: ignore).

from pytorch_lightning.callbacks import Callback  # noqa: E402
from pytorch_lightning.cli import LightningArgumentParser  # noqa: E402
from pytorch_lightning.strategies import (  # noqa: E402
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
)

import lightning_accum  # noqa: E402
from lightning_accum import (  # noqa: E402
    AccumulationStrategyMixin,
    ManualAccumulation,
    MicroStep,
    SampleDrivenLR,
    __version__,
    all_gather_with_grad,
    cached,
    estimated_stepping_batches,
)
from lightning_accum.cli import FocusedErrors  # noqa: E402
from lightning_accum.strategies.deepspeed import DeepSpeedAccumulationMixin  # noqa: E402


class AccumulationScheduler(lightning_accum.AccumulationScheduler, Callback):  # type: ignore[misc]  # the namespaces' types differ in name only
    """:class:`lightning_accum.AccumulationScheduler`, a ``pytorch_lightning.Callback`` as well.

    The same arguments and behaviour; needed only where a ``pytorch_lightning`` type is checked (LightningCLI's
    ``trainer.callbacks``): in Python code ``lightning_accum.AccumulationScheduler`` trains a
    ``pytorch_lightning.Trainer`` just as well.

    In YAML::

        trainer:
          callbacks:
            - class_path: lightning_accum.pytorch_lightning.AccumulationScheduler
              init_args: {scheduling: {0: 2, 100: 8}, unit: step}
    """


class DDPAccumulationStrategy(AccumulationStrategyMixin, DDPStrategy):  # type: ignore[misc]  # the namespaces' types differ in name only
    """``pytorch_lightning``'s ``DDPStrategy`` with one all-reduce per optimizer step.

    :class:`lightning_accum.DDPAccumulationStrategy` for a ``pytorch_lightning.Trainer``: the same arguments.

    Example::

        pl.Trainer(devices=2, strategy=DDPAccumulationStrategy(), callbacks=[AccumulationScheduler({0: 4})])
    """


class FSDPAccumulationStrategy(AccumulationStrategyMixin, FSDPStrategy):  # type: ignore[misc]  # the namespaces' types differ in name only
    """``pytorch_lightning``'s ``FSDPStrategy`` (FSDP1), as :class:`lightning_accum.FSDPAccumulationStrategy`.

    Example::

        pl.Trainer(accelerator="cuda", devices=8, strategy=FSDPAccumulationStrategy(gradient_sync="every"))
    """


class ModelParallelAccumulationStrategy(AccumulationStrategyMixin, ModelParallelStrategy):  # type: ignore[misc]  # the namespaces' types differ in name only
    """``pytorch_lightning``'s ``ModelParallelStrategy``, as :class:`lightning_accum.ModelParallelAccumulationStrategy`.

    Example::

        pl.Trainer(devices=2, strategy=ModelParallelAccumulationStrategy(data_parallel_size=2, tensor_parallel_size=1))
    """


class DeepSpeedAccumulationStrategy(DeepSpeedAccumulationMixin, DeepSpeedStrategy):
    """``pytorch_lightning``'s ``DeepSpeedStrategy``, as :class:`lightning_accum.DeepSpeedAccumulationStrategy`.

    Example::

        pl.Trainer(devices=8, precision="bf16-mixed", strategy=DeepSpeedAccumulationStrategy(stage=2))
    """


class AccumulationArgumentParser(FocusedErrors, LightningArgumentParser):
    """``pytorch_lightning``'s LightningCLI parser, as :class:`lightning_accum.cli.AccumulationArgumentParser`.

    Example::

        from pytorch_lightning.cli import LightningCLI

        LightningCLI(MyModel, MyData, parser_class=AccumulationArgumentParser)
    """


# lightning_accum.__all__ and the parser, listed (tests/test_standalone.py holds the two lists together)
__all__ = [
    "AccumulationArgumentParser",
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
