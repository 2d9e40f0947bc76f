"""Accumulating gradients in a wider dtype than the parameters': one rounding per window instead of one per micro-step.

With ``bfloat16`` parameters every backward adds its gradient into a ``bfloat16`` ``.grad``, so a window of ``k``
micro-batches rounds ``k`` times; the error grows with ``k`` (benchmarks/precision.py). A :class:`WideAccumulator`
moves each micro-batch's gradient into a ``float32`` buffer before the next backward (``.grad`` is set to None, so
that backward writes its gradient alone, exactly; every ``on_after_backward`` hook still sees the micro-batch's own
gradient), and writes the window's mean back into ``.grad`` once, rounded to the parameter's dtype, before the
optimizer step.

Pure (torch only).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

_NAMES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "32": torch.float32,
    "float64": torch.float64,
    "fp64": torch.float64,
    "64": torch.float64,
}


def check_grad_accum_dtype(value: object) -> torch.dtype | None:
    """The accumulation dtype ``value`` names: ``None`` (the parameters' own), ``"float32"``, ``"float64"`` or a dtype.

    Raises:
        TypeError: If ``value`` is neither ``None``, a string nor a ``torch.dtype``.
        ValueError: If it names an unknown dtype, or one that is not at least as wide as ``float32``.

    Example::

        >>> check_grad_accum_dtype("float32")
        torch.float32
        >>> check_grad_accum_dtype(None) is None
        True
    """
    if value is None:
        return None
    if isinstance(value, str):
        name = value.lower().removeprefix("torch.")
        if name not in _NAMES:
            raise ValueError(
                f"`grad_accum_dtype` must be None, 'float32' or 'float64' (or a torch dtype), got {value!r}"
            )
        return _NAMES[name]
    if not isinstance(value, torch.dtype):
        raise TypeError(f"`grad_accum_dtype` must be None, a dtype name or a torch.dtype, got {value!r}")
    if value not in (torch.float32, torch.float64):
        raise ValueError(
            f"`grad_accum_dtype={value}` would not widen anything: use torch.float32 (or torch.float64), or None to"
            " accumulate in the parameters' dtype"
        )
    return value


def accumulation_dtype(value: object) -> tuple[torch.dtype, bool]:
    """``(dtype, strict)`` for ``grad_accum_dtype``: ``"auto"`` is float32, not strict (``None`` is left out).

    Example::

        >>> accumulation_dtype("auto"), accumulation_dtype("float64")
        ((torch.float32, False), (torch.float64, True))
    """
    if isinstance(value, str) and value.lower() == "auto":  # names are read as check_grad_accum_dtype reads them
        return torch.float32, False
    return check_grad_accum_dtype(value) or torch.float32, True


def narrower(dtype: torch.dtype, than: torch.dtype) -> bool:
    """Whether floating-point ``dtype`` holds fewer mantissa bits than ``than`` (``bfloat16`` < ``float32``)."""
    return dtype.is_floating_point and torch.finfo(dtype).eps > torch.finfo(than).eps


class WideAccumulator:
    """A wide buffer per parameter: add each micro-batch's ``.grad`` into it, write the window's mean back once.

    Args:
        params: The trainable parameters to accumulate for.
        dtype: The accumulation dtype.

    Example::

        >>> weight = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
        >>> accumulator = WideAccumulator([weight], torch.float32)
        >>> for value in (1.0, 2.0**-8, 2.0**-8):  # added in bfloat16, each 2**-8 would round away next to 1.0
        ...     weight.grad = torch.full((3,), value, dtype=torch.bfloat16)
        ...     accumulator.add()
        >>> accumulator.write(scale=1.0); weight.grad.float().tolist()
        [1.0078125, 1.0078125, 1.0078125]
    """

    def __init__(self, params: Sequence[torch.Tensor], dtype: torch.dtype) -> None:
        self.params = list(params)
        self.dtype = dtype
        # one flat buffer per device, one reduction each: the parameters' buffers, then one flag per parameter (did
        # it receive a gradient in the window), so that a reduction also tells which parameters no rank touched
        self._flat: dict[torch.device, torch.Tensor] = {}
        self._flags: dict[torch.device, torch.Tensor] = {}
        self.buffers: list[torch.Tensor] = []
        self._touched = [False] * len(self.params)  # which buffers received a gradient in this window
        self._on_device: dict[torch.device, list[int]] = {}  # the parameters' indices, per device
        for index, param in enumerate(self.params):
            self._on_device.setdefault(param.device, []).append(index)
        for device, indices in self._on_device.items():
            numel = sum(self.params[i].numel() for i in indices)
            self._flat[device] = torch.zeros(numel + len(indices), dtype=dtype, device=device)
            self._flags[device] = self._flat[device][numel:]
        offsets = dict.fromkeys(self._flat, 0)
        for param in self.params:
            start = offsets[param.device]
            self.buffers.append(self._flat[param.device][start : start + param.numel()].view_as(param))
            offsets[param.device] = start + param.numel()

    @property
    def nbytes(self) -> int:
        """The memory the buffers hold."""
        return sum(flat.numel() * flat.element_size() for flat in self._flat.values())

    def zero(self) -> None:
        """Start a new window: the first gradient each buffer receives replaces what it held."""
        self._touched = [False] * len(self.params)

    def add(self, weight: float | torch.Tensor = 1.0) -> None:
        """Move each parameter's ``.grad`` (one micro-batch's gradient) into its buffer, leaving ``.grad`` None.

        The next backward then writes its gradient into a fresh ``.grad`` (autograd takes it over without adding),
        and no pass zeroes anything: a buffer's first gradient of the window is copied, the later ones are added.
        ``weight`` multiplies the gradient in the buffers' dtype (a one-element tensor stays on its device).
        """
        first: list[tuple[torch.Tensor, torch.Tensor]] = []
        later: list[tuple[torch.Tensor, torch.Tensor]] = []
        for index, (buffer, param) in enumerate(zip(self.buffers, self.params, strict=True)):
            if param.grad is None:
                continue
            (later if self._touched[index] else first).append((buffer, param.grad))
            self._touched[index] = True
            param.grad = None
        if first:
            torch._foreach_copy_([b for b, _ in first], [g for _, g in first])
            if isinstance(weight, torch.Tensor) or weight != 1.0:
                torch._foreach_mul_([b for b, _ in first], _scalar(weight, self.dtype))
        if not later:
            return
        if isinstance(weight, torch.Tensor):  # computed in the buffers' dtype: they decide the result type
            for buffer, grad in later:
                buffer.addcmul_(grad, weight.to(self.dtype))
        else:
            torch._foreach_add_([b for b, _ in later], [g for _, g in later], alpha=weight)

    def reduce(self, all_reduce_sum: Callable[[torch.Tensor], None], world_size: int) -> None:
        """Sum the buffers over ranks with ``all_reduce_sum`` (in place, in the wide dtype) and divide by the ranks.

        Every rank's buffers take part whole (one that received no gradient in the window is zeroed first); a
        parameter that no rank touched keeps no gradient.
        """
        for device, on_device in self._on_device.items():
            for index in on_device:
                if not self._touched[index]:
                    self.buffers[index].zero_()
            self._flags[device].copy_(torch.tensor([float(self._touched[i]) for i in on_device]))
            all_reduce_sum(self._flat[device])
            if world_size > 1:
                self._flat[device][: -len(on_device) or None].div_(world_size)
            touched = self._flags[device].tolist()
            for slot, index in enumerate(on_device):
                self._touched[index] = touched[slot] > 0

    def write(self, scale: float | torch.Tensor) -> None:
        """Put ``scale x buffer`` into the ``.grad`` of each parameter that received a gradient, rounded once."""
        touched = [(b, p) for b, p, t in zip(self.buffers, self.params, self._touched, strict=True) if t]
        scale_in_place([buffer for buffer, _ in touched], scale)  # a parameter without a gradient keeps None
        for buffer, param in touched:
            param.grad = buffer.to(param.dtype)


def scale_in_place(tensors: list[torch.Tensor], scale: float | torch.Tensor) -> None:
    """Multiply ``tensors`` by ``scale`` in place, a host number or a 0-d tensor used where it is (never read).

    Nothing is done for the host number 1; a scale computed on the device stays there.

    Example::

        >>> grads = [torch.ones(2)]
        >>> scale_in_place(grads, torch.tensor(0.5)); grads
        [tensor([0.5000, 0.5000])]
    """
    if tensors and (isinstance(scale, torch.Tensor) or scale != 1.0):
        torch._foreach_mul_(tensors, scale)


def _scalar(weight: float | torch.Tensor, dtype: torch.dtype) -> Any:
    return weight.to(dtype) if isinstance(weight, torch.Tensor) else weight
