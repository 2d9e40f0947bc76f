"""Learning-rate rules for a changing effective batch, and how a scale reaches the optimizer.

This module owns the arithmetic of the scale (none, linear or square root of effective / base batch), its optional
warmup when it jumps, and applying it to an optimizer *only for its update*: the scale multiplies each param group's
``lr`` once the step's closure has run and the scheduler's own value is put back in the step's post-hook, so an LR
scheduler (StepLR, warmup then cosine, OneCycleLR) keeps its shape and never sees the scale. Pure: no Lightning import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, get_args

from torch.optim import LBFGS, Optimizer
from torch.utils.hooks import RemovableHandle

LRScaling = Literal["none", "linear", "sqrt"]
LR_RULES: tuple[str, ...] = get_args(LRScaling)


def check_rule(rule: object) -> LRScaling:
    """Return ``rule`` if it is ``'none'``, ``'linear'`` or ``'sqrt'``.

    Raises:
        ValueError: Otherwise, naming the allowed values.

    Example::

        >>> check_rule("sqrt")
        'sqrt'
    """
    if rule not in LR_RULES:
        raise ValueError(f"`lr_scaling` must be one of 'none', 'linear' or 'sqrt', got {rule!r}")
    return rule  # type: ignore[return-value]


SCALE_WARNING = 4.0
"""The LR scale past which a run without ``lr_scale_max`` is warned, once: a scaled LR that diverges is the most
likely way a growing batch fails (the linear rule is exact only for small steps, Goyal et al. 2017)."""


def check_max_scale(value: object) -> float | None:
    """Return ``value`` (``lr_scale_max``) as a float if it is ``None`` or a finite number >= 1.

    Raises:
        ValueError: Otherwise, naming the argument and the value.

    Example::

        >>> check_max_scale(8)
        8.0
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 1.0 <= value < math.inf:
        raise ValueError(f"`lr_scale_max` must be a finite number >= 1 or None, got {value!r}")
    return float(value)


def lr_scale(rule: LRScaling, effective_batch_size: float, base_batch_size: float) -> float:
    """The factor by which the configured learning rate is multiplied at ``effective_batch_size``.

    ``linear``: Goyal et al. 2017 (arXiv:1706.02677), for SGD. ``sqrt``: Krizhevsky 2014 (arXiv:1404.5997) and Malladi
    et al. 2022 (arXiv:2205.10287), for Adam-type optimizers.

    Example::

        >>> lr_scale("sqrt", 64, 256)
        0.5
        >>> lr_scale("linear", 64, 256)
        0.25
    """
    if rule == "none":
        return 1.0
    ratio = effective_batch_size / base_batch_size
    return ratio if rule == "linear" else math.sqrt(ratio)


def cap_factor(rule: LRScaling, max_scale: float | None, base_batch_size: float, batch_per_factor: float) -> int | None:
    """The largest factor whose LR scale the rule reaches within ``max_scale`` (``None``: nothing is capped).

    Past it the scale stays at ``max_scale`` while the batch grows: each sample then moves the weights less, as a
    decayed LR would. ``batch_per_factor`` is the effective batch of one unit of factor, in ``base_batch_size``'s
    unit.

    Example::

        >>> cap_factor("linear", 4.0, base_batch_size=8, batch_per_factor=8)  # the scale reaches 4 at factor 4
        4
        >>> cap_factor("sqrt", 2.0, base_batch_size=8, batch_per_factor=8)  # sqrt(4) = 2
        4
        >>> cap_factor("linear", None, base_batch_size=8, batch_per_factor=8) is None
        True
    """
    if max_scale is None or rule == "none" or batch_per_factor <= 0:
        return None
    capped_batch = base_batch_size * (max_scale if rule == "linear" else max_scale**2)
    return max(1, math.floor(capped_batch / batch_per_factor + 1e-9))


def held_window_scale(
    rule: LRScaling,
    scale: float,
    held_batch: float,
    full_batch: float,
    base_batch_size: float,
    max_scale: float | None = None,
) -> float:
    """The scale for a window that holds ``held_batch`` of the ``full_batch`` its factor was scaled for.

    ``scale`` is the factor's scale (its warmup included). A window cut short (an epoch's last, ``limit_train_batches``)
    steps at the rate of the batch it holds: the rule's scale at ``held_batch`` (capped at ``max_scale``), never more
    than ``scale``, so with the warmup done it is exactly the rule at ``held_batch``, and a warmup still rising from a
    smaller scale keeps its value. Past the cap (the rule's scale at ``full_batch`` above ``max_scale``) the factor's
    batch grew while its rate did not, as a decayed rate would: a short window keeps that decay, the factor's scale
    times the rule's ratio of the held batch to the full one (its rate per sample under the linear rule), where the
    rule at the held batch alone would step the last, noisiest window of an epoch at up to the factor over the cap's
    factor times the full window's rate per sample. A full window, or the rule ``"none"``, keeps ``scale``.

    Example::

        >>> held_window_scale("linear", 4.0, held_batch=8, full_batch=32, base_batch_size=8)  # 1 micro-batch of 4
        1.0
        >>> held_window_scale("sqrt", 2.0, held_batch=8, full_batch=32, base_batch_size=8)
        1.0
        >>> held_window_scale("linear", 2.0, held_batch=24, full_batch=32, base_batch_size=8, max_scale=2.0)  # 2 x 3/4
        1.5
        >>> held_window_scale("linear", 1.5, held_batch=16, full_batch=32, base_batch_size=8)  # warming up to 4
        1.5
    """
    if rule == "none" or held_batch >= full_batch:
        return scale
    held, full = lr_scale(rule, held_batch, base_batch_size), lr_scale(rule, full_batch, base_batch_size)
    if max_scale is not None and full > max_scale:  # past the cap: the full window's decay, kept
        return scale * held / full
    return min(scale, held if max_scale is None else min(held, max_scale))


def lr_summary(lr: float, rule: LRScaling, effective_batch_size: float, base_batch_size: float) -> str:
    """How the configured learning rate becomes the one used at ``effective_batch_size``, for the run's summary.

    Example::

        >>> lr_summary(3e-4, "sqrt", 64, 256)
        'lr 0.0003 x sqrt(64/256) = 0.00015'
    """
    if rule == "none":
        return f"lr {lr:g} (not scaled)"
    ratio = f"{effective_batch_size:g}/{base_batch_size:g}"
    scaled = lr * lr_scale(rule, effective_batch_size, base_batch_size)
    rule_text = f"({ratio})" if rule == "linear" else f"sqrt({ratio})"
    return f"lr {lr:g} x {rule_text} = {scaled:g}"


@dataclass
class ScaleWarmup:
    """A scale that moves linearly to each new value over ``steps`` optimizer steps (Goyal et al.'s gradual warmup).

    Training starts from a scale of 1 (the configured learning rate). When :meth:`set` gives a new target at step
    ``t``, the scale at step ``t + i`` is ``start + (target - start) * min(1, i / steps)``, where ``start`` is the scale
    that was in force at ``t``. With ``steps=0`` the scale jumps.

    Example::

        >>> warmup = ScaleWarmup(steps=4)
        >>> warmup.set(2.0, step=0)
        >>> [warmup.value(s) for s in range(6)]
        [1.0, 1.25, 1.5, 1.75, 2.0, 2.0]
    """

    steps: int = 0
    start: float = 1.0
    target: float = 1.0
    since: int = 0

    def set(self, target: float, step: int) -> None:
        """Aim for ``target`` from optimizer step ``step`` on (nothing happens if it is already the target)."""
        if target != self.target:
            self.start, self.target, self.since = self.value(step), target, step

    def value(self, step: int) -> float:
        """The scale at optimizer step ``step``."""
        if self.steps <= 0 or step >= self.since + self.steps:
            return self.target
        return self.start + (self.target - self.start) * (step - self.since) / self.steps

    def state_dict(self) -> dict[str, Any]:
        """The warmup's position, for checkpoints."""
        return {"start": self.start, "target": self.target, "since": self.since}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position saved by :meth:`state_dict`; missing keys keep their defaults."""
        self.start = float(state.get("start", 1.0))
        self.target = float(state.get("target", 1.0))
        self.since = int(state.get("since", 0))


class ScaledStep:
    """Multiply every param group's learning rate by ``scale()`` for the optimizer's update, and only then.

    Lightning runs the window's last micro-step (forward, backward, ``on_before_optimizer_step``, clipping) inside
    ``optimizer.step(closure)``. The scale is applied after that closure returns, just before the update, and the
    configured values are put back right after it, so no hook, exception or checkpoint ever sees a scaled ``lr``
    (without a closure, as under AMP's GradScaler, and for L-BFGS, which reads its ``lr`` before calling the closure,
    it is applied as the step begins).

    With ``beta2_power``, Adam's ``beta2`` is raised to its value for the update too (``beta2 ** (batch / base)``:
    the second moment's half-life kept in samples or tokens, Marek et al. 2025) and put back with the rate.

    Args:
        optimizer: The optimizer to scale.
        scale: Returns the scale for the step about to be taken.
        beta2_power: Returns the power for ``beta2`` in the step about to be taken; ``None``: ``betas`` untouched.

    Example::

        >>> import torch
        >>> param = torch.nn.Parameter(torch.ones(1)); param.grad = torch.ones(1)
        >>> optimizer = torch.optim.SGD([param], lr=0.1)
        >>> scaled = ScaledStep(optimizer, lambda: 2.0)
        >>> seen = []
        >>> optimizer.step(lambda: seen.append(optimizer.param_groups[0]["lr"]))
        >>> round(param.item(), 6), optimizer.param_groups[0]["lr"], seen  # the closure saw the configured lr
        (0.8, 0.1, [0.1])
        >>> scaled.remove()
    """

    def __init__(self, optimizer: Optimizer, scale: Any, beta2_power: Any = None) -> None:
        self._optimizer = optimizer
        self._scale = scale
        self._beta2_power = beta2_power
        self._unscaled: list[Any] | None = None
        self._betas: list[Any] = []  # the param groups' configured betas while the power is applied
        self._handles: list[RemovableHandle] = [
            optimizer.register_step_pre_hook(self._before_step),
            optimizer.register_step_post_hook(self._restore),
        ]

    @property
    def optimizer(self) -> Optimizer:
        """The optimizer this scale is attached to."""
        return self._optimizer

    @property
    def applied(self) -> bool:
        """Whether the scale is in the optimizer now (during the update, or inside ``step`` after the closure)."""
        return self._unscaled is not None

    def configured(self) -> list[float]:
        """The param groups' learning rates without the scale, also while it is applied."""
        if self._unscaled is not None:
            return list(self._unscaled)
        return [group["lr"] for group in self._optimizer.param_groups]

    def configured_betas(self) -> list[Any]:
        """The param groups' ``betas`` without the power (``None`` for a group without), also while it is applied."""
        if self._betas:
            return list(self._betas)
        return [group.get("betas") for group in self._optimizer.param_groups]

    def _before_step(self, optimizer: Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # torch hands a pre-hook the step's own arguments: (optimizer, closure?) and its keywords
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None or isinstance(optimizer, LBFGS):  # L-BFGS reads its lr before it calls the closure
            self._apply(optimizer)
            return None

        def scaled_closure() -> Any:
            result = closure()
            self._apply(optimizer)  # the closure is done: only the update is left
            return result

        if "closure" in kwargs:
            return args, {**kwargs, "closure": scaled_closure}
        return (args[0], scaled_closure, *args[2:]), kwargs

    def _apply(self, optimizer: Optimizer) -> None:
        if self._unscaled is not None:  # once per step
            return
        scale = self._scale()
        self._unscaled = [group["lr"] for group in optimizer.param_groups]
        if scale != 1.0:
            for group in optimizer.param_groups:
                group["lr"] = group["lr"] * scale
        power = 1.0 if self._beta2_power is None else self._beta2_power()
        if power != 1.0:
            self._betas = [group.get("betas") for group in optimizer.param_groups]
            for group in optimizer.param_groups:
                if "betas" in group:
                    beta1, beta2 = group["betas"]
                    group["betas"] = (beta1, beta2**power)

    def _restore(self, optimizer: Optimizer, *_: Any) -> None:
        if self._unscaled is None:
            return
        for group, lr in zip(optimizer.param_groups, self._unscaled, strict=True):
            group["lr"] = lr
        for group, betas in zip(
            optimizer.param_groups, self._betas or [None] * len(optimizer.param_groups), strict=True
        ):
            if betas is not None:
                group["betas"] = betas
        self._unscaled, self._betas = None, []

    def remove(self) -> None:
        """Detach from the optimizer, putting back the configured values if an update raised while scaled."""
        self._restore(self._optimizer)
        for handle in self._handles:
            handle.remove()
        self._handles = []
