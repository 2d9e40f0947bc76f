"""A coupled loss's exact big-batch gradient through ``cached``: its time and memory against a true big batch, and its
time against plain micro-batches of the same chunk.

    python benchmarks/coupled.py                   # two tables; writes coupled.json and coupled.md under --out
    python benchmarks/coupled.py --quick           # tiny sizes, a few seconds (what the test runs)

**Memory and time against the big batch.**

One training step of a dual encoder: two towers, each Linear(256, 1024) -> GELU -> Dropout(0.1) -> Linear(1024, 1024)
-> LayerNorm -> Linear(1024, 128), and InfoNCE with in-batch negatives and a learnable temperature (gradients set to
None, both towers forward, the loss, backward; no optimizer step). Computed (a) as one true big batch in plain
PyTorch, (b) with each tower through :func:`lightning_accum.distributed.coupled.cached` in chunks of 8, 32 and 128 rows
(those smaller than the batch), at batches of 64, 256 and 1024 rows.

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

**Time against plain micro-batches of the same chunk** (what accumulating micro-batches costs: not exact, each
micro-batch its own negatives), one training step of a siamese encoder on a batch of 256 pairs, InfoNCE with a
learnable temperature, for two towers:

- *tiny BERT*: a random BertModel (2 layers, width 128, 2 heads, feed-forward 512, dropout 0.1) with mean pooling
  under the attention mask and unit length, on random token ids whose lengths are drawn as text's are (log-normal:
  queries of median 12 tokens, at most 48; documents of median 40, at most 192), each batch padded to its longest row;
- *the example's encoder*: ``examples/contrastive.py``'s ``Encoder`` (hashed words, a learned weighted mean, a residual
  MLP with dropout; width 96) on 256 of its standard-library pairs (queries of 32 words, code of 128, zero-padded as
  its loader gives them).

Runs: *plain micro-batches* of ``c`` rows, each padded to its own longest row as a loader of batch ``c`` collates it,
forward, its own InfoNCE, backward (the reference of the ratios); *cached* ``chunk_size=c`` on the batch padded as
one; *cached + chunk_tokens*, ``chunk_tokens`` = ``c`` x the side's longest row as well (chunks of ``c`` rows still,
since none of them can hold more tokens, but taken longest first and each cut to its longest row; the tiny BERT only,
the example's encoder takes no attention mask); *first pass alone*: ``cached`` under ``torch.no_grad()``, the extra
forward that ``cached`` adds; and the *big batch* in one plain forward (its ratio against micro-batches of the largest
chunk). Ratios are taken round by round against the plain micro-batches; exactness as above (the weights after one
SGD step against the big batch's, dropout off).

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

from lightning_accum.distributed.coupled import cached  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

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
# the tiny BERT: its shape, and the token lengths of its queries and documents (log-normal: median, sigma, longest)
BERT: dict[str, Any] = {"width": 128, "layers": 2, "heads": 2, "feed_forward": 512, "vocabulary": 1000}
TEXT: dict[str, Any] = {"batch": 256, "chunks": [8, 32], "queries": (12, 0.6, 48), "documents": (40, 0.6, 192)}
QUICK_BERT: dict[str, Any] = {"width": 16, "layers": 1, "heads": 2, "feed_forward": 32, "vocabulary": 50}
QUICK_TEXT: dict[str, Any] = {"batch": 16, "chunks": [4, 8], "queries": (4, 0.6, 8), "documents": (6, 0.6, 12)}

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


# ------------------------------------------------------------------ against plain micro-batches

Side = dict[str, torch.Tensor]  # a tower's keyword arguments: input_ids, and attention_mask for the tiny BERT


class MeanPooledBert(nn.Module):
    """A random BertModel whose token states are averaged under the attention mask: a unit sentence embedding."""

    def __init__(self, shape: dict[str, Any]) -> None:
        super().__init__()
        from transformers import BertConfig, BertModel

        config = BertConfig(
            vocab_size=shape["vocabulary"],
            hidden_size=shape["width"],
            num_hidden_layers=shape["layers"],
            num_attention_heads=shape["heads"],
            intermediate_size=shape["feed_forward"],
            max_position_embeddings=512,
        )
        self.bert = BertModel(config, add_pooling_layer=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        states = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        weights = attention_mask.unsqueeze(-1).to(states.dtype)
        return nn.functional.normalize((states * weights).sum(1) / weights.sum(1), dim=-1)


class Siamese(nn.Module):
    """One tower for queries and documents, and the log of the InfoNCE temperature's inverse."""

    def __init__(self, tower: nn.Module) -> None:
        super().__init__()
        self.tower = tower
        self.log_scale = nn.Parameter(torch.tensor(2.0))


def padded_text(rows: int, lengths: tuple[float, float, int], vocabulary: int, generator: torch.Generator) -> Side:
    """Random token ids of log-normal lengths (median, sigma, longest), padded with 0 to the longest row."""
    median, sigma, longest = lengths
    drawn = (torch.randn(rows, generator=generator) * sigma).exp() * median
    counts = drawn.round().clamp(1, longest).long()
    width = int(counts.max())
    mask = (torch.arange(width) < counts[:, None]).long()
    return {
        "input_ids": torch.randint(1, vocabulary, (rows, width), generator=generator) * mask,
        "attention_mask": mask,
    }


def trimmed(side: Side, start: int, stop: int) -> Side:
    """Rows ``start:stop`` of ``side`` as a loader of that batch collates them: padded to their own longest row."""
    part = {key: value[start:stop] for key, value in side.items()}
    if "attention_mask" not in part:
        return part
    width = int(part["attention_mask"].sum(1).max())
    return {key: value[:, :width] for key, value in part.items()}


def text_towers(quick: bool) -> dict[str, tuple[Siamese, tuple[Side, Side]]]:
    """The two models of the micro-batch table, each with its batch of (queries, documents)."""
    text = QUICK_TEXT if quick else TEXT
    torch.manual_seed(0)
    bert = Siamese(MeanPooledBert(QUICK_BERT if quick else BERT))
    generator = torch.Generator().manual_seed(2)
    vocabulary = (QUICK_BERT if quick else BERT)["vocabulary"]
    bert_batch = tuple(
        padded_text(text["batch"], text[side], vocabulary, generator) for side in ("queries", "documents")
    )
    sys.path.insert(0, str(EXAMPLES))
    import contrastive

    encoder = Siamese(contrastive.Encoder(buckets=4096, width=16 if quick else 96, dropout=0.2))
    if quick:
        example_batch = tuple({"ids": torch.randint(0, 4096, (text["batch"], words))} for words in (8, 16))
    else:
        pairs = contrastive.code_pairs()
        chosen = torch.randperm(len(pairs), generator=generator)[: text["batch"]].tolist()
        queries = contrastive.hashed_words([pairs[i].query for i in chosen], 32, 4096)
        example_batch = (
            {"ids": queries},
            {"ids": contrastive.hashed_words([pairs[i].code for i in chosen], 128, 4096)},
        )
    return {"tiny BERT": (bert, bert_batch), "example encoder": (encoder, example_batch)}  # type: ignore[dict-item]


def info_nce_step(model: Siamese, queries: torch.Tensor, documents: torch.Tensor) -> None:
    info_nce(queries, documents, model.log_scale).backward()


def micro_batch_run(model: Siamese, batch: tuple[Side, Side], run: str, chunk: int) -> Callable[[], Any]:
    """One step of ``run`` (plain, cached, tokens, first pass, big) at chunks of ``chunk`` rows, as a callable."""
    queries, documents = batch
    rows = len(next(iter(queries.values())))

    def tokens(side: Side) -> dict[str, int]:  # at most ``chunk`` rows still: the budget holds them at any length
        return {"chunk_tokens": chunk * side["attention_mask"].shape[1]} if run == "tokens" else {}

    def step() -> None:
        model.zero_grad(set_to_none=True)
        if run == "plain":
            for start in range(0, rows, chunk):
                parts = (trimmed(side, start, start + chunk) for side in batch)
                info_nce_step(model, *(model.tower(**part) for part in parts))
        elif run == "big":
            info_nce_step(model, model.tower(**queries), model.tower(**documents))
        elif run == "first pass":
            with torch.no_grad():
                for side in batch:
                    cached(model.tower, chunk_size=chunk, **side)
        else:
            info_nce_step(model, *(cached(model.tower, chunk_size=chunk, **tokens(side), **side) for side in batch))

    return step


def micro_batch_exactness(model: Siamese, batch: tuple[Side, Side], run: str, chunk: int) -> float:
    """The largest weight difference after one SGD step (dropout off) between ``run`` and the big batch."""
    weights = []
    for name in (run, "big"):
        copy_ = copy.deepcopy(model).eval()
        with full_float32():
            micro_batch_run(copy_, batch, name, chunk)()
        torch.optim.SGD(copy_.parameters(), lr=LR).step()
        weights.append([param.detach() for param in copy_.parameters()])
    return deviation(*weights)


def versus_micro_batches(quick: bool, rounds: int) -> list[dict[str, Any]]:
    """Every model's runs at every chunk, timed in rotated rounds: one row each, ratios to plain micro-batches."""
    text = QUICK_TEXT if quick else TEXT
    table = []
    for model_name, (model, batch) in text_towers(quick).items():
        runs = ["plain", "cached", *(["tokens"] if "attention_mask" in batch[0] else []), "first pass"]
        configs = {(run, chunk): micro_batch_run(model, batch, run, chunk) for chunk in text["chunks"] for run in runs}
        configs[("big", 0)] = micro_batch_run(model, batch, "big", text["batch"])
        names = [f"{run} {chunk}" for run, chunk in configs]
        times = timed(dict(zip(names, configs.values(), strict=True)), rounds)
        for (run, chunk), name in zip(configs, names, strict=True):
            baseline = f"plain {chunk}" if run != "big" else f"plain {text['chunks'][-1]}"
            exact = run in ("cached", "tokens")
            table.append(
                {
                    "model": model_name,
                    "run": run,
                    "chunk": chunk or None,
                    "ms_per_step": statistics.median(times[name]) * 1e3,
                    "versus_plain": ratio(times, name, baseline),
                    "max_abs_weight_difference": micro_batch_exactness(model, batch, run, chunk) if exact else None,
                }
            )
    return table


def timed(steps: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[float]]:
    """Each step's seconds in ``rounds`` rotated rounds, after a warm-up round."""
    rotated_rounds(lambda name: synchronized_seconds(steps[name]), list(steps), 1)
    return rotated_rounds(lambda name: synchronized_seconds(steps[name]), list(steps), rounds)


RUN_NAMES = {
    "plain": "plain micro-batches",
    "cached": "cached",
    "tokens": "cached + chunk_tokens",
    "first pass": "first pass alone",
    "big": "big batch",
}


def micro_batch_markdown(rows: list[dict[str, Any]]) -> str:
    """The micro-batch table: each run's time and its ratio to plain micro-batches of the same chunk."""
    lines = [
        "| model | run | chunk | ms/step | ratio to plain micro-batches (median) | range | max abs weight difference |",
        "| --- | --- | ---: | ---: | ---: | --- | ---: |",
    ]
    for row in rows:
        versus = row["versus_plain"]
        plain = row["run"] == "plain"
        exact = row["max_abs_weight_difference"]
        cells = [
            row["model"],
            RUN_NAMES[row["run"]],
            str(row["chunk"] or "-"),
            f"{row['ms_per_step']:.1f}",
            "1" if plain else f"{versus['median']:.2f}",
            "-" if plain else f"{versus['min']:.2f} to {versus['max']:.2f}",
            "-" if exact is None else f"{exact:.1e}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


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
    micro = versus_micro_batches(args.quick, rounds)
    text = markdown(rows) + "\n" + micro_batch_markdown(micro)
    print(text, end="")
    name = "coupled_quick" if args.quick else "coupled"
    result = {
        "device": device(),
        "torch_threads": torch.get_num_threads(),
        "sizes": sizes,
        "rounds": rounds,
        "seconds": time.perf_counter() - started,
        "rows": rows,
        "versus_micro_batches": micro,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2))
    (args.out / f"{name}.md").write_text(text)
    print(f"\nwrote {args.out / name}.json and .md in {result['seconds']:.0f} s")


if __name__ == "__main__":
    main()
