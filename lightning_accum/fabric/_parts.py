"""The micro-steps of a Fabric window: its loader batches, each whole or, for the noise scale, in two halves.

A window the noise scale measures at factor 1 on one process holds one loader batch, whose one gradient has nothing to
be compared with. As the Trainer's micro-batcher does (:mod:`lightning_accum.trainer._microbatch`), that batch runs as
two halves, two micro-steps of one window: each is weighed by its share of the batch's rows (item weighting weighs them
by their items instead), so that the step is the step on the whole batch. The window, the factor and the sample
counts still count loader batches; the loss and items the features read at a loader batch's end are the whole
batch's (:class:`LoaderBatch`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from lightning_accum.core.split import batch_rows, split_batch, split_problem


@dataclass(frozen=True)
class Piece:
    """One micro-step of a window: a loader batch, or a part of one.

    Attributes:
        batch: What ``Accumulator.batches`` yields for it.
        share: Its share of its loader batch's rows (``1.0`` for a whole batch).
        first: Whether it is its loader batch's first part (the window counts the loader batch then).
        last: Whether it is its loader batch's last part (the loader batch ends with it).
    """

    batch: Any
    share: float = 1.0
    first: bool = True
    last: bool = True


def pieces(window: list[Any], parts: int) -> list[Piece]:
    """The micro-steps of ``window`` (its loader batches): a lone batch in ``parts`` parts when ``parts > 1``.

    A batch of one row, or of rows the splitter cannot find, runs whole (the window then measures nothing new).

    Example::

        >>> [(len(p.batch), p.share, p.first, p.last) for p in pieces([torch.zeros(5, 2)], parts=2)]
        [(3, 0.6, True, False), (2, 0.4, False, True)]
        >>> len(pieces([torch.zeros(5, 2), torch.zeros(5, 2)], parts=2))  # a window of two: each batch whole
        2
    """
    if parts < 2 or len(window) != 1:
        return [Piece(batch) for batch in window]
    batch = window[0]
    rows = batch_rows(batch)
    if rows is None or rows < 2 or split_problem(batch) is not None:
        return [Piece(batch)]
    split = split_batch(batch, math.ceil(rows / parts))
    last = len(split) - 1
    return [Piece(part, (batch_rows(part) or 0) / rows, i == 0, i == last) for i, part in enumerate(split)]


def check_halves(batch: Any) -> None:
    """Refuse, at the run's first loader batch, a batch the noise scale's halves could not split.

    Raises:
        ValueError: If :func:`~lightning_accum.core.split.split_problem` finds a problem, naming the batch's type and
        it.
    """
    problem = split_problem(batch)
    if problem is not None:
        kind = type(batch).__name__
        raise ValueError(
            f"adaptive=True measures a window of one loader batch (factor 1, one process) in two halves, but a"
            f" loader batch of type {kind} cannot be split: {problem}. Either teach the splitter the batch with"
            f" `lightning_accum.core.split.register_splitter({kind}, fn)` (see docs/microbatching.md), or start the"
            " schedule at factor 2 (scheduling={0: 2}), where a window has two micro-batches to compare"
        )


class LoaderBatch:
    """A split loader batch's mean loss and items, added up over its parts, for the features' ``MICRO_BATCH_ENDED``.

    Example::

        >>> whole = LoaderBatch()
        >>> whole.add(torch.tensor(1.0), 0.6, None); whole.add(torch.tensor(2.0), 0.4, None)
        >>> round(float(whole.loss), 6), whole.items
        (1.4, None)
    """

    def __init__(self) -> None:
        self.loss: torch.Tensor | None = None  # a mean over the loader batch: by rows, or by items
        self.items: Any = None
        self._weighted: torch.Tensor | None = None

    def add(self, loss: torch.Tensor | None, share: float, items: Any) -> None:
        """Add a part's mean ``loss`` (``None``: it had none), its ``share`` of the rows and its ``items``."""
        if loss is None:
            return
        if items is None:
            self.loss = loss * share if self.loss is None else self.loss + loss * share
            return
        weighted = loss * torch.as_tensor(items, dtype=loss.dtype, device=loss.device)
        self._weighted = weighted if self._weighted is None else self._weighted + weighted
        self.items = items if self.items is None else self.items + items
        count = torch.as_tensor(self.items, dtype=loss.dtype, device=loss.device)
        self.loss = self._weighted / count.clamp(min=1)
