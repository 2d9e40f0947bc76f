"""One accumulation window: the micro-steps whose gradients make one optimizer step.

This module owns the bookkeeping of the window in progress: how many micro-steps it was opened for, how many were
taken, whether the last one taken ended it, and the correction that turns the accumulated gradient into the mean
over the micro-steps really taken. It decides nothing about factors (that is the schedule's job) and never touches
the Trainer. Pure: no Lightning import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Window:
    """The accumulation window in progress.

    Lightning divides each micro-batch's loss by ``size`` (the callback sets ``trainer.accumulate_grad_batches`` to
    it), so a window that ends early, at the end of an epoch whose length was unknown, holds ``taken / size`` of the
    mean gradient; :attr:`gradient_correction` restores it.

    Attributes:
        size: Micro-steps the window was opened for: the divisor applied to each loss.
        taken: Micro-steps taken so far.
        closed: Whether the last micro-step taken ended the window (true before the first window opens).

    Example::

        >>> window = Window()
        >>> window.open(size=3)
        >>> window.take(ends_epoch=False); window.is_first, window.closed
        (True, False)
        >>> window.take(ends_epoch=True); window.closed, window.gradient_correction
        (True, 1.5)
    """

    size: int = 0
    taken: int = 0
    closed: bool = True

    def open(self, size: int) -> None:
        """Start a new window of ``size`` micro-steps."""
        if size < 1:
            raise ValueError(f"A window needs at least one micro-step, got size={size}")
        self.size, self.taken, self.closed = size, 0, False

    def take(self, ends_epoch: bool) -> None:
        """Count one micro-step; the window closes when it is full or the epoch ends."""
        self.taken += 1
        self.closed = self.taken >= self.size or ends_epoch

    def discard(self) -> None:
        """Drop an unfinished window (its gradients are zeroed when the next one opens)."""
        self.closed = True

    @property
    def is_first(self) -> bool:
        """Whether the micro-step just taken opened the window (gradients are zeroed before its backward)."""
        return self.taken == 1

    @property
    def gradient_correction(self) -> float:
        """The factor that turns the accumulated gradient into the mean over the micro-steps taken."""
        return self.size / self.taken if self.taken else 1.0

    def state_dict(self) -> dict[str, Any]:
        """The window as a plain dict, for checkpoints."""
        return {"size": self.size, "taken": self.taken, "closed": self.closed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a window saved by :meth:`state_dict`; missing keys keep their defaults."""
        self.size = int(state.get("size", 0))
        self.taken = int(state.get("taken", 0))
        self.closed = bool(state.get("closed", True))
