"""A tiny transformers causal LM on 2 CPU processes (gloo, DDP), ranks holding different numbers of tokens.

    python tests/scripts/hf_ranks.py OUT_DIR

Each rank trains on its own sequences (no DistributedSampler): rank 0 on short ones, rank 1 on long ones, so the two
ranks' micro-batches bear very different numbers of tokens. ``normalize_by="token"`` is the only weighting argument.
Rank 0 writes ``OUT_DIR/<name>.json`` with the final weights.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lightning_accum import AccumulationScheduler, DDPAccumulationStrategy  # noqa: E402
from tests.helpers import DictDataset  # noqa: E402
from tests.test_hf_models import FACTOR, LOADER_BATCH, HFModule, make_batch_data, make_model  # noqa: E402


def rank_data(rank: int) -> dict[str, torch.Tensor]:
    """Rank 0: 3 tokens a sequence (2 bear loss); rank 1: every sequence whole (ragged, up to 10)."""
    data = make_batch_data(seed=rank)
    if rank == 0:
        data["labels"][:, 3:] = -100
        data["attention_mask"][:, 3:] = 0
    return data


def run(name: str, out: Path, **arguments: object) -> None:
    callback = AccumulationScheduler({0: FACTOR}, log_metrics=False, normalize_by="token", **arguments)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPAccumulationStrategy(),
        max_epochs=1,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    module = HFModule(make_model("causal"))
    data = rank_data(int(os.environ.get("LOCAL_RANK", 0)))
    trainer.fit(module, DataLoader(DictDataset(data), batch_size=LOADER_BATCH))
    if trainer.global_rank == 0:
        weights = {key: value.flatten().tolist() for key, value in module.model.state_dict().items()}
        (out / f"{name}.json").write_text(json.dumps({"steps": trainer.global_step, "weights": weights}))


if __name__ == "__main__":
    target = Path(sys.argv[1])
    run("whole", target)
    run("split", target, micro_batch_size=2)
    os._exit(0)  # torch 2.13's gloo may abort a worker at interpreter exit, after the records are written
