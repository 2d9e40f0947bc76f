"""cached() on a sentence-transformers model, against sentence-transformers' own losses (code we did not write).

A tiny random BERT and its tokenizer are built in a temporary folder (no download) and loaded as sentence-transformers
loads any model: ``Transformer(path)`` and mean ``Pooling``. The reference is ``CachedMultipleNegativesRankingLoss``
(its own GradCache, in train mode with dropout: the batches are built so that its chunks, which it cuts to their
longest row, have the shapes of ours, and so draw the same masks) or ``MultipleNegativesRankingLoss`` (one plain
forward), one SGD step each.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import sentence_transformers as st
import torch
import transformers
from sentence_transformers.util import cos_sim
from torch import nn
from torch.utils.data import DataLoader
from transformers import BertConfig, BertModel, BertTokenizerFast

try:  # sentence-transformers 6 (beside transformers 5, torch >= 2.6)
    from sentence_transformers.sentence_transformer.losses import (
        CachedMultipleNegativesRankingLoss,
        MultipleNegativesRankingLoss,
    )
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
except ImportError:  # sentence-transformers 5 (beside transformers 4, the oldest supported torch)
    from sentence_transformers.losses import CachedMultipleNegativesRankingLoss, MultipleNegativesRankingLoss
    from sentence_transformers.models import Pooling, Transformer

from lightning_accum import AccumulationScheduler, cached
from tests.helpers import trainer

WORDS = [f"w{i}" for i in range(300)]
ROWS, CHUNK, LONGEST, SCALE, LR = 16, 4, 24, 20.0, 0.1


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random BERT (2 layers, width 32, dropout 0.1) and a word-level tokenizer, saved as a model folder."""
    folder = tmp_path_factory.mktemp("tiny-bert")
    vocab = {word: index for index, word in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS])}
    if int(transformers.__version__.split(".")[0]) >= 5:
        BertTokenizerFast(vocab=vocab).save_pretrained(folder)
    else:  # transformers 4 reads the vocabulary from a file
        (folder / "vocab.txt").write_text("".join(f"{word}\n" for word in vocab))
        BertTokenizerFast(vocab_file=str(folder / "vocab.txt")).save_pretrained(folder)
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=48,
        max_position_embeddings=64,
    )
    BertModel(config).save_pretrained(folder)
    return folder


def sentence_model(folder: Path) -> st.SentenceTransformer:
    """The model in train mode (sentence-transformers builds it in eval mode): dropout draws its masks."""
    transformer = Transformer(str(folder))
    width = getattr(transformer, "get_embedding_dimension", None) or transformer.get_word_embedding_dimension  # 6; 5
    model = st.SentenceTransformer(modules=[transformer, Pooling(width(), "mean")])
    return model.train()


def preprocess(model: st.SentenceTransformer, rows: list[str]) -> dict[str, Any]:
    """The model's features of ``rows``, as its users make them: ``preprocess`` (sentence-transformers 6, with a
    "modality" string) or ``tokenize`` (5)."""
    return model.preprocess(rows) if hasattr(model, "preprocess") else model.tokenize(rows)


def texts(seed: int, rows: int = ROWS) -> list[str]:
    """Texts of 1 to LONGEST words; the first of every CHUNK rows has LONGEST, so no chunk is cut shorter."""
    rng = random.Random(seed)
    lengths = [LONGEST if row % CHUNK == 0 else rng.randint(1, LONGEST) for row in range(rows)]
    return [" ".join(rng.choice(WORDS) for _ in range(length)) for length in lengths]


def mnrl(queries: torch.Tensor, documents: torch.Tensor) -> torch.Tensor:
    """MultipleNegativesRankingLoss as its users write it: scaled cosine similarities, the diagonal the positives."""
    scores = cos_sim(queries, documents) * SCALE
    return nn.functional.cross_entropy(scores, torch.arange(len(queries)))


def stepped(model: nn.Module, loss: Callable[[], torch.Tensor], seed: int = 5) -> dict[str, torch.Tensor]:
    """The weights after one SGD step on ``loss()``, computed from ``seed``."""
    model.zero_grad()
    torch.manual_seed(seed)
    loss().backward()
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return {name: param.detach().clone() for name, param in model.named_parameters()}


def deviation(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[name] - b[name]).abs().max().item() for name in a)


def st_cached_step(folder: Path, pair: tuple[list[str], list[str]]) -> dict[str, torch.Tensor]:
    model = sentence_model(folder)
    features = [preprocess(model, side) for side in pair]
    reference = CachedMultipleNegativesRankingLoss(model, scale=SCALE, mini_batch_size=CHUNK)
    return stepped(model, lambda: reference(features, None))


def mean_pooled(output: Any, mask: torch.Tensor) -> torch.Tensor:
    """Mean pooling over the unpadded tokens, as the Pooling module computes it."""
    weights = mask.unsqueeze(-1).to(output.last_hidden_state.dtype)
    return (output.last_hidden_state * weights).sum(1) / weights.sum(1).clamp(min=1e-9)


@pytest.mark.parametrize("given_as", ["preprocess", "BatchEncoding", "**encoding"])
def test_sentence_transformers_inputs_as_they_come_take_its_own_cached_losss_step(model_dir, given_as):
    pair = (texts(1), texts(2))
    expected = st_cached_step(model_dir, pair)
    model = sentence_model(model_dir)
    tokenizer = model[0].tokenizer

    def loss() -> torch.Tensor:
        if given_as == "preprocess":  # a dict of tensors and a "modality" string, positionally
            sides = [cached(model, preprocess(model, side), chunk_size=CHUNK) for side in pair]
            return mnrl(*(side["sentence_embedding"] for side in sides))
        encodings = [tokenizer(side, padding=True, return_tensors="pt") for side in pair]
        if given_as == "BatchEncoding":  # a UserDict, not a dict
            return mnrl(*(cached(model, encoding, chunk_size=CHUNK)["sentence_embedding"] for encoding in encodings))
        bert = model[0].auto_model  # the Hugging Face model itself, with the encoding as keyword arguments
        sides = [mean_pooled(cached(bert, **e, chunk_size=CHUNK), e["attention_mask"]) for e in encodings]
        return mnrl(*sides)

    assert deviation(stepped(model, loss), expected) <= 1e-6


def test_the_non_tensor_outputs_are_the_first_chunks_and_the_callers_features_are_left_as_they_were(model_dir):
    model = sentence_model(model_dir)
    features = preprocess(model, texts(3))
    features.setdefault("modality", "text")  # sentence-transformers 6's own non-tensor feature, carried by 5 too
    before = dict(features)
    out = cached(model, features, chunk_size=CHUNK)
    assert out["modality"] == "text"
    assert out["token_embeddings"].shape[:2] == features["input_ids"].shape
    assert torch.equal(out["input_ids"], features["input_ids"])
    assert features.keys() == before.keys()  # the model writes its outputs into each chunk's dict, not the caller's
    assert all(features[key] is before[key] for key in before)


class SentenceEmbedding(nn.Module):
    """The model's pooled embedding alone: what chunk_tokens needs (its chunks have no common token length)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, features: dict[str, Any]) -> torch.Tensor:
        return self.model(features)["sentence_embedding"]


def test_chunks_by_a_token_budget_take_the_plain_losss_step(model_dir):
    """Eval mode (no dropout): chunks of rows sorted by length and cut to their longest row, one plain forward."""
    rng = random.Random(4)
    pair = tuple([" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40))) for _ in range(ROWS)] for _ in "qd")
    reference = sentence_model(model_dir).eval()
    plain = MultipleNegativesRankingLoss(reference, scale=SCALE)
    expected = stepped(reference, lambda: plain([preprocess(reference, side) for side in pair], None))
    model = sentence_model(model_dir).eval()
    tower = SentenceEmbedding(model)
    sizes: list[tuple[int, int]] = []
    model[0].register_forward_pre_hook(lambda _, args: sizes.append(tuple(args[0]["input_ids"].shape)))

    def loss() -> torch.Tensor:
        return mnrl(*(cached(tower, preprocess(model, side), chunk_tokens=120) for side in pair))

    assert deviation(stepped(model, loss), expected) <= 1e-6
    assert all(rows * length <= 120 or rows == 1 for rows, length in sizes)
    assert max(rows for rows, _ in sizes) > 120 // 42  # short rows share a chunk: not one chunk per longest row
    with pytest.raises(ValueError, match=r"changes shape between chunks.*chunk_tokens cuts each chunk"):
        cached(model, preprocess(model, pair[0]), chunk_tokens=120)  # its outputs hold per-token states


# ------------------------------------------------------------------ in a LightningModule, as its users write it


class Pairs(torch.utils.data.Dataset):
    def __init__(self, queries: list[str], documents: list[str]) -> None:
        self.queries, self.documents = queries, documents

    def __len__(self) -> int:
        return len(self.queries)

    def __getitem__(self, index: int) -> tuple[str, str]:
        return self.queries[index], self.documents[index]


def pair_loader(model: st.SentenceTransformer) -> DataLoader:
    """Loader batches of ROWS pairs, tokenized by the model as a collate function."""

    def collate(rows: list[tuple[str, str]]) -> tuple[dict[str, Any], dict[str, Any]]:
        return preprocess(model, [q for q, _ in rows]), preprocess(model, [d for _, d in rows])

    return DataLoader(Pairs(texts(6, 3 * ROWS), texts(7, 3 * ROWS)), batch_size=ROWS, collate_fn=collate)


class SentenceEncoder(pl.LightningModule):
    def __init__(self, model: st.SentenceTransformer) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch: tuple[dict[str, Any], dict[str, Any]], batch_idx: int) -> torch.Tensor:
        queries, documents = (cached(self.model, side)["sentence_embedding"] for side in batch)
        return mnrl(queries, documents)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def test_a_sentence_transformer_fit_in_lightning_takes_its_own_cached_losss_steps(model_dir):
    """Three optimizer steps with dropout, micro_batch_size lent as the chunk size, against the loss's own loop."""
    reference = sentence_model(model_dir)
    loss = CachedMultipleNegativesRankingLoss(reference, scale=SCALE, mini_batch_size=CHUNK)
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    torch.manual_seed(5)
    for queries, documents in pair_loader(reference):
        optimizer.zero_grad()
        loss([queries, documents], None).backward()
        optimizer.step()

    module = SentenceEncoder(sentence_model(model_dir))
    torch.manual_seed(5)
    run = trainer([AccumulationScheduler({0: 1}, micro_batch_size=CHUNK)], max_epochs=1)
    run.fit(module, pair_loader(module.model))
    assert run.global_step == 3
    expected = dict(reference.named_parameters())
    assert deviation(dict(module.model.named_parameters()), expected) <= 1e-6
