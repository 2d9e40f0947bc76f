"""Adaptive accumulation: the policy alone, and the factor growing as a model's noise scale grows."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from lightning_accum import AccumulationScheduler
from lightning_accum.adaptive import AdaptiveFactor
from tests.helpers import RegressionModule, make_data, trainer


def test_the_policy_doubles_after_patience_and_only_up_to_the_bound():
    policy = AdaptiveFactor(target=1.0, max_factor=8, interval=10, patience=2)
    assert [policy.due(step) for step in (0, 5, 10, 20)] == [False, False, True, True]
    assert policy.propose(2, effective_batch=32, noise_scale=100.0) == 2  # one vote
    assert policy.propose(2, effective_batch=32, noise_scale=50.0) == 2  # 50 < 64: the votes reset
    assert policy.propose(2, effective_batch=32, noise_scale=100.0) == 2
    assert policy.propose(2, effective_batch=32, noise_scale=100.0) == 4  # two in a row
    assert policy.propose(4, effective_batch=64, noise_scale=None) == 4  # no estimate yet
    assert policy.propose(8, effective_batch=128, noise_scale=1e9) == 8  # 16 > max_factor
    assert AdaptiveFactor(target=4.0, patience=1).propose(1, effective_batch=8, noise_scale=4.0) == 2  # 16 >= 16


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"adaptive": True}, ValueError, "set noise_scale=True as well"),
        ({"adaptive": "yes", "noise_scale": True}, TypeError, "`adaptive` must be a bool"),
        ({"adaptive_target": 0}, ValueError, "`adaptive_target` must be a positive finite number, got 0"),
        ({"adaptive_target": float("inf")}, ValueError, "`adaptive_target` must be a positive finite number, got inf"),
        ({"adaptive_max_factor": 0}, ValueError, "`adaptive_max_factor` must be an integer >= 1, got 0"),
        ({"adaptive_interval": 2.5}, TypeError, "`adaptive_interval` must be an integer"),
    ],
)
def test_bad_adaptive_arguments_name_themselves(kwargs, error, match):
    with pytest.raises(error, match=match):
        AccumulationScheduler({0: 2}, **kwargs)


def test_the_factor_grows_in_powers_of_two_as_the_noise_scale_grows(tmp_path):
    # a regression with label noise: as the model converges |G| shrinks while the gradient noise stays, so the
    # noise scale grows over training
    x, y = make_data(512, seed=5)
    callback = AccumulationScheduler(
        {0: 2},
        noise_scale=True,
        noise_scale_decay=0.9,
        adaptive=True,
        adaptive_interval=5,
        adaptive_max_factor=32,
        lr_scaling="sqrt",
    )
    loader = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(0))
    logger = CSVLogger(tmp_path, name="run", version=0)
    trainer([callback], max_epochs=6, logger=logger, log_every_n_steps=1).fit(RegressionModule(lr=0.05), loader)
    rows = (tmp_path / "run" / "version_0" / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    factors = [float(row.split(",")[header.index("accum/factor")]) for row in rows[1:]]
    scales = [float(row.split(",")[header.index("accum/lr_scale")]) for row in rows[1:]]
    noise = [float(row.split(",")[header.index("accum/noise_scale")] or "nan") for row in rows[1:]]
    assert factors[0] == 2.0
    assert max(factors) >= 4.0  # it grew
    assert all(b >= a for a, b in zip(factors, factors[1:], strict=False))  # it only grows
    assert set(factors) <= {2.0, 4.0, 8.0, 16.0, 32.0}
    assert scales[-1] == pytest.approx((factors[-1] / 2.0) ** 0.5)  # the LR follows by the sqrt rule
    first_growth = factors.index(4.0)
    assert noise[first_growth - 1] >= 2 * 8  # it grew because the noise scale reached twice the batch of 8


def test_the_adaptive_factor_survives_a_checkpoint():
    callback = AccumulationScheduler({0: 2}, noise_scale=True, adaptive=True)
    callback.features["adaptive"].factor = 8
    restored = AccumulationScheduler({0: 2}, noise_scale=True, adaptive=True)
    restored.load_state_dict(callback.state_dict())
    assert restored.features["adaptive"].factor == 8


def test_adaptive_compares_the_noise_scale_with_the_batch_in_the_same_unit():
    # micro-batches of 8 from an iterable without a batch_size: the micro-batch size is unknown to Lightning, but the
    # noise scale (about 10.7 samples on this frozen model) must be compared with 16 samples, not 2 micro-batches
    from tests.helpers import BatchStream

    x, y = make_data(2048, seed=3)
    callback = AccumulationScheduler(
        {0: 2},
        normalize_by="sample",
        noise_scale=True,
        noise_scale_interval=1,
        adaptive=True,
        adaptive_interval=5,
        adaptive_patience=3,
    )
    trainer([callback], max_epochs=2).fit(RegressionModule(lr=0.0), DataLoader(BatchStream(x, y, 8), batch_size=None))
    assert callback.features["adaptive"].factor == 0  # never grew: 10.7 < 2 x 16
    assert 5 < callback.features["noise_scale"].estimate.noise_scale < 20
