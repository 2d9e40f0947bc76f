"""An FSDP2 unit that one rank skips on some micro-batches (conditional compute), on 2 CPU processes (gloo).

    python tests/scripts/skipped_unit.py OUT_DIR
    python tests/scripts/skipped_unit.py last_fp32 every OUT_DIR   # only the configurations whose names start so

The model is ``inp -> tanh -> [h + tanh(cond(h)) if the micro-batch says so] -> tanh(mid) -> out``, each Linear
its own ``fully_shard`` unit (``cond`` and ``mid`` of the same size), under the root unit. Each rank trains on its own
24 samples (no DistributedSampler), 6 micro-batches of 4 in windows of 3 (``AccumulationScheduler({0: 3})``). A
column of the data says whether ``cond`` runs on a micro-batch. Lightning launches the second process itself
(devices=2), as a user would. Every rank writes ``OUT_DIR/<name>.rank<r>.json`` with ``raised`` (the exception's
text, if fit raised), the optimizer steps and the final full weights.

Configurations: each ``gradient_sync`` with float32 parameters or a bfloat16 ``param_dtype``
(``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``), rank 1 alone skipping ``cond``
on window 0's last micro-batch (``skip_last``) or on window 1's middle one only (``skip_middle``); both ranks
skipping it together; rank 1 skipping it with either fix the error names (a zero-weight call, or ``cond`` left in
the root unit with ``set_reduce_scatter_unused_params(True)``); and rank 1 running ``cond``'s forward but leaving its
output out of the loss (``output_unused``: no backward for it on rank 1).

The ``guard_*`` configurations train 6 windows (18 micro-batches a rank) and record ``guard_all_gathers``, the
collective check's all-gathers in each micro-step of each fit: with the default check, then a resume from a
checkpoint on the same trainer for 6 more; with ``check_collectives=2`` and ``"always"``; and with rank 1 skipping
``cond`` in the last window the default checks, or in window 4 with ``"always"``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lightning_accum import AccumulationScheduler, ModelParallelAccumulationStrategy  # noqa: E402
from lightning_accum.compat.torch import fsdp2_reduces_unused_params  # noqa: E402

MICRO_BATCH, MICRO_STEPS, FACTOR, LR = 4, 6, 3, 0.1  # windows: micro-steps 0-2 and 3-5
SAMPLES_PER_RANK = MICRO_BATCH * MICRO_STEPS
WINDOW_LAST, WINDOW_MIDDLE = 2, 4  # the last micro-step of window 0, the middle one of window 1


def make_data(
    skips: dict[int, tuple[int, ...]], micro_steps: int = MICRO_STEPS
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both ranks' samples (rank r holds ``[r * n, (r + 1) * n)``, ``n = micro_steps * MICRO_BATCH``) and, per
    sample, whether ``cond`` runs on it: not on rank r's micro-batches ``skips[r]``."""
    samples_per_rank = micro_steps * MICRO_BATCH
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2 * samples_per_rank, 5, generator=generator)
    y = x @ torch.randn(5, 1, generator=generator) + 0.3 * torch.randn(2 * samples_per_rank, 1, generator=generator)
    use = torch.ones(2 * samples_per_rank)
    for rank, skipped in skips.items():
        for step in skipped:
            start = rank * samples_per_rank + step * MICRO_BATCH
            use[start : start + MICRO_BATCH] = 0
    return x, y, use


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.inp = nn.Linear(5, 8)
        self.cond = nn.Linear(8, 8)
        self.mid = nn.Linear(8, 8)  # the same size as `cond`: their all-gathers could pair up silently
        self.out = nn.Linear(8, 1)
        # where `cond` is not wanted: skip it (None), run it with zero weight (the fix the error names), or run its
        # forward with an output that takes no part in the loss (no backward on that rank)
        self.unwanted: str | None = None

    def forward(self, x: torch.Tensor, use_cond: bool) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        if use_cond:  # conditional compute: the unit runs only when the micro-batch asks for it
            h = h + torch.tanh(self.cond(h))
        elif self.unwanted == "zero_weight":
            h = h + 0 * torch.tanh(self.cond(h))
        elif self.unwanted == "output_unused":
            torch.tanh(self.cond(h))
        return self.out(torch.tanh(self.mid(h)))


def loss_of(net: nn.Module, x: torch.Tensor, y: torch.Tensor, use: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(net(x, bool(use.all())).float(), y)


class Model(pl.LightningModule):
    def __init__(self, bf16: bool, fix: str | None) -> None:
        super().__init__()
        self.net = Net()
        self.net.unwanted = fix if fix in ("zero_weight", "output_unused") else None
        self.bf16 = bf16
        self.fix = fix

    def configure_model(self) -> None:
        from lightning_accum.compat.torch import fsdp_module_type, fully_shard, mixed_precision_policy

        if isinstance(self.net, fsdp_module_type()):  # a second fit (the resume) of the same model
            return
        mesh = self.device_mesh["data_parallel"]
        policy = mixed_precision_policy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if self.bf16 else None
        options: dict[str, Any] = {"mesh": mesh} if policy is None else {"mesh": mesh, "mp_policy": policy}
        units = [self.net.inp, self.net.cond, self.net.mid, self.net.out, self.net]
        if self.fix == "unused_params":  # the other documented fix: `cond` belongs to the root unit, run by all
            units.remove(self.net.cond)
        for unit in units:
            fully_shard(unit, **options)
        if self.fix == "unused_params":
            self.net.set_reduce_scatter_unused_params(True, recurse=False)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return loss_of(self.net, *batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


class GuardCollectives(pl.Callback):
    """The guard's agreements in each micro-step of each fit: ``c10d::allgather_`` events of torch.profiler.

    FSDP2 all-gathers parameters with ``c10d::_allgather_base_``; nothing else in these fits all-gathers a list.
    """

    def __init__(self) -> None:
        self.fits: list[list[int]] = []

    def on_train_start(self, *_: Any) -> None:
        self.fits.append([])

    def on_train_batch_start(self, *_: Any) -> None:
        self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        self.profiler.__enter__()

    def on_train_batch_end(self, *_: Any) -> None:  # after the window's optimizer step, where it ends one
        self.profiler.__exit__(None, None, None)
        self.fits[-1].append(sum(event.name == "c10d::allgather_" for event in self.profiler.events()))


def full_weights(module: nn.Module) -> dict[str, list[float]]:
    # a collective under FSDP2: every rank takes part, in the same order
    return {name: param.full_tensor().detach().flatten().tolist() for name, param in module.named_parameters()}


def run(
    name: str,
    out: Path,
    gradient_sync: str,
    bf16: bool = False,
    skips: dict[int, tuple[int, ...]] | None = None,
    fix: str | None = None,
    check_collectives: bool | int | str = True,
    micro_steps: int = MICRO_STEPS,
    resume: bool = False,
    count: bool = False,
) -> None:
    counter = GuardCollectives()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelAccumulationStrategy(
            data_parallel_size=2,
            tensor_parallel_size=1,
            gradient_sync=gradient_sync,
            check_collectives=check_collectives,  # type: ignore[arg-type]
        ),
        max_epochs=1,
        callbacks=[AccumulationScheduler({0: FACTOR})] + ([counter] if count else []),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    rank = int(os.environ.get("LOCAL_RANK", 0))
    x, y, use = make_data(skips or {}, micro_steps)
    mine = slice(rank * micro_steps * MICRO_BATCH, (rank + 1) * micro_steps * MICRO_BATCH)
    loader = DataLoader(TensorDataset(x[mine], y[mine], use[mine]), batch_size=MICRO_BATCH)
    model = Model(bf16, fix)
    record: dict[str, Any] = {}
    try:
        trainer.fit(model, loader)
        if resume:  # the same trainer and strategy fit again, from a checkpoint, for one more epoch
            trainer.save_checkpoint(out / f"{name}.ckpt")
            trainer.fit_loop.max_epochs = 2
            trainer.fit(model, loader, ckpt_path=out / f"{name}.ckpt")
    except (RuntimeError, ValueError) as error:
        record["raised"] = str(error)
    record |= {
        "optimizer_steps": trainer.global_step,
        "weights": full_weights(model.net),
        "guard_all_gathers": counter.fits,
    }
    (out / f"{name}.rank{trainer.global_rank}.json").write_text(json.dumps(record))
    print(f"rank {trainer.global_rank}: {name} done ({'raised' if 'raised' in record else 'trained'})", flush=True)


SYNCS = ("last", "every", "reduce_scatter")
# the fixes the guard's error names: the second (`set_reduce_scatter_unused_params`) from torch 2.13 on
FIXES = ("zero_weight", "unused_params") if fsdp2_reduces_unused_params() else ("zero_weight",)
CONFIGS: dict[str, dict[str, Any]] = {}
for sync in SYNCS:
    for precision in ("fp32", "bf16"):
        # rank 1 skips `cond` on window 0's last micro-batch (and would on window 1's middle one)
        CONFIGS[f"{sync}_{precision}_skip_last"] = {
            "gradient_sync": sync,
            "bf16": precision == "bf16",
            "skips": {1: (WINDOW_LAST, WINDOW_MIDDLE)},
        }
        # rank 1 skips `cond` on window 1's middle micro-batch only: window 0 steps
        CONFIGS[f"{sync}_{precision}_skip_middle"] = {
            "gradient_sync": sync,
            "bf16": precision == "bf16",
            "skips": {1: (WINDOW_MIDDLE,)},
        }
for sync in SYNCS:
    # both ranks skip `cond` on the same micro-batches: FSDP2 needs nothing more
    CONFIGS[f"{sync}_fp32_everyone_skips"] = {
        "gradient_sync": sync,
        "skips": {0: (WINDOW_LAST, WINDOW_MIDDLE), 1: (WINDOW_LAST, WINDOW_MIDDLE)},
    }
    # rank 1 alone skips, with either fix that the error names
    for fix in FIXES:
        CONFIGS[f"{sync}_fp32_{fix}"] = {"gradient_sync": sync, "skips": {1: (WINDOW_LAST, WINDOW_MIDDLE)}, "fix": fix}
# rank 1 runs `cond`'s forward but leaves its output out of the loss: the reduce-scatters differ (raises), except
# under "last" on a micro-step that does not end its window, which reduces nothing
CONFIGS["every_fp32_output_unused"] = {"gradient_sync": "every", "skips": {1: (WINDOW_LAST,)}, "fix": "output_unused"}
CONFIGS["last_fp32_output_unused_middle"] = {
    "gradient_sync": "last",
    "skips": {1: (WINDOW_MIDDLE,)},
    "fix": "output_unused",
}


# the guard checks the first windows of every fit, then steps aside: 6 windows of 3 micro-steps, and a resume of 6 more
GUARD_STEPS = 18
COUNTED = {"gradient_sync": "last", "micro_steps": GUARD_STEPS, "count": True}
CONFIGS["guard_default_resume"] = {**COUNTED, "resume": True}
CONFIGS["guard_two_windows"] = {**COUNTED, "check_collectives": 2}
CONFIGS["guard_always"] = {**COUNTED, "check_collectives": "always"}
# rank 1 skips `cond` in the middle of the last checked window (the default's third), or, with the check always on,
# in the middle of window 4: every rank raises the same error there
CONFIGS["guard_default_skip_window2"] = {"gradient_sync": "last", "micro_steps": GUARD_STEPS, "skips": {1: (7,)}}
CONFIGS["guard_always_skip_window4"] = {
    "gradient_sync": "last",
    "micro_steps": GUARD_STEPS,
    "skips": {1: (13,)},
    "check_collectives": "always",
}


def main() -> None:
    out, only = Path(sys.argv[-1]), sys.argv[1:-1]
    out.mkdir(parents=True, exist_ok=True)
    for name, options in CONFIGS.items():
        if not only or any(name.startswith(prefix) for prefix in only):
            run(name, out, **options)
    # every record is written: leave without the interpreter's C++ teardown (see two_ranks.py)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
