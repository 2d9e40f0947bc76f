"""DDPAccumulationStrategy: Lightning's DDPStrategy with the accumulation mixin."""

from __future__ import annotations

from lightning.pytorch.strategies import DDPStrategy

from lightning_accum.strategies.mixin import AccumulationStrategyMixin


class DDPAccumulationStrategy(AccumulationStrategyMixin, DDPStrategy):
    """``DDPStrategy`` that all-reduces gradients once per optimizer step, at the window ends the callback decides.

    Takes every argument of Lightning's ``DDPStrategy`` plus ``gradient_sync`` (see
    :class:`~lightning_accum.AccumulationStrategyMixin`).

    Example::

        Trainer(devices=2, strategy=DDPAccumulationStrategy(), callbacks=[AccumulationScheduler({0: 4})])

    In YAML::

        trainer:
          strategy:
            class_path: lightning_accum.DDPAccumulationStrategy
            init_args: {gradient_sync: last, find_unused_parameters: false}
    """
