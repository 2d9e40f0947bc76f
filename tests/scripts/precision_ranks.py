"""One window of 32 bfloat16 micro-batches on 2 CPU processes (gloo); record the gradient the optimizer sees.

    python tests/scripts/precision_ranks.py ddp,fsdp2 OUT_DIR   # DDP's configurations, then FSDP2's
    python tests/scripts/precision_ranks.py fsdp2 OUT_DIR       # FSDP2's only

Each rank trains on its own half of the data in order (no DistributedSampler), so micro-step j of rank r holds
samples ``r * 128 + 4j ...``. For each configuration every rank writes ``OUT_DIR/<name>.rank<r>.json``: the full
gradient each parameter had at the update (or the error raised). tests/test_precision.py compares it with the
correctly rounded mean of the 64 micro-batch gradients.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lightning_accum import (  # noqa: E402
    AccumulationScheduler,
    DDPAccumulationStrategy,
    ModelParallelAccumulationStrategy,
)
from tests.test_precision import FACTOR, FEATURES, MICRO_BATCH, RecordingSGD, loss, make_data, make_net  # noqa: E402


class Module(pl.LightningModule):
    def __init__(self, shard: dict[str, Any] | None, head: bool = False, unused: bool = False) -> None:
        super().__init__()
        self.net = make_net()
        # a float32 head on a bfloat16 net (32-true), and a layer no rank uses
        self.head = nn.Linear(FEATURES, 1) if head else None
        self.unused = nn.Linear(2, 2) if unused else None
        self.shard = shard
        self.seen: list[torch.Tensor] = []

    def configure_model(self) -> None:
        if self.shard is not None:
            from lightning_accum.compat.torch import fully_shard, mixed_precision_policy

            policy = mixed_precision_policy(**self.shard)
            fully_shard(self.net, mesh=self.device_mesh["data_parallel"], mp_policy=policy)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.head is not None:
            return nn.functional.mse_loss(self.head(self.net(x.bfloat16()).float()), y[:, :1])
        return loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return RecordingSGD(self.parameters(), lr=0.1, seen=self.seen)


# name -> (backend strategy, Trainer precision, fully_shard's MixedPrecisionPolicy arguments, grad_accum_dtype)
BF16 = {"param_dtype": torch.bfloat16}
CONFIGS: dict[str, tuple[str, str, dict[str, Any] | None, str | None]] = {
    "ddp_float32": ("ddp", "bf16-true", None, "float32"),
    "ddp_none": ("ddp", "bf16-true", None, None),
    "ddp_stock_float32": ("ddp_stock", "bf16-true", None, "float32"),  # refused on every rank
    "ddp_stock_auto": ("ddp_stock", "bf16-true", None, "auto"),  # warns, accumulates in bfloat16
    # bfloat16 sharded parameters
    "fsdp2_last_float32": ("last", "bf16-true", {}, "float32"),
    "fsdp2_last_none": ("last", "bf16-true", {}, None),
    "fsdp2_last_user_reduce_float32": ("last", "bf16-true", {"reduce_dtype": torch.float32}, None),
    "fsdp2_every_bf16_shards": ("every", "bf16-true", {}, "float32"),  # refused on every rank
    # float32 sharded parameters, bfloat16 compute
    "fsdp2_every_float32": ("every", "32-true", BF16, "float32"),
    "fsdp2_every_none": ("every", "32-true", BF16, None),
    "fsdp2_last_mixed_float32": ("last", "32-true", BF16, "float32"),
    "fsdp2_last_mixed_none": ("last", "32-true", BF16, None),
    "ddp_mixed_float32": ("ddp", "32-true", None, "float32"),  # every parameter goes through the float32 sums
    "ddp_unused_float32": ("ddp", "bf16-true", None, "float32"),  # a parameter no rank uses keeps no gradient
    "ddp_static_float32": ("ddp", "bf16-true", None, "float32"),  # refused: DDP(static_graph=True)
    # a factor that is no power of two: each loss backpropagated unscaled, 1/3 applied in float32
    "ddp_float32_k3": ("ddp", "bf16-true", None, "float32"),
    "ddp_float32_k3_fp16": ("ddp", "16-true", None, "float32"),
    # sample weighting with ragged ranks: rank 1's last micro-batch holds 1 sample (12 + 9 samples in the window)
    "ddp_float32_k3_samples": ("ddp", "bf16-true", None, "float32"),
    # FSDP2 at factors that are no power of two: each unscaled micro-batch gradient weighed in float32 as FSDP2
    # accumulates it, the reduced float32 shards rounded once
    "fsdp2_last_float32_k3": ("last", "bf16-true", {}, "float32"),
    "fsdp2_last_float32_k5": ("last", "bf16-true", {}, "float32"),
    "fsdp2_last_float32_k5_short": ("last", "bf16-true", {}, "float32"),  # the epoch holds 3 batches: a window of 3
    "fsdp2_last_float32_k3_samples": ("last", "bf16-true", {}, "float32"),
    "fsdp2_last_mixed_float32_k3": ("last", "32-true", BF16, "float32"),  # float32 shards, bfloat16 compute
    "fsdp2_every_float32_k3": ("every", "32-true", BF16, "float32"),
    "fsdp2_last_none_k3": ("last", "bf16-true", {}, None),  # each loss divided by 3 in bfloat16
}
FACTORS = {  # the others: FACTOR
    "ddp_float32_k3": 3,
    "ddp_float32_k3_fp16": 3,
    "ddp_float32_k3_samples": 3,
    "fsdp2_last_float32_k3": 3,
    "fsdp2_last_float32_k5": 5,
    "fsdp2_last_float32_k5_short": 5,
    "fsdp2_last_float32_k3_samples": 3,
    "fsdp2_last_mixed_float32_k3": 3,
    "fsdp2_every_float32_k3": 3,
    "fsdp2_last_none_k3": 3,
}
BATCHES = {"fsdp2_last_float32_k5_short": 3}  # micro-batches on each rank; the others: the factor
RANK_1_SHORT_BY = {"ddp_float32_k3_samples": 3, "fsdp2_last_float32_k3_samples": 3}


def run(name: str, out: Path) -> None:
    kind, precision, shard, grad_accum_dtype = CONFIGS[name]
    factor = FACTORS.get(name, FACTOR)
    if kind == "ddp":
        strategy: Any = DDPAccumulationStrategy(
            find_unused_parameters=name == "ddp_unused_float32", static_graph=name == "ddp_static_float32"
        )
    elif kind == "ddp_stock":
        strategy = DDPStrategy()
    else:
        strategy = ModelParallelAccumulationStrategy(gradient_sync=kind, data_parallel_size=2, tensor_parallel_size=1)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        precision=precision,
        max_steps=1,
        callbacks=[
            AccumulationScheduler(
                {0: factor},
                grad_accum_dtype=grad_accum_dtype,
                normalize_by="sample" if name in RANK_1_SHORT_BY else "micro_batch",
            )
        ],
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    rank = int(os.environ.get("LOCAL_RANK", 0))
    batches = BATCHES.get(name, factor)
    x, y = make_data(2 * batches * MICRO_BATCH)
    short = RANK_1_SHORT_BY.get(name, 0) if rank == 1 else 0
    half = slice(rank * batches * MICRO_BATCH, (rank + 1) * batches * MICRO_BATCH - short)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[half], y[half]), batch_size=MICRO_BATCH)
    module = Module(
        None if kind.startswith("ddp") else shard, head=name == "ddp_mixed_float32", unused="unused" in name
    )
    if name == "ddp_mixed_float32":
        module.net.to(torch.bfloat16)
    record: dict[str, Any] = {}
    try:
        trainer.fit(module, data)
    except ValueError as error:  # the same check fails on every rank
        record["raised"] = str(error)
    full = [g.full_tensor() if hasattr(g, "full_tensor") else g for g in module.seen]
    record["grads"] = [None if g is None else g.float().flatten().tolist() for g in full]
    record["dtypes"] = [None if g is None else str(g.dtype) for g in full]
    (out / f"{name}.rank{trainer.global_rank}.json").write_text(json.dumps(record))


def main() -> None:
    backends, out = sys.argv[1].split(","), Path(sys.argv[-1])
    out.mkdir(parents=True, exist_ok=True)
    for backend in backends:  # in the same two processes: a process costs seconds of imports
        for name, (kind, *_) in CONFIGS.items():
            if kind.startswith("ddp") == (backend == "ddp"):
                run(name, out)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as two_ranks.py: skip torch's exit-time teardown after gloo


if __name__ == "__main__":
    main()
