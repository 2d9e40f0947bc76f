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

_OOM_MESSAGES = ("out of memory", "can't allocate memory", "cannot allocate memory", "failed to allocate")


def register_splitter(kind: type, splitter: Callable[[Any, int], list[Any]]) -> None:
    """Teach :func:`split_batch` a batch type: ``splitter(batch, size)`` returns its micro-batches of ``size`` rows.

    Example::

        class Packed:  # a batch the splitter does not know
            def __init__(self, tokens, lengths): ...

        register_splitter(Packed, lambda batch, size: [Packed(t, l) for t, l in zip(...)])
    """
    _SPLITTERS[kind] = splitter


def batch_rows(batch: Any) -> int | None:
    """The first dimension of the first tensor in ``batch`` (``None`` if it holds none).

    Example::

        >>> batch_rows({"x": torch.zeros(6, 3), "y": torch.zeros(6)})
        6
    """
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() > 0 else None
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
            " `lightning_accum.split.register_splitter(type, fn)`, or give the loader the micro-batch size"
        )
    return [_slice(batch, start, min(start + size, rows), rows) for start in range(0, rows, size)]


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
