"""Hugging Face models nobody here wrote, with ``normalize_by="token"`` and nothing else, against plain PyTorch.

Tiny random-init transformers models (built from configs, no download): a causal LM (Llama), a sequence-to-sequence
model (T5) and a masked LM (BERT), each returning its own ``.loss`` from ``training_step``. The reference is one
plain-PyTorch SGD step per big batch, on the sum of the big batch's token losses over its loss-bearing tokens,
computed here from the model's logits (shifted by one for the causal LM, as given for the others), never from the
model's own loss or from lightning_accum.
"""

from __future__ import annotations

import copy
import logging
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_accum import AccumulationScheduler
from tests.helpers import DictDataset, trainer

transformers = pytest.importorskip("transformers")  # the test extra installs it; the library does not need it

VOCAB, LENGTH, SEQUENCES, LOADER_BATCH, FACTOR, LR = 48, 10, 32, 4, 4, 0.5


def make_batch_data(seed: int = 0, sequences: int = SEQUENCES) -> dict[str, torch.Tensor]:
    """Right-padded sequences of 3 to LENGTH tokens: labels are the inputs, -100 on the padding."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (sequences, LENGTH), generator=generator)
    lengths = torch.randint(3, LENGTH + 1, (sequences,), generator=generator)
    mask = torch.arange(LENGTH)[None, :] < lengths[:, None]
    ids = torch.where(mask, ids, torch.zeros_like(ids))
    return {"input_ids": ids, "attention_mask": mask.long(), "labels": torch.where(mask, ids, -100)}


def make_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "causal":
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=2, max_position_embeddings=LENGTH,
        )  # fmt: skip
        return transformers.LlamaForCausalLM(config)
    if kind == "seq2seq":
        config = transformers.T5Config(
            vocab_size=VOCAB, d_model=16, d_ff=32, d_kv=8, num_layers=1, num_heads=2, decoder_start_token_id=0,
            pad_token_id=0, dropout_rate=0.0,
        )  # fmt: skip
        return transformers.T5ForConditionalGeneration(config)
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=LENGTH, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.BertForMaskedLM(config)


class HFModule(pl.LightningModule):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss  # the model's own loss: a mean over the tokens it weighs

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def reference(model: nn.Module, data: dict[str, torch.Tensor], shift: bool) -> list[torch.Tensor]:
    """One SGD step per window of FACTOR loader batches, on sum(token losses) / loss-bearing tokens of the window."""
    model = copy.deepcopy(model)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    window = LOADER_BATCH * FACTOR
    for start in range(0, SEQUENCES, window):
        batch = {key: value[start : start + window] for key, value in data.items()}
        logits = model(**batch).logits
        labels = batch["labels"]
        if shift:
            logits, labels = logits[:, :-1], labels[:, 1:]
        losses = nn.functional.cross_entropy(
            logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100, reduction="sum"
        )
        optimizer.zero_grad()
        (losses / (labels != -100).sum()).backward()
        optimizer.step()
    return [param.detach().clone() for param in model.parameters()]


def fit(model: nn.Module, data: dict[str, torch.Tensor], **arguments: Any) -> pl.Trainer:
    fit_trainer = trainer([AccumulationScheduler({0: FACTOR}, log_metrics=False, **arguments)], max_epochs=1)
    fit_trainer.fit(HFModule(model), DataLoader(DictDataset(data), batch_size=LOADER_BATCH))
    return fit_trainer


def deviation(model: nn.Module, expected: list[torch.Tensor]) -> float:
    return max(
        (param.detach() - want).abs().max().item() for param, want in zip(model.parameters(), expected, strict=True)
    )


@pytest.mark.parametrize("micro_batch_size", [None, 2], ids=["whole", "split"])
def test_a_causal_lm_with_token_weighting_alone_ends_at_the_big_batch(micro_batch_size):
    data, model = make_batch_data(), make_model("causal")
    expected = reference(model, data, shift=True)
    ours = copy.deepcopy(model)
    fit(ours, data, normalize_by="token", micro_batch_size=micro_batch_size)
    assert deviation(ours, expected) <= 1e-6
    # counting the unshifted labels (one token per sequence too many) is measurably off: the test can fail
    unshifted = copy.deepcopy(model)
    fit(unshifted, data, normalize_by="token", count_items=lambda batch: (batch["labels"] != -100).sum())
    assert deviation(unshifted, expected) > 1e-5


@pytest.mark.parametrize("kind", ["seq2seq", "masked"])
def test_sequence_to_sequence_and_masked_lms_weigh_their_labels_as_given(kind):
    data, model = make_batch_data(), make_model(kind)
    if kind == "masked":  # a masked LM bears loss only where tokens are masked
        hidden = torch.rand(data["labels"].shape, generator=torch.Generator().manual_seed(1)) < 0.3
        data["labels"] = torch.where(hidden & (data["labels"] != -100), data["labels"], -100)
    expected = reference(model, data, shift=False)
    ours = copy.deepcopy(model)
    fit(ours, data, normalize_by="token")
    assert deviation(ours, expected) <= 1e-6


@pytest.mark.parametrize(
    ("kind", "phrase"),
    [
        ("causal", "tokens counted as LlamaForCausalLM weighs them (labels[..., 1:] != -100)"),
        ("seq2seq", "tokens counted as T5ForConditionalGeneration weighs them (labels != -100)"),
    ],
)
def test_the_fits_summary_says_how_tokens_are_counted(kind, phrase, caplog):
    fit_trainer = trainer([AccumulationScheduler({0: FACTOR}, normalize_by="token")], max_epochs=1)
    with caplog.at_level(logging.INFO):
        fit_trainer.fit(HFModule(make_model(kind)), DataLoader(DictDataset(make_batch_data()), batch_size=4))
    (summary,) = [record.message for record in caplog.records if "x factor" in record.message]
    assert phrase in summary


class PlainCausal(pl.LightningModule):
    """A causal LM of our own (not transformers') that shifts the labels inside, as Hugging Face models do."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(8, VOCAB)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self.head(self.embed(batch["input_ids"]))
        return nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, VOCAB), batch["labels"][:, 1:].reshape(-1), ignore_index=-100
        )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def _warnings_of(**arguments: Any) -> list[str]:
    fit_trainer = trainer([AccumulationScheduler({0: 2}, log_metrics=False, **arguments)], max_epochs=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit_trainer.fit(PlainCausal(), DataLoader(DictDataset(make_batch_data(sequences=16)), batch_size=4))
    return [str(warning.message) for warning in caught if "equal `input_ids`" in str(warning.message)]


def test_labels_that_repeat_the_inputs_warn_once_when_no_model_says_how_to_count_them():
    (message,) = _warnings_of(normalize_by="token")
    assert "count_items=lambda batch: (batch['labels'][..., 1:] != -100).sum()" in message
    assert _warnings_of(normalize_by="token", count_items=lambda batch: (batch["labels"][..., 1:] != -100).sum()) == []
    assert _warnings_of(normalize_by="sample") == []


def test_on_two_ddp_ranks_with_different_token_counts_a_causal_lm_ends_at_the_big_batch(tmp_path):
    """tests/scripts/hf_ranks.py: rank 0's sequences bear 2 loss tokens each, rank 1's up to 9."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
    from hf_ranks import rank_data

    script = Path(__file__).resolve().parent / "scripts" / "hf_ranks.py"
    done = subprocess.run(
        ["timeout", "-s", "KILL", "300", sys.executable, str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    first, second = rank_data(0), rank_data(1)
    # the window of step s: each rank's FACTOR loader batches of step s, both ranks together
    window = LOADER_BATCH * FACTOR
    starts = range(0, SEQUENCES, window)
    both = {
        key: torch.cat([part for s in starts for part in (first[key][s : s + window], second[key][s : s + window])])
        for key in first
    }
    model = make_model("causal")
    expected = dict(zip(model.state_dict(), _reference_two(model, both), strict=True))
    tokens = [int((data["labels"][:, 1:] != -100).sum()) for data in (first, second)]
    assert tokens[1] > 2 * tokens[0]  # the ranks' token counts differ widely
    for name in ("whole", "split"):
        record = json.loads((tmp_path / f"{name}.json").read_text())
        assert record["steps"] == SEQUENCES // window
        deviation = max(
            (torch.tensor(values) - expected[key].flatten()).abs().max().item()
            for key, values in record["weights"].items()
        )
        assert deviation <= 1e-5, name


def _reference_two(model: nn.Module, both: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """As ``reference``, with windows of 2 x LOADER_BATCH x FACTOR sequences (both ranks' micro-batches)."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    window = 2 * LOADER_BATCH * FACTOR
    for start in range(0, 2 * SEQUENCES, window):
        batch = {key: value[start : start + window] for key, value in both.items()}
        logits, labels = model(**batch).logits[:, :-1], batch["labels"][:, 1:]
        losses = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="sum")
        optimizer.zero_grad()
        (losses / (labels != -100).sum()).backward()
        optimizer.step()
    return [value.detach().clone() for value in model.state_dict().values()]


# ------------------------------------------------------------------ which model counts, and how


def test_only_a_trainable_model_counts_and_heads_that_disagree_count_as_given():
    from lightning_accum.core.items import token_head

    teacher, student = make_model("masked"), make_model("causal")
    teacher.requires_grad_(False)  # a frozen teacher: its loss is not the one trained on
    both = nn.ModuleDict({"teacher": teacher, "student": student})
    assert token_head(both) == ("LlamaForCausalLM", True)
    teacher.requires_grad_(True)  # two trained heads that count differently: no rule is taken
    assert token_head(both) is None


def test_labels_shifted_by_the_collate_are_counted_as_given():
    from lightning_accum.core.items import count_tokens

    labels = torch.tensor([[5, 6, 7, -100]])
    batch = {"labels": labels, "shift_labels": torch.tensor([[6, 7, -100, -100]])}
    assert int(count_tokens(batch, shift=True)) == 2  # the model averages over shift_labels as given
    assert int(count_tokens({"labels": labels}, shift=True)) == 2  # labels[..., 1:]: 6, 7


def test_a_causal_lm_head_that_takes_its_labels_as_given_is_counted_as_given():
    from lightning_accum.core.items import token_head

    config = transformers.XLMConfig(vocab_size=VOCAB, emb_dim=16, n_layers=1, n_heads=2, max_position_embeddings=16)
    assert token_head(transformers.XLMWithLMHeadModel(config)) == ("XLMWithLMHeadModel", False)


class PreShifted(pl.LightningModule):
    """A causal LM whose collate shifted the labels already: the loss is computed here, on the logits as they are."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch["labels"].reshape(-1), ignore_index=-100)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def _pre_shifted() -> dict[str, torch.Tensor]:
    data = make_batch_data()
    labels = torch.full_like(data["labels"], -100)
    labels[:, :-1] = data["labels"][:, 1:]  # labels[t] = input_ids[t + 1]: the collate shifted them
    return {**data, "labels": labels}


@pytest.mark.parametrize(
    ("arguments", "named"), [({"normalize_by": "token"}, "normalize_by='token'"), ({"unit": "token"}, "unit='token'")]
)
def test_labels_a_collate_shifted_beside_a_head_that_shifts_again_warn_at_the_first_batch(arguments, named):
    # the count follows the Llama head's rule (labels[..., 1:]) while this training_step weighs every label: one
    # token per sequence short, 2 to 3% of this update, in silence before
    data, model = _pre_shifted(), make_model("causal")
    scheduling = {0: FACTOR} if "unit" not in arguments else {0: FACTOR * 8}
    callback = AccumulationScheduler(scheduling, log_metrics=False, **arguments)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer([callback], max_steps=1).fit(PreShifted(model), DataLoader(DictDataset(data), batch_size=LOADER_BATCH))
    shifted = [str(w.message) for w in caught if "shifted by one already" in str(w.message)]
    assert len(shifted) == 1
    assert named in shifted[0]
    assert "LlamaForCausalLM shifts its labels again" in shifted[0]
    assert "count_items=lambda batch: (batch['labels'] != -100).sum()" in shifted[0]


def test_labels_a_collate_shifted_counted_with_count_items_end_at_the_big_batch_and_warn_nothing():
    data, model = _pre_shifted(), make_model("causal")
    expected = reference(model, data, shift=False)  # every label as given: the loss this training_step computes
    module = PreShifted(model)
    callback = AccumulationScheduler(
        {0: FACTOR}, normalize_by="token", count_items=lambda batch: (batch["labels"] != -100).sum(), log_metrics=False
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer([callback], max_epochs=1).fit(module, DataLoader(DictDataset(data), batch_size=LOADER_BATCH))
    assert not [w for w in caught if "shifted by one already" in str(w.message)]
    assert deviation(module.model, expected) <= 1e-6


def test_unshifted_labels_beside_a_head_that_shifts_them_warn_nothing():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(make_model("causal"), make_batch_data(), normalize_by="token", unit="token")
    assert not [
        w for w in caught if "shifted by one already" in str(w.message) or "equal `input_ids`" in str(w.message)
    ]
