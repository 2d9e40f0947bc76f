"""The place in the train dataloader's samples, for the Trainer: a resumed run's loader starts where the run stopped.

The Trainer shell's twin of ``fabric/_data.py``. :class:`LoaderPosition` keeps the coordinator's place in the epoch's
global order (:class:`~lightning_accum.core.data_position.DataPosition`, in the callback's state under ``"data"``); at
a resumed fit's start :func:`reposition` starts the train dataloader at the first sample the run had not consumed, on
any number of ranks. :func:`restore_loader_states` gives the train dataloaders the states a checkpoint holds where
Lightning set them up too early, and :func:`drop_loader_states_of_other_ranks` drops those of a checkpoint written on
another number of ranks.

Lightning glue: it reads ``trainer.fit_loop`` (public attributes, and the private ones that hold the pending loader
states and the data fetcher); the private names are pinned by ``tests/test_lightning_contract.py``.
"""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader

from lightning_accum.core.data_position import DataPosition
from lightning_accum.core.events import Context
from lightning_accum.core.fit import sampler_ranks


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


def reposition(trainer: pl.Trainer, data: DataPosition, ranks: tuple[int, int]) -> Repositioned | None:
    """Start the train dataloader at the first sample the resumed run had not consumed, on any number of ranks.

    ``data`` holds the checkpoint's place in the epoch's global order; ``ranks``: ``(ranks, rank)`` among which the
    loader's sampler deals (the fit's plan's ``data_ranks``). The loader's batch sampler draws from a
    :class:`~lightning_accum.core.data_position.Dealt` sampler for the rest of the fit (:meth:`Repositioned.put_back`
    gives its own back), and the loop's batch counters say how many of this rank's batches are behind it, so the epoch
    ends where its samples do. A loader that resumes by its own state on the same ranks is left to it; one whose
    position cannot be set is warned of, naming what the resumed epoch repeats. Private names of Lightning's fit loop
    (the data fetcher, pinned by ``tests/test_lightning_contract.py``).
    """
    world, rank = ranks
    loop = trainer.fit_loop
    if data.resumed_from in (None, world) and loop.on_save_checkpoint().get("combined_loader"):
        data.forget()  # a loader with state_dict on the same ranks: Lightning gave it its state
        return None
    loader = trainer.train_dataloader
    resume = data.resume(loader, world, rank, trainer.current_epoch)
    progress: Any = loop.epoch_loop.batch_progress
    if isinstance(resume, str) and not progress.is_last_batch:  # an epoch of unknown length the loop saw end: no loss
        rank_zero_warn(f"AccumulationScheduler: {resume}")
    if resume is None or isinstance(resume, str):
        return None
    assert isinstance(loader, DataLoader), "DataPosition.resume checked it"
    # an ended epoch the loop still counts in the old world's batches (a checkpoint at its last batch): all of them
    done = (
        resume.done
        if resume.done is not None
        else resume.batches
        if resume.ended and progress.current.processed
        else None
    )
    if done is not None:
        shift = done - progress.current.processed
        for counts in (progress.current, progress.total):
            counts.ready, counts.started = counts.ready + shift, counts.started + shift
            counts.processed, counts.completed = counts.processed + shift, counts.completed + shift
    kept = Repositioned(loader, resume.sampler)
    if loop._data_fetcher is not None and resume.sampler is not None:
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

    The callback calls :meth:`batch_ended` after each loader batch, :meth:`fit_started` at
    ``on_train_start`` (after the checkpoint's state is loaded) and :meth:`release` at the fit's end; its state goes
    in the callback's under ``"data"``.
    """

    def __init__(self) -> None:
        self.data = DataPosition()
        self._rows, self._world = 0, 1  # the train dataloader's rows per batch (0: not known); the ranks
        self._kept: Repositioned | None = None

    def fit_started(self, trainer: pl.Trainer, ctx: Context, target_batch_size: int | None, grows: bool) -> None:
        """Reposition a resumed run's loader, learn the order it deals, and say what another number of ranks changes.

        The loader states a checkpoint holds go to loaders that sizing a schedule set up early (Lightning #20550).
        """
        restore_loader_states(trainer)
        self._rows, self._world = ctx.plan.loader_batch_size or 0, ctx.plan.data_ranks[0]
        self._kept = reposition(trainer, self.data, ctx.plan.data_ranks)
        self.data.describe(trainer.train_dataloader, self._world)
        self.data.say_global_batch(ctx, target_batch_size, grows)

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
