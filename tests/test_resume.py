"""Resuming from a checkpoint written at an optimizer step reproduces the uninterrupted run."""

from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import TensorDataset

from lightning_accum import AccumulationScheduler
from tests.helpers import (
    RegressionModule,
    ResumableLoader,
    loader,
    make_data,
    max_deviation,
    reference_weights,
    trainer,
    weights,
)

# 2 samples a micro-step, 9 micro-batches an epoch; the factor goes 1 -> 3 once 7 samples are seen and -> 2 at 30
SCHEDULE = {0: 1, 7: 3, 30: 2}
WINDOWS = [[1, 1, 1, 1, 3, 2], [3, 3, 2, 1], [2, 2, 2, 2, 1]]  # epoch 1: the window at 30 samples uses 2


def _callback() -> AccumulationScheduler:
    return AccumulationScheduler(scheduling=SCHEDULE, unit="sample")


def test_resume_at_an_epoch_end_matches_the_uninterrupted_run(tmp_path):
    x, y = make_data(18)
    whole = RegressionModule()
    trainer([_callback()], max_epochs=3).fit(whole, loader(x, y, 2))
    reference = reference_weights(x, y, 2, WINDOWS)
    assert max_deviation(weights(whole), reference) <= 1e-6

    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, filename="{epoch}")
    first = trainer([_callback(), checkpoint], max_epochs=1, enable_checkpointing=True)
    first.fit(RegressionModule(), loader(x, y, 2))

    resumed = RegressionModule(seed=99)  # the checkpoint, not the seed, must decide the weights
    callback = _callback()
    second = trainer([callback], max_epochs=3)
    second.fit(resumed, loader(x, y, 2), ckpt_path=tmp_path / "epoch=0.ckpt")
    assert callback.samples_seen == 3 * 18
    assert second.global_step == sum(len(epoch) for epoch in WINDOWS)
    assert max_deviation(weights(resumed), weights(whole)) <= 1e-6


def test_resume_in_the_middle_of_an_epoch_at_a_step_boundary(tmp_path):
    """Step 5 ends at batch 6 of epoch 0 (12 samples seen: factor 3 was in force); resuming there is exact."""
    x, y = make_data(18)
    whole = RegressionModule()
    trainer([_callback()], max_epochs=2).fit(whole, ResumableLoader(TensorDataset(x, y), batch_size=2))
    assert max_deviation(weights(whole), reference_weights(x, y, 2, WINDOWS[:2])) <= 1e-6

    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=5, save_top_k=-1, filename="{step}")
    first = trainer([_callback(), checkpoint], max_epochs=1, enable_checkpointing=True)
    first.fit(RegressionModule(), ResumableLoader(TensorDataset(x, y), batch_size=2))
    path = tmp_path / "step=5.ckpt"

    resumed = RegressionModule(seed=99)
    callback = _callback()
    second = trainer([callback], max_epochs=2)
    second.fit(resumed, ResumableLoader(TensorDataset(x, y), batch_size=2), ckpt_path=path)
    assert second.global_step == 10
    assert max_deviation(weights(resumed), weights(whole)) <= 1e-6


def test_a_second_fit_on_the_same_trainer_continues_exactly():
    x, y = make_data(18)
    model = RegressionModule()
    callback = _callback()
    fit_trainer = trainer([callback], max_epochs=1)
    fit_trainer.fit(model, loader(x, y, 2))
    fit_trainer.fit_loop.max_epochs = 3
    fit_trainer.fit(model, loader(x, y, 2))
    assert max_deviation(weights(model), reference_weights(x, y, 2, WINDOWS)) <= 1e-6
    assert fit_trainer.accumulate_grad_batches == 1


def test_the_lr_scale_continues_after_a_resume(tmp_path):
    """The base batch is the first window's of the whole run, not of the resumed part."""
    import torch

    x, y = make_data(16)

    def callback() -> AccumulationScheduler:
        return AccumulationScheduler({0: 2, 4: 8}, unit="step", lr_scaling="linear")

    whole_callback = callback()
    whole = RegressionModule()
    trainer([whole_callback], max_epochs=3).fit(whole, loader(x, y, 2))

    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, filename="{epoch}")
    trainer([callback(), checkpoint], max_epochs=1, enable_checkpointing=True).fit(RegressionModule(), loader(x, y, 2))
    resumed_callback = callback()
    resumed = RegressionModule(seed=99)
    trainer([resumed_callback], max_epochs=3).fit(resumed, loader(x, y, 2), ckpt_path=tmp_path / "epoch=0.ckpt")
    assert (
        resumed_callback.features["lr_scaling"].base_batch_size
        == whole_callback.features["lr_scaling"].base_batch_size
        == 4.0
    )  # micro-batch 2 x factor 2
    assert max_deviation(weights(resumed), weights(whole)) <= 1e-6
    assert torch.isfinite(torch.cat([p.flatten() for p in weights(resumed)])).all()


def test_a_checkpoint_without_the_callbacks_state_counts_from_the_loop_and_says_so(tmp_path):
    """Written by a run without the callback: the sample count comes from the loop's batches, with a warning."""
    import pytest

    x, y = make_data(18)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, filename="{epoch}")
    trainer([checkpoint], max_epochs=1, enable_checkpointing=True).fit(RegressionModule(), loader(x, y, 2))
    callback = _callback()
    with pytest.warns(UserWarning, match=r"holds no AccumulationScheduler state.*counting the 9 micro-batches"):
        trainer([callback], max_epochs=2).fit(RegressionModule(), loader(x, y, 2), ckpt_path=tmp_path / "epoch=0.ckpt")
    assert callback.samples_seen == 36  # 18 counted from the loop, 18 trained
