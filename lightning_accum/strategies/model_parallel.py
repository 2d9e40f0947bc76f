"""ModelParallelAccumulationStrategy: Lightning's ModelParallelStrategy (FSDP2, tensor parallel) with the mixin."""

from __future__ import annotations

from lightning.pytorch.strategies import ModelParallelStrategy

from lightning_accum.strategies.mixin import AccumulationStrategyMixin


class ModelParallelAccumulationStrategy(AccumulationStrategyMixin, ModelParallelStrategy):
    """``ModelParallelStrategy`` whose FSDP2 modules reduce-scatter once per window instead of every micro-step.

    Stock ``ModelParallelStrategy`` never tells ``fully_shard`` modules to skip their reduction, so with a factor of
    k they reduce-scatter k times per optimizer step. This class sets ``set_requires_gradient_sync(False)`` on the
    non-final micro-steps (``gradient_sync="last"``), or keeps the reduce-scatters and defers only HSDP's all-reduce
    (``"reduce_scatter"``). Takes every argument of Lightning's
    ``ModelParallelStrategy``; apply ``fully_shard`` in ``configure_model`` as usual.

    Example::

        Trainer(devices=2, strategy=ModelParallelAccumulationStrategy(data_parallel_size=2, tensor_parallel_size=1),
                callbacks=[AccumulationScheduler({0: 4})])
    """
