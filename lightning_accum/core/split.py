"""Splitting a loader batch into micro-batches along its first dimension, and recognising out-of-memory errors.

Pure (torch only). The batch's rows are the first dimension of its first tensor. Inside tuples, lists, dicts,
namedtuples and dataclasses (nested), each tensor is sliced along dimension 0, and a list or tuple that holds no
tensor and is as long as the batch is the batch's values, one per row (the names of its samples, as the default
collate function gathers a string field): it is sliced with the rows. Anything else (a string, a number, ``None``, a
list of another length) is shared by every micro-batch. A batch of another kind can teach the splitter with
:func:`register_splitter`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

_SPLITTERS: dict[type, Callable[[Any, int], list[Any]]] = {}
_ROWS: dict[type, Callable[[Any], int]] = {}

_OOM_MESSAGES = ("out of memory", "can't allocate memory", "cannot allocate memory", "failed to allocate")


def register_splitter(kind: type, splitter: Callable[[Any, int], list[Any]], rows: Callable[[Any], int] = len) -> None:
    """Teach :func:`split_batch` a batch type: ``splitter(batch, size)`` returns its micro-batches of ``size`` rows.

    Args:
        kind: The batch's type (exactly: a subclass needs its own registration).
        splitter: ``splitter(batch, size)``: the batch's micro-batches of ``size`` rows each, the last holding what
            is left.
        rows: ``rows(batch)``: how many rows (samples) the batch holds; ``len`` by default.

    Example::

        class Pair:  # a batch the splitter cannot look inside: a collate_fn's own object
            def __init__(self, x, y):
                self.x, self.y = x, y

        def cut(batch, size):
            return [Pair(batch.x[i : i + size], batch.y[i : i + size]) for i in range(0, len(batch.x), size)]

        register_splitter(Pair, cut, rows=lambda batch: len(batch.x))
    """
    _SPLITTERS[kind] = splitter
    _ROWS[kind] = rows


def batch_rows(batch: Any) -> int | None:
    """The first dimension of the first tensor in ``batch`` (``None`` if it holds none).

    Example::

        >>> batch_rows({"x": torch.zeros(6, 3), "y": torch.zeros(6)})
        6
    """
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() > 0 else None
    if type(batch) in _ROWS:
        return int(_ROWS[type(batch)](batch))
    for value in _values(batch):
        rows = batch_rows(value)
        if rows is not None:
            return rows
    return None


def split_batch(batch: Any, size: int) -> list[Any]:
    """``batch`` as micro-batches of ``size`` rows each (the last holds what is left).

    Raises:
        TypeError: If ``batch`` holds no tensor with a first dimension and no splitter is registered for it.
        ValueError: If two tensors in ``batch`` disagree on the first dimension.

    Example::

        >>> batch = {"x": torch.arange(5), "name": ["a", "b", "c", "d", "e"], "classes": ["cat", "dog"], "split": "t"}
        >>> parts = split_batch(batch, size=2)
        >>> [p["x"].tolist() for p in parts], [p["name"] for p in parts]
        ([[0, 1], [2, 3], [4]], [['a', 'b'], ['c', 'd'], ['e']])
        >>> parts[2]["classes"], parts[2]["split"]
        (['cat', 'dog'], 't')
    """
    if type(batch) in _SPLITTERS:
        return _SPLITTERS[type(batch)](batch, size)
    rows = batch_rows(batch)
    if rows is None:
        raise TypeError(
            f"AccumulationScheduler cannot split a batch of type {type(batch).__name__} into micro-batches: it holds"
            " no tensor with a batch dimension. Register a splitter with"
            " `lightning_accum.core.split.register_splitter(type, fn)`, or give the loader the micro-batch size"
        )
    return [_slice(batch, start, min(start + size, rows), rows) for start in range(0, rows, size)]


def split_problem(batch: Any) -> str | None:
    """Why ``batch`` cannot be split into micro-batches by :func:`split_batch`, or ``None`` if it can.

    Checked on a loader batch before any step, so that what would fail (or silently train whole batches) at the first
    split is said at once.

    Example::

        >>> split_problem((torch.zeros(8, 2), torch.zeros(8))) is None
        True
        >>> split_problem((torch.zeros(8, 2), torch.zeros(8), torch.ones(3)))[:52]
        'its tensor at [2] has 3 rows, not the 8 of its first'
    """
    if type(batch) in _SPLITTERS:
        return None
    rows = batch_rows(batch)
    if rows is None:
        kind = type(batch).__name__
        return (
            f"the splitter finds no tensor with a batch dimension in a {kind} (it looks inside tuples, lists, dicts,"
            " namedtuples and dataclasses)"
        )
    mismatch = _first_mismatch(batch, rows, "")
    if mismatch is None:
        return None
    where, found = mismatch
    return (
        f"its tensor at {where or 'the top'} has {found} rows, not the {rows} of its first tensor (a tensor shared by"
        " every sample belongs in the module, as a buffer)"
    )


def _first_mismatch(batch: Any, rows: int, where: str) -> tuple[str, int] | None:
    """Where in ``batch`` the first tensor whose first dimension is not ``rows`` sits, and that dimension."""
    if isinstance(batch, torch.Tensor):
        return (where, int(batch.shape[0])) if batch.dim() > 0 and batch.shape[0] != rows else None
    if isinstance(batch, Mapping):
        children: Iterable[tuple[str, Any]] = ((f"{where}[{key!r}]", value) for key, value in batch.items())
    elif isinstance(batch, (list, tuple)):
        children = ((f"{where}[{index}]", value) for index, value in enumerate(batch))
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        children = ((f"{where}.{f.name}", getattr(batch, f.name)) for f in dataclasses.fields(batch))
    else:
        return None
    for path, value in children:
        found = _first_mismatch(value, rows, path)
        if found is not None:
            return found
    return None


def _slice(batch: Any, start: int, stop: int, rows: int) -> Any:
    if type(batch) in _SPLITTERS:
        raise TypeError(f"a registered {type(batch).__name__} inside a larger batch cannot be split by rows")
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            return batch
        if batch.shape[0] != rows:
            raise ValueError(
                f"Cannot split a batch whose tensors disagree on the first dimension ({batch.shape[0]} and {rows})"
            )
        return batch[start:stop]
    if isinstance(batch, Mapping):
        return type(batch)({key: _slice(value, start, stop, rows) for key, value in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(_slice(value, start, stop, rows) for value in batch))
    if isinstance(batch, (list, tuple)):
        if len(batch) == rows and not _holds_tensor(batch):  # one value per row
            return batch[start:stop]
        return type(batch)(_slice(value, start, stop, rows) for value in batch)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        changes = {
            field.name: _slice(getattr(batch, field.name), start, stop, rows) for field in dataclasses.fields(batch)
        }
        return dataclasses.replace(batch, **changes)
    return batch


def _values(batch: Any) -> Iterable[Any]:
    """What a tuple, list, dict or dataclass holds (nothing for anything else)."""
    if isinstance(batch, Mapping):
        return batch.values()
    if isinstance(batch, (list, tuple)):
        return batch
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return [getattr(batch, field.name) for field in dataclasses.fields(batch)]
    return ()


def _holds_tensor(batch: Any) -> bool:
    return isinstance(batch, torch.Tensor) or any(_holds_tensor(value) for value in _values(batch))


def label_span(batch: Any, key: str = "labels", ignore_index: int = -100) -> tuple[int, int] | None:
    """The fewest and the most loss-bearing labels a row of ``batch[key]`` holds (``None``: no such labels).

    A loss that is a mean over labels padded with ``ignore_index`` is not a mean over rows where rows hold different
    numbers: parts of the batch weighed by their rows do not add up to it. Reads the labels once (a host read).

    Example::

        >>> label_span({"labels": torch.tensor([[1, 2, -100], [3, -100, -100]])})
        (1, 2)
        >>> label_span((torch.zeros(2),)) is None
        True
    """
    labels = batch.get(key) if isinstance(batch, Mapping) else None
    if not isinstance(labels, torch.Tensor) or labels.dim() < 2:
        return None
    counts = (labels != ignore_index).flatten(1).sum(1)
    return int(counts.min()), int(counts.max())


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocator's out-of-memory error.

    CUDA raises ``torch.OutOfMemoryError``; the CPU and MPS allocators a ``RuntimeError`` that says so.

    Example::

        >>> is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory")), is_out_of_memory(ValueError("x"))
        (True, False)
    """
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and any(text in str(error).lower() for text in _OOM_MESSAGES)
