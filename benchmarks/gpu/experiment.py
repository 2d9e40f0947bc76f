"""The classic accumulation experiment on the device, with GPT-2 small: memory, time per sample and loss.

    python benchmarks/gpu/experiment.py --out DIR [--dry]

GPT-2 small (124M parameters, built from its config with random weights: nothing is downloaded) on byte sequences of
1024 tokens from the Python standard library's sources, AdamW. A fixed micro-batch of 8 sequences accumulated k times
(``AccumulationScheduler({0: k})``) against one batch of 8k with stock Lightning, k = 1, 2, 4, 8, 16, in fp32 (TF32
matmuls, ``torch.set_float32_matmul_precision("high")``, as Lightning advises on tensor-core GPUs) and in
``bf16-mixed``. Each run takes 3 optimizer steps on the same sequences in the same order; the time per sample is
measured over steps 2 and 3 (``torch.cuda.synchronize()`` at both ends), the peak is
``torch.cuda.max_memory_allocated`` over the whole fit (with what was allocated before it beside it), and the final
loss is the model's loss on 8 held-out sequences. A big batch that does not fit says so: its out-of-memory error is
the result, and the larger big batches of the same precision are not tried. The accumulated runs of both precisions
run first, the big batches after.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parents[1] / "examples")]  # harness, common, byte_lm
import lightning.pytorch as pl  # noqa: E402
from harness import MIB, Clock, Report, arguments, byte_tokens, device, gpt2, quiet, release, trainer  # noqa: E402

from lightning_accum import AccumulationScheduler  # noqa: E402
from lightning_accum.core.split import is_out_of_memory  # noqa: E402

STEPS = 3  # the first is not timed (kernel selection, allocator warm-up)
HELD_OUT = 8
PRECISIONS = ("32-true", "bf16-mixed")
SHOWN = {"32-true": "fp32 (TF32)", "bf16-mixed": "bf16-mixed"}


class LanguageModel(pl.LightningModule):
    def __init__(self, dry: bool) -> None:
        super().__init__()
        with torch.device(device()):  # initialised where it trains: seconds saved per run for GPT-2 small
            self.model = gpt2(dry)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        return self.model(input_ids=tokens, labels=tokens).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-4)


def run(
    tokens: torch.Tensor, held_out: torch.Tensor, micro: int, factor: int, accumulate: bool, precision: str, dry: bool
) -> dict[str, Any]:
    """Train one configuration; its peak memory, time per sample and final loss, or its out-of-memory error."""
    batch = micro if accumulate else micro * factor
    clock = Clock(first_timed_batch=factor if accumulate else 1)
    callbacks: list[pl.Callback] = [clock]
    if accumulate:
        callbacks.insert(0, AccumulationScheduler({0: factor}, log_metrics=False))
    loader = DataLoader(TensorDataset(tokens[: STEPS * micro * factor]), batch_size=batch)
    release()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    result: dict[str, Any] = {"allocated_before_mib": before / MIB}
    module: LanguageModel | None = None
    fit: pl.Trainer | None = None
    try:
        module = LanguageModel(dry)
        fit = trainer(max_epochs=1, precision=precision, callbacks=callbacks)
        fit.fit(module, loader)
        result["outcome"] = "ok"
    except (torch.OutOfMemoryError, RuntimeError) as error:  # near a full device also "CUDA error: out of memory"
        if not is_out_of_memory(error):
            raise
        result["outcome"] = "out of memory"
        result["error"] = str(error).split("\n")[0][:300]
    if torch.cuda.is_available():
        result["peak_mib"] = torch.cuda.max_memory_allocated() / MIB
    if result["outcome"] == "ok":
        assert module is not None
        timed_samples = (STEPS - 1) * micro * factor
        result["ms_per_sample"] = clock.seconds / timed_samples * 1e3
        result["samples_per_second"] = timed_samples / clock.seconds
        result["final_loss"] = evaluate(module, held_out, precision)
    del module, fit, callbacks
    release()
    return result


def evaluate(module: LanguageModel, held_out: torch.Tensor, precision: str) -> float:
    model = module.model.to(device()).eval()
    autocast = torch.autocast(device().type, dtype=torch.bfloat16) if precision == "bf16-mixed" else None
    with torch.no_grad(), autocast or contextlib.nullcontext():
        tokens = held_out.to(device())
        return float(model(input_ids=tokens, labels=tokens).loss)


def main(argv: Sequence[str] | None = None) -> None:
    args = arguments(argv, __doc__.split("\n")[0])
    quiet()
    micro, length = (2, 32) if args.dry else (8, 1024)
    factors = (1, 2, 4) if args.dry else (1, 2, 4, 8, 16)
    report = Report(
        args.out,
        "experiment",
        "The accumulation experiment: GPT-2 small, micro-batch x factor against one big batch",
        f"GPT-2 small from its config (random init), sequences of {length} tokens, AdamW, {STEPS} optimizer steps on"
        f" the same sequences per run; micro-batch {micro} accumulated k times (`AccumulationScheduler`) against one"
        " batch of the same size with stock Lightning. Peak: `torch.cuda.max_memory_allocated` over the fit (before:"
        " allocated when it started); time per sample over steps 2 and 3; final loss on 8 held-out sequences. fp32 uses"
        " TF32 matmuls.",
    )
    report.table(
        "runs",
        ["precision", "k", "batch", "run", "before (GiB)", "peak (GiB)", "ms/sample", "samples/s", "final loss"],
    )
    tokens = byte_tokens(STEPS * micro * max(factors) + HELD_OUT, length)
    tokens, held_out = tokens[:-HELD_OUT], tokens[-HELD_OUT:]
    torch.set_float32_matmul_precision("high")
    # every accumulated run first, the big batches (which may run out of memory) after: an error that takes the
    # process down near a full device costs the rows that come after it, never the accumulated ones
    plan = [(p, k, True) for p in PRECISIONS for k in factors] + [
        (p, k, False) for p in PRECISIONS for k in factors[1:]
    ]
    too_big: dict[str, int] = {}  # per precision, the smallest big batch that did not fit
    longest = 0.0
    for precision, factor, accumulate in plan:
        batch = micro * factor
        name = f"{micro} x {factor} accumulated" if accumulate else f"one batch of {batch}"
        cells = [SHOWN[precision], str(factor), str(batch), name]
        keys = {"precision": precision, "factor": factor, "accumulate": accumulate}
        if not accumulate and precision in too_big:
            report.row(
                "runs",
                [*cells, "-", "-", "-", "-", f"not tried: {too_big[precision]} did not fit"],
                outcome="not tried",
                **keys,
            )
            continue
        if time.monotonic() + 1.5 * longest > args.deadline:
            report.row("runs", [*cells, "-", "-", "-", "-", "not run: out of time"], outcome="out of time", **keys)
            continue
        started = time.monotonic()
        result = run(tokens, held_out, micro, factor, accumulate, precision, args.dry)
        longest = max(longest, time.monotonic() - started)
        before = f"{result['allocated_before_mib'] / 1024:.2f}"
        peak = f"{result['peak_mib'] / 1024:.2f}" if "peak_mib" in result else "-"
        if result["outcome"] == "ok":
            numbers = [
                f"{result['ms_per_sample']:.2f}",
                f"{result['samples_per_second']:.1f}",
                f"{result['final_loss']:.4f}",
            ]
        else:
            too_big[precision] = min(too_big.get(precision, batch), batch)
            numbers = ["-", "-", f"out of memory ({peak} GiB when it failed)"]
            peak = "-"
        report.row("runs", [*cells, before, peak, *numbers], **keys, **result)
    report.reorder("runs", lambda row: (PRECISIONS.index(row["precision"]), row["factor"], not row["accumulate"]))
    torch.set_float32_matmul_precision("highest")
    summarize(report)
    report.finish()


def summarize(report: Report) -> None:
    """One note per precision: the peaks of accumulation and of the largest big batch that fit, and the loss gap."""
    rows = [row for row in report.tables["runs"]["rows"] if row.get("outcome") == "ok"]
    for precision in PRECISIONS:
        accumulated = [row for row in rows if row["precision"] == precision and row["accumulate"]]
        big = {row["factor"]: row for row in rows if row["precision"] == precision and not row["accumulate"]}
        if not accumulated:
            continue
        phrases = []
        if "peak_mib" in accumulated[0]:
            low, high = accumulated[0], accumulated[-1]
            phrases.append(
                f"accumulation peaked at {low['peak_mib'] / 1024:.2f} GiB at factor {low['factor']} and"
                f" {high['peak_mib'] / 1024:.2f} GiB at factor {high['factor']}"
            )
            if big:
                largest = big[max(big)]
                phrases.append(
                    f"the largest big batch that fit, {largest['factor']} micro-batches' worth, peaked at"
                    f" {largest['peak_mib'] / 1024:.2f} GiB"
                )
        gaps = [
            abs(row["final_loss"] - big[row["factor"]]["final_loss"]) for row in accumulated if row["factor"] in big
        ]
        if gaps:
            phrases.append(f"where both ran, the final losses of the two ways differ by at most {max(gaps):.1e}")
        report.note(f"{SHOWN[precision]}: {'; '.join(phrases)}.")


if __name__ == "__main__":
    main()
