"""The standalone packages: code that says ``import pytorch_lightning as pl`` or ``from lightning_fabric import ...``.

``pip install lightning`` puts ``pytorch_lightning`` and ``lightning_fabric`` beside ``lightning.pytorch`` and
``lightning.fabric``, with class hierarchies of their own. The callback, ``ManualAccumulation`` and the Fabric
``Accumulator`` are imported as always and take Lightning's names from the Trainer or Fabric in hand; the classes that
subclass a Trainer class come from ``lightning_accum.pytorch_lightning`` (and ``lightning_accum.lightning_fabric``).
Each is compared with plain PyTorch, as tests/test_exactness.py, tests/test_distributed.py and tests/test_fabric.py
compare the ``lightning`` namespace; two ranks run tests/scripts/two_ranks.py written against ``pytorch_lightning``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import lightning.fabric
import lightning.pytorch
import lightning_fabric
import pytest
import pytorch_lightning as pl
import torch
import yaml
from torch import nn

import lightning_accum
import lightning_accum.lightning_fabric
import lightning_accum.pytorch_lightning
from lightning_accum import ManualAccumulation
from lightning_accum.compat.lightning import (
    _FABRIC_NAMES,
    _TRAINER_NAMES,
    FabricNames,
    TrainerNames,
    fabric_names,
    trainer_names,
)
from lightning_accum.compat.versions import release
from lightning_accum.fabric import Accumulator
from tests.helpers import (
    BACKENDS,
    FSDP2,
    LR,
    NO_FSDP2,
    RegressionModule,
    launch_environment,
    launched_ahead,
    loader,
    make_data,
    make_net,
    reference_weights,
)
from tests.helpers import trainer as lightning_trainer

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from fabric_common import (  # noqa: E402
    TinyLM,
    make_pairs,
    mean_loss,
    micro_batches,
    reference_snapshots,
    relative_distance,  # noqa: E402
)

from tests.test_distributed import WINDOWS, _launch, _records, max_deviation  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HOME = "lightning_accum.pytorch_lightning"  # what a pytorch_lightning user imports
# pytorch_lightning before 2.6 checks its callbacks against its own Callback class (`is_overridden("state_dict")` in
# _validate_callbacks_list), so its users take the callback from HOME too; from 2.6 the one imported as today works
PLAIN_CALLBACK_WORKS = release(pl.__version__) >= (2, 6, 0)
BEFORE_2_6 = "pytorch_lightning before 2.6 refuses a callback that is not its own Callback"
CALLBACK_HOME = "lightning_accum" if PLAIN_CALLBACK_WORKS else HOME
Scheduler = sys.modules[CALLBACK_HOME].AccumulationScheduler  # the callback the tests attach to a standalone Trainer


class Regression(pl.LightningModule):
    """tests/helpers.py's RegressionModule, written against ``pytorch_lightning``."""

    def __init__(self, manual: ManualAccumulation | None = None) -> None:
        super().__init__()
        self.net = make_net()
        self.manual = manual
        self.automatic_optimization = manual is None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        x, y = batch
        if self.manual is None:
            return nn.functional.mse_loss(self.net(x), y)
        optimizer = self.optimizers()
        with self.manual.micro_step(self) as micro:
            self.manual_backward(micro.scale(nn.functional.mse_loss(self.net(x), y)))
        if micro.should_step:
            optimizer.step()
            optimizer.zero_grad()
        return None

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


class StepsInItsOwnHook(Regression):
    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)


def standalone_trainer(callbacks: list[Any], **kwargs: Any) -> pl.Trainer:
    return lightning_trainer(callbacks, trainer_class=pl.Trainer, **kwargs)  # tests/helpers.py's, standalone


def deviation(module: nn.Module, reference: list[torch.Tensor]) -> float:
    return max((p.detach() - q).abs().max().item() for p, q in zip(module.parameters(), reference, strict=True))


# ----------------------------------------------------------------------------------------------- the Trainer


@pytest.mark.parametrize(
    "home",
    [pytest.param("lightning_accum", marks=pytest.mark.skipif(not PLAIN_CALLBACK_WORKS, reason=BEFORE_2_6)), HOME],
)
def test_a_pytorch_lightning_trainer_takes_the_big_batchs_steps(home):
    """Factor 2 for 3 optimizer steps, then 4 (by step): 10 micro-batches an epoch, windows cut at the epoch's end."""
    scheduler = sys.modules[home].AccumulationScheduler(scheduling={0: 2, 3: 4}, unit="step")
    x, y = make_data(40)
    model = Regression()
    trainer = standalone_trainer([scheduler], max_epochs=2)
    trainer.fit(model, loader(x, y, 4))
    windows = [[2, 2, 2, 4], [4, 4, 2]]
    assert trainer.global_step == 7
    assert deviation(model, reference_weights(x, y, 4, windows)) <= 1e-6
    assert lightning_accum.estimated_stepping_batches(trainer) == 7


def test_manual_accumulation_under_a_pytorch_lightning_trainer():
    x, y = make_data(28)
    model = Regression(manual=ManualAccumulation(3))
    standalone_trainer([], max_epochs=2).fit(model, loader(x, y, 4))
    assert deviation(model, reference_weights(x, y, 4, [[3, 3, 1], [3, 3, 1]])) <= 1e-6


def test_lightnings_own_checks_read_the_standalone_module():
    """The fit-start checks call `is_overridden` on the module: ``lightning.pytorch``'s refuses a standalone one."""
    x, y = make_data(16)
    with pytest.warns(UserWarning, match=r"`LightningModule.optimizer_step` is overridden"):
        standalone_trainer([Scheduler({0: 2})], max_epochs=1).fit(StepsInItsOwnHook(), loader(x, y, 4))


def test_messages_go_through_the_rank_zero_logger_of_the_trainers_own_namespace(caplog):
    """Lightning's `rank_zero_info` logs through the logger of the namespace imported last (here pytorch_lightning's,
    imported after lightning.pytorch): the callback's lines follow the Trainer they are about instead."""
    x, y = make_data(16)
    for trainer_class, logger in ((pl.Trainer, "pytorch_lightning"), (lightning.pytorch.Trainer, "lightning.pytorch")):
        caplog.clear()
        with caplog.at_level("INFO"):
            lightning_trainer([Scheduler({0: 2})], trainer_class=trainer_class, max_epochs=1).fit(
                Regression() if trainer_class is pl.Trainer else RegressionModule(), loader(x, y, 4)
            )
        summary = "AccumulationScheduler: micro 4 x factor 2 x world 1 = 8 samples; lr 0.1 (not scaled)"
        assert [r.name for r in caplog.records if r.message == summary] == [f"{logger}.utilities.rank_zero"]


@pytest.mark.parametrize("namespace", [pl, lightning.pytorch])
def test_lightnings_accumulation_callback_of_either_namespace_is_refused_beside_ours(namespace):
    x, y = make_data(16)
    if namespace is not pl and not PLAIN_CALLBACK_WORKS:
        pytest.skip(BEFORE_2_6)  # the Trainer itself refuses lightning.pytorch's callback
    callbacks = [Scheduler({0: 2}), namespace.callbacks.GradientAccumulationScheduler({0: 2})]
    with pytest.raises(ValueError, match="Only one accumulation callback may be attached: found GradientAccumulation"):
        standalone_trainer(callbacks, max_epochs=1).fit(Regression(), loader(x, y, 4))


def test_errors_name_the_class_a_pytorch_lightning_user_imports():
    pytest.importorskip("deepspeed")
    from lightning_accum.trainer._checks import check_trainer

    stock = pl.strategies.DeepSpeedStrategy(stage=2)  # accumulates by itself, with one fixed factor
    trainer = standalone_trainer([scheduler := Scheduler({0: 2})], strategy=stock)
    with pytest.raises(ValueError, match=r"use lightning_accum\.pytorch_lightning\.DeepSpeedAccumulationStrategy"):
        check_trainer(trainer, Regression(), scheduler)


def test_the_trainers_deepspeed_twin_names_itself_when_it_refuses_a_config():
    pytest.importorskip("deepspeed")
    with pytest.raises(ValueError, match=rf"but with {HOME}\.DeepSpeedAccumulationStrategy the AccumulationScheduler"):
        lightning_accum.pytorch_lightning.DeepSpeedAccumulationStrategy(config={"train_batch_size": 64})


def test_every_public_name_is_importable_from_the_standalone_module():
    import pytorch_lightning.cli

    twins = {  # lightning_accum.pytorch_lightning's classes over pytorch_lightning's, and lightning_accum's
        "AccumulationScheduler": (pl.Callback, lightning_accum.AccumulationScheduler),
        "DDPAccumulationStrategy": (pl.strategies.DDPStrategy, None),
        "FSDPAccumulationStrategy": (pl.strategies.FSDPStrategy, None),
        "ModelParallelAccumulationStrategy": (pl.strategies.ModelParallelStrategy, None),
        "DeepSpeedAccumulationStrategy": (pl.strategies.DeepSpeedStrategy, None),
    }
    standalone = lightning_accum.pytorch_lightning
    assert set(lightning_accum.__all__) | {"AccumulationArgumentParser"} == set(standalone.__all__)
    for name in lightning_accum.__all__:
        ours, theirs = getattr(lightning_accum, name), getattr(standalone, name)
        if name not in twins:
            assert theirs is ours, name
            continue
        base, also = twins[name]
        assert issubclass(theirs, base), name
        assert issubclass(theirs, also) if also else not issubclass(theirs, lightning.pytorch.strategies.Strategy)
        assert theirs.__init__ is ours.__init__ or name != "AccumulationScheduler"  # the same arguments
    parser = standalone.AccumulationArgumentParser
    assert issubclass(parser, pytorch_lightning.cli.LightningArgumentParser)
    assert not issubclass(parser, lightning.pytorch.cli.LightningArgumentParser)


def test_the_twin_strategies_are_what_a_pytorch_lightning_trainer_accepts():
    from lightning_accum.pytorch_lightning import DDPAccumulationStrategy

    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=DDPAccumulationStrategy(gradient_sync="every"))
    assert trainer.strategy.gradient_sync == "every"
    with pytest.raises(Exception, match="pytorch_lightning.strategies.Strategy"):
        pl.Trainer(accelerator="cpu", devices=1, strategy=lightning_accum.DDPAccumulationStrategy())


# ------------------------------------------------------------------------------------------------ two ranks


STANDALONE = {"LIGHTNING_NAMESPACE": "pytorch_lightning", "LIGHTNING_ACCUM_CALLBACK": CALLBACK_HOME}


def _two_ranks(out: Path) -> Path:
    env = STANDALONE
    _launch("two_ranks.py", ",".join(BACKENDS), "stock_k4", "last_k3", "manual_k3", out=out, env=env)
    return out


standalone_ranks = launched_ahead("standalone_ranks", _two_ranks)


@pytest.mark.parametrize("name", ["last_k3", "manual_k3"])
def test_two_ranks_under_pytorch_lightnings_ddp_reduce_once_per_step_and_equal_the_big_batch(standalone_ranks, name):
    rank0, rank1 = _records(standalone_ranks / "ddp", name)
    assert rank0["trainer_class"] == "pytorch_lightning.trainer.trainer.Trainer"
    assert rank0["strategy_class"] == "lightning_accum.pytorch_lightning.DDPAccumulationStrategy"
    if name == "last_k3":  # the callback as imported today, where this release takes it
        assert f"{Scheduler.__module__}.AccumulationScheduler" in rank0["callback_classes"]
    assert rank0["world_size"] == 2
    assert rank0["optimizer_steps"] == len(WINDOWS[name])
    for record in (rank0, rank1):
        buckets = len(set(record["allreduce_buckets"]))
        assert buckets >= 1
        assert len(record["allreduce_buckets"]) == record["optimizer_steps"] * buckets
    assert max_deviation(rank0, WINDOWS[name], name) <= 1e-6


@pytest.mark.skipif(not FSDP2, reason=NO_FSDP2)
def test_two_ranks_under_pytorch_lightnings_model_parallel_reduce_scatter_once_per_step(standalone_ranks):
    out = standalone_ranks / "fsdp2"
    stock = _records(out, "stock_k4")[0]
    assert stock["reduce_scatters"] == 2 * stock["micro_steps"]  # two units, every micro-step
    for name in ("last_k3", "manual_k3"):
        rank0, rank1 = _records(out, name)
        assert rank0["strategy_class"] == "lightning_accum.pytorch_lightning.ModelParallelAccumulationStrategy"
        assert rank0["reduce_scatters"] == rank1["reduce_scatters"] == 2 * rank0["optimizer_steps"]
        assert max_deviation(rank0, WINDOWS[name], name) <= 1e-5


def _deepspeed(out: Path) -> Path:
    from tests.test_deepspeed import _check, _start

    _check(_start(["runs:2:ramp", "runs:3:k3"], out, 400, env=STANDALONE), killed=False)
    env = {"LIGHTNING_NAMESPACE": "lightning_fabric"}
    _launch("fabric_deepspeed.py", out=out / "fabric", limit=300, env=env)
    return out


standalone_deepspeed = launched_ahead("standalone_deepspeed", _deepspeed)


@pytest.mark.parametrize(("stage", "name"), [(2, "ramp"), (3, "k3")])
def test_pytorch_lightnings_deepspeed_steps_where_the_windows_end(standalone_deepspeed, stage, name):
    from tests.test_deepspeed import WINDOWS as DEEPSPEED_WINDOWS
    from tests.test_deepspeed import _deviation, big_batch_weights

    first, second = (
        json.loads((standalone_deepspeed / f"zero{stage}" / f"{name}.rank{rank}.json").read_text()) for rank in (0, 1)
    )
    windows = DEEPSPEED_WINDOWS[name]
    assert first["strategy_class"] == f"{HOME}.DeepSpeedAccumulationStrategy"
    assert f"{Scheduler.__module__}.AccumulationScheduler" in first["callback_classes"]
    for record in (first, second):
        assert "raised" not in record, record.get("raised")
        assert record["optimizer_steps"] == record["ds_global_steps"] == len(windows)
    assert _deviation(first["weights"], big_batch_weights(windows, name)) <= 1e-5


def test_lightning_fabrics_deepspeed_twin_steps_once_per_window_and_equals_the_big_batch(standalone_deepspeed):
    from tests.test_fabric_distributed import WINDOWS as FABRIC_WINDOWS
    from tests.test_fabric_distributed import distance

    out = standalone_deepspeed / "fabric"
    rank0, rank1 = (json.loads((out / f"zero2_token_k3.rank{rank}.json").read_text()) for rank in (0, 1))
    assert rank0["classes"] == [
        "lightning_fabric.fabric.Fabric",
        "lightning_accum.lightning_fabric.DeepSpeedAccumulationStrategy",
    ]
    for record in (rank0, rank1):
        assert record["optimizer_steps"] == record["global_steps"] == len(FABRIC_WINDOWS)
    assert rank0["weights"] == rank1["weights"]
    assert distance(rank0["weights"]) <= 1e-5
    for record in (json.loads((out / f"stock_refused.rank{rank}.json").read_text()) for rank in (0, 1)):
        assert "strategy=lightning_accum.lightning_fabric.DeepSpeedAccumulationStrategy(...)" in record["raised"]
        assert record["global_steps"] == 0


# ------------------------------------------------------------------------------------------------ LightningCLI


def _cli(tmp_path: Path, callback: dict[str, Any], strategy: Any = "auto") -> subprocess.CompletedProcess:
    config = {
        "trainer": {
            "max_epochs": 1,
            "accelerator": "cpu",
            "devices": 1,
            "strategy": strategy,
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "callbacks": [
                {"class_path": "lightning_accum.pytorch_lightning.AccumulationScheduler", "init_args": callback}
            ],
        }
    }
    path = tmp_path / "run.yaml"  # not config.yaml: LightningCLI saves the configuration it ran there
    path.write_text(yaml.safe_dump(config))
    return subprocess.run(
        [
            "timeout",
            "-s",
            "KILL",
            "300",
            sys.executable,
            str(ROOT / "tests/scripts/tiny_cli.py"),
            "fit",
            "--config",
            str(path),
        ],
        capture_output=True,
        text=True,
        check=False,
        env=launch_environment() | {"LIGHTNING_NAMESPACE": "pytorch_lightning"},
        cwd=tmp_path,  # where LightningCLI saves the configuration it ran
    )


def test_pytorch_lightnings_cli_trains_from_yaml_with_the_twins(tmp_path):
    strategy = {"class_path": "lightning_accum.pytorch_lightning.DDPAccumulationStrategy"}
    done = _cli(tmp_path, {"scheduling": {0: 4}}, strategy)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "micro 4 x factor 4 x world 1 = 16 samples" in done.stdout + done.stderr


def test_pytorch_lightnings_cli_names_the_class_it_takes_for_one_of_the_lightning_namespace(tmp_path):
    done = _cli(tmp_path, {"scheduling": {0: 2}}, {"class_path": "lightning_accum.DDPAccumulationStrategy"})
    assert done.returncode == 2
    hint = "pytorch_lightning's LightningCLI takes lightning_accum.pytorch_lightning.DDPAccumulationStrategy"
    assert done.stderr.strip().splitlines()[-1].strip() == hint, done.stderr[-3000:]


def test_pytorch_lightnings_cli_names_a_bad_value_by_its_key(tmp_path):
    done = _cli(tmp_path, {"unit": "epochs"})
    assert done.returncode == 2
    tail = "\n".join(done.stderr.strip().splitlines()[-6:])
    assert "unit" in tail, done.stderr[-3000:]
    assert "epochs" in tail
    assert "Traceback" not in done.stderr


# --------------------------------------------------------------------------------------------------- Fabric


def test_the_accumulator_on_a_lightning_fabric_fabric_equals_the_big_batch():
    data = micro_batches(make_pairs(30, empty=range(6, 9)), 3)
    windows = [data[0:4], data[4:8], data[8:10]]
    reference = reference_snapshots(windows * 2)
    fabric = lightning_fabric.Fabric(accelerator="cpu", devices=1)
    model = TinyLM()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.5))
    accumulator = lightning_accum.lightning_fabric.Accumulator(
        fabric, model, optimizer, scheduling={0: 4}, normalize_by="token", shift_labels=True
    )
    for _ in range(2):
        for batch in accumulator.batches(data):
            with accumulator.micro_step(batch) as micro:
                micro.backward(mean_loss(model, batch))
            if micro.should_step:
                optimizer.step()
                optimizer.zero_grad()
    assert accumulator.optimizer_steps == 6
    assert relative_distance(list(model.parameters()), reference[-1], reference[0]) <= 1e-6
    assert (
        max((p.detach() - q).abs().max().item() for p, q in zip(model.parameters(), reference[-1], strict=True)) <= 1e-6
    )


def test_the_accumulator_refuses_what_is_no_fabric_naming_both_namespaces():
    with pytest.raises(TypeError, match=r"lightning\.fabric\.Fabric or a lightning_fabric\.Fabric, got Trainer"):
        Accumulator(pl.Trainer(), nn.Linear(2, 1), None, scheduling={0: 2})  # type: ignore[arg-type]


def test_the_fabric_deepspeed_twin_is_a_lightning_fabric_strategy_with_unmanaged_accumulation():
    pytest.importorskip("deepspeed")
    strategy = lightning_accum.lightning_fabric.DeepSpeedAccumulationStrategy(stage=2)
    assert isinstance(strategy, lightning_fabric.strategies.DeepSpeedStrategy)
    assert not isinstance(strategy, lightning.fabric.strategies.DeepSpeedStrategy)
    assert strategy.config["zero_optimization"]["stage"] == 2
    assert strategy.config.get("managed_gradient_accumulation") is False
    with pytest.raises(ValueError, match=r"lightning_accum\.lightning_fabric\.DeepSpeedAccumulationStrategy"):
        lightning_accum.lightning_fabric.DeepSpeedAccumulationStrategy(config={"gradient_accumulation_steps": 4})
    fabric = lightning_fabric.Fabric(accelerator="cpu", devices=1, strategy=strategy)  # accepted as its own
    assert fabric.strategy is strategy


# ------------------------------------------------------------------------------------- names and their contract


@pytest.mark.parametrize(
    ("obj", "package"),
    [
        (pl.Trainer(), "pytorch_lightning"),
        (lightning.pytorch.Trainer(), "lightning.pytorch"),
        (Regression(), "pytorch_lightning"),
        (lightning_accum.pytorch_lightning.DDPAccumulationStrategy(), "pytorch_lightning"),
        (lightning_accum.DDPAccumulationStrategy(), "lightning.pytorch"),
        (object(), "lightning.pytorch"),  # anything else: the lightning namespace
    ],
)
def test_the_names_come_from_the_namespace_of_the_object_in_hand(obj, package):
    assert trainer_names(obj).package == package


def test_the_fabric_names_come_from_the_fabrics_namespace():
    assert fabric_names(lightning_fabric.Fabric(accelerator="cpu", devices=1)).package == "lightning_fabric"
    assert fabric_names(lightning.fabric.Fabric(accelerator="cpu", devices=1)).package == "lightning.fabric"


@pytest.mark.parametrize(("names", "table"), [(TrainerNames, _TRAINER_NAMES), (FabricNames, _FABRIC_NAMES)])
def test_every_name_lightning_accum_uses_exists_in_both_namespaces_as_classes_of_their_own(names, table):
    """Contract: a Lightning release that moves one of these names fails here, not inside a user's fit."""
    first, second = (
        names(package)
        for package in (
            ("lightning.pytorch", "pytorch_lightning")
            if names is TrainerNames
            else ("lightning.fabric", "lightning_fabric")
        )
    )
    for name in table:
        ours, theirs = getattr(first, name), getattr(second, name)
        if isinstance(ours, type):
            assert ours is not theirs, name
            assert ours.__name__ == theirs.__name__, name
            assert theirs.__module__.startswith(second.package), name


def test_rank_zero_warnings_and_the_rank_are_one_in_every_namespace():
    """Contract: rank_zero_warn is imported once (each namespace re-exports lightning_utilities'), and
    TrainerNames.rank_zero_info reads the rank Lightning sets, on lightning_utilities' rank_zero_only."""
    import lightning.pytorch.utilities.rank_zero as ours
    import lightning_utilities.core.rank_zero as utilities
    import pytorch_lightning.utilities.rank_zero as theirs

    assert ours.rank_zero_warn is theirs.rank_zero_warn is utilities.rank_zero_warn
    assert ours.rank_zero_only is theirs.rank_zero_only is utilities.rank_zero_only


# ---------------------------------------------------------------------------------------------- the versions


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["timeout", "-s", "KILL", "120", sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
        env=launch_environment(),
    )


RANGE = ">=2.5.1,<2.7.0"  # pyproject.toml's, as the messages write it


@pytest.mark.parametrize(
    ("distribution", "version", "message"),
    [
        ("lightning", "2.5.0", f"supports lightning {RANGE}, but lightning 2.5.0 is installed"),
        ("lightning", "2.7.0", f"supports lightning {RANGE}, but lightning 2.7.0 is installed"),
        ("torch", "2.3.1+cu121", "supports torch>=2.4.0, but torch 2.3.1+cu121 is installed"),
    ],
)
def test_import_refuses_an_unsupported_lightning_or_torch_naming_both_versions(distribution, version, message):
    done = _python(
        f"""
        from importlib import metadata
        real = metadata.version
        metadata.version = lambda name: {version!r} if name == {distribution!r} else real(name)
        import lightning_accum
        """
    )
    assert done.returncode == 1
    assert f"ImportError: lightning_accum {message}" in done.stderr, done.stderr[-2000:]


def test_the_standalone_module_refuses_an_unsupported_pytorch_lightning():
    done = _python(
        """
        import pytorch_lightning
        pytorch_lightning.__version__ = "2.4.0"
        import lightning_accum  # lightning itself is supported
        import lightning_accum.pytorch_lightning
        """
    )
    assert done.returncode == 1
    assert f"supports pytorch_lightning {RANGE}, but pytorch_lightning 2.4.0 is installed" in done.stderr


@pytest.mark.skipif(not PLAIN_CALLBACK_WORKS, reason=BEFORE_2_6)
def test_a_standalone_trainer_of_an_unsupported_release_is_refused_before_the_first_step():
    done = _python(
        """
        import pytorch_lightning as pl
        pl.__version__ = "2.4.0"
        import torch
        from lightning_accum import AccumulationScheduler
        from tests.helpers import loader, make_data, make_net

        class Regression(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = make_net()

            def training_step(self, batch, batch_idx):
                return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

        x, y = make_data(8)
        model = Regression()
        before = [p.detach().clone() for p in model.parameters()]
        trainer = pl.Trainer(callbacks=[AccumulationScheduler({0: 2})], max_epochs=1, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False)
        try:
            trainer.fit(model, loader(x, y, 4))
        except ImportError as error:
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
            print("refused:", error)
        """
    )
    refusal = f"refused: lightning_accum supports pytorch_lightning {RANGE}, but pytorch_lightning 2.4.0 is installed"
    assert refusal in done.stdout, done.stderr[-2000:]


def test_pyproject_declares_the_range_the_import_checks():
    from lightning_accum.compat.versions import LIGHTNING_CEILING, LIGHTNING_FLOOR, TORCH_FLOOR

    text = (ROOT / "pyproject.toml").read_text()

    def release(numbers: tuple[int, ...]) -> str:
        return ".".join(map(str, numbers)).removesuffix(".0")

    assert f'"lightning>={release(LIGHTNING_FLOOR)},<{release(LIGHTNING_CEILING)}"' in text
    assert f'"torch>={release(TORCH_FLOOR)}"' in text


def test_the_supported_range_holds_the_installed_releases():
    from lightning_accum.compat.versions import check_lightning, check_torch

    for package in (lightning, pl, lightning_fabric):
        check_lightning(package.__name__, package.__version__)
    check_torch(torch.__version__)
    assert json.loads(json.dumps(lightning_accum.__all__))  # the package imported: nothing was refused
