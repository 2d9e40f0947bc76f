"""The Lightning namespace of the object in hand: ``lightning``, or the standalone ``pytorch_lightning`` and co.

``pip install lightning`` puts three packages in an environment: ``lightning`` (``lightning.pytorch``,
``lightning.fabric``) and the standalone ``pytorch_lightning`` and ``lightning_fabric``. They hold the same code
under separate class hierarchies, so a ``pytorch_lightning.Trainer``'s strategy is no
``lightning.pytorch.strategies.DeepSpeedStrategy`` and ``lightning.pytorch``'s ``is_overridden`` refuses a
``pytorch_lightning.LightningModule``. lightning_accum keeps one source for both: the shells and strategies never
import a Lightning class to test an object against; they ask this module for the names of the namespace the object
in hand comes from (the Trainer, the LightningModule, the strategy, the Fabric) and use those. Classes that must
subclass a namespace's own class (the strategies, the CLI parser, the Fabric DeepSpeed strategy) are mixins over
the namespace's base, with a ready-made class in each namespace: :mod:`lightning_accum` and
:mod:`lightning_accum.fabric` for ``lightning``, :mod:`lightning_accum.pytorch_lightning` and
:mod:`lightning_accum.lightning_fabric` for the standalone packages.

Rank-zero warnings (``rank_zero_warn``) are ``lightning_utilities``' function, which every namespace re-exports: it is
imported once, from anywhere. ``rank_zero_info`` is that package's too, but it logs through a logger that the last
namespace imported sets for all of them; :meth:`TrainerNames.rank_zero_info` logs through the Trainer's own namespace's
(``lightning.pytorch.utilities.rank_zero`` or ``pytorch_lightning.utilities.rank_zero``), whatever else was imported.

A standalone package outside the supported range is refused (``ImportError``) the first time its names are asked for.
"""

from __future__ import annotations

import functools
import logging
from importlib import import_module
from typing import TYPE_CHECKING, Any, ClassVar

from lightning_utilities.core.rank_zero import rank_zero_only

from lightning_accum.compat.versions import check_lightning

if TYPE_CHECKING:
    from collections.abc import Callable

    import lightning.fabric as lf
    import lightning.pytorch as pl
    from lightning.pytorch.trainer.states import TrainerFn

TRAINER_PACKAGES = ("lightning.pytorch", "pytorch_lightning")
FABRIC_PACKAGES = ("lightning.fabric", "lightning_fabric")

# name -> the submodule of the package that defines it
_TRAINER_NAMES = {
    "LearningRateFinder": "callbacks",
    "RichProgressBar": "callbacks",
    "TQDMProgressBar": "callbacks",
    "CUDAAccelerator": "accelerators",
    "DDPStrategy": "strategies",
    "DeepSpeedStrategy": "strategies",
    "FSDPStrategy": "strategies",
    "ModelParallelStrategy": "strategies",
    "ParallelStrategy": "strategies",
    "TrainerFn": "trainer.states",
    "is_overridden": "utilities.model_helpers",
}
_FABRIC_NAMES = {
    "Fabric": "",
    "CUDAAccelerator": "accelerators",
    "DDPStrategy": "strategies",
    "DeepSpeedStrategy": "strategies",
    "FSDPStrategy": "strategies",
    "ModelParallelStrategy": "strategies",
    "TensorBoardLogger": "loggers",
    "is_wrapped": "wrappers",
    "reset_seed": "utilities.seed",
}


class _Names:
    """The names of ``_TABLE`` (name: the submodule that defines it) from one package, and its version."""

    _TABLE: ClassVar[dict[str, str]]
    _HOMES: ClassVar[tuple[str, str]]  # where lightning_accum's classes for the namespace live (named in messages)
    _PACKAGES: ClassVar[tuple[str, str]]

    package: str
    home: str
    version: str

    def __init__(self, package: str) -> None:
        self.package = package
        self.home = self._HOMES[self._PACKAGES.index(package)]
        self.version = import_module(package).__version__
        for name, submodule in self._TABLE.items():
            setattr(self, name, getattr(import_module(f"{package}.{submodule}".rstrip(".")), name))


class TrainerNames(_Names):
    """The names lightning_accum uses from one Trainer package (``lightning.pytorch`` or ``pytorch_lightning``).

    Example::

        names = trainer_names(trainer)
        if isinstance(trainer.strategy, names.DeepSpeedStrategy): ...
    """

    _TABLE = _TRAINER_NAMES
    _HOMES = ("lightning_accum", "lightning_accum.pytorch_lightning")
    _PACKAGES = TRAINER_PACKAGES

    fabric_package: str
    LearningRateFinder: type[pl.callbacks.LearningRateFinder]
    RichProgressBar: type[pl.callbacks.RichProgressBar]
    TQDMProgressBar: type[pl.callbacks.TQDMProgressBar]
    CUDAAccelerator: type[pl.accelerators.CUDAAccelerator]
    DDPStrategy: type[pl.strategies.DDPStrategy]
    DeepSpeedStrategy: type[pl.strategies.DeepSpeedStrategy]
    FSDPStrategy: type[pl.strategies.FSDPStrategy]
    ModelParallelStrategy: type[pl.strategies.ModelParallelStrategy]
    ParallelStrategy: type[pl.strategies.ParallelStrategy]
    TrainerFn: type[TrainerFn]
    is_overridden: Callable[..., bool]
    reset_seed: Callable[[], None]  # from the Fabric package of the same namespace

    def __init__(self, package: str) -> None:
        super().__init__(package)
        self.fabric_package = FABRIC_PACKAGES[TRAINER_PACKAGES.index(package)]
        self.reset_seed = import_module(f"{self.fabric_package}.utilities.seed").reset_seed

    def rank_zero_info(self, text: str) -> None:
        """Log ``text`` at INFO on rank zero, as Lightning's ``rank_zero_info``, through this namespace's logger."""
        if getattr(rank_zero_only, "rank", 0) == 0:
            logging.getLogger(f"{self.package}.utilities.rank_zero").info(text, stacklevel=2)


class FabricNames(_Names):
    """The names lightning_accum uses from one Fabric package (``lightning.fabric`` or ``lightning_fabric``)."""

    _TABLE = _FABRIC_NAMES
    _HOMES = ("lightning_accum.fabric", "lightning_accum.lightning_fabric")
    _PACKAGES = FABRIC_PACKAGES

    Fabric: type[lf.Fabric]
    CUDAAccelerator: type[lf.accelerators.CUDAAccelerator]
    DDPStrategy: type[lf.strategies.DDPStrategy]
    DeepSpeedStrategy: type[lf.strategies.DeepSpeedStrategy]
    FSDPStrategy: type[lf.strategies.FSDPStrategy]
    ModelParallelStrategy: type[lf.strategies.ModelParallelStrategy]
    TensorBoardLogger: type[lf.loggers.TensorBoardLogger]
    is_wrapped: Callable[[Any], bool]
    reset_seed: Callable[[], None]


def _package_of(cls: type, packages: tuple[str, ...]) -> str | None:
    return _package_of_class(cls, packages)  # typed apart: mypy holds a `type` unhashable for functools.cache


@functools.cache
def _package_of_class(cls: Any, packages: tuple[str, ...]) -> str | None:
    for klass in cls.__mro__:
        for package in packages:
            if klass.__module__ == package or klass.__module__.startswith(package + "."):
                return package
    return None


def trainer_package(obj: object) -> str | None:
    """``"lightning.pytorch"`` or ``"pytorch_lightning"``: the Trainer package whose class ``obj`` is an instance of.

    The first class in ``obj``'s MRO that belongs to either decides (a Trainer, a LightningModule, a strategy, a
    callback); ``None`` if none does.
    """
    return _package_of(type(obj), TRAINER_PACKAGES)


def fabric_package(obj: object) -> str | None:
    """``"lightning.fabric"`` or ``"lightning_fabric"``: the Fabric package of ``obj``'s class (``None`` if neither)."""
    return _package_of(type(obj), FABRIC_PACKAGES)


def trainer_names(obj: object = None) -> TrainerNames:
    """The Lightning names of the Trainer package ``obj`` belongs to (``lightning.pytorch`` if it belongs to none).

    Args:
        obj: A Trainer, LightningModule, strategy or callback: the object in hand.

    Raises:
        ImportError: If ``obj`` comes from a standalone ``pytorch_lightning`` outside the supported range.
    """
    return names_of_trainer_package(trainer_package(obj) or TRAINER_PACKAGES[0])


def fabric_names(obj: object = None) -> FabricNames:
    """The Lightning names of the Fabric package ``obj`` (a Fabric or its strategy) belongs to.

    Raises:
        ImportError: If ``obj`` comes from a standalone ``lightning_fabric`` outside the supported range.
    """
    return names_of_fabric_package(fabric_package(obj) or FABRIC_PACKAGES[0])


@functools.cache
def names_of_trainer_package(package: str) -> TrainerNames:
    """The names of ``"lightning.pytorch"`` or ``"pytorch_lightning"`` (its release checked first, if standalone)."""
    if package == "pytorch_lightning":  # before its names are looked up: an old release may lack some
        check_lightning(package, import_module(package).__version__)
    return TrainerNames(package)


@functools.cache
def names_of_fabric_package(package: str) -> FabricNames:
    """The names of ``"lightning.fabric"`` or ``"lightning_fabric"`` (its release checked first, if standalone)."""
    if package == "lightning_fabric":
        check_lightning(package, import_module(package).__version__)
    return FabricNames(package)


def is_fabric(obj: object) -> bool:
    """Whether ``obj`` is a ``Fabric`` of either namespace."""
    package = fabric_package(obj)
    return package is not None and isinstance(obj, names_of_fabric_package(package).Fabric)


def is_tensorboard(logger: object) -> bool:
    """Whether ``logger`` is Lightning's ``TensorBoardLogger`` (a Trainer's or a Fabric's, of either namespace)."""
    package = fabric_package(logger)  # the Trainer's TensorBoardLogger subclasses its namespace's Fabric one
    return package is not None and isinstance(logger, names_of_fabric_package(package).TensorBoardLogger)
