"""Exact gradient accumulation for Lightning Fabric loops: :class:`Accumulator`, a second shell over the core.

``from lightning_accum.fabric import Accumulator`` gives a hand-written Fabric loop (litgpt's ``finetune`` and
``pretrain`` scripts) what :class:`~lightning_accum.AccumulationScheduler` and the accumulation strategies give the
Trainer; see ``docs/fabric.md``.
"""

from lightning_accum.fabric.accumulator import Accumulator, MicroStep
from lightning_accum.fabric.deepspeed import DeepSpeedAccumulationStrategy

__all__ = ["Accumulator", "DeepSpeedAccumulationStrategy", "MicroStep"]
