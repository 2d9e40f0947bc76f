"""The noise scale and adaptive growth in a Fabric loop, on one process: the callback's estimate, the exact value,
halves that step as the whole batch, growth from factor 1, its console line and dashboard, and resume.

Multi-rank (DDP, FSDP2) runs are in tests/test_fabric_noise_ranks.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accum import AccumulationScheduler
from lightning_accum.fabric import Accumulator
from tests.helpers import RegressionModule, exact_noise_scale, make_data, make_net, trainer


def fabric_run(
    loaders: list[Any], lr: float = 0.0, loggers: Any = None, net: nn.Module | None = None, **options: Any
) -> tuple[Accumulator, nn.Module, list[int]]:
    """``make_net()`` trained by plain SGD through the Accumulator, one epoch per loader: the sizes it was fed."""
    fabric = Fabric(accelerator="cpu", devices=1, loggers=loggers)
    net = net if net is not None else make_net()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=lr))
    accumulator = Accumulator(fabric, model, optimizer, **options)
    fed = []
    for loader in loaders:
        for batch in accumulator.batches(loader):
            x, y = batch
            fed.append(len(x))
            with accumulator.micro_step(batch) as micro:
                micro.backward(nn.functional.mse_loss(model(x), y))
            if micro.should_step:
                optimizer.step()
                optimizer.zero_grad()
    return accumulator, net, fed


def shuffled(x: torch.Tensor, y: torch.Tensor, batch_size: int, seed: int) -> DataLoader:
    return DataLoader(
        TensorDataset(x, y), batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(seed)
    )


NOISE = {"noise_scale": True, "noise_scale_interval": 1, "noise_scale_decay": 0.99}


@pytest.mark.parametrize(
    "options",
    [
        {"scheduling": {0: 4}},  # windows of 4 micro-batches
        {"adaptive": True, "adaptive_max_factor": 1},  # factor 1: every measured loader batch in two halves
    ],
    ids=["factor_4", "factor_1_halves"],
)
def test_on_a_frozen_model_the_estimate_is_the_callbacks_and_near_the_exact_value(options):
    """Learning rate 0, the same data in the same order: the Accumulator's estimate equals the callback's (1e-4
    relative), and both lie within [0.67, 1.5] of B_simple from every per-sample gradient."""
    x, y = make_data(2048, seed=3)
    exact = exact_noise_scale(make_net(), x, y)
    callback = AccumulationScheduler(**NOISE, **options)
    trainer([callback], max_epochs=3).fit(RegressionModule(lr=0.0), shuffled(x, y, 8, seed=0))
    through_trainer = callback.features["noise_scale"].estimate  # type: ignore[attr-defined]
    loader = shuffled(x, y, 8, seed=0)
    accumulator, _, fed = fabric_run([loader] * 3, log_metrics=False, **NOISE, **options)
    estimate = accumulator.features["noise_scale"].estimate  # type: ignore[attr-defined]
    assert estimate.noise_scale == pytest.approx(through_trainer.noise_scale, rel=1e-4)
    assert estimate.measurements == pytest.approx(through_trainer.measurements, rel=1e-9)
    assert 0.67 <= estimate.noise_scale / exact <= 1.5
    assert set(fed) == ({4} if "adaptive" in options else {8})


@pytest.mark.parametrize("normalize_by", ["micro_batch", "sample"])
def test_windows_measured_in_halves_step_as_plain_pytorch_steps_on_the_whole_batch(normalize_by):
    """Factor 1, every window measured, loader batches of 7: each runs as halves of 4 and 3, weighed by their rows,
    and the weights follow plain SGD steps on each whole batch's mean loss (float32, 1e-6)."""
    x, y = make_data(98, seed=4)
    loader = DataLoader(TensorDataset(x, y), batch_size=7)
    options = {"normalize_by": normalize_by, "adaptive": True, "adaptive_max_factor": 1}
    accumulator, net, fed = fabric_run([loader], lr=0.1, log_metrics=False, **NOISE, **options)
    assert fed == [4, 3] * 14
    assert accumulator.optimizer_steps == 14
    assert accumulator.samples_seen == 98
    assert accumulator.features["noise_scale"].estimate.measurements > 3  # type: ignore[attr-defined]
    plain = make_net()
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    for start in range(0, 98, 7):
        optimizer.zero_grad()
        nn.functional.mse_loss(plain(x[start : start + 7]), y[start : start + 7]).backward()
        optimizer.step()
    for ours, theirs in zip(net.parameters(), plain.parameters(), strict=True):
        assert (ours - theirs).abs().max().item() <= 1e-6


def test_adaptive_growth_from_factor_1_grows_prints_its_line_and_logs_its_dashboard(tmp_path, capsys):
    """A regression with label noise: as the model converges the noise scale grows, and so does the factor, only up;
    the Fabric console gets the callback's line, and a TensorBoardLogger the noise scale, its bounds and the factor."""
    from lightning.fabric.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2, metadata

    x, y = make_data(2048, seed=5)
    logger = TensorBoardLogger(tmp_path, name="run", version=0)
    options = {"noise_scale_interval": 1, "lr_scaling": "sqrt", "log_every_n_steps": 1}
    loaders = [shuffled(x, y, 4, seed=epoch) for epoch in range(2)]
    accumulator, _, _ = fabric_run(loaders, lr=0.05, loggers=[logger], noise_scale=True, adaptive=True, **options)
    logger.finalize("success")
    assert accumulator.features["adaptive"].factor >= 4  # type: ignore[attr-defined]
    lines = [line for line in capsys.readouterr().out.splitlines() if "-> " in line]
    assert lines[0].startswith("Accumulator: factor 1 -> 2 (batch 4 -> 8) from optimizer step")
    events = EventAccumulator(str(tmp_path / "run" / "version_0"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    factors = [e.value for e in events.Scalars("accum/factor")]
    assert factors[0] == 1.0
    assert factors[-1] >= 4.0
    assert all(b >= a for a, b in zip(factors, factors[1:], strict=False))  # only up
    assert events.Scalars("accum/noise_scale")[-1].value > 4 * factors[-2] / 2
    assert events.Scalars("accum/noise_scale_low")
    layouts = [
        layout_pb2.Layout.FromString(t.tensor_proto.string_val[0]) for t in events.Tensors(metadata.CONFIG_SUMMARY_TAG)
    ]
    assert "accum/noise_scale(_low|_high)?$" in str(layouts[-1])  # the estimate and its bounds, one chart
    assert "accum/factor" in str(layouts[-1])


def test_adaptive_growth_resumes_exactly_through_fabric_save_and_load(tmp_path):
    """An epoch, a checkpoint, three more in a new Fabric, Accumulator and optimizer: the same weights (bit for bit),
    factor, decision state and estimate as four epochs uninterrupted (the factor grows on both sides of it)."""
    x, y = make_data(1024, seed=5)
    options = {"noise_scale": True, "noise_scale_interval": 1, "adaptive": True, "log_metrics": False}
    whole, whole_net, _ = fabric_run([shuffled(x, y, 4, seed=epoch) for epoch in range(4)], lr=0.1, **options)

    def resumed(epochs: range, path: Path, load: bool) -> tuple[Accumulator, nn.Module]:
        fabric = Fabric(accelerator="cpu", devices=1)
        net = make_net()
        model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        accumulator = Accumulator(fabric, model, optimizer, **options)
        state = {"model": model, "optimizer": optimizer, "accumulator": accumulator}
        if load:
            fabric.load(path, state)
        for epoch in epochs:
            assert accumulator.epoch == epoch
            for batch in accumulator.batches(shuffled(x, y, 4, seed=epoch)):  # each epoch's own order
                with accumulator.micro_step(batch) as micro:
                    micro.backward(nn.functional.mse_loss(model(batch[0]), batch[1]))
                if micro.should_step:
                    optimizer.step()
                    optimizer.zero_grad()
        fabric.save(path, state)
        return accumulator, net

    first, _ = resumed(range(1), tmp_path / "ckpt", load=False)
    assert 1 < first.features["adaptive"].factor < whole.features["adaptive"].factor  # type: ignore[attr-defined]
    second, net = resumed(range(1, 4), tmp_path / "ckpt", load=True)
    assert second.optimizer_steps == whole.optimizer_steps
    for name in ("adaptive", "noise_scale"):
        assert second.features[name].state_dict() == whole.features[name].state_dict()
    for ours, theirs in zip(net.parameters(), whole_net.parameters(), strict=True):
        assert torch.equal(ours, theirs)


def test_adaptive_without_the_noise_scale_and_bad_values_are_refused_naming_them():
    fabric = Fabric(accelerator="cpu", devices=1)
    net = make_net()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"`adaptive=True` .* set noise_scale=True as well \(got noise_scale=False\)"):
        Accumulator(fabric, model, optimizer, adaptive=True)
    with pytest.raises(ValueError, match="noise_scale_interval"):
        Accumulator(fabric, model, optimizer, noise_scale=True, noise_scale_interval=0)
    with pytest.raises(ValueError, match=r"adaptive_max_factor"):
        Accumulator(fabric, model, optimizer, noise_scale=True, adaptive=True, adaptive_max_factor=0)
    Accumulator(fabric, model, optimizer, noise_scale=True, adaptive=True).close()  # nothing left claimed


def test_a_batch_the_halves_cannot_split_is_refused_before_any_step():
    fabric = Fabric(accelerator="cpu", devices=1)
    net = make_net()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    accumulator = Accumulator(fabric, model, optimizer, noise_scale=True, adaptive=True, log_metrics=False)
    x, y = make_data(16)
    batches = [(x[i : i + 4], y[i : i + 4], torch.ones(3)) for i in range(0, 16, 4)]  # a tensor of 3 rows
    before = [p.detach().clone() for p in net.parameters()]

    def train() -> None:
        for batch in accumulator.batches(batches):
            with accumulator.micro_step(batch) as micro:
                micro.backward(nn.functional.mse_loss(model(batch[0]), batch[1]))

    with pytest.raises(ValueError, match=r"two halves, but a loader batch of type tuple cannot be split: its tensor"):
        train()
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True))
    assert accumulator.optimizer_steps == 0


@pytest.mark.parametrize("normalize_by", ["micro_batch", "token"])
def test_halves_of_batches_whose_rows_bear_uneven_tokens_are_warned_of_unless_weighed_by_tokens(normalize_by):
    """A token-mean loss over rows padded with -100: halves weighed by their rows are not the whole batch's mean
    (found by an adversarial test: 0.024 from plain SGD after 9 steps), so normalize_by='micro_batch' is warned of
    once, at the first window measured in halves; normalize_by='token' weighs them by their tokens, exactly."""
    import warnings

    from tests.helpers import make_tokens, token_loss

    tokens = make_tokens(40)  # features and labels with -100 on rows of different lengths
    batches = [{key: value[i : i + 4] for key, value in tokens.items()} for i in range(0, 40, 4)]
    fabric = Fabric(accelerator="cpu", devices=1)
    net = nn.Linear(5, 1)
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    options = {"normalize_by": normalize_by, "adaptive": True, "adaptive_max_factor": 1, "log_metrics": False}
    accumulator = Accumulator(fabric, model, optimizer, **NOISE, **options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in accumulator.batches(batches):
            with accumulator.micro_step(batch) as micro:
                micro.backward(token_loss(model, batch["features"], batch["labels"]))
            if micro.should_step:
                optimizer.step()
                optimizer.zero_grad()
    said = [str(w.message) for w in caught if "weighs each half by its rows" in str(w.message)]
    assert len(said) == (1 if normalize_by == "micro_batch" else 0)
    if said:
        assert said[0].startswith("Accumulator: a window measured in halves")
        assert "normalize_by='token'" in said[0]
