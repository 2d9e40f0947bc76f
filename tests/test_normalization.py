"""normalize_by="sample" and "token": ragged micro-batches step on the mean over every sample or token of the window.

The reference is plain PyTorch: one SGD step per window on the loss averaged over all samples (or all loss-bearing
tokens) of the window's micro-batches taken together, as one big batch.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accum import AccumulationScheduler
from lightning_accum.core.items import check_count, count_samples, count_tokens
from tests.helpers import (
    LR,
    BatchStream,
    DictDataset,
    RegressionModule,
    loader,
    make_data,
    make_net,
    make_tokens,
    max_deviation,
    reference_weights,
    token_loss,
    trainer,
    weights,
)

TOLERANCE = 1e-6


def sample_reference(x, y, batch_size, windows):
    """One step per window on the mean over all the window's samples (windows in micro-batches, epoch by epoch)."""
    net = make_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    for epoch_windows in windows:
        start = 0
        for size in epoch_windows:
            stop = min(start + size * batch_size, len(x))
            optimizer.zero_grad()
            nn.functional.mse_loss(net(x[start:stop]), y[start:stop]).backward()
            optimizer.step()
            start = stop
    return [p.detach().clone() for p in net.parameters()]


@pytest.mark.parametrize(
    ("samples", "batch_size", "scheduling", "windows"),
    [
        (22, 4, {0: 3}, [[3, 3]]),  # micro-batches 4 4 4 | 4 4 2: the second window holds 10 samples
        (30, 4, {0: 1, 1: 4}, [[1] * 8, [4, 4]]),  # 8 micro-batches of 4 4 4 4 4 4 4 2
    ],
)
def test_sample_weighting_equals_one_big_batch(samples, batch_size, scheduling, windows):
    x, y = make_data(samples)
    model = RegressionModule()
    fit = trainer([AccumulationScheduler(scheduling, normalize_by="sample")], max_epochs=len(windows))
    fit.fit(model, loader(x, y, batch_size))
    assert max_deviation(weights(model), sample_reference(x, y, batch_size, windows)) <= TOLERANCE

    # the default weighs the short micro-batch like the others: a different, measurably wrong step
    stock = RegressionModule()
    trainer([AccumulationScheduler(scheduling)], max_epochs=len(windows)).fit(stock, loader(x, y, batch_size))
    assert max_deviation(weights(stock), sample_reference(x, y, batch_size, windows)) > 1e-4


def test_sample_weighting_in_an_epoch_of_unknown_length():
    x, y = make_data(22)
    model = RegressionModule()
    fit = trainer([AccumulationScheduler({0: 4}, normalize_by="sample", micro_batch_size=4)], max_epochs=2)
    fit.fit(model, DataLoader(BatchStream(x, y, 4), batch_size=None))
    # 6 micro-batches an epoch (the last holds 2): windows 4 | 2, cut short by the epoch's end
    assert max_deviation(weights(model), sample_reference(x, y, 4, [[4, 2], [4, 2]])) <= TOLERANCE


class TokenModule(RegressionModule):
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return token_loss(self.net, batch["features"], batch["labels"])  # the mean over this micro-batch's tokens


def token_reference(data, batch_size, windows):
    net = make_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    start = 0
    for size in windows:
        stop = start + size * batch_size
        optimizer.zero_grad()
        token_loss(net, data["features"][start:stop], data["labels"][start:stop]).backward()
        optimizer.step()
        start = stop
    return [p.detach().clone() for p in net.parameters()]


def test_token_weighting_equals_the_mean_over_every_token_of_the_window():
    data = make_tokens(24)
    model = TokenModule()
    fit = trainer([AccumulationScheduler({0: 3}, normalize_by="token")], max_epochs=1)
    fit.fit(model, DataLoader(DictDataset(data), batch_size=2))
    assert fit.global_step == 4
    assert max_deviation(weights(model), token_reference(data, 2, [3, 3, 3, 3])) <= TOLERANCE

    per_micro_batch = TokenModule()
    trainer([AccumulationScheduler({0: 3})], max_epochs=1).fit(per_micro_batch, DataLoader(DictDataset(data), 2))
    assert max_deviation(weights(per_micro_batch), token_reference(data, 2, [3, 3, 3, 3])) > 1e-4


def test_token_counting_from_a_tuple_batch_and_from_a_callable():
    data = make_tokens(12)

    class TupleModule(RegressionModule):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            features, labels = batch
            return token_loss(self.net, features, labels)

    loader_ = DataLoader(TensorDataset(data["features"], data["labels"]), batch_size=2)
    by_position = TupleModule()
    trainer([AccumulationScheduler({0: 2}, normalize_by="token", token_key=1)], max_epochs=1).fit(by_position, loader_)
    by_callable = TupleModule()
    callback = AccumulationScheduler({0: 2}, normalize_by="token", count_items=lambda batch: (batch[1] != -100).sum())
    trainer([callback], max_epochs=1).fit(by_callable, loader_)
    reference = token_reference(data, 2, [2, 2, 2])
    assert max_deviation(weights(by_position), reference) <= TOLERANCE
    assert max_deviation(weights(by_callable), reference) <= TOLERANCE


def test_the_window_token_count_and_token_weighted_loss_are_logged(tmp_path):
    data = make_tokens(12)
    logger = CSVLogger(tmp_path, name="run", version=0)
    callback = AccumulationScheduler({0: 3}, normalize_by="token")
    module = TokenModule()
    trainer([callback], max_epochs=1, logger=logger, log_every_n_steps=1).fit(module, DataLoader(DictDataset(data), 2))
    rows = (tmp_path / "run" / "version_0" / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    first = dict(zip(header, rows[1].split(","), strict=True))
    assert float(first["accum/window_tokens"]) == float((data["labels"][:6] != -100).sum())
    assert float(first["accum/window_loss"]) == pytest.approx(
        token_loss(make_net(), data["features"][:6], data["labels"][:6]).item(), rel=1e-5
    )


def test_counting_rules():
    assert count_samples((torch.zeros(5, 2), torch.zeros(5))) == 5
    assert count_samples({"a": [torch.tensor(1.0), torch.zeros(3, 1)]}) == 3
    assert count_tokens({"labels": torch.tensor([[1, -100], [-100, -100]])}).item() == 1
    assert count_tokens((torch.zeros(2), torch.tensor([0, 3, 7])), key=1, ignore_index=0).item() == 2
    with pytest.raises(ValueError, match="pass `count_items`"):
        count_samples({"text": "no tensors here"})
    with pytest.raises(KeyError, match="token_key='labels'"):
        count_tokens({"input_ids": torch.zeros(2, 3)})
    with pytest.raises(TypeError, match="expects a tensor"):
        count_tokens({"labels": [1, 2]})
    assert count_samples([torch.zeros(3, 2), torch.zeros(3)]) == 3  # the usual batch, counted without a search
    assert count_samples([torch.tensor(2.0), torch.zeros(4, 1)]) == 4  # a 0-dim first element has no batch size
    assert check_count(7, batch_idx=0) == 7.0
    with pytest.raises(ValueError, match="returned -2 for batch 1"):
        check_count(-2, batch_idx=1)
    with pytest.raises(ValueError, match="for batch 2: a micro-batch's count must be a finite number"):
        check_count(10**400, batch_idx=2)  # beyond any float


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"normalize_by": "tokens"}, ValueError, r"`normalize_by` must be one of .*got 'tokens'"),
        ({"normalize_by": "token", "token_key": 1.5}, TypeError, r"`token_key` must be .* got 1.5"),
        ({"normalize_by": "token", "ignore_index": "-100"}, TypeError, "`ignore_index` must be an integer"),
        ({"normalize_by": "token", "count_items": 3}, TypeError, "`count_items` must be a callable"),
    ],
)
def test_bad_normalization_arguments_name_themselves(kwargs, error, match):
    with pytest.raises(error, match=match):
        AccumulationScheduler({0: 2}, **kwargs)


def test_dataloader_iter_cannot_be_weighted_and_says_so():
    class IterModule(RegressionModule):
        def training_step(self, dataloader_iter: Any) -> torch.Tensor:
            batch, _, _ = next(dataloader_iter)
            return super().training_step(batch, 0)

    x, y = make_data(8)
    model = IterModule()
    before = weights(model)
    with pytest.raises(ValueError, match="dataloader_iter"):
        trainer([AccumulationScheduler({0: 2}, normalize_by="sample")], max_epochs=1).fit(model, loader(x, y, 4))
    assert max_deviation(weights(model), before) == 0.0


def test_a_first_window_without_backward_is_skipped_quietly():
    class SkipsTheFirstBatches(RegressionModule):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
            return None if self.global_step == 0 and batch_idx < 3 else super().training_step(batch, batch_idx)

    x, y = make_data(24)
    model = SkipsTheFirstBatches()
    fit = trainer([AccumulationScheduler({0: 3}, normalize_by="sample")], max_epochs=1)
    fit.fit(model, loader(x, y, 4))
    # the first window had no backward and no gradient; the second steps on the mean over its 12 samples
    assert max_deviation(weights(model), sample_reference(x[12:], y[12:], 4, [[3]])) <= TOLERANCE


@pytest.mark.parametrize("normalize_by", ["micro_batch", "sample"])
def test_a_skipped_micro_step_under_each_normalization(normalize_by):
    """`training_step` returning None for batch 1 of a window of 3 (batches 0-2), as docs/normalization.md says.

    micro_batch: the skipped micro-batch counts as a zero gradient, so the step is on (loss_0 + loss_2) / 3, as in
    stock Lightning. sample: its samples are not counted, so the step is on the mean over the samples trained.
    """

    class SkipsBatch1(RegressionModule):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
            return None if batch_idx == 1 else super().training_step(batch, batch_idx)

    x, y = make_data(12)
    model = SkipsBatch1()
    trainer([AccumulationScheduler({0: 3}, normalize_by=normalize_by)], max_epochs=1).fit(model, loader(x, y, 4))
    net = make_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    first, last = (nn.functional.mse_loss(net(x[i : i + 4]), y[i : i + 4]) for i in (0, 8))
    ((first + last) / 3 if normalize_by == "micro_batch" else (first + last) / 2).backward()
    optimizer.step()
    assert max_deviation(weights(model), [p.detach() for p in net.parameters()]) <= TOLERANCE


# ------------------------------------------------------------------ unit="token": schedules keyed by tokens consumed


def token_keyed_reference(data, batch_size, epochs, factor_at):
    """Plain PyTorch: at each window's start, the factor for the loss-bearing tokens consumed so far (windows never
    span epochs); one SGD step per window on the mean of its micro-batches' token-mean losses."""
    net = make_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    labels, features = data["labels"], data["features"]
    batches = [slice(i, i + batch_size) for i in range(0, len(labels), batch_size)]
    tokens, windows = 0, []
    for _ in range(epochs):
        start = 0
        while start < len(batches):
            size = min(factor_at(tokens), len(batches) - start)
            window = batches[start : start + size]
            optimizer.zero_grad()
            (sum(token_loss(net, features[b], labels[b]) for b in window) / size).backward()
            optimizer.step()
            tokens += sum(int((labels[b] != -100).sum()) for b in window)
            windows.append(size)
            start += size
    return [p.detach().clone() for p in net.parameters()], windows


def test_a_token_keyed_schedule_matches_plain_pytorch():
    data = make_tokens(48)  # 0 to 6 loss-bearing tokens a sequence: micro-batches hold different counts
    model = TokenModule()
    schedule = {0: 1, 40: 3, 150: 2}

    def factor_at(tokens):
        return schedule[max(key for key in schedule if key <= tokens)]

    reference, windows = token_keyed_reference(data, 4, 2, factor_at)
    fit = trainer([AccumulationScheduler(schedule, unit="token")], max_epochs=2)
    fit.fit(model, DataLoader(DictDataset(data), batch_size=4))
    assert len(set(windows)) == 3  # every factor of the schedule was used
    assert fit.global_step == len(windows)
    assert max_deviation(weights(model), reference) <= TOLERANCE
    assert fit.callbacks[0].features["token_count"].tokens_seen == 2 * int((data["labels"] != -100).sum())


def test_a_token_keyed_ramp_matches_plain_pytorch():
    """target 16 samples from 4 in steps of 4 over 60 tokens: factors 1, 2, 3, 4 from 0, 20, 40, 60 tokens."""
    data = make_tokens(48)
    model = TokenModule()
    callback = AccumulationScheduler(
        target_batch_size=16, ramp_start_batch_size=4, ramp_increment=4, ramp_samples=60, unit="token"
    )
    reference, windows = token_keyed_reference(data, 4, 2, lambda tokens: 1 + min(tokens // 20, 3))
    trainer([callback], max_epochs=2).fit(model, DataLoader(DictDataset(data), batch_size=4))
    assert {1, 2, 3, 4} <= set(windows)  # the ramp ran through every stage
    assert max_deviation(weights(model), reference) <= TOLERANCE


def test_tokens_are_counted_with_count_items_when_normalizing_by_token():
    data = make_tokens(24)
    callback = AccumulationScheduler({0: 1, 10: 2}, unit="token", normalize_by="token", count_items=lambda b: 5)
    trainer([callback], max_epochs=1).fit(TokenModule(), DataLoader(DictDataset(data), batch_size=4))
    assert callback.features["token_count"].tokens_seen == 5 * 6


def test_a_token_schedule_over_batches_without_labels_names_unit_token_not_the_weighting():
    # before, the message named normalize_by='token' (which this run does not set)
    x, y = make_data(32)
    module = RegressionModule()
    before = [p.detach().clone() for p in module.parameters()]
    callback = AccumulationScheduler({0: 2}, unit="token")
    with pytest.raises(KeyError, match=r"unit='token' reads the labels at `token_key='labels'`") as raised:
        trainer([callback], max_epochs=1).fit(module, loader(x, y, 4))
    message = str(raised.value)
    assert "normalize_by='token' reads" not in message
    assert "pass `count_items` (it counts the schedule's tokens" in message
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))


@pytest.mark.parametrize("normalize_by", ["micro_batch", "token"])
def test_a_token_schedule_over_batches_without_labels_trains_with_count_items_as_its_error_advises(normalize_by):
    """The error above advises `count_items`: passed alone (the default normalize_by), the schedule counts with it and
    the run trains, its windows those of a plain loop keyed by the counted tokens (each batch of 4 counts 4 x 3)."""
    x, y = make_data(32)
    module = RegressionModule()
    callback = AccumulationScheduler(
        {0: 1, 30: 2}, unit="token", count_items=lambda batch: 3 * len(batch[0]), normalize_by=normalize_by
    )
    trainer([callback], max_epochs=1).fit(module, loader(x, y, 4))
    assert callback.features["token_count"].tokens_seen == 8 * 12  # type: ignore[attr-defined]
    # factor 1 until 30 tokens (3 windows: 36 tokens), then 2: windows 1, 1, 1, 2, 2, 1 (the epoch's rest)
    reference = reference_weights(x, y, 4, [[1, 1, 1, 2, 2, 1]])
    assert max_deviation(weights(module), reference) <= TOLERANCE


def test_a_token_schedule_with_samples_weighted_by_count_items_reads_the_tokens_from_the_labels():
    data = make_tokens(24)
    callback = AccumulationScheduler({0: 1, 10: 2}, unit="token", normalize_by="sample", count_items=lambda b: 4)
    trainer([callback], max_epochs=1).fit(TokenModule(), DataLoader(DictDataset(data), batch_size=4))
    assert callback.features["token_count"].tokens_seen == int((data["labels"] != -100).sum())  # type: ignore
