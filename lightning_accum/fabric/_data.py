"""The Accumulator's place in its loader's samples, so that a resumed epoch starts where the run stopped.

A resumed epoch starts at the first sample the run had not consumed, on any number of ranks, and a Fabric loader's
sampler gets the run's epoch. Fabric glue over :class:`~lightning_accum.core.data_position.DataPosition`: around each
call of ``Accumulator.batches``, the loader's batch sampler draws from a
:class:`~lightning_accum.core.data_position.Dealt` sampler where the run's order must be kept or its epoch resumed, and
gets its own sampler back when the call ends. Fabric's loader wrapper sets the sampler's epoch to the number of times
that process iterated it (a private count, ``_num_iter_calls``, pinned by ``tests/test_lightning_contract.py``): it is
given the run's epoch, so a run resumed in a new process trains the epoch's own order.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric import Fabric
from lightning.fabric.utilities.rank_zero import rank_zero_warn

from lightning_accum.core.data_position import DataPosition, Dealt
from lightning_accum.core.fit import sampler_ranks


class LoaderPosition:
    """Where the Accumulator's run is in its loader's epoch, in samples; its state goes under ``"data"``.

    Example::

        position = LoaderPosition(fabric)
        done = position.open(loader, epoch=1, in_epoch=0)   # batches() begins: loader batches already behind
        position.took()                                       # each loader batch taken, on every rank
        position.close()                                      # batches() ends: the loader's own sampler again
    """

    def __init__(self, fabric: Fabric) -> None:
        self.data = DataPosition()
        self._world, self._rank = sampler_ranks(fabric.strategy)
        self._dealt: Dealt | None = None  # what the loader deals from for the rest of the run, once resumed
        self._own: tuple[Any, Any] | None = None  # (batch sampler, its own sampler) while a call of batches runs
        self._rows = 0

    def open(self, iterable: Any, epoch: int, in_epoch: int) -> int:
        """A call of ``batches`` over ``iterable`` begins: the loader batches of the epoch already behind it."""
        if hasattr(iterable, "_num_iter_calls"):  # Fabric's wrapper: the sampler's epoch is the run's
            iterable._num_iter_calls = epoch
        loader = getattr(iterable, "_dataloader", iterable)
        if in_epoch == 0:
            self.data.start_epoch(epoch)
        if self.data.loaded is not None:
            in_epoch = self._resume(iterable, loader, epoch, in_epoch)
        batch_sampler, dealt = getattr(loader, "batch_sampler", None), self._dealt
        if dealt is not None and not _deals_as(loader, dealt):  # another loader: its own order
            self._dealt = dealt = None
        if dealt is not None and batch_sampler is not None:
            dealt.epoch = epoch
            self._own, batch_sampler.sampler = (batch_sampler, batch_sampler.sampler), dealt
        self.data.describe(loader, self._world)
        self._rows = getattr(batch_sampler, "batch_size", None) or 0
        return in_epoch

    def _resume(self, iterable: Any, loader: Any, epoch: int, in_epoch: int) -> int:
        if self.data.resumed_from in (None, self._world) and callable(getattr(iterable, "state_dict", None)):
            self.data.forget()  # a stateful loader on the same ranks: `fabric.load` gave it its state
            return in_epoch
        plan = self.data.resume(loader, self._world, self._rank, epoch)
        if isinstance(plan, str):
            rank_zero_warn(f"Accumulator: {plan}")
        if plan is None or isinstance(plan, str):
            return in_epoch
        if plan.sampler is not None:  # the epoch is the run's, set in `open`
            self._dealt, plan.sampler.follow_set_epoch = plan.sampler, False
        return in_epoch if plan.done is None else plan.done

    def took(self) -> None:
        """Every rank took a loader batch."""
        self.data.took(self._rows, self._world)

    def close(self) -> None:
        """The call of ``batches`` ended: the loader's own sampler again."""
        if self._own is not None:
            batch_sampler, sampler = self._own
            batch_sampler.sampler, self._own = sampler, None
        if self._dealt is not None:  # the resumed epoch's rest was dealt: another call in it begins at its start
            self._dealt.start = 0


def _deals_as(loader: Any, dealt: Dealt) -> bool:
    """Whether ``loader`` is one the resumed run's order was dealt for: as many samples, as many a rank an epoch."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    sampler, dataset = getattr(batch_sampler, "sampler", None), getattr(loader, "dataset", None)
    try:
        return len(sampler) == dealt.length and len(dataset) == dealt.order.length  # type: ignore[arg-type]
    except TypeError:
        return False
