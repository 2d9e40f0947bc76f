"""DeepSpeed ZeRO 1-3 under the AccumulationScheduler, on two real CPU processes (gloo), against plain PyTorch.

tests/scripts/deepspeed_ranks.py trains as a user would (``Trainer(devices=2, strategy=DeepSpeedAccumulationStrategy(
stage=s))``); the reference is tests/test_distributed.py's: one plain-PyTorch SGD step per window, on one process,
on the mean loss over every sample (or loss-bearing token) of the window on both ranks. DeepSpeed's facts relied on
(deepspeed 0.19.8): ``managed_gradient_accumulation: false`` makes every ``engine.step()`` one optimizer step and
``engine.backward`` only accumulate; ``global_steps`` counts steps; ``global_samples`` adds micro-batch x world per
backward; ZeRO optimizers divide the gradient by their ``loss_scale`` before clipping.
"""

from __future__ import annotations

import csv
import glob
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import lightning_accum
from lightning_accum import DeepSpeedAccumulationStrategy
from tests.helpers import launch_environment, launched_ahead
from tests.test_distributed import MICRO_STEPS_PER_EPOCH, NUM_SAMPLES, make_data, make_net, micro_step_indices
from tests.test_distributed import reference_weights as big_batch_weights

SCRIPT = Path(__file__).resolve().parent / "scripts" / "deepspeed_ranks.py"
LR = 0.1
WINDOWS = {
    "k3": [3, 3, 2, 3, 3, 2],  # 8 micro-steps an epoch: each epoch's last window holds the 2 left
    "step_schedule": [2, 2, 2, 2, 4, 4],  # {0: 2, 3: 4} by step: the window of step 3 is cut by the epoch's end
    "token_k3": [3, 3, 2, 3, 3, 2],
    # global batch 8 -> 16 -> 24 -> 32 every 16 samples (8 a micro-step): factors 1, 1, 2, 3, then 4 (1 left)
    "ramp": [1, 1, 2, 3, 1, 4, 4],
    "lr_sqrt": [2, 2, 2, 2, 4, 4],
    "split_k3": [3, 3, 2, 3, 3, 2],  # loader batches of 4 split in micro-batches of 2
    "plain_k2": [2] * 8,
    "last_cut": [3, 3, 3, 2],  # epoch 0: one window, then one micro-step of a window that is dropped
}


# a process costs seconds of imports: one launch runs several stages, the two killed ones (each ends its launch
# killed in a window) side by side, as each mostly waits on gloo; then both resumes in one launch
KILLED = (["runs:1", "killed:2"], ["killed:3"])
RESUMED = ["resume:2", "resume:3"]


def _launch_all(tmp: Path, limit: int = 400) -> Path:
    for process in [_start(steps, tmp, limit) for steps in KILLED]:
        _check(process, killed=True)
    _check(_start(RESUMED, tmp, limit), killed=False)
    return tmp


def _start(steps: list[str], tmp: Path, limit: int, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        ["timeout", "-s", "KILL", str(limit), sys.executable, str(SCRIPT), str(tmp), *steps],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=launch_environment() | (env or {}),
    )


def _check(process: subprocess.Popen, killed: bool) -> None:
    output, _ = process.communicate()
    clues = [line for line in output.splitlines() if "Error" in line or "Traceback" in line][-20:]
    if killed:  # the run kills itself with SIGKILL, as a preempted job dies (`timeout` passes 137 on)
        assert process.returncode in (137, -9), f"exit {process.returncode}; {clues}\n{output[-4000:]}"
    else:
        assert process.returncode == 0, f"exit {process.returncode}; {clues}\n{output[-4000:]}"


launched = launched_ahead("launched", _launch_all)


def _records(out: Path, name: str) -> list[dict]:
    return [json.loads((out / f"{name}.rank{rank}.json").read_text()) for rank in (0, 1)]


def _deviation(weights: dict[str, list[float]], reference: dict[str, torch.Tensor]) -> float:
    assert set(weights) == set(reference)
    return max((torch.tensor(weights[name]) - reference[name].flatten()).abs().max().item() for name in reference)


RUNS = [(stage, name) for stage in (1, 2, 3) for name in ("k3", "step_schedule", "token_k3", "last_cut")]
RUNS += [(2, name) for name in ("ramp", "split_k3", "plain_k2")]


@pytest.mark.parametrize(("stage", "name"), RUNS, ids=[f"zero{stage}-{name}" for stage, name in RUNS])
def test_every_stage_ends_at_the_big_batch_weights_with_the_steps_the_schedule_implies(launched, stage, name):
    out = launched / f"zero{stage}"
    first, second = _records(out, name)
    windows = WINDOWS[name]
    for record in (first, second):
        assert "raised" not in record, record.get("raised")
        assert record["optimizer_steps"] == len(windows)
        assert record["ds_global_steps"] == record["optimizer_steps"]  # DeepSpeed's count is Lightning's
    # DeepSpeed counts the samples of every backward, 2 ranks x 4 a loader batch (a split batch's parts each, and a
    # dropped window's, as DeepSpeed counts those of a step it skips on overflow)
    backwards = sum(windows) * (2 if name == "split_k3" else 1) + (1 if name == "last_cut" else 0)  # + the dropped
    assert first["ds_global_samples"] == 2 * 4 * backwards
    assert _deviation(first["weights"], big_batch_weights(windows, name)) <= 1e-5


@pytest.mark.parametrize("stage", [1, 2, 3], ids=["zero1", "zero2", "zero3"])
def test_the_metrics_log_each_windows_factor_and_samples_at_its_step(launched, stage):
    with open(launched / f"zero{stage}" / "k3" / "version_0" / "metrics.csv") as file:
        rows = [row for row in csv.DictReader(file) if row.get("accum/factor")]
    windows = WINDOWS["k3"]
    assert [int(row["step"]) for row in rows] == list(range(1, len(windows) + 1))  # as each optimizer step ends
    assert [float(row["accum/effective_batch_size"]) for row in rows] == [2 * 4 * size for size in windows]
    assert [float(row["accum/samples_seen"]) for row in rows] == [2 * 4 * sum(windows[: i + 1]) for i in range(6)]
    assert [float(row["accum/optimizer_steps"]) for row in rows] == list(range(1, len(windows) + 1))


@pytest.mark.parametrize("stage", [1, 2, 3], ids=["zero1", "zero2", "zero3"])
def test_validate_after_the_fit_runs_deepspeeds_inference_engine_on_the_trained_weights(launched, stage):
    record = _records(launched / f"zero{stage}", "k3")[0]
    reference = make_net()
    reference.load_state_dict(big_batch_weights(WINDOWS["k3"], "k3"))
    x, y = make_data(NUM_SAMPLES)
    with torch.no_grad():
        expected = nn.functional.mse_loss(reference(x), y).item()  # every sample once, 32 a rank in batches of 4
    assert record["val_loss"] == pytest.approx(expected, abs=1e-5)


def test_each_loss_is_divided_once_where_stock_lightning_divides_it_twice(launched):
    """Stock ``DeepSpeedStrategy`` + ``accumulate_grad_batches=2`` steps at half the LR; the strategy at the LR."""
    out = launched / "zero2"
    ours, stock = _records(out, "plain_k2")[0], _records(out, "stock_k2")[0]
    assert _deviation(ours["weights"], _reference([2] * 8, [LR] * 8)) <= 1e-5
    assert _deviation(stock["weights"], _reference([2] * 8, [LR] * 8)) > 1e-2  # the double division
    assert _deviation(stock["weights"], _reference([2] * 8, [LR / 2] * 8)) <= 1e-5


def test_sqrt_lr_scaling_with_warmup_steps_with_the_rates_of_the_rule(launched):
    out = launched / "zero2"
    record = _records(out, "lr_sqrt")[0]
    # base: the first window's 2 x 8 samples; from step 3 the factor is 4 (32 samples): the scale moves from 1 to
    # sqrt(2) over 2 steps, the old scale used at the step of the change (docs/learning-rate.md)
    target = math.sqrt(32 / 16)
    scales = [1.0, 1.0, 1.0, 1.0, 1.0 + (target - 1.0) / 2, target]
    assert _deviation(record["weights"], _reference(WINDOWS["lr_sqrt"], [LR * s for s in scales])) <= 1e-5
    assert _deviation(record["weights"], _reference(WINDOWS["lr_sqrt"], [LR] * 6)) > 1e-3  # the scale mattered


def test_a_deepspeed_checkpoint_written_inside_a_window_holds_the_configured_lr(launched):
    out = launched / "zero2"
    for written in ("mid", "boundary"):
        files = glob.glob(str(out / "lr_sqrt" / written / "checkpoint" / "*optim_states.pt"))
        assert len(files) == 2, files  # one ZeRO partition per rank
        for file in files:
            state = torch.load(file, map_location="cpu", weights_only=False)["optimizer_state_dict"]
            groups = state["base_optimizer_state"]["param_groups"]
            assert [group["lr"] for group in groups] == [LR]


REFUSED = {
    "noise_scale": (
        "`noise_scale=True` reads each micro-batch's full gradient, which DeepSpeedAccumulationStrategy (ZeRO"
        " stage 2) reduces inside its own step: use it with a single device, DDP or FSDP2 (`fully_shard`,"
        " ModelParallelStrategy), or set noise_scale=False"
    ),
    "stock_callback": (  # Lightning's own DeepSpeedStrategy
        "`StockOnCPU` accumulates gradients by itself with one fixed factor, so AccumulationScheduler cannot"
        " control its windows: use lightning_accum.DeepSpeedAccumulationStrategy (same arguments)"
    ),
    "manual_k3": (
        "ManualAccumulation is not supported under DeepSpeedAccumulationStrategy (ZeRO stage 2): DeepSpeed keeps the"
        " window's gradient in its own partitions, where the window cannot check or correct it. Use automatic"
        " optimization with AccumulationScheduler and DeepSpeedAccumulationStrategy"
    ),
    "bf16_float32": (
        "DeepSpeed (ZeRO stage 2) accumulates the gradients of torch.bfloat16 parameters itself, in the dtype of its"
        " config's `data_types.grad_accum_dtype` (DeepSpeed takes fp32 there for bf16 parameters at ZeRO stage 1"
        " only): set grad_accum_dtype=None here"
    ),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_what_deepspeed_cannot_do_is_refused_on_every_rank_before_a_step(launched, name):
    for record in _records(launched / "zero2", name):
        assert record["raised"] == REFUSED[name]
        assert record["optimizer_steps"] == 0


# ------------------------------------------------------------------ resume


@pytest.mark.parametrize("stage", [2, 3], ids=["zero2", "zero3"])
@pytest.mark.parametrize("written", ["boundary", "mid"])
def test_a_run_killed_in_a_window_resumes_from_a_deepspeed_checkpoint_exactly(launched, stage, written):
    """``boundary``: written as step 4 ends; ``mid``: inside the window of step 5. The run was then SIGKILLed
    in the middle of that window; both resume to the uninterrupted run's weights."""
    out = launched / f"zero{stage}"
    full, record = _records(out, "full")[0], _records(out, f"resumed_{written}")[0]
    assert record["optimizer_steps"] == full["optimizer_steps"] == record["ds_global_steps"] == 6
    assert record["ds_global_samples"] == full["ds_global_samples"]
    reference = {name: torch.tensor(values) for name, values in full["weights"].items()}
    assert _deviation(record["weights"], reference) <= 1e-6
    assert _deviation(full["weights"], big_batch_weights(WINDOWS["k3"], "k3")) <= 1e-5


# ------------------------------------------------------------------ refusals, in this process


@pytest.mark.parametrize(
    ("config", "key"),
    [
        ({"gradient_accumulation_steps": 4}, "gradient_accumulation_steps"),
        ({"train_batch_size": 64}, "train_batch_size"),
        ({"managed_gradient_accumulation": True}, "managed_gradient_accumulation"),
    ],
)
def test_a_config_that_sets_the_accumulation_is_refused_and_left_unchanged(config, key):
    given = {"zero_optimization": {"stage": 2}, **config}
    kept = json.loads(json.dumps(given))
    with pytest.raises(ValueError, match="DeepSpeed config sets") as raised:
        DeepSpeedAccumulationStrategy(config=given)
    assert str(raised.value) == (
        f"The DeepSpeed config sets {key!r} ({config[key]!r}), but with lightning_accum.DeepSpeedAccumulationStrategy"
        " the AccumulationScheduler owns accumulation: remove it, and give the factor as"
        " AccumulationScheduler(scheduling=...) or the global batch as target_batch_size=..."
    )
    assert given == kept


def test_a_config_that_already_says_unmanaged_accumulation_is_taken():
    strategy = DeepSpeedAccumulationStrategy(
        config={"zero_optimization": {"stage": 2}, "managed_gradient_accumulation": False}
    )
    assert strategy.config["managed_gradient_accumulation"] is False


def test_overlap_comm_is_off_under_stage_1_unless_asked_for():
    assert DeepSpeedAccumulationStrategy(stage=1).config["zero_optimization"]["overlap_comm"] is False
    assert DeepSpeedAccumulationStrategy(stage=2).config["zero_optimization"]["overlap_comm"] is True
    with pytest.raises(ValueError, match="overlap_comm=True under ZeRO stage 1"):
        DeepSpeedAccumulationStrategy(config={"zero_optimization": {"stage": 1, "overlap_comm": True}})


def test_the_strategy_accumulates_unmanaged_and_is_exported():
    strategy = DeepSpeedAccumulationStrategy(stage=3)
    assert strategy.config["managed_gradient_accumulation"] is False
    assert not strategy.handles_gradient_accumulation
    assert strategy.zero_stage == 3
    assert lightning_accum.DeepSpeedAccumulationStrategy is DeepSpeedAccumulationStrategy


def _reference(windows: list[int], lrs: list[float]) -> dict[str, torch.Tensor]:
    """One SGD step per window at the given LR, on the mean loss over the window's samples on both ranks."""
    x, y = make_data(NUM_SAMPLES)
    net = make_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    position = 0
    for size, lr in zip(windows, lrs, strict=True):
        epoch, first = divmod(position, MICRO_STEPS_PER_EPOCH)
        position += size
        index = torch.tensor(sum(micro_step_indices(epoch)[first : first + size], []))
        optimizer.zero_grad()
        nn.functional.mse_loss(net(x[index]), y[index]).backward()
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
    return {name: param.detach() for name, param in net.named_parameters()}


# ------------------------------------------------------------------ Lightning's own DeepSpeed tests, ported
# from tests/tests_pytorch/strategies/test_deepspeed.py (lightning 2.6): the ones that run without CUDA, with this
# strategy in place of DeepSpeedStrategy. Its one change to the config: `managed_gradient_accumulation: false`.

LIGHTNING_CONFIG = {
    "optimizer": {"type": "SGD", "params": {"lr": 3e-5}},
    "scheduler": {
        "type": "WarmupLR",
        "params": {"last_batch_iteration": -1, "warmup_min_lr": 0, "warmup_max_lr": 3e-5, "warmup_num_steps": 100},
    },
}


# ported from test_deepspeed.py::test_deepspeed_with_invalid_config_path
def test_deepspeed_with_invalid_config_path():
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    with pytest.raises(MisconfigurationException, match="You passed in a path to a DeepSpeed config but the path"):
        DeepSpeedAccumulationStrategy(config="invalid_path.json")


# ported from test_deepspeed.py::test_deepspeed_with_env_path
def test_deepspeed_with_env_path(tmp_path, monkeypatch):
    config_path = tmp_path / "temp.json"
    config_path.write_text(json.dumps(LIGHTNING_CONFIG))
    monkeypatch.setenv("PL_DEEPSPEED_CONFIG_PATH", str(config_path))
    strategy = DeepSpeedAccumulationStrategy()
    assert strategy.config == {**LIGHTNING_CONFIG, "managed_gradient_accumulation": False}


# ported from test_deepspeed.py::test_deepspeed_defaults
def test_deepspeed_defaults():
    strategy = DeepSpeedAccumulationStrategy()
    assert strategy.config is not None
    assert isinstance(strategy.config["zero_optimization"], dict)


# ported from test_deepspeed.py::test_deepspeed_custom_activation_checkpointing_params
def test_deepspeed_custom_activation_checkpointing_params():
    strategy = DeepSpeedAccumulationStrategy(
        partition_activations=True,
        cpu_checkpointing=True,
        contiguous_memory_optimization=True,
        synchronize_checkpoint_boundary=True,
    )
    checkpoint_config = strategy.config["activation_checkpointing"]
    assert checkpoint_config["partition_activations"]
    assert checkpoint_config["cpu_checkpointing"]
    assert checkpoint_config["contiguous_memory_optimization"]
    assert checkpoint_config["synchronize_checkpoint_boundary"]


# ------------------------------------------------------------------ DeepSpeed's behaviour the strategy relies on


def test_deepspeed_unmanaged_accumulation_and_settable_loss_scales_are_there():
    """deepspeed 0.19.8: if these change, lightning_accum/strategies/deepspeed.py must be revisited."""
    import inspect

    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    engine = inspect.getsource(inspect.getmodule(DeepSpeedEngine))  # its methods are wrapped for NVTX ranges
    assert "def backward(self, loss, retain_graph=False, scale_wrt_gas=True):" in engine
    assert "if not self.managed_gradient_accumulation():" in engine  # step() is then the boundary
    for optimizer in (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3):
        scale = optimizer.loss_scale
        assert isinstance(scale, property)
        assert scale.fset is not None  # the window's correction is folded in there
        assert "combined_scale = self.loss_scale" in inspect.getsource(inspect.getmodule(optimizer))
    # a dropped window: ZeRO-2 keeps reduced gradients where only step() (or its overflow path) clears them, and the
    # strategy clears the same ones
    zero = inspect.getsource(inspect.getmodule(DeepSpeedZeroOptimizer))
    for cleared in (
        "self._release_preflattened_grad_buffers()",
        "self.reset_cpu_buffers()",
        "self.averaged_gradients[k] = None",
        "self.all_grad_tensors[k] = None",
        "self.micro_step_id = INITIAL_MICRO_STEP_ID",
    ):
        assert cleared in zero
