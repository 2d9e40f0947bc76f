r"""AccumulationScheduler: exact gradient accumulation with schedules by epoch, step or sample.

This module is the coordinator and the only place that talks to the Trainer. It owns the window, the schedule and
the loop routing (which micro-step opens and closes a window), keeps the position (samples seen, micro-steps), and
at each window event updates the :class:`~lightning_accum.events.Context` and dispatches the event to the enabled
features (:mod:`lightning_accum.features`). It holds no feature's state: the checkpoint is its own position and
window plus each feature's state under the feature's name.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler, LearningRateFinder
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_accum._loop import LoopControl, ends_epoch
from lightning_accum._microbatch import AUTO, MicroBatcher
from lightning_accum._resume import ResumePoint
from lightning_accum._types import Decay, NonNegativeInt, PositiveFloat, PositiveInt, Scheduling
from lightning_accum.events import Context, Event, Feature, Features, resolve, takes_dataloader_iter
from lightning_accum.features import (
    AdaptiveGrowth,
    ItemWeighting,
    LRScaling,
    Metrics,
    NoiseScale,
    ProgressBar,
    TokenCount,
    WideAccumulation,
)
from lightning_accum.precision import check_grad_accum_dtype
from lightning_accum.schedule import Schedule, ScheduleSpec, check_bool, count_optimizer_steps
from lightning_accum.strategies.mixin import AccumulationStrategyMixin
from lightning_accum.sync import fsdp2_modules
from lightning_accum.window import Window


class AccumulationScheduler(Callback):
    r"""Accumulate gradients exactly, with a factor that may change by epoch, optimizer step or samples consumed.

    Every optimizer step equals the step of one big batch made of its window's micro-batches: each micro-batch's loss
    is divided by the micro-batches the window really holds (the last window of an epoch holds what is left), and a
    factor change never splits or merges a window: it applies from the first window that *starts* at or after its
    position (see ``docs/schedules.md``). Everything else is a feature of its own (:mod:`lightning_accum.features`),
    switched on by its arguments.

    Args:
        scheduling: ``{position: factor}``; positions before the first key use factor 1. ``None`` with no
            ``target_batch_size`` means factor 1 throughout.
        unit: What the keys count: ``"epoch"``, ``"step"`` (optimizer steps), ``"sample"`` (samples consumed by all
            ranks together, ``micro_batch_size x world_size`` per micro-step) or ``"token"`` (loss-bearing tokens
            consumed by all ranks together, counted as ``normalize_by="token"`` counts them;
            :class:`~lightning_accum.features.TokenCount`). With a ramp, ``"token"`` makes ``ramp_samples`` count
            tokens.
        target_batch_size: The global effective batch in samples: factor = target / (micro-batch x world size).
        ramp_start_batch_size: With the next two: ramp the global batch linearly from this size to
            ``target_batch_size``, as Megatron's ``--rampup-batch-size``.
        ramp_increment: How much the global batch grows at each stage of the ramp.
        ramp_samples: Samples (all ranks together; tokens with ``unit="token"``) over which the ramp reaches
            ``target_batch_size``.
        micro_batch_size: Below the train dataloader's ``batch_size``: split each loader batch into micro-batches of
            this many rows, each with its own forward and backward (the factor still counts loader batches).
            ``"auto"``: start at the loader's batch and halve on out-of-memory errors, every rank alike
            (docs/microbatching.md). Otherwise: the samples a rank's micro-batch counts, by default the loader's
            ``batch_size``.
        lr_scaling: ``"none"``, ``"linear"`` or ``"sqrt"``: the LR used is the configured one times
            ``effective / base`` or its square root, inside ``optimizer.step()`` only
            (:class:`~lightning_accum.features.LRScaling`).
        base_batch_size: The global batch at which the LR was tuned; by default the first window's effective batch.
        lr_warmup_steps: Move the scale linearly to each new value over this many optimizer steps.
        normalize_by: What a micro-batch weighs: ``"micro_batch"`` (the same), ``"sample"`` or ``"token"`` (its
            items, over the window and all ranks; :class:`~lightning_accum.features.ItemWeighting`).
        token_key: Where ``"token"`` finds the labels: a mapping key or a tuple position.
        ignore_index: The label value that bears no loss.
        count_items: ``batch -> int or tensor``, counting a micro-batch's items instead.
        noise_scale: Estimate the gradient noise scale from the micro-batch gradients and log
            ``accum/noise_scale`` (:class:`~lightning_accum.features.NoiseScale`; not with FSDP).
        noise_scale_decay: Decay of the moving averages that smooth the estimate, in ``[0, 1)``.
        adaptive: Double the factor when the noise scale calls for a larger batch; rank zero decides for every rank
            (needs ``noise_scale``; :class:`~lightning_accum.features.AdaptiveGrowth`).
        adaptive_target: The wanted effective batch as a multiple of the noise scale.
        adaptive_max_factor: The largest factor adaptive growth may reach.
        adaptive_interval: Optimizer steps between two adaptive checks.
        adaptive_patience: Consecutive checks that must call for growth before the factor doubles.
        grad_accum_dtype: The dtype micro-batch gradients are summed in where the parameters are narrower
            (``bf16-true``, ``16-true``, FSDP2 with a bfloat16 ``param_dtype``): ``"float32"``, ``"float64"`` or a
            ``torch.dtype``; ``"auto"`` (the default) is ``"float32"`` where the strategy supports it and the
            parameters' dtype elsewhere, with a warning; ``None`` always the parameters' dtype. Costs 4 bytes per
            narrower trainable parameter (:class:`~lightning_accum.features.WideAccumulation`).
        log_metrics: Log the ``accum/...`` metrics every ``Trainer(log_every_n_steps)`` optimizer steps through every
            logger, with a TensorBoard dashboard, and show the factor in the progress bar
            (:class:`~lightning_accum.features.Metrics`).

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If an argument has a wrong value, or (before the first batch) conflicts with the Trainer:
            ``accumulate_grad_batches != 1``, a strategy that accumulates by itself (DeepSpeed), manual
            optimization, a target batch that does not divide.

    Example::

        from lightning.pytorch import Trainer
        from lightning_accum import AccumulationScheduler

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
        normalize_by: Literal["micro_batch", "sample", "token"] = "micro_batch",
        token_key: str | int = "labels",
        ignore_index: int = -100,
        count_items: Callable[[Any], Any] | None = None,
        noise_scale: bool = False,
        noise_scale_decay: Decay = 0.95,
        adaptive: bool = False,
        adaptive_target: PositiveFloat = 1.0,
        adaptive_max_factor: PositiveInt = 64,
        adaptive_interval: PositiveInt = 50,
        adaptive_patience: PositiveInt = 2,
        log_metrics: bool = True,
        grad_accum_dtype: str | None = "auto",
    ) -> None:
        super().__init__()
        growth = AdaptiveGrowth(adaptive_target, adaptive_max_factor, adaptive_interval, adaptive_patience)
        if check_bool("adaptive", adaptive) and noise_scale is not True:
            raise ValueError(
                f"`adaptive=True` grows the factor from the measured noise scale: set noise_scale=True as well (got"
                f" noise_scale={noise_scale!r})"
            )
        # The one place features are registered, each with its switch. Every feature's arguments are checked, on or
        # off; the order is the order events reach them: weighting publishes the items the noise scale reads, wide
        # accumulation moves each micro-batch's gradient out before the noise scale sets aside the window's sum (it
        # then finds no sum to hold), the noise scale publishes what growth reads, growth the factor LR scaling reads,
        # and metrics logs what all of them added.
        registry: list[tuple[Feature, bool]] = [
            (TokenCount(token_key, ignore_index, count_items if normalize_by == "token" else None), unit == "token"),
            (ItemWeighting(normalize_by, token_key, ignore_index, count_items), normalize_by != "micro_batch"),
            (WideAccumulation(*_accumulation_dtype(grad_accum_dtype)), grad_accum_dtype is not None),
            (NoiseScale(noise_scale_decay), check_bool("noise_scale", noise_scale)),
            (growth, adaptive),
            (LRScaling(lr_scaling, base_batch_size, lr_warmup_steps), True),
            (ProgressBar(), True),
            (Metrics(), check_bool("log_metrics", log_metrics)),
        ]
        self._features = Features(feature for feature, enabled in registry if enabled)
        auto = micro_batch_size == AUTO
        if isinstance(micro_batch_size, str) and not auto:
            raise ValueError(f"`micro_batch_size` must be an integer >= 1, 'auto' or None, got {micro_batch_size!r}")
        self._spec = ScheduleSpec.from_args(
            scheduling,
            unit,
            target_batch_size,
            ramp_start_batch_size,
            ramp_increment,
            ramp_samples,
            None if auto else micro_batch_size,  # type: ignore[arg-type]
        )
        # splits loader batches larger than `micro_batch_size` (installed at fit start when a batch is larger)
        self._batcher = (
            MicroBatcher(None if auto else micro_batch_size, auto, self._split_hooks())  # type: ignore[arg-type]
            if micro_batch_size is not None
            else None
        )
        self._ctx = Context()  # the position, the window and what features publish; handed to every event
        self._schedule: Schedule | None = None  # built at fit start, from the micro-batch size every rank shares
        self._loop: LoopControl | None = None  # from setup to teardown
        self._resume = ResumePoint()  # what a checkpoint written inside a window resumes from

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
        """The enabled features by name (``"noise_scale"``, ``"adaptive"``, ``"lr_scaling"``, ...), read-only.

        Example::

            estimate = scheduler.features["noise_scale"].estimate.noise_scale
        """
        return self._features

    def estimated_stepping_batches(self, trainer: pl.Trainer) -> int | float:
        """The number of optimizer steps this run takes under the schedule, for sizing LR schedulers.

        ``trainer.estimated_stepping_batches`` assumes one constant factor (``Trainer(accumulate_grad_batches)``);
        call this instead, or :func:`estimated_stepping_batches`, from ``configure_optimizers``.

        Example::

            def configure_optimizers(self):
                optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3)
                total = lightning_accum.estimated_stepping_batches(self.trainer)
                scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-3, total_steps=total)
                return [optimizer], [{"scheduler": scheduler, "interval": "step"}]
        """
        return _count_steps(trainer, self._spec, micro_batch_size=None)

    # ------------------------------------------------------------------ Trainer hooks: the window's life

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        _check_trainer(trainer, pl_module, self)
        ctx = self._ctx
        ctx.bind(trainer, pl_module)
        if trainer.global_step == 0:  # a new run (a checkpoint, restored after setup, overrides this)
            ctx.samples_seen = ctx.micro_steps = 0
            ctx.window = Window()
            self._features.reset()
        self._features.dispatch(Event.SETUP, ctx)
        self._resume = ResumePoint()
        # with micro-batching the window's gradients are zeroed before its first loader batch's micro-batches run
        self._loop = LoopControl(
            trainer, lambda: ctx.window.is_first and not self._splitting, lambda: ctx.window.closed
        )
        # what runs the loop before the windows take charge (a tuner, from on_fit_start) accumulates as stock
        # Lightning would with the first window's factor
        self._loop.set_factor(_factor_before_training(trainer, self._spec, ctx.samples_seen))
        if isinstance(trainer.strategy, AccumulationStrategyMixin):
            trainer.strategy.connect_window(lambda: ctx.window.closed)
            trainer.strategy.drop_unreduced_gradients()  # from a previous fit that ended in the middle of a window

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        ctx = self._ctx
        # the one place the micro-batch size is decided, the same on every rank, so every rank builds one schedule
        split = _splits(trainer, self._batcher)
        given = None if split else self._spec.micro_batch_size  # with splitting, the loader's batch is what counts
        ctx.micro_batch_size = _agree_across_ranks(trainer, _infer_micro_batch_size(trainer, given), given)
        if split:
            assert self._batcher is not None
            _check_splitting(trainer, self._batcher, self._features)
            self._batcher.install(trainer, pl_module)
        ctx.splitting = split
        self._schedule = self._spec.build(ctx.micro_batch_size, trainer.world_size)
        if self._schedule.max_factor > trainer.num_training_batches:
            rank_zero_warn(
                f"AccumulationScheduler: the schedule reaches factor {self._schedule.max_factor}, more than an"
                f" epoch's {trainer.num_training_batches} batches, and a window never spans epochs: such windows hold"
                f" {trainer.num_training_batches} micro-batches, and LR scaling and the logs use that. Use a smaller"
                " factor, or more batches per epoch"
            )
        if trainer.ckpt_path is not None and not self._resume.restored and trainer.global_step > 0:
            self._count_from_the_loop(trainer)
        if trainer.ckpt_path is not None:
            _warn_if_resuming_mid_epoch_without_loader_state(trainer)
        ctx.optimizers, ctx.optimizer_steps = list(trainer.optimizers), trainer.global_step
        ctx.schedule, ctx.factor, ctx.summary = self._schedule, self._scheduled_factor(trainer), []
        self._features.dispatch(Event.FIT_START, ctx)
        self._features.settle()  # the features this fit gives nothing to do leave the window events
        self._take_charge(trainer)  # before the loop resets: a restart asks where the last window ended
        self._resume.between_windows(trainer, self._current_state(between=True))
        if self._schedule.max_factor > 1 or self._features.handle(Event.WINDOW_OPENING):
            _warn_if_optimization_hooks_are_overridden(pl_module)
            steps = _count_steps(trainer, self._spec, ctx.micro_batch_size)
            bound = " at most" if self._features.handle(Event.WINDOW_OPENING) else ""
            rank_zero_info(
                f"AccumulationScheduler: this run takes{bound} {steps} optimizer steps;"
                " `trainer.estimated_stepping_batches` does not know the schedule: size LR schedules with"
                " `lightning_accum.estimated_stepping_batches(trainer)`."
            )

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, *_: Any) -> None:
        self._resume.in_step = False  # a batch whose rest of epoch was skipped (-1) never reached its end
        if not self._ctx.window.closed:
            # an epoch cut short (should_stop, a skipped rest of epoch): its partial window never stepped
            self._ctx.window.discard()
            if isinstance(trainer.strategy, AccumulationStrategyMixin):
                trainer.strategy.drop_unreduced_gradients()
            if self._resume.ready:
                self._resume.between_windows(trainer, self._current_state(between=True))

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *_: Any) -> None:
        if not self._take_charge(trainer):
            return
        ctx, loop = self._ctx, self._loop
        assert loop is not None, "_take_charge checked it"
        # the loop's own index: the hook's argument lags by one with `training_step(self, dataloader_iter)`
        batch_idx = trainer.fit_loop.epoch_loop.batch_idx
        self._resume.in_step = True
        if ctx.window.closed:
            ctx.optimizer_steps = trainer.global_step  # it changes only at a window's end
            self._resume.window_opened(trainer)
            self._open_window(trainer, batch_idx)
        ctx.window.take(ends_epoch=ends_epoch(trainer, batch_idx))
        ctx.batch, ctx.batch_idx = batch, batch_idx
        if not self._splitting:
            self._features.dispatch(Event.MICRO_BATCH_STARTED, ctx)
        elif ctx.window.is_first:  # Lightning would zero them after training_step, where the micro-batches run
            for optimizer in trainer.optimizers:
                optimizer.zero_grad(set_to_none=True)

    def _open_window(self, trainer: pl.Trainer, batch_idx: int, closing: bool | None = None) -> None:
        """Open a window at ``batch_idx``; ``closing`` forces whether this batch ends it (a restart, see below)."""
        ctx, loop = self._ctx, self._loop
        assert loop is not None, "_take_charge checked it"
        ctx.factor = self._scheduled_factor(trainer)
        self._features.dispatch(Event.WINDOW_OPENING, ctx)
        # what a window can hold, for the LR and the logs
        ctx.factor = int(min(ctx.factor, trainer.num_training_batches))
        # a window never spans epochs: the last one holds what is left (when the epoch's length is known)
        size = min(ctx.factor, trainer.num_training_batches - batch_idx)
        if closing is not None:  # Lightning decided before training_step whether this batch steps: keep to it
            size = 1 if closing else max(2, size)
        ctx.window.open(int(size))
        loop.set_factor(ctx.window.size)  # the divisor Lightning applies to each loss
        ctx.summary = []
        self._features.dispatch(Event.WINDOW_OPENED, ctx)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if not self._in_charge:
            return
        share = 1.0
        if self._splitting:
            assert self._batcher is not None
            if self._batcher.anchored:
                return  # the anchor's backward adds zeros: no micro-batch's
            share = self._batcher.share
        self._ctx.loss, self._ctx.loss_divisor = loss, self._ctx.window.size / share
        self._features.dispatch(Event.BEFORE_BACKWARD, self._ctx)

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._anchored:
            self._batcher.anchored = False  # type: ignore[union-attr]
            return
        if self._in_charge:
            self._features.dispatch(Event.AFTER_BACKWARD, self._ctx)

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if not self._in_charge:
            return
        ctx = self._ctx
        # the gradient holds sum(grad_i) / size; only an epoch of unknown length ends a window before it is full
        ctx.optimizer, ctx.gradient_scale = optimizer, ctx.window.gradient_correction
        self._features.dispatch(Event.WINDOW_CLOSING, ctx)
        if ctx.gradient_scale != 1.0:
            _scale_gradients(optimizer, ctx.gradient_scale)
        self._features.dispatch(Event.GRADIENT_READY, ctx)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *_: Any) -> None:
        self._resume.in_step = False
        if not self._in_charge:
            return
        ctx = self._ctx
        ctx.samples_seen += ctx.samples_per_micro_step
        ctx.micro_steps += 1
        if ctx.window.closed:  # the window's last micro-step, which steps (or skipped its step)
            ctx.optimizer_steps = trainer.global_step
        if self._features.handle(Event.MICRO_BATCH_ENDED):  # what training_step returned, for whoever reads it
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            ctx.loss = loss if isinstance(loss, torch.Tensor) else None
        if self._splitting:  # the loader batch's loss and items, over its micro-batches
            assert self._batcher is not None
            batch_loss, ctx.items = self._batcher.report
            ctx.loss = None if batch_loss is None else batch_loss / ctx.window.size
        self._features.dispatch(Event.MICRO_BATCH_ENDED, ctx)
        if ctx.window.closed:
            ctx.metrics = {}
            if self._splitting:
                assert self._batcher is not None
                ctx.metrics["accum/micro_batch_size"] = float(self._batcher.size or 0)
            self._features.dispatch(Event.WINDOW_CLOSED, ctx)
            self._resume.between_windows(trainer, self._current_state(between=True))
        ctx.batch = ctx.loss = ctx.optimizer = None

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._release(trainer)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._release(trainer)

    @override
    def state_dict(self) -> dict[str, Any]:
        if self._rewinding:  # inside a window: the state from before it, which the checkpoint resumes from
            assert self._resume.callback_state is not None
            state = copy.deepcopy(resolve(self._resume.callback_state))
            if "micro_batch_size_found" in (current := self._current_state()):
                state["micro_batch_size_found"] = current["micro_batch_size_found"]  # a size found stays found
            return state
        return self._current_state()

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if self._rewinding:
            self._resume.rewind(checkpoint)
        self._features.on_save_checkpoint(checkpoint)

    def _current_state(self, between: bool = False) -> dict[str, Any]:
        """The callback's state; ``between`` windows, each feature's :meth:`~Feature.window_state` (see resolve)."""
        ctx = self._ctx
        own = {"samples_seen": ctx.samples_seen, "micro_steps": ctx.micro_steps, "window": ctx.window.state_dict()}
        if self._batcher is not None and self._batcher.auto and self._batcher.size is not None:
            own["micro_batch_size_found"] = self._batcher.size
        return {**own, **(self._features.window_states() if between else self._features.state_dict())}

    @property
    def _rewinding(self) -> bool:
        """Whether a checkpoint written now falls inside a window (a micro-step in progress, or a window open)."""
        resume = self._resume
        return resume.ready and (resume.in_step or not self._ctx.window.closed) and not resume.stepped

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state, ctx = _upgrade_state(state_dict), self._ctx
        self._resume.restored = True
        ctx.samples_seen = int(state.get("samples_seen", 0))
        ctx.micro_steps = int(state.get("micro_steps", 0))
        if self._batcher is not None and self._batcher.auto and state.get("micro_batch_size_found"):
            self._batcher.size = int(state["micro_batch_size_found"])  # a resumed run does not search again
        self._features.load_state_dict(state)
        ctx.window.load_state_dict(state.get("window", {}))
        if not ctx.window.closed:
            rank_zero_warn(
                f"AccumulationScheduler: the checkpoint was written after micro-step {ctx.window.taken} of a window"
                f" of {ctx.window.size} by an earlier lightning_accum, which kept no window start; that"
                " window's gradients are not in the checkpoint, so training resumes with a new window."
            )
            ctx.window.discard()

    def _count_from_the_loop(self, trainer: pl.Trainer) -> None:
        """A resume from a checkpoint without this callback's state: count what was done from the loop's batches."""
        ctx = self._ctx
        done = int(getattr(trainer.fit_loop.epoch_loop.batch_progress.total, "processed", 0))  # a _ProcessedTracker
        ctx.micro_steps, ctx.samples_seen = done, done * ctx.samples_per_micro_step
        rank_zero_warn(
            f"AccumulationScheduler: the checkpoint {str(trainer.ckpt_path)!r} holds no AccumulationScheduler state"
            f" (it was written without this callback); counting the {done} micro-batches the loop has done"
            f" ({ctx.samples_seen} samples) for the schedule, while the LR-scaling base and warmup, the noise-scale"
            " estimate and adaptive growth start afresh"
        )

    # ------------------------------------------------------------------ micro-batching: the coordinator's side

    @property
    def _splitting(self) -> bool:
        return self._batcher is not None and self._batcher.installed

    @property
    def _anchored(self) -> bool:
        """Whether the backward Lightning runs now is the micro-batcher's anchor (no micro-batch's)."""
        return self._splitting and self._batcher is not None and self._batcher.anchored

    def _split_hooks(self) -> dict[str, Callable[..., Any]]:
        return {
            "start": self._micro_batch_started,
            "before_backward": self._micro_batch_backward,
            "after_backward": self._micro_batch_after_backward,
            "restart_window": self._restart_window,
            "any_rank": self._any_rank,
            "smallest": self._smallest,
        }

    def _micro_batch_started(self, part: Any, weight: float) -> tuple[Any, float]:
        """A micro-batch of the loader batch begins; returns its items and its share of the batch's loss."""
        ctx = self._ctx
        ctx.batch = part
        self._features.dispatch(Event.MICRO_BATCH_STARTED, ctx)
        share = weight if ctx.items is None else 1.0  # item weighting weighs micro-batches itself
        assert self._batcher is not None
        self._batcher.share = share
        return ctx.items, share

    def _micro_batch_backward(self, loss: torch.Tensor, share: float) -> torch.Tensor:
        """What a micro-batch's backward runs on: as Lightning would hand it (divided, weighed, scaled)."""
        ctx = self._ctx
        tensor = loss * (share / ctx.window.size)
        ctx.loss, ctx.loss_divisor = tensor, ctx.window.size / share
        self._features.dispatch(Event.BEFORE_BACKWARD, ctx)
        scaler = getattr(getattr(ctx.trainer, "precision_plugin", None), "scaler", None)
        return scaler.scale(tensor) if scaler is not None else tensor

    def _micro_batch_after_backward(self) -> None:
        self._features.dispatch(Event.AFTER_BACKWARD, self._ctx)

    def _restart_window(self) -> None:
        """Out of memory in ``"auto"``: the window in progress is dropped; this loader batch opens a new one.

        Lightning decided before ``training_step`` whether this batch steps; the new window keeps to it: the batch
        trains alone if it was to end its window, and opens a window of at least two batches if not.
        """
        ctx, trainer = self._ctx, self._ctx.trainer
        assert self._batcher is not None
        assert self._batcher.changes
        old, new = self._batcher.changes[-1]
        rank_zero_info(
            f"AccumulationScheduler: out of memory with micro-batches of {old}; training this batch again, as the"
            f" first of a new window, with micro-batches of {new} (optimizer step {trainer.global_step})"
        )
        if isinstance(trainer.strategy, AccumulationStrategyMixin):
            trainer.strategy.drop_unreduced_gradients()
        closing = ctx.window.closed
        ctx.loss = ctx.batch = None  # the failed attempt's graph and batch: nothing may keep them alive
        ctx.window.discard()
        batch_idx = trainer.fit_loop.epoch_loop.batch_idx
        self._open_window(trainer, batch_idx, closing=closing)
        ctx.window.take(ends_epoch=ends_epoch(trainer, batch_idx))

    def _any_rank(self, flag: bool) -> bool:
        return self._reduce_number(float(flag), "sum") > 0

    def _smallest(self, size: int) -> int:
        return int(self._reduce_number(float(size), "min"))

    def _reduce_number(self, value: float, op: str) -> float:
        """``value`` reduced over the ranks (one scalar collective; none on one process)."""
        trainer = self._ctx.trainer
        if trainer.world_size == 1:
            return value
        local = torch.tensor(value, device=trainer.strategy.root_device)
        return float(trainer.strategy.reduce(local, reduce_op=op).item())

    @property
    def _in_charge(self) -> bool:
        return self._loop is not None and self._loop.in_charge

    def _take_charge(self, trainer: pl.Trainer) -> bool:
        """Whether the windows run this micro-step (not while another component sets the factor itself)."""
        loop = self._loop
        assert loop is not None, "setup creates the loop control"
        if loop.in_charge and not loop.changed_elsewhere():  # every micro-step but the first
            return True
        return loop.take_charge(at_epoch_start=trainer.fit_loop.epoch_loop.batch_idx == 0)

    def _scheduled_factor(self, trainer: pl.Trainer) -> int:
        schedule, ctx = self._schedule, self._ctx
        assert schedule is not None, "on_train_start builds the schedule"
        unit = schedule.unit
        if unit == "step":
            return schedule.factor_at(trainer.global_step)
        if unit == "epoch":
            return schedule.factor_at(trainer.current_epoch)
        return schedule.factor_at(_position(trainer, ctx.samples_seen, ctx.tokens_seen)[unit])

    def _release(self, trainer: pl.Trainer) -> None:
        """Give the Trainer back as it was; safe to call more than once."""
        self._features.dispatch(Event.FIT_END, self._ctx)
        if isinstance(trainer.strategy, AccumulationStrategyMixin):
            trainer.strategy.connect_window(None)
        if self._loop is not None:
            self._loop.release()
            self._loop = None
        if self._batcher is not None:
            self._batcher.release()
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


def _infer_micro_batch_size(trainer: pl.Trainer, given: int | None) -> int | None:
    """The per-rank micro-batch size: ``given``, else the train dataloader's ``batch_size``, else ``None``."""
    return given if given is not None else _loader_batch_size(trainer)


def _loader_batch_size(trainer: pl.Trainer) -> int | None:
    """The train dataloader's ``batch_size`` (``None`` when it has none, e.g. a loader of ready-made batches)."""
    loader = trainer.train_dataloader
    if not isinstance(loader, DataLoader):
        return None
    size = loader.batch_size or getattr(loader.batch_sampler, "batch_size", None)
    return size if isinstance(size, int) and size > 0 else None


def _splits(trainer: pl.Trainer, batcher: MicroBatcher | None) -> bool:
    """Whether this fit splits loader batches: ``"auto"``, or a ``micro_batch_size`` below the loader's batch."""
    if batcher is None:
        return False
    loader_size = _loader_batch_size(trainer)
    return batcher.auto or (loader_size is not None and batcher.size is not None and batcher.size < loader_size)


def _check_splitting(trainer: pl.Trainer, batcher: MicroBatcher, features: Features) -> None:
    """Refuse what micro-batching cannot do, on every rank alike (the conditions are the same everywhere)."""
    if takes_dataloader_iter(trainer.lightning_module):
        raise ValueError(
            "micro_batch_size splits the batch handed to `training_step`, but `training_step(self, dataloader_iter)`"
            " fetches its own: use `training_step(self, batch, batch_idx)` or no micro_batch_size"
        )
    if batcher.auto and fsdp2_modules(trainer.strategy.model):
        raise ValueError(
            "micro_batch_size='auto' cannot retry a batch under FSDP2: a rank out of memory would leave the other ranks"
            " waiting in a parameter all-gather. Give an integer micro_batch_size (find it with `lightning-accum plan"
            " --probe`)"
        )
    if batcher.auto and trainer.world_size > 1 and "item_weighting" in features:
        raise ValueError(
            "micro_batch_size='auto' with normalize_by='sample' or 'token' on several ranks is not supported: the"
            " weighting's first all-reduce would meet another rank's out-of-memory check. Give an integer"
            " micro_batch_size, or normalize_by='micro_batch'"
        )


def _accumulation_dtype(value: object) -> tuple[torch.dtype, bool]:
    """``(dtype, strict)`` for ``grad_accum_dtype``: ``"auto"`` is float32, not strict (``None`` is left out)."""
    if value == "auto":
        return torch.float32, False
    return check_grad_accum_dtype(value) or torch.float32, True


def _agree_across_ranks(trainer: pl.Trainer, micro_batch_size: int | None, given: int | None) -> int | None:
    """The micro-batch size every rank uses; raise on every rank if the ranks' loaders disagree on what windows need.

    One all-gather at the start of the fit: each rank's inferred micro-batch size and batches per epoch. Ranks with
    different numbers of batches would leave one rank waiting for the others in a reduction; ranks that infer
    different micro-batch sizes would count samples (``unit="sample"``, targets, ramps, LR rules) differently.

    Raises:
        ValueError: On every rank, naming each rank's value, if they disagree.
    """
    if trainer.world_size == 1:
        return micro_batch_size
    batches = trainer.num_training_batches
    local = torch.tensor(
        [micro_batch_size or -1, batches if math.isfinite(batches) else -1],
        dtype=torch.float64,
        device=trainer.strategy.root_device,
    )
    gathered = trainer.strategy.all_gather(local).reshape(-1, 2).cpu().tolist()
    sizes = [None if size < 0 else int(size) for size, _ in gathered]
    lengths = [None if length < 0 else int(length) for _, length in gathered]

    def by_rank(values: list[int | None]) -> str:
        return ", ".join(f"rank {rank}: {'unknown' if value is None else value}" for rank, value in enumerate(values))

    if len(set(lengths)) > 1:
        raise ValueError(
            f"AccumulationScheduler: the ranks disagree on the number of training batches per epoch"
            f" ({by_rank(lengths)}): a window would wait forever for a rank that ran out of data. Keep Lightning's"
            " DistributedSampler (`Trainer(use_distributed_sampler=True)`) or give every rank as many batches"
        )
    if given is None and len(set(sizes)) > 1:
        raise ValueError(
            f"AccumulationScheduler: the ranks' DataLoaders disagree on the micro-batch size ({by_rank(sizes)}),"
            " so they would count samples differently. Give every rank's DataLoader the same `batch_size`, or pass"
            " `micro_batch_size` to AccumulationScheduler to say how many samples a rank's micro-batch counts"
        )
    return sizes[0]


def _check_trainer(trainer: pl.Trainer, pl_module: pl.LightningModule, callback: AccumulationScheduler) -> None:
    """Raise before the first batch when the Trainer cannot run the callback."""
    if trainer.accumulate_grad_batches != 1:
        raise ValueError(
            f"AccumulationScheduler sets the factor itself: remove `Trainer(accumulate_grad_batches="
            f"{trainer.accumulate_grad_batches})` or give the factor as AccumulationScheduler(scheduling={{0:"
            f" {trainer.accumulate_grad_batches}}})"
        )
    if trainer.strategy.handles_gradient_accumulation:
        raise ValueError(
            f"`{type(trainer.strategy).__name__}` accumulates gradients by itself (as DeepSpeed does), so"
            " AccumulationScheduler cannot control its windows: use its own accumulation setting instead"
        )
    if not pl_module.automatic_optimization:
        raise ValueError(
            "AccumulationScheduler drives automatic optimization; with `automatic_optimization = False` call"
            " `manual_backward` and `optimizer.step()` yourself at the window boundaries"
        )
    for other in trainer.callbacks:  # type: ignore[attr-defined]
        if other is not callback and isinstance(other, (AccumulationScheduler, GradientAccumulationScheduler)):
            raise ValueError(
                f"Only one accumulation callback may be attached: found {type(other).__name__} beside this"
                " AccumulationScheduler"
            )
    if isinstance(trainer.strategy, ModelParallelStrategy) and not isinstance(
        trainer.strategy, AccumulationStrategyMixin
    ):
        rank_zero_warn(
            "AccumulationScheduler: ModelParallelStrategy reduce-scatters FSDP2 gradients on every micro-step;"
            " use lightning_accum.ModelParallelAccumulationStrategy to reduce once per optimizer step"
        )


def _count_steps(trainer: pl.Trainer, spec: ScheduleSpec, micro_batch_size: int | None) -> int | float:
    """The optimizer steps of the run under ``spec``, from ``micro_batch_size`` (or the loader's, when ``None``)."""
    if trainer.max_epochs == -1 and trainer.max_steps == -1:
        return float("inf")
    if trainer.train_dataloader is None:
        trainer.fit_loop.setup_data()
    batches = trainer.num_training_batches
    if batches == float("inf"):
        return float("inf") if trainer.max_steps == -1 else trainer.max_steps
    if micro_batch_size is None:
        micro_batch_size = _infer_micro_batch_size(trainer, spec.micro_batch_size)
    return count_optimizer_steps(
        spec.build(micro_batch_size, trainer.world_size),
        batches_per_epoch=int(batches),
        max_epochs=trainer.max_epochs if trainer.max_epochs is not None else -1,
        max_steps=trainer.max_steps,
        samples_per_micro_step=(micro_batch_size or 0) * trainer.world_size,
    )


def _position(trainer: pl.Trainer, samples_seen: int, tokens_seen: int = 0) -> dict[str, int]:
    """Where the run is, in each unit a schedule can be keyed by."""
    return {"epoch": trainer.current_epoch, "step": trainer.global_step, "sample": samples_seen, "token": tokens_seen}


def _factor_before_training(trainer: pl.Trainer, spec: ScheduleSpec, samples_seen: int) -> int:
    """The first window's factor, for what runs the loop before the windows take charge (a tuner)."""
    factor = spec.factor_before_loading(_position(trainer, samples_seen), trainer.world_size)
    if factor is not None:
        return factor
    if any(isinstance(callback, LearningRateFinder) for callback in trainer.callbacks):  # type: ignore[attr-defined]
        raise ValueError(
            f"`lr_find` runs before AccumulationScheduler can read the micro-batch size from the train dataloader, so"
            f" it cannot accumulate to `target_batch_size={spec.target_batch_size}`: pass `micro_batch_size` to"
            " AccumulationScheduler"
        )
    return 1  # a batch-size search: its trials measure memory, and the size it finds sets the factor


def _warn_if_resuming_mid_epoch_without_loader_state(trainer: pl.Trainer) -> None:
    """Lightning's own check assumes a constant factor (steps per epoch), so it misses most resumes under a schedule."""
    done = int(getattr(trainer.fit_loop.epoch_loop.batch_progress.current, "processed", 0))
    if 0 < done < trainer.num_training_batches and not trainer.fit_loop.on_save_checkpoint().get("combined_loader"):
        rank_zero_warn(
            f"AccumulationScheduler: resuming in the middle of an epoch (after batch {done}) with a train dataloader"
            " that has no `state_dict`: the epoch's data starts again from its beginning, so the resumed run differs"
            " from the uninterrupted one. Use a resumable dataloader (torchdata's StatefulDataLoader) or resume from"
            " a checkpoint written at an epoch's end"
        )


def _warn_if_optimization_hooks_are_overridden(pl_module: pl.LightningModule) -> None:
    overridden = [name for name in ("optimizer_step", "optimizer_zero_grad") if is_overridden(name, pl_module)]
    if overridden:
        hooks = " and ".join(f"`LightningModule.{name}`" for name in overridden)
        rank_zero_warn(
            f"AccumulationScheduler: {hooks} {'is' if len(overridden) == 1 else 'are'} overridden; under"
            " accumulation they run once per optimizer step (once per window of micro-batches), not on every batch"
        )


def _scale_gradients(optimizer: Any, scale: float) -> None:
    with torch.no_grad():
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.grad.mul_(scale)


def _upgrade_state(state: dict[str, Any]) -> dict[str, Any]:
    """Read a checkpoint written before each feature had its own entry (the LR warmup and base at the top level)."""
    if "lr_warmup" not in state and "base_batch_size" not in state:
        return state
    state = dict(state)
    lr_state = {"warmup": state.pop("lr_warmup", {})}
    if "base_batch_size" in state:
        lr_state["base_batch_size"] = state.pop("base_batch_size")
    return {**state, "lr_scaling": lr_state}
