"""FSDP2 checkpoints written and read with the Accumulator in the state (Fabric) and with the callback (Trainer), on 2
CPU processes (gloo), and the runs they resume against the run never interrupted.

    python tests/scripts/fsdp2_checkpoints.py OUT_DIR uninterrupted,saved,trainer_uninterrupted,trainer_saved
    python tests/scripts/fsdp2_checkpoints.py OUT_DIR loaded,trainer_resumed    # new processes, from those saves

Each mode runs once per checkpoint kind of KINDS, each time with a fresh Fabric (or Trainer), model and optimizer, in
the same two processes (``Fabric(accelerator="cpu", devices=2)`` launches the second itself; a process costs seconds
of imports):

- ``uninterrupted``: EPOCHS epochs of the documented loop, under ``ModelParallelStrategy`` (``fully_shard`` on TinyLM's
  block, head and the root), factor 3 over each rank's own 8 micro-batches (3 optimizer steps an epoch).
- ``saved``: ``fabric.save`` before the first optimizer step, then one epoch and ``fabric.save`` again, the model,
  optimizer and accumulator in the state. Torch's distributed checkpoint (``get_optimizer_state_dict``) initializes
  an optimizer without state by calling ``optimizer.step()`` on zero gradients at LR 0 and then puts the LRs back:
  before any step, and at every save of a stateless optimizer (plain SGD keeps nothing).
- ``loaded``: the Accumulator created first, as documented, then ``fabric.load`` of the epoch's checkpoint into the
  same state (its optimizer is fresh: the same zero-LR step again), and the loop from ``accumulator.epoch`` on.
- ``trainer_uninterrupted``, ``trainer_saved``, ``trainer_resumed``: the same model in a LightningModule sharded in
  ``configure_model``, ``ModelParallelAccumulationStrategy`` and ``AccumulationScheduler({0: 3})``: EPOCHS epochs;
  one epoch and ``trainer.save_checkpoint``; ``fit(ckpt_path=...)`` to EPOCHS.

Every rank writes ``OUT_DIR/<mode>_<kind>.rank<r>.json``: what the accumulator (or Trainer) said where the run was,
each param group's LR after each save and load, the error a save or load raised if any, and the full weights.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader

from lightning_accum.compat.torch import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from fabric_common import TinyLM, leave, make_pairs, mean_loss, micro_batches  # noqa: E402

from lightning_accum import AccumulationScheduler, ModelParallelAccumulationStrategy  # noqa: E402
from lightning_accum.fabric import Accumulator  # noqa: E402

EPOCHS, ROWS, PAIRS = 2, 3, 24  # each rank: 8 micro-batches of 3, windows of 3, 3 and 2
# the checkpoint kind -> (save_distributed_checkpoint, the optimizer's momentum, its LR). Plain SGD keeps no state, so
# every save and load of it takes torch's zero-LR step; SGD with momentum keeps a buffer per parameter once it stepped,
# so its save after the epoch skips that step. (The buffer is the first gradient either way, after a zero one or not:
# the save before the first step leaves the run as it was. AdamW would count the zero-LR step in its bias
# correction.) Plain SGD saves sharded: Lightning 2.6.6 cannot load a full checkpoint of an optimizer without state
# (`_rekey_optimizer_state_if_needed` reads the first key of its empty state: IndexError).
KINDS: dict[str, tuple[bool, float, float]] = {"sharded": (True, 0.0, 0.5), "full": (False, 0.9, 0.1)}


def rank_pairs(rank: int) -> list[dict[str, torch.Tensor]]:
    return make_pairs(PAIRS, seed=10 + rank)  # each rank its own pairs (ragged: different token counts)


def shard_layers(model: nn.Module, mesh: Any) -> nn.Module:
    for layer in (model.block, model.head):
        fully_shard(layer, mesh=mesh["data_parallel"])
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def optimizer_for(kind: str, parameters: Any) -> torch.optim.Optimizer:
    _, momentum, lr = KINDS[kind]
    return torch.optim.SGD(parameters, lr=lr, momentum=momentum)


def full_weights(model: nn.Module) -> dict[str, list[float]]:
    weights = {}
    for name, param in model.named_parameters():
        tensor = param.full_tensor() if hasattr(param, "full_tensor") else param  # a DTensor under FSDP2
        weights[name.removeprefix("_forward_module.").removeprefix("module.")] = tensor.detach().flatten().tolist()
    return weights


def lrs(optimizer: Any) -> list[float]:
    return [float(group["lr"]) for group in optimizer.param_groups]


def failure(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"


def checkpoint(out: Path, kind: str, name: str) -> Path:
    return out / f"{name}_{kind}.ckpt"  # sharded: a folder of shards; full: one file


def write(out: Path, mode: str, kind: str, rank: int, record: dict) -> None:
    (out / f"{mode}_{kind}.rank{rank}.json").write_text(json.dumps(record))


# ------------------------------------------------------------------ Fabric


def set_up(kind: str) -> tuple[Fabric, Any, Any, Accumulator, list[dict[str, torch.Tensor]]]:
    strategy = ModelParallelStrategy(
        parallelize_fn=shard_layers,
        data_parallel_size=2,
        tensor_parallel_size=1,
        save_distributed_checkpoint=KINDS[kind][0],
    )
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    model = fabric.setup_module(TinyLM())
    optimizer = fabric.setup_optimizers(optimizer_for(kind, model.parameters()))
    accumulator = Accumulator(
        fabric, model, optimizer, scheduling={0: 3}, normalize_by="token", shift_labels=True, log_metrics=False
    )
    return fabric, model, optimizer, accumulator, micro_batches(rank_pairs(fabric.global_rank), ROWS)


class Probe:
    """A stateful object of the user's beside the Accumulator: what Lightning's load does with one (the contract)."""

    def __init__(self) -> None:
        self.value = 0

    def state_dict(self) -> dict[str, int]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.value = state["value"]


def train(model: Any, optimizer: Any, accumulator: Accumulator, data: list, epochs: int) -> None:
    for _ in range(accumulator.epoch, epochs):
        for batch in accumulator.batches(data):
            with accumulator.micro_step(batch) as micro:
                micro.backward(mean_loss(model, batch))
            if micro.should_step:
                optimizer.step()
                optimizer.zero_grad()


def uninterrupted(out: Path, kind: str) -> None:
    fabric, model, optimizer, accumulator, data = set_up(kind)
    train(model, optimizer, accumulator, data, EPOCHS)
    record = {"optimizer_steps": accumulator.optimizer_steps, "lrs": lrs(optimizer), "weights": full_weights(model)}
    write(out, "uninterrupted", kind, fabric.global_rank, record)


def saved(out: Path, kind: str) -> None:
    fabric, model, optimizer, accumulator, data = set_up(kind)
    probe = Probe()
    probe.value = 7
    state = {"model": model, "optimizer": optimizer, "accumulator": accumulator, "probe": probe}
    record: dict[str, Any] = {}
    # each save's error is kept and the run goes on: every save is tried (both ranks raise at the same place, in
    # torch's optimizer-state init, before any collective of the optimizer's state)
    for name, epochs in (("before_first_step", 0), ("after_epoch", 1)):
        train(model, optimizer, accumulator, data, epochs)
        record[f"steps_{name}"] = accumulator.optimizer_steps
        try:
            fabric.save(checkpoint(out, kind, name), state)
        except Exception as error:  # noqa: BLE001 (recorded for the test to report)
            record[f"raised_{name}"] = failure(error)
        record[f"lrs_{name}"] = lrs(optimizer)
    record["weights"] = full_weights(model)
    write(out, "saved", kind, fabric.global_rank, record)


def loaded(out: Path, kind: str) -> None:
    fabric, model, optimizer, accumulator, data = set_up(kind)  # the Accumulator first, as documented
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "accumulator": accumulator, "probe": Probe()}
    record: dict[str, Any] = {}
    try:
        fabric.load(checkpoint(out, kind, "after_epoch"), state)
    except Exception as error:  # noqa: BLE001
        record["raised"] = failure(error)
        write(out, "loaded", kind, fabric.global_rank, record)
        return
    record["loaded"] = {
        "optimizer_steps": accumulator.optimizer_steps,
        "epoch": accumulator.epoch,
        "lrs": lrs(optimizer),
        "accumulator_kept": state["accumulator"] is accumulator,
        "accumulator_type": type(state["accumulator"]).__name__,
        "probe": [
            type(state["probe"]).__name__,
            state["probe"].state_dict() if isinstance(state["probe"], Probe) else state["probe"],
        ],
    }
    train(model, optimizer, accumulator, data, EPOCHS)
    record |= {"optimizer_steps": accumulator.optimizer_steps, "lrs": lrs(optimizer), "weights": full_weights(model)}
    write(out, "loaded", kind, fabric.global_rank, record)


# ------------------------------------------------------------------ Trainer


class Tiny(pl.LightningModule):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.net = TinyLM()
        self.kind = kind

    def configure_model(self) -> None:
        shard_layers(self.net, self.device_mesh)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return mean_loss(self.net, batch)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(rank_pairs(self.global_rank), batch_size=ROWS)  # in order, no DistributedSampler

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return optimizer_for(self.kind, self.parameters())


def fit(kind: str, epochs: int, ckpt_path: Path | None = None) -> tuple[pl.Trainer, Tiny]:
    strategy = ModelParallelAccumulationStrategy(
        data_parallel_size=2, tensor_parallel_size=1, save_distributed_checkpoint=KINDS[kind][0]
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        callbacks=[AccumulationScheduler({0: 3})],
        max_epochs=epochs,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    module = Tiny(kind)
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer, module


def trainer_record(trainer: pl.Trainer, module: Tiny) -> dict[str, Any]:
    return {
        "global_step": trainer.global_step,
        "current_epoch": trainer.current_epoch,
        "lrs": lrs(trainer.optimizers[0]),
        "weights": full_weights(module.net),
    }


def trainer_uninterrupted(out: Path, kind: str) -> None:
    trainer, module = fit(kind, EPOCHS)
    write(out, "trainer_uninterrupted", kind, trainer.global_rank, trainer_record(trainer, module))


def trainer_saved(out: Path, kind: str) -> None:
    trainer, module = fit(kind, 1)
    record: dict[str, Any] = {}
    try:
        trainer.save_checkpoint(checkpoint(out, kind, "trainer"))
    except Exception as error:  # noqa: BLE001
        record["raised"] = failure(error)
    write(out, "trainer_saved", kind, trainer.global_rank, record | trainer_record(trainer, module))


def trainer_resumed(out: Path, kind: str) -> None:
    trainer, module = fit(kind, EPOCHS, ckpt_path=checkpoint(out, kind, "trainer"))
    write(out, "trainer_resumed", kind, trainer.global_rank, trainer_record(trainer, module))


MODES = {
    "uninterrupted": uninterrupted,
    "saved": saved,
    "loaded": loaded,
    "trainer_uninterrupted": trainer_uninterrupted,
    "trainer_saved": trainer_saved,
    "trainer_resumed": trainer_resumed,
}


def main() -> None:
    out, modes = Path(sys.argv[1]), sys.argv[2].split(",")
    out.mkdir(parents=True, exist_ok=True)
    for mode in modes:
        for kind in KINDS:
            MODES[mode](out, kind)
    leave()


if __name__ == "__main__":
    main()
