"""One training run per stateful configuration, to be stopped and resumed (tests/test_resume_matrix.py).

    python tests/scripts/resume_run.py NAME OUT_DIR

trains configuration NAME with a ``ModelCheckpoint`` that writes ``last.ckpt`` every 2 optimizer steps and kills
itself with SIGKILL in the middle of a window in epoch 1 (after the backward of batch 5), as a preempted job dies.
The test resumes from ``last.ckpt`` and compares with the uninterrupted run.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lightning_accum import AccumulationScheduler, SampleDrivenLR, cached, estimated_stepping_batches  # noqa: E402
from tests.helpers import (  # noqa: E402
    DictDataset,
    RegressionModule,
    ResumableLoader,
    make_data,
    make_tokens,
    token_loss,
    trainer,
)

EPOCHS, SAMPLES, MICRO_BATCH = 3, 48, 4  # 12 micro-batches an epoch
KILL_AT = (1, 5)  # (epoch, batch): SIGKILL after this micro-step's backward

# name -> AccumulationScheduler arguments; every configuration keeps state across a resume
CONFIGS: dict[str, dict[str, Any]] = {
    "epoch_unit": dict(scheduling={0: 2, 1: 3, 2: 5}, unit="epoch"),
    "step_unit": dict(scheduling={0: 2, 4: 3, 9: 5}, unit="step"),
    "sample_unit": dict(scheduling={0: 1, 24: 3, 100: 2}, unit="sample"),
    "ramp": dict(target_batch_size=16, ramp_start_batch_size=4, ramp_increment=4, ramp_samples=64),
    "lr_warmup": dict(scheduling={0: 2, 3: 4}, unit="step", lr_scaling="sqrt", lr_warmup_steps=3),
    # every third window measured: measured windows before and after the interruption
    "noise_scale": dict(scheduling={0: 2}, noise_scale=True, noise_scale_decay=0.5, noise_scale_interval=3),
    # the module's LR schedule is a SampleDrivenLR (make_module): its position is state too
    "adaptive": dict(
        scheduling={0: 2},
        noise_scale=True,
        noise_scale_decay=0.8,
        noise_scale_interval=2,
        adaptive=True,
        adaptive_target=64.0,
        adaptive_max_factor=8,
        adaptive_confidence=0.6,  # grows 2 -> 4 at step 8, just before the kill, on fresh evidence that is state too
        lr_scaling="linear",
    ),
    # from factor 1: measured windows run as two halves; the factor grows and comes down again
    "adaptive_from_1": dict(
        noise_scale=True,
        noise_scale_decay=0.8,
        noise_scale_interval=1,
        adaptive=True,
        adaptive_target=16.0,
        adaptive_max_factor=6,
        adaptive_confidence=0.6,
        adaptive_shrink=True,
        lr_scaling="sqrt",
    ),
    "token": dict(scheduling={0: 3, 1: 2}, normalize_by="token"),
    # a loss that couples its batch's rows (lightning_accum.cached): loader batches are never split, chunks of 2
    "coupled": dict(scheduling={0: 3}, micro_batch_size=2),
    "token_unit": dict(scheduling={0: 1, 30: 3, 120: 2}, unit="token"),
    "token_ramp": dict(target_batch_size=16, ramp_start_batch_size=4, ramp_increment=4, ramp_samples=90, unit="token"),
    "everything": dict(
        target_batch_size=16,
        ramp_start_batch_size=8,
        ramp_increment=8,
        ramp_samples=48,
        lr_scaling="sqrt",
        lr_warmup_steps=2,
        noise_scale=True,
        normalize_by="token",
    ),
}


class SampleDrivenModule(RegressionModule):
    """SGD with a linear decay spread over the run's samples (lightning_accum.SampleDrivenLR)."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        steps = int(estimated_stepping_batches(self.trainer))
        decay = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_iters=steps)
        return [optimizer], [{"scheduler": SampleDrivenLR(decay), "interval": "step"}]


class TokenModule(RegressionModule):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return token_loss(self.net, batch["features"], batch["labels"])


class CoupledModule(RegressionModule):
    """A contrastive loss over the batch: each row's score against every row's target, the row's own the positive."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = cached(self.net, x) @ y.T
        return nn.functional.cross_entropy(logits, torch.arange(len(x)))


def _tokens(name: str) -> bool:
    return CONFIGS[name].get("normalize_by") == "token" or CONFIGS[name].get("unit") == "token"


def make_module(name: str, seed: int = 1) -> pl.LightningModule:
    torch.manual_seed(0)
    if _tokens(name):
        module: pl.LightningModule = TokenModule(seed=seed)
    elif name.startswith("adaptive"):
        module = SampleDrivenModule(seed=seed)
    elif name == "coupled":
        module = CoupledModule(seed=seed)
    else:
        module = RegressionModule(seed=seed)
    return module


def make_loader(name: str) -> ResumableLoader:
    if _tokens(name):
        data: Any = DictDataset(make_tokens(SAMPLES))
    else:
        data = TensorDataset(*make_data(SAMPLES))
    return ResumableLoader(data, batch_size=MICRO_BATCH)


def make_callback(name: str) -> AccumulationScheduler:
    return AccumulationScheduler(**CONFIGS[name])


def full_weights(module: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


class KillMidWindow(Callback):
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if (trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_idx) == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    name, out = sys.argv[1], Path(sys.argv[2])
    checkpoints = ModelCheckpoint(dirpath=out, save_last=True, save_top_k=0, every_n_train_steps=2)
    run = trainer([make_callback(name), checkpoints, KillMidWindow()], max_epochs=EPOCHS, enable_checkpointing=True)
    run.fit(make_module(name), make_loader(name))
    raise SystemExit("the run was not killed")


if __name__ == "__main__":
    main()
