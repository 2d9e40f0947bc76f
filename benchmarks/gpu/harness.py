"""What the GPU suite's parts share: their arguments, an incremental report, the device, a quiet Trainer.

Each part is a script with a ``main(argv)``; ``suite.py`` runs each in a process of its own under its own time
budget. A part writes ``<name>.json`` and ``<name>.md`` after every row, so a part stopped at its budget still leaves
what it measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

MIB = 2**20


def arguments(argv: Sequence[str] | None, description: str) -> argparse.Namespace:
    """``--out DIR``, ``--dry`` (tiny sizes, any device) and ``--budget SECONDS``.

    Adds ``deadline``: the ``time.monotonic()`` by which the part should have started its last measurement (90% of the
    budget, counted from ``--started`` where the suite gives it; the rest is for finishing it and writing the report).
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu"))
    parser.add_argument("--dry", action="store_true", help="tiny sizes, to check the script on any machine")
    parser.add_argument("--budget", type=float, default=600.0, help="seconds this part may take")
    parser.add_argument("--started", type=float, default=None, help="time.time() the budget counts from (the suite's)")
    args = parser.parse_args(argv)
    spent = time.time() - args.started if args.started is not None else 0.0  # the interpreter's start, the imports
    args.deadline = time.monotonic() - spent + 0.9 * args.budget
    return args


def quiet() -> None:
    """Lightning's info lines and warnings off: the part's own lines are what the log is for."""
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_accum", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


def device() -> torch.device:
    """The CUDA device if there is one, else the CPU (the dry mode's usual machine)."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def trainer(**kwargs: Any) -> pl.Trainer:
    """A Trainer on :func:`device`, one device, with nothing on that the part does not ask for."""
    options: dict[str, Any] = {
        "accelerator": device().type,
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
    }
    return pl.Trainer(**{**options, **kwargs})


def synchronize() -> None:
    """Wait for the device's queued kernels (a timing point); nothing on the CPU."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Clock(pl.Callback):
    """Seconds from the start of training batch ``first_timed_batch`` to the end of the fit, synchronised at both."""

    def __init__(self, first_timed_batch: int) -> None:
        self.first_timed_batch = first_timed_batch
        self.started = self.seconds = float("nan")

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, index: int) -> None:
        if index == self.first_timed_batch:
            synchronize()
            self.started = time.perf_counter()

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        synchronize()
        self.seconds = time.perf_counter() - self.started


def release() -> None:
    """Free what earlier runs left: garbage first, then the caching allocator's unused blocks."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def max_deviation(a: Iterable[torch.Tensor], b: Iterable[torch.Tensor]) -> float:
    """The largest absolute difference between two lists of tensors, element by element, in float64."""
    return max(
        (x.detach().double().cpu() - y.detach().double().cpu()).abs().max().item() for x, y in zip(a, b, strict=True)
    )


def weights(module: nn.Module) -> list[torch.Tensor]:
    """The module's parameters as full tensors (an FSDP2 ``DTensor`` gathered), detached."""
    return [p.full_tensor().detach() if hasattr(p, "full_tensor") else p.detach() for p in module.parameters()]


def gpt2(dry: bool, **overrides: Any) -> nn.Module:
    """GPT-2 small (124M parameters, 12 layers of width 768) from its config, random init; tiny when ``dry``.

    Dropout is off (as in nanoGPT's pre-training default), so that runs which draw random numbers in a different
    order (micro-batches against one big batch) train the same function.
    """
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as transformers_logging

    transformers_logging.set_verbosity_error()
    sizes: dict[str, Any] = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    if dry:
        sizes |= {"n_layer": 2, "n_embd": 64, "n_head": 2, "n_positions": 64, "vocab_size": 256}
        sizes |= {"bos_token_id": 0, "eos_token_id": 0}
    config = GPT2Config(**{**sizes, **overrides})
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def byte_tokens(sequences: int, length: int) -> torch.Tensor:
    """``sequences`` rows of ``length`` bytes of the Python standard library's sources (as token ids 0-255)."""
    from byte_lm import read_corpus  # examples/, on the path the parts set

    corpus = read_corpus(sequences * length)
    if len(corpus) < sequences * length:  # a small standard library: repeat it
        corpus = corpus.repeat(sequences * length // len(corpus) + 1)
    return corpus[: sequences * length].view(sequences, length)


class Report:
    """A part's tables and notes, written as ``<name>.json`` and ``<name>.md`` after every change.

    Example::

        report = Report(out, "exactness", "Exactness on CUDA", "what was run")
        report.table("weights", ["setting", "max abs deviation"])
        report.row("weights", ["fp32", "3.0e-08"], setting="fp32", deviation=3e-8)
    """

    def __init__(self, out: Path, name: str, title: str, description: str) -> None:
        self.path = out / name
        self.title, self.description = title, description
        self.tables: dict[str, dict[str, Any]] = {}
        self.notes: list[str] = []
        self.status = "running"
        out.mkdir(parents=True, exist_ok=True)
        self.save()

    def table(self, key: str, headers: list[str], caption: str = "") -> None:
        """Start a table with these column headers and an optional caption above it."""
        self.tables[key] = {"headers": headers, "caption": caption, "cells": [], "rows": []}
        self.save()

    def row(self, key: str, cells: list[str], **data: Any) -> None:
        """A row of ``key``: its cells as shown and its numbers as data."""
        self.tables[key]["cells"].append(cells)
        self.tables[key]["rows"].append(data)
        self.save()

    def check(self, what: str, expected: str, measured: str, holds: bool) -> None:
        """A row of the ``checks`` table (started on first use): what was expected, what was measured, whether it held.

        The suite counts every row whose ``passed`` is false as a check that did not hold.
        """
        if "checks" not in self.tables:
            self.table("checks", ["check", "expected", "measured", "holds"])
        self.row("checks", [what, expected, measured, "yes" if holds else "**NO**"], check=what, passed=holds)

    def note(self, text: str) -> None:
        """A sentence printed under the tables."""
        self.notes.append(text)
        self.save()

    def finish(self, status: str = "ok") -> None:
        """The part's outcome: ``ok``, or ``skipped: ...`` with the reason."""
        self.status = status
        self.save()

    def markdown(self) -> str:
        """The report as Markdown: a heading, the description, each table with its caption, the notes."""
        lines = [f"### {self.title}", "", self.description, ""]
        if self.status != "ok":
            lines += [f"**{self.status}**", ""]
        for table in self.tables.values():
            if table["caption"]:
                lines += [table["caption"], ""]
            lines.append("| " + " | ".join(table["headers"]) + " |")
            lines.append("| " + " | ".join("---" for _ in table["headers"]) + " |")
            lines += ["| " + " | ".join(cells) + " |" for cells in table["cells"]]
            lines.append("")
        lines += [f"- {note}" for note in self.notes]
        return "\n".join(lines).rstrip() + "\n"

    def reorder(self, key: str, sort_key: Callable[[dict[str, Any]], Any]) -> None:
        """Sort the rows of table ``key`` by ``sort_key(row data)`` (rows measured in another order than shown)."""
        table = self.tables[key]
        pairs = sorted(zip(table["rows"], table["cells"], strict=True), key=lambda pair: sort_key(pair[0]))
        table["rows"], table["cells"] = [row for row, _ in pairs], [cells for _, cells in pairs]
        self.save()

    def save(self) -> None:
        """Write both files whole or not at all: a part killed at its budget leaves the last complete version."""
        record = {"title": self.title, "status": self.status, "tables": self.tables, "notes": self.notes}
        for suffix, text in ((".json", json.dumps(record, indent=2, default=str)), (".md", self.markdown())):
            partial = self.path.with_suffix(suffix + ".partial")
            partial.write_text(text)
            os.replace(partial, self.path.with_suffix(suffix))


def skip_without_cuda(report: Report) -> bool:
    """Finish ``report`` as skipped when there is no CUDA device; True if so."""
    if torch.cuda.is_available():
        return False
    report.finish("skipped: no CUDA")
    return True
