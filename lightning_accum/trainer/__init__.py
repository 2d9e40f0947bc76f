"""The Trainer shell: :class:`~lightning_accum.AccumulationScheduler` and the glue that reads and writes the Trainer.

The coordinator (:mod:`~lightning_accum.trainer.callback`) builds the fit's plan at ``on_train_start``
(:mod:`~lightning_accum.trainer._plan`), routes Lightning's loop (``_loop``), splits loader batches (``_microbatch``),
keeps the resume point (``_resume``) and the place in the loader's samples (``_data``), checks the Trainer
(``_checks``), agrees with the other ranks (``_ranks``) and shows the features the run through ``_run.TrainerRun``.
``manual`` is the same windows under manual optimization.

May import: Lightning's Trainer package, :mod:`lightning_accum.strategies`, :mod:`lightning_accum.features`,
:mod:`lightning_accum.distributed`, :mod:`lightning_accum.core` and :mod:`lightning_accum.compat`; never the Fabric
shell.
"""
