"""LR scaling (``lr_scaling``, ``base_batch_size``, ``lr_warmup_steps``, ``lr_scale_max``): the LR follows the batch.

At each window's opening the scale's target is set from the factor's effective batch (linear or square-root rule of
:mod:`lightning_accum.core.scaling`, capped at ``lr_scale_max``, with an optional warmup); a window that holds fewer
micro-batches than its factor (an epoch's last, ``limit_train_batches``, an epoch of unknown length that ends) steps at
the rate of the batch it holds (past ``lr_scale_max``, with the full window's decay), without moving the warmup's
target. The scale multiplies each param group's ``lr`` only while ``optimizer.step()`` runs, so LR schedulers keep
their own shape. Always on: with ``lr_scaling="none"`` the scale is 1, no optimizer step is wrapped, and only
``accum/lr`` and ``accum/lr_scale`` are logged.

``accum/lr`` is the learning rate the step really used, read just before the step (after the window's last backward,
before the LR scheduler moves on), scale included; with several param groups of different rates each has its own
``accum/lr_group_<i>``. Adds the configured LR and its scaling to the run's summary, and a phrase whenever the scale's
target changes. Publishes ``ctx.lr_cap_factor`` at ``FIT_START`` (where ``lr_scale_max`` stops the scale).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_accum.core.events import Context, Feature
from lightning_accum.core.scaling import (
    SCALE_WARNING,
    ScaledStep,
    ScaleWarmup,
    cap_factor,
    check_max_scale,
    check_rule,
    held_window_scale,
    lr_scale,
    lr_summary,
)
from lightning_accum.core.schedule import check_bool, check_int


class LRScaling(Feature):
    """Scale the configured learning rate with the effective batch, inside each optimizer step only.

    Args:
        rule: ``"none"``, ``"linear"`` or ``"sqrt"``.
        base_batch_size: The global batch (in samples) at which the configured learning rate was tuned; by default
            the effective batch of the first window. Kept in the checkpoint, so a resumed run keeps its base.
        warmup_steps: Move the scale linearly to each new value over this many optimizer steps.
        max_scale: The largest scale (``lr_scale_max``): the rule's scale is capped there, with a warning the first
            time; ``None``: no cap, and a warning the first time the scaled LR passes :data:`SCALE_WARNING` (4) times
            the LR schedule's peak (the scale times the schedule's LR over its highest so far).
        beta2: Keep Adam's ``beta2`` half-life fixed in samples (or tokens) as the batch changes
            (``beta2_follows_batch``): each update uses ``beta2 ** (batch / base_batch_size)`` (Marek et al. 2025),
            logged as ``accum/beta2``; the param groups keep their own ``betas`` outside the update.

    Raises:
        TypeError: If ``base_batch_size`` or ``warmup_steps`` is not an integer.
        ValueError: If ``rule`` is unknown or a number is out of range; at ``FIT_START``, if ``base_batch_size`` is
            given and the micro-batch size is unknown, or ``beta2`` is on and an optimizer has no ``betas``.

    Example::

        >>> import torch
        >>> from lightning_accum.core.events import Context, Event, Features
        >>> param = torch.nn.Parameter(torch.zeros(1)); param.grad = torch.ones(1)
        >>> optimizer = torch.optim.SGD([param], lr=0.1)
        >>> features = Features([LRScaling("linear", base_batch_size=8)])
        >>> ctx = Context(micro_batch_size=4, optimizers=[optimizer], factor=4)
        >>> features.dispatch(Event.FIT_START, ctx); ctx.window.open(4); features.dispatch(Event.WINDOW_OPENED, ctx)
        >>> optimizer.step(); round(param.item(), 6), optimizer.param_groups[0]["lr"]  # stepped with 0.1 x 16/8
        (-0.2, 0.1)
        >>> features.dispatch(Event.FIT_END, ctx)
    """

    name = "lr_scaling"

    def __init__(
        self,
        rule: str = "none",
        base_batch_size: int | None = None,
        warmup_steps: int = 0,
        max_scale: float | None = None,
        beta2: bool = False,
    ) -> None:
        self.rule = check_rule(rule)
        self.beta2 = check_bool("beta2_follows_batch", beta2)
        self._power = 1.0  # beta2's power in the step the window in progress ends with
        self.max_scale = check_max_scale(max_scale)
        self._warned = False  # whether this run was told its scale passed the bound
        self._peaks: list[float] = []  # each param group's highest LR in this fit (the warning's reference)
        self._configured_base = None if base_batch_size is None else check_int("base_batch_size", base_batch_size, 1)
        self._warmup = ScaleWarmup(steps=check_int("lr_warmup_steps", warmup_steps, minimum=0))
        # resolved at the run's first fit start, then kept (checkpointed): samples, or micro-batches when the
        # micro-batch size is unknown
        self.base_batch_size: float | None = None
        self._scale = 1.0  # the scale of the step the window in progress ends with
        self._used: list[float] = []  # the learning rates of the window's step, per param group, scale included
        self._scaled_steps: list[ScaledStep] = []

    @override
    def reset(self) -> None:
        self._warmup = ScaleWarmup(steps=self._warmup.steps)
        self.base_batch_size, self._warned = None, False

    @override
    def fit_start(self, ctx: Context) -> None:
        # a resumed or continued run keeps the base it started from, so the scale continues where it was
        if self.base_batch_size is None:
            self.base_batch_size = self._resolve_base(ctx)
        elif self._configured_base is not None and self.base_batch_size != self._configured_base:
            rank_zero_warn(
                f"{ctx.run.owner}: `base_batch_size={self._configured_base}` differs from the base this run"
                f" started with ({self.base_batch_size:g}, from the checkpoint); the run keeps {self.base_batch_size:g}"
                " so that its learning rate continues where it was"
            )
        # the rule "none" keeps the scale at 1 (nothing to apply around the optimizers' steps), unless a checkpoint's
        # warmup still moves it from another rule's value
        self._peaks = []
        scales = self.rule != "none" or self._warmup.start != 1.0 or self._warmup.target != 1.0 or self.beta2
        assert self.base_batch_size is not None, "resolved above"
        ctx.lr_cap_factor = cap_factor(self.rule, self.max_scale, self.base_batch_size, ctx.effective_batch(1))
        power = self._current_power if self.beta2 else None
        if self.beta2:
            _check_betas(ctx)
        self._scaled_steps = [ScaledStep(o, self._current_scale, power) for o in ctx.optimizers if scales]
        if ctx.optimizers:
            lr = _configured_lr(ctx.optimizers[0])
            ctx.summary.append(lr_summary(lr, self.rule, ctx.effective_batch(ctx.factor), self.base_batch_size))
            if self.beta2:
                ctx.summary.append(f"beta2 ** (batch / {self.base_batch_size:g}): its half-life kept in samples")

    def _resolve_base(self, ctx: Context) -> float:
        if self._configured_base is None:
            return float(ctx.effective_batch(ctx.factor))
        if ctx.plan.micro_batch_size is None:
            raise ValueError(
                f"`base_batch_size={self._configured_base}` is in samples, but the micro-batch size could not be read"
                f" from the train dataloader's `batch_size`: pass `micro_batch_size` to {ctx.run.owner}"
            )
        return float(self._configured_base)

    def _schedule_ratio(self, ctx: Context) -> float:
        """Where the LR schedules stand: the largest of the param groups' LR over its peak (1 at the peak).

        A group's peak is the highest of its ``initial_lr`` (what an LR scheduler started from) and every LR it had at
        a window's opening in this fit: a one-cycle or warmup schedule that rises past ``initial_lr`` is at its peak
        while it rises.
        """
        groups = [group for optimizer in ctx.optimizers for group in optimizer.param_groups]
        if len(self._peaks) != len(groups):
            self._peaks = [0.0] * len(groups)
        ratios = []
        for i, group in enumerate(groups):
            lr, initial = float(group["lr"]), group.get("initial_lr")
            start = float(initial) if isinstance(initial, (int, float)) else lr
            self._peaks[i] = max(self._peaks[i], lr, start)
            if self._peaks[i] > 0:
                ratios.append(lr / self._peaks[i])
        return max(ratios, default=1.0)

    def _current_scale(self) -> float:
        return self._scale

    def _current_power(self) -> float:
        return self._power

    @override
    def window_opened(self, ctx: Context) -> None:
        assert self.base_batch_size is not None, "resolved at fit start"
        target = self._bounded(lr_scale(self.rule, ctx.effective_batch(ctx.factor), self.base_batch_size), ctx)
        if target != self._warmup.target and self.rule != "none":
            over = f" over {self._warmup.steps} steps" if self._warmup.steps else ""
            ctx.summary.append(f"lr scale {self._warmup.target:.4g} -> {target:.4g}{over}")
        self._warmup.set(target, step=ctx.optimizer_steps)
        self._scale = self._held(ctx, ctx.window.size)
        self._power = ctx.effective_batch(ctx.window.size) / self.base_batch_size

    def _held(self, ctx: Context, micro_batches: int) -> float:
        """The scale of a step on ``micro_batches`` of the window's factor: the rule at the batch the window holds."""
        assert self.base_batch_size is not None, "resolved at fit start"
        full, held = ctx.effective_batch(ctx.factor), ctx.effective_batch(micro_batches)
        scale = self._warmup.value(ctx.optimizer_steps)
        return held_window_scale(self.rule, scale, held, full, self.base_batch_size, self.max_scale)

    def _bounded(self, scale: float, ctx: Context) -> float:
        """``scale`` within ``max_scale``; the first scale past the bound is told.

        Without a bound, the first LR past :data:`SCALE_WARNING` times the schedule's peak is told: the scale times
        where the LR schedule stands (its LR over its highest so far), so that a batch grown where the schedule decays
        (Seesaw, growth held to the budget), which keeps the LR at or below its peak, is not.
        """
        bound = self.max_scale if self.max_scale is not None else SCALE_WARNING
        used = scale if self.max_scale is not None or self._warned else scale * self._schedule_ratio(ctx)
        if used > bound and not self._warned:
            self._warned = True
            batch = ctx.effective_batch(ctx.factor)
            if self.max_scale is not None:
                told = f"it stays at lr_scale_max={self.max_scale:g}"
            else:
                told = "set lr_scale_max to cap it (a scaled LR that diverges is the usual way a growing batch fails)"
            where = f" ({used:.4g} x the schedule's peak LR where it stands)" if used != scale else ""
            rank_zero_warn(
                f"{ctx.run.owner}: lr_scaling={self.rule!r} scales the learning rate by {scale:.4g} at the"
                f" effective batch {batch:g} (base {self.base_batch_size:g}){where}, past {bound:g}: {told}"
            )
        return min(scale, self.max_scale) if self.max_scale is not None else scale

    @override
    def window_closing(self, ctx: Context) -> None:
        if ctx.window.taken < ctx.window.size:  # an epoch of unknown length ended: the window holds what it took
            assert self.base_batch_size is not None, "resolved at fit start"
            self._scale = self._held(ctx, ctx.window.taken)
            self._power = ctx.effective_batch(ctx.window.taken) / self.base_batch_size
        # what ScaledStep hands the optimizer for the update; the LR scheduler steps only after the optimizer
        scaled = next((s for s in self._scaled_steps if s.optimizer is ctx.optimizer), None)
        configured = scaled.configured() if scaled else [group["lr"] for group in ctx.optimizer.param_groups]
        self._used = [float(lr * self._scale) for lr in configured]

    @override
    def window_closed(self, ctx: Context) -> None:
        ctx.metrics["accum/lr_scale"] = self._scale
        betas = ctx.optimizer.param_groups[0].get("betas") if self.beta2 and ctx.optimizer is not None else None
        if betas is not None:
            ctx.metrics["accum/beta2"] = float(betas[1]) ** self._power
        if not self._used:
            return
        ctx.metrics["accum/lr"] = self._used[0]
        if any(lr != self._used[0] for lr in self._used):
            ctx.metrics.update({f"accum/lr_group_{i}": lr for i, lr in enumerate(self._used)})

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # written from inside `optimizer.step` (after the closure, before the update): store the configured LR
        states = checkpoint.get("optimizer_states") or []
        for scaled, state in zip(self._scaled_steps, states, strict=False):
            groups = state.get("param_groups") if isinstance(state, dict) else None
            if scaled.applied and isinstance(groups, list) and len(groups) == len(scaled.configured()):
                for group, lr, betas in zip(groups, scaled.configured(), scaled.configured_betas(), strict=True):
                    group["lr"] = lr
                    if betas is not None:
                        group["betas"] = betas

    @override
    def fit_end(self, ctx: Context) -> None:
        self._used = []
        for scaled in self._scaled_steps:
            scaled.remove()
        self._scaled_steps = []

    @override
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"warmup": self._warmup.state_dict()}
        if self.base_batch_size is not None:  # not before the first fit start (a tuner saves one then)
            state["base_batch_size"] = self.base_batch_size
        return state

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._warmup.load_state_dict(state.get("warmup", {}))
        base = state.get("base_batch_size")
        self.base_batch_size = None if base is None else float(base)


def _check_betas(ctx: Context) -> None:
    """Refuse ``beta2_follows_batch`` where an optimizer has no ``betas`` to follow the batch.

    Raises:
        ValueError: Naming the optimizer.
    """
    for optimizer in ctx.optimizers:
        if not all(len(group.get("betas") or ()) == 2 for group in optimizer.param_groups):
            raise ValueError(
                f"`beta2_follows_batch=True` keeps Adam's beta2 half-life fixed in samples, but"
                f" {type(optimizer).__name__} has param groups without two `betas`: use it with Adam, AdamW (or another"
                " optimizer with `betas`), or leave beta2_follows_batch=False"
            )


def _configured_lr(optimizer: Any) -> float:
    """The learning rate the optimizer was built with, not the value an LR scheduler has moved it to at start."""
    lr = optimizer.defaults.get("lr")
    return float(lr) if isinstance(lr, (int, float)) else float(optimizer.param_groups[0]["lr"])
