"""The pure cores: the arithmetic and state of accumulation, free of Lightning, each tested without a Trainer.

The schedule (which factor applies where) and the fit's plan (:mod:`~lightning_accum.core.fit`: the facts of a fit,
found once by a shell), the window, item counts, the noise-scale estimator and adaptive growth's test, LR rules and
sample-driven LR schedules, Seesaw's arithmetic, the accumulation dtype, batch splitting, the place in a loader's
samples, the metrics' layout, the planner behind ``lightning-accum plan``, and :mod:`~lightning_accum.core.events`:
the window events, the context they carry and the base class of a feature.

May import: torch and :mod:`lightning_accum.compat`; never Lightning, never another layer of lightning_accum.
"""
