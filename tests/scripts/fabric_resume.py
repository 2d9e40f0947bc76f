"""A Fabric fine-tuning loop with the Accumulator, saved with ``fabric.save`` and killed in the middle of a window.

    python tests/scripts/fabric_resume.py OUT_DIR uninterrupted     # trains EPOCHS epochs; writes weights.json
    python tests/scripts/fabric_resume.py OUT_DIR killed_resumed    # a child trains, saving every 2 steps, and kills
                                                                    # itself with SIGKILL inside a window of epoch 1;
                                                                    # then a fresh run resumes from the last save

Every piece of state a resume needs is exercised: a factor that follows the tokens consumed (the token count), the
LR scale's warmup and base batch, the typical token count the losses are put on, SGD's momentum, the loader's
position in its epoch (a stateful loader) and the accumulator's. ``OUT_DIR/<mode>.json`` holds the final weights,
the optimizer steps and, for the resumed run, where it resumed.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from fabric_common import TinyLM, make_pairs, mean_loss  # noqa: E402

from lightning_accum.fabric import Accumulator  # noqa: E402
from tests.helpers import DictDataset, ResumableLoader  # noqa: E402

EPOCHS, ROWS = 3, 3
# epoch 0: windows 2, 2, 2 (60 tokens reached), 3 and the 1 left; epoch 1: 3, 3, 3, 1 (steps 6-9). The last checkpoint
# is written after step 6, in the middle of epoch 1; the run dies inside the window of step 8
KILL_AT_STEP = 7


def dataset() -> DictDataset:
    pairs = make_pairs(30, seed=3)  # 10 micro-batches of 3 an epoch
    return DictDataset({key: torch.stack([pair[key] for pair in pairs]) for key in ("input_ids", "labels")})


def train(out: Path, kill: bool, resume: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    fabric = Fabric(accelerator="cpu", devices=1)
    model = TinyLM()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9))
    loader = ResumableLoader(dataset(), batch_size=ROWS)
    accumulator = Accumulator(
        fabric, model, optimizer,
        scheduling={0: 2, 60: 3}, unit="token",  # factor 3 once 60 loss-bearing tokens are consumed
        normalize_by="token", shift_labels=True,
        lr_scaling="sqrt", lr_warmup_steps=3, micro_batch_size=ROWS,
        log_metrics=False,
    )  # fmt: skip
    state = {"model": model, "optimizer": optimizer, "accumulator": accumulator, "loader": loader}
    record: dict[str, Any] = {}
    # the uninterrupted run saves too, beside it in the same folder: each run its own file
    checkpoint = out / ("uninterrupted.ckpt" if not (kill or resume) else "killed.ckpt")
    if resume:
        fabric.load(checkpoint, state)
        record["resumed_at"] = [accumulator.epoch, accumulator.optimizer_steps]
    for _ in range(accumulator.epoch, EPOCHS):
        for batch in accumulator.batches(loader):
            with accumulator.micro_step(batch) as micro:
                micro.backward(mean_loss(model, batch))
            if kill and accumulator.optimizer_steps == KILL_AT_STEP and not micro.should_step:
                os.kill(os.getpid(), signal.SIGKILL)  # inside a window, a step after the last checkpoint
            if micro.should_step:
                optimizer.step()
                optimizer.zero_grad()
                if accumulator.optimizer_steps % 2 == 0:
                    fabric.save(checkpoint, state)
    record["optimizer_steps"] = accumulator.optimizer_steps
    record["weights"] = [p.detach().flatten().tolist() for p in model.parameters()]
    return record


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    out.mkdir(parents=True, exist_ok=True)
    if mode == "uninterrupted":
        record = train(out, kill=False, resume=False)
    else:
        child = os.fork()
        if child == 0:
            try:
                train(out, kill=True, resume=False)
            finally:
                os._exit(3)  # only if it was not killed
        _, status = os.waitpid(child, 0)
        record = train(out, kill=False, resume=True)
        record["killed"] = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    (out / f"{mode}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
