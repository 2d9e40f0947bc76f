"""DeepSpeed ZeRO under our windows: the config that lets the caller own accumulation, and the window's gradient.

What both loops (``lightning_accum.DeepSpeedAccumulationStrategy`` for the Trainer,
``lightning_accum.fabric.DeepSpeedAccumulationStrategy`` and ``Accumulator`` for Fabric) need of DeepSpeed:

- :func:`unmanaged_config`: DeepSpeed's *unmanaged* accumulation (``managed_gradient_accumulation: false``,
  ``gradient_accumulation_steps: 1``): ``engine.backward`` only accumulates, every ``engine.step()`` is one optimizer
  step over however many micro-batches came before it, and the caller divides each loss once;
- :func:`fold_scale` and :class:`FoldedScale`: the window's gradient lives in ZeRO's partitions, not in ``.grad``: a
  scale (a window whose micro-batches are weighed by their items) is folded into the divisor ZeRO applies before
  clipping and the update, for that step;
- :func:`drop_window`: a window abandoned before its step leaves ZeRO stage 2's reduced partitions behind, which
  ``zero_grad`` does not reach;
- :func:`initialize_on_rank`: on CPU (tests, with gloo) ``deepspeed.initialize`` is given the local rank where
  Lightning passes ``root_device.index`` (``None``).

Pure: torch and DeepSpeed (imported where used), no Lightning.
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Generator, Iterable, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch.optim import Optimizer

OWNED = ("gradient_accumulation_steps", "train_batch_size")  # the window's size is ours, not the config's


def config_stage(config: Mapping[str, Any] | None) -> int:
    """The ZeRO stage of a DeepSpeed config (0 without ``zero_optimization``).

    Example::

        >>> config_stage({"zero_optimization": {"stage": 2}}), config_stage(None)
        (2, 0)
    """
    return int(((config or {}).get("zero_optimization") or {}).get("stage", 0))


def unmanaged_config(
    config: Mapping[str, Any] | None, overlap_asked: bool, owner: str, arguments: str
) -> dict[str, Any]:
    """A copy of ``config`` with DeepSpeed's unmanaged accumulation (the caller's windows decide every step).

    Args:
        config: The user's DeepSpeed config (never changed).
        overlap_asked: Whether the user asked for ``overlap_comm`` (then it is refused under ZeRO stage 0 or 1, where
            unmanaged accumulation reduces in ``step()``, after the last backward; else it is turned off there).
        owner: Who owns the accumulation, for the message (``"with X the AccumulationScheduler"``).
        arguments: Whose arguments give the factor instead, for the message (``"AccumulationScheduler"``).

    Raises:
        ValueError: If ``config`` sets ``gradient_accumulation_steps`` or ``train_batch_size``, turns
            ``managed_gradient_accumulation`` on, or ``overlap_comm`` was asked for under ZeRO stage 0 or 1.

    Example::

        >>> unmanaged_config({"zero_optimization": {"stage": 2}}, False, "the Accumulator", "Accumulator")
        {'zero_optimization': {'stage': 2}, 'managed_gradient_accumulation': False}
    """
    copied: dict[str, Any] = copy.deepcopy(dict(config or {}))
    for key in (*OWNED, "managed_gradient_accumulation"):
        if key in copied and not (key == "managed_gradient_accumulation" and copied[key] is False):
            raise ValueError(
                f"The DeepSpeed config sets {key!r} ({copied[key]!r}), but {owner} owns accumulation: remove it, and"
                f" give the factor as {arguments}(scheduling=...) or the global batch as target_batch_size=..."
            )
    zero = copied.get("zero_optimization") or {}
    if zero.get("stage", 0) < 2 and zero.get("overlap_comm"):
        if overlap_asked:
            raise ValueError(
                f"overlap_comm=True under ZeRO stage {zero.get('stage', 0)}: DeepSpeed's unmanaged accumulation"
                " reduces this stage's gradients in step(), after the last backward, so there is nothing to"
                " overlap: set overlap_comm to false (or use stage 2 or 3)"
            )
        zero["overlap_comm"] = False  # Lightning's default, which DeepSpeed refuses here
    copied["managed_gradient_accumulation"] = False
    return copied


def updating_optimizer(optimizer: Any) -> Any:
    """The ``torch.optim.Optimizer`` that updates the weights: DeepSpeed's ZeRO wrappers hold it as ``.optimizer``.

    Example::

        >>> sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        >>> updating_optimizer(sgd) is sgd
        True
    """
    inner = getattr(optimizer, "optimizer", None)
    if not isinstance(optimizer, Optimizer) and isinstance(inner, Optimizer):
        return inner
    return optimizer


def fold_scale(optimizer: Any, scale: float | torch.Tensor, params: Iterable[torch.Tensor]) -> float | None:
    """Make the step about to run use the window's gradient times ``scale``; what to give back after it.

    ZeRO's optimizers divide the gradient by their loss scale just before clipping and the update, so ``scale`` is
    folded into that divisor; the caller multiplies ``optimizer.loss_scale`` by the returned value after the step
    (keeping any change DeepSpeed's dynamic scaler made). Without ZeRO (a plain torch optimizer), the local gradients
    of ``params`` are scaled now (DeepSpeed all-reduces them in ``step()``), and nothing is to be given back.

    Raises:
        ValueError: If the optimizer's loss scale is one DeepSpeed does not let the caller set.
    """
    value = float(scale)  # the ZeRO optimizer keeps its loss scale on the host: once per window
    if value == 1.0:
        return None
    if not hasattr(optimizer, "loss_scale") or getattr(optimizer, "custom_loss_scaler", False):
        if isinstance(optimizer, Optimizer):  # ZeRO stage 0
            with torch.no_grad():
                for param in params:
                    if param.grad is not None:
                        param.grad.mul_(value)
            return None
        raise ValueError(
            f"{type(optimizer).__name__} has no loss scale that can be set, so the window's gradient cannot be"
            " corrected: use normalize_by='micro_batch'"
        )
    optimizer.loss_scale = optimizer.loss_scale / value
    return value


class FoldedScale:
    """A window's gradient scale folded into a ZeRO optimizer's loss scale for one step, and given back after it.

    A strategy calls :meth:`fold` before its step and runs the step inside :meth:`step`.

    Example::

        >>> sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        >>> folded = FoldedScale()
        >>> folded.fold(sgd, 1.0, []);
        >>> with folded.step():
        ...     pass
    """

    def __init__(self) -> None:
        self._folded: tuple[Any, float] | None = None  # (optimizer, what to multiply its loss scale by after the step)

    def fold(self, optimizer: Any, scale: float | torch.Tensor, params: Iterable[torch.Tensor]) -> None:
        """Make the coming step use the window's gradient times ``scale`` (:func:`fold_scale`)."""
        given_back = fold_scale(optimizer, scale, params)
        if given_back is not None:
            self._folded = (optimizer, given_back)

    @contextmanager
    def step(self) -> Generator[None, None, None]:
        """Around the step: after it, the loss scale as DeepSpeed's scaler left it, without the window's scale."""
        try:
            yield
        finally:
            if self._folded is not None:
                optimizer, given_back = self._folded
                optimizer.loss_scale = optimizer.loss_scale * given_back
                self._folded = None


def drop_window(optimizer: Any) -> None:
    """Forget the gradient of a window abandoned before its step (ZeRO stage 2 keeps it where ``zero_grad`` cannot).

    Under ZeRO stage 2 DeepSpeed keeps each backward's reduced gradient in its partitions until ``step()``: they are
    dropped as DeepSpeed drops them itself after an overflow. Stage 3 and no ZeRO: ``zero_grad`` clears them.
    """
    from deepspeed.runtime.zero.stage_1_and_2 import INITIAL_MICRO_STEP_ID, DeepSpeedZeroOptimizer

    if not isinstance(optimizer, DeepSpeedZeroOptimizer):
        return
    optimizer.zero_grad(set_to_none=True)
    optimizer._release_preflattened_grad_buffers()
    if optimizer.cpu_offload:
        optimizer.reset_cpu_buffers()
    for group in optimizer.averaged_gradients:
        optimizer.averaged_gradients[group] = None
        optimizer.all_grad_tensors[group] = None
    optimizer.micro_step_id = INITIAL_MICRO_STEP_ID


@contextmanager
def initialize_on_rank(device_rank: int | None) -> Generator[None, None, None]:
    """Give ``deepspeed.initialize`` ``device_rank`` (the local rank) where the caller passes ``None`` (on CPU).

    Lightning passes ``root_device.index`` as DeepSpeed's ``device_rank``, which is ``None`` on CPU; with
    ``device_rank=None`` nothing changes.
    """
    import deepspeed

    initialize = deepspeed.initialize
    if device_rank is None:
        yield
        return

    def on_rank(*args: Any, **kwargs: Any) -> Any:
        kwargs["args"] = argparse.Namespace(device_rank=device_rank)
        return initialize(*args, **kwargs)

    deepspeed.initialize = on_rank
    try:
        yield
    finally:
        deepspeed.initialize = initialize
