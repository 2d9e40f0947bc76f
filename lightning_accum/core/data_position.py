"""Where a run is in its data, in samples: an epoch's global order, and each rank's share of what is left of it.

A ``DistributedSampler`` deals an epoch's indices round-robin: rank ``r`` of ``W`` takes positions ``r, r + W, ...``,
so after ``k`` micro-batches of ``b`` rows on every rank the run has consumed exactly the global positions
``[0, k * b * W)``, whatever ``W`` is. A run's place in an epoch is therefore a number of samples that means the same
on any number of ranks. A resumed run deals the rest of the epoch's global order to its own ranks from there
(:class:`Dealt`), and keeps the run's order in the epochs after (a run begun on one device with a sequential loader
goes on in that order on two; a run begun on two goes on in their shuffled order on one).

Pure: torch only (its samplers). Both shells keep a :class:`DataPosition` and call it at the same moments.

Example::

    position = DataPosition()
    position.describe(loader, world_size=2)           # each epoch's start: the order the loader's sampler deals
    position.took(rows=4, world_size=2)              # after each loader batch: 8 samples of the global order
    state = position.state_dict()                     # in the checkpoint
    resumed = DataPosition(); resumed.load_state_dict(state)
    plan = resumed.resume(loader, world_size=1, rank=0, epoch=0)   # on one device: where its share starts
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, Sampler, SequentialSampler

from lightning_accum.core.events import Context


@dataclass(frozen=True)
class Order:
    """The global order of an epoch's samples: what all the run's ranks consume together, position by position.

    ``kind`` is ``"sequential"`` (``range(length)``) or ``"distributed"``: ``torch.utils.data.DistributedSampler``'s
    indices for every rank together (shuffled with ``seed + epoch``, padded or cut for ``world`` ranks), which is also
    the sampler Lightning gives a training loader on several devices.
    """

    kind: str
    length: int
    shuffle: bool = False
    seed: int = 0
    drop_last: bool = False
    world: int = 1

    def indices(self, epoch: int) -> list[int]:
        """The epoch's dataset indices in global order (``DistributedSampler.__iter__`` before its subsampling)."""
        if self.kind == "sequential" or not self.shuffle:
            indices = list(range(self.length))
        else:
            generator = torch.Generator()
            generator.manual_seed(self.seed + epoch)
            indices = torch.randperm(self.length, generator=generator).tolist()
        total = self.total
        if total <= len(indices):
            return indices[:total]
        return (indices * math.ceil(total / len(indices)))[:total]  # padded by repeating from the start, as torch does

    @property
    def total(self) -> int:
        """The positions of an epoch (the dataset, padded or cut to a multiple of ``world``)."""
        if self.kind == "sequential":
            return self.length
        if self.drop_last and self.length % self.world:
            return math.ceil((self.length - self.world) / self.world) * self.world
        return math.ceil(self.length / self.world) * self.world

    def same_as(self, other: Order) -> bool:
        """Whether both deal the same indices in every epoch (sequential is an unshuffled, unpadded distributed)."""
        if self.length != other.length or self.total != self.length or other.total != other.length:
            return self == other
        shuffled, other_shuffled = (
            self.kind == "distributed" and self.shuffle,
            other.kind == "distributed" and other.shuffle,
        )
        return shuffled == other_shuffled and (not shuffled or self.seed == other.seed)


def order_of(sampler: Any) -> Order | None:
    """The global order ``sampler`` deals, or ``None`` where it cannot be told (a random or custom sampler)."""
    if isinstance(sampler, Dealt):
        return sampler.order
    if type(sampler) is DistributedSampler:  # torch's own, which Lightning gives a plain training loader
        size = len(sampler.dataset)  # type: ignore[arg-type]
        return Order("distributed", size, sampler.shuffle, sampler.seed, sampler.drop_last, sampler.num_replicas)
    if type(sampler) is SequentialSampler:
        return Order("sequential", len(sampler))
    return None


class Dealt(Sampler[int]):
    """Rank ``rank``'s share of ``order`` on ``world`` ranks, ``length`` indices an epoch, from ``start`` in ``epoch``.

    The epoch it is built for begins at global position ``start`` (what the run had consumed); later epochs begin at
    0. Rank ``r`` takes positions ``start + r, start + r + world, ...`` up to ``length * world``, every rank as many
    (the last ones wrap around to the epoch's first positions, as ``DistributedSampler`` pads). The epoch comes from
    ``set_epoch`` (Lightning's loop calls it) unless ``follow_set_epoch`` is off (a Fabric loader's wrapper would set
    its own count of iterations): then the caller sets :attr:`epoch`.
    """

    def __init__(
        self, order: Order, rank: int, world: int, length: int, epoch: int, start: int, follow_set_epoch: bool = True
    ) -> None:
        self.order, self.rank, self.world, self.length = order, rank, world, length
        self.epoch, self.first_epoch, self.start, self.follow_set_epoch = epoch, epoch, start, follow_set_epoch

    def set_epoch(self, epoch: int) -> None:  # noqa: D102 (DistributedSampler's)
        if self.follow_set_epoch:
            self.epoch = epoch

    def __len__(self) -> int:
        return self.length  # a whole epoch's share, as the sampler it stands in for

    def __iter__(self) -> Iterator[int]:
        start = self.start if self.epoch == self.first_epoch else 0
        return iter(share(self.order.indices(self.epoch), start, self.length * self.world, self.rank, self.world))


def share(indices: list[int], start: int, end: int, rank: int, world: int) -> list[int]:
    """Rank ``rank``'s share of the global positions ``[start, end)`` of ``indices``, wrapping past their end."""
    count = max(0, -(-(end - start) // world))
    first = start + rank
    if first + world * (count - 1) < len(indices):
        return indices[first : first + world * count : world]
    return [indices[(first + world * j) % len(indices)] for j in range(count)]


@dataclass(frozen=True)
class Resume:
    """Where a resumed run's loader starts: ``sampler`` in place of the loader's, ``done`` of its batches behind it.

    ``done`` is ``None`` at an epoch's boundary (the loop's own count stands); ``ended``: the checkpoint's epoch was
    consumed to its end (a loop that still counts its batches has all of this rank's ``batches`` behind it).
    ``sampler`` is ``None`` where the loader's own sampler deals the run's order already.
    """

    sampler: Dealt | None
    done: int | None
    batches: int = 0
    ended: bool = False


class DataPosition:
    """The run's place in the epoch's global order (samples of all ranks), the order, and the world that dealt it."""

    def __init__(self) -> None:
        self.position = 0  # global positions of the epoch in progress consumed
        self.epoch = 0  # the epoch they belong to
        self.world_size = 0  # the ranks the run had when the state was written (0: unknown)
        self.epoch_size = 0  # an epoch's positions: one rank's share times the ranks (0: unknown)
        self.order: Order | None = None
        self.loaded: dict[str, Any] | None = None  # the state a checkpoint gave, until the resumed run reads it
        self.resumed_from: int | None = None  # the ranks of the run whose checkpoint this one resumed (if known)

    def describe(self, loader: Any, world_size: int) -> None:
        """At an epoch's start: the order ``loader`` deals (``None`` where it cannot be told) on ``world_size``."""
        sampler = _sampler(loader)
        self.order = order_of(sampler) if sampler is not None else None
        size, batches = _len(sampler), _len(loader)
        if size is None and batches is not None:  # a batch sampler of its own: its batches times their rows
            size = batches * (getattr(getattr(loader, "batch_sampler", None), "batch_size", None) or 0)
        self.epoch_size, self.world_size = (size or 0) * world_size, world_size

    def start_epoch(self, epoch: int) -> None:
        """Epoch ``epoch`` begins at its first position."""
        self.position, self.epoch = 0, epoch

    def took(self, rows: int, world_size: int) -> None:
        """Every rank took a loader batch of ``rows`` indices."""
        self.position += rows * world_size

    def state_dict(self) -> dict[str, Any]:
        """Plain values: the position and its epoch, the ranks and the order (``None`` where it cannot be told)."""
        order = None if self.order is None else asdict(self.order)
        own = {"position": self.position, "epoch": self.epoch, "world_size": self.world_size}
        return {**own, "epoch_size": self.epoch_size, "order": order}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Keep a checkpoint's state for :meth:`resume` (a checkpoint of an older release has none: nothing moves)."""
        self.loaded = dict(state) if state else None
        if self.loaded is not None:
            self.position, self.epoch = int(self.loaded.get("position", 0)), int(self.loaded.get("epoch", 0))
            order = self.loaded.get("order")
            self.order = Order(**order) if order else None
            self.world_size = int(self.loaded.get("world_size", 0))
            self.epoch_size = int(self.loaded.get("epoch_size", 0))
            self.resumed_from = self.world_size or None

    def forget(self) -> None:
        """The loader resumes by its own state (``state_dict``, the same ranks): nothing of its order is moved."""
        self.loaded = None

    def say_global_batch(self, ctx: Context, target_batch_size: int | None, grows: bool) -> None:
        """Print, for a fixed factor resumed on other ranks, the old and the new global batch, and what keeps it.

        Nothing to say where a target batch or adaptive growth (``grows``) keeps the global batch.
        """
        world, new_world, micro = self.resumed_from, ctx.world_size, ctx.plan.micro_batch_size or 1
        if world is None or world == new_world or target_batch_size is not None or grows:
            return
        was, now = ctx.factor * world * micro, ctx.factor * new_world * micro
        ctx.run.print(
            f"{ctx.run.owner}: resumed on {new_world} process(es) from a checkpoint written on {world}: the global"
            f" batch is now {now} samples (factor {ctx.factor} x micro-batch {micro} x {new_world}), was {was}."
            f" `target_batch_size={was}` keeps it on any number of processes"
        )

    def resume(self, loader: Any, world_size: int, rank: int, epoch: int) -> Resume | str | None:
        """Where ``loader`` starts on ``world_size`` ranks in ``epoch``: a :class:`Resume`, ``None``, or why not.

        ``None``: nothing to move; a text: why it cannot start where the run stopped. The checkpoint's place counts
        only in the epoch it was written in: a loop that goes on with the next one (a fit stopped by ``max_steps`` or
        ``should_stop`` inside an epoch ends it) starts that epoch afresh. Call once, at the resumed run's start,
        before the epoch's first batch; it forgets the checkpoint's state.
        """
        if self.loaded is None:
            return None
        self.loaded = None
        ended = 0 < self.epoch_size <= self.position and self.epoch in (epoch - 1, epoch)  # the loop may count it
        middle = self.epoch == epoch and self.position > 0 and not ended  # an unknown epoch size: inside, if anything
        position = self.position if middle else 0
        if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
            return _cannot(loader, position) if middle else None
        sampler, batch_sampler = _sampler(loader), loader.batch_sampler
        own = order_of(sampler) if sampler is not None else None
        run_order = self.order
        if run_order is None or own is None or type(batch_sampler) is not BatchSampler:
            return _cannot(loader, position) if middle else None
        length, batches = len(sampler), len(batch_sampler)
        if not middle:  # at an epoch's boundary only the order may need keeping
            keeps = own.same_as(run_order)
            dealt = None if keeps else Dealt(run_order, rank, world_size, length, epoch, 0)
            return Resume(dealt, None, batches, ended)
        rows = batch_sampler.batch_size
        left = max(0, -(-(length * world_size - position) // world_size))  # this rank's indices left in the epoch
        left_batches = left // rows if batch_sampler.drop_last else -(-left // rows)
        return Resume(Dealt(run_order, rank, world_size, length, epoch, position), batches - left_batches, batches)


def _len(obj: Any) -> int | None:
    """``len(obj)``, or ``None`` where it has none."""
    try:
        return len(obj)
    except TypeError:
        return None


def _sampler(loader: Any) -> Any:
    """The sampler a loader's batch sampler draws from (Fabric's wrapper is seen through)."""
    loader = getattr(loader, "_dataloader", loader)
    batch_sampler = getattr(loader, "batch_sampler", None)
    return getattr(batch_sampler, "sampler", None)


def _cannot(loader: Any, position: int) -> str:
    """Why a loader cannot start where the run stopped inside an epoch, and what the resumed epoch then trains."""
    what = "an IterableDataset" if isinstance(getattr(loader, "dataset", None), IterableDataset) else None
    if what is None:
        sampler = _sampler(loader)
        what = f"a {type(sampler).__name__}" if sampler is not None else f"a {type(loader).__name__}"
    return (
        f"the run stopped in the middle of an epoch, after {position} of its samples (all ranks), and the train"
        f" dataloader draws from {what}, whose place cannot be set: the resumed epoch begins its order again (a"
        " random sampler draws a new one), so samples the run had consumed are trained again and as many of the"
        " rest are not. Sequential loaders and DistributedSampler (which Lightning gives a training loader on several"
        " devices) resume at the sample where the run stopped, on any number of devices"
    )
