"""What reaches TensorBoard: the listed tags with the right values, the custom-scalars layout and the summary."""

import pytest
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_accum import AccumulationScheduler
from tests.helpers import RegressionModule, loader, make_data, trainer

# 10 micro-batches of 4 an epoch, factor 2 until step 3, then 4: windows 2,2,2,4 | 4,4,2
FACTORS = [2, 2, 2, 4, 4, 4, 4]
TAKEN = [2, 2, 2, 4, 4, 4, 2]


def _events(tmp_path):
    x, y = make_data(40)
    logger = TensorBoardLogger(tmp_path, name="run", version=0)
    callback = AccumulationScheduler({0: 2, 3: 4}, unit="step", lr_scaling="linear")
    trainer([callback], max_epochs=2, logger=logger, log_every_n_steps=1).fit(RegressionModule(), loader(x, y, 4))
    events = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events


def _values(events, tag):
    return [event.value for event in events.Scalars(tag)]


def test_every_listed_tag_is_logged_once_per_optimizer_step_with_its_value(tmp_path):
    events = _events(tmp_path)
    tags = set(events.Tags()["scalars"])
    expected_tags = {
        "accum/factor",
        "accum/effective_batch_size",
        "accum/micro_batch_size",
        "accum/world_size",
        "accum/lr",
        "accum/lr_scale",
        "accum/samples_seen",
        "accum/optimizer_steps",
        "accum/micro_steps",
        "accum/window_loss",
        "accum/samples_per_second",
        "accum/memory_rss_mb",
    }
    assert expected_tags <= tags
    assert [event.step for event in events.Scalars("accum/factor")] == list(range(1, 8))
    assert _values(events, "accum/factor") == FACTORS
    assert _values(events, "accum/effective_batch_size") == [4 * taken for taken in TAKEN]
    assert _values(events, "accum/micro_steps") == [2, 4, 6, 10, 14, 18, 20]
    assert _values(events, "accum/samples_seen") == [8, 16, 24, 40, 56, 72, 80]
    assert _values(events, "accum/lr_scale") == [1, 1, 1, 2, 2, 2, 2]  # linear, base = first effective batch (8)
    assert _values(events, "accum/lr") == pytest.approx([0.1, 0.1, 0.1, 0.2, 0.2, 0.2, 0.2])
    assert all(value > 0 for value in _values(events, "accum/memory_rss_mb"))


def test_window_loss_is_the_mean_over_the_window(tmp_path):
    import torch
    from torch import nn

    from tests.helpers import make_net

    events = _events(tmp_path)
    x, y = make_data(40)
    net = make_net(1)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    batches = [(x[i : i + 4], y[i : i + 4]) for i in range(0, 40, 4)]
    expected, start, scales = [], 0, [1, 1, 1, 2, 2, 2, 2]
    for step, size in enumerate([2, 2, 2, 4, 4, 4, 2]):
        window = batches[start : start + size] if start + size <= 10 else batches[start:]
        start = (start + size) % 10
        optimizer.zero_grad()
        loss = sum(nn.functional.mse_loss(net(bx), by) for bx, by in window) / size
        loss.backward()
        optimizer.param_groups[0]["lr"] = 0.1 * scales[step]
        optimizer.step()
        expected.append(loss.item())
    assert _values(events, "accum/window_loss") == pytest.approx(expected, rel=1e-5)


def test_tensorboard_gets_the_dashboard_and_the_summary(tmp_path):
    events = _events(tmp_path)
    tensor_tags = events.Tags()["tensors"]
    assert "custom_scalars__config__" in tensor_tags
    from tensorboard.plugins.custom_scalar import layout_pb2

    layout = layout_pb2.Layout()
    layout.ParseFromString(events.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0])
    titles = {chart.title for category in layout.category for chart in category.chart}
    assert {"factor and effective batch", "lr as used", "window loss", "memory (MiB)"} <= titles
    summary = events.Tensors("accum/summary/text_summary")[0].tensor_proto.string_val[0].decode()
    assert summary == "micro 4 x factor 2 x world 1 = 8 samples; lr 0.1 x (8/8) = 0.1"


def test_any_logger_receives_the_metrics(tmp_path):
    x, y = make_data(16)
    logger = CSVLogger(tmp_path, name="csv", version=0)
    trainer([AccumulationScheduler({0: 2})], max_epochs=1, logger=logger).fit(RegressionModule(), loader(x, y, 4))
    header = (tmp_path / "csv" / "version_0" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"accum/factor", "accum/window_loss", "accum/lr"} <= set(header)
