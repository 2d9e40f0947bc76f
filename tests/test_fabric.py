"""lightning_accum.fabric.Accumulator on one process, against a plain-PyTorch big batch, and its refusals.

The reference (tests/scripts/fabric_common.py) takes one SGD step per window on the window's sequences as one batch,
the loss summed over their supervised tokens and divided by their number. The loop under test is litgpt's
``finetune/full.py`` loop with the Accumulator in place of its accumulation lines.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from fabric_common import (  # noqa: E402
    LR,
    TinyLM,
    litgpt_loop,
    make_pairs,
    mean_loss,
    micro_batches,
    reference_snapshots,
    relative_distance,
)

from lightning_accum.fabric import Accumulator  # noqa: E402

ROWS = 3  # sequences per micro-batch
# 30 pairs in 10 micro-batches of 3; factor 4: windows 4, 4 and the 2 left; samples 6-8 bear no token at all
PAIRS = make_pairs(30, empty=range(6, 9))
DATA = micro_batches(PAIRS, ROWS)
WINDOWS = [DATA[0:4], DATA[4:8], DATA[8:10]]


def setup(lr: float = LR, **fabric_args: Any) -> tuple[Fabric, Any, Any]:
    fabric = Fabric(accelerator="cpu", devices=1, **fabric_args)
    model = TinyLM()
    return fabric, *fabric.setup(model, torch.optim.SGD(model.parameters(), lr=lr))


def train(accumulator: Accumulator, model: Any, optimizer: Any, data: list, epochs: int = 1, **batches: Any) -> None:
    for _ in range(epochs):
        for batch in accumulator.batches(data, **batches):
            with accumulator.micro_step(batch) as micro:
                micro.backward(mean_loss(model, batch))
            if micro.should_step:
                optimizer.step()
                optimizer.zero_grad()


def test_token_weighted_windows_equal_the_big_batch_and_litgpts_loop_does_not():
    reference = reference_snapshots(WINDOWS * 2)
    fabric, model, optimizer = setup()
    accumulator = Accumulator(fabric, model, optimizer, scheduling={0: 4}, normalize_by="token", shift_labels=True)
    train(accumulator, model, optimizer, DATA, epochs=2)
    assert accumulator.optimizer_steps == 6  # the short last window of each epoch is stepped
    assert relative_distance(list(model.parameters()), reference[-1], reference[0]) <= 1e-6

    fabric, model, optimizer = setup()
    litgpt_loop(fabric, model, optimizer, DATA, factor=4, epochs=2)
    assert relative_distance(list(model.parameters()), reference[-1], reference[0]) > 1e-2


def test_a_summed_loss_and_a_micro_batch_without_tokens_give_the_same_steps():
    """`reduction="sum"` takes the micro-batch's summed token losses; micro-batch 2 bears no token at all, so its mean
    is 0 / 0 (NaN): it weighs nothing and raises nothing."""
    assert mean_loss(TinyLM(), DATA[2]).isnan()
    reference = reference_snapshots(WINDOWS)
    fabric, model, optimizer = setup()
    accumulator = Accumulator(fabric, model, optimizer, scheduling={0: 4}, normalize_by="token", shift_labels=True)
    for batch in accumulator.batches(DATA):
        with accumulator.micro_step(batch) as micro:
            logits = model(batch["input_ids"])[:, :-1].flatten(0, 1)
            labels = batch["labels"][:, 1:].flatten()
            micro.backward(F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum"), reduction="sum")
        if micro.should_step:
            optimizer.step()
            optimizer.zero_grad()
    assert relative_distance(list(model.parameters()), reference[-1], reference[0]) <= 1e-6


def test_every_micro_batch_weighs_the_same_by_default_and_the_short_window_is_its_own_mean():
    fabric, model, optimizer = setup()
    accumulator = Accumulator(fabric, model, optimizer, scheduling={0: 4})
    data = DATA[3:]  # 7 micro-batches, each with tokens: windows 4 and 3
    train(accumulator, model, optimizer, data)
    net = TinyLM()
    sgd = torch.optim.SGD(net.parameters(), lr=LR)
    start = [p.detach().clone() for p in net.parameters()]
    for window in (data[:4], data[4:]):
        sgd.zero_grad()
        (sum(mean_loss(net, batch) for batch in window) / len(window)).backward()
        sgd.step()
    assert relative_distance(list(model.parameters()), list(net.parameters()), start) <= 1e-6


def test_an_endless_iterable_stops_after_max_steps_windows():
    reference = reference_snapshots([DATA[0:4], DATA[4:8], [*DATA[8:10], *DATA[0:2]]])
    fabric, model, optimizer = setup()
    accumulator = Accumulator(fabric, model, optimizer, scheduling={0: 4}, normalize_by="token", shift_labels=True)
    fetched = []

    def endless():
        while True:
            for batch in DATA:
                fetched.append(batch)
                yield batch

    train(accumulator, model, optimizer, endless(), max_steps=3)
    assert accumulator.optimizer_steps == 3
    assert len(fetched) == 12  # never a micro-batch of a window beyond the last
    assert relative_distance(list(model.parameters()), reference[-1], reference[0]) <= 1e-6


def test_steps_are_counted_up_front_with_the_short_window():
    fabric, model, optimizer = setup()
    loader = torch.utils.data.DataLoader(PAIRS, batch_size=ROWS)  # 10 batches of 3
    accumulator = Accumulator(fabric, model, optimizer, scheduling={0: 4, 3: 2}, unit="step")
    assert accumulator.steps_per_epoch(loader) == 3  # 4, 4, 2
    assert accumulator.total_steps(loader, epochs=2) == 3 + 5  # then factor 2: 5 windows
    assert accumulator.total_steps(loader, epochs=2, max_steps=4) == 4
    accumulator.close()  # one Accumulator per optimizer at a time
    target = Accumulator(fabric, model, optimizer, target_batch_size=12)  # 12 / (3 x 1 rank): factor 4
    assert target.steps_per_epoch(loader) == 3


def test_a_target_batch_the_micro_batches_cannot_reach_is_refused_naming_the_numbers():
    fabric, model, optimizer = setup()
    with pytest.raises(ValueError, match=r"`target_batch_size=10` is not a multiple of .* 3 x 1 = 3.*9 or 12"):
        Accumulator(fabric, model, optimizer, target_batch_size=10, micro_batch_size=3)
    accumulator = Accumulator(fabric, model, optimizer, target_batch_size=10)
    loader = torch.utils.data.DataLoader(PAIRS, batch_size=ROWS)
    with pytest.raises(ValueError, match=r"`target_batch_size=10` is not a multiple"):
        next(iter(accumulator.batches(loader)))


def test_the_schedule_the_user_passed_is_left_unchanged():
    fabric, model, optimizer = setup()
    scheduling = {3: 2}
    Accumulator(fabric, model, optimizer, scheduling=scheduling, unit="step")
    assert scheduling == {3: 2}


def _weights(model: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _misuse_backward_outside(accumulator: Accumulator, model: Any, optimizer: Any) -> None:
    batches = accumulator.batches(DATA)
    batch = next(batches)
    with accumulator.micro_step(batch) as micro:
        micro.backward(mean_loss(model, batch))
    micro.backward(mean_loss(model, batch))


def _misuse_nested(accumulator: Accumulator, model: Any, optimizer: Any) -> None:
    batches = accumulator.batches(DATA)
    batch = next(batches)
    with accumulator.micro_step(batch), accumulator.micro_step(batch):
        pass


def _misuse_another_batch(accumulator: Accumulator, model: Any, optimizer: Any) -> None:
    batches = accumulator.batches(DATA)
    next(batches)
    with accumulator.micro_step(DATA[1]):
        pass


def _misuse_step_mid_window(accumulator: Accumulator, model: Any, optimizer: Any) -> None:
    for batch in accumulator.batches(DATA):
        with accumulator.micro_step(batch) as micro:
            micro.backward(mean_loss(model, batch))
        optimizer.step()  # Accelerate's habit: a step on every batch


def _misuse_no_backward(accumulator: Accumulator, model: Any, optimizer: Any) -> None:
    batches = accumulator.batches(DATA)
    batch = next(batches)
    with accumulator.micro_step(batch):
        mean_loss(model, batch)


def _misuse_skipped_batch(accumulator: Accumulator, model: Any, optimizer: Any) -> None:
    for _ in accumulator.batches(DATA):
        pass


def _misuse_save_mid_window(accumulator: Accumulator, model: Any, optimizer: Any) -> None:
    for batch in accumulator.batches(DATA):
        with accumulator.micro_step(batch) as micro:
            micro.backward(mean_loss(model, batch))
        accumulator.state_dict()


def _misuse_sum_without_counts(accumulator: Accumulator, model: Any, optimizer: Any) -> None:
    batches = accumulator.batches(DATA)
    batch = next(batches)
    with accumulator.micro_step(batch) as micro:
        micro.backward(mean_loss(model, batch), reduction="sum")


@pytest.mark.parametrize(
    ("misuse", "error", "match"),
    [
        (_misuse_backward_outside, RuntimeError, r"micro.backward\(loss\) was called outside its `micro_step` block"),
        (_misuse_nested, RuntimeError, "entered inside another `micro_step` block"),
        (_misuse_another_batch, RuntimeError, "takes the micro-batch `accumulator.batches\\(loader\\)` yielded last"),
        (_misuse_step_mid_window, RuntimeError, r"optimizer.step\(\) was called after micro-step 1 of a window of 4"),
        (_misuse_no_backward, RuntimeError, r"ended without `micro.backward\(loss\)`"),
        (_misuse_skipped_batch, RuntimeError, "was not trained on"),
        (_misuse_save_mid_window, RuntimeError, r"state_dict was called inside a window \(micro-step 1 of 4\)"),
        (_misuse_sum_without_counts, ValueError, "reduction='sum'.*normalize_by='sample' or 'token'"),
    ],
)
def test_misuse_raises_what_to_do_before_any_weight_changes(misuse, error, match):
    fabric, model, optimizer = setup()
    accumulator = Accumulator(fabric, model, optimizer, scheduling={0: 4})
    before = _weights(model)
    with pytest.raises(error, match=match):
        misuse(accumulator, model, optimizer)
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(model), strict=True))


@pytest.mark.parametrize("order", ["before", "after"])
def test_fabric_backward_inside_a_micro_step_block_raises_and_the_window_is_dropped(order):
    """``fabric.backward(loss)`` beside ``micro.backward(loss)`` in one block trained on a doubled, wrongly weighted
    gradient without a word: it raises now, before or after ``micro.backward``, no step can take the window, and
    outside a block ``fabric.backward`` is Fabric's own again."""
    fabric, model, optimizer = setup()
    accumulator = Accumulator(fabric, model, optimizer, scheduling={0: 4}, log_metrics=False)
    before = _weights(model)
    batches = accumulator.batches(DATA)
    batch = next(batches)

    def both_backwards() -> None:
        with accumulator.micro_step(batch) as micro:
            if order == "after":
                micro.backward(mean_loss(model, batch))
            fabric.backward(mean_loss(model, batch))

    with pytest.raises(RuntimeError, match=r"fabric.backward\(loss\) was called inside a `micro_step` block"):
        both_backwards()
    assert all(p.grad is None for p in model.parameters())  # the window was dropped with what it held
    with pytest.raises(RuntimeError, match="with no window's gradient ready"):
        optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(model), strict=True))
    assert "backward" not in vars(fabric)  # Fabric's own method again
    fabric.backward(mean_loss(model, DATA[0]))  # outside a block, as any Fabric loop
    assert all(p.grad is not None for p in model.parameters())


def test_a_users_own_fabric_backward_is_put_back_after_each_block():
    fabric, model, optimizer = setup()
    calls = []

    def wrapper(*args: Any, **kwargs: Any) -> None:  # a user's instrumentation of fabric.backward
        calls.append(1)
        Fabric.backward(fabric, *args, **kwargs)

    fabric.backward = wrapper
    train(Accumulator(fabric, model, optimizer, scheduling={0: 2}, log_metrics=False), model, optimizer, DATA[:4])
    assert fabric.backward is wrapper
    assert len(calls) == 4  # micro.backward goes through it, in every block


def test_a_step_at_learning_rate_0_on_a_window_in_progress_is_refused_as_any_early_step():
    """A warmup from learning rate 0 stepped after the first micro-batch: refused, though torch's checkpoint steps an
    optimizer at learning rate 0 (on zero gradients, to create its state) and that step passes."""
    fabric, model, optimizer = setup(lr=0.0)
    with pytest.raises(RuntimeError, match=r"optimizer.step\(\) was called after micro-step 1 of a window of 4"):
        _misuse_step_mid_window(Accumulator(fabric, model, optimizer, scheduling={0: 4}), model, optimizer)


def test_a_second_accumulator_over_parameters_another_one_steps_is_refused_naming_both():
    fabric, model, optimizer = setup()
    Accumulator(fabric, model, optimizer, scheduling={0: 4})
    head = fabric.setup_optimizers(torch.optim.AdamW(model.head.parameters(), lr=LR))
    with pytest.raises(ValueError, match=r"`optimizer` \(AdamW\) holds 2 parameter\(s\) that an open Accumulator"
                       r" already steps with its optimizer \(SGD\): head.weight, head.bias"):  # fmt: skip
        Accumulator(fabric, model, head)


def test_a_model_or_optimizer_this_fabric_did_not_set_up_is_refused():
    """Ported from Lightning's tests/tests_fabric/test_fabric.py::test_no_backward_sync (a model not set up raises
    TypeError): here for the model and the optimizer, and for those of another Fabric."""
    fabric, model, optimizer = setup()
    other, other_model, other_optimizer = setup()
    raw = TinyLM()
    with pytest.raises(TypeError, match="`model` must be the module this Fabric set up.*got a TinyLM"):
        Accumulator(fabric, raw, optimizer)
    with pytest.raises(TypeError, match="`model` must be the module this Fabric set up"):
        Accumulator(fabric, other_model, optimizer)
    with pytest.raises(TypeError, match="`optimizer` must be the optimizer this Fabric set up.*got a SGD"):
        Accumulator(fabric, model, torch.optim.SGD(raw.parameters(), lr=LR))
    with pytest.raises(TypeError, match="`optimizer` must be the optimizer this Fabric set up"):
        Accumulator(fabric, model, other_optimizer)
    with pytest.raises(TypeError, match="`fabric` must be a lightning.fabric.Fabric"):
        Accumulator(object(), model, optimizer)  # type: ignore[arg-type]


def _scaled_reference(windows: list, scales: list[float], t_max: int) -> list[torch.Tensor]:
    """Plain PyTorch: the big-batch steps at lr = cosine schedule x the window's scale."""
    net = TinyLM()
    sgd = torch.optim.SGD(net.parameters(), lr=LR)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(sgd, T_max=t_max)
    for window, scale in zip(windows, scales, strict=True):
        big = {key: torch.cat([batch[key] for batch in window]) for key in ("input_ids", "labels")}
        logits, labels = net(big["input_ids"])[:, :-1].flatten(0, 1), big["labels"][:, 1:].flatten()
        sgd.zero_grad()
        (F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum") / (labels != -100).sum()).backward()
        configured = sgd.param_groups[0]["lr"]
        sgd.param_groups[0]["lr"] = configured * scale
        sgd.step()
        sgd.param_groups[0]["lr"] = configured
        cosine.step()
    return list(net.parameters())


def _scaled_run(data: list, epochs: int, **options: Any) -> tuple[list[torch.Tensor], list[float], list[float]]:
    fabric, model, optimizer = setup()
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=5)
    accumulator = Accumulator(
        fabric, model, optimizer, normalize_by="token", shift_labels=True, micro_batch_size=ROWS, **options
    )
    configured, after_step = [], []
    for _ in range(epochs):
        for batch in accumulator.batches(data):
            with accumulator.micro_step(batch) as micro:
                micro.backward(mean_loss(model, batch))
            if micro.should_step:
                configured.append(cosine.get_last_lr()[0])
                optimizer.step()
                after_step.append(optimizer.param_groups[0]["lr"])
                optimizer.zero_grad()
                cosine.step()
    return list(model.parameters()), configured, after_step


def test_lr_scaling_scales_the_step_alone_and_a_chained_scheduler_keeps_its_shape():
    """Linear rule, base batch 3 (one micro-batch): factor 2 steps at twice the scheduled LR, factor 4 at 4 times."""
    data = DATA[:8]  # whole windows only
    weights, configured, after_step = _scaled_run(
        data, epochs=1, scheduling={0: 2, 2: 4}, unit="step", lr_scaling="linear", base_batch_size=ROWS
    )
    assert after_step == configured  # the scheduler's value is back after each step
    reference = _scaled_reference([data[0:2], data[2:4], data[4:8]], [2.0, 2.0, 4.0], t_max=5)
    start = list(TinyLM().parameters())
    assert relative_distance(weights, reference, start) <= 1e-6


def test_a_short_last_window_steps_at_the_rate_of_the_batch_it_holds():
    """Factor 4 scaled by 4; the epoch's last window holds 2 micro-batches, so it steps at twice the LR, not 4."""
    weights, _, _ = _scaled_run(DATA, epochs=1, scheduling={0: 4}, lr_scaling="linear", base_batch_size=ROWS)
    reference = _scaled_reference(WINDOWS, [4.0, 4.0, 2.0], t_max=5)
    start = list(TinyLM().parameters())
    assert relative_distance(weights, reference, start) <= 1e-6


class Captured:
    """A Fabric logger that keeps what it is given."""

    name, version, root_dir, log_dir, group_separator = "captured", 0, "", "", "/"

    def __init__(self) -> None:
        self.logged: list[tuple[int | None, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.logged.append((step, dict(metrics)))

    def log_hyperparams(self, *_: Any, **__: Any) -> None:
        pass

    def save(self) -> None:
        pass

    def finalize(self, status: str) -> None:
        pass


def test_the_metrics_and_the_windows_exact_loss_are_logged_through_fabric_log_dict():
    logger = Captured()
    fabric, model, optimizer = setup(loggers=[logger])
    accumulator = Accumulator(
        fabric, model, optimizer, scheduling={0: 4}, normalize_by="token", shift_labels=True, log_every_n_steps=1
    )
    net = TinyLM()  # the big batch's loss before each step, on the reference's own weights
    sgd = torch.optim.SGD(net.parameters(), lr=LR)
    expected = []
    for window in WINDOWS:
        big = {key: torch.cat([batch[key] for batch in window]) for key in ("input_ids", "labels")}
        logits, labels = net(big["input_ids"])[:, :-1].flatten(0, 1), big["labels"][:, 1:].flatten()
        loss = F.cross_entropy(logits, labels, ignore_index=-100)
        expected.append(loss.item())
        sgd.zero_grad()
        loss.backward()
        sgd.step()
    train(accumulator, model, optimizer, DATA)
    assert [step for step, _ in logger.logged] == [1, 2, 3]
    tokens = [sum(int((batch["labels"][:, 1:] != -100).sum()) for batch in window) for window in WINDOWS]
    for (_, metrics), loss, count, micro_steps in zip(logger.logged, expected, tokens, (4, 8, 10), strict=True):
        assert metrics["accum/window_loss"] == pytest.approx(loss, rel=1e-6)  # the window's exact token mean
        assert metrics["accum/window_tokens"] == count
        assert metrics["accum/factor"] == 4
        assert metrics["accum/micro_steps"] == micro_steps
        assert metrics["accum/lr"] == LR


def _host_reads(factor: int, windows: int) -> int:
    """The reads of a tensor's value on the host made from lightning_accum's code over ``windows`` windows."""
    import traceback

    from torch.overrides import TorchFunctionMode

    package = str(Path(__file__).resolve().parents[1] / "lightning_accum")
    reads = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "nonzero"}

    class Count(TorchFunctionMode):
        count = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            if getattr(func, "__name__", "") in reads and any(
                frame.filename.startswith(package) for frame in traceback.extract_stack()
            ):
                Count.count += 1
            return func(*args, **(kwargs or {}))

    fabric, model, optimizer = setup()
    accumulator = Accumulator(
        fabric, model, optimizer, scheduling={0: factor}, normalize_by="token", shift_labels=True, log_metrics=False
    )
    data = [DATA[3 + i % 7] for i in range(factor * windows)]
    with Count():
        train(accumulator, model, optimizer, data)
    return Count.count


def test_no_value_is_read_on_the_host_per_micro_step():
    """Counts stay on the device: the reads per window do not grow with the micro-steps in it."""
    assert _host_reads(factor=8, windows=2) == _host_reads(factor=2, windows=2)


def _bf16_windows(grad_accum_dtype: str | None) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """Under bf16-true, factor 3: each window's weights at its start and its gradient as the step sees it."""
    fabric, model, optimizer = setup(precision="bf16-true")
    accumulator = Accumulator(
        fabric, model, optimizer, scheduling={0: 3}, normalize_by="token", shift_labels=True,
        grad_accum_dtype=grad_accum_dtype,
    )  # fmt: skip
    seen, start = [], _weights(model)
    for batch in accumulator.batches(DATA[3:9]):
        with accumulator.micro_step(batch) as micro:
            micro.backward(mean_loss(model, batch))
        if micro.should_step:
            seen.append((start, [p.grad.clone() for p in model.parameters()]))
            optimizer.step()
            optimizer.zero_grad()
            start = _weights(model)
    return seen


def _float32_sum(weights: list[torch.Tensor], window: list) -> list[torch.Tensor]:
    """Plain PyTorch: each micro-batch's bfloat16 gradient, weighted by its share of the window's tokens, summed in
    float32 and rounded to bfloat16 once."""
    net = TinyLM().to(torch.bfloat16)
    with torch.no_grad():
        for param, value in zip(net.parameters(), weights, strict=True):
            param.copy_(value)
    tokens = [(batch["labels"][:, 1:] != -100).sum() for batch in window]
    total = [torch.zeros_like(p, dtype=torch.float32) for p in net.parameters()]
    for batch, count in zip(window, tokens, strict=True):
        net.zero_grad()
        mean_loss(net, batch).backward()
        for sum_, param in zip(total, net.parameters(), strict=True):
            sum_ += param.grad.float() * (count / sum(tokens))
    return [sum_.to(torch.bfloat16) for sum_ in total]


def _ulps(value: torch.Tensor, reference: torch.Tensor) -> float:
    """The largest distance between ``value`` and ``reference`` in units of the last place of bfloat16 at the
    reference (at least the smallest normal's)."""
    ulp = (torch.nextafter(reference.abs(), torch.tensor(float("inf"), dtype=torch.bfloat16)) - reference.abs()).float()
    ulp = ulp.clamp(min=torch.finfo(torch.bfloat16).tiny)
    return float(((value.float() - reference.float()).abs() / ulp).max())


def test_bf16_true_gradients_are_the_float32_sum_rounded_once_within_one_ulp():
    windows = [DATA[3:6], DATA[6:9]]
    wide = _bf16_windows("float32")
    assert len(wide) == 2
    for (start, grads), window in zip(wide, windows, strict=True):
        reference = _float32_sum(start, window)
        assert max(_ulps(g, r) for g, r in zip(grads, reference, strict=True)) <= 1.0
    # accumulated in bfloat16 (grad_accum_dtype=None), every micro-step rounds: further than one place from it
    start, grads = _bf16_windows(None)[0]
    assert max(_ulps(g, r) for g, r in zip(grads, _float32_sum(start, windows[0]), strict=True)) > 1.0


def test_a_fabric_loader_gives_its_batch_size_to_a_target_batch():
    """Fabric's loader wrapper is no DataLoader: its batch size is read all the same (12 / 3 = factor 4)."""
    fabric, model, optimizer = setup()
    loader = fabric.setup_dataloaders(
        torch.utils.data.DataLoader(PAIRS, batch_size=ROWS), use_distributed_sampler=False
    )
    accumulator = Accumulator(fabric, model, optimizer, target_batch_size=12, normalize_by="token", shift_labels=True)
    train(accumulator, model, optimizer, loader)
    assert accumulator.optimizer_steps == 3
    assert accumulator.samples_seen == 30
    reference = reference_snapshots(WINDOWS)
    assert relative_distance(list(model.parameters()), reference[-1], reference[0]) <= 1e-6


@pytest.mark.parametrize(
    ("arguments", "error", "match"),
    [
        ({"shift_labels": True}, ValueError, r"`shift_labels=True` counts .* normalize_by='micro_batch'"),
        ({"shift_labels": True, "normalize_by": "token", "count_items": len}, ValueError, "without `count_items`"),
        ({"shift_labels": 1}, TypeError, "`shift_labels` must be a bool"),
        ({"gradient_sync": "sometimes"}, ValueError, "`gradient_sync` must be one of"),
        ({"log_every_n_steps": 0}, ValueError, "`log_every_n_steps` must be an integer >= 1, got 0"),
        ({"normalize_by": "tokens"}, ValueError, "`normalize_by` must be one of"),
        ({"lr_scaling": "cubic"}, ValueError, "`lr_scaling` must be one of 'none', 'linear' or 'sqrt'"),
        ({"scheduling": {0: 0}}, ValueError, r"scheduling\[0\] \(the factor\)"),
        ({"grad_accum_dtype": "float16"}, ValueError, "`grad_accum_dtype` must be None, 'float32' or 'float64'"),
    ],
)
def test_bad_arguments_are_refused_naming_them(arguments, error, match):
    fabric, model, optimizer = setup()
    with pytest.raises(error, match=match):
        Accumulator(fabric, model, optimizer, **arguments)


def test_a_bad_max_steps_is_refused_before_any_micro_batch_is_fetched():
    fabric, model, optimizer = setup()
    accumulator = Accumulator(fabric, model, optimizer)
    fetched = []

    def recorded():
        for batch in DATA:
            fetched.append(batch)
            yield batch

    with pytest.raises(ValueError, match="`max_steps` must be an integer >= 0, got -1"):
        next(accumulator.batches(recorded(), max_steps=-1))
    assert fetched == []


def test_the_console_names_the_accumulator_not_the_callback(capsys):
    fabric, model, optimizer = setup()
    accumulator = Accumulator(fabric, model, optimizer, scheduling={0: 4}, lr_scaling="linear")
    train(accumulator, model, optimizer, DATA)
    printed = capsys.readouterr().out
    assert printed.startswith("Accumulator: factor 4 x world 1")
    assert "AccumulationScheduler" not in printed


# ------------------------------------------------------------------ found by an adversarial review


def test_a_call_left_early_leaves_the_epoch_and_the_next_call_trains_all_it_is_given():
    """A `break` in the middle of a window drops that window (its gradient zeroed); the next call is a whole epoch of
    what it is given, not cut short by the micro-batches the first call took."""
    fabric, model, optimizer = setup()
    accumulator = Accumulator(fabric, model, optimizer, scheduling={0: 4}, normalize_by="token", shift_labels=True)
    for index, batch in enumerate(accumulator.batches(DATA)):
        with accumulator.micro_step(batch) as micro:
            micro.backward(mean_loss(model, batch))
        if micro.should_step:
            optimizer.step()
            optimizer.zero_grad()
        if index == 5:  # inside the second window
            break
    assert accumulator.optimizer_steps == 1
    after_break = [p.detach().clone() for p in model.parameters()]
    taken = []
    for batch in accumulator.batches(DATA):
        taken.append(batch)
        with accumulator.micro_step(batch) as micro:
            micro.backward(mean_loss(model, batch))
        if micro.should_step:
            optimizer.step()
            optimizer.zero_grad()
    assert len(taken) == 10
    assert accumulator.optimizer_steps == 1 + 3
    # the second call's steps are the big batch's steps from where the first call left the weights
    net = TinyLM()
    with torch.no_grad():
        for p, q in zip(net.parameters(), after_break, strict=True):
            p.copy_(q)
    sgd = torch.optim.SGD(net.parameters(), lr=LR)
    for window in WINDOWS:
        sgd.zero_grad()
        tokens = sum(int((b["labels"][:, 1:] != -100).sum()) for b in window)
        sum(mean_loss(net, b).nan_to_num() * int((b["labels"][:, 1:] != -100).sum()) for b in window).div(
            tokens
        ).backward()
        sgd.step()
    assert relative_distance(list(model.parameters()), list(net.parameters()), after_break) <= 1e-6


def test_a_resumed_epoch_given_the_micro_batches_left_trains_them_all():
    """Resumed between windows after 4 micro-batches, with the 6 left of the epoch (a sized iterable): both windows
    are trained and the epoch ends after them."""
    fabric, model, optimizer = setup()
    accumulator = Accumulator(fabric, model, optimizer, scheduling={0: 4})
    train(accumulator, model, optimizer, DATA, max_steps=1)
    state = accumulator.state_dict()
    accumulator.close()
    resumed = Accumulator(fabric, model, optimizer, scheduling={0: 4})
    resumed.load_state_dict(state)
    taken = 0
    for batch in resumed.batches(DATA[4:]):
        taken += 1
        with resumed.micro_step(batch) as micro:
            micro.backward(mean_loss(model, batch).nan_to_num())
        if micro.should_step:
            optimizer.step()
            optimizer.zero_grad()
    assert (taken, resumed.optimizer_steps, resumed.epoch) == (6, 3, 1)


def test_parameters_the_optimizer_does_not_hold_are_refused():
    fabric = Fabric(accelerator="cpu", devices=1)
    net = TinyLM()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.head.parameters(), lr=LR))
    with pytest.raises(ValueError, match=r"`optimizer` does not hold \d+ trainable parameter\(s\) of the model"):
        Accumulator(fabric, model, optimizer)


def test_one_accumulator_per_optimizer_and_none_after_close():
    fabric, model, optimizer = setup()
    first = Accumulator(fabric, model, optimizer, scheduling={0: 2}, lr_scaling="linear", base_batch_size=1)
    with pytest.raises(ValueError, match="`optimizer` already has an Accumulator"):
        Accumulator(fabric, model, optimizer)
    first.close()
    with pytest.raises(RuntimeError, match=r"Accumulator.batches was called after `close\(\)`"):
        next(first.batches(DATA))
    second = Accumulator(fabric, model, optimizer, scheduling={0: 2})
    train(second, model, optimizer, DATA[3:7])
    assert optimizer.param_groups[0]["lr"] == LR  # nothing of the first's scale is left


def test_an_error_in_the_last_block_drops_the_window_and_refuses_the_step():
    fabric, model, optimizer = setup()
    accumulator = Accumulator(fabric, model, optimizer, scheduling={0: 4})
    before = _weights(model)
    for batch in accumulator.batches(DATA):
        try:
            with accumulator.micro_step(batch) as micro:
                if micro.should_step:
                    raise KeyError("a bad batch")
                micro.backward(mean_loss(model, batch).nan_to_num())
        except KeyError:
            with pytest.raises(RuntimeError, match="no window's gradient ready"):
                optimizer.step()
            break
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(model), strict=True))
    assert all(p.grad is None for p in model.parameters())


def test_shifted_labels_weigh_samples_under_normalize_by_sample_and_count_the_token_schedule():
    """shift_labels with normalize_by='sample' and unit='token': the windows weigh samples; the schedule counts the
    shifted tokens."""
    fabric, model, optimizer = setup()
    accumulator = Accumulator(
        fabric, model, optimizer, scheduling={0: 4}, unit="token", normalize_by="sample", shift_labels=True
    )
    train(accumulator, model, optimizer, DATA)
    shifted = sum(int((batch["labels"][:, 1:] != -100).sum()) for batch in DATA)
    assert accumulator.features["token_count"].tokens_seen == shifted  # type: ignore[attr-defined]
    net = TinyLM()
    sgd = torch.optim.SGD(net.parameters(), lr=LR)
    start = [p.detach().clone() for p in net.parameters()]
    for window in WINDOWS:
        sgd.zero_grad()
        rows = sum(len(batch["labels"]) for batch in window)
        (sum(mean_loss(net, batch).nan_to_num() * len(batch["labels"]) for batch in window) / rows).backward()
        sgd.step()
    assert relative_distance(list(model.parameters()), list(net.parameters()), start) <= 1e-6


def test_a_state_loaded_in_the_same_process_moves_the_token_schedule_back():
    fabric, model, optimizer = setup()
    accumulator = Accumulator(fabric, model, optimizer, scheduling={0: 1, 30: 4}, unit="token", shift_labels=True)
    train(accumulator, model, optimizer, DATA, max_steps=2)
    state = accumulator.state_dict()
    train(accumulator, model, optimizer, DATA)  # past 30 tokens: factor 4
    assert accumulator.factor == 4
    accumulator.load_state_dict(state)
    batches = accumulator.batches(DATA)
    next(batches)
    assert accumulator.factor == 1  # at the tokens of the state loaded


# ------------------------------------------------------------------ a pretraining loop's budget and LR schedule


def _endless() -> Any:
    """litgpt's CycleIterator over the micro-batches: an iterable without a length or an end."""
    while True:
        yield from DATA


def _tokens(batch: dict[str, torch.Tensor]) -> int:
    return int((batch["labels"][:, 1:] != -100).sum())  # what the shifted loss bears, counted by hand


@pytest.mark.parametrize("budget", ["max_tokens", "max_samples"])
def test_an_endless_iterable_stops_after_the_window_that_reaches_the_budget(budget):
    fabric, model, optimizer = setup()
    accumulator = Accumulator(
        fabric, model, optimizer, scheduling={0: 2}, unit="token", normalize_by="token", shift_labels=True,
        micro_batch_size=ROWS,  # an endless generator has no `batch_size` to read it from
    )  # fmt: skip
    limit = 100 if budget == "max_tokens" else 30
    taken = []
    for batch in accumulator.batches(_endless(), **{budget: limit}):
        with accumulator.micro_step(batch) as micro:
            micro.backward(mean_loss(model, batch))
        taken.append(batch)
        if micro.should_step:
            optimizer.step()
            optimizer.zero_grad()
    counts = [_tokens(batch) if budget == "max_tokens" else ROWS for batch in taken]
    windows = [sum(counts[i : i + 2]) for i in range(0, len(counts), 2)]
    assert len(taken) % 2 == 0  # whole windows only
    assert sum(windows[:-1]) < limit <= sum(windows)  # the window that reached it was the last
    assert accumulator.optimizer_steps == len(windows)
    assert accumulator.features["token_count"].tokens_seen == sum(map(_tokens, taken))  # type: ignore[attr-defined]
    assert accumulator.samples_seen == ROWS * len(taken)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"max_tokens": 100}, ValueError, r"`max_tokens=100` stops at the loss-bearing tokens .* unit='token'"),
        ({"max_samples": -1}, ValueError, "`max_samples` must be"),
        ({"max_samples": 1.5}, TypeError, "`max_samples` must be an integer"),
        ({"max_samples": 30}, ValueError, r"`max_samples=30` counts samples .* pass `micro_batch_size`"),
    ],
)
def test_a_budget_that_cannot_be_kept_is_refused_naming_it(kwargs, error, match):
    fabric, model, optimizer = setup()
    accumulator = Accumulator(fabric, model, optimizer, scheduling={0: 2})
    with pytest.raises(error, match=match):
        next(accumulator.batches(_endless(), **kwargs))


@pytest.mark.parametrize("lr_scaling", ["none", "sqrt"])
def test_an_lr_schedule_moved_by_tokens_ends_where_the_token_budget_ends(lr_scaling):
    """litgpt's warmup then cosine, sized in 40 steps over a budget of 400 tokens: moved by the tokens consumed, it
    stands at 40 x tokens / 400 after each window (computed here by hand), and at its end once the budget is spent,
    whatever steps the windows took. With LR scaling too, whose scale is taken off after each update (it once put the
    LR of before the schedule's move back)."""
    import math

    from lightning_accum import SampleDrivenLR

    fabric, model, optimizer = setup(lr=1.0)

    def warmup_cosine(step: int) -> float:
        return step / 4 if step < 4 else 0.5 * (1 + math.cos(math.pi * (step - 4) / 36))

    schedule = SampleDrivenLR(
        torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine), steps=40, total=400, unit="token"
    )
    accumulator = Accumulator(
        fabric, model, optimizer, scheduling={0: 3}, unit="token", normalize_by="token", shift_labels=True,
        lr_scheduler=schedule, log_metrics=False, lr_scaling=lr_scaling, base_batch_size=ROWS, micro_batch_size=ROWS,
    )  # fmt: skip
    consumed, seen = 0, []
    for batch in accumulator.batches(_endless(), max_tokens=400):
        with accumulator.micro_step(batch) as micro:
            micro.backward(mean_loss(model, batch))
        consumed += _tokens(batch)
        if micro.should_step:
            seen.append((optimizer.param_groups[0]["lr"], warmup_cosine(min(40, consumed * 40 // 400))))
            optimizer.step()
            optimizer.zero_grad()
            schedule.step()  # the loop's own call, as litgpt makes it: a moved schedule ignores it
    # the LR the step used is the one the tokens before its window called for; after the last, the schedule's end
    used = [lr for lr, _ in seen]
    expected = [1.0 * warmup_cosine(0)] + [called for _, called in seen[:-1]]
    assert used == pytest.approx(expected)
    assert consumed >= 400
    assert optimizer.param_groups[0]["lr"] == pytest.approx(warmup_cosine(40))  # annealed to its end: 0


def test_an_lr_scheduler_the_accumulator_cannot_move_is_refused():
    fabric, model, optimizer = setup()
    plain = torch.optim.lr_scheduler.LinearLR(optimizer)
    with pytest.raises(TypeError, match=r"`lr_scheduler` is moved by the samples or tokens .*SampleDrivenLR\("):
        Accumulator(fabric, model, optimizer, lr_scheduler=plain)
    other = torch.optim.SGD(TinyLM().parameters(), lr=0.1)
    from lightning_accum import SampleDrivenLR

    with pytest.raises(TypeError, match="schedules another optimizer than the Accumulator's"):
        Accumulator(fabric, model, optimizer, lr_scheduler=SampleDrivenLR(torch.optim.lr_scheduler.LinearLR(other)))


def test_a_fabric_tensorboard_logger_gets_the_callbacks_dashboard_and_summary(tmp_path):
    """The same ``accum/*`` scalars, Custom Scalars layout and summary text as a Trainer's TensorBoardLogger gets, read
    back with TensorBoard's own event reader."""
    from lightning.fabric.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2, metadata

    logger = TensorBoardLogger(tmp_path, name="run", version=0)
    fabric, model, optimizer = setup(loggers=[logger])
    accumulator = Accumulator(fabric, model, optimizer, scheduling={0: 4}, micro_batch_size=ROWS, log_every_n_steps=1)
    train(accumulator, model, optimizer, DATA)
    logger.finalize("success")
    events = EventAccumulator(str(tmp_path / "run" / "version_0"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("accum/factor")] == [(1, 4.0), (2, 4.0), (3, 4.0)]
    assert [e.value for e in events.Scalars("accum/effective_batch_size")] == [12.0, 12.0, 6.0]  # the short window
    layouts = [
        layout_pb2.Layout.FromString(t.tensor_proto.string_val[0]) for t in events.Tensors(metadata.CONFIG_SUMMARY_TAG)
    ]
    assert len(layouts) == 1  # written once, with the first logged step
    charts = {chart.title for category in layouts[0].category for chart in category.chart}
    assert "accum/factor" in str(layouts[0])
    assert len(charts) >= 5
    summary = events.Tensors("accum/summary/text_summary")[0].tensor_proto.string_val[0].decode()
    assert summary == "micro 3 x factor 4 x world 1 = 12 samples; lr 0.5 (not scaled)"
