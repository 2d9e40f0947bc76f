"""Exactness on the device: lightning_accum against a plain-PyTorch big-batch step, weight by weight.

    python benchmarks/gpu/exactness.py --out DIR [--dry]

An MLP (32 -> 256 -> LayerNorm -> 256 -> 8, GELU) trains two epochs of 14 micro-batches of 16 at factor 4, so every
epoch ends with a window of 2: 8 optimizer steps of SGD. The reference, in plain PyTorch on the same device, takes one
step per window on one forward of the window's rows concatenated (the big batch). Settings: fp32 with TF32 off and on,
``bf16-mixed`` (the reference under ``torch.autocast``), sample weighting with a ragged last micro-batch, and token
weighting (a token model whose labels hold -100 at random places; the reference is the mean over the window's
loss-bearing tokens). Where the big batch itself is not exact (TF32, bf16), both are also compared with the same
reference in float64: accumulation should land as close to it as the big batch does. Then ``bf16-true`` with float32
accumulation: the gradient the optimizer sees against the correctly rounded mean of the same micro-batch gradients
(``benchmarks/precision.py``'s measure, on this device), in bfloat16 ulps.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parents[1] / "examples")]  # harness, common, byte_lm
import lightning.pytorch as pl  # noqa: E402
from harness import Report, arguments, device, max_deviation, quiet, trainer  # noqa: E402

from lightning_accum import AccumulationScheduler  # noqa: E402

FACTOR, MICRO_BATCH, EPOCHS, LR = 4, 16, 2, 0.1
EXACT = 1e-6  # the project's bound for fp32 on one process
VOCAB, LENGTH = 64, 12


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 256), nn.GELU(), nn.LayerNorm(256), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 8)
    )


def token_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, 32), nn.GELU(), nn.Linear(32, VOCAB))


def regression_data(samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(samples, 32, generator=generator)
    return x, torch.sin(x[:, :8] * 2) + 0.1 * torch.randn(samples, 8, generator=generator)


class Tokens(Dataset):
    """Token sequences whose labels bear no loss (-100) at about 30% of the places, unevenly per row."""

    def __init__(self, samples: int) -> None:
        generator = torch.Generator().manual_seed(2)
        self.input_ids = torch.randint(0, VOCAB, (samples, LENGTH), generator=generator)
        labels = torch.roll(self.input_ids, -1, dims=1) * 7 % VOCAB
        self.labels = labels.masked_fill(torch.rand(samples, LENGTH, generator=generator) < 0.3, -100)

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[index], "labels": self.labels[index]}


def mse(net: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(net(x).float(), y.float())


def token_ce(net: nn.Module, batch: Any) -> torch.Tensor:
    logits = net(batch["input_ids"]).float()
    return nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)


class Module(pl.LightningModule):
    def __init__(self, net: nn.Module, loss: Callable[[nn.Module, Any], torch.Tensor]) -> None:
        super().__init__()
        self.net, self.loss = net, loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss(self.net, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def windows(loader: DataLoader) -> list[list[Any]]:
    """The loader's micro-batches grouped as the windows of factor 4, the epoch's last window short, per epoch."""
    batches = list(loader)
    return [batches[i : i + FACTOR] for _ in range(EPOCHS) for i in range(0, len(batches), FACTOR)]


def concatenate(window: list[Any]) -> Any:
    if isinstance(window[0], dict):
        return {key: torch.cat([b[key] for b in window]) for key in window[0]}
    return [torch.cat(parts) for parts in zip(*window, strict=True)]


def to(batch: Any, where: torch.device, dtype: torch.dtype | None) -> Any:
    def move(t: torch.Tensor) -> torch.Tensor:
        return t.to(where, dtype=dtype if dtype is not None and t.is_floating_point() else None)

    return {k: move(v) for k, v in batch.items()} if isinstance(batch, dict) else [move(t) for t in batch]


def big_batch(
    net_fn: Callable[[], nn.Module],
    loss: Callable[[nn.Module, Any], torch.Tensor],
    loader: DataLoader,
    dtype: torch.dtype = torch.float32,
    autocast: bool = False,
) -> list[torch.Tensor]:
    """Plain PyTorch: one SGD step per window on one forward and backward of its rows concatenated."""
    where = device()
    net = net_fn().to(where, dtype=dtype)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    for window in windows(loader):
        optimizer.zero_grad()
        batch = to(concatenate(window), where, dtype)
        context = torch.autocast(where.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        with context:
            value = loss(net, batch)
        value.backward()
        optimizer.step()
    return [p.detach() for p in net.parameters()]


def ours(
    net_fn: Callable[[], nn.Module],
    loss: Callable[[nn.Module, Any], torch.Tensor],
    loader: DataLoader,
    precision: str = "32-true",
    stock: bool = False,
    **options: Any,
) -> list[torch.Tensor]:
    """The same windows through Lightning: the callback (or stock ``accumulate_grad_batches``)."""
    module = Module(net_fn(), loss)
    extra: dict[str, Any] = (
        {"accumulate_grad_batches": FACTOR}
        if stock
        else {"callbacks": [AccumulationScheduler({0: FACTOR}, log_metrics=False, **options)]}
    )
    trainer(max_epochs=EPOCHS, precision=precision, **extra).fit(module, loader)
    return [p.detach() for p in module.parameters()]


def main(argv: Sequence[str] | None = None) -> None:
    args = arguments(argv, __doc__.split("\n")[0])
    quiet()
    report = Report(
        args.out,
        "exactness",
        "Exactness against a plain-PyTorch big batch",
        "An MLP, two epochs of 14 micro-batches of 16 at factor 4 (each epoch ends with a window of 2), 8 SGD steps;"
        " the reference takes one step per window on one forward of the window's rows. Max absolute weight deviation."
        " float64: the same big-batch reference in float64, the truth that TF32 and bf16 only approximate.",
    )
    report.table(
        "weights",
        ["setting", "max abs deviation from the big batch", "from float64: ours", "from float64: big batch", "verdict"],
    )
    full = DataLoader(TensorDataset(*regression_data(14 * MICRO_BATCH)), batch_size=MICRO_BATCH)
    ragged = DataLoader(TensorDataset(*regression_data(13 * MICRO_BATCH + 7)), batch_size=MICRO_BATCH)
    tokens = DataLoader(Tokens(14 * MICRO_BATCH), batch_size=MICRO_BATCH)
    settings: list[tuple[str, dict[str, Any]]] = [
        ("fp32, TF32 off", {"tf32": False}),
        ("fp32, TF32 off, stock Lightning", {"tf32": False, "stock": True}),
        ("fp32, TF32 on", {"tf32": True}),
        ("bf16-mixed", {"tf32": False, "precision": "bf16-mixed"}),
        ("sample weighting, last micro-batch of 7", {"tf32": False, "loader": ragged, "normalize_by": "sample"}),
        ("token weighting (-100 labels)", {"tf32": False, "loader": tokens, "normalize_by": "token"}),
    ]
    for name, setting in settings:
        setting = dict(setting)
        tf32, loader = setting.pop("tf32"), setting.pop("loader", full)
        net_fn, loss = (token_net, token_ce) if loader is tokens else (mlp, mse)
        torch.set_float32_matmul_precision("high" if tf32 else "highest")
        autocast = setting.get("precision") == "bf16-mixed"
        reference = big_batch(net_fn, loss, loader, autocast=autocast)
        trained = ours(net_fn, loss, loader, **setting)
        deviation = max_deviation(trained, reference)
        approximate = tf32 or autocast
        if approximate:
            truth = big_batch(net_fn, loss, loader, dtype=torch.float64)
            ours_error, big_error = max_deviation(trained, truth), max_deviation(reference, truth)
            good = ours_error <= 3 * big_error  # the same rounding noise as the big batch's, not a larger error
            verdict = "as close to float64 as the big batch" if good else "further from float64 than the big batch"
            cells = [f"{ours_error:.1e}", f"{big_error:.1e}"]
        else:
            ours_error = big_error = None
            stock = setting.get("stock", False)
            good = (deviation > EXACT) if stock else deviation <= EXACT
            verdict = f"exact (<= {EXACT:g})" if deviation <= EXACT else "not exact"
            if stock:
                verdict += " (as expected: stock divides each epoch's window of 2 by 4)"
            cells = ["-", "-"]
        report.row(
            "weights",
            [name, f"{deviation:.1e}", *cells, verdict],
            setting=name,
            deviation=deviation,
            from_float64=ours_error,
            big_batch_from_float64=big_error,
            passed=good,
        )
    torch.set_float32_matmul_precision("highest")

    import precision  # benchmarks/precision.py: the correctly rounded mean and the ulp count

    report.table(
        "bf16",
        ["factor", "bf16 accumulation: max ulps", "fp32 accumulation: max ulps", "fp32: relative norm error"],
        caption="`bf16-true`, a Linear(256, 256), micro-batch 4, one window: the gradient the optimizer sees against"
        " the correctly rounded mean of the same micro-batch gradients (summed in float32, rounded once).",
    )
    for factor in (1, 4) if args.dry else (1, 4, 16, 64):
        narrow = precision.error(None, factor, device().type)
        wide = precision.error("float32", factor, device().type)
        report.row(
            "bf16",
            [str(factor), f"{narrow['max_ulps']:.0f}", f"{wide['max_ulps']:.0f}", f"{wide['relative_norm_error']:.1e}"],
            factor=factor,
            bfloat16=narrow,
            float32=wide,
            passed=wide["max_ulps"] <= 1,
        )
    report.finish()


if __name__ == "__main__":
    main()
