"""Exactness over 200 optimizer steps: maximum weight deviation from a plain-PyTorch big-batch reference.

    python benchmarks/exactness.py                 # prints a table, writes exactness.json

An MLP trains for 4 epochs of 203 micro-batches of 4 samples (the last micro-batch of each epoch holds 2) with factor
4: 51 windows an epoch, the last of them 3 micro-batches long, 204 optimizer steps in all. The reference takes one SGD
step per window on the mean of its micro-batches' mean losses, in plain PyTorch. lightning_accum and stock
``Trainer(accumulate_grad_batches=4)`` are compared with it in fp32 and fp64; stock under-weights each epoch's last
window, by 3/4.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accum import AccumulationScheduler

SAMPLES, MICRO_BATCH, FACTOR, EPOCHS, LR = 810, 4, 4, 4, 0.05


def make_net(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1)).to(dtype)


def make_data(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 8, generator=generator)
    y = torch.sin(x.sum(1, keepdim=True)) + 0.1 * torch.randn(SAMPLES, 1, generator=generator)
    return x.to(dtype), y.to(dtype)


class Module(pl.LightningModule):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.net = make_net(dtype)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def reference(dtype: torch.dtype) -> list[torch.Tensor]:
    x, y = make_data(dtype)
    net = make_net(dtype)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    batches = [(x[i : i + MICRO_BATCH], y[i : i + MICRO_BATCH]) for i in range(0, SAMPLES, MICRO_BATCH)]
    for _ in range(EPOCHS):
        for start in range(0, len(batches), FACTOR):
            window = batches[start : start + FACTOR]
            optimizer.zero_grad()
            (sum(nn.functional.mse_loss(net(bx), by) for bx, by in window) / len(window)).backward()
            optimizer.step()
    return [p.detach() for p in net.parameters()]


def trained(dtype: torch.dtype, ours: bool) -> tuple[list[torch.Tensor], int]:
    extra: dict[str, Any] = (
        {"callbacks": [AccumulationScheduler({0: FACTOR}, log_metrics=False)]}
        if ours
        else {"accumulate_grad_batches": FACTOR}
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=EPOCHS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        precision="64-true" if dtype == torch.float64 else "32-true",
        **extra,
    )
    module = Module(dtype)
    trainer.fit(module, DataLoader(TensorDataset(*make_data(dtype)), batch_size=MICRO_BATCH))
    return [p.detach() for p in module.parameters()], trainer.global_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    rows = []
    for dtype, name in ((torch.float32, "fp32"), (torch.float64, "fp64")):
        expected = reference(dtype)
        for ours in (True, False):
            weights, steps = trained(dtype, ours)
            deviation = max((a - b).abs().max().item() for a, b in zip(weights, expected, strict=True))
            rows.append(
                {"dtype": name, "run": "lightning_accum" if ours else "stock", "steps": steps, "max": deviation}
            )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "exactness.json").write_text(json.dumps(rows, indent=2))
    lines = [
        "| dtype | run | optimizer steps | max abs weight deviation from the reference |",
        "| --- | --- | ---: | ---: |",
    ]
    lines += [f"| {r['dtype']} | {r['run']} | {r['steps']} | {r['max']:.1e} |" for r in rows]
    print("\n" + "\n".join(lines) + f"\n\nwrote {args.out / 'exactness.json'}")


if __name__ == "__main__":
    main()
