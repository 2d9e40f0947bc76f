"""Supervised fine-tuning in a Lightning Fabric loop in the style of litgpt's ``finetune/full.py``, made exact.

The task: given a docstring's first paragraph as the prompt (``# <docstring>\\n``), write the function's ``def`` line,
byte by byte, for the functions of the Python standard library that runs the example (no download). Prompts and
responses have very different lengths, so micro-batches hold very different numbers of supervised tokens; the prompt
and the padding are masked with -100. The model is the repository's byte-level transformer (``examples/byte_lm.py``).

Three runs from the same weights, over the same epochs and the same micro-batches in the same order:

- **big batch**, the reference: one AdamW step per window on the window's sequences as one batch, the loss summed over
  their supervised tokens and divided by their number;
- **Accumulator**: litgpt's loop with ``lightning_accum.fabric.Accumulator`` (``normalize_by="token"``,
  ``shift_labels=True``) in place of its accumulation lines;
- **litgpt**: litgpt's loop as it is (each micro-batch's own mean divided by the factor, ``fabric.no_backward_sync``,
  a step at every multiple of the factor, so an epoch's short last window is never stepped), its ``CycleIterator``
  replaced by a loop over epochs.

After each epoch it prints, side by side, how far each run's weights are from the big batch's: ``|w - w_big| /
|w_big - w_start|``, the distance relative to how far the reference moved (0 is the big batch itself). With AdamW
(litgpt's optimizer) an exact accumulation still sits a little away from the big batch: its update divides each
gradient element by its own running magnitude, so float32 rounding in elements whose gradient is near zero becomes
a visible difference; ``--optimizer sgd`` shows the rounding alone::

    python examples/fabric_sft.py                                  # a few minutes on 2 CPU cores
    python examples/fabric_sft.py --optimizer sgd
    python examples/fabric_sft.py --pairs 96 --width 16 --layers 1 --epochs 1   # a quick look
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from byte_lm import ByteLM  # noqa: E402
from contrastive import code_pairs  # noqa: E402

from lightning_accum.fabric import Accumulator  # noqa: E402

Batch = dict[str, torch.Tensor]


def sft_pairs(count: int, context: int, root: Path | None = None) -> list[tuple[bytes, bytes]]:
    """``(prompt, response)`` pairs: a docstring's first paragraph as a comment, the function's ``def`` line."""
    pairs = []
    for pair in code_pairs(root):
        definition = next((line.strip() for line in pair.code.splitlines() if line.lstrip().startswith("def ")), None)
        if definition is None:
            continue
        prompt, response = f"# {pair.query}\n".encode(), definition.encode()
        if len(prompt) + len(response) <= context:
            pairs.append((prompt, response))
        if len(pairs) == count:
            break
    return pairs


def collate(pairs: Sequence[tuple[bytes, bytes]]) -> Batch:
    """Padded to the longest sequence of the micro-batch (byte 0); labels -100 on the prompt and the padding."""
    length = max(len(prompt) + len(response) for prompt, response in pairs)
    ids = torch.zeros(len(pairs), length, dtype=torch.long)
    labels = torch.full((len(pairs), length), -100, dtype=torch.long)
    for row, (prompt, response) in enumerate(pairs):
        sequence = torch.tensor(list(prompt + response))
        ids[row, : len(sequence)] = sequence
        labels[row, len(prompt) : len(sequence)] = sequence[len(prompt) :]
    return {"input_ids": ids, "labels": labels}


def loss_fn(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """litgpt's loss: the logits at t predict the label at t + 1 (``chunked_cross_entropy(logits[..., :-1, :],
    targets[..., 1:])``), a mean over the micro-batch's own supervised tokens."""
    logits, labels = logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()
    return F.cross_entropy(logits, labels, ignore_index=-100, reduction=reduction)


def lr_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int, max_steps: int) -> Any:
    """litgpt's ``get_lr_scheduler``: linear warmup, then cosine annealing."""
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: step / warmup_steps)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(max_steps - warmup_steps, 1))
    return torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, cosine], milestones=[warmup_steps])


def new_model(args: argparse.Namespace) -> ByteLM:
    torch.manual_seed(args.seed)
    return ByteLM(context=args.context, width=args.width, layers=args.layers, heads=args.heads)


def new_optimizer(model: torch.nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    if args.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=args.lr)
    return torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.02)


def big_batch(data: list[Batch], steps_per_epoch: int, args: argparse.Namespace) -> list[list[torch.Tensor]]:
    """The reference: a step per window on its sequences as one batch; the weights at the start and each epoch's end."""
    model = new_model(args)
    optimizer = new_optimizer(model, args)
    scheduler = lr_scheduler(optimizer, args.warmup_steps, args.epochs * steps_per_epoch)
    snapshots = [[p.detach().clone() for p in model.parameters()]]
    for _ in range(args.epochs):
        for start in range(0, len(data), args.factor):
            window = data[start : start + args.factor]
            length = max(batch["input_ids"].shape[1] for batch in window)
            ids = torch.cat([F.pad(batch["input_ids"], (0, length - batch["input_ids"].shape[1])) for batch in window])
            labels = torch.cat(
                [F.pad(batch["labels"], (0, length - batch["labels"].shape[1]), value=-100) for batch in window]
            )
            optimizer.zero_grad()
            (loss_fn(model(ids), labels, reduction="sum") / (labels[:, 1:] != -100).sum()).backward()
            optimizer.step()
            scheduler.step()
        snapshots.append([p.detach().clone() for p in model.parameters()])
    return snapshots


def accumulated(fabric: Fabric, data: list[Batch], args: argparse.Namespace) -> list[list[torch.Tensor]]:
    """litgpt's loop through the Accumulator: the weights at each epoch's end."""
    model = new_model(args)
    model, optimizer = fabric.setup(model, new_optimizer(model, args))
    accumulator = Accumulator(
        fabric,
        model,
        optimizer,
        scheduling={0: args.factor},
        normalize_by="token",  # every supervised token of the window weighs the same
        shift_labels=True,  # the loss counts labels[..., 1:]
        micro_batch_size=args.micro_batch,
    )
    lr_max_steps = args.epochs * accumulator.steps_per_epoch(data)
    scheduler = lr_scheduler(optimizer, args.warmup_steps, lr_max_steps)
    snapshots = []
    for _ in range(args.epochs):
        for batch in accumulator.batches(data):
            with accumulator.micro_step(batch) as micro:
                logits = model(batch["input_ids"])
                micro.backward(loss_fn(logits, batch["labels"]))  # the micro-batch's own mean, as litgpt computes it
            if micro.should_step:
                optimizer.step()
                optimizer.zero_grad()
                scheduler.step()
        snapshots.append([p.detach().clone() for p in model.parameters()])
    accumulator.close()
    return snapshots


def litgpt(fabric: Fabric, data: list[Batch], args: argparse.Namespace) -> list[list[torch.Tensor]]:
    """litgpt's loop as it is: the weights at each epoch's end."""
    model = new_model(args)
    model, optimizer = fabric.setup(model, new_optimizer(model, args))
    steps_per_epoch = len(data) // args.factor
    scheduler = lr_scheduler(optimizer, args.warmup_steps, args.epochs * steps_per_epoch)
    snapshots, iter_num = [], 0
    for _ in range(args.epochs):
        for batch in data:
            iter_num += 1
            is_accumulating = iter_num % args.factor != 0
            with fabric.no_backward_sync(model, enabled=is_accumulating):
                logits = model(batch["input_ids"])
                loss = loss_fn(logits, batch["labels"])
                fabric.backward(loss / args.factor)
            if not is_accumulating:
                optimizer.step()
                optimizer.zero_grad()
                scheduler.step()
        snapshots.append([p.detach().clone() for p in model.parameters()])
    return snapshots


def distance(weights: list[torch.Tensor], reference: list[torch.Tensor], start: list[torch.Tensor]) -> float:
    """``|weights - reference| / |reference - start|``."""
    gap = sum((w - r).pow(2).sum() for w, r in zip(weights, reference, strict=True))
    moved = sum((r - s).pow(2).sum() for r, s in zip(reference, start, strict=True))
    return float((gap / moved).sqrt())


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=1000, help="training pairs (the last micro-batch may be short)")
    parser.add_argument("--micro-batch", type=int, default=4, dest="micro_batch", help="pairs per micro-batch")
    parser.add_argument("--factor", type=int, default=8, help="micro-batches per optimizer step")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--context", type=int, default=128, help="longest prompt + response, in bytes")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument(
        "--optimizer", choices=["adamw", "sgd"], default="adamw", help="litgpt's AdamW, or SGD (linear in the gradient)"
    )
    parser.add_argument("--lr", type=float, default=None, help="the peak LR (default: 2e-3 for AdamW, 0.5 for SGD)")
    parser.add_argument("--warmup-steps", type=int, default=4, dest="warmup_steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--root", type=Path, default=None, help="where the pairs come from (the standard library)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    """Train the three runs and print their distances to the big batch after each epoch; returns the rows."""
    args = parse(argv)
    if args.lr is None:
        args.lr = 2e-3 if args.optimizer == "adamw" else 0.5
    started = time.perf_counter()
    pairs = sft_pairs(args.pairs, args.context, args.root)
    data = [collate(pairs[i : i + args.micro_batch]) for i in range(0, len(pairs), args.micro_batch)]
    tokens = [int((batch["labels"][:, 1:] != -100).sum()) for batch in data]
    steps_per_epoch = math.ceil(len(data) / args.factor)
    print(
        f"{len(pairs)} pairs in {len(data)} micro-batches of {args.micro_batch} ({min(tokens)} to {max(tokens)}"
        f" supervised tokens each), factor {args.factor}: {steps_per_epoch} steps an epoch, the last on"
        f" {len(data) - (steps_per_epoch - 1) * args.factor} micro-batches; litgpt's loop takes"
        f" {len(data) // args.factor}"
    )
    fabric = Fabric(accelerator="cpu", devices=1)
    reference = big_batch(data, steps_per_epoch, args)
    ours, theirs = accumulated(fabric, data, args), litgpt(fabric, data, args)
    rows = []
    print("| epoch | Accumulator | litgpt's loop |")
    print("| ---: | ---: | ---: |")
    for epoch in range(args.epochs):
        row = {
            "epoch": epoch + 1,
            "accumulator": distance(ours[epoch], reference[epoch + 1], reference[0]),
            "litgpt": distance(theirs[epoch], reference[epoch + 1], reference[0]),
        }
        rows.append(row)
        print(f"| {row['epoch']} | {row['accumulator']:.1e} | {row['litgpt']:.1e} |")
    print(f"distance to the big batch's weights, relative to how far they moved; {time.perf_counter() - started:.0f} s")
    return rows


if __name__ == "__main__":
    main()
