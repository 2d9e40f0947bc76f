"""What the Accumulator refuses before any weight changes, besides the misuse of a loop's blocks.

Arguments that contradict, an optimizer (or parameters) it cannot serve, a step before the window's gradient is final.
Lightning glue (Fabric's strategies); the misuse of a loop's blocks is checked where it happens, in the Accumulator
(``fabric.backward`` inside a block: :mod:`~lightning_accum.fabric._shadows`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_accum.compat.lightning import fabric_names
from lightning_accum.compat.torch import require_fsdp2
from lightning_accum.core.sample_driven_lr import SampleDrivenLR
from lightning_accum.core.schedule import check_bool
from lightning_accum.core.window import Window
from lightning_accum.distributed.sync import fsdp2_modules

# optimizers an open Accumulator steps -> the ids of their parameters
_IN_USE: weakref.WeakKeyDictionary[torch.optim.Optimizer, frozenset[int]] = weakref.WeakKeyDictionary()


def check_shift_labels(shift_labels: object, count_items: Any, normalize_by: str, unit: str) -> None:
    """``shift_labels`` counts the labels' tokens: it needs a token count (weighting or schedule), no ``count_items``.

    Raises:
        TypeError: If ``shift_labels`` is not a bool.
        ValueError: If it is on where it counts nothing.
    """
    if check_bool("shift_labels", shift_labels) and (count_items is not None or "token" not in (normalize_by, unit)):
        raise ValueError(
            "`shift_labels=True` counts the tokens of labels[..., 1:]: use it with normalize_by='token' or"
            f" unit='token' and without `count_items` (got normalize_by={normalize_by!r}, unit={unit!r},"
            f" count_items={count_items!r})"
        )


def check_fsdp2(module: nn.Module) -> None:
    """Refuse a model with ``fully_shard`` units on a torch older than the FSDP2 mechanics' floor."""
    if fsdp2_modules(module):
        require_fsdp2(
            "the Accumulator on a model with `fully_shard` (FSDP2) units",
            "accumulate without it (each micro-batch's loss divided by the factor, FSDP2 then reduce-scatters on"
            " every micro-step), or train the model with DDPStrategy or FSDPStrategy (FSDP1)",
        )


def check_optimizer(fabric: Fabric, model: Any, optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer that another open Accumulator steps, or that misses trainable parameters of the model.

    And a model with ``fully_shard`` units on a torch below the FSDP2 floor (:func:`check_fsdp2`).

    Raises:
        RuntimeError: From :func:`check_fsdp2`.
        ValueError: If another Accumulator holds ``optimizer`` (each would scale its learning rate) or parameters of
            it (each would weigh and step their gradients), or it does not hold every trainable parameter (their
            gradients would miss the window's weighting; under DeepSpeed ZeRO's optimizer holds partitions of them
            all).
    """
    check_fsdp2(getattr(model, "_forward_module", model))  # what the strategy's parallelize_fn returned
    if optimizer in _IN_USE:
        raise ValueError(
            "`optimizer` already has an Accumulator: two would each scale its learning rate and its gradients."
            " Call `close()` on the first one before creating another"
        )
    mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for other, params in list(_IN_USE.items()):
        shared = mine & params
        if shared:
            module = getattr(model, "module", model)  # the user's names, not the Fabric wrapper's
            names = [name for name, p in module.named_parameters() if id(p) in shared] or ["(unnamed)"]
            raise ValueError(
                f"`optimizer` ({type(optimizer).__name__}) holds {len(shared)} parameter(s) that an open Accumulator"
                f" already steps with its optimizer ({type(other).__name__}): {', '.join(names[:3])}"
                f"{', ...' if len(names) > 3 else ''}. Two Accumulators would each weigh the window's gradients of"
                " those parameters and step them. Call `close()` on the first Accumulator before creating another,"
                " or give each optimizer parameters of its own"
            )
    if isinstance(fabric.strategy, fabric_names(fabric).DeepSpeedStrategy):
        return
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    missing = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in held]
    if missing:
        raise ValueError(
            f"`optimizer` does not hold {len(missing)} trainable parameter(s) of the model ({', '.join(missing[:3])}"
            f"{', ...' if len(missing) > 3 else ''}): the Accumulator weighs the window's gradients of its optimizer's"
            " parameters only. Pass one optimizer over every trainable parameter, or freeze the others"
            " (requires_grad=False)"
        )


def claim(optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    """``optimizer`` (and its parameters) is stepped by an open Accumulator from now on; returns the release."""
    _IN_USE[optimizer] = frozenset(id(p) for group in optimizer.param_groups for p in group["params"])

    def release() -> None:
        _IN_USE.pop(optimizer, None)

    return release


def early_step(window: Window, inside: bool) -> str:
    """What an ``optimizer.step()`` before the window's gradient is final is told (``inside`` a ``micro_step`` block).

    Example::

        >>> early_step(Window(size=4, taken=1, closed=False), inside=False)[:63]
        'optimizer.step() was called after micro-step 1 of a window of 4'
    """
    if inside:
        where = f"inside the `micro_step` block of micro-step {window.taken} of {window.size}"
    elif not window.closed:
        where = f"after micro-step {window.taken} of a window of {window.size}"
    else:
        where = "with no window's gradient ready (the window's last block raised, or the step was taken already)"
    return (
        f"optimizer.step() was called {where}: the gradient is not the window's mean. Step only when"
        " `micro.should_step` is true, after its `micro_step` block exits"
    )


def check_open(what: str, closed: bool) -> None:
    """Refuse ``Accumulator.what`` after ``close()``."""
    if closed:
        raise RuntimeError(f"Accumulator.{what} was called after `close()`: create a new Accumulator")


def check_entry(nested: bool, offered: bool) -> None:
    """Refuse a ``micro_step`` block inside another (``nested``), or on a batch ``batches`` did not just offer.

    Raises:
        RuntimeError: Saying how the blocks go.
    """
    if nested:
        raise RuntimeError(
            "Accumulator.micro_step was entered inside another `micro_step` block: enter it once per micro-batch,"
            " around the micro-batch's forward and `micro.backward(loss)`"
        )
    if not offered:
        raise RuntimeError(
            "Accumulator.micro_step takes the micro-batch `accumulator.batches(loader)` yielded last, once:"
            " `for batch in accumulator.batches(loader): with accumulator.micro_step(batch) as micro: ...`"
        )


def check_backed(loss: object, index: int, size: int) -> None:
    """A ``micro_step`` block must backpropagate its loss (``loss``: what ``micro.backward`` recorded, or ``None``)."""
    if loss is None:
        raise RuntimeError(
            f"The `micro_step` block of micro-batch {index} of {size} ended without `micro.backward(loss)`: every"
            " micro-batch of a window backpropagates its loss"
        )


def check_taken(offered: bool) -> None:
    """Refuse a micro-batch ``batches`` yielded and the loop did not train on (``offered``: it is still on offer)."""
    if offered:
        raise RuntimeError(
            "The micro-batch `accumulator.batches` yielded was not trained on: run each through"
            " `with accumulator.micro_step(batch) as micro: ...`"
        )


def check_between_windows(what: str, inside_block: bool, window: Window) -> None:
    """Refuse ``what`` inside a window (a ``micro_step`` block open, or a window not closed)."""
    if inside_block or not window.closed:
        raise RuntimeError(
            f"{what} was called inside a window (micro-step {window.taken} of {window.size}): call it between"
            " windows, after `optimizer.step()`"
        )


def driven(lr_scheduler: object, optimizer: torch.optim.Optimizer) -> list[tuple[Any, str, int]]:
    """The Accumulator's ``lr_scheduler`` as the LR schedulers the features move (``Run.lr_schedulers``).

    Raises:
        TypeError: If ``lr_scheduler`` is not a :class:`~lightning_accum.SampleDrivenLR`, or not over ``optimizer``.
    """
    if lr_scheduler is None:
        return []
    if not isinstance(lr_scheduler, SampleDrivenLR):
        raise TypeError(
            "`lr_scheduler` is moved by the samples or tokens the run consumes: wrap the scheduler,"
            f" `lr_scheduler=SampleDrivenLR(scheduler, steps=..., total=...)`, got {lr_scheduler!r}; a scheduler the"
            " loop steps itself needs no Accumulator argument"
        )
    inner = getattr(lr_scheduler.optimizer, "optimizer", lr_scheduler.optimizer)  # a Fabric-wrapped optimizer's
    if inner is not optimizer:
        raise TypeError(
            f"`lr_scheduler` ({type(lr_scheduler.scheduler).__name__}) schedules another optimizer than the"
            " Accumulator's: create it over the optimizer given to the Accumulator"
        )
    return [(lr_scheduler, "step", 1)]
