"""The pure LR rules, the scale warmup, and the step-only application of a scale."""

import math

import pytest
import torch

from lightning_accum.core.scaling import ScaledStep, ScaleWarmup, check_rule, held_window_scale, lr_scale


@pytest.mark.parametrize(
    ("rule", "effective", "base", "expected"),
    [("none", 64, 16, 1.0), ("linear", 64, 16, 4.0), ("sqrt", 64, 16, 2.0), ("sqrt", 8, 32, 0.5)],
)
def test_lr_rules(rule, effective, base, expected):
    assert lr_scale(rule, effective, base) == pytest.approx(expected)


def test_unknown_rule_names_the_allowed_values():
    with pytest.raises(ValueError, match=r"`lr_scaling` must be one of 'none', 'linear' or 'sqrt', got 'cubic'"):
        check_rule("cubic")


def test_warmup_moves_from_the_scale_in_force_to_the_new_target():
    warmup = ScaleWarmup(steps=2)
    warmup.set(3.0, step=0)
    assert [warmup.value(s) for s in range(3)] == [1.0, 2.0, 3.0]
    warmup.set(3.0, step=5)  # same target: nothing restarts
    assert warmup.value(5) == 3.0
    warmup.set(1.0, step=10)
    assert [warmup.value(s) for s in (10, 11, 12)] == [3.0, 2.0, 1.0]
    restored = ScaleWarmup(steps=2)
    restored.load_state_dict(warmup.state_dict())
    assert restored == warmup


def test_scaled_step_uses_the_scale_only_inside_step():
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([{"params": [param], "lr": 0.1}], lr=0.1)
    seen = []
    optimizer.register_step_pre_hook(lambda opt, *_: seen.append(opt.param_groups[0]["lr"]))
    scaled = ScaledStep(optimizer, lambda: math.sqrt(4.0))
    param.grad = torch.ones(2)
    optimizer.step()
    assert optimizer.param_groups[0]["lr"] == 0.1  # what a scheduler reads and writes
    assert param.detach().tolist() == pytest.approx([-0.2, -0.2])
    scaled.remove()
    optimizer.step()
    assert param.detach().tolist() == pytest.approx([-0.3, -0.3])
    assert seen == [0.1, 0.1]  # hooks registered before ours see the scheduler's value


def test_an_update_that_raises_leaves_the_lr_scaled_only_until_the_scale_is_removed():
    class Failing(torch.optim.SGD):
        def step(self, closure=None):  # the update itself raises, after the scale was applied
            raise RuntimeError("update failed")

    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = Failing([param], lr=0.1)
    scaled = ScaledStep(optimizer, lambda: 4.0)
    param.grad = torch.ones(1)
    with pytest.raises(RuntimeError, match="update failed"):
        optimizer.step()
    scaled.remove()  # what the callback does on the exception, before checkpoints are written
    assert optimizer.param_groups[0]["lr"] == 0.1


def test_lbfgs_which_reads_its_lr_before_the_closure_steps_with_the_scaled_lr():
    def run(lr, scale=None):
        param = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
        optimizer = torch.optim.LBFGS([param], lr=lr, max_iter=3)
        scaled = ScaledStep(optimizer, lambda: scale) if scale else None

        def closure():
            optimizer.zero_grad()
            loss = (param**2).sum()
            loss.backward()
            return loss

        optimizer.step(closure)
        if scaled:
            scaled.remove()
        return param.detach().tolist(), optimizer.param_groups[0]["lr"]

    plain, _ = run(0.2)
    scaled, lr_after = run(0.1, scale=2.0)
    assert scaled == pytest.approx(plain, rel=1e-6)
    assert lr_after == 0.1


@pytest.mark.parametrize(
    ("rule", "scale", "held", "full", "cap", "expected"),
    [
        ("linear", 4.0, 8, 32, None, 1.0),  # the rule at the batch held: 8 / 8
        ("sqrt", 2.0, 8, 32, None, 1.0),
        ("linear", 4.0, 16, 32, None, 2.0),
        ("linear", 4.0, 32, 32, None, 4.0),  # a full window keeps the factor's scale
        ("linear", 2.0, 24, 32, 2.0, 1.5),  # past the cap (the full batch's 4 held at 2): 2 x 24 / 32
        ("sqrt", 2.0, 16, 64, 2.0, 1.0),  # the full batch's 2.83 held at 2: 2 x sqrt(16 / 64)
        ("linear", 4.0, 16, 32, 4.0, 2.0),  # the cap not reached: the rule at the held batch
        ("linear", 1.5, 16, 32, None, 1.5),  # a warmup rising to 4 keeps its value below the held batch's 2
        ("linear", 6.0, 16, 32, None, 2.0),  # a warmup coming down from 8 to 4: the held batch's 2
        ("none", 1.0, 8, 32, None, 1.0),
    ],
)
def test_a_window_cut_short_steps_at_the_scale_of_the_batch_it_holds(rule, scale, held, full, cap, expected):
    assert held_window_scale(rule, scale, held, full, base_batch_size=8, max_scale=cap) == pytest.approx(expected)
