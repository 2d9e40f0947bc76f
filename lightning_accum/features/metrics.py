"""Metrics and dashboard (``log_metrics=True``): the ``accum/...`` values of each optimizer step, through every logger.

Registered last, so that at ``WINDOW_CLOSED`` it finds every other feature's values in ``ctx.metrics`` and logs them
with its own (factor, effective batch, progress, window loss, throughput, memory; see :mod:`lightning_accum.monitor`)
in one call per logger. At ``FIT_START`` it writes the Custom Scalars layout and the run's summary line (the other
features' phrases joined to its own) to TensorBoard, and shows the factor and effective batch in the progress bar.
"""

from __future__ import annotations

import time

import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_accum.events import Context, Feature
from lightning_accum.monitor import StepRecord, batch_summary, memory_metrics, step_metrics, tensorboard_layout


class Metrics(Feature):
    """Log the window's metrics once per optimizer step, on rank zero, through every logger of the Trainer.

    The window loss is rank zero's mean training loss over the window: per micro-batch, or per sample or token when
    item weighting publishes ``ctx.items``.
    """

    name = "metrics"

    def __init__(self) -> None:
        self._loss: torch.Tensor | None = None  # the window's summed loss so far (weighted by items, if counted)
        self._items: torch.Tensor | int = 0  # the items that loss is summed over (item weighting only)
        self._started = 0.0

    @override
    def fit_start(self, ctx: Context) -> None:
        if not ctx.is_global_zero:
            return
        text = "; ".join([batch_summary(ctx.micro_batch_size, ctx.factor, ctx.world_size), *ctx.summary])
        for logger in getattr(ctx.trainer, "loggers", []):
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_custom_scalars(tensorboard_layout())
                logger.experiment.add_text("accum/summary", text, global_step=ctx.optimizer_steps)
        rank_zero_info(f"AccumulationScheduler: {text}")

    @override
    def window_opened(self, ctx: Context) -> None:
        self._loss, self._items, self._started = None, 0, time.perf_counter()

    @override
    def micro_batch_ended(self, ctx: Context) -> None:
        if ctx.loss is None:  # a skipped micro-step (training_step returned None)
            return
        loss = ctx.loss.detach()  # Lightning's loss is already divided by the window's size
        if ctx.items is not None:  # weigh by items: sum(loss_i * items_i), divided at the window's end
            loss = loss * ctx.window.size * torch.as_tensor(ctx.items, dtype=loss.dtype, device=loss.device)
            self._items = self._items + ctx.items
        self._loss = loss if self._loss is None else self._loss + loss

    @override
    def window_closed(self, ctx: Context) -> None:
        if ctx.module is not None and hasattr(ctx.module, "log_dict"):
            ctx.module.log_dict(
                {"factor": float(ctx.factor), "eff_batch": float(ctx.effective_batch(ctx.window.taken))},
                prog_bar=True,
                logger=False,
                on_step=True,
                on_epoch=False,
                batch_size=1,
            )
        loggers = getattr(ctx.trainer, "loggers", [])
        if not ctx.is_global_zero or not loggers:
            return
        record = StepRecord(
            factor=ctx.factor,
            micro_steps_in_window=ctx.window.taken,
            micro_batch_size=ctx.micro_batch_size,
            world_size=ctx.world_size,
            samples_seen=ctx.samples_seen,
            optimizer_steps=ctx.optimizer_steps,
            micro_steps=ctx.micro_steps,
            window_loss=self._window_loss(ctx),
            seconds=time.perf_counter() - self._started,
        )
        device = getattr(ctx.module, "device", torch.device("cpu"))
        metrics = {**step_metrics(record), **memory_metrics(device), **ctx.metrics}
        for logger in loggers:
            logger.log_metrics(metrics, step=ctx.optimizer_steps)

    def _window_loss(self, ctx: Context) -> float | None:
        if self._loss is None:
            return None
        if ctx.items is None:
            return self._loss.item() * ctx.window.gradient_correction
        items = float(torch.as_tensor(self._items).sum())
        return self._loss.item() / items if items > 0 else None
