"""Exact large-batch gradients for losses that couple the rows of a batch (GradCache, Gao et al. 2021).

Pure (torch only). A contrastive loss with in-batch negatives compares every row with every other, so accumulating
micro-batches changes the objective. :func:`cached` runs a tower on chunks of the batch without keeping a graph and
returns the whole batch's embeddings; the loss is computed on the whole batch; the backward replays each chunk with
its random state and autocast state restored and pushes the cached embedding gradient through it. The gradient is the
big batch's; the memory held is one chunk's graph. :func:`all_gather_with_grad` makes the batch span every rank.

This module owns the chunking, the RNG and autocast capture and replay, and the world-size rule. It does not know the
Trainer: the Lightning glue learns of each ``cached`` call through :func:`add_listener`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn
from torch.autograd.function import once_differentiable
from torch.func import functional_call
from torch.nn.modules.batchnorm import _BatchNorm, _NormBase
from torch.utils.checkpoint import get_device_states, set_device_states

Listener = Callable[[int, int | None], int | None]
_listeners: list[Listener] = []


def add_listener(listener: Listener) -> Callable[[], None]:
    """Call ``listener(rows, chunk_size)`` at each :func:`cached` call that builds a graph; returns its remover.

    ``rows`` is the call's batch, ``chunk_size`` the one it was given (``None`` if none). What the listener returns
    is the chunk size of a call given none (``None``: no opinion). The Lightning glue listens to know that the step
    it runs couples its rows, and to lend its ``micro_batch_size`` as the chunk size. A listener may raise to stop
    the call before any forward.

    Example::

        >>> calls = []
        >>> remove = add_listener(lambda rows, chunk: calls.append((rows, chunk)) or 2)
        >>> _ = cached(nn.Linear(3, 2), torch.zeros(4, 3))
        >>> remove()
        >>> calls
        [(4, None)]
    """
    _listeners.append(listener)
    return lambda: _listeners.remove(listener)


def cached(module: nn.Module, *inputs: Any, chunk_size: int | None = None, **kwargs: Any) -> Any:
    """``module(*inputs, **kwargs)``, computed in chunks of rows with the big batch's exact gradient.

    Every tensor in ``inputs`` and ``kwargs`` (nested in tuples, lists and dicts too) is cut along its first
    dimension, which all of them share; anything else, and a tensor without dimensions, goes whole to every chunk.
    The chunks run under ``torch.no_grad()``, and their outputs (a tensor, or tuples, lists and dicts of tensors) are
    concatenated along dimension 0. When grad is enabled and a parameter of ``module`` or an input requires grad, the
    result requires grad; its backward replays each chunk with the CPU and device RNG states and the autocast state of
    its first run, and sends the chunk's slice of the incoming gradient through it. The gradients of all chunks are
    summed (in float32 where narrower) and handed to autograd as the gradients of the parameters (and inputs), so each
    parameter's ``.grad`` is written once per backward, as DDP requires, even for a tower that two ``cached`` calls
    share, and a hook on a parameter sees the summed gradient once (the replay runs on aliases of the parameters).
    With grad disabled (validation) the chunks run the same way and the concatenation is returned.

    Args:
        module: The tower. Its ``BatchNorm`` layers must be in eval mode; only the default generators' random state is
            restored (a module drawing from a ``torch.Generator`` of its own is not exact).
        *inputs: The positional arguments of ``module``.
        chunk_size: The rows of a chunk (the last holds what is left). ``None``: in a fit with an
            :class:`~lightning_accum.AccumulationScheduler`, its ``micro_batch_size`` (the size ``"auto"`` has
            found); else one chunk, the whole batch (exact still, and no graph kept between forward and backward).
        **kwargs: The keyword arguments of ``module``.

    Returns:
        What ``module`` returns, concatenated over the chunks.

    Raises:
        TypeError: If ``module`` is not an ``nn.Module``.
        ValueError: If ``chunk_size`` is not a positive int; if ``module`` holds a ``BatchNorm`` in training mode or
            without running statistics (its statistics would be each chunk's), or a norm that updates running
            statistics in training mode (the replay would update them again); if the tensors disagree on the first
            dimension; if an output is not a tensor whose first dimension is the chunk's rows.

    Example::

        >>> tower = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
        >>> queries, documents = cached(tower, torch.randn(10, 8), chunk_size=3), tower(torch.randn(10, 8))
        >>> logits = queries @ documents.T
        >>> nn.functional.cross_entropy(logits, torch.arange(10)).backward()
        >>> tower[0].weight.grad.shape
        torch.Size([16, 8])
    """
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"cached() runs an nn.Module (its parameters get the gradient), got `module={module!r}`: wrap the function"
            " in a module, or pass the module it calls"
        )
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"`chunk_size` must be a positive int, got {chunk_size!r}")
    _check_norms(module)
    leaves, spec = pytree.tree_flatten((inputs, kwargs))
    rows = _rows(inputs, kwargs)
    named = [(name, param) for name, param in module.named_parameters() if param.requires_grad]
    params = [param for _, param in named]
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    graph = torch.is_grad_enabled() and bool(params or any(tensor.requires_grad for tensor in tensors))
    lent = [listener(rows, chunk_size) for listener in list(_listeners)] if graph else []
    step = chunk_size or next((size for size in lent if size is not None), None) or max(rows, 1)
    run = _Chunks(module, leaves, spec, [(start, min(start + step, rows)) for start in range(0, max(rows, 1), step)])
    if not graph:
        with torch.no_grad():
            return run.unflatten(run.first_pass())
    run.capture_state(tensors + list(module.parameters()) + list(module.buffers()))
    run.names = [name for name, _ in named]
    flat = _Cached.apply(run, len(tensors), *tensors, *params)
    return run.unflatten(list(flat))


def all_gather_with_grad(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's ``tensor``, concatenated along dimension 0 in rank order, with the gradient of this rank's rows.

    For a loss that every rank computes identically on the global batch (InfoNCE over every rank's embeddings). The
    backward hands this rank the gradient of its own rows multiplied by the world size ``W``. Why: rank ``r``'s
    parameters reach the global loss ``L`` only through its rows, so it computes ``g_r``, its rows' share of
    ``dL/dθ``; the true gradient is ``sum_r g_r``; DDP averages over ranks, ``(1/W) sum_r g_r``; the factor ``W``
    restores the sum. A parameter that enters the loss directly (a learnable temperature) already gets all of
    ``dL/dθ`` on every rank, and DDP's average of ``W`` equal values is right: it takes no factor, and takes none here
    since it does not pass through this function. The rule assumes the loss is the same on every rank: a loss of this
    rank's rows only (local queries against gathered documents) needs the incoming gradients summed over ranks instead.

    Without an initialized process group, or with one rank, ``tensor`` itself is returned.

    Args:
        tensor: This rank's rows; every rank's must have the same shape.

    Raises:
        ValueError: On every rank, if the ranks' first dimensions differ (one small all-gather of the sizes checks).

    Example::

        >>> embeddings = torch.randn(4, 8, requires_grad=True)
        >>> all_gather_with_grad(embeddings) is embeddings  # no process group: the tensor itself
        True
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return tensor
    sizes = [torch.zeros(1, dtype=torch.long, device=tensor.device) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([tensor.shape[0]], device=tensor.device))
    if len({int(size) for size in sizes}) > 1:
        found = ", ".join(f"rank {rank}: {int(size)}" for rank, size in enumerate(sizes))
        raise ValueError(f"all_gather_with_grad() needs the same number of rows on every rank, got {found}")
    return _Gather.apply(tensor)


class _Gather(torch.autograd.Function):
    """All-gather in forward; this rank's rows of the incoming gradient, times the world size, in backward."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        ctx.rows = tensor.shape[0]
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        start = dist.get_rank() * ctx.rows
        return grad[start : start + ctx.rows] * dist.get_world_size()


def _check_norms(module: nn.Module) -> None:
    """Refuse a norm layer whose output or buffers depend on how the batch is cut into chunks."""
    for name, layer in module.named_modules():
        if not isinstance(layer, _NormBase):
            continue
        batch_statistics = isinstance(layer, _BatchNorm) and (layer.training or not layer.track_running_stats)
        if batch_statistics or (layer.training and layer.track_running_stats):
            mode = "in training mode" if layer.training else "without running statistics"
            why = "its batch statistics would be each chunk's, and " if batch_statistics else ""
            raise ValueError(
                f"cached() cannot run {type(layer).__name__} `{name or type(module).__name__}` {mode}: {why}the"
                " replay in backward would run it again on each chunk (updating running statistics a second time)."
                " Put it in eval mode with running statistics, or use a norm without them (LayerNorm)"
            )


def _rows(inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The first dimension every tensor in the arguments shares."""
    named = [
        (f"{where}{pytree.keystr(path)}", leaf)
        for where, tree in (("inputs", inputs), ("kwargs", kwargs))
        for path, leaf in pytree.tree_flatten_with_path(tree)[0]
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0
    ]
    if not named:
        raise ValueError("cached() found no tensor with a first (batch) dimension in the arguments of the module")
    first, rows = named[0][0], int(named[0][1].shape[0])
    for name, tensor in named[1:]:
        if tensor.shape[0] != rows:
            raise ValueError(f"cached() cuts every tensor by rows: {name} has {tensor.shape[0]}, {first} has {rows}")
    return rows


def _restore_rng(cpu_state: torch.Tensor, states: list[torch.Tensor], devices: list[int], device_type: str) -> None:
    """Set the random state a chunk's first pass started from (the CPU's, and the devices')."""
    torch.set_rng_state(cpu_state)
    if devices:
        set_device_states(devices, states, device_type=device_type)


class _Chunks:
    """One ``cached`` call: the arguments, the chunks' bounds, the state each chunk ran with, and its two passes."""

    def __init__(self, module: nn.Module, leaves: list[Any], spec: pytree.TreeSpec, bounds: list[tuple[int, int]]):
        self.module, self.leaves, self.spec, self.bounds = module, leaves, spec, bounds
        self.output_spec: pytree.TreeSpec | None = None
        self.names: list[str] = []  # the trainable parameters' names, which the replay runs on aliases of
        self.device_type = "cuda"
        self.representatives: list[torch.Tensor] = []  # one tensor on each device whose RNG state a chunk keeps
        self.autocast: list[tuple[str, dict[str, Any]]] = []
        self.rng: list[tuple[torch.Tensor, list[torch.Tensor]]] = []

    def unflatten(self, flat: list[torch.Tensor]) -> Any:
        assert self.output_spec is not None, "the first pass sets the structure of the outputs"
        return pytree.tree_unflatten(flat, self.output_spec)

    @property
    def devices(self) -> list[int]:
        return [tensor.get_device() for tensor in self.representatives]

    def capture_state(self, tensors: list[torch.Tensor]) -> None:
        """The devices whose RNG states each chunk keeps, and the autocast state the replay takes up again."""
        by_device = {tensor.device: tensor for tensor in tensors if tensor.device.type not in ("cpu", "meta")}
        types = {device.type for device in by_device}
        self.device_type = "cuda" if "cuda" in types or not types else sorted(types)[0]
        self.representatives = [t for d, t in sorted(by_device.items(), key=str) if d.type == self.device_type]
        cache = torch.is_autocast_cache_enabled()
        self.autocast = [
            (kind, {"enabled": torch.is_autocast_enabled(kind), "dtype": torch.get_autocast_dtype(kind)})
            for kind in sorted(types | {"cpu"})
            if torch.amp.is_autocast_available(kind)
        ]
        for _, kwargs in self.autocast:
            kwargs["cache_enabled"] = cache

    def outputs(self, output: Any, rows: int) -> list[torch.Tensor]:
        """``output``'s tensors, checked: each a tensor of ``rows`` rows, in the structure of the first chunk's."""
        found, spec = pytree.tree_flatten_with_path(output)
        for path, leaf in found:
            if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0 or leaf.shape[0] != rows:
                what = f"{leaf.shape[0]} rows" if isinstance(leaf, torch.Tensor) and leaf.dim() else repr(leaf)[:60]
                raise ValueError(
                    f"cached(): the module's output{pytree.keystr(path)} must be a tensor of the chunk's {rows} rows,"
                    f" not {what}: return only per-row tensors (a Hugging Face model: pass use_cache=False)"
                )
        if self.output_spec is not None and spec != self.output_spec:
            raise ValueError(f"cached(): the module's outputs differ in structure between chunks: {spec}")
        self.output_spec = spec
        return [leaf for _, leaf in found]

    def first_pass(self) -> list[torch.Tensor]:
        """Every chunk's output, run in the current grad mode and concatenated; each chunk's RNG state is kept."""
        parts = []
        for start, stop in self.bounds:
            device_states = get_device_states(*self.representatives)[1] if self.representatives else []
            self.rng.append((torch.get_rng_state(), device_states))
            cut = [x[start:stop] if isinstance(x, torch.Tensor) and x.dim() > 0 else x for x in self.leaves]
            args, kwargs = pytree.tree_unflatten(cut, self.spec)
            parts.append(self.outputs(self.module(*args, **kwargs), stop - start))
        return [torch.cat(pieces) if len(pieces) > 1 else pieces[0] for pieces in zip(*parts, strict=True)]

    def replay(
        self, inputs: list[torch.Tensor], wanted: list[bool], params: list[torch.Tensor], grads: tuple[Any, ...]
    ) -> list[torch.Tensor | None]:
        """The gradients of ``inputs`` (those ``wanted``) and of ``params``, summed over the replayed chunks.

        The chunks run on detached aliases of the parameters (``torch.func.functional_call``): a hook the user put on
        a parameter sees its summed gradient once, when autograd hands it over, never a chunk's share. Gradients
        narrower than float32 are summed in float32 and rounded once.
        """
        totals: list[torch.Tensor | None] = [None] * (len(inputs) + len(params))
        aliases = [param.detach().requires_grad_() for param in params]
        with torch.random.fork_rng(devices=self.devices, device_type=self.device_type):
            for (start, stop), rng in zip(self.bounds, self.rng, strict=True):
                _restore_rng(*rng, self.devices, self.device_type)
                cut = [
                    (x[start:stop] if x.dim() else x).detach().requires_grad_(w)
                    for x, w in zip(inputs, wanted, strict=True)
                ]
                with torch.enable_grad(), contextlib.ExitStack() as autocast:
                    for kind, state in self.autocast:
                        autocast.enter_context(torch.autocast(kind, **state))
                    tensors = iter(cut)
                    leaves = [next(tensors) if isinstance(x, torch.Tensor) else x for x in self.leaves]
                    args, kwargs = pytree.tree_unflatten(leaves, self.spec)
                    output = functional_call(self.module, dict(zip(self.names, aliases, strict=True)), args, kwargs)
                    outputs = self.outputs(output, stop - start)
                pairs = [
                    (o, g[start:stop]) for o, g in zip(outputs, grads, strict=True) if g is not None and o.requires_grad
                ]
                sources = [(i, x) for i, x in enumerate(cut) if wanted[i]] + list(enumerate(aliases, len(inputs)))
                if not pairs or not sources:
                    continue
                outs, slices = zip(*pairs, strict=True)
                found = torch.autograd.grad(outs, [x for _, x in sources], slices, allow_unused=True)
                for (index, _), grad in zip(sources, found, strict=True):
                    rows = (start, stop) if index < len(inputs) and inputs[index].dim() else None
                    totals[index] = _accumulate(totals[index], grad, rows, [*inputs, *params][index])
        wholes = [*inputs, *params]
        return [total if total is None else total.to(wholes[i].dtype) for i, total in enumerate(totals)]


def _accumulate(
    total: torch.Tensor | None, grad: torch.Tensor | None, rows: tuple[int, int] | None, whole: torch.Tensor
) -> torch.Tensor | None:
    """``total`` with one chunk's ``grad`` added: to ``rows`` of a tensor cut by rows, else to all of it."""
    if grad is None:
        return total
    if rows is None:
        if total is None:  # a float32 copy of a narrower gradient; else autograd.grad's fresh tensor, ours to add to
            return grad.float() if grad.dtype in (torch.bfloat16, torch.float16) else grad
        return total.add_(grad)
    total = torch.zeros_like(whole) if total is None else total
    total[rows[0] : rows[1]] = grad
    return total


class _Cached(torch.autograd.Function):
    """The first pass without a graph; in backward, the replay, whose summed gradients autograd accumulates once."""

    @staticmethod
    def forward(ctx: Any, run: _Chunks, inputs: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.run, ctx.inputs, ctx.params = run, inputs, tensors[inputs:]
        ctx.save_for_backward(*tensors[:inputs])
        ctx.set_materialize_grads(False)
        outputs = run.first_pass()
        ctx.mark_non_differentiable(*[o for o in outputs if not (o.is_floating_point() or o.is_complex())])
        return tuple(outputs)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        wanted = list(ctx.needs_input_grad[2 : 2 + ctx.inputs])
        return (None, None, *ctx.run.replay(list(ctx.saved_tensors), wanted, list(ctx.params), grads))
