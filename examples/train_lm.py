"""A byte-level transformer language model on the Python standard library's own sources, with a batch-size ramp.

Runs on a laptop CPU in about a minute and needs no download: the corpus is the ``.py`` files of the Python that
runs it. The global batch ramps from 16 to 64 sequences over the first 3,000 samples while each micro-batch stays at
8, so the accumulation factor goes 2 -> 4 -> 6 -> 8 in the middle of the epoch, exactly, and the learning rate follows
the square root of the effective batch. Logs go to ./lightning_logs: `tensorboard --logdir lightning_logs`.

    python examples/train_lm.py --max_steps 200
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lightning_accum
from lightning_accum import AccumulationScheduler


def read_corpus(max_bytes: int) -> torch.Tensor:
    """The first ``max_bytes`` bytes of the standard library's sources, in a fixed order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).long()


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


class ByteLM(pl.LightningModule):
    def __init__(self, context: int = 64, width: int = 64, layers: int = 2, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(256, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        layer = nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=4 * width, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(width, 256)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens) + self.position[: tokens.shape[1]]
        return self.head(self.blocks(hidden, mask=self.causal, is_causal=True))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        loss = nn.functional.cross_entropy(self(tokens).flatten(0, 1), targets.flatten())
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):  # noqa: ANN201
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        total = lightning_accum.estimated_stepping_batches(self.trainer)  # knows the ramp
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=self.hparams.lr, total_steps=int(total))
        return [optimizer], [{"scheduler": scheduler, "interval": "step"}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max_steps", type=int, default=200)
    parser.add_argument("--micro_batch_size", type=int, default=8)
    parser.add_argument("--corpus_bytes", type=int, default=2_000_000)
    args = parser.parse_args()

    pl.seed_everything(0)
    data = DataLoader(ByteWindows(read_corpus(args.corpus_bytes), context=64), batch_size=args.micro_batch_size)
    accumulation = AccumulationScheduler(
        target_batch_size=64, ramp_start_batch_size=16, ramp_increment=16, ramp_samples=3_000, lr_scaling="sqrt"
    )
    trainer = pl.Trainer(accelerator="cpu", max_steps=args.max_steps, callbacks=[accumulation], log_every_n_steps=5)
    trainer.fit(ByteLM(), data)
    print(
        f"trained {trainer.global_step} optimizer steps over {accumulation.samples_seen} samples;"
        f" final factor {accumulation.factor}; final loss {trainer.callback_metrics['train/loss'].item():.3f}"
    )


if __name__ == "__main__":
    main()
