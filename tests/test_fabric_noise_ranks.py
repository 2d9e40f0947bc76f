"""The noise scale and adaptive growth in Fabric loops on two real CPU processes (gloo), DDP and FSDP2.

tests/scripts/fabric_noise_ranks.py runs every configuration in one launch. Each rank trains the tiny LM on its own
padded pairs, token-weighted: the ranks' micro-batch gradients and token counts differ on purpose, and every rank must
still hold the same estimate and open the same windows. The reference is plain PyTorch on one process.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from fabric_common import LR, TinyLM, make_pairs, mean_loss, micro_batches  # noqa: E402

from tests.helpers import FSDP2, NO_FSDP2, backends, launch_ranks, launched_ahead, rank_records  # noqa: E402

SCRIPT = Path(__file__).resolve().parent / "scripts" / "fabric_noise_ranks.py"

launched = launched_ahead("launched", lambda out: launch_ranks(SCRIPT, out))


records = rank_records


def reference_sums(factor: int = 2) -> list[tuple[float, float]]:
    """Plain PyTorch: per window, the mean squared norm of every micro-batch gradient of both ranks (of its own mean
    loss over its tokens; those without tokens left out) and the squared norm of the window's gradient (the mean over
    all its tokens); then one SGD step on it."""
    ranks = [micro_batches(make_pairs(24, seed=10 + rank), 3) for rank in (0, 1)]
    model = TinyLM()
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=LR)
    sums = []
    for start in range(0, 8, factor):
        grads, tokens = [], []
        for batch in ranks[0][start : start + factor] + ranks[1][start : start + factor]:
            count = int((batch["labels"][:, 1:] != -100).sum())
            if count:
                grads.append(torch.autograd.grad(mean_loss(model, batch), params))
                tokens.append(count)
        step = [sum(g[i] * n for g, n in zip(grads, tokens, strict=True)) / sum(tokens) for i in range(len(params))]
        small = sum(sum(g.double().pow(2).sum() for g in grad) for grad in grads) / len(grads)
        sums.append((float(small), float(sum(g.double().pow(2).sum() for g in step))))
        for param, grad in zip(params, step, strict=True):
            param.grad = grad
        optimizer.step()
    return sums


@pytest.mark.parametrize("backend", backends("ddp", "fsdp2"))
def test_every_measured_windows_two_sums_are_plain_pytorchs_over_both_ranks(launched, backend):
    """Under FSDP2 each micro-batch gradient is squared on the unsharded parameters and the step's on the two
    shards; the first window is measured too (its unsharded parameters exist from its first forward)."""
    rank0, rank1 = records(launched, f"{backend}_sums_k2")
    assert rank0["measurements"] == rank1["measurements"]
    expected = reference_sums()
    assert sorted(map(int, rank0["measurements"])) == [1, 2, 3, 4]
    for step, (small, big) in rank0["measurements"].items():
        assert small == pytest.approx(expected[int(step) - 1][0], rel=1e-5), step
        assert big == pytest.approx(expected[int(step) - 1][1], rel=1e-5), step


@pytest.mark.parametrize("backend", backends("ddp", "fsdp2"))
def test_adaptive_growth_from_factor_1_is_decided_once_for_every_rank(launched, backend):
    rank0, rank1 = records(launched, f"{backend}_adaptive_k1")
    assert rank0["factors"][0] == 1
    assert rank0["adaptive_factor"] >= 4  # it grew
    assert rank0["factors"] == rank1["factors"]
    assert rank0["weights"] == rank1["weights"]
    # rank 1's Accumulator asked for a batch 64 times the noise scale: it still opens rank zero's windows
    disagree0, disagree1 = records(launched, f"{backend}_adaptive_k1_disagree")
    assert disagree0["factors"] == disagree1["factors"] == rank0["factors"]
    assert disagree0["weights"] == disagree1["weights"] == rank0["weights"]


@pytest.mark.skipif(not FSDP2, reason=NO_FSDP2)
def test_fsdp2_measures_and_decides_as_ddp_does(launched):
    ddp, fsdp2 = records(launched, "ddp_adaptive_k1")[0], records(launched, "fsdp2_adaptive_k1")[0]
    assert fsdp2["factors"] == ddp["factors"]
    assert fsdp2["measurements"].keys() == ddp["measurements"].keys()
    for step, sums in fsdp2["measurements"].items():
        assert sums == pytest.approx(ddp["measurements"][step], rel=1e-5)
    for name, values in fsdp2["weights"].items():
        assert values == pytest.approx(ddp["weights"][name], abs=1e-5)
