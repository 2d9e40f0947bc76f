"""The gradient noise scale (``noise_scale=True``), measured from the micro-batch gradients accumulation computes.

Each micro-batch's squared gradient norm is computed on the device, in float32 (or float64 for float64 gradients),
and kept there with the backward it belongs to (:class:`SquareSums`) until the optimizer step reads them all:

- the small parameters (under ``LARGE`` elements, at most ``STAGING`` together, of one dtype) get no hook where a
  backward reduces nothing across ranks: :class:`HeldGradients` keeps their gradients in rows, each the window's
  running sum after one more backward. Before a backward it copies the row ``.grad`` points at into the next one and
  points ``.grad`` there, so autograd adds the micro-batch's gradient in place (the additions autograd makes: the
  same values) and nothing is done after the backward but the window's last. Each backward's gradient is the
  difference of two rows: after the window's last backward, before anything scales ``.grad``, one subtraction writes
  the differences into the rows after the one ``.grad`` points at, and at the step one reduction squares them with
  that row, the window's mean. Where a backward reduces (DDP's last micro-step), their hooks copy them into a
  float32 staging vector before the reduction instead;
- a large parameter's hook squares its gradient at once with one dot, as backward produces it. Nothing keeps a
  gradient that backward allocated: autograd frees each as it would without the estimate, so the allocator sees the
  same pattern (a gradient held across backward's large allocations makes glibc page-fault megabytes per
  micro-step).

Once the window's gradient is its mean, its squared norm joins the micro-batch ones in the estimator of
:mod:`lightning_accum.noise`. Each micro-batch's gradient is that of the loss Lightning backpropagates, so its sum
is unscaled by ``ctx.loss_divisor`` and the AMP loss scale, constant over a window, is taken out once per step,
with the step's one transfer to the host.

Reads ``ctx.items`` and ``ctx.window_items`` when item weighting publishes them; publishes ``ctx.noise_scale`` and
``ctx.noise_batch`` at ``GRADIENT_READY``.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from torch._utils import _flatten_dense_tensors
from typing_extensions import override

from lightning_accum.events import Context, Feature
from lightning_accum.items import count_samples
from lightning_accum.noise import NoiseScaleEstimate, NoiseScaleEstimator

FLUSH = 64  # small gradients flattened together into one dot, when read from .grad
LARGE = 1 << 14  # a gradient of this many elements or more gets its own dot: the launch no longer dominates
STAGING = 1 << 20  # elements of the small parameters together, and of their rows unless three rows need more
ROWS = 64  # backwards whose small gradients are kept, to be squared together, before they are squared
ROW_TENSORS = 1 << 12  # tensors the rows are split into (one per parameter and row) at most
ENTRIES = 256  # squares the sums hold before their room doubles
STEPS = 64  # steps whose sums wait to be read at most: then they are read and folded into the estimate


class SquareSums:
    """The squared gradient norms of the steps not read yet: one slot per backward, then one for the step's mean.

    Each addition is one reduction on the device (a large tensor's squared entries summed, small ones' flattened
    together, or each row's of a matrix) written into an entry of a float32 vector allocated beforehand, with the
    slot it belongs to; :meth:`values` moves them to the host together and adds them up per slot. Nothing the
    reductions make is kept: a small tensor made inside a backward and kept beyond it (a large gradient's square)
    makes glibc page-fault backward's large allocations afresh (3 ms a micro-step in a raw PyTorch loop over the
    benchmarks' compute-bound MLP). Only float64 sums, and sums on another device, are kept as tensors of their own.

    Args:
        device: Where the sums are computed: the gradients' device.

    Example::

        >>> sums = SquareSums(torch.device("cpu"))
        >>> sums.add(0, torch.tensor([3.0, 4.0]))
        >>> sums.add_all(2, [], [torch.ones(2, 2), torch.ones(3)])
        >>> sums.add_steps(0, torch.tensor([[0.0, 0.0], [0.0, 1.0], [0.0, 3.0]]))  # steps of 1 and 2
        >>> sums.values(3, [])[0]
        [26.0, 4.0, 7.0]
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._index = -1 if device.type == "cpu" else (device.index or 0)  # as Tensor.get_device() numbers it
        self._entries = torch.empty(ENTRIES, device=device)  # float32: where the reductions write, one entry each
        self._views = self._entries.unbind()  # the first ENTRIES entries' views, made once (later ones: per use)
        self._spans: dict[tuple[int, int], torch.Tensor] = {}  # (first entry, entries): their view, made once
        self._slots: list[int] = []  # the slot of each entry written
        self._roots: list[int] = []  # the entries that hold a norm (squared when read), not a square
        self._sums: list[torch.Tensor] = []  # float64 or another device's: 0-d (one slot) or 1-d (consecutive slots)
        self._firsts: list[int] = []  # the slot of each one's first entry

    def clear(self) -> None:
        """No slot holds anything."""
        self._slots, self._roots, self._sums, self._firsts = [], [], [], []

    def mark(self) -> tuple[int, int]:
        """Where the sums stand: :meth:`rewind` drops what is added after."""
        return len(self._slots), len(self._sums)

    def rewind(self, mark: tuple[int, int]) -> None:
        """Drop what was added since ``mark`` (a window dropped before its step)."""
        entries, sums = mark
        del self._slots[entries:], self._sums[sums:], self._firsts[sums:]
        if self._roots and self._roots[-1] >= entries:
            self._roots = [at for at in self._roots if at < entries]

    def _room(self, count: int) -> int:
        """The first of ``count`` free entries (twice the room, the entries so far copied over, when full)."""
        at = len(self._slots)
        size = self._entries.numel()
        if at + count > size:
            while at + count > size:
                size *= 2
            entries = torch.empty(size, device=self.device)
            entries[:at].copy_(self._entries[:at])
            self._entries, self._views, self._spans = entries, entries[:ENTRIES].unbind(), {}
        return at

    def _entry(self, at: int) -> torch.Tensor:
        return self._views[at] if at < len(self._views) else self._entries[at]

    def rebase(self, first: int) -> None:
        """Drop the sums of the slots before ``first`` (read already) and number the others from 0."""
        cut = next((at for at, slot in enumerate(self._slots) if slot >= first), len(self._slots))
        kept = len(self._slots) - cut
        if cut and kept:
            self._entries[:kept].copy_(self._entries[cut : cut + kept].clone())
        self._slots = [slot - first for slot in self._slots[cut:]]
        self._roots = [at - cut for at in self._roots if at >= cut]
        sums = [(slot - first, tensor) for slot, tensor in zip(self._firsts, self._sums, strict=True) if slot >= first]
        self._firsts, self._sums = [slot for slot, _ in sums], [tensor for _, tensor in sums]

    def add(self, slot: int, tensor: torch.Tensor) -> None:
        """Add the squared entries of ``tensor`` to ``slot``."""
        at = len(self._slots)
        if not (  # the usual, checked first: a float32 gradient on the device, with a free entry
            tensor.dtype is torch.float32
            and at < len(self._views)
            and not tensor.requires_grad
            and tensor.layout is torch.strided
            and tensor.get_device() == self._index
        ):
            if tensor.requires_grad:  # a backward with create_graph=True: the sums stay out of its graph
                tensor = tensor.detach()
            if tensor.is_sparse:  # an embedding's sparse gradient: its entries, each index once
                tensor = tensor.coalesce().values()
            if tensor.dtype == torch.float64 or tensor.get_device() != self._index:  # a tensor of its own
                square = torch.linalg.vector_norm(tensor).square()
                self._sums.append(square if square.get_device() == self._index else square.to(self.device))
                self._firsts.append(slot)
                return
            at = self._room(1)
        if tensor.dtype is torch.float32 and tensor.is_contiguous():
            flat = tensor.view(-1)
            torch.dot(flat, flat, out=self._entry(at))
        else:  # a narrower dtype, or a strided tensor (no copy): its norm in float32, squared when read
            torch.linalg.vector_norm(tensor, dtype=torch.float32, out=self._entry(at))
            self._roots.append(at)
        self._slots.append(slot)

    def add_flat(self, slot: int, tensors: list[torch.Tensor]) -> None:
        """Add the squared entries of small ``tensors`` on one device to ``slot``: one flatten, one norm."""
        self.add(slot, _flatten_dense_tensors(tensors) if len(tensors) > 1 else tensors[0])

    def add_all(self, slot: int, large: list[torch.Tensor], small: list[torch.Tensor]) -> None:
        """Add the ``large`` tensors one by one and the ``small`` ones ``FLUSH`` at a time to ``slot``."""
        for tensor in large:
            self.add(slot, tensor)
        for start in range(0, len(small), FLUSH):
            self.add_flat(slot, small[start : start + FLUSH])

    def add_steps(self, first: int, rows: torch.Tensor) -> None:
        """Add the squared difference of each two consecutive rows of ``rows`` to the slots from ``first`` on.

        ``rows``: float32 or wider, on the device. One subtraction, one reduction.
        """
        steps = torch.diff(rows, dim=0)
        if rows.dtype != torch.float32:
            self._sums.append(torch.linalg.vecdot(steps, steps))
            self._firsts.append(first)
            return
        self.add_rows(first, steps)

    def add_rows(self, first: int, rows: torch.Tensor, lead: int | None = None) -> None:
        """Add the squared entries of each row of ``rows`` (float32, on the device) to the slots from ``first`` on.

        With ``lead``, the first row's go to slot ``lead``, the others' to the slots from ``first`` on. One reduction.
        """
        count = rows.shape[0]
        at = self._room(count)
        span = self._spans.get((at, count))
        if span is None:
            span = self._spans[at, count] = self._entries.narrow(0, at, count)
        torch.linalg.vecdot(rows, rows, out=span)
        if lead is None:
            self._slots.extend(range(first, first + count))
        else:
            self._slots.append(lead)
            self._slots.extend(range(first, first + count - 1))

    def values(self, count: int, columns: list[list[Any]]) -> tuple[list[float], list[list[float]]]:
        """The first ``count`` slots' sums, and each column of numbers or tensors as floats: one transfer."""
        written = len(self._slots)
        read, slots = _on_host([*self._sums, self._entries.narrow(0, 0, written)], columns, self._index < 0)
        sums = [0.0] * count
        entries = read.pop()
        for at in self._roots:
            entries[at] *= entries[at]
        for slot, value in zip(self._slots, entries, strict=True):
            if slot < count:
                sums[slot] += value
        for first, values in zip(self._firsts, read, strict=True):
            if isinstance(values, float):  # one slot's
                if first < count:
                    sums[first] += values
                continue
            for offset, value in enumerate(values):
                if first + offset < count:
                    sums[first + offset] += value
        return sums, slots


class HeldGradients:
    """The small parameters' gradients of a window, in rows: each row the window's sum after one more backward.

    Before a backward that reduces nothing across ranks, :meth:`take` copies the row holding the window's sum so far
    into the next row and points each parameter's ``.grad`` at its place there (a tensor of its own over the rows'
    storage): autograd adds the backward's gradient into it in place, as it adds into any ``.grad``. So ``.grad``
    holds the window's sum so far, with the values autograd gives it, and nothing is done after the backward. A
    parameter whose ``.grad`` is ``None`` keeps ``None``: autograd creates its gradient as it would without the
    estimate, and the next :meth:`take` copies it into its place (as it copies a ``.grad`` set elsewhere, e.g. by a
    ``create_graph=True`` backward). Each backward's gradient is the difference of two consecutive rows: :meth:`flush`
    squares the differences not yet squared together (one subtraction, one reduction), before anything changes
    ``.grad`` in place (before a backward that reduces, when the rows run out); after the window's last backward it
    only subtracts, into the rows after the one ``.grad`` points at, and :meth:`square_last` squares them with that
    row, the window's mean, at the step.

    Args:
        params: Parameters of one dtype, on one device.
        staging: Also allocate a float32 staging vector, for hooks that copy gradients into it (several ranks).

    Example::

        >>> weight = torch.nn.Parameter(torch.zeros(2))
        >>> held, sums = HeldGradients([weight]), SquareSums(torch.device("cpu"))
        >>> for slot, value in enumerate((3.0, 4.0)):
        ...     held.take(slot, sums)
        ...     (value * weight.sum()).backward()  # a micro-batch's gradient (value, value)
        >>> held.flush(sums); weight.grad.tolist(), sums.values(2, [])[0]
        ([7.0, 7.0], [18.0, 32.0])
    """

    def __init__(self, params: list[torch.Tensor], staging: bool = False) -> None:
        self.params = params
        device, dtype = params[0].device, params[0].dtype
        numel = sum(param.numel() for param in params)
        # rows: as many as fit in STAGING elements, at most ROWS, at most ROW_TENSORS tensors in all, at least three
        count = max(3, min(ROWS, STAGING // max(numel, 1), ROW_TENSORS // len(params)))
        self.rows = torch.zeros(count, numel, dtype=dtype, device=device)
        self._rows = self.rows.unbind()  # a view per row, made once
        self._first_two = self.rows[:2]
        self._nones = [None] * len(params)
        storage = self.rows.untyped_storage()
        self._places: list[list[torch.Tensor]] = []  # per row, each parameter's place: own tensors, not views
        for row in range(count):
            offset, places = row * numel, []
            for param in params:
                shape = param.shape
                place = torch.empty(0, dtype=dtype, device=device).set_(storage, offset, shape, _contiguous(shape))
                places.append(place)
                offset += param.numel()
            self._places.append(places)
        self._wide = self.rows.dtype in (torch.float32, torch.float64)  # differenced and squared in its own dtype
        # (first row, last row, after it): the rows after the first, those before the last, and where their
        # differences go (the rows after the last, or the buffer below)
        self._spans: dict[tuple[int, int, bool], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._steps: torch.Tensor | None = None  # float32 rows' differences, when squared at once
        # the window's last differences, made at its last backward into the rows after the one .grad points at, and
        # squared at the step with the window's mean (that row) in one reduction: (that row, differences, first slot)
        self._pending: tuple[int, int, int] | None = None
        self.staging = torch.zeros(numel, device=device) if staging else None  # float32, for the stage hooks
        self.stage_views: list[torch.Tensor] = []
        offset = 0
        for param in params if staging else ():
            self.stage_views.append(self.staging[offset : offset + param.numel()].view(param.shape))  # type: ignore[index]
            offset += param.numel()
        self._held = bytearray(len(params))  # which parameters' sum the rows hold (their .grad is not None)
        self._unheld: list[int] = []  # the others, by index: their .grad is None, their places zero
        self._expect: Sequence[torch.Tensor | None] = []  # each .grad as the latest take left it
        self._row: int | None = None  # the row holding the sum after the latest backward (None: no backward yet)
        self._last = 0  # the row .grad pointed at when the last window ended
        self._base = 0  # the rows from here to _row hold differences not yet squared
        self._first_slot = 0  # the slot (backward of the window) of row _base + 1

    def reset(self) -> None:
        """A new window: nothing of it is held yet (differences left unsquared: a window without its step)."""
        if self._row is not None:
            self._last = self._row
        self._row, self._pending = None, None

    def take(self, slot: int, sums: SquareSums) -> None:
        """Before the backward of ``slot``: ``.grad`` to the next row, holding the window's sum so far."""
        if self._pending is not None:  # another backward after the window's last take (micro-batches of a batch):
            self.square_last(sums)  # squared before the next row, the first difference's, is written
        row, params = self._row, self.params
        grads = [param.grad for param in params]
        if (  # every backward of the window but the first: .grad as the last take left it
            row is not None
            and row + 1 < len(self._rows)
            and (row == self._base or slot == self._first_slot + row - self._base)
            and all(map(operator.is_, grads, self._expect))
        ):
            self._rows[row + 1].copy_(self._rows[row])
            row += 1
        else:
            row = self._settle_row(slot, grads, sums)
        if row == self._base + 1:  # the first backward not yet squared
            self._first_slot = slot
        places = self._places[row]
        if self._unheld:  # they keep None: autograd creates their gradient, the next take copies it
            expect: list[torch.Tensor | None] = list(places)
            for index in self._unheld:
                expect[index] = None
            for param, place in zip(params, expect, strict=True):
                if place is not None:
                    param.grad = place
            self._expect = expect
        else:
            for param, place in zip(params, places, strict=True):
                param.grad = place
            self._expect = places
        self._row = row

    def _settle_row(self, slot: int, grads: list[torch.Tensor | None], sums: SquareSums) -> int:
        """The row this backward adds into, holding the window's sum so far (what ``.grad`` holds now)."""
        row = self._row
        if row is None:  # the window's first backward
            return self._start(grads)
        places, held = self._places[row], self._held
        for index in _copy_in(places, grads):
            held[index] = 1
        dropped = []
        for index, (grad, place) in enumerate(zip(grads, places, strict=True)):
            if grad is None and held[index]:  # something dropped it (set to None): the sum starts again from zero
                dropped.append(place)
                held[index] = 0
        self._unheld = [index for index, value in enumerate(held) if not value]
        pending = row != self._base
        full = row + 1 == len(self._rows)
        if pending and (dropped or full or slot != self._first_slot + row - self._base):
            self.flush(sums)  # the rows full, a sum dropped, or a backward in between not held
        if dropped:
            torch._foreach_zero_(dropped)
        if full:
            self._rows[0].copy_(self._rows[row])
            row = self._base = 0
        self._rows[row + 1].copy_(self._rows[row])
        return row + 1

    def _start(self, grads: list[torch.Tensor | None]) -> int:
        """The window's first take: the base row holds what ``.grad`` holds (zero where it holds ``None``)."""
        last = self._last
        if all(map(operator.is_, grads, self._nones)):  # set to None (zero_grad's default): zeros, one fill
            self._held, self._unheld = bytearray(len(grads)), list(range(len(grads)))
            self._first_two.zero_()
            self._base = 0
            return 1
        self._held = bytearray(grad is not None for grad in grads)
        self._unheld = [index for index, grad in enumerate(grads) if grad is None]
        if last + 1 < len(self._rows) and all(
            grad is None or grad is place for grad, place in zip(grads, self._places[last], strict=True)
        ):
            row = last  # .grad left as the last window ended it (zeroed in place, or kept): no copy
            if self._unheld:
                torch._foreach_zero_([self._places[last][index] for index in self._unheld])
        else:  # tensors set elsewhere: each value copied (cloned first: it may lie in the rows)
            row = 0
            present = [
                (place, grad.detach().clone())
                for place, grad in zip(self._places[0], grads, strict=True)
                if grad is not None
            ]
            self._rows[0].zero_()
            torch._foreach_copy_([place for place, _ in present], [grad for _, grad in present])
        self._base = row
        self._rows[row + 1].copy_(self._rows[row])
        return row + 1

    def restore(self) -> None:
        """At the fit's end: each ``.grad`` in the rows becomes a tensor of its own, so that the rows are freed."""
        storage = self.rows.untyped_storage().data_ptr()
        for param in self.params:
            grad = param.grad
            if grad is not None and grad.untyped_storage().data_ptr() == storage:
                param.grad = grad.clone()
        self._row, self._pending = None, None

    def flush(self, sums: SquareSums, last: bool = False) -> None:
        """Add the squared differences of the rows not yet squared (one per backward) to their slots of ``sums``.

        After the window's ``last`` backward, float32 differences that fit in the rows after the one ``.grad`` points
        at are made there, and squared by :meth:`square_last` at the step, with the window's mean.
        """
        row = self._row
        if row is None or row == self._base:  # nothing since the last flush (a pending square waits for the step)
            return
        _copy_in(self._places[row], [param.grad for param in self.params])
        count = row - self._base
        if self.rows.dtype is not torch.float32:  # one difference in float32 (or float64), one reduction
            rows = self.rows.narrow(0, self._base, row + 1 - self._base)
            sums.add_steps(self._first_slot, rows if self._wide else rows.float())
        else:  # the differences into place, without an allocation
            after = last and row + count < len(self._rows)  # into the rows after the one .grad points at
            span = self._spans.get((self._base, row, after))
            if span is None:  # each span's views made once (a few are in use at a time)
                if len(self._spans) >= len(self._rows):
                    self._spans.clear()
                span = self._spans[self._base, row, after] = self._span(self._base, row, after)
            later, earlier, steps = span
            torch.sub(later, earlier, out=steps)
            if after:
                self._pending = (row, count, self._first_slot)
            else:
                sums.add_rows(self._first_slot, steps)
        self._base = row

    def square_last(self, sums: SquareSums, mean: int | None = None, gradients: Sequence[torch.Tensor] = ()) -> bool:
        """Square the differences :meth:`flush` left after the window's last backward, into their slots of ``sums``.

        With ``mean`` (a slot) and the window's ``gradients`` as :meth:`gradients` gives them: when they are the row
        ``.grad`` points at, whole (the window's mean), that row is squared with them, in the same reduction, into
        slot ``mean``. Returns whether it was.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return False
        row, count, first = pending
        rows = self.rows.narrow(0, row, count + 1)  # the row .grad points at, then the differences
        if mean is not None and row == self._row and len(gradients) == 1 and gradients[0] is self._rows[row]:
            sums.add_rows(first, rows, lead=mean)
            return True
        sums.add_rows(first, rows[1:])
        return False

    def _span(self, base: int, row: int, after: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The float32 rows after ``base`` up to ``row``, those before them, and where their differences go.

        The differences go into the rows after ``row`` (``after``: squared later, with ``row``), or into a buffer.
        """
        count = row - base
        if after:
            steps = self.rows[row + 1 : row + 1 + count]
        else:
            if self._steps is None or self._steps.shape[0] < count:  # room for the longest span so far
                self._steps = torch.empty(count, self.rows.shape[1], device=self.rows.device)
                self._spans = {}
            steps = self._steps[:count]
        return self.rows[base + 1 : row + 1], self.rows[base:row], steps

    def gradients(self) -> list[torch.Tensor]:
        """The parameters' gradients that exist: the row ``.grad`` points at, whole, when it holds every one."""
        grads = [param.grad for param in self.params]
        row = self._row
        if row is not None and all(map(operator.is_, grads, self._expect)):  # the others' places are zero
            return [self._rows[row]]
        return [grad for grad in grads if grad is not None]


def _copy_in(places: list[torch.Tensor], grads: list[torch.Tensor | None]) -> list[int]:
    """Copy each gradient that is not its place into the place, in one call; return their indices.

    Such a gradient holds the parameter's sum: autograd created it (the parameter had ``None``), summed it out of place
    (``create_graph=True``), or something set it.
    """
    copied = [
        index
        for index, (grad, place) in enumerate(zip(grads, places, strict=True))
        if grad is not None and grad is not place
    ]
    if copied:
        torch._foreach_copy_([places[index] for index in copied], [grads[index].detach() for index in copied])  # type: ignore[union-attr]
    return copied


def _contiguous(shape: torch.Size) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _on_host(sums: list[torch.Tensor], columns: list[list[Any]], on_cpu: bool) -> tuple[list[Any], list[list[float]]]:
    """Each of ``sums`` read as ``Tensor.tolist()`` reads it, and each column of numbers or tensors as floats.

    On an accelerator, every tensor among them comes to the host in one transfer (one synchronisation); on the CPU
    (``on_cpu``, and no tensor in the columns), where nothing is transferred, each is read as it is.
    """
    column_tensors = [value for column in columns for value in column if isinstance(value, torch.Tensor)]
    if on_cpu and not column_tensors:
        return [tensor.tolist() for tensor in sums], [[float(value) for value in column] for column in columns]
    tensors = [*sums, *column_tensors]
    device = next((tensor.device for tensor in tensors if tensor.device.type != "cpu"), torch.device("cpu"))
    flat = torch.cat([tensor.to(device, torch.float32).reshape(-1) for tensor in tensors]).tolist()
    host, at = [], 0
    for tensor in sums:
        host.append(flat[at] if tensor.dim() == 0 else flat[at : at + tensor.numel()])
        at += tensor.numel()
    scalars = iter(flat[at:])  # the columns' tensors: one number each
    return host, [[next(scalars) if isinstance(v, torch.Tensor) else float(v) for v in column] for column in columns]


def _items(ctx: Context) -> Any:
    """The micro-batch's items, as the estimate counts them: item weighting's, or else its samples."""
    if ctx.items is not None:
        return ctx.items
    try:
        return count_samples(ctx.batch)
    except ValueError:
        return ctx.micro_batch_size or 1


def _skips_reduction(ctx: Context) -> bool:
    """Whether the backward about to run leaves the gradients unreduced across ranks.

    DDP inside ``no_sync``, or with its reduction taken over for the window; ``False`` where that is unknown.
    """
    model = getattr(getattr(ctx.trainer, "strategy", None), "model", None)
    return getattr(model, "require_backward_grad_sync", True) is False


class NoiseScale(Feature):
    """Estimate the simple noise scale ``B_simple = tr(Sigma) / |G|^2`` once per optimizer step.

    Logs ``accum/noise_scale`` (in samples, or tokens under ``normalize_by="token"``), ``accum/noise_grad_sq``,
    ``accum/noise_trace`` and ``accum/noise_scale_to_batch`` (the noise scale over the step's batch). Under DDP the
    small batch is one rank's micro-batch and the big batch the global window.

    Args:
        decay: Decay of the moving averages that smooth the two estimates, in ``[0, 1)``.

    Raises:
        ValueError: If ``decay`` is outside ``[0, 1)``; at ``setup``, under FSDP, whose hooks see only shards.

    Example::

        >>> import torch
        >>> from lightning_accum.events import Context, Event, Features
        >>> from lightning_accum.window import Window
        >>> net = torch.nn.Linear(2, 1, bias=False)
        >>> features, ctx = Features([NoiseScale(decay=0.0)]), Context(module=net)
        >>> ctx.window.open(2); features.dispatch(Event.WINDOW_OPENED, ctx)
        >>> for x in ([1.0, 0.0], [1.0, 1.0]):  # micro-batch gradients (1, 0) and (1, 1)
        ...     ctx.batch, ctx.loss_divisor = torch.tensor([x]), 2.0
        ...     features.dispatch(Event.MICRO_BATCH_STARTED, ctx)
        ...     features.dispatch(Event.BEFORE_BACKWARD, ctx)
        ...     (net(ctx.batch).sum() / 2).backward()
        ...     features.dispatch(Event.AFTER_BACKWARD, ctx)
        >>> features.dispatch(Event.GRADIENT_READY, ctx); ctx.noise_scale
        0.5
    """

    name = "noise_scale"

    def __init__(self, decay: float = 0.95) -> None:
        self._estimator = NoiseScaleEstimator(decay)
        self._hooks: dict[int, Any] = {}  # id(param) -> hook handle
        self._module: Any = None  # the module whose parameters were listed
        self._unhooked: list[torch.Tensor] = []  # its parameters not taken in yet (frozen so far)
        self._large: list[torch.Tensor] = []  # parameters whose gradients are squared in their hooks
        self._held: HeldGradients | None = None  # the small parameters' gradients, held between backwards
        self._stage_hooks = False  # whether the small parameters have hooks (several ranks)
        self._batch: tuple[float, int] | None = None  # (big batch, micro-steps) of the latest update
        self._device: torch.device | None = None  # the first trainable parameter's
        self._sums: SquareSums | None = None  # one slot per backward of the window, then the mean's
        self._backwards = 0  # backwards of this window so far
        self._first = 0  # the slot of this window's first backward: the steps not read yet hold the ones before
        self._steps: list[tuple[Any, ...]] = []  # the steps whose sums are not read yet: what reads them needs
        self._mark = (0, 0)  # where the sums stood when the latest step was added to them
        self._folded = 0  # steps folded into the estimator (this feature's life): the steps added are these and _steps
        self._kept: tuple[int, dict[str, Any] | None] = (-1, None)  # (steps, the estimator's state after them)
        self._adding = False  # whether the hooks add to the sums now (inside a backward of a window)
        self._slot = 0  # the slot they add to: the backward in progress
        self._taking = False  # whether the backward in progress adds the small gradients into a row
        self._staging_now = False  # whether the small parameters' hooks copy their gradients now
        self._seen = bytearray()  # which of them did, by index, in the backward in progress
        self._unscales: list[Any] = []  # per backward: turns its gradient into the micro-batch mean's
        self._small_items: list[Any] = []
        self._tensors = False  # whether a divisor or a count of this window is a tensor
        self._scaler: tuple[Any, Any] = (None, None)  # (trainer, its AMP loss scaler or None)

    @property
    def estimate(self) -> NoiseScaleEstimate:
        """The current smoothed estimates."""
        self._fold()
        return self._estimator.estimate

    @override
    def reset(self) -> None:
        self._estimator = NoiseScaleEstimator(self._estimator.decay)
        self._batch, self._steps = None, []

    @override
    def setup(self, ctx: Context) -> None:
        strategy = getattr(ctx.trainer, "strategy", None)
        if isinstance(strategy, (FSDPStrategy, ModelParallelStrategy)):
            raise ValueError(
                f"`noise_scale=True` reads each micro-batch's full gradient, which {type(strategy).__name__}"
                " shards: use it with a single device or DDP, or set noise_scale=False"
            )

    @override
    def window_opened(self, ctx: Context) -> None:
        self._unscales, self._small_items, self._tensors = [], [], False  # nothing of a dropped window survives
        self._backwards, self._adding, self._taking, self._staging_now = 0, False, False, False
        if self._module is not ctx.module:  # the module's parameters, listed once per fit
            self._module, self._unhooked = ctx.module, list(ctx.module.parameters())
        unhooked = self._unhooked
        if unhooked and any(param.requires_grad for param in unhooked):  # the first window, or a layer unfrozen since
            sparse = {  # nn.Embedding(sparse=True) and the like: their gradients stay sparse, as autograd makes them
                id(param)
                for module in ctx.module.modules()
                if getattr(module, "sparse", False) is True
                for param in module.parameters(recurse=False)
            }
            self._take_in(unhooked, several_ranks=ctx.world_size > 1, keep=sparse)
        if self._held is not None:
            self._held.reset()
        sums = self._sums
        if sums is not None:
            if not self._steps:  # every step read: the slots start again
                sums.clear()
                self._first = 0
            else:
                sums.rewind(self._mark)  # what a window dropped before its step added goes
                first = self._steps[0][0]
                if first:  # steps read inside a window left their sums: dropped, the others numbered from 0
                    sums.rebase(first)
                    self._steps = [(step[0] - first, *step[1:]) for step in self._steps]
                    self._first, self._mark = self._first - first, sums.mark()

    def _take_in(self, params: list[torch.Tensor], several_ranks: bool, keep: set[int]) -> None:
        """Take in the trainable ``params``: a large gradient is squared in its hook, a small one held.

        The small gradients (of contiguous parameters of the first small one's dtype and device, at most ``STAGING``
        elements together) get a hook only where a backward may reduce them across ranks (``several_ranks``): it
        copies them into the staging vector as backward produces them, before the reduction. A parameter in ``keep``
        (sparse gradients), and one stored in another layout (``channels_last``, a transposed view: autograd gives its
        gradient the parameter's strides, which fused optimizers rely on), is squared in its hook as a large one is.
        """
        small = list(self._held.params) if self._held is not None else []
        staged = sum(param.numel() for param in small)
        for param in params:
            if not param.requires_grad:
                continue
            if self._device is None:
                self._device = param.device  # where the sums are kept
            dtype = small[0].dtype if small else param.dtype  # the held buffer's
            if (
                param.numel() < LARGE
                and id(param) not in keep
                and param.is_contiguous()
                and param.device == self._device
                and param.dtype == dtype
                and staged + param.numel() <= STAGING
            ):
                small.append(param)
                staged += param.numel()
                self._hooks[id(param)] = None  # hooked below, if at all
            else:
                self._large.append(param)
                self._hooks[id(param)] = param.register_hook(self._add_large)
        self._unhooked = [param for param in self._unhooked if id(param) not in self._hooks]
        if self._held is not None and len(self._held.params) == len(small):
            return  # no new small parameter
        stage_hooks = bool(small) and several_ranks
        for index, param in enumerate(small):  # the stage hooks hold indices into the new held parameters
            if self._hooks[id(param)] is not None:
                self._hooks[id(param)].remove()
            self._hooks[id(param)] = param.register_hook(self._stager(index)) if stage_hooks else None
        self._held = HeldGradients(small, staging=stage_hooks) if small else None
        self._stage_hooks = stage_hooks

    @override
    def before_backward(self, ctx: Context) -> None:
        if not self._hooks:
            return
        sums = self._sums
        if sums is None:
            sums = self._sums = SquareSums(self._device or torch.device("cpu"))
        slot, held = self._first + self._backwards, self._held
        # a backward that reduces nothing across ranks adds the small parameters' gradients into a row of their
        # own; one that reduces them is staged by their hooks before the reduction, which changes .grad in place, so
        # the rows are squared before it. Large gradients are squared in their hooks, while backward has just
        # written them.
        self._taking = held is not None and (ctx.world_size == 1 or _skips_reduction(ctx))
        if self._taking:
            held.take(slot, sums)  # type: ignore[union-attr]
        elif held is not None:
            held.flush(sums)
        self._staging_now = self._stage_hooks and not self._taking
        if self._staging_now:
            self._seen = bytearray(len(held.params))  # type: ignore[union-attr]
        if self._large or self._staging_now:  # the hooks add to this backward's slot
            self._slot, self._adding = slot, True
        divisor, items = ctx.loss_divisor, _items(ctx)
        self._unscales.append(divisor)
        self._small_items.append(items)
        if isinstance(divisor, torch.Tensor) or isinstance(items, torch.Tensor):
            self._tensors = True  # read with this step's sums: tensors are not kept beyond their step
        self._backwards += 1

    def _add_large(self, grad: torch.Tensor) -> None:
        if self._adding:
            self._sums.add(self._slot, grad)  # type: ignore[union-attr]

    def _stager(self, index: int) -> Any:
        """The hook of the ``index``-th small parameter: copies its gradient into the staging vector."""

        def stage(grad: torch.Tensor) -> None:
            if not self._staging_now:
                return
            if grad.requires_grad:  # a backward with create_graph=True
                grad = grad.detach()
            view = self._held.stage_views[index]  # type: ignore[union-attr]
            if self._seen[index]:  # a second part of this backward's gradient (reentrant checkpointing)
                view.add_(grad)
                return
            view.copy_(grad)  # a copy into place: the gradient itself is not kept
            self._seen[index] = 1

        return stage

    @override
    def after_backward(self, ctx: Context) -> None:
        sums, held = self._sums, self._held
        if sums is None:
            return
        if self._adding:
            if self._staging_now:
                assert held is not None
                staged = self._seen.count(1)
                if staged == len(held.params) and held.staging is not None:
                    sums.add(self._slot, held.staging)  # every small gradient in place: one norm
                elif staged:  # some small parameters got no gradient: their places hold an earlier backward's
                    views = [view for view, seen in zip(held.stage_views, self._seen, strict=True) if seen]
                    sums.add_all(self._slot, [], views)
            self._adding = self._staging_now = False
        if self._taking:
            assert held is not None
            if ctx.window.closed:  # the window's last backward: difference its rows before anything scales .grad
                held.flush(sums, last=True)
            self._taking = False

    @override
    def window_closing(self, ctx: Context) -> None:
        if self._held is not None and self._sums is not None:
            self._held.flush(self._sums)  # what a window whose last micro-step skipped its backward left

    @override
    def gradient_ready(self, ctx: Context) -> None:
        self._add_step(ctx)
        ctx.publish_noise(self._published)

    def _published(self) -> tuple[float | None, tuple[float, int] | None]:
        self._fold()
        return self._estimator.estimate.noise_scale, self._batch

    def _add_step(self, ctx: Context) -> None:
        """Add this step's window mean (reduced, normalized) to the sums, and what its estimate needs to the steps.

        The sums are read (one transfer to the host) and folded into the estimator when something reads the
        estimate, every ``STEPS`` steps, or at once when the step's divisors or items are tensors.
        """
        count, first, self._backwards = self._backwards, self._first, 0
        tensors, self._tensors = self._tensors, False
        unscales, self._unscales = self._unscales, []
        items, self._small_items = self._small_items, []
        large = [param.grad for param in self._large if param.grad is not None]
        held = self._held
        small = held.gradients() if held is not None else []
        sums = self._sums
        if not count or not (large or small) or sums is None:
            return
        sums.add_all(first + count, large, [])
        if held is not None:
            if held.square_last(sums, first + count, small):  # the mean, squared with the differences
                small = []
            held.flush(sums)  # rows left (the window closing events were not dispatched)
        sums.add_all(first + count, [], small)
        if self._scaler[0] is not ctx.trainer:  # the trainer's loss scaler, looked up once per trainer
            self._scaler = (ctx.trainer, getattr(getattr(ctx.trainer, "precision_plugin", None), "scaler", None))
        scaler = self._scaler[1]
        scale = scaler.get_scale() if scaler is not None and scaler.is_enabled() else None  # the window's backwards'
        self._steps.append((first, count, unscales, items, scale, ctx.window_items, ctx.world_size))
        self._first, self._mark = first + count + 1, sums.mark()
        if len(self._steps) >= STEPS or tensors:
            self._fold()  # tensors are not kept beyond their step

    def _fold(self, count: int | None = None) -> None:
        """Fold the steps not read yet (or the first ``count``) into the estimator, in order: one transfer."""
        steps = self._steps[:count] if count is not None else self._steps
        self._steps = self._steps[len(steps) :]
        if not steps or self._sums is None:
            return
        unscales = [value for step in steps for value in step[2]]
        items = [value for step in steps for value in step[3]]
        squares, (unscales, items) = self._sums.values(self._first, [unscales, items])
        at = 0  # each step's first divisor and count in the columns
        for first, count, _, _, scale, window_items, world_size in steps:
            self._fold_step(
                squares[first : first + count + 1],
                unscales[at : at + count],
                items[at : at + count],
                scale,
                window_items,
                world_size,
            )
            at += count
            self._folded += 1
            if self._folded == self._kept[0]:  # the state a window state asked for
                self._kept = (self._folded, self._estimator.state_dict())

    def _fold_step(
        self,
        squares: list[float],
        unscales: list[float],
        items: list[float],
        scale: float | None,
        window_items: float | None,
        world_size: int,
    ) -> None:
        """Fold one step into the estimator: its backwards' squared norms and its mean's (the last of ``squares``)."""
        count = len(unscales)
        bearing = [i for i in range(count) if items[i] > 0]  # a micro-batch without items holds no gradient sample
        if not bearing:
            return
        small_sq = sum(squares[i] * unscales[i] ** 2 for i in bearing) / len(bearing)
        if scale is not None:  # the AMP loss scale the window's backwards ran with
            small_sq = small_sq / scale**2
        inverse_small = sum(1.0 / items[i] for i in bearing) / len(bearing)
        # the step is the mean over every item of the window on every rank (item weighting), or else the mean of the
        # micro-batches' means over every rank
        big = window_items if window_items is not None else count * world_size / inverse_small
        self._estimator.update(small_sq, squares[count], inverse_small, big)
        self._batch = (big, count)

    @override
    def window_closed(self, ctx: Context) -> None:
        if not ctx.step_logged:  # the estimate is read (its sums moved to the host) only for the steps logged
            return
        estimate = self.estimate
        if estimate.noise_scale is not None:
            ctx.metrics["accum/noise_scale"] = estimate.noise_scale
            ctx.metrics["accum/noise_grad_sq"] = estimate.grad_sq
            ctx.metrics["accum/noise_trace"] = estimate.trace
            if self._batch is not None and self._batch[0] > 0:  # the batch in the estimate's own unit
                ctx.metrics["accum/noise_scale_to_batch"] = estimate.noise_scale / self._batch[0]

    @override
    def fit_end(self, ctx: Context) -> None:
        self._fold()
        if self._held is not None:
            self._held.restore()  # no .grad left in the rows: they are freed with this feature's references
        for hook in self._hooks.values():
            if hook is not None:
                hook.remove()
        self._hooks, self._large, self._held, self._unhooked, self._module = {}, [], None, [], None
        self._unscales, self._small_items, self._tensors = [], [], False
        self._sums, self._adding, self._backwards, self._taking, self._staging_now = None, False, 0, False, False
        self._first, self._mark = 0, (0, 0)
        self._stage_hooks, self._seen, self._device, self._scaler = False, bytearray(), None, (None, None)

    @override
    def state_dict(self) -> dict[str, Any]:
        self._fold()
        return dict(self._estimator.state_dict())

    @override
    def window_state(self) -> dict[str, Any] | Callable[[], dict[str, Any]]:
        if not self._steps:
            return self.state_dict()
        added = self._folded + len(self._steps)
        self._kept = (added, None)
        return functools.partial(self._state_after, added)

    def _state_after(self, added: int) -> dict[str, Any]:
        """The estimator's state after the first ``added`` steps (those of a window state), however many are folded."""
        if self._folded < added:
            self._fold(added - self._folded)
        steps, state = self._kept
        if steps == added and state is not None:
            return dict(state)
        return dict(self._estimator.state_dict())  # folded just up to them

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._steps, self._kept = [], (-1, None)  # replaced, as the estimator is
        self._estimator.load_state_dict(state)
