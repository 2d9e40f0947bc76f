"""The examples as a user runs them: the LightningCLI configs (parsed, run, round-tripped) and the experiment."""

from __future__ import annotations

import json
import math
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_accum import AccumulationScheduler, DDPAccumulationStrategy, SampleDrivenLR
from tests.helpers import launch_environment, launched_ahead

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
CONFIGS = sorted((EXAMPLES / "configs").glob("lm_*.yaml"))  # examples/train_lm.py's
HF_CONFIG = EXAMPLES / "configs" / "hf_causal_lm.yaml"  # examples/hf_causal_lm.py's
# a model and corpus small enough for a test; everything else comes from the config
SMALL = [
    "--model.width=16",
    "--model.layers=1",
    "--data.context=16",
    "--data.corpus_bytes=60000",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--trainer.limit_val_batches=1",
]


@pytest.fixture(scope="module")
def train_lm():
    sys.path.insert(0, str(EXAMPLES))
    try:
        import train_lm

        yield train_lm
    finally:
        sys.path.remove(str(EXAMPLES))


def _scalars(log_dir, tag):
    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    return [event.value for event in events.Scalars(tag)]


def _callback(cli) -> AccumulationScheduler:
    (callback,) = [c for c in cli.trainer.callbacks if isinstance(c, AccumulationScheduler)]
    return callback


def _init_args(config: dict) -> dict:
    (entry,) = [c for c in config["trainer"]["callbacks"] if c["class_path"].endswith("AccumulationScheduler")]
    args = dict(entry["init_args"])
    if args.get("scheduling"):
        args["scheduling"] = {int(key): value for key, value in args["scheduling"].items()}  # YAML may quote keys
    return args


def test_every_example_config_sets_the_callback_by_class_path():
    assert {path.name for path in CONFIGS} >= {
        "lm_ramp.yaml",
        "lm_step_schedule.yaml",
        "lm_ddp.yaml",
        "lm_adaptive.yaml",
        "lm_seesaw.yaml",
    }
    for path in [*CONFIGS, HF_CONFIG]:
        assert _init_args(yaml.safe_load(path.read_text())), path


def test_the_ramp_config_trains_with_the_ramp_and_sqrt_scaling(train_lm, tmp_path):
    args = ["fit", f"--config={CONFIGS[0].parent / 'lm_ramp.yaml'}", f"--trainer.default_root_dir={tmp_path}"]
    cli = train_lm.main(
        [*args, *SMALL, "--trainer.max_steps=3", "--trainer.val_check_interval=4", "--trainer.log_every_n_steps=1"]
    )
    callback = _callback(cli)
    assert cli.trainer.global_step == 3
    assert callback.factor == 2  # the ramp starts at 16 samples = micro-batch 8 x 2
    assert callback.samples_seen == 3 * 16
    assert callback.features["lr_scaling"].rule == "sqrt"
    assert callback.features["lr_scaling"].base_batch_size == 16.0
    log_dir = Path(cli.trainer.logger.log_dir)
    assert (log_dir / "config.yaml").exists()  # LightningCLI saved the resolved config beside the events
    assert _scalars(log_dir, "accum/factor") == [2.0, 2.0, 2.0]
    assert _scalars(log_dir, "accum/effective_batch_size") == [16.0, 16.0, 16.0]


def test_the_step_schedule_config_changes_the_factor_at_step_50(train_lm, tmp_path):
    args = ["fit", f"--config={CONFIGS[0].parent / 'lm_step_schedule.yaml'}", f"--trainer.default_root_dir={tmp_path}"]
    cli = train_lm.main([*args, *SMALL, "--trainer.max_steps=53", "--trainer.log_every_n_steps=1"])
    callback = _callback(cli)
    assert cli.trainer.global_step == 53
    assert callback.factor == 4
    assert callback._spec.scheduling == {0: 1, 50: 4, 120: 8}
    factors = _scalars(Path(cli.trainer.logger.log_dir), "accum/factor")
    assert factors == [1.0] * 50 + [4.0] * 3
    scales = _scalars(Path(cli.trainer.logger.log_dir), "accum/lr_scale")
    assert scales[49] == pytest.approx(1.0)
    # linear rule, warming up from 1 towards 4 over 20 steps from step 50
    assert scales[50] == pytest.approx(1.0)
    assert scales[51] == pytest.approx(1 + 3 / 20)
    assert scales[52] == pytest.approx(1 + 2 * 3 / 20)


def test_the_adaptive_config_anneals_its_schedule_where_the_epoch_ends(train_lm, tmp_path):
    args = ["fit", f"--config={CONFIGS[0].parent / 'lm_adaptive.yaml'}", f"--trainer.default_root_dir={tmp_path}"]
    cli = train_lm.main([*args, *SMALL, "--data.corpus_bytes=8000", "--trainer.val_check_interval=1.0"])
    callback = _callback(cli)
    assert callback.features["adaptive"].policy.target == 1.0  # type: ignore[attr-defined]
    (config,) = cli.trainer.lr_scheduler_configs
    assert isinstance(config.scheduler, SampleDrivenLR)
    epoch_steps = math.ceil(cli.trainer.num_training_batches / 2)  # factor 2 throughout: what it was sized for
    assert config.scheduler.steps == epoch_steps
    assert config.scheduler.taken == epoch_steps  # the one-cycle schedule ran to its end with the epoch
    assert cli.trainer.global_step <= epoch_steps


def test_the_seesaw_config_doubles_the_factor_where_the_one_cycle_halves_the_lr(train_lm, tmp_path):
    args = ["fit", f"--config={CONFIGS[0].parent / 'lm_seesaw.yaml'}", f"--trainer.default_root_dir={tmp_path}"]
    cli = train_lm.main([*args, *SMALL, "--data.corpus_bytes=30000", "--trainer.log_every_n_steps=1"])
    seesaw = _callback(cli).features["seesaw"]
    (config,) = cli.trainer.lr_scheduler_configs
    factors = [factor for _, factor in seesaw.schedule.points]  # type: ignore[attr-defined]
    assert factors == [2, 4, 8, 16]  # the one-cycle's LR halves four times before its end (at most 16)
    assert cli.trainer.global_step == seesaw.planned_steps  # type: ignore[attr-defined]
    assert config.scheduler.taken == config.scheduler.steps  # the schedule ran to its end with the epoch
    logged = _scalars(Path(cli.trainer.logger.log_dir), "accum/factor")
    assert logged[0] == 2.0
    assert sorted(set(logged)) == [2.0, 4.0, 8.0, 16.0]
    assert logged == sorted(logged)


def test_the_data_module_reads_a_users_file(train_lm, tmp_path):
    text = tmp_path / "mine.txt"
    text.write_bytes(bytes(range(256)) * 100)
    args = ["fit", f"--config={CONFIGS[0].parent / 'lm_ramp.yaml'}", f"--trainer.default_root_dir={tmp_path}"]
    cli = train_lm.main(
        [*args, *SMALL, f"--data.path={text}", "--trainer.max_steps=1", "--trainer.val_check_interval=2"]
    )
    inputs, _ = cli.datamodule.train_set[0]
    assert inputs.tolist() == list(range(16))  # the file's bytes, not the standard library's


@pytest.mark.parametrize("config", CONFIGS, ids=lambda path: path.name)
def test_print_config_round_trips(train_lm, config, tmp_path, capsys):
    def printed(path):
        with pytest.raises(SystemExit) as exit_info:
            train_lm.main(["fit", f"--config={path}", "--print_config"])
        assert exit_info.value.code in (None, 0)
        return capsys.readouterr().out

    first = printed(config)
    (tmp_path / "printed.yaml").write_text(first)
    assert printed(tmp_path / "printed.yaml") == first
    original, resolved = yaml.safe_load(config.read_text()), yaml.safe_load(first)
    assert _init_args(original).items() <= _init_args(resolved).items()
    for section in ("model", "data"):
        assert original[section].items() <= resolved[section].items()


def test_the_ddp_config_builds_the_accumulation_strategy_with_its_parent_arguments(train_lm, tmp_path):
    config = yaml.safe_load((EXAMPLES / "configs" / "lm_ddp.yaml").read_text())
    strategy = train_lm.main(["--config", str(EXAMPLES / "configs" / "lm_ddp.yaml")], run=False).trainer.strategy
    assert isinstance(strategy, DDPAccumulationStrategy)
    assert strategy.gradient_sync == "last"
    assert strategy._ddp_kwargs["find_unused_parameters"] is False
    # the parser resolves DDPStrategy's **kwargs through the mixin exactly as for Lightning's own DDPStrategy
    config["trainer"]["strategy"] = {
        "class_path": "lightning.pytorch.strategies.DDPStrategy",
        "init_args": {"find_unused_parameters": False},
    }
    (tmp_path / "stock.yaml").write_text(yaml.safe_dump(config))
    stock = train_lm.main(["--config", str(tmp_path / "stock.yaml")], run=False).trainer.strategy
    assert strategy._ddp_kwargs == stock._ddp_kwargs


def _train_lm(config: Path, *overrides: str, cwd: Path) -> str:
    """Run examples/train_lm.py as a user would, from ``cwd``; return everything it printed."""
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "train_lm.py"), "fit", f"--config={config}", *SMALL, *overrides],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env=launch_environment(),
    )
    printed = done.stdout + done.stderr
    if done.returncode == -signal.SIGABRT and _EXIT_ABORT in done.stderr and "`Trainer.fit` stopped" in done.stderr:
        # torch 2.13 can abort at interpreter exit after gloo on a loaded machine (a C++ thread still joinable when
        # static objects are destroyed; tests/scripts/fsdp1_sync.py): the fit itself ran to its end
        return printed
    assert done.returncode == 0, done.stderr[-3000:]
    return printed


_EXIT_ABORT = "terminate called without an active exception"


def _ddp_config_run(cwd: Path) -> str:
    return _train_lm(
        EXAMPLES / "configs" / "lm_ddp.yaml",
        *["--trainer.max_steps=2", "--trainer.limit_val_batches=0", "--trainer.logger=false"],
        "--trainer.enable_checkpointing=false",
        cwd=cwd,
    )


ddp_config_run = launched_ahead("ddp_config_run", _ddp_config_run)


def test_the_ddp_config_trains_on_two_processes(ddp_config_run):
    assert "micro 8 x factor 4 x world 2 = 64 samples" in ddp_config_run


def test_a_bad_value_in_yaml_names_the_argument(train_lm, tmp_path, capsys):
    config = yaml.safe_load((EXAMPLES / "configs" / "lm_step_schedule.yaml").read_text())
    config["trainer"]["callbacks"][0]["init_args"]["unit"] = "epochs"
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit):
        train_lm.main(["fit", f"--config={tmp_path / 'bad.yaml'}"])
    error = capsys.readouterr().err
    assert "unit" in error
    assert "epochs" in error

    # a factor of 0: the parser rejects it (through the constrained types of the signature) before any class is built
    config["trainer"]["callbacks"][0]["init_args"].update(unit="step", scheduling={0: 1, 50: 0})
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit) as exited:
        train_lm.main(["fit", f"--config={tmp_path / 'bad.yaml'}"])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert 'Parser key "scheduling"' in error
    assert "50: 0" in error


def _readme_run(cwd: Path) -> tuple[Path, str]:
    readme = (ROOT / "README.md").read_text()
    command = re.search(r"\.venv/bin/python (examples/train_lm\.py fit --config (\S+))", readme)
    assert command, "README's first command runs examples/train_lm.py with a config"
    return cwd, _train_lm(ROOT / command.group(2), "--trainer.max_steps=2", "--trainer.val_check_interval=4", cwd=cwd)


readme_run = launched_ahead("readme_run", _readme_run)


def test_the_readme_command_runs_the_main_example_from_the_command_line(readme_run):
    cwd, printed = readme_run
    (version,) = (cwd / "lightning_logs").iterdir()  # ./lightning_logs, where the README says
    assert list(version.glob("events.out.tfevents.*"))
    assert "micro 8 x factor 2 x world 1 = 16 samples" in printed


def _experiment(tmp: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp / "experiment"
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "accumulation_experiment.py"), "--factors", "1", "2", "--samples", "64"]
        + ["--micro_batch_size", "4", "--context", "16", "--width", "16", "--layers", "1", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env=launch_environment(),
    )
    return done, out


experiment = launched_ahead("experiment", _experiment)


def test_the_accumulation_experiment_writes_its_table_plot_and_numbers(experiment):
    done, out = experiment
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert [(r["factor"], r["accumulate"]) for r in results] == [(1, True), (2, True), (2, False)]
    assert [r["optimizer_steps"] for r in results] == [16, 8, 8]
    accumulated, big = results[1], results[2]
    # the same optimizer steps on the same samples: the same model, up to float summation order
    assert accumulated["final_val_loss"] == pytest.approx(big["final_val_loss"], abs=1e-5)
    assert all(r["peak_memory_mib"] >= 0 and r["seconds"] > 0 and r["curve"] for r in results)
    table = (out / "results.md").read_text()
    assert table.count("\n| ") == 2 + len(results)  # header, rule and one row per run
    assert "one batch of 8" in table
    assert "4 x 2 accumulated" in table
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_hugging_face_example_fine_tunes_with_token_weighting_alone(tmp_path, caplog):
    """examples/hf_causal_lm.py: the callback recognises the causal-LM head and says how it counts tokens."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(EXAMPLES))
    try:
        import hf_causal_lm
    finally:
        sys.path.remove(str(EXAMPLES))
    args = ["fit", f"--config={HF_CONFIG}", f"--trainer.default_root_dir={tmp_path}", "--trainer.max_steps=3"]
    with caplog.at_level("INFO"):
        cli = hf_causal_lm.main([*args, "--data.lines=256", "--trainer.enable_progress_bar=false"])
    assert cli.trainer.global_step == 3
    (summary,) = [record.message for record in caplog.records if "x factor" in record.message]
    assert "each loader batch split into micro-batches of 4 rows" in summary
    assert "tokens counted as LlamaForCausalLM weighs them (labels[..., 1:] != -100)" in summary
    assert _callback(cli).features["item_weighting"].normalize_by == "token"
