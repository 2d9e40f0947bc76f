"""Route Lightning's accumulation decisions to the window, only while the callback's windows are in charge.

Lightning 2.6 decides *where a window ends* in ``_TrainingEpochLoop._should_accumulate``
(``batch_progress.current.ready % trainer.accumulate_grad_batches``, or the epoch's last batch), *where gradients
are zeroed* in ``_AutomaticOptimization._make_zero_grad_fn`` (``batch_idx % trainer.accumulate_grad_batches``), and
*which step-interval LR schedulers step* in ``_TrainingEpochLoop.update_lr_schedulers`` (``(batch_idx + 1) %
frequency``, counting batches of the epoch). The first two agree only while the factor is constant from the start of
an epoch, and the third counts batches where ``frequency`` means optimizer steps. No public hook lets a callback make
these decisions, so :class:`LoopControl` shadows the three bound methods on the Trainer's own loop instances while
the callback's windows are in charge, and gives them back otherwise:

- before training starts (a tuner's ``lr_find`` or ``scale_batch_size`` runs the loop from ``on_fit_start``) nothing
  is routed, and ``trainer.accumulate_grad_batches`` holds the factor of the callback's first window;
- while another component has set ``trainer.accumulate_grad_batches`` itself (:meth:`LoopControl.follow`), Lightning's
  own arithmetic applies with that value, except that a micro-step without backward (``fit_loop._skip_backward``, read
  where that property reads it, ``epoch_loop.automatic_optimization._skip_backward``,
  which ``StochasticWeightAveraging`` sets for its BatchNorm epoch) never ends a window: there is nothing to step on,
  and stock Lightning would step on the epoch's last batch with stale gradients;
- after ``fit`` the Trainer's own ``accumulate_grad_batches`` is put back.

The divisor Lightning applies to each loss stays ``trainer.accumulate_grad_batches``, which the callback sets to the
window's size (to 1 when wide accumulation weighs each micro-batch's gradient in float32 instead).
``tests/test_lightning_contract.py`` fails if this private behaviour changes. This module owns only that routing: it
never decides a boundary itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl

from lightning_accum.compat.lightning import trainer_names
from lightning_accum.trainer._run import print_line

_SHADOWED = (
    ("epoch_loop", "_should_accumulate"),
    ("epoch_loop", "update_lr_schedulers"),
    ("automatic_optimization", "_make_zero_grad_fn"),
)


def ends_epoch(trainer: pl.Trainer, batch_idx: int) -> bool:
    """Whether the batch at ``batch_idx`` is its epoch's last (by the epoch's length, or the fetcher's last batch)."""
    return batch_idx + 1 >= trainer.num_training_batches or trainer.is_last_batch


class LoopControl:
    """Own ``trainer.accumulate_grad_batches`` and, while in charge, Lightning's accumulation decisions.

    Args:
        trainer: The Trainer whose loops to route.
        starts_window: Whether the micro-step in progress opened a window.
        ends_window: Whether the micro-step in progress (or, between micro-steps, the last one) ended a window.
    """

    def __init__(self, trainer: pl.Trainer, starts_window: Callable[[], bool], ends_window: Callable[[], bool]) -> None:
        self._trainer = trainer
        self._starts_window = starts_window
        self._ends_window = ends_window
        self._targets: list[Any] = []
        self._following = False  # Lightning's own arithmetic, with a factor another component set
        self.in_charge = False  # whether the decisions are routed to the window now (installed, not following)
        self._own = trainer.accumulate_grad_batches  # the Trainer's own value, given back by release()
        self._factor = self._own  # the value this control last set

    @property
    def following(self) -> bool:
        """Whether Lightning's own arithmetic decides, with a factor another component set."""
        return self._following

    def take_charge(self) -> bool:
        """Route to the window, unless another component has set the factor: then follow it and return ``False``.

        Such a factor is followed from an epoch's start (as ``StochasticWeightAveraging`` sets one for its BatchNorm
        epoch) until it is given back at an epoch's start.

        Raises:
            RuntimeError: If the factor was set, or given back, in the middle of an epoch: that would split a window.
        """
        changed = self.changed_elsewhere()
        if self.in_charge and not changed:  # every micro-step but the first
            return True
        if changed != self._following and self._trainer.fit_loop.epoch_loop.batch_idx != 0:  # not at an epoch's start
            raise RuntimeError(
                f"`trainer.accumulate_grad_batches` was set to {self._trainer.accumulate_grad_batches} in the middle"
                " of an epoch; AccumulationScheduler sets it itself, and follows another component's value only from"
                " an epoch's start to an epoch's start: change it in `on_train_epoch_start` and give it back in"
                " `on_train_epoch_end`, or give the factor to AccumulationScheduler"
            )
        if not changed:
            self.lead()
            return True
        if not self._following:  # said in the middle of training: above the progress bar
            print_line(
                self._trainer,
                f"AccumulationScheduler: another component set `trainer.accumulate_grad_batches ="
                f" {self._trainer.accumulate_grad_batches}`; Lightning's own accumulation applies until it is set back",
            )
        self.follow()
        return False

    def lead(self) -> None:
        """Route the decisions to the window."""
        self._install()
        self._following, self.in_charge = False, True

    def follow(self) -> None:
        """Let Lightning's own arithmetic decide with the factor another component set (see the module's docstring)."""
        self._install()
        self._following, self.in_charge = True, False

    def set_factor(self, factor: int) -> None:
        """Set ``trainer.accumulate_grad_batches`` (the divisor of each loss, and the factor outside the windows)."""
        self._trainer.accumulate_grad_batches = self._factor = factor

    def changed_elsewhere(self) -> bool:
        """Whether something other than this control has set ``trainer.accumulate_grad_batches`` since it last did."""
        return self._trainer.accumulate_grad_batches != self._factor

    def _install(self) -> None:
        """Shadow the decisions on the Trainer's loop instances (nothing happens if they already are).

        Raises:
            RuntimeError: If this Lightning version no longer has the methods that are routed.
        """
        if self._targets:
            return
        epoch_loop = self._trainer.fit_loop.epoch_loop
        owners = {"epoch_loop": epoch_loop, "automatic_optimization": epoch_loop.automatic_optimization}
        for owner, name in _SHADOWED:
            if not callable(getattr(type(owners[owner]), name, None)):
                raise RuntimeError(
                    f"lightning_accum routes `{type(owners[owner]).__name__}.{name}`, which lightning"
                    f" {trainer_names(self._trainer).version} does not have: install a lightning version within the"
                    " range that lightning_accum pins"
                )
        should_accumulate = self._should_accumulate(epoch_loop)
        routed = {
            "_should_accumulate": should_accumulate,
            "update_lr_schedulers": self._update_lr_schedulers(epoch_loop, should_accumulate),
            "_make_zero_grad_fn": self._make_zero_grad_fn(owners["automatic_optimization"]),
        }
        for owner, name in _SHADOWED:
            setattr(owners[owner], name, routed[name])
            self._targets.append((owners[owner], name))

    def release(self) -> None:
        """Give the decisions and the Trainer's own ``accumulate_grad_batches`` back; safe to call more than once."""
        for owner, name in self._targets:
            owner.__dict__.pop(name, None)
        self._targets, self._following, self.in_charge = [], False, False
        self.set_factor(self._own)

    def _should_accumulate(self, epoch_loop: Any) -> Callable[[], bool]:
        progress = epoch_loop.batch_progress.current
        lightning_should_accumulate = epoch_loop._should_accumulate
        optimization = epoch_loop.automatic_optimization  # what `fit_loop._skip_backward` reads

        def should_accumulate() -> bool:
            if optimization._skip_backward:  # nothing was backpropagated, so there is nothing to step on
                return True
            if self._following:
                return lightning_should_accumulate()
            # a batch that never started (on_train_batch_start returned -1) must not step the LR schedulers
            return progress.started < progress.ready or not self._ends_window()

        return should_accumulate

    def _update_lr_schedulers(
        self, epoch_loop: Any, should_accumulate: Callable[[], bool]
    ) -> Callable[[str, bool], None]:
        lightning_update = epoch_loop.update_lr_schedulers
        trainer = self._trainer

        def update_lr_schedulers(interval: str, update_plateau_schedulers: bool) -> None:
            if self._following or interval != "step":
                lightning_update(interval, update_plateau_schedulers)
                return
            if should_accumulate():  # inside a window (twice per micro-step): what Lightning would return on
                return
            configs = trainer.strategy.lr_scheduler_configs
            if not any(config.frequency > 1 for config in configs):
                lightning_update(interval, update_plateau_schedulers)
                return
            # `frequency` counts optimizer steps: hand Lightning only the step schedulers due at this optimizer
            # step, each as due on every call (the copies share the scheduler objects)
            due = [
                dataclasses.replace(config, frequency=1)
                for config in configs
                if config.interval == "step" and trainer.global_step % config.frequency == 0
            ]
            trainer.strategy.lr_scheduler_configs = due
            try:
                lightning_update(interval, update_plateau_schedulers)
            finally:
                trainer.strategy.lr_scheduler_configs = configs

        return update_lr_schedulers

    def _make_zero_grad_fn(self, optimization: Any) -> Callable[[int, Any], Any]:
        lightning_zero_grad_fn = optimization._make_zero_grad_fn
        trainer = self._trainer

        def make_zero_grad_fn(batch_idx: int, optimizer: Any) -> Any:
            if self._following:
                return lightning_zero_grad_fn(batch_idx, optimizer)
            if not self._starts_window():
                return None
            # Lightning's own builder keeps its hooks and progress counters; with a divisor of 1 it never skips.
            divisor, trainer.accumulate_grad_batches = trainer.accumulate_grad_batches, 1
            try:
                return lightning_zero_grad_fn(batch_idx, optimizer)
            finally:
                trainer.accumulate_grad_batches = divisor

        return make_zero_grad_fn
