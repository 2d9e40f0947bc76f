"""A LightningModule for `lightning-accum plan --probe`: its activations grow with the micro-batch."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn


class WideNet(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            *(nn.Sequential(nn.Linear(512, 4096), nn.GELU(), nn.Linear(4096, 512)) for _ in range(2))
        )
        self.example_input_array = torch.randn(4, 512)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
