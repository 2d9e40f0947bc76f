"""A checkpoint resumes exactly on another number of processes: in the middle of an epoch, at its end, after a SIGKILL.

tests/scripts/resume_ranks.py trains with ``AccumulationScheduler(target_batch_size=32)`` on 1 or 2 CPU processes
(factor 8 or 4: the global batch is 32 either way), and resumes on 1 or 2 the checkpoints written at step 4 (half of
epoch 0, at a window boundary), at step 8 (epoch 0's last batch), at epoch 0's end (``on_train_epoch_end``) and, by
a run SIGKILLed inside the window of step 7, ``last.ckpt`` at step 6. A resumed run keeps the global order of the run
that wrote the checkpoint: on one process the loader's sequential order, on two the shuffled order of the
DistributedSampler Lightning gives each rank (seed 0, reshuffled each epoch), dealt to the resumed run's processes
from the first sample not consumed. It must end where the uninterrupted run of the checkpoint's world size ends,
after every window trained on the reference's samples.

Other configurations resumed on another number of processes (the script's ``--config``): a fixed factor 4 and no
target batch, whose global batch changes with the processes, and says so once; and adaptive growth, whose factor is
carried so that the global batch it had reached stays, or the fit refuses where no whole factor keeps it.

The reference is plain PyTorch on one process (no Lightning): per epoch the global order, one SGD step per 32
consecutive positions on the mean loss over those 32 samples. Each run is a process of its own (a resume starts
afresh, as a user's does), forked from one interpreter that has imported Lightning (tests.helpers.run_forked).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from resume_ranks import (  # noqa: E402
    EPOCHS,
    GLOBAL_BATCH,
    KILL_STEP,
    LR,
    MICRO_BATCH,
    MODEL_SEED,
    MOMENTUM,
    SAMPLES,
    SEED,
)

from tests.helpers import launched_ahead, make_data, make_net, run_forked  # noqa: E402

SCRIPT = Path(__file__).resolve().parent / "scripts" / "resume_ranks.py"
STEPS = EPOCHS * SAMPLES // GLOBAL_BATCH  # 16 optimizer steps, 8 an epoch
# name -> (mode, processes); the whole runs write step=4.ckpt, step=8.ckpt, ..., the killed ones last.ckpt at step 6
RUNS = {"whole2": ("whole", 2), "whole1": ("whole", 1), "kill1": ("kill", 1), "kill2": ("kill", 2)}
# step 4 (half of epoch 0) and step 8 (its last batch), written at on_train_batch_end; and epoch 0's own checkpoint,
# written at on_train_epoch_end
MIDDLE, END, EPOCH_END = "step=4.ckpt", "step=8.ckpt", "epochs/epoch=0.ckpt"
# name -> (the run that wrote the checkpoint, the checkpoint, processes of the resumed run, its first step)
RESUMES = {
    "2to1_middle": ("whole2", MIDDLE, 1, 4),
    "1to2_middle": ("whole1", MIDDLE, 2, 4),
    "2to1_end": ("whole2", END, 1, 8),
    "1to2_end": ("whole1", END, 2, 8),
    "2to2_middle": ("whole2", MIDDLE, 2, 4),
    "killed_2to1": ("kill2", "last.ckpt", 1, KILL_STEP),
    "2to2_end": ("whole2", END, 2, 8),
    "2to1_epoch_end": ("whole2", EPOCH_END, 1, 8),
    "1to2_epoch_end": ("whole1", EPOCH_END, 2, 8),
    "killed_1to2": ("kill1", "last.ckpt", 2, KILL_STEP),
}
# the other configurations (resume_ranks.CONFIGS), launched with the runs above: name -> (configuration, processes)
CONFIG_RUNS = {"fixed2": ("fixed", 2), "adaptive2": ("adaptive", 2), "adaptive1": ("adaptive", 1)}
GROWN = "the first checkpoint whose adaptive factor has grown"  # found by _first_grown once the run has ended
ODD = "adaptive1_odd.ckpt"  # fault injection: adaptive1's GROWN checkpoint with its adaptive factor made 3
# name -> (configuration, the run whose checkpoint it resumes, the checkpoint, processes of the resumed run)
CONFIG_RESUMES = {
    "fixed_2to1": ("fixed", "fixed2", MIDDLE, 1),  # step 4 of 32 samples: half of epoch 0
    "adaptive_2to1": ("adaptive", "adaptive2", GROWN, 1),
    "adaptive_1to2": ("adaptive", "adaptive1", GROWN, 2),
    "adaptive_odd_1to2": ("adaptive", "adaptive1", ODD, 2),
}
# what a fixed factor resumed on another number of processes prints (lightning_accum/core/data_position.py), and its
# start, which no target_batch_size run may print
GLOBAL_BATCH_LINE = (
    "AccumulationScheduler: resumed on {now} process(es) from a checkpoint written on {was}: the global batch is now"
    " {batch} samples (factor {factor} x micro-batch {micro} x {now}), was {old}. `target_batch_size={old}` keeps it"
    " on any number of processes"
)
GLOBAL_BATCH_START = "from a checkpoint written on"
# what adaptive growth resumed on another number of processes prints (lightning_accum/features/adaptive_growth.py)
CARRIED_LINE = (
    "AccumulationScheduler: adaptive growth resumed on {now} process(es) from a checkpoint written on {was}: factor"
    " {factor} -> {carried} keeps the global batch of {batch} samples"
)


def _state(checkpoint: Path) -> dict[str, Any]:
    """The AccumulationScheduler's state in ``checkpoint``."""
    return torch.load(checkpoint, weights_only=False)["callbacks"]["AccumulationScheduler"]


def _first_grown(folder: Path) -> Path | None:
    """The first checkpoint (by step) of an adaptive whole run whose adaptive factor has grown (is above 0)."""
    for path in sorted(folder.glob("step=*.ckpt"), key=lambda path: int(path.stem.split("=")[1])):
        if _state(path)["adaptive"]["factor"] > 0:
            return path
    return None


def _config_checkpoint(root: Path, name: str) -> Path | None:
    """The checkpoint the resume ``name`` of CONFIG_RESUMES starts from (``None``: its run wrote none that fits)."""
    _, run, checkpoint, _ = CONFIG_RESUMES[name]
    if checkpoint == GROWN:
        return _first_grown(root / run)
    path = root / (checkpoint if checkpoint == ODD else f"{run}/{checkpoint}")
    return path if path.exists() else None


def _inject_odd_factor(root: Path) -> None:
    """Fault injection: adaptive1's first grown checkpoint, written on 1 process, with its adaptive factor made 3.

    With this data adaptive growth doubles 2 -> 4 -> 8, so a real run reaches no odd factor cheaply; an odd one (a
    global batch of 3 micro-batches) is what 2 processes cannot hold in whole micro-batches.
    """
    grown = _first_grown(root / "adaptive1")
    if grown is None:
        return
    checkpoint = torch.load(grown, weights_only=False)
    checkpoint["callbacks"]["AccumulationScheduler"]["adaptive"]["factor"] = 3
    torch.save(checkpoint, root / ODD)


def _launch(root: Path) -> tuple[Path, dict[str, tuple[int, str]], dict[str, tuple[int, str]] | AssertionError]:
    """The uninterrupted and killed runs, then every resume of their checkpoints, each a process of its own.

    The runs and resumes of the other configurations go in the same two batches, under their names.
    """
    jobs = {name: [str(SCRIPT), str(root), name, mode, str(world)] for name, (mode, world) in RUNS.items()}
    for name, (config, world) in CONFIG_RUNS.items():
        jobs[name] = [str(SCRIPT), str(root), name, "whole", str(world), "--config", config]
    runs = run_forked(jobs, preload=["lightning.pytorch", "lightning_accum"], folder=root, limit=240)
    _inject_odd_factor(root)
    jobs = {
        name: [str(SCRIPT), str(root), name, "resume", str(world), str(root / run / checkpoint)]
        for name, (run, checkpoint, world, _) in RESUMES.items()
    }
    for name, (config, _, _, world) in CONFIG_RESUMES.items():
        path = _config_checkpoint(root, name)
        if path is not None:  # else its test says the run wrote no such checkpoint
            jobs[name] = [str(SCRIPT), str(root), name, "resume", str(world), str(path), "--config", config]
    try:
        resumes: Any = run_forked(jobs, preload=["lightning.pytorch", "lightning_accum"], folder=root, limit=240)
    except AssertionError as error:  # a resume that hangs fails the resume tests, not those of the runs before
        resumes = error
    return root, runs, resumes


launched = launched_ahead("launched", _launch)


def global_order(world_size: int, epoch: int) -> torch.Tensor:
    """The dataset indices of ``epoch`` in the order a run on ``world_size`` processes consumes them, all together.

    One process: the loader's own order (``shuffle=False``). Two: rank r takes positions r, r + 2, ... of the
    DistributedSampler's permutation, so the ranks' micro-batches j hold positions 8j to 8j + 7 of it together.
    """
    if world_size == 1:
        return torch.arange(SAMPLES)
    return torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(SEED + epoch))


def reference(world_size: int) -> tuple[dict[str, torch.Tensor], list[list[int]]]:
    """Plain PyTorch: one SGD step (momentum 0.5) per 32 consecutive positions of each epoch's global order, on
    their mean loss.

    The final weights, and each step's dataset indices (sorted).
    """
    x, y = make_data(SAMPLES)
    net = make_net(MODEL_SEED)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    windows = []
    for epoch in range(EPOCHS):
        order = global_order(world_size, epoch)
        for start in range(0, SAMPLES, GLOBAL_BATCH):
            index = order[start : start + GLOBAL_BATCH]
            optimizer.zero_grad()
            nn.functional.mse_loss(net(x[index]), y[index]).backward()
            optimizer.step()
            windows.append(sorted(index.tolist()))
    return {name: param.detach().flatten() for name, param in net.named_parameters()}, windows


def _records(root: Path, name: str, world_size: int) -> list[dict[str, Any]]:
    return [json.loads((root / f"{name}.rank{rank}.json").read_text()) for rank in range(world_size)]


def _windows(records: list[dict[str, Any]]) -> dict[int, list[int]]:
    """Optimizer step (0-based) -> the dataset indices every rank trained on in its window, sorted."""
    windows: dict[int, list[int]] = {}
    for record in records:
        for step, indices in record["steps"].items():
            windows.setdefault(int(step), []).extend(indices)
    return {step: sorted(indices) for step, indices in sorted(windows.items())}


def _differences(trained: dict[int, list[int]], windows: list[list[int]]) -> dict[int, str]:
    """Step -> how its samples differ from the reference's window (``windows[step]``)."""
    wrong = {}
    for step, expected in enumerate(windows):
        got = trained.get(step)
        if got is None:
            wrong[step] = "not trained"
        elif got != expected:
            foreign, repeated = len(set(got) - set(expected)), len(got) - len(set(got))
            wrong[step] = f"{foreign} of {len(got)} not in the reference's window, {repeated} repeated"
    return wrong


def _deviation(weights: dict[str, list[float]], other: dict[str, Any]) -> float:
    assert weights.keys() == other.keys()
    return max((torch.tensor(weights[key]) - torch.as_tensor(other[key])).abs().max().item() for key in weights)


def _finished(outcomes: dict[str, tuple[int, str]], name: str) -> str:
    status, output = outcomes[name]
    assert status == 0, f"{name}: exit {status}\n{output[-4000:]}"
    return output


def _resumes(launched: Any) -> dict[str, tuple[int, str]]:
    resumes = launched[2]
    if isinstance(resumes, AssertionError):
        raise resumes
    return resumes


@pytest.mark.parametrize("world_size", [1, 2])
def test_an_uninterrupted_run_matches_the_plain_pytorch_reference(launched, world_size):
    """Validates the reference, and the records the resume tests read: the same weights, and each step's samples
    those of 32 consecutive positions of the global order, on either number of processes."""
    root, runs, _ = launched
    _finished(runs, f"whole{world_size}")
    records = _records(root, f"whole{world_size}", world_size)
    weights, windows = reference(world_size)
    for record in records:
        assert record["world_size"] == world_size
        assert (record["start_step"], record["global_step"]) == (0, STEPS)
        assert record["weights"] == records[0]["weights"]  # every rank holds the same model
    assert _windows(records) == dict(enumerate(windows))
    assert _deviation(records[0]["weights"], weights) <= 1e-5
    folder = root / f"whole{world_size}"
    assert {str(path.relative_to(folder)) for path in folder.rglob("*.ckpt")} >= {MIDDLE, END, EPOCH_END}


@pytest.mark.parametrize("name", list(RESUMES))
def test_a_checkpoint_resumes_exactly_on_another_number_of_processes(launched, name):
    """The resumed run ends within 1e-6 of the uninterrupted run of the checkpoint's world size, at the same step,
    and every window of the whole run (the checkpointed run's before the checkpoint, the resumed run's after) trained
    on the reference's samples for that window: none repeated, none skipped, in the checkpointed run's order."""
    root, runs, _ = launched
    run, _, world_size, first_step = RESUMES[name]
    if run.startswith("kill"):
        status, output = runs[run]
        assert status == -9, f"{run} was not SIGKILLed (exit {status}): {output[-3000:]}"
    _finished(_resumes(launched), name)
    saved_world = RUNS[run][1]
    records = _records(root, name, world_size)
    for record in records:
        assert record["world_size"] == world_size
        assert (record["start_step"], record["global_step"]) == (first_step, STEPS), "(first step, last step)"
        assert record["weights"] == records[0]["weights"]
    # the steps before the checkpoint from the run that wrote it (the killed one's file is written as it dies)
    written = _windows(_records(root, run, saved_world))
    trained = {step: indices for step, indices in written.items() if step < first_step} | _windows(records)
    _, windows = reference(saved_world)
    wrong = _differences(trained, windows)
    assert not wrong, f"steps (0-based) whose samples differ from the reference's: {wrong}"
    assert sorted(trained) == list(range(STEPS))
    uninterrupted = _records(root, f"whole{saved_world}", saved_world)[0]
    deviation = _deviation(records[0]["weights"], uninterrupted["weights"])
    assert deviation <= 1e-6, f"{deviation:.3g} from the uninterrupted run on {saved_world} process(es)"


@pytest.mark.parametrize("name", [name for name in RESUMES if name.endswith("_end")])
def test_a_resume_at_an_epochs_end_warns_of_no_resume_in_the_middle_of_an_epoch(launched, name):
    """A checkpoint written at epoch 0's end holds 32 loader batches done of 64 on one process, or 32 of 32 on two:
    counted in batches, a resume on the other number looks like one in the middle of an epoch. It is not."""
    output = _finished(_resumes(launched), name)
    assert "middle of an epoch" not in output, output[-3000:]


@pytest.mark.parametrize("name", list(RESUMES))
def test_no_exact_resume_prints_lightnings_warning_that_it_ended_before_the_epoch(launched, name):
    """Lightning warns of a checkpoint "that ended before the epoch ended" from ``global_step`` modulo its own
    steps per epoch, which assume one loader batch per step (its ``accumulate_grad_batches`` is 1 here): at 8 steps
    of 32 or 64 batches an epoch it would warn on every resume, of unreliable results, while each is exact."""
    output = _finished(_resumes(launched), name)
    assert "ended before the epoch ended" not in output, output[-3000:]


# ------------------------------------------------------------------ other configurations


def _config_resume(launched: Any, name: str) -> tuple[Path, Path, tuple[int, str]]:
    """``(root, the checkpoint, (exit status, output))`` of the resume ``name`` of CONFIG_RESUMES."""
    root, runs, _ = launched
    _, run, checkpoint, _ = CONFIG_RESUMES[name]
    _finished(runs, run)
    path = _config_checkpoint(root, name)
    assert path is not None, f"{run} wrote no checkpoint for {name} ({checkpoint})"
    return root, path, _resumes(launched)[name]


def _trained(windows: list[list[int]]) -> dict[str, torch.Tensor]:
    """Plain PyTorch: one SGD step (momentum 0.5) per window of dataset indices, on their mean loss."""
    x, y = make_data(SAMPLES)
    net = make_net(MODEL_SEED)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    for index in windows:
        optimizer.zero_grad()
        nn.functional.mse_loss(net(x[index]), y[index]).backward()
        optimizer.step()
    return {name: param.detach().flatten() for name, param in net.named_parameters()}


def test_a_fixed_factor_resumed_on_another_number_of_processes_prints_the_changed_global_batch_once(launched):
    """``scheduling={0: 4}`` checkpointed on 2 processes (4 x micro-batch 4 x 2 = 32 samples) and resumed on 1: one
    line says the global batch is now 16 samples, was 32, and that ``target_batch_size=32`` keeps it; the
    uninterrupted run, never resumed, says nothing of it."""
    _, _, (status, output) = _config_resume(launched, "fixed_2to1")
    assert status == 0, f"fixed_2to1: exit {status}\n{output[-4000:]}"
    line = GLOBAL_BATCH_LINE.format(now=1, was=2, batch=16, factor=4, micro=MICRO_BATCH, old=32)
    assert output.count(line) == 1, output[-3000:]
    assert output.count(GLOBAL_BATCH_START) == 1, output[-3000:]
    assert GLOBAL_BATCH_START not in _finished(launched[1], "fixed2")


def test_a_fixed_factor_resumed_on_one_process_goes_on_in_windows_of_16_samples_of_the_two_process_order(launched):
    """The global batch the line announces is the one trained: after 4 steps of 32 samples on 2 processes, the run
    on 1 takes windows of 16 consecutive positions of the 2-process order (the rest of epoch 0 from position 128,
    then epoch 1), 8 + 16 steps, and ends within 1e-5 of plain PyTorch trained on those windows."""
    root, _, (status, output) = _config_resume(launched, "fixed_2to1")
    assert status == 0, f"fixed_2to1: exit {status}\n{output[-4000:]}"
    (record,) = _records(root, "fixed_2to1", 1)
    first = SAMPLES // 2 // GLOBAL_BATCH  # 4 steps of 32: half of epoch 0
    half = 16  # factor 4 x micro-batch 4 x 1 process
    assert record["first_window"] == {"factor": 4, "adaptive": None}
    assert (record["start_step"], record["global_step"]) == (first, first + (SAMPLES // 2 + SAMPLES) // half)
    orders = [global_order(2, epoch) for epoch in range(EPOCHS)]
    windows = [
        sorted(orders[0][start : start + GLOBAL_BATCH].tolist()) for start in range(0, SAMPLES // 2, GLOBAL_BATCH)
    ]
    windows += [sorted(orders[0][start : start + half].tolist()) for start in range(SAMPLES // 2, SAMPLES, half)]
    windows += [sorted(orders[1][start : start + half].tolist()) for start in range(0, SAMPLES, half)]
    written = _windows(_records(root, "fixed2", 2))
    trained = {step: indices for step, indices in written.items() if step < first} | _windows([record])
    wrong = _differences(trained, windows)
    assert not wrong, f"steps (0-based) whose samples differ from the expected windows: {wrong}"
    assert sorted(trained) == list(range(len(windows)))
    deviation = _deviation(record["weights"], _trained(windows))
    assert deviation <= 1e-5, f"{deviation:.3g} from plain PyTorch on the same windows"


def test_a_target_batch_size_resumed_on_any_number_of_processes_never_prints_the_global_batch_line(launched):
    """``target_batch_size=32`` keeps the global batch on 1 or 2 processes: none of its runs, resumed on the same
    number of processes or another, prints the line a fixed factor prints."""
    _, runs, _ = launched
    outputs = {name: runs[name][1] for name in RUNS} | {name: _finished(_resumes(launched), name) for name in RESUMES}
    printed = [name for name, output in outputs.items() if GLOBAL_BATCH_START in output]
    assert not printed, f"printed by {printed}: {outputs[printed[0]][-3000:] if printed else ''}"


@pytest.mark.parametrize("name", ["adaptive_2to1", "adaptive_1to2"])
def test_adaptive_growth_resumed_on_another_number_of_processes_keeps_the_global_batch(launched, name):
    """The first checkpoint whose adaptive factor F has grown (written on W processes: ``world_size`` in its state),
    resumed on W' processes, opens its first window at factor F x W / W' (adaptive and in force), so factor x
    processes x micro-batch is the global batch of the checkpointed run's last window before the checkpoint; it says
    so once, and prints no fixed factor's line. Every sample is trained once an epoch over both runs together."""
    root, checkpoint, (status, output) = _config_resume(launched, name)
    assert status == 0, f"{name}: exit {status}\n{output[-4000:]}"
    _, run, _, world = CONFIG_RESUMES[name]
    saved_world = CONFIG_RUNS[run][1]
    state = _state(checkpoint)["adaptive"]
    factor = state["factor"]
    assert state["world_size"] == saved_world
    carried, batch = factor * saved_world // world, factor * saved_world * MICRO_BATCH
    assert carried * world * MICRO_BATCH == batch, f"factor {factor} on {saved_world} is no whole factor on {world}"
    records = _records(root, name, world)
    first_step = torch.load(checkpoint, weights_only=False)["global_step"]
    for record in records:
        assert record["start_step"] == first_step
        assert record["first_window"] == {"factor": carried, "adaptive": carried}, "the first window's factors"
        assert record["weights"] == records[0]["weights"]
    line = CARRIED_LINE.format(now=world, was=saved_world, factor=factor, carried=carried, batch=batch)
    assert output.count(line) == 1, output[-3000:]
    assert output.count("adaptive growth resumed on") == 1, output[-3000:]
    assert GLOBAL_BATCH_START not in output.replace(line, ""), output[-3000:]
    written = _windows(_records(root, run, saved_world))
    resumed = _windows(records)
    assert len(written[first_step - 1]) == batch, "the checkpointed run's last window: the global batch it had reached"
    assert len(resumed[first_step]) == batch, "the resumed run's first window (all processes)"
    trained = [index for step, indices in written.items() if step < first_step for index in indices]
    trained += [index for indices in resumed.values() for index in indices]
    assert sorted(trained) == sorted(list(range(SAMPLES)) * EPOCHS), "each sample once an epoch"


def test_an_adaptive_factor_that_no_whole_factor_carries_refuses_the_resume_before_any_weight_changes(launched):
    """Fault injection (a real 1-process checkpoint whose adaptive factor is edited to 3: this data grows it 2 -> 4
    -> 8): resumed on 2 processes, the global batch of 3 micro-batches is none 2 processes hold in whole micro-batches.
    The fit raises ValueError naming the nearest whole factor (2), having trained no batch: the weights are the
    checkpoint's."""
    root, checkpoint, (status, output) = _config_resume(launched, "adaptive_odd_1to2")
    state = _state(checkpoint)["adaptive"]
    assert (state["factor"], state["world_size"]) == (3, 1), "the injected fault"
    assert status not in (0, -9), f"adaptive_odd_1to2 did not fail (exit {status}): {output[-3000:]}"
    assert "ValueError" in output, output[-3000:]
    assert "the nearest whole factor is 2" in output, output[-3000:]
    record = _records(root, "adaptive_odd_1to2", 1)[0]  # rank 0's: rank 1 may be stopped before it writes its own
    assert str(record["error"]).startswith("ValueError: "), record["error"]
    assert "the nearest whole factor is 2" in record["error"]
    written = torch.load(checkpoint, weights_only=False)
    assert record["steps"] == {}, "batches trained before the error"
    assert record["global_step"] == written["global_step"]
    weights = {key.removeprefix("net."): value for key, value in written["state_dict"].items()}
    assert _deviation(record["weights"], {key: value.flatten() for key, value in weights.items()}) == 0.0
