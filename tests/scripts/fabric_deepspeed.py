"""A Fabric loop with the Accumulator under DeepSpeed ZeRO on 2 CPU processes (gloo), launched as a user would.

    python tests/scripts/fabric_deepspeed.py OUT_DIR

``Fabric(accelerator="cpu", devices=2, strategy=lightning_accum.fabric.DeepSpeedAccumulationStrategy(stage=2))``
launches the second process itself. Each rank trains on its own padded prompt/response pairs (tests/scripts/
fabric_ranks.py's), token-weighted, factor 3; then Fabric's stock DeepSpeed strategy (its CPU refusals lifted) is
given to the Accumulator, which must refuse it. Every rank writes ``OUT_DIR/<name>.rank<r>.json``: DeepSpeed's own
step count, the full fp32 weights, the error raised. DeepSpeed's ``deepspeed_shm_comm`` op is switched off before it
is built (it needs g++), so collectives run on plain gloo.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import deepspeed.ops
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from fabric_common import LR, TinyLM, leave, mean_loss  # noqa: E402
from fabric_ranks import rank_data  # noqa: E402

from lightning_accum.fabric.deepspeed import _DeepSpeedOnCPU  # noqa: E402

if os.environ.get("LIGHTNING_NAMESPACE") == "lightning_fabric":  # as a user of the standalone package writes it
    from lightning_fabric import Fabric
    from lightning_fabric.strategies import DeepSpeedStrategy

    from lightning_accum.lightning_fabric import Accumulator, DeepSpeedAccumulationStrategy
else:
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DeepSpeedStrategy

    from lightning_accum.fabric import Accumulator, DeepSpeedAccumulationStrategy


class StockOnCPU(_DeepSpeedOnCPU, DeepSpeedStrategy):
    """Fabric's own DeepSpeedStrategy, with only its refusals of CPU lifted."""


deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # plain gloo, no C++ build


def full_weights(model: torch.nn.Module) -> dict[str, list[float]]:
    from deepspeed.utils import safe_get_full_fp32_param

    return {
        name.removeprefix("_forward_module.").removeprefix("module."): safe_get_full_fp32_param(p).flatten().tolist()
        for name, p in model.named_parameters()
    }


def run(out: Path, name: str, strategy: Any, **options: Any) -> None:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    net = TinyLM()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=LR))
    record: dict[str, Any] = {}
    try:
        accumulator = Accumulator(
            fabric,
            model,
            optimizer,
            scheduling={0: 3},
            normalize_by="token",
            shift_labels=True,
            log_metrics=False,
            **options,
        )
        for batch in accumulator.batches(rank_data(fabric.global_rank)):
            with accumulator.micro_step(batch) as micro:
                micro.backward(mean_loss(model, batch))
            if micro.should_step:
                optimizer.step()
                optimizer.zero_grad()
        record["optimizer_steps"] = accumulator.optimizer_steps
    except ValueError as error:
        record["raised"] = str(error)
    record["global_steps"] = fabric.strategy.model.global_steps
    record["classes"] = [f"{type(obj).__module__}.{type(obj).__name__}" for obj in (fabric, fabric.strategy)]
    record["weights"] = full_weights(model)
    (out / f"{name}.rank{fabric.global_rank}.json").write_text(json.dumps(record))


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    run(out, "zero2_token_k3", DeepSpeedAccumulationStrategy(stage=2))
    run(out, "stock_refused", StockOnCPU(stage=2))
    # the noise scale reads each micro-batch's gradient, which the engine reduces inside its own step
    run(out, "noise_refused", DeepSpeedAccumulationStrategy(stage=2), noise_scale=True, adaptive=True)
    leave()


if __name__ == "__main__":
    main()
