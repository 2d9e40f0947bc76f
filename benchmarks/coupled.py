"""A coupled loss's exact big-batch gradient through ``cached``: its time and memory against a true big batch.

    python benchmarks/coupled.py                   # one table; writes coupled.json and coupled.md under --out
    python benchmarks/coupled.py --quick           # tiny sizes, a few seconds (what the test runs)

One training step of a dual encoder: two towers, each Linear(256, 1024) -> GELU -> Dropout(0.1) -> Linear(1024, 1024)
-> LayerNorm -> Linear(1024, 128), and InfoNCE with in-batch negatives and a learnable temperature (gradients set to
None, both towers forward, the loss, backward; no optimizer step). Computed (a) as one true big batch in plain
PyTorch, (b) with each tower through :func:`lightning_accum.coupled.cached` in chunks of 8, 32 and 128 rows (those
smaller than the batch), at batches of 64, 256 and 1024 rows.

- Time: a warm-up round, then every configuration once per round in an order rotated every round
  (``common.rotated_rounds``); ms/step is the median over the rounds, the ratio is taken round by round against the
  big batch of the same rows, its median reported with its range.
- Saved: the bytes autograd saves for backward, seen through ``torch.autograd.graph.saved_tensors_hooks``, each
  storage counted once, and storages the caller holds anyway (the parameters, the input batch) not counted.
  *towers*: held after both towers' forward; *loss*: what the loss adds (its floor is the batch x batch logits);
  *backward*: the most held at once of what the backward saves (``cached`` replays one chunk of one tower at a
  time); *peak*: the most held at once over the step.
- CUDA peak: ``torch.cuda.max_memory_allocated`` over one step, above what was allocated before it (CUDA only).
- Exactness: dropout off, float32 (TF32 off), one SGD step (lr 0.1) from the same weights: the largest absolute
  difference between the weights after a cached step and after the big batch's.

On a CPU, torch runs on one thread unless ``--threads`` says otherwise: on cores that other work shares, every
operator's threads wait at its end for the slowest one, and a step of many small chunks has many operators, so that
more threads would measure the machine's load more than ``cached``.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import device, ratio, rotated_rounds  # noqa: E402

from lightning_accum.coupled import cached  # noqa: E402

MIB = 2**20
LR = 0.1
DEFAULT: dict[str, Any] = {
    "in_features": 256,
    "width": 1024,
    "out_features": 128,
    "batches": [64, 256, 1024],
    "chunks": [8, 32, 128],
}
QUICK: dict[str, Any] = {"in_features": 16, "width": 32, "out_features": 8, "batches": [16, 32], "chunks": [4, 8]}

Batch = tuple[torch.Tensor, torch.Tensor]


def tower(in_features: int, width: int, out_features: int, dropout: float) -> nn.Module:
    return nn.Sequential(
        nn.Linear(in_features, width),
        nn.GELU(),
        nn.Dropout(dropout),
        nn.Linear(width, width),
        nn.LayerNorm(width),
        nn.Linear(width, out_features),
    )


class DualEncoder(nn.Module):
    """A query tower, a document tower, and the log of the InfoNCE temperature's inverse."""

    def __init__(self, in_features: int, width: int, out_features: int, dropout: float = 0.1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.query = tower(in_features, width, out_features, dropout)
        self.document = tower(in_features, width, out_features, dropout)
        self.log_scale = nn.Parameter(torch.tensor(2.0))


def info_nce(queries: torch.Tensor, documents: torch.Tensor, log_scale: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each query against every document of the batch, its own the positive."""
    logits = queries @ documents.T * log_scale.exp()
    return nn.functional.cross_entropy(logits, torch.arange(len(queries), device=logits.device))


def make_batch(rows: int, in_features: int, on: torch.device | str = "cpu") -> Batch:
    generator = torch.Generator().manual_seed(1)
    queries, documents = (torch.randn(rows, in_features, generator=generator) for _ in range(2))
    return queries.to(on), documents.to(on)


def step(
    model: DualEncoder, batch: Batch, chunk: int | None, phase: Callable[[str], None] = lambda _: None
) -> torch.Tensor:
    """One step's gradients: the big batch (``chunk`` None) or each tower through ``cached``.

    ``phase(name)`` is called as each part of the step begins: ``towers``, ``loss``, ``backward``.
    """
    model.zero_grad(set_to_none=True)
    queries, documents = batch
    phase("towers")
    if chunk is None:
        embedded = model.query(queries), model.document(documents)
    else:
        embedded = cached(model.query, queries, chunk_size=chunk), cached(model.document, documents, chunk_size=chunk)
    phase("loss")
    loss = info_nce(*embedded, model.log_scale)
    phase("backward")
    loss.backward()
    return loss.detach()


class SavedBytes:
    """Bytes of the storages autograd holds for backward, by the phase in which each was first saved.

    Each storage counts once however many saved tensors view it, from the first save to the release of the last,
    and storages of ``held_anyway`` (parameters, inputs) not at all. Use as ``saved_tensors_hooks(saved.pack,
    saved.unpack)``; ``phase`` names the part of the step that the next saves belong to.
    """

    def __init__(self, held_anyway: Iterable[torch.Tensor]) -> None:
        self.excluded = {t.untyped_storage().data_ptr() for t in held_anyway}
        self.current = "towers"
        self.storages: dict[int, tuple[str, int, int]] = {}  # pointer: (phase, bytes, saved tensors viewing it)
        self.live: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.total_peak = 0

    def phase(self, name: str) -> None:
        self.current = name

    def pack(self, tensor: torch.Tensor) -> _Saved:
        pointer = tensor.untyped_storage().data_ptr()
        if pointer == 0 or pointer in self.excluded:
            return _Saved(tensor, None, self)
        phase, size, views = self.storages.get(pointer, (self.current, tensor.untyped_storage().nbytes(), 0))
        self.storages[pointer] = (phase, size, views + 1)
        if views == 0:
            self.live[phase] = self.live.get(phase, 0) + size
            self.peak[phase] = max(self.peak.get(phase, 0), self.live[phase])
            self.total_peak = max(self.total_peak, sum(self.live.values()))
        return _Saved(tensor, pointer, self)

    @staticmethod
    def unpack(saved: _Saved) -> torch.Tensor:
        return saved.tensor

    def release(self, pointer: int) -> None:
        phase, size, views = self.storages[pointer]
        if views > 1:
            self.storages[pointer] = (phase, size, views - 1)
            return
        del self.storages[pointer]
        self.live[phase] -= size


class _Saved:
    """One saved tensor; autograd drops it when it frees the graph node that saved it."""

    def __init__(self, tensor: torch.Tensor, pointer: int | None, owner: SavedBytes) -> None:
        self.tensor, self.pointer, self.owner = tensor, pointer, owner

    def __del__(self) -> None:
        if self.pointer is not None:
            self.owner.release(self.pointer)


def saved_bytes(model: DualEncoder, batch: Batch, chunk: int | None) -> dict[str, int]:
    """The bytes one step saves for backward: ``towers``, ``loss``, ``backward``, ``peak`` (see the top)."""
    saved = SavedBytes([*model.parameters(), *batch])
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        step(model, batch, chunk, saved.phase)
    return {
        "towers": saved.peak.get("towers", 0),
        "loss": saved.peak.get("loss", 0),
        "backward": saved.peak.get("backward", 0),
        "peak": saved.total_peak,
    }


def cuda_peak(run: Callable[[], Any]) -> int:
    """Bytes ``torch.cuda.max_memory_allocated`` rose above what was allocated before ``run()``."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def step_peak(model: DualEncoder, batch: Batch, chunk: int | None) -> int:
    """The CUDA peak of one step, with the previous step's gradients freed first."""
    model.zero_grad(set_to_none=True)
    return cuda_peak(lambda: step(model, batch, chunk))


@contextmanager
def full_float32() -> Iterator[None]:
    """TF32 off for matmuls and convolutions: float32 as written."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def trained(model: DualEncoder, batch: Batch, chunk: int | None) -> list[torch.Tensor]:
    """The weights after one SGD step of a copy of ``model`` (dropout off, float32)."""
    model = copy.deepcopy(model).eval()
    with full_float32():
        step(model, batch, chunk)
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return [param.detach() for param in model.parameters()]


def deviation(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """The largest absolute difference between two lists of tensors, element by element."""
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b, strict=True))


def synchronized_seconds(run: Callable[[], Any]) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    run()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def configurations(batches: list[int], chunks: list[int]) -> dict[str, tuple[int, int | None]]:
    """``name: (batch, chunk)``: each batch as one big batch, then through ``cached`` at every smaller chunk."""
    found: dict[str, tuple[int, int | None]] = {}
    for batch in batches:
        found[f"{batch} big batch"] = (batch, None)
        found.update({f"{batch} cached {chunk}": (batch, chunk) for chunk in chunks if chunk < batch})
    return found


def measure(sizes: dict[str, Any], rounds: int) -> list[dict[str, Any]]:
    """Every configuration's time, saved bytes, CUDA peak and exactness: one row each."""
    on = device()
    shape = (sizes["in_features"], sizes["width"], sizes["out_features"])
    model, exact_model = DualEncoder(*shape).to(on), DualEncoder(*shape, dropout=0.0).to(on)
    batches = {rows: make_batch(rows, sizes["in_features"], on) for rows in sizes["batches"]}
    configs = configurations(sizes["batches"], sizes["chunks"])
    references = {rows: trained(exact_model, batches[rows], None) for rows in batches}

    def seconds(name: str) -> float:
        rows, chunk = configs[name]
        return synchronized_seconds(lambda: step(model, batches[rows], chunk))

    rotated_rounds(seconds, list(configs), 1)  # warm-up
    times = rotated_rounds(seconds, list(configs), rounds)
    table = []
    for name, (rows, chunk) in configs.items():
        versus = ratio(times, name, f"{rows} big batch")
        table.append(
            {
                "batch": rows,
                "run": "big batch" if chunk is None else "cached",
                "chunk": chunk,
                "ms_per_step": statistics.median(times[name]) * 1e3,
                "ratio": versus,
                "saved": saved_bytes(model, batches[rows], chunk),
                "cuda_peak": step_peak(model, batches[rows], chunk) if on == "cuda" else None,
                "max_abs_weight_difference": deviation(trained(exact_model, batches[rows], chunk), references[rows]),
            }
        )
    return table


def markdown(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table, the saved bytes in MiB (KiB where every peak is under 1 MiB)."""
    cuda = rows[0]["cuda_peak"] is not None
    unit, per_unit = ("KiB", 2**10) if max(row["saved"]["peak"] for row in rows) < MIB else ("MiB", MIB)
    headers = ["batch", "run", "chunk", "ms/step", "ratio to big batch (median)", "range"]
    headers += [f"saved: towers ({unit})", f"loss ({unit})", f"backward ({unit})", f"peak ({unit})"]
    headers += [*(["CUDA peak (MiB)"] if cuda else []), "max abs weight difference"]
    lines = [
        "| " + " | ".join(headers) + " |",
        "| " + " | ".join("---" if h in ("run", "range") else "---:" for h in headers) + " |",
    ]
    for row in rows:
        versus, saved, big = row["ratio"], row["saved"], row["chunk"] is None
        cells = [
            str(row["batch"]),
            row["run"],
            "-" if big else str(row["chunk"]),
            f"{row['ms_per_step']:.1f}",
            "1" if big else f"{versus['median']:.2f}",
            "-" if big else f"{versus['min']:.2f} to {versus['max']:.2f}",
            *(f"{saved[part] / per_unit:.2f}" for part in ("towers", "loss", "backward", "peak")),
            *([f"{row['cuda_peak'] / MIB:.1f}"] if cuda else []),
            "reference" if big else f"{row['max_abs_weight_difference']:.1e}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    if not cuda:
        lines += ["", "CUDA peak memory: skipped: no CUDA."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes and 2 rounds: seconds, to check the script")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 7, 2 with --quick)")
    parser.add_argument("--threads", type=int, default=1, help="torch's CPU threads, on a CPU (default 1)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    if device() == "cpu":
        torch.set_num_threads(args.threads)
    sizes = QUICK if args.quick else DEFAULT
    rounds = args.rounds or (2 if args.quick else 7)
    started = time.perf_counter()
    rows = measure(sizes, rounds)
    text = markdown(rows)
    print(text, end="")
    name = "coupled_quick" if args.quick else "coupled"
    result = {
        "device": device(),
        "torch_threads": torch.get_num_threads(),
        "sizes": sizes,
        "rounds": rounds,
        "seconds": time.perf_counter() - started,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2))
    (args.out / f"{name}.md").write_text(text)
    print(f"\nwrote {args.out / name}.json and .md in {result['seconds']:.0f} s")


if __name__ == "__main__":
    main()
