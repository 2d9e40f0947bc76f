"""``cached`` inside a Lightning fit: windows of coupled batches, clipping, micro_batch_size as the chunk, "auto", the
noise scale's halves, and the dashboard's values, each against a plain-PyTorch loop over whole batches.

The reference never imports lightning_accum: one SGD step per window on the mean of the window's InfoNCE losses,
each over its own loader batch (what a window of coupled batches means), optionally with the gradient norm clipped.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accum import AccumulationScheduler, cached
from tests.helpers import launch_environment, launched_ahead, trainer
from tests.test_coupled import IN_FEATURES, LR, DualEncoder, clip_loss, info_nce

ROWS, BATCH = 48, 12


def make_pairs(rows: int = ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    queries = torch.randn(rows, IN_FEATURES, generator=generator)
    return queries, queries + 0.5 * torch.randn(rows, IN_FEATURES, generator=generator)  # noisy positives


class Contrastive(pl.LightningModule):
    """A dual encoder whose training step runs both towers through ``cached``; records each tower call's rows."""

    def __init__(self, chunk_size: int | None = None, oom_above: int | None = None) -> None:
        super().__init__()
        self.model = DualEncoder()
        self.chunk_size, self.oom_above = chunk_size, oom_above
        self.rows: list[int] = []  # the rows of each forward of the query tower (first passes and replays)
        self.model.query.register_forward_pre_hook(lambda _, args: self._forward(len(args[0])))

    def _forward(self, rows: int) -> None:
        if self.oom_above is not None and rows > self.oom_above:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {rows} rows")
        self.rows.append(rows)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        q, d = batch
        queries = cached(self.model.query, q, chunk_size=self.chunk_size)
        documents = cached(self.model.document, d, chunk_size=self.chunk_size)
        return info_nce(queries, documents, self.model.log_temperature)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def reference(
    windows: list[int], batch: int = BATCH, clip: float | None = None, loss: Callable[..., torch.Tensor] = info_nce
) -> list[torch.Tensor]:
    """Plain PyTorch: per window, one SGD step on the mean of its batches' losses (InfoNCE), each over a whole batch."""
    model = DualEncoder()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    q, d = make_pairs()
    batches = [(q[i : i + batch], d[i : i + batch]) for i in range(0, ROWS, batch)]
    start = 0
    for size in windows:
        optimizer.zero_grad()
        group = batches[start : start + size]
        start += size
        total = sum(loss(model.query(bq), model.document(bd), model.log_temperature) for bq, bd in group)
        (total / len(group)).backward()
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def fit(module: Contrastive, callback: AccumulationScheduler, **kwargs: Any) -> pl.Trainer:
    run = trainer([callback], **{"max_epochs": 1, **kwargs})
    run.fit(module, DataLoader(TensorDataset(*make_pairs()), batch_size=BATCH))
    return run


def deviation(module: Contrastive, expected: list[torch.Tensor]) -> float:
    return max((p.detach() - e).abs().max().item() for p, e in zip(module.parameters(), expected, strict=True))


@pytest.mark.parametrize("clip", [None, 0.5])
def test_windows_of_coupled_batches_are_plain_pytorchs_windows_with_and_without_clipping(clip):
    module = Contrastive(chunk_size=5)
    run = fit(module, AccumulationScheduler({0: 2}), gradient_clip_val=clip)
    assert run.global_step == 2
    assert deviation(module, reference([2, 2], clip=clip)) <= 1e-6
    assert set(module.rows) == {5, 2}  # chunks of 5, 5 and 2 of each batch of 12, never the whole batch


def test_micro_batch_size_is_the_chunk_size_and_the_loader_batch_is_never_split(tmp_path):
    module = Contrastive()
    callback = AccumulationScheduler({0: 2}, micro_batch_size=5)
    fit(module, callback, logger=CSVLogger(tmp_path), log_every_n_steps=1)
    assert deviation(module, reference([2, 2])) <= 1e-6  # the InfoNCE of whole batches of 12: not of parts of 5
    assert set(module.rows) == {5, 2}  # the first batch's first part stopped before any forward
    logged = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text().splitlines()
    header, last = logged[0].split(","), logged[-1].split(",")
    values = {key: value for key, value in zip(header, last, strict=True) if value}
    assert float(values["accum/coupled_batch"]) == BATCH
    assert float(values["accum/chunk_size"]) == 5
    # a micro-step is the whole loader batch (a constant of the fit: logged with its first logged step)
    column = header.index("accum/micro_batch_size")
    assert {row.split(",")[column] for row in logged[1:]} - {""} == {f"{float(BATCH)}"}


def test_a_split_window_in_progress_is_opened_again_when_the_first_coupled_step_is_found_in_it():
    """The first part of the first batch stops before any forward; the window opens again; nothing counts twice."""
    module = Contrastive()
    callback = AccumulationScheduler({0: 3}, micro_batch_size=4)
    run = fit(module, callback)
    assert run.global_step == 2  # windows of 3 and 1 (what is left of the epoch): none dropped, none repeated
    assert deviation(module, reference([3, 1])) <= 1e-6
    assert callback.samples_seen == ROWS


def test_auto_halves_the_chunk_size_on_out_of_memory_and_stays_exact():
    module = Contrastive(oom_above=3)
    callback = AccumulationScheduler({0: 2}, micro_batch_size="auto")
    fit(module, callback)
    assert deviation(module, reference([2, 2])) <= 1e-6
    assert callback._batcher.changes == [(12, 6), (6, 3)]
    assert max(module.rows) == 3


def test_adaptive_from_factor_1_says_once_that_a_coupled_batch_has_no_halves():
    module = Contrastive(chunk_size=6)
    callback = AccumulationScheduler(noise_scale=True, noise_scale_interval=1, adaptive=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(module, callback, max_epochs=2)
    said = [str(w.message) for w in caught if "couples its batch's rows" in str(w.message)]
    assert len(said) == 1, said
    assert "measured only on windows of factor 2 or more" in said[0]
    assert deviation(module, reference([1] * 4)) > 0  # it trained (two epochs: not the one-epoch reference)
    assert set(module.rows) == {6}  # whole batches of 12, in chunks of 6: never halves of 6 run as micro-batches


class MultiTask(Contrastive):
    """Even batches: a per-row loss (no coupling); odd batches: InfoNCE through ``cached``."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx % 2:
            return super().training_step(batch, batch_idx)
        q, d = batch
        return (self.model.query(q) - self.model.document(d)).pow(2).mean()


def test_a_first_cached_call_in_the_middle_of_a_window_keeps_what_the_window_trained_before_it():
    module = MultiTask()
    run = fit(module, AccumulationScheduler({0: 2}, micro_batch_size=4))
    assert run.global_step == 2
    model = DualEncoder()  # plain PyTorch: windows of batches (0, 1) and (2, 3), each batch whole
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    q, d = make_pairs()
    for window in ((0, 1), (2, 3)):
        optimizer.zero_grad()
        losses = []
        for index in window:
            bq, bd = q[index * BATCH : (index + 1) * BATCH], d[index * BATCH : (index + 1) * BATCH]
            if index % 2:
                losses.append(info_nce(model.query(bq), model.document(bd), model.log_temperature))
            else:
                losses.append((model.query(bq) - model.document(bd)).pow(2).mean())
        (sum(losses) / 2).backward()
        optimizer.step()
    assert deviation(module, [p.detach() for p in model.parameters()]) <= 1e-6


def test_a_first_cached_call_after_a_part_of_the_batch_trained_is_refused():
    class LastPartOnly(Contrastive):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if len(batch[0]) == 2:  # the last part of 5, 5, 2
                return super().training_step(batch, batch_idx)
            return self.model.query(batch[0]).pow(2).mean()

    with pytest.raises(RuntimeError, match=r"first called in part 3 of a loader batch split into micro-batches of 5"):
        fit(LastPartOnly(), AccumulationScheduler({0: 2}, micro_batch_size=5))


def test_the_noise_scale_measures_windows_of_coupled_batches():
    callback = AccumulationScheduler({0: 2}, micro_batch_size=4, noise_scale=True, noise_scale_interval=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(Contrastive(), callback, max_epochs=3)
    assert not [w for w in caught if "in parts" in str(w.message)]
    assert callback.features["noise_scale"].estimate.noise_scale is not None


# ------------------------------------------------------------------ two DDP ranks, global negatives

SCRIPT = Path(__file__).resolve().parent / "scripts" / "coupled_ranks.py"


def _launch(out: Path) -> Path:
    # `timeout -s KILL` kills the whole process group (Lightning's launcher starts rank 1 as rank 0's child)
    done = subprocess.run(
        ["timeout", "-s", "KILL", "300", sys.executable, str(SCRIPT), str(out)],
        capture_output=True,
        text=True,
        check=False,
        env=launch_environment(),
    )
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return out


coupled_ranks = launched_ahead("coupled_ranks", _launch)


def _records(out: Path, name: str) -> list[dict[str, Any]]:
    return [json.loads((out / f"{name}.rank{rank}.json").read_text()) for rank in (0, 1)]


def _weights(record: dict[str, Any]) -> dict[str, torch.Tensor]:
    assert "error" not in record, record["error"]
    return {
        key: torch.tensor(value).reshape(DualEncoder().state_dict()[key].shape)
        for key, value in record["weights"].items()
    }


def _deviation(found: dict[str, torch.Tensor], expected: list[torch.Tensor]) -> float:
    reference = dict(zip(DualEncoder().state_dict(), expected, strict=True))
    return max((found[key] - reference[key]).abs().max().item() for key in reference)


def test_global_negatives_on_two_ddp_ranks_are_the_single_process_step_on_the_global_batch(coupled_ranks):
    ranks = _records(coupled_ranks, "global")
    for record in ranks:
        assert record["steps"] == 2
        assert _deviation(_weights(record), reference([2, 2])) <= 1e-5
    assert ranks[0]["weights"] == ranks[1]["weights"]  # identical, not just close
    buckets = len(set(ranks[0]["allreduces"]))
    assert len(ranks[0]["allreduces"]) == 2 * buckets  # one reduction per optimizer step, none per micro-step


def test_openclips_rank_local_loss_on_two_ddp_ranks_is_the_single_process_step_on_the_global_batch(coupled_ranks):
    ranks = _records(coupled_ranks, "local")
    for record in ranks:
        assert record["steps"] == 2
        assert _deviation(_weights(record), reference([2, 2], loss=clip_loss)) <= 1e-5
    assert ranks[0]["weights"] == ranks[1]["weights"]
    assert len(ranks[0]["allreduces"]) == 2 * len(set(ranks[0]["allreduces"]))  # one reduction per optimizer step


def test_deepspeed_zero2_with_the_callback_is_the_single_process_step_on_the_global_batch(coupled_ranks):
    for record in _records(coupled_ranks, "zero2"):
        assert record["steps"] == 2
        assert _deviation(_weights(record), reference([2, 2])) <= 1e-5


def test_deepspeed_zero3_without_the_callback_is_refused_by_cached_before_any_step(coupled_ranks):
    for record in _records(coupled_ranks, "zero3"):
        assert record["steps"] == 0
        assert record["error"].startswith(
            "cached() cannot run `Tower`: its parameter `net.0.weight` is a DeepSpeed ZeRO-3"
        )


def test_ranks_with_unequal_batches_raise_the_same_error_on_every_rank(coupled_ranks):
    ranks = _records(coupled_ranks, "unequal")
    assert [record.get("error") for record in ranks] == [ranks[0].get("error")] * 2
    assert "rank 0: 6, rank 1: 5" in ranks[0]["error"]
    assert ranks[0]["steps"] == ranks[1]["steps"] == 0
