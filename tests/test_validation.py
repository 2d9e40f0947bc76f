"""Bad input gets a clear error naming the argument and the value, before any weight changes."""

import copy

import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from torch.utils.data import DataLoader

from lightning_accum import AccumulationScheduler, ManualAccumulation
from tests.helpers import BatchStream, RegressionModule, loader, make_data, max_deviation, trainer, weights

BAD_ARGUMENTS = [
    (dict(scheduling=[(0, 4)]), TypeError, r"`scheduling` must be a dict.*\[\(0, 4\)\]"),
    (dict(scheduling={}), ValueError, r"`scheduling` must not be empty"),
    (dict(scheduling={-1: 4}), ValueError, r"scheduling key -1.*>= 0, got -1"),
    (dict(scheduling={1.5: 4}), TypeError, r"scheduling key 1.5.*integer, got 1.5"),
    (dict(scheduling={"2": 4}), TypeError, r"scheduling key '2'.*integer, got '2'"),
    (dict(scheduling={True: 4}), TypeError, r"scheduling key True.*got True of type bool"),
    (dict(scheduling={0: 0}), ValueError, r"scheduling\[0\] \(the factor\).*>= 1, got 0"),
    (dict(scheduling={0: -3}), ValueError, r"scheduling\[0\] \(the factor\).*>= 1, got -3"),
    (dict(scheduling={0: 2.5}), TypeError, r"scheduling\[0\] \(the factor\).*integer, got 2.5"),
    (dict(scheduling={0: None}), TypeError, r"scheduling\[0\] \(the factor\).*got None"),
    (
        dict(scheduling={0: 2}, unit="batch"),
        ValueError,
        r"`unit` must be one of 'epoch', 'step', 'sample' or 'token', got 'batch'",
    ),
    (dict(target_batch_size=0), ValueError, r"`target_batch_size` must be an integer >= 1, got 0"),
    (dict(target_batch_size=-64), ValueError, r"`target_batch_size` must be an integer >= 1, got -64"),
    (dict(target_batch_size=64.0), TypeError, r"`target_batch_size` must be an integer, got 64.0"),
    (dict(scheduling={0: 2}, target_batch_size=64), ValueError, r"either `scheduling`.*or `target_batch_size`"),
    (dict(ramp_start_batch_size=8, ramp_increment=8, ramp_samples=100), ValueError, r"ramp needs `target_batch_size`"),
    (dict(target_batch_size=64, ramp_start_batch_size=8), ValueError, r"missing \['ramp_increment', 'ramp_samples'\]"),
    (
        dict(target_batch_size=64, ramp_start_batch_size=128, ramp_increment=8, ramp_samples=100),
        ValueError,
        r"`ramp_start_batch_size=128` must be smaller than `target_batch_size=64`",
    ),
    (
        dict(target_batch_size=64, ramp_start_batch_size=8, ramp_increment=0, ramp_samples=100),
        ValueError,
        r"`ramp_increment` must be an integer >= 1, got 0",
    ),
    (
        dict(target_batch_size=64, ramp_start_batch_size=8, ramp_increment=10, ramp_samples=100),
        ValueError,
        r"`ramp_increment=10` must divide target_batch_size - ramp_start_batch_size = 64 - 8 = 56",
    ),
    (
        dict(target_batch_size=64, ramp_start_batch_size=8, ramp_increment=8, ramp_samples=-5),
        ValueError,
        r"`ramp_samples` must be an integer >= 1, got -5",
    ),
    (dict(micro_batch_size=0), ValueError, r"`micro_batch_size` must be an integer >= 1, got 0"),
]


@pytest.mark.parametrize(("arguments", "error", "message"), BAD_ARGUMENTS)
def test_bad_arguments_raise_at_construction(arguments, error, message):
    before = copy.deepcopy(arguments)
    with pytest.raises(error, match=message):
        AccumulationScheduler(**arguments)
    assert arguments == before


def test_the_users_schedule_is_not_mutated():
    scheduling = {3: 4}
    callback = AccumulationScheduler(scheduling)
    x, y = make_data(16)
    trainer([callback], max_epochs=4).fit(RegressionModule(), loader(x, y, 4))
    assert scheduling == {3: 4}


class ManualModule(RegressionModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


def _deepspeed_like_strategy():
    from lightning.pytorch.strategies import SingleDeviceStrategy

    class AccumulatingStrategy(SingleDeviceStrategy):
        @property
        def handles_gradient_accumulation(self) -> bool:
            return True

    return AccumulatingStrategy(device="cpu")


# (callback arguments, extra Trainer arguments, module class, dataloader maker, message)
TRAINER_CONFLICTS = {
    "Trainer(accumulate_grad_batches)": (
        dict(scheduling={0: 2}),
        dict(accumulate_grad_batches=4),
        RegressionModule,
        None,
        r"remove `Trainer\(accumulate_grad_batches=4\)`",
    ),
    "a strategy that accumulates by itself": (
        dict(scheduling={0: 2}),
        dict(strategy="deepspeed_like"),
        RegressionModule,
        None,
        r"`AccumulatingStrategy` accumulates gradients by itself",
    ),
    "manual optimization": (
        dict(scheduling={0: 2}),
        {},
        ManualModule,
        None,
        r"automatic_optimization = False",
    ),
    "a second accumulation callback": (
        dict(scheduling={0: 2}),
        dict(extra_callback=GradientAccumulationScheduler({0: 2})),
        RegressionModule,
        None,
        r"found GradientAccumulationScheduler beside this AccumulationScheduler",
    ),
    "a target that does not divide": (
        dict(target_batch_size=10),
        {},
        RegressionModule,
        None,
        r"`target_batch_size=10` is not a multiple of .* 4 x 1 = 4.*Nearest valid: 8 or 12",
    ),
    "a ramp through sizes that do not divide": (
        dict(target_batch_size=16, ramp_start_batch_size=6, ramp_increment=5, ramp_samples=40),
        {},
        RegressionModule,
        None,
        r"passes through global batch sizes \[6, 11\]",
    ),
    "a target with no known micro-batch size": (
        dict(target_batch_size=16),
        {},
        RegressionModule,
        "stream",
        r"pass `micro_batch_size`",
    ),
    "sample keys with no known micro-batch size": (
        dict(scheduling={0: 1, 20: 2}, unit="sample"),
        {},
        RegressionModule,
        "stream",
        r"`unit='sample'`.*pass `micro_batch_size`",
    ),
}


@pytest.mark.parametrize("case", list(TRAINER_CONFLICTS))
def test_trainer_conflicts_raise_before_any_weight_changes(case):
    arguments, trainer_arguments, module_class, data, message = TRAINER_CONFLICTS[case]
    trainer_arguments = dict(trainer_arguments)
    callbacks = [AccumulationScheduler(**arguments)]
    if "extra_callback" in trainer_arguments:
        callbacks.append(trainer_arguments.pop("extra_callback"))
    if trainer_arguments.get("strategy") == "deepspeed_like":
        trainer_arguments["strategy"] = _deepspeed_like_strategy()
    x, y = make_data(32)
    train_data = DataLoader(BatchStream(x, y, 4), batch_size=None) if data == "stream" else loader(x, y, 4)
    model = module_class()
    before = weights(model)
    fit_trainer = trainer(callbacks, max_epochs=1, **trainer_arguments)
    with pytest.raises(ValueError, match=message):
        fit_trainer.fit(model, train_data)
    assert fit_trainer.global_step == 0
    assert max_deviation(weights(model), before) == 0.0


def test_a_failed_fit_gives_the_loop_back_to_lightning():
    x, y = make_data(32)
    fit_trainer = trainer([AccumulationScheduler(target_batch_size=10)], max_epochs=1)
    with pytest.raises(ValueError, match="target_batch_size=10"):
        fit_trainer.fit(RegressionModule(), loader(x, y, 4))
    epoch_loop = fit_trainer.fit_loop.epoch_loop
    assert "_should_accumulate" not in vars(epoch_loop)
    assert "_make_zero_grad_fn" not in vars(epoch_loop.automatic_optimization)
    assert fit_trainer.accumulate_grad_batches == 1


def _count_at(bad_batch: int, value: object):
    """A `count_items` that counts samples, except at `bad_batch`, where it returns `value`."""
    seen = []

    def count(batch):
        seen.append(None)
        return value if len(seen) - 1 == bad_batch else len(batch[0])

    return count


# what `count_items` returns at one micro-batch, and the error; windows of 4 micro-batches of 4 samples
BAD_COUNTS = {
    "negative int": (1, -1, ValueError, r"`count_items` returned -1 for batch 1: .*finite number >= 0"),
    "NaN float": (2, float("nan"), ValueError, r"`count_items` returned nan for batch 2"),
    "infinite float": (0, float("inf"), ValueError, r"`count_items` returned inf for batch 0"),
    "negative tensor": (3, torch.tensor(-2.0), ValueError, r"`count_items` returned -2.0 for batch 3"),
    "NaN tensor": (1, torch.tensor(float("nan")), ValueError, r"`count_items` returned nan for batch 1"),
    "infinite tensor": (2, torch.tensor([float("inf")]), ValueError, r"`count_items` returned inf for batch 2"),
    "None": (0, None, TypeError, r"`count_items` returned None \(NoneType\) for batch 0"),
    "a string": (1, "4", TypeError, r"`count_items` returned '4' \(str\) for batch 1"),
    "a bool": (0, True, TypeError, r"`count_items` returned True \(bool\) for batch 0"),
    "a bool tensor": (0, torch.tensor(True), TypeError, r"`count_items` returned a torch.bool tensor for batch 0"),
    "two numbers": (2, torch.tensor([1, 2]), ValueError, r"returned a tensor of shape \(2,\) for batch 2"),
}


@pytest.mark.parametrize("case", list(BAD_COUNTS))
def test_a_bad_count_items_result_raises_before_the_step(case):
    bad_batch, value, error, message = BAD_COUNTS[case]
    x, y = make_data(32)
    model = RegressionModule()
    before = weights(model)
    callback = AccumulationScheduler({0: 4}, normalize_by="sample", count_items=_count_at(bad_batch, value))
    fit_trainer = trainer([callback], max_epochs=1)
    with pytest.raises(error, match=message):
        fit_trainer.fit(model, loader(x, y, 4))
    assert fit_trainer.global_step == 0
    assert max_deviation(weights(model), before) == 0.0


def test_a_bad_tensor_count_in_a_window_kept_on_the_device_is_found_at_the_next_logged_step(tmp_path):
    """Device counts are read on the first 3 windows and on logged steps: a NaN counted in window 7 (factor 1) stays on
    the device until the check of step 10, which raises before its step, naming the batch and the steps between."""
    from lightning.pytorch.loggers import CSVLogger

    x, y = make_data(48)

    def count(batch):  # a tensor for every batch, NaN for batch 6
        return torch.tensor(float("nan") if torch.equal(batch[0], x[24:28]) else 4.0)

    callback = AccumulationScheduler(normalize_by="sample", count_items=count)
    fit_trainer = trainer([callback], max_epochs=1, logger=CSVLogger(tmp_path), log_every_n_steps=5)
    with pytest.raises(ValueError, match=r"returned nan for batch 6, in the window of optimizer step 7, read at the"):
        fit_trainer.fit(RegressionModule(), loader(x, y, 4))
    assert fit_trainer.global_step == 9


def test_a_window_without_items_raises_before_the_step():
    x, y = make_data(32)
    model = RegressionModule()
    before = weights(model)
    callback = AccumulationScheduler({0: 4}, normalize_by="token", count_items=lambda batch: torch.tensor(0))
    fit_trainer = trainer([callback], max_epochs=1)
    with pytest.raises(ValueError, match=r"`count_items` counted 0 tokens in the window of batches 0-3"):
        fit_trainer.fit(model, loader(x, y, 4))
    assert max_deviation(weights(model), before) == 0.0


def test_zero_items_in_some_micro_batches_is_allowed():
    x, y = make_data(32)
    model = RegressionModule()
    callback = AccumulationScheduler({0: 4}, normalize_by="sample", count_items=_count_at(1, 0))
    trainer([callback], max_epochs=1).fit(model, loader(x, y, 4))
    assert callback.features["item_weighting"].normalize_by == "sample"


class MisusedManualAccumulation(RegressionModule):
    """Manual optimization with ManualAccumulation, used wrongly in the way `misuse` names."""

    def __init__(self, misuse: str) -> None:
        super().__init__()
        self.misuse = misuse
        self.automatic_optimization = misuse == "automatic optimization"
        self.accumulation = ManualAccumulation(scheduling=2)

    def training_step(self, batch, batch_idx):
        if self.automatic_optimization:
            with self.accumulation.micro_step(self) as micro:
                return micro.scale(super().training_step(batch, batch_idx))
        optimizer = self.optimizers()
        with self.accumulation.micro_step(self) as micro:
            if self.misuse == "nested":
                with self.accumulation.micro_step(self):
                    pass
            if self.misuse != "step without backward":
                self.manual_backward(micro.scale(super().training_step(batch, batch_idx)))
        if self.misuse == "twice in one batch":
            with self.accumulation.micro_step(self):
                pass
        if micro.should_step or self.misuse == "step before the window ends":
            optimizer.step()
            optimizer.zero_grad()
        return None


MANUAL_MISUSE = {
    "automatic optimization": r"micro_step is for manual optimization.*automatic_optimization = False",
    "nested": r"entered inside another `micro_step` block",
    "twice in one batch": r"entered twice for batch 0",
    "step before the window ends": r"optimizer.step\(\) was called on micro-step 1 of a window of 2",
    "step without backward": r"window that ran no backward: call `self.manual_backward",
}


@pytest.mark.parametrize("misuse", list(MANUAL_MISUSE))
def test_manual_accumulation_misuse_raises_before_any_weight_changes(misuse):
    x, y = make_data(32)
    model = MisusedManualAccumulation(misuse)
    before = weights(model)
    with pytest.raises(RuntimeError, match=MANUAL_MISUSE[misuse]):
        trainer(max_epochs=1).fit(model, loader(x, y, 4))
    assert max_deviation(weights(model), before) == 0.0


@pytest.mark.parametrize("set_to_none", [True, False])
def test_manual_accumulation_accepts_either_way_of_zeroing(set_to_none):
    class Correct(MisusedManualAccumulation):
        def training_step(self, batch, batch_idx):
            optimizer = self.optimizers()
            with self.accumulation.micro_step(self) as micro:
                self.manual_backward(micro.scale(RegressionModule.training_step(self, batch, batch_idx)))
            if micro.should_step:
                optimizer.step()
                optimizer.zero_grad(set_to_none=set_to_none)

    x, y = make_data(32)
    model = Correct("none")
    fit_trainer = trainer(max_epochs=2)
    fit_trainer.fit(model, loader(x, y, 4))
    assert fit_trainer.global_step == 8


def test_manual_accumulation_lets_a_second_optimizer_step_every_batch():
    """A GAN-like module: the generator accumulates, the discriminator steps on every batch."""

    class TwoOptimizers(RegressionModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.accumulation = ManualAccumulation(2)
            self.other = torch.nn.Linear(5, 1)

        def training_step(self, batch, batch_idx):
            main, other = self.optimizers()
            with self.accumulation.micro_step(self) as micro:
                self.manual_backward(micro.scale(super().training_step(batch, batch_idx)))
            if micro.should_step:
                main.step()
                main.zero_grad()
            self.manual_backward(self.other(batch[0]).pow(2).mean())
            other.step()
            other.zero_grad()

        def configure_optimizers(self):
            return torch.optim.SGD(self.net.parameters(), lr=0.1), torch.optim.SGD(self.other.parameters(), lr=0.1)

    x, y = make_data(32)
    fit_trainer = trainer(max_epochs=1)
    fit_trainer.fit(TwoOptimizers(), loader(x, y, 4))
    assert fit_trainer.global_step == 4 + 8  # Lightning counts both optimizers' steps


def test_manual_accumulation_retries_a_failed_batch_on_the_same_trainer():
    class FailsOnce(MisusedManualAccumulation):
        failed = False

        def training_step(self, batch, batch_idx):
            optimizer = self.optimizers()
            with self.accumulation.micro_step(self) as micro:
                if not FailsOnce.failed:
                    FailsOnce.failed = True
                    raise RuntimeError("transient")
                self.manual_backward(micro.scale(RegressionModule.training_step(self, batch, batch_idx)))
            if micro.should_step:
                optimizer.step()
                optimizer.zero_grad()

    x, y = make_data(32)
    model = FailsOnce("none")
    fit_trainer = trainer(max_epochs=1)
    with pytest.raises(RuntimeError, match="transient"):
        fit_trainer.fit(model, loader(x, y, 4))
    fit_trainer.fit(model, loader(x, y, 4))
    assert fit_trainer.global_step == 4


def test_manual_accumulation_with_lbfgs_runs_the_backward_inside_the_closure():
    class LBFGSModule(MisusedManualAccumulation):
        def training_step(self, batch, batch_idx):
            optimizer = self.optimizers()
            with self.accumulation.micro_step(self) as micro:
                pass
            if micro.should_step:

                def closure():
                    optimizer.zero_grad()
                    loss = RegressionModule.training_step(self, batch, batch_idx)
                    self.manual_backward(loss)
                    return loss

                optimizer.step(closure=closure)

        def configure_optimizers(self):
            return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=2)

    x, y = make_data(32)
    model = LBFGSModule("none")
    before = weights(model)
    trainer(max_epochs=1).fit(model, loader(x, y, 4))
    assert max_deviation(weights(model), before) > 0


@pytest.mark.parametrize(
    "count",
    [np.int64(4), np.array(4), np.array([4.0]), torch.tensor(4, dtype=torch.bfloat16), torch.tensor([[4]]), 4.0],
    ids=["numpy int", "0-d numpy array", "1-element numpy array", "bfloat16 tensor", "1x1 tensor", "float"],
)
def test_counts_of_every_numeric_kind_are_accepted(count):
    x, y = make_data(32)
    reference, model = RegressionModule(), RegressionModule()
    trainer([AccumulationScheduler({0: 4}, normalize_by="sample")], max_epochs=1).fit(reference, loader(x, y, 4))
    callback = AccumulationScheduler({0: 4}, normalize_by="sample", count_items=lambda batch: count)
    trainer([callback], max_epochs=1).fit(model, loader(x, y, 4))
    assert max_deviation(weights(model), weights(reference)) <= 1e-6  # equal counts: equal weights
