"""The gradient noise scale (``noise_scale=True``), measured from the micro-batch gradients accumulation computes.

One hook per trainable parameter takes each micro-batch's gradient as backward produces it: a large one's squared
norm at once (one dot), small ones every ``FLUSH`` together in one fused ``torch._foreach_norm`` (no gradient is
copied; at most ``FLUSH`` small ones are held a little longer than backward would). Once the window's gradient is
its mean, its squared norm joins the micro-batch ones in the estimator of :mod:`lightning_accum.noise`. The hooked
gradient is that of the loss Lightning backpropagates, so each micro-batch's sum is unscaled by
``ctx.loss_divisor`` (kept on the device: no host synchronisation per micro-step) and the AMP loss scale, constant
over a window, is taken out once per step.

Reads ``ctx.items`` and ``ctx.window_items`` when item weighting publishes them; publishes ``ctx.noise_scale`` and
``ctx.noise_batch`` at ``GRADIENT_READY``.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from typing_extensions import override

from lightning_accum.events import Context, Feature
from lightning_accum.items import count_samples
from lightning_accum.noise import NoiseScaleEstimate, NoiseScaleEstimator

FLUSH = 64  # small gradients whose squared norms are taken together, in one fused kernel
LARGE = 1 << 16  # a gradient of this many elements or more gets its own dot: the launch no longer dominates


def _sum_of_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The sum of the squared entries of ``tensors`` (float32): a dot per large one, one fused norm for the rest."""
    large = [t.reshape(-1) for t in tensors if t.numel() >= LARGE]
    small = [t for t in tensors if t.numel() < LARGE]
    parts = [torch.dot(t, t).float() for t in large]
    if small:
        norms = torch._foreach_norm(small)
        if len({(n.dtype, n.device) for n in norms}) == 1:
            stacked = torch.stack(norms).float()
            parts.append(torch.dot(stacked, stacked))
        else:  # mixed dtypes or devices
            parts.extend(n.float().square().to(parts[0].device if parts else n.device) for n in norms)
    devices = {p.device for p in parts}
    if len(devices) > 1:
        parts = [p.to(parts[0].device) for p in parts]
    return torch.stack(parts).sum() if len(parts) > 1 else parts[0]


def _micro_batch_squares(small: list[tuple[list[torch.Tensor], Any]], device: torch.device) -> torch.Tensor:
    """Each micro-batch's squared gradient norm, unscaled: its partial sums added, times its unscale squared."""
    partials = [part.float().to(device) for parts, _ in small for part in parts]
    segments = torch.tensor([index for index, (parts, _) in enumerate(small) for _ in parts], device=device)
    sums = torch.zeros(len(small), device=device)
    if partials:
        sums.index_add_(0, segments, torch.stack(partials))
    unscale = torch.stack([torch.as_tensor(u, dtype=torch.float32, device=device).reshape(()) for _, u in small])
    return sums * unscale.square()


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
        self._params: list[torch.Tensor] = []  # the parameters hooked when the window opened
        self._batch: tuple[float, int] | None = None  # (big batch, micro-steps) of the latest update
        self._micro_items: Any = 1  # the micro-batch in progress, as the estimate counts it
        self._micro_sq: list[torch.Tensor] | None = None  # partial squared norms of the micro-batch in progress
        self._micro_unscale: float | torch.Tensor = 1.0  # turns the hooked gradient into the micro-batch mean's
        self._small_sqs: list[tuple[list[torch.Tensor], Any]] = []  # this window's (partial squares, unscale)
        self._small_items: list[Any] = []
        self._pending: list[torch.Tensor] = []  # gradients of the micro-batch in progress, not yet in _micro_sq

    @property
    def estimate(self) -> NoiseScaleEstimate:
        """The current smoothed estimates."""
        return self._estimator.estimate

    @override
    def reset(self) -> None:
        self._estimator = NoiseScaleEstimator(self._estimator.decay)
        self._batch = None

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
        self._small_sqs, self._small_items, self._micro_sq = [], [], None  # nothing of a dropped window survives
        self._pending = []
        self._params = []  # S_big is measured on exactly the parameters whose micro-batch gradients are hooked
        for param in ctx.module.parameters():  # hook parameters that became trainable (an unfrozen backbone)
            if param.requires_grad and id(param) not in self._hooks:
                self._hooks[id(param)] = param.register_hook(self._add_micro_sq)
            if id(param) in self._hooks:
                self._params.append(param)

    @override
    def micro_batch_started(self, ctx: Context) -> None:
        if ctx.items is not None:
            self._micro_items = ctx.items
            return
        try:
            self._micro_items = count_samples(ctx.batch)
        except ValueError:
            self._micro_items = ctx.micro_batch_size or 1

    @override
    def before_backward(self, ctx: Context) -> None:
        self._micro_sq = []  # the micro-batch's partial squared norms, summed once per optimizer step
        self._micro_unscale = ctx.loss_divisor

    def _add_micro_sq(self, grad: torch.Tensor) -> None:
        if self._micro_sq is None:
            return
        if grad.numel() >= LARGE:  # a large gradient: its own fused dot now, without holding it
            flat = grad.reshape(-1)
            self._micro_sq.append(torch.dot(flat, flat))
            return
        self._pending.append(grad)
        if len(self._pending) >= FLUSH:
            self._flush()

    def _flush(self) -> None:
        """The squared norms of the small gradients collected so far: one fused norm, one dot."""
        pending, self._pending = self._pending, []
        if not pending or self._micro_sq is None:
            return
        self._micro_sq.append(_sum_of_squares(pending))  # backward's gradients need no detach

    @override
    def after_backward(self, ctx: Context) -> None:
        self._flush()
        if self._micro_sq is not None:
            self._small_sqs.append((self._micro_sq, self._micro_unscale))
            self._small_items.append(self._micro_items)
            self._micro_sq = None

    @override
    def gradient_ready(self, ctx: Context) -> None:
        self._update(ctx)
        ctx.noise_scale, ctx.noise_batch = self.estimate.noise_scale, self._batch

    def _update(self, ctx: Context) -> None:
        """Fold this step's micro-batch gradients and their (reduced, normalized) mean into the estimator."""
        small, self._small_sqs = self._small_sqs, []
        items, self._small_items = self._small_items, []
        grads = [param.grad for param in self._params if param.grad is not None]
        if not small or not grads:
            return
        sizes = torch.stack([torch.as_tensor(n, dtype=torch.float32).reshape(()).cpu() for n in items])
        bearing = sizes > 0  # a micro-batch without items (no loss-bearing token) holds no gradient sample
        if int(bearing.sum()) == 0:
            return
        big_sq = _sum_of_squares(grads)
        small_sq = _micro_batch_squares(small, big_sq.device)[bearing.to(big_sq.device)].mean()
        scaler = getattr(getattr(ctx.trainer, "precision_plugin", None), "scaler", None)
        if scaler is not None and scaler.is_enabled():  # the scale the window's backwards ran with
            small_sq = small_sq / scaler.get_scale() ** 2
        values = torch.stack([small_sq, big_sq.to(small_sq.device)]).tolist()  # one host sync per optimizer step
        inverse_small = float((1.0 / sizes[bearing]).mean())
        # the step is the mean over every item of the window on every rank (item weighting), or else the mean of the
        # micro-batches' means over every rank
        big = ctx.window_items if ctx.window_items is not None else len(small) * ctx.world_size / inverse_small
        self._estimator.update(values[0], values[1], inverse_small, big)
        self._batch = (big, len(small))

    @override
    def window_closed(self, ctx: Context) -> None:
        estimate = self.estimate
        if estimate.noise_scale is not None:
            ctx.metrics["accum/noise_scale"] = estimate.noise_scale
            ctx.metrics["accum/noise_grad_sq"] = estimate.grad_sq
            ctx.metrics["accum/noise_trace"] = estimate.trace
            if self._batch is not None and self._batch[0] > 0:  # the batch in the estimate's own unit
                ctx.metrics["accum/noise_scale_to_batch"] = estimate.noise_scale / self._batch[0]

    @override
    def fit_end(self, ctx: Context) -> None:
        for hook in self._hooks.values():
            hook.remove()
        self._hooks, self._params, self._small_sqs, self._small_items = {}, [], [], []
        self._micro_sq, self._pending = None, []

    @override
    def state_dict(self) -> dict[str, Any]:
        return dict(self._estimator.state_dict())

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._estimator.load_state_dict(state)
