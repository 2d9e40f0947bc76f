"""MicroStep: one micro-batch of a Fabric loop's window, as ``Accumulator.micro_step`` yields it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from lightning_accum.fabric.accumulator import Accumulator


class MicroStep:
    """One micro-batch of a window: its place, and the backward that gives it its exact share of the window's loss.

    Attributes:
        index: The micro-batch's position in its window, from 0.
        size: Micro-batches the window holds (its last, short window: what was left of the epoch).
    """

    def __init__(self, accumulator: Accumulator, index: int, size: int) -> None:
        self._accumulator = accumulator
        self.index, self.size = index, size
        self.loss: torch.Tensor | None = None  # the micro-batch's mean loss, detached, once backward ran

    @property
    def should_step(self) -> bool:
        """Whether this micro-batch ends the window: then ``optimizer.step()`` and ``optimizer.zero_grad()``."""
        return self.index == self.size - 1

    def backward(self, loss: torch.Tensor, reduction: Literal["mean", "sum"] = "mean") -> None:
        """Backpropagate this micro-batch's share of the window's loss (through ``fabric.backward``).

        Args:
            loss: The micro-batch's loss: the mean over its own items (``reduction="mean"``, the usual
                ``cross_entropy``), or their sum (``"sum"``, with ``normalize_by="sample"`` or ``"token"``).
            reduction: How ``loss`` was reduced over the micro-batch's items.

        Raises:
            RuntimeError: Outside its ``micro_step`` block, or a second time in it.
            ValueError: If ``reduction`` is unknown, or ``"sum"`` without item counts to divide by.
        """
        self._accumulator._backward(self, loss, reduction)
