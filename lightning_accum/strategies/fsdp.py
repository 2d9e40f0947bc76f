"""FSDPAccumulationStrategy: Lightning's FSDPStrategy (FSDP1) with the accumulation mixin."""

from __future__ import annotations

from lightning.pytorch.strategies import FSDPStrategy

from lightning_accum.strategies.mixin import AccumulationStrategyMixin


class FSDPAccumulationStrategy(AccumulationStrategyMixin, FSDPStrategy):
    """``FSDPStrategy`` (FSDP1) with a choice between one reduce-scatter per window and sharded gradient memory.

    ``gradient_sync="last"`` skips the reduce-scatter on non-final micro-steps (``no_sync``; each rank keeps the
    unsharded gradients until the window ends); ``"every"`` reduce-scatters every micro-step so that each rank keeps
    only its shard, as Accelerate's ``sync_each_batch``. Takes every argument of Lightning's ``FSDPStrategy``.

    Example::

        Trainer(accelerator="cuda", devices=8, strategy=FSDPAccumulationStrategy(gradient_sync="every"),
                callbacks=[AccumulationScheduler(target_batch_size=1024)])
    """
