"""Seesaw, the LR schedule's bound on adaptive growth, and beta2 following the batch: the factors read off an LR
schedule by hand, each shell's weights against a plain-PyTorch loop that does the same by hand, resume, refusals."""

from __future__ import annotations

import copy
import math
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_accum
from lightning_accum import AccumulationScheduler, SampleDrivenLR
from lightning_accum.core.events import Context, Event, Features, Run
from lightning_accum.core.fit import FitPlan
from lightning_accum.core.noise import NoiseReading, NoiseScaleEstimate
from lightning_accum.core.schedule import Schedule
from lightning_accum.core.seesaw import decay_ratios, growth_bound, planned_steps, seesaw_schedule, steps_ratio
from lightning_accum.fabric import Accumulator
from lightning_accum.features import AdaptiveGrowth, Seesaw
from tests.helpers import LR, RegressionModule, make_data, make_net, max_deviation, trainer, weights

MICRO, SAMPLES = 4, 96  # 24 micro-batches in the epoch
STEPS = SAMPLES // MICRO  # the steps at factor 1, which the StepLR below is sized with
# StepLR(step_size=6, gamma=0.5) over 24 steps spread over 96 samples halves the LR at 24, 48 and 72 samples: factor
# 1 until 24, then 2, 4 (from 48) and 8 (from 72). Windows open where the previous ones ended: 6 of 1 (to 24), 3 of 2
# (to 48), 4 (48 to 64), 4 (64 to 80, opened before 72), and the epoch's 4 micro-batches left (an 8 cut short)
WINDOWS = [1] * 6 + [2] * 3 + [4, 4, 4]


def _factor_by_hand(samples: int, max_factor: int = 8) -> int:
    """The LR halved at a quarter, a half and three quarters of the samples: one doubling each, at most max_factor."""
    return min(max_factor, 2 ** sum(samples >= SAMPLES * q // 4 for q in (1, 2, 3)))


class HalvingAdamW(RegressionModule):
    """AdamW whose LR halves every quarter of the steps (StepLR), moved by samples (SampleDrivenLR)."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.01)
        steps = int(lightning_accum.estimated_stepping_batches(self.trainer))
        halving = torch.optim.lr_scheduler.StepLR(optimizer, step_size=steps // 4, gamma=0.5)
        return [optimizer], [{"scheduler": SampleDrivenLR(halving), "interval": "step"}]


class Planned(pl.Callback):
    """What ``estimated_stepping_batches`` says once the fit has started."""

    def __init__(self) -> None:
        self.steps: list[float] = []

    def on_train_start(self, trainer: pl.Trainer, *_: Any) -> None:
        self.steps.append(lightning_accum.estimated_stepping_batches(trainer))


def seesaw_reference(
    x: torch.Tensor, y: torch.Tensor, rule: str = "sqrt", beta2: bool = False, dtype: torch.dtype = torch.float64
) -> tuple[nn.Module, list[int]]:
    """Plain PyTorch: AdamW on each window's mean loss; the window's factor doubles at each quarter of the samples (a
    halving of the StepLR), the LR is the StepLR's times the rule's scale of the batch the window holds, the StepLR
    stepped to ``floor(samples x 24 / 96)`` after each window; with ``beta2``, each update's beta2 is 0.999 ** size."""
    net = make_net().to(dtype)
    optimizer = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.01)
    halving = torch.optim.lr_scheduler.StepLR(optimizer, step_size=STEPS // 4, gamma=0.5)
    start, taken, sizes = 0, 0, []
    while start < SAMPLES:
        size = min(_factor_by_hand(start), (SAMPLES - start) // MICRO)
        optimizer.zero_grad()
        for index in range(start, start + size * MICRO, MICRO):
            (nn.functional.mse_loss(net(x[index : index + MICRO]), y[index : index + MICRO]) / size).backward()
        scheduled = optimizer.param_groups[0]["lr"]
        optimizer.param_groups[0]["lr"] = scheduled * (math.sqrt(size) if rule == "sqrt" else size)
        if beta2:
            optimizer.param_groups[0]["betas"] = (0.9, 0.999**size)
        optimizer.step()
        optimizer.param_groups[0]["lr"], optimizer.param_groups[0]["betas"] = scheduled, (0.9, 0.999)
        start += size * MICRO
        sizes.append(size)
        while taken < min(STEPS, math.floor(start * STEPS / SAMPLES)):
            halving.step()
            taken += 1
    return net, sizes


# ------------------------------------------------------------------ the factors, read off an LR schedule


def test_the_factor_doubles_at_each_halving_of_step_decay_cosine_and_warmup_stable_decay():
    steps, total = 100, 1000
    step_decay = [0.5 ** (j // 25) for j in range(steps + 1)]
    assert seesaw_schedule(step_decay, steps, total, "sample", base=1, max_factor=16).points == (
        (0, 1),
        (250, 2),
        (500, 4),
        (750, 8),
        (1000, 16),
    )
    # warmup over 10 steps, then cosine to 0: the peak is at step 10; the LR is half of it mid-way through the decay
    cosine = [(j + 1) / 10 if j < 10 else 0.5 * (1 + math.cos(math.pi * (j - 10) / 90)) for j in range(steps + 1)]
    points = dict(seesaw_schedule(cosine, steps, total, "token", base=2, max_factor=8).points)
    assert points == {0: 2, 550: 4, 700: 8}  # 0.5 at step 55, 0.25 at step 70 (cos(2pi/3) = -0.5), at most 8
    # warmup-stable-decay: held at the peak, then a linear decay to 0 over the last fifth
    wsd = [min(1.0, (j + 1) / 10) if j < 80 else (100 - j) / 20 for j in range(steps + 1)]
    assert dict(seesaw_schedule(wsd, steps, total, "sample", base=1, max_factor=4).points) == {0: 1, 900: 2, 950: 4}


def test_the_warmup_never_grows_the_batch_and_a_rising_lr_brings_it_back():
    assert decay_ratios([0.1, 0.5, 1.0, 0.4, 1.0]) == [1.0, 1.0, 1.0, 2.5, 1.0]
    restart = [1.0, 0.5, 0.25, 1.0, 0.5]  # a warm restart: the peak again, the factor back at its base
    assert dict(seesaw_schedule(restart, 4, 40, "sample", base=1, max_factor=8).points) == {
        0: 1,
        10: 2,
        20: 4,
        30: 1,
        40: 2,
    }


def test_the_growth_bound_is_the_peak_over_the_current_lr_times_the_first_factor():
    lrs = [0.5, 1.0, 0.8, 0.5, 0.3, 0.1]
    assert dict(growth_bound(lrs, 5, 500, "token", base=2, max_factor=16).points) == {0: 2, 300: 4, 400: 6, 500: 16}


def test_the_steps_a_schedule_takes_counted_window_by_window():
    schedule = Schedule(((0, 1), (24, 2), (48, 4), (72, 8)), unit="sample")
    assert planned_steps(schedule, total=96, per_micro_step=4) == 6 + 3 + 2 + 1  # 80 -> 112 passes the end
    assert steps_ratio(schedule, total=96, base=1) == pytest.approx(0.25 + 0.25 / 2 + 0.25 / 4 + 0.25 / 8)


def test_reading_the_lr_schedule_ahead_leaves_it_as_it_was():
    """A warmup-then-cosine SequentialLR and a OneCycleLR step on exactly as an untouched copy does."""
    for build in (
        lambda o: torch.optim.lr_scheduler.SequentialLR(
            o,
            [torch.optim.lr_scheduler.LinearLR(o, 0.1, 1.0, 5), torch.optim.lr_scheduler.CosineAnnealingLR(o, 15)],
            milestones=[5],
        ),
        lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=21),
    ):
        params = [nn.Parameter(torch.zeros(2))]
        optimizer, twin = torch.optim.AdamW(params, lr=0.1), torch.optim.AdamW(copy.deepcopy(params), lr=0.1)
        read, untouched = SampleDrivenLR(build(optimizer), steps=20, total=200), build(twin)
        ahead = read.planned_lrs()
        lrs = []
        for _ in range(20):
            optimizer.step()
            twin.step()
            read.step()
            untouched.step()
            lrs.append(untouched.get_last_lr()[0])
            assert optimizer.param_groups[0]["lr"] == twin.param_groups[0]["lr"]
        assert ahead[1:] == pytest.approx(lrs, rel=1e-12)
        assert optimizer.param_groups[0]["betas"] == twin.param_groups[0]["betas"]


# ------------------------------------------------------------------ both shells against a plain loop


@pytest.mark.parametrize(("rule", "beta2"), [("sqrt", False), ("linear", False), ("sqrt", True)])
def test_seesaw_in_the_trainer_equals_a_plain_loop_doing_it_by_hand(rule, beta2):
    x, y = make_data(SAMPLES)
    module = HalvingAdamW().double()
    callback, planned = AccumulationScheduler(seesaw=True, lr_scaling=rule, beta2_follows_batch=beta2), Planned()
    run = trainer([callback, planned], max_epochs=1, precision="64-true")
    run.fit(module, DataLoader(TensorDataset(x.double(), y.double()), batch_size=MICRO))
    net, sizes = seesaw_reference(x.double(), y.double(), rule, beta2)
    assert sizes == WINDOWS
    assert run.global_step == len(WINDOWS)
    assert planned.steps == [len(WINDOWS)]  # known from the fit's start
    assert lightning_accum.estimated_stepping_batches(run) == STEPS  # after the fit: the schedule's own again
    assert max_deviation(weights(module), list(net.parameters())) <= 1e-12
    assert module.optimizers().param_groups[0]["betas"] == (0.9, 0.999)  # type: ignore[union-attr]
    assert run.lr_scheduler_configs[0].scheduler.taken == STEPS  # the schedule ended where the data ended


@pytest.mark.parametrize("beta2", [False, True])
def test_seesaw_in_fabric_equals_the_same_plain_loop(beta2):
    x, y = make_data(SAMPLES)
    fabric = Fabric(accelerator="cpu", devices=1)
    net = make_net()
    optimizer = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.01)
    model, optimizer = fabric.setup(net, optimizer)
    halving = torch.optim.lr_scheduler.StepLR(optimizer, step_size=STEPS // 4, gamma=0.5)
    loader = DataLoader(TensorDataset(x, y), batch_size=MICRO)
    accumulator = Accumulator(
        fabric,
        model,
        optimizer,
        lr_scaling="sqrt",
        seesaw=True,
        beta2_follows_batch=beta2,
        lr_scheduler=SampleDrivenLR(halving, steps=STEPS, total=SAMPLES),
        log_metrics=False,
    )
    sizes = []
    for batch in accumulator.batches(loader):
        inputs, targets = batch
        with accumulator.micro_step(batch) as micro:
            micro.backward(nn.functional.mse_loss(model(inputs), targets))
        if micro.should_step:
            sizes.append(accumulator.factor)
            optimizer.step()
            optimizer.zero_grad()
    reference, expected = seesaw_reference(x, y, beta2=beta2, dtype=torch.float32)
    assert sizes == expected == WINDOWS
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.999)
    assert max_deviation(list(net.parameters()), list(reference.parameters())) <= 1e-6


def test_a_run_resumed_in_the_middle_keeps_the_factors_it_started_with(tmp_path):
    """Written after step 8 (32 samples, factor 2): the resumed run reads its factors from the checkpoint, not from
    the LR schedule, which by then stands past two of its halvings."""
    x, y = make_data(SAMPLES)
    whole = HalvingAdamW()
    trainer([AccumulationScheduler(seesaw=True, lr_scaling="sqrt")], max_epochs=1).fit(
        whole, DataLoader(TensorDataset(x, y), batch_size=MICRO)
    )
    reference, _ = seesaw_reference(x, y, dtype=torch.float32)
    assert max_deviation(weights(whole), list(reference.parameters())) <= 1e-6

    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=8, save_top_k=-1, filename="{step}")
    first = trainer(
        [AccumulationScheduler(seesaw=True, lr_scaling="sqrt"), checkpoint], max_epochs=1, enable_checkpointing=True
    )
    first.fit(HalvingAdamW(), DataLoader(TensorDataset(x, y), batch_size=MICRO))
    resumed, callback = HalvingAdamW(seed=99), AccumulationScheduler(seesaw=True, lr_scaling="sqrt")
    second = trainer([callback], max_epochs=1)
    second.fit(resumed, DataLoader(TensorDataset(x, y), batch_size=MICRO), ckpt_path=tmp_path / "step=8.ckpt")
    assert second.global_step == len(WINDOWS)
    assert max_deviation(weights(resumed), weights(whole)) <= 1e-6


# ------------------------------------------------------------------ what the user is told


def test_seesaw_refuses_what_it_cannot_read_before_any_weight_changes():
    x, y = make_data(SAMPLES)
    module = RegressionModule()  # plain SGD, no LR schedule
    before = weights(module)
    with pytest.raises(ValueError, match=r"seesaw=True.*SampleDrivenLR"):
        trainer([AccumulationScheduler(seesaw=True)], max_epochs=1).fit(module, DataLoader(TensorDataset(x, y)))
    assert max_deviation(weights(module), before) == 0.0
    changing = trainer([AccumulationScheduler(scheduling={0: 1, 2: 2}, seesaw=True, lr_scaling="sqrt")], max_epochs=1)
    with pytest.raises(ValueError, match=r"accumulation schedule changes it"):
        changing.fit(HalvingAdamW(), DataLoader(TensorDataset(x, y), batch_size=MICRO))
    with pytest.raises(ValueError, match=r"`seesaw=True`.*`adaptive=True`.*choose one"):
        AccumulationScheduler(seesaw=True, noise_scale=True, adaptive=True)
    with pytest.raises(ValueError, match=r"`seesaw_max_factor` must be an integer >= 2, got 1"):
        AccumulationScheduler(seesaw=True, seesaw_max_factor=1)
    with pytest.raises(ValueError, match=r"`beta2_follows_batch=True`.*SGD has param groups without two `betas`"):
        trainer([AccumulationScheduler(beta2_follows_batch=True)], max_epochs=1).fit(
            RegressionModule(), DataLoader(TensorDataset(x, y))
        )


def test_a_run_bounded_by_max_steps_is_told_its_lr_schedule_ends_early():
    x, y = make_data(SAMPLES)
    run = trainer([AccumulationScheduler(seesaw=True, lr_scaling="sqrt")], max_steps=5)
    with pytest.warns(UserWarning, match=r"seesaw=True in a run bounded by `max_steps`"):
        run.fit(HalvingAdamW(), DataLoader(TensorDataset(x, y), batch_size=MICRO))


def test_the_summary_says_where_the_factor_doubles(caplog):
    x, y = make_data(SAMPLES)
    callback = AccumulationScheduler(seesaw=True, lr_scaling="sqrt", noise_scale=True, noise_scale_interval=1)
    with caplog.at_level("INFO"):
        trainer([callback], max_epochs=1).fit(HalvingAdamW(), DataLoader(TensorDataset(x, y), batch_size=MICRO))
    assert "seesaw: factor 1 -> 2 at 25% of the samples, -> 4 at 50%, -> 8 at 75%" in caplog.text
    assert f"0.47 x the optimizer steps of factor 1 throughout, {len(WINDOWS)} planned" in caplog.text


@pytest.mark.parametrize(
    ("noise_scale", "measurements", "warned"),
    [
        (100.0, 8.0, True),  # 8 x 32 samples, well past a noise scale of 100 known within a few percent
        (100.0, 1.0, False),  # one measurement: no bound to be sure of
        (1000.0, 8.0, False),  # the batch stays under the noise scale
    ],
)
def test_a_batch_past_the_noise_scales_upper_bound_is_warned_once(noise_scale, measurements, warned):
    optimizer = torch.optim.AdamW([nn.Parameter(torch.zeros(1))], lr=1e-3)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=100)
    driven = SampleDrivenLR(cosine, steps=100, total=6400)
    driven.attach(lambda: 0.0, steps=100, total=6400)
    features = Features([Seesaw(max_factor=8)])
    ctx = Context(run=_Cosine(driven), plan=FitPlan(micro_batch_size=32, schedule=Schedule.constant(1)))
    features.dispatch(Event.FIT_START, ctx)
    estimate = NoiseScaleEstimate(
        1.0, noise_scale, noise_scale, measurements, grad_sq_var=1e-4, trace_var=1.0, covariance=0.0
    )
    ctx.noise = NoiseReading(estimate, 32.0, 1, 1)
    ctx.samples_seen = 6000  # past the cosine's third halving: factor 8
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):  # three windows: at most one warning
            features.dispatch(Event.WINDOW_OPENING, ctx)
    assert ctx.factor == 8
    told = [str(w.message) for w in caught if "outgrows the measured noise scale" in str(w.message)]
    assert len(told) == int(warned)
    if warned:
        assert "Seesaw's batch at factor 8 (256 samples) outgrows the measured noise scale (at most 10" in told[0]


@pytest.mark.parametrize(("cap", "warned"), [(4.0, True), (8.0, False), (None, False)])
def test_seesaw_past_the_factor_lr_scale_max_allows_is_warned(cap, warned):
    """Under the linear rule a cap of 4 stops the scale at factor 4: past it the rule gives back no share of the
    schedule's halvings. A cap of 8 (or none) gives back every one."""
    from lightning_accum.features import LRScaling

    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    driven = SampleDrivenLR(torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=100), steps=100, total=6400)
    driven.attach(lambda: 0.0, steps=100, total=6400)
    features = Features([LRScaling("linear", base_batch_size=32, max_scale=cap), Seesaw(8, "linear")])
    ctx = Context(run=_Cosine(driven), plan=FitPlan(micro_batch_size=32, schedule=Schedule.constant(1)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        features.dispatch(Event.FIT_START, ctx)
    told = [str(w.message) for w in caught if "lr_scale_max stops" in str(w.message)]
    assert len(told) == int(warned)
    if warned:
        assert "Seesaw's factor reaches 8, but lr_scale_max stops the LR rule's scale at factor 4" in told[0]
        assert "seesaw_max_factor=4" in told[0]


# ------------------------------------------------------------------ adaptive growth held to the LR schedule


class _Cosine(Run):
    def __init__(self, driven: SampleDrivenLR) -> None:
        self.driven, self.lines = driven, []

    @property
    def lr_schedulers(self) -> list[tuple[Any, str, int]]:
        return [(self.driven, "step", 1)]

    def print(self, text: str) -> None:
        self.lines.append(text)


def test_adaptive_growth_is_held_to_the_peak_over_the_current_lr_and_says_so():
    """A noise scale of about 100 samples calls for factor 12 (8 samples a micro-step); the cosine allows 1 until
    its LR halves (half the samples), then the peak over the current LR."""
    optimizer = torch.optim.AdamW([nn.Parameter(torch.zeros(1))], lr=1.0)
    driven = SampleDrivenLR(torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=100), steps=100, total=8000)
    driven.attach(lambda: 0.0, steps=100, total=8000)
    run = _Cosine(driven)
    growth = AdaptiveGrowth(target=1.0, max_factor=16)
    features, ctx = Features([growth]), Context(run=run, factor=1, plan=FitPlan(micro_batch_size=8))
    features.dispatch(Event.FIT_START, ctx)
    sure = NoiseScaleEstimate(1.0, 100.0, 100.0, 8.0, grad_sq_var=1e-4, trace_var=1.0, covariance=0.0)
    factors = []
    for step in range(1, 1000):
        ctx.factor, ctx.optimizer_steps = 1, step - 1
        ctx.noise = NoiseReading(sure, 8.0 * max(1, growth.factor), max(1, growth.factor), step, evidence=sure)
        features.dispatch(Event.WINDOW_OPENING, ctx)
        factors.append(ctx.factor)
        ctx.samples_seen += 8 * ctx.factor
    bound = growth.bound
    assert bound is not None
    assert max(factors[: factors.index(2)]) == 1
    first_growth = sum(8 * f for f in factors[: factors.index(2)])
    assert first_growth >= 4000  # never before the cosine's LR halved (at half of the 8000 samples)
    for position, factor in zip(_positions(factors), factors, strict=True):
        assert factor <= bound.factor_at(position)
    assert any("held to" in line and "by the budget (the LR schedule's peak" in line for line in run.lines)


def test_far_below_the_noise_scale_growth_passes_the_lr_schedules_bound_up_to_a_tenth_of_it():
    """A noise scale of about 1,000 samples: a batch of 12 x 8 = 96 samples, under a tenth of it, costs at most a
    tenth more examples, so growth reaches factor 12 before the cosine's LR has halved, and no further."""
    optimizer = torch.optim.AdamW([nn.Parameter(torch.zeros(1))], lr=1.0)
    driven = SampleDrivenLR(torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=100), steps=100, total=80_000)
    driven.attach(lambda: 0.0, steps=100, total=80_000)
    growth = AdaptiveGrowth(target=1.0, max_factor=64)
    features, ctx = Features([growth]), Context(run=_Cosine(driven), factor=1, plan=FitPlan(micro_batch_size=8))
    features.dispatch(Event.FIT_START, ctx)
    sure = NoiseScaleEstimate(1.0, 1000.0, 1000.0, 8.0, grad_sq_var=1e-4, trace_var=1.0, covariance=0.0)
    factors = []
    while ctx.samples_seen < 20_000:  # the cosine's LR is above 0.85 of its peak: its own bound is 1
        ctx.factor = 1
        reading = NoiseReading(sure, 8.0 * max(1, growth.factor), max(1, growth.factor), ctx.optimizer_steps + 1)
        ctx.noise = replace(reading, evidence=sure)
        features.dispatch(Event.WINDOW_OPENING, ctx)
        factors.append(ctx.factor)
        ctx.samples_seen, ctx.optimizer_steps = ctx.samples_seen + 8 * ctx.factor, ctx.optimizer_steps + 1
    assert growth.bound is not None
    assert growth.bound.factor_at(20_000) == 1
    assert max(factors) == 12


@pytest.mark.parametrize(
    ("noise_scale", "scheduled", "expected"),
    [
        (100.0, True, 4),  # past the cosine's halvings the schedule allows 8, the cap stops the rule's scale at 4
        (1000.0, True, 12),  # a tenth of 1,000 samples is 12 micro-batches of 8: growth past the cap costs little
        (100.0, False, 12),  # a constant rate: growth is its only decay, the noise scale alone calls it (100 // 8)
    ],
)
def test_past_lr_scale_max_a_scheduled_run_grows_only_to_a_tenth_of_the_noise_scale(noise_scale, scheduled, expected):
    """Past the factor where lr_scale_max stops the linear rule's scale, a larger batch lowers the LR per sample on
    top of the LR schedule's decay: under a schedule only a batch of at most a tenth of the noise scale passes it. At
    a constant rate nothing else decays the LR, and growth follows the noise scale."""
    from lightning_accum.features import LRScaling

    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    driven = SampleDrivenLR(torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=100), steps=100, total=8000)
    driven.attach(lambda: 0.0, steps=100, total=8000)
    growth = AdaptiveGrowth(target=1.0, max_factor=16)
    features = Features([LRScaling("linear", base_batch_size=8, max_scale=4), growth])
    ctx = Context(run=_Cosine(driven) if scheduled else Run(), factor=1, plan=FitPlan(micro_batch_size=8))
    features.dispatch(Event.FIT_START, ctx)
    assert ctx.lr_cap_factor == 4
    sure = NoiseScaleEstimate(1.0, noise_scale, noise_scale, 8.0, grad_sq_var=1e-4, trace_var=1.0, covariance=0.0)
    for step in range(1, 300):
        ctx.factor, ctx.optimizer_steps = 1, step - 1
        ctx.noise = NoiseReading(sure, 8.0 * max(1, growth.factor), max(1, growth.factor), step, evidence=sure)
        features.dispatch(Event.WINDOW_OPENING, ctx)
        ctx.samples_seen = 7800  # near the cosine's end, where its own bound is 8 and more
    assert growth.bound is None or growth.bound.factor_at(7800) >= 8
    assert growth.factor == expected


def _positions(factors: list[int]) -> list[int]:
    positions, seen = [], 0
    for factor in factors:
        positions.append(seen)
        seen += 8 * factor
    return positions


def test_the_dashboard_draws_the_factor_the_lr_and_the_beta2_each_step_used(tmp_path):
    import csv

    from lightning.pytorch.loggers import CSVLogger

    x, y = make_data(SAMPLES)
    callback = AccumulationScheduler(seesaw=True, lr_scaling="sqrt", beta2_follows_batch=True)
    logger = CSVLogger(tmp_path, name="run")
    run = trainer([callback], max_epochs=1, logger=logger, log_every_n_steps=1)
    run.fit(HalvingAdamW(), DataLoader(TensorDataset(x, y), batch_size=MICRO))
    with open(Path(logger.log_dir) / "metrics.csv") as metrics:
        rows = [row for row in csv.DictReader(metrics) if row.get("accum/factor")]
    factors = [float(row["accum/factor"]) for row in rows]
    assert factors == [1.0] * 6 + [2.0] * 3 + [4.0, 4.0, 8.0]  # the last: factor 8, cut short to the epoch's 4
    for row, size in zip(rows, WINDOWS, strict=True):
        assert float(row["accum/beta2"]) == pytest.approx(0.999**size, rel=1e-9)
    halvings = [float(row["accum/lr"]) / LR for row in rows]  # the StepLR's rate times sqrt(window)
    assert halvings[0] == pytest.approx(1.0)
    assert halvings[6] == pytest.approx(0.5 * math.sqrt(2))  # the first window of 2: the LR fell by sqrt(2), not 2
