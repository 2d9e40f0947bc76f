"""Metrics and dashboard (``log_metrics=True``): the ``accum/...`` values of each optimizer step, through every logger.

Registered last, so that at ``WINDOW_CLOSED`` it finds every other feature's values in ``ctx.metrics`` and logs them
with its own (factor, effective batch, progress, window loss, throughput, memory; see
:mod:`lightning_accum.core.monitor`) in one call per logger, every ``log_every_n_steps`` optimizer steps (published as
``ctx.log_every`` at ``FIT_START``, read by item weighting, which checks its device counts on the logged steps); what
the device holds is read to the host in one read, on a logged step only; the run's constants (micro-batch size, world
size) with the first logged step only. With the first logged step it writes the Custom Scalars layout (again only when a
quantity appears later, such as the noise scale's first estimate: no other logged step builds it), and at ``FIT_START``
the run's summary line (the other features' phrases joined to its own) to TensorBoard's Text tab and the console (a line
of its own above the progress bar, ``ctx.run.print``); whenever a window opens with another factor, effective batch or
LR scale, it adds an entry saying what changed, at which optimizer step and sample. The progress bar shows the factor
and the effective batch as integers, and says when a window was cut short (``ctx.run.show_in_progress_bar``).
"""

from __future__ import annotations

import time

import torch
from typing_extensions import override

from lightning_accum.compat.lightning import is_tensorboard
from lightning_accum.core.events import Context, Feature
from lightning_accum.core.monitor import StepRecord, batch_summary, memory_metrics, step_metrics, tensorboard_layout

CONSTANTS = ("accum/micro_batch_size", "accum/world_size")
"""What does not change within a fit: logged with its first logged step only."""


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
        self._batch: tuple[int, int] | None = None  # (factor, effective batch) of the last window, this fit
        self._tags: set[str] = set()  # what this fit logged so far: the dashboard draws a chart for each quantity
        self._layout: dict[str, dict[str, list]] | None = None  # the dashboard written last, this fit
        self._step = 0  # the optimizer step the window in progress ends in
        self._logging = False  # whether that step is logged

    @override
    def fit_start(self, ctx: Context) -> None:
        self._batch, self._tags, self._layout = None, set(), None
        ctx.log_every = ctx.run.log_every_n_steps if ctx.run.loggers else 0  # the same on every rank
        if ctx.is_global_zero:
            self._write_summary(
                ctx, [batch_summary(ctx.plan.micro_batch_size, ctx.factor, ctx.world_size), *ctx.summary]
            )

    @override
    def window_opened(self, ctx: Context) -> None:
        self._loss, self._items, self._started = None, 0, time.perf_counter()
        self._step = ctx.optimizer_steps + 1  # the step this window takes
        # its loss is summed only if that step is logged, on rank zero
        self._logging = ctx.is_global_zero and ctx.log_every > 0 and self._step % ctx.log_every == 0
        batch = (ctx.factor, ctx.effective_batch(ctx.factor))
        changes = []
        if self._batch is not None and batch != self._batch:
            changes.append(f"factor {self._batch[0]} -> {batch[0]}")
            unit = "samples" if ctx.plan.micro_batch_size is not None else "micro-batches"
            changes.append(f"effective batch {self._batch[1]} -> {batch[1]} {unit}")
        if self._batch is not None and (changes or ctx.summary) and ctx.is_global_zero:
            where = f"optimizer step {ctx.optimizer_steps}, {ctx.samples_seen} samples seen"
            self._write_summary(ctx, [f"{where}: {', '.join([*changes, *ctx.summary])}"])
        self._batch = batch

    def _write_summary(self, ctx: Context, phrases: list[str]) -> None:
        text = "; ".join(phrases)
        for logger in ctx.run.loggers:
            if is_tensorboard(logger):
                logger.experiment.add_text("accum/summary", text, global_step=ctx.optimizer_steps)
        ctx.run.print(f"{ctx.run.owner}: {text}")

    @override
    def micro_batch_ended(self, ctx: Context) -> None:
        if ctx.loss is None or not self._logging:  # a skipped micro-step (training_step returned None), or no log
            return
        loss = ctx.loss.detach()  # Lightning's loss is already divided by the window's size
        if ctx.items is not None:  # weigh by items: sum(loss_i * items_i), divided at the window's end
            if isinstance(ctx.items, torch.Tensor):
                loss = loss * ctx.window.size * ctx.items.to(device=loss.device, dtype=loss.dtype)
            else:  # a host count: one multiplication, no copy to the device
                loss = loss * (ctx.items * ctx.window.size)
            self._items = self._items + ctx.items
        self._loss = loss if self._loss is None else self._loss + loss

    @override
    def window_closed(self, ctx: Context) -> None:
        effective = ctx.effective_batch(ctx.window.taken)
        shown = effective if ctx.window.taken == ctx.factor else f"{effective} (short window)"
        ctx.run.show_in_progress_bar({"factor": ctx.factor, "eff_batch": shown})
        if ctx.optimizer_steps != self._step or not self._logging:  # no step taken (no backward), or not logged
            return
        loggers = ctx.run.loggers
        # what the device holds (the window's loss, device counts, other features' tensors): read in one go
        held = {name: value for name, value in ctx.metrics.items() if isinstance(value, torch.Tensor)}
        for name, value in (("loss", self._loss), ("items", self._items)):
            if isinstance(value, torch.Tensor):
                held[f"_{name}"] = value.sum()
        read = _read(held)
        record = StepRecord(
            factor=ctx.factor,
            micro_steps_in_window=ctx.window.taken,
            micro_batch_size=ctx.plan.micro_batch_size,
            world_size=ctx.world_size,
            samples_seen=ctx.samples_seen,
            optimizer_steps=ctx.optimizer_steps,
            micro_steps=ctx.micro_steps,
            window_loss=self._window_loss(
                ctx, read.get("_loss"), read["_items"] if "_items" in read else float(self._items)
            ),
            seconds=time.perf_counter() - self._started,
        )
        device = getattr(ctx.module, "device", torch.device("cpu"))
        steps = step_metrics(record)
        if self._tags:  # the run's constants were logged with its first logged step (a split size that changes, the
            for name in CONSTANTS:  # micro-batcher's, comes with ctx.metrics)
                steps.pop(name, None)
        metrics = {**steps, **memory_metrics(device), **ctx.metrics}
        metrics.update((name, value) for name, value in read.items() if not name.startswith("_"))
        for logger in loggers:
            logger.log_metrics(metrics, step=ctx.optimizer_steps)
        # written with the first logged step, and again only when a quantity appears later (the noise scale's first
        # measured window): TensorBoard shows the run's latest layout
        new = metrics.keys() - self._tags
        if new:
            self._tags |= new
            layout = tensorboard_layout(self._tags)
            if layout != self._layout:
                self._layout = layout
                for logger in loggers:
                    if is_tensorboard(logger):
                        logger.experiment.add_custom_scalars(layout)

    def _window_loss(self, ctx: Context, loss: float | None, items: float) -> float | None:
        if loss is None:
            return None
        if ctx.items is None:
            return loss * ctx.window.gradient_correction
        return loss / items if items > 0 else None


def _read(tensors: dict[str, torch.Tensor]) -> dict[str, float]:
    """The values of 0-d tensors, read to the host together: one wait for the device."""
    if not tensors:
        return {}
    first = next(iter(tensors.values()))
    dtype = torch.float32 if first.device.type == "mps" else torch.float64
    values = torch.stack([t.detach().to(device=first.device, dtype=dtype).reshape(()) for t in tensors.values()])
    return dict(zip(tensors, values.tolist(), strict=True))
