"""Every torch from 2.4: what lightning_accum finds in the installed torch, and FSDP2 refused where it is not tested.

The FSDP2 mechanics (one reduction per window, float32 accumulation, the noise scale on unsharded gradients, the
collective guard) read FSDP2 state that is tested exact from ``lightning_accum.compat.torch.FSDP2_FLOOR`` on. Below it,
a model with ``fully_shard`` units is refused before any optimizer step, in the Trainer (with
``ModelParallelAccumulationStrategy``, or the callback under stock ``ModelParallelStrategy``) and in Fabric (the
``Accumulator``), naming the torch release it needs. Here the refusal is tested on every torch (the floor raised above
the installed release where the installed one is new enough), in one process; on a torch below the floor (CI's oldest
stage) also on two real ranks, as a user launches them.
"""

from __future__ import annotations

import ast
import importlib
import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallelStrategy
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

from lightning_accum import AccumulationScheduler, ModelParallelAccumulationStrategy
from lightning_accum.compat import torch as _torch
from lightning_accum.compat.versions import TORCH_FLOOR
from lightning_accum.distributed.sync import skip_gradient_sync
from lightning_accum.fabric import Accumulator
from tests.helpers import FSDP2, RegressionModule, launch_environment, loader, make_data, make_net, trainer

SCRIPTS = Path(__file__).resolve().parent / "scripts"


@pytest.fixture
def fsdp2_refused(monkeypatch):
    """The FSDP2 floor above the installed torch (as on a torch older than the floor); the group of one destroyed."""
    release = _torch.torch_release()
    monkeypatch.setattr(_torch, "FSDP2_FLOOR", max(_torch.FSDP2_FLOOR, (release[0], release[1] + 1, 0)))
    yield f"torch>={'.'.join(map(str, _torch.FSDP2_FLOOR))}"
    if dist.is_initialized():
        dist.destroy_process_group()


def test_the_fsdp2_names_are_found_in_the_installed_torch():
    fsdp = importlib.import_module(
        "torch.distributed.fsdp" if _torch.torch_release() >= (2, 6, 0) else "torch.distributed._composable.fsdp"
    )
    assert _torch.fsdp_module_type() is fsdp.FSDPModule
    assert type(_torch.mixed_precision_policy(param_dtype=torch.bfloat16)) is fsdp.MixedPrecisionPolicy
    tensor = importlib.import_module(
        "torch.distributed.tensor" if _torch.torch_release() >= (2, 5, 0) else "torch.distributed._tensor"
    )
    assert _torch.dtensor_type() is tensor.DTensor


def test_the_private_torch_names_read_outside_fsdp2_are_in_the_installed_torch():
    # cached() (lightning_accum/distributed/coupled.py) and the batch-norm warning (_checks.py) read these on every
    # torch; the FSDP2 state is pinned in tests/test_torch_contract.py where FSDP2 runs
    from torch.nn.modules.batchnorm import _BatchNorm, _NormBase
    from torch.utils import _pytree as pytree
    from torch.utils.checkpoint import get_device_states, set_device_states

    assert issubclass(nn.BatchNorm1d, _BatchNorm)
    assert issubclass(_BatchNorm, _NormBase)
    assert issubclass(nn.InstanceNorm1d, _NormBase)
    assert not issubclass(nn.InstanceNorm1d, _BatchNorm)
    assert dict in pytree.SUPPORTED_NODES
    assert isinstance(pytree.tree_flatten({"a": 1})[1], pytree.TreeSpec)
    leaves, spec = pytree.tree_flatten_with_path({"a": [torch.ones(1)]})
    assert pytree.keystr(leaves[0][0]) == "['a'][0]"
    assert pytree.tree_unflatten([2], spec) == {"a": [2]}
    assert get_device_states(torch.ones(1)) == ([], [])  # CPU tensors: no device state to keep
    set_device_states([], [])


class _Pair:  # a node type registered as a library written for an older torch registers it: without key paths
    def __init__(self, first: torch.Tensor, second: torch.Tensor) -> None:
        self.first, self.second = first, second


def test_a_node_without_key_paths_names_its_children_by_position_and_the_others_keep_their_keys():
    from torch.utils import _pytree as pytree

    pytree.register_pytree_node(_Pair, lambda p: ([p.first, p.second], None), lambda leaves, _: _Pair(*leaves))
    try:
        mask = torch.ones(2, 3)
        tree = {"out": _Pair(torch.zeros(2), torch.ones(2)), "kwargs": {"attention_mask": mask}, "n": 3}
        with pytest.raises(ValueError, match="flatten_with_keys_fn"):  # torch's own, on this node
            pytree.tree_flatten_with_path(tree)
        found, spec = _torch.tree_flatten_with_path(tree)
        keys = [pytree.keystr(path) for path, _ in found]
        assert sorted(keys) == sorted(["['out'][0]", "['out'][1]", "['kwargs']['attention_mask']", "['n']"])
        assert spec == pytree.tree_flatten(tree)[1]
        assert all(a is b for (_, a), b in zip(found, pytree.tree_leaves(tree), strict=True))  # tree_flatten's order
        assert next(leaf for path, leaf in found if path[-1] == pytree.MappingKey("attention_mask")) is mask
        plain = {"x": [torch.ones(1)]}  # a tree whose nodes all name their children: torch's own answer
        assert _torch.tree_flatten_with_path(plain) == pytree.tree_flatten_with_path(plain)
    finally:
        if hasattr(pytree, "_deregister_pytree_node"):
            pytree._deregister_pytree_node(_Pair)
        else:  # torch 2.4
            pytree.SUPPORTED_NODES.pop(_Pair, None)


def test_the_feature_floors_are_the_tested_releases():
    # pinned to literal releases, so that a broken version check cannot skip the FSDP2 tests of a newer torch
    release = _torch.torch_release()
    assert _torch.has_fsdp2_mechanics() == (release >= (2, 9, 0))
    assert _torch.fsdp2_reduces_unused_params() == (release >= (2, 13, 0))
    assert (release >= (2, 9, 0)) == FSDP2


def test_every_module_imports_on_the_installed_torch():
    # in a fresh interpreter, every module of the package: on CI's oldest stage (torch 2.4) a module that imports at
    # load time a name that release lacks fails here
    code = (
        "import importlib, pkgutil, lightning_accum\n"
        "for info in pkgutil.walk_packages(lightning_accum.__path__, 'lightning_accum.'):\n"
        "    importlib.import_module(info.name)\n"
        "print('imported')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "imported" in done.stdout


MOVED = (
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed._tensor",
    "torch.distributed._composable",
)


def test_no_module_but_the_version_layer_imports_what_moved_between_torch_releases():
    # FSDP2 and DTensor sit in other modules before torch 2.6 and 2.5: only lightning_accum/compat/torch.py finds them,
    # and there only inside functions; elsewhere FSDP1's `FullyShardedDataParallel` (the same in every release) may be
    # imported inside a function
    package = Path(_torch.__file__).parents[1]  # lightning_accum/, of lightning_accum/compat/torch.py
    found = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text())
        top = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(MOVED):
                names = {alias.name for alias in node.names}
                fsdp1 = node.module == "torch.distributed.fsdp" and names <= {"FullyShardedDataParallel"}
                if id(node) in top or not (fsdp1 or path.relative_to(package).as_posix() == "compat/torch.py"):
                    found.append(f"{path.relative_to(package)}:{node.lineno} from {node.module} import {names}")
            elif isinstance(node, ast.Import) and any(a.name.startswith(MOVED) for a in node.names):
                found.append(f"{path.relative_to(package)}:{node.lineno}")
    assert not found


def test_ci_tests_the_torch_floors_the_package_declares():
    # .ci/run's oldest stage installs the torch floor, its fsdp2-floor stage a release of FSDP2_FLOOR's minor
    root = Path(__file__).resolve().parents[1]
    ci = (root / ".ci" / "run").read_text()
    fsdp2 = re.search(r"^TORCH_FSDP2=(\d+)\.(\d+)\.(\d+)", ci, re.M)
    assert fsdp2 is not None
    assert tuple(map(int, fsdp2.groups()))[:2] == _torch.FSDP2_FLOOR[:2]
    oldest = re.search(r"^torch==(\d+)\.(\d+)\.(\d+)$", (root / ".ci" / "constraints-oldest.txt").read_text(), re.M)
    assert oldest is not None
    assert tuple(map(int, oldest.groups()))[:2] == TORCH_FLOOR[:2]
    assert f'"torch>={TORCH_FLOOR[0]}.{TORCH_FLOOR[1]}"' in (root / "pyproject.toml").read_text()


def test_the_refusal_names_the_feature_the_torch_release_and_what_to_do(fsdp2_refused):
    assert not _torch.has_fsdp2_mechanics()
    with pytest.raises(RuntimeError) as raised:
        _torch.require_fsdp2("the thing", "do the other thing")
    message = str(raised.value)
    assert message.startswith("the thing needs " + fsdp2_refused)
    assert f"torch {torch.__version__} is installed: do the other thing, or upgrade torch" in message


class Sharded(RegressionModule):
    def configure_model(self) -> None:
        _torch.fully_shard(self.net, mesh=self.device_mesh["data_parallel"])


def test_the_trainer_refuses_fsdp2_before_any_step(fsdp2_refused):
    x, y = make_data(8)
    module = Sharded()
    before = [p.detach().clone() for p in make_net().parameters()]
    strategy = ModelParallelAccumulationStrategy(data_parallel_size=1, tensor_parallel_size=1)
    fit = trainer([AccumulationScheduler({0: 2})], max_epochs=1, strategy=strategy)
    with pytest.raises(
        RuntimeError,
        match=re.escape(f"ModelParallelAccumulationStrategy with `fully_shard` (FSDP2) units needs {fsdp2_refused}"),
    ) as raised:
        fit.fit(module, loader(x, y, 4))
    assert "DDPAccumulationStrategy" in str(raised.value)
    assert fit.global_step == 0
    after = [p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in module.net.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_the_callback_refuses_fsdp2_under_stock_model_parallel_before_the_sanity_check(fsdp2_refused):
    class Validated(Sharded):
        def validation_step(self, batch, batch_idx):
            seen.append(batch_idx)  # the sanity check's forward would come here

    seen: list[int] = []
    x, y = make_data(8)
    fit = trainer(
        [AccumulationScheduler({0: 2})],
        max_epochs=1,
        num_sanity_val_steps=2,
        strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1),
    )
    message = (
        f"AccumulationScheduler on a model with `fully_shard` (FSDP2) units needs {fsdp2_refused} (lightning_accum's"
        f" FSDP2 mechanics read FSDP2 state that is tested exact from that release on), but torch {torch.__version__}"
        " is installed: remove the callback and give stock ModelParallelStrategy `Trainer(accumulate_grad_batches=k)`"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no advice to use the strategy this torch refuses
        with pytest.raises(RuntimeError, match=re.escape(message)):
            fit.fit(Validated(), loader(x, y, 4), loader(x, y, 4))
    assert seen == []
    assert fit.global_step == 0


def test_skip_gradient_sync_refuses_fsdp2_units(fsdp2_refused):
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{_free_port()}")
    from torch.distributed.device_mesh import init_device_mesh

    net = make_net()
    _torch.fully_shard(net, mesh=init_device_mesh("cpu", (1,)))
    with (
        pytest.raises(
            RuntimeError, match=re.escape(f"skip_gradient_sync on `fully_shard` (FSDP2) units needs {fsdp2_refused}")
        ),
        skip_gradient_sync(net, "last"),
    ):
        pass


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_the_accumulator_refuses_fsdp2_when_it_is_built(fsdp2_refused):
    def shard(module: nn.Module, mesh) -> nn.Module:
        _torch.fully_shard(module, mesh=mesh["data_parallel"])
        return module

    strategy = FabricModelParallelStrategy(parallelize_fn=shard, data_parallel_size=1, tensor_parallel_size=1)
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()
    model = fabric.setup_module(make_net())
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(RuntimeError) as raised:
        Accumulator(fabric, model, optimizer, scheduling={0: 2})
    assert str(raised.value).startswith(
        f"the Accumulator on a model with `fully_shard` (FSDP2) units needs {fsdp2_refused}"
    )
    assert str(raised.value).endswith(
        "accumulate without it (each micro-batch's loss divided by the factor, FSDP2 then reduce-scatters on every"
        " micro-step), or train the model with DDPStrategy or FSDPStrategy (FSDP1), or upgrade torch (pip install"
        f" '{fsdp2_refused}')"
    )


REFUSED = ("last_k3", "manual_k3", "token_k3", "noise_sums_k3")  # tests/scripts/two_ranks.py, under our strategy


@pytest.mark.skipif(_torch.has_fsdp2_mechanics(), reason="FSDP2 runs on this torch: tests/test_distributed.py")
def test_two_ranks_are_refused_before_any_step_on_a_torch_below_the_fsdp2_floor(tmp_path):
    # ModelParallelAccumulationStrategy with the callback, ManualAccumulation, token weighting and the noise scale, as
    # tests/scripts/two_ranks.py runs them under FSDP2 on a newer torch, launched as a user would on this one
    done = subprocess.run(
        [
            "timeout",
            "-s",
            "KILL",
            "240",
            sys.executable,
            str(SCRIPTS / "two_ranks.py"),
            "fsdp2",
            *REFUSED,
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        check=False,
        env=launch_environment(),
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]  # every rank refused, none hung
    floor = ".".join(map(str, _torch.FSDP2_FLOOR))
    sys.path.insert(0, str(SCRIPTS))
    from two_ranks import make_net as two_ranks_net

    untouched = [param.detach().flatten().tolist() for param in two_ranks_net().parameters()]
    for name in REFUSED:
        for rank in (0, 1):
            record = json.loads((tmp_path / "fsdp2" / f"{name}.rank{rank}.json").read_text())
            assert record["raised"].startswith(
                f"ModelParallelAccumulationStrategy with `fully_shard` (FSDP2) units needs torch>={floor}"
            )
            assert f"but torch {torch.__version__} is installed" in record["raised"]
            assert record["optimizer_steps"] == 0
            assert list(record["weights"].values()) == untouched
