"""The gradient noise scale (``noise_scale=True``), measured on sampled windows from the micro-batch gradients.

A window is measured when the optimizer step it ends in is a multiple of ``interval``; a logged step logs the latest
estimate, whichever window it was measured on. For that window only, each trainable parameter (under FSDP2 its unsharded
parameter: :mod:`lightning_accum.distributed.noise_grads`) gets a gradient hook (``Tensor.register_hook``): it sees the
micro-batch's own gradient before autograd accumulates it (and before any reduction across ranks), squares it into an
entry of a float32 vector allocated beforehand, and lets it go. ``.grad`` is never replaced, aliased or kept, and no
tensor made inside a backward outlives it (one that did would make glibc page-fault the backward's large allocations
afresh: 3.4x the page faults of a raw 4 x 1024 MLP loop). At the step, the window's mean is squared from ``.grad``
(reduced and normalized, before clipping), and the squared norms become the two sums of ``core.noise``, whose
averages decay per optimizer step (not per measured window, which would make them lag ``interval`` times as far); on
several ranks the micro-batch sums are added over the ranks in one all-reduce (with FSDP2's shard squares), so every
rank holds the same estimate. On the other windows nothing runs. With ``adaptive``, on one process where the schedule
can give factor 1, a measured window of one loader batch asks for two halves (``ctx.noise_parts``), run as two
micro-batches (the Trainer's micro-batcher, the Accumulator's ``batches``), so the window has two gradients to compare.

Reads ``ctx.items`` and ``ctx.window_items`` (item weighting; a tensor is read with the window's sums); publishes
``ctx.noise`` at ``FIT_START`` and at each measured window's ``GRADIENT_READY``, ``ctx.noise_parts`` at ``FIT_START``
(the most it will ask for) and ``WINDOW_OPENED``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

import lightning_accum.distributed.noise_grads as noise_grads
from lightning_accum.core import noise
from lightning_accum.core.adaptive import check_evidence
from lightning_accum.core.events import Context, Feature, takes_dataloader_iter
from lightning_accum.core.items import count_samples
from lightning_accum.core.schedule import check_int


class NoiseScale(Feature):
    """Estimate the simple noise scale ``B_simple = tr(Sigma) / |G|^2`` on sampled windows.

    Logs ``accum/noise_scale`` (in samples, or tokens under ``normalize_by="token"``), ``accum/noise_grad_sq``,
    ``accum/noise_trace``, ``accum/noise_scale_to_batch`` (the noise scale over the latest measured batch) and
    ``accum/noise_measurements`` (the effective number of measured windows behind it). Under DDP and FSDP2 the small
    batch is one rank's micro-batch and the big batch the global window.

    Args:
        decay: Decay of the moving averages that smooth the two estimates, per optimizer step, in ``[0, 1)``: a
            measured window ``k`` steps after the previous one weighs ``1 - decay ** k``.
        interval: Measure every ``interval``-th window (by the optimizer step it ends in); ``1`` measures every one.
            The other windows cost nothing, logged ones included (they log the latest estimate).
        adaptive: Adaptive growth acts on the estimate: on one process a measured window of one loader batch runs as
            its two halves, so that factor 1 has two gradients to compare (the loss must be a mean over the batch's
            rows); the measurements are also averaged per measured window, the evidence its decisions read
            (``NoiseReading.evidence``), and ``decay`` must let those averages hold enough of it.

    Raises:
        TypeError: If ``interval`` is not an integer.
        ValueError: If ``decay`` is outside ``[0, 1)`` or ``interval`` below 1; with ``adaptive``, if the two could
            never hold the evidence it needs (:func:`~lightning_accum.core.adaptive.check_evidence`); under DeepSpeed or
            FSDP1, whose micro-batch gradients no hook sees whole.

    Example::

        >>> import torch
        >>> from lightning_accum.core.events import Context, Event, Features
        >>> net = torch.nn.Linear(2, 1, bias=False)
        >>> features, ctx = Features([NoiseScale(decay=0.0, interval=1)]), Context(module=net)
        >>> ctx.window.open(2); features.dispatch(Event.WINDOW_OPENED, ctx)
        >>> for x in ([1.0, 0.0], [1.0, 1.0]):  # micro-batch gradients (1, 0) and (1, 1)
        ...     ctx.batch, ctx.loss_divisor = torch.tensor([x]), 2.0
        ...     features.dispatch(Event.BEFORE_BACKWARD, ctx)
        ...     (net(ctx.batch).sum() / 2).backward()
        ...     features.dispatch(Event.AFTER_BACKWARD, ctx)
        >>> features.dispatch(Event.GRADIENT_READY, ctx); ctx.noise.estimate.noise_scale
        0.5
    """

    name = "noise_scale"

    def __init__(self, decay: float = 0.95, interval: int = 10, adaptive: bool = False) -> None:
        self._estimator = noise.NoiseScaleEstimator(decay)
        self.interval = check_int("noise_scale_interval", interval, minimum=1)
        self.adaptive = adaptive
        if adaptive:
            check_evidence(self._estimator.decay)
        # adaptive growth's evidence: the same measurements, averaged per measured window (adaptive.py says why)
        self._evidence = noise.NoiseScaleEstimator(decay) if adaptive else None
        self.measurement: noise.NoiseMeasurement | None = None  # the latest window's, this fit
        self._warned = False  # whether windows whose gradients came in parts were warned of
        self._batch: tuple[float, int] | None = None  # (items, micro-steps) of the latest measured window
        self._step = 0  # the optimizer step of the latest measured window
        self._params: list[torch.Tensor] = []  # hooked for the window in progress (empty: not measured)
        self._hooks: list[Any] = []
        self._entries: list[torch.Tensor] = []  # float32 0-d views the squares are written into, made once
        self._count = 0  # entries written in the window in progress
        self._recording = False  # whether a micro-batch's backward is in progress (its hooks write)
        self._seen = bytearray()  # which parameters' hooks ran in the backward in progress
        self._parts = False  # whether a parameter's gradient came in parts in a backward of this window
        self._backwards: list[tuple[int, Any, Any]] = []  # (first entry, loss divisor, items) of each backward
        self._halves = False  # whether measured windows of one loader batch are split in two halves (this fit)
        self._measuring = False  # whether the window in progress is measured and not hooked yet
        self._rows = noise_grads.RowsCheck()  # whether halves weighed by their rows hold uneven labels
        self._sharded = False  # whether the step's gradients are shards (FSDP2), their squares summed over the ranks

    @property
    def estimate(self) -> noise.NoiseScaleEstimate:
        """The current smoothed estimates."""
        return self._estimator.estimate

    @override
    def reset(self) -> None:
        self._estimator = noise.NoiseScaleEstimator(self._estimator.decay)
        self._evidence = noise.NoiseScaleEstimator(self._estimator.decay) if self.adaptive else None
        self.measurement, self._batch, self._step = None, None, 0

    @override
    def setup(self, ctx: Context) -> None:
        noise_grads.check_strategy(ctx.run.data_parallel, wrapped=False)

    @override
    def fit_start(self, ctx: Context) -> None:
        noise_grads.check_strategy(ctx.run.data_parallel, wrapped=True)
        self.measurement = None
        ctx.noise = self._reading()
        # one process: a window of one loader batch has a single gradient, so measured ones are split in two halves
        one_batch = ctx.world_size == 1 and (ctx.plan.schedule is None or ctx.plan.schedule.min_factor == 1)
        self._halves = self.adaptive and one_batch and not ctx.plan.splitting
        self._rows = noise_grads.RowsCheck(windows=3 if self._halves else 0)
        self._check_halves(ctx)
        ctx.noise_parts = 2 if self._halves else 1

    def _check_halves(self, ctx: Context) -> None:
        """No halves where a loader batch cannot be split (at fit start, or once a step is found to couple its rows)."""
        if self._halves and not ctx.can_split:
            self._halves = False
            why = "`training_step(self, dataloader_iter)` fetches its own batches"
            if not takes_dataloader_iter(ctx.module):
                why = "the training step couples its batch's rows (`lightning_accum.cached`): its batch is never split"
            rank_zero_warn(
                f"{ctx.run.owner}: {why}, so a window of one loader batch cannot be measured in two halves: the"
                " noise scale is measured only on windows of factor 2 or more"
            )

    def _reading(self) -> noise.NoiseReading | None:
        if self._batch is None:
            return None
        evidence = self._evidence.estimate if self._evidence is not None else None
        return noise.NoiseReading(self._estimator.estimate, self._batch[0], self._batch[1], self._step, evidence)

    @override
    def window_opened(self, ctx: Context) -> None:
        self._release()  # a window dropped before its step leaves nothing behind
        self._check_halves(ctx)
        step = ctx.optimizer_steps + 1  # the step this window ends in
        measured = step % self.interval == 0
        ctx.noise_parts = 2 if measured and self._halves and ctx.window.size == 1 else 1
        self._measuring = measured  # hooked at its first backward (FSDP2 makes unsharded parameters in the forward)

    def _hook(self, ctx: Context) -> None:
        self._measuring = False
        found = noise_grads.targets(ctx.module)
        if found.complete and (leaves := found.leaves):
            self._params, self._sharded = found.params, found.sharded
            self._hooks = [leaf.register_hook(functools.partial(self._add, i)) for i, leaf in enumerate(leaves)]
            self._reserve(len(leaves) * ctx.window.size * ctx.noise_parts + len(self._params), leaves[0].device)

    def _reserve(self, count: int, device: torch.device) -> None:
        """At least ``count`` entries, those written kept (room grows by doubling, rarely inside a backward)."""
        if len(self._entries) >= count and self._entries[0].device == device:
            return
        # float32 whatever the default dtype (bf16-true makes it bfloat16 around the step, where this may run)
        entries = torch.zeros(max(count, 2 * len(self._entries)), dtype=torch.float32, device=device)
        if self._count:
            entries[: self._count].copy_(torch.stack(self._entries[: self._count]))
        self._entries = list(entries.unbind())

    @override
    def before_backward(self, ctx: Context) -> None:
        if self._measuring:
            self._hook(ctx)
        if ctx.noise_parts > 1 and ctx.items is None:  # a half weighed by its rows: its labels looked at
            self._rows.see(ctx.batch)
        if self._hooks:
            self._recording, self._seen = True, bytearray(len(self._hooks))
            self._backwards.append((self._count, ctx.loss_divisor, _items(ctx)))

    def _add(self, index: int, grad: torch.Tensor) -> None:
        if not self._recording:  # a gradient computed outside the micro-batches' backwards
            return
        # a second part of this backward's gradient (reentrant checkpointing of a layer used twice): its square is
        # not the sum of the parts' squares
        self._parts = self._parts or bool(self._seen[index])
        self._seen[index] = 1
        self._square(grad)

    def _square(self, grad: torch.Tensor) -> None:
        """Write the squared norm of ``grad`` into the next entry: one reduction, in float32."""
        if self._count == len(self._entries):
            self._reserve(self._count + 1, self._entries[0].device)
        noise_grads.square_into(grad, self._entries[self._count])
        self._count += 1

    @override
    def after_backward(self, ctx: Context) -> None:
        self._recording = False

    @override
    def gradient_ready(self, ctx: Context) -> None:
        if (warning := self._rows.said()) is not None:
            rank_zero_warn(f"{ctx.run.owner}: {warning}")
        if not self._hooks:
            return
        backwards, params, parts, first_mean = self._backwards, self._params, self._parts, self._count
        for param in params:
            if param.grad is not None:
                self._square(param.grad)
        entries = self._entries[: self._count]
        self._release()
        # every rank measures the same windows and adds its sums in, whatever it has to add
        reduce = ctx.reduce if ctx.world_size > 1 else None
        counted = ctx.window_items if isinstance(ctx.window_items, torch.Tensor) else None
        small, bearing, inverse, micro_batches, in_parts, big_sq, *items = noise.window_sums(
            backwards, parts, entries, first_mean, reduce, counted, self._sharded
        )
        if in_parts:
            if not self._warned:
                self._warned = True
                rank_zero_warn(
                    f"{ctx.run.owner}: a parameter's gradient reached its hook in parts within one backward"
                    " (reentrant activation checkpointing of a layer used more than once): the noise scale cannot"
                    " square it whole and skips such windows. Use `checkpoint(..., use_reentrant=False)`"
                )
            return
        if not bearing or first_mean == len(entries):  # no micro-batch held an item, or no gradient: nothing measured
            return
        scale = ctx.run.loss_scale()  # the AMP loss scale the window's backwards ran with
        small_sq = small / bearing / (scale**2 if scale is not None else 1.0)
        inverse_small = inverse / bearing
        # the step is the mean over every item of the window on every rank (item weighting), or else the mean of the
        # micro-batches' means over every rank
        big = float(items[0] if items else ctx.window_items) if ctx.window_items is not None else None
        big = big if big is not None else micro_batches / inverse_small
        self.measurement = noise.NoiseMeasurement(small_sq, big_sq, inverse_small, big, int(bearing))
        step = ctx.optimizer_steps + 1  # the step this window ends in; the averages decay per step since the last
        if self._estimator.update(small_sq, big_sq, inverse_small, big, steps=step - self._step) is not None:
            self._batch, self._step = (big, ctx.window.taken), step
            if self._evidence is not None:
                self._evidence.update(small_sq, big_sq, inverse_small, big, steps=1)
        ctx.noise = self._reading()

    @override
    def window_closed(self, ctx: Context) -> None:
        estimate = self._estimator.estimate
        if not estimate.measurements:
            return
        ctx.metrics["accum/noise_grad_sq"] = estimate.grad_sq
        ctx.metrics["accum/noise_trace"] = estimate.trace
        ctx.metrics["accum/noise_measurements"] = estimate.measurements
        if estimate.noise_scale is None:  # |G|^2 at or below 0: no ratio to log
            return
        ctx.metrics["accum/noise_scale"] = estimate.noise_scale
        if self._batch is not None and self._batch[0] > 0:  # the batch in the estimate's own unit
            ctx.metrics["accum/noise_scale_to_batch"] = estimate.noise_scale / self._batch[0]

    @override
    def fit_end(self, ctx: Context) -> None:
        self._release()

    def _release(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._params, self._hooks, self._backwards, self._count = [], [], [], 0
        self._recording = self._parts = self._measuring = False

    @override
    def state_dict(self) -> dict[str, Any]:
        items, micro_steps = self._batch if self._batch is not None else (None, None)
        batch = {"batch_items": items, "batch_micro_steps": micro_steps, "step": self._step}
        evidence = {"evidence": self._evidence.state_dict()} if self._evidence is not None else {}
        return {**self._estimator.state_dict(), **batch, **evidence}

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._estimator.load_state_dict(state)
        if self._evidence is not None:  # a checkpoint without it (written without adaptive growth) starts from none
            self._evidence = noise.NoiseScaleEstimator(self._estimator.decay)
            if "evidence" in state:
                self._evidence.load_state_dict(state["evidence"])
        items, micro_steps = state.get("batch_items"), state.get("batch_micro_steps")
        self._batch = None if items is None or micro_steps is None else (float(items), int(micro_steps))
        self._step = int(state.get("step", 0))


def _items(ctx: Context) -> Any:
    """The micro-batch's items, as the estimate counts them: item weighting's, or else its samples."""
    try:
        return ctx.items if ctx.items is not None else count_samples(ctx.batch)
    except ValueError:
        return ctx.plan.micro_batch_size or 1
