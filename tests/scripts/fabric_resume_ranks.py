"""A Fabric loop with the Accumulator, saved with ``fabric.save`` in the middle of an epoch and resumed on another
number of devices.

    python tests/scripts/fabric_resume_ranks.py OUT WORLD uninterrupted         # trains EPOCHS epochs on WORLD devices,
                                                                                # saving after each step of SAVE_AT
    python tests/scripts/fabric_resume_ranks.py OUT WORLD killed                # saves as above into one file and
                                                                                # dies by SIGKILL inside a window
    python tests/scripts/fabric_resume_ranks.py OUT WORLD resume NAME=CKPT ...  # each: resumes CKPT on WORLD devices

``Fabric(accelerator="cpu", devices=WORLD)`` launches the ranks itself (DDP on gloo for 2). The data are 256 samples of
a linear regression that carry their dataset index; the model a float32 ``Linear(5, 1)``, SGD at 0.1 with momentum 0.9,
the loss each micro-batch's own mean, ``Accumulator(target_batch_size=32, normalize_by="sample")``: micro-batches of 4,
factor 8 on one device and 4 on two, 8 optimizer steps an epoch. On two devices the loader is shuffled: Fabric gives it
a ``DistributedSampler`` seeded with SEED (``seed_everything``); on one it is sequential (a ``RandomSampler``'s order
cannot be resumed). Each resume runs with a fresh Fabric, model, optimizer and loader, in the same order on every rank.

Every rank writes ``OUT/<NAME>.rank<r>.json``: the initial and final weights, the optimizer steps, the dataset indices
it trained at each optimizer step (with the epoch), the sampler its loader drew from, where a resume started, and the
error a resume raised. The uninterrupted run is named ``uninterrupted_w<WORLD>`` and saves ``<its name>.step<S>.ckpt``.
The killed run, ``killed_w<WORLD>``, saves into ``<its name>.ckpt`` (last after step 12), writes its record after every
step, and ``<its name>.rank<r>.killed.json`` just before it kills itself.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from fabric_common import leave  # noqa: E402

from lightning_accum.fabric import Accumulator  # noqa: E402
from tests.helpers import IN_FEATURES, make_data  # noqa: E402

EPOCHS, SAMPLES, ROWS, TARGET = 2, 256, 4, 32
LR, MOMENTUM = 0.1, 0.9
SEED = 7  # the DistributedSampler's on several devices: epoch e is torch.randperm seeded with SEED + e
# checkpoints after step 3 (epoch 0, 96 of 256 samples), step 8 (epoch 0's end) and step 12 (epoch 1, 128 samples)
SAVE_AT = (3, 8, 12)
# the killed run dies after 2 micro-batches of the window of step 14 (its last save after step 12)
KILL_IN_STEP, KILL_AFTER = 14, 2


def dataset() -> TensorDataset:
    x, y = make_data(SAMPLES)
    return TensorDataset(x, y, torch.arange(SAMPLES))  # each sample carries its dataset index


def linear_model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Linear(IN_FEATURES, 1)


def flat(model: nn.Module) -> list[list[float]]:
    return [p.detach().flatten().tolist() for p in model.parameters()]


def sampler_of(loader: Any) -> dict[str, Any]:
    """The sampler the loader's batches are drawn from, as Fabric set it up."""
    sampler = loader._dataloader.batch_sampler.sampler  # Fabric's wrapper, then the DataLoader
    return {"type": type(sampler).__name__, **{key: getattr(sampler, key, None) for key in ("shuffle", "seed")}}


def write(out: Path, name: str, rank: int, record: dict[str, Any]) -> None:
    (out / f"{name}.rank{rank}.json").write_text(json.dumps(record))


def train(
    out: Path,
    name: str,
    world: int,
    save: Callable[[int], Path] | None = None,
    checkpoint: str | None = None,
    kill: bool = False,
) -> None:
    fabric = Fabric(accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto")
    fabric.launch()
    fabric.seed_everything(SEED)  # Fabric seeds the DistributedSampler it puts in the loader with it
    model = linear_model()
    record: dict[str, Any] = {"world": fabric.world_size, "initial": flat(model), "steps": {}}
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM))
    loader = fabric.setup_dataloaders(DataLoader(dataset(), batch_size=ROWS, shuffle=world > 1))
    record["sampler"] = sampler_of(loader)
    accumulator = Accumulator(
        fabric, model, optimizer, target_batch_size=TARGET, normalize_by="sample", log_metrics=False
    )
    state = {"model": model, "optimizer": optimizer, "accumulator": accumulator}
    rank = fabric.global_rank
    try:
        if checkpoint is not None:
            fabric.load(checkpoint, state)
            record["resumed_at"] = [accumulator.epoch, accumulator.optimizer_steps, accumulator.samples_seen]
        for epoch in range(accumulator.epoch, EPOCHS):
            window: list[int] = []  # the dataset indices this rank trains in the window in progress
            for batch in accumulator.batches(loader):
                x, y, index = batch
                window += index.tolist()
                with accumulator.micro_step(batch) as micro:
                    micro.backward(F.mse_loss(model(x), y))
                if kill and accumulator.optimizer_steps == KILL_IN_STEP - 1 and len(window) == KILL_AFTER * ROWS:
                    killed = {"after_step": accumulator.optimizer_steps, "in_window": len(window) // ROWS}
                    (out / f"{name}.rank{rank}.killed.json").write_text(json.dumps(killed))
                    os.kill(os.getpid(), signal.SIGKILL)  # inside a window, two steps after the last save
                if micro.should_step:
                    optimizer.step()
                    optimizer.zero_grad()
                    record["steps"][str(accumulator.optimizer_steps)] = {"epoch": epoch, "indices": window}
                    window = []
                    if save is not None and accumulator.optimizer_steps in SAVE_AT:
                        fabric.save(save(accumulator.optimizer_steps), state)
                    if kill:  # what the run did before it dies
                        write(out, name, rank, record)
    except Exception as error:  # a resume that fails is recorded, and the next one runs
        if checkpoint is None:
            raise
        record["raised"] = "".join(traceback.format_exception(type(error), error, error.__traceback__))[-3000:]
    record["optimizer_steps"] = accumulator.optimizer_steps
    record["weights"] = flat(model)
    accumulator.close()
    write(out, name, rank, record)


def main() -> None:
    out, world, mode, jobs = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4:]
    out.mkdir(parents=True, exist_ok=True)
    if mode == "uninterrupted":
        name = f"uninterrupted_w{world}"
        train(out, name, world, save=lambda step: out / f"{name}.step{step}.ckpt")
    elif mode == "killed":
        name = f"killed_w{world}"
        train(out, name, world, save=lambda step: out / f"{name}.ckpt", kill=True)
        raise SystemExit(f"{name} was not killed")
    elif mode == "resume":
        for job in jobs:
            name, checkpoint = job.split("=", 1)
            train(out, name, world, checkpoint=checkpoint)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    if world > 1:
        leave()


if __name__ == "__main__":
    main()
