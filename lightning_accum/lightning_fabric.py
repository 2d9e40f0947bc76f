"""lightning_accum's Fabric shell for the standalone ``lightning_fabric`` package: the same names.

:class:`~lightning_accum.fabric.Accumulator` takes a ``lightning_fabric.Fabric`` as it takes a
``lightning.fabric.Fabric`` (it reads Lightning's names from the Fabric it is given), so it is the same object here.
The one class that subclasses a Fabric class, :class:`DeepSpeedAccumulationStrategy`, is ``lightning_fabric``'s twin
of :class:`lightning_accum.fabric.DeepSpeedAccumulationStrategy`::

    from lightning_fabric import Fabric
    from lightning_accum.lightning_fabric import Accumulator, DeepSpeedAccumulationStrategy

    fabric = Fabric(devices=8, precision="bf16-true", strategy=DeepSpeedAccumulationStrategy(stage=2))

Importing this module refuses a ``lightning_fabric`` release outside the supported range (``ImportError``).
"""

from __future__ import annotations

from lightning_accum.compat.lightning import names_of_fabric_package

names_of_fabric_package("lightning_fabric")  # imports it, and refuses an unsupported release

from lightning_fabric.strategies import DeepSpeedStrategy  # noqa: E402

from lightning_accum.fabric import Accumulator, MicroStep  # noqa: E402
from lightning_accum.fabric.deepspeed import DeepSpeedAccumulationMixin  # noqa: E402


class DeepSpeedAccumulationStrategy(DeepSpeedAccumulationMixin, DeepSpeedStrategy):
    """``lightning_fabric``'s ``DeepSpeedStrategy``, as :class:`lightning_accum.fabric.DeepSpeedAccumulationStrategy`.

    Example::

        fabric = Fabric(devices=8, precision="bf16-true", strategy=DeepSpeedAccumulationStrategy(stage=2))
    """


__all__ = ["Accumulator", "DeepSpeedAccumulationStrategy", "MicroStep"]
