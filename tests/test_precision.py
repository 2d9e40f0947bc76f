"""Accumulation in float32 under bfloat16 parameters: the step's gradient is the correctly rounded window mean.

The reference is plain PyTorch: each micro-batch's gradient computed alone by the same bfloat16 module (of the loss
divided by the window's size, as Lightning divides it; a power of two, so exact), summed in float32 and rounded to
bfloat16 once. Without float32 accumulation each micro-batch's gradient is added into a bfloat16 ``.grad``, one
rounding per micro-step; the test measures that error too.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_accum import AccumulationScheduler
from lightning_accum.core.precision import WideAccumulator, check_grad_accum_dtype, narrower
from tests.helpers import (
    BACKENDS,
    DictDataset,
    launch_environment,
    launched_ahead,
    mse,
    rank_records,
    trainer,
)

FEATURES, FACTOR, MICRO_BATCH = 64, 32, 4


def bf16_ulps(value: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """|value - reference| in units in the last place of the bfloat16 ``reference`` (elementwise)."""
    reference, value = reference.float(), value.float()
    magnitude = torch.maximum(reference.abs(), value.abs()).clamp(min=torch.finfo(torch.bfloat16).tiny)
    exponent = torch.floor(torch.log2(magnitude))  # at 0, the ulp of the other value
    return (value - reference).abs() / torch.exp2(exponent - 7)


def make_data(samples: int = FACTOR * MICRO_BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, FEATURES, generator=generator)
    y = x @ torch.randn(FEATURES, FEATURES, generator=generator) / 8 + torch.randn(
        samples, FEATURES, generator=generator
    )
    return x, y


def loss(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """MSE in the prediction's dtype (FSDP2 with a bfloat16 ``param_dtype`` predicts in bfloat16 from float32 data)."""
    return mse(prediction, target.to(prediction.dtype))


def make_net() -> nn.Module:
    torch.manual_seed(3)
    return nn.Linear(FEATURES, FEATURES)


def reference_gradients(x: torch.Tensor, y: torch.Tensor, factor: int = FACTOR, ranks: int = 1) -> list[torch.Tensor]:
    """The correctly rounded mean of the micro-batch gradients of the bfloat16 module, one tensor per parameter.

    ``ranks`` windows of ``factor`` micro-batches each, consecutive in ``x`` (rank r's from ``r x factor`` on), as
    the ranks' gradients are averaged.
    """
    net = make_net().to(torch.bfloat16)
    sums = [torch.zeros_like(p, dtype=torch.float32) for p in net.parameters()]
    for start in range(0, ranks * factor * MICRO_BATCH, MICRO_BATCH):
        net.zero_grad()
        (loss(net(x[start : start + MICRO_BATCH].bfloat16()), y[start : start + MICRO_BATCH]) / factor).backward()
        for total, p in zip(sums, net.parameters(), strict=True):
            total += p.grad.float()
    return [(total / ranks).to(torch.bfloat16) for total in sums]


class Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return RecordingSGD(self.parameters(), lr=0.1, seen=self.seen)


class RecordingSGD(torch.optim.SGD):
    """SGD that records the gradients of its update: after the closure (the window's last backward, normalization
    and clipping), as the update reads them."""

    def __init__(self, params: Any, lr: float, seen: list[torch.Tensor]) -> None:
        super().__init__(params, lr=lr)
        self.seen = seen

    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        self.seen.extend(
            None if p.grad is None else p.grad.detach().clone() for group in self.param_groups for p in group["params"]
        )
        super().step()
        return loss


def optimizer_gradients(
    grad_accum_dtype: str | None, x: torch.Tensor, y: torch.Tensor, noise_scale: bool = False
) -> list[torch.Tensor]:
    module = Module()
    callback = AccumulationScheduler({0: FACTOR}, grad_accum_dtype=grad_accum_dtype, noise_scale=noise_scale)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=MICRO_BATCH)
    trainer([callback], max_steps=1, precision="bf16-true").fit(module, data)
    assert all(g.dtype == torch.bfloat16 for g in module.seen)
    return module.seen


@pytest.fixture(scope="module")
def measured():
    x, y = make_data()
    reference = reference_gradients(x, y)
    errors = {}
    for dtype in ("float32", "auto", None):
        seen = optimizer_gradients(dtype, x, y)
        errors[dtype] = max(bf16_ulps(g, r).max().item() for g, r in zip(seen, reference, strict=True))
    return errors


@pytest.mark.parametrize("grad_accum_dtype", ["float32", "auto"])
def test_bf16_true_factor_32_is_within_one_ulp_of_the_correctly_rounded_mean(measured, grad_accum_dtype):
    assert measured[grad_accum_dtype] <= 1.0


@pytest.mark.parametrize("grad_accum_dtype", ["float32", None])
def test_the_noise_scale_changes_no_bit_of_the_step_gradient(grad_accum_dtype):
    """The noise scale holds the window's bfloat16 sums itself between backwards, or finds them moved out by float32
    accumulation: either way the optimizer sees the gradient it would see without it."""
    x, y = make_data()
    plain = optimizer_gradients(grad_accum_dtype, x, y)
    noisy = optimizer_gradients(grad_accum_dtype, x, y, noise_scale=True)
    assert all(torch.equal(a, b) for a, b in zip(plain, noisy, strict=True))


def test_bf16_accumulation_is_what_the_option_removes(measured):
    assert measured[None] > 8.0  # one rounding per micro-step, 32 of them (measured: tens of ulps)


def test_the_summary_names_the_accumulation_dtype_and_its_memory(caplog):
    x, y = make_data()
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=MICRO_BATCH)
    with caplog.at_level("INFO"):
        trainer([AccumulationScheduler({0: FACTOR})], max_steps=1, precision="bf16-true").fit(Module(), data)
    assert "gradients accumulated in float32 (+0.0 MiB)" in caplog.text  # 64 x 65 parameters x 4 bytes


class MixedModule(pl.LightningModule):
    """A bfloat16 body and a float32 head (32-true): only the body is narrower than float32."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.body = nn.Linear(FEATURES, FEATURES).to(torch.bfloat16)
        self.head = nn.Linear(FEATURES, 1)
        self.seen: list[torch.Tensor] = []
        self.after_backward_grads: list[bool] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.head(self.body(x.bfloat16()).float()), y[:, :1])

    def on_after_backward(self) -> None:
        self.after_backward_grads.append(all(p.grad is not None for p in self.parameters()))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return RecordingSGD(self.parameters(), lr=0.1, seen=self.seen)


def test_float32_parameters_beside_bfloat16_ones_get_the_windows_normalized_mean():
    """normalize_by="sample": the head (float32, accumulated in .grad) is scaled as the body (float32 buffers)."""
    x, y = make_data(16)
    module = MixedModule()
    reference = MixedModule()
    callback = AccumulationScheduler({0: 4}, normalize_by="sample", grad_accum_dtype="float32")
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=MICRO_BATCH)
    trainer([callback], max_steps=1).fit(module, data)
    reference.zero_grad()
    reference.training_step((x, y), 0).backward()  # one batch of 16: the mean over every sample
    head_weight, head_bias = module.seen[2], module.seen[3]
    assert torch.allclose(head_weight, reference.head.weight.grad, rtol=1e-5, atol=1e-7)
    assert torch.allclose(head_bias, reference.head.bias.grad, rtol=1e-5, atol=1e-7)
    assert all(module.after_backward_grads)  # on_after_backward sees each micro-batch's gradient, never None


def test_float32_parameters_allocate_nothing():
    """bf16-mixed and 16-mixed keep float32 parameters and gradients: nothing to widen."""
    accumulator_params = [p for p in make_net().parameters() if narrower(p.dtype, torch.float32)]
    assert accumulator_params == []
    assert narrower(torch.bfloat16, torch.float32)
    assert narrower(torch.float16, torch.float32)
    assert not narrower(torch.float32, torch.float32)


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        ("float16", ValueError, r"`grad_accum_dtype` must be None, 'float32' or 'float64'.*'float16'"),
        ("int8", ValueError, r"got 'int8'"),
        (torch.bfloat16, ValueError, r"`grad_accum_dtype=torch.bfloat16` would not widen anything"),
        (32, TypeError, r"`grad_accum_dtype` must be None, a dtype name or a torch.dtype, got 32"),
    ],
)
def test_a_bad_grad_accum_dtype_names_itself(value, error, match):
    with pytest.raises(error, match=match):
        AccumulationScheduler(grad_accum_dtype=value)


def test_accepted_spellings():
    for value in ("float32", "fp32", "torch.float32", torch.float32):
        assert check_grad_accum_dtype(value) is torch.float32
    assert check_grad_accum_dtype("float64") is torch.float64


def test_the_accumulator_writes_only_gradients_that_exist():
    used, unused = (nn.Parameter(torch.zeros(2, dtype=torch.bfloat16)) for _ in range(2))
    accumulator = WideAccumulator([used, unused], torch.float32)
    accumulator.zero()
    used.grad = torch.ones(2, dtype=torch.bfloat16)
    accumulator.add()
    accumulator.write(scale=0.5)
    assert used.grad.tolist() == [0.5, 0.5]
    assert unused.grad is None
    assert accumulator.nbytes == 16 + 8  # two buffers of 2 float32 values, and a flag each


# ------------------------------------------------------------------ two processes (tests/scripts/precision_ranks.py)

SCRIPT = Path(__file__).resolve().parent / "scripts" / "precision_ranks.py"


def _two_ranks(out: Path) -> Path:
    """Every configuration under DDP, then under FSDP2, in one launch (a process costs seconds of imports)."""
    done = subprocess.run(
        ["timeout", "-s", "KILL", "300", sys.executable, str(SCRIPT), ",".join(BACKENDS), str(out)],
        capture_output=True,
        text=True,
        check=False,
        env=launch_environment(),
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return out


two_ranks = launched_ahead("two_ranks", _two_ranks)


def _ulps(record: dict) -> float:
    reference = reference_gradients(*make_data(2 * FACTOR * MICRO_BATCH), ranks=2)  # rank r holds samples r*128 on
    return max(
        bf16_ulps(torch.tensor(grad).view_as(r), r).max().item()
        for grad, r in zip(record["grads"], reference, strict=True)
    )


_records = rank_records


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        ("ddp_float32", "torch.bfloat16"),  # DDP's reduction off; the float32 sums all-reduced once
        ("fsdp2_last_float32", "torch.bfloat16"),  # bfloat16 shards: FSDP2 accumulates unsharded in float32
        ("fsdp2_last_user_reduce_float32", "torch.bfloat16"),  # the user's reduce_dtype=float32 does the same
        ("fsdp2_last_mixed_float32", "torch.float32"),  # float32 shards, bfloat16 compute
        ("fsdp2_every_float32", "torch.float32"),  # reduce-scatter in float32 every micro-step
    ],
)
def test_two_ranks_are_within_one_ulp_of_the_correctly_rounded_mean(two_ranks, name, dtype):
    rank0, rank1 = _records(two_ranks, name)
    assert "raised" not in rank0, rank0.get("raised")
    assert rank0["grads"] == rank1["grads"]
    assert set(rank0["dtypes"]) == {dtype}
    assert _ulps(rank0) <= 1.0


@pytest.mark.parametrize(
    ("name", "dtype", "batches"),
    [
        ("ddp_float32_k3", torch.bfloat16, 3),
        ("ddp_float32_k3_fp16", torch.float16, 3),
        ("ddp_float32_k3_samples", torch.bfloat16, 3),  # normalize_by="sample", rank 1's last micro-batch of 1 sample
        # FSDP2 (bfloat16 shards, gradient_sync="last"): each micro-batch's gradient weighed in float32 as FSDP2
        # accumulates it, the window's scale applied to the reduced float32 shards before their one rounding
        ("fsdp2_last_float32_k3", torch.bfloat16, 3),
        ("fsdp2_last_float32_k5", torch.bfloat16, 5),
        ("fsdp2_last_float32_k5_short", torch.bfloat16, 3),  # factor 5, the epoch's 3 batches: a window of 3
        ("fsdp2_last_float32_k3_samples", torch.bfloat16, 3),
        # float32 shards, bfloat16 compute: the float32 gradient, within one bfloat16 place of the compute's sum
        ("fsdp2_last_mixed_float32_k3", torch.bfloat16, 3),
        ("fsdp2_every_float32_k3", torch.bfloat16, 3),
    ],
)
def test_two_ranks_at_a_factor_that_is_no_power_of_two_are_within_one_ulp_of_the_correctly_rounded_mean(
    two_ranks, name, dtype, batches
):
    """Each micro-batch's gradient of its own unscaled loss, weighted (1 / (2 x batches), or its samples over the
    window's), summed in float64 over both ranks and rounded once: the correctly rounded mean."""
    rank0, rank1 = _records(two_ranks, name)
    assert "raised" not in rank0, rank0.get("raised")
    assert rank0["grads"] == rank1["grads"]
    assert _worst_ulps(rank0, dtype, batches, short=3 if name.endswith("samples") else 0) <= 1.0


def test_fsdp2_dividing_each_loss_by_3_in_bfloat16_is_what_the_option_removes(two_ranks):
    """grad_accum_dtype=None under FSDP2 at factor 3: each loss divided by 3 in bfloat16 before its backward (the
    issue measured 235 ulps in the worst element)."""
    rank0, _ = _records(two_ranks, "fsdp2_last_none_k3")
    assert _worst_ulps(rank0, torch.bfloat16, 3) > 8.0


def _worst_ulps(record: dict, dtype: torch.dtype, batches: int, short: int = 0) -> float:
    x, y = make_data(2 * batches * MICRO_BATCH)
    net = make_net().to(dtype)
    sums = [torch.zeros_like(p, dtype=torch.float64) for p in net.parameters()]
    rows = batches * MICRO_BATCH
    parts = [(s, min(s + MICRO_BATCH, rows)) for s in range(0, rows, MICRO_BATCH)]
    parts += [(s, min(s + MICRO_BATCH, 2 * rows - short)) for s in range(rows, 2 * rows, MICRO_BATCH)]
    samples = sum(end - start for start, end in parts)
    for start, end in parts:
        net.zero_grad()
        with _default_dtype(dtype):
            part_loss = loss(net(x[start:end].to(dtype)), y[start:end].to(dtype))
        part_loss.backward()
        weight = (end - start) / samples if short else 1 / len(parts)
        for total, p in zip(sums, net.parameters(), strict=True):
            total += weight * p.grad.double()
    expected = [total.to(dtype) for total in sums]
    return max(
        ulps(torch.tensor(grad).view_as(r), r).max().item() for grad, r in zip(record["grads"], expected, strict=True)
    )


@pytest.mark.parametrize(
    "name", ["ddp_none", "ddp_stock_auto", "fsdp2_last_none", "fsdp2_last_mixed_none", "fsdp2_every_none"]
)
def test_two_ranks_accumulating_in_bfloat16_show_the_error_the_option_removes(two_ranks, name):
    rank0, _ = _records(two_ranks, name)
    assert _ulps(rank0) > 8.0  # measured: hundreds to thousands of ulps in the worst element


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("ddp_stock_float32", r"grad_accum_dtype='float32' under DDPStrategy.*DDPAccumulationStrategy"),
        ("fsdp2_every_bf16_shards", r"FSDP2 sharded parameters in torch.bfloat16: with gradient_sync='every'"),
    ],
)
def test_a_strategy_that_cannot_accumulate_wide_is_refused_on_every_rank(two_ranks, name, message):
    for record in _records(two_ranks, name):
        assert re.search(message, record["raised"])
        assert record["grads"] == []  # refused before any step


def test_two_ranks_reduce_float32_parameters_beside_bfloat16_ones(two_ranks):
    """DDP's own reduction is off for the window: the float32 head goes through the float32 sums too."""
    rank0, rank1 = _records(two_ranks, "ddp_mixed_float32")
    assert "raised" not in rank0, rank0.get("raised")
    assert rank0["grads"] == rank1["grads"]
    assert rank0["dtypes"] == ["torch.bfloat16", "torch.bfloat16", "torch.float32", "torch.float32"]


def test_two_ranks_leave_a_parameter_no_rank_used_without_a_gradient(two_ranks):
    rank0, rank1 = _records(two_ranks, "ddp_unused_float32")
    assert rank0["grads"][2:] == rank1["grads"][2:] == [None, None]  # the unused layer's weight and bias
    assert rank0["grads"][:2] == rank1["grads"][:2]


def test_two_ranks_refuse_a_static_graph_with_float32_sums(two_ranks):
    for record in _records(two_ranks, "ddp_static_float32"):
        assert "static_graph=True" in record["raised"]


def test_a_split_loader_batch_is_accumulated_in_float32_too():
    """Factor 1, loader batches of 32 split into 8 micro-batches of 4: a window of one batch, eight backwards."""
    x, y = make_data(8 * MICRO_BATCH)
    module = Module()
    callback = AccumulationScheduler({0: 1}, micro_batch_size=MICRO_BATCH, grad_accum_dtype="float32")
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8 * MICRO_BATCH)
    trainer([callback], max_steps=1, precision="bf16-true").fit(module, data)
    reference = reference_gradients(x, y, factor=8)
    assert max(bf16_ulps(g, r).max().item() for g, r in zip(module.seen, reference, strict=True)) <= 1.0


@pytest.mark.parametrize("spelling", ["auto", "Auto", "AUTO"])
def test_auto_is_read_in_any_case_as_the_dtype_names_are(spelling):
    features = AccumulationScheduler(grad_accum_dtype=spelling).features
    assert features["wide_accumulation"].dtype is torch.float32
    assert not features["wide_accumulation"].strict  # "auto": a warning where the strategy cannot, not an error
    assert AccumulationScheduler(grad_accum_dtype="FLOAT32").features["wide_accumulation"].strict


# ------------------------------------------------------------------ any factor, short windows, token weights
# The reference: each micro-batch's gradient of its own unscaled loss, by the same narrow module, summed in float32
# with the micro-batch's weight (1 / window size, or its tokens over the window's), rounded to the narrow dtype once.


def ulps(value: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """|value - reference| in units in the last place of ``reference``'s dtype (bfloat16: 7 bits, float16: 10)."""
    bits = {torch.bfloat16: 7, torch.float16: 10}[reference.dtype]
    reference, value = reference.float(), value.float()
    magnitude = torch.maximum(reference.abs(), value.abs()).clamp(min=torch.finfo(torch.float16).tiny)
    return (value - reference).abs() / torch.exp2(torch.floor(torch.log2(magnitude)) - bits)


class TokenModule(pl.LightningModule):
    """A narrow linear map on dict batches whose loss is the mean squared error over the entries labels keep."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return token_mse(self.net, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return RecordingSGD(self.parameters(), lr=0.0, seen=self.seen)  # lr 0: every window sees the same weights


def token_mse(net: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    kept = batch["labels"] != -100
    error = (net(batch["x"].to(net.weight.dtype)).float() - batch["y"]) ** 2
    return error[kept].mean().to(net.weight.dtype)  # the loss in the module's dtype, as a narrow model returns it


def token_data(samples: int) -> dict[str, torch.Tensor]:
    x, y = make_data(samples)
    generator = torch.Generator().manual_seed(5)
    kept = torch.rand(samples, FEATURES, generator=generator) < torch.rand(samples, 1, generator=generator)
    kept[:, 0] = True  # every row bears some loss
    return {"x": x, "y": y, "labels": torch.where(kept, 0, -100)}


def reference_windows(
    data: dict[str, torch.Tensor], windows: list[int], dtype: torch.dtype, tokens: bool
) -> list[list[torch.Tensor]]:
    net = make_net().to(dtype)
    result, start = [], 0
    for size in windows:
        # the precision plugin hands training_step floating-point inputs in the module's dtype
        parts = [
            {k: _as(v[i : i + MICRO_BATCH], dtype) for k, v in data.items()}
            for i in range(start, start + size * MICRO_BATCH, MICRO_BATCH)
        ]
        counts = [float((part["labels"] != -100).sum()) for part in parts]
        weights = [c / sum(counts) for c in counts] if tokens else [1.0 / size] * size
        sums = [torch.zeros_like(p, dtype=torch.float64) for p in net.parameters()]
        for part, weight in zip(parts, weights, strict=True):
            net.zero_grad()
            with _default_dtype(dtype):  # as bf16-true / 16-true run training_step
                loss = token_mse(net, part)
            loss.backward()
            for total, p in zip(sums, net.parameters(), strict=True):
                total += weight * p.grad.double()
        result.append([total.to(dtype) for total in sums])
        start += size * MICRO_BATCH
    return result


@pytest.mark.parametrize("precision", ["bf16-true", "16-true"])
@pytest.mark.parametrize(
    ("factor", "micro_batches", "tokens"),
    [(3, 3, False), (5, 5, False), (32, 32, False), (3, 5, False), (3, 5, True)],
    ids=["factor-3", "factor-5", "factor-32", "short-last-window", "token-weighted"],
)
def test_the_step_gradient_is_within_one_ulp_of_the_correctly_rounded_weighted_mean(
    precision, factor, micro_batches, tokens
):
    data = token_data(micro_batches * MICRO_BATCH)
    module = TokenModule()
    callback = AccumulationScheduler(
        {0: factor}, grad_accum_dtype="float32", normalize_by="token" if tokens else "micro_batch", log_metrics=False
    )
    loader = torch.utils.data.DataLoader(DictDataset(data), batch_size=MICRO_BATCH)
    trainer([callback], max_epochs=1, precision=precision).fit(module, loader)
    windows = [min(factor, micro_batches - start) for start in range(0, micro_batches, factor)]
    dtype = torch.bfloat16 if precision == "bf16-true" else torch.float16
    expected = [g for window in reference_windows(data, windows, dtype, tokens) for g in window]
    assert len(module.seen) == len(expected)
    worst = max(ulps(g, r).max().item() for g, r in zip(module.seen, expected, strict=True))
    assert worst <= 1.0


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Any:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _as(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


class ScaledModule(TokenModule):
    """A bfloat16 linear map times a float32 scale (kept float32 under bf16-true): the scale's gradient is float32."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, FEATURES).bfloat16().float())  # exact in bfloat16

    def on_train_start(self) -> None:
        self.scale.data = self.scale.data.float()  # bf16-true converted the module; this parameter stays float32

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        kept = batch["labels"] != -100
        error = (self.net(batch["x"].to(torch.bfloat16)).float() * self.scale - batch["y"]) ** 2
        return error[kept].mean().to(torch.bfloat16)


def _scale_gradient(data: dict[str, torch.Tensor], grad_accum_dtype: str | None) -> torch.Tensor:
    module = ScaledModule()
    callback = AccumulationScheduler({0: 3}, grad_accum_dtype=grad_accum_dtype, log_metrics=False)
    loader = torch.utils.data.DataLoader(DictDataset(data), batch_size=MICRO_BATCH)
    trainer([callback], max_epochs=1, precision="bf16-true").fit(module, loader)
    return module.seen[[p is module.scale for p in module.parameters()].index(True)]


def test_float32_parameters_in_a_bf16_model_get_the_mean_without_bias():
    """At factor 3 the loss is no longer divided in bfloat16 (1/3 -> 0.333984): no bias on float32 parameters."""
    data = token_data(3 * MICRO_BATCH)
    reference = ScaledModule()
    reference.net.to(torch.bfloat16)
    total = torch.zeros(FEATURES, dtype=torch.float64)
    for start in range(0, 3 * MICRO_BATCH, MICRO_BATCH):
        reference.zero_grad()
        part = {k: _as(v[start : start + MICRO_BATCH], torch.bfloat16) for k, v in data.items()}
        with _default_dtype(torch.bfloat16):
            loss = reference.training_step(part, 0)
        loss.backward()
        total += reference.scale.grad.double() / 3
    for grad_accum_dtype, bound in (("float32", 1e-6), (None, None)):
        scale_grad = _scale_gradient(data, grad_accum_dtype)
        assert scale_grad.dtype == torch.float32
        relative = ((scale_grad.double() - total) / total.abs().max()).abs().max().item()
        if bound is not None:
            assert relative <= bound
        else:  # the loss divided by 3 in bfloat16, as before: the 0.16% bias
            assert relative > 1e-3
