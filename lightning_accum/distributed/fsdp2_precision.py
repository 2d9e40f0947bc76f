"""FSDP2's window of narrow gradients weighed and summed in float32, reduced across ranks, and rounded once.

Under FSDP2 (``fully_shard``) the window's gradient is reduced across ranks, and cast to the sharded parameters'
dtype, inside the backward of its last micro-batch: no hook of the optimizer step can weigh it in a wider dtype
afterwards. Dividing each micro-batch's loss by the window's size before its backward rounds every bfloat16 gradient
of it (``1/3`` is no bfloat16 number: measured 317 ulps off the correctly rounded mean at factor 3 on 2 ranks). So
every micro-batch backpropagates its unscaled loss, and:

- :func:`widen_reduce_dtype` gives each unit whose gradients are narrower ``reduce_dtype=float32``: FSDP2 keeps the
  unreduced unsharded gradients of ``gradient_sync="last"`` in float32 and reduce-scatters them in float32;
- :class:`FSDP2Weights` moves each micro-batch's unsharded gradient, times its weight, into that float32 buffer as
  autograd writes it (a hook after each unsharded parameter's gradient accumulation), and multiplies each unit's
  reduced float32 shard by the window's scale (FSDP2's all-reduce hook, which runs on the reduced shard before FSDP2
  casts it to the shard's dtype).

The window's gradient is then the float32 weighted sum over its micro-batches and the ranks, rounded once. This reads
and writes torch-private FSDP2 state: a parameter's ``_unsharded_param`` and ``unsharded_accumulated_grad``, a param
group's ``mp_policy`` and ``_all_reduce_hook`` (torch 2.9 to 2.14; ``tests/test_torch_contract.py`` fails if they
change). Pure torch: no Lightning import.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_accum.core.precision import narrower
from lightning_accum.distributed.sync import fsdp2_param_groups


def widen_reduce_dtype(module: nn.Module | None, dtype: torch.dtype) -> Callable[[], None]:
    """Make every FSDP2 unit whose gradients are narrower than ``dtype`` accumulate and reduce them in ``dtype``.

    FSDP2 keeps the unreduced unsharded gradients of skipped reductions in its ``reduce_dtype`` when one is set
    (``MixedPrecisionPolicy(reduce_dtype=...)``), else in the gradients' own dtype, and reduce-scatters in that
    dtype; the reduced shard is cast to the sharded parameter's dtype once (measured in torch 2.13, see
    docs/strategies.md). This gives each narrower unit's policy ``reduce_dtype=dtype``, exactly what the user could
    have passed to ``fully_shard``, and applies it if FSDP2 already read the policy. Returns a function that puts the
    previous policies back.
    """
    changed: list[tuple[Any, Any]] = []  # (param group, previous policy)
    for group in fsdp2_param_groups(module):
        if narrower(_gradient_dtype(group) or dtype, dtype):
            changed.append((group, group.mp_policy))
            _set_policy(group, dataclasses.replace(group.mp_policy, reduce_dtype=dtype))

    def restore() -> None:
        for group, policy in reversed(changed):
            _set_policy(group, policy)

    return restore


def computes_narrower(module: nn.Module | None, dtype: torch.dtype) -> bool:
    """Whether some FSDP2 unit of ``module`` computes gradients narrower than ``dtype`` (before any reduce).

    Its ``param_dtype`` where the policy sets one (bfloat16 compute on float32 shards), else its shards' dtype; frozen
    units count too (a backbone unfrozen later trains in the same windows).
    """
    for group in fsdp2_param_groups(module):
        params = [p.sharded_param for p in group.fsdp_params]
        if params and narrower(group.mp_policy.param_dtype or params[0].dtype, dtype):
            return True
    return False


def _gradient_dtype(group: Any) -> torch.dtype | None:
    """The dtype a unit reduces its gradients in: its policy's ``reduce_dtype``, else its compute dtype.

    Read for every unit, frozen ones too: one unfrozen after the fit started must already reduce in the wide dtype.
    """
    params = [p.sharded_param for p in group.fsdp_params]
    policy = group.mp_policy
    return policy.reduce_dtype or policy.param_dtype or (params[0].dtype if params else None)


def _set_policy(group: Any, policy: Any) -> None:
    group.mp_policy = policy
    if all(hasattr(p, "reduce_dtype") for p in group.fsdp_params):  # FSDP2 initialised its dtypes already
        group._init_mp_dtypes()


class FSDP2Weights:
    """Weigh each backward's unsharded FSDP2 gradients in ``dtype`` as they accumulate; scale the reduced window's.

    Set :attr:`weight` before each backward (the micro-batch's share of the window); :meth:`arm` the window's scale
    before its last backward (the one that reduces), and :meth:`disarm` it at the step: it says whether a reduction
    applied it. Construct it after ``fully_shard`` (and :func:`widen_reduce_dtype`), call :meth:`watch` before each
    backward (FSDP2 creates a unit's unsharded parameters at its first all-gather), :meth:`remove` at the end.

    Args:
        module: The model, with ``fully_shard`` applied to it or to its submodules.
        dtype: The accumulation dtype (``torch.float32``).

    Example::

        weights = FSDP2Weights(model, torch.float32)
        for i, batch in enumerate(window):
            weights.watch()
            weights.weight = 1 / len(window)
            if i == len(window) - 1:
                weights.arm(1.0)
            with contextlib.nullcontext() if i == len(window) - 1 else skip_gradient_sync(model, "last"):
                loss_fn(model(batch)).backward()  # the unscaled loss
        assert weights.disarm()
        optimizer.step()
    """

    def __init__(self, module: nn.Module, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.weight: float | torch.Tensor = 1.0
        self._scale: float | torch.Tensor | None = None
        self._scaled = False  # whether a reduction applied the armed scale
        self._groups = fsdp2_param_groups(module)
        self._hooks: dict[int, Any] = {}  # id(FSDPParam) -> the hook on its unsharded parameter
        self._all_hooked = False
        self._previous = [(group, getattr(group, "_all_reduce_hook", None)) for group in self._groups]
        for group, previous in self._previous:
            group._all_reduce_hook = self._reduce_hook(previous)

    @property
    def params(self) -> list[torch.Tensor]:
        """The parameters FSDP2 manages (their sharded ``nn.Parameter`` s, as the module holds them)."""
        return [p.sharded_param for group in self._groups for p in group.fsdp_params]

    def watch(self) -> None:
        """Hook every trainable unsharded parameter FSDP2 has created (after its unit's first all-gather)."""
        if self._all_hooked:
            return
        complete = True
        for group in self._groups:
            hooked = len(self._hooks)
            for fsdp_param in group.fsdp_params:
                if id(fsdp_param) in self._hooks:
                    continue
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                if unsharded is None or not unsharded.requires_grad:  # not gathered yet, or frozen for now
                    complete = False
                    continue
                self._hooks[id(fsdp_param)] = unsharded.register_post_accumulate_grad_hook(self._move(fsdp_param))
            if len(self._hooks) > hooked and getattr(group, "_orig_dtype", True) is None:
                # a unit frozen when FSDP2 initialised it, unfrozen since: FSDP2 read its dtypes from its trainable
                # parameters (none), so it would neither cast its reduced gradient back nor reduce in float32
                group._init_mp_dtypes()
        self._all_hooked = complete

    def arm(self, scale: float | torch.Tensor) -> None:
        """Multiply the reduced float32 shards of the window's reducing backward by ``scale`` before their rounding."""
        self._scale, self._scaled = scale, False

    def disarm(self) -> bool:
        """Stop scaling reductions; whether one applied the armed scale (else the window's gradient lacks it)."""
        scaled = self._scaled
        self._scale, self._scaled = None, False
        return scaled

    def remove(self) -> None:
        """Remove the hooks and give every param group its own all-reduce hook back."""
        for handle in self._hooks.values():
            handle.remove()
        self._hooks, self._all_hooked = {}, False
        for group, previous in self._previous:
            group._all_reduce_hook = previous
        self._previous = []

    def _move(self, fsdp_param: Any) -> Callable[[torch.Tensor], None]:
        def hook(unsharded: torch.Tensor) -> None:
            grad = unsharded.grad
            if grad is None:
                return
            unsharded.grad = None  # FSDP2 then takes (or keeps) the wide sum alone
            weight = self.weight
            total = fsdp_param.unsharded_accumulated_grad
            if total is None:  # in the unit's reduce dtype, which FSDP2 reduces and casts back from
                total = grad.to(getattr(fsdp_param, "reduce_dtype", None) or grad.dtype, copy=True)
                if isinstance(weight, torch.Tensor) or weight != 1.0:
                    total.mul_(weight)
                fsdp_param.unsharded_accumulated_grad = total
            elif isinstance(weight, torch.Tensor):
                total.addcmul_(grad, weight.to(total.dtype))
            else:
                total.add_(grad, alpha=weight)

        return hook

    def _reduce_hook(self, previous: Callable[[torch.Tensor], None] | None) -> Callable[[torch.Tensor], None]:
        def hook(reduced: torch.Tensor) -> None:  # the unit's reduced shard, in its reduce dtype
            if previous is not None:
                previous(reduced)
            scale = self._scale
            if scale is None:
                return
            if isinstance(scale, torch.Tensor) or scale != 1.0:
                reduced.mul_(scale)
            self._scaled = True

        return hook
