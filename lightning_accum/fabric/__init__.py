"""Exact gradient accumulation for Lightning Fabric loops: :class:`Accumulator`, a second shell over the core.

``from lightning_accum.fabric import Accumulator`` gives a hand-written Fabric loop (litgpt's ``finetune`` and
``pretrain`` scripts) what :class:`~lightning_accum.AccumulationScheduler` and the accumulation strategies give the
Trainer; see ``docs/fabric.md``. The shell builds the fit's plan (:class:`~lightning_accum.core.fit.FitPlan`) at the
loop's first ``batches`` and drives the features through the callback's window events.

May import: Lightning's Fabric package, :mod:`lightning_accum.features`, :mod:`lightning_accum.distributed`,
:mod:`lightning_accum.core` and :mod:`lightning_accum.compat`; never the Trainer's shell
(:mod:`lightning_accum.trainer`, :mod:`lightning_accum.strategies`, ``lightning.pytorch``), and nothing outside this
folder imports it but the entry points.
"""

from lightning_accum.fabric.accumulator import Accumulator, MicroStep
from lightning_accum.fabric.deepspeed import DeepSpeedAccumulationStrategy

__all__ = ["Accumulator", "DeepSpeedAccumulationStrategy", "MicroStep"]
