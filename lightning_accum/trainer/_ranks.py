"""Rank agreement: what every rank must share, computed once and shared, or refused on every rank alike.

- :func:`agree_on_batches`: at the fit's start, one all-gather of each rank's micro-batch size and batches per epoch;
  ranks that disagree raise together, each naming every rank's value.
- :func:`any_rank` and :func:`smallest`: one scalar all-reduce each (none on one process), for the micro-batcher's
  out-of-memory agreement.

Lightning glue: collectives through the Trainer's strategy.
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import torch


def agree_on_batches(trainer: pl.Trainer, micro_batch_size: int | None, given: int | None) -> int | None:
    """The micro-batch size every rank uses; raise on every rank if the ranks' loaders disagree on what windows need.

    Ranks with different numbers of batches would leave one rank waiting for the others in a reduction; ranks that
    infer different micro-batch sizes would count samples (``unit="sample"``, targets, ramps, LR rules) differently.

    Args:
        trainer: The Trainer of the fit.
        micro_batch_size: This rank's micro-batch size (``None``: unknown).
        given: The size the user gave (then the ranks' loaders may differ).

    Raises:
        ValueError: On every rank, naming each rank's value, if they disagree.
    """
    if trainer.world_size == 1:
        return micro_batch_size
    batches = trainer.num_training_batches
    local = torch.tensor(
        [micro_batch_size or -1, batches if math.isfinite(batches) else -1],
        dtype=torch.float64,
        device=trainer.strategy.root_device,
    )
    gathered = _all_gather(trainer, local).reshape(-1, 2).cpu().tolist()
    sizes = [None if size < 0 else int(size) for size, _ in gathered]
    lengths = [None if length < 0 else int(length) for _, length in gathered]

    def by_rank(values: list[int | None]) -> str:
        return ", ".join(f"rank {rank}: {'unknown' if value is None else value}" for rank, value in enumerate(values))

    if len(set(lengths)) > 1:
        raise ValueError(
            f"AccumulationScheduler: the ranks disagree on the number of training batches per epoch"
            f" ({by_rank(lengths)}): a window would wait forever for a rank that ran out of data. Keep Lightning's"
            " DistributedSampler (`Trainer(use_distributed_sampler=True)`) or give every rank as many batches"
        )
    if given is None and len(set(sizes)) > 1:
        raise ValueError(
            f"AccumulationScheduler: the ranks' DataLoaders disagree on the micro-batch size ({by_rank(sizes)}),"
            " so they would count samples differently. Give every rank's DataLoader the same `batch_size`, or pass"
            " `micro_batch_size` to AccumulationScheduler to say how many samples a rank's micro-batch counts"
        )
    return sizes[0]


def any_rank(trainer: pl.Trainer, flag: bool) -> bool:
    """Whether ``flag`` is true on any rank."""
    return _reduce(trainer, float(flag), "sum") > 0


def smallest(trainer: pl.Trainer, size: int) -> int:
    """The smallest ``size`` over the ranks."""
    return int(_reduce(trainer, float(size), "min"))


def _reduce(trainer: pl.Trainer, value: float, op: str) -> float:
    if trainer.world_size == 1:
        return value
    local = torch.tensor(value, device=trainer.strategy.root_device)
    return float(trainer.strategy.reduce(local, reduce_op=op).item())


def _all_gather(trainer: pl.Trainer, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` from every rank, stacked, with ``torch.distributed.all_gather`` on the default group.

    Not ``strategy.all_gather``: Lightning's goes through the deprecated ``torch.distributed.nn.functional.all_gather``
    and warns on every fit.
    """
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return trainer.strategy.all_gather(tensor)
    gathered = [torch.empty_like(tensor) for _ in range(trainer.world_size)]
    torch.distributed.all_gather(gathered, tensor.contiguous())
    return torch.stack(gathered)
