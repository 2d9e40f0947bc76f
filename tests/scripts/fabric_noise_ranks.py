"""The noise scale and adaptive growth in Fabric loops on 2 CPU processes (gloo), launched as a user would.

    python tests/scripts/fabric_noise_ranks.py OUT_DIR

One launch runs every configuration of CONFIGS in turn (DDP, and FSDP2 with ``fully_shard`` on each layer and the
root), each with a fresh Fabric, model and optimizer. Each rank trains the tiny LM of fabric_common.py on its own
padded pairs (token-weighted, ragged token counts) and writes ``OUT_DIR/<name>.rank<r>.json``: each measured window's
two sums by the optimizer step it ends in, the estimate, the adaptive factor, the optimizer steps and the full weights.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from fabric_common import TinyLM, leave, mean_loss  # noqa: E402
from fabric_ranks import full_weights, rank_data, strategy  # noqa: E402
from lightning.fabric import Fabric  # noqa: E402

from lightning_accum.fabric import Accumulator  # noqa: E402
from tests.helpers import BACKENDS  # noqa: E402

TOKENS = {"normalize_by": "token", "shift_labels": True}
CONFIGS: dict[str, dict[str, Any]] = {
    # factor 2, every window measured, no smoothing: each window's two sums as they were
    "sums_k2": dict(scheduling={0: 2}, noise_scale=True, noise_scale_interval=1, noise_scale_decay=0.0, epochs=1),
    # from factor 1 (no halves on two ranks: each rank's micro-batch is a small batch), 12 epochs
    "adaptive_k1": dict(noise_scale=True, noise_scale_interval=1, noise_scale_decay=0.9, adaptive=True, epochs=12),
    # the same, with rank 1's Accumulator built with another target: every rank still takes rank zero's decisions
    "adaptive_k1_disagree": dict(
        noise_scale=True, noise_scale_interval=1, noise_scale_decay=0.9, adaptive=True, epochs=12, rank1_target=64.0
    ),
}


def run(out: Path, backend: str, name: str, epochs: int, rank1_target: float | None = None, **options: Any) -> None:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy(backend))
    fabric.launch()
    model = fabric.setup_module(TinyLM())
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.5))
    if rank1_target is not None and fabric.global_rank == 1:
        options["adaptive_target"] = rank1_target
    accumulator = Accumulator(fabric, model, optimizer, log_metrics=False, **TOKENS, **options)
    measurements: dict[int, list[float]] = {}
    factors = []
    data = rank_data(fabric.global_rank)
    for _ in range(epochs):
        for batch in accumulator.batches(data):
            with accumulator.micro_step(batch) as micro:
                micro.backward(mean_loss(model, batch))
            if micro.should_step:
                optimizer.step()
                optimizer.zero_grad()
                measured = accumulator.features["noise_scale"].measurement  # type: ignore[attr-defined]
                if measured is not None and measured not in measurements.values():
                    measurements[accumulator.optimizer_steps] = measured
                factors.append(accumulator.factor)
    record = {
        "measurements": {step: [m.small_sq, m.big_sq] for step, m in measurements.items()},
        "noise_scale": accumulator.features["noise_scale"].estimate.noise_scale,  # type: ignore[attr-defined]
        "factors": factors,
        "optimizer_steps": accumulator.optimizer_steps,
        "weights": full_weights(model),
    }
    if "adaptive" in accumulator.features:
        record["adaptive_factor"] = accumulator.features["adaptive"].factor  # type: ignore[attr-defined]
    accumulator.close()
    (out / f"{backend}_{name}.rank{fabric.global_rank}.json").write_text(json.dumps(record))


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for backend in BACKENDS:  # FSDP2 where lightning_accum runs it on this torch
        for name, options in CONFIGS.items():
            run(out, backend, name, **options)
    leave()


if __name__ == "__main__":
    main()
