"""The CUDA memory of an exact big-batch step of a contrastive loss: a true big batch against ``cached`` chunks.

    python benchmarks/gpu/coupled_memory.py --out DIR [--dry]

The dual encoder of ``benchmarks/coupled.py`` (InfoNCE with in-batch negatives and a learnable temperature) at GPU
sizes: two towers Linear(512, 4096) -> GELU -> Dropout(0.1) -> Linear(4096, 4096) -> LayerNorm -> Linear(4096, 256),
float32 (PyTorch's default: no TF32 for matmuls), batches of 4096 and 16384 rows, each as one big batch and through
``cached`` in chunks of 512 and 4096 rows (those under the batch). One step: gradients set to None, both towers
forward, the loss, backward (about 5 TFLOP at 16384 rows through ``cached``: a tenth of a second). Measured:

- memory: ``max_memory_allocated`` over one step above what was allocated before it (the model, its inputs), and the
  same for the loss alone on embeddings given (its floor: the batch x batch logits, about 1 GiB each at 16384 rows);
- exactness: dropout off, one SGD step (lr 0.1) from the same weights, cached against the big batch;
- time: a warm-up round, then up to 5 rounds with each configuration once per round in rotated order, until the
  budget; ms/step the median, ratios to the big batch of the same rows taken round by round.

Checks: at every batch, cached needs less memory than the big batch; at a fixed chunk, a cached step's memory above
the loss alone grows with the batch by less than a tenth of what the big batch's does; every cached step's weights are
within 1e-6 of the big batch's. Without CUDA (``--dry`` on a CPU) the sizes are tiny (batches of 16 and 32 rows, chunks
of 4, one timed round), and the bytes autograd saves for backward (at most at once, ``coupled.SavedBytes``) stand in
for the CUDA memory.
"""

from __future__ import annotations

import functools
import statistics
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # harness; common and coupled (benchmarks/coupled.py)
from common import ratio, rotated_rounds  # noqa: E402
from coupled import (  # noqa: E402
    QUICK,
    DualEncoder,
    SavedBytes,
    configurations,
    cuda_peak,
    deviation,
    info_nce,
    make_batch,
    step,
    synchronized_seconds,
    trained,
)
from harness import MIB, Report, arguments, device, quiet, release  # noqa: E402

SIZES: dict[str, Any] = {
    "in_features": 512,
    "width": 4096,
    "out_features": 256,
    "batches": [4096, 16384],
    "chunks": [512, 4096],
}
DRY: dict[str, Any] = {**QUICK, "chunks": [4]}  # the fewest configurations every check needs
ROUNDS, EXACT = 5, 1e-6


def memory(run: Callable[[], Any], held_anyway: Iterable[torch.Tensor]) -> int:
    """Bytes ``run()`` needs: the CUDA peak above what was allocated before; without CUDA, the saved bytes' peak."""
    if torch.cuda.is_available():
        return cuda_peak(run)
    saved = SavedBytes(held_anyway)
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        run()
    return saved.total_peak


def loss_alone(rows: int, out_features: int, on: torch.device) -> int:
    """The memory of the loss and its backward on embeddings given: what any exact step of this batch needs."""
    generator = torch.Generator().manual_seed(2)
    queries, documents = (
        torch.randn(rows, out_features, generator=generator).to(on).requires_grad_() for _ in range(2)
    )
    log_scale = nn.Parameter(torch.tensor(2.0, device=on))
    return memory(lambda: info_nce(queries, documents, log_scale).backward(), [queries, documents, log_scale])


def main(argv: Sequence[str] | None = None) -> None:
    args = arguments(argv, __doc__.split("\n")[0])
    quiet()
    cuda, on = torch.cuda.is_available(), device()
    if not cuda:
        torch.set_num_threads(1)  # tiny operators on shared cores: more threads only wait for one another
    sizes = DRY if args.dry else SIZES
    shape = (sizes["in_features"], sizes["width"], sizes["out_features"])
    unit, per_unit = ("MiB", MIB) if cuda else ("KiB", 2**10)
    what = "CUDA peak above the start" if cuda else "no CUDA: peak bytes saved for backward"
    report = Report(
        args.out,
        "coupled_memory",
        "Memory of an exact big-batch contrastive step: `cached` against a true big batch",
        f"Dual encoder, towers Linear({shape[0]}, {shape[1]}) -> GELU -> Dropout(0.1) -> Linear({shape[1]},"
        f" {shape[1]}) -> LayerNorm -> Linear({shape[1]}, {shape[2]}), InfoNCE with in-batch negatives, float32;"
        f" one step (forward, loss, backward). Memory: {what}.",
    )
    report.table(
        "memory",
        ["batch", "run", f"step ({unit})", f"loss alone ({unit})", "max abs weight difference"],
        "Memory of one step, and the weights after one SGD step (dropout off) against the big batch's.",
    )
    model, exact_model = DualEncoder(*shape).to(on), DualEncoder(*shape, dropout=0.0).to(on)
    configs = configurations(sizes["batches"], sizes["chunks"])
    batches = {rows: make_batch(rows, sizes["in_features"], on) for rows in sizes["batches"]}
    floors = {rows: loss_alone(rows, sizes["out_features"], on) for rows in batches}
    references = {rows: trained(exact_model, batches[rows], None) for rows in batches}
    found: dict[str, int] = {}
    for name, (rows, chunk) in configs.items():
        difference = deviation(trained(exact_model, batches[rows], chunk), references[rows]) if chunk else 0.0
        release()
        model.zero_grad(set_to_none=True)
        run = functools.partial(step, model, batches[rows], chunk)
        found[name] = memory(run, [*model.parameters(), *batches[rows]])
        cells = [str(rows), f"cached, chunk {chunk}" if chunk else "big batch", f"{found[name] / per_unit:.1f}"]
        cells += [f"{floors[rows] / per_unit:.1f}", f"{difference:.1e}" if chunk else "reference"]
        report.row("memory", cells, batch=rows, chunk=chunk, bytes=found[name], loss_alone=floors[rows])
        if chunk:
            report.check(
                f"weights, batch {rows}, chunk {chunk}",
                f"<= {EXACT:g} from the big batch's",
                f"{difference:.1e}",
                difference <= EXACT,
            )
    model.zero_grad(set_to_none=True)
    memory_checks(report, configs, found, floors, per_unit, unit)
    timing(report, model, batches, configs, 1 if args.dry else ROUNDS, args.deadline)
    report.finish()


def memory_checks(
    report: Report,
    configs: dict[str, tuple[int, int | None]],
    found: dict[str, int],
    floors: dict[int, int],
    per_unit: int,
    unit: str,
) -> None:
    """Cached below the big batch at every batch; at a fixed chunk, its memory over the loss set by the chunk."""
    big = {rows: found[name] for name, (rows, chunk) in configs.items() if chunk is None}
    for name, (rows, chunk) in configs.items():
        if chunk is not None:
            report.check(
                f"memory, batch {rows}, chunk {chunk}",
                f"< the big batch's {big[rows] / per_unit:.1f} {unit}",
                f"{found[name] / per_unit:.1f} {unit}",
                found[name] < big[rows],
            )
    smallest, largest = min(big), max(big)
    big_growth = (big[largest] - floors[largest]) - (big[smallest] - floors[smallest])
    for chunk in sorted({chunk for rows, chunk in configs.values() if chunk is not None and chunk < smallest}):
        growth = (found[f"{largest} cached {chunk}"] - floors[largest]) - (
            found[f"{smallest} cached {chunk}"] - floors[smallest]
        )
        report.check(
            f"memory over the loss alone, chunk {chunk}, batch {smallest} to {largest}",
            f"grows by < a tenth of the big batch's {big_growth / per_unit:.1f} {unit}",
            f"{growth / per_unit:.1f} {unit}",
            growth < big_growth / 10,
        )


def timing(
    report: Report,
    model: DualEncoder,
    batches: dict[int, tuple[torch.Tensor, torch.Tensor]],
    configs: dict[str, tuple[int, int | None]],
    rounds: int,
    deadline: float,
) -> None:
    """Time per step in rotated rounds until the deadline; the ratio to the big batch of the same rows."""
    report.table(
        "time",
        ["batch", "run", "ms/step", "ratio to big batch (median)", "range", "rounds"],
        "Time per step: a warm-up round, then rotated rounds; ratios taken round by round.",
    )

    def seconds(name: str) -> float:
        rows, chunk = configs[name]
        return synchronized_seconds(lambda: step(model, batches[rows], chunk))

    names = list(configs)
    rotated_rounds(seconds, names, 1)
    times = rotated_rounds(seconds, names, rounds, deadline)
    for name, (rows, chunk) in configs.items():
        versus = ratio(times, name, f"{rows} big batch")
        cells = [str(rows), f"cached, chunk {chunk}" if chunk else "big batch"]
        cells += [f"{statistics.median(times[name]) * 1e3:.1f}", f"{versus['median']:.2f}"]
        cells += [f"{versus['min']:.2f} to {versus['max']:.2f}", str(len(times[name]))]
        report.row("time", cells, batch=rows, chunk=chunk, seconds=times[name], ratio=versus)


if __name__ == "__main__":
    main()
