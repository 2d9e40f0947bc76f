"""The strategy mixin and ManualAccumulation on one process: arguments, errors, and exactness without a reference gap.

The collective counts and the two-process exactness are in test_distributed.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, ParallelStrategy, SingleDeviceStrategy
from torch import nn

from lightning_accum import (
    AccumulationScheduler,
    AccumulationStrategyMixin,
    DDPAccumulationStrategy,
    FSDPAccumulationStrategy,
    ManualAccumulation,
    ModelParallelAccumulationStrategy,
)
from lightning_accum.distributed.sync import can_control, check_gradient_sync, skip_gradient_sync
from tests.helpers import (
    FSDP2,
    NO_FSDP2,
    RegressionModule,
    loader,
    make_data,
    max_deviation,
    reference_weights,
    trainer,
    weights,
)


@pytest.fixture
def one_process_group():
    """A gloo process group of one, for DDP on this process; destroyed afterwards."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_every_parent_argument_passes_through():
    ddp = DDPAccumulationStrategy(
        gradient_sync="every", find_unused_parameters=True, bucket_cap_mb=5, static_graph=False
    )
    assert ddp.gradient_sync == "every"
    assert ddp._ddp_kwargs == {"find_unused_parameters": True, "bucket_cap_mb": 5, "static_graph": False}
    model_parallel = ModelParallelAccumulationStrategy(
        data_parallel_size=2, tensor_parallel_size=1, save_distributed_checkpoint=False
    )
    assert model_parallel.gradient_sync == "last"
    assert (model_parallel._data_parallel_size, model_parallel._save_distributed_checkpoint) == (2, False)
    fsdp = FSDPAccumulationStrategy(sharding_strategy="SHARD_GRAD_OP", auto_wrap_policy={nn.Linear}, cpu_offload=False)
    assert fsdp.sharding_strategy.name == "SHARD_GRAD_OP"
    assert isinstance(ddp, DDPStrategy)
    assert isinstance(model_parallel, ModelParallelStrategy)


def test_a_bad_gradient_sync_names_the_argument():
    expected = r"`gradient_sync` must be one of \['last', 'every', 'reduce_scatter'\], got 'sometimes'"
    with pytest.raises(ValueError, match=expected):
        DDPAccumulationStrategy(gradient_sync="sometimes")
    with pytest.raises(ValueError, match="gradient_sync"):
        check_gradient_sync(None)


@pytest.mark.parametrize(
    ("text", "value", "windows"), [("true", True, 3), ("false", False, 0), ("1", 1, 1), ("always", "always", None)]
)
def test_lightning_cli_reads_check_collectives_from_yaml(text, value, windows):
    from lightning.pytorch.cli import LightningArgumentParser
    from lightning.pytorch.strategies import Strategy

    parser = LightningArgumentParser()
    parser.add_subclass_arguments(Strategy, "strategy")
    strategy = "lightning_accum.ModelParallelAccumulationStrategy"
    config = parser.parse_string(f"strategy: {{class_path: {strategy}, init_args: {{check_collectives: {text}}}}}")
    given = config.strategy.init_args.check_collectives
    assert (given, type(given)) == (value, type(value))  # 1 stays a number of windows, not True
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes  # its name before 4.49
    assert instantiate(config).strategy._checked_windows == windows


def test_the_mixin_refuses_a_strategy_without_data_parallel_communication():
    class SingleDeviceAccumulation(AccumulationStrategyMixin, SingleDeviceStrategy):
        pass

    with pytest.raises(TypeError, match="ParallelStrategy.*SingleDeviceAccumulation is not one"):
        SingleDeviceAccumulation(device="cpu")


def test_the_mixin_refuses_a_strategy_that_accumulates_by_itself():
    # DeepSpeed needs the deepspeed package; a ParallelStrategy that owns accumulation stands in for it
    class OwnsAccumulation(DDPStrategy):
        @property
        def handles_gradient_accumulation(self) -> bool:
            return True

    class Mixed(AccumulationStrategyMixin, OwnsAccumulation):
        pass

    with pytest.raises(ValueError, match="accumulates gradients by itself"):
        Mixed()


def test_a_window_that_ends_here_must_not_skip_sync():
    strategy = DDPAccumulationStrategy()
    strategy.connect_window(lambda: True)
    with pytest.raises(RuntimeError, match="ends the AccumulationScheduler's window"), strategy.block_backward_sync():
        pass
    strategy.connect_window(lambda: False)
    with strategy.block_backward_sync():
        assert strategy._sync_blocked
    assert not strategy._sync_blocked


def test_skip_gradient_sync_leaves_a_plain_module_alone():
    net = nn.Linear(2, 1)
    assert not can_control(net)
    with skip_gradient_sync(net, "last"):
        net(torch.ones(1, 2)).sum().backward()
    assert net.weight.grad is not None


class ManualModule(RegressionModule):
    def __init__(self, accumulation: ManualAccumulation, wrong_last_step: bool = False) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.accumulation = accumulation
        self.wrong_last_step = wrong_last_step

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        with self.accumulation.micro_step(self) as micro:
            loss = super().training_step(batch, batch_idx)
            if micro.should_step and self.wrong_last_step:
                with self.trainer.strategy.block_backward_sync():  # the misuse the strategy must catch
                    self.manual_backward(micro.scale(loss))
            else:
                self.manual_backward(micro.scale(loss))
        if micro.should_step:
            optimizer.step()
            optimizer.zero_grad()


@pytest.mark.parametrize(
    ("scheduling", "unit", "windows"),
    [
        (3, "step", [[3, 3, 3, 1], [3, 3, 3, 1]]),  # the last window of an epoch holds what is left
        ({0: 2, 3: 4}, "step", [[2, 2, 2, 4], [4, 4, 2]]),  # a change in the middle of an epoch
        ({0: 1, 1: 5}, "epoch", [[1] * 10, [5, 5]]),
    ],
)
def test_manual_accumulation_equals_the_big_batch_reference(scheduling, unit, windows):
    x, y = make_data(40)
    module = ManualModule(ManualAccumulation(scheduling, unit=unit))
    fit = trainer(max_epochs=2)
    fit.fit(module, loader(x, y, 4))
    assert fit.global_step == sum(len(epoch) for epoch in windows)
    assert max_deviation(weights(module), reference_weights(x, y, 4, windows)) <= 1e-6


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"scheduling": 0}, ValueError, "scheduling"),
        ({"scheduling": 2.5}, TypeError, "scheduling"),
        ({"scheduling": {0: 0}}, ValueError, "factor"),
        ({"scheduling": 2, "unit": "sample"}, ValueError, "'step' or 'epoch', got 'sample'"),
    ],
)
def test_manual_accumulation_rejects_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        ManualAccumulation(**kwargs)


def test_one_process_has_nothing_to_reduce_so_nothing_to_refuse(one_process_group):
    # with 2 ranks the same training_step raises (test_distributed.py); with 1 the gradients are complete
    x, y = make_data(16)
    module = ManualModule(ManualAccumulation(2), wrong_last_step=True)
    fit = trainer(max_epochs=1, devices=1, strategy=DDPAccumulationStrategy(), use_distributed_sampler=False)
    fit.fit(module, loader(x, y, 4))
    assert max_deviation(weights(module), reference_weights(x, y, 4, [[2, 2]])) <= 1e-6


def test_gradient_sync_every_steps_normally(one_process_group):
    x, y = make_data(16)
    module = RegressionModule()
    strategy = DDPAccumulationStrategy(gradient_sync="every")
    fit = trainer([AccumulationScheduler({0: 2})], max_epochs=1, strategy=strategy, use_distributed_sampler=False)
    fit.fit(module, loader(x, y, 4))
    assert fit.global_step == 2
    assert max_deviation(weights(module), reference_weights(x, y, 4, [[2, 2]])) <= 1e-6


def test_the_callback_hands_its_window_to_the_strategy_and_takes_it_back(one_process_group):
    x, y = make_data(16)
    seen: list[bool] = []

    class Probe(DDPAccumulationStrategy):
        def block_backward_sync(self):  # noqa: ANN201
            seen.append(self._window_ends is not None)
            return super().block_backward_sync()

    strategy = Probe()
    fit = trainer([AccumulationScheduler({0: 2})], max_epochs=1, strategy=strategy)
    fit.fit(RegressionModule(), loader(x, y, 4))
    assert seen == [True, True]  # micro-steps 0 and 2 of windows [0, 1] and [2, 3]
    assert strategy._window_ends is None


@pytest.mark.skipif(not FSDP2, reason=NO_FSDP2)  # below the floor the FSDP2 model is refused instead
def test_the_callback_warns_that_stock_model_parallel_reduce_scatters_every_micro_step(one_process_group):
    class Sharded(RegressionModule):
        def configure_model(self) -> None:  # ModelParallelStrategy insists on it; one process has nothing to shard
            pass

    x, y = make_data(8)
    fit = trainer(
        [AccumulationScheduler({0: 2})],
        max_epochs=1,
        strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1),
    )
    with pytest.warns(UserWarning, match="ModelParallelAccumulationStrategy"):
        fit.fit(Sharded(), loader(x, y, 4))


def test_the_strategies_are_parallel_strategies():
    for cls in (DDPAccumulationStrategy, FSDPAccumulationStrategy, ModelParallelAccumulationStrategy):
        assert issubclass(cls, ParallelStrategy)
        assert issubclass(cls, AccumulationStrategyMixin)
        assert cls.__mro__.index(AccumulationStrategyMixin) < cls.__mro__.index(ParallelStrategy)
