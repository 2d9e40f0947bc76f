"""The Accumulator under DeepSpeed ZeRO 2 on two real CPU processes (gloo), against the plain-PyTorch big batch.

tests/scripts/fabric_deepspeed.py trains as a user would (``Fabric(devices=2,
strategy=lightning_accum.fabric.DeepSpeedAccumulationStrategy(stage=2))``), on tests/test_fabric_distributed.py's data
and reference. DeepSpeed's facts relied on (deepspeed 0.19.8): with ``managed_gradient_accumulation: false``,
``engine.backward`` only accumulates and every ``engine.step()`` is one optimizer step (``global_steps``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from lightning.fabric.strategies import DeepSpeedStrategy

from lightning_accum.fabric import DeepSpeedAccumulationStrategy
from tests.helpers import launch_ranks, launched_ahead
from tests.test_fabric_distributed import WINDOWS, distance, records

SCRIPT = Path(__file__).resolve().parent / "scripts" / "fabric_deepspeed.py"


def _launch(out: Path) -> Path:
    return launch_ranks(SCRIPT, out)


launched = launched_ahead("launched", _launch)


def test_zero2_steps_once_per_window_and_equals_the_big_batch(launched):
    rank0, rank1 = records(launched, "zero2_token_k3")
    for record in (rank0, rank1):
        assert record["optimizer_steps"] == record["global_steps"] == len(WINDOWS)  # DeepSpeed's own count agrees
    assert rank0["weights"] == rank1["weights"]
    assert distance(rank0["weights"]) <= 1e-5


def test_an_engine_that_accumulates_by_itself_is_refused_before_any_step(launched):
    for record in records(launched, "stock_refused"):
        assert "accumulates by itself (managed_gradient_accumulation=True" in record["raised"]
        assert "lightning_accum.fabric.DeepSpeedAccumulationStrategy" in record["raised"]
        assert record["global_steps"] == 0


def test_the_noise_scale_and_adaptive_growth_are_refused_when_the_accumulator_is_built(launched):
    for record in records(launched, "noise_refused"):
        assert record["raised"] == (
            "`noise_scale=True` reads each micro-batch's full gradient, which DeepSpeedAccumulationStrategy (ZeRO"
            " stage 2) reduces inside its own step: use it with a single device, DDP or FSDP2 (`fully_shard`,"
            " ModelParallelStrategy), or set noise_scale=False"
        )
        assert "optimizer_steps" not in record
        assert record["global_steps"] == 0


def test_the_strategy_configures_unmanaged_accumulation_and_refuses_a_config_that_sets_it():
    strategy = DeepSpeedAccumulationStrategy(stage=2)
    assert isinstance(strategy, DeepSpeedStrategy)
    assert strategy.config["managed_gradient_accumulation"] is False
    given = {"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 4}
    with pytest.raises(ValueError, match=r"sets 'gradient_accumulation_steps' \(4\), but with lightning_accum.fabric"):
        DeepSpeedAccumulationStrategy(config=given)
    assert given == {"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 4}  # the user's, unchanged
    with pytest.raises(ValueError, match="overlap_comm=True under ZeRO stage 1"):
        DeepSpeedAccumulationStrategy(config={"zero_optimization": {"stage": 1, "overlap_comm": True}})
