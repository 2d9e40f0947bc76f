"""The optimizer really uses the rule's learning rate at every step, composed with LR schedulers."""

import math

import pytest
import torch
from torch import nn

from lightning_accum import AccumulationScheduler
from tests.helpers import (
    BatchStream,
    MeasuredLR,
    RegressionModule,
    loader,
    make_data,
    make_net,
    max_deviation,
    trainer,
    weights,
)


def used(spy: MeasuredLR) -> list[float]:
    return [lrs[0] for lrs in spy.used]


class ScheduledModule(RegressionModule):
    def __init__(self, make_scheduler) -> None:
        super().__init__()
        self.make_scheduler = make_scheduler

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        return [optimizer], [{"scheduler": self.make_scheduler(optimizer), "interval": "step"}]


def _scheduler_lrs(make_scheduler, steps: int) -> list[float]:
    """What the LR scheduler alone gives at each step, from torch on a throwaway optimizer."""
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    scheduler = make_scheduler(optimizer)
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def _reference(x, y, batch_size, windows, lrs) -> list[torch.Tensor]:
    """Plain PyTorch: one SGD step per window on the mean loss, with the given learning rate for each step."""
    net = make_net(1)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    batches = [(x[i : i + batch_size], y[i : i + batch_size]) for i in range(0, len(x), batch_size)]
    step = 0
    for epoch_windows in windows:
        start = 0
        for size in epoch_windows:
            window, start = batches[start : start + size], start + size
            optimizer.zero_grad()
            (sum(nn.functional.mse_loss(net(bx), by) for bx, by in window) / size).backward()
            optimizer.param_groups[0]["lr"] = lrs[step]
            optimizer.step()
            step += 1
    return [p.detach().clone() for p in net.parameters()]


# 10 batches of 4 an epoch; factor 2 until step 3, then 4: windows 2,2,2,4 | 4,4,2; effective 8 then 16 samples, and
# the short last window holds 8
WINDOWS = [[2, 2, 2, 4], [4, 4, 2]]
HELD = [2, 2, 2, 4, 4, 4, 2]


def test_linear_rule_composes_with_step_lr():
    def step_lr(optimizer):
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)

    x, y = make_data(40)
    spy = MeasuredLR()
    callback = AccumulationScheduler({0: 2, 3: 4}, unit="step", lr_scaling="linear", base_batch_size=8)
    model = ScheduledModule(step_lr)
    trainer([callback, spy], max_epochs=2, precision="64-true").fit(model, loader(x, y, 4))
    expected = [0.1 * 0.5 ** (step // 2) * (4 * held / 8) for step, held in enumerate(HELD)]
    assert used(spy) == pytest.approx(expected, rel=1e-9)  # measured from each update: delta = -lr * grad
    assert max_deviation(weights(model), _reference(x, y, 4, WINDOWS, expected)) <= 1e-6


def test_sqrt_rule_with_scale_warmup_composes_with_warmup_then_cosine():
    def warmup_cosine(optimizer):
        warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.2, total_iters=2)
        cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=5)
        return torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, cosine], milestones=[2])

    x, y = make_data(40)
    spy = MeasuredLR()
    # base defaults to the first window's effective batch (8); at step 3 the target scale is sqrt(16/8), reached
    # linearly over 2 steps; the short last window steps at sqrt(8/8)
    callback = AccumulationScheduler({0: 2, 3: 4}, unit="step", lr_scaling="sqrt", lr_warmup_steps=2)
    model = ScheduledModule(warmup_cosine)
    trainer([callback, spy], max_epochs=2, precision="64-true").fit(model, loader(x, y, 4))
    target = math.sqrt(2)
    scale = [1, 1, 1, 1, 1 + (target - 1) / 2, target, 1]
    expected = [lr * s for lr, s in zip(_scheduler_lrs(warmup_cosine, 7), scale, strict=True)]
    assert used(spy) == pytest.approx(expected, rel=1e-9)
    assert max_deviation(weights(model), _reference(x, y, 4, WINDOWS, expected)) <= 1e-6


@pytest.mark.parametrize(("rule", "full", "held"), [("linear", 4.0, 2.0), ("sqrt", 2.0, math.sqrt(2))])
@pytest.mark.parametrize("sized", [True, False], ids=["sized", "unknown length"])
def test_a_short_last_window_steps_at_the_lr_of_the_batch_it_holds(rule, full, held, sized):
    """10 batches of 4 at factor 4 from a base of 4 samples: windows of 16, 16 and 8 samples. The last step's LR is
    the rule's at 8 samples, not at 16, whether the epoch's end is known when the window opens or only at its end."""
    x, y = make_data(40)
    spy = MeasuredLR()
    callback = AccumulationScheduler({0: 4}, lr_scaling=rule, base_batch_size=4, micro_batch_size=4)
    data = loader(x, y, 4) if sized else torch.utils.data.DataLoader(BatchStream(x, y, 4), batch_size=None)
    model = RegressionModule()
    trainer([callback, spy], max_epochs=2, precision="64-true").fit(model, data)
    expected = [0.1 * scale for scale in (full, full, held)] * 2
    assert used(spy) == pytest.approx(expected, rel=1e-9)  # measured from each update: delta = -lr * grad
    assert max_deviation(weights(model), _reference(x, y, 4, [[4, 4, 2]] * 2, expected)) <= 1e-6


@pytest.mark.parametrize(("rule", "cap", "held"), [("linear", 2.0, 1.0), ("sqrt", 1.5, 1.5 / math.sqrt(2))])
@pytest.mark.parametrize("sized", [True, False], ids=["sized", "unknown length"])
def test_past_lr_scale_max_a_short_window_keeps_the_full_windows_decay(rule, cap, held, sized):
    """The same windows of 16, 16 and 8 samples with the scale capped below the rule's at 16: the full windows step
    at the cap, and the short one at the cap times the rule's ratio of 8 samples to 16 (the full window's rate per
    sample under the linear rule), not at the rule's own scale at 8 samples, which would be the run's largest rate
    per sample on its noisiest step."""
    x, y = make_data(40)
    spy = MeasuredLR()
    callback = AccumulationScheduler({0: 4}, lr_scaling=rule, base_batch_size=4, micro_batch_size=4, lr_scale_max=cap)
    data = loader(x, y, 4) if sized else torch.utils.data.DataLoader(BatchStream(x, y, 4), batch_size=None)
    model = RegressionModule()
    trainer([callback, spy], max_epochs=2, precision="64-true").fit(model, data)
    expected = [0.1 * scale for scale in (cap, cap, held)] * 2
    assert used(spy) == pytest.approx(expected, rel=1e-9)
    assert max_deviation(weights(model), _reference(x, y, 4, [[4, 4, 2]] * 2, expected)) <= 1e-6


def test_several_param_groups_keep_their_ratio_and_the_scheduler_value_is_untouched():
    class TwoGroups(RegressionModule):
        def configure_optimizers(self):
            first, second = self.net[0], self.net[2]
            return torch.optim.SGD(
                [{"params": first.parameters(), "lr": 0.1}, {"params": second.parameters(), "lr": 0.01}]
            )

    spy = MeasuredLR()
    x, y = make_data(24)  # windows of 1, 1 and 4 batches of 4
    callback = AccumulationScheduler({0: 1, 2: 4}, unit="step", lr_scaling="linear", base_batch_size=4)
    fit_trainer = trainer([callback, spy], max_epochs=1, precision="64-true")
    fit_trainer.fit(TwoGroups(), loader(x, y, 4))
    assert [lr for group in spy.used for lr in group] == pytest.approx([0.1, 0.01, 0.1, 0.01, 0.4, 0.04], rel=1e-9)
    assert [g["lr"] for g in fit_trainer.optimizers[0].param_groups] == [0.1, 0.01]


def test_a_batch_skipped_with_minus_one_does_not_step_the_lr_scheduler():
    class SkipsRest(ScheduledModule):
        def on_train_batch_start(self, batch, batch_idx):
            return -1 if batch_idx == 5 else None

    x, y = make_data(40)
    model = SkipsRest(lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5))
    fit_trainer = trainer([AccumulationScheduler({0: 3})], max_epochs=1)
    fit_trainer.fit(model, loader(x, y, 4))  # windows 0-2 step; 3-4 never finish: batch 5 skips the rest
    assert fit_trainer.global_step == 1
    assert fit_trainer.lr_scheduler_configs[0].scheduler.last_epoch == 1


@pytest.mark.parametrize("where", ["on_before_optimizer_step", "optimizer_update"])
def test_an_exception_in_a_step_leaves_the_configured_lr_in_the_optimizer_and_the_checkpoint(tmp_path, where):
    """The scale is applied only for the update: nothing raised or saved around it sees the scaled value."""
    from lightning.pytorch.callbacks import Callback, OnExceptionCheckpoint

    class Failing(torch.optim.SGD):
        def step(self, closure=None):
            if where == "optimizer_update" and self.fail:
                closure()
                raise RuntimeError("update failed")
            return super().step(closure)

    class Module(RegressionModule):
        def configure_optimizers(self):
            optimizer = Failing(self.parameters(), lr=0.1)
            optimizer.fail = False
            return optimizer

    class FailAtStep2(Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if trainer.global_step == 2:
                optimizer.fail = True
                if where == "on_before_optimizer_step":
                    raise RuntimeError("hook failed")

    x, y = make_data(40)
    callback = AccumulationScheduler({0: 2}, lr_scaling="linear", base_batch_size=4)  # scale 2
    saved = OnExceptionCheckpoint(dirpath=tmp_path, filename="on_exception")
    fit_trainer = trainer([callback, FailAtStep2(), saved], max_epochs=1, enable_checkpointing=True)
    with pytest.raises(RuntimeError, match="failed"):
        fit_trainer.fit(Module(), loader(x, y, 4))
    assert fit_trainer.optimizers[0].param_groups[0]["lr"] == 0.1
    checkpoint = torch.load(tmp_path / "on_exception.ckpt", weights_only=False)
    assert checkpoint["optimizer_states"][0]["param_groups"][0]["lr"] == 0.1


def test_a_factor_larger_than_the_epoch_warns_and_scales_the_lr_for_the_window_it_can_hold():
    spy = MeasuredLR()
    x, y = make_data(12)  # 3 batches of 4 an epoch
    callback = AccumulationScheduler({0: 8}, lr_scaling="linear", base_batch_size=4)
    with pytest.warns(UserWarning, match=r"the schedule reaches factor 8, more than an epoch's 3 batches"):
        trainer([callback, spy], max_epochs=2, precision="64-true").fit(RegressionModule(), loader(x, y, 4))
    assert used(spy) == pytest.approx([0.3, 0.3], rel=1e-9)  # the window of 3 x 4 samples, not 8 x 4


def test_a_warmup_resumed_under_the_rule_none_is_applied_as_it_is_logged(tmp_path):
    """A checkpoint of a run with the linear rule (scale 4), resumed with ``lr_scaling="none"`` and a warmup: the scale
    moves back to 1 over the warmup, and the optimizer really uses what ``accum/lr`` and ``accum/lr_scale`` say."""
    from lightning.pytorch.loggers import CSVLogger

    x, y = make_data(64)
    first = trainer([AccumulationScheduler({0: 4}, lr_scaling="linear", base_batch_size=4)], max_epochs=1)
    first.fit(RegressionModule(), loader(x, y, 4))
    path = tmp_path / "linear.ckpt"
    first.save_checkpoint(path)
    spy = MeasuredLR()
    callback = AccumulationScheduler({0: 4}, lr_scaling="none", lr_warmup_steps=4)
    logger = CSVLogger(tmp_path, name="resumed")
    resumed = trainer([callback, spy], max_epochs=2, precision="64-true", logger=logger, log_every_n_steps=1)
    resumed.fit(RegressionModule(), loader(x, y, 4), ckpt_path=path)
    rows = (tmp_path / "resumed" / "version_0" / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    logged = [
        float(row.split(",")[header.index("accum/lr")]) for row in rows[1:] if row.split(",")[header.index("accum/lr")]
    ]
    assert logged == pytest.approx([0.4, 0.325, 0.25, 0.175], abs=1e-12)  # 0.1 x a scale from 4 to 1 over 4 steps
    assert used(spy) == pytest.approx(logged, rel=1e-9)
