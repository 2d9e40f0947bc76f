"""The resume point: a checkpoint written in the middle of a window holds the state from before the window.

A window's gradients live only in ``.grad`` until its optimizer step, so a checkpoint written inside the window (a
time-based ``ModelCheckpoint``, ``OnExceptionCheckpoint``, a SLURM requeue, ``trainer.save_checkpoint`` in a hook)
cannot resume it where it stopped. It can resume it from its start: the weights, the optimizer and the LR schedulers
do not change inside a window, so only the loop's batch counters, the train dataloaders' states (when they have
``state_dict``) and the callback's own state must be those of the moment the window opened. This module keeps them
and writes them into such a checkpoint; the resumed run then trains the whole window again from the same weights
and the same batches, and ends where the uninterrupted run ends.

It also counts what a checkpoint written without the callback's state has done (:func:`count_from_the_loop`), and
gives the train dataloaders the states a checkpoint holds where Lightning set them up too early
(:func:`restore_loader_states`).

Lightning glue: it reads ``trainer.fit_loop`` (public attributes, and for :func:`restore_loader_states` the private
ones that hold the pending loader states) and writes the ``"loops"`` entry of Lightning's checkpoint dict; the layout
and the private names are pinned by ``tests/test_lightning_contract.py``.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader

from lightning_accum._position import loader_batch_size
from lightning_accum.data_position import DataPosition, sampler_ranks
from lightning_accum.events import Context
from lightning_accum.schedule import ScheduleSpec

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

    def count_unrestored(self, trainer: pl.Trainer, ctx: Context) -> None:
        """Resuming a checkpoint without the callback's state: the loop's counts (:func:`count_from_the_loop`)."""
        if trainer.ckpt_path is not None and not self.restored and trainer.global_step > 0:
            ctx.micro_steps, ctx.samples_seen = count_from_the_loop(trainer, ctx.samples_per_micro_step)

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


def restore_loader_states(trainer: pl.Trainer) -> None:
    """Give the train dataloaders the states the checkpoint holds, where Lightning set them up before the restore.

    ``estimated_stepping_batches`` (Lightning's, and :func:`lightning_accum.estimated_stepping_batches`) sets the train
    dataloaders up when ``configure_optimizers`` sizes a schedule with it, before the checkpoint is restored; the fit
    loop then keeps them as they are and never loads the states it restored (Lightning issue #20550): a run resumed in
    the middle of an epoch would train on the epoch's first batches again. This loads them and makes the fetcher's
    iterator anew, as Lightning does when it sets the loaders up after the restore. Private names of Lightning's fit
    loop (``tests/test_lightning_contract.py`` pins them); nothing happens when no state is pending.
    """
    loop = trainer.fit_loop
    if loop._should_reload_train_dl:  # Lightning sets the loaders up anew before the epoch, and loads the states then
        return
    if loop.restarting and loop._combined_loader_states_to_load and loop._combined_loader is not None:
        loop._load_combined_loader_states()
        if loop._data_fetcher is not None:
            iter(loop._data_fetcher)


def count_from_the_loop(trainer: pl.Trainer, samples_per_micro_step: int) -> tuple[int, int]:
    """``(micro-steps, samples)`` done, for a resume from a checkpoint without the callback's state, from the loop."""
    done = int(getattr(trainer.fit_loop.epoch_loop.batch_progress.total, "processed", 0))  # a _ProcessedTracker
    samples = done * samples_per_micro_step
    rank_zero_warn(
        f"AccumulationScheduler: the checkpoint {str(trainer.ckpt_path)!r} holds no AccumulationScheduler state"
        f" (it was written without this callback); counting the {done} micro-batches the loop has done"
        f" ({samples} samples) for the schedule, while the LR-scaling base and warmup, the noise-scale"
        " estimate and adaptive growth start afresh"
    )
    return done, samples


def drop_loader_states_of_other_ranks(trainer: pl.Trainer, checkpoint: dict[str, Any], key: str) -> None:
    """Drop the dataloader states of a checkpoint of another number of ranks, before Lightning loads them.

    They count one rank's batches among that many, which would put every rank at the wrong place; the sampler is
    repositioned by samples instead (:func:`reposition`), where it can be.
    """
    saved = checkpoint.get("callbacks", {}).get(key, {}).get("data", {}).get("world_size")
    fit_loop, world = checkpoint.get("loops", {}).get("fit_loop"), sampler_ranks(trainer.strategy)[0]
    if saved in (None, 0, world) or not isinstance(fit_loop, dict):
        return
    if fit_loop.get("state_dict", {}).pop("combined_loader", None):
        rank_zero_warn(
            f"AccumulationScheduler: the checkpoint was written on {saved} process(es) and this run has {world}: the"
            " train dataloader's own state (`state_dict`: one rank's count of its own batches) cannot say where each"
            " rank is now, so it is not loaded; the loader starts at the first sample the run had not consumed where"
            " its sampler allows it (a sequential sampler or a DistributedSampler)"
        )


def reposition(trainer: pl.Trainer, data: DataPosition) -> Repositioned | None:
    """Start the train dataloader at the first sample the resumed run had not consumed, on any number of ranks.

    ``data`` holds the checkpoint's place in the epoch's global order. The loader's batch sampler draws from a
    :class:`~lightning_accum.data_position.Dealt` sampler for the rest of the fit (:meth:`Repositioned.put_back` gives
    its own back), and the loop's batch counters say how many of this rank's batches are behind it, so the epoch ends
    where its samples do. A loader that resumes by its own state on the same ranks is left to it; one whose position
    cannot be set is warned of, naming what the resumed epoch repeats. Private names of Lightning's fit loop (the
    data fetcher, pinned by ``tests/test_lightning_contract.py``).
    """
    world, rank = sampler_ranks(trainer.strategy)
    loop = trainer.fit_loop
    if data.resumed_from in (None, world) and loop.on_save_checkpoint().get("combined_loader"):
        data.forget()  # a loader with state_dict on the same ranks: Lightning gave it its state
        return None
    loader = trainer.train_dataloader
    plan = data.resume(loader, world, rank, trainer.current_epoch)
    progress: Any = loop.epoch_loop.batch_progress
    if isinstance(plan, str) and not progress.is_last_batch:  # an epoch of unknown length the loop saw end: no loss
        rank_zero_warn(f"AccumulationScheduler: {plan}")
    if plan is None or isinstance(plan, str):
        return None
    assert isinstance(loader, DataLoader), "DataPosition.resume checked it"
    # an ended epoch the loop still counts in the old world's batches (a checkpoint at its last batch): all of them
    done = plan.done if plan.done is not None else plan.batches if plan.ended and progress.current.processed else None
    if done is not None:
        shift = done - progress.current.processed
        for counts in (progress.current, progress.total):
            counts.ready, counts.started = counts.ready + shift, counts.started + shift
            counts.processed, counts.completed = counts.processed + shift, counts.completed + shift
    kept = Repositioned(loader, plan.sampler)
    if loop._data_fetcher is not None and plan.sampler is not None:
        iter(loop._data_fetcher)  # the iterator anew, drawing from the repositioned sampler
    return kept


class Repositioned:
    """A resumed train dataloader: the sampler :func:`reposition` gave it, and Lightning's warning quieted.

    Lightning's warning that a resume "ended before the epoch ended" counts the steps of a constant factor over its
    batches; it is false where the loader starts where the run stopped, and quieted until the fit's end.
    """

    def __init__(self, loader: DataLoader, sampler: Any) -> None:
        batch_sampler: Any = loader.batch_sampler
        self.loader, self.own = loader, batch_sampler.sampler
        if sampler is not None:
            batch_sampler.sampler = sampler
        warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch")
        self.quiet: Any = warnings.filters[0]

    def put_back(self) -> None:
        """The loader's own sampler again, and Lightning's warnings as they were."""
        self.loader.batch_sampler.sampler = self.own  # type: ignore[union-attr]
        filters: list[Any] = warnings.filters  # type: ignore[assignment]
        if self.quiet in filters:
            filters.remove(self.quiet)


class LoaderPosition:
    """The callback's place in the train dataloader's samples (:class:`DataPosition`), kept for the Trainer.

    The callback calls :meth:`batch_started` and :meth:`batch_ended` around each loader batch, :meth:`fit_started` at
    ``on_train_start`` (after the checkpoint's state is loaded) and :meth:`release` at the fit's end; its state goes
    in the callback's under ``"data"``.
    """

    def __init__(self) -> None:
        self.data = DataPosition()
        self._rows, self._world = 0, 1  # the train dataloader's rows per batch (0: not known); the ranks
        self._kept: Repositioned | None = None

    def fit_started(self, trainer: pl.Trainer, ctx: Context, spec: ScheduleSpec, grows: bool) -> None:
        """Reposition a resumed run's loader, learn the order it deals, and say what another number of ranks changes.

        The loader states a checkpoint holds go to loaders that sizing a schedule set up early (Lightning #20550).
        """
        restore_loader_states(trainer)
        self._rows, self._world = loader_batch_size(trainer) or 0, sampler_ranks(trainer.strategy)[0]
        self._kept = reposition(trainer, self.data)
        self.data.describe(trainer.train_dataloader, self._world)
        self.data.say_global_batch(ctx, spec.target_batch_size, grows)

    def batch_ended(self, trainer: pl.Trainer, batch_idx: int) -> None:
        """Every rank consumed a loader batch; an epoch's first begins at its order's first position (anew)."""
        if batch_idx == 0:
            self.data.start_epoch(trainer.current_epoch)
            self.data.describe(trainer.train_dataloader, self._world)
        self.data.took(self._rows, self._world)

    def state_dict(self) -> dict[str, Any]:
        """The position, the ranks and the order (:meth:`DataPosition.state_dict`)."""
        return self.data.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint's place, for :meth:`fit_started` to resume at."""
        self.data.load_state_dict(state)

    def release(self) -> None:
        """Give a repositioned loader its own sampler back."""
        if self._kept is not None:
            self._kept.put_back()
            self._kept = None
