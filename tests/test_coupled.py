"""cached() and all_gather_with_grad() against a plain big-batch step of a dual encoder with an InfoNCE loss.

The reference never imports lightning_accum: one forward of the whole batch with grad, ``loss.backward()``, one SGD
step; with dropout, the same chunks forwarded with grad in the same order from the same seed. The two-rank check runs
on two CPU processes (gloo) and compares with the single-process big batch of both ranks' rows.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.fsdp._common_utils import _set_fsdp_flattened

from lightning_accum.compat.torch import fully_shard
from lightning_accum.distributed import coupled
from lightning_accum.distributed.coupled import add_listener, all_gather_with_grad, cached
from tests.helpers import launched_ahead

IN_FEATURES, WIDTH, OUT_FEATURES, BATCH = 6, 32, 8, 24
LR = 0.1


class Tower(nn.Module):
    def __init__(self, dropout: float = 0.0, width: int = WIDTH, in_features: int = IN_FEATURES) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(in_features, width), nn.GELU(), nn.Dropout(dropout), nn.Linear(width, OUT_FEATURES)
        )
        self.norm = nn.LayerNorm(OUT_FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.net(x))


class DualEncoder(nn.Module):
    def __init__(self, dropout: float = 0.0, shared: bool = False, width: int = WIDTH, in_features: int = IN_FEATURES):
        super().__init__()
        torch.manual_seed(0)
        self.query = Tower(dropout, width, in_features)
        self.document = self.query if shared else Tower(dropout, width, in_features)
        self.log_temperature = nn.Parameter(torch.tensor(0.5))


def info_nce(queries: torch.Tensor, documents: torch.Tensor, log_temperature: torch.Tensor) -> torch.Tensor:
    logits = queries @ documents.T * log_temperature.exp()
    return nn.functional.cross_entropy(logits, torch.arange(len(queries)))


def make_batch(rows: int = BATCH, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return tuple(torch.randn(rows, IN_FEATURES, generator=generator, dtype=dtype) for _ in range(2))  # type: ignore[return-value]


def step(model: nn.Module, loss: Callable[[Any], torch.Tensor]) -> tuple[dict[str, torch.Tensor], ...]:
    """The gradients of ``loss(model)`` and the weights after one SGD step on them."""
    model.zero_grad()
    loss(model).backward()
    grads = {name: param.grad.clone() for name, param in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return grads, {name: param.detach().clone() for name, param in model.named_parameters()}


def deviation(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[name] - b[name]).abs().max().item() for name in a)


def big_batch(q: torch.Tensor, d: torch.Tensor) -> Callable[[Any], torch.Tensor]:
    return lambda m: info_nce(m.query(q), m.document(d), m.log_temperature)


def with_cache(q: torch.Tensor, d: torch.Tensor, chunk_size: int | None) -> Callable[[Any], torch.Tensor]:
    return lambda m: info_nce(
        cached(m.query, q, chunk_size=chunk_size), cached(m.document, d, chunk_size=chunk_size), m.log_temperature
    )


def chunked_with_grad(q: torch.Tensor, d: torch.Tensor, chunk_size: int) -> Callable[[Any], torch.Tensor]:
    """The chunks forwarded with grad, in cached()'s order: the same random draws as its first pass."""

    def loss(m: Any) -> torch.Tensor:
        queries = torch.cat([m.query(part) for part in q.split(chunk_size)])
        documents = torch.cat([m.document(part) for part in d.split(chunk_size)])
        return info_nce(queries, documents, m.log_temperature)

    return loss


@pytest.mark.parametrize("chunk_size", [1, 7, 16, None])
def test_the_step_is_the_big_batchs_in_float32(chunk_size):
    q, d = make_batch()
    _, expected = step(DualEncoder(), big_batch(q, d))
    _, found = step(DualEncoder(), with_cache(q, d, chunk_size))
    assert deviation(found, expected) <= 1e-6


@pytest.mark.parametrize("chunk_size", [1, 7, 16])
def test_the_gradient_is_the_big_batchs_in_float64(chunk_size):
    """Float32 sums rows in another order per chunk (gradients of ~10 differ by a few 1e-6); float64 shows it exact."""
    q, d = make_batch(dtype=torch.float64)
    expected, _ = step(DualEncoder().double(), big_batch(q, d))
    found, _ = step(DualEncoder().double(), with_cache(q, d, chunk_size))
    assert deviation(found, expected) <= 1e-12


def seeded_step(model: nn.Module, loss: Callable[[Any], torch.Tensor]) -> tuple[dict[str, torch.Tensor], float]:
    """The weights after one step from seed 5, and the next random number drawn after it."""
    torch.manual_seed(5)
    return step(model, loss)[1], torch.rand(1).item()


def test_with_dropout_the_replay_draws_the_first_passs_masks(monkeypatch):
    q, d = make_batch()
    expected, after = seeded_step(DualEncoder(dropout=0.1), chunked_with_grad(q, d, 7))
    found, found_after = seeded_step(DualEncoder(dropout=0.1), with_cache(q, d, 7))
    assert deviation(found, expected) <= 1e-6
    assert found_after == after, "the replay leaves the random state as the forward left it"

    monkeypatch.setattr(coupled, "_restore_rng", lambda *_: None)
    unrestored, _ = seeded_step(DualEncoder(dropout=0.1), with_cache(q, d, 7))
    assert deviation(unrestored, expected) > 1e-4


def test_a_tower_shared_by_queries_and_documents_gets_the_sum_of_both():
    q, d = make_batch()
    _, expected = step(DualEncoder(shared=True), big_batch(q, d))
    _, found = step(DualEncoder(shared=True), with_cache(q, d, 5))
    assert deviation(found, expected) <= 1e-6


def test_each_parameter_accumulates_once_per_backward():
    """One post-accumulate-grad call each (DDP's reducer marks a parameter ready once), with 3 chunks and a tower
    used twice: the replay's torch.autograd.grad accumulates nothing itself."""
    model = DualEncoder(shared=True)
    calls = {name: 0 for name, _ in model.named_parameters()}
    for name, param in model.named_parameters():
        param.register_post_accumulate_grad_hook(lambda _, name=name: calls.__setitem__(name, calls[name] + 1))
    q, d = make_batch()
    with_cache(q, d, 8)(model).backward()
    assert calls == dict.fromkeys(calls, 1)


class DictTower(nn.Module):
    """Takes a dict of token ids and mask; returns a dict holding a tuple."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(20, OUT_FEATURES)
        self.proj = nn.Linear(OUT_FEATURES, OUT_FEATURES)

    def forward(self, batch: dict[str, torch.Tensor], pool: str = "first", scale: float = 1.0) -> dict[str, Any]:
        tokens = self.proj(self.embed(batch["ids"])) * scale
        mask = batch["mask"].unsqueeze(-1)
        pooled = (tokens * mask).sum(1) / mask.sum(1) if pool == "mean" else tokens[:, 0]
        return {"pooled": pooled, "extra": (tokens, batch["mask"])}


def test_dict_inputs_nested_outputs_and_non_tensor_arguments():
    generator = torch.Generator().manual_seed(2)
    queries = {"ids": torch.randint(20, (BATCH, 5), generator=generator), "mask": torch.ones(BATCH, 5)}
    queries["mask"][::3, 3:] = 0
    documents = {"ids": torch.randint(20, (BATCH, 5), generator=generator), "mask": torch.ones(BATCH, 5)}

    def loss(tower: nn.Module, run: Callable[..., Any]) -> torch.Tensor:
        q, d = run(tower, queries, pool="mean", scale=2.0), run(tower, documents, pool="mean", scale=2.0)
        assert isinstance(q, dict)
        assert isinstance(q["extra"], tuple)
        assert torch.equal(q["extra"][1], queries["mask"])
        return info_nce(q["pooled"], d["pooled"], torch.tensor(0.0)) + q["extra"][0].pow(2).mean()

    _, expected = step(DictTower(), lambda tower: loss(tower, lambda t, *a, **k: t(*a, **k)))
    _, found = step(DictTower(), lambda tower: loss(tower, lambda t, *a, **k: cached(t, *a, chunk_size=7, **k)))
    assert deviation(found, expected) <= 1e-6


def test_inputs_that_require_grad_get_their_gradient_through_the_cache():
    """A tower fed by a layer outside it (cut by rows) and by a scalar it shares (whole to every chunk)."""
    q, d = make_batch(dtype=torch.float64)

    def loss(m: Any, run: Callable[..., torch.Tensor]) -> torch.Tensor:
        scale = m.log_temperature.exp()
        return info_nce(run(m.query, m.stem(q) * scale), run(m.document, m.stem(d)), torch.tensor(0.0))

    def model() -> nn.Module:
        encoder = DualEncoder()
        encoder.stem = nn.Linear(IN_FEATURES, IN_FEATURES)
        return encoder.double()

    expected, _ = step(model(), lambda m: loss(m, lambda t, x: t(x)))
    found, _ = step(model(), lambda m: loss(m, lambda t, x: cached(t, x, chunk_size=5)))
    assert deviation(found, expected) <= 1e-12


class ScaledTower(Tower):
    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x) * scale


def test_a_shared_scalar_input_gets_the_sum_over_chunks():
    q, d = make_batch(dtype=torch.float64)
    grads = []
    for run in (lambda t, x, s: t(x, s), lambda t, x, s: cached(t, x, s, chunk_size=5)):
        torch.manual_seed(0)
        tower = ScaledTower().double()
        scale = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
        info_nce(run(tower, q, scale), tower(d, torch.tensor(1.0)), torch.tensor(0.0)).backward()
        grads.append(scale.grad)
    assert abs(grads[0] - grads[1]) <= 1e-12


@pytest.mark.parametrize("backward_under", ["no autocast", "autocast"])
def test_the_replay_runs_under_the_autocast_state_of_the_first_pass(backward_under):
    """Lightning's precision plugin leaves autocast before backward: the replay takes up the forward's state again
    (bfloat16 on CPU here), and a backward under autocast does not turn a float32 forward into bfloat16."""
    q, d = make_batch()
    model, dtypes = DualEncoder(), []
    model.query.net[0].register_forward_hook(lambda *args: dtypes.append(args[2].dtype))
    backward = torch.autocast("cpu", dtype=torch.bfloat16, enabled=backward_under == "autocast")
    for forward_enabled in (True, False):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=forward_enabled):
            loss = with_cache(q, d, 8)(model)
        with backward:
            loss.backward()
    assert dtypes == [torch.bfloat16] * 6 + [torch.float32] * 6  # 3 chunks, first pass and replay, twice


def test_under_autocast_the_gradient_is_the_chunks_with_grad_to_bfloat16_precision():
    """The reference sums the chunks' bfloat16 weight gradients in bfloat16, the cache in float32: a few ulps apart."""
    q, d = make_batch()
    grads = []
    for loss in (chunked_with_grad(q, d, 8), with_cache(q, d, 8)):
        model = DualEncoder()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            value = loss(model)
        value.backward()
        grads.append({name: param.grad for name, param in model.named_parameters()})
    largest = max(grad.abs().max().item() for grad in grads[0].values())
    assert deviation(grads[1], grads[0]) <= largest / 64


def test_without_grad_the_chunks_run_and_nothing_is_kept():
    model, (q, _) = DualEncoder(), make_batch()
    with torch.no_grad():
        found = cached(model.query, q, chunk_size=5)
        expected = model.query(q)
    assert not found.requires_grad
    assert (found - expected).abs().max().item() <= 1e-6


def test_a_listener_hears_each_call_that_builds_a_graph_and_lends_the_chunk_size_of_calls_given_none():
    sizes: list[int] = []
    tower = Tower()
    tower.register_forward_pre_hook(lambda _, args: sizes.append(len(args[0])))
    q, _ = make_batch()
    heard: list[tuple[int, int | None]] = []
    remove = add_listener(lambda rows, chunk: heard.append((rows, chunk)) or 10)
    try:
        cached(tower, q)  # lent 10
        cached(tower, q, chunk_size=12)  # its own
        with torch.no_grad():
            cached(tower, q)  # no graph: not heard, one chunk
    finally:
        remove()
    cached(tower, q)  # nobody listens: one chunk
    assert sizes == [10, 10, 4, 12, 12, 24, 24]
    assert heard == [(24, None), (24, 12)]


def test_batch_norm_in_training_mode_is_refused():
    tower = nn.Sequential(nn.Linear(IN_FEATURES, 4), nn.BatchNorm1d(4))
    with pytest.raises(ValueError, match=r"BatchNorm1d `1` in training mode.*each chunk's.*a second time"):
        cached(tower, torch.randn(8, IN_FEATURES), chunk_size=4)
    assert tower[1].num_batches_tracked == 0, "refused before any forward"
    tower.eval()
    cached(tower, torch.randn(8, IN_FEATURES), chunk_size=4).sum().backward()


@pytest.mark.parametrize(
    ("norm", "train"),
    [
        (lambda: nn.BatchNorm1d(2, track_running_stats=False), False),  # batch statistics even in eval mode
        (lambda: nn.InstanceNorm1d(2, track_running_stats=True), True),  # its running statistics updated twice
    ],
)
def test_a_norm_whose_result_or_buffers_depend_on_the_chunks_is_refused(norm, train):
    tower = nn.Sequential(nn.Linear(IN_FEATURES, 4), nn.Unflatten(1, (2, 2)), norm(), nn.Flatten()).train(train)
    with pytest.raises(ValueError, match=r"cannot run (BatchNorm1d|InstanceNorm1d) `2`.*LayerNorm"):
        cached(tower, torch.randn(8, IN_FEATURES), chunk_size=4)


def test_a_norm_on_each_row_alone_is_exact():
    tower = nn.Sequential(nn.Linear(IN_FEATURES, 4), nn.Unflatten(1, (2, 2)), nn.InstanceNorm1d(2), nn.Flatten())
    x, weights = torch.randn(8, IN_FEATURES), torch.randn(8, 4)
    expected = torch.autograd.grad((tower(x) * weights).sum(), tower[0].weight)[0]
    found = torch.autograd.grad((cached(tower, x, chunk_size=3) * weights).sum(), tower[0].weight)[0]
    assert (found - expected).abs().max().item() <= 1e-5


def test_a_function_is_refused_naming_the_module_argument():
    with pytest.raises(TypeError, match=r"cached\(\) runs an nn.Module.*`module=<function"):
        cached(lambda x: x, torch.randn(4, 2))


def test_a_hook_on_a_parameter_sees_the_summed_gradient_once_not_each_chunks_share():
    q, d = make_batch()
    _, expected = step(DualEncoder(), big_batch(q, d))  # the hook doubles the gradient: the step is twice as long
    model, calls = DualEncoder(), []
    model.query.net[0].weight.register_hook(lambda grad: calls.append(1) or grad * 2)
    _, found = step(model, with_cache(q, d, 5))
    plain, plain_calls = DualEncoder(), []
    plain.query.net[0].weight.register_hook(lambda grad: plain_calls.append(1) or grad * 2)
    _, reference = step(plain, big_batch(q, d))
    assert calls == plain_calls == [1]
    assert deviation(found, reference) <= 1e-6
    assert deviation(found, expected) > 1e-3  # the hook did act


def test_narrow_gradients_are_summed_over_chunks_in_float32_and_rounded_once():
    """bfloat16 parameters: chunks of one row lose no more than the big batch does against float64."""
    q, d = make_batch(96)

    def error(loss: Callable[[Any], torch.Tensor]) -> float:
        exact, _ = step(DualEncoder().double(), big_batch(q.double(), d.double()))
        found, _ = step(DualEncoder().to(torch.bfloat16), loss)
        largest = max(exact[k].abs().max().item() for k in exact)
        return max((found[k].double() - exact[k]).abs().max().item() for k in exact) / largest

    whole = error(big_batch(q.bfloat16(), d.bfloat16()))  # 1.3e-2; summed in bfloat16, chunks of one lost 2.1e-2
    assert error(with_cache(q.bfloat16(), d.bfloat16(), 1)) <= 1.2 * whole


def test_tensors_that_disagree_on_rows_are_refused():
    with pytest.raises(ValueError, match=r"kwargs\['batch'\]\['mask'\] has 5, inputs\[0\] has 6"):
        cached(DictTower(), torch.zeros(6), batch={"ids": torch.zeros(6, 2), "mask": torch.zeros(5, 2)})


@pytest.mark.parametrize("argument", ["chunk_size", "chunk_tokens"])
@pytest.mark.parametrize("value", [0, -1, 2.5, True])
def test_a_chunk_size_or_token_budget_that_is_not_a_positive_int_is_refused(argument, value):
    with pytest.raises(ValueError, match=rf"`{argument}` must be a positive int, got {value}"):
        cached(Tower(), torch.zeros(6, IN_FEATURES), **{argument: value})


class Summary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(IN_FEATURES, 2)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        y = self.linear(x)
        return {"rows": y, "mean": y.mean(0, keepdim=True)}


def test_an_output_without_the_chunks_rows_is_refused():
    with pytest.raises(ValueError, match=r"output\['mean'\] must be a tensor of the chunk's 4 rows, not 1 rows"):
        cached(Summary(), torch.zeros(6, IN_FEATURES), chunk_size=4)


class Centred(Tower):
    """Subtracts the batch's mean embedding: its rows are not independent."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y - y.mean(0)


def test_a_tower_that_mixes_rows_is_not_the_big_batchs_unless_the_chunk_is_the_batch():
    """The row rule: a batch statistic inside the tower sees only its chunk (cached cannot detect it)."""
    q, d = make_batch()

    def encoder() -> DualEncoder:
        model = DualEncoder()
        model.query = Centred()
        return model

    _, expected = step(encoder(), big_batch(q, d))
    _, whole = step(encoder(), with_cache(q, d, None))
    _, chunked = step(encoder(), with_cache(q, d, 6))
    assert deviation(whole, expected) <= 1e-6
    assert deviation(chunked, expected) > 1e-2


class TokenTower(nn.Module):
    """Token embeddings (or ``inputs_embeds``) with positions, self-attention under the padding mask, a masked mean."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.position = nn.Embedding(50, OUT_FEATURES), nn.Embedding(40, OUT_FEATURES)
        self.attention = nn.MultiheadAttention(OUT_FEATURES, 2, dropout=dropout, batch_first=True)
        self.out = nn.Sequential(nn.Linear(OUT_FEATURES, WIDTH), nn.GELU(), nn.Dropout(dropout), nn.Linear(WIDTH, 4))

    def forward(
        self, input_ids: torch.Tensor | None = None, attention_mask: Any = None, inputs_embeds: Any = None
    ) -> torch.Tensor:
        tokens = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        tokens = tokens + self.position(torch.arange(tokens.shape[1]))
        padded = attention_mask == 0
        mixed, _ = self.attention(tokens, tokens, tokens, key_padding_mask=padded, need_weights=False)
        weights = attention_mask.unsqueeze(-1).to(mixed.dtype)
        return self.out((mixed * weights).sum(1) / weights.sum(1))


def padded_tokens(rows: int = BATCH, longest: int = 30) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    lengths = torch.randint(1, longest + 1, (rows,), generator=generator)
    mask = (torch.arange(longest) < lengths[:, None]).long()
    return torch.randint(1, 50, (rows, longest), generator=generator) * mask, mask


def sorted_chunks_with_grad(tower: nn.Module, ids: torch.Tensor, mask: torch.Tensor, tokens: int) -> torch.Tensor:
    """What chunk_tokens says it does, forwarded with grad: rows longest first, chunks of rows x longest <= tokens,
    each cut to its longest row, in the batch's order again."""
    lengths = mask.sum(1)
    order = torch.argsort(lengths, descending=True, stable=True).tolist()
    outputs: list[torch.Tensor | None] = [None] * len(order)
    start = 0
    while start < len(order):
        width = int(lengths[order[start]])
        rows = order[start : start + max(1, tokens // width)]
        for row, output in zip(rows, tower(ids[rows, :width], mask[rows, :width]), strict=True):
            outputs[row] = output
        start += len(rows)
    return torch.stack(outputs)  # type: ignore[arg-type]


def test_chunks_by_a_token_budget_give_the_big_batchs_gradient_to_the_parameters_and_the_inputs_in_float64():
    """Rows sorted by length, cut to each chunk's longest: the outputs and the input gradient come back in the
    batch's order, exactly (the gradient of the cut padding is the big batch's: zero)."""
    ids, mask = padded_tokens()
    weights = torch.randn(BATCH, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    found = []
    for run in (
        lambda t, e: t(inputs_embeds=e, attention_mask=mask),
        lambda t, e: cached(t, inputs_embeds=e, attention_mask=mask, chunk_tokens=60),
    ):
        tower = TokenTower().double()
        embeds = tower.embed(ids).detach().requires_grad_()
        (run(tower, embeds) * weights).sum().backward()
        found.append(
            {"inputs_embeds": embeds.grad, **{n: p.grad for n, p in tower.named_parameters() if p.grad is not None}}
        )
    assert found[0].keys() == found[1].keys()
    assert deviation(found[1], found[0]) <= 1e-12


@pytest.mark.parametrize("rows", ["chunk_size", "lent"])
def test_chunks_by_a_token_budget_hold_at_most_the_budget_and_the_chunk_sizes_rows(rows):
    ids, mask = padded_tokens()
    tower, shapes = TokenTower(), []
    tower.embed.register_forward_pre_hook(lambda _, args: shapes.append(tuple(args[0].shape)))
    remove = add_listener(lambda *_: 3 if rows == "lent" else None)  # as the callback lends micro_batch_size
    try:
        cached(tower, ids, attention_mask=mask, chunk_tokens=60, chunk_size=3 if rows == "chunk_size" else None)
    finally:
        remove()
    assert sum(rows for rows, _ in shapes) == BATCH
    assert all(rows <= 3 and (rows * width <= 60 or rows == 1) for rows, width in shapes)
    assert [width for _, width in shapes] == sorted((width for _, width in shapes), reverse=True)
    assert shapes[-1][1] < mask.shape[1]  # the short rows' chunks are cut short


def test_with_dropout_the_replay_of_chunks_by_a_token_budget_draws_the_first_passs_masks():
    ids, mask = padded_tokens()
    weights = torch.randn(BATCH, 4, generator=torch.Generator().manual_seed(4))
    found = []
    for run in (
        lambda t: sorted_chunks_with_grad(t, ids, mask, 60),
        lambda t: cached(t, ids, attention_mask=mask, chunk_tokens=60),
    ):
        tower = TokenTower(dropout=0.2)
        torch.manual_seed(5)
        (run(tower) * weights).sum().backward()
        found.append({name: param.grad for name, param in tower.named_parameters()})
    assert deviation(found[1], found[0]) <= 1e-6


@pytest.mark.parametrize(
    ("arguments", "found"),
    [
        ({"input_ids": torch.zeros(4, 3, dtype=torch.long)}, "found 0"),
        ({"batch": {"attention_mask": torch.ones(4, 3)}, "attention_mask": torch.ones(4, 3)}, r"found 2 with shapes"),
        ({"attention_mask": torch.ones(4)}, r"found 1 with shapes \[\(4,\)\]"),
    ],
)
def test_a_token_budget_without_one_2d_attention_mask_is_refused(arguments, found):
    with pytest.raises(
        ValueError, match=rf"`chunk_tokens` counts each row's tokens by one 2-D `attention_mask`.*{found}"
    ):
        cached(TokenTower(), chunk_tokens=8, **arguments)


def test_a_parameter_that_fsdp_flattened_is_refused_before_any_forward():
    tower = Tower()
    _set_fsdp_flattened(tower.net[0].weight)  # what FSDP marks the original parameters it views in its flat one with
    calls = []
    tower.register_forward_pre_hook(lambda *_: calls.append(1))
    with pytest.raises(ValueError, match=r"its parameter `net.0.weight` is part of an FSDP flat parameter"):
        cached(tower, torch.zeros(4, IN_FEATURES))
    assert calls == []


def saved_bytes(forward: Callable[[], Any]) -> int:
    """The bytes of the tensors autograd saves for backward while ``forward()`` runs."""
    total = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        forward()
    return total


def test_the_towers_keep_no_activations():
    """Width 512, batch 256, chunks of 16: the cache keeps only its inputs (for the replay), the big batch every
    layer's activations; the loss's own (its 256 x 256 logits) are the same in both."""
    model, q, d = DualEncoder(width=512, in_features=16), torch.randn(256, 16), torch.randn(256, 16)
    big_towers = saved_bytes(lambda: (model.query(q), model.document(d)))
    cached_towers = saved_bytes(
        lambda: (cached(model.query, q, chunk_size=16), cached(model.document, d, chunk_size=16))
    )
    assert cached_towers == q.nbytes + d.nbytes
    assert cached_towers < big_towers / 4
    big_total = saved_bytes(lambda: big_batch(q, d)(model))
    cached_total = saved_bytes(lambda: with_cache(q, d, 16)(model))
    assert cached_total < big_total / 3


def test_without_a_process_group_the_tensor_itself_is_returned():
    assert not dist.is_initialized()
    tensor = torch.randn(3, 2, requires_grad=True)
    assert all_gather_with_grad(tensor) is tensor


# ------------------------------------------------------------------ two ranks (gloo)

HALF = BATCH // 2


def clip_loss(images: torch.Tensor, texts: torch.Tensor, log_scale: torch.Tensor, rank: int = 0) -> torch.Tensor:
    """OpenCLIP's ClipLoss as its users set it for large runs (``local_loss=True, gather_with_grad=True``): this
    rank's rows against every rank's, the two directions averaged; with no process group, the whole batch's."""
    all_images, all_texts = all_gather_with_grad(images), all_gather_with_grad(texts)
    logits_per_image = log_scale.exp() * images @ all_texts.T
    logits_per_text = log_scale.exp() * texts @ all_images.T
    labels = torch.arange(len(images)) + len(images) * rank
    return (
        nn.functional.cross_entropy(logits_per_image, labels) + nn.functional.cross_entropy(logits_per_text, labels)
    ) / 2


def _ddp_average(model: nn.Module) -> dict[str, torch.Tensor]:
    """What DDP does to the gradients: their mean over the ranks."""
    for param in model.parameters():
        dist.all_reduce(param.grad)
        param.grad /= dist.get_world_size()
    return {name: param.grad for name, param in model.named_parameters()}


def _rank(rank: int, port: int, folder: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        (q, d), rows = make_batch(), slice(rank * HALF, (rank + 1) * HALF)
        record: dict[str, Any] = {}
        model = DualEncoder()
        queries = all_gather_with_grad(cached(model.query, q[rows], chunk_size=5))
        documents = all_gather_with_grad(model.document(d[rows]))
        info_nce(queries, documents, model.log_temperature).backward()
        record["global"] = _ddp_average(model)
        model = DualEncoder()
        clip_loss(
            cached(model.query, q[rows], chunk_size=5), model.document(d[rows]), model.log_temperature, rank
        ).backward()
        record["local"] = _ddp_average(model)
        for name, attempt in {
            "unequal": lambda: all_gather_with_grad(torch.zeros(3 + rank, 2)),
            "fsdp2": lambda: cached(fully_shard(Tower()), q[rows], chunk_size=5),
        }.items():
            try:
                attempt()
                record[name] = ""
            except ValueError as raised:
                record[name] = str(raised)
        torch.save(record, Path(folder) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _two_ranks(folder: Path) -> Path:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.start_processes(_rank, args=(port, str(folder)), nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + 120
    try:
        while not context.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                raise TimeoutError("the two ranks did not finish within 120 s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    return folder


two_ranks = launched_ahead("two_ranks", _two_ranks)


def test_two_ranks_gathering_with_grad_take_the_big_batchs_step(two_ranks):
    expected, _ = step(DualEncoder(), big_batch(*make_batch()))
    for rank in (0, 1):
        record = torch.load(two_ranks / f"rank{rank}.pt")
        assert deviation(record["global"], expected) <= 1e-5


def test_a_rank_local_loss_against_the_gathered_batch_takes_the_big_batchs_step(two_ranks):
    """OpenCLIP's local loss: the ranks' losses differ, so the gather's backward must sum every rank's gradient of
    this rank's rows (a world-size factor on this rank's own is right for a global loss only); the temperature too."""
    q, d = make_batch()
    model = DualEncoder()
    expected, _ = step(model, lambda m: clip_loss(m.query(q), m.document(d), m.log_temperature))
    for rank in (0, 1):
        found = torch.load(two_ranks / f"rank{rank}.pt")["local"]
        assert deviation(found, expected) <= 1e-5


def test_ranks_with_unequal_rows_are_refused_on_every_rank(two_ranks):
    for rank in (0, 1):
        error = torch.load(two_ranks / f"rank{rank}.pt")["unequal"]
        assert error == "all_gather_with_grad() needs the same number of rows on every rank, got rank 0: 3, rank 1: 4"


def test_fsdp2_shards_are_refused_naming_the_parameter(two_ranks):
    for rank in (0, 1):
        error = torch.load(two_ranks / f"rank{rank}.pt")["fsdp2"]
        assert "cached() cannot run `FSDPTower`: its parameter `net.0.weight` is a DTensor (FSDP2" in error
        assert "DDP (DDPAccumulationStrategy) or DeepSpeed ZeRO stage 1 or 2" in error
