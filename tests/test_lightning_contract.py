"""The private Lightning behaviour lightning_accum relies on (see lightning_accum/_loop.py).

If one of these fails after a Lightning upgrade, the loop routing must be revisited before widening the pin.
"""

import inspect

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loops.optimization.automatic import ClosureResult, _AutomaticOptimization
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

from lightning_accum._loop import LoopControl
from tests.helpers import RegressionModule, loader, make_data, trainer


def test_the_routed_methods_exist_with_the_expected_signatures():
    assert list(inspect.signature(_TrainingEpochLoop._should_accumulate).parameters) == ["self"]
    assert list(inspect.signature(_AutomaticOptimization._make_zero_grad_fn).parameters) == [
        "self",
        "batch_idx",
        "optimizer",
    ]


def test_lightning_divides_each_loss_by_accumulate_grad_batches():
    assert ClosureResult.from_training_step_output(torch.tensor(6.0), 3).loss.item() == 2.0


class WindowsOfThree(Callback):
    """Routes Lightning's decisions to fixed windows of 3 micro-batches, counting what Lightning then does."""

    def __init__(self) -> None:
        self.micro_step = -1
        self.steps = self.zero_grads = 0
        self.control = None

    def setup(self, trainer, pl_module, stage):
        self.control = LoopControl(trainer, lambda: self.micro_step % 3 == 0, lambda: self.micro_step % 3 == 2)
        self.control.install()

    def on_train_batch_start(self, *_):
        self.micro_step += 1

    def on_before_zero_grad(self, *_):
        self.zero_grads += 1

    def on_before_optimizer_step(self, *_):
        self.steps += 1


def test_lightning_consults_the_shadowed_decisions_and_gets_them_back():
    x, y = make_data(36)
    spy = WindowsOfThree()
    fit_trainer = trainer([spy], max_epochs=1)
    fit_trainer.fit(RegressionModule(), loader(x, y, 4))  # 9 micro-batches, accumulate_grad_batches=1
    assert (spy.steps, spy.zero_grads, fit_trainer.global_step) == (3, 3, 3)

    spy.control.remove()
    epoch_loop = fit_trainer.fit_loop.epoch_loop
    assert "_should_accumulate" not in vars(epoch_loop)
    assert "_make_zero_grad_fn" not in vars(epoch_loop.automatic_optimization)


def test_on_before_backward_receives_the_fresh_quotient_that_backward_runs_on():
    """normalize_by='sample'/'token' re-weights that tensor in place (lightning_accum/callback.py)."""
    seen = []

    class Zero(Callback):
        def on_before_backward(self, trainer, pl_module, loss):
            seen.append((loss.grad_fn is not None and not loss.is_leaf, loss._base is None))
            loss.mul_(0.0)

    x, y = make_data(8)
    module = RegressionModule()
    before = [p.detach().clone() for p in module.parameters()]
    trainer([Zero()], max_epochs=1, accumulate_grad_batches=2).fit(module, loader(x, y, 4))
    assert seen == [(True, True), (True, True)]  # a non-leaf, non-view result of Lightning's division
    assert all(torch.equal(p, q) for p, q in zip(module.parameters(), before, strict=True))  # zero gradients
