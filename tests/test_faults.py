"""Faults inside a step: an exception and a checkpoint at each hook leave the configured LR, and resume exactly.

Each case trains with an LR scale of 3 (linear rule, factor 3, base batch 4), writes a checkpoint with
``trainer.save_checkpoint`` at one hook of one micro-step of the window of batches 6-8, and raises there. The
optimizer must hold the configured LR afterwards and in the checkpoint, and a run resumed from that checkpoint must
end at the uninterrupted run's weights: the checkpoint resumes the window from its first batch.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_accum import AccumulationScheduler
from tests.helpers import (
    LR,
    RegressionModule,
    ResumableLoader,
    make_data,
    max_deviation,
    reference_snapshots,
    trainer,
    weights,
)

# 10 batches of 4 an epoch; windows 2 2 2 | 3 (batches 6-8, scale 3) | 1, then 3 3 3 1
WINDOW = (6, 7, 8)
CHECKPOINT = "fault.ckpt"


class Injected(RuntimeError):
    pass


class Fault:
    """Writes a checkpoint and raises at ``hook`` in batch ``batch_idx`` of ``epoch``."""

    def __init__(self, hook: str, batch_idx: int, path: Any, epoch: int = 0) -> None:
        self.hook, self.batch_idx, self.path, self.epoch = hook, batch_idx, path, epoch
        self.lr_at_fault: float | None = None

    def __call__(self, trainer: Any, hook: str) -> None:
        where = (trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_idx)
        if hook != self.hook or where != (self.epoch, self.batch_idx):
            return
        self.lr_at_fault = trainer.optimizers[0].param_groups[0]["lr"]
        trainer.save_checkpoint(self.path)
        raise Injected(f"injected at {hook}")


class FaultCallback(Callback):
    def __init__(self, fault: Fault) -> None:
        self.fault = fault

    def on_before_backward(self, trainer, pl_module, loss):
        self.fault(trainer, "on_before_backward")

    def on_after_backward(self, trainer, pl_module):
        self.fault(trainer, "on_after_backward")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.fault(trainer, "on_before_optimizer_step")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.fault(trainer, "on_train_batch_end")


class FaultySGD(torch.optim.SGD):
    """SGD that calls the fault inside ``step``: after the closure (the window's last backward), before the update."""

    fault: Fault | None = None
    trainer: Any = None

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        if self.fault is not None:
            self.fault(self.trainer, "optimizer step")
        super().step()
        return loss


class Module(RegressionModule):
    def __init__(self, fault: Fault | None = None, seed: int = 1) -> None:
        super().__init__(seed=seed)
        self.fault = fault

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        if self.fault is not None:
            self.fault(self.trainer, "configure_gradient_clipping")
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_optimizers(self):
        optimizer = FaultySGD(self.parameters(), lr=self.lr)
        optimizer.fault, optimizer.trainer = self.fault, self.trainer
        return optimizer


def _callback() -> AccumulationScheduler:
    return AccumulationScheduler({0: 2, 3: 3}, unit="step", lr_scaling="linear", base_batch_size=4)


def _loader() -> ResumableLoader:
    x, y = make_data(40)
    return ResumableLoader(TensorDataset(x, y), batch_size=4)


CASES = [
    ("on_before_backward", WINDOW[0]),  # the window's first micro-step
    ("on_after_backward", WINDOW[1]),  # a middle one
    ("on_train_batch_end", WINDOW[1]),  # between micro-steps (a time-based ModelCheckpoint saves here)
    ("on_before_backward", WINDOW[2]),  # the last one: Lightning runs it inside optimizer.step
    ("on_after_backward", WINDOW[2]),
    ("on_before_optimizer_step", WINDOW[2]),
    ("configure_gradient_clipping", WINDOW[2]),
    ("optimizer step", WINDOW[2]),  # after the closure, with the scale applied for the update
]


@pytest.fixture(scope="module")
def uninterrupted():
    model = Module()
    fit_trainer = trainer([_callback()], max_epochs=2)
    fit_trainer.fit(model, _loader())
    return weights(model), fit_trainer.global_step


@pytest.mark.parametrize(("hook", "batch_idx"), CASES)
def test_a_fault_in_a_step_leaves_the_configured_lr_and_its_checkpoint_resumes_exactly(
    tmp_path, uninterrupted, hook, batch_idx
):
    fault = Fault(hook, batch_idx, tmp_path / CHECKPOINT)
    callbacks = [_callback(), FaultCallback(fault)]
    failing = trainer(callbacks, max_epochs=2, gradient_clip_val=100.0)  # clipping that never clips
    with pytest.raises(Injected):
        failing.fit(Module(fault), _loader())
    assert failing.global_step == 3  # the fault came before the window's step
    if hook != "optimizer step":  # inside the step, the update itself holds the scaled LR
        assert fault.lr_at_fault == LR
    assert failing.optimizers[0].param_groups[0]["lr"] == LR
    checkpoint = torch.load(tmp_path / CHECKPOINT, weights_only=False)
    assert checkpoint["optimizer_states"][0]["param_groups"][0]["lr"] == LR

    resumed = Module(seed=99)  # the checkpoint, not the seed, decides the weights
    resumed_trainer = trainer([_callback()], max_epochs=2, gradient_clip_val=100.0)
    resumed_trainer.fit(resumed, _loader(), ckpt_path=tmp_path / CHECKPOINT)
    reference, steps = uninterrupted
    assert resumed_trainer.global_step == steps
    assert max_deviation(weights(resumed), reference) <= 1e-6


def test_a_checkpoint_between_windows_is_written_as_lightning_writes_it(tmp_path):
    """After a window's step nothing is rewound: the checkpoint resumes at the next batch."""
    saved = {}

    class SaveAfterStep(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == WINDOW[2]:
                trainer.save_checkpoint(tmp_path / CHECKPOINT)
                saved["progress"] = trainer.fit_loop.epoch_loop.batch_progress.state_dict()

    trainer([_callback(), SaveAfterStep()], max_epochs=1).fit(Module(), _loader())
    checkpoint = torch.load(tmp_path / CHECKPOINT, weights_only=False)
    assert checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"] == saved["progress"]
    assert checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"consumed": WINDOW[2] + 1}]


def _resumed_run(path, loader_factory=_loader):
    resumed = Module(seed=99)
    resumed_trainer = trainer([_callback()], max_epochs=2, gradient_clip_val=100.0)
    resumed_trainer.fit(resumed, loader_factory(), ckpt_path=path)
    return weights(resumed), resumed_trainer.global_step


def test_a_checkpoint_in_an_epochs_first_window_starts_the_loader_afresh(tmp_path, uninterrupted):
    """The loader state kept after the previous epoch's last batch would resume at that epoch's end, where a
    torchdata StatefulDataLoader yields nothing: the checkpoint holds no loader state, and the epoch starts anew."""

    def torchdata_like():
        x, y = make_data(40)
        return ResumableLoader(TensorDataset(x, y), batch_size=4, wrap=False)

    fault = Fault("on_after_backward", 1, tmp_path / CHECKPOINT, epoch=1)  # epoch 1's first window: batches 0-2
    failing = trainer([_callback(), FaultCallback(fault)], max_epochs=2, gradient_clip_val=100.0)
    with pytest.raises(Injected):
        failing.fit(Module(), torchdata_like())
    checkpoint = torch.load(tmp_path / CHECKPOINT, weights_only=False)
    assert "combined_loader" not in checkpoint["loops"]["fit_loop"]["state_dict"]
    reference, steps = uninterrupted
    resumed, resumed_steps = _resumed_run(tmp_path / CHECKPOINT, torchdata_like)
    assert resumed_steps == steps
    assert max_deviation(resumed, reference) <= 1e-6


def test_a_checkpoint_written_after_the_step_by_a_callback_listed_first_is_not_rewound(tmp_path, uninterrupted):
    """A saver that runs before the AccumulationScheduler in on_train_batch_end sees the window's step done."""

    class SaveAtBatch8(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.current_epoch == 0 and batch_idx == WINDOW[2]:
                trainer.save_checkpoint(tmp_path / CHECKPOINT)

    trainer([SaveAtBatch8(), _callback()], max_epochs=1).fit(Module(), _loader())
    checkpoint = torch.load(tmp_path / CHECKPOINT, weights_only=False)
    assert checkpoint["global_step"] == 4
    assert checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"consumed": WINDOW[2] + 1}]
    reference, steps = uninterrupted
    resumed, resumed_steps = _resumed_run(tmp_path / CHECKPOINT)
    assert resumed_steps == steps
    assert max_deviation(resumed, reference) <= 1e-6


def test_a_window_dropped_by_a_skipped_rest_of_epoch_leaves_no_stale_resume_point(tmp_path):
    """-1 from on_train_batch_start inside a window; a checkpoint in the next epoch's first window resumes exactly."""

    class SkipsRestAt7(Module):
        def on_train_batch_start(self, batch, batch_idx):
            return -1 if (self.current_epoch, batch_idx) == (0, 7) else None

    class SaveInEpoch1(Callback):
        def on_after_backward(self, trainer, pl_module):
            if (trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_idx) == (1, 1):
                trainer.save_checkpoint(tmp_path / CHECKPOINT)

    whole = SkipsRestAt7()
    whole_trainer = trainer([_callback(), SaveInEpoch1()], max_epochs=2)
    whole_trainer.fit(whole, _loader())
    checkpoint = torch.load(tmp_path / CHECKPOINT, weights_only=False)
    assert checkpoint["callbacks"]["AccumulationScheduler"]["micro_steps"] == 7  # batches 0-6 trained in epoch 0
    resumed = SkipsRestAt7(seed=99)
    resumed_trainer = trainer([_callback()], max_epochs=2)
    resumed_trainer.fit(resumed, _loader(), ckpt_path=tmp_path / CHECKPOINT)
    assert resumed_trainer.global_step == whole_trainer.global_step
    assert max_deviation(weights(resumed), weights(whole)) <= 1e-6


def test_a_plain_loader_resumed_inside_a_window_in_the_middle_of_an_epoch_starts_where_the_window_did(tmp_path):
    """A loader without ``state_dict`` (issue 47): the sampler is set to the window's first sample, the epoch ends
    where the uninterrupted run's does, and the loader's own sampler is given back at the fit's end."""
    fault = Fault("on_before_backward", WINDOW[1], tmp_path / CHECKPOINT)
    x, y = make_data(40)
    plain = torch.utils.data.DataLoader(TensorDataset(x, y), batch_size=4)
    own = plain.batch_sampler.sampler
    whole, whole_trainer = Module(), trainer([_callback()], max_epochs=2)
    whole_trainer.fit(whole, plain)
    with pytest.raises(Injected):
        trainer([_callback(), FaultCallback(fault)], max_epochs=2).fit(Module(), plain)
    resumed, resumed_trainer = Module(seed=99), trainer([_callback()], max_epochs=2)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*(middle of an epoch|ended before the epoch)")
        resumed_trainer.fit(resumed, plain, ckpt_path=tmp_path / CHECKPOINT)
    assert resumed_trainer.global_step == whole_trainer.global_step
    assert max_deviation(weights(resumed), weights(whole)) <= 1e-6
    assert plain.batch_sampler.sampler is own


def test_a_reloaded_loader_with_state_is_kept_for_the_window_it_feeds(tmp_path):
    """A plain loader in epoch 0, then (reloaded each epoch) one with ``state_dict``: whether a loader has state is
    asked of each loader object, so a checkpoint inside epoch 1's window of batches 3-5 holds the state at batch 3."""

    class Reloading(Module):
        def train_dataloader(self):
            data = TensorDataset(*make_data(40))
            return ResumableLoader(data, batch_size=4) if self.trainer.current_epoch else DataLoader(data, batch_size=4)

    fault = Fault("on_after_backward", 4, tmp_path / CHECKPOINT, epoch=1)
    failing = trainer([_callback(), FaultCallback(fault)], max_epochs=2, reload_dataloaders_every_n_epochs=1)
    with pytest.raises(Injected):
        failing.fit(Reloading(fault))
    checkpoint = torch.load(tmp_path / CHECKPOINT, weights_only=False)
    assert checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"consumed": 3}]


def test_a_fit_stopped_inside_an_epoch_resumes_with_the_next_epoch_as_lightnings_loop_does(tmp_path):
    """``max_steps`` ends a fit in the middle of epoch 0 and Lightning's checkpoint says epoch 1: the place in epoch 0
    the callback kept must not be applied to epoch 1 (found by an adversarial test: it dealt epoch 1 from sample 24 and
    trained 16 of its 40 samples). The resumed fit trains all of epoch 1, as plain PyTorch does after 2 windows."""
    x, y = make_data(40)
    plain = DataLoader(TensorDataset(x, y), batch_size=4)
    first = trainer([AccumulationScheduler({0: 3})], max_steps=2, enable_checkpointing=False)
    first.fit(Module(), plain)
    first.save_checkpoint(tmp_path / "stopped.ckpt")
    assert first.current_epoch == 1
    resumed, resumed_trainer = Module(seed=99), trainer([AccumulationScheduler({0: 3})], max_epochs=2)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=r".*(middle of an epoch|trained again)")
        resumed_trainer.fit(resumed, plain, ckpt_path=tmp_path / "stopped.ckpt")
    assert resumed_trainer.global_step == 2 + 4  # epoch 1's windows of 3, 3, 3, 1
    reference = reference_snapshots(x, y, 4, [[3, 3], [3, 3, 3, 1]])[-1]
    assert max_deviation(weights(resumed), reference) <= 1e-6


def test_an_epoch_end_checkpoint_of_a_loader_whose_place_cannot_be_set_resumes_without_a_warning(tmp_path):
    """A shuffled loader on one device (a RandomSampler) checkpointed at its epoch's end: nothing of the epoch is left,
    so nothing is trained again and nothing is warned of (found by an adversarial test)."""
    x, y = make_data(40)
    shuffled = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)
    first = trainer([AccumulationScheduler({0: 3})], max_epochs=1, enable_checkpointing=False)
    first.fit(Module(), shuffled)
    first.save_checkpoint(tmp_path / "end.ckpt")
    resumed_trainer = trainer([AccumulationScheduler({0: 3})], max_epochs=2)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=r".*(middle of an epoch|trained again)")
        resumed_trainer.fit(Module(seed=99), shuffled, ckpt_path=tmp_path / "end.ckpt")
    assert resumed_trainer.global_step == 8


def test_a_loader_state_of_another_number_of_ranks_is_not_loaded_and_the_sampler_starts_where_the_run_stopped(tmp_path):
    """A loader with ``state_dict`` whose checkpoint came from 2 ranks (fault injection: a real 1-process checkpoint
    whose callback state says 2): its state counts one rank's batches of 2, so it is dropped before Lightning loads it,
    with a warning, and the sequential sampler starts at the first sample not consumed. Loaded, the state would skip 6
    more batches on top of the repositioned sampler."""
    every_3 = ModelCheckpoint(dirpath=tmp_path, filename="{step}", save_top_k=-1, every_n_train_steps=3)
    whole = Module()
    whole_trainer = trainer([AccumulationScheduler({0: 2}), every_3], max_epochs=2, enable_checkpointing=True)
    whole_trainer.fit(whole, _loader())
    checkpoint = torch.load(tmp_path / "step=3.ckpt", weights_only=False)  # after 6 of epoch 0's 10 batches
    assert checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"consumed": 6}]
    checkpoint["callbacks"]["AccumulationScheduler"]["data"]["world_size"] = 2
    torch.save(checkpoint, tmp_path / "from_two.ckpt")
    resumed, resumed_trainer = Module(seed=99), trainer([AccumulationScheduler({0: 2})], max_epochs=2)
    with pytest.warns(UserWarning, match=r"written on 2 process\(es\) and this run has 1.*it is not loaded"):
        resumed_trainer.fit(resumed, _loader(), ckpt_path=tmp_path / "from_two.ckpt")
    assert resumed_trainer.global_step == whole_trainer.global_step
    assert max_deviation(weights(resumed), weights(whole)) <= 1e-6
