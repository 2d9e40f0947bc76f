"""Every optimizer step equals one step of a plain-PyTorch loop on the mean loss over the window."""

import pytest
import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from torch.utils.data import DataLoader

import lightning_accum
from lightning_accum import AccumulationScheduler
from tests.helpers import (
    BatchStream,
    RegressionModule,
    loader,
    make_data,
    max_deviation,
    reference_weights,
    trainer,
    weights,
)

TOLERANCE = 1e-6

# (callback arguments, samples, micro-batch, epochs, the windows of each epoch worked out by hand)
CASES = {
    "incomplete last window": (dict(scheduling={0: 4}), 40, 4, 1, [[4, 4, 2]]),
    "per-epoch changes": (dict(scheduling={0: 1, 1: 3, 2: 2}), 28, 4, 3, [[1] * 7, [3, 3, 1], [2, 2, 2, 1]]),
    # 2 -> 4 at optimizer step 3, which begins at batch 6: stock Lightning skips a zero_grad there
    "step-keyed change mid-epoch": (dict(scheduling={0: 2, 3: 4}, unit="step"), 40, 4, 2, [[2, 2, 2, 4], [4, 4, 2]]),
    # 2 samples a micro-step; the window that starts with 8 >= 7 samples seen is the first of factor 3
    "sample-keyed change mid-epoch": (
        dict(scheduling={0: 1, 7: 3}, unit="sample"),
        18,
        2,
        2,
        [[1, 1, 1, 1, 3, 2], [3, 3, 3]],
    ),
    "epochs shorter than the factor": (dict(scheduling={0: 5}), 12, 4, 2, [[3], [3]]),
    "target batch size": (dict(target_batch_size=12), 32, 4, 1, [[3, 3, 2]]),
    # global batch 2 -> 4 -> 6 at 0, 6 and 12 samples, 2 samples a micro-step
    "batch-size ramp": (
        dict(target_batch_size=6, ramp_start_batch_size=2, ramp_increment=2, ramp_samples=12),
        20,
        2,
        2,
        [[1, 1, 1, 2, 2, 3], [3, 3, 3, 1]],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_the_big_batch_reference(case):
    arguments, samples, batch_size, epochs, windows = CASES[case]
    x, y = make_data(samples)
    model = RegressionModule()
    callback = AccumulationScheduler(**arguments)
    fit_trainer = trainer([callback], max_epochs=epochs)
    expected_steps = sum(len(epoch) for epoch in windows)
    fit_trainer.fit(model, loader(x, y, batch_size))
    assert fit_trainer.global_step == expected_steps
    assert max_deviation(weights(model), reference_weights(x, y, batch_size, windows)) <= TOLERANCE


def test_an_epoch_of_unknown_length_ends_its_window_early_and_exactly():
    x, y = make_data(40)
    model = RegressionModule()
    fit_trainer = trainer([AccumulationScheduler({0: 4})], max_epochs=2)
    fit_trainer.fit(model, DataLoader(BatchStream(x, y, 4), batch_size=None))
    assert fit_trainer.global_step == 6
    assert max_deviation(weights(model), reference_weights(x, y, 4, [[4, 4, 2], [4, 4, 2]])) <= TOLERANCE


def test_stock_lightning_underweights_the_last_window_which_we_fix():
    """The measured bug (Lightning #19987): the last window of 2 batches is divided by 4."""
    x, y = make_data(40)
    stock = RegressionModule()
    trainer([GradientAccumulationScheduler({0: 4})], max_epochs=3).fit(stock, loader(x, y, 4))
    reference = reference_weights(x, y, 4, [[4, 4, 2]] * 3)
    assert max_deviation(weights(stock), reference) > 1e-3
    ours = RegressionModule()
    trainer([AccumulationScheduler({0: 4})], max_epochs=3).fit(ours, loader(x, y, 4))
    assert max_deviation(weights(ours), reference) <= TOLERANCE


class OneCycleModule(RegressionModule):
    """Sizes OneCycleLR from the replacement for ``trainer.estimated_stepping_batches``."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        self.total_steps = lightning_accum.estimated_stepping_batches(self.trainer)
        self.stock_estimate = self.trainer.estimated_stepping_batches
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=self.lr, total_steps=self.total_steps)
        return [optimizer], [{"scheduler": scheduler, "interval": "step"}]


@pytest.mark.parametrize("case", ["per-epoch changes", "step-keyed change mid-epoch", "batch-size ramp"])
def test_estimated_stepping_batches_counts_the_steps_the_schedule_takes(case):
    arguments, samples, batch_size, epochs, windows = CASES[case]
    x, y = make_data(samples)
    model = OneCycleModule()
    fit_trainer = trainer([AccumulationScheduler(**arguments)], max_epochs=epochs)
    fit_trainer.fit(model, loader(x, y, batch_size))  # OneCycleLR raises if stepped more than total_steps
    assert model.total_steps == fit_trainer.global_step == sum(len(epoch) for epoch in windows)
    assert model.stock_estimate != model.total_steps  # what stock Lightning reports is wrong under a schedule
    assert fit_trainer.lr_scheduler_configs[0].scheduler.last_epoch == model.total_steps


def test_estimated_stepping_batches_honours_max_steps_and_falls_back_without_the_callback():
    x, y = make_data(40)
    model = OneCycleModule()
    fit_trainer = trainer([AccumulationScheduler({0: 4})], max_epochs=10, max_steps=5)
    fit_trainer.fit(model, loader(x, y, 4))
    assert model.total_steps == fit_trainer.global_step == 5
    plain = OneCycleModule()
    trainer(max_epochs=2).fit(plain, loader(x, y, 4))
    assert plain.total_steps == plain.stock_estimate == 20


def test_steps_counted_before_the_fit_of_an_endless_loader_end_at_max_steps_without_building_a_schedule():
    """An epoch of unknown length: the run ends at ``max_steps``, so nothing is counted and no schedule is built (a
    target the callback's ``micro_batch_size`` does not divide may still be reached from the loader's batch, which the
    fit's plan reads at its start)."""
    from types import SimpleNamespace

    from lightning_accum.core.schedule import ScheduleSpec
    from lightning_accum.trainer._plan import count_steps

    spec = ScheduleSpec.from_args(None, "epoch", 72, None, None, None, 16)
    with pytest.raises(ValueError, match="72"):
        spec.build(16, 1)
    endless = SimpleNamespace(
        max_epochs=-1, max_steps=7, train_dataloader=object(), world_size=1, num_training_batches=float("inf")
    )
    assert count_steps(endless, spec) == 7


def test_step_interval_lr_schedulers_step_once_per_window():
    class StepLRModule(RegressionModule):
        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
            return [optimizer], [{"scheduler": scheduler, "interval": "step"}]

    x, y = make_data(40)
    model = StepLRModule()
    fit_trainer = trainer([AccumulationScheduler({0: 2, 3: 4}, unit="step")], max_epochs=1)
    fit_trainer.fit(model, loader(x, y, 4))
    assert fit_trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**4)


def test_training_step_with_dataloader_iter_is_exact():
    class IterModule(RegressionModule):
        def training_step(self, dataloader_iter):
            x, y = next(dataloader_iter)[0]
            return torch.nn.functional.mse_loss(self.net(x), y)

    x, y = make_data(40)
    model = IterModule()
    fit_trainer = trainer([AccumulationScheduler({0: 3})], max_epochs=2)
    fit_trainer.fit(model, loader(x, y, 4))
    assert fit_trainer.global_step == 8
    assert max_deviation(weights(model), reference_weights(x, y, 4, [[3, 3, 3, 1]] * 2)) <= TOLERANCE


def test_reusing_the_callback_in_a_new_trainer_starts_the_schedule_afresh():
    x, y = make_data(40)
    callback = AccumulationScheduler({0: 1, 20: 3}, unit="sample")  # 4 samples a micro-step: 1,1,1,1,1,3,2
    for _ in range(2):
        model = RegressionModule()
        fit_trainer = trainer([callback], max_epochs=1)
        fit_trainer.fit(model, loader(x, y, 4))
        assert fit_trainer.global_step == 7
        assert callback.samples_seen == 40
        assert max_deviation(weights(model), reference_weights(x, y, 4, [[1, 1, 1, 1, 1, 3, 2]])) <= TOLERANCE
