"""The gradient noise scale: the estimator's algebra, the two sums of every measured window against plain PyTorch,
the logged estimate against the exact B_simple, and ``.grad`` left as PyTorch defines it."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accum import AccumulationScheduler
from lightning_accum.core.events import Context, Event, Features
from lightning_accum.core.noise import NoiseScaleEstimator
from lightning_accum.core.window import Window
from lightning_accum.features import NoiseScale
from tests import helpers
from tests.helpers import (
    DictDataset,
    RegressionModule,
    make_data,
    make_net,
    make_tokens,
    mse,
    token_loss,
    trainer,
)
from tests.test_features import _noise_scale_reference


def exact_noise_scale(x: torch.Tensor, y: torch.Tensor) -> float:
    """B_simple of the tests' regression net on ``(x, y)``, from every per-sample gradient."""
    return helpers.exact_noise_scale(make_net(), x, y)


def test_the_estimator_is_unbiased_on_synthetic_gradients():
    # micro-gradients g_i = G + noise with known |G|^2 and per-sample variance: the averages converge to them
    generator = torch.Generator().manual_seed(0)
    true_g, per_sample_var, b, n = torch.tensor([3.0, -1.0, 0.5]), 40.0, 8, 4
    estimator = NoiseScaleEstimator(decay=0.999)
    for _ in range(4000):
        micro = true_g + torch.randn(n, 3, generator=generator) * (per_sample_var / 3 / b) ** 0.5
        estimator.update(micro.pow(2).sum(1).mean().item(), micro.mean(0).pow(2).sum().item(), 1 / b, n * b)
    estimate = estimator.estimate
    assert estimate.grad_sq == pytest.approx(true_g.pow(2).sum().item(), rel=0.05)
    assert estimate.trace == pytest.approx(per_sample_var, rel=0.05)


def test_the_estimator_needs_two_micro_gradients_finite_values_and_a_valid_decay():
    estimator = NoiseScaleEstimator(decay=0.5)
    assert estimator.update(1.0, 1.0, inverse_small_batch=1 / 8, big_batch=8) is None  # one micro-batch
    estimator.update(5.0, 2.0, 1 / 8, 32)
    before = estimator.estimate
    assert estimator.update(float("inf"), float("inf"), 1 / 8, 32) is None  # a step AMP's scaler skips
    assert estimator.update(float("nan"), 2.0, 1 / 8, 32) is None
    assert estimator.estimate == before
    with pytest.raises(ValueError, match=r"`noise_scale_decay` must be a number in \[0, 1\), got 1.0"):
        AccumulationScheduler({0: 2}, noise_scale=True, noise_scale_decay=1.0)
    with pytest.raises(TypeError, match="`noise_scale` must be a bool"):
        AccumulationScheduler({0: 2}, noise_scale="yes")


def test_the_averages_decay_per_optimizer_step_whatever_the_sampling():
    """A measurement k steps after the previous one weighs 1 - decay**k against it: the averages reach back the same
    number of optimizer steps whether every window is measured or every tenth (per measurement they would lag ten
    times as far behind a noise scale that grows)."""
    decay, steps, values = 0.9, [1, 10, 3, 10], [(5.0, 2.0), (7.0, 3.0), (4.0, 1.5), (6.0, 1.0)]
    estimator = NoiseScaleEstimator(decay)
    for k, (small, big) in zip(steps, values, strict=True):
        estimator.update(small, big, 1 / 8, 32, steps=k)
    weights = [(1 - decay**k) * decay ** sum(steps[i + 1 :]) for i, k in enumerate(steps)]
    traces = [(small - big) / (1 / 8 - 1 / 32) for small, big in values]
    grads = [big - trace / 32 for (_, big), trace in zip(values, traces, strict=True)]
    expected_trace = sum(w * t for w, t in zip(weights, traces, strict=True)) / sum(weights)
    expected_grad_sq = sum(w * g for w, g in zip(weights, grads, strict=True)) / sum(weights)
    assert estimator.estimate.trace == pytest.approx(expected_trace, rel=1e-12)
    assert estimator.estimate.grad_sq == pytest.approx(expected_grad_sq, rel=1e-12)
    every = NoiseScaleEstimator(decay)  # one measurement per step: the same as before sampling existed
    for small, big in values:
        every.update(small, big, 1 / 8, 32)
    assert every.state_dict()["weight"] == pytest.approx(1 - decay ** len(values))


def test_the_logged_noise_scale_converges_to_the_exact_value_on_a_frozen_model(tmp_path):
    x, y = make_data(2048, seed=3)
    exact = exact_noise_scale(x, y)
    logger = CSVLogger(tmp_path, name="run", version=0)
    module = RegressionModule(lr=0.0)  # frozen: every step samples the same gradient distribution
    callback = AccumulationScheduler({0: 8}, noise_scale=True, noise_scale_decay=0.99)
    loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(0))
    trainer([callback], max_epochs=6, logger=logger, log_every_n_steps=1).fit(module, loader)
    rows = (tmp_path / "run" / "version_0" / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    column = [row.split(",")[header.index("accum/noise_scale")] for row in rows[1:]]
    # every 10th window measured (the default); every step from the first measured one on logs the latest estimate
    assert len(column) == 6 * 2048 // 64
    assert not any(column[:9])
    assert all(column[9:])
    logged = [float(value) for value in column[9:]]
    assert all(i % 10 == 0 for i in range(1, len(logged)) if logged[i] != logged[i - 1])  # new at steps 20, 30, ...
    assert logged[-1] == pytest.approx(exact, rel=0.25)


class RaggedBatches(torch.utils.data.IterableDataset):
    """Shuffled samples in batches of random sizes from 1 to 15: micro-batches of very different weights."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, seed: int = 0) -> None:
        self.x, self.y, self.epoch, self.seed = x, y, 0, seed

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        self.epoch += 1
        order = torch.randperm(len(self.x), generator=generator)
        start = 0
        while start < len(order):
            size = int(torch.randint(1, 16, (1,), generator=generator))
            index = order[start : start + size]
            start += size
            yield self.x[index], self.y[index]


def test_the_noise_scale_is_unbiased_with_ragged_micro_batches(tmp_path):
    x, y = make_data(2048, seed=3)
    exact = exact_noise_scale(x, y)
    callback = AccumulationScheduler(
        {0: 4}, normalize_by="sample", noise_scale=True, noise_scale_decay=0.99, noise_scale_interval=1
    )
    trainer([callback], max_epochs=4).fit(RegressionModule(lr=0.0), DataLoader(RaggedBatches(x, y), batch_size=None))
    assert callback.features["noise_scale"].estimate.noise_scale == pytest.approx(exact, rel=0.25)


def test_parameters_unfrozen_during_training_are_measured_too(tmp_path):
    from lightning.pytorch.callbacks import Callback

    class UnfreezeAtEpoch1(Callback):
        def on_train_epoch_start(self, trainer, pl_module):
            pl_module.net[0].requires_grad_(trainer.current_epoch >= 1)

    x, y = make_data(2048, seed=3)
    exact = exact_noise_scale(x, y)
    module = RegressionModule(lr=0.0)
    module.net[0].requires_grad_(False)
    callback = AccumulationScheduler({0: 8}, noise_scale=True, noise_scale_decay=0.95)
    loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(0))
    trainer([UnfreezeAtEpoch1(), callback], max_epochs=5).fit(module, loader)
    estimate = callback.features["noise_scale"].estimate
    assert estimate.trace > 0
    assert estimate.noise_scale == pytest.approx(exact, rel=0.25)  # the whole model, as after unfreezing


class GradientProbe(pl.LightningModule):
    """Small parameters, with or without a large weight, and a head only odd batches use; records what ``.grad``
    holds after every backward, as the LightningModule's ``on_after_backward`` sees it."""

    def __init__(self, width: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(16, width)  # 16 x 1024 weights: squared in a hook
        self.out = nn.Linear(width, 1)
        self.odd = nn.Linear(16, 1)  # no gradient in even micro-batches
        self.seen: list[list[torch.Tensor | None]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        prediction = self.out(torch.tanh(self.body(x)))
        if batch_idx % 2:
            prediction = prediction + self.odd(x)
        return nn.functional.mse_loss(prediction, y)

    def on_after_backward(self) -> None:
        self.seen.append([None if p.grad is None else p.grad.clone() for p in self.parameters()])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # momentum and weight decay: a parameter without a gradient must keep None, not a zero
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)


@pytest.mark.parametrize("width", [512, 1024], ids=["small-only", "with-a-large-weight"])
@pytest.mark.parametrize("zero_grad", ["set_to_none", "zeroed"])
def test_the_noise_scale_leaves_every_gradient_as_autograd_accumulates_it(zero_grad, width):
    """Writing each backward's small gradients into a row and holding their sum, beside a large weight's hook or
    not, changes no value of ``.grad`` after any backward, nor of a weight."""

    class Probe(GradientProbe):
        def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
            optimizer.zero_grad(set_to_none=zero_grad == "set_to_none")

    generator = torch.Generator().manual_seed(3)
    x = torch.randn(48, 16, generator=generator)
    y = x[:, :1] - x[:, 1:2] + 0.3 * torch.randn(48, 1, generator=generator)
    modules = {}
    for noise in (False, True):
        modules[noise] = Probe(width)
        callback = AccumulationScheduler({0: 3, 1: 4}, noise_scale=noise, noise_scale_decay=0.0, noise_scale_interval=1)
        trainer([callback], max_epochs=2).fit(modules[noise], DataLoader(TensorDataset(x, y), batch_size=4))
    plain, noisy = modules[False], modules[True]
    assert len(plain.seen) == len(noisy.seen) == 24
    for seen_plain, seen_noisy in zip(plain.seen, noisy.seen, strict=True):
        for a, b in zip(seen_plain, seen_noisy, strict=True):
            assert (a is None) == (b is None)
            assert a is None or torch.equal(a, b)
    assert any(grads[-1] is None for grads in plain.seen)  # the odd head had no gradient at some backwards
    for a, b in zip(plain.parameters(), noisy.parameters(), strict=True):
        assert torch.equal(a, b)
    assert noisy.trainer.callbacks[0].features["noise_scale"].estimate.noise_scale is not None


def test_a_parameter_outside_the_optimizer_keeps_accumulating_across_windows_as_without_the_estimate():
    """Lightning zeroes only what the optimizers hold: a trainable parameter outside them keeps its ``.grad`` from
    window to window, beside gradients set to None. Windows of one micro-batch (the epochs' last) come in between.
    Every backward's ``.grad`` and every weight must be those of the run without the estimate."""

    class Outside(GradientProbe):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD([*self.body.parameters(), *self.out.parameters()], lr=0.05, momentum=0.9)

    generator = torch.Generator().manual_seed(4)
    x = torch.randn(36, 16, generator=generator)
    y = x[:, :1] + 0.3 * torch.randn(36, 1, generator=generator)
    modules = {}
    for noise in (False, True):
        modules[noise] = Outside(512)
        callback = AccumulationScheduler({0: 2, 1: 4}, noise_scale=noise, noise_scale_decay=0.0, noise_scale_interval=1)
        trainer([callback], max_epochs=2).fit(modules[noise], DataLoader(TensorDataset(x, y), batch_size=4))
    plain, noisy = modules[False], modules[True]
    assert len(plain.seen) == len(noisy.seen) == 18  # 9 micro-batches per epoch: windows of 2 (4) and 1, 4 (2) and 1
    for seen_plain, seen_noisy in zip(plain.seen, noisy.seen, strict=True):
        for a, b in zip(seen_plain, seen_noisy, strict=True):
            assert (a is None) == (b is None)
            assert a is None or torch.equal(a, b)
    odd = [grads[-1] for grads in plain.seen if grads[-1] is not None]
    assert len({float(grad.abs().sum()) for grad in odd}) > 1  # the odd head's gradient grew across windows
    for a, b in zip(plain.parameters(), noisy.parameters(), strict=True):
        assert torch.equal(a, b)
        assert (a.grad is None) == (b.grad is None)
        assert a.grad is None or torch.equal(a.grad, b.grad)
    assert noisy.trainer.callbacks[0].features["noise_scale"].estimate.noise_scale is not None


class BeforeTheScheduler(pl.Callback):
    """Listed before AccumulationScheduler: sees each backward's gradients first, and changes them."""

    def __init__(self, change: str) -> None:
        self.change, self.backwards = change, 0

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.change == "drop" and self.backwards % 2 == 0:
            pl_module.out.bias.grad = None  # a callback discarding a gradient
        if self.change == "clip":  # clips, in place, what has a gradient (as clip_grad_norm_ does)
            torch.nn.utils.clip_grad_norm_([p for p in pl_module.parameters() if p.grad is not None], 0.5)
        self.backwards += 1


class SeesBeforeBackward(GradientProbe):
    def on_before_backward(self, loss: torch.Tensor) -> None:
        self.before.append([None if p.grad is None else p.grad.clone() for p in self.parameters()])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)


@pytest.mark.parametrize("change", ["drop", "clip"])
def test_a_callback_before_the_scheduler_that_changes_gradients_sees_and_leaves_what_it_would_without_it(change):
    """Whatever another callback does to ``.grad`` in its ``on_after_backward`` (drop it, clip it in place), and
    whatever the LightningModule's ``on_before_backward`` sees (``None`` before a parameter's first gradient), every
    value, every ``None``, every sign of zero and every weight are those of the run without the estimate."""
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(32, 16, generator=generator)
    y = x[:, :1] + 0.3 * torch.randn(32, 1, generator=generator)
    x[:, 3] = -0.0  # a column of negative zeros: the body's weight gradient holds -0.0 there
    modules = {}
    for noise in (False, True):
        modules[noise] = SeesBeforeBackward(512)
        modules[noise].before = []
        scheduler = AccumulationScheduler({0: 2, 1: 4}, noise_scale=noise, noise_scale_interval=1)
        callbacks = [BeforeTheScheduler(change), scheduler]
        trainer(callbacks, max_epochs=2).fit(modules[noise], DataLoader(TensorDataset(x, y), batch_size=4))
    plain, noisy = modules[False], modules[True]
    for seen_plain, seen_noisy in [
        *zip(plain.seen, noisy.seen, strict=True),
        *zip(plain.before, noisy.before, strict=True),
    ]:
        for a, b in zip(seen_plain, seen_noisy, strict=True):
            assert (a is None) == (b is None)
            assert a is None or (torch.equal(a, b) and torch.equal(a.signbit(), b.signbit()))
    assert any(grads[0] is None for grads in plain.before)  # the window's first backward starts from None
    for a, b in zip(plain.parameters(), noisy.parameters(), strict=True):
        assert torch.equal(a, b)


def start_backward(features: Features, ctx: Context, batch: Any, loss_divisor: float) -> None:
    """A micro-batch up to its backward, with the events the callback dispatches around Lightning's hooks."""
    ctx.window.take(ends_epoch=False)
    ctx.batch, ctx.loss_divisor = batch, loss_divisor
    features.dispatch(Event.MICRO_BATCH_STARTED, ctx)
    features.dispatch(Event.BEFORE_BACKWARD, ctx)


def test_a_backward_that_never_ends_leaves_the_gradients_as_autograd_would():
    """An exception between the noise scale's ``on_before_backward`` and ``on_after_backward``: the fit's end puts the
    window's gradients back into ``.grad``, with what the interrupted backward wrote added."""
    x, y = make_data(12, seed=5)
    batches = [(x[i : i + 4], y[i : i + 4]) for i in range(0, 12, 4)]
    net, reference = make_net(), make_net()
    features, ctx = Features([NoiseScale(interval=1)]), Context(module=net)
    ctx.window.open(3)
    features.dispatch(Event.WINDOW_OPENED, ctx)
    for index, (xb, yb) in enumerate(batches):
        start_backward(features, ctx, (xb, yb), 3.0)
        (nn.functional.mse_loss(net(xb), yb) / 3).backward()
        (nn.functional.mse_loss(reference(xb), yb) / 3).backward()
        if index == 1:  # another callback's on_after_backward raises before this one's
            break
        features.dispatch(Event.AFTER_BACKWARD, ctx)
    features.dispatch(Event.FIT_END, ctx)
    for a, b in zip(net.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    assert not any(param._backward_hooks for param in net.parameters())


def test_a_window_dropped_inside_a_backward_leaves_nothing_in_the_next_one():
    """micro_batch_size='auto' drops a window whose backward ran out of memory (its gradients set to None, the window
    opened again): what that backward wrote must not reach the next window's gradients or estimate."""

    x, y = make_data(16, seed=6)
    batches = [(x[i : i + 4], y[i : i + 4]) for i in range(0, 16, 4)]
    net = make_net()
    features, ctx = Features([NoiseScale(decay=0.0, interval=1)]), Context(module=net)
    ctx.window.open(4)
    features.dispatch(Event.WINDOW_OPENED, ctx)
    start_backward(features, ctx, batches[0], 4.0)
    (nn.functional.mse_loss(net(x[:4]), y[:4]) * 100).backward()  # the failed attempt's gradient, then out of memory
    for param in net.parameters():
        param.grad = None  # as the micro-batcher drops them
    ctx.window.discard()
    ctx.window.open(4)
    features.dispatch(Event.WINDOW_OPENED, ctx)
    reference = make_net()
    for xb, yb in batches:
        start_backward(features, ctx, (xb, yb), 4.0)
        (nn.functional.mse_loss(net(xb), yb) / 4).backward()
        (nn.functional.mse_loss(reference(xb), yb) / 4).backward()
        features.dispatch(Event.AFTER_BACKWARD, ctx)
    for a, b in zip(net.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    features.dispatch(Event.GRADIENT_READY, ctx)
    assert ctx.noise.estimate.noise_scale == pytest.approx(_noise_scale_reference(reference, batches), rel=1e-4)


def _window_noise_scale(net: nn.Module, batches: list[Any], mean: list[torch.Tensor]) -> float:
    """McCandlish et al.'s A.1, in plain PyTorch, from each micro-batch's mean-loss gradient and the step's ``mean``."""
    small = [
        torch.cat([g.flatten() for g in torch.autograd.grad(nn.functional.mse_loss(net(x), y), list(net.parameters()))])
        for x, y in batches
    ]
    big = torch.cat([g.flatten() for g in mean])
    n, b = len(batches), len(batches[0][0])
    s_small, s_big = torch.stack([g @ g for g in small]).mean().item(), (big @ big).item()
    return (b * n * (s_small - s_big) / (n - 1)) / ((n * s_big - s_small) / (n - 1))


@pytest.mark.parametrize("replaced", [False, True], ids=["grad-as-accumulated", "grad-replaced-before-the-step"])
def test_the_window_is_squared_as_the_optimizer_gets_it_and_a_window_dropped_after_its_backwards_leaves_nothing(
    replaced,
):
    """The window's mean is read from ``.grad`` at the step, whatever another callback made of it before; a window
    dropped between its last backward and its step (``micro_batch_size="auto"``) leaves nothing in the estimate."""
    x, _ = make_data(48, seed=7)
    y = x[:, :1] * 3.0 + 0.3 * torch.randn(48, 1, generator=torch.Generator().manual_seed(7))  # |G|^2 above the noise
    windows = [[(x[i : i + 4], y[i : i + 4]) for i in range(start, start + 16, 4)] for start in (0, 16, 32)]
    net = make_net()
    noise = NoiseScale(decay=0.0, interval=1)
    features, ctx = Features([noise]), Context(module=net)
    for index, batches in enumerate(windows):
        net.zero_grad(set_to_none=index != 1)
        ctx.window = Window()
        ctx.window.open(4)
        features.dispatch(Event.WINDOW_OPENED, ctx)
        for xb, yb in batches:
            start_backward(features, ctx, (xb, yb), 4.0)
            (nn.functional.mse_loss(net(xb), yb) / 4).backward()
            features.dispatch(Event.AFTER_BACKWARD, ctx)
        if index == 0:  # dropped after its last backward: never steps
            continue
        if replaced:  # e.g. another callback's on_before_optimizer_step: the step's gradient is this tensor
            net[0].bias.grad = net[0].bias.grad * 3.0
        features.dispatch(Event.WINDOW_CLOSING, ctx)
        mean = [param.grad.clone() for param in net.parameters()]
        features.dispatch(Event.GRADIENT_READY, ctx)
        assert ctx.noise.estimate.noise_scale == pytest.approx(_window_noise_scale(net, batches, mean), rel=1e-4)
    assert noise.state_dict()["updates"] == 2  # the dropped window was never measured


def test_every_micro_batch_of_a_windows_last_loader_batch_is_squared():
    """``micro_batch_size`` splits a loader batch into micro-batches: the window's last loader batch runs several
    backwards after the window closed, and each is a micro-batch of the estimate."""
    x, _ = make_data(16, seed=8)
    y = x[:, :1] * 3.0 + 0.3 * torch.randn(16, 1, generator=torch.Generator().manual_seed(8))
    parts = [(x[i : i + 2], y[i : i + 2]) for i in range(0, 16, 2)]  # 2 loader batches of 4 micro-batches
    net = make_net()
    features, ctx = Features([NoiseScale(decay=0.0, interval=1)]), Context(module=net)
    ctx.window.open(2)
    features.dispatch(Event.WINDOW_OPENED, ctx)
    for batch in range(2):
        ctx.window.take(ends_epoch=False)  # the loader batch: closes the window at the second
        for xb, yb in parts[4 * batch : 4 * batch + 4]:
            ctx.batch, ctx.loss_divisor = (xb, yb), 8.0
            features.dispatch(Event.MICRO_BATCH_STARTED, ctx)
            features.dispatch(Event.BEFORE_BACKWARD, ctx)
            (nn.functional.mse_loss(net(xb), yb) / 8).backward()
            features.dispatch(Event.AFTER_BACKWARD, ctx)
    features.dispatch(Event.WINDOW_CLOSING, ctx)
    mean = [param.grad.clone() for param in net.parameters()]
    features.dispatch(Event.GRADIENT_READY, ctx)
    assert ctx.noise.estimate.noise_scale == pytest.approx(_window_noise_scale(net, parts, mean), rel=1e-4)


def test_a_parameter_without_a_gradient_keeps_none_when_a_backward_never_ends():
    """The window's first backward interrupted: a parameter it did not reach has no gradient after the fit's end."""

    torch.manual_seed(0)
    used, unused = nn.Linear(5, 1), nn.Linear(5, 1)
    net = nn.ModuleList([used, unused])
    features, ctx = Features([NoiseScale(interval=1)]), Context(module=net)
    ctx.window.open(2)
    features.dispatch(Event.WINDOW_OPENED, ctx)
    x, y = make_data(4, seed=2)
    start_backward(features, ctx, (x, y), 2.0)
    (nn.functional.mse_loss(used(x), y) / 2).backward()
    features.dispatch(Event.FIT_END, ctx)  # on_exception: the backward's on_after_backward never came
    expected = torch.autograd.grad(nn.functional.mse_loss(used(x), y) / 2, list(used.parameters()))
    assert all(torch.equal(p.grad, g) for p, g in zip(used.parameters(), expected, strict=True))
    assert all(p.grad is None for p in unused.parameters())


class ConvAndEmbedding(nn.Module):
    """A channels_last convolution (its gradient keeps the parameter's strides) and a sparse embedding."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
        self.embedding = nn.Embedding(10, 4, sparse=True)

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        images, tokens = batch
        return self.conv(images).mean((2, 3)).pow(2).sum() + self.embedding(tokens).sum(1).pow(2).sum()


def test_channels_last_and_sparse_gradients_keep_their_layout_for_fused_and_sparse_optimizers():
    """A channels_last weight's gradient keeps its strides (fused Adam pairs weight and gradient by memory position)
    and an embedding's gradient stays sparse (SparseAdam refuses a dense one): the weights equal plain PyTorch's."""

    generator = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(2, 3, 6, 6, generator=generator), torch.randint(0, 10, (2, 3), generator=generator))
        for _ in range(6)
    ]
    nets = {}
    for noise in (False, True):
        net = ConvAndEmbedding()
        dense = torch.optim.Adam(net.conv.parameters(), lr=1e-2, fused=True)
        sparse = torch.optim.SparseAdam(net.embedding.parameters(), lr=1e-2)
        features, ctx = Features([NoiseScale(decay=0.0, interval=1)] if noise else []), Context(module=net)
        for start in (0, 3):  # two windows of three micro-batches
            ctx.window = Window()
            ctx.window.open(3)
            features.dispatch(Event.WINDOW_OPENED, ctx)
            for batch in batches[start : start + 3]:
                start_backward(features, ctx, batch, 3.0)
                (net(batch) / 3).backward()
                features.dispatch(Event.AFTER_BACKWARD, ctx)
                assert net.conv.weight.grad.stride() == net.conv.weight.stride()
                assert net.embedding.weight.grad.is_sparse
            features.dispatch(Event.GRADIENT_READY, ctx)
            dense.step()
            sparse.step()
            dense.zero_grad()
            sparse.zero_grad()
        nets[noise] = net
    for a, b in zip(nets[False].parameters(), nets[True].parameters(), strict=True):
        assert torch.equal(a, b)


def test_only_every_interval_th_window_is_measured_and_logged_steps_log_the_latest_estimate(tmp_path):
    """Logging every 4 steps measures nothing more: windows 5 and 10 are measured, and the logged steps 8 and 12 show
    the estimates of windows 5 and 10 (step 4 has none yet)."""

    class Updates(pl.Callback):  # the estimator's updates and estimate after each step
        def __init__(self) -> None:
            self.seen: list[tuple[float, float]] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx % 2 == 1:
                feature = trainer.callbacks[0].features["noise_scale"]
                self.seen.append((feature.state_dict()["updates"], feature.estimate.grad_sq))

    x, y = make_data(96)  # 12 steps of 2 micro-batches of 4
    callback = AccumulationScheduler({0: 2}, noise_scale=True, noise_scale_decay=0.0, noise_scale_interval=5)
    updates = Updates()
    logger = CSVLogger(tmp_path, name="run", version=0)
    trainer([callback, updates], max_epochs=1, logger=logger, log_every_n_steps=4).fit(
        RegressionModule(), DataLoader(TensorDataset(x, y), batch_size=4)
    )
    counts = [0.0] + [count for count, _ in updates.seen]
    measured = [step for step in range(1, 13) if counts[step] > counts[step - 1]]
    assert measured == [5, 10]
    rows = (tmp_path / "run" / "version_0" / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    logged = [row.split(",")[header.index("accum/noise_grad_sq")] for row in rows[1:]]
    assert logged[0] == ""
    assert [float(v) for v in logged[1:]] == pytest.approx([updates.seen[4][1], updates.seen[9][1]])


class _SaveInside(pl.Callback):
    """Listed after the scheduler: writes a checkpoint at ``hook`` of batch ``batch_idx`` (inside a window)."""

    def __init__(self, hook: str, batch_idx: int, path: Any) -> None:
        self.hook, self.batch_idx, self.path = hook, batch_idx, path

    def _at(self, trainer: pl.Trainer, hook: str) -> None:
        if hook == self.hook and trainer.fit_loop.epoch_loop.batch_idx == self.batch_idx:
            trainer.save_checkpoint(self.path)

    def on_before_backward(self, trainer, pl_module, loss):
        self._at(trainer, "on_before_backward")

    def on_after_backward(self, trainer, pl_module):
        self._at(trainer, "on_after_backward")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self._at(trainer, "on_before_optimizer_step")  # after GRADIENT_READY: the window's step is added


class _StateAtBatchStart(pl.Callback):
    """Records the noise scale's state as batch ``batch_idx`` of the first epoch starts (uninterrupted run)."""

    def __init__(self, scheduler: AccumulationScheduler, batch_idx: int) -> None:
        self.scheduler, self.batch_idx = scheduler, batch_idx
        self.state: dict[str, Any] | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.batch_idx and trainer.current_epoch == 0:
            self.state = self.scheduler.features["noise_scale"].state_dict()


@pytest.mark.parametrize(
    ("hook", "batch_idx"),
    [("on_before_backward", 6), ("on_after_backward", 7), ("on_before_backward", 8), ("on_before_optimizer_step", 8)],
)
def test_a_checkpoint_inside_a_window_keeps_the_estimate_of_the_windows_start(tmp_path, hook, batch_idx):
    x, y = make_data(48)  # 12 batches of 4, windows of 3: the one of batches 6-8 starts after 2 steps
    loader = helpers.ResumableLoader(TensorDataset(x, y), batch_size=4)
    whole = AccumulationScheduler({0: 3}, noise_scale=True, noise_scale_interval=1)
    start = _StateAtBatchStart(whole, 6)
    trainer([whole, start], max_epochs=2).fit(RegressionModule(), loader)

    path = tmp_path / "inside.ckpt"
    interrupted = AccumulationScheduler({0: 3}, noise_scale=True, noise_scale_interval=1)
    trainer([interrupted, _SaveInside(hook, batch_idx, path)], max_epochs=1).fit(RegressionModule(), loader)
    saved = torch.load(path, weights_only=False)["callbacks"]
    (state,) = [value for key, value in saved.items() if key.startswith("AccumulationScheduler")]
    assert start.state is not None
    assert start.state["updates"] == 2.0
    assert state["noise_scale"] == start.state  # the same folds, in the same order: equal floats

    resumed = AccumulationScheduler({0: 3}, noise_scale=True, noise_scale_interval=1)
    trainer([resumed], max_epochs=2).fit(RegressionModule(seed=99), loader, ckpt_path=path)
    assert resumed.features["noise_scale"].state_dict() == pytest.approx(
        whole.features["noise_scale"].state_dict(), rel=1e-9
    )


# ------------------------------------------------------------------ what users hold, and the sums against plain PyTorch


class KeepsGradients(pl.Callback):
    """Keeps a reference to every ``p.grad`` at each ``on_before_optimizer_step``, with a copy of its values then
    (as gradient logging, gradient EMAs or debugging code keep them)."""

    def __init__(self) -> None:
        self.kept: list[tuple[torch.Tensor, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.kept += [(p.grad, p.grad.clone()) for p in pl_module.parameters() if p.grad is not None]


@pytest.mark.parametrize("interval", [1, 10], ids=["every-window", "default-sampling"])
def test_every_gradient_a_callback_keeps_still_holds_its_steps_values_at_the_end(interval):
    x, y = make_data(4 * 4 * 30)  # 30 steps of 4 micro-batches of 4
    keeps = KeepsGradients()
    callback = AccumulationScheduler({0: 4}, noise_scale=True, noise_scale_interval=interval)
    trainer([callback, keeps], max_epochs=1).fit(RegressionModule(), DataLoader(TensorDataset(x, y), batch_size=4))
    assert callback.features["noise_scale"].estimate.noise_scale is not None
    assert len(keeps.kept) == 30 * 4
    overwritten = sum(not torch.equal(kept, values) for kept, values in keeps.kept)
    assert overwritten == 0


class Measurements(pl.Callback):
    """Listed after the scheduler: each optimizer step's new noise measurement, by the step it ends in."""

    def __init__(self) -> None:
        self.by_step: dict[int, Any] = {}
        self._last: Any = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        measurement = trainer.callbacks[0].features["noise_scale"].measurement
        if measurement is not None and measurement is not self._last:
            self.by_step[trainer.global_step + 1] = measurement
        self._last = measurement


def reference_sums(
    windows: list[list[list[Any]]], loss_and_items: Any, weighting: str, net: nn.Module, lr: float = 0.1
) -> list[tuple[float, float]]:
    """Plain PyTorch: for each window (its loader batches, each a list of micro-batches), the mean squared norm of
    the micro-batch gradients (each of its micro-batch's mean loss; those without items left out) and the squared
    norm of the window's gradient; then one SGD step on that gradient.

    The window's gradient is the mean of its loader batches' mean-loss gradients (``"micro_batch"``), or the
    gradient of the mean loss over every item of the window (``"sample"``, ``"token"``). A loader batch's micro-batches
    weigh their rows. In reduced precision the micro-batch gradients are summed in float32 (in order) and the
    window's gradient rounded once.
    """
    params = list(net.parameters())
    optimizer = torch.optim.SGD(params, lr=lr)
    sums = []
    for window in windows:
        micro, weights, small = [], [], []
        for batch in window:
            rows = sum(_rows(part) for part in batch)
            for part in batch:
                total, items = loss_and_items(net, part)
                grad = torch.autograd.grad(total / max(items, 1), params, allow_unused=True)
                grad = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grad, strict=True)]
                micro.append(grad)
                if items > 0:
                    small.append(sum(g.float().pow(2).sum() for g in grad).item())
                weights.append(items if weighting != "micro_batch" else _rows(part) / rows / len(window))
        total_weight = sum(weights) if weighting != "micro_batch" else 1.0
        step = []
        for index, param in enumerate(params):
            accumulated = torch.zeros_like(param, dtype=torch.float32)
            for grad, weight in zip(micro, weights, strict=True):
                accumulated += grad[index].float() * weight
            step.append((accumulated / total_weight).to(param.dtype))
        for param, grad in zip(params, step, strict=True):
            param.grad = grad
        sums.append((sum(small) / len(small), sum(g.float().pow(2).sum() for g in step).item()))
        optimizer.step()
    return sums


def _rows(batch: Any) -> int:
    return len(batch["labels"]) if isinstance(batch, dict) else len(batch[0])


def _mse_sum(net: nn.Module, batch: Any) -> tuple[torch.Tensor, int]:
    x, y = batch
    return mse(net(x), y, reduction="sum"), len(x)


def _token_sum(net: nn.Module, batch: Any) -> tuple[torch.Tensor, int]:
    items = int((batch["labels"] != -100).sum())
    return token_loss(net, batch["features"], batch["labels"]) * max(items, 1), items


class TokenModule(RegressionModule):
    def training_step(self, batch, batch_idx):
        return token_loss(self.net, batch["features"], batch["labels"])


CASES = {
    # name: (normalize_by, micro_batch_size, loader batch, samples, precision)
    "micro-batch-means": ("micro_batch", None, 4, 100, "32-true"),  # the epoch's last window holds 1 batch of 4
    "sample-weighting": ("sample", None, 5, 122, "32-true"),  # the last batch holds 2
    "token-weighting": ("token", None, 4, 96, "32-true"),
    "split-micro-batches": ("micro_batch", 3, 8, 192, "32-true"),  # loader batches of 8 in parts of 3, 3, 2
    "bf16-float32-accumulation": ("micro_batch", None, 4, 96, "bf16-true"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_two_sums_of_every_measured_window_are_plain_pytorchs(case):
    """On every measured window (every third step here), the mean squared micro-batch gradient norm and the squared
    norm of the step's gradient equal plain PyTorch's, each micro-batch's gradient computed alone."""
    normalize_by, micro_batch_size, batch_size, samples, precision = CASES[case]
    factor = 4
    if normalize_by == "token":
        tokens = make_tokens(samples, seed=2)
        data: Any = DictDataset(tokens)
        batches = [{k: v[i : i + batch_size] for k, v in tokens.items()} for i in range(0, samples, batch_size)]
        module: pl.LightningModule = TokenModule()
    else:
        x, y = make_data(samples, seed=2)
        data = TensorDataset(x, y)
        batches = [(x[i : i + batch_size], y[i : i + batch_size]) for i in range(0, samples, batch_size)]
        module = RegressionModule()
    if micro_batch_size is not None:
        split = [
            [(b[0][i : i + micro_batch_size], b[1][i : i + micro_batch_size]) for i in range(0, len(b[0]), 3)]
            for b in batches
        ]
    else:
        split = [[b] for b in batches]
    if precision == "bf16-true":
        split = [[tuple(t.bfloat16() for t in part) for part in batch] for batch in split]
    windows = [split[i : i + factor] for i in range(0, len(split), factor)]
    callback = AccumulationScheduler(
        {0: factor},
        normalize_by=normalize_by,
        micro_batch_size=micro_batch_size,
        noise_scale=True,
        noise_scale_decay=0.0,
        noise_scale_interval=3,
        grad_accum_dtype="float32",
    )
    measurements = Measurements()
    trainer([callback, measurements], max_epochs=1, precision=precision).fit(
        module, DataLoader(data, batch_size=batch_size)
    )
    net = make_net().to(torch.bfloat16) if precision == "bf16-true" else make_net()
    expected = reference_sums(windows, _token_sum if normalize_by == "token" else _mse_sum, normalize_by, net)
    assert sorted(measurements.by_step) == [s for s in range(1, len(windows) + 1) if s % 3 == 0]
    for step, measurement in measurements.by_step.items():
        small, big = expected[step - 1]
        assert measurement.small_sq == pytest.approx(small, rel=1e-6), step
        assert measurement.big_sq == pytest.approx(big, rel=1e-6), step


@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
def test_at_factor_1_a_measured_batchs_halves_give_plain_pytorchs_two_sums_in_bfloat16_too(precision):
    """At factor 1 a measured window is its loader batch in two halves. Under bf16-true (which makes the default dtype
    bfloat16 around the step) the float32 squares were allocated in bfloat16 and the first measured window raised
    (issue 54, item 1); the sums must be plain PyTorch's, each half's gradient computed alone."""
    x, y = make_data(64, seed=2)
    halves = [[[(x[i : i + 4], y[i : i + 4]), (x[i + 4 : i + 8], y[i + 4 : i + 8])]] for i in range(0, 64, 8)]
    if precision == "bf16-true":
        halves = [[[tuple(t.bfloat16() for t in part) for part in batch] for batch in window] for window in halves]
    callback = AccumulationScheduler(  # adaptive growth asks for the halves; its largest factor keeps factor 1
        {0: 1},
        noise_scale=True,
        noise_scale_interval=3,
        adaptive=True,
        adaptive_max_factor=1,
        grad_accum_dtype="float32",
    )
    measurements = Measurements()
    trainer([callback, measurements], max_epochs=1, precision=precision).fit(
        RegressionModule(), DataLoader(TensorDataset(x, y), batch_size=8)
    )
    net = make_net().to(torch.bfloat16) if precision == "bf16-true" else make_net()
    expected = reference_sums(halves, _mse_sum, "micro_batch", net)
    # bfloat16: each half's gradient is the run's own bfloat16 computation (its loss weighed by its rows), the
    # reference's another rounding of it: within one bfloat16 place
    rel = 2**-8 if precision == "bf16-true" else 1e-6
    assert sorted(measurements.by_step) == [3, 6]
    for step, measurement in measurements.by_step.items():
        small, big = expected[step - 1]
        assert measurement.small_sq == pytest.approx(small, rel=rel), step
        assert measurement.big_sq == pytest.approx(big, rel=rel), step


@pytest.mark.parametrize("precision", ["bf16-true", "bf16-mixed"])  # "16-mixed" is bf16-mixed on a CPU
def test_adaptive_growth_from_factor_1_runs_in_reduced_precision(precision):
    x, y = make_data(64, seed=2)
    callback = AccumulationScheduler({0: 1}, noise_scale=True, adaptive=True, noise_scale_interval=1)
    fit = trainer([callback], max_epochs=1, precision=precision)
    fit.fit(RegressionModule(), DataLoader(TensorDataset(x, y), batch_size=8))
    assert callback.features["noise_scale"].estimate.noise_scale is not None
    assert fit.global_step >= 1
