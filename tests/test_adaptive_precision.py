"""Adaptive growth from factor 1 in every reduced precision, in both shells, against a plain loop (issue 54, item 1).

Each run starts at factor 1 with every window measured, so that its factor-1 windows are loader batches in two halves
(each half's loss weighed by its rows) and its later windows whole loader batches; the noise scale grows the factor
within the run. The plain loop replays the windows the run took (the factor is the run's own decision) with plain
PyTorch: under bf16-true each part's gradient computed alone by the bfloat16 module, weighed and summed in float32,
rounded to bfloat16 once, then the bfloat16 SGD update (the correctly rounded window mean, as tests/test_precision.py
defines it; bit for bit on one process); under bf16-mixed (and 16-mixed, which a CPU runs in bfloat16) each part's
loss over autocast, scaled by its share and backpropagated into float32 gradients.

On two ranks (tests/scripts/growth_ranks.py: DDP and FSDP2, bf16-true and bf16-mixed, each shell) the
plain loop goes over both ranks' halves of the data.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accum import AccumulationScheduler
from lightning_accum.fabric import Accumulator
from tests.helpers import backends, launch_ranks, launched_ahead, make_data, make_net, mse, rank_records, trainer
from tests.test_precision import bf16_ulps

BATCH, SAMPLES, LR = 8, 480, 0.05
GROWTH = {"noise_scale": True, "noise_scale_interval": 1, "adaptive": True, "adaptive_target": 8.0}
PRECISIONS = ["bf16-true", "bf16-mixed", "16-mixed"]


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    return make_data(SAMPLES, seed=6)


def plain_loop(x: torch.Tensor, y: torch.Tensor, windows: list[int], precision: str, shell: str) -> nn.Module:
    """Plain PyTorch on the run's windows (in loader batches of ``BATCH``): a window of 1 is its batch's two halves.

    Under bf16-true the Trainer hands ``training_step`` the whole batch in bfloat16, Fabric only the model's input.
    """
    net = make_net().to(torch.bfloat16) if precision == "bf16-true" else make_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    start = 0
    for size in windows:
        rows = [x[i : i + BATCH] for i in range(start, start + size * BATCH, BATCH)]
        targets = [y[i : i + BATCH] for i in range(start, start + size * BATCH, BATCH)]
        if size == 1:  # measured at factor 1: the halves, each weighing its rows over the batch's
            half = BATCH // 2
            rows, targets = [rows[0][:half], rows[0][half:]], [targets[0][:half], targets[0][half:]]
        shares = [len(part) / BATCH / size for part in rows]
        optimizer.zero_grad()
        if precision == "bf16-true":
            sums = [torch.zeros_like(p, dtype=torch.float32) for p in net.parameters()]
            for part, target, share in zip(rows, targets, shares, strict=True):
                net.zero_grad()
                target = target.bfloat16() if shell == "trainer" else target
                mse(net(part.bfloat16()).float(), target.float()).backward()
                for total, p in zip(sums, net.parameters(), strict=True):
                    total += p.grad.float() * share
            for total, p in zip(sums, net.parameters(), strict=True):
                p.grad = total.to(torch.bfloat16)
        else:
            for part, target, share in zip(rows, targets, shares, strict=True):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    prediction = net(part)
                (mse(prediction.float(), target) * share).backward()
        optimizer.step()
        start += size * BATCH
    return net


def _compare(ours: nn.Module, reference: nn.Module, precision: str) -> None:
    for mine, theirs in zip(ours.parameters(), reference.parameters(), strict=True):
        if precision == "bf16-true":
            assert mine.dtype == torch.bfloat16
            assert bf16_ulps(mine.detach(), theirs.detach()).max().item() == 0.0
        else:
            assert (mine.detach() - theirs.detach()).abs().max().item() <= 1e-6


class _Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return mse(self.net(x).float(), y.float())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


class _Windows(pl.Callback):
    def __init__(self, scheduler: AccumulationScheduler) -> None:
        self.scheduler, self.sizes = scheduler, []

    def on_before_optimizer_step(self, *_: Any) -> None:
        self.sizes.append(self.scheduler.factor)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_adaptive_growth_in_the_trainer_steps_as_a_plain_loop_in_reduced_precision(precision):
    x, y = _data()
    module, callback = _Module(), AccumulationScheduler({0: 1}, **GROWTH)
    windows = _Windows(callback)
    trainer([callback, windows], max_epochs=1, precision=precision).fit(
        module, DataLoader(TensorDataset(x, y), batch_size=BATCH)
    )
    assert windows.sizes[0] == 1
    assert max(windows.sizes) > 1  # it grew within the run
    assert sum(windows.sizes) == SAMPLES // BATCH
    _compare(module.net, plain_loop(x, y, windows.sizes, precision, "trainer"), precision)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_adaptive_growth_in_fabric_steps_as_a_plain_loop_in_reduced_precision(precision):
    x, y = _data()
    fabric = Fabric(accelerator="cpu", devices=1, precision=precision)  # type: ignore[arg-type]
    net = make_net()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=LR))
    accumulator = Accumulator(fabric, model, optimizer, log_metrics=False, **GROWTH)
    sizes = []
    for batch in accumulator.batches(DataLoader(TensorDataset(x, y), batch_size=BATCH)):
        inputs, targets = batch
        with accumulator.micro_step(batch) as micro:
            micro.backward(mse(model(inputs).float(), targets.float()))
        if micro.should_step:
            sizes.append(accumulator.factor)
            optimizer.step()
            optimizer.zero_grad()
    assert sizes[0] == 1
    assert max(sizes) > 1
    assert sum(sizes) == SAMPLES // BATCH
    _compare(net, plain_loop(x, y, sizes, precision, "fabric"), precision)


# ------------------------------------------------------------------ two processes (DDP, FSDP2), both shells

SCRIPT = Path(__file__).resolve().parent / "scripts" / "growth_ranks.py"
launched = launched_ahead("launched", lambda out: launch_ranks(SCRIPT, out))


def plain_two_ranks(windows: list[int], precision: str, shell: str) -> nn.Module:
    """Plain PyTorch over both ranks' halves: a window of f is f loader batches on each rank (on two ranks a factor-1
    window is no halves: each rank's batch is a part already), each part weighing 1 / 2f."""
    x, y = make_data(SAMPLES, seed=6)
    half = SAMPLES // 2
    net = make_net().to(torch.bfloat16) if precision == "bf16-true" else make_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    start = 0
    for size in windows:
        starts = [rank * half + start + BATCH * i for rank in (0, 1) for i in range(size)]
        optimizer.zero_grad()
        sums = [torch.zeros_like(p, dtype=torch.float32) for p in net.parameters()]
        for first in starts:
            part, target = x[first : first + BATCH], y[first : first + BATCH]
            if precision == "bf16-true":
                net.zero_grad()
                target = target.bfloat16() if shell == "trainer" else target
                mse(net(part.bfloat16()).float(), target.float()).backward()
                for total, p in zip(sums, net.parameters(), strict=True):
                    total += p.grad.float() / (2 * size)
            else:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    prediction = net(part)
                (mse(prediction.float(), target) / (2 * size)).backward()
        if precision == "bf16-true":
            for total, p in zip(sums, net.parameters(), strict=True):
                p.grad = total.to(torch.bfloat16)
        optimizer.step()
        start += size * BATCH
    return net


@pytest.mark.parametrize("precision", ["bf16-true", "bf16-mixed"])
@pytest.mark.parametrize("backend", backends("ddp", "fsdp2"))
@pytest.mark.parametrize("shell", ["trainer", "fabric"])
def test_adaptive_growth_on_two_ranks_steps_as_a_plain_loop_over_both_halves(launched, shell, backend, precision):
    rank0, rank1 = rank_records(launched, f"{shell}_{backend}_{precision}")
    assert rank0["windows"] == rank1["windows"]  # rank zero decides, every rank follows
    assert rank0["windows"][0] == 1
    assert max(rank0["windows"]) > 1
    assert sum(rank0["windows"]) == SAMPLES // 2 // BATCH
    assert rank0["weights"] == rank1["weights"]
    reference = plain_two_ranks(rank0["windows"], precision, shell)
    for weights, theirs in zip(rank0["weights"], reference.parameters(), strict=True):
        mine = torch.tensor(weights).view_as(theirs)
        if precision == "bf16-true":  # the ranks' float32 sums added in another order: within one bfloat16 place
            assert bf16_ulps(mine.bfloat16(), theirs.detach()).max().item() <= 1.0
        else:
            assert (mine - theirs.detach()).abs().max().item() <= 1e-5


# ------------------------------------------------------------------ the same launch: Seesaw with ranks that disagree


def test_seesaw_on_two_ranks_takes_rank_zeros_factors_when_their_lr_schedules_disagree(launched):
    """Rank 0's StepLR halves every 7 of its 30 steps (at 112, 224, 336 and 448 of the 480 samples), rank 1's every
    15: both ranks step on rank zero's factors, worked out here by hand, so every window's reduction meets its
    partner and the fit ends (the weights differ: each rank updates with its own LR, the user's bug)."""
    rank0, rank1 = rank_records(launched, "seesaw_disagree")
    windows, seen, left = [], 0, SAMPLES // 2 // BATCH
    while left:
        size = min(2 ** sum(seen >= at for at in (112, 224, 336, 448)), 8, left)  # seesaw_max_factor: 8
        windows.append(size)
        seen, left = seen + 2 * BATCH * size, left - size
    assert rank0["windows"] == rank1["windows"] == windows
