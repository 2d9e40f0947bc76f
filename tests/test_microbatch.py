"""micro_batch_size=m splits each loader batch; "auto" finds the size that fits after out-of-memory errors.

The reference is plain PyTorch on the whole loader batches: one SGD step per window on the mean of its batches'
losses (or on the mean over every sample or token of the window). The out-of-memory error is the real
``torch.OutOfMemoryError``, raised by a module above a number of rows, as CUDA's allocator raises it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accum import AccumulationScheduler
from lightning_accum.core.split import batch_rows, is_out_of_memory, split_batch
from tests.helpers import (
    LR,
    DictDataset,
    RegressionModule,
    loader,
    make_data,
    make_net,
    make_tokens,
    max_deviation,
    reference_weights,
    token_loss,
    trainer,
    weights,
)
from tests.test_normalization import TokenModule, sample_reference, token_reference

TOLERANCE = 1e-6


class DictModule(RegressionModule):
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return nn.functional.mse_loss(self.net(batch["x"]), batch["y"])


class TensorModule(RegressionModule):
    """The batch is one tensor: the first 5 columns are the input, the last the target."""

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return nn.functional.mse_loss(self.net(batch[:, :5]), batch[:, 5:])


class OutOfMemoryAbove(RegressionModule):
    """Raises torch.OutOfMemoryError in forward for more than ``limit`` rows, as the CUDA allocator would."""

    def __init__(self, limit: int = 5, seed: int = 1) -> None:
        super().__init__(seed=seed)
        self.limit, self.raised = limit, 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if len(batch[0]) > self.limit:
            self.raised += 1
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {len(batch[0])} rows")
        return super().training_step(batch, batch_idx)


def test_split_batch_handles_tensors_tuples_dicts_and_dataclasses():
    @dataclass
    class Batch:
        x: torch.Tensor
        meta: str

    parts = split_batch({"a": (torch.arange(7), Batch(torch.arange(7) * 2, "m"))}, 3)
    assert [batch_rows(p) for p in parts] == [3, 3, 1]
    assert parts[2]["a"][1].x.tolist() == [12]
    assert parts[1]["a"][1].meta == "m"
    with pytest.raises(TypeError, match="cannot split a batch of type str"):
        split_batch("text", 2)
    with pytest.raises(ValueError, match="disagree on the first dimension"):
        split_batch((torch.zeros(4), torch.zeros(3)), 2)
    assert is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate"))


def test_split_batch_cuts_per_sample_values_with_their_rows():
    """A list or tuple as long as the batch, holding no tensor, is one value per row; other values are shared."""
    batch = {
        "x": torch.arange(5),
        "name": ["a", "b", "c", "d", "e"],
        "score": (0.5, None, 2, 3, 4),
        "tags": [["t"], [], ["u", "v"], [], {"w": 1}],
        "classes": ["cat", "dog"],  # another length: shared
        "split": "train",
        "pair": [torch.arange(5), ["p", "q", "r", "s", "t"]],  # holds a tensor: a structure, cut inside
    }
    first, second, last = split_batch(batch, 2)
    assert second["name"] == ["c", "d"]
    assert second["score"] == (2, 3)
    assert second["tags"] == [["u", "v"], []]
    assert last["tags"] == [{"w": 1}]
    assert last["pair"][0].tolist() == [4]
    assert last["pair"][1] == ["t"]
    assert first["classes"] == ["cat", "dog"]
    assert last["split"] == "train"
    # a batch of tuples, collated: the top-level list of tensors is a structure, even as long as the batch
    columns = split_batch([torch.arange(3), torch.arange(3) * 10, ["a", "b", "c"]], 2)
    assert [part[0].tolist() for part in columns] == [[0, 1], [2]]
    assert [part[2] for part in columns] == [["a", "b"], ["c"]]


class NamedSamples(torch.utils.data.Dataset):
    """Samples with values beside their tensors: an index, a name, a score (sometimes None), tags of any length."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"x": self.x[index], "y": self.y[index], "index": index, "name": f"row{index}"}


def keep_values(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """A collate function that stacks the tensors and keeps each other value in a list, one per sample."""
    index = [sample["index"] for sample in samples]
    return {
        "x": torch.stack([sample["x"] for sample in samples]),
        "y": torch.stack([sample["y"] for sample in samples]),
        "index": index,
        "name": [sample["name"] for sample in samples],
        "score": [None if i % 4 == 0 else i / 2 for i in index],
        "tags": [[f"t{i}"] * (i % 3) for i in index],
        "classes": ["cat", "dog", "cow"],  # not one per sample: shared
        "split": "train",
    }


@pytest.mark.parametrize("collate", ["default", "keep_values"])
def test_a_split_batch_hands_each_micro_batch_its_rows_values(collate):
    """Loader batches of 12 in micro-batches of 5: each micro-batch sees the names, scores and tags of its rows."""
    seen: list[dict[str, Any]] = []

    class Paired(DictModule):
        def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
            index = batch["index"]
            seen.append({**batch, "index": index.tolist() if isinstance(index, torch.Tensor) else index})
            return super().training_step(batch, batch_idx)

    x, y = make_data(24)
    data = DataLoader(NamedSamples(x, y), batch_size=12, collate_fn=keep_values if collate == "keep_values" else None)
    trainer([AccumulationScheduler({0: 2}, micro_batch_size=5)], max_epochs=1).fit(Paired(), data)
    assert [len(batch["index"]) for batch in seen] == [5, 5, 2, 5, 5, 2]
    for batch in seen:
        index = batch["index"]
        assert torch.equal(batch["x"], x[index])
        assert batch["name"] == [f"row{i}" for i in index]
        if collate == "keep_values":
            assert batch["score"] == [None if i % 4 == 0 else i / 2 for i in index]
            assert batch["tags"] == [[f"t{i}"] * (i % 3) for i in index]
            assert batch["classes"] == ["cat", "dog", "cow"]
            assert batch["split"] == "train"


@pytest.mark.parametrize("kind", ["tuple", "dict", "tensor"])
@pytest.mark.parametrize("micro", [4, 5])  # dividing the loader batch of 16, and not (5, 5, 5, 1)
def test_splitting_equals_the_step_on_the_whole_batch(kind, micro):
    x, y = make_data(64)
    if kind == "tuple":
        model, data = RegressionModule(), loader(x, y, 16)
    elif kind == "dict":
        model, data = DictModule(), DataLoader(DictDataset({"x": x, "y": y, "labels": y}), batch_size=16)
    else:
        model, data = TensorModule(), DataLoader(torch.cat([x, y], dim=1), batch_size=16)
    fit = trainer([AccumulationScheduler({0: 2}, micro_batch_size=micro)], max_epochs=2)
    fit.fit(model, data)
    assert fit.global_step == 4
    assert max_deviation(weights(model), reference_weights(x, y, 16, [[2, 2], [2, 2]])) <= TOLERANCE


def test_splitting_with_sample_weighting_and_a_short_last_batch():
    x, y = make_data(60)  # loader batches 16 16 16 12, micro-batches of 5: 5 5 5 1 | ... | 5 5 2
    model = RegressionModule()
    callback = AccumulationScheduler({0: 2}, normalize_by="sample", micro_batch_size=5)
    trainer([callback], max_epochs=1).fit(model, loader(x, y, 16))
    assert max_deviation(weights(model), sample_reference(x, y, 16, [[2, 2]])) <= TOLERANCE


def test_splitting_with_token_weighting():
    data = make_tokens(48)
    model = TokenModule()
    callback = AccumulationScheduler({0: 2}, normalize_by="token", micro_batch_size=3)
    trainer([callback], max_epochs=1).fit(model, DataLoader(DictDataset(data), batch_size=8))
    assert max_deviation(weights(model), token_reference(data, 8, [2, 2, 2])) <= TOLERANCE


def test_a_micro_batch_size_the_loader_batch_already_meets_splits_nothing():
    x, y = make_data(32)
    model = RegressionModule()
    callback = AccumulationScheduler({0: 2}, micro_batch_size=8)
    trainer([callback], max_epochs=1).fit(model, loader(x, y, 8))
    assert max_deviation(weights(model), reference_weights(x, y, 8, [[2, 2]])) <= TOLERANCE
    assert "training_step" not in vars(model)


def test_auto_halves_on_out_of_memory_settles_at_four_trains_exactly_and_logs_it(tmp_path):
    x, y = make_data(64)
    model = OutOfMemoryAbove(limit=5)
    callback = AccumulationScheduler({0: 2}, micro_batch_size="auto")
    logger = CSVLogger(tmp_path, name="run", version=0)
    fit = trainer([callback], max_epochs=2, logger=logger, log_every_n_steps=1)
    fit.fit(model, loader(x, y, 16))
    assert model.raised == 2  # 16 and 8 rows ran out of memory; 4 fits
    assert callback.state_dict()["micro_batch_size_found"] == 4
    assert fit.global_step == 4
    assert max_deviation(weights(model), reference_weights(x, y, 16, [[2, 2], [2, 2]])) <= TOLERANCE
    rows = (tmp_path / "run" / "version_0" / "metrics.csv").read_text().splitlines()
    column = rows[0].split(",").index("accum/micro_batch_size")
    assert {row.split(",")[column] for row in rows[1:] if row.split(",")[column]} == {"4.0"}
    assert "training_step" not in vars(model)  # the shadow is gone after the fit


def test_auto_keeps_the_size_it_found_across_a_resume(tmp_path):
    x, y = make_data(64)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, filename="{epoch}")
    first = trainer(
        [AccumulationScheduler({0: 2}, micro_batch_size="auto"), checkpoint], max_epochs=1, enable_checkpointing=True
    )
    first.fit(OutOfMemoryAbove(limit=5), loader(x, y, 16))
    resumed = OutOfMemoryAbove(limit=5, seed=99)
    callback = AccumulationScheduler({0: 2}, micro_batch_size="auto")
    trainer([callback], max_epochs=2).fit(resumed, loader(x, y, 16), ckpt_path=tmp_path / "epoch=0.ckpt")
    assert resumed.raised == 0  # no search again
    assert max_deviation(weights(resumed), reference_weights(x, y, 16, [[2, 2], [2, 2]])) <= TOLERANCE


class CountsRows(RegressionModule):
    """Records the rows of each micro-batch; never runs out of memory."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.rows.append(len(batch[0]))
        return super().training_step(batch, batch_idx)


def test_auto_reused_on_a_new_run_searches_again_from_the_loaders_batch_size():
    """The size found belongs to its run: a fresh fit (global step 0, no checkpoint) starts from the loader's 16."""
    x, y = make_data(64)
    callback = AccumulationScheduler({0: 2}, micro_batch_size="auto")
    trainer([callback], max_epochs=1).fit(OutOfMemoryAbove(limit=5), loader(x, y, 16))
    assert callback.state_dict()["micro_batch_size_found"] == 4
    model = CountsRows()
    trainer([callback], max_epochs=1).fit(model, loader(x, y, 16))
    assert model.rows == [16, 16, 16, 16]
    assert callback.state_dict()["micro_batch_size_found"] == 16


def test_auto_reused_keeps_the_size_found_when_the_fit_continues_or_resumes(tmp_path):
    x, y = make_data(64)
    callback = AccumulationScheduler({0: 2}, micro_batch_size="auto")
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, filename="{epoch}")
    fit = trainer([callback, checkpoint], max_epochs=1, enable_checkpointing=True)
    model = OutOfMemoryAbove(limit=5)
    fit.fit(model, loader(x, y, 16))
    assert model.raised == 2
    # continued: the same Trainer and module, fitted on to a later epoch (global step 2)
    fit.fit_loop.max_epochs = 2
    fit.fit(model, loader(x, y, 16))
    assert model.raised == 2  # no search again
    assert callback.state_dict()["micro_batch_size_found"] == 4
    # an unrelated fresh fit searches again; a resumed one then takes the size from the checkpoint
    trainer([callback], max_epochs=1).fit(CountsRows(), loader(x, y, 16))
    assert callback.state_dict()["micro_batch_size_found"] == 16
    resumed = OutOfMemoryAbove(limit=5, seed=99)
    trainer([callback], max_epochs=2).fit(resumed, loader(x, y, 16), ckpt_path=tmp_path / "epoch=0.ckpt")
    assert resumed.raised == 0
    assert callback.state_dict()["micro_batch_size_found"] == 4
    assert max_deviation(weights(resumed), reference_weights(x, y, 16, [[2, 2], [2, 2]])) <= TOLERANCE


def test_auto_in_the_middle_of_a_window_drops_the_window_and_opens_one_at_the_failing_batch():
    """An out-of-memory error at the second loader batch of a window of 2: the first batch's gradients are dropped.

    Lightning decided before training_step that batch 1 steps, so it trains alone; batches 2-3 form the next window.
    """

    class GrowsAtBatch1(OutOfMemoryAbove):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.limit = 16 if batch_idx == 0 and self.raised == 0 else 5
            return super().training_step(batch, batch_idx)

    x, y = make_data(64)
    model = GrowsAtBatch1()
    fit = trainer([AccumulationScheduler({0: 2}, micro_batch_size="auto")], max_epochs=1)
    fit.fit(model, loader(x, y, 16))
    # batch 0 trained at 16 and was dropped; batch 1 then steps alone, and batches 2-3 form the next window
    net = make_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    for window in ([1], [2, 3]):
        optimizer.zero_grad()
        loss = sum(nn.functional.mse_loss(net(x[16 * b : 16 * b + 16]), y[16 * b : 16 * b + 16]) for b in window)
        (loss / len(window)).backward()
        optimizer.step()
    assert fit.global_step == 2
    assert max_deviation(weights(model), [p.detach() for p in net.parameters()]) <= TOLERANCE


def test_auto_at_one_sample_raises_a_clear_error():
    x, y = make_data(16)
    model = OutOfMemoryAbove(limit=0)
    before = weights(model)
    with pytest.raises(RuntimeError, match="a micro-batch of one sample does not fit in memory"):
        trainer([AccumulationScheduler({0: 2}, micro_batch_size="auto")], max_epochs=1).fit(model, loader(x, y, 4))
    assert max_deviation(weights(model), before) == 0.0


def test_a_bad_micro_batch_size_names_itself():
    with pytest.raises(ValueError, match=r"`micro_batch_size` must be an integer >= 1, 'auto' or None, got 'max'"):
        AccumulationScheduler(micro_batch_size="max")


def test_a_token_loss_split_by_rows():
    """Under micro_batch normalization rows weigh micro-batches: a token-mean loss is then the mean of row means."""
    data = make_tokens(16)
    model = TokenModule()
    trainer([AccumulationScheduler({0: 1}, micro_batch_size=8)], max_epochs=1).fit(
        model, DataLoader(DictDataset(data), batch_size=16)
    )
    net = make_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    halves = (slice(0, 8), slice(8, 16))
    (sum(token_loss(net, data["features"][h], data["labels"][h]) for h in halves) / 2).backward()
    optimizer.step()
    assert max_deviation(weights(model), [p.detach() for p in net.parameters()]) <= TOLERANCE


def test_the_features_see_each_micro_batch_as_a_micro_step():
    x, y = make_data(64)
    model = RegressionModule()
    callback = AccumulationScheduler(
        {0: 2},
        micro_batch_size=5,
        normalize_by="sample",
        noise_scale=True,
        noise_scale_interval=1,
        grad_accum_dtype="float32",
    )
    trainer([callback], max_epochs=1).fit(model, loader(x, y, 16))
    assert max_deviation(weights(model), sample_reference(x, y, 16, [[2, 2]])) <= TOLERANCE
    assert callback.features["noise_scale"].estimate.noise_scale is not None  # from micro-batches of 5, 5, 5, 1
    assert callback.samples_seen == 64


def test_auto_with_sample_weighting_on_one_process_is_exact():
    """The anchor's backward is no micro-batch's: the weighting counts each micro-batch once."""
    x, y = make_data(60)
    model = OutOfMemoryAbove(limit=5)
    callback = AccumulationScheduler({0: 2}, normalize_by="sample", micro_batch_size="auto")
    trainer([callback], max_epochs=1).fit(model, loader(x, y, 16))
    assert max_deviation(weights(model), sample_reference(x, y, 16, [[2, 2]])) <= TOLERANCE


def test_a_parameter_no_micro_batch_used_keeps_no_gradient_under_auto():
    class WithUnusedHead(OutOfMemoryAbove):
        def __init__(self) -> None:
            super().__init__(limit=5)
            self.unused = nn.Linear(5, 1)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.1, weight_decay=0.1)

    x, y = make_data(32)
    model = WithUnusedHead()
    before = [p.detach().clone() for p in model.unused.parameters()]
    trainer([AccumulationScheduler({0: 2}, micro_batch_size="auto")], max_epochs=1).fit(model, loader(x, y, 16))
    assert max_deviation([p.detach() for p in model.unused.parameters()], before) == 0.0  # no decay: no gradient


def test_lightning_sees_the_loader_batchs_loss_in_its_outputs():
    seen: dict[str, list[float]] = {}

    class Outputs(RegressionModule):
        def on_train_batch_end(self, outputs, batch, batch_idx):
            seen.setdefault(self.mode, []).append(float(outputs["loss"]))

    x, y = make_data(32)
    for mode in (None, 5, "auto"):
        model = Outputs()
        model.mode = str(mode)
        trainer([AccumulationScheduler({0: 1}, micro_batch_size=mode)], max_epochs=1).fit(model, loader(x, y, 16))
    assert seen["5"] == pytest.approx(seen["None"], rel=1e-6)
    assert seen["auto"] == pytest.approx(seen["None"], rel=1e-6)


def test_the_callback_with_micro_batching_pickles():
    import pickle

    for size in (4, "auto"):
        callback = AccumulationScheduler({0: 2}, micro_batch_size=size)
        x, y = make_data(32)
        trainer([callback], max_epochs=1).fit(RegressionModule(), loader(x, y, 16))
        assert pickle.loads(pickle.dumps(callback)).state_dict() == callback.state_dict()


# ------------------------------------------------------------------ batches the splitter cannot cut: said at once


class Pair:
    """A batch of a user's own class (a collate_fn that returns an object): the splitter cannot look inside it."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y


class PairModule(RegressionModule):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if isinstance(batch, Pair):
            return nn.functional.mse_loss(self.net(batch.x), batch.y)
        x, y, class_weights = batch  # class weights: one per class, shared by every row
        return (class_weights.mean() * nn.functional.mse_loss(self.net(x), y, reduction="none")).mean()


def _pairs(x: torch.Tensor, y: torch.Tensor) -> DataLoader:
    def collate(rows: list) -> Pair:
        return Pair(torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows]))

    return DataLoader(list(zip(x, y, strict=True)), batch_size=8, collate_fn=collate)


def _with_class_weights(x: torch.Tensor, y: torch.Tensor) -> DataLoader:
    def collate(rows: list) -> tuple:
        return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows]), torch.tensor([1.0, 2.0, 3.0])

    return DataLoader(list(zip(x, y, strict=True)), batch_size=8, collate_fn=collate)


@pytest.mark.parametrize(
    ("batches", "options", "match"),
    [
        # stock Lightning trains these whole; before this check, a fixed size trained whole batches of 8 in silence, and
        # adaptive growth never measured a window (a Pair) or raised at its first measured window, after 9 steps
        (_pairs, {"micro_batch_size": 4}, r"micro_batch_size=4: a loader batch of type Pair cannot be split.*register"),
        (_pairs, {"noise_scale": True, "adaptive": True}, r"adaptive=True measures .* type Pair cannot be split"),
        (
            _with_class_weights,
            {"noise_scale": True, "adaptive": True},
            r"adaptive=True .* type tuple cannot be split: its tensor at \[2\] has 3 rows, not the 8 .* buffer",
        ),
        (_with_class_weights, {"micro_batch_size": 4}, r"micro_batch_size=4: .* at \[2\] has 3 rows"),
    ],
)
def test_a_batch_the_splitter_cannot_cut_is_refused_at_the_first_batch_before_any_step(batches, options, match):
    x, y = make_data(64)
    module = PairModule()
    before = [p.detach().clone() for p in module.parameters()]
    fit = trainer([AccumulationScheduler(**options)], max_epochs=1)
    with pytest.raises(ValueError, match=match):
        fit.fit(module, batches(x, y))
    assert fit.global_step == 0
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))


def test_auto_warns_once_of_a_batch_it_could_not_cut_and_trains_as_stock():
    x, y = make_data(64)
    module, plain = PairModule(), PairModule()
    with pytest.warns(UserWarning, match=r"micro_batch_size='auto', but a loader batch of type Pair cannot be split"):
        trainer([AccumulationScheduler({0: 2}, micro_batch_size="auto")], max_epochs=1).fit(module, _pairs(x, y))
    trainer(max_epochs=1, accumulate_grad_batches=2).fit(plain, _pairs(x, y))  # 8 full windows: stock is exact
    assert max_deviation(weights(module), weights(plain)) <= TOLERANCE


def test_a_registered_splitter_lets_adaptive_growth_measure_a_users_batch_class():
    from lightning_accum.core.split import _ROWS, _SPLITTERS, register_splitter

    def cut(batch: Pair, size: int) -> list[Pair]:
        return [Pair(batch.x[i : i + size], batch.y[i : i + size]) for i in range(0, len(batch.x), size)]

    register_splitter(Pair, cut, rows=lambda batch: len(batch.x))
    try:
        x, y = make_data(256)
        estimates = []
        runs = ((PairModule, _pairs(x, y)), (RegressionModule, DataLoader(TensorDataset(x, y), batch_size=8)))
        for module, batches in runs:  # the user's class, and a tuple of tensors
            callback = AccumulationScheduler(noise_scale=True, noise_scale_interval=1, adaptive=True)
            trainer([callback], max_epochs=1).fit(module(lr=0.0), batches)
            estimates.append(callback.features["noise_scale"].estimate)  # type: ignore[attr-defined]
        assert estimates[0].measurements > 3
        # the halves and their sample counts are the same as the built-in splitter's for a tuple of tensors
        assert estimates[0].noise_scale == pytest.approx(estimates[1].noise_scale, rel=1e-6)
    finally:
        del _SPLITTERS[Pair], _ROWS[Pair]
