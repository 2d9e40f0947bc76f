"""Two real CPU processes (gloo): gradient collectives per optimizer step and weights against one big batch.

The scripts in tests/scripts are launched as a user would (``python script.py``, ``Trainer(devices=2)``); each runs
several configurations in one launch. The reference is plain PyTorch on one process: one SGD step per window on the
mean loss over every sample of the window on both ranks. Lightning gives each rank a shuffling DistributedSampler
(seed 0, reshuffled each epoch), so micro-step j of an epoch holds rank 0's and rank 1's j-th micro-batches of that
epoch's order; the reference draws the same orders from torch's DistributedSampler.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from two_ranks import LR, NUM_SAMPLES, make_data, make_net  # noqa: E402

from tests.helpers import (  # noqa: E402
    BACKENDS,
    FSDP2,
    NO_FSDP2,
    backends,
    exact_noise_scale,
    launch_environment,
    launched_ahead,
    make_tokens,
    rank_records,
    token_loss,
)

SCRIPTS = Path(__file__).resolve().parent / "scripts"
MICRO_BATCH = 4  # per rank
MICRO_STEPS_PER_EPOCH = 8
UNITS = 2  # FSDP units (two Linear layers): one reduce-scatter each per reduction
WINDOWS = {
    "stock_k4": [4, 4, 4, 4],
    "last_k3": [3, 3, 2, 3, 3, 2],  # the last window of each epoch holds the 2 micro-steps left
    "every_k3": [3, 3, 2, 3, 3, 2],
    "manual_k3": [3, 3, 2, 3, 3, 2],
    "last_step_schedule": [2, 2, 2, 2, 4, 4],  # {0: 2, 3: 4} by step: factor 4 from step 3, cut at the epoch end
    "sample_ragged_k3": [3, 3, 2, 3, 3, 2],  # 60 samples: each rank's last micro-batch holds 2
    "token_k3": [3, 3, 2, 3, 3, 2],
}
NUM_SAMPLES_OF = {"sample_ragged_k3": 60}
WINDOWS["reduce_scatter_k3"] = WINDOWS["every_k3"]  # no HSDP on 2 processes: the same as "every"
# (epoch, first micro-step, size): epoch 0 stops at micro-step 4, one micro-step into its second window
EXPLICIT = {name: [(0, 0, 3), (1, 0, 3), (1, 3, 3), (1, 6, 2)] for name in ("last_cut", "manual_cut")}
WINDOWS.update({name: [size for _, _, size in windows] for name, windows in EXPLICIT.items()})


def rank_micro_batches(epoch: int, num_samples: int = NUM_SAMPLES) -> list[list[list[int]]]:
    """``[micro-step][rank]``: each rank's micro-batch of ``epoch``, in the order Lightning feeds them."""
    orders = []
    for rank in (0, 1):
        sampler = DistributedSampler(range(num_samples), num_replicas=2, rank=rank, shuffle=True, seed=0)
        sampler.set_epoch(epoch)
        orders.append(list(sampler))
    return [
        [orders[rank][j * MICRO_BATCH : (j + 1) * MICRO_BATCH] for rank in (0, 1)] for j in range(MICRO_STEPS_PER_EPOCH)
    ]


def micro_step_indices(epoch: int, num_samples: int = NUM_SAMPLES) -> list[list[int]]:
    """The samples of each micro-step of ``epoch``, both ranks together, in the order Lightning feeds them."""
    return [first + second for first, second in rank_micro_batches(epoch, num_samples)]


def reference_weights(windows: list[int], name: str = "") -> dict[str, torch.Tensor]:
    num_samples = NUM_SAMPLES_OF.get(name, NUM_SAMPLES)
    x, y = make_data(num_samples)
    tokens = make_tokens(NUM_SAMPLES) if name.startswith("token") else None
    net = make_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    position = 0
    placed = []
    for size in windows:
        epoch, first = divmod(position, MICRO_STEPS_PER_EPOCH)
        placed.append((epoch, first, size))
        position += size
    for epoch, first, size in EXPLICIT.get(name, placed):
        assert first + size <= MICRO_STEPS_PER_EPOCH, "a window never spans epochs"
        index = torch.tensor(sum(micro_step_indices(epoch, num_samples)[first : first + size], []))
        optimizer.zero_grad()
        if tokens is None:  # the mean over every sample of the window
            nn.functional.mse_loss(net(x[index]), y[index]).backward()
        else:  # the mean over every loss-bearing token of the window
            token_loss(net, tokens["features"][index], tokens["labels"][index]).backward()
        optimizer.step()
    return {name: param.detach() for name, param in net.named_parameters()}


def max_deviation(record: dict, windows: list[int], name: str = "") -> float:
    reference = reference_weights(windows, name)
    assert set(record["weights"]) == set(reference)
    return max(
        (torch.tensor(record["weights"][name]) - reference[name].flatten()).abs().max().item() for name in reference
    )


def _launch(script: str, *args: str, out: Path, limit: int = 600, env: dict[str, str] | None = None) -> str:
    # `timeout -s KILL` kills the whole process group (Lightning's launcher starts rank 1 as rank 0's child, and
    # swallows SIGTERM): a hang fails the test instead of holding the suite
    done = subprocess.run(
        ["timeout", "-s", "KILL", str(limit), sys.executable, str(SCRIPTS / script), *args, str(out)],
        capture_output=True,
        text=True,
        check=False,
        env=launch_environment() | (env or {}),
    )
    output = done.stdout + done.stderr
    clues = [line for line in output.splitlines() if any(word in line for word in ("Error", "Traceback", "terminate"))]
    assert done.returncode != 137, f"killed after {limit} s: a rank hung; {clues[-20:]}"
    assert done.returncode == 0, f"exit {done.returncode}; {clues[-20:]}\n" + done.stdout[-2000:] + done.stderr[-4000:]
    (out / "output.txt").write_text(output)  # what the user saw
    return output


_records = rank_records


def _two_ranks(out: Path) -> Path:
    """Every configuration under DDP, then under FSDP2, in one launch (a process costs seconds of imports)."""
    _launch("two_ranks.py", ",".join(BACKENDS), out=out)
    return out


two_ranks = launched_ahead("two_ranks", _two_ranks)


@pytest.fixture(scope="module")
def ddp(two_ranks):
    return two_ranks / "ddp"


@pytest.fixture(scope="module")
def fsdp2(two_ranks):
    if not FSDP2:
        pytest.skip(NO_FSDP2)
    return two_ranks / "fsdp2"


def test_ddp_fits_print_no_warning_about_lightnings_deprecated_all_gather(two_ranks):
    output = (two_ranks / "output.txt").read_text()  # the DDP fits' and the FSDP2 fits'
    assert "torch.distributed.nn.functional.all_gather" not in output


@pytest.mark.parametrize("backend", backends("ddp", "fsdp2"))
def test_a_step_on_unreduced_gradients_raises_before_the_weights_change(backend, request):
    for record in _records(request.getfixturevalue(backend), "misuse_last_step"):
        assert "reduction across ranks has not run" in record["raised"]
        assert record["optimizer_steps"] == 0
    untouched = {name: param.detach().flatten().tolist() for name, param in make_net().named_parameters()}
    assert _records(request.getfixturevalue(backend), "misuse_last_step")[0]["weights"] == untouched


@pytest.mark.parametrize("backend", backends("ddp", "fsdp2"))
def test_the_noise_scale_under_ddp_and_fsdp2_converges_to_the_exact_value(backend, request):
    exact = exact_noise_scale(make_net(), *make_data(1024))  # the two-rank script's net and data
    rank0, _ = _records(request.getfixturevalue(backend), "noise_frozen_k4")
    # small batch: one rank's micro-batch of 4; big batch: 4 micro-steps x 2 ranks x 4 = 32 samples
    assert rank0["noise_scale"] == pytest.approx(exact, rel=0.25)


def test_the_noise_scale_squares_each_ranks_own_micro_batch_gradients_whatever_the_sync_policy(ddp):
    """With DDP reducing inside every backward (gradient_sync="every"), .grad after a backward holds the ranks' mean:
    the window's first micro-batch is then measured from its hooks, not from .grad, and the estimate is the one of
    gradient_sync="last" (the same frozen model, data and micro-batches)."""
    every, _ = _records(ddp, "noise_frozen_k4_every")
    last, _ = _records(ddp, "noise_frozen_k4")
    assert every["noise_scale"] is not None
    assert every["noise_trace"] == pytest.approx(last["noise_trace"], rel=1e-5)
    assert every["noise_grad_sq"] == pytest.approx(last["noise_grad_sq"], rel=1e-5)


def reference_noise_sums(windows: list[int], normalize_by: str, num_samples: int) -> list[tuple[float, float]]:
    """Plain PyTorch on one process: for each window, the mean squared norm of every micro-batch gradient of both
    ranks (each of its micro-batch's mean loss; those without items left out) and the squared norm of the window's
    gradient (the mean of the micro-batch means, or the mean over every item); then one SGD step on it."""
    x, y = make_data(num_samples)
    tokens = make_tokens(NUM_SAMPLES) if normalize_by == "token" else None
    net = make_net()
    params = list(net.parameters())
    optimizer = torch.optim.SGD(params, lr=LR)
    sums, position = [], 0
    for size in windows:
        epoch, first = divmod(position, MICRO_STEPS_PER_EPOCH)
        position += size
        micro: list[tuple[list[torch.Tensor], float]] = []
        for ranks in rank_micro_batches(epoch, num_samples)[first : first + size]:
            for index in map(torch.tensor, ranks):
                if tokens is None:
                    loss, items = nn.functional.mse_loss(net(x[index]), y[index]), float(len(index))
                else:
                    labels = tokens["labels"][index]
                    loss, items = token_loss(net, tokens["features"][index], labels), float((labels != -100).sum())
                micro.append(([g.detach() for g in torch.autograd.grad(loss, params)], items))
        weights = [1.0 if normalize_by == "micro_batch" else items for _, items in micro]
        step = [
            sum(g[i] * w for (g, _), w in zip(micro, weights, strict=True)) / sum(weights) for i in range(len(params))
        ]
        small = [sum(g.pow(2).sum() for g in grads).item() for grads, items in micro if items > 0]
        sums.append((sum(small) / len(small), sum(g.pow(2).sum() for g in step).item()))
        for param, grad in zip(params, step, strict=True):
            param.grad = grad
        optimizer.step()
    return sums


@pytest.mark.parametrize(
    ("name", "normalize_by", "num_samples"),
    [
        ("noise_sums_k3", "micro_batch", 64),
        ("noise_sums_sample_ragged", "sample", 60),
        ("noise_sums_token", "token", 64),
    ],
)
@pytest.mark.parametrize("backend", backends("ddp", "fsdp2"))
def test_every_measured_windows_two_sums_are_plain_pytorchs_over_both_ranks(
    backend, name, normalize_by, num_samples, request
):
    """Each rank squares its own micro-batch gradients (they differ from the other rank's: the ranks disagree on
    purpose); one all-reduce adds them up, so both ranks measure the same window, equal to plain PyTorch's. Under
    FSDP2 the micro-batch gradients are read on the unsharded parameters and the step's from the two shards."""
    rank0, rank1 = _records(request.getfixturevalue(backend), name)
    assert rank0["measurements"] == rank1["measurements"]
    expected = reference_noise_sums(WINDOWS["last_k3"], normalize_by, num_samples)
    assert sorted(map(int, rank0["measurements"])) == [2, 4, 6]  # every other window
    for step, (small, big) in rank0["measurements"].items():
        assert small == pytest.approx(expected[int(step) - 1][0], rel=1e-6), step
        assert big == pytest.approx(expected[int(step) - 1][1], rel=1e-6), step
    assert rank0["noise_scale"] == rank1["noise_scale"]


def test_every_gradient_a_callback_keeps_under_ddp_still_holds_its_steps_values(ddp):
    for record in _records(ddp, "noise_sums_k3"):
        assert record["kept_gradients"] == 6 * 4  # 6 steps of the net's 4 parameters
        assert record["kept_gradients_overwritten"] == 0


@pytest.mark.parametrize("backend", backends("ddp", "fsdp2"))
def test_adaptive_growth_is_decided_once_for_every_rank(backend, request):
    ddp = request.getfixturevalue(backend)
    rank0, rank1 = _records(ddp, "adaptive_k2")
    assert rank0["adaptive_factor"] >= 4  # it grew from 2
    assert rank0["adaptive_factor"] == rank1["adaptive_factor"]
    assert rank0["optimizer_steps"] == rank1["optimizer_steps"]
    reductions = "allreduce_buckets" if backend == "ddp" else "reduce_scatters"
    assert rank0[reductions] == rank1[reductions]  # the same windows, so the same reductions
    # rank 1's callback asked for a batch 64 times the noise scale: it still opens rank zero's windows
    disagree0, disagree1 = _records(ddp, "adaptive_disagree_k2")
    assert disagree0["adaptive_factor"] == disagree1["adaptive_factor"] == rank0["adaptive_factor"]
    assert disagree0["optimizer_steps"] == disagree1["optimizer_steps"] == rank0["optimizer_steps"]
    assert disagree0["weights"] == rank0["weights"]


@pytest.mark.parametrize("name", list(WINDOWS))
def test_ddp_matches_the_big_batch_reference(ddp, name):
    rank0, rank1 = _records(ddp, name)
    assert rank0["world_size"] == 2
    assert rank0["optimizer_steps"] == len(WINDOWS[name])
    assert max_deviation(rank0, WINDOWS[name], name) <= 1e-5


@pytest.mark.parametrize(
    ("name", "reductions"),
    [
        ("stock_k4", "per_step"),  # stock DDP already skips with a constant factor (no_sync)
        ("last_k3", "per_step"),
        ("last_step_schedule", "per_step"),  # and stays exact across a change in the middle of an epoch
        ("manual_k3", "per_step"),
        ("sample_ragged_k3", "per_step"),  # the weighting adds one scalar all-reduce, not a gradient one
        ("last_cut", "per_step"),  # the dropped window never reduced
        ("manual_cut", "per_step"),
        ("token_k3", "per_step"),
        ("every_k3", "per_micro_step"),
        ("reduce_scatter_k3", "per_micro_step"),
    ],
)
def test_ddp_all_reduces_once_per_bucket_per_optimizer_step(ddp, name, reductions):
    for record in _records(ddp, name):
        buckets = len(set(record["allreduce_buckets"]))
        assert buckets >= 1
        per = record["optimizer_steps"] if reductions == "per_step" else record["micro_steps"]
        assert len(record["allreduce_buckets"]) == per * buckets


@pytest.mark.parametrize("name", list(WINDOWS))
def test_fsdp2_matches_the_big_batch_reference(fsdp2, name):
    rank0, _ = _records(fsdp2, name)
    assert rank0["optimizer_steps"] == len(WINDOWS[name])
    assert max_deviation(rank0, WINDOWS[name], name) <= 1e-5


def test_stock_model_parallel_reduce_scatters_on_every_micro_step(fsdp2):
    for record in _records(fsdp2, "stock_k4"):
        assert record["micro_steps"] == 16
        assert record["reduce_scatters"] == UNITS * record["micro_steps"]  # 8 per optimizer step at factor 4


@pytest.mark.parametrize(
    "name", ["last_k3", "last_step_schedule", "manual_k3", "sample_ragged_k3", "token_k3", "last_cut", "manual_cut"]
)
def test_fsdp2_reduce_scatters_once_per_unit_per_optimizer_step_with_last(fsdp2, name):
    stock = _records(fsdp2, "stock_k4")[0]
    for record in _records(fsdp2, name):
        assert record["reduce_scatters"] == UNITS * record["optimizer_steps"]
        # skipping the reduction costs no extra parameter all-gathers
        if "cut" not in name:
            assert record["all_gathers"] == stock["all_gathers"]


@pytest.mark.parametrize("name", ["every_k3", "reduce_scatter_k3"])
def test_fsdp2_reduce_scatters_every_micro_step_with_every(fsdp2, name):
    for record in _records(fsdp2, name):
        assert record["reduce_scatters"] == UNITS * record["micro_steps"]


@pytest.mark.parametrize("backend", backends("ddp", "fsdp2"))
@pytest.mark.parametrize(("manual_name", "automatic_name"), [("manual_k3", "last_k3"), ("manual_cut", "last_cut")])
def test_manual_accumulation_equals_automatic(backend, manual_name, automatic_name, request):
    out = request.getfixturevalue(backend)
    manual, automatic = _records(out, manual_name), _records(out, automatic_name)
    for key in ("allreduce_buckets", "reduce_scatters", "all_gathers", "optimizer_steps", "micro_steps"):
        assert [r.get(key) for r in manual] == [r.get(key) for r in automatic], key
    for name, values in automatic[0]["weights"].items():
        assert torch.tensor(manual[0]["weights"][name]).sub(torch.tensor(values)).abs().max().item() <= 1e-6


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="Lightning's FSDPStrategy (FSDP1) needs 2 CUDA devices")
def test_fsdp1_end_to_end_on_cuda(tmp_path):
    _launch("two_ranks.py", "fsdp1", out=tmp_path)
    for name, windows in WINDOWS.items():
        rank0, rank1 = _records(tmp_path / "fsdp1", name)
        assert rank0["optimizer_steps"] == len(windows)
        assert max_deviation(rank0, windows, name) <= 1e-5, name
        if name != "stock_k4":
            per = rank0["micro_steps"] if name == "every_k3" else rank0["optimizer_steps"]
            assert rank0["reduce_scatters"] == rank1["reduce_scatters"] == UNITS * per, name


def _fsdp1_sync(out: Path) -> Path:
    _launch("fsdp1_sync.py", out=out)
    return out


fsdp1_sync = launched_ahead("fsdp1_sync", _fsdp1_sync)


def test_fsdp1_sync_control_on_the_real_fsdp_class(fsdp1_sync):
    last, every = (json.loads((fsdp1_sync / f"{policy}.json").read_text()) for policy in ("last", "every"))
    windows = WINDOWS["last_k3"]
    assert last["optimizer_steps"] == every["optimizer_steps"] == len(windows)
    assert last["reduce_scatters"] == UNITS * len(windows)
    assert every["reduce_scatters"] == UNITS * sum(windows)
    assert max_deviation(last, windows) <= 1e-5
    assert max_deviation(every, windows) <= 1e-5


# ------------------------------------------------------------------ ranks that disagree on purpose


@pytest.mark.parametrize("backend", backends("ddp", "fsdp2"))
@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("disagree_length", r"disagree on the number of training batches per epoch \(rank 0: 8, rank 1: 6\)"),
        ("disagree_micro_batch", r"disagree on the micro-batch size \(rank 0: 4, rank 1: 2\).*`micro_batch_size`"),
    ],
)
def test_ranks_that_disagree_on_their_data_raise_on_every_rank_before_training(backend, name, message, request):
    records = _records(request.getfixturevalue(backend), name)
    for record in records:
        assert re.search(message, record["raised"])
        assert record["optimizer_steps"] == 0
    assert records[0]["weights"] == records[1]["weights"] == _untouched()


@pytest.mark.parametrize("backend", backends("ddp", "fsdp2"))
def test_a_bad_count_on_one_rank_raises_on_every_rank_before_the_step(backend, request):
    rank0, rank1 = _records(request.getfixturevalue(backend), "disagree_bad_count")
    assert "returned nan for batch 1" in rank1["raised"]
    assert "on 1 other rank(s) up to the window ending at batch 2" in rank0["raised"]
    for record in (rank0, rank1):
        assert record["optimizer_steps"] == 0
        assert record["weights"] == _untouched()


@pytest.mark.parametrize("backend", backends("ddp", "fsdp2"))
def test_a_given_micro_batch_size_counts_the_same_samples_on_ranks_with_different_loaders(backend, request):
    rank0, rank1 = _records(request.getfixturevalue(backend), "disagree_micro_batch_given")
    # 8 samples a micro-step by the given size: 4 steps at factor 1, then factor 2 (2 steps left in epoch 0, 4 in 1)
    assert rank0["optimizer_steps"] == rank1["optimizer_steps"] == 10
    assert rank0["weights"] == rank1["weights"]


@pytest.mark.parametrize("backend", backends("ddp", "fsdp2"))
def test_a_rank_without_tokens_in_a_window_trains_as_one_big_batch(backend, request):
    """Rank 1's first window bears no loss at all: the step is the mean over rank 0's tokens, on both ranks."""
    rank0, rank1 = _records(request.getfixturevalue(backend), "disagree_tokens")
    assert rank0["weights"] == rank1["weights"]
    tokens = make_tokens(NUM_SAMPLES)
    tokens["labels"][32:44] = -100
    net = make_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    for _ in range(2):  # epochs: each rank's 8 micro-batches in order, in windows of 3, 3 and 2
        for first, size in ((0, 3), (3, 3), (6, 2)):
            index = [rank * 32 + 4 * j + i for rank in (0, 1) for j in range(first, first + size) for i in range(4)]
            optimizer.zero_grad()
            token_loss(net, tokens["features"][index], tokens["labels"][index]).backward()
            optimizer.step()
    for name, param in net.named_parameters():
        assert (torch.tensor(rank0["weights"][name]) - param.detach().flatten()).abs().max().item() <= 1e-5


def _untouched() -> dict[str, list[float]]:
    return {name: param.detach().flatten().tolist() for name, param in make_net().named_parameters()}


def _spawn(out: Path) -> Path:
    _launch("spawn.py", out=out, limit=300)
    return out


spawn = launched_ahead("spawn", _spawn)


def test_ddp_spawn_pickles_the_callback_with_every_option_and_manual_accumulation(spawn):
    """start_method="spawn" pickles the Trainer with its callbacks and strategy, and the module."""
    for name, steps in (("every_option", 8), ("manual", 5)):
        rank0, rank1 = (json.loads((spawn / f"{name}.rank{rank}.json").read_text()) for rank in (0, 1))
        assert rank0["optimizer_steps"] == rank1["optimizer_steps"] == steps
        assert rank0["weights"] == rank1["weights"]


@pytest.mark.parametrize("backend", backends("ddp", "fsdp2"))
def test_a_token_keyed_schedule_counts_the_tokens_of_both_ranks(backend, request):
    """{0: 1, 30: 3, 200: 2} by loss-bearing tokens, both ranks together: the windows of the plain-PyTorch loop."""
    rank0, rank1 = _records(request.getfixturevalue(backend), "token_unit")
    assert rank0["weights"] == rank1["weights"]
    schedule = {0: 1, 30: 3, 200: 2}
    tokens = make_tokens(NUM_SAMPLES)
    features, labels = tokens["features"], tokens["labels"]
    net = make_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    seen, windows = 0, []
    for epoch in range(2):
        steps = micro_step_indices(epoch)
        first = 0
        while first < MICRO_STEPS_PER_EPOCH:
            size = min(schedule[max(key for key in schedule if key <= seen)], MICRO_STEPS_PER_EPOCH - first)
            window = steps[first : first + size]
            optimizer.zero_grad()  # each rank's micro-batch weighs the same: the mean of their token means
            halves = [index[:MICRO_BATCH] for index in window] + [index[MICRO_BATCH:] for index in window]
            (sum(token_loss(net, features[h], labels[h]) for h in halves) / len(halves)).backward()
            optimizer.step()
            seen += sum(int((labels[index] != -100).sum()) for index in window)
            windows.append(size)
            first += size
    assert len(set(windows)) == 3
    assert rank0["optimizer_steps"] == len(windows)
    for name, param in net.named_parameters():
        assert (torch.tensor(rank0["weights"][name]) - param.detach().flatten()).abs().max().item() <= 1e-5


def _full_epoch_reference(epochs: int = 2) -> dict[str, torch.Tensor]:
    """One SGD step per epoch on the mean over all 64 samples (each step: both ranks' two loader batches of 16)."""
    x, y = make_data(NUM_SAMPLES)
    net = make_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    for _ in range(epochs):
        optimizer.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        optimizer.step()
    return {name: param.detach() for name, param in net.named_parameters()}


def _deviation(record: dict, reference: dict[str, torch.Tensor]) -> float:
    return max((torch.tensor(record["weights"][k]) - v.flatten()).abs().max().item() for k, v in reference.items())


@pytest.mark.parametrize("backend", backends("ddp", "fsdp2"))
def test_splitting_loader_batches_on_two_ranks_equals_the_whole_batches(backend, request):
    rank0, rank1 = _records(request.getfixturevalue(backend), "split_m5")
    assert rank0["optimizer_steps"] == 2
    assert rank0["weights"] == rank1["weights"]
    assert _deviation(rank0, _full_epoch_reference()) <= 1e-5


def test_auto_on_two_ranks_where_one_runs_out_of_memory_settles_both_at_the_same_size(ddp):
    rank0, rank1 = _records(ddp, "auto_oom_rank1")
    assert "raised" not in rank0, rank0.get("raised")
    assert rank0["optimizer_steps"] == rank1["optimizer_steps"] == 2
    assert rank0["micro_batch_size_found"] == rank1["micro_batch_size_found"] == 4
    assert rank0["weights"] == rank1["weights"]
    assert _deviation(rank0, _full_epoch_reference()) <= 1e-5


def test_auto_is_refused_under_fsdp2_on_every_rank(fsdp2):
    for record in _records(fsdp2, "auto_oom_rank1"):
        assert "cannot retry a batch under FSDP2" in record["raised"]
        assert record["optimizer_steps"] == 0
