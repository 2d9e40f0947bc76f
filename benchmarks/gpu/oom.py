"""A real out-of-memory error meeting ``micro_batch_size="auto"``: where it settles, the weights, the memory after.

    python benchmarks/gpu/oom.py --out DIR [--dry]

A wide MLP (Linear(1024, 8192), GELU, Linear(8192, 1024); fp32, TF32 off) trains 4 loader batches of 16384 rows at
factor 2 with ``micro_batch_size="auto"``, under ``torch.cuda.set_per_process_memory_fraction``: the cap is sized
from a probe of the activation memory per row so that micro-batches of 4096 rows fit with room to spare and 8192 do
not. The callback starts at the loader batch, meets the caching allocator's real ``torch.OutOfMemoryError``, halves
and settles. Checked: where it settles, the weights against a plain-PyTorch big-batch step per window (no cap), and
the allocated memory at the end of every loader batch against a run with the settled size fixed from the start (no
cap, no error): after the recovery the error must have left nothing behind. Without CUDA (``--dry`` on a CPU) the
module raises ``torch.OutOfMemoryError`` itself above 4096 rows, so that everything but the cap is exercised.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # harness, common
import lightning.pytorch as pl  # noqa: E402
from harness import MIB, Report, arguments, device, max_deviation, quiet, release, trainer  # noqa: E402

from lightning_accum import AccumulationScheduler  # noqa: E402

FACTOR, LR, EXACT = 2, 0.01, 1e-6


class Wide(pl.LightningModule):
    def __init__(self, width: int, hidden: int, simulate_above: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))
        self.simulate_above = simulate_above

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.simulate_above is not None and len(x) > self.simulate_above:
            raise torch.OutOfMemoryError(f"out of memory (simulated for {len(x)} rows: no CUDA)")
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


class Allocated(pl.Callback):
    """CUDA memory allocated at the end of every loader batch."""

    def __init__(self) -> None:
        self.after_batch: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *_: Any) -> None:
        if torch.cuda.is_available():
            self.after_batch.append(torch.cuda.memory_allocated() / MIB)


def per_row_bytes(width: int, hidden: int, rows: int) -> tuple[float, float]:
    """A probe in plain PyTorch: (memory a step needs besides its rows, bytes per row), from steps of r and 2r rows."""
    peaks = []
    for count in (rows, 2 * rows):
        release()
        module = Wide(width, hidden).to(device())
        torch.cuda.reset_peak_memory_stats()
        x = torch.randn(count, width, device=device())
        nn.functional.mse_loss(module.net(x), x).backward()
        peaks.append(torch.cuda.max_memory_allocated())
        del module, x
    release()
    per_row = (peaks[1] - peaks[0]) / rows
    return peaks[0] - rows * per_row, per_row


def fit(data: TensorDataset, rows: int, width: int, hidden: int, size: int | str, simulate: int | None) -> dict:
    module = Wide(width, hidden, simulate)
    accumulation = AccumulationScheduler({0: FACTOR}, micro_batch_size=size, log_metrics=False)
    allocated = Allocated()
    oom_before = torch.cuda.memory_stats().get("num_ooms", 0) if torch.cuda.is_available() else 0
    trainer(max_epochs=1, callbacks=[accumulation, allocated]).fit(module, DataLoader(data, batch_size=rows))
    oom_after = torch.cuda.memory_stats().get("num_ooms", 0) if torch.cuda.is_available() else 0
    state = accumulation.state_dict()
    return {
        "weights": [p.detach() for p in module.parameters()],
        "settled": state.get("micro_batch_size_found", size),
        "allocated_after_batch_mib": allocated.after_batch,
        "allocator_ooms": oom_after - oom_before,
    }


def big_batch(data: TensorDataset, rows: int, width: int, hidden: int) -> list[torch.Tensor]:
    """Plain PyTorch: one SGD step per window of ``FACTOR`` loader batches, on one forward of all their rows."""
    net = Wide(width, hidden).net.to(device())
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    x, y = (t.to(device()) for t in data.tensors)
    for start in range(0, len(x), rows * FACTOR):
        optimizer.zero_grad()
        window = slice(start, start + rows * FACTOR)
        nn.functional.mse_loss(net(x[window]), y[window]).backward()
        optimizer.step()
    return [p.detach() for p in net.parameters()]


def main(argv: Sequence[str] | None = None) -> None:
    args = arguments(argv, __doc__.split("\n")[0])
    quiet()
    cuda = torch.cuda.is_available()
    width, hidden, rows = (64, 256, 64) if args.dry else (1024, 8192, 16384)
    fits = rows // 4  # the micro-batch that should fit under the cap
    report = Report(
        args.out,
        "oom",
        'A real out-of-memory error and `micro_batch_size="auto"`',
        f"Linear({width}, {hidden}), GELU, Linear({hidden}, {width}); 4 loader batches of {rows} rows at factor"
        f' {FACTOR}, `micro_batch_size="auto"`, '
        + (
            "under `torch.cuda.set_per_process_memory_fraction` sized so that micro-batches of"
            f" {fits} rows fit and {2 * fits} do not."
            if cuda
            else f"no CUDA: the module raises `torch.OutOfMemoryError` itself above {fits} rows."
        ),
    )
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4 * rows, width, generator=generator)
    data = TensorDataset(x, torch.tanh(x) + 0.1 * torch.randn(4 * rows, width, generator=generator))
    torch.set_float32_matmul_precision("highest")
    reference = big_batch(data, rows, width, hidden)
    fraction = None
    if cuda:
        fixed_bytes, row_bytes = per_row_bytes(width, hidden, 1024)
        batch_bytes = 2 * rows * width * 4  # the loader batch (x and y) on the device
        cap = fixed_bytes + batch_bytes + 1.5 * fits * row_bytes + 64 * MIB
        fraction = cap / torch.cuda.get_device_properties(0).total_memory
        report.note(
            f"Probe: {row_bytes / 1024:.1f} KiB of activations per row, {fixed_bytes / MIB:.0f} MiB besides; cap"
            f" {cap / MIB:.0f} MiB (fraction {fraction:.5f} of the device)."
        )
        release()
        torch.cuda.set_per_process_memory_fraction(fraction)
    try:
        auto = fit(data, rows, width, hidden, "auto", None if cuda else fits)
    finally:
        if cuda:
            torch.cuda.set_per_process_memory_fraction(1.0)
    release()
    fixed = fit(data, rows, width, hidden, auto["settled"], None)
    report.table(
        "runs",
        [
            "run",
            "micro-batch",
            "allocator OOMs",
            "max abs weight deviation from the big batch",
            "allocated after each loader batch (MiB)",
        ],
    )
    for name, run in (("auto, under the cap", auto), ("settled size fixed, no cap", fixed)):
        deviation = max_deviation(run["weights"], reference)
        shown = ", ".join(f"{value:.1f}" for value in run["allocated_after_batch_mib"]) or "- (no CUDA)"
        report.row(
            "runs",
            [name, str(run["settled"]), str(run["allocator_ooms"]), f"{deviation:.1e}", shown],
            run=name,
            settled=run["settled"],
            allocator_ooms=run["allocator_ooms"],
            deviation=deviation,
            allocated_after_batch_mib=run["allocated_after_batch_mib"],
        )
    report.check("where `auto` settles", f"{fits} rows", f"{auto['settled']} rows", auto["settled"] == fits)
    deviation = max_deviation(auto["weights"], reference)
    report.check("weights against the big batch", f"<= {EXACT:g}", f"{deviation:.1e}", deviation <= EXACT)
    if cuda:
        report.check(
            "real out-of-memory errors met (allocator count)",
            "2 (whole batch, half)",
            str(auto["allocator_ooms"]),
            auto["allocator_ooms"] >= 1,
        )
        after, clean = auto["allocated_after_batch_mib"], fixed["allocated_after_batch_mib"]
        gap = max((abs(a - b) for a, b in zip(after, clean, strict=True)), default=float("inf"))
        report.check(
            "allocated after each loader batch, against the run that never ran out",
            "<= 1 MiB apart",
            f"{gap:.2f} MiB",
            len(after) == len(clean) > 0 and gap <= 1.0,
        )
    report.finish()


if __name__ == "__main__":
    main()
