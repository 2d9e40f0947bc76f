"""A wrong value in a LightningCLI config ends the command with the key and the value in the last lines, no traceback.

Every case is a real process: ``tests/scripts/tiny_cli.py`` (a LightningCLI of a tiny model with
:class:`lightning_accum.cli.AccumulationArgumentParser`) run on a YAML config that is correct except for one value,
given in the YAML or on the command line. The parser rejects the value before anything trains; the correct config
itself trains (``test_the_correct_config_trains``), so each failure is the bad value's. The processes fork from one
interpreter that has imported torch and Lightning (tests.helpers.run_forked), one per core at a time, as a fresh
interpreter costs seconds of imports; more cases run the same script's ``main`` in this process. A few run the same
model and data through plain LightningCLI, without that parser.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import yaml

from lightning_accum.cli import focus_config_error
from tests.helpers import launched_ahead, run_forked

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "tiny_cli.py"
SCHEDULER = "lightning_accum.AccumulationScheduler"


class Case(NamedTuple):
    name: str
    callback: dict[str, Any]  # the scheduler's init_args
    key: str  # must be named in the last lines
    value: str  # must be shown in the last lines
    strategy: dict[str, Any] | None = None  # trainer.strategy
    argv: tuple[str, ...] = ()  # after --config


# each in a process of its own: the scheduler's arguments, a strategy's, and a value given on the command line
CASES = [
    Case("negative factor", {"scheduling": {0: -2}}, "scheduling", "-2"),
    Case("zero factor", {"scheduling": {0: 1, 50: 0}}, "scheduling", "50: 0"),
    Case("negative position", {"scheduling": {-1: 2}}, "scheduling", "-1"),
    Case("fractional factor", {"scheduling": {0: 2.5}}, "scheduling", "2.5"),
    Case("unit typo", {"unit": "epochs"}, "unit", "epochs"),
    Case("zero target batch", {"target_batch_size": 0}, "target_batch_size", "0"),
    Case(
        "negative ramp increment",
        {"target_batch_size": 64, "ramp_start_batch_size": 16, "ramp_increment": -1, "ramp_samples": 640},
        "ramp_increment",
        "-1",
    ),
    Case("zero micro-batch", {"micro_batch_size": 0}, "micro_batch_size", "0"),
    Case("lr rule typo", {"lr_scaling": "cubic"}, "lr_scaling", "cubic"),
    Case("negative warmup", {"lr_warmup_steps": -1}, "lr_warmup_steps", "-1"),
    Case("normalize_by typo", {"normalize_by": "tokens"}, "normalize_by", "tokens"),
    Case("decay above 1", {"noise_scale_decay": 1.5}, "noise_scale_decay", "1.5"),
    Case("zero adaptive target", {"adaptive_target": 0}, "adaptive_target", "0"),
    Case("zero adaptive max factor", {"adaptive_max_factor": 0}, "adaptive_max_factor", "0"),
    Case(
        "DDP gradient_sync typo",
        {},
        "gradient_sync",
        "lastt",
        strategy={"class_path": "lightning_accum.DDPAccumulationStrategy", "init_args": {"gradient_sync": "lastt"}},
    ),
    Case("unit on the command line", {}, "unit", "epochs", argv=("--trainer.callbacks.init_args.unit=epochs",)),
    # found in review: `{}` on the command line used to be read as a bare Callback, dropping the scheduler silently
    Case("empty schedule on the command line", {}, "scheduling", "{}", argv=("--trainer.callbacks.scheduling={}",)),
]
# the same model and data through plain LightningCLI (no parser_class): values only the constructor refuses. An empty
# schedule passes the parse, since refusing it there makes jsonargparse read `--trainer.callbacks.scheduling={}` as a
# bare Callback (it skips an unknown key whose value is an empty mapping) and train without the scheduler; `adaptive`
# without `noise_scale` is a combination no type of a single argument can refuse
PLAIN_CLI = f"""import sys
sys.path.insert(0, {str(SCRIPT.parent)!r})
from lightning.pytorch.cli import LightningCLI
from tiny_cli import TinyData, TinyModel
LightningCLI(TinyModel, TinyData, seed_everything_default=0)
"""
PLAIN_CASES = [
    Case("plain: empty schedule", {"scheduling": {}}, "scheduling", "{}"),
    Case("plain: empty schedule on the command line", {}, "scheduling", "{}", argv=CASES[-1].argv),
    Case("plain: adaptive without noise scale", {"adaptive": True}, "adaptive", "noise_scale=False"),
]
# the same checks in this test's process (a process costs seconds of imports): more strategies and command lines
MORE_CASES = [
    Case("negative adaptive target", {"adaptive_target": -1}, "adaptive_target", "-1"),
    Case("adaptive confidence of 1", {"adaptive_confidence": 1.0}, "adaptive_confidence", "1.0"),
    Case("LR scale cap below 1", {"lr_scale_max": 0.5}, "lr_scale_max", "0.5"),
    # removed in favour of the confidence bound: an old config is refused, naming the key
    Case("removed adaptive_interval", {"adaptive_interval": 50}, "adaptive_interval", "not accepted"),
    Case("grad_accum_dtype typo", {"grad_accum_dtype": "float16"}, "grad_accum_dtype", "float16"),
    # a combination no single type rejects: the constructor's message, without a traceback
    Case("adaptive without noise scale", {"adaptive": True}, "adaptive", "noise_scale=False"),
    Case(
        "FSDP gradient_sync typo",
        {},
        "gradient_sync",
        "each",
        strategy={"class_path": "lightning_accum.FSDPAccumulationStrategy", "init_args": {"gradient_sync": "each"}},
    ),
    Case(
        "FSDP2 gradient_sync typo",
        {},
        "gradient_sync",
        "reduce-scatter",
        strategy={
            "class_path": "lightning_accum.ModelParallelAccumulationStrategy",
            "init_args": {"gradient_sync": "reduce-scatter"},
        },
    ),
    Case(
        "DDP argument passed through",
        {},
        "start_method",
        "fork2",
        strategy={"class_path": "lightning_accum.DDPAccumulationStrategy", "init_args": {"start_method": "fork2"}},
    ),
    Case(
        "decay on the command line",
        {},
        "noise_scale_decay",
        "-0.5",
        argv=("--trainer.callbacks.init_args.noise_scale_decay=-0.5",),
    ),
    Case(
        "gradient_sync on the command line",
        {},
        "gradient_sync",
        "evry",
        argv=("--trainer.strategy=lightning_accum.DDPAccumulationStrategy", "--trainer.strategy.gradient_sync=evry"),
    ),
]


def _config(case: Case | None) -> dict[str, Any]:
    trainer: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "fast_dev_run": 4,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "logger": False,
    }
    init_args: dict[str, Any] = {"scheduling": {0: 2}, "unit": "step"}
    if case is not None:
        if "target_batch_size" in case.callback:  # a target batch replaces the factors
            init_args = {}
        init_args.update(case.callback)
        if case.strategy is not None:
            trainer["strategy"] = case.strategy
    trainer["callbacks"] = [{"class_path": SCHEDULER, "init_args": init_args}]
    return {"trainer": trainer, "data": {"batch_size": 4}}


def _runs(folder: Path) -> dict[str, tuple[int, str]]:
    """Every case and the correct config, each a process of its own: name -> (exit status, stdout and stderr
    combined in the order written)."""
    plain_cli = folder / "plain_cli.py"
    plain_cli.write_text(PLAIN_CLI)
    configs = {case.name: (case, f"case{index}", SCRIPT) for index, case in enumerate(CASES)}
    configs.update({case.name: (case, f"plain{index}", plain_cli) for index, case in enumerate(PLAIN_CASES)})
    jobs = {"correct": [str(SCRIPT), "fit", "--config", _write(_config(None), folder / "correct.yaml")]}
    for name, (case, stem, script) in configs.items():
        jobs[name] = [str(script), "fit", "--config", _write(_config(case), folder / f"{stem}.yaml"), *case.argv]
    return run_forked(jobs, preload=["lightning.pytorch", "lightning.pytorch.cli"], folder=folder)


runs = launched_ahead("runs", _runs)


def _write(config: dict[str, Any], path: Path) -> str:
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_the_correct_config_trains(runs):
    returncode, output = runs["correct"]
    assert returncode == 0, output[-3000:]
    assert "Traceback" not in output


def _check_named(case: Case, output: str) -> str:
    """The last lines of ``output``, checked to name the case's key and value, with no traceback before them."""
    last = "\n".join([line for line in output.splitlines() if line.strip()][-5:])
    assert "Traceback" not in output, output[-3000:]
    assert case.key in last, last
    assert re.search(rf"(?<![\w.]){re.escape(case.value)}(?![\w.])", last), last
    return last


def _check(case: Case, output: str) -> None:
    last = _check_named(case, output)
    # none of the alternatives that were not meant: the union's NoneType and Callback-subclass explanations
    assert "NoneType" not in last
    assert "Not a valid subclass" not in last


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_a_wrong_value_ends_the_process_naming_its_key_and_value_in_the_last_lines(runs, case):
    returncode, output = runs[case.name]
    assert returncode != 0, output[-3000:]
    _check(case, output)


@pytest.mark.parametrize("case", PLAIN_CASES, ids=[case.name for case in PLAIN_CASES])
def test_plain_lightning_cli_never_trains_on_a_value_the_constructor_refuses(runs, case):
    returncode, output = runs[case.name]
    assert returncode != 0, output[-3000:]
    assert case.key in output, output[-3000:]


# Plain LightningCLI calls the constructors itself and catches nothing they raise: jsonargparse would wrap the
# ValueError in a union error and Python print it with its traceback. lightning_accum registers a jsonargparse
# instantiator for AccumulationScheduler when it is imported (lightning_accum/trainer/_instantiate.py): one line, exit
# 2.
@pytest.mark.parametrize("case", PLAIN_CASES, ids=[case.name for case in PLAIN_CASES])
def test_plain_lightning_cli_names_a_value_the_constructor_refuses_in_the_last_lines(runs, case):
    _check_named(case, runs[case.name][1])


@pytest.fixture(scope="module")
def tiny_cli():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import tiny_cli

        yield tiny_cli
    finally:
        sys.path.remove(str(SCRIPT.parent))


@pytest.mark.parametrize("case", MORE_CASES, ids=[case.name for case in MORE_CASES])
@pytest.mark.filterwarnings("ignore:(?s).*only one JsonargparseDeprecationWarning per type")  # from Lightning's calls
def test_a_wrong_value_exits_naming_its_key_and_value_in_the_last_lines(tiny_cli, case, tmp_path, capsys):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(_config(case)))
    with pytest.raises(SystemExit) as exited:
        tiny_cli.main(["fit", "--config", str(path), *case.argv])
    assert exited.value.code == 2
    captured = capsys.readouterr()
    _check(case, captured.out + captured.err)


@pytest.mark.filterwarnings("ignore:(?s).*only one JsonargparseDeprecationWarning per type")
def test_token_schedules_and_the_accumulation_dtype_come_from_yaml(tiny_cli, tmp_path):
    config = _config(None)
    config["trainer"]["callbacks"][0]["init_args"] = {
        "scheduling": {0: 1, 8: 2},
        "unit": "token",
        "token_key": 1,  # the tiny model's (inputs, targets): every target counts
        "grad_accum_dtype": "float32",
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = tiny_cli.main(["fit", "--config", str(path)])
    callback = cli.trainer.callbacks[0]
    assert callback.features["token_count"].tokens_seen == 4 * 4  # fast_dev_run: 4 micro-batches of 4 targets
    assert callback.features["wide_accumulation"].dtype is torch.float32


def test_a_message_it_does_not_recognize_is_kept_as_it_is():
    message = "Parser key \"trainer.max_steps\":\n  Expected a <class 'int'>. Got value: many"
    assert focus_config_error(message) == message
    # a union with several alternatives and no class named keeps every alternative
    union = (
        'Parser key "x":\n  Does not validate against any of the Union subtypes\n  Subtypes: [int, str]\n'
        "  Errors:\n    - Expected a <class 'int'>\n    - Expected a <class 'str'>\n"
        "  Given value type: <class 'list'>\n  Given value: []"
    )
    assert focus_config_error(union) == union
