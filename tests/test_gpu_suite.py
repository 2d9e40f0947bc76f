"""The GPU suite (benchmarks/gpu/) in its dry mode, as the GPU machine would run it: so that it cannot rot unseen.

The lent GPU machine has torch, Lightning, transformers and tensorboard but not DeepSpeed, and jsonargparse only as a
carried wheel: the dry run here blocks DeepSpeed's import, and a run without jsonargparse must say what to carry.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import FSDP2

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "benchmarks" / "gpu" / "run.sh"
BLOCKER = """
import sys


class _NotOnTheGpuMachine:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (not on the GPU machine)", name=name)
        return None


sys.meta_path.insert(0, _NotOnTheGpuMachine())
"""


def suite(tmp: Path, *args: str, blocked: tuple[str, ...] = ("deepspeed",)) -> subprocess.CompletedProcess:
    """``bash benchmarks/gpu/run.sh ARGS`` with ``blocked`` packages made unimportable, under a hard timeout."""
    site = tmp / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(BLOCKER.format(blocked=set(blocked)))
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(site)}
    return subprocess.run(
        ["timeout", "-s", "KILL", "240", "bash", str(RUN), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp,
        check=False,
    )


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu-dry")
    done = suite(tmp, "--dry", str(tmp / "out"))
    return done, tmp / "out"


def test_the_dry_suite_runs_every_part_and_every_check_holds_without_deepspeed(dry_run):
    done, out = dry_run
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads((out / "results.json").read_text())
    parts = results["parts"]
    assert list(parts) == ["exactness", "oom", "fsdp", "memory_metrics", "coupled_memory", "experiment", "overhead"]
    assert {name: part["status"] for name, part in parts.items()} == dict.fromkeys(parts, "ok")
    assert results["environment"]["mode"] == "dry (tiny sizes)"
    assert results["environment"]["device"].startswith("no CUDA device")

    exactness = parts["exactness"]["report"]["tables"]
    assert [row["passed"] for row in exactness["weights"]["rows"]] == [True] * 6
    assert [row["float32"]["max_ulps"] for row in exactness["bf16"]["rows"]] == [0, 0]
    assert exactness["bf16"]["rows"][1]["bfloat16"]["max_ulps"] > 1  # bf16 accumulation is not exact at factor 4

    fsdp = parts["fsdp"]["report"]["tables"]["runs"]
    fsdp2 = ["matches"] if FSDP2 else [f"skipped: refused on torch {torch.__version__} (docs/compatibility.md)"]
    assert [cells[-1] for cells in fsdp["cells"]] == ["skipped: FSDP1 needs CUDA"] * 2 + fsdp2 * 2

    oom = parts["oom"]["report"]["tables"]["runs"]["rows"]
    assert [row["settled"] for row in oom] == [16, 16]  # 64 rows -> 32 -> 16 on the simulated errors
    assert all(row["deviation"] <= 1e-6 for row in oom)
    checks = parts["oom"]["report"]["tables"]["checks"]["rows"]
    assert [(row["check"], row["passed"]) for row in checks] == [
        ("where `auto` settles", True),
        ("weights against the big batch", True),
    ]  # the two CUDA-only checks (the allocator's count, the memory after the recovery) need a device

    runs = parts["experiment"]["report"]["tables"]["runs"]["rows"]
    assert len(runs) == 2 * 5
    assert all(row["outcome"] == "ok" for row in runs)
    by_pair: dict[tuple, list[float]] = {}
    for row in runs:
        by_pair.setdefault((row["precision"], row["factor"]), []).append(row["final_loss"])
    assert all(abs(a - b) < 1e-3 for a, *rest in by_pair.values() for b in rest)  # accumulated = big batch

    ratios = parts["overhead"]["report"]["tables"]["ratios"]["rows"]
    assert len(ratios) == 8
    assert all(row["rounds"] >= 1 and row["median"] > 0 for row in ratios)

    metrics = parts["memory_metrics"]["report"]["tables"]["metrics"]["rows"]
    assert [(row["metric"], row["passed"]) for row in metrics] == [("accum/memory_rss_mb", True)]

    text = (out / "results.md").read_text()
    assert "Every check held." in text
    for title in ("Exactness", "out-of-memory", "FSDP1 and FSDP2", "accumulation experiment", "callback's cost"):
        assert title in text
    assert all((out / "parts" / f"{name}.log").exists() for name in parts)


def test_a_part_past_its_budget_is_reported_with_its_rows_and_the_next_part_still_runs(tmp_path):
    done = suite(tmp_path, "--dry", str(tmp_path / "out"), "--only", "overhead", "fsdp", "--budget", "overhead=2")
    assert done.returncode == 1
    parts = json.loads((tmp_path / "out" / "results.json").read_text())["parts"]
    assert list(parts) == ["overhead", "fsdp"]
    assert parts["overhead"]["status"] == "timed out after 2 s"
    assert parts["overhead"]["report"]["status"] == "running"  # what it wrote before it was stopped
    assert parts["fsdp"]["status"] == "ok"
    assert "| overhead | timed out after 2 s |" in (tmp_path / "out" / "results.md").read_text()


def test_without_jsonargparse_the_suite_says_what_to_carry(tmp_path):
    done = suite(tmp_path, "--dry", str(tmp_path / "out"), blocked=("deepspeed", "jsonargparse"))
    assert done.returncode == 2
    assert "jsonargparse cannot be imported here" in done.stderr
    assert "benchmarks/gpu/prepare.sh" in done.stderr


def test_a_check_that_does_not_hold_is_named_in_the_summary_and_fails_the_run():
    spec = importlib.util.spec_from_file_location("suite", ROOT / "benchmarks" / "gpu" / "suite.py")
    suite_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite_module)
    report = {
        "title": "FSDP1 and FSDP2 on one device",
        "tables": {
            "runs": {
                "cells": [["FSDP2", "last", "6", "3.0e-08", "matches"], ["FSDP2", "every", "6", "4.8e-02", "NO"]],
                "rows": [{"passed": True}, {"passed": False}],
            }
        },
    }
    assert suite_module.checks_failed(report) == ["FSDP1 and FSDP2 on one device: FSDP2 / every"]
    assert suite_module.checks_failed(None) == []


def _to_docs():
    spec = importlib.util.spec_from_file_location("to_docs", ROOT / "benchmarks" / "gpu" / "to_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_to_docs_refuses_a_dry_run(dry_run, tmp_path, capsys):
    _, out = dry_run
    docs = tmp_path / "benchmarks.md"
    docs.write_text((ROOT / "docs" / "benchmarks.md").read_text())
    assert _to_docs().main([str(out), "--docs", str(docs), "--results", str(tmp_path / "results")]) == 2
    assert "only a full run on a CUDA device goes into the docs" in capsys.readouterr().err
    assert docs.read_text() == (ROOT / "docs" / "benchmarks.md").read_text()


def test_to_docs_puts_a_gpu_run_into_the_docs_section_and_the_results_folder(dry_run, tmp_path):
    _, out = dry_run
    run = tmp_path / "run"
    (run / "parts").mkdir(parents=True)
    results = json.loads((out / "results.json").read_text())
    results["environment"] |= {"mode": "full", "device": "NVIDIA H100 80GB HBM3", "memory_gib": 79.2}
    (run / "results.json").write_text(json.dumps(results))
    (run / "results.md").write_text("Run of today: NVIDIA H100 80GB HBM3.\n\n### Exactness\n\n| a |\n| --- |\n| 1 |\n")
    (run / "parts" / "exactness.md").write_text("### Exactness\n")
    docs = tmp_path / "benchmarks.md"
    original = (ROOT / "docs" / "benchmarks.md").read_text()
    assert "No GPU figures exist yet" in original  # until a GPU run fills the section
    docs.write_text(original)
    assert _to_docs().main([str(run), "--docs", str(docs), "--results", str(tmp_path / "results")]) == 0
    filled = docs.read_text()
    assert "No GPU figures exist yet" not in filled
    assert "NVIDIA H100 80GB HBM3" in filled
    assert "\n#### Exactness\n" in filled
    before, after = original.split("<!-- gpu-suite:begin")[0], original.split("<!-- gpu-suite:end -->")[1]
    assert filled.startswith(before)
    assert filled.endswith(after)
    assert sorted(p.name for p in (tmp_path / "results").rglob("*") if p.is_file()) == [
        "exactness.md",
        "results.json",
        "results.md",
    ]
