"""benchmarks/coupled.py at its ``--quick`` sizes: its tables have every row, its saved bytes scale as GradCache's do.

Run in this process (the benchmark's ``main``), so that it costs seconds, not an interpreter's start.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    spec = importlib.util.spec_from_file_location("coupled_benchmark", ROOT / "benchmarks" / "coupled.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path_factory.mktemp("coupled")
    threads = torch.get_num_threads()
    try:
        module.main(["--quick", "--rounds", "1", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)  # the benchmark sets its own
    return json.loads((out / "coupled_quick.json").read_text()), (out / "coupled_quick.md").read_text()


def test_the_table_has_a_big_batch_row_and_a_row_per_smaller_chunk_for_every_batch(quick_run):
    result, table = quick_run
    rows = {(row["batch"], row["chunk"]) for row in result["rows"]}
    assert rows == {(16, None), (16, 4), (16, 8), (32, None), (32, 4), (32, 8)}
    against_big_batch = table.split("| model |")[0]  # the micro-batch table follows
    assert against_big_batch.count("| big batch |") == 2
    assert against_big_batch.count("| cached |") == 4
    assert "CUDA peak memory: skipped: no CUDA." in table or "CUDA peak (MiB)" in table


def test_cached_holds_one_chunk_of_activations_and_the_big_batch_holds_the_batch(quick_run):
    result, _ = quick_run
    saved = {(row["batch"], row["chunk"]): row["saved"] for row in result["rows"]}
    assert saved[(32, None)]["towers"] == 2 * saved[(16, None)]["towers"] > 0  # the big batch's towers: all its rows
    for chunk in (4, 8):
        assert saved[(16, chunk)]["towers"] == saved[(32, chunk)]["towers"] == 0  # no graph between the passes
        assert saved[(16, chunk)]["backward"] == saved[(32, chunk)]["backward"] > 0  # the replay: one chunk's graph
    assert saved[(16, 8)]["backward"] == 2 * saved[(16, 4)]["backward"]
    assert saved[(16, 4)]["loss"] == saved[(16, None)]["loss"]  # the loss sees the same embeddings either way
    assert saved[(32, 4)]["peak"] < saved[(32, None)]["peak"]


def test_cached_matches_the_big_batch_after_one_sgd_step(quick_run):
    result, _ = quick_run
    assert all(row["max_abs_weight_difference"] < 1e-5 for row in result["rows"])


def test_the_micro_batch_table_times_every_run_of_both_towers_and_cached_is_exact(quick_run):
    result, table = quick_run
    runs = {(row["model"], row["run"], row["chunk"]) for row in result["versus_micro_batches"]}
    for chunk in (4, 8):
        towers = ("tiny BERT", "example encoder")
        assert {(model, run, chunk) for model in towers for run in ("plain", "cached")} <= runs
        assert ("tiny BERT", "tokens", chunk) in runs
        assert ("example encoder", "tokens", chunk) not in runs  # its encoder takes no attention mask
    assert {("tiny BERT", "big", None), ("example encoder", "big", None)} <= runs
    for row in result["versus_micro_batches"]:
        exact = row["max_abs_weight_difference"]
        assert (exact is not None) == (row["run"] in ("cached", "tokens"))
        assert exact is None or exact < 1e-5
    assert table.count("| plain micro-batches |") == 4
    assert table.count("| cached + chunk_tokens |") == 2
