"""Bad input gets a clear error naming the argument and the value, before any weight changes."""

import copy

import pytest
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from torch.utils.data import DataLoader

from lightning_accum import AccumulationScheduler
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
        r"`unit` must be one of 'epoch', 'step' or 'sample', got 'batch'",
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
