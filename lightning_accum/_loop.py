"""Route Lightning's two accumulation decisions to the window.

Lightning 2.6 decides *where a window ends* in ``_TrainingEpochLoop._should_accumulate``
(``batch_progress.current.ready % trainer.accumulate_grad_batches``, or the epoch's last batch) and *where gradients
are zeroed* in ``_AutomaticOptimization._make_zero_grad_fn`` (``batch_idx % trainer.accumulate_grad_batches``). The
two agree only while the factor is constant from the start of the epoch: a change in the middle of an epoch skips a
``zero_grad`` or zeroes half a window. No public hook lets a callback make either decision, so while the callback is
attached these two bound methods are shadowed on the Trainer's own loop instances and restored afterwards. The
divisor Lightning applies to each loss stays ``trainer.accumulate_grad_batches``, which the callback sets to the
window's size. ``tests/test_lightning_contract.py`` fails if this private behaviour changes.

This module owns only that routing: it never decides a boundary itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl

_SHADOWED = (("epoch_loop", "_should_accumulate"), ("automatic_optimization", "_make_zero_grad_fn"))


class LoopControl:
    """Make the Trainer's fit loop step and zero gradients where the window says.

    Args:
        trainer: The Trainer whose loops to route.
        starts_window: Whether the micro-step in progress opened a window.
        ends_window: Whether the micro-step in progress (or, between micro-steps, the last one) ended a window.
    """

    def __init__(self, trainer: pl.Trainer, starts_window: Callable[[], bool], ends_window: Callable[[], bool]) -> None:
        self._trainer = trainer
        self._starts_window = starts_window
        self._ends_window = ends_window
        self._targets: list[Any] = []

    def install(self) -> None:
        """Shadow the two decisions on the Trainer's loop instances.

        Raises:
            RuntimeError: If this Lightning version no longer has the methods that are routed.
        """
        epoch_loop = self._trainer.fit_loop.epoch_loop
        owners = {"epoch_loop": epoch_loop, "automatic_optimization": epoch_loop.automatic_optimization}
        for owner, name in _SHADOWED:
            if not callable(getattr(type(owners[owner]), name, None)):
                raise RuntimeError(
                    f"lightning_accum routes `{type(owners[owner]).__name__}.{name}`, which lightning"
                    f" {pl.__version__} does not have: install a lightning version within the range that"
                    " lightning_accum pins"
                )
        optimization: Any = owners["automatic_optimization"]
        lightning_zero_grad_fn = optimization._make_zero_grad_fn

        progress: Any = epoch_loop.batch_progress.current

        def should_accumulate() -> bool:
            # a batch that never started (on_train_batch_start returned -1) must not step the LR schedulers
            return progress.started < progress.ready or not self._ends_window()

        def make_zero_grad_fn(batch_idx: int, optimizer: Any) -> Any:
            if not self._starts_window():
                return None
            # Lightning's own builder keeps its hooks and progress counters; with a divisor of 1 it never skips.
            trainer = self._trainer
            divisor, trainer.accumulate_grad_batches = trainer.accumulate_grad_batches, 1
            try:
                return lightning_zero_grad_fn(batch_idx, optimizer)
            finally:
                trainer.accumulate_grad_batches = divisor

        epoch_loop._should_accumulate = should_accumulate  # type: ignore[method-assign]
        optimization._make_zero_grad_fn = make_zero_grad_fn
        self._targets = [(epoch_loop, "_should_accumulate"), (optimization, "_make_zero_grad_fn")]

    def remove(self) -> None:
        """Give the decisions back to Lightning; safe to call more than once."""
        for owner, name in self._targets:
            owner.__dict__.pop(name, None)
        self._targets = []
