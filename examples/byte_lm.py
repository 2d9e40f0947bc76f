"""A small byte-level transformer language model and its data: the Python standard library's own sources.

Shared by the examples. The corpus needs no download: it is the ``.py`` files of the Python that runs the example,
read in a fixed order, so every machine trains on the same bytes. The last ``val_fraction`` of the corpus is held out.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lightning_accum


def read_corpus(max_bytes: int) -> torch.Tensor:
    """The first ``max_bytes`` bytes of the standard library's sources (fewer if the library is smaller)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(stdlib.glob("*.py")) + sorted(stdlib.glob("*/*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).long()


def read_file(path: str | Path, max_bytes: int) -> torch.Tensor:
    """The first ``max_bytes`` bytes of any file (a user's own text), as byte values.

    Raises:
        ValueError: If the file holds fewer than 20,000 bytes: too few to hold some out and still train.
    """
    data = Path(path).read_bytes()[:max_bytes]
    if len(data) < 20_000:
        raise ValueError(f"{path}: {len(data)} bytes; give a file of at least 20000 (a part of it is held out)")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


class ByteWindows(Dataset):
    """Non-overlapping windows of ``context + 1`` bytes: inputs and next-byte targets."""

    def __init__(self, corpus: torch.Tensor, context: int) -> None:
        self.corpus, self.context = corpus, context

    def __len__(self) -> int:
        return (len(self.corpus) - 1) // self.context

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.context
        window = self.corpus[start : start + self.context + 1]
        return window[:-1], window[1:]


class StdlibBytes(pl.LightningDataModule):
    """Byte windows of the standard library's sources, or of any text or bytes file of yours (``path``).

    Args:
        batch_size: Sequences per micro-batch on one device (the accumulation callback reads it from here).
        context: Bytes per sequence.
        corpus_bytes: How much of the standard library (or of ``path``) to read.
        val_fraction: The share of the corpus, taken from its end, held out for validation.
        shuffle: Shuffle the training windows each epoch.
        path: Train on this file's bytes instead (``--data.path my.txt``; its last ``val_fraction`` held out).
    """

    def __init__(
        self,
        batch_size: int = 8,
        context: int = 128,
        corpus_bytes: int = 4_000_000,
        val_fraction: float = 0.02,
        shuffle: bool = True,
        path: str | None = None,
    ) -> None:
        super().__init__()
        self.batch_size, self.context, self.corpus_bytes = batch_size, context, corpus_bytes
        self.val_fraction, self.shuffle, self.path = val_fraction, shuffle, path

    def setup(self, stage: str) -> None:
        corpus = read_corpus(self.corpus_bytes) if self.path is None else read_file(self.path, self.corpus_bytes)
        split = int(len(corpus) * (1 - self.val_fraction))
        self.train_set = ByteWindows(corpus[:split], self.context)
        self.val_set = ByteWindows(corpus[split:], self.context)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=self.shuffle, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=64)


class ByteLM(pl.LightningModule):
    """A pre-norm causal transformer over bytes, trained with AdamW and a one-cycle learning rate.

    Args:
        context: Longest sequence (linked to ``data.context`` on the command line).
        width: Model width.
        layers: Transformer blocks.
        heads: Attention heads.
        lr: Peak learning rate of the one-cycle schedule, before the accumulation callback's LR scaling.
        weight_decay: AdamW's decoupled weight decay.
        dropout: Dropout in the blocks (0 keeps accumulation bit-for-bit comparable with one big batch).
    """

    def __init__(
        self,
        context: int = 128,
        width: int = 128,
        layers: int = 4,
        heads: int = 4,
        lr: float = 2e-3,
        weight_decay: float = 0.01,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(256, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        block = nn.TransformerEncoderLayer(
            width, heads, dim_feedforward=4 * width, dropout=dropout, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 256)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        hidden = self.embed(tokens) + self.position[:length]
        hidden = self.blocks(hidden, mask=self.causal[:length, :length], is_causal=True)
        return self.head(self.norm(hidden))

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        tokens, targets = batch
        return nn.functional.cross_entropy(self(tokens).flatten(0, 1), targets.flatten())

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val/loss", self.loss(batch), prog_bar=True)

    def configure_optimizers(self):  # noqa: ANN201
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
        # sized in the optimizer steps the accumulation schedule implies (Lightning's own estimate ignores it), and
        # moved by the samples consumed, so that it ends where the data ends however the factor grows
        total = int(lightning_accum.estimated_stepping_batches(self.trainer))
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=self.hparams.lr, total_steps=total)
        return [optimizer], [{"scheduler": lightning_accum.SampleDrivenLR(scheduler), "interval": "step"}]
