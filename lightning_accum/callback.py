r"""AccumulationScheduler: exact gradient accumulation with schedules by epoch, step or sample.

This module is the only place that talks to the Trainer: it asks the schedule for the factor at each window
boundary, owns the window, tells Lightning's loop where windows start and end, and keeps what a resumed run needs in
the checkpoint.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_accum._loop import LoopControl
from lightning_accum.adaptive import AdaptiveFactor
from lightning_accum.items import check_normalize_by, count_samples, make_counter
from lightning_accum.monitor import StepRecord, memory_metrics, step_metrics, summary_text, tensorboard_layout
from lightning_accum.noise import NoiseScaleEstimator
from lightning_accum.scaling import ScaledStep, ScaleWarmup, check_rule, lr_scale
from lightning_accum.schedule import (
    BatchSizeRamp,
    Schedule,
    build_schedule,
    check_int,
    check_unit,
    count_optimizer_steps,
)
from lightning_accum.strategies.mixin import AccumulationStrategyMixin
from lightning_accum.window import Window


class AccumulationScheduler(Callback):
    r"""Accumulate gradients exactly, with a factor that may change by epoch, optimizer step or samples consumed.

    Every optimizer step equals the step of one big batch made of its window's micro-batches: each micro-batch's loss
    is divided by the number of micro-batches the window really holds, so the last, incomplete window of an epoch is
    weighed right, and a factor change never splits or merges a window.

    **When a change takes effect.** A new factor applies from the first window that *starts* at or after its
    position; the window in progress always finishes with the factor it was opened with.

    - ``unit="epoch"``: at the first batch of that epoch (windows never span epochs).
    - ``unit="step"``: exactly at that optimizer step (``trainer.global_step``), which is always a window boundary.
    - ``unit="sample"`` (and the ramp): at the first window that starts once that many samples have been consumed by
      all ranks together. Samples are counted as ``micro_batch_size x world_size`` per micro-batch.

    The last window of an epoch holds the batches that are left; it steps with the mean over those.

    Args:
        scheduling: ``{position: factor}``; positions before the first key use factor 1. ``None`` with no
            ``target_batch_size`` means factor 1 throughout.
        unit: What the keys of ``scheduling`` count: ``"epoch"`` (as Lightning's ``GradientAccumulationScheduler``),
            ``"step"`` (optimizer steps) or ``"sample"`` (samples consumed by all ranks together).
        target_batch_size: The global effective batch in samples; the factor is
            ``target_batch_size / (micro_batch_size x world_size)``, which must be a whole number.
        ramp_start_batch_size: With ``ramp_increment`` and ``ramp_samples``: start the global batch at this size
            and grow it linearly to ``target_batch_size``, as Megatron's ``--rampup-batch-size``.
        ramp_increment: How much the global batch grows at each stage of the ramp.
        ramp_samples: Samples (all ranks together) over which the ramp reaches ``target_batch_size``.
        micro_batch_size: Samples per micro-batch on one rank. By default read from the train dataloader's
            ``batch_size``; needed only for ``target_batch_size``, ``unit="sample"`` and a ``base_batch_size``.
        lr_scaling: ``"none"``, ``"linear"`` or ``"sqrt"``: the optimizer's learning rate is the configured one (as the
            LR scheduler shapes it) times ``effective / base`` or ``sqrt(effective / base)``, re-applied whenever the
            effective batch changes. The scale is applied only while ``optimizer.step()`` runs, so schedulers keep
            their own shape and ``param_group["lr"]`` shows the unscaled value outside the step.
        base_batch_size: The global batch (in samples) at which the configured learning rate was tuned. By default
            the effective batch of the first window.
        lr_warmup_steps: Move the scale linearly to each new value over this many optimizer steps instead of
            jumping (Goyal et al.'s gradual warmup); the first scale warms up from 1.
        normalize_by: What each micro-batch weighs in the window's mean. ``"micro_batch"``: each the same (the mean of
            the micro-batches' mean losses). ``"sample"``: its number of samples, so the step equals the mean over all
            samples of the window on all ranks even when micro-batches differ in size (a short last batch with
            ``drop_last=False``). ``"token"``: its number of loss-bearing tokens, totalled over the window and all
            ranks, so the step equals that of the mean loss over every token of the window (the "gradient
            accumulation bug" fixed in Hugging Face transformers in October 2024). ``training_step`` keeps returning
            its usual per-micro-batch mean loss. One all-reduce of a scalar per optimizer step across ranks.
        token_key: Where ``normalize_by="token"`` finds the labels in a batch: a key of a mapping batch or a position
            in a tuple or list batch.
        ignore_index: The label value that bears no loss; every other label counts as one token.
        count_items: A function ``batch -> int or tensor`` that counts a micro-batch's items, for batches the two
            rules above do not cover (it replaces them for ``"sample"`` and ``"token"``).
        noise_scale: Estimate the gradient noise scale ``B_simple = tr(Sigma) / |G|^2`` (McCandlish et al. 2018), the
            batch size beyond which a larger batch buys little, from the micro-batch gradients accumulation already
            computes, and log it as ``accum/noise_scale`` (in samples, or in tokens under ``normalize_by="token"``)
            with ``accum/noise_grad_sq`` and ``accum/noise_trace``. Parameter hooks read each micro-batch's gradient
            as backward produces it; no gradient is copied. Under DDP the small batch is one rank's micro-batch and
            the big batch the global window. Not available with FSDP, whose hooks see only shards.
        noise_scale_decay: Decay of the moving averages that smooth the two estimates, in ``[0, 1)``.
        adaptive: Grow the factor when the measured noise scale says a larger batch pays (needs ``noise_scale``):
            every ``adaptive_interval`` optimizer steps, rank zero checks whether ``adaptive_target x noise scale``
            has reached twice the effective batch on ``adaptive_patience`` consecutive checks, and if so the factor
            doubles (never above ``adaptive_max_factor``, never down), for every rank alike (the decision is
            broadcast). The learning rate follows by ``lr_scaling``. The factor is then the larger of the schedule's
            and the adaptive one, and :func:`estimated_stepping_batches` becomes an upper bound.
        adaptive_target: The wanted effective batch as a multiple of the noise scale.
        adaptive_max_factor: The largest factor adaptive growth may reach.
        adaptive_interval: Optimizer steps between two adaptive checks.
        adaptive_patience: Consecutive checks that must call for growth before the factor doubles.
        log_metrics: Log the ``accum/...`` metrics (see :mod:`lightning_accum.monitor`) once per optimizer step
            through every logger, with a dashboard and a summary for TensorBoard, and show the factor and effective
            batch in the progress bar.

    Raises:
        TypeError: If an argument has the wrong type (a non-integer key or factor, a non-dict schedule).
        ValueError: If an argument has a wrong value (an empty schedule, a negative key, a factor below 1, an unknown
            unit, both ``scheduling`` and ``target_batch_size``, an incomplete ramp). Conflicts that need the Trainer
            (``Trainer(accumulate_grad_batches != 1)``, a strategy that accumulates by itself such as DeepSpeed,
            manual optimization, a target that does not divide) raise ``ValueError`` before the first batch.

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
        scheduling: dict[int, int] | None = None,
        unit: Literal["epoch", "step", "sample"] = "epoch",
        target_batch_size: int | None = None,
        ramp_start_batch_size: int | None = None,
        ramp_increment: int | None = None,
        ramp_samples: int | None = None,
        micro_batch_size: int | None = None,
        lr_scaling: Literal["none", "linear", "sqrt"] = "none",
        base_batch_size: int | None = None,
        lr_warmup_steps: int = 0,
        normalize_by: Literal["micro_batch", "sample", "token"] = "micro_batch",
        token_key: str | int = "labels",
        ignore_index: int = -100,
        count_items: Callable[[Any], Any] | None = None,
        noise_scale: bool = False,
        noise_scale_decay: float = 0.95,
        adaptive: bool = False,
        adaptive_target: float = 1.0,
        adaptive_max_factor: int = 64,
        adaptive_interval: int = 50,
        adaptive_patience: int = 2,
        log_metrics: bool = True,
    ) -> None:
        super().__init__()
        policy = AdaptiveFactor(adaptive_target, adaptive_max_factor, adaptive_interval, adaptive_patience)
        if not isinstance(adaptive, bool):
            raise TypeError(f"`adaptive` must be a bool, got {adaptive!r}")
        if adaptive and noise_scale is not True:
            raise ValueError(
                f"`adaptive=True` grows the factor from the measured noise scale: set noise_scale=True as well (got"
                f" noise_scale={noise_scale!r})"
            )
        self._adaptive = policy if adaptive else None
        self._adaptive_factor = 0  # 0 until adaptive growth raises the factor above the schedule's
        self._adaptive_checked_at = -1
        self._restored_base: float | None = None
        if not isinstance(noise_scale, bool):
            raise TypeError(f"`noise_scale` must be a bool, got {noise_scale!r}")
        NoiseScaleEstimator(noise_scale_decay)  # validates the decay even when the estimate is off
        self._noise = NoiseScaleEstimator(noise_scale_decay) if noise_scale else None
        self._noise_decay = noise_scale_decay
        self._normalize_by = check_normalize_by(normalize_by)
        if not isinstance(token_key, (str, int)) or isinstance(token_key, bool):
            raise TypeError(f"`token_key` must be a str (a mapping key) or an int (a position), got {token_key!r}")
        check_int("ignore_index", ignore_index, minimum=-(2**63))
        if count_items is not None and not callable(count_items):
            raise TypeError(f"`count_items` must be a callable `batch -> int`, got {count_items!r}")
        self._count_items = make_counter(self._normalize_by, token_key, ignore_index, count_items)
        self._unit = check_unit(unit)
        self._rule = check_rule(lr_scaling)
        self._base_batch_size = None if base_batch_size is None else check_int("base_batch_size", base_batch_size, 1)
        self._warmup = ScaleWarmup(steps=check_int("lr_warmup_steps", lr_warmup_steps, minimum=0))
        if not isinstance(log_metrics, bool):
            raise TypeError(f"`log_metrics` must be a bool, got {log_metrics!r}")
        self._log_metrics = log_metrics
        if scheduling is not None:
            if target_batch_size is not None:
                raise ValueError(
                    f"Give either `scheduling` (factors) or `target_batch_size` (a global batch), not both:"
                    f" got scheduling={scheduling!r} and target_batch_size={target_batch_size!r}"
                )
            self._scheduling: dict[int, int] | None = dict(Schedule.from_mapping(scheduling, unit).points)
        else:
            self._scheduling = None
        if target_batch_size is not None:
            check_int("target_batch_size", target_batch_size, minimum=1)
        self._target_batch_size = target_batch_size
        self._ramp = self._make_ramp(target_batch_size, ramp_start_batch_size, ramp_increment, ramp_samples)
        self._micro_batch_size = (
            None if micro_batch_size is None else check_int("micro_batch_size", micro_batch_size, 1)
        )

        self._window = Window()
        self._factor = 1  # the scheduled factor of the window in progress
        self._samples_seen = 0
        self._micro_steps = 0
        self._base: float = 1.0  # resolved base batch, in samples (or micro-batches when the size is unknown)
        self._scaled_steps: list[ScaledStep] = []
        self._window_loss: torch.Tensor | None = None
        self._window_started = 0.0
        self._schedule: Schedule | None = None
        self._resolved_micro_batch_size: int | None = None
        self._samples_per_micro_step = 0
        self._loop: LoopControl | None = None
        self._trainer_accumulate_grad_batches = 1
        self._items: Any = None  # the micro-batch in progress: its samples or tokens on this rank
        self._window_items: Any = 0  # this rank's items in the window so far (a tensor once counted)
        self._items_per_micro_batch: float | None = None  # the same on every rank: the scale the losses are put on
        self._last_window_items = 0.0  # all ranks, for logging
        self._noise_hooks: dict[int, Any] = {}  # id(param) -> hook handle
        self._noise_params: list[torch.Tensor] = []  # the parameters hooked when the window opened
        self._noise_batch: tuple[float, int] | None = None  # (big batch, micro-steps) of the latest update
        self._micro_items: Any = 1  # the micro-batch in progress, as the noise scale counts it
        self._micro_sq: torch.Tensor | None = None  # squared norm of the micro-batch gradient in progress
        # turns the hooked gradient into the gradient of the micro-batch's mean loss (up to the AMP loss scale)
        self._micro_unscale: float | torch.Tensor = 1.0
        self._small_sqs: list[torch.Tensor] = []  # this window's micro-batch gradients' squared norms
        self._small_items: list[Any] = []

    @staticmethod
    def _make_ramp(
        target: int | None, start: int | None, increment: int | None, samples: int | None
    ) -> BatchSizeRamp | None:
        given = {"ramp_start_batch_size": start, "ramp_increment": increment, "ramp_samples": samples}
        if all(value is None for value in given.values()):
            return None
        missing = [name for name, value in given.items() if value is None]
        if missing:
            raise ValueError(f"A batch-size ramp needs all of {list(given)}; missing {missing} (got {given})")
        if target is None:
            raise ValueError(f"A batch-size ramp needs `target_batch_size`, the size it ramps to (got {given})")
        return BatchSizeRamp(start=start, increment=increment, samples=samples, target=target)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ what the user can ask

    @property
    def factor(self) -> int:
        """The size of the window in progress (the factor it was opened with, or what was left of the epoch)."""
        return self._window.size

    @property
    def samples_seen(self) -> int:
        """Samples consumed by all ranks together, counted as ``micro_batch_size x world_size`` per micro-batch."""
        return self._samples_seen

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
        if trainer.max_epochs == -1 and trainer.max_steps == -1:
            return float("inf")
        if trainer.train_dataloader is None:
            trainer.fit_loop.setup_data()
        batches = trainer.num_training_batches
        if batches == float("inf"):
            return float("inf") if trainer.max_steps == -1 else trainer.max_steps
        schedule = self._build_schedule(trainer, _infer_micro_batch_size(trainer, self._micro_batch_size))
        return count_optimizer_steps(
            schedule,
            batches_per_epoch=int(batches),
            max_epochs=trainer.max_epochs if trainer.max_epochs is not None else -1,
            max_steps=trainer.max_steps,
            samples_per_micro_step=self._samples_per_micro_step,
        )

    # ------------------------------------------------------------------ Trainer hooks

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        _check_trainer(trainer, pl_module, self)
        if self._count_items is not None and "dataloader_iter" in inspect.signature(pl_module.training_step).parameters:
            raise ValueError(
                f"normalize_by={self._normalize_by!r} counts each micro-batch's items before its backward, but"
                " `training_step(self, dataloader_iter)` hides the batch from callbacks: use `training_step(self,"
                " batch, batch_idx)` or normalize_by='micro_batch'"
            )
        if self._noise is not None and isinstance(trainer.strategy, (FSDPStrategy, ModelParallelStrategy)):
            raise ValueError(
                f"`noise_scale=True` reads each micro-batch's full gradient, which {type(trainer.strategy).__name__}"
                " shards: use it with a single device or DDP, or set noise_scale=False"
            )
        self._items_per_micro_batch = None
        self._restored_base = None  # a checkpoint restored after setup sets it again
        if trainer.global_step == 0:  # a new run (a checkpoint, restored after setup, overrides this)
            if self._noise is not None:
                self._noise = NoiseScaleEstimator(self._noise_decay)
            self._adaptive_factor, self._adaptive_checked_at = 0, -1
            self._samples_seen = self._micro_steps = 0
            self._window = Window()
            self._warmup = ScaleWarmup(steps=self._warmup.steps)
        self._trainer_accumulate_grad_batches = trainer.accumulate_grad_batches
        self._loop = LoopControl(trainer, lambda: self._window.is_first, lambda: self._window.closed)
        self._loop.install()
        strategy = trainer.strategy
        if isinstance(strategy, AccumulationStrategyMixin):
            strategy.connect_window(lambda: self._window.closed)
            strategy.drop_unreduced_gradients()  # from a previous fit that ended in the middle of a window
        elif isinstance(strategy, ModelParallelStrategy):
            rank_zero_warn(
                "AccumulationScheduler: ModelParallelStrategy reduce-scatters FSDP2 gradients on every micro-step;"
                " use lightning_accum.ModelParallelAccumulationStrategy to reduce once per optimizer step"
            )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # every rank must build the same schedule: the micro-batch size of rank 0 decides
        self._resolved_micro_batch_size = trainer.strategy.broadcast(
            _infer_micro_batch_size(trainer, self._micro_batch_size), src=0
        )
        self._schedule = self._build_schedule(trainer, self._resolved_micro_batch_size)
        # a resumed run keeps the base it started from, so the LR scale continues where it was
        self._base = self._restored_base if self._restored_base is not None else self._resolve_base_batch_size(trainer)
        self._scaled_steps = [ScaledStep(optimizer, self._current_scale(trainer)) for optimizer in trainer.optimizers]
        if self._adaptive is not None and self._factor_now(trainer) == 1 and trainer.world_size == 1:
            rank_zero_warn(
                "AccumulationScheduler: adaptive accumulation starts from factor 1 on one process, where a step has a"
                " single micro-batch gradient and the noise scale cannot be measured: start from a factor of 2"
            )
        if self._schedule.max_factor > 1:
            steps = self.estimated_stepping_batches(trainer)
            bound = " at most" if self._adaptive is not None else ""
            rank_zero_info(
                f"AccumulationScheduler: this run takes{bound} {steps} optimizer steps;"
                " `trainer.estimated_stepping_batches` does not know the schedule: size LR schedules with"
                " `lightning_accum.estimated_stepping_batches(trainer)`."
            )
        if self._log_metrics and trainer.is_global_zero:
            first_lr = trainer.optimizers[0].param_groups[0]["lr"] if trainer.optimizers else None
            text = summary_text(
                self._resolved_micro_batch_size,
                self._factor_now(trainer),
                trainer.world_size,
                first_lr,
                self._rule,
                self._base,
            )
            for logger in trainer.loggers:
                if isinstance(logger, TensorBoardLogger):
                    logger.experiment.add_custom_scalars(tensorboard_layout())
                    logger.experiment.add_text("accum/summary", text, global_step=trainer.global_step)
            rank_zero_info(f"AccumulationScheduler: {text}")

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, *_: Any) -> None:
        if not self._window.closed:
            # an epoch cut short (should_stop, a skipped rest of epoch): its partial window never stepped
            self._window.discard()
            if isinstance(trainer.strategy, AccumulationStrategyMixin):
                trainer.strategy.drop_unreduced_gradients()

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *_: Any) -> None:
        # the loop's own index: the hook's argument lags by one with `training_step(self, dataloader_iter)`
        batch_idx = trainer.fit_loop.epoch_loop.batch_idx
        if self._window.closed:
            if self._adaptive is not None:
                self._check_adaptive(trainer)
            self._factor = self._factor_now(trainer)
            # a window never spans epochs: the last one holds what is left (when the epoch's length is known)
            self._window.open(int(min(self._factor, trainer.num_training_batches - batch_idx)))
            trainer.accumulate_grad_batches = self._window.size
            effective = self._effective_batch_size(self._factor, trainer.world_size)
            self._warmup.set(lr_scale(self._rule, effective, self._base), step=trainer.global_step)
            self._window_loss, self._window_started = None, time.perf_counter()
            self._window_items = 0
            if self._noise is not None:
                self._open_noise_window(pl_module)
        ends_epoch = batch_idx + 1 >= trainer.num_training_batches or trainer.is_last_batch
        self._window.take(ends_epoch=ends_epoch)
        if self._count_items is not None:
            self._items = self._count_items(batch)
        if self._noise is not None:
            self._micro_items = self._items if self._count_items is not None else self._count_samples(batch)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self._count_items is not None:
            self._weigh_loss(trainer, loss)
        if self._noise is not None:
            self._micro_sq = torch.zeros((), device=loss.device)
            # the hooked gradient is that of the loss Lightning backpropagates: the micro-batch's mean loss divided
            # by the window's size, or re-weighted by its items (kept on the device: no host sync per micro-step);
            # the AMP loss scale, constant over a window, is taken out once per step
            if self._count_items is None:
                self._micro_unscale = float(self._window.size)
            else:
                assert self._items_per_micro_batch is not None
                items = torch.as_tensor(self._items, dtype=torch.float32, device=loss.device)
                self._micro_unscale = self._items_per_micro_batch / items.clamp(min=1.0)

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._noise is not None and self._micro_sq is not None:
            self._small_sqs.append(self._micro_sq * self._micro_unscale**2)
            self._small_items.append(self._micro_items)
            self._micro_sq = None

    def _open_noise_window(self, pl_module: pl.LightningModule) -> None:
        """Start the window's noise bookkeeping; hook parameters that became trainable (an unfrozen backbone)."""
        self._small_sqs, self._small_items, self._micro_sq = [], [], None  # nothing of a dropped window survives
        self._noise_params = []  # S_big is measured on exactly the parameters whose micro-batch gradients are hooked
        for param in pl_module.parameters():
            if param.requires_grad and id(param) not in self._noise_hooks:
                self._noise_hooks[id(param)] = param.register_hook(self._add_micro_sq)
            if id(param) in self._noise_hooks:
                self._noise_params.append(param)

    def _count_samples(self, batch: Any) -> int:
        try:
            return count_samples(batch)
        except ValueError:
            return self._resolved_micro_batch_size or 1

    def _add_micro_sq(self, grad: torch.Tensor) -> None:
        if self._micro_sq is not None:
            with torch.no_grad():
                flat = grad.detach().reshape(-1)
                self._micro_sq += torch.dot(flat, flat).float()  # one fused pass, no temporary

    def _weigh_loss(self, trainer: pl.Trainer, loss: torch.Tensor) -> None:
        items = self._items
        if self._items_per_micro_batch is None:
            # once per fit: a scale common to all ranks, so that weighted losses stay near the unweighted ones
            first = torch.as_tensor(items, dtype=torch.float32, device=loss.device)
            self._items_per_micro_batch = max(float(trainer.strategy.reduce(first, reduce_op="mean")), 1.0)
        # Lightning divided the loss by the window's size; make it items / (typical items) instead, in place: the
        # tensor handed to this hook is the fresh quotient that backward runs on
        weight = torch.as_tensor(items, dtype=loss.dtype, device=loss.device) * (
            self._window.size / self._items_per_micro_batch
        )
        loss.mul_(weight)
        self._window_items = self._window_items + items

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self._count_items is not None:
            self._normalize_by_items(trainer, pl_module, optimizer)
        elif self._window.gradient_correction != 1.0:  # only an epoch of unknown length ends a window early
            with torch.no_grad():
                for group in optimizer.param_groups:
                    for param in group["params"]:
                        if param.grad is not None:
                            param.grad.mul_(self._window.gradient_correction)
        if self._noise is not None and optimizer is trainer.optimizers[0]:
            self._update_noise_scale(trainer, optimizer)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._samples_seen += self._samples_per_micro_step
        self._micro_steps += 1
        if not self._log_metrics:
            return
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):  # Lightning's loss is already divided by the window's size
            loss = loss.detach()
            if self._count_items is not None:  # weigh by items: sum(loss_i * items_i), divided at the window's end
                loss = loss * self._window.size * torch.as_tensor(self._items, dtype=loss.dtype, device=loss.device)
            self._window_loss = loss if self._window_loss is None else self._window_loss + loss
        if self._window.closed:
            self._log_step(trainer, pl_module)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._release(trainer)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._release(trainer)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "samples_seen": self._samples_seen,
            "micro_steps": self._micro_steps,
            "window": self._window.state_dict(),
            "lr_warmup": self._warmup.state_dict(),
            "base_batch_size": self._base,
            **({"noise_scale": self._noise.state_dict()} if self._noise is not None else {}),
            **(
                {
                    "adaptive": {
                        "factor": self._adaptive_factor,
                        "checked_at": self._adaptive_checked_at,
                        **self._adaptive.state_dict(),
                    }
                }
                if self._adaptive is not None
                else {}
            ),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._samples_seen = int(state_dict.get("samples_seen", 0))
        self._micro_steps = int(state_dict.get("micro_steps", 0))
        self._warmup.load_state_dict(state_dict.get("lr_warmup", {}))
        if "base_batch_size" in state_dict:
            self._restored_base = float(state_dict["base_batch_size"])
        if self._noise is not None:
            self._noise.load_state_dict(state_dict.get("noise_scale", {}))
        if self._adaptive is not None:
            self._adaptive_factor = int(state_dict.get("adaptive", {}).get("factor", 0))
            self._adaptive_checked_at = int(state_dict.get("adaptive", {}).get("checked_at", -1))
            self._adaptive.load_state_dict(state_dict.get("adaptive", {}))
        self._window.load_state_dict(state_dict.get("window", {}))
        if not self._window.closed:
            rank_zero_warn(
                f"AccumulationScheduler: the checkpoint was written after micro-step {self._window.taken} of a window"
                f" of {self._window.size}; that window's gradients are not in the checkpoint, so training resumes"
                " with a new window. Save checkpoints at optimizer steps to resume exactly."
            )
            self._window.discard()

    # ------------------------------------------------------------------ helpers

    def _normalize_by_items(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        """Turn the sum of item-weighted gradients into the mean over every item of the window on every rank."""
        if self._items_per_micro_batch is None:  # no backward yet in this fit (training_step returned None)
            return
        device = pl_module.device
        dtype = torch.float32 if device.type == "mps" else torch.float64
        local = torch.as_tensor(self._window_items, dtype=dtype, device=device)
        total = float(trainer.strategy.reduce(local, reduce_op="sum"))  # the one collective this adds per step
        self._last_window_items = total
        # the gradient holds the rank average of sum(items_i * grad_i) / items_per_micro_batch
        scale = trainer.world_size * self._items_per_micro_batch / total if total > 0 else 0.0
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is not None:
                        param.grad.mul_(scale)

    def _build_schedule(self, trainer: pl.Trainer, micro_batch_size: int | None) -> Schedule:
        self._samples_per_micro_step = (micro_batch_size or 0) * trainer.world_size
        if self._unit == "sample" and self._scheduling is not None and micro_batch_size is None:
            raise ValueError(
                "`unit='sample'` counts samples, but the micro-batch size could not be read from the train"
                " dataloader's `batch_size`: pass `micro_batch_size` to AccumulationScheduler"
            )
        return build_schedule(
            self._scheduling, self._unit, self._target_batch_size, self._ramp, micro_batch_size, trainer.world_size
        )

    def _effective_batch_size(self, factor: int, world_size: int) -> int:
        """Samples in a window of ``factor`` micro-batches, or micro-batches when the micro-batch size is unknown."""
        return (self._resolved_micro_batch_size or 1) * factor * world_size

    def _resolve_base_batch_size(self, trainer: pl.Trainer) -> float:
        if self._base_batch_size is None:
            return float(self._effective_batch_size(self._factor_now(trainer), trainer.world_size))
        if self._resolved_micro_batch_size is None:
            raise ValueError(
                f"`base_batch_size={self._base_batch_size}` is in samples, but the micro-batch size could not be read"
                " from the train dataloader's `batch_size`: pass `micro_batch_size` to AccumulationScheduler"
            )
        return float(self._base_batch_size)

    def _current_scale(self, trainer: pl.Trainer) -> Any:
        return lambda: self._warmup.value(trainer.global_step)

    def _log_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        effective = self._effective_batch_size(self._window.taken, trainer.world_size)
        pl_module.log_dict(
            {"factor": float(self._factor), "eff_batch": float(effective)},
            prog_bar=True,
            logger=False,
            on_step=True,
            on_epoch=False,
            batch_size=1,
        )
        if not trainer.is_global_zero or not trainer.loggers:
            return
        scale = self._warmup.value(trainer.global_step - 1)  # the step just taken
        lr = trainer.optimizers[0].param_groups[0]["lr"] * scale if trainer.optimizers else None
        record = StepRecord(
            factor=self._factor,
            micro_steps_in_window=self._window.taken,
            micro_batch_size=self._resolved_micro_batch_size,
            world_size=trainer.world_size,
            lr=None if lr is None else float(lr),
            lr_scale=scale,
            samples_seen=self._samples_seen,
            optimizer_steps=trainer.global_step,
            micro_steps=self._micro_steps,
            window_loss=self._window_loss_value(),
            seconds=time.perf_counter() - self._window_started,
        )
        metrics = {**step_metrics(record), **memory_metrics(pl_module.device)}
        if self._count_items is not None:
            metrics[f"accum/window_{self._normalize_by}s"] = self._last_window_items
        estimate = self._noise.estimate if self._noise is not None else None
        if estimate is not None and estimate.noise_scale is not None:
            metrics |= {
                "accum/noise_scale": estimate.noise_scale,
                "accum/noise_grad_sq": estimate.grad_sq,
                "accum/noise_trace": estimate.trace,
            }
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    def _check_adaptive(self, trainer: pl.Trainer) -> None:
        """At a window boundary: maybe double the factor, as rank zero decides from its noise-scale estimate."""
        assert self._adaptive is not None
        assert self._noise is not None
        step = trainer.global_step
        if not self._adaptive.due(step) or step == self._adaptive_checked_at:
            return
        self._adaptive_checked_at = step
        current = self._factor_now(trainer)
        # the batch the next windows would have, in the noise scale's own unit (samples or tokens, as measured)
        big, micro_steps = self._noise_batch if self._noise_batch is not None else (0.0, 1)
        effective = big * current / micro_steps
        proposal = current
        if trainer.is_global_zero:
            proposal = self._adaptive.propose(current, effective, self._noise.estimate.noise_scale)
        proposal = int(trainer.strategy.broadcast(proposal, src=0))  # every rank takes rank zero's decision
        if proposal > current:
            self._adaptive_factor = proposal
            rank_zero_info(
                f"AccumulationScheduler: the noise scale ({self._noise.estimate.noise_scale or 0:.4g}) calls for a"
                f" larger batch: factor {current} -> {proposal} from optimizer step {step}"
            )

    def _update_noise_scale(self, trainer: pl.Trainer, optimizer: Any) -> None:
        """Fold this step's micro-batch gradients and their (reduced, normalized) mean into the noise scale."""
        assert self._noise is not None
        small, self._small_sqs = self._small_sqs, []
        items, self._small_items = self._small_items, []
        grads = [param.grad for param in self._noise_params if param.grad is not None]
        if not small or not grads:
            return
        sizes = torch.stack([torch.as_tensor(n, dtype=torch.float32).reshape(()).cpu() for n in items])
        bearing = sizes > 0  # a micro-batch without items (no loss-bearing token) holds no gradient sample
        if int(bearing.sum()) == 0:
            return
        big_sq = torch.stack([torch.dot(g.detach().reshape(-1), g.detach().reshape(-1)).float() for g in grads]).sum()
        small_sq = torch.stack(small)[bearing.to(small[0].device)].mean()
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None and scaler.is_enabled():  # the scale the window's backwards ran with
            small_sq = small_sq / scaler.get_scale() ** 2
        values = torch.stack([small_sq, big_sq.to(small_sq.device)]).tolist()  # one host sync per optimizer step
        inverse_small = float((1.0 / sizes[bearing]).mean())
        if self._count_items is not None:  # the step is the mean over every item of the window on every rank
            big = self._last_window_items
        else:  # the step is the mean of the micro-batches' means over every rank
            big = len(small) * trainer.world_size / inverse_small
        self._noise.update(values[0], values[1], inverse_small, big)
        self._noise_batch = (big, len(small))

    def _window_loss_value(self) -> float | None:
        """Rank zero's mean training loss over the window: per micro-batch, or per sample or token."""
        if self._window_loss is None:
            return None
        if self._count_items is None:
            return self._window_loss.item() * self._window.gradient_correction
        items = float(torch.as_tensor(self._window_items).sum())
        return self._window_loss.item() / items if items > 0 else None

    def _factor_now(self, trainer: pl.Trainer) -> int:
        assert self._schedule is not None, "on_train_start builds the schedule"
        position = {"epoch": trainer.current_epoch, "step": trainer.global_step, "sample": self._samples_seen}
        return max(self._schedule.factor_at(position[self._schedule.unit]), self._adaptive_factor)

    def _release(self, trainer: pl.Trainer) -> None:
        for scaled in self._scaled_steps:
            scaled.remove()
        self._scaled_steps = []
        for hook in self._noise_hooks.values():
            hook.remove()
        self._noise_hooks, self._noise_params, self._small_sqs, self._small_items = {}, [], [], []
        self._micro_sq = None
        if isinstance(trainer.strategy, AccumulationStrategyMixin):
            trainer.strategy.connect_window(None)
        if self._loop is not None:
            self._loop.remove()
            self._loop = None
            trainer.accumulate_grad_batches = self._trainer_accumulate_grad_batches


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
    if given is not None:
        return given
    loader = trainer.train_dataloader
    if not isinstance(loader, DataLoader):
        return None
    size = loader.batch_size or getattr(loader.batch_sampler, "batch_size", None)
    return size if isinstance(size, int) and size > 0 else None


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
