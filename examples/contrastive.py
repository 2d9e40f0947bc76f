"""A dual encoder for code search: InfoNCE over in-batch negatives, the loss that accumulation changes.

Queries are the first paragraph of a docstring, documents are the function's source with the docstring removed, both
taken from the Python standard library that runs the example (no download; the pairs follow that Python's version).
One small encoder embeds both sides (a siamese tower): hashed words, a learned weighted mean of their embeddings,
LayerNorm and a residual MLP with dropout; a learnable temperature as in CLIP (initialized at 0.07). The loss is the
symmetric InfoNCE with in-batch negatives, so every row of a batch is a negative for every other: a batch of 256 is a
256-way classification, and 16 micro-batches of 16 accumulated are sixteen 16-way classifications, another objective.

Two modes::

    python examples/contrastive.py fit --config examples/configs/contrastive.yaml
    python examples/contrastive.py compare --seeds 0 1 --out contrastive_compare

``fit`` is LightningCLI: loader batches of 256 pairs, each tower call through ``lightning_accum.cached`` in
chunks of 16 rows, the exact batch-256 gradient at the activation memory of 16 rows. ``compare`` trains these
variants at equal samples (the same pairs in the same order, the same one-cycle learning rate by samples, the same
seed) and writes ``results.md``, ``results.json`` and ``results.png`` (with matplotlib) to ``--out``:

=========  ============  ======  ==========================================================================
variant    loader batch  factor  what each optimizer step trains on
=========  ============  ======  ==========================================================================
``true``   256           1       InfoNCE over 256 rows through ``cached(chunk_size=16)``: the exact gradient
``big``    256           1       the same loss in one plain forward: the reference ``true`` must match
``naive``  16            16      16 InfoNCE losses over 16 rows each, averaged by ``AccumulationScheduler``
``small``  16            1       InfoNCE over 16 rows; 16x the steps, the LR x sqrt(16 / 256) (``--small_lr``)
=========  ============  ======  ==========================================================================

What to expect: ``true`` and ``big`` take the same steps (the same gradient up to float32 rounding; with dropout, up to
the order in which the masks are drawn) and end at the same figures; ``naive``, at the same optimizer steps and
samples, ends several points of top-1 below them, and ``small`` near ``naive``. With ``--small_lr same``, ``small``'s
16x more steps at the big batch's learning rate bring it level with ``true`` on this task: what the exact big batch
wins is over accumulation at equal steps, not over 16x the steps.

Held out: the pairs whose qualified name hashes below ``val_fraction`` (20%) of the unit interval, about a thousand.
Each held-out query is ranked against the code of a pool of held-out pairs (pools of 256 in a fixed order, and the
whole held-out set at once): top-1 is the share ranked first, MRR the mean reciprocal rank.

On cores that other work shares, pass ``--threads 1``: the model's operators are tiny, and each parallel region of
torch's would wait for its slowest thread, many times slower than one thread alone; the figures do not change.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import os
import re
import sys
import sysconfig
import textwrap
import time
import zlib
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

import lightning_accum
from lightning_accum import AccumulationScheduler, cached
from lightning_accum.cli import AccumulationArgumentParser

# ------------------------------------------------------------------------------------------------------------- data

SKIPPED_DIRECTORIES = frozenset({"test", "tests", "idle_test", "idlelib", "lib2to3", "site-packages", "__pycache__"})
QUERY_CHARACTERS = (24, 320)  # a docstring's first paragraph shorter or longer than this is not a usable query
_WORD = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|[0-9]+")


@dataclass(frozen=True)
class CodePair:
    """One function of the standard library: a query and the document that answers it."""

    name: str  # the qualified name: module.Class.function
    query: str  # the docstring's first paragraph, on one line
    code: str  # the function's source, decorators included, without its docstring


def code_pairs(root: Path | None = None) -> list[CodePair]:
    """The (docstring, source) pairs of the functions under ``root`` (the standard library by default).

    Files are read in sorted order, directories depth first; a function (or method, or nested function) is taken when
    its docstring's first paragraph has 24 to 320 characters and something follows the docstring; a query already
    seen is skipped (the first function keeps it). Tests, IDLE, lib2to3 and site-packages are left out.
    """
    return list(_code_pairs(str(root or sysconfig.get_paths()["stdlib"])))


@lru_cache(maxsize=4)
def _code_pairs(root: str) -> tuple[CodePair, ...]:
    pairs: list[CodePair] = []
    seen: set[str] = set()
    for path in _python_files(root):
        try:
            source = Path(path).read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        module = os.path.relpath(path, root)[: -len(".py")].replace(os.sep, ".")
        for pair in _functions(tree, module, source.splitlines(keepends=True)):
            if pair.query not in seen:
                seen.add(pair.query)
                pairs.append(pair)
    return tuple(pairs)


def _python_files(root: str) -> list[str]:
    files = []
    for directory, subdirectories, names in os.walk(root):
        subdirectories[:] = sorted(name for name in subdirectories if name not in SKIPPED_DIRECTORIES)
        files += [os.path.join(directory, name) for name in sorted(names) if name.endswith(".py")]
    return files


def _functions(tree: ast.AST, prefix: str, lines: list[str]) -> list[CodePair]:
    """The pairs of the functions defined in ``tree``, nested ones included, in the order of the source."""
    pairs = []
    for node in ast.iter_child_nodes(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue
        name = f"{prefix}.{node.name}"
        if not isinstance(node, ast.ClassDef) and (pair := _pair(node, name, lines)):
            pairs.append(pair)
        pairs += _functions(node, name, lines)
    return pairs


def _pair(node: ast.FunctionDef | ast.AsyncFunctionDef, name: str, lines: list[str]) -> CodePair | None:
    docstring = ast.get_docstring(node)
    first, *rest = node.body
    if not docstring or not rest or first.lineno == node.lineno or first.end_lineno is None:
        return None  # nothing but a docstring, or a docstring on the line of the `def`
    query = " ".join(docstring.split("\n\n")[0].split())
    if not QUERY_CHARACTERS[0] <= len(query) <= QUERY_CHARACTERS[1]:
        return None
    start = (node.decorator_list[0] if node.decorator_list else node).lineno - 1
    code = "".join(lines[start : first.lineno - 1] + lines[first.end_lineno : node.end_lineno])
    return CodePair(name, query, textwrap.dedent(code))


def is_held_out(name: str, fraction: float) -> bool:
    """Whether the pair ``name`` is held out: its hash, read as a number in [0, 1), is below ``fraction``."""
    return int(hashlib.sha1(name.encode()).hexdigest()[:8], 16) / 2**32 < fraction


def hashed_words(texts: list[str], length: int, buckets: int) -> torch.Tensor:
    """Each text's first ``length`` words, hashed to ids in ``[1, buckets)``, padded with 0: ``(len(texts), length)``.

    Words are runs of letters or digits, identifiers split at underscores and case changes, lowercased: the query's
    "Return the file name" and the code's ``return self.file_name`` share their words.
    """
    ids = torch.zeros(len(texts), length, dtype=torch.long)
    for row, text in enumerate(texts):
        words = _WORD.findall(text)[:length]
        ids[row, : len(words)] = torch.tensor([zlib.crc32(word.lower().encode()) % (buckets - 1) + 1 for word in words])
    return ids


class CodeSearchData(pl.LightningDataModule):
    """Hashed (query, code) pairs of the standard library's functions, with a fixed held-out split.

    The training loader draws ``samples`` pairs in all (whole permutations of the training pairs, then part of one)
    in an order fixed by ``seed``, so that loaders of batch 256 and batch 16 see the same pairs in the same order: a
    batch of 256 holds exactly the 16 batches of 16 that follow one another in the other. A fit of one epoch consumes
    them all. Each validation batch is one candidate pool.

    Args:
        batch_size: Pairs per loader batch: the batch the InfoNCE loss couples.
        samples: Pairs drawn for training in one epoch.
        val_fraction: The share of pairs held out, chosen by the hash of their qualified name.
        pool_size: Held-out pairs ranked against one another (the last incomplete pool is left out); ``None``: the
            whole held-out set is one pool.
        buckets: Hash buckets of the words (linked to the model's embedding rows on the command line).
        query_words: Words kept from each query.
        code_words: Words kept from each function's source.
        seed: Seed of the training order.
    """

    def __init__(
        self,
        batch_size: int = 256,
        samples: int = 51_200,
        val_fraction: float = 0.2,
        pool_size: int | None = 256,
        buckets: int = 4096,
        query_words: int = 32,
        code_words: int = 128,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.batch_size, self.samples, self.val_fraction, self.pool_size = batch_size, samples, val_fraction, pool_size
        self.buckets, self.query_words, self.code_words, self.seed = buckets, query_words, code_words, seed

    def setup(self, stage: str) -> None:
        pairs = code_pairs()
        self.train_set = self._dataset([pair for pair in pairs if not is_held_out(pair.name, self.val_fraction)])
        self.val_set = self._dataset([pair for pair in pairs if is_held_out(pair.name, self.val_fraction)])

    def _dataset(self, pairs: list[CodePair]) -> TensorDataset:
        queries = hashed_words([pair.query for pair in pairs], self.query_words, self.buckets)
        return TensorDataset(queries, hashed_words([pair.code for pair in pairs], self.code_words, self.buckets))

    def train_dataloader(self) -> DataLoader:
        order = torch.Generator().manual_seed(self.seed)
        sampler = RandomSampler(self.train_set, num_samples=self.samples, generator=order)
        return DataLoader(self.train_set, batch_size=self.batch_size, sampler=sampler, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return pools(self.val_set, self.pool_size)


def pools(dataset: TensorDataset, pool_size: int | None) -> DataLoader:
    """``dataset`` in pools of ``pool_size`` pairs in a fixed order, the last incomplete one left out; ``None``: one."""
    return DataLoader(dataset, batch_size=pool_size or len(dataset), drop_last=True)


# ------------------------------------------------------------------------------------------------------------ model


class Encoder(nn.Module):
    """Hashed words to a unit vector: embeddings, a softmax-weighted mean, LayerNorm, a residual MLP.

    Each word has a learned score (0 at first: a plain mean); the mean weighs the words by the softmax of their
    scores, a learned inverse document frequency. Dropout acts inside the MLP, on its hidden layer.
    """

    def __init__(self, buckets: int, width: int, dropout: float) -> None:
        super().__init__()
        self.embed = nn.Embedding(buckets, width, padding_idx=0)
        self.score = nn.Embedding(buckets, 1, padding_idx=0)
        nn.init.zeros_(self.score.weight)
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Dropout(dropout), nn.Linear(width, width))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        scores = self.score(ids).squeeze(-1).masked_fill(ids == 0, -math.inf)
        pooled = self.norm((scores.softmax(-1).unsqueeze(-1) * self.embed(ids)).sum(1))
        return nn.functional.normalize(pooled + self.mlp(pooled), dim=-1)


def info_nce(queries: torch.Tensor, documents: torch.Tensor, logit_scale: torch.Tensor) -> torch.Tensor:
    """Symmetric InfoNCE: row i of each side is the positive of row i of the other, every other row a negative."""
    logits = queries @ documents.T * logit_scale
    targets = torch.arange(len(queries), device=queries.device)
    return (nn.functional.cross_entropy(logits, targets) + nn.functional.cross_entropy(logits.T, targets)) / 2


def retrieval_metrics(queries: torch.Tensor, documents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-1 accuracy and mean reciprocal rank of each query's own document among all ``documents``."""
    similarity = queries @ documents.T
    rank = (similarity > similarity.diagonal().unsqueeze(1)).sum(1)
    return (rank == 0).float().mean(), (1 / (rank + 1)).mean()


class DualEncoder(pl.LightningModule):
    """One encoder for queries and code, InfoNCE with a learnable temperature, AdamW and a one-cycle learning rate.

    Args:
        buckets: Embedding rows (linked to ``data.buckets`` on the command line).
        width: Embedding and model width.
        dropout: Dropout on the hidden layer of the MLP.
        lr: Peak learning rate of the one-cycle schedule, before the accumulation callback's LR scaling.
        weight_decay: AdamW's decoupled weight decay.
        temperature: The initial temperature of the softmax (the logit scale is learned, at most 100, as in CLIP).
        chunk_size: Rows per chunk of ``cached``: the loss's gradient is the loader batch's, at one chunk's activation
            memory. ``None``: one plain forward of the whole batch.
    """

    def __init__(
        self,
        buckets: int = 4096,
        width: int = 96,
        dropout: float = 0.2,
        lr: float = 0.03,
        weight_decay: float = 0.01,
        temperature: float = 0.07,
        chunk_size: int | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.encoder = Encoder(buckets, width, dropout)
        self.log_logit_scale = nn.Parameter(torch.tensor(math.log(1 / temperature)))

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.hparams.chunk_size is None:
            return self.encoder(ids)
        return cached(self.encoder, ids, chunk_size=self.hparams.chunk_size)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        queries, code = batch
        logit_scale = self.log_logit_scale.clamp(max=math.log(100)).exp()
        loss = info_nce(self.embed(queries), self.embed(code), logit_scale)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/temperature", 1 / logit_scale)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        queries, code = batch
        top1, mrr = retrieval_metrics(self.encoder(queries), self.encoder(code))
        self.log_dict({"val/top1": top1, "val/mrr": mrr}, prog_bar=True)

    def configure_optimizers(self):  # noqa: ANN201
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
        total = int(lightning_accum.estimated_stepping_batches(self.trainer))
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=self.hparams.lr, total_steps=total, pct_start=0.1
        )
        return [optimizer], [{"scheduler": lightning_accum.SampleDrivenLR(scheduler), "interval": "step"}]


class ContrastiveCLI(LightningCLI):
    """LightningCLI with the model's embedding rows tied to the data's hash buckets."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.buckets", "model.buckets")


# ---------------------------------------------------------------------------------------------------------- compare

VARIANTS = ("true", "big", "naive", "small")


@dataclass(frozen=True)
class Settings:
    """What every variant of a comparison shares (the sizes, the learning rate, the samples) and how ``small`` runs."""

    samples: int = 51_200
    batch_size: int = 256
    micro_batch_size: int = 16
    lr: float = 0.03
    small_lr: Literal["sqrt", "same"] = "sqrt"  # "sqrt": the LR x sqrt(micro / batch) for `small`; "same": the LR
    width: int = 96
    dropout: float = 0.2
    pool_size: int = 256


def variant_setup(variant: str, settings: Settings) -> tuple[int, int | None, AccumulationScheduler]:
    """The loader batch, the chunk size of ``cached`` (``None``: a plain forward) and the callback of ``variant``."""
    batch, micro = settings.batch_size, settings.micro_batch_size
    if variant == "true":
        return batch, micro, AccumulationScheduler({0: 1})
    if variant == "big":
        return batch, None, AccumulationScheduler({0: 1})
    if variant == "naive":
        return micro, None, AccumulationScheduler({0: batch // micro})
    if variant == "small":
        rule = {"lr_scaling": "sqrt", "base_batch_size": batch} if settings.small_lr == "sqrt" else {}
        return micro, None, AccumulationScheduler({0: 1}, **rule)
    raise ValueError(f"`variant` must be one of {', '.join(map(repr, VARIANTS))}, got {variant!r}")


def train_variant(variant: str, seed: int, settings: Settings) -> tuple[DualEncoder, dict[str, Any]]:
    """Train one variant from ``seed`` on one device and measure it on the held-out pairs."""
    pl.seed_everything(seed, verbose=False)
    loader_batch, chunk_size, accumulation = variant_setup(variant, settings)
    data = CodeSearchData(batch_size=loader_batch, samples=settings.samples, pool_size=settings.pool_size, seed=seed)
    model = DualEncoder(
        buckets=data.buckets,
        width=settings.width,
        dropout=settings.dropout,
        lr=settings.lr,
        chunk_size=chunk_size,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        callbacks=[accumulation],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    start = time.perf_counter()
    trainer.fit(model, datamodule=data)
    seconds = time.perf_counter() - start
    top1, mrr = held_out_metrics(model, data.val_set, settings.pool_size)
    return model, {
        "variant": variant,
        "seed": seed,
        "loader_batch": loader_batch,
        "factor": accumulation.factor,
        "chunk_size": chunk_size,
        "top1": top1,
        "mrr": mrr,
        "top1_all": held_out_metrics(model, data.val_set, None)[0],
        "held_out": len(data.val_set),
        "optimizer_steps": trainer.global_step,
        "samples": accumulation.samples_seen,
        "temperature": 1 / model.log_logit_scale.exp().item(),
        "seconds": seconds,
    }


def held_out_metrics(model: DualEncoder, dataset: TensorDataset, pool_size: int | None) -> tuple[float, float]:
    """Top-1 and MRR over the pools of ``pool_size`` held-out pairs (``None``: one pool of all), as validation's."""
    model.eval()
    with torch.no_grad():
        found = [
            retrieval_metrics(model.encoder(queries), model.encoder(code))
            for queries, code in pools(dataset, pool_size)
        ]
    return tuple(torch.stack(metric).mean().item() for metric in zip(*found, strict=True))  # type: ignore[return-value]


def markdown_table(results: list[dict[str, Any]], pool_size: int) -> str:
    """One row per run, then the mean of each variant over its seeds."""
    held_out = results[0]["held_out"]
    lines = [
        f"| variant | seed | loader batch | factor | chunk | top-1 (pools of {pool_size}) | MRR (pools of {pool_size})"
        f" | top-1 (all {held_out}) | optimizer steps | temperature | time (s) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in results:
        lines.append(
            f"| {row['variant']} | {row['seed']} | {row['loader_batch']} | {row['factor']} | {row['chunk_size'] or '-'}"
            f" | {row['top1']:.3f} | {row['mrr']:.3f} | {row['top1_all']:.3f} | {row['optimizer_steps']}"
            f" | {row['temperature']:.3f} | {row['seconds']:.1f} |"
        )
    lines += ["", f"| variant | mean top-1 ({pool_size}) | mean MRR ({pool_size}) | mean top-1 (all) |"]
    lines.append("| --- | ---: | ---: | ---: |")
    for variant, rows in _by_variant(results).items():
        means = [sum(row[key] for row in rows) / len(rows) for key in ("top1", "mrr", "top1_all")]
        lines.append(f"| {variant} | " + " | ".join(f"{mean:.3f}" for mean in means) + " |")
    return "\n".join(lines)


def _by_variant(results: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    grouped: dict[str, list[dict[str, Any]]] = {}
    for row in results:
        grouped.setdefault(row["variant"], []).append(row)
    return grouped


def plot(results: list[dict[str, Any]], path: Path, pool_size: int) -> bool:
    """Each metric of each variant: a bar at the mean, labelled, and a dot per seed; ``False`` without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grouped = _by_variant(results)
    metrics = {
        "top1": f"top-1 among {pool_size}",
        "mrr": f"MRR among {pool_size}",
        "top1_all": f"top-1 among all {results[0]['held_out']}",
    }
    figure, axes = plt.subplots(1, len(metrics), figsize=(13, 4))
    for axis, (key, label) in zip(axes, metrics.items(), strict=True):
        for x, rows in enumerate(grouped.values()):
            values = [row[key] for row in rows]
            mean = sum(values) / len(values)
            axis.bar(x, mean, color=f"C{x}", alpha=0.6)
            axis.scatter([x] * len(values), values, color="black", s=12, zorder=3)
            axis.annotate(
                f"{mean:.3f}", (x, max(values)), ha="center", va="bottom", xytext=(0, 4), textcoords="offset points"
            )
        axis.set_xticks(range(len(grouped)), list(grouped))
        axis.set_ylim(0, 1.12 * max(row[key] for row in results))
        axis.set_title(f"held-out {label}")
    figure.suptitle(f"Equal samples ({results[0]['samples']} pairs): the exact big batch against accumulation")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def compare(argv: list[str]) -> list[dict[str, Any]]:
    """The compare mode: every variant for every seed, then the table, the numbers and the plot under ``--out``."""
    defaults = Settings()
    parser = argparse.ArgumentParser(prog="contrastive.py compare", description=compare.__doc__)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--out", type=Path, default=Path("contrastive_compare"))
    parser.add_argument("--threads", type=int, help="torch's CPU threads (default: torch's; 1 on busy shared cores)")
    for name in ("samples", "batch_size", "micro_batch_size", "width", "pool_size"):
        parser.add_argument(f"--{name}", type=int, default=getattr(defaults, name))
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--dropout", type=float, default=defaults.dropout)
    parser.add_argument("--small_lr", choices=("sqrt", "same"), default=defaults.small_lr)
    args = parser.parse_args(argv)
    settings = Settings(**{key: getattr(args, key) for key in asdict(defaults)})
    if args.batch_size % args.micro_batch_size or args.samples % args.batch_size:
        parser.error("--batch_size must be a multiple of --micro_batch_size, and --samples of --batch_size")
    if args.threads:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    results = []
    for seed in args.seeds:
        for variant in args.variants:
            _, result = train_variant(variant, seed, settings)
            print(
                f"{variant:>5} seed {seed}: top-1 {result['top1']:.3f}  MRR {result['mrr']:.3f}  top-1 (all)"
                f" {result['top1_all']:.3f}  {result['optimizer_steps']} steps  {result['seconds']:.1f} s",
                flush=True,
            )
            results.append(result)
    total = time.perf_counter() - started
    table = markdown_table(results, settings.pool_size)
    command = " ".join(["python examples/contrastive.py compare", *argv])
    text = (
        f"# Contrastive training at equal samples\n\n`{command}`: {settings.samples} training pairs per run, effective"
        f" batch {settings.batch_size}, micro-batch (and chunk) {settings.micro_batch_size}, peak LR {settings.lr}"
        f" ({settings.small_lr} rule for `small`), torch {torch.__version__} on {torch.get_num_threads()} CPU"
        f" thread(s); {total:.0f} s in all.\n\n{table}\n"
    )
    (args.out / "results.md").write_text(text)
    (args.out / "results.json").write_text(json.dumps({"settings": asdict(settings), "results": results}, indent=2))
    plotted = plot(results, args.out / "results.png", settings.pool_size)
    print(f"\n{table}\n\nwrote {args.out / 'results.md'}, results.json" + (", results.png" if plotted else ""))
    return results


def main(args: list[str] | None = None, run: bool = True) -> ContrastiveCLI | list[dict[str, Any]]:
    argv = sys.argv[1:] if args is None else args
    if argv[:1] == ["compare"]:
        return compare(argv[1:])
    return ContrastiveCLI(
        DualEncoder,
        CodeSearchData,
        args=argv,
        run=run,
        seed_everything_default=0,
        parser_class=AccumulationArgumentParser,
    )


if __name__ == "__main__":
    main()
