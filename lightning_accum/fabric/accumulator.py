r"""Accumulator: exact, scheduled gradient accumulation for a Lightning Fabric loop, in a few lines.

The Fabric shell over the core :class:`~lightning_accum.AccumulationScheduler` uses. It owns only what a Fabric loop
needs: the windows over the user's iterable (:meth:`Accumulator.batches`: each window fetched at its start), one
micro-step's gradient sync under Fabric's strategy and its backward through ``fabric.backward``
(:meth:`Accumulator.micro_step`), the checks a hand-written loop needs, and the state ``fabric.save`` carries. The
schedule and its target-batch arithmetic (:mod:`lightning_accum.core.schedule`), the window
(:mod:`lightning_accum.core.window`), the sync policies (:mod:`lightning_accum.distributed.sync`) and every feature the
loop runs (token count, item weighting, wide accumulation, LR scaling, metrics: :mod:`lightning_accum.features`) are the
callback's own, driven through the same window events; the features see Fabric through
:class:`~lightning_accum.fabric._run.FabricRun`.

A window's micro-batches are all fetched when it opens, never one of the next window: its size is known before its
first backward (a short last window is divided by what it holds), and a loader whose state is saved between windows
resumes where the run would have gone on.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Literal

import torch
from lightning.fabric import Fabric

from lightning_accum.compat.lightning import fabric_names
from lightning_accum.core.adaptive import check_needs_noise_scale
from lightning_accum.core.events import Context, Event, Feature, Features
from lightning_accum.core.precision import accumulation_dtype
from lightning_accum.core.sample_driven_lr import SampleDrivenLR
from lightning_accum.core.schedule import Budget, Schedule, ScheduleSpec, check_bool, check_int, plan_run, run_epoch
from lightning_accum.core.seesaw import check_seesaw
from lightning_accum.core.window import Window
from lightning_accum.distributed.sync import check_gradient_sync, skip_gradient_sync
from lightning_accum.fabric._checks import (
    check_backed,
    check_between_windows,
    check_entry,
    check_open,
    check_optimizer,
    check_shift_labels,
    check_taken,
    claim,
    driven,
    early_step,
)
from lightning_accum.fabric._data import LoaderPosition
from lightning_accum.fabric._parts import LoaderBatch, Piece, check_halves, pieces
from lightning_accum.fabric._ranks import agree_on_window, over_ranks
from lightning_accum.fabric._run import FabricRun
from lightning_accum.fabric._setup import (
    data_parallel,
    drop_pending,
    fit_plan,
    plan_epoch,
    scale_window,
    set_up_model,
    set_up_optimizer,
)
from lightning_accum.fabric._shadows import initializes_state, keep_on_load, own_backward
from lightning_accum.fabric.micro_step import MicroStep, as_mean, check_backward
from lightning_accum.features import (
    AdaptiveGrowth,
    ItemWeighting,
    LRScaling,
    Metrics,
    NoiseScale,
    SampleDrivenSchedules,
    Seesaw,
    TokenCount,
    WideAccumulation,
)


class Accumulator:
    r"""Accumulate gradients in a Lightning Fabric loop exactly, with the schedules of ``AccumulationScheduler``.

    Every optimizer step equals one step on the big batch's loss: the mean over the window's micro-batches, samples
    or tokens on every data-parallel rank (``normalize_by``); the last window of an epoch holds what is left and is
    stepped. Gradients are reduced across ranks once per window (DDP, FSDP1, FSDP2, HSDP: ``gradient_sync``), and
    under DeepSpeed every ``optimizer.step()`` is one window's step. The arguments mean what they mean on
    :class:`~lightning_accum.AccumulationScheduler`.

    Args:
        fabric: The Fabric the loop runs under (launched): ``lightning.fabric``'s or ``lightning_fabric``'s.
        model: The model ``fabric.setup`` returned.
        optimizer: The optimizer ``fabric.setup`` returned (one).
        scheduling: ``{position: factor}``; factor 1 before the first key (throughout with no key and no target).
        unit: What the keys count: ``"epoch"`` (calls of :meth:`batches`), ``"step"``, ``"sample"`` or ``"token"``.
        target_batch_size: The global batch in samples: factor = target / (micro-batch x data-parallel size).
        ramp_start_batch_size: With the next two: ramp the global batch linearly from this size to the target.
        ramp_increment: How much the global batch grows at each stage of the ramp.
        ramp_samples: Samples (tokens with ``unit="token"``) of all ranks over which the ramp reaches the target.
        micro_batch_size: Samples in a rank's micro-batch; by default the loader's ``batch_size``.
        lr_scaling: ``"none"``, ``"linear"`` or ``"sqrt"``: the LR times ``effective / base`` or its root, in steps.
        base_batch_size: The global batch at which the LR was tuned; by default the first window's effective batch.
        lr_warmup_steps: Move the scale linearly to each new value over this many optimizer steps.
        lr_scale_max: The largest LR scale, warned of when first passed; ``None``: no cap, warned past 4x the peak LR.
        beta2_follows_batch: Adam's ``beta2 ** (batch / base)`` in each update: its half-life kept in samples.
        normalize_by: A micro-batch weighs the same (``"micro_batch"``) or its items (``"sample"``, ``"token"``).
        token_key: Where ``"token"`` finds the labels: a mapping key or a tuple position.
        ignore_index: The label value that bears no loss.
        count_items: ``batch -> int or tensor``, counting a micro-batch's items instead.
        shift_labels: Count ``labels[..., 1:]``: a causal LM's loss on ``logits[..., :-1]`` against ``labels[..., 1:]``
            (litgpt's ``chunked_cross_entropy``) has one item fewer per sequence than its labels bear.
        grad_accum_dtype: The dtype micro-batch gradients are summed in where the parameters are narrower;
            ``"auto"``: float32 where the strategy supports it; ``None``: the parameters' dtype.
        gradient_sync: ``"last"``: one gradient reduction per window; ``"every"``: every micro-step (FSDP keeps only
            its gradient shard); ``"reduce_scatter"``: as ``"every"``, HSDP's all-reduce across replicas deferred.
        noise_scale: Estimate the gradient noise scale (the critical batch) and log ``accum/noise_scale``.
        noise_scale_decay: Decay of the estimate's averages per step (and of adaptive's evidence per window), [0, 1).
        noise_scale_interval: Measure every N-th window (``1``: all); the others cost nothing, logged ones included.
        adaptive: Set the factor from the noise scale once the evidence calls for it (needs ``noise_scale``); at
            factor 1 on one process a measured window's loader batch is yielded as its two halves.
        adaptive_target: The wanted effective batch as a multiple of the noise scale.
        adaptive_max_factor: The largest factor adaptive growth may reach.
        adaptive_confidence: One-sided confidence of a factor's first test, spent over its later ones, ``[0.5, 1)``.
        adaptive_shrink: Let the factor come down again when the noise scale's upper bound falls below the batch.
        adaptive_lr_bound: Hold growth to the ``lr_scheduler``'s peak over current LR, or past it a tenth of B_noise.
        seesaw: Double the factor where the ``lr_scheduler``'s LR halves; ``lr_scaling`` gives back its share.
        seesaw_max_factor: The largest factor Seesaw reaches; past it the LR schedule goes on as given.
        log_metrics: Log the ``accum/...`` metrics through Fabric's loggers every ``log_every_n_steps`` steps.
        log_every_n_steps: Optimizer steps between two logged steps.
        lr_scheduler: A :class:`~lightning_accum.SampleDrivenLR` over ``optimizer``, moved after each window to where
            the samples (or, ``unit="token"``, tokens) consumed put it, so that it ends at its ``total``.

    Raises:
        TypeError: If an argument has the wrong type, or ``model`` or ``optimizer`` was not set up by ``fabric``.
        ValueError: If an argument has a wrong value, or a DeepSpeed engine accumulates by itself.

    Example::

        accumulator = Accumulator(fabric, model, optimizer, scheduling={0: 4}, normalize_by="token")
        for epoch in range(epochs):
            for batch in accumulator.batches(train_dataloader):
                with accumulator.micro_step(batch) as micro:
                    loss = loss_fn(model(batch["input_ids"]), batch["labels"])  # the micro-batch's own mean
                    micro.backward(loss)
                if micro.should_step:
                    fabric.clip_gradients(model, optimizer, max_norm=1.0)  # the window's mean gradient
                    optimizer.step()
                    optimizer.zero_grad()
    """

    def __init__(
        self,
        fabric: Fabric,
        model: Any,
        optimizer: Any,
        scheduling: dict[int, int] | None = None,
        unit: Literal["epoch", "step", "sample", "token"] = "epoch",
        target_batch_size: int | None = None,
        ramp_start_batch_size: int | None = None,
        ramp_increment: int | None = None,
        ramp_samples: int | None = None,
        micro_batch_size: int | None = None,
        lr_scaling: Literal["none", "linear", "sqrt"] = "none",
        base_batch_size: int | None = None,
        lr_warmup_steps: int = 0,
        lr_scale_max: float | None = None,
        beta2_follows_batch: bool = False,
        normalize_by: Literal["micro_batch", "sample", "token"] = "micro_batch",
        token_key: str | int = "labels",
        ignore_index: int = -100,
        count_items: Callable[[Any], Any] | None = None,
        shift_labels: bool = False,
        grad_accum_dtype: str | torch.dtype | None = "auto",
        gradient_sync: Literal["last", "every", "reduce_scatter"] = "last",
        noise_scale: bool = False,
        noise_scale_decay: float = 0.95,
        noise_scale_interval: int = 10,
        adaptive: bool = False,
        adaptive_target: float = 1.0,
        adaptive_max_factor: int = 64,
        adaptive_confidence: float = 0.9,
        adaptive_shrink: bool = False,
        adaptive_lr_bound: bool = True,
        seesaw: bool = False,
        seesaw_max_factor: int = 8,
        log_metrics: bool = True,
        log_every_n_steps: int = 50,
        lr_scheduler: SampleDrivenLR | None = None,
    ) -> None:
        self._fabric = fabric
        self._model, self._forward = set_up_model(fabric, model)
        self._wrapped_optimizer, self._optimizer = set_up_optimizer(fabric, optimizer)
        check_shift_labels(shift_labels, count_items, normalize_by, unit)
        check_needs_noise_scale(adaptive, noise_scale)
        check_optimizer(fabric, self._model, self._optimizer)
        self._policy = check_gradient_sync(gradient_sync)
        log_every = check_int("log_every_n_steps", log_every_n_steps, minimum=1)
        # the callback's features, each with its switch, in its order (the progress bar, the Trainer's, left out)
        growth = (adaptive_target, adaptive_max_factor, adaptive_confidence, adaptive_shrink, adaptive_lr_bound)
        registry: list[tuple[Feature, bool]] = [
            (TokenCount(token_key, ignore_index, count_items, normalize_by, shift_labels), unit == "token"),
            (
                ItemWeighting(normalize_by, token_key, ignore_index, count_items, shift_labels),
                normalize_by != "micro_batch",
            ),
            (WideAccumulation(*accumulation_dtype(grad_accum_dtype)), grad_accum_dtype is not None),
            (NoiseScale(noise_scale_decay, noise_scale_interval, adaptive), check_bool("noise_scale", noise_scale)),
            (AdaptiveGrowth(*growth), adaptive),
            (LRScaling(lr_scaling, base_batch_size, lr_warmup_steps, lr_scale_max, beta2_follows_batch), True),
            (SampleDrivenSchedules(), True),
            (Seesaw(seesaw_max_factor, lr_scaling), check_seesaw(seesaw, seesaw_max_factor, adaptive)),  # reads it
            (Metrics(), check_bool("log_metrics", log_metrics)),
        ]
        self._features = Features(feature for feature, enabled in registry if enabled)
        self._spec = ScheduleSpec.from_args(
            scheduling, unit, target_batch_size, ramp_start_batch_size, ramp_increment, ramp_samples, micro_batch_size
        )
        self._group, data_parallel_size = data_parallel(fabric)
        if micro_batch_size is not None:  # a target batch that cannot be reached is refused now, naming the numbers
            self._spec.build(micro_batch_size, data_parallel_size)
        self._epoch, self._in_epoch = 0, 0  # epochs completed (calls of `batches` that reached the end); its batches
        self._data = LoaderPosition(fabric)  # the place in the loader's samples, on any number of ranks
        self._max_steps = -1
        self._active: MicroStep | None = None  # the micro-step whose block is open
        self._offered: Any = None  # the micro-batch `batches` yielded last, until its micro-step begins
        self._ended: MicroStep | None = None  # the micro-step whose block exited, until its end is dispatched
        self._in_call = 0  # micro-batches taken in the call of `batches` in progress
        self._ends_epoch = False  # the window in progress holds the rest of the epoch
        ctx = self._ctx = Context(world_size=data_parallel_size, is_global_zero=fabric.is_global_zero)
        ctx.module, ctx.broadcast = self._model.module, lambda obj: fabric.broadcast(obj)
        ctx.reduce = over_ranks(self._group, data_parallel_size)
        ctx.run = FabricRun(
            fabric,
            self._forward,
            self._policy,
            log_every,
            epoch=lambda: self._epoch,
            batches_per_epoch=lambda: ctx.plan.batches_per_epoch,
            max_steps=lambda: self._max_steps,
            lr_schedulers=driven(lr_scheduler, self._optimizer),
        )
        self._features.dispatch(Event.SETUP, ctx)  # what a feature refuses under this strategy, before any step
        self._hooks = [
            self._optimizer.register_step_pre_hook(self._before_step),
            self._optimizer.register_step_post_hook(self._after_step),
        ]
        self._release = claim(self._optimizer)
        self._unshadow_load = keep_on_load(fabric.strategy, Accumulator)  # a sharded fabric.load restores it too
        self._fabric_backward: Callable[..., Any] = fabric.backward
        self._halves: bool | None = None  # True until the run's first batch is checked for the noise scale's halves
        self._pieces: list[Piece] = []  # the window's micro-steps (its loader batches, whole or in parts), how many
        self._begun, self._loader_batch = 0, LoaderBatch()  # begun; a split loader batch's loss and items so far
        self._ready, self._closed = False, False  # the window's gradient is final (its last block exited); closed

    # ------------------------------------------------------------------ what the loop reads

    @property
    def optimizer_steps(self) -> int:
        """Windows completed: the optimizer steps the loop has taken."""
        return self._ctx.optimizer_steps

    @property
    def samples_seen(self) -> int:
        """Samples consumed by all data-parallel ranks together (micro-batch size x ranks per micro-batch)."""
        return self._ctx.samples_seen

    @property
    def epoch(self) -> int:
        """The epoch in progress, or the next one between epochs (from 0): ``for epoch in range(accumulator.epoch, n)``.

        A call of :meth:`batches` that reaches its iterable's end completes an epoch.
        """
        return self._epoch

    @property
    def factor(self) -> int:
        """The size of the window in progress (the factor it was opened with, or what was left of the epoch)."""
        return self._ctx.window.size

    @property
    def features(self) -> Features:
        """The enabled features by name, read-only (``accumulator.features["lr_scaling"]``)."""
        return self._features

    def steps_per_epoch(self, iterable: Iterable[Any]) -> int:
        """The optimizer steps an epoch of ``iterable`` (a sized one) takes from the run's position, short window too.

        Under ``unit="token"`` or adaptive growth an upper bound: the schedule's factors (tokens, growth not known).

        Example::

            lr_max_steps = min(epochs * accumulator.steps_per_epoch(train_dataloader), max_steps)
        """
        schedule, batches, per_micro_step = self._epoch_plan(iterable)
        ctx = self._ctx
        position = (self._epoch, 0, ctx.optimizer_steps, ctx.samples_seen)
        return run_epoch(schedule, batches, *position, -1, per_micro_step, 1, ctx.tokens_seen)[1]

    def total_steps(self, iterable: Iterable[Any], epochs: int, max_steps: int = -1) -> int:
        """The optimizer steps of ``epochs`` epochs of ``iterable`` from step 0, to size an LR schedule (as above)."""
        schedule, batches, per_micro_step = self._epoch_plan(iterable)
        return plan_run(schedule, batches, epochs, max_steps, per_micro_step)[0]

    def _epoch_plan(self, iterable: Iterable[Any]) -> tuple[Schedule, int, int]:
        plan = self._ctx.plan  # before the first epoch: nothing known, the schedule built from the iterable's size
        return plan_epoch(iterable, self._spec, plan.schedule, plan.micro_batch_size, self._ctx.world_size)

    # ------------------------------------------------------------------ the windows of an epoch

    def batches(
        self,
        iterable: Iterable[Any],
        max_steps: int | None = None,
        max_samples: int | None = None,
        max_tokens: int | None = None,
    ) -> Iterator[Any]:
        """The micro-batches of one epoch of ``iterable``, window by window; run each through :meth:`micro_step`.

        A window's micro-batches are fetched when it opens (never one of the next window); the epoch's last window
        holds what is left of it and is stepped. One call is one epoch: windows never span calls.

        Args:
            iterable: A ``DataLoader``, a Fabric loader, or any iterable of batches (an endless one with
                ``max_steps``).
            max_steps: Stop after the window that completes this optimizer step (counted over the whole run).
            max_samples: Stop after the window that reaches these samples (all ranks, over the whole run).
            max_tokens: Stop after the window that reaches these loss-bearing tokens (all ranks, the whole run; litgpt's
                ``max_tokens``), as ``unit="token"`` counts them.

        Raises:
            ValueError: On every rank, if the ranks' loaders differ in length (checked at the epoch's start for sized
                ones, at each window for the others) or in batch size; if a budget is negative, or ``max_tokens`` is
                given where no tokens are counted.
        """
        check_open("batches", self._closed)
        budget = Budget.checked(max_steps, max_samples, max_tokens, counts_tokens="token_count" in self._features)
        self._max_steps, ctx = -1 if budget.steps is None else budget.steps, self._ctx
        self._start_epoch(iterable)
        budget.check_counted(ctx.samples_per_micro_step)
        self._in_epoch = self._data.open(iterable, self._epoch, self._in_epoch)  # a resumed loader starts on
        self._in_call = 0  # micro-batches this call took: a sized iterable ends after its length
        iterator = iter(iterable)
        try:
            while not budget.spent(ctx.optimizer_steps, ctx.samples_seen, ctx.tokens_seen):
                window = self._fetch(iterator)
                if not window:  # the iterable ended with a full window
                    self._epoch, self._in_epoch = self._epoch + 1, 0
                    break
                for piece in window:
                    self._offered = piece.batch
                    yield piece.batch
                    check_taken(self._offered is piece.batch)
                self._finish_window()
                if self._in_epoch == 0:  # that window ended the epoch
                    break
        finally:
            self._offered = None
            self._data.close()
            if self._inside_window:  # left inside a window (an error, a break)
                self._discard_window()
            self._finish_window()

    def _start_epoch(self, iterable: Iterable[Any]) -> None:
        ctx = self._ctx
        self._check_between_windows("Accumulator.batches")
        made = ctx.plan if ctx.plan.schedule is not None else None  # at the run's first epoch the plan is made
        plan = fit_plan(self._fabric, iterable, self._spec, made, ctx.world_size, (self._epoch, ctx.optimizer_steps))
        if made is not None:  # a later epoch: its iterable's sizes
            ctx.plan = plan
        else:
            ctx.start(plan)
            ctx.optimizers, ctx.summary = [self._optimizer], []
            self._features.dispatch(Event.FIT_START, ctx)
            self._data.data.say_global_batch(ctx, self._spec.target_batch_size, "adaptive" in self._features)
            self._features.settle()
            self._hooks[1].remove()  # the window ends after the features' own post-step hooks (LR scaling's restore)
            self._hooks[1] = self._optimizer.register_step_post_hook(self._after_step)
            self._halves = True if ctx.noise_parts > 1 else None  # the noise scale may measure in halves
        if self._in_epoch == 0:
            self._features.dispatch(Event.EPOCH_STARTED, ctx)

    def _fetch(self, iterator: Iterator[Any]) -> list[Piece]:
        """Open the next window with the micro-steps it holds (none: the epoch ended)."""
        ctx = self._ctx
        ctx.factor = ctx.scheduled_factor(self._epoch)
        self._features.dispatch(Event.WINDOW_OPENING, ctx)
        ctx.factor = int(min(ctx.factor, ctx.plan.batches_per_epoch))  # what a window can hold, for the LR and the logs
        window = list(itertools.islice(iterator, ctx.factor))
        if math.isinf(
            ctx.plan.batches_per_epoch
        ):  # unsized loaders: the ranks agree on every window before its backward
            agree_on_window(self._fabric, len(window), step=ctx.optimizer_steps + 1)
        # the window that empties the iterable ends the epoch: a short one, or the last of a sized iterable's
        self._ends_epoch = len(window) < ctx.factor or self._in_call + len(window) >= ctx.plan.batches_per_epoch
        if window and self._halves is not None:  # the run's first loader batch, where halves may be asked for
            self._halves = None
            check_halves(window[0])
        self._pieces, self._begun = [], 0
        if window:
            ctx.window.open(len(window))
            ctx.summary = []
            self._features.dispatch(Event.WINDOW_OPENED, ctx)
            self._pieces = pieces(window, ctx.noise_parts)  # a measured window of one batch: in halves
        return self._pieces

    # ------------------------------------------------------------------ one micro-step

    @contextmanager
    def micro_step(self, batch: Any) -> Iterator[MicroStep]:
        """Train on ``batch``, the micro-batch :meth:`batches` yielded last: wrap its forward and ``micro.backward``.

        On a non-final micro-step of a window the gradient reduction across ranks is skipped (``gradient_sync``).
        When the window's last block exits, its gradient is final: the window's mean, ready for clipping and
        ``optimizer.step()``.

        Raises:
            RuntimeError: If blocks are nested, ``batch`` is not the micro-batch :meth:`batches` yielded last, or the
                block ends without ``micro.backward(loss)``.
        """
        ctx = self._ctx
        check_open("micro_step", self._closed)
        check_entry(nested=self._active is not None, offered=self._offered is not None and batch is self._offered)
        piece, self._offered = self._pieces[self._begun], None
        if piece.first:  # the window counts loader batches: opened with what it holds, closes at its last
            ctx.window.take(ends_epoch=False)
        micro = MicroStep(self._backward, self._begun, len(self._pieces))
        self._begun += 1
        ctx.batch, ctx.batch_idx, ctx.last_backward = batch, self._in_epoch, micro.should_step
        ctx.gradient_scale = ctx.window.gradient_correction  # what the window's last backward scales by, if it does
        self._features.dispatch(Event.MICRO_BATCH_STARTED, ctx)
        share = piece.share if ctx.items is None else 1.0  # item weighting weighs a half by its items
        ctx.loss_divisor = ctx.window.size / share
        if ctx.weights_in_float32:  # the unscaled loss is backpropagated; its weight goes in with its gradient
            ctx.micro_weight, ctx.loss_divisor = share / ctx.window.size, 1.0
        self._active = micro
        try:
            with self._sync(last=micro.should_step), own_backward(self._fabric) as backward:
                self._fabric_backward = backward  # the Fabric's own, which micro.backward calls
                yield micro
        except BaseException:
            self._active = None
            self._discard_window()  # the window cannot be completed: no step may take what it holds
            raise
        finally:
            self._active = None
        check_backed(micro.loss, micro.index, micro.size)
        self._end_micro_step(micro, piece)

    def _sync(self, last: bool) -> AbstractContextManager:
        deepspeed = isinstance(self._fabric.strategy, fabric_names(self._fabric).DeepSpeedStrategy)  # it reduces as
        return nullcontext() if last or deepspeed else skip_gradient_sync(self._forward, self._policy)  # it accumulates

    def _backward(self, micro: MicroStep, loss: torch.Tensor, reduction: str) -> None:
        ctx = self._ctx
        check_backward(inside=self._active is micro, again=micro.loss is not None)
        loss = as_mean(loss, reduction, ctx.items)
        micro.loss = loss.detach()
        ctx.loss = loss / ctx.loss_divisor  # a fresh tensor, which the features may re-weigh in place
        self._features.dispatch(Event.BEFORE_BACKWARD, ctx)
        self._fabric_backward(ctx.loss, model=self._model)
        self._features.dispatch(Event.AFTER_BACKWARD, ctx)

    def _end_micro_step(self, micro: MicroStep, piece: Piece) -> None:
        """A micro-step's block exited; the window's last makes the gradient final (its end comes with the step)."""
        ctx = self._ctx
        if not (piece.first and piece.last):  # a part of a loader batch: the batch ends with its last part
            self._loader_batch.add(micro.loss, piece.share, ctx.items)
            if not piece.last:
                return
        self._ended = micro
        if micro.should_step:
            ctx.optimizer, ctx.gradient_scale = self._optimizer, ctx.window.gradient_correction
            self._features.dispatch(Event.WINDOW_CLOSING, ctx)
            scale_window(self._fabric, self._wrapped_optimizer, self._optimizer, ctx.gradient_scale)
            self._features.dispatch(Event.GRADIENT_READY, ctx)
            self._ready = True
        else:
            self._micro_batch_ended()

    def _micro_batch_ended(self) -> None:
        ctx, micro = self._ctx, self._ended
        if micro is None:
            return
        self._ended = None
        ctx.samples_seen += ctx.samples_per_micro_step
        ctx.micro_steps += 1
        self._in_epoch, self._in_call = self._in_epoch + 1, self._in_call + 1
        self._data.took()
        loss, whole, self._loader_batch = micro.loss, self._loader_batch, LoaderBatch()
        if whole.loss is not None:  # a loader batch run in parts: the whole batch's loss and items
            loss, ctx.items = whole.loss, whole.items if ctx.items is not None else None
        ctx.loss = None if loss is None else loss / ctx.window.size
        self._features.dispatch(Event.MICRO_BATCH_ENDED, ctx)
        ctx.batch = ctx.loss = None

    def _finish_window(self) -> None:
        """The window's step was taken (or skipped by the loop): its last micro-step ends, and the window with it."""
        ctx = self._ctx
        if self._ended is None or not ctx.window.closed:
            return
        self._ready = False
        ctx.optimizer_steps += 1
        self._micro_batch_ended()
        ctx.metrics = {}
        self._features.dispatch(Event.WINDOW_CLOSED, ctx)
        ctx.optimizer = None
        if self._ends_epoch:  # between this step and the next window, the run is at the next epoch's start
            self._epoch, self._in_epoch = self._epoch + 1, 0

    def _discard_window(self) -> None:
        """Drop a window left before its end: its gradients, and what the strategy kept for its reduction."""
        self._ctx.window.discard()
        self._ended, self._ready, self._pieces, self._begun, self._loader_batch = None, False, [], 0, LoaderBatch()
        self._optimizer.zero_grad(set_to_none=True)
        drop_pending(self._fabric, self._wrapped_optimizer, self._forward)

    # ------------------------------------------------------------------ the optimizer's step

    def _before_step(self, *_: Any) -> None:
        if self._ready or (self._active is None and initializes_state(self._optimizer)):
            return  # the window's step, or torch's checkpoint creating the optimizer's state at learning rate 0
        raise RuntimeError(early_step(self._ctx.window, inside=self._active is not None))

    def _after_step(self, *_: Any) -> None:
        self._finish_window()

    # ------------------------------------------------------------------ misuse between windows

    @property
    def _inside_window(self) -> bool:
        """Whether a window is in progress: a block open, micro-steps left, or its step not taken."""
        return self._active is not None or not self._ctx.window.closed or self._begun < len(self._pieces)

    def _check_between_windows(self, what: str) -> None:
        check_between_windows(what, self._inside_window, self._ctx.window)

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """The position and every feature's state, between windows (``fabric.save(path, {"accumulator": ...})``).

        Raises:
            RuntimeError: Inside a window: a checkpoint is written between windows, after ``optimizer.step()``.
        """
        self._check_between_windows("Accumulator.state_dict")
        self._finish_window()
        ctx = self._ctx
        own: dict[str, Any] = dict(
            epoch=self._epoch, micro_batches_in_epoch=self._in_epoch, optimizer_steps=ctx.optimizer_steps
        )
        own |= dict(samples_seen=ctx.samples_seen, micro_steps=ctx.micro_steps, data=self._data.data.state_dict())
        return {**own, **self._features.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (``fabric.load``), before the resumed run's first :meth:`batches`."""
        self._check_between_windows("Accumulator.load_state_dict")
        ctx = self._ctx
        self._epoch = int(state.get("epoch", 0))
        self._in_epoch = int(state.get("micro_batches_in_epoch", 0))
        ctx.optimizer_steps = int(state.get("optimizer_steps", 0))
        ctx.samples_seen = int(state.get("samples_seen", 0))
        ctx.micro_steps = int(state.get("micro_steps", 0))
        self._data.data.load_state_dict(state.get("data", {}))
        self._features.load_state_dict(state)
        if "token_count" in self._features:  # the schedule's position, as the first epoch's FIT_START publishes it
            ctx.tokens_seen = self._features["token_count"].tokens_seen  # type: ignore[attr-defined]
        ctx.window = Window()

    def close(self) -> None:
        """Give the model and optimizer back as they were (LR hooks, DDP's reduction, FSDP2's reduce dtype).

        The Accumulator takes no more micro-batches after it; another may then be created on the optimizer.
        """
        if self._closed:
            return
        self._closed = True
        self._features.dispatch(Event.FIT_END, self._ctx)
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._unshadow_load()
        self._release()
        self._ctx.release()
