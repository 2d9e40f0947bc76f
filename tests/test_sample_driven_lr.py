"""SampleDrivenLR: an LR schedule moved by samples consumed, against a plain-PyTorch reference; Lightning's own
LearningRateMonitor tests with it; its refusals."""

from __future__ import annotations

import math
import pickle
import re
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger
from torch import nn, optim
from torch.utils.data import DataLoader, TensorDataset

import lightning_accum
from lightning_accum import AccumulationScheduler, SampleDrivenLR
from tests.helpers import LR, MeasuredLR, RegressionModule, make_data, make_net, max_deviation, trainer

MICRO, SAMPLES = 4, 96  # 24 micro-batches an epoch


class LinearDecay(RegressionModule):
    """SGD whose rate decays linearly to 10% over the schedule, sized with the callback's stepping batches."""

    def __init__(self, wrap: bool = True) -> None:
        super().__init__()
        self.wrap = wrap

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=LR)
        steps = int(lightning_accum.estimated_stepping_batches(self.trainer))
        decay = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_iters=steps)
        return [optimizer], [{"scheduler": SampleDrivenLR(decay) if self.wrap else decay, "interval": "step"}]


def reference(windows: list[int], steps: int, x: torch.Tensor, y: torch.Tensor) -> tuple[nn.Module, list[float]]:
    """Plain PyTorch: SGD on each window's mean loss, the rate read from a LinearLR of ``steps`` steps stepped to
    ``floor(samples x steps / total)`` after each window."""
    net = make_net().to(x.dtype)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    decay = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_iters=steps)
    used, start, taken, total = [], 0, 0, len(x)
    for size in windows:
        optimizer.zero_grad()
        for index in range(start, start + size * MICRO, MICRO):
            (nn.functional.mse_loss(net(x[index : index + MICRO]), y[index : index + MICRO]) / size).backward()
        used.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        start += size * MICRO
        while taken < min(steps, math.floor(start * steps / total)):
            decay.step()
            taken += 1
    return net, used


@pytest.mark.parametrize(
    ("scheduling", "unit", "windows", "steps"),
    [
        ({0: 2}, "epoch", [2] * 12, 12),  # a constant factor: the same as stepping by optimizer steps
        ({0: 1, 4: 3}, "step", [1] * 4 + [3] * 6 + [2], 11),  # sized for 11 steps: 96 samples, 11 windows
    ],
)
def test_the_rate_follows_the_samples_consumed_as_a_plain_loop_computes_it(scheduling, unit, windows, steps):
    x, y = make_data(SAMPLES)
    module, measured = LinearDecay(), MeasuredLR()
    callback = AccumulationScheduler(scheduling, unit=unit)
    run = trainer([callback, measured], max_epochs=1, precision="64-true")
    run.fit(module.double(), DataLoader(TensorDataset(x.double(), y.double()), batch_size=MICRO))
    net, used = reference(windows, steps, x.double(), y.double())
    assert run.global_step == len(windows)
    assert [lrs[0] for lrs in measured.used] == pytest.approx(used, rel=1e-9)
    assert max_deviation(list(module.net.parameters()), list(net.parameters())) <= 1e-12
    assert run.lr_scheduler_configs[0].scheduler.taken == steps  # it ended where the data ended


def test_under_adaptive_growth_the_schedule_ends_where_the_run_ends():
    """Sized for the steps at factor 1 (the most there can be); growth takes fewer, and the schedule still ends."""
    x, y = make_data(1024, seed=5)
    module = LinearDecay()
    callback = AccumulationScheduler(noise_scale=True, noise_scale_interval=1, adaptive=True, adaptive_target=4.0)
    run = trainer([callback], max_epochs=1)
    run.fit(module, DataLoader(TensorDataset(x, y), batch_size=MICRO))
    scheduler = run.lr_scheduler_configs[0].scheduler
    assert run.global_step < 1024 // MICRO  # it grew
    assert scheduler.steps == 1024 // MICRO
    assert scheduler.taken == scheduler.steps
    assert scheduler.get_last_lr() == pytest.approx([LR * 0.1])
    plain = LinearDecay(wrap=False)  # stepped per optimizer step, the same schedule stops short of its end
    grows = AccumulationScheduler(noise_scale=True, noise_scale_interval=1, adaptive=True, adaptive_target=4.0)
    trainer([grows], max_epochs=1).fit(plain, DataLoader(TensorDataset(x, y), batch_size=MICRO))
    assert plain.lr_schedulers().get_last_lr()[0] > 2 * LR * 0.1  # type: ignore[union-attr]


def test_without_the_callback_it_steps_as_the_scheduler_it_wraps():
    x, y = make_data(SAMPLES)
    wrapped, plain = LinearDecay(), LinearDecay(wrap=False)
    for module in (wrapped, plain):
        pl.seed_everything(0)
        trainer(max_epochs=1).fit(module, DataLoader(TensorDataset(x, y), batch_size=MICRO))
    assert wrapped.lr_schedulers().get_last_lr() == plain.lr_schedulers().get_last_lr()  # type: ignore[union-attr]
    assert max_deviation(list(wrapped.net.parameters()), list(plain.net.parameters())) == 0.0


def test_warmup_then_cosine_as_a_sequential_scheduler_ends_with_the_data():
    class WarmupCosine(RegressionModule):
        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.SGD(self.parameters(), lr=LR)
            steps = int(lightning_accum.estimated_stepping_batches(self.trainer))
            warmup = torch.optim.lr_scheduler.LinearLR(optimizer, 0.1, 1.0, total_iters=4)
            cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps - 4)
            sequential = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, cosine], milestones=[4])
            return [optimizer], [{"scheduler": SampleDrivenLR(sequential), "interval": "step"}]

    x, y = make_data(SAMPLES)
    run = trainer([AccumulationScheduler({0: 1, 6: 3}, unit="step")], max_epochs=1)
    run.fit(WarmupCosine(), DataLoader(TensorDataset(x, y), batch_size=MICRO))
    scheduler = run.lr_scheduler_configs[0].scheduler
    assert scheduler.taken == scheduler.steps == 12  # 6 windows of 1, then 6 of 3
    assert scheduler.get_last_lr()[0] == pytest.approx(0.0, abs=1e-12)  # the cosine's end


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"interval": "epoch"}, "interval='epoch', frequency=1: pass `steps`"),
        ({"interval": "step", "frequency": 2}, "interval='step', frequency=2: pass `steps`"),
    ],
)
def test_a_scheduler_config_that_counts_other_steps_is_refused_unless_sized(config, match):
    class Configured(RegressionModule):
        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.SGD(self.parameters(), lr=LR)
            decay = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_iters=5)
            return [optimizer], [{"scheduler": SampleDrivenLR(decay), **config}]

    x, y = make_data(SAMPLES)
    with pytest.raises(ValueError, match=re.escape(match)):
        trainer([AccumulationScheduler({0: 2})], max_epochs=1).fit(Configured(), DataLoader(TensorDataset(x, y), 4))


def test_a_run_of_unknown_length_needs_steps_and_total():
    from tests.helpers import BatchStream

    class Sized(RegressionModule):
        def __init__(self, **wrapper: Any) -> None:
            super().__init__()
            self.wrapper = wrapper

        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.SGD(self.parameters(), lr=LR)
            decay = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_iters=12)
            return [optimizer], [SampleDrivenLR(decay, **self.wrapper)]

    x, y = make_data(SAMPLES)
    stream = DataLoader(BatchStream(x, y, MICRO), batch_size=None)  # no length: the run's samples are unknown
    with pytest.raises(ValueError, match="micro-batch size could not be read .*: pass `micro_batch_size`"):
        trainer([AccumulationScheduler({0: 2})], max_epochs=1).fit(Sized(), stream)
    known = {"scheduling": {0: 2}, "micro_batch_size": MICRO}
    with pytest.raises(ValueError, match="samples are not known up front .*: pass `total`"):
        trainer([AccumulationScheduler(**known)], max_epochs=1).fit(Sized(), stream)
    with pytest.raises(ValueError, match="samples are not known up front .*: pass `steps`"):
        trainer([AccumulationScheduler(**known)], max_epochs=1).fit(Sized(total=SAMPLES), stream)
    module = Sized(steps=12, total=SAMPLES)
    trainer([AccumulationScheduler(**known)], max_epochs=1).fit(module, stream)
    assert module.lr_schedulers().taken == 12  # type: ignore[union-attr]


def test_its_state_restores_the_wrapped_scheduler_and_its_position():
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = SampleDrivenLR(torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.0, total_iters=10))
    consumed = [35]
    schedule.attach(lambda: consumed[0], steps=10, total=100)
    schedule.advance()
    state = schedule.state_dict()
    optimizer2 = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    restored = SampleDrivenLR(torch.optim.lr_scheduler.LinearLR(optimizer2, 1.0, 0.0, total_iters=10))
    restored.load_state_dict(state)
    assert (restored.taken, restored.steps, restored.total) == (3, 10, 100)
    assert restored.get_last_lr() == pytest.approx([0.7])
    assert not pickle.loads(pickle.dumps(schedule)).attached  # what moves it stays with the fit


@pytest.mark.parametrize(
    ("build", "error", "match"),
    [
        (lambda opt: SampleDrivenLR(opt), TypeError, "`scheduler` must be a torch LR scheduler"),
        (
            lambda opt: SampleDrivenLR(torch.optim.lr_scheduler.ReduceLROnPlateau(opt)),
            TypeError,
            "ReduceLROnPlateau follows a monitored metric",
        ),
        (lambda opt: SampleDrivenLR(_step_lr(opt), unit="epoch"), ValueError, "`unit` must be 'sample' or 'token'"),
        (lambda opt: SampleDrivenLR(_step_lr(opt), steps=0), ValueError, "`steps` must be an integer >= 1"),
        (lambda opt: SampleDrivenLR(_step_lr(opt), unit="token"), ValueError, "needs `total`: the tokens"),
    ],
)
def test_bad_arguments_name_themselves(build, error, match):
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(error, match=match):
        build(optimizer)


def _step_lr(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)


def test_a_token_schedule_needs_the_callback_to_count_tokens():
    class Tokens(LinearDecay):
        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.SGD(self.parameters(), lr=LR)
            decay = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_iters=10)
            return [optimizer], [SampleDrivenLR(decay, unit="token", total=1000)]

    x, y = make_data(SAMPLES)
    with pytest.raises(ValueError, match="SampleDrivenLR\\(unit='token'\\) moves by the tokens"):
        trainer([AccumulationScheduler({0: 2})], max_epochs=1).fit(Tokens(), DataLoader(TensorDataset(x, y), 4))


# ==================== tests_pytorch/callbacks/test_lr_monitor.py, with the scheduler moved by samples


class _Boring(BoringModel):
    """BoringModel whose scheduler is wrapped; ``opt`` picks the optimizer as the upstream tests do."""

    def __init__(self, opt: str = "SGD", name: str | None = None) -> None:
        super().__init__()
        self.opt, self.name = opt, name

    def configure_optimizers(self) -> Any:
        kwargs = {"momentum": 0.9} if self.opt == "SGD" else {"betas": (0.9, 0.999)}
        optimizer = getattr(optim, self.opt)(self.parameters(), lr=1e-2, **kwargs)
        one_cycle = optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=10_000)
        # the upstream tests return the scheduler alone (interval "epoch"); moved by samples, it is sized in steps
        config: dict[str, Any] = {"scheduler": SampleDrivenLR(one_cycle, steps=10_000), "interval": "step"}
        if self.name:
            config["name"] = self.name
        return [optimizer], [config]


def _monitored(tmp_path, model: BoringModel, **monitor: Any) -> tuple[pl.Trainer, LearningRateMonitor]:
    lr_monitor = LearningRateMonitor(**monitor)
    run = pl.Trainer(
        default_root_dir=tmp_path,
        max_epochs=2,
        limit_val_batches=2,
        limit_train_batches=6,
        log_every_n_steps=1,
        callbacks=[lr_monitor, AccumulationScheduler({0: 2})],
        logger=CSVLogger(tmp_path),
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    run.fit(model)
    return run, lr_monitor


# ported from tests/tests_pytorch/callbacks/test_lr_monitor.py::test_lr_monitor_single_lr
def test_lr_monitor_single_lr(tmp_path):
    run, lr_monitor = _monitored(tmp_path, _Boring())
    assert lr_monitor.lrs, "No learning rates logged"
    assert all(v is None for v in lr_monitor.last_momentum_values.values()), "Momentum should not be logged by default"
    assert len(lr_monitor.lrs) == len(run.lr_scheduler_configs)
    assert list(lr_monitor.lrs) == ["lr-SGD"]


# ported from tests/tests_pytorch/callbacks/test_lr_monitor.py::test_lr_monitor_single_lr_with_momentum
@pytest.mark.parametrize("opt", ["SGD", "Adam"])
def test_lr_monitor_single_lr_with_momentum(tmp_path, opt: str):
    run, lr_monitor = _monitored(tmp_path, _Boring(opt), log_momentum=True, log_weight_decay=True)
    assert all(v is not None for v in lr_monitor.last_momentum_values.values()), "Expected momentum to be logged"
    assert len(lr_monitor.last_momentum_values) == len(run.lr_scheduler_configs)
    assert all(k == f"lr-{opt}-momentum" for k in lr_monitor.last_momentum_values)
    assert all(k == f"lr-{opt}-weight_decay" for k in lr_monitor.last_weight_decay_values)


# ported from tests/tests_pytorch/callbacks/test_lr_monitor.py::test_lr_monitor_custom_name
def test_lr_monitor_custom_name(tmp_path):
    _, lr_monitor = _monitored(tmp_path, _Boring(name="my_logging_name"))
    assert list(lr_monitor.lrs) == ["my_logging_name"]
