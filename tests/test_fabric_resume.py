"""A Fabric loop killed with SIGKILL inside a window and resumed from its last ``fabric.save`` ends where the
uninterrupted loop ends (tests/scripts/fabric_resume.py: the accumulator, the model, SGD's momentum and a stateful
loader in the checkpoint, saved every 2 optimizer steps; the factor follows the tokens consumed, the LR scale warms
up)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import launched_ahead, run_forked

SCRIPT = Path(__file__).resolve().parent / "scripts" / "fabric_resume.py"


def _runs(root: Path) -> dict[str, dict]:
    jobs = {mode: [str(SCRIPT), str(root), mode] for mode in ("uninterrupted", "killed_resumed")}
    done = run_forked(jobs, preload=["lightning.fabric", "lightning_accum.fabric"], folder=root, limit=240)
    for mode, (status, output) in done.items():
        assert status == 0, f"{mode}: exit {status}\n{output[-3000:]}"
    return {mode: json.loads((root / f"{mode}.json").read_text()) for mode in jobs}


runs = launched_ahead("runs", _runs)


def test_a_run_killed_inside_a_window_resumes_from_its_last_save_to_the_same_weights(runs):
    resumed, uninterrupted = runs["killed_resumed"], runs["uninterrupted"]
    assert resumed["killed"]
    assert resumed["resumed_at"] == [1, 6]  # epoch 1 in progress, after step 6: a resume in the middle of an epoch
    assert resumed["optimizer_steps"] == uninterrupted["optimizer_steps"] == 13
    assert resumed["weights"] == uninterrupted["weights"]  # one process, the same operations: bit for bit
