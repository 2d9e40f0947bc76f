"""What reaches TensorBoard: the listed tags with the right values, the custom-scalars layout and the summary."""

import pytest
import torch
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
    # linear, base = first effective batch (8); the short last window steps at the rate of the 8 samples it holds
    assert _values(events, "accum/lr_scale") == [1, 1, 1, 2, 2, 2, 1]
    assert _values(events, "accum/lr") == pytest.approx([0.1, 0.1, 0.1, 0.2, 0.2, 0.2, 0.1])
    assert all(value > 0 for value in _values(events, "accum/memory_rss_mb"))
    # the run's constants: with the first logged step only
    assert [(e.step, e.value) for e in events.Scalars("accum/micro_batch_size")] == [(1, 4.0)]
    assert [(e.step, e.value) for e in events.Scalars("accum/world_size")] == [(1, 1.0)]


def test_the_dashboard_layout_is_built_when_a_quantity_first_appears_and_at_no_other_logged_step(tmp_path, monkeypatch):
    """Rebuilding the Custom Scalars layout at every logged step took about a third of the metrics feature's time
    there (issue 46): it is built with the first logged step, and again only when a quantity appears later."""
    import lightning_accum.features.metrics as metrics

    built = []

    def counted(tags):
        built.append(set(tags))
        return layout(tags)

    layout = metrics.tensorboard_layout
    monkeypatch.setattr(metrics, "tensorboard_layout", counted)
    x, y = make_data(64)
    logger = TensorBoardLogger(tmp_path, name="run", version=0)
    callback = AccumulationScheduler({0: 2}, noise_scale=True, noise_scale_interval=5)
    trainer([callback], max_epochs=1, logger=logger, log_every_n_steps=1).fit(RegressionModule(), loader(x, y, 4))
    assert len(built) == 2  # 8 logged steps: the first, and the 5th, where the noise scale's first estimate appears
    assert "accum/noise_scale" not in built[0]
    assert "accum/noise_scale" in built[1]


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
    assert {"factor", "effective batch", "lr as used", "window loss", "memory (MiB)"} <= titles
    summary = events.Tensors("accum/summary/text_summary")[0].tensor_proto.string_val[0].decode()
    assert summary == "micro 4 x factor 2 x world 1 = 8 samples; lr 0.1 x (8/8) = 0.1"


def test_any_logger_receives_the_metrics(tmp_path):
    x, y = make_data(48)
    logger = CSVLogger(tmp_path, name="csv", version=0)
    fit = trainer([AccumulationScheduler({0: 2})], max_epochs=1, logger=logger, log_every_n_steps=2)
    fit.fit(RegressionModule(), loader(x, y, 4))
    rows = (tmp_path / "csv" / "version_0" / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    assert {"accum/factor", "accum/window_loss", "accum/lr"} <= set(header)
    logged = [row.split(",") for row in rows[1:] if row.split(",")[header.index("accum/factor")]]
    steps = [row[header.index("step")] for row in logged]
    assert steps == ["2", "4", "6"]  # every `log_every_n_steps` optimizer steps, as Lightning logs
    # the window loss is summed only in windows that end in a logged step: those windows' mean loss, in plain PyTorch
    import torch
    from torch import nn

    from tests.helpers import make_net

    net = make_net(1)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    expected = []
    for start in range(0, 48, 8):
        optimizer.zero_grad()
        loss = sum(nn.functional.mse_loss(net(x[i : i + 4]), y[i : i + 4]) for i in (start, start + 4)) / 2
        loss.backward()
        optimizer.step()
        expected.append(loss.item())
    window_losses = [float(row[header.index("accum/window_loss")]) for row in logged]
    assert window_losses == pytest.approx(expected[1::2], rel=1e-5)


def test_accum_lr_is_the_lr_each_step_really_used(tmp_path):
    """Against the LR measured from each plain-SGD update (delta = -lr * grad), with StepLR, a factor change, sqrt."""
    import torch

    from tests.helpers import MeasuredLR

    class StepLRModule(RegressionModule):
        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
            return [optimizer], [{"scheduler": scheduler, "interval": "step"}]

    x, y = make_data(40)
    logger = CSVLogger(tmp_path, name="csv", version=0)
    measured = MeasuredLR()
    callback = AccumulationScheduler({0: 2, 3: 4}, unit="step", lr_scaling="sqrt")
    fit_trainer = trainer([callback, measured], max_epochs=2, logger=logger, log_every_n_steps=1, precision="64-true")
    fit_trainer.fit(StepLRModule(), loader(x, y, 4))
    logger.save()
    rows = (tmp_path / "csv" / "version_0" / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    logged = [
        float(row.split(",")[header.index("accum/lr")]) for row in rows[1:] if row.split(",")[header.index("accum/lr")]
    ]
    used = [lrs[0] for lrs in measured.used]
    assert len(logged) == len(used) == 7
    assert logged == pytest.approx(used, rel=1e-6)
    # StepLR halves every 2 steps; from step 3 the effective batch doubles: sqrt(2), but for the short last window
    expected = [0.1 * 0.5 ** (step // 2) * (2**0.5 if 3 <= step < 6 else 1.0) for step in range(7)]
    assert used == pytest.approx(expected, rel=1e-9)


def test_the_summary_follows_the_run(tmp_path):
    events = _events(tmp_path)
    entries = [
        (event.step, event.tensor_proto.string_val[0].decode())
        for event in events.Tensors("accum/summary/text_summary")
    ]
    assert entries == [
        (0, "micro 4 x factor 2 x world 1 = 8 samples; lr 0.1 x (8/8) = 0.1"),
        (3, "optimizer step 3, 24 samples seen: factor 2 -> 4, effective batch 8 -> 16 samples, lr scale 1 -> 2"),
    ]


def test_the_summary_names_the_configured_lr_not_a_schedulers_first_value(tmp_path):
    import torch

    class OneCycle(RegressionModule):
        def configure_optimizers(self):
            optimizer = torch.optim.AdamW(self.parameters(), lr=0.002)
            scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.002, total_steps=20)
            return [optimizer], [{"scheduler": scheduler, "interval": "step"}]

    x, y = make_data(16)
    logger = TensorBoardLogger(tmp_path, name="run", version=0)
    callback = AccumulationScheduler({0: 2}, lr_scaling="sqrt")
    trainer([callback], max_epochs=1, logger=logger).fit(OneCycle(), loader(x, y, 4))
    events = EventAccumulator(logger.log_dir, size_guidance={"tensors": 0})
    events.Reload()
    summary = events.Tensors("accum/summary/text_summary")[0].tensor_proto.string_val[0].decode()
    assert summary == "micro 4 x factor 2 x world 1 = 8 samples; lr 0.002 x sqrt(8/8) = 0.002"


def test_the_progress_bar_shows_integers_and_says_when_a_window_is_short(tmp_path):
    from lightning.pytorch.callbacks import Callback

    shown = []

    class Shown(Callback):
        def on_train_batch_end(self, trainer, *_):
            shown.append((trainer.progress_bar_metrics.get("factor"), trainer.progress_bar_metrics.get("eff_batch")))

    x, y = make_data(20)  # 5 micro-batches of 4: windows of 2, 2 and a short one of 1
    trainer([AccumulationScheduler({0: 2}), Shown()], max_epochs=1).fit(RegressionModule(), loader(x, y, 4))
    # as text, which TQDM and Rich both show as given (tests/test_console.py reads them on a terminal)
    assert shown == [(None, None), ("2", "8"), ("2", "8"), ("2", "8"), ("2", "4 (short window)")]


# ------------------------------------------------------------------ what the fit prints before its first batch


def _fit_messages(caplog, module=None, **arguments) -> tuple[list[str], list[str]]:
    """(info lines, warnings) of a fit of ``module`` (the regression model) under ``arguments``."""
    import warnings

    x, y = make_data(64)
    fit_trainer = trainer([AccumulationScheduler(**arguments)], max_epochs=2)
    with caplog.at_level("INFO"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit_trainer.fit(module or RegressionModule(), loader(x, y, 8))
    return [record.message for record in caplog.records], [str(warning.message) for warning in caught]


@pytest.mark.parametrize(
    ("arguments", "noted"),
    [
        ({"scheduling": {0: 4}}, False),  # a constant factor: the Trainer's own figure (4 steps) is right
        ({"scheduling": {0: 2, 1: 4}}, True),  # 4 + 2 steps, where the Trainer counts 4 + 4
    ],
)
def test_the_stepping_batches_note_is_printed_only_where_the_trainers_figure_is_wrong(caplog, arguments, noted):
    infos, _ = _fit_messages(caplog, **arguments)
    notes = [line for line in infos if "`trainer.estimated_stepping_batches` does not know the schedule" in line]
    assert len(notes) == int(noted)
    if noted:
        assert "this run takes 6 optimizer steps" in notes[0]


def test_the_summary_says_how_loader_batches_are_split(caplog):
    infos, _ = _fit_messages(caplog, scheduling={0: 2}, micro_batch_size=4)
    (summary,) = [line for line in infos if "x factor" in line]
    assert summary.startswith("AccumulationScheduler: micro 8 x factor 2 x world 1 = 16 samples;")
    assert "each loader batch split into micro-batches of 4 rows" in summary


class BatchNormModule(RegressionModule):
    def __init__(self, sync: bool = False) -> None:
        super().__init__()
        self.norm = torch.nn.SyncBatchNorm(5) if sync else torch.nn.BatchNorm1d(5)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if not isinstance(self.norm, torch.nn.SyncBatchNorm):  # SyncBatchNorm needs a process group to run
            x = self.norm(x)
        return torch.nn.functional.mse_loss(self.net(x), y)


@pytest.mark.parametrize(
    ("module", "arguments", "warned"),
    [
        (lambda: BatchNormModule(), {"scheduling": {0: 4}}, True),
        (lambda: BatchNormModule(), {"scheduling": {0: 1}, "micro_batch_size": 4}, True),  # windows of two parts
        (lambda: BatchNormModule(), {"scheduling": {0: 1}}, False),  # one micro-batch a window: as a big batch
        (lambda: BatchNormModule(sync=True), {"scheduling": {0: 4}}, False),
        (lambda: RegressionModule(), {"scheduling": {0: 4}}, False),
    ],
    ids=["factor-4", "split", "factor-1", "sync-batch-norm", "no-batch-norm"],
)
def test_batch_norm_layers_warn_once_when_windows_hold_several_micro_batches(caplog, module, arguments, warned):
    _, caught = _fit_messages(caplog, module(), **arguments)
    batch_norm = [message for message in caught if "BatchNorm layers" in message]
    assert len(batch_norm) == int(warned)
    if warned:
        assert batch_norm[0].startswith("AccumulationScheduler: the model's BatchNorm layers (`norm`) normalize")


def test_the_cuda_memory_metrics_read_the_peak_and_never_reset_it(monkeypatch):
    # CUDA cannot run here: torch.cuda's four readers are replaced; what matters is that the user's peak statistic,
    # which examples/accumulation_experiment.py and the GPU suite measure a fit with, is never reset by the callback
    # (benchmarks/gpu/memory_metrics.py checks the same against a real device)
    from lightning_accum.core.monitor import memory_metrics

    calls = []
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 3 * 2**20)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 8 * 2**20)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 5 * 2**20)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: calls.append(device))
    metrics = memory_metrics(torch.device("cuda", 0))
    assert metrics == {
        "accum/memory_allocated_mb": 3.0,
        "accum/memory_reserved_mb": 8.0,
        "accum/memory_peak_mb": 5.0,
    }
    assert calls == []
