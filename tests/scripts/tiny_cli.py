"""A LightningCLI with a tiny model, using lightning_accum's parser, for the error-message tests.

    python tests/scripts/tiny_cli.py fit --config CONFIG.yaml
    LIGHTNING_NAMESPACE=pytorch_lightning python tests/scripts/tiny_cli.py fit --config CONFIG.yaml

A correct configuration trains a 4 -> 1 linear model on 64 random samples in about a second (with
``--trainer.fast_dev_run=true``). A wrong value is rejected while the arguments are parsed (or, for a combination no
single type rejects, while the classes are built), before anything trains: the process exits with status 2 and the
error's last lines name the key and the value (``tests/test_cli_errors.py``, which also calls :func:`main` in its own
process for more cases).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

if os.environ.get("LIGHTNING_NAMESPACE") == "pytorch_lightning":  # as a user of the standalone package writes it
    import pytorch_lightning as pl
    from pytorch_lightning.cli import LightningCLI

    from lightning_accum.pytorch_lightning import AccumulationArgumentParser
else:
    import lightning.pytorch as pl
    from lightning.pytorch.cli import LightningCLI

    from lightning_accum.cli import AccumulationArgumentParser


class TinyModel(pl.LightningModule):
    """A linear regression, ``width`` inputs to one output."""

    def __init__(self, width: int = 4, lr: float = 0.1) -> None:
        super().__init__()
        self.layer = nn.Linear(width, 1)
        self.lr = lr

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.mse_loss(self.layer(inputs), targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class TinyData(pl.LightningDataModule):
    """64 random samples of ``width`` features, in micro-batches of ``batch_size``."""

    def __init__(self, batch_size: int = 4, width: int = 4) -> None:
        super().__init__()
        self.batch_size = batch_size
        generator = torch.Generator().manual_seed(0)
        self.dataset = TensorDataset(
            torch.randn(64, width, generator=generator), torch.randn(64, 1, generator=generator)
        )

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size)


def main(args: list[str] | None = None) -> LightningCLI:
    return LightningCLI(
        TinyModel, TinyData, parser_class=AccumulationArgumentParser, seed_everything_default=0, args=args
    )


if __name__ == "__main__":
    main()
