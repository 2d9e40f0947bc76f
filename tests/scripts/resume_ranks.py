"""A fit with ``AccumulationScheduler(target_batch_size=32)`` on 1 or 2 CPU processes, checkpointed, killed and resumed
on another number of processes, as a user would write it (tests/test_resume_ranks.py).

    python tests/scripts/resume_ranks.py OUT_DIR NAME whole W          # uninterrupted on W processes; writes
                                                                      # OUT_DIR/NAME/step=4.ckpt, step=8.ckpt, ...
                                                                      # and OUT_DIR/NAME/epochs/epoch=0.ckpt, ...
    python tests/scripts/resume_ranks.py OUT_DIR NAME kill W           # writes OUT_DIR/NAME/last.ckpt every 2 steps
                                                                      # and SIGKILLs itself inside the window of step 7
    python tests/scripts/resume_ranks.py OUT_DIR NAME resume W CKPT    # resumes CKPT on W processes

A last argument ``--config CONFIG`` trains another of CONFIGS (``target``, the default, is the one above): ``fixed``, a
fixed factor 4 and no target batch (a global batch of 32 on two processes, 16 on one), and ``adaptive``, adaptive
growth from factor 2 (global batch 16 on two processes), whose whole run writes a checkpoint every 2 steps
(``step=2.ckpt``, ``step=4.ckpt``, ...) so that some hold a grown factor. ``kill`` trains ``target`` only.

256 samples in loader batches of 4 (``shuffle=False``), a global batch of 32 samples: factor 8 on one process, 4 on
two; 8 optimizer steps an epoch, 2 epochs. On two processes Lightning gives the loader a shuffled DistributedSampler
(seed 0 from ``seed_everything``). The dataset holds each sample's index, so every rank records which samples each
optimizer step trained on. Each rank writes ``OUT_DIR/NAME.rank<r>.json``: the world size, the optimizer step the
fit started from and ended at, the dataset indices of each step (by the step's 0-based index; this rank's share), the
window the fit's first batch opened (its size, and the adaptive factor under ``adaptive``), and the final weights. The
killed run writes its file just before it dies; a fit that raises writes it with the error, then raises it again.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lightning_accum import AccumulationScheduler, DDPAccumulationStrategy  # noqa: E402
from tests.helpers import make_data, make_net  # noqa: E402

SAMPLES, MICRO_BATCH, GLOBAL_BATCH, EPOCHS = 256, 4, 32, 2  # 8 optimizer steps an epoch on any number of processes
LR, MOMENTUM = 0.1, 0.5  # momentum: the optimizer's state must come from the checkpoint too
SEED, MODEL_SEED = 0, 1  # seed_everything's (the DistributedSampler's), and the uninterrupted model's weights
CHECKPOINT_EVERY = 4  # step=4: half of epoch 0 (128 samples), at a window boundary; step=8: epoch 0's end
KILL_STEP, KILL_MICRO_STEP = 6, 2  # killed after the backward of the third micro-step of the window of step 7
LAST_EVERY = 2  # the killed run's last.ckpt: written at step 6, in the middle of epoch 0
ADAPTIVE_CHECKPOINT_EVERY = 2  # the adaptive whole run's checkpoints: the first ones after the factor grows

# name -> AccumulationScheduler arguments
CONFIGS: dict[str, dict[str, Any]] = {
    "target": dict(target_batch_size=GLOBAL_BATCH, normalize_by="sample"),
    # factor 4 x micro-batch 4 x 2 processes: 32 samples on two processes, 16 on one
    "fixed": dict(scheduling={0: 4}, normalize_by="sample"),
    # tests/scripts/resume_run.py's "adaptive": from factor 2 (16 samples on two processes, 8 on one), it grows
    # 2 -> 4 from optimizer step 8 and 4 -> 8 from step 14 on either number of processes (with this data and seed):
    # step=10.ckpt is the first checkpoint that holds a grown factor
    "adaptive": dict(
        scheduling={0: 2},
        normalize_by="sample",
        noise_scale=True,
        noise_scale_decay=0.8,
        noise_scale_interval=2,
        adaptive=True,
        adaptive_target=64.0,
        adaptive_max_factor=8,
        adaptive_confidence=0.6,
    ),
}


class IndexedRegression(pl.LightningModule):
    """The helpers' regression net on ``(index, x, y)`` batches; records the indices each optimizer step trains on."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.net = make_net(seed)
        self.steps: dict[int, list[int]] = {}  # 0-based optimizer step -> this rank's dataset indices
        self.start_step = -1

    def on_train_start(self) -> None:
        self.start_step = self.trainer.global_step  # after the checkpoint's restore

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        index, x, y = batch
        # global_step counts the steps taken: the micro-batch belongs to the window of the next one
        self.steps.setdefault(self.trainer.global_step, []).extend(index.tolist())
        return nn.functional.mse_loss(self.net(x), y)  # the mean over the micro-batch

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)


class FirstWindow(pl.Callback):
    """The window the fit's first batch opens: its size (``AccumulationScheduler.factor``) and the adaptive factor.

    Placed after the scheduler, whose ``on_train_batch_start`` opens the window first.
    """

    def __init__(self, scheduler: AccumulationScheduler) -> None:
        self.scheduler = scheduler
        self.seen: dict[str, int | None] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        if not self.seen:
            features = self.scheduler.features
            adaptive = features["adaptive"].factor if "adaptive" in features else None  # type: ignore[attr-defined]
            self.seen = {"factor": self.scheduler.factor, "adaptive": adaptive}


def dump(
    trainer: pl.Trainer,
    module: IndexedRegression,
    out: Path,
    name: str,
    first: FirstWindow | None = None,
    error: str | None = None,
) -> None:
    record = {
        "world_size": trainer.world_size,
        "start_step": module.start_step,
        "global_step": trainer.global_step,
        "steps": module.steps,
        "first_window": first.seen if first is not None else {},
        "error": error,
        "weights": {key: param.detach().flatten().tolist() for key, param in module.net.named_parameters()},
    }
    (out / f"{name}.rank{trainer.global_rank}.json").write_text(json.dumps(record))


class KillInsideAWindow(pl.Callback):
    """SIGKILL, as a preempted job dies, in the middle of the window of step KILL_STEP + 1 (every rank at once)."""

    def __init__(self, out: Path, name: str) -> None:
        self.out, self.name = out, name

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        micro_steps = GLOBAL_BATCH // (MICRO_BATCH * trainer.world_size)  # a window's micro-steps on each rank
        if trainer.fit_loop.epoch_loop.batch_idx == KILL_STEP * micro_steps + KILL_MICRO_STEP:
            assert trainer.global_step == KILL_STEP
            dump(trainer, pl_module, self.out, self.name)  # type: ignore[arg-type]
            sys.stdout.flush()
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    args = sys.argv[1:]
    config = "target"
    if "--config" in args:
        at = args.index("--config")
        config = args.pop(at + 1)
        del args[at]
    out, name, mode, world = Path(args[0]), args[1], args[2], int(args[3])
    assert mode != "kill" or config == "target", "KillInsideAWindow counts the windows of target_batch_size=32"
    pl.seed_everything(SEED)
    scheduler = AccumulationScheduler(**CONFIGS[config])
    first = FirstWindow(scheduler)
    callbacks: list[pl.Callback] = [scheduler, first]
    if mode == "whole":
        every = ModelCheckpoint(
            dirpath=out / name,
            filename="{step}",
            save_top_k=-1,
            every_n_train_steps=ADAPTIVE_CHECKPOINT_EVERY if config == "adaptive" else CHECKPOINT_EVERY,
        )
        # and at each epoch's end, from on_train_epoch_end (after its last batch's on_train_batch_end)
        epochs = ModelCheckpoint(
            dirpath=out / name / "epochs", filename="{epoch}", save_top_k=-1, save_on_train_epoch_end=True
        )
        callbacks += [every, epochs]
    elif mode == "kill":
        last = ModelCheckpoint(dirpath=out / name, save_last=True, save_top_k=0, every_n_train_steps=LAST_EVERY)
        callbacks += [last, KillInsideAWindow(out, name)]
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=DDPAccumulationStrategy() if world > 1 else "auto",
        max_epochs=EPOCHS,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=mode != "resume",
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    # resumed: another seed, so that only the checkpoint can give the weights the run goes on from
    module = IndexedRegression(MODEL_SEED if mode != "resume" else 99)
    x, y = make_data(SAMPLES)
    loader = DataLoader(TensorDataset(torch.arange(SAMPLES), x, y), batch_size=MICRO_BATCH, shuffle=False)
    try:
        trainer.fit(module, loader, ckpt_path=args[4] if mode == "resume" else None)
    except Exception as error:  # what the fit had done when it raised: the steps it took, the weights it left
        dump(trainer, module, out, name, first, error=f"{type(error).__name__}: {error}")
        raise
    if mode == "kill":
        raise SystemExit("the run was not killed")
    dump(trainer, module, out, name, first)
    # every record is written: leave without the interpreter's C++ teardown, which torch 2.13 can abort on a loaded
    # machine after gloo runs (tests/scripts/two_ranks.py)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
