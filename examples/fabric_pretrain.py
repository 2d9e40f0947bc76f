"""Pretraining in a Lightning Fabric loop in the style of litgpt's ``pretrain.py``: batch-size schedules at one budget.

litgpt's pretraining loop, with ``lightning_accum.fabric.Accumulator`` in place of its accumulation lines: an endless
``CycleIterator`` over a shuffled loader, a token budget (``batches(..., max_tokens=...)``) and a warmup-then-cosine
LR schedule moved by the tokens consumed (``SampleDrivenLR(..., unit="token")``), so that it ends where the budget
ends whatever factors the windows had; every target token weighs the same (``normalize_by="token"``). The model is
the repository's byte-level transformer (``examples/byte_lm.py``), trained on the Python standard library's own
sources (no download; the last tenth held out).

Batch-size schedules (``--schedules``), each from the same weights on the same token budget and the same order of
micro-batches:

- ``small``: factor 1 throughout, the sample-efficient baseline;
- ``large``: factor ``--max-factor`` throughout;
- ``ramp``: the global batch ramped by hand from one micro-batch to ``--max-factor`` over the first half of the
  budget (the ``ramp_*`` arguments; Merrill et al.'s batch-size warmup);
- ``seesaw``: Seesaw (Meterez et al. 2025): the factor doubles wherever the cosine schedule's LR halves (at 50%, 67%
  and 77% of the budget), up to ``--max-factor``, and the LR rule gives back its share of each halving (the linear
  rule: all of it; the square-root rule: sqrt(2));
- ``adaptive``: from factor 1, grown by the gradient noise scale (``noise_scale=True, adaptive=True``, every tenth
  window measured, at most ``--max-factor``), held to the LR schedule's peak over its current LR (the budget's bound);
  at factor 1 a measured window's batch is yielded as its two halves.

``--data FILE`` trains on any text or bytes file instead (its last tenth held out); ``--beta2-follows-batch`` keeps
AdamW's ``beta2`` half-life fixed in tokens as the batch grows (``beta2 ** factor``, Marek et al. 2025);
``--devices N`` trains every run on N CPU processes (DDP over gloo, each rank its own shard of the data, the
micro-batch per process, the token budget over all of them; Fabric starts the other processes by running the
script again with its command line, so use it from the command line, not through ``main(argv)``).

The peak LR (8e-3) is the small batch's best of 2e-3, 4e-3, 8e-3 and 1.6e-2. A larger batch gets a larger LR by the
linear rule from one micro-batch's batch (``lr_scaling="linear"``: on this model it beat the square-root rule for
every schedule that grows, docs/batch-schedules.md; ``--lr-scaling sqrt``, the usual rule for Adam, or ``none``, the
same peak LR for every run). For each seed and schedule it prints the optimizer steps, the held-out loss (mean
cross-entropy per byte) and the wall time; then each schedule's means over the seeds, with steps and loss as ratios
to ``small``::

    python examples/fabric_pretrain.py                     # 3 seeds, about 8 minutes on 2 CPU cores
    python examples/fabric_pretrain.py --lr-scaling sqrt   # the square-root rule for every batch
    python examples/fabric_pretrain.py --seeds 0 --tokens 200000 --width 32 --layers 1   # a quick look
    python examples/fabric_pretrain.py --data my.txt --schedules small seesaw adaptive --seeds 7 8 9 --json out.json
    python examples/fabric_pretrain.py --devices 2 --micro-batch 4   # 2 processes, the same global batch
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parent))
from byte_lm import ByteLM, ByteWindows, read_corpus, read_file  # noqa: E402

from lightning_accum import SampleDrivenLR  # noqa: E402
from lightning_accum.fabric import Accumulator  # noqa: E402

SCHEDULES = ("small", "large", "ramp", "seesaw", "adaptive")


class CycleIterator:
    """litgpt's ``CycleIterator``: an iterable that starts over when it ends, forever (its ``epoch`` counts rounds)."""

    def __init__(self, iterable: Iterable[Any]) -> None:
        self.iterable, self.epoch = iterable, 0

    def __iter__(self) -> Iterator[Any]:
        while True:
            sampler = getattr(self.iterable, "sampler", None)
            if hasattr(sampler, "set_epoch"):  # a DistributedSampler (--devices N): another order each round
                sampler.set_epoch(self.epoch)
            yield from self.iterable
            self.epoch += 1


def warmup_then_cosine(warmup: int, steps: int) -> Any:
    """litgpt's schedule as a multiplier of the peak LR: linear warmup over ``warmup`` steps, then cosine to 0."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def options(schedule: str, args: argparse.Namespace, world_size: int = 1) -> dict[str, Any]:
    """The Accumulator's arguments for one batch-size schedule (the rest is the same for every run)."""
    if schedule == "small":
        return {"scheduling": {0: 1}}
    if schedule == "large":
        return {"scheduling": {0: args.max_factor}}
    if schedule == "ramp":  # global batches in sequences; the ramp's length in tokens (unit="token")
        batch = args.micro_batch * world_size  # one micro-step on every rank
        return {
            "target_batch_size": batch * args.max_factor,
            "ramp_start_batch_size": batch,
            "ramp_increment": batch,
            "ramp_samples": args.tokens // 2,
        }
    if schedule == "seesaw":  # the factor doubles where the cosine halves the LR (lr_scaling gives back its share)
        return {"seesaw": True, "seesaw_max_factor": args.max_factor}
    return {
        "noise_scale": True,
        "noise_scale_interval": args.noise_scale_interval,
        "adaptive": True,
        "adaptive_max_factor": args.max_factor,
    }


def train(
    fabric: Fabric, schedule: str, seed: int, data: tuple[ByteWindows, ByteWindows], args: argparse.Namespace
) -> dict[str, Any]:
    """One run of litgpt's loop through the Accumulator: its optimizer steps, held-out loss and wall time."""
    torch.manual_seed(seed)
    model = ByteLM(context=args.context, width=args.width, layers=args.layers, heads=args.heads)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    if fabric.world_size == 1:  # the same micro-batches in the same order for every schedule
        order = torch.Generator().manual_seed(seed)
        loader = DataLoader(data[0], batch_size=args.micro_batch, shuffle=True, generator=order, drop_last=True)
    else:  # each rank its own shard, in an order set by the seed
        shard = DistributedSampler(
            data[0], fabric.world_size, fabric.global_rank, shuffle=True, seed=seed, drop_last=True
        )
        loader = DataLoader(data[0], batch_size=args.micro_batch, sampler=shard, drop_last=True)
    lr_steps = 1000  # the schedule's resolution: SampleDrivenLR places it by the tokens consumed
    lr = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_then_cosine(lr_steps // 20, lr_steps))
    accumulator = Accumulator(
        fabric,
        model,
        optimizer,
        unit="token",
        normalize_by="token",
        count_items=lambda batch: batch[1].numel(),  # every target byte bears loss
        micro_batch_size=args.micro_batch,  # litgpt's micro_batch_size: an endless iterator has no batch_size
        lr_scheduler=SampleDrivenLR(lr, steps=lr_steps, total=args.tokens, unit="token"),
        lr_scaling=args.lr_scaling,  # from the batch of one micro-step on every rank, the small run's
        base_batch_size=args.micro_batch * fabric.world_size,
        beta2_follows_batch=args.beta2_follows_batch,  # AdamW's beta2 half-life kept in tokens as the batch grows
        log_metrics=False,
        **options(schedule, args, fabric.world_size),
    )
    start = time.perf_counter()
    for batch in accumulator.batches(CycleIterator(loader), max_tokens=args.tokens):
        inputs, targets = batch
        with accumulator.micro_step(batch) as micro:
            logits = model(inputs)
            micro.backward(F.cross_entropy(logits.flatten(0, 1), targets.flatten()))
        if micro.should_step:
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            optimizer.zero_grad()
    seconds = time.perf_counter() - start
    factor = accumulator.factor
    accumulator.close()
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():  # every rank evaluates its identical weights on the whole held-out tenth
        for inputs, targets in DataLoader(data[1], batch_size=64):
            total += float(F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(), reduction="sum"))
            count += targets.numel()
    return {"steps": accumulator.optimizer_steps, "loss": total / count, "seconds": seconds, "factor": factor}


def summary(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each schedule's means over the seeds; steps and loss also as ratios to ``small`` of the same seed."""
    small = {r["seed"]: r for r in results if r["schedule"] == "small"}
    rows = []
    for schedule in dict.fromkeys(r["schedule"] for r in results):
        runs = [r for r in results if r["schedule"] == schedule]
        loss_ratios = [r["loss"] / small[r["seed"]]["loss"] for r in runs]
        rows.append(
            {
                "schedule": schedule,
                "steps": statistics.mean(r["steps"] for r in runs),
                "steps_ratio": statistics.mean(r["steps"] / small[r["seed"]]["steps"] for r in runs),
                "loss": statistics.mean(r["loss"] for r in runs),
                "loss_ratio": statistics.mean(loss_ratios),
                "loss_ratio_se": statistics.stdev(loss_ratios) / len(runs) ** 0.5 if len(runs) > 1 else 0.0,
                "seconds": statistics.mean(r["seconds"] for r in runs),
                "final_factors": [r["factor"] for r in runs],
            }
        )
    return rows


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--schedules",
        nargs="+",
        choices=SCHEDULES,
        default=list(SCHEDULES),
        help="the batch-size schedules to run, each against small (which always runs)",
    )
    parser.add_argument(
        "--data", type=Path, default=None, help="train on this text or bytes file (last tenth held out)"
    )
    parser.add_argument("--tokens", type=int, default=1_000_000, help="the token budget of every run")
    parser.add_argument("--corpus-bytes", type=int, default=2_000_000, dest="corpus_bytes")
    parser.add_argument("--context", type=int, default=64, help="bytes per sequence")
    parser.add_argument("--micro-batch", type=int, default=8, dest="micro_batch", help="sequences per micro-batch")
    parser.add_argument("--max-factor", type=int, default=8, dest="max_factor", help="the large batch's factor")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument(
        "--noise-scale-interval",
        type=int,
        default=10,
        dest="noise_scale_interval",
        help="adaptive: measure every N-th window (10: the default; examples/configs/lm_adaptive.yaml measures 2)",
    )
    parser.add_argument(
        "--lr", type=float, default=8e-3, help="AdamW's peak learning rate at one micro-batch (the small run's best)"
    )
    parser.add_argument(
        "--lr-scaling",
        choices=["none", "sqrt", "linear"],
        default="linear",
        dest="lr_scaling",
        help="the LR of a larger batch: the same, or times its size over one micro-batch's (or its square root)",
    )
    parser.add_argument(
        "--beta2-follows-batch",
        action="store_true",
        dest="beta2_follows_batch",
        help="AdamW's beta2 ** (batch / one micro-batch's) in each update: its half-life kept in tokens",
    )
    parser.add_argument(
        "--devices", type=int, default=1, help="CPU processes (DDP over gloo); --micro-batch is per process"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write every run and the summary here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse(argv)
    strategy = "ddp" if args.devices > 1 else "auto"
    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy=strategy)
    fabric.launch()  # with --devices N, the script runs once per process from here on
    torch.set_num_threads(max(1, min(2, torch.get_num_threads()) // args.devices))
    corpus = read_corpus(args.corpus_bytes) if args.data is None else read_file(args.data, args.corpus_bytes)
    split = int(len(corpus) * 0.9)
    data = (ByteWindows(corpus[:split], args.context), ByteWindows(corpus[split:], args.context))
    on = f" on each of {args.devices} processes" if args.devices > 1 else ""
    fabric.print(f"{args.tokens:,} tokens a run; micro-batches of {args.micro_batch} x {args.context} bytes{on}")
    fabric.print("| seed | schedule | optimizer steps | held-out loss | wall time (s) | final factor |")
    fabric.print("| ---: | --- | ---: | ---: | ---: | ---: |")
    results = []
    schedules = ["small", *(schedule for schedule in args.schedules if schedule != "small")]
    for seed in args.seeds:
        for schedule in schedules:
            result = {"seed": seed, "schedule": schedule, **train(fabric, schedule, seed, data, args)}
            results.append(result)
            fabric.print(
                f"| {seed} | {schedule} | {result['steps']} | {result['loss']:.4f} | {result['seconds']:.1f} |"
                f" {result['factor']} |",
                flush=True,
            )
    rows = summary(results)
    fabric.print(f"\nmeans over {len(args.seeds)} seeds; steps and held-out loss also over small's, seed by seed")
    fabric.print(
        "| schedule | optimizer steps | steps / small | held-out loss | loss / small (+- s.e.) | wall time (s) |"
    )
    fabric.print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        fabric.print(
            f"| {row['schedule']} | {row['steps']:.0f} | {row['steps_ratio']:.2f} | {row['loss']:.4f} |"
            f" {row['loss_ratio']:.4f} +- {row['loss_ratio_se']:.4f} | {row['seconds']:.1f} |"
        )
    if args.json is not None and fabric.is_global_zero:
        options = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
        args.json.write_text(json.dumps({"args": options, "runs": results, "rows": rows}))
    return rows


if __name__ == "__main__":
    main()
