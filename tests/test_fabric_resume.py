"""A Fabric loop killed with SIGKILL inside a window and resumed from its last ``fabric.save`` ends where the
uninterrupted loop ends (tests/scripts/fabric_resume.py: the accumulator, the model, SGD's momentum and a stateful
loader in the checkpoint, saved every 2 optimizer steps; the factor follows the tokens consumed, the LR scale warms
up)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from lightning.fabric import Fabric
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_accum.fabric import Accumulator
from tests.helpers import launched_ahead, make_data, make_net, max_deviation, run_forked

SCRIPT = Path(__file__).resolve().parent / "scripts" / "fabric_resume.py"


def _runs(root: Path) -> dict[str, dict]:
    jobs = {mode: [str(SCRIPT), str(root), mode] for mode in ("uninterrupted", "killed_resumed")}
    done = run_forked(jobs, preload=["lightning.fabric", "lightning_accum.fabric"], folder=root, limit=240)
    for mode, (status, output) in done.items():
        assert status == 0, f"{mode}: exit {status}\n{output[-3000:]}"
    return {mode: json.loads((root / f"{mode}.json").read_text()) for mode in jobs}


runs = launched_ahead("runs", _runs)


def test_a_run_killed_inside_a_window_resumes_from_its_last_save_to_the_same_weights(runs):
    resumed, uninterrupted = runs["killed_resumed"], runs["uninterrupted"]
    assert resumed["killed"]
    assert resumed["resumed_at"] == [1, 6]  # epoch 1 in progress, after step 6: a resume in the middle of an epoch
    assert resumed["optimizer_steps"] == uninterrupted["optimizer_steps"] == 13
    assert resumed["weights"] == uninterrupted["weights"]  # one process, the same operations: bit for bit


class _Run:
    """One process, plain loaders: a linear model, SGD, ``Accumulator(target_batch_size=12)`` over batches of 4."""

    def __init__(self, seed: int = 1) -> None:
        self.fabric = Fabric(accelerator="cpu", devices=1)
        model = make_net(seed)
        self.model, self.optimizer = self.fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        self.accumulator = Accumulator(self.fabric, self.model, self.optimizer, target_batch_size=12, log_metrics=False)

    def call(self, loader: DataLoader, until_step: int | None = None) -> None:
        """One call of ``batches``: to its end, or left after the window of optimizer step ``until_step``."""
        for batch in self.accumulator.batches(loader):
            with self.accumulator.micro_step(batch) as micro:
                micro.backward(F.mse_loss(self.model(batch[0]), batch[1]))
            if micro.should_step:
                self.optimizer.step()
                self.optimizer.zero_grad()
                if self.accumulator.optimizer_steps == until_step:
                    break

    def resumed(self) -> _Run:
        """A fresh process's run from this one's state (saved between windows), this one closed."""
        state = copy.deepcopy([self.model.state_dict(), self.optimizer.state_dict(), self.accumulator.state_dict()])
        self.accumulator.close()
        fresh = _Run(seed=99)
        fresh.model.load_state_dict(state[0])
        fresh.optimizer.load_state_dict(state[1])
        fresh.accumulator.load_state_dict(state[2])
        return fresh

    def weights(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]


def _loaders() -> tuple[DataLoader, DataLoader]:
    return (
        DataLoader(TensorDataset(*make_data(40, seed=1)), batch_size=4),
        DataLoader(TensorDataset(*make_data(60, seed=2)), batch_size=4),
    )


def test_a_resumed_epoch_is_dealt_to_its_own_loader_and_a_later_loader_keeps_its_order():
    """Resumed after step 2 of epoch 0 (24 of loader A's 40 samples), then epoch 1 over loader B (60 samples): B is
    not given A's resumed order (found by an adversarial test: B trained its first 40 samples only)."""
    a, b = _loaders()
    whole = _Run()
    whole.call(a)
    whole.call(b)
    run = _Run()
    run.call(a, until_step=2)
    run = run.resumed()
    run.call(a)
    run.call(b)
    assert run.accumulator.optimizer_steps == whole.accumulator.optimizer_steps == 4 + 5
    assert max_deviation(run.weights(), whole.weights()) <= 1e-6


def test_a_call_left_in_a_resumed_epoch_and_called_again_trains_all_it_is_given_as_the_uninterrupted_one():
    """In the resumed epoch, a call left after one window and a second call: the second is a whole epoch of what it
    is given, from the loader's first sample, as without the resume (not from the resume point again)."""
    a, _ = _loaders()
    whole = _Run()
    whole.call(a, until_step=3)
    whole.call(a)
    run = _Run()
    run.call(a, until_step=2)
    run = run.resumed()
    run.call(a, until_step=3)
    run.call(a)
    assert run.accumulator.optimizer_steps == whole.accumulator.optimizer_steps
    assert max_deviation(run.weights(), whole.weights()) <= 1e-6
