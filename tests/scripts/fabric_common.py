"""A tiny causal LM, padded prompt/response pairs, and the plain-PyTorch big-batch reference, for the Fabric tests.

Shared by tests/test_fabric*.py and the Fabric scripts. The reference never imports lightning_accum: one SGD step per
window on the big batch's loss, the sum of the token losses over every supervised token of the window's sequences (on
every rank) divided by their number.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

VOCAB, LENGTH, WIDTH = 32, 12, 16
LR = 0.5


class TinyLM(nn.Module):
    """Embeddings, a causal running mean, one hidden layer and a head: each position sees the ones before it."""

    def __init__(self, seed: int = 1) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.block = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(ids)
        positions = torch.arange(1, ids.shape[1] + 1, device=ids.device, dtype=hidden.dtype)
        hidden = hidden.cumsum(1) / positions[:, None]
        return self.head(torch.tanh(self.block(hidden)))


def make_pairs(samples: int, seed: int = 0, empty: Sequence[int] = ()) -> list[dict[str, torch.Tensor]]:
    """Prompt/response pairs padded to ``LENGTH``: labels are the ids on the response, -100 on prompt and padding.

    Responses are 0 to 7 tokens long, so sequences bear very different numbers of tokens (some none); the samples in
    ``empty`` bear none.
    """
    generator = torch.Generator().manual_seed(seed)
    pairs = []
    for index in range(samples):
        prompt = int(torch.randint(1, 5, (), generator=generator))
        response = 0 if index in empty else int(torch.randint(0, 8, (), generator=generator))
        ids = torch.randint(1, VOCAB, (LENGTH,), generator=generator)
        ids[prompt + response :] = 0  # padding
        labels = ids.clone()
        labels[:prompt] = -100
        labels[prompt + response :] = -100
        pairs.append({"input_ids": ids, "labels": labels})
    return pairs


def micro_batches(pairs: Sequence[dict[str, torch.Tensor]], rows: int) -> list[dict[str, torch.Tensor]]:
    """The pairs in consecutive micro-batches of ``rows`` (the last may hold fewer)."""
    return [
        {key: torch.stack([pair[key] for pair in pairs[i : i + rows]]) for key in ("input_ids", "labels")}
        for i in range(0, len(pairs), rows)
    ]


def mean_loss(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The micro-batch's own mean loss, as litgpt computes it: logits at t predict the label at t + 1."""
    logits = model(batch["input_ids"])
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch["labels"][:, 1:].flatten(), ignore_index=-100)


Batch = dict[str, torch.Tensor]


def reference_snapshots(windows: Sequence[Sequence[Batch]], lr: float = LR) -> list[list[torch.Tensor]]:
    """Plain PyTorch: one SGD step per window on its sequences as one batch, the loss summed over its supervised tokens
    and divided by their number; the weights before the first step and after each."""
    model = TinyLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    snapshots = [[p.detach().clone() for p in model.parameters()]]
    for window in windows:
        big = {key: torch.cat([batch[key] for batch in window]) for key in ("input_ids", "labels")}
        logits = model(big["input_ids"])[:, :-1].flatten(0, 1)
        labels = big["labels"][:, 1:].flatten()
        loss = F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum") / (labels != -100).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        snapshots.append([p.detach().clone() for p in model.parameters()])
    return snapshots


def relative_distance(
    weights: Sequence[torch.Tensor], reference: Sequence[torch.Tensor], start: Sequence[torch.Tensor]
) -> float:
    """``|weights - reference| / |reference - start|``: the distance relative to how far the reference moved."""

    def squared(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> torch.Tensor:
        return sum((x.detach().float() - y.detach().float()).pow(2).sum() for x, y in zip(a, b, strict=True))

    return float((squared(weights, reference) / squared(reference, start)).sqrt())


def litgpt_loop(fabric: Any, model: Any, optimizer: Any, data: Iterable[Batch], factor: int, epochs: int = 1) -> int:
    """litgpt's finetune/full.py accumulation (its CycleIterator replaced by epochs), with Fabric's no_backward_sync:
    every micro-batch's own mean divided by the factor; a step only at a multiple of the factor, so an epoch's short
    last window is never stepped. The optimizer steps taken."""
    iter_num = steps = 0
    for _ in range(epochs):
        for batch in data:
            iter_num += 1
            is_accumulating = iter_num % factor != 0
            with fabric.no_backward_sync(model, enabled=is_accumulating):
                fabric.backward(mean_loss(model, batch) / factor)
            if not is_accumulating:
                optimizer.step()
                optimizer.zero_grad()
                steps += 1
    return steps


def leave() -> None:
    """Every rank has written its records: wait for the others, then leave without the interpreter's C++ teardown,
    which torch 2.13 can abort on a loaded machine after gloo runs (see two_ranks.py)."""
    torch.distributed.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
