"""TrainerRun: the features' read-only view of the Trainer, and the actions they may ask of it.

Features never hold the Trainer (``tests/test_architecture.py`` checks it): at ``setup`` the coordinator binds the
:class:`~lightning_accum.core.events.Context` to a :class:`TrainerRun`, which answers what the features may know (epoch,
batches per epoch, loggers, how gradients travel between ranks, the AMP loss scale) and carries out the few actions
they may ask for (size the progress bar, show values beside it, print a line above it, hand DDP's reduction to the
callback for a window). :func:`print_line` prints a line of the package's whole, above the bar while one is drawn: the
features' lines through ``Run.print``, the micro-batcher's directly.

Lightning glue. It reads the Trainer's public attributes; sizing Lightning's TQDM bar uses its private
``_train_progress_bar`` (the public property raises before an epoch starts), and keeps the size across the bar's
own reset at an epoch's start by wrapping the bar's ``on_train_epoch_start`` on the instance for the fit
(``tests/test_lightning_contract.py`` pins both); :func:`print_line` reads the same attribute to know whether the TQDM
bar is drawn.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_accum.compat.lightning import trainer_names
from lightning_accum.core.events import Context, DataParallel, Run, takes_dataloader_iter
from lightning_accum.distributed.sync import fsdp2_modules
from lightning_accum.strategies.deepspeed import DeepSpeedAccumulationMixin
from lightning_accum.strategies.mixin import AccumulationStrategyMixin


class TrainerRun(Run):
    """What the features may know of ``trainer`` and ask of it, for one fit.

    Args:
        trainer: The Trainer of the fit.
    """

    def __init__(self, trainer: pl.Trainer) -> None:
        self._trainer = trainer
        self._names = names = trainer_names(trainer)
        bar = trainer.progress_bar_callback
        self._bar = bar if isinstance(bar, (names.TQDMProgressBar, names.RichProgressBar)) else None
        self._total: tuple[int, int] | None = None  # (epoch, total) the bar was last sized to
        self._bar_reset: Callable[..., Any] | None = None  # the bar's own on_train_epoch_start, while wrapped

    @property
    def names(self) -> Any:  # noqa: D102 (Run's)
        return self._names

    @property
    def epoch(self) -> int:  # noqa: D102 (Run's)
        return self._trainer.current_epoch

    @property
    def batches_per_epoch(self) -> float:  # noqa: D102
        return float(self._trainer.num_training_batches)

    @property
    def max_steps(self) -> int:  # noqa: D102
        return self._trainer.max_steps

    @property
    def log_every_n_steps(self) -> int:  # noqa: D102
        return max(1, int(getattr(self._trainer, "log_every_n_steps", 1) or 1))

    @property
    def loggers(self) -> list[Any]:  # noqa: D102
        return list(self._trainer.loggers)

    @property
    def lr_schedulers(self) -> list[tuple[Any, str, int]]:  # noqa: D102
        return [(c.scheduler, c.interval, c.frequency) for c in self._trainer.lr_scheduler_configs]

    @property
    def has_progress_bar(self) -> bool:  # noqa: D102
        return self._bar is not None

    @property
    def data_parallel(self) -> DataParallel:  # noqa: D102
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.nn.parallel import DistributedDataParallel

        strategy: Any = self._trainer.strategy
        model = getattr(strategy, "model", None)
        wrapper = "none"
        if isinstance(model, DistributedDataParallel):
            wrapper = "ddp"
        elif isinstance(model, FullyShardedDataParallel):
            wrapper = "fsdp1"
        elif fsdp2_modules(model):
            wrapper = "fsdp2"
        elif isinstance(strategy, DeepSpeedAccumulationMixin):
            wrapper = "deepspeed"
        return DataParallel(
            wrapper=wrapper,
            strategy=type(strategy).__name__,
            gradient_sync=strategy.gradient_sync if isinstance(strategy, AccumulationStrategyMixin) else None,
            static_graph=bool(getattr(model, "static_graph", False)),
            shards_parameters=isinstance(strategy, (self._names.FSDPStrategy, self._names.ModelParallelStrategy)),
            zero_stage=strategy.zero_stage if wrapper == "deepspeed" else None,
        )

    def loss_scale(self) -> float | None:  # noqa: D102
        scaler = getattr(self._trainer.precision_plugin, "scaler", None)
        return float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else None

    def set_progress_total(self, total: int) -> None:  # noqa: D102
        if self._bar is None:
            return
        self._total = (self._trainer.current_epoch, total)
        if self._bar_reset is None:  # the bar resets its total at each epoch's start, after this callback's hook
            self._bar_reset = self._bar.on_train_epoch_start
            self._bar.on_train_epoch_start = self._after_bar_reset  # type: ignore[method-assign]
        _set_total(self._bar, total)

    def _after_bar_reset(self, trainer: pl.Trainer, *args: Any) -> None:
        assert self._bar_reset is not None
        assert self._bar is not None
        self._bar_reset(trainer, *args)
        if self._total is not None and self._total[0] == trainer.current_epoch:
            _set_total(self._bar, self._total[1])

    def show_in_progress_bar(self, values: dict[str, Any]) -> None:  # noqa: D102
        # as text, which both bars show as given: the Rich bar writes a number in its theme's format (2 as `2.000`)
        text: dict[str, Any] = {name: str(value) for name, value in values.items()}
        self._trainer.progress_bar_metrics.update(text)

    def print(self, text: str) -> None:  # noqa: D102
        print_line(self._trainer, text)

    def reduce_gradients_elsewhere(self, elsewhere: bool) -> None:  # noqa: D102
        strategy = self._trainer.strategy
        if isinstance(strategy, AccumulationStrategyMixin):
            strategy.reduce_gradients_elsewhere(elsewhere)

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:  # noqa: D102
        torch.distributed.all_reduce(tensor, group=self._trainer.strategy.model.process_group)  # type: ignore[union-attr]

    def release(self) -> None:  # noqa: D102

        if self._bar is not None and "on_train_epoch_start" in vars(self._bar):
            del self._bar.on_train_epoch_start
        self._bar_reset = None


def bind(ctx: Context, trainer: pl.Trainer, module: pl.LightningModule) -> TrainerRun:
    """Bind ``ctx`` to the fit of ``trainer``: ranks and collectives from its strategy, the run's view."""
    run = TrainerRun(trainer)
    ctx.module, ctx.run, ctx.can_split = module, run, not takes_dataloader_iter(module)
    ctx.world_size, ctx.is_global_zero = trainer.world_size, trainer.is_global_zero
    ctx.reduce = lambda tensor, op: trainer.strategy.reduce(tensor, reduce_op=op)
    ctx.broadcast = lambda obj: trainer.strategy.broadcast(obj, src=0)
    return run


def print_line(trainer: pl.Trainer, text: str) -> None:
    """Print ``text`` on rank zero as a line of its own: above Lightning's train progress bar while one is drawn.

    A drawn bar (TQDM or Rich) prints it through its own ``print``, which clears the bar, writes the line and draws
    the bar again below it; otherwise it goes through Lightning's rank-zero logging (``rank_zero_info``, logger
    ``lightning.pytorch.utilities.rank_zero``, or ``pytorch_lightning``'s for its Trainer). A line logged beside a
    drawn bar lands at the end of the bar's own line: the bar ends in a carriage return, not a newline, and the logging
    handler knows nothing of it.

    Args:
        trainer: The Trainer whose bar is asked.
        text: One line, without its newline.

    Example::

        print_line(trainer, "AccumulationScheduler: factor 2 -> 4")
    """
    bar = trainer.progress_bar_callback
    if trainer.is_global_zero and bar is not None and _drawn(bar):
        bar.print(text)
    else:
        trainer_names(trainer).rank_zero_info(text)  # nothing on the other ranks


def _drawn(bar: Any) -> bool:
    """Whether ``bar`` is one of Lightning's bars and on the terminal now.

    An enabled TQDM bar not yet drawn, or no longer, would print nothing: its ``print`` needs a bar to write above.
    """
    names = trainer_names(bar)
    if isinstance(bar, names.TQDMProgressBar):
        # created at the bar's own on_train_start (after this package's, unless the user lists the bar first);
        # closing it (at the fit's end, and at each epoch's end with `leave=True`) disables it
        shown = bar._train_progress_bar
        return bar.is_enabled and shown is not None and not shown.disable
    if isinstance(bar, names.RichProgressBar):
        return bar.is_enabled and bar.progress is not None and bar.progress.live.is_started
    return False


def _set_total(bar: Any, total: int) -> None:
    if isinstance(bar, trainer_names(bar).TQDMProgressBar):
        if bar._train_progress_bar is not None:  # public `train_progress_bar` raises before the epoch starts
            bar.train_progress_bar.total = total
            bar.train_progress_bar.refresh()
    else:
        task = getattr(bar, "train_progress_bar_id", None)
        if bar.progress is not None and task is not None:
            bar.progress.update(task, total=total)
