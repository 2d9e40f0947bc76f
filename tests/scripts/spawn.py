"""Two processes started with ``start_method="spawn"`` (Lightning pickles the Trainer, its callbacks and strategy).

    python tests/scripts/spawn.py OUT_DIR

Trains with AccumulationScheduler and every option that keeps objects (a ramp, LR scaling with warmup, token
weighting, the noise scale, adaptive growth) under DDPAccumulationStrategy(start_method="spawn"), and a manual
optimization module holding a ManualAccumulation; each rank writes ``OUT_DIR/<name>.rank<r>.json`` with its
optimizer steps and weights.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lightning_accum import AccumulationScheduler, DDPAccumulationStrategy, ManualAccumulation  # noqa: E402
from tests.helpers import DictDataset, RegressionModule, make_tokens, token_loss  # noqa: E402


class TokenModule(RegressionModule):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return token_loss(self.net, batch["features"], batch["labels"])


class ManualTokenModule(TokenModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.accumulation = ManualAccumulation({0: 2, 2: 4}, unit="step")

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        with self.accumulation.micro_step(self) as micro:
            self.manual_backward(micro.scale(super().training_step(batch, batch_idx)))
        if micro.should_step:
            optimizer.step()
            optimizer.zero_grad()


class Record(pl.Callback):
    """Each spawned rank writes its optimizer steps and weights (the main process's Trainer does not count them)."""

    def __init__(self, name: str, out: Path) -> None:
        self.name, self.out = name, out

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        weights = [p.detach().flatten().tolist() for p in pl_module.parameters()]
        record = {"optimizer_steps": trainer.global_step, "weights": weights}
        (self.out / f"{self.name}.rank{trainer.global_rank}.json").write_text(json.dumps(record))


def run(name: str, out: Path) -> None:
    callbacks: list[pl.Callback] = [Record(name, out)]
    if name == "every_option":
        callbacks.append(
            AccumulationScheduler(
                target_batch_size=32,
                ramp_start_batch_size=8,
                ramp_increment=8,
                ramp_samples=64,
                normalize_by="token",
                lr_scaling="sqrt",
                lr_warmup_steps=2,
                noise_scale=True,
                adaptive=True,
            )
        )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPAccumulationStrategy(start_method="spawn"),
        max_epochs=2,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = TokenModule() if name == "every_option" else ManualTokenModule()
    try:
        trainer.fit(module, torch.utils.data.DataLoader(DictDataset(make_tokens(64)), batch_size=4))
    except torch.multiprocessing.ProcessExitedException as error:
        # torch 2.13 can abort a spawned gloo worker at interpreter exit on a loaded machine ("terminate called
        # without an active exception": a C++ thread still joinable when static objects are destroyed; see
        # fsdp1_sync.py). Only that abort, after both ranks wrote their records, is let through: the test checks them
        written = all((out / f"{name}.rank{rank}.json").exists() for rank in (0, 1))
        if error.signal_name != "SIGABRT" or not written:
            raise
        print(f"{name}: a worker aborted at exit after its fit ({error})", file=sys.stderr)


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for name in ("every_option", "manual"):
        run(name, out)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as two_ranks.py: skip torch's exit-time teardown after gloo
