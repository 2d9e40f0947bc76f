"""The Fabric methods the Accumulator shadows on the user's objects while it needs them, and why.

- ``fabric.load`` of a sharded checkpoint keeps the Accumulator in ``state`` (:func:`keep_on_load`, while the
  Accumulator is open). ``fabric.load(path, state)`` restores a stateful entry of ``state`` in place
  (``load_state_dict``) for full checkpoints and for most strategies, but Lightning's ``FSDPStrategy`` and
  ``ModelParallelStrategy`` (FSDP2) load a *sharded* checkpoint's other entries by replacing them in ``state`` with
  what was saved (``state[key] = metadata.pop(key)`` in ``lightning/fabric/strategies/model_parallel.py``, Lightning
  2.5 to 2.6): the Accumulator would fall out of the user's ``state`` as a plain dict, unrestored, and the run would
  restart at step 0 with the loaded weights. ``load_checkpoint`` (the strategy's public method ``fabric.load``
  calls) is shadowed on the strategy instance by one that, after the strategy's own, hands each plain dict that
  replaced an Accumulator to its ``load_state_dict`` and puts the Accumulator back; where the strategy restored it in
  place already, it does nothing. The shadow goes when the last Accumulator on the strategy closes.
  ``tests/test_fsdp2_checkpoints.py`` holds the contract test: it fails if Lightning stops replacing the entry.
- ``fabric.backward`` raises inside a ``micro_step`` block (:func:`own_backward`, for the block's duration).

Torch's distributed checkpoint steps the optimizer once to create its state (:func:`initializes_state`): the
Accumulator's step guard lets that step pass.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

_SHADOW = "load_checkpoint"


def keep_on_load(strategy: Any, stateful: type) -> Callable[[], None]:
    """Make ``strategy.load_checkpoint`` restore each ``stateful`` object of ``state`` in place; returns the undo.

    Args:
        strategy: The Fabric's strategy (``fabric.strategy``).
        stateful: The class whose instances must stay in ``state`` (the Accumulator).
    """
    shadow = strategy.__dict__.get(_SHADOW)
    if shadow is None or not hasattr(shadow, "users"):
        shadow = _shadow(strategy.load_checkpoint, stateful)
        setattr(strategy, _SHADOW, shadow)
    shadow.users += 1

    def undo() -> None:
        shadow.users -= 1
        if shadow.users == 0 and strategy.__dict__.get(_SHADOW) is shadow:
            delattr(strategy, _SHADOW)

    return undo


def _shadow(load_checkpoint: Callable[..., Any], stateful: type) -> Any:
    signature = inspect.signature(load_checkpoint)

    def shadow(*args: Any, **kwargs: Any) -> Any:
        state = signature.bind(*args, **kwargs).arguments.get("state")
        held: dict[str, Any] = {}
        if isinstance(state, dict):
            held = {key: obj for key, obj in state.items() if isinstance(obj, stateful)}
        remainder = load_checkpoint(*args, **kwargs)
        for key, obj in held.items():
            loaded = state.get(key)  # type: ignore[union-attr]
            if loaded is not obj and isinstance(loaded, dict):  # the strategy replaced it with the saved state
                obj.load_state_dict(loaded)
                state[key] = obj  # type: ignore[index]
        return remainder

    shadow.users = 0  # type: ignore[attr-defined]
    return shadow


def initializes_state(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a step outside any window is torch's distributed checkpoint creating the optimizer's state.

    ``torch.distributed.checkpoint.state_dict`` (``fabric.save`` and ``fabric.load`` under FSDP2 and FSDP) gives an
    optimizer without state and without gradients zero gradients and steps it once with every learning rate set to 0,
    then puts the learning rates back: a step that moves no weight, which the Accumulator does not count. A step at
    learning rate 0 on a real gradient (a warmup from 0 stepped too early) is none: it is refused as any early step.
    Reads each gradient's local values, only in that case (an early step at learning rate 0).
    """
    groups = optimizer.param_groups
    if optimizer.state or not groups or any(float(group.get("lr", 1.0)) != 0.0 for group in groups):
        return False
    grads = [p.grad for group in groups for p in group["params"] if p.requires_grad]
    if not grads or any(grad is None for grad in grads):
        return False
    local = [grad.to_local() if hasattr(grad, "to_local") else grad for grad in grads]  # no collective on a DTensor
    return not bool(
        torch.stack([t.detach().abs().amax().float() if t.numel() else t.new_zeros(()) for t in local]).any()
    )


@contextmanager
def own_backward(fabric: Any) -> Iterator[Callable[..., Any]]:
    """Inside a ``micro_step`` block ``fabric.backward`` raises; yields Fabric's own, which ``micro.backward`` calls.

    A second backward in a block adds a gradient that none of the window's weights was applied to (measured:
    ``fabric.backward(loss)`` beside ``micro.backward(loss)`` trained on a doubled, wrongly weighted gradient without a
    word). The Fabric instance's own attribute shadows its method for the block's duration only.
    """
    own = fabric.backward
    shadowed = "backward" in vars(fabric)  # the user's own attribute (a wrapper), put back after the block

    def refused(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            "fabric.backward(loss) was called inside a `micro_step` block: `micro.backward(loss)` backpropagates the"
            " micro-batch's share of the window's loss (through fabric.backward), and another backward would add a"
            " gradient weighed wrongly into the window's. Call `micro.backward(loss)` alone in the block (the window"
            " was dropped: no step takes its gradient)"
        )

    fabric.backward = refused
    try:
        yield own
    finally:
        if vars(fabric).get("backward") is refused:
            if shadowed:
                fabric.backward = own
            else:
                del fabric.backward
