"""The classic gradient-accumulation experiment: a fixed micro-batch, factors 1, 4, 8 and 16.

For each factor k the byte-level transformer of ``byte_lm.py`` trains on the same samples in the same order twice:
with micro-batches of ``b`` accumulated k at a time (``AccumulationScheduler``), and with one batch of ``b x k`` and
no accumulation. Each run is a fresh process, so its peak memory is its own. The script writes a Markdown table, a
PNG plot and the raw numbers as JSON::

    python examples/accumulation_experiment.py                  # factors 1 4 8 16, a few minutes on a laptop CPU
    python examples/accumulation_experiment.py --factors 1 2 --samples 256 --out /tmp/exp

What to expect: accumulation keeps peak memory at the micro-batch's while the big batch's grows with k; the two
reach the same final loss (they take the same optimizer steps); larger effective batches take fewer steps on the same
samples, so at a fixed sample budget and learning rate their loss is higher.

Memory is the peak allocated CUDA memory on a GPU; on CPU it is the growth of the process's peak resident memory
during ``fit`` (``ru_maxrss`` minus the resident memory just before), which includes allocator slack.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from byte_lm import ByteLM, ByteWindows, read_corpus  # noqa: E402

from lightning_accum import AccumulationScheduler  # noqa: E402
from lightning_accum.core.monitor import peak_resident_bytes, resident_bytes  # noqa: E402

_MIB = 2**20


def run_one(config: dict[str, Any]) -> dict[str, Any]:
    """Train one configuration in this process and measure it."""
    pl.seed_everything(0, verbose=False)
    micro, factor, accumulate = config["micro_batch_size"], config["factor"], config["accumulate"]
    context = config["context"]
    corpus = read_corpus(config["samples"] * (context + 1) + 64 * (context + 1) * config["val_batches"] + 1)
    split = config["samples"] * context + 1
    train = ByteWindows(corpus[:split], context)
    val = ByteWindows(corpus[split:], context)
    batch_size = micro if accumulate else micro * factor
    model = ByteLM(context=context, width=config["width"], layers=config["layers"], lr=config["lr"])
    accumulation = AccumulationScheduler(scheduling={0: factor if accumulate else 1})
    accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    trainer = pl.Trainer(
        accelerator=accelerator,
        devices=1,
        max_epochs=1,
        callbacks=[accumulation],
        logger=pl.loggers.CSVLogger(config["log_dir"], name=f"k{factor}-{'accumulate' if accumulate else 'big'}"),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    # the same shuffled order for every run: a batch of b x k holds exactly the k micro-batches of one window
    order = torch.Generator().manual_seed(0)
    loader = DataLoader(train, batch_size=batch_size, shuffle=True, generator=order, drop_last=True)
    if accelerator == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = resident_bytes()
    start = time.perf_counter()
    trainer.fit(model, loader)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() - before if accelerator == "cuda" else peak_resident_bytes() - before
    model.eval()
    with torch.no_grad():
        losses = [model.loss(batch).item() for batch in DataLoader(val, batch_size=64)]
    curve = _read_curve(Path(trainer.logger.log_dir) / "metrics.csv")
    return {
        **config,
        "device": accelerator,
        "effective_batch_size": micro * factor,
        "peak_memory_mib": peak / _MIB,
        "seconds": seconds,
        "samples_per_second": accumulation.samples_seen / seconds,
        "optimizer_steps": trainer.global_step,
        "final_val_loss": sum(losses) / len(losses),
        "curve": curve,
    }


def _read_curve(path: Path) -> list[tuple[float, float]]:
    import csv

    with path.open() as handle:
        rows = list(csv.DictReader(handle))
    return [
        (float(row["accum/samples_seen"]), float(row["accum/window_loss"]))
        for row in rows
        if row.get("accum/window_loss") and row.get("accum/samples_seen")
    ]


def run_isolated(config: dict[str, Any]) -> dict[str, Any]:
    """Run one configuration in a fresh Python process, so that its peak memory is its own."""
    done = subprocess.run(
        [sys.executable, __file__, "--run-one", json.dumps(config)], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"run {config} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def markdown_table(results: list[dict[str, Any]]) -> str:
    """The results as a Markdown table, accumulated and big-batch runs side by side."""
    lines = [
        "| factor | effective batch | run | peak memory (MiB) | time (s) | samples/s | optimizer steps"
        " | final val loss |",
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in results:
        run = (
            f"{row['micro_batch_size']} x {row['factor']} accumulated"
            if row["accumulate"]
            else (f"one batch of {row['effective_batch_size']}")
        )
        lines.append(
            f"| {row['factor']} | {row['effective_batch_size']} | {run} | {row['peak_memory_mib']:.1f} |"
            f" {row['seconds']:.1f} | {row['samples_per_second']:.0f} | {row['optimizer_steps']} |"
            f" {row['final_val_loss']:.4f} |"
        )
    return "\n".join(lines)


def summary(results: list[dict[str, Any]]) -> str:
    """Two sentences on what the table shows: memory saved, and how far apart the two ways' losses are."""
    pairs = [
        (a, b)
        for a in results
        for b in results
        if a["accumulate"] and not b["accumulate"] and a["factor"] == b["factor"] and a["factor"] > 1
    ]
    if not pairs:
        return ""
    gap = max(abs(a["final_val_loss"] - b["final_val_loss"]) for a, b in pairs)
    largest = max(pairs, key=lambda pair: pair[0]["factor"])
    accumulated, big = largest
    return (
        f"At factor {accumulated['factor']} accumulation peaks at {accumulated['peak_memory_mib']:.1f} MiB against"
        f" {big['peak_memory_mib']:.1f} MiB for one batch of {big['effective_batch_size']}; the final validation"
        f" losses of the two ways differ by at most {gap:.2e} over all factors."
    )


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Peak memory against the effective batch, and the loss curves of the accumulated runs, in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (memory, loss) = plt.subplots(1, 2, figsize=(11, 4.2))
    for accumulate, label, marker in ((True, "accumulated micro-batches", "o"), (False, "one big batch", "s")):
        rows = sorted((r for r in results if r["accumulate"] == accumulate), key=lambda r: r["effective_batch_size"])
        memory.plot(
            [r["effective_batch_size"] for r in rows], [r["peak_memory_mib"] for r in rows], marker=marker, label=label
        )
    memory.set_xscale("log", base=2)
    memory.set_xlabel("effective batch (samples)")
    memory.set_ylabel(f"peak memory (MiB, {results[0]['device']})")
    memory.set_title("Memory: accumulation stays at the micro-batch's")
    memory.legend()
    for row in sorted((r for r in results if r["accumulate"]), key=lambda r: r["factor"]):
        if row["curve"]:
            samples, losses = zip(*row["curve"], strict=False)
            loss.plot(samples, losses, label=f"factor {row['factor']} (batch {row['effective_batch_size']})")
    loss.set_xlabel("samples seen")
    loss.set_ylabel("training loss over the window")
    loss.set_title("Loss at a fixed sample budget")
    loss.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--factors", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--micro_batch_size", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4096, help="training samples, the same for every run")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--val_batches", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("accumulation_experiment"))
    parser.add_argument("--run-one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run_one:
        print(json.dumps(run_one(json.loads(args.run_one))))
        return []
    for factor in args.factors:
        if args.samples % (args.micro_batch_size * factor):
            parser.error(f"--samples {args.samples} must be a multiple of micro_batch_size x factor for every factor")
    args.out.mkdir(parents=True, exist_ok=True)
    base = {
        "micro_batch_size": args.micro_batch_size,
        "samples": args.samples,
        "context": args.context,
        "width": args.width,
        "layers": args.layers,
        "lr": args.lr,
        "val_batches": args.val_batches,
        "log_dir": str(args.out / "logs"),
    }
    results = []
    for factor in args.factors:
        for accumulate in (True, False) if factor > 1 else (True,):
            result = run_isolated({**base, "factor": factor, "accumulate": accumulate})
            print(
                f"factor {factor:>3} {'accumulated' if accumulate else 'big batch  '}:"
                f" {result['peak_memory_mib']:8.1f} MiB  {result['seconds']:6.1f} s"
                f"  val loss {result['final_val_loss']:.4f}",
                flush=True,
            )
            results.append(result)
    table = markdown_table(results)
    device = results[0]["device"]
    text = (
        f"# Accumulation experiment\n\nMicro-batch {args.micro_batch_size}, {args.samples} training samples of"
        f" {args.context} bytes, on {device}; `python examples/accumulation_experiment.py"
        f" {' '.join(argv if argv is not None else sys.argv[1:])}`.\n\n{table}\n\n{summary(results)}\n"
    )
    (args.out / "results.md").write_text(text)
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    plot(results, args.out / "results.png")
    print(f"\n{table}\n\n{summary(results)}\nwrote {args.out / 'results.md'}, results.png and results.json")
    return results


if __name__ == "__main__":
    main()
