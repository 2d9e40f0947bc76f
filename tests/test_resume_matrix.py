"""Every configuration with state resumes exactly: from a checkpoint at a window boundary, and after a SIGKILL.

The configurations (tests/scripts/resume_run.py) cover each kind of state the callback keeps: schedules by epoch,
step, sample and token, ramps by samples and by tokens, LR scaling with warmup, the noise scale, adaptive growth
(from factor 1 too, with a SampleDrivenLR schedule), token weighting, a loss that couples its batch's rows
(``cached``, whose loader batches are never split), and all of them together. Each resumed run
must end within 1e-6 of the uninterrupted run, with the same number of optimizer steps.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from resume_run import (  # noqa: E402
    CONFIGS,
    EPOCHS,
    full_weights,
    make_callback,
    make_loader,
    make_module,
)

from lightning_accum import AccumulationScheduler  # noqa: E402
from tests.helpers import launched_ahead, max_deviation, run_forked, trainer  # noqa: E402

SCRIPT = Path(__file__).resolve().parent / "scripts" / "resume_run.py"


def _killed(root: Path) -> tuple[Path, dict[str, tuple[int, str]]]:
    """Every configuration's run, SIGKILLed in the middle of a window, each a process of its own."""
    jobs = {name: [str(SCRIPT), name, str(root / name)] for name in CONFIGS}
    return root, run_forked(jobs, preload=["lightning.pytorch"], folder=root)


killed = launched_ahead("killed", _killed)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """name -> (weights, optimizer steps, checkpoint directory with one checkpoint every 3 steps, callback)."""
    results = {}
    for name in CONFIGS:
        directory = tmp_path_factory.mktemp(name)
        every_3 = ModelCheckpoint(dirpath=directory, filename="{step}", save_top_k=-1, every_n_train_steps=3)
        callback = make_callback(name)
        run = trainer([callback, every_3], max_epochs=EPOCHS, enable_checkpointing=True)
        module = make_module(name)
        run.fit(module, make_loader(name))
        results[name] = (full_weights(module), run.global_step, directory, callback)
    return results


def _resume(name: str, path: Path):
    callback = make_callback(name)
    run = trainer([callback], max_epochs=EPOCHS)
    module = make_module(name, seed=99)  # the checkpoint, not the seed, must decide the weights
    run.fit(module, make_loader(name), ckpt_path=path)
    return full_weights(module), run.global_step, callback


def _flat(state: object, prefix: str = "") -> dict[str, object]:
    if isinstance(state, dict):
        return {k: v for key, value in state.items() for k, v in _flat(value, f"{prefix}{key}.").items()}
    if isinstance(state, (list, tuple)):
        return {k: v for i, value in enumerate(state) for k, v in _flat(value, f"{prefix}{i}.").items()}
    return {prefix: state}


def _assert_same_state(resumed: AccumulationScheduler, whole: AccumulationScheduler) -> None:
    """The callback's whole state (counters, noise-scale estimate, adaptive factor, LR warmup) as if never stopped."""
    mine, theirs = _flat(resumed.state_dict()), _flat(whole.state_dict())
    assert mine.keys() == theirs.keys()
    for key, value in theirs.items():
        if isinstance(value, float):
            assert mine[key] == pytest.approx(value, rel=1e-6, abs=1e-12, nan_ok=True), key
        else:
            assert mine[key] == value, key


def test_the_configurations_change_what_they_should(uninterrupted):
    """Guards the matrix: each configuration really has the state its resume is meant to test."""
    _, _, _, adaptive = uninterrupted["adaptive"]
    assert adaptive.features["adaptive"].factor > 2  # it grew from 2 during the run
    _, _, _, from_one = uninterrupted["adaptive_from_1"]
    assert from_one.features["adaptive"].factor > 1  # it grew from 1, measuring halves
    _, _, _, noise = uninterrupted["noise_scale"]
    assert noise.features["noise_scale"].estimate.noise_scale is not None
    for name in ("ramp", "sample_unit", "everything"):
        assert uninterrupted[name][3].samples_seen == EPOCHS * 48
    for name in ("token_unit", "token_ramp"):
        assert uninterrupted[name][3].features["token_count"].tokens_seen > 120  # past the last key
    assert uninterrupted["coupled"][3]._batcher.coupled == (4, 2)  # whole loader batches of 4, in chunks of 2


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_checkpoint_at_a_window_boundary_resumes_exactly(uninterrupted, name):
    reference, steps, directory, _ = uninterrupted[name]
    middle = sorted(directory.glob("step=*.ckpt"), key=lambda p: int(p.stem.split("=")[1]))
    path = middle[len(middle) // 2]  # a step in the middle of the run, mostly in the middle of an epoch
    resumed, resumed_steps, callback = _resume(name, path)
    assert resumed_steps == steps
    assert max_deviation(resumed, reference) <= 1e-6
    _assert_same_state(callback, uninterrupted[name][3])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_run_killed_in_the_middle_of_a_window_resumes_exactly(killed, uninterrupted, name):
    root, outcomes = killed
    code, output = outcomes[name]
    assert code == -9, f"the run was not SIGKILLed (exit {code}): {output[-2000:]}"
    reference, steps, _, _ = uninterrupted[name]
    resumed, resumed_steps, callback = _resume(name, root / name / "last.ckpt")
    assert resumed_steps == steps
    assert max_deviation(resumed, reference) <= 1e-6
    _assert_same_state(callback, uninterrupted[name][3])
