"""Skip or defer gradient communication on the non-final micro-steps of a window, for DDP, FSDP1 and FSDP2.

Pure torch (no Lightning import): :func:`skip_gradient_sync` is a context manager around one micro-step's forward
and backward. Under the ``"last"`` policy gradients are reduced once per optimizer step:

- DDP and FSDP1 (``FullyShardedDataParallel``): the module's own ``no_sync()``. FSDP1 then keeps *unsharded*
  gradients on every rank until the window's last backward.
- FSDP2 (``fully_shard``): ``set_requires_gradient_sync(False)`` on every FSDP module, each module's previous
  state restored in ``finally`` together with ``set_is_last_backward(True)``, so the window's last backward reduces
  and finalizes. Each rank accumulates the unsharded gradients of the sharded units in between.
  ``set_is_last_backward(False)`` is *not* set on the non-final micro-steps: in torch 2.13 it leaves FSDP2's
  backward-prefetch order uncleared and costs one mistargeted all-gather per window (measured: 70 all-gathers instead
  of 64 for 16 micro-steps of a 2-unit model), and with no reduction pending it has nothing to save.

Under the ``"every"`` policy every micro-step reduces as usual, so each FSDP rank keeps only its shard of the
gradients (sharded memory, one reduction per micro-step). ``"reduce_scatter"`` is ``"every"`` with, on an HSDP mesh
(``fully_shard`` on a 2-D mesh), the all-reduce across replicas deferred to the window's last micro-step with
``set_requires_all_reduce``; every sharded unit must then take part in the window's last backward, or torch never
all-reduces its deferred sum (:func:`fsdp2_pending_gradients` detects it). DDP has no sharded gradients, so the two
only add all-reduces there.

FSDP2 keeps the gradients of skipped reductions in its own unsharded buffers, which ``optimizer.zero_grad()`` does
not reach: :func:`drop_fsdp2_pending_gradients` clears them when a window is abandoned before its last micro-step.
Both read torch-private FSDP2 state (torch 2.9 to 2.14, the releases lightning_accum runs FSDP2 on;
``tests/test_torch_contract.py`` fails if it changes).

FSDP2 all-gathers and reduce-scatters a unit only on the ranks that run it, so a unit that some ranks skip
(conditional compute) pairs the ranks' collectives wrongly, whatever the policy. :class:`FSDP2CollectiveGuard` makes
the ranks agree, on a small gloo group of its own, before each FSDP2 collective, at the end of each forward and
backward and before each optimizer step, and raises the same error on every rank where they differ; the strategy
keeps it for as many windows as :func:`checked_windows` reads from its ``check_collectives`` argument.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal, cast

from torch import nn

from lightning_accum.compat.torch import fsdp2_reduces_unused_params, fsdp_module_type, require_fsdp2

GradientSync = Literal["last", "every", "reduce_scatter"]
GRADIENT_SYNCS: tuple[GradientSync, ...] = ("last", "every", "reduce_scatter")
CheckCollectives = bool | int | Literal["always"]
CHECKED_WINDOWS = 3  # windows of each fit that `check_collectives=True` checks (Composer: 3 clean batches)


def check_gradient_sync(value: object) -> GradientSync:
    """Return ``value`` if it is a known gradient-sync policy.

    Raises:
        ValueError: If ``value`` is not ``"last"``, ``"every"`` or ``"reduce_scatter"``.

    Example::

        >>> check_gradient_sync("last")
        'last'
    """
    if value not in GRADIENT_SYNCS:
        raise ValueError(f"`gradient_sync` must be one of {list(GRADIENT_SYNCS)}, got {value!r}")
    return cast(GradientSync, value)


def checked_windows(value: object) -> int | None:
    """How many windows at the start of each fit the ranks agree on every FSDP2 collective; ``None``: all of them.

    ``True``: the first :data:`CHECKED_WINDOWS`; a number n: the first n (``0``, like ``False``: none);
    ``"always"``: every window.

    Raises:
        ValueError: If ``value`` is none of these (a negative number, another string, a float).

    Example::

        >>> checked_windows(True), checked_windows(10), checked_windows("always"), checked_windows(False)
        (3, 10, None, 0)
    """
    if isinstance(value, bool):
        return CHECKED_WINDOWS if value else 0
    if value == "always":
        return None
    if isinstance(value, int) and value >= 0:
        return value
    raise ValueError(
        "`check_collectives` must be True (the first windows of each fit), False, 'always' or a number of windows"
        f" (an int >= 0), got {value!r}"
    )


def fsdp2_modules(module: nn.Module | None) -> list[nn.Module]:
    """The modules under ``module`` (itself included) that ``fully_shard`` was applied to."""
    fsdp_module = fsdp_module_type()
    if module is None or fsdp_module is None:
        return []
    return [sub for sub in module.modules() if isinstance(sub, fsdp_module)]


def has_no_sync(module: nn.Module | None) -> bool:
    """Whether ``module`` is a DDP or FSDP1 wrapper, whose ``no_sync()`` skips the gradient reduction."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(module, (DistributedDataParallel, FullyShardedDataParallel))


def can_control(module: nn.Module | None) -> bool:
    """Whether :func:`skip_gradient_sync` knows how to control ``module``'s gradient communication."""
    return has_no_sync(module) or bool(fsdp2_modules(module))


@contextmanager
def skip_gradient_sync(module: nn.Module | None, policy: GradientSync = "last") -> Iterator[None]:
    """Run a non-final micro-step of a window with gradient communication skipped (``"last"``) or only deferred.

    Args:
        module: The wrapped model: a ``DistributedDataParallel``, a ``FullyShardedDataParallel``, or a module with
            ``fully_shard`` applied to it or to its submodules. Anything else (one process, no data parallelism)
            runs unchanged.
        policy: ``"last"``: no gradient communication until the window's last micro-step. ``"every"``: reduce (and
            reduce-scatter) on every micro-step. ``"reduce_scatter"``: as ``"every"``, deferring only HSDP's
            all-reduce across replicas to the window's end.

    Example::

        for i, batch in enumerate(window):
            last = i == len(window) - 1
            with contextlib.nullcontext() if last else skip_gradient_sync(model, "last"):
                (loss_fn(model(batch)) / len(window)).backward()
        optimizer.step()
    """
    check_gradient_sync(policy)
    if policy == "every":
        yield
        return
    fsdp2 = fsdp2_modules(module)
    if fsdp2:
        require_fsdp2("skip_gradient_sync on `fully_shard` (FSDP2) units", "reduce on every micro-step")
        previous = [fsdp2_sync_state(sub) for sub in fsdp2]
        try:
            for sub in fsdp2:
                if policy == "last":
                    sub.set_requires_gradient_sync(False, recurse=False)  # type: ignore[operator]
                else:
                    sub.set_requires_all_reduce(False, recurse=False)  # type: ignore[operator]
            yield
        finally:
            for sub, (reduce, all_reduce) in zip(fsdp2, previous, strict=True):
                sub.set_requires_gradient_sync(reduce, recurse=False)  # type: ignore[operator]
                if all_reduce != reduce:
                    sub.set_requires_all_reduce(all_reduce, recurse=False)  # type: ignore[operator]
                sub.set_is_last_backward(True)  # type: ignore[operator]
        return
    if policy == "last" and module is not None and has_no_sync(module):
        with module.no_sync():  # type: ignore[operator]
            yield
        return
    yield


def fsdp2_sync_state(unit: nn.Module) -> tuple[bool, bool]:
    """``(reduce-scatters, all-reduces across replicas)``: what an FSDP2 unit's next backward does with its gradients.

    ``set_requires_gradient_sync`` and ``set_requires_all_reduce`` write these flags and no public getter reads them,
    so they are read from the unit's parameter groups (torch-private ``reduce_grads`` and ``all_reduce_grads``,
    ``tests/test_fabric_sync.py`` pins them); a unit without parameters reduces as by default.
    """
    groups = param_groups_of(unit._get_fsdp_state())  # type: ignore[operator]
    if not groups:
        return True, True
    return bool(groups[0].reduce_grads), bool(groups[0].all_reduce_grads)


def fsdp2_param_groups(module: nn.Module | None) -> list[Any]:
    """The parameter groups of every FSDP2 unit under ``module`` (torch-private ``FSDPParamGroup`` s)."""
    groups = []
    for sub in fsdp2_modules(module):
        groups += param_groups_of(sub._get_fsdp_state())  # type: ignore[operator]
    return groups


def param_groups_of(state: Any) -> list[Any]:
    """An FSDP2 unit's parameter groups: its ``_fsdp_param_groups``, or on older torch its one ``_fsdp_param_group``.

    torch's list of groups per unit is recent; releases before it hold a single group (or ``None``) under the
    singular name. Without this fallback every FSDP2 check here would find no group and silently do nothing.
    """
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        return [] if group is None else [group]
    return list(groups)


def fsdp2_pending_gradients(module: nn.Module | None) -> bool:
    """Whether an FSDP2 unit holds gradients that no reduction has reached yet.

    True after a backward with ``set_requires_gradient_sync(False)`` (unsharded gradients accumulated) or, on HSDP,
    with ``set_requires_all_reduce(False)`` (a reduce-scattered sum awaiting its all-reduce). An optimizer step at
    that point would miss them.
    """
    for group in fsdp2_param_groups(module):
        if getattr(group, "_partial_reduce_output", None) is not None:
            return True
        for param in getattr(group, "fsdp_params", []):
            if getattr(param, "unsharded_accumulated_grad", None) is not None:
                return True
            unsharded = getattr(param, "_unsharded_param", None)
            if unsharded is not None and unsharded.grad is not None:
                return True
    return False


def drop_fsdp2_pending_gradients(module: nn.Module | None) -> None:
    """Forget the gradients FSDP2 accumulated for reductions that will not happen (an abandoned window)."""
    for group in fsdp2_param_groups(module):
        if hasattr(group, "_partial_reduce_output"):
            group._partial_reduce_output = None
        for param in getattr(group, "fsdp_params", []):
            if hasattr(param, "unsharded_accumulated_grad"):
                param.unsharded_accumulated_grad = None
            unsharded = getattr(param, "_unsharded_param", None)
            if unsharded is not None:
                unsharded.grad = None


# ------------------------------------------------------------------ the ranks agree before each FSDP2 collective

ALL_GATHER_FORWARD, ALL_GATHER_BACKWARD, REDUCE_SCATTER, FORWARD_END, BACKWARD_END, OPTIMIZER_STEP = range(1, 7)
_FIELDS = 5  # per rank: event, unit, bytes, the collective group's first rank, a flag (the step's pending gradients)
_GUARD_GROUP: list[Any] = []  # weak references to the default process group and the guard group made under it


def _guard_group() -> Any:
    """A gloo group over every rank, of the guard's own: created once per default process group, on every rank.

    Its own so that an agreement never pairs with another collective; gloo so that it runs on the CPU (under NCCL a
    CUDA collective read on the host would wait for the GPU's queue). Creating it is a collective, so every rank
    asks at the same point (the strategy's setup), and every rank finds it made or not alike: it lives as long as
    the default group it was made under (torch keeps both until ``destroy_process_group()``; held weakly here, so
    that they and their store's port go then).
    """
    import weakref

    import torch.distributed as dist

    world = dist.group.WORLD
    if _GUARD_GROUP and _GUARD_GROUP[0]() is world and _GUARD_GROUP[1]() is not None:
        return _GUARD_GROUP[1]()
    group = dist.new_group(backend="gloo")
    _GUARD_GROUP[:] = [weakref.ref(world), weakref.ref(group)]
    return group


def _in_backward() -> bool:
    import torch

    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


class _AgreedAllGather:
    """An FSDP2 ``AllGather`` comm that makes the ranks agree before delegating to the one it wraps."""

    def __init__(self, inner: Any, guard: FSDP2CollectiveGuard, unit: int) -> None:
        self.inner, self.guard, self.unit = inner, guard, unit

    def allocate(self, size: Any, *, dtype: Any, device: Any) -> Any:
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: Any, input_tensor: Any, group: Any, async_op: bool = False) -> Any:
        event = ALL_GATHER_BACKWARD if _in_backward() else ALL_GATHER_FORWARD
        self.guard.agree(event, self.unit, input_tensor.numel() * input_tensor.element_size(), group)
        return self.inner(output_tensor=output_tensor, input_tensor=input_tensor, group=group, async_op=async_op)


class _AgreedReduceScatter:
    """An FSDP2 ``ReduceScatter`` comm that makes the ranks agree before delegating to the one it wraps."""

    def __init__(self, inner: Any, guard: FSDP2CollectiveGuard, unit: int) -> None:
        self.inner, self.guard, self.unit = inner, guard, unit

    def allocate(self, size: Any, *, dtype: Any, device: Any) -> Any:
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: Any, input_tensor: Any, group: Any, op: Any, async_op: bool = False) -> Any:
        self.guard.agree(REDUCE_SCATTER, self.unit, input_tensor.numel() * input_tensor.element_size(), group)
        return self.inner(output_tensor=output_tensor, input_tensor=input_tensor, group=group, op=op, async_op=async_op)


class FSDP2CollectiveGuard:
    """Make the ranks agree on each FSDP2 collective of ``module`` before any rank issues it; raise on all if not.

    FSDP2 all-gathers a unit's parameters (in its forward, and in its backward after resharding) and reduce-scatters
    its gradients only on the ranks that run that unit. A unit that some ranks skip (conditional compute, a mixture
    of experts, a head used only sometimes) pairs one rank's collective with another collective of the other ranks:
    gloo aborts a process ("Received data size doesn't match expected size"; measured in torch 2.13 on every
    ``gradient_sync`` policy, with no result from either rank), NCCL hangs or reduces the wrong tensors.

    The guard wraps every param group's all-gather and reduce-scatter comm (FSDP2's ``Comm`` objects, those
    ``set_custom_all_gather``/``set_custom_reduce_scatter`` replace) so that each first all-gathers, on a gloo group
    of the guard's own, what every rank is about to issue (5 integers a rank); it does the same at the end of each
    top-level FSDP2 module's forward, of each backward (:meth:`backward_ended`) and before each optimizer step
    (:meth:`pending_ranks`). Where the ranks differ, every rank raises the same ``RuntimeError`` before the collective
    that would have paired wrongly. The cost is one such small CPU collective per FSDP2 collective, as long as the
    guard is in place: :meth:`remove` gives FSDP2 its own comms back and removes the hooks, after which it costs
    nothing. Construct it on every rank at the same point (it may create its group, a collective), and remove it on
    every rank at the same point (between optimizer steps that every rank agreed on).

    Args:
        module: The model, with ``fully_shard`` applied to it or to its submodules.
        names_from: The module whose ``named_modules()`` name the units in messages (default ``module``).
    """

    def __init__(self, module: nn.Module, names_from: nn.Module | None = None) -> None:
        import torch.distributed as dist

        self.module = module
        self.group = _guard_group()
        self.world_size = dist.get_world_size(self.group)
        self._group_keys: dict[int, tuple[Any, int]] = {}
        names = {sub: name for name, sub in (names_from or module).named_modules()}
        units = fsdp2_modules(module)
        self._module_names = [names.get(unit, type(unit).__name__) or "the root module" for unit in units]
        self._group_names: list[str] = []
        self._wrapped: list[tuple[Any, Any, Any]] = []  # (param group, all-gather comm, reduce-scatter comm)
        for unit, name in zip(units, self._module_names, strict=True):
            groups = param_groups_of(unit._get_fsdp_state())  # type: ignore[operator]
            for group in groups:
                index = len(self._group_names)
                self._group_names.append(name if len(groups) == 1 else f"{name} (param group {index})")
                if not (hasattr(group, "_all_gather_comm") and hasattr(group, "_reduce_scatter_comm")):
                    continue  # an older torch without comm objects: only the boundaries below agree
                all_gather, reduce_scatter = group._all_gather_comm, group._reduce_scatter_comm
                while isinstance(all_gather, _AgreedAllGather):  # a guard of an earlier fit was left in place
                    all_gather = all_gather.inner
                while isinstance(reduce_scatter, _AgreedReduceScatter):
                    reduce_scatter = reduce_scatter.inner
                self._wrapped.append((group, all_gather, reduce_scatter))
                group._all_gather_comm = _AgreedAllGather(all_gather, self, index)
                group._reduce_scatter_comm = _AgreedReduceScatter(reduce_scatter, self, index)
        inner = {id(sub) for unit in units for sub in unit.modules() if sub is not unit}
        self._hooks = [  # at the end of each top-level unit's forward (the root's, where there is one)
            unit.register_forward_hook(self._forward_hook(index))
            for index, unit in enumerate(units)
            if id(unit) not in inner
        ]

    def remove(self) -> None:
        """Give every param group its comms back and remove the forward hooks."""
        for group, all_gather, reduce_scatter in self._wrapped:
            group._all_gather_comm, group._reduce_scatter_comm = all_gather, reduce_scatter
        for hook in self._hooks:
            hook.remove()
        self._wrapped, self._hooks = [], []
        self.group = None  # the default process group keeps it for the next guard

    def _forward_hook(self, index: int) -> Callable[..., None]:
        import torch

        @torch.compiler.disable
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self.agree(FORWARD_END, index)

        return hook

    def backward_ended(self) -> None:
        """Agree that every rank finished its backward (none is left waiting in a reduce-scatter)."""
        self.agree(BACKWARD_END)

    def pending_ranks(self, pending: bool) -> list[int]:
        """Agree that every rank is about to step; the ranks that hold gradients no reduction has reached."""
        rows = self.agree(OPTIMIZER_STEP, flag=int(pending))
        return [rank for rank, row in enumerate(rows) if row[4]]

    def agree(self, event: int, unit: int = -1, nbytes: int = 0, group: Any = None, flag: int = 0) -> list[list[int]]:
        """All-gather what each rank is about to do; raise on every rank if they differ.

        Ranks must agree on the event and the unit, and ranks in the same collective group on its size in bytes.
        """
        import torch
        import torch.distributed as dist

        mine = torch.tensor([event, unit, nbytes, self._group_key(group), flag], dtype=torch.int64)
        everyone = [torch.empty(_FIELDS, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(everyone, mine, group=self.group)
        rows = [row.tolist() for row in everyone]
        first = rows[0]
        same_size: dict[int, int] = {}  # collective group -> bytes
        for row in rows:
            if row[:2] != first[:2] or same_size.setdefault(row[3], row[2]) != row[2]:
                raise RuntimeError(self._message(rows))
        return rows

    def _group_key(self, group: Any) -> int:
        if group is None:
            return -1
        cached = self._group_keys.get(id(group))
        if cached is None or cached[0] is not group:
            import torch.distributed as dist

            cached = (group, min(dist.get_process_group_ranks(group)))
            self._group_keys[id(group)] = cached
        return cached[1]

    def _describe(self, row: list[int]) -> str:
        event, unit, nbytes = row[:3]
        if event == FORWARD_END:
            return f"the end of `{self._module_names[unit]}`'s forward"
        if event == BACKWARD_END:
            return "the end of the backward"
        if event == OPTIMIZER_STEP:
            return "the optimizer step"
        name = self._group_names[unit]
        if event == REDUCE_SCATTER:
            return f"the reduce-scatter of `{name}`'s gradients ({nbytes} bytes)"
        phase = "backward" if event == ALL_GATHER_BACKWARD else "forward"
        return f"the all-gather of `{name}`'s parameters for its {phase} ({nbytes} bytes)"

    def _message(self, rows: list[list[int]]) -> str:
        ranks: dict[str, list[int]] = {}
        for rank, row in enumerate(rows):
            ranks.setdefault(self._describe(row), []).append(rank)
        where = "; ".join(
            f"{'rank' if len(who) == 1 else 'ranks'} {', '.join(map(str, who))}: {what}" for what, who in ranks.items()
        )
        other_fix = (  # torch 2.13 and newer
            ", or leave it out of `fully_shard` so that it belongs to a unit every rank runs, and call"
            " `set_reduce_scatter_unused_params(True)` on that unit"
            if fsdp2_reduces_unused_params()
            else ""
        )
        return (
            f"FSDP2 units ran differently on the ranks: the ranks are about to issue different collectives ({where}),"
            " which would hang or crash the run, so every rank raises here instead. Every FSDP2 unit (a module given"
            " to `fully_shard`) must run its forward and backward on every rank, in the same order, in every"
            " micro-step: a unit that only some ranks run (conditional compute, a mixture of experts, a head used"
            " only sometimes) cannot be all-gathered or reduced. Call it on every rank, with zero weight where its"
            f" result is not needed (`h = h + 0 * unit(h)`){other_fix}"
        )
