"""Each feature on its own, driven through its window events without a Trainer, against plain PyTorch.

``drive`` plays the coordinator's part as Lightning would: the loss divided by the window's size, backward, then at the
window's end the gradient scale a feature set, applied once. The references are plain PyTorch computations.
"""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch
from torch import nn

from lightning_accum.core.events import Context, Event, Feature, Features, Run
from lightning_accum.core.fit import FitPlan
from lightning_accum.core.noise import NoiseReading, NoiseScaleEstimate
from lightning_accum.core.window import Window
from lightning_accum.features import AdaptiveGrowth, ItemWeighting, LRScaling, Metrics, NoiseScale
from tests.helpers import make_data, make_net, make_tokens, token_loss


def drive(
    features: Features,
    ctx: Context,
    net: nn.Module,
    batches: list[Any],
    loss_fn: Any,
    set_to_none: bool = True,
    create_graph: bool = False,
) -> None:
    """One window over ``batches``, with the events in the order the callback dispatches them around Lightning's."""
    ctx.module = net
    ctx.window = Window()
    ctx.window.open(len(batches))
    features.dispatch(Event.WINDOW_OPENED, ctx)
    net.zero_grad(set_to_none=set_to_none)
    for batch in batches:
        ctx.window.take(ends_epoch=False)
        ctx.batch = batch
        features.dispatch(Event.MICRO_BATCH_STARTED, ctx)
        loss = loss_fn(net, batch) / ctx.window.size  # Lightning's division
        returned = loss.detach().clone()  # what training_step's output holds, untouched by re-weighing
        ctx.loss, ctx.loss_divisor = loss, float(ctx.window.size)
        features.dispatch(Event.BEFORE_BACKWARD, ctx)
        loss.backward(create_graph=create_graph)
        features.dispatch(Event.AFTER_BACKWARD, ctx)
        if ctx.window.closed:
            ctx.gradient_scale = ctx.window.gradient_correction
            features.dispatch(Event.WINDOW_CLOSING, ctx)
            with torch.no_grad():
                for param in net.parameters():
                    param.grad.mul_(ctx.gradient_scale)
            features.dispatch(Event.GRADIENT_READY, ctx)
        ctx.loss = returned
        features.dispatch(Event.MICRO_BATCH_ENDED, ctx)


def mse(net: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(net(batch[0]), batch[1])


def grads(net: nn.Module) -> list[torch.Tensor]:
    return [param.grad.detach().clone() for param in net.parameters()]


def big_batch_grads(loss: torch.Tensor, net: nn.Module) -> list[torch.Tensor]:
    return [grad.detach() for grad in torch.autograd.grad(loss, list(net.parameters()))]


def assert_close(a: list[torch.Tensor], b: list[torch.Tensor], tolerance: float = 1e-6) -> None:
    assert max((x - y).abs().max().item() for x, y in zip(a, b, strict=True)) <= tolerance


# ------------------------------------------------------------------ the dispatcher


def test_features_get_only_the_events_they_override_in_registration_order():
    seen: list[str] = []

    class First(Feature):
        name = "first"

        def window_closed(self, ctx: Context) -> None:
            seen.append("first")

    class Second(Feature):
        name = "second"

        def window_closed(self, ctx: Context) -> None:
            seen.append("second")

        def before_backward(self, ctx: Context) -> None:
            seen.append("second:backward")

    features = Features([First(), Second()])
    assert [event for event in Event if features.handle(event)] == [Event.BEFORE_BACKWARD, Event.WINDOW_CLOSED]
    features.dispatch(Event.WINDOW_CLOSED, Context())
    features.dispatch(Event.WINDOW_OPENED, Context())
    assert seen == ["first", "second"]
    assert list(features) == ["first", "second"]


def test_the_checkpoint_holds_each_feature_under_its_name():
    features = Features([AdaptiveGrowth(), LRScaling("sqrt", warmup_steps=3)])
    state = features.state_dict()
    assert set(state) == {"adaptive", "lr_scaling"}
    assert state["lr_scaling"]["warmup"] == {"start": 1.0, "target": 1.0, "since": 0}
    restored = Features([AdaptiveGrowth(), LRScaling("sqrt", warmup_steps=3)])
    restored.load_state_dict({"adaptive": {"factor": 8}})  # a missing entry loads as empty
    assert restored["adaptive"].factor == 8  # type: ignore[attr-defined]


# ------------------------------------------------------------------ item weighting


@pytest.mark.parametrize("sizes", [[5, 1, 3], [2, 2], [7]])
def test_sample_weighting_makes_the_window_step_on_the_mean_over_its_samples(sizes):
    x, y = make_data(sum(sizes))
    net, reference = make_net(), make_net()
    bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    batches = [(x[a:b], y[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    ctx = Context()
    drive(Features([ItemWeighting("sample")]), ctx, net, batches, mse)
    assert_close(grads(net), big_batch_grads(mse(reference, (x, y)), reference))
    assert ctx.window_items == sum(sizes)
    # micro-batches of one size weigh what Lightning's division gave them: the gradient is left untouched
    assert (ctx.gradient_scale == 1.0) == (len(set(sizes)) == 1)


def test_token_weighting_makes_the_window_step_on_the_mean_over_its_tokens():
    tokens = make_tokens(9, seed=3)
    net, reference = make_net(), make_net()
    batches = [{key: value[a:b] for key, value in tokens.items()} for a, b in ((0, 2), (2, 7), (7, 9))]
    ctx = Context()
    drive(
        Features([ItemWeighting("token")]),
        ctx,
        net,
        batches,
        lambda model, batch: token_loss(model, batch["features"], batch["labels"]),
    )
    expected = big_batch_grads(token_loss(reference, tokens["features"], tokens["labels"]), reference)
    assert_close(grads(net), expected)
    assert ctx.window_items == int((tokens["labels"] != -100).sum())


def test_item_weighting_is_picklable_for_ddp_spawn():
    for feature in (ItemWeighting("token", token_key="y"), ItemWeighting("sample")):
        assert pickle.loads(pickle.dumps(feature)).normalize_by == feature.normalize_by


def count_rows(batch):
    return len(batch[0])


def test_everything_the_user_hands_lightning_pickles_before_and_after_a_fit():
    """ddp_spawn pickles the Trainer (callbacks, strategy) and the module; a second fit may come after the first."""
    from lightning_accum import (
        AccumulationScheduler,
        DDPAccumulationStrategy,
        FSDPAccumulationStrategy,
        ManualAccumulation,
        ModelParallelAccumulationStrategy,
    )
    from tests.helpers import RegressionModule, loader, make_data, trainer

    callback = AccumulationScheduler(
        target_batch_size=16,
        ramp_start_batch_size=4,
        ramp_increment=4,
        ramp_samples=16,
        normalize_by="sample",
        count_items=count_rows,
        lr_scaling="sqrt",
        lr_warmup_steps=2,
        noise_scale=True,
        adaptive=True,
    )
    assert pickle.loads(pickle.dumps(callback)).state_dict() == callback.state_dict()
    x, y = make_data(32)
    trainer([callback], max_epochs=1).fit(RegressionModule(), loader(x, y, 4))
    assert pickle.loads(pickle.dumps(callback)).state_dict() == callback.state_dict()

    class Manual(RegressionModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.accumulation = ManualAccumulation(2)

        def training_step(self, batch, batch_idx):
            with self.accumulation.micro_step(self) as micro:
                self.manual_backward(micro.scale(super().training_step(batch, batch_idx)))
            if micro.should_step:
                self.optimizers().step()
                self.optimizers().zero_grad()

    module = Manual()
    trainer(max_epochs=1).fit(module, loader(x, y, 4))  # registers its step checks on the optimizer
    assert pickle.loads(pickle.dumps(module.accumulation)).factor == module.accumulation.factor
    for strategy in (DDPAccumulationStrategy(), FSDPAccumulationStrategy(), ModelParallelAccumulationStrategy()):
        assert type(pickle.loads(pickle.dumps(strategy))) is type(strategy)


# ------------------------------------------------------------------ noise scale


def test_noise_scale_matches_the_unbiased_estimators_computed_directly():
    x, y = make_data(24, seed=5)
    net = make_net()
    batches = [(x[i : i + 6], y[i : i + 6]) for i in range(0, 24, 6)]
    ctx = Context()
    drive(Features([NoiseScale(decay=0.0, interval=1)]), ctx, net, batches, mse)
    # plain PyTorch: each micro-batch's mean-loss gradient and the window's, then McCandlish et al.'s A.1
    reference = make_net()
    small = [torch.cat([g.flatten() for g in big_batch_grads(mse(reference, b), reference)]) for b in batches]
    big = torch.cat([g.flatten() for g in big_batch_grads(mse(reference, (x, y)), reference)])
    n, b = len(batches), 6
    s_small = torch.stack([(g @ g) for g in small]).mean().item()
    s_big = (big @ big).item()
    grad_sq = (n * s_big - s_small) / (n - 1)
    trace = b * n * (s_small - s_big) / (n - 1)
    assert ctx.noise.estimate.noise_scale == pytest.approx(trace / grad_sq, rel=1e-4)
    assert (ctx.noise.items, ctx.noise.micro_steps) == (pytest.approx(24.0), 4)


def _noise_scale_reference(net: nn.Module, batches: list[Any]) -> float:
    """McCandlish et al.'s A.1 from each micro-batch's mean-loss gradient and the window's, in plain PyTorch."""
    small = [torch.cat([g.flatten() for g in big_batch_grads(mse(net, b), net)]) for b in batches]
    x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    big = torch.cat([g.flatten() for g in big_batch_grads(mse(net, (x, y)), net)])
    n, b = len(batches), len(batches[0][0])
    s_small = torch.stack([(g @ g) for g in small]).mean().item()
    s_big = (big @ big).item()
    return (b * n * (s_small - s_big) / (n - 1)) / ((n * s_big - s_small) / (n - 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("micro_batches", [3, 12], ids=["3-backwards", "12-backwards"])
@pytest.mark.parametrize("set_to_none", [True, False], ids=["grads-none", "grads-zeroed"])
def test_noise_scale_from_large_and_small_tensors(set_to_none, micro_batches, dtype):
    # a weight of 256 x 128 beside small ones; the window's gradients start from None or zeroed
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(256, 128), nn.Tanh(), nn.Linear(128, 1)).to(dtype)
    x = torch.randn(16 * micro_batches, 256)
    y = (x[:, :1] * 3.0 + 0.3 * torch.randn(16 * micro_batches, 1)).to(dtype)  # a signal: |G|^2 above the noise
    x = x.to(dtype)
    batches = [(x[i : i + 16], y[i : i + 16]) for i in range(0, 16 * micro_batches, 16)]
    for param in net.parameters():
        param.grad = torch.ones_like(param)  # a previous window's, zeroed in place or set to None by drive
    ctx = Context()
    drive(Features([NoiseScale(decay=0.0, interval=1)]), ctx, net, batches, mse, set_to_none=set_to_none)
    expected = _noise_scale_reference(net, batches)
    assert expected > 0
    assert ctx.noise.estimate.noise_scale == pytest.approx(expected, rel=1e-4)


def test_noise_scale_counts_a_parameter_without_a_gradient_as_zero():
    """A head that only some micro-batches use: its gradient in the others is zero, not an earlier one's."""
    torch.manual_seed(0)
    heads = nn.ModuleList([nn.Linear(5, 1), nn.Linear(5, 1)])

    def loss_fn(net: nn.Module, batch: Any) -> torch.Tensor:
        x, y, head = batch
        return nn.functional.mse_loss(net[head](x), y)

    x, y = make_data(32, seed=4)
    batches = [(x[i : i + 8], y[i : i + 8], head) for i, head in zip(range(0, 32, 8), (0, 1, 1, 0), strict=True)]
    ctx = Context()
    drive(Features([NoiseScale(decay=0.0, interval=1)]), ctx, heads, batches, loss_fn)

    def flat_grad(loss: torch.Tensor) -> torch.Tensor:
        params = list(heads.parameters())
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        filled = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)]
        return torch.cat([g.flatten() for g in filled])

    small = [flat_grad(loss_fn(heads, batch)) for batch in batches]
    big = torch.stack(small).mean(0)  # the window's mean gradient: Lightning's division by the window's size
    n, b = 4, 8
    s_small = torch.stack([g @ g for g in small]).mean().item()
    s_big = (big @ big).item()
    grad_sq, trace = (n * s_big - s_small) / (n - 1), b * n * (s_small - s_big) / (n - 1)
    assert grad_sq > 0
    assert ctx.noise.estimate.noise_scale == pytest.approx(trace / grad_sq, rel=1e-4)


class SharedTwice(nn.Module):
    """A layer used twice, optionally under reentrant checkpointing (which backpropagates each use on its own)."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.shared, self.head = nn.Linear(5, 5), nn.Linear(5, 5), nn.Linear(5, 1)
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        x = torch.tanh(self.first(x))
        for _ in range(2):
            x = torch.tanh(checkpoint(self.shared, x, use_reentrant=True) if self.checkpointed else self.shared(x))
        return self.head(x)


def test_noise_scale_under_create_graph():
    """A backward with ``create_graph=True`` (second-order optimizers) hands the hooks gradients that require grad."""
    x, y = make_data(128, seed=7)
    batches = [(x[i : i + 32], y[i : i + 32]) for i in range(0, 128, 32)]
    ctx = Context()
    net = SharedTwice(checkpointed=False)
    drive(Features([NoiseScale(decay=0.0, interval=1)]), ctx, net, batches, mse, False, create_graph=True)
    expected = _noise_scale_reference(SharedTwice(checkpointed=False), batches)
    assert expected > 0
    assert ctx.noise.estimate.noise_scale == pytest.approx(expected, rel=1e-4)


def test_noise_scale_skips_a_window_whose_gradients_come_in_parts_under_reentrant_checkpointing():
    """Reentrant checkpointing of a layer used twice hands each use's part of the layer's gradient to its hook on
    its own: the squared parts are not the squared gradient, so the window is not measured, with a warning."""
    x, y = make_data(128, seed=7)
    batches = [(x[i : i + 32], y[i : i + 32]) for i in range(0, 128, 32)]
    ctx = Context()
    net = SharedTwice(checkpointed=True)
    with pytest.warns(UserWarning, match="use_reentrant=False"):
        drive(Features([NoiseScale(decay=0.0, interval=1)]), ctx, net, batches, mse, False)
    assert ctx.noise is None or ctx.noise.estimate.noise_scale is None
    plain = SharedTwice(checkpointed=False)
    drive(Features([NoiseScale(decay=0.0, interval=1)]), ctx, plain, batches, mse, False)
    for a, b in zip(net.parameters(), plain.parameters(), strict=True):  # the gradients are autograd's, untouched
        torch.testing.assert_close(a.grad, b.grad)


def test_noise_scale_leaves_autograd_the_gradients_it_computes():
    """On a measured window every ``.grad`` is the tensor autograd made (created, or added into in place): the hooks
    read each micro-batch's gradient and keep nothing, so autograd never has to copy one."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(256, 128), nn.Tanh(), nn.Linear(128, 1))
    features, ctx = Features([NoiseScale(interval=1)]), Context(module=net)
    ctx.window.open(3)
    features.dispatch(Event.WINDOW_OPENED, ctx)
    computed: dict[int, int] = {}

    def observer(key: int) -> Any:
        return lambda grad: computed.__setitem__(key, grad.data_ptr())

    for param in net.parameters():  # registered after the feature's hooks: sees the gradient they saw
        param.register_hook(observer(id(param)))
    x, y = torch.randn(4, 256), torch.randn(4, 1)
    first: list[int] = []
    for index in range(3):
        ctx.window.take(ends_epoch=False)
        ctx.batch, ctx.loss_divisor = (x, y), 3.0
        features.dispatch(Event.MICRO_BATCH_STARTED, ctx)
        features.dispatch(Event.BEFORE_BACKWARD, ctx)
        (mse(net, (x, y)) / 3).backward()
        features.dispatch(Event.AFTER_BACKWARD, ctx)
        if index == 0:  # autograd took the tensor it computed as .grad (it would copy one something still held)
            first = [param.grad.data_ptr() for param in net.parameters()]
            assert first == [computed[id(param)] for param in net.parameters()]
        else:  # and added the later ones into it in place
            assert [param.grad.data_ptr() for param in net.parameters()] == first
    features.dispatch(Event.GRADIENT_READY, ctx)
    assert ctx.noise is not None
    assert ctx.noise.estimate.noise_scale is not None


def test_noise_scale_reads_the_items_and_the_loss_divisor_item_weighting_publishes():
    x, y = make_data(12, seed=6)
    sizes = [(0, 2), (2, 9), (9, 12)]
    batches = [(x[a:b], y[a:b]) for a, b in sizes]
    weighted, plain = Context(), Context()
    drive(Features([ItemWeighting("sample"), NoiseScale(decay=0.0, interval=1)]), weighted, make_net(), batches, mse)
    assert weighted.noise is not None
    assert (weighted.noise.items, weighted.noise.micro_steps) == (12.0, 3)  # the window's samples, as weighed
    drive(Features([NoiseScale(decay=0.0, interval=1)]), plain, make_net(), batches, mse)
    assert plain.noise is not None
    assert plain.noise.items != pytest.approx(12.0)  # micro-batch means: n / mean(1 / b_i)


@pytest.mark.parametrize(("interval", "log_every"), [(1, 0), (3, 0), (4, 6), (10, 0)])
def test_noise_scale_measures_every_interval_th_window_with_hooks_only_then(interval, log_every):
    """Hooks on the trainable parameters for the windows measured, none on the others nor after the fit; the steps
    measured are the multiples of ``interval``, whatever the logging interval (a logged step logs the latest)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 1))
    net[1].bias.requires_grad_(False)
    noise = NoiseScale(decay=0.0, interval=interval)
    features, ctx = Features([noise]), Context(module=net, log_every=log_every)
    x, y = make_data(48, seed=1)
    x = torch.cat([x, x, x, x[:, :1]], dim=1)  # 16 features
    measured = []
    for step in range(12):
        ctx.optimizer_steps = step
        ctx.window = Window()
        ctx.window.open(2)
        features.dispatch(Event.WINDOW_OPENED, ctx)
        hooked = [bool(param._backward_hooks) for param in net.parameters()]
        assert hooked == ([True, True, True, False] if noise._hooks else [False] * 4)
        net.zero_grad(set_to_none=True)
        for part in (slice(4 * step, 4 * step + 2), slice(4 * step + 2, 4 * step + 4)):
            ctx.window.take(ends_epoch=False)
            ctx.batch, ctx.loss_divisor = (x[part], y[part]), 2.0
            features.dispatch(Event.BEFORE_BACKWARD, ctx)
            (mse(net, ctx.batch) / 2).backward()
            features.dispatch(Event.AFTER_BACKWARD, ctx)
        noise.measurement = None
        features.dispatch(Event.GRADIENT_READY, ctx)
        if noise.measurement is not None:
            measured.append(step + 1)
        assert not any(param._backward_hooks for param in net.parameters())  # removed at the step
    expected = [s for s in range(1, 13) if s % interval == 0]
    assert measured == expected
    features.dispatch(Event.WINDOW_OPENED, ctx)
    features.dispatch(Event.FIT_END, ctx)
    assert not any(param._backward_hooks for param in net.parameters())


# ------------------------------------------------------------------ adaptive growth


def _reading(noise_scale: float, step: int, items: float = 16.0, micro_steps: int = 2) -> NoiseReading:
    """A reading with a tight interval (4 measurements, 1% scatter) around ``noise_scale``, as evidence too."""
    estimate = NoiseScaleEstimate(1.0, noise_scale, noise_scale, 4.0, 1e-4, (noise_scale / 100) ** 2, 0.0)
    return NoiseReading(estimate, items, micro_steps, step, evidence=estimate)


def test_adaptive_growth_decides_once_per_measured_window_and_broadcasts_rank_zeros_decision():
    growth = AdaptiveGrowth(target=1.0, max_factor=8)
    features = Features([growth])
    decided: list[int] = []
    ctx = Context(factor=2, is_global_zero=False, broadcast=lambda value: decided.append(value) or 4)
    ctx.noise, ctx.optimizer_steps = _reading(100.0, step=1), 1
    features.dispatch(Event.WINDOW_OPENING, ctx)
    assert decided == [2]  # a non-zero rank proposes nothing of its own and takes rank zero's answer
    assert ctx.factor == 4
    assert growth.factor == 4
    ctx.factor, ctx.optimizer_steps = 2, 2
    features.dispatch(Event.WINDOW_OPENING, ctx)  # no window measured since: no decision, no collective
    assert decided == [2]
    assert ctx.factor == 4


def test_adaptive_growth_waits_for_fresh_evidence_and_doubles_at_most_per_change():
    growth = AdaptiveGrowth(target=1.0, max_factor=64)
    features, factors = Features([growth]), []
    for step in range(1, 13):
        ctx = Context(factor=1, optimizer_steps=step)
        ctx.noise = _reading(1000.0, step=step, items=8.0, micro_steps=1)  # calls for 125 x 8: far above the maximum
        features.dispatch(Event.WINDOW_OPENING, ctx)
        factors.append(ctx.factor)
    # the first decision after 3 measured windows, then each change on 3 windows measured since the last one
    assert factors == [1, 1, 2, 2, 2, 4, 4, 4, 8, 8, 8, 16]


def test_adaptive_growth_resumes_with_the_measurement_it_decides_from():
    def run(steps: range, growth: AdaptiveGrowth) -> list[int]:
        features, factors = Features([growth]), []
        for step in steps:
            ctx = Context(factor=2, optimizer_steps=step)
            ctx.noise = _reading(4.0 * step, step=step - step % 3) if step >= 3 else None  # every 3rd measured
            features.dispatch(Event.WINDOW_OPENING, ctx)
            factors.append(ctx.factor)
        return factors

    whole = run(range(30), AdaptiveGrowth(max_factor=64, shrink=True))
    first = AdaptiveGrowth(max_factor=64, shrink=True)
    head = run(range(15), first)
    resumed = AdaptiveGrowth(max_factor=64, shrink=True)
    resumed.load_state_dict(copy.deepcopy(first.state_dict()))
    assert head + run(range(15, 30), resumed) == whole
    assert whole[-1] > 2


class PrintingRun(Run):
    def __init__(self) -> None:
        self.printed: list[str] = []

    def print(self, text: str) -> None:
        self.printed.append(text)


@pytest.mark.parametrize(("factor", "saved", "world", "carried"), [(4, 2, 1, 8), (3, 1, 3, 1), (8, 4, 2, 16)])
def test_adaptive_growth_resumed_on_other_ranks_keeps_the_global_batch_it_had_reached(factor, saved, world, carried):
    """Issue 47: the factor reached on ``saved`` ranks becomes factor x saved / world, with one line saying so."""
    growth = AdaptiveGrowth(max_factor=8)
    growth.load_state_dict({"factor": factor, "decided_at": 5, "fresh": 1, "world_size": saved})
    run = PrintingRun()
    ctx = Context(factor=2, world_size=world, run=run, plan=FitPlan(micro_batch_size=4))
    Features([growth]).dispatch(Event.FIT_START, ctx)
    assert growth.factor == carried
    assert ctx.factor == max(2, carried)  # the schedule's 2 is the floor
    above = ", above adaptive_max_factor=8" if carried > 8 else ""  # the batch is kept; growth stops there
    assert run.printed == [
        f"AccumulationScheduler: adaptive growth resumed on {world} process(es) from a checkpoint written on {saved}:"
        f" factor {factor} -> {carried} keeps the global batch of {factor * saved * 4} samples{above}"
    ]
    assert growth.state_dict()["world_size"] == world  # what the next checkpoint says


def test_adaptive_growth_refuses_a_global_batch_the_new_ranks_cannot_hold_naming_the_nearest_factor():
    growth = AdaptiveGrowth()
    growth.load_state_dict({"factor": 3, "world_size": 1})
    ctx = Context(factor=1, world_size=2, run=PrintingRun(), plan=FitPlan(micro_batch_size=4))
    with pytest.raises(
        ValueError,
        match=r"factor 3 on 1 process\(es\), a global batch of 12 samples.*nearest whole"
        r" factor is 2 \(a global batch of 16\)",
    ):
        Features([growth]).dispatch(Event.FIT_START, ctx)
    assert growth.factor == 3


def test_adaptive_growth_from_a_checkpoint_without_its_ranks_or_on_the_same_ranks_keeps_its_factor():
    for state in ({"factor": 4}, {"factor": 4, "world_size": 2}):
        growth = AdaptiveGrowth()
        growth.load_state_dict(state)
        run = PrintingRun()
        Features([growth]).dispatch(
            Event.FIT_START, Context(factor=1, world_size=2, run=run, plan=FitPlan(micro_batch_size=4))
        )
        assert growth.factor == 4
        assert run.printed == []


def test_a_fixed_factor_resumed_on_other_ranks_names_the_old_and_new_global_batch_and_what_keeps_it():
    from lightning_accum.core.data_position import DataPosition

    position = DataPosition()
    position.load_state_dict({"position": 0, "world_size": 2, "epoch_size": 64, "order": None})
    run = PrintingRun()
    ctx = Context(factor=4, world_size=1, run=run, plan=FitPlan(micro_batch_size=4))
    position.say_global_batch(ctx, target_batch_size=None, grows=False)
    assert run.printed == [
        "AccumulationScheduler: resumed on 1 process(es) from a checkpoint written on 2: the global batch is now 16"
        " samples (factor 4 x micro-batch 4 x 1), was 32. `target_batch_size=32` keeps it on any number of processes"
    ]
    position.say_global_batch(ctx, target_batch_size=32, grows=False)  # the target keeps it: nothing to say
    position.say_global_batch(ctx, target_batch_size=None, grows=True)  # adaptive growth says its own line
    ctx.world_size = 2
    position.say_global_batch(ctx, target_batch_size=None, grows=False)  # the same ranks
    assert len(run.printed) == 1


# ------------------------------------------------------------------ LR scaling


def test_lr_scaling_applies_the_scale_inside_the_step_only_and_warms_it_up():
    param = nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=0.1)
    lr = LRScaling("linear", base_batch_size=4, warmup_steps=2)
    features = Features([lr])
    ctx = Context(optimizers=[optimizer], factor=2, plan=FitPlan(micro_batch_size=2))
    features.dispatch(Event.FIT_START, ctx)
    assert ctx.summary == ["lr 0.1 x (4/4) = 0.1"]
    used = []
    for step, factor in enumerate([2, 4, 4, 4]):
        ctx.factor, ctx.optimizer_steps = factor, step
        ctx.window.open(factor)
        features.dispatch(Event.WINDOW_OPENED, ctx)
        for _ in range(factor):
            ctx.window.take(ends_epoch=False)
        before = param.item()
        param.grad = torch.ones(1)
        ctx.optimizer = optimizer
        features.dispatch(Event.WINDOW_CLOSING, ctx)
        optimizer.step()
        used.append(round(before - param.item(), 9))
        assert optimizer.param_groups[0]["lr"] == 0.1  # the scheduler's value, outside the step
        ctx.metrics = {}
        features.dispatch(Event.WINDOW_CLOSED, ctx)
        assert ctx.metrics["accum/lr"] == pytest.approx(used[-1])
    assert used == pytest.approx([0.1, 0.1, 0.15, 0.2])  # from step 1 the target 2 is reached over 2 steps
    features.dispatch(Event.FIT_END, ctx)
    optimizer.step()
    assert optimizer.param_groups[0]["lr"] == 0.1


def test_lr_scaling_refuses_a_base_in_samples_without_the_micro_batch_size():
    with pytest.raises(ValueError, match="base_batch_size=64"):
        LRScaling("sqrt", base_batch_size=64).fit_start(Context(plan=FitPlan(micro_batch_size=None)))


# ------------------------------------------------------------------ metrics


class ListLogger:
    def __init__(self) -> None:
        self.logged: list[tuple[dict[str, float], int]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.logged.append((metrics, step))


class LoggingRun(Run):
    def __init__(self) -> None:
        self._loggers = [ListLogger()]

    @property
    def loggers(self) -> list[Any]:
        return self._loggers


def test_metrics_logs_its_own_values_and_every_other_features_in_one_call():
    run = LoggingRun()
    x, y = make_data(8)
    net = make_net()
    features = Features([ItemWeighting("sample"), Metrics()])
    ctx = Context(run=run, module=net, log_every=1, plan=FitPlan(micro_batch_size=4))
    batches = [(x[:3], y[:3]), (x[3:8], y[3:8])]
    drive(features, ctx, net, batches, mse)
    ctx.optimizer_steps, ctx.metrics = 1, {}
    features.dispatch(Event.WINDOW_CLOSED, ctx)
    ((metrics, step),) = run.loggers[0].logged
    assert step == 1
    assert metrics["accum/window_samples"] == 8.0
    expected_loss = mse(net, (x, y)).item()  # the mean over the window's 8 samples, not of the two means
    assert metrics["accum/window_loss"] == pytest.approx(expected_loss, rel=1e-6)
    assert metrics["accum/factor"] == 1.0
    assert "accum/memory_rss_mb" in metrics


def test_metrics_logs_nothing_on_other_ranks():
    run = LoggingRun()
    Metrics().window_closed(Context(is_global_zero=False, run=run, module=make_net(), log_every=1))
    assert run.loggers[0].logged == []
