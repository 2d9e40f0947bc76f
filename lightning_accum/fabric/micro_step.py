"""MicroStep: one micro-batch of a Fabric loop's window, as ``Accumulator.micro_step`` yields it.

And its backward's checks: once, inside its block, of the micro-batch's mean loss (or its sum, divided here).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch


class MicroStep:
    """One micro-batch of a window: its place, and the backward that gives it its exact share of the window's loss.

    Attributes:
        index: The micro-batch's position in its window, from 0.
        size: Micro-batches the window holds (its last, short window: what was left of the epoch; a window of one
            loader batch the noise scale measures in halves: 2).
    """

    def __init__(self, backward: Callable[[MicroStep, torch.Tensor, str], None], index: int, size: int) -> None:
        self._backward = backward  # the Accumulator's, which checks the call and runs it through fabric.backward
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
        self._backward(self, loss, reduction)


def check_backward(inside: bool, again: bool) -> None:
    """Refuse ``micro.backward`` outside its block (not ``inside``), or a second time in it (``again``)."""
    if not inside or again:
        where = "outside its `micro_step` block" if not inside else "twice in one `micro_step`"
        raise RuntimeError(
            f"micro.backward(loss) was called {where}: call it once, inside `with accumulator.micro_step(batch) as"
            " micro:`"
        )


def as_mean(loss: torch.Tensor, reduction: str, items: Any) -> torch.Tensor:
    """The micro-batch's mean loss: ``loss`` itself, or its sum over the micro-batch's ``items`` divided by them.

    A micro-batch without items weighs 0 (where ``items`` is a tensor): its mean, maybe ``0 / 0``, becomes 0.

    Example::

        >>> float(as_mean(torch.tensor(6.0), "sum", 3))
        2.0

    Raises:
        ValueError: If ``reduction`` is unknown, or ``"sum"`` where no items are counted.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"`reduction` must be 'mean' or 'sum', got {reduction!r}")
    if reduction == "sum":
        if items is None:
            raise ValueError(
                "micro.backward(loss, reduction='sum') divides by the micro-batch's items: set"
                " normalize_by='sample' or 'token' (or count_items) on the Accumulator"
            )
        loss = loss / (items.clamp(min=1) if isinstance(items, torch.Tensor) else max(items, 1.0))
    if isinstance(items, torch.Tensor):
        loss = torch.where(items > 0, loss, torch.zeros_like(loss))
    return loss
