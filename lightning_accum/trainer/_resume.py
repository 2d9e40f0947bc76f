"""The resume point: a checkpoint written in the middle of a window holds the state from before the window.

A window's gradients live only in ``.grad`` until its optimizer step, so a checkpoint written inside the window (a
time-based ``ModelCheckpoint``, ``OnExceptionCheckpoint``, a SLURM requeue, ``trainer.save_checkpoint`` in a hook)
cannot resume it where it stopped. It can resume it from its start: the weights, the optimizer and the LR schedulers
do not change inside a window, so only the loop's batch counters, the train dataloaders' states (when they have
``state_dict``) and the callback's own state must be those of the moment the window opened. This module keeps them
and writes them into such a checkpoint; the resumed run then trains the whole window again from the same weights
and the same batches, and ends where the uninterrupted run ends.

The place in the train dataloader's samples, which the resumed run starts from, is ``_data.LoaderPosition``'s.

Lightning glue: it reads ``trainer.fit_loop`` (public attributes) and writes the ``"loops"`` entry of Lightning's
checkpoint dict; the layout is pinned by ``tests/test_lightning_contract.py``.
"""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as pl

from lightning_accum.trainer._data import LoaderPosition

_BATCH_PROGRESS = "epoch_loop.batch_progress"


class ResumePoint:
    """The state a checkpoint needs to resume at the first micro-step of the window in progress.

    Call :meth:`between_windows` when no window is in progress (at the fit's start and after each window's last
    micro-step) and :meth:`window_opened` at each window's first micro-step; set :attr:`in_step` from a micro-step's
    start to its end. A checkpoint written then takes :meth:`state` as the callback's state and :meth:`rewind` for
    Lightning's loops.

    Example::

        point = ResumePoint()
        point.between_windows(trainer, callback.state_dict())   # after a step: what comes next is a new window
        point.window_opened(trainer)                             # the window's first micro-step begins
        state = point.state(current, window_open=True)           # a checkpoint written inside the window...
        point.rewind(checkpoint, window_open=True)               # ...resumes at the window's first batch
    """

    def __init__(self) -> None:
        self.in_step = False  # between the callback's on_train_batch_start and on_train_batch_end
        self.restored = False  # whether this fit loaded the callback's state from a checkpoint
        self.callback_state: dict[str, Any] | None = None
        self._loaders: list[dict[str, Any]] | None = None
        self._stateless: Any = None  # the train dataloaders last found to have no state_dict
        self._batches: tuple[int, int, bool] | None = None  # batches completed before the window (in all, in the
        # epoch), and whether its first batch is the epoch's last
        self._fit_loop: Any = None  # the Trainer's fit loop, to tell whether the window has stepped
        self._steps_at_open = 0
        self.data = LoaderPosition()  # the place in the train dataloader's samples, on any number of ranks

    def between_windows(self, trainer: pl.Trainer, callback_state: dict[str, Any]) -> None:
        """Keep the callback's state and the dataloaders' states: the next batch opens a window."""
        # kept as given, once per optimizer step: the callback builds it afresh, of plain values (each feature's
        # state_dict() returns new containers; tests/test_architecture.py checks it), and it is copied when written
        self.callback_state = callback_state
        loaders = trainer.train_dataloader
        if loaders is not None and loaders is self._stateless:  # asked once per dataloader object, not per step
            self._loaders = None
            return
        # the same call Lightning makes to checkpoint the dataloaders: `state_dict()` of those that have one
        states = trainer.fit_loop.on_save_checkpoint().get("combined_loader")
        self._loaders = copy.deepcopy(states)
        self._stateless = loaders if states is None else None

    def window_opened(self, trainer: pl.Trainer) -> None:
        """Keep where the window starts: the batches completed before it."""
        progress = trainer.fit_loop.epoch_loop.batch_progress
        self._batches = (progress.total.completed, progress.current.completed, progress.is_last_batch)
        self._fit_loop, self._steps_at_open = trainer.fit_loop, trainer.global_step

    @property
    def stepped(self) -> bool:
        """Whether the optimizer has stepped since the window opened (its update is in the weights)."""
        return self._fit_loop is not None and self._fit_loop.epoch_loop.global_step > self._steps_at_open

    @property
    def ready(self) -> bool:
        """Whether a window's start is known (not before the fit's first micro-step)."""
        return self.callback_state is not None and self._batches is not None

    def inside(self, window_open: bool) -> bool:
        """Whether a checkpoint written now falls inside a window (a micro-step in progress, or ``window_open``)."""
        return self.ready and (self.in_step or window_open) and not self.stepped

    def state(self, current: dict[str, Any], window_open: bool) -> dict[str, Any]:
        """The callback's state to checkpoint: ``current``, or inside a window the state kept at its start.

        A micro-batch size that ``"auto"`` found stays found.
        """
        if not self.inside(window_open):
            return current
        assert self.callback_state is not None
        state = copy.deepcopy(self.callback_state)
        if "micro_batch_size_found" in current:
            state["micro_batch_size_found"] = current["micro_batch_size_found"]
        return state

    def rewind(self, checkpoint: dict[str, Any], window_open: bool) -> None:
        """Inside a window, make ``checkpoint``'s loop and dataloaders resume at the window's first batch."""
        if not self.inside(window_open):
            return
        assert self._batches is not None
        fit_loop = checkpoint.get("loops", {}).get("fit_loop")
        if not isinstance(fit_loop, dict) or _BATCH_PROGRESS not in fit_loop:
            return  # not Lightning's layout (a contract test guards it): leave the checkpoint as written
        total, current, is_last_batch = self._batches
        progress = fit_loop[_BATCH_PROGRESS]
        # as Lightning writes it from inside the window's first batch: started, not yet processed
        for counts, done in ((progress["total"], total), (progress["current"], current)):
            counts.update(ready=done + 1, started=done + 1, processed=done, completed=done)
        progress["is_last_batch"] = is_last_batch
        loop_state = fit_loop.setdefault("state_dict", {})
        if self._loaders is not None and current > 0:
            loop_state["combined_loader"] = copy.deepcopy(self._loaders)
        else:
            # the window is the epoch's first: the states kept after the previous epoch's last batch would resume at
            # that epoch's end (torchdata's StatefulDataLoader then yields nothing); without a state, each loader
            # starts the epoch afresh, as the window does
            loop_state.pop("combined_loader", None)
