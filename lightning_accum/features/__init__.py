"""The shells' optional features, one module each; :mod:`lightning_accum.core.events` says how they are driven.

A feature never imports another feature module: what one feature needs from another reaches it through the
:class:`~lightning_accum.core.events.Context` (the fit's facts through ``ctx.plan``). Both shells register them, in
dispatch order, in ``AccumulationScheduler.__init__`` and ``Accumulator.__init__``.

May import: :mod:`lightning_accum.distributed`, :mod:`lightning_accum.core` and :mod:`lightning_accum.compat`; never
the Trainer or its internals (a feature sees the run through ``ctx.run``), never a shell.
"""

from lightning_accum.features.adaptive_growth import AdaptiveGrowth
from lightning_accum.features.item_weighting import ItemWeighting
from lightning_accum.features.lr_scaling import LRScaling
from lightning_accum.features.metrics import Metrics
from lightning_accum.features.noise_scale import NoiseScale
from lightning_accum.features.progress_bar import ProgressBar
from lightning_accum.features.sample_driven import SampleDrivenSchedules
from lightning_accum.features.seesaw import Seesaw
from lightning_accum.features.token_count import TokenCount
from lightning_accum.features.wide_accumulation import WideAccumulation

__all__ = [
    "AdaptiveGrowth",
    "ItemWeighting",
    "LRScaling",
    "Metrics",
    "NoiseScale",
    "ProgressBar",
    "SampleDrivenSchedules",
    "Seesaw",
    "TokenCount",
    "WideAccumulation",
]
