"""The structure docs/architecture.md describes, checked against the code.

The package's folders are its layers, and each imports only the layers below it (the documented table of layers is
the one this file holds); no import circles, not even under ``TYPE_CHECKING`` or inside a function. A coordinator with
a few attributes of its own, that reads on one screen and starts a fit from one plan; features that never import each
other and never touch the Trainer; the layers below the shells without Lightning; the documented table of which
feature handles which event.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_accum import AccumulationScheduler
from lightning_accum.core.events import Event
from lightning_accum.features import (
    AdaptiveGrowth,
    ItemWeighting,
    LRScaling,
    Metrics,
    NoiseScale,
    ProgressBar,
    SampleDrivenSchedules,
    Seesaw,
    TokenCount,
    WideAccumulation,
)

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_accum"
DOCS = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
# the layers, bottom up, and the layers each may import besides itself: the folders of lightning_accum/ (the root's
# modules, the public entry points, may import every layer)
LAYERS = {
    "compat": set(),
    "core": {"compat"},
    "distributed": {"compat", "core"},
    "features": {"compat", "core", "distributed"},
    "strategies": {"compat", "core", "distributed"},
    "fabric": {"compat", "core", "distributed", "features"},
    "trainer": {"compat", "core", "distributed", "features", "strategies"},
}
ROOT = {"__init__", "__about__", "cli", "pytorch_lightning", "lightning_fabric"}  # what users import
# the layers that never import Lightning at load time (compat's `lightning` module imports a namespace when asked)
WITHOUT_LIGHTNING = ("compat", "core", "distributed")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, everywhere: bool = False) -> set[str]:
    """The modules ``path`` imports at module level, or ``everywhere`` (under ``if TYPE_CHECKING``, in functions)."""
    found = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree) if everywhere else tree.body:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def layer(module: str) -> str:
    """The layer (folder) of a lightning_accum module, ``""`` for the root's."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else ""


def ours(module: str) -> str | None:
    """The lightning_accum module an import names (``from lightning_accum.x import name``: ``lightning_accum.x``)."""
    while module and module not in MODULES:
        module = module.rpartition(".")[0]
    return module or None


def test_the_folders_are_the_layers_and_the_root_holds_only_the_entry_points():
    folders = {path.name for path in PACKAGE.iterdir() if path.is_dir() and (path / "__init__.py").is_file()}
    assert folders == set(LAYERS)
    assert {path.stem for path in PACKAGE.glob("*.py")} == ROOT


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_each_layers_docstring_says_what_it_may_import(name):
    """Each folder's ``__init__`` says what it holds and which layers it may import, as LAYERS and the docs do."""
    doc = ast.get_docstring(ast.parse((PACKAGE / name / "__init__.py").read_text())) or ""
    assert "May import:" in doc, name
    allowed = doc[doc.index("May import:") :]
    for other in LAYERS[name]:
        assert f"lightning_accum.{other}" in allowed, f"{name}'s docstring does not name {other}"


def test_the_documented_layers_are_the_tree_s():
    """docs/architecture.md's table of layers: each folder, and the layers it may import, as the code holds them."""
    text = DOCS.read_text()
    header = "| layer | what it holds | may import |"
    assert header in text
    rows = text[text.index(header) :].splitlines()[2 : 2 + len(LAYERS)]
    documented = {}
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        documented[cells[0].strip("`/")] = set(re.findall(r"`(\w+)/?`", cells[2]))
    assert documented == LAYERS


def test_each_layer_imports_only_the_layers_below_it():
    """Every import, at load time or later (in a function, under ``TYPE_CHECKING``): a layer's own, or one it may."""
    for name, path in MODULES.items():
        own = layer(name)
        if own == "":
            continue  # the entry points (the root's modules) re-export every layer
        for module in imports(path, everywhere=True):
            target = ours(module) if module.startswith("lightning_accum") else None
            if target is None or layer(target) == own:
                continue
            assert layer(target) != "", f"{name} ({own}) imports the entry point {target}"
            assert layer(target) in LAYERS[own], f"{name} ({own}) imports {target} ({layer(target)})"


@pytest.mark.parametrize("name", [name for name in MODULES if layer(name) in WITHOUT_LIGHTNING])
def test_the_layers_below_the_shells_import_no_lightning(name):
    assert not any(
        module.split(".")[0] in ("lightning", "pytorch_lightning", "lightning_fabric")
        for module in imports(MODULES[name])
    )


# what a feature may not reach: the Trainer and its loops, strategies, connectors and state
TRAINER_INTERNALS = ("lightning.pytorch.trainer", "lightning.pytorch.loops", "lightning.pytorch.strategies")


def test_no_feature_reads_the_trainer_or_imports_its_internals():
    """Features see the run through ``Context.run`` (a read-only view, and the actions they may ask for)."""
    features = [path for name, path in MODULES.items() if name.startswith("lightning_accum.features.")]
    for path in features:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                assert node.attr != "trainer", f"{path.name}:{node.lineno} reads `.trainer`"
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                for name in names:
                    assert not name.startswith(TRAINER_INTERNALS), f"{path.name}:{node.lineno} imports {name}"
                    assert name.split(".")[0] != "lightning_accum" or layer(name) in {
                        "features",
                        *LAYERS["features"],
                    }, f"{path.name} imports {name}"


def test_the_core_reads_on_one_screen():
    """The noise scale in at most 300 lines, the coordinator's class in at most 372 (350 before its FSDP2 check at
    ``on_fit_start``, issue 53; 355 before issue 54's four arguments, each a line of signature and of docstring, and
    the Seesaw and adaptive bound entries of its registry) and its module in 460 (450 before them)."""
    callback = MODULES["lightning_accum.trainer.callback"]
    (scheduler,) = [
        node for node in ast.parse(callback.read_text()).body if getattr(node, "name", "") == "AccumulationScheduler"
    ]
    assert scheduler.end_lineno - scheduler.lineno + 1 <= 372
    assert len(callback.read_text().splitlines()) <= 460
    assert len(MODULES["lightning_accum.features.noise_scale"].read_text().splitlines()) <= 300


def test_no_feature_module_imports_another():
    features = {name for name in MODULES if name.startswith("lightning_accum.features.")}
    assert len(features) == 10
    for name in features:
        assert not (imports(MODULES[name]) & (features - {name})), name


def test_the_package_has_no_import_cycles():
    """None at load time, nor through imports under ``TYPE_CHECKING`` or inside functions."""
    graph = {
        name: {target for m in imports(path, everywhere=True) if (target := ours(m)) not in (None, name)}
        for name, path in MODULES.items()
    }
    visiting, done = set(), set()

    def visit(name: str, trail: list[str]) -> None:
        assert name not in visiting, " -> ".join([*trail, name])
        if name in done:
            return
        visiting.add(name)
        for successor in graph[name]:
            visit(successor, [*trail, name])
        visiting.discard(name)
        done.add(name)

    for name in graph:
        visit(name, [])


def test_the_coordinator_holds_few_attributes_of_its_own():
    own = set(vars(AccumulationScheduler())) - set(vars(Callback()))
    assert own == {"_spec", "_features", "_ctx", "_loop", "_resume", "_batcher"}  # the schedule is the plan's


def test_the_checkpoint_is_the_coordinators_state_and_each_features_under_its_name():
    callback = AccumulationScheduler({0: 2}, normalize_by="token", noise_scale=True, adaptive=True, lr_scaling="sqrt")
    assert set(callback.state_dict()) == {
        "samples_seen",
        "micro_steps",
        "window",
        "data",  # the place in the train dataloader's samples (issue 47)
        "item_weighting",
        "noise_scale",
        "adaptive",
        "wide_accumulation",
        "lr_scaling",
        "sample_driven_lr",
        "progress_bar",
        "metrics",
    }
    assert list(AccumulationScheduler(log_metrics=False).features) == [
        "wide_accumulation",
        "lr_scaling",
        "sample_driven_lr",
        "progress_bar",
    ]


def test_every_state_is_new_containers_of_plain_values():
    """The resume point keeps the state from a window's start as the callback returns it, without a copy
    (lightning_accum/trainer/_resume.py): nothing in it may be a container a feature goes on changing."""
    from tests.helpers import RegressionModule, loader, make_data, trainer

    every_window = dict(noise_scale=True, noise_scale_interval=1, adaptive=True)
    callback = AccumulationScheduler({0: 2}, normalize_by="sample", lr_scaling="sqrt", **every_window)
    x, y = make_data(32)
    trainer([callback], max_epochs=2).fit(RegressionModule(), loader(x, y, 4))
    first, second = callback.state_dict(), callback.state_dict()
    assert first == second
    assert first["noise_scale"]["updates"] > 0  # states that moved during the fit
    assert first["adaptive"]["decided_at"] > 0

    def walk(a, b, where):
        if isinstance(a, (dict, list, tuple)):
            assert a is not b, f"{where} is the same container twice"
            items = a.items() if isinstance(a, dict) else enumerate(a)
            for key, value in items:
                walk(value, b[key], f"{where}[{key!r}]")
        else:
            assert a is None or type(a) in (bool, int, float, str), f"{where}: {type(a).__name__}"

    walk(first, second, "state")


def test_the_documented_event_table_is_what_each_feature_handles():
    features = [
        TokenCount(),
        ItemWeighting(),
        WideAccumulation(torch.float32),
        NoiseScale(),
        AdaptiveGrowth(),
        LRScaling(),
        SampleDrivenSchedules(),
        Seesaw(),
        ProgressBar(),
        Metrics(),
    ]
    text = DOCS.read_text()
    header = "| event | " + " | ".join(f"`{type(feature).__name__}`" for feature in features) + " |"
    assert header in text
    rows = text[text.index(header) :].splitlines()[2 : 2 + len(Event)]
    for event, row in zip(Event, rows, strict=True):
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert re.fullmatch(rf"`{event.name}`", cells[0]), row
        assert [cell == "x" for cell in cells[1:]] == [feature.handles(event) for feature in features], row


def test_every_test_the_compatibility_page_names_exists():
    text = (DOCS.parent / "compatibility.md").read_text()
    names = set(re.findall(r"`(test_[a-z0-9_]+)`", text))
    defined = {
        name
        for path in (DOCS.parents[1] / "tests").glob("test_*.py")
        for name in re.findall(r"^def (test_[a-z0-9_]+)\(", path.read_text(), re.M)
    }
    assert names
    assert names <= defined, names - defined


# ------------------------------------------------------------------ the Fabric shell (lightning_accum/fabric/)

# lightning_accum.lightning_fabric: the Fabric shell's names for the standalone lightning_fabric package
FABRIC = {name for name in MODULES if name.startswith(("lightning_accum.fabric", "lightning_accum.lightning_fabric"))}
# the Trainer's shell: what only the callback, its glue and the Trainer's strategies may import
TRAINER_SHELL = (
    "lightning.pytorch",
    "pytorch_lightning",
    "lightning_accum.trainer",
    "lightning_accum.strategies",
    "lightning_accum.cli",
    "lightning_accum.pytorch_lightning",
)
# what both shells share besides the cores, the distributed mechanics and the features: the namespace in hand
NAMESPACES = {"lightning_accum.compat.lightning", "lightning_accum.compat.versions"}


def test_the_fabric_shell_stands_beside_the_callback_on_the_core_and_never_reaches_the_trainer():
    """Both shells point down at the same rooms: the Fabric package imports the pure modules, the events and the
    features, and nothing of the Trainer's shell (nor does anything in the package import the Fabric shell)."""
    assert {"lightning_accum.fabric", "lightning_accum.fabric.accumulator"} <= FABRIC
    for name in FABRIC:
        for module in imports(MODULES[name], everywhere=True):
            assert not module.startswith(TRAINER_SHELL), f"{name} imports {module}"
            target = ours(module) if module.startswith("lightning_accum.") else None
            if target is not None and not target.startswith("lightning_accum.fabric"):
                assert layer(target) in LAYERS["fabric"], f"{name} imports {target}, of a layer it stands above"
    for name in set(MODULES) - FABRIC:
        assert not any(module.startswith("lightning_accum.fabric") for module in imports(MODULES[name])), name


def test_the_fabric_shell_reads_in_a_few_screens():
    """The Accumulator's class in at most 510 lines and its module in 590 (500 and 580 before issue 54's four arguments
    and their docstring lines)."""
    accumulator = MODULES["lightning_accum.fabric.accumulator"]
    (shell,) = [node for node in ast.parse(accumulator.read_text()).body if getattr(node, "name", "") == "Accumulator"]
    assert shell.end_lineno - shell.lineno + 1 <= 510
    assert len(accumulator.read_text().splitlines()) <= 590


def _fabric_fit(loader: torch.utils.data.DataLoader, epochs: int, **options: Any) -> None:
    """``epochs`` epochs of ``loader`` (``tests.helpers.DictDataset`` of tokens) through an Accumulator at factor 4."""
    from lightning.fabric import Fabric
    from torch import nn

    from lightning_accum.fabric import Accumulator
    from tests.helpers import token_loss

    fabric = Fabric(accelerator="cpu", devices=1)
    net = nn.Linear(5, 1)
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    accumulator = Accumulator(fabric, model, optimizer, scheduling={0: 4}, log_metrics=False, **options)
    for _ in range(epochs):
        for batch in accumulator.batches(loader):
            with accumulator.micro_step(batch) as micro:
                micro.backward(token_loss(model, batch["features"], batch["labels"]))
            if micro.should_step:
                optimizer.step()
                optimizer.zero_grad()
    accumulator.close()


def _dispatched(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    from lightning_accum.core.events import Features

    seen: list[str] = []
    dispatch = Features.dispatch

    def recording(self: Features, event: Event, ctx: object) -> None:
        seen.append(event.name)
        dispatch(self, event, ctx)

    monkeypatch.setattr(Features, "dispatch", recording)
    return seen


def test_the_fabric_shell_dispatches_the_callbacks_events_in_the_callbacks_order(monkeypatch):
    """One epoch of 10 micro-batches at factor 4 (windows 4, 4 and the 2 left), token-weighted, through the Trainer
    and through Fabric: the same window events in the same order (SETUP comes when the Accumulator is built)."""

    from tests.helpers import DictDataset, LinearTokenModule, make_tokens, trainer

    tokens = make_tokens(40)

    seen = _dispatched(monkeypatch)
    loader = torch.utils.data.DataLoader(DictDataset(tokens), batch_size=4)
    callback = AccumulationScheduler({0: 4}, normalize_by="token", log_metrics=False)
    trainer([callback], max_epochs=1).fit(LinearTokenModule(), loader)
    through_trainer = [event for event in seen if event != "SETUP"]

    seen.clear()
    _fabric_fit(loader, epochs=1, normalize_by="token")
    assert seen[0] == "SETUP"  # at construction, not at the Trainer's setup
    assert seen[1:] == through_trainer
    assert seen.count("WINDOW_CLOSED") == 3


@pytest.mark.parametrize("name", sorted(NAMESPACES))
def test_the_modules_that_pick_a_namespace_import_none_themselves(name):
    """`_lightning` imports a namespace's names only when asked for them; `_versions` reads version strings."""
    assert not any(
        module.split(".")[0] in ("lightning", "pytorch_lightning", "lightning_fabric")
        for module in imports(MODULES[name])
    )


def test_the_fit_starts_from_one_plan_in_both_shells(monkeypatch):
    """The Trainer at ``on_train_start`` and Fabric at its first ``batches`` build one ``FitPlan``: the facts of the
    fit (the micro-batch size the ranks agreed on once, the loader's batches, the schedule, the planned steps), which
    every feature reads from ``FIT_START`` on; the callback's ``on_train_start`` builds it and hands it on."""

    import lightning_accum.trainer._plan as trainer_plan
    from lightning_accum.core.events import Features
    from lightning_accum.core.fit import FitPlan
    from tests.helpers import DictDataset, LinearTokenModule, make_tokens, trainer

    plans: list[FitPlan] = []
    dispatch, agree = Features.dispatch, trainer_plan.agree_on_batches
    agreements: list[int | None] = []

    def recording(self: Features, event: Event, ctx: object) -> None:
        if event == Event.FIT_START:
            plans.append(ctx.plan)  # type: ignore[attr-defined]
        dispatch(self, event, ctx)

    def agreeing(*args: object) -> int | None:
        agreements.append(size := agree(*args))  # type: ignore[arg-type]
        return size

    monkeypatch.setattr(Features, "dispatch", recording)
    monkeypatch.setattr(trainer_plan, "agree_on_batches", agreeing)
    loader = torch.utils.data.DataLoader(DictDataset(make_tokens(40)), batch_size=4)
    callback = AccumulationScheduler({0: 4}, log_metrics=False)
    trainer([callback], max_epochs=2).fit(LinearTokenModule(), loader)
    (plan,) = plans
    assert agreements == [4]  # once per fit
    assert (plan.micro_batch_size, plan.loader_batch_size, plan.batches_per_epoch) == (4, 4, 10)
    assert (plan.schedule.factor_at(0), plan.planned_steps, plan.planned_samples) == (4, 6, 80)  # windows 4, 4, 2
    assert (plan.epoch, plan.optimizer_steps, plan.resumed, plan.counted) == (0, 0, False, None)

    plans.clear()
    _fabric_fit(loader, epochs=2)
    (plan,) = plans  # made at the first epoch; a later epoch's loader only updates its sizes
    assert (plan.micro_batch_size, plan.loader_batch_size, plan.batches_per_epoch) == (4, 4, 10)
    assert plan.schedule.factor_at(0) == 4
    assert plan.names.package == "lightning.fabric"


def test_on_train_start_builds_the_plan_and_hands_it_on_in_a_handful_of_lines():
    callback = MODULES["lightning_accum.trainer.callback"]
    (scheduler,) = [
        node for node in ast.parse(callback.read_text()).body if getattr(node, "name", "") == "AccumulationScheduler"
    ]
    (start,) = [node for node in scheduler.body if getattr(node, "name", "") == "on_train_start"]
    assert start.end_lineno - start.body[0].lineno + 1 <= 14
