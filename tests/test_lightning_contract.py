"""The private Lightning behaviour lightning_accum relies on (see lightning_accum/trainer/_loop.py).

If one of these fails after a Lightning upgrade, the loop routing must be revisited before widening the pin.
"""

import inspect

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loops.optimization.automatic import ClosureResult, _AutomaticOptimization
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

from lightning_accum.trainer._loop import LoopControl
from tests.helpers import RegressionModule, loader, make_data, trainer


def test_the_routed_methods_exist_with_the_expected_signatures():
    assert list(inspect.signature(_TrainingEpochLoop._should_accumulate).parameters) == ["self"]
    assert list(inspect.signature(_AutomaticOptimization._make_zero_grad_fn).parameters) == [
        "self",
        "batch_idx",
        "optimizer",
    ]
    assert list(inspect.signature(_TrainingEpochLoop.update_lr_schedulers).parameters) == [
        "self",
        "interval",
        "update_plateau_schedulers",
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
        self.control.lead()

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

    spy.control.release()
    epoch_loop = fit_trainer.fit_loop.epoch_loop
    assert "_should_accumulate" not in vars(epoch_loop)
    assert "update_lr_schedulers" not in vars(epoch_loop)
    assert "_make_zero_grad_fn" not in vars(epoch_loop.automatic_optimization)


def test_step_schedulers_step_from_the_configs_the_strategy_holds_when_the_loop_asks():
    """LoopControl hands Lightning only the step schedulers due at an optimizer step, by swapping that list."""
    x, y = make_data(24)
    stepped = []

    class Module(RegressionModule):
        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
            return [optimizer], [{"scheduler": scheduler, "interval": "step", "frequency": 2}]

        def lr_scheduler_step(self, scheduler, metric):
            stepped.append(self.trainer.global_step)
            scheduler.step()

    class HideSchedulers(Callback):
        def on_train_batch_end(self, trainer, *_):
            if trainer.global_step == 3:  # from here on the loop finds no scheduler to step
                trainer.strategy.lr_scheduler_configs = []

    trainer([HideSchedulers()], max_epochs=1).fit(Module(), loader(x, y, 4))  # 6 batches
    assert stepped == [2]  # (batch_idx + 1) % frequency counts batches; the list is read on every call


def test_tuners_run_the_loop_from_on_fit_start_with_only_their_own_callback(tmp_path):
    """AccumulationScheduler takes charge at on_train_start: the tuner's loop never runs its hooks or routing."""
    from lightning.pytorch.tuner import Tuner

    x, y = make_data(64)
    calls = []

    class Spy(Callback):
        def on_fit_start(self, *_):
            calls.append("fit_start")

        def on_train_start(self, *_):
            calls.append("train_start")

        def on_train_batch_start(self, *_):
            calls.append("batch")

    class Module(RegressionModule):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.lr)

    module = Module()
    module.lr = 0.1
    tuner_trainer = trainer([Spy()], max_epochs=1, default_root_dir=tmp_path)
    Tuner(tuner_trainer).lr_find(module, loader(x, y, 4), num_training=5)
    assert calls == []  # the finder runs first in on_fit_start, with only its own callback, then ends the fit


def test_swa_sets_accumulate_grad_batches_for_its_batch_norm_epoch_and_gives_it_back():
    """AccumulationScheduler follows a factor another component sets between epochs (tests/test_lightning_compat.py)."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging
    from torch import nn

    x, y = make_data(16)
    seen = []

    class WithBatchNorm(RegressionModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(x.shape[1], 8), nn.BatchNorm1d(8), nn.Linear(8, y.shape[1]))

    class Spy(Callback):
        def on_train_batch_start(self, trainer, *_):
            skip = trainer.fit_loop._skip_backward
            # lightning_accum/trainer/_loop.py reads the attribute the fit loop's property forwards to
            assert trainer.fit_loop.epoch_loop.automatic_optimization._skip_backward is skip
            seen.append((trainer.current_epoch, trainer.accumulate_grad_batches, skip))

    swa = StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1)
    trainer([swa, Spy()], max_epochs=2, accumulate_grad_batches=2).fit(WithBatchNorm(), loader(x, y, 4))
    # the extra epoch: one window longer than the epoch, and no backward (the routing takes no step on none)
    assert sorted(set(seen)) == [(0, 2, False), (1, 2, False), (2, 5, True)]


def test_on_before_backward_receives_the_fresh_quotient_that_backward_runs_on():
    """normalize_by='sample'/'token' re-weights that tensor in place (lightning_accum/trainer/callback.py)."""
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


def test_a_checkpoint_keeps_the_loop_progress_and_loader_states_where_resume_points_rewind_them(tmp_path):
    """lightning_accum/trainer/_resume.py rewrites these entries of a checkpoint written inside a window; a restart from
    counters with ``completed`` below ``started`` redoes the batch, with the loaders' saved states reloaded."""
    from tests.helpers import ResumableLoader

    x, y = make_data(16)
    seen = {}

    class Save(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 2:
                seen["hook"] = trainer.fit_loop.on_save_checkpoint()
                trainer.save_checkpoint(tmp_path / "mid.ckpt")

    data = ResumableLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    trainer([Save()], max_epochs=1).fit(RegressionModule(), data)
    fit_loop = torch.load(tmp_path / "mid.ckpt", weights_only=False)["loops"]["fit_loop"]
    assert fit_loop["state_dict"]["combined_loader"] == seen["hook"]["combined_loader"] == [{"consumed": 3}]
    progress = fit_loop["epoch_loop.batch_progress"]
    assert set(progress) == {"total", "current", "is_last_batch"}
    assert progress["current"] == {"ready": 3, "started": 2, "processed": 2, "completed": 2}

    # resuming from it with the loader rewound one batch: batch 2 is trained again, from the right data
    fit_loop["state_dict"]["combined_loader"] = [{"consumed": 2}]
    checkpoint = torch.load(tmp_path / "mid.ckpt", weights_only=False)
    checkpoint["loops"]["fit_loop"] = fit_loop
    torch.save(checkpoint, tmp_path / "rewound.ckpt")
    batches = []

    class Record(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            batches.append((batch_idx, batch[0][0, 0].item()))

    data = ResumableLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    trainer([Record()], max_epochs=1).fit(RegressionModule(), data, ckpt_path=tmp_path / "rewound.ckpt")
    assert batches == [(2, x[8, 0].item()), (3, x[12, 0].item())]


def test_loader_states_sized_early_are_dropped_by_lightning_and_restored_by_the_callback(tmp_path):
    """Lightning issue #20550: ``estimated_stepping_batches`` in ``configure_optimizers`` sets the train loader up
    before the checkpoint is restored, and the fit loop never loads the states it restored
    (lightning_accum/trainer/_data.py's ``restore_loader_states`` loads them, through the private names pinned here).
    Resumed at batch 2 of 4: stock Lightning trains batch 0 again, the callback batch 2."""
    from lightning.pytorch.loops.fit_loop import _FitLoop

    from lightning_accum import AccumulationScheduler
    from tests.helpers import ResumableLoader

    for name in ("_combined_loader_states_to_load", "_combined_loader", "_data_fetcher"):
        assert name in vars(_FitLoop(trainer()))
    assert callable(_FitLoop._load_combined_loader_states)
    assert isinstance(_FitLoop._should_reload_train_dl, property)
    x, y = make_data(16)

    class Sized(RegressionModule):
        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            steps = int(self.trainer.estimated_stepping_batches)
            return [optimizer], [torch.optim.lr_scheduler.LinearLR(optimizer, total_iters=steps)]

    class Save(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 2:
                trainer.save_checkpoint(tmp_path / "mid.ckpt")

    def first_batch_after_resume(callbacks: list[Callback]) -> float:
        data = ResumableLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
        trainer([*callbacks, Save()], max_epochs=1).fit(Sized(), data)
        seen = []

        class Record(Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                seen.append(batch[0][0, 0].item())

        data = ResumableLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
        trainer([*callbacks, Record()], max_epochs=1).fit(Sized(), data, ckpt_path=tmp_path / "mid.ckpt")
        return seen[0]

    assert first_batch_after_resume([]) == x[0, 0].item()  # upstream: the loader starts over
    assert first_batch_after_resume([AccumulationScheduler()]) == x[8, 0].item()  # restored


def test_the_tqdm_bar_resets_its_total_in_its_own_epoch_start_hook_which_runs_after_this_callbacks(tmp_path):
    """lightning_accum/trainer/_run.py sizes the bar through its private ``_train_progress_bar`` and re-applies the size
    after the bar's own ``on_train_epoch_start`` (wrapped on the instance), which sets Lightning's count."""
    from lightning.pytorch.callbacks import TQDMProgressBar

    seen = []

    class Before(Callback):  # a user's callback: listed before Lightning's default bar
        def on_train_epoch_start(self, trainer, pl_module):
            bar = trainer.progress_bar_callback
            seen.append(("before", bar._train_progress_bar is not None))
            bar.train_progress_bar.total = 1234

    class After(Callback):
        def on_train_epoch_start(self, trainer, pl_module):
            seen.append(("after", trainer.progress_bar_callback.train_progress_bar.total))

    x, y = make_data(16)
    # the bar listed after the user's callback, as Lightning appends its default one (RichProgressBar where rich is
    # installed, as the test extra's transformers brings it)
    fit = trainer([Before(), TQDMProgressBar()], max_epochs=1, enable_progress_bar=True, default_root_dir=tmp_path)
    assert isinstance(fit.progress_bar_callback, TQDMProgressBar)
    fit.callbacks.append(After())
    fit.fit(RegressionModule(), loader(x, y, 4))
    assert seen == [("before", True), ("after", 4)]  # the bar's reset replaced the value set before it


def test_the_deepspeed_strategy_methods_overridden_for_cpu_and_accumulation_keep_their_signatures():
    """DeepSpeedAccumulationStrategy overrides these private methods of Lightning's DeepSpeedStrategy: if their
    signatures or roles change, the overrides must be revisited (lightning_accum/strategies/deepspeed.py)."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    assert list(inspect.signature(DeepSpeedStrategy._format_batch_size_and_grad_accum_config).parameters) == ["self"]
    assert list(inspect.signature(DeepSpeedStrategy._setup_model_and_optimizer).parameters) == [
        "self",
        "model",
        "optimizer",
        "lr_scheduler",
    ]
    assert list(inspect.signature(DeepSpeedStrategy._init_deepspeed_distributed).parameters) == ["self"]
    # Lightning writes the Trainer's factor into the config there, and refuses a config that sets it
    source = inspect.getsource(DeepSpeedStrategy._format_batch_size_and_grad_accum_config)
    assert 'self.config["gradient_accumulation_steps"] = self.lightning_module.trainer.accumulate_grad_batches' in (
        source
    )
    # and passes `root_device.index` (None on CPU) to `deepspeed.initialize`, looked up on the module as it is called
    # (the strategy swaps it for one that passes the local rank, for that call only)
    for method in (DeepSpeedStrategy._setup_model_and_optimizer, DeepSpeedStrategy._initialize_deepspeed_inference):
        source = inspect.getsource(method)
        assert "deepspeed.initialize(\n" in source
        assert "args=argparse.Namespace(device_rank=self.root_device.index)" in source


def test_a_restarted_epoch_counts_its_batches_from_the_progress_the_callback_shifts_and_reads_the_batch_sampler_anew():
    """What lightning_accum/trainer/_data.py's ``reposition`` relies on (issue 47): a loader without state restarted
    in the middle of an epoch iterates from its sampler's start, and the epoch ends when the fetcher's count, started at
    ``batch_progress.current.ready``, reaches the loader's length; Lightning sets the epoch through the batch sampler's
    ``sampler`` (``_set_sampler_epoch``); the fit loop holds a ``_data_fetcher`` that ``iter`` makes anew."""
    from lightning.fabric.utilities.data import _set_sampler_epoch
    from lightning.pytorch.loops.fetchers import _DataFetcher

    source = inspect.getsource(_TrainingEpochLoop.on_run_start)
    assert "data_fetcher.fetched += self.batch_progress.current.ready" in source
    assert "self.done = self.fetched >= self.length" in inspect.getsource(_DataFetcher.__next__)
    for name in ("ready", "started", "processed", "completed"):
        assert hasattr(_TrainingEpochLoop(trainer()).batch_progress.current, name)

    class Epoch:
        epoch = -1

        def set_epoch(self, epoch: int) -> None:
            self.epoch = epoch

    data = torch.utils.data.DataLoader(range(8), batch_size=2)
    data.batch_sampler.sampler = Epoch()  # what reposition installs: a BatchSampler's sampler may be replaced
    _set_sampler_epoch(data, 3)
    assert data.batch_sampler.sampler.epoch == 3


def test_fabric_sets_the_sampler_epoch_to_its_own_count_of_iterations():
    """lightning_accum/fabric/_data.py gives Fabric's loader wrapper the run's epoch through this private count."""
    from lightning.fabric.wrappers import _FabricDataLoader

    sampler = torch.utils.data.DistributedSampler(range(8), num_replicas=2, rank=0)
    wrapped = _FabricDataLoader(torch.utils.data.DataLoader(range(8), batch_size=2, sampler=sampler))
    assert wrapped._num_iter_calls == 0
    wrapped._num_iter_calls = 5
    list(wrapped)
    assert sampler.epoch == 5
    assert wrapped._num_iter_calls == 6
