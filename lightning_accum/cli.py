r"""The ``lightning-accum`` command, to ``plan`` a configuration before a run, and a LightningCLI parser.

    lightning-accum plan --global-batch 512 --devices 8 --dataset-size 1000000 --base-lr 3e-4 --base-batch 256 \\
        --rule sqrt
    lightning-accum plan --global-batch 100 --devices 16          # explains: 96 or 112
    lightning-accum plan --global-batch 1024 --devices 2 --probe my_pkg.models:MyModule --memory-budget 8000

With ``--probe MODULE:CLASS`` the command instantiates the LightningModule (no arguments), builds micro-batches of
each candidate size from its ``example_input_array``, and measures the peak memory of one forward and backward in a
fresh process per size (CUDA: peak allocated; CPU: growth of the peak resident memory), then keeps the micro-batches
that fit ``--memory-budget`` MiB. A target it cannot probe (no such module or class, no ``example_input_array``) ends
the command like any bad value: a one-line error naming it, exit status 2.

:class:`AccumulationArgumentParser`, for ``LightningCLI(..., parser_class=AccumulationArgumentParser)``, ends a parse
error with the key and the value that were wrong.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from lightning.pytorch.cli import LightningArgumentParser

from lightning_accum.compat.lightning import TRAINER_PACKAGES, trainer_package
from lightning_accum.core.monitor import peak_resident_bytes, resident_bytes
from lightning_accum.core.plan import Plan, plan, plan_table

_MIB = 2**20
_PROBE = "_probe"  # private: `python -m lightning_accum.cli _probe MODULE:CLASS SIZE`, run by probe_isolated
# plan()'s parameters, as the flags that set them
_FLAGS = {
    "global_batch": "--global-batch",
    "devices": "--devices",
    "micro_batch": "--micro-batch",
    "micro_batches": "--micro-batch",
    "dataset_size": "--dataset-size",
    "base_lr": "--base-lr",
    "base_batch": "--base-batch",
    "rule": "--rule",
    "lr_scaling": "--rule",
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit status (2 for a configuration with no valid plan).

    Example::

        lightning-accum plan --global-batch 100 --devices 16
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == [_PROBE]:  # dispatched before the public parser, which does not list it
        prober = argparse.ArgumentParser(prog=f"lightning-accum {_PROBE}")
        prober.add_argument("target")
        prober.add_argument("micro_batch", type=int)
        probe_args = prober.parse_args(args[1:])
        try:
            peak = probe_once(probe_args.target, probe_args.micro_batch)
        except UnprobeableTarget as error:  # for probe_isolated, which names it as the value of --probe
            print(json.dumps({"unprobeable": str(error)}))
            return 2
        print(json.dumps({"peak_bytes": peak}))
        return 0
    parser = argparse.ArgumentParser(prog="lightning-accum", description="Plan gradient accumulation for Lightning.")
    commands = parser.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND")
    planner = commands.add_parser(
        "plan",
        help="list the micro-batch / factor / learning-rate configurations that reach a global batch",
        description="List the micro-batch sizes and accumulation factors that reach --global-batch on --devices, with"
        " the optimizer steps per epoch and the scaled learning rate; explain the batches that do not divide, with"
        " the nearest valid ones. With --probe, keep the micro-batches that fit --memory-budget.",
        epilog="example: lightning-accum plan --global-batch 512 --devices 8 --dataset-size 1000000"
        " --base-lr 3e-4 --base-batch 256 --rule sqrt",
        formatter_class=_DefaultsFormatter,
    )
    planner.add_argument("--global-batch", type=int, required=True, help="the effective batch, all devices together")
    planner.add_argument("--devices", type=int, default=1, help="devices (ranks) in data parallel")
    planner.add_argument("--micro-batch", type=int, nargs="+", help="micro-batch sizes to consider (default: all)")
    planner.add_argument("--dataset-size", type=int, help="training samples, for the per-epoch columns")
    planner.add_argument("--base-lr", type=_positive_float, help="the learning rate tuned at --base-batch")
    planner.add_argument(
        "--base-batch", type=int, help="the global batch at which --base-lr was tuned (default: --global-batch)"
    )
    planner.add_argument("--rule", choices=["none", "linear", "sqrt"], default="none", help="LR scaling rule")
    planner.add_argument(
        "--probe", type=_target, metavar="MODULE:CLASS", help="measure peak memory per micro-batch on this model"
    )
    planner.add_argument(
        "--memory-budget", type=_positive_float, metavar="MIB", help="with --probe: memory per device, MiB"
    )
    args_ns = parser.parse_args(args)
    if (args_ns.probe is None) != (args_ns.memory_budget is None):
        planner.error("--probe and --memory-budget go together")
    return _plan(planner, args_ns)


def _plan(planner: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    _make_plan(planner, args, max_micro_batch=None)  # a bad value fails here, before the (slow) probe
    max_micro_batch = None
    if args.probe is not None:
        per_device = args.global_batch // args.devices if args.global_batch % args.devices == 0 else 0
        candidates = args.micro_batch or [
            size for size in range(per_device, 0, -1) if per_device and not per_device % size
        ]
        try:
            max_micro_batch, measured = fit_budget(args.probe, candidates, args.memory_budget)
        except UnprobeableTarget as error:
            planner.error(f"argument --probe: {error}")
        for size, peak in measured:
            print(f"probe: micro-batch {size}: peak {peak / _MIB:.1f} MiB", file=sys.stderr)
        if max_micro_batch is None:
            print(f"no micro-batch fits {args.memory_budget:g} MiB", file=sys.stderr)
            return 2
    result = _make_plan(planner, args, max_micro_batch)
    print(plan_table(result))
    return 0 if result.rows else 2


def _make_plan(planner: argparse.ArgumentParser, args: argparse.Namespace, max_micro_batch: int | None) -> Plan:
    try:
        return plan(
            args.global_batch,
            devices=args.devices,
            micro_batches=args.micro_batch,
            dataset_size=args.dataset_size,
            base_lr=args.base_lr,
            base_batch=args.base_batch,
            rule=args.rule,
            max_micro_batch=max_micro_batch,
        )
    except (TypeError, ValueError) as error:
        planner.error(_name_flags(str(error)))


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show an option's default in its help, unless it has none (``None``) or the help already tells it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}") from None
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return value


def _target(text: str) -> str:
    try:
        _module_and_class(text)
    except UnprobeableTarget as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def _module_and_class(target: str) -> tuple[str, str]:
    module_name, _, class_name = target.partition(":")
    if not module_name or not class_name:
        raise UnprobeableTarget(f"expected MODULE:CLASS, got {target!r}")
    return module_name, class_name


def _name_flags(message: str) -> str:
    """A message of ``plan()``, with the parameter names it quotes replaced by the flags (``--global-batch``)."""
    return re.sub(r"`(\w+)`", lambda match: f"`{_FLAGS.get(match.group(1), match.group(1))}`", message)


class FocusedErrors:
    """Mixed in before a LightningCLI parser: a bad value named by its key and value, a constructor error in one line.

    :class:`AccumulationArgumentParser` is this over ``lightning.pytorch``'s ``LightningArgumentParser``;
    :class:`lightning_accum.pytorch_lightning.AccumulationArgumentParser` over ``pytorch_lightning``'s.
    """

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        """Print the usage and the focused message (:func:`focus_config_error`), and exit with status 2.

        A class of lightning_accum's other namespace (``lightning_accum.AccumulationScheduler`` given to
        ``pytorch_lightning``'s LightningCLI) is named with the class this parser's namespace takes.
        """
        hint = namespace_hint(message, trainer_package(self) or TRAINER_PACKAGES[0])
        super().error(focus_config_error(message) + hint, ex)  # type: ignore[misc]
        raise AssertionError("the parser's error() exits")  # pragma: no cover

    def instantiate(self, namespace: Any, instantiate_groups: bool = True, *, instantiators: Any = None) -> Any:
        """Instantiate the classes; a constructor error of lightning_accum's classes becomes an ``error()``."""
        from lightning_accum.strategies.mixin import AccumulationStrategyMixin
        from lightning_accum.trainer.callback import AccumulationScheduler

        failures: list[tuple[str, str]] = []

        def construct(class_type: type, *args: Any, **kwargs: Any) -> Any:
            try:
                return class_type(*args, **kwargs)
            except (TypeError, ValueError) as failure:
                failures.append((class_type.__qualname__, str(failure)))
                raise

        ours = [(construct, AccumulationScheduler, True), (construct, AccumulationStrategyMixin, True)]
        try:
            return super().instantiate(  # type: ignore[misc]
                namespace, instantiate_groups, instantiators=[*(instantiators or []), *ours]
            )
        except (TypeError, ValueError) as error:
            for name, failure in reversed(failures):
                if failure in str(error):  # this failure, not one of an alternative that was then dropped
                    self.error(f"{name}: {failure}", error)
            raise


class AccumulationArgumentParser(FocusedErrors, LightningArgumentParser):
    """LightningCLI's parser, with a bad configuration value named by its key and value in the error's last lines.

    jsonargparse reports a bad value inside a class given by ``class_path`` (a callback in ``trainer.callbacks``, a
    ``trainer.strategy``) as a failure of every alternative of the enclosing type (``list[Callback] | Callback |
    None``), so its last lines are about ``Callback`` subclasses and ``NoneType``. This parser keeps, in each such
    union, only the alternative that names the class (``Problem with given class_path ...``) and drops the ``None``
    alternative, so the error ends with the class, the key and the value. A message it does not recognize is printed
    as jsonargparse wrote it. A ``TypeError`` or ``ValueError`` raised by the constructor of
    :class:`~lightning_accum.AccumulationScheduler` or of an accumulation strategy (a combination of arguments that no
    single type rejects, such as ``adaptive: true`` without ``noise_scale: true``) ends the command the same way,
    without a traceback.

    Example::

        from lightning.pytorch.cli import LightningCLI
        from lightning_accum.cli import AccumulationArgumentParser

        LightningCLI(MyModel, MyData, parser_class=AccumulationArgumentParser)

    With ``pytorch_lightning``'s ``LightningCLI``, import it from :mod:`lightning_accum.pytorch_lightning`.
    """


_IMPORT_PATH = re.compile(r"Import path (lightning_accum(?:\.pytorch_lightning)?)\.(\w+) does not correspond")


def namespace_hint(message: str, package: str) -> str:
    """A last line for a jsonargparse ``message`` that refused a class of lightning_accum's other Lightning namespace.

    Args:
        message: The parse error.
        package: The namespace of the LightningCLI: ``"lightning.pytorch"`` or ``"pytorch_lightning"``.

    Example::

        refused = "Import path lightning_accum.AccumulationScheduler does not correspond to a subclass of Callback"
        namespace_hint(refused, "pytorch_lightning")
        # a new line: "  pytorch_lightning's LightningCLI takes lightning_accum.pytorch_lightning.AccumulationScheduler"
    """
    ours = "lightning_accum.pytorch_lightning" if package == "pytorch_lightning" else "lightning_accum"
    for module, name in _IMPORT_PATH.findall(message):
        if module != ours:
            return f"\n  {package}'s LightningCLI takes {ours}.{name}"
    return ""


def focus_config_error(message: str) -> str:
    """The jsonargparse error ``message`` with each union failure reduced to the alternative that names a class.

    In a ``Does not validate against any of the Union subtypes`` block, the ``Expected a <class 'NoneType'>``
    alternative is dropped and, if an alternative starts with ``Problem with given class_path``, only the first
    such one is kept (else, if one says the value ``does not conform to restriction``, only that one); when one
    alternative is left, the block becomes that alternative (with the given value when the alternative is a one-line
    message that does not show it). Anything else is kept as it is.

    Example::

        >>> print(focus_config_error('''Parser key "trainer.callbacks":
        ...   Does not validate against any of the Union subtypes
        ...   Subtypes: [list[Callback], Callback, NoneType]
        ...   Errors:
        ...     - Problem with given class_path 'lightning_accum.AccumulationScheduler':
        ...         Parser key "unit":
        ...           Expected a typing.Literal['epoch', 'step', 'sample']. Got value: epochs
        ...     - Not a valid subclass of Callback
        ...     - Expected a <class 'NoneType'>
        ...   Given value type: <class 'list'>
        ...   Given value: [...]'''))
        Parser key "trainer.callbacks":
          Problem with given class_path 'lightning_accum.AccumulationScheduler':
            Parser key "unit":
              Expected a typing.Literal['epoch', 'step', 'sample']. Got value: epochs
    """
    if _UNION not in message:
        return message
    root = _Node("")
    stack = [(-1, root)]
    for line in message.splitlines():
        indent = len(line) - len(line.lstrip(" "))
        while stack[-1][0] >= indent:
            stack.pop()
        node = _Node(line.strip())
        stack[-1][1].children.append(node)
        stack.append((indent, node))
    return "\n".join(_render(_focus(root.children), depth=0))


_UNION = "Does not validate against any of the Union subtypes"
_UNION_PARTS = ("Subtypes:", "Errors:", "Given value type:", "Given value:")


@dataclass
class _Node:
    """A line of a jsonargparse message and the lines indented under it."""

    text: str
    children: list[_Node] = field(default_factory=list)


def _focus(nodes: list[_Node]) -> list[_Node]:
    focused: list[_Node] = []
    index = 0
    while index < len(nodes):
        node = nodes[index]
        index += 1
        if node.text != _UNION:
            focused.append(_Node(node.text, _focus(node.children)))
            continue
        block = [node]
        while index < len(nodes) and nodes[index].text.startswith(_UNION_PARTS):
            block.append(nodes[index])
            index += 1
        focused.extend(_focus_union(block))
    return focused


def _focus_union(block: list[_Node]) -> list[_Node]:
    parts = {part: node for node in block[1:] for part in _UNION_PARTS if node.text.startswith(part)}
    errors = parts.get("Errors:")
    if errors is None:
        return block
    alternatives = [alt for alt in errors.children if alt.text != "- Expected a <class 'NoneType'>"]
    named = [alt for alt in alternatives if alt.text.startswith("- Problem with given class_path")]
    if named:
        alternatives = named[:1]
    restricted = [alt for alt in alternatives if "does not conform to restriction" in alt.text]
    if restricted:  # the value had the right type and a wrong value: that is the alternative meant
        alternatives = restricted[:1]
    if len(alternatives) != 1 or not alternatives[0].text.startswith("- "):
        return [block[0], *(_Node(node.text, _focus(node.children)) for node in block[1:])]
    (alternative,) = alternatives
    text = alternative.text[2:]
    given = parts.get("Given value:")
    if given is not None and not alternative.children:
        value = given.text[len("Given value:") :].strip()
        if not re.search(rf"(?<![\w.]){re.escape(value)}(?![\w.])", text) or "restriction" in text:
            text = f"{text}. Got value: {value}"
    return [_Node(text, _focus(alternative.children))]


def _render(nodes: list[_Node], depth: int) -> list[str]:
    lines = []
    for node in nodes:
        lines.append("  " * depth + node.text)
        lines.extend(_render(node.children, depth + 1))
    return lines


class UnprobeableTarget(ValueError):
    """The ``MODULE:CLASS`` given to probe names no module or class, or a module without ``example_input_array``."""


def fit_budget(target: str, candidates: Sequence[int], budget_mib: float) -> tuple[int | None, list[tuple[int, int]]]:
    """The largest candidate micro-batch whose measured peak memory fits ``budget_mib``, and what was measured.

    Sizes are probed from the smallest up and the search stops at the first that does not fit.

    Raises:
        UnprobeableTarget: If ``target`` cannot be probed.
        RuntimeError: If a probe fails otherwise (the model's own error, with the probe's traceback).
    """
    measured: list[tuple[int, int]] = []
    best = None
    for size in sorted(set(candidates)):
        peak = probe_isolated(target, size)
        measured.append((size, peak))
        if peak > budget_mib * _MIB:
            break
        best = size
    return best, measured


def probe_isolated(target: str, micro_batch: int) -> int:
    """Peak memory, in bytes, of one forward and backward at ``micro_batch``, in a fresh Python process.

    Raises:
        UnprobeableTarget: If ``target`` cannot be probed.
        RuntimeError: If the probe fails otherwise.
    """
    done = subprocess.run(
        [sys.executable, "-m", "lightning_accum.cli", "_probe", target, str(micro_batch)],
        capture_output=True,
        text=True,
        check=False,
    )
    answer = _last_json_line(done.stdout)
    if done.returncode == 2 and "unprobeable" in answer:
        raise UnprobeableTarget(answer["unprobeable"])
    if done.returncode != 0 or "peak_bytes" not in answer:
        raise RuntimeError(f"probing {target} at micro-batch {micro_batch} failed:\n{done.stderr[-3000:]}")
    return int(answer["peak_bytes"])


def _last_json_line(output: str) -> dict[str, Any]:
    """The probe's answer: the JSON object on the last line of its output (``{}`` if there is none)."""
    lines = output.strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        return {}
    return answer if isinstance(answer, dict) else {}


def probe_once(target: str, micro_batch: int) -> int:
    """In this process: instantiate ``MODULE:CLASS``, run one forward and backward at ``micro_batch``, measure.

    Raises:
        UnprobeableTarget: If ``target`` names no module or class, or its instance has no ``example_input_array``.
    """
    import torch

    model = _load_class(target)()
    example = getattr(model, "example_input_array", None)
    if example is None:
        _, class_name = _module_and_class(target)
        raise UnprobeableTarget(
            f"the probe builds its micro-batches from `{class_name}.example_input_array`, which is not set, got"
            f" {target!r}"
        )
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = model.to(device)
    inputs = _resize(example, micro_batch, device)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = resident_bytes()
    output = model(*inputs) if isinstance(inputs, tuple) else model(inputs)
    _first_tensor(output).float().mean().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated() - before)
    return int(max(peak_resident_bytes() - before, 0))


def _load_class(target: str) -> Any:
    """The class ``MODULE:CLASS`` names; an error in the module's own imports keeps its traceback."""
    module_name, class_name = _module_and_class(target)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        missing = error.name or ""
        if module_name != missing and not module_name.startswith(f"{missing}."):
            raise  # the module exists; something it imports does not
        raise UnprobeableTarget(f"no module named {missing!r}, got {target!r}") from None
    try:
        return getattr(module, class_name)
    except AttributeError:
        raise UnprobeableTarget(f"module {module_name!r} has no attribute {class_name!r}, got {target!r}") from None


def _resize(example: Any, size: int, device: Any) -> Any:
    import torch

    if isinstance(example, torch.Tensor):
        repeats = math.ceil(size / example.shape[0])
        return torch.cat([example] * repeats)[:size].to(device)
    if isinstance(example, (tuple, list)):
        return tuple(_resize(part, size, device) for part in example)
    if isinstance(example, dict):
        return {key: _resize(value, size, device) for key, value in example.items()}
    return example


def _first_tensor(output: Any) -> Any:
    import torch

    if isinstance(output, torch.Tensor):
        return output
    values = output.values() if isinstance(output, dict) else output
    for value in values:
        found = _first_tensor(value)
        if found is not None:
            return found
    raise ValueError("the model's output holds no tensor to backpropagate from")


if __name__ == "__main__":
    sys.exit(main())
