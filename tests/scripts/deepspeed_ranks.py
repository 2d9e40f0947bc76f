"""Train the tiny regression model under DeepSpeed on 2 CPU processes (gloo), as a user would, and record it.

    python tests/scripts/deepspeed_ranks.py OUT_DIR COMMAND:STAGE ...   # each in turn, in the same two processes

    runs:S     the configurations of CONFIGS (and STAGE_2) under ZeRO stage S (runs:S:NAME: that one only)
    killed:S   the same, then checkpoints and SIGKILL mid-window (so it comes last)
    resume:S   resume from each checkpoint the killed run of stage S wrote

``Trainer(devices=2)`` launches the second process itself; a process costs seconds of imports, so one launch runs
several stages. Each configuration runs with a fresh Trainer and model; every rank writes
``OUT_DIR/zero<S>/<name>.rank<r>.json``: Lightning's ``global_step``, DeepSpeed's ``global_steps`` and
``global_samples``, the micro-steps, and (rank 0) the final full fp32 weights. DeepSpeed's ``deepspeed_shm_comm`` op
is switched off before it is built (it needs g++ and 90 s), so collectives run on plain gloo.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import deepspeed.ops
import torch
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from two_ranks import NUM_SAMPLES, Regression, make_data  # noqa: E402

from lightning_accum import ManualAccumulation  # noqa: E402

# the callback from the module LIGHTNING_ACCUM_CALLBACK names: lightning_accum (as imported today) by default, or
# lightning_accum.pytorch_lightning (what pytorch_lightning before 2.6 needs: it checks callbacks against its Callback)
AccumulationScheduler = importlib.import_module(
    os.environ.get("LIGHTNING_ACCUM_CALLBACK", "lightning_accum")
).AccumulationScheduler
from lightning_accum.strategies.deepspeed import _DeepSpeedOnCPU  # noqa: E402
from tests.helpers import DictDataset, ResumableLoader, make_tokens  # noqa: E402

if os.environ.get("LIGHTNING_NAMESPACE") == "pytorch_lightning":  # as a user of the standalone package writes it
    import pytorch_lightning as pl
    from pytorch_lightning.loggers import CSVLogger

    from lightning_accum.pytorch_lightning import DeepSpeedAccumulationStrategy
else:
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    from lightning_accum import DeepSpeedAccumulationStrategy

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # plain gloo, no C++ build

MID_WINDOW = (1, 4)  # (epoch, batch) inside a window of factor 3 (windows start at batches 0, 3, 6)
BOUNDARY_STEP = 4  # a checkpoint written as this optimizer step ends


class StockOnCPU(_DeepSpeedOnCPU, pl.strategies.DeepSpeedStrategy):
    """Lightning's own DeepSpeedStrategy, with only its three refusals of CPU lifted (to show its double division)."""


class Checkpoints(pl.Callback):
    """Writes ``mid`` inside a window and ``boundary`` at a window's end; then kills this rank, if asked."""

    def __init__(self, directory: Path, kill: bool) -> None:
        self.directory, self.kill = directory, kill

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        position = (trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_idx)
        if trainer.global_step == BOUNDARY_STEP and not (self.directory / "boundary").exists():
            trainer.save_checkpoint(self.directory / "boundary")
        if position == MID_WINDOW:
            trainer.save_checkpoint(self.directory / "mid")
        if self.kill and position == (MID_WINDOW[0], MID_WINDOW[1] + 1):  # still inside the window
            trainer.strategy.barrier()
            os.kill(os.getpid(), signal.SIGKILL)


class Validated(Regression):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch), sync_dist=True)


def full_weights(module: torch.nn.Module) -> dict[str, list[float]]:
    from deepspeed.utils import safe_get_full_fp32_param

    return {name: safe_get_full_fp32_param(p).flatten().tolist() for name, p in module.named_parameters()}


def fit(stage: int, name: str, out: Path, ckpt_path: str | None = None, **options: Any) -> None:
    callbacks: list[pl.Callback] = list(options.pop("callbacks", []))
    trainer_args: dict[str, Any] = {"precision": options.pop("precision", "32-true"), "logger": False}
    if options.pop("csv", False):  # the callback's metrics, logged at every optimizer step
        trainer_args |= {"logger": CSVLogger(out, name=name, version=0), "log_every_n_steps": 1}
    manual = ManualAccumulation(options.pop("manual")) if "manual" in options else None
    if "factor" in options:  # no AccumulationScheduler: Trainer(accumulate_grad_batches=k)
        trainer_args["accumulate_grad_batches"] = options.pop("factor")
    elif manual is None:
        logs = "log_every_n_steps" in trainer_args
        arguments = {"log_metrics": logs, "grad_accum_dtype": None, **options.pop("args")}
        callbacks.insert(0, AccumulationScheduler(**arguments))
    stock = options.pop("stock", False)
    strategy = StockOnCPU(stage=stage) if stock else DeepSpeedAccumulationStrategy(stage=stage)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=2,
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_args,
    )
    cut_at = options.pop("cut_at", None)  # on_train_batch_start returns -1 there: the epoch ends in a window
    validate = options.pop("validate", False)  # trainer.validate after the fit (DeepSpeed's inference engine)
    model = (Validated if validate else Regression)(
        shard=False, manual=manual, cut_at=None if cut_at is None else tuple(cut_at)
    )
    data: Any = DictDataset(make_tokens(NUM_SAMPLES)) if options.pop("tokens", False) else TensorDataset(*make_data())
    record: dict[str, Any] = {}
    try:
        trainer.fit(model, ResumableLoader(data, batch_size=4), ckpt_path=ckpt_path)  # resumes mid-epoch
    except (RuntimeError, ValueError) as error:
        record["raised"] = str(error)
    engine = trainer.strategy.model if hasattr(trainer.strategy.model, "global_steps") else None
    record |= {
        "optimizer_steps": trainer.global_step,
        "micro_steps": trainer.fit_loop.epoch_loop.total_batch_idx + 1,
        "ds_global_steps": getattr(engine, "global_steps", None),
        "ds_global_samples": getattr(engine, "global_samples", None),
        "strategy_class": f"{type(trainer.strategy).__module__}.{type(trainer.strategy).__name__}",
        "callback_classes": [f"{type(c).__module__}.{type(c).__name__}" for c in callbacks],
    }
    if "raised" not in record:
        record["weights"] = full_weights(model.net)  # a collective under ZeRO-3: every rank takes part
    if validate:
        (metrics,) = trainer.validate(model, ResumableLoader(data, batch_size=4), verbose=False)
        record["val_loss"] = metrics["val_loss"]
    (out / f"{name}.rank{trainer.global_rank}.json").write_text(json.dumps(record))


CONFIGS: dict[str, dict[str, Any]] = {
    # each epoch's last window holds the 2 micro-steps left; validated after the fit
    "k3": {"args": {"scheduling": {0: 3}}, "csv": True, "validate": True},
    "step_schedule": {"args": {"scheduling": {0: 2, 3: 4}, "unit": "step"}},  # factor 4 from the middle of epoch 0
    "token_k3": {"args": {"scheduling": {0: 3}, "normalize_by": "token"}, "tokens": True},
    # epoch 0 ends one micro-step into its second window: that window is dropped with its gradients
    "last_cut": {"args": {"scheduling": {0: 3}}, "cut_at": [0, 4]},
}
STAGE_2 = {
    # 8 samples a micro-step; the global batch 8 -> 16 -> 24 -> 32, every 16 samples
    "ramp": {"args": {"target_batch_size": 32, "ramp_start_batch_size": 8, "ramp_increment": 8, "ramp_samples": 48}},
    "lr_sqrt": {"args": {"scheduling": {0: 2, 3: 4}, "unit": "step", "lr_scaling": "sqrt", "lr_warmup_steps": 2}},
    "split_k3": {"args": {"scheduling": {0: 3}, "micro_batch_size": 2}},
    "plain_k2": {"factor": 2},  # no callback: Trainer(accumulate_grad_batches=2)
    "stock_k2": {"factor": 2, "stock": True},  # Lightning's DeepSpeedStrategy: each loss divided twice
    "noise_scale": {"args": {"scheduling": {0: 2}, "noise_scale": True}},
    "stock_callback": {"args": {"scheduling": {0: 2}}, "stock": True},  # refused: it accumulates by itself
    "manual_k3": {"manual": 3},  # ManualAccumulation (no callback): refused
    # DeepSpeed accumulates bf16 gradients itself: float32 accumulation asked of the callback is refused
    "bf16_float32": {"args": {"scheduling": {0: 2}, "grad_accum_dtype": "float32"}, "precision": "bf16-true"},
}


def main() -> None:
    root = Path(sys.argv[1])
    for step in sys.argv[2:]:
        command, stage, *only = step.split(":")
        run(command, int(stage), root / f"zero{stage}", only)
    os._exit(0)  # torch 2.13's gloo may abort a worker at interpreter exit, after the records are written


def run(command: str, stage: int, out: Path, only: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if command in ("runs", "killed"):
        configs = CONFIGS | (STAGE_2 if stage == 2 else {})
        for name, options in configs.items():
            if only and name not in only:
                continue
            kept = [Checkpoints(out / name, kill=False)] if name == "lr_sqrt" else []  # the LR DeepSpeed saves
            fit(stage, name, out, callbacks=kept, **json.loads(json.dumps(options), object_hook=_int_keys))
    if command == "killed":  # the uninterrupted run, then the same run killed in a window after two checkpoints
        fit(stage, "full", out, args={"scheduling": {0: 3}})
        fit(stage, "killed", out, args={"scheduling": {0: 3}}, callbacks=[Checkpoints(out / "killed", kill=True)])
    if command == "resume":
        for written in ("boundary", "mid"):
            ckpt = str(out / "killed" / written)
            fit(stage, f"resumed_{written}", out, ckpt_path=ckpt, args={"scheduling": {0: 3}})


def _int_keys(mapping: dict[str, Any]) -> dict[Any, Any]:
    return {int(key) if key.isdigit() else key: value for key, value in mapping.items()}


if __name__ == "__main__":
    main()
