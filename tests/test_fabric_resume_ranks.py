"""A Fabric run resumed from a ``fabric.save`` checkpoint in the middle of an epoch, or at its end, on another number of
devices ends where the uninterrupted run ends, having trained every sample of every epoch once, in the run's order.

tests/scripts/fabric_resume_ranks.py trains 2 epochs of 256 samples with ``Accumulator(target_batch_size=32,
normalize_by="sample")`` and micro-batches of 4 on 1 device (sequential loader, factor 8) or 2 (Fabric's
DistributedSampler, shuffled with seed 7; factor 4), saving after steps 3 (epoch 0, 96 samples in), 8 (epoch 0's end)
and 12 (epoch 1, 128 samples in). A run's position in an epoch is the samples all ranks consumed of its global order:
the DistributedSampler deals position ``i * W + r`` to rank ``r``, so a window covers 32 consecutive positions on any
number of devices. A resumed run keeps the order of the run that wrote the checkpoint, from its first sample not
consumed, and in the epochs after (epoch 1 trains epoch 1's permutation, not epoch 0's again).

The reference is plain PyTorch on one process: from the runs' initial weights, per epoch the global order the
uninterrupted run's loader deals, one SGD step (momentum 0.9) on the mean loss over each window's 32 samples.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DistributedSampler

from tests.helpers import IN_FEATURES, launch_environment, launch_ranks, launched_ahead, make_data

SCRIPT = Path(__file__).resolve().parent / "scripts" / "fabric_resume_ranks.py"
EPOCHS, SAMPLES, WINDOW, STEPS_PER_EPOCH = 2, 256, 32, 8
STEPS = EPOCHS * STEPS_PER_EPOCH
LR, MOMENTUM, SEED = 0.1, 0.9, 7
SAVED_AT = {3: 0, 8: 1, 12: 1}  # the checkpoints' optimizer steps, and the epoch each resumes in
KILLED_AFTER = 12  # the killed run's last save; it died inside the window of step 14
RESUMES = [(written, resumed_on, step) for written, resumed_on in ((2, 1), (1, 2), (2, 2)) for step in SAVED_AT]


# ------------------------------------------------------------------ the launches


_WRITTEN: dict[str, Path] = {}
_WRITING = threading.Lock()


def _write(folder: Path) -> Path:
    """The uninterrupted runs on 1 and 2 devices and their checkpoints (once; both fixtures need them)."""
    with _WRITING:
        if "folder" not in _WRITTEN:
            for world in (1, 2):
                launch_ranks(SCRIPT, folder, str(world), "uninterrupted", limit=240)
            _WRITTEN["folder"] = folder
        return _WRITTEN["folder"]


def _kill(out: Path, world: int, limit: int = 240) -> None:
    """The run on ``world`` devices that kills itself with SIGKILL inside a window, after its last save."""
    command = ["timeout", "-s", "KILL", str(limit), sys.executable, str(SCRIPT), str(out), str(world), "killed"]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=launch_environment()
    )
    # `timeout` dies with its child (rank 0) and so stops watching: a rank left behind would hold the pipe open.
    # It leads its own process group, which every rank joins: whatever is left of it is killed at the limit
    try:
        output, _ = process.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        output = None
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    if output is None:
        output = process.communicate()[0]
    # each rank writes a file just before it kills itself; `timeout` passes the SIGKILL on as its own death
    killed = [out / f"killed_w{world}.rank{rank}.killed.json" for rank in range(world)]
    missing = [path.name for path in killed if not path.exists()]
    assert not missing, f"killed_w{world}: exit {process.returncode} without {missing}\n{output[-4000:]}"
    assert process.returncode in (-9, 137), f"killed_w{world}: exit {process.returncode}\n{output[-4000:]}"


def _launch_written(folder: Path) -> Path:
    return _write(folder)


def _launch_resumed(folder: Path) -> tuple[Path, Path]:
    """The killed runs, then every resume: those on 2 devices in one launch, those on 1 in another."""
    for world in (1, 2):
        _kill(folder, world)
    checkpoints = _write(folder / "written")
    for resumed_on in (2, 1):
        jobs = [
            f"{name(w, r, step)}={checkpoints / f'uninterrupted_w{w}.step{step}.ckpt'}"
            for w, r, step in RESUMES
            if r == resumed_on
        ]
        jobs.append(f"killed_w{3 - resumed_on}_on{resumed_on}={folder / f'killed_w{3 - resumed_on}.ckpt'}")
        launch_ranks(SCRIPT, folder, str(resumed_on), "resume", *jobs, limit=240)
    return checkpoints, folder


written = launched_ahead("written", _launch_written)
resumed = launched_ahead("resumed", _launch_resumed)


def name(written_on: int, resumed_on: int, step: int) -> str:
    return f"w{written_on}_step{step}_on{resumed_on}"


def records(out: Path, run: str) -> list[dict]:
    ranks = sorted(out.glob(f"{run}.rank[0-9].json"))
    assert ranks, f"{run}: no record"
    return [json.loads(path.read_text()) for path in ranks]


def weights(record: dict) -> list[torch.Tensor]:
    return [torch.tensor(values) for values in record["weights"]]


def deviation(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a, b, strict=True))


# ------------------------------------------------------------------ the reference (plain PyTorch)


def global_order(world: int, epoch: int) -> list[int]:
    """The dataset indices of ``epoch`` in the order the uninterrupted run on ``world`` devices consumes them: one
    device, sequential; two, the DistributedSampler's shares (seed 7, epoch ``epoch``) dealt round-robin."""
    if world == 1:
        return list(range(SAMPLES))
    shares = []
    for rank in range(world):
        sampler = DistributedSampler(range(SAMPLES), num_replicas=world, rank=rank, shuffle=True, seed=SEED)
        sampler.set_epoch(epoch)
        shares.append(list(sampler))
    return [index for position in zip(*shares, strict=True) for index in position]


def reference_windows(world: int) -> dict[int, list[int]]:
    """Optimizer step -> the dataset indices of its window: 32 consecutive positions of the epoch's global order."""
    windows = {}
    for epoch in range(EPOCHS):
        order = global_order(world, epoch)
        for window in range(STEPS_PER_EPOCH):
            windows[epoch * STEPS_PER_EPOCH + window + 1] = order[window * WINDOW : (window + 1) * WINDOW]
    return windows


def reference_weights(world: int, initial: list[list[float]]) -> list[torch.Tensor]:
    """One SGD step on the mean loss over each window's 32 samples, in the global order of ``world`` devices."""
    x, y = make_data(SAMPLES)
    net = nn.Linear(IN_FEATURES, 1)
    with torch.no_grad():
        for param, values in zip(net.parameters(), initial, strict=True):
            param.copy_(torch.tensor(values).view_as(param))
    optimizer = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    for _, indices in sorted(reference_windows(world).items()):
        index = torch.tensor(indices)
        optimizer.zero_grad()
        F.mse_loss(net(x[index]), y[index]).backward()
        optimizer.step()
    return [p.detach().flatten().clone() for p in net.parameters()]


def check_windows(ranks: list[dict], world: int, steps: range) -> None:
    """Every step of ``steps`` trained its reference window's 32 samples, each once, over all ranks."""
    reference = reference_windows(world)
    for rank in ranks:
        assert sorted(map(int, rank["steps"])) == list(steps)
    for step in steps:
        trained = collections.Counter(i for rank in ranks for i in rank["steps"][str(step)]["indices"])
        repeated = sorted(i for i, count in trained.items() if count > 1)
        assert not repeated, f"step {step}: samples {repeated} trained twice"
        assert set(trained) == set(reference[step]), (
            f"step {step}: {len(set(trained) - set(reference[step]))} samples not of its window,"
            f" {len(set(reference[step]) - set(trained))} of its window not trained"
        )
        assert [rank["steps"][str(step)]["epoch"] for rank in ranks] == [(step - 1) // STEPS_PER_EPOCH] * len(ranks)


# ------------------------------------------------------------------ the tests


@pytest.mark.parametrize("world", [1, 2])
def test_the_uninterrupted_run_equals_the_reference(written, world):
    """Validates the reference: the uninterrupted run's loader deals the order it assumes, its windows are the
    reference's, and its weights are the reference's within 1e-5."""
    ranks = records(written, f"uninterrupted_w{world}")
    assert len(ranks) == world
    sampler = {"type": "SequentialSampler", "shuffle": None, "seed": None}
    if world > 1:
        sampler = {"type": "DistributedSampler", "shuffle": True, "seed": SEED}
    assert all(rank["sampler"] == sampler for rank in ranks)
    assert [rank["optimizer_steps"] for rank in ranks] == [STEPS] * len(ranks)
    assert all(rank["weights"] == ranks[0]["weights"] for rank in ranks)
    check_windows(ranks, world, range(1, STEPS + 1))
    assert deviation(weights(ranks[0]), reference_weights(world, ranks[0]["initial"])) <= 1e-5


def test_the_uninterrupted_runs_start_from_the_same_weights(written):
    assert records(written, "uninterrupted_w1")[0]["initial"] == records(written, "uninterrupted_w2")[0]["initial"]


@pytest.mark.parametrize(("written_on", "resumed_on", "step"), RESUMES)
def test_a_resume_on_another_number_of_devices_ends_where_the_run_ends(resumed, written_on, resumed_on, step):
    """A checkpoint written after ``step`` on ``written_on`` devices (in the middle of epoch 0 or 1, or at epoch 0's
    end), resumed on ``resumed_on``: it trains the rest of the run's order from the first sample not consumed, every
    window the reference's 32 samples, the same optimizer steps, and ends within 1e-6 of the uninterrupted run."""
    written_folder, folder = resumed
    ranks = records(folder, name(written_on, resumed_on, step))
    assert len(ranks) == resumed_on
    assert "raised" not in ranks[0], ranks[0]["raised"]
    assert ranks[0]["resumed_at"] == [SAVED_AT[step], step, step * WINDOW]
    assert [rank["optimizer_steps"] for rank in ranks] == [STEPS] * len(ranks)
    check_windows(ranks, written_on, range(step + 1, STEPS + 1))
    assert all(rank["weights"] == ranks[0]["weights"] for rank in ranks)
    uninterrupted = records(written_folder, f"uninterrupted_w{written_on}")[0]
    assert deviation(weights(ranks[0]), weights(uninterrupted)) <= 1e-6


@pytest.mark.parametrize(("killed_on", "resumed_on"), [(2, 1), (1, 2)])
def test_a_run_killed_inside_a_window_resumes_on_another_number_of_devices(resumed, killed_on, resumed_on):
    """A run that died by SIGKILL inside the window of step 14, resumed from its last save (after step 12) on another
    number of devices: steps 13 and 14 are trained again on the same samples, and the run ends within 1e-6 of the
    uninterrupted run of its number of devices."""
    written_folder, folder = resumed
    killed = records(folder, f"killed_w{killed_on}")
    assert len(killed) == killed_on
    check_windows(killed, killed_on, range(1, KILLED_AFTER + 2))  # it died after step 13
    ranks = records(folder, f"killed_w{killed_on}_on{resumed_on}")
    assert len(ranks) == resumed_on
    assert "raised" not in ranks[0], ranks[0]["raised"]
    assert ranks[0]["resumed_at"] == [1, KILLED_AFTER, KILLED_AFTER * WINDOW]
    assert [rank["optimizer_steps"] for rank in ranks] == [STEPS] * len(ranks)
    check_windows(ranks, killed_on, range(KILLED_AFTER + 1, STEPS + 1))
    assert all(rank["weights"] == ranks[0]["weights"] for rank in ranks)
    uninterrupted = records(written_folder, f"uninterrupted_w{killed_on}")[0]
    assert deviation(weights(ranks[0]), weights(uninterrupted)) <= 1e-6
