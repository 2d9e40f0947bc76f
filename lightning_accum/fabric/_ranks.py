"""What the ranks of a Fabric run must agree on before a window's first backward: their loaders' lengths and sizes.

Ranks whose loaders hold different numbers of batches would leave one rank waiting in a reduction the others never
issue (DDP) or pair FSDP2's collectives wrongly; ranks that read different micro-batch sizes would count samples
differently. Sized loaders are compared once per epoch (one all-gather), unsized ones at every window (one scalar
all-reduce, read on the host once per window). Every rank raises the same error.

Lightning glue: collectives on the default process group of Fabric's strategy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric import Fabric


def over_ranks(group: Any, world_size: int) -> Callable[[torch.Tensor, str], torch.Tensor]:
    """``reduce(tensor, "sum" | "mean")`` for ``Context.reduce``: ``tensor`` summed (or averaged) over ``group``."""

    def reduce(tensor: torch.Tensor, op: str) -> torch.Tensor:
        if world_size == 1:
            return tensor
        torch.distributed.all_reduce(tensor, group=group)
        return tensor / world_size if op == "mean" else tensor

    return reduce


def agree_on_loaders(fabric: Fabric, size: int | None, length: int | None, given: int | None) -> int | None:
    """The micro-batch size every rank uses; raise on every rank if the ranks' loaders differ (one all-gather).

    Args:
        fabric: The run's Fabric.
        size: This rank's micro-batch size (``None``: unknown).
        length: This rank's loader length (``None``: unsized).
        given: The size the user gave the Accumulator (then the loaders' batch sizes may differ).
    """
    if fabric.world_size == 1:
        return size
    local = torch.tensor([size or -1, -1 if length is None else length], dtype=torch.int64, device=fabric.device)
    gathered = [torch.empty_like(local) for _ in range(fabric.world_size)]
    torch.distributed.all_gather(gathered, local)
    rows = [row.tolist() for row in gathered]
    lengths, sizes = [row[1] for row in rows], [row[0] for row in rows]
    if len(set(lengths)) > 1:
        raise ValueError(
            f"Accumulator.batches: the ranks' loaders hold different numbers of batches ({_by_rank(lengths)}): a"
            " window would wait forever for a rank that ran out. Set the loaders up with"
            " `fabric.setup_dataloaders` (a DistributedSampler) or give every rank as many batches"
        )
    if len(set(sizes)) > 1 and given is None:
        raise ValueError(
            f"Accumulator.batches: the ranks' loaders have different batch sizes ({_by_rank(sizes)}), so they"
            " would count samples differently: give every rank's loader the same `batch_size`, or pass"
            " `micro_batch_size` to the Accumulator"
        )
    return size


def agree_on_window(fabric: Fabric, held: int, step: int) -> None:
    """Raise on every rank if the ranks fetched different numbers of micro-batches for the window of ``step``."""
    if fabric.world_size == 1:
        return
    local = torch.tensor([held, -held], dtype=torch.int64, device=fabric.device)
    torch.distributed.all_reduce(local, op=torch.distributed.ReduceOp.MAX)
    most, minus_fewest = local.tolist()  # one host read per window, for unsized loaders only
    fewest = -minus_fewest
    if most != fewest:
        raise ValueError(
            f"Accumulator.batches: the ranks' loaders ran out at different points: the window of optimizer step"
            f" {step} holds {fewest} micro-batches on one rank and {most} on another (this rank: {held}). Give every"
            " rank as many batches (a DistributedSampler, or an iterable that yields as many on every rank)"
        )


def _by_rank(values: list[int]) -> str:
    return ", ".join(f"rank {rank}: {'unknown' if value < 0 else value}" for rank, value in enumerate(values))
