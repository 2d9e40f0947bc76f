"""bfloat16 accumulation against float32 accumulation (``grad_accum_dtype``): error by factor, then time and memory.

    python benchmarks/precision.py                 # prints two tables, writes precision.json

1. Error: a Linear(256, 256) under ``precision="bf16-true"``, micro-batch 4, one window of factor k = 1 ... 128,
   trained once with ``grad_accum_dtype=None`` (each micro-batch gradient added into a bfloat16 ``.grad``) and once
   with ``"float32"``. The gradient the optimizer sees is compared with the correctly rounded mean of the same
   micro-batch gradients (each computed alone by the same bfloat16 module, summed in float32, rounded once): the
   worst element in bfloat16 ulps, and the relative error of the whole gradient's norm.
2. Cost: the benchmarks' MLP (4 x Linear(1024, 1024), micro-batch 64, factor 4) under ``bf16-true``, both settings
   in alternating rounds in one process; the median ratio of the time per micro-step, and the bytes of the float32
   buffers against the bfloat16 parameters'.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import FACTOR, alternate, device, fit_seconds  # noqa: E402

from lightning_accum import AccumulationScheduler  # noqa: E402

WIDTH, MICRO_BATCH = 256, 4


def mse(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``nn.functional.mse_loss``; written out where torch has no kernel for the dtype (bfloat16 on torch 2.4's CPU)."""
    try:
        return nn.functional.mse_loss(prediction, target)
    except RuntimeError:  # "mse_cpu" not implemented for 'BFloat16'
        return (prediction - target).square().mean()


class Recording(torch.optim.SGD):
    """SGD that keeps the gradients of its update (after the closure: the window's last backward and normalization)."""

    seen: list[torch.Tensor]

    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        self.seen = [p.grad.detach().clone() for group in self.param_groups for p in group["params"]]
        super().step()
        return loss


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(WIDTH, WIDTH)
        self.optimizer: Recording | None = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return mse(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        self.optimizer = Recording(self.parameters(), lr=0.1)
        return self.optimizer


def data(samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(samples, WIDTH, generator=generator)
    return x, x @ torch.randn(WIDTH, WIDTH, generator=generator) / 16 + torch.randn(samples, WIDTH, generator=generator)


def reference(x: torch.Tensor, y: torch.Tensor, factor: int, device: str = "cpu") -> list[torch.Tensor]:
    """The correctly rounded mean: each micro-batch's gradient alone, summed in float32, rounded once."""
    net = Regression().net.to(device=device, dtype=torch.bfloat16)
    x, y = x.to(device), y.to(device)
    sums = [torch.zeros_like(p, dtype=torch.float32) for p in net.parameters()]
    for start in range(0, factor * MICRO_BATCH, MICRO_BATCH):
        net.zero_grad()
        xb, yb = x[start : start + MICRO_BATCH].bfloat16(), y[start : start + MICRO_BATCH].bfloat16()
        (mse(net(xb), yb) / factor).backward()
        for total, p in zip(sums, net.parameters(), strict=True):
            total += p.grad.float()
    return [total.to(torch.bfloat16) for total in sums]


def trainer(accelerator: str = "auto", **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(
        accelerator=accelerator,
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def error(grad_accum_dtype: str | None, factor: int, device: str = "cpu") -> dict[str, float]:
    """The gradient one window of ``factor`` hands the optimizer, against the correctly rounded mean, on ``device``."""
    x, y = data(factor * MICRO_BATCH)
    module = Regression()
    callback = AccumulationScheduler({0: factor}, grad_accum_dtype=grad_accum_dtype)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=MICRO_BATCH)
    trainer(device, callbacks=[callback], max_steps=1, precision="bf16-true").fit(module, loader)
    assert module.optimizer is not None
    seen, exact = module.optimizer.seen, reference(x, y, factor, device)
    ulps = 0.0
    for g, r in zip(seen, exact, strict=True):
        r32, g32 = r.float(), g.float()
        magnitude = torch.maximum(r32.abs(), g32.abs()).clamp(min=torch.finfo(torch.bfloat16).tiny)
        exponent = torch.floor(torch.log2(magnitude))  # at 0, the ulp of the other value
        ulps = max(ulps, ((g32 - r32).abs() / torch.exp2(exponent - 7)).max().item())
    flat_seen = torch.cat([g.float().flatten() for g in seen])
    flat_exact = torch.cat([r.float().flatten() for r in exact])
    return {"max_ulps": ulps, "relative_norm_error": ((flat_seen - flat_exact).norm() / flat_exact.norm()).item()}


def micro_step_seconds(wide: bool, steps: int) -> float:
    callback = AccumulationScheduler({0: FACTOR}, grad_accum_dtype="float32" if wide else None, log_metrics=False)
    run = trainer(callbacks=[callback], max_epochs=1, precision="bf16-true")
    return fit_seconds(run, steps) / (steps * FACTOR)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--factors", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()

    rows = [
        {"factor": factor, "bfloat16": error(None, factor, device()), "float32": error("float32", factor, device())}
        for factor in args.factors
    ]
    print("| factor | bf16 accumulation: max ulps | rel. norm error | fp32 accumulation: max ulps | rel. norm error |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        bf16, fp32 = row["bfloat16"], row["float32"]
        print(
            f"| {row['factor']} | {bf16['max_ulps']:.0f} | {bf16['relative_norm_error']:.2e} |"
            f" {fp32['max_ulps']:.0f} | {fp32['relative_norm_error']:.2e} |"
        )

    timing = alternate(lambda wide: micro_step_seconds(wide, args.steps), args.rounds)
    params = sum(p.numel() for p in nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(4))).parameters())
    cost = {
        "device": device(),
        "ms_per_micro_step_bf16": timing["baseline"] * 1e3,
        "ms_per_micro_step_fp32": timing["candidate"] * 1e3,
        "ratio": timing["ratio"],
        "ratio_range": [min(timing["ratios"]), max(timing["ratios"])],
        "buffer_mib": params * 4 / 2**20,
        "bf16_params_mib": params * 2 / 2**20,
    }
    print()
    print(
        "| device | bf16 accumulation (ms/micro-step) | fp32 (ms/micro-step) | ratio (median) | range | fp32 buffer |"
    )
    print("| --- | ---: | ---: | ---: | --- | ---: |")
    print(
        f"| {cost['device']} | {cost['ms_per_micro_step_bf16']:.2f} | {cost['ms_per_micro_step_fp32']:.2f} |"
        f" {cost['ratio']:.3f} | {cost['ratio_range'][0]:.3f} to {cost['ratio_range'][1]:.3f} |"
        f" {cost['buffer_mib']:.1f} MiB (2x the {cost['bf16_params_mib']:.1f} MiB of bf16 parameters) |"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "precision.json").write_text(json.dumps({"error": rows, "cost": cost}, indent=2))


if __name__ == "__main__":
    main()
