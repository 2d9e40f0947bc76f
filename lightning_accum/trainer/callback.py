r"""AccumulationScheduler: exact gradient accumulation with schedules by epoch, step or sample.

This module is the coordinator. It owns the window, the schedule and the loop routing (which micro-step opens and
closes a window), keeps the position (samples seen, micro-steps), and at each window event updates the
:class:`~lightning_accum.core.events.Context` and dispatches the event to the enabled features
(:mod:`lightning_accum.features`). One micro-step routine serves Lightning's hooks and the micro-batcher alike
(``_start_micro_batch``, then Lightning's backward hooks). A fit starts from its plan, the facts read from the Trainer
once (``_plan``); what it checks before the first batch, what the ranks must agree on, what a checkpoint written
inside a window holds and where the loader resumes live in modules of their own (``_checks``, ``_ranks``,
``_resume``, ``_data``); the features see the Trainer only through ``_run.TrainerRun``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_accum.core.events import Context, Event, Feature, Features
from lightning_accum.core.precision import accumulation_dtype, scale_in_place
from lightning_accum.core.schedule import ScheduleSpec, check_bool
from lightning_accum.core.seesaw import check_seesaw
from lightning_accum.core.types import Confidence, Decay, NonNegativeInt, PositiveFloat, PositiveInt, Scheduling
from lightning_accum.core.window import Window
from lightning_accum.features import (
    AdaptiveGrowth,
    ItemWeighting,
    LRScaling,
    Metrics,
    NoiseScale,
    ProgressBar,
    SampleDrivenSchedules,
    Seesaw,
    TokenCount,
    WideAccumulation,
)
from lightning_accum.strategies.deepspeed import DeepSpeedAccumulationMixin, updating_optimizer
from lightning_accum.strategies.mixin import AccumulationStrategyMixin
from lightning_accum.trainer._checks import check_arguments, check_fsdp2, check_trainer, warn_at_fit_start
from lightning_accum.trainer._data import drop_loader_states_of_other_ranks
from lightning_accum.trainer._loop import LoopControl, ends_epoch
from lightning_accum.trainer._microbatch import AUTO, MicroBatcher
from lightning_accum.trainer._plan import count_steps, factor_before_training, fit_plan
from lightning_accum.trainer._resume import ResumePoint
from lightning_accum.trainer._run import bind


class AccumulationScheduler(Callback):
    r"""Accumulate gradients exactly, with a factor that may change by epoch, optimizer step, samples or tokens.

    Every optimizer step equals the step of one big batch made of its window's micro-batches (the last window of an
    epoch holds what is left), and a factor change applies from the first window that *starts* at or after its
    position (``docs/schedules.md``). Everything else is a feature of its own (:mod:`lightning_accum.features`).

    Args:
        scheduling: ``{position: factor}``; factor 1 before the first key (throughout with no key and no target).
        unit: What the keys count: ``"epoch"``, ``"step"`` (optimizer steps), ``"sample"`` or ``"token"``
            (samples, or loss-bearing tokens as ``normalize_by="token"`` counts them, consumed by all ranks together).
        target_batch_size: The global effective batch in samples: factor = target / (micro-batch x world size).
        ramp_start_batch_size: With the next two: ramp the global batch linearly from this size to the target.
        ramp_increment: How much the global batch grows at each stage of the ramp.
        ramp_samples: Samples (tokens with ``unit="token"``) of all ranks over which the ramp reaches the target.
        micro_batch_size: Below the loader's ``batch_size``: split each loader batch into micro-batches of this many
            rows (the factor counts loader batches; a step calling ``cached`` chunks by it instead); ``"auto"``: halve
            on out-of-memory errors (``docs/microbatching.md``). Else the samples a rank's micro-batch counts.
        lr_scaling: ``"none"``, ``"linear"`` or ``"sqrt"``: the LR times ``effective / base`` or its root, in steps.
        base_batch_size: The global batch at which the LR was tuned; by default the first window's effective batch.
        lr_warmup_steps: Move the scale linearly to each new value over this many optimizer steps.
        lr_scale_max: The largest LR scale, warned of when first passed; ``None``: no cap, warned past 4x the peak LR.
        beta2_follows_batch: Adam's ``beta2 ** (batch / base)`` in each update: its half-life kept in samples.
        normalize_by: A micro-batch weighs the same (``"micro_batch"``) or its items (``"sample"``, ``"token"``).
        token_key: Where ``"token"`` finds the labels: a mapping key or a tuple position.
        ignore_index: The label value that bears no loss.
        count_items: ``batch -> int or tensor``, counting a micro-batch's items instead (and ``unit="token"``'s).
        noise_scale: Estimate the gradient noise scale (the critical batch) and log ``accum/noise_scale``.
        noise_scale_decay: Decay of the estimate's averages per step (and of adaptive's evidence per window), [0, 1).
        noise_scale_interval: Measure every N-th window (``1``: all); the others cost nothing, logged ones included.
        adaptive: Set the factor from the noise scale once the evidence calls for it (needs ``noise_scale``).
        adaptive_target: The wanted effective batch as a multiple of the noise scale.
        adaptive_max_factor: The largest factor adaptive growth may reach.
        adaptive_confidence: One-sided confidence of a factor's first test, spent over its later ones, ``[0.5, 1)``.
        adaptive_shrink: Let the factor come down again when the noise scale's upper bound falls below the batch.
        adaptive_lr_bound: Hold growth to the ``SampleDrivenLR``'s peak over current LR, or past it a tenth of B_noise.
        seesaw: Double the factor where the ``SampleDrivenLR``'s LR halves; ``lr_scaling`` gives back its share.
        seesaw_max_factor: The largest factor Seesaw reaches; past it the LR schedule goes on as given.
        grad_accum_dtype: The dtype micro-batch gradients are summed in where the parameters are narrower
            (``"float32"``, ``"float64"``, a ``torch.dtype``); ``"auto"``: float32 where the strategy supports it, with
            a warning elsewhere; ``None``: the parameters' dtype (``docs/precision.md``).
        log_metrics: Log the ``accum/...`` metrics every ``log_every_n_steps`` steps; show the factor by the bar.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If an argument has a wrong value, or (before the first batch) conflicts with the Trainer
            (``accumulate_grad_batches != 1``, manual optimization, a target batch that does not divide, ...).

    Example::

        # factor 2 for the first 100 optimizer steps, then 8
        trainer = Trainer(callbacks=[AccumulationScheduler(scheduling={0: 2, 100: 8}, unit="step")])

        # a global batch of 256 samples, ramped up from 64 over the first 100k samples
        AccumulationScheduler(target_batch_size=256, ramp_start_batch_size=64, ramp_increment=64, ramp_samples=100_000)
    """

    def __init__(
        self,
        scheduling: Scheduling | None = None,
        unit: Literal["epoch", "step", "sample", "token"] = "epoch",
        target_batch_size: PositiveInt | None = None,
        ramp_start_batch_size: PositiveInt | None = None,
        ramp_increment: PositiveInt | None = None,
        ramp_samples: PositiveInt | None = None,
        micro_batch_size: PositiveInt | Literal["auto"] | None = None,
        lr_scaling: Literal["none", "linear", "sqrt"] = "none",
        base_batch_size: PositiveInt | None = None,
        lr_warmup_steps: NonNegativeInt = 0,
        lr_scale_max: PositiveFloat | None = None,
        beta2_follows_batch: bool = False,
        normalize_by: Literal["micro_batch", "sample", "token"] = "micro_batch",
        token_key: str | int = "labels",
        ignore_index: int = -100,
        count_items: Callable[[Any], Any] | None = None,
        noise_scale: bool = False,
        noise_scale_decay: Decay = 0.95,
        noise_scale_interval: PositiveInt = 10,
        adaptive: bool = False,
        adaptive_target: PositiveFloat = 1.0,
        adaptive_max_factor: PositiveInt = 64,
        adaptive_confidence: Confidence = 0.9,
        adaptive_shrink: bool = False,
        adaptive_lr_bound: bool = True,
        seesaw: bool = False,
        seesaw_max_factor: PositiveInt = 8,
        log_metrics: bool = True,
        grad_accum_dtype: str | None = "auto",
    ) -> None:
        super().__init__()
        check_arguments(adaptive, noise_scale, micro_batch_size)
        # The one place features are registered, each with its switch (arguments checked, on or off), in the order
        # events reach them: each publishes what the ones after it read; metrics logs what all of them added.
        growth = (adaptive_target, adaptive_max_factor, adaptive_confidence, adaptive_shrink, adaptive_lr_bound)
        registry: list[tuple[Feature, bool]] = [
            (TokenCount(token_key, ignore_index, count_items, normalize_by), unit == "token"),
            (ItemWeighting(normalize_by, token_key, ignore_index, count_items), normalize_by != "micro_batch"),
            (WideAccumulation(*accumulation_dtype(grad_accum_dtype)), grad_accum_dtype is not None),
            (NoiseScale(noise_scale_decay, noise_scale_interval, adaptive), check_bool("noise_scale", noise_scale)),
            (AdaptiveGrowth(*growth), adaptive),
            (LRScaling(lr_scaling, base_batch_size, lr_warmup_steps, lr_scale_max, beta2_follows_batch), True),
            (SampleDrivenSchedules(), True),
            (Seesaw(seesaw_max_factor, lr_scaling), check_seesaw(seesaw, seesaw_max_factor, adaptive)),  # reads it
            (ProgressBar(), True),
            (Metrics(), check_bool("log_metrics", log_metrics)),
        ]
        self._features = Features(feature for feature, enabled in registry if enabled)
        size = None if isinstance(micro_batch_size, str) else micro_batch_size  # "auto" starts at the loader's
        self._spec = ScheduleSpec.from_args(
            scheduling, unit, target_batch_size, ramp_start_batch_size, ramp_increment, ramp_samples, size
        )
        self._batcher = MicroBatcher(size, auto=micro_batch_size == AUTO)  # splits larger loader batches, if installed
        self._ctx = Context()  # the position, the window and what features publish; handed to every event
        self._loop: LoopControl | None = None  # from setup to teardown
        self._resume = ResumePoint()  # what a checkpoint written inside a window resumes from, and where in the data

    @property
    def factor(self) -> int:
        """The size of the window in progress (the factor it was opened with, or what was left of the epoch)."""
        return self._ctx.window.size

    @property
    def samples_seen(self) -> int:
        """Samples consumed by all ranks together, counted as ``micro_batch_size x world_size`` per micro-batch."""
        return self._ctx.samples_seen

    @property
    def features(self) -> Features:
        """The enabled features by name, read-only: ``scheduler.features["noise_scale"].estimate``."""
        return self._features

    def estimated_stepping_batches(self, trainer: pl.Trainer) -> int | float:
        """The optimizer steps this run takes under the schedule, for sizing LR schedulers (see the function)."""
        seesaw = self._features.get("seesaw")  # from the fit's start: the steps at Seesaw's factors
        if isinstance(seesaw, Seesaw) and seesaw.fitting and seesaw.planned_steps is not None:
            return seesaw.planned_steps
        return count_steps(trainer, self._spec)

    # ------------------------------------------------------------------ the fit

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        check_trainer(trainer, pl_module, self, AccumulationScheduler)
        bind(ctx := self._ctx, trainer, pl_module)
        if trainer.global_step == 0:  # a new run (a checkpoint, restored after setup, overrides this)
            ctx.samples_seen = ctx.micro_steps = 0
            ctx.window = Window()
            self._features.reset()
        self._features.dispatch(Event.SETUP, ctx)
        self._resume = ResumePoint()
        # with micro-batching the micro-batcher zeroes a window's gradients before its first loader batch's parts
        self._loop = LoopControl(
            trainer, lambda: ctx.window.is_first and not self._batcher.zeroes, lambda: ctx.window.closed
        )
        # a tuner runs the loop before the windows take charge: as stock Lightning with the first window's factor
        self._loop.set_factor(factor_before_training(trainer, self._spec, ctx.samples_seen))
        if isinstance(trainer.strategy, AccumulationStrategyMixin):
            trainer.strategy.connect_window(lambda: ctx.window.closed)
            trainer.strategy.drop_unreduced_gradients()  # from a previous fit that ended in the middle of a window

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        check_fsdp2(trainer)  # after configure_model, before the sanity check's first forward

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        ctx, features, batcher = self._ctx, self._features, self._batcher
        weighs, restored = "item_weighting" in features, self._resume.restored
        plan = fit_plan(trainer, self._spec, batcher.size, batcher.auto, weighs, restored, ctx.run.names)
        ctx.start(plan)  # the fit's facts, found once: every rank's micro-batch size, the schedule, where it starts
        ctx.optimizers = [updating_optimizer(o) for o in trainer.optimizers]
        batcher.start(trainer, pl_module, owner=self, ctx=ctx)  # split loader batches where the plan says so
        self._resume.data.fit_started(trainer, ctx, self._spec.target_batch_size, "adaptive" in features)
        features.dispatch(Event.FIT_START, ctx)
        batcher.start_halves(trainer, pl_module, owner=self, ctx=ctx)  # where the noise scale measures in halves
        features.settle()  # the features this fit gives nothing to do leave the window events
        assert self._loop is not None, "setup creates it"
        self._loop.take_charge()  # before the loop resets: a restart asks where the last window ended
        self._resume.between_windows(trainer, self._current_state())
        warn_at_fit_start(trainer, plan, features.handle(Event.WINDOW_OPENING), batcher.installed)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, *_: Any) -> None:
        ctx, self._resume.in_step = self._ctx, False  # a batch whose rest of epoch was skipped (-1) never ended
        if not ctx.window.closed:  # an epoch cut short (should_stop, a skipped rest of epoch): it never stepped
            ctx.window.discard()
            _drop_unreduced_gradients(trainer)
            if self._resume.ready:
                self._resume.between_windows(trainer, self._current_state())
        if self._in_charge:
            ctx.optimizer_steps = trainer.global_step
            self._features.dispatch(Event.EPOCH_STARTED, ctx)

    # ------------------------------------------------------------------ one micro-step

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *_: Any) -> None:
        if self._loop is None or not self._loop.take_charge():  # not while another component sets the factor
            return
        ctx = self._ctx
        # the loop's own index: the hook's argument lags by one with `training_step(self, dataloader_iter)`
        ctx.batch_idx = trainer.fit_loop.epoch_loop.batch_idx
        self._resume.in_step = True
        self._batcher.inspect(batch, halves=ctx.noise_parts > 1)  # the fit's first batch, before a weight changes
        if ctx.window.closed:
            self._resume.window_opened(trainer)
            self._open_window(trainer)
        ctx.window.take(ends_epoch=ends_epoch(trainer, ctx.batch_idx))
        if not self._batcher.installed:  # else each micro-batch starts inside the micro-batcher's training_step
            self._start_micro_batch(batch)

    def _start_micro_batch(self, batch: Any, share: float = 1.0, last: bool = True) -> tuple[Any, float]:
        """A micro-batch (``share`` of a loader batch's rows; ``last``: its last part) begins: ``(items, weight)``."""
        ctx = self._ctx
        ctx.batch, ctx.last_backward = batch, ctx.window.closed and last
        ctx.gradient_scale = ctx.window.gradient_correction  # what the window's last backward scales by, if it does
        self._features.dispatch(Event.MICRO_BATCH_STARTED, ctx)
        share = share if ctx.items is None else 1.0  # item weighting weighs micro-batches itself
        ctx.loss_divisor = ctx.window.size / share
        if ctx.weights_in_float32:  # the unscaled loss is backpropagated; its weight goes in with its gradient
            ctx.micro_weight, ctx.loss_divisor, share = share / ctx.window.size, 1.0, 1.0
        return ctx.items, share

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self._in_charge and not self._batcher.anchored:  # the micro-batcher's anchor is no micro-batch
            self._ctx.loss = loss
            self._features.dispatch(Event.BEFORE_BACKWARD, self._ctx)

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._in_charge and not self._batcher.anchored:
            self._features.dispatch(Event.AFTER_BACKWARD, self._ctx)

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if not self._in_charge:
            return
        ctx = self._ctx
        # the gradient holds sum(grad_i) / size; only an epoch of unknown length ends a window before it is full
        ctx.optimizer, ctx.gradient_scale = updating_optimizer(optimizer), ctx.window.gradient_correction
        self._features.dispatch(Event.WINDOW_CLOSING, ctx)
        _scale_gradients(trainer, optimizer, ctx.gradient_scale)
        self._features.dispatch(Event.GRADIENT_READY, ctx)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *_: Any) -> None:
        self._resume.in_step = False
        if not self._in_charge:
            return
        ctx = self._ctx
        ctx.samples_seen, ctx.micro_steps = ctx.samples_seen + ctx.samples_per_micro_step, ctx.micro_steps + 1
        self._resume.data.batch_ended(trainer, ctx.batch_idx)
        if ctx.window.closed:  # the window's last micro-step, which steps (or skipped its step)
            ctx.optimizer_steps = trainer.global_step
        report = self._batcher.report()  # a split loader batch's loss and items, over its micro-batches
        if report is not None:
            loss, ctx.items = report
            ctx.loss = None if loss is None else loss / ctx.window.size
        elif self._features.handle(Event.MICRO_BATCH_ENDED):  # what training_step returned, for whoever reads it
            ctx.loss = _window_share(outputs, ctx)
        self._features.dispatch(Event.MICRO_BATCH_ENDED, ctx)
        if ctx.window.closed:
            ctx.metrics = {**self._batcher.metrics()}
            self._features.dispatch(Event.WINDOW_CLOSED, ctx)
            self._resume.between_windows(trainer, self._current_state())
        ctx.batch = ctx.loss = ctx.optimizer = None

    def _restart_window(self, trainer: pl.Trainer) -> None:
        """Out of memory (``"auto"``): drop the window in progress; this loader batch opens one (``Owner`` protocol)."""
        _drop_unreduced_gradients(trainer)
        ctx, closing = self._ctx, self._ctx.window.closed
        ctx.loss = ctx.batch = None  # the failed attempt's graph and batch: nothing may keep them alive
        ctx.window.discard()
        self._open_window(trainer, closing=closing)
        ctx.window.take(ends_epoch=ends_epoch(trainer, ctx.batch_idx))

    def _couple(self) -> None:  # Owner protocol: a step couples its rows (`cached`): no batch is split, nor halved
        self._ctx.can_split = False

    def _open_window(self, trainer: pl.Trainer, closing: bool | None = None) -> None:
        """Open a window at ``ctx.batch_idx``; ``closing`` forces whether this batch ends it (a restart)."""
        ctx, loop = self._ctx, self._loop
        assert loop is not None, "_take_charge checked it"
        ctx.optimizer_steps = trainer.global_step  # it changes only at a window's end
        ctx.factor = ctx.scheduled_factor(trainer.current_epoch)
        self._features.dispatch(Event.WINDOW_OPENING, ctx)
        ctx.factor = int(min(ctx.factor, trainer.num_training_batches))  # what a window can hold, for the LR and logs
        size = min(ctx.factor, trainer.num_training_batches - ctx.batch_idx)  # a window never spans epochs
        if closing is not None:  # Lightning decided before training_step whether this batch steps: keep to it
            size = 1 if closing else max(2, size)
        ctx.window.open(int(size))
        loop.set_factor(1 if ctx.weights_in_float32 else ctx.window.size)  # the divisor Lightning applies to a loss
        ctx.summary = []
        self._features.dispatch(Event.WINDOW_OPENED, ctx)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._release(trainer)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._release(trainer)

    # ------------------------------------------------------------------ checkpoints

    @override
    def state_dict(self) -> dict[str, Any]:  # inside a window: the state from before it, where it resumes
        return self._resume.state(self._current_state(), window_open=not self._ctx.window.closed)

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        self._resume.rewind(checkpoint, window_open=not self._ctx.window.closed)
        self._features.on_save_checkpoint(checkpoint)

    @override
    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        drop_loader_states_of_other_ranks(trainer, checkpoint, self.state_key)  # before Lightning loads them

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        ctx, self._resume.restored = self._ctx, True
        ctx.samples_seen, ctx.micro_steps = (int(state_dict.get(key, 0)) for key in ("samples_seen", "micro_steps"))
        self._resume.data.load_state_dict(state_dict.get("data", {}))
        self._batcher.load_state_dict(state_dict)
        self._features.load_state_dict(state_dict)
        ctx.window.load_state_dict(state_dict.get("window", {}))

    def _current_state(self) -> dict[str, Any]:
        ctx, data = self._ctx, self._resume.data.state_dict()
        own = {"samples_seen": ctx.samples_seen, "micro_steps": ctx.micro_steps, "window": ctx.window.state_dict()}
        return {**own, "data": data, **self._batcher.state_dict(), **self._features.state_dict()}

    # ------------------------------------------------------------------ who decides

    @property
    def _in_charge(self) -> bool:
        return self._loop is not None and self._loop.in_charge

    def _release(self, trainer: pl.Trainer) -> None:
        """Give the Trainer back as it was; safe to call more than once."""
        self._features.dispatch(Event.FIT_END, self._ctx)
        if isinstance(trainer.strategy, AccumulationStrategyMixin):
            trainer.strategy.connect_window(None)
        if self._loop is not None:
            self._loop.release()
            self._loop = None
        self._batcher.release()
        self._resume.data.release()
        self._ctx.release()


def estimated_stepping_batches(trainer: pl.Trainer) -> int | float:
    """The optimizer steps of this fit under the trainer's :class:`AccumulationScheduler`.

    Falls back to ``trainer.estimated_stepping_batches`` when no ``AccumulationScheduler`` is attached, so a module
    can call it unconditionally from ``configure_optimizers``.

    Example::

        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            total = lightning_accum.estimated_stepping_batches(self.trainer)
            return [optimizer], [torch.optim.lr_scheduler.OneCycleLR(optimizer, 0.1, total_steps=total)]
    """
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, AccumulationScheduler):
            return callback.estimated_stepping_batches(trainer)
    return trainer.estimated_stepping_batches


def _drop_unreduced_gradients(trainer: pl.Trainer) -> None:
    """A window abandoned before its end: the strategy forgets what it kept for a reduction that will not come."""
    if isinstance(trainer.strategy, (AccumulationStrategyMixin, DeepSpeedAccumulationMixin)):
        trainer.strategy.drop_unreduced_gradients()


def _window_share(outputs: Any, ctx: Context) -> torch.Tensor | None:
    """The loss ``training_step`` returned over the window's size (Lightning divides by 1 when weighing in float32)."""
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    return (loss / ctx.window.size if ctx.weights_in_float32 else loss) if isinstance(loss, torch.Tensor) else None


def _scale_gradients(trainer: pl.Trainer, optimizer: Any, scale: float | torch.Tensor) -> None:
    if isinstance(trainer.strategy, DeepSpeedAccumulationMixin):  # ZeRO holds the window's gradient, not `.grad`
        # folded into ZeRO's loss-scale divisor, a host number: the one read of a scale kept on the device
        trainer.strategy.scale_window_gradients(optimizer, float(scale))
    else:
        scale_in_place(
            [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None], scale
        )
