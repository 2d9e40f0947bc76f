"""Where the noise scale reads gradients: each micro-batch's whole gradient, and the step's, whole or sharded.

A micro-batch's gradient reaches a tensor hook on the leaf autograd accumulates it into: the parameter itself, or,
under FSDP2 (``fully_shard``), the unit's unsharded parameter, which holds the rank's whole gradient before the
reduce-scatter (torch-private ``FSDPParam._unsharded_param``, created at the unit's first all-gather and kept across
iterations; pinned by ``tests/test_torch_contract.py``). The step's gradient is ``.grad``: whole after DDP's
all-reduce, a shard (a ``DTensor``) under FSDP2, whose local squares add up over the ranks to the whole square
(divided by the ranks that hold the same shard, HSDP's replicas). Pure torch: no Lightning import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_accum.core.events import DataParallel
from lightning_accum.core.split import label_span
from lightning_accum.distributed.sync import fsdp2_param_groups

# said once per fit, at the first window measured in halves, where the halves' labels bear uneven tokens
HALVES_BY_ROWS = (
    "a window measured in halves weighs each half by its rows (normalize_by='micro_batch'), but the batch's labels"
    " hold different numbers of loss-bearing tokens per row: a loss that is a mean over tokens is then not the whole"
    " batch's on those windows. Set normalize_by='token' (the mean over every token) to step as the whole batch"
)


class RowsCheck:
    """Whether the first ``windows`` windows measured in halves weighed by their rows hold rows of uneven labels.

    Example::

        >>> check = RowsCheck(windows=3)
        >>> check.see({"labels": torch.tensor([[1, -100]])}); check.see({"labels": torch.tensor([[1, 2]])})
        >>> check.said() == HALVES_BY_ROWS, check.windows
        (True, 0)
    """

    def __init__(self, windows: int = 0) -> None:
        self.windows = windows
        self._spans: list[tuple[int, int]] = []

    def see(self, part: Any) -> None:
        """Look at a half of a measured window's loader batch (one host read, while windows are left)."""
        span = label_span(part) if self.windows else None
        if span is not None:
            self._spans.append(span)

    def said(self) -> str | None:
        """At the window's step: what to say once, where its halves' rows bore uneven labels (``None``: nothing)."""
        spans, self._spans = self._spans, []
        if not spans:
            return None
        self.windows -= 1
        if min(low for low, _ in spans) == max(high for _, high in spans):
            return None
        self.windows = 0
        return HALVES_BY_ROWS


def check_strategy(parallel: DataParallel, wrapped: bool) -> None:
    """Refuse DeepSpeed and FSDP1, whose micro-batch gradients no hook sees whole.

    ``wrapped``: the model's wrapper is known (at fit start); before it, a sharding strategy may turn out FSDP2's.

    Raises:
        ValueError: Naming the strategy, what it does and what to use instead.
    """
    fsdp1 = parallel.wrapper == "fsdp1" or (wrapped and parallel.shards_parameters and parallel.wrapper != "fsdp2")
    if parallel.wrapper == "deepspeed" or fsdp1:
        deepspeed = f"(ZeRO stage {parallel.zero_stage}) reduces inside its own step"
        raise ValueError(
            f"`noise_scale=True` reads each micro-batch's full gradient, which {parallel.strategy}"
            f" {deepspeed if parallel.wrapper == 'deepspeed' else 'shards'}: use it with a single device, DDP or FSDP2"
            " (`fully_shard`, ModelParallelStrategy), or set noise_scale=False"
        )


@dataclass(frozen=True)
class Targets:
    """Where a measured window's gradients are read (:func:`targets`).

    Attributes:
        leaves: The trainable leaves each micro-batch's gradient reaches (FSDP2's unsharded parameters, or the
            parameters themselves).
        complete: Whether every such leaf exists: under FSDP2 a unit's unsharded parameters exist only from its
            first all-gather on, and a window without them all is not measured.
        params: The trainable parameters whose ``.grad`` the step takes (under FSDP2 the sharded ones).
        sharded: Whether some of those ``.grad`` are shards, whose squares are summed over the ranks.
    """

    leaves: list[torch.Tensor]
    complete: bool
    params: list[torch.Tensor]
    sharded: bool


def targets(module: nn.Module) -> Targets:
    """Where ``module``'s gradients are read, in one pass over its FSDP2 units (none: its own parameters).

    Between a unit's forward and its backward ``fully_shard`` may have registered the unsharded parameters on the
    module: they are neither counted twice nor taken for the step's.

    Example::

        >>> found = targets(nn.Linear(2, 1))
        >>> [tuple(leaf.shape) for leaf in found.leaves], found.complete, found.sharded
        ([(1, 2), (1,)], True, False)
    """
    managed: set[int] = set()
    leaves: list[torch.Tensor] = []
    shards: list[torch.Tensor] = []
    complete = True
    for group in fsdp2_param_groups(module):
        for fsdp_param in group.fsdp_params:
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            managed |= {id(fsdp_param.sharded_param), id(unsharded)}
            if not fsdp_param.sharded_param.requires_grad:
                continue
            shards.append(fsdp_param.sharded_param)
            if unsharded is None:
                complete = False
            else:
                leaves.append(unsharded)
    own: list[torch.Tensor] = [p for p in module.parameters() if p.requires_grad and id(p) not in managed]
    return Targets(leaves + own, complete, shards + own, bool(shards))


def local_part(grad: torch.Tensor) -> tuple[torch.Tensor, float]:
    """``grad``'s local tensor, and by how many ranks its square is held (a ``DTensor``'s replicas; else ``1``).

    Example::

        >>> local_part(torch.ones(3))[1]
        1.0
    """
    to_local = getattr(grad, "to_local", None)
    if to_local is None:
        return grad, 1.0
    mesh, placements = grad.device_mesh, grad.placements  # type: ignore[attr-defined]
    replicas = math.prod(mesh.size(dim) for dim, placement in enumerate(placements) if placement.is_replicate())
    return to_local(), float(replicas)


def square_into(grad: torch.Tensor, entry: torch.Tensor) -> None:
    """Write the squared norm of ``grad`` (its local part, over its replicas) into ``entry``, in float32, at once.

    Example::

        >>> entry = torch.zeros(())
        >>> square_into(torch.tensor([3.0, 4.0]), entry); float(entry)
        25.0
    """
    grad, replicas = local_part(grad)
    if grad.requires_grad:  # a backward with create_graph=True: the sums stay out of its graph
        grad = grad.detach()
    if grad.is_sparse:  # an embedding's sparse gradient: its entries, each index once
        grad = grad.coalesce().values()
    flat: Any = grad.reshape(-1) if grad.dtype is torch.float32 else grad.reshape(-1).float()
    if flat.device == entry.device:
        torch.dot(flat, flat, out=entry)
    else:  # a parameter on another device than the first trainable one
        entry.copy_(torch.dot(flat, flat))
    if replicas != 1.0:
        entry.div_(replicas)
