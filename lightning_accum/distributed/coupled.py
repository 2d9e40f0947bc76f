"""Exact large-batch gradients for losses that couple the rows of a batch (GradCache, Gao et al. 2021).

Pure (torch only). A contrastive loss with in-batch negatives compares every row with every other, so accumulating
micro-batches changes the objective. :func:`cached` runs a tower on chunks of the batch without keeping a graph and
returns the whole batch's embeddings; the loss is computed on the whole batch; the backward replays each chunk with
its random state and autocast state restored and pushes the cached embedding gradient through it. The gradient is the
big batch's; the memory held is one chunk's graph. :func:`all_gather_with_grad` makes the batch span every rank.

This module owns the chunking (by rows, or by a token budget over rows sorted by length), the RNG and autocast capture
and replay, the refusal of parameters that a distributed engine shards, and the gather's gradient rule. It does not
know the Trainer: the Lightning glue learns of each ``cached`` call through :func:`add_listener`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn
from torch.autograd.function import once_differentiable
from torch.func import functional_call
from torch.nn.modules.batchnorm import _BatchNorm, _NormBase
from torch.utils.checkpoint import get_device_states, set_device_states

from lightning_accum.compat.torch import dtensor_type, tree_flatten_with_path

Listener = Callable[[int, int | None], int | None]
_listeners: list[Listener] = []
_NARROW = (torch.bfloat16, torch.float16)


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


def cached(
    module: nn.Module, *inputs: Any, chunk_size: int | None = None, chunk_tokens: int | None = None, **kwargs: Any
) -> Any:
    """``module(*inputs, **kwargs)``, computed in chunks of rows with the big batch's exact gradient.

    Every tensor in ``inputs`` and ``kwargs`` (nested in tuples, lists and mappings too: a dict, a tokenizer's
    ``BatchEncoding``, sentence-transformers' features) is cut along its first dimension, which all of them share;
    anything else, and a tensor without dimensions, goes whole to every chunk. A mapping that is not a dict (a
    ``BatchEncoding``) reaches the module as a dict of its chunk. The chunks run under ``torch.no_grad()``, and their
    outputs are concatenated along dimension 0: a tensor, or tuples, lists and dicts of tensors (a ``ModelOutput`` keeps
    its type), where anything that is not a tensor (a ``"modality"`` string) is the first chunk's. When grad is enabled
    and a parameter of ``module`` or an input requires grad, the result requires grad; its backward replays each chunk
    with the CPU and device RNG states and the autocast state of its first run, and sends the chunk's slice of the
    incoming gradient through it. The chunks' gradients accumulate in place (in float32 where narrower) and are handed
    to autograd as the gradients of the parameters (and inputs), so each parameter's ``.grad`` is written once per
    backward, as DDP requires, even for a tower that two ``cached`` calls share, and a hook on a parameter sees the
    summed gradient once (the replay runs on aliases of the parameters). With grad disabled (validation) the chunks
    run the same way and the concatenation is returned.

    **Rows must be independent inside the module**: each row's output may depend on its own inputs and the parameters,
    never on the other rows of the batch. A layer that mixes rows (``x - x.mean(0)``, a batch statistic, attention
    across the batch) sees only its chunk, and the gradient is silently not the big batch's. Norm layers are checked;
    nothing else can be. The loss outside ``cached`` may couple the rows as it likes.

    Args:
        module: The tower. Its ``BatchNorm`` layers must be in eval mode; only the default generators' random state is
            restored (a module drawing from a ``torch.Generator`` of its own is not exact). Its parameters must be
            whole on this process (not ZeRO-3 partitions, FSDP flat parameters or DTensor shards).
        *inputs: The positional arguments of ``module``.
        chunk_size: The most rows of a chunk (the last holds what is left). ``None``: in a fit with an
            :class:`~lightning_accum.AccumulationScheduler`, its ``micro_batch_size`` (the size ``"auto"`` has
            found); else no limit: one chunk, the whole batch (exact still, and no graph kept between the passes).
        chunk_tokens: The most tokens of a chunk, counted as its rows times its longest row, for text padded under an
            ``attention_mask`` (2-D, a mapping's key or a keyword argument; exactly one). The rows are taken longest
            first, each chunk as many as fit (at least one), and each chunk is cut to its longest row: every tensor
            whose second dimension is the mask's length loses the columns that are padding in all the chunk's rows.
            Exact for a module that ignores padded positions as the mask says (a transformer with a mean or CLS
            pooling) and returns no per-token output; the outputs come back in the batch's order. ``None``: chunks
            by rows only, nothing cut.
        **kwargs: The keyword arguments of ``module``.

    Returns:
        What ``module`` returns, concatenated over the chunks.

    Raises:
        TypeError: If ``module`` is not an ``nn.Module``.
        ValueError: If ``chunk_size`` or ``chunk_tokens`` is not a positive int; if ``module`` holds a ``BatchNorm`` in
            training mode or without running statistics (its statistics would be each chunk's), or a norm that
            updates running statistics in training mode (the replay would update them again); if a parameter is
            sharded by a distributed engine; if the tensors disagree on the first dimension; if ``chunk_tokens`` finds
            no attention mask, or several; if an output tensor is not one of the chunk's rows, or changes shape
            between chunks beyond its rows.

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
    for name, value in (("chunk_size", chunk_size), ("chunk_tokens", chunk_tokens)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"`{name}` must be a positive int, got {value!r}")
    _check_norms(module)
    _check_whole(module)
    inputs, kwargs = _as_dicts((inputs, kwargs))
    leaves, spec = pytree.tree_flatten((inputs, kwargs))
    rows = _rows(inputs, kwargs)
    named = [(name, param) for name, param in module.named_parameters() if param.requires_grad]
    params = [param for _, param in named]
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    graph = torch.is_grad_enabled() and bool(params or any(tensor.requires_grad for tensor in tensors))
    lent = [listener(rows, chunk_size) for listener in list(_listeners)] if graph else []
    step = chunk_size or next((size for size in lent if size is not None), None) or max(rows, 1)
    run = _Chunks(module, leaves, spec)
    if chunk_tokens is None:
        run.bounds = [(start, min(start + step, rows)) for start in range(0, max(rows, 1), step)]
    else:
        run.by_tokens(_attention_mask(inputs, kwargs), chunk_tokens, step)
    if not graph:
        with torch.no_grad():
            return run.unflatten(run.first_pass())
    run.capture_state(tensors + list(module.parameters()) + list(module.buffers()))
    run.names = [name for name, _ in named]
    flat = _Cached.apply(run, len(tensors), *tensors, *params)
    return run.unflatten(list(flat))


def all_gather_with_grad(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's ``tensor``, concatenated along dimension 0 in rank order, with the gradient of this rank's rows.

    For a loss over the global batch, whether every rank computes the same loss on all of it (InfoNCE over every
    rank's embeddings) or each rank the loss of its own rows against all of them (OpenCLIP's ``local_loss=True``).
    The backward sums the incoming gradients over the ranks (one all-reduce of the gathered tensor's gradient) and
    hands this rank the sum's rows of its own. Why: under DDP's average the objective is the mean of the ranks' losses,
    ``L = (1/W) sum_k L_k``; rank ``r``'s rows reach every ``L_k``, so their gradient is ``(1/W) sum_k dL_k/dx_r``, and
    DDP's division by ``W`` leaves ``sum_k dL_k/dx_r`` to each rank. When every rank computes the same loss the sum is
    ``W`` times each rank's own. A parameter that enters the loss directly (a learnable temperature) gets
    ``dL_k/dθ`` on rank ``k``, whose DDP average is right as it is: it does not pass through this function.

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
    """All-gather in forward; in backward, the incoming gradients summed over ranks, this rank's rows of the sum."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        ctx.rows = tensor.shape[0]
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        summed = grad.clone(memory_format=torch.contiguous_format)  # autograd's buffer is not ours to reduce into
        dist.all_reduce(summed)
        start = dist.get_rank() * ctx.rows
        return summed[start : start + ctx.rows]


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


def _check_whole(module: nn.Module) -> None:
    """Refuse a parameter that a distributed engine shards: the replay would bypass its gather and its reduction."""
    for name, param in module.named_parameters():
        engine = _sharded_by(param)
        if engine is not None:
            raise ValueError(
                f"cached() cannot run `{type(module).__name__}`: its parameter `{name}` is {engine}, which that engine"
                " gathers and reduces inside its own hooks, while the replay in backward runs the chunks on aliases"
                " of the parameters and hands autograd each parameter's whole gradient at once. Train a coupled loss"
                " on one device, with DDP (DDPAccumulationStrategy) or DeepSpeed ZeRO stage 1 or 2, or compute it"
                " without cached()"
            )


def _sharded_by(param: torch.Tensor) -> str | None:
    """What shards ``param`` (a DeepSpeed ZeRO-3 partition, an FSDP flat parameter, a DTensor), or ``None``."""
    if hasattr(param, "ds_id"):
        return "a DeepSpeed ZeRO-3 partition"
    if getattr(param, "_fsdp_flattened", False) or getattr(param, "_is_flat_param", False):
        return "part of an FSDP flat parameter"
    dtensor = dtensor_type()
    if dtensor is not None and isinstance(param, dtensor):
        return "a DTensor (FSDP2 or tensor parallelism)"
    return None


def _is_opaque_mapping(node: Any) -> bool:
    """A mapping that torch's pytree does not take apart (``BatchEncoding``, any ``UserDict``)."""
    return isinstance(node, Mapping) and type(node) not in pytree.SUPPORTED_NODES


def _as_dicts(tree: Any) -> Any:
    """``tree`` with each mapping that torch's pytree does not take apart turned into a dict of its items."""
    return pytree.tree_map(
        lambda node: {key: _as_dicts(value) for key, value in node.items()} if _is_opaque_mapping(node) else node,
        tree,
        is_leaf=_is_opaque_mapping,
    )


def _rows(inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The first dimension every tensor in the arguments shares."""
    named = [
        (f"{where}{pytree.keystr(path)}", leaf)
        for where, tree in (("inputs", inputs), ("kwargs", kwargs))
        for path, leaf in tree_flatten_with_path(tree)[0]
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0
    ]
    if not named:
        raise ValueError("cached() found no tensor with a first (batch) dimension in the arguments of the module")
    first, rows = named[0][0], int(named[0][1].shape[0])
    for name, tensor in named[1:]:
        if tensor.shape[0] != rows:
            raise ValueError(f"cached() cuts every tensor by rows: {name} has {tensor.shape[0]}, {first} has {rows}")
    return rows


def _attention_mask(inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """The one 2-D tensor under the key ``attention_mask`` in the arguments, for ``chunk_tokens``."""
    found = [
        leaf
        for path, leaf in tree_flatten_with_path((inputs, kwargs))[0]
        if path and getattr(path[-1], "key", None) == "attention_mask" and isinstance(leaf, torch.Tensor)
    ]
    if len(found) != 1 or found[0].dim() != 2:
        shapes = [tuple(mask.shape) for mask in found]
        raise ValueError(
            "`chunk_tokens` counts each row's tokens by one 2-D `attention_mask` (a key of a mapping argument, or a"
            f" keyword argument), found {len(found)}{f' with shapes {shapes}' if found else ''}: use chunk_size"
        )
    return found[0]


def _restore_rng(cpu_state: torch.Tensor, states: list[torch.Tensor], devices: list[int], device_type: str) -> None:
    """Set the random state a chunk's first pass started from (the CPU's, and the devices')."""
    torch.set_rng_state(cpu_state)
    if devices:
        set_device_states(devices, states, device_type=device_type)


class _Chunks:
    """One ``cached`` call: the arguments, the chunks, the state each chunk ran with, and its two passes.

    With ``chunk_tokens`` the rows are taken in ``order`` (longest first) and each chunk is cut to its ``widths``
    entry; the passes work on the rows in that order, and what they return is put back in the batch's order.
    """

    def __init__(self, module: nn.Module, leaves: list[Any], spec: pytree.TreeSpec) -> None:
        self.module, self.leaves, self.spec = module, leaves, spec
        self.bounds: list[tuple[int, int]] = []
        self.order: torch.Tensor | None = None  # the rows, longest first; None: the batch's order
        self.widths: list[int] = []  # each chunk's columns, with chunk_tokens
        self.columns = 0  # the attention mask's length: tensors with this second dimension are cut to a width
        self.output_spec: pytree.TreeSpec | None = None
        self.constants: dict[int, Any] = {}  # the outputs that are not tensors (the first chunk's), by position
        self.names: list[str] = []  # the trainable parameters' names, which the replay runs on aliases of
        self.device_type = "cuda"
        self.representatives: list[torch.Tensor] = []  # one tensor on each device whose RNG state a chunk keeps
        self.autocast: list[tuple[str, dict[str, Any]]] = []
        self.rng: list[tuple[torch.Tensor, list[torch.Tensor]]] = []

    def by_tokens(self, mask: torch.Tensor, tokens: int, most_rows: int) -> None:
        """Chunks of at most ``tokens`` tokens (rows x longest row) and ``most_rows`` rows, over rows longest first."""
        self.columns = mask.shape[1]
        positions = torch.arange(1, self.columns + 1, device=mask.device)
        lengths = torch.where(mask != 0, positions, 0).amax(1)  # each row's last unpadded column, plus one
        self.order = torch.argsort(lengths, descending=True, stable=True)
        longest = lengths[self.order].clamp(min=1).tolist()
        start = 0
        while start < len(longest):
            stop = min(start + max(1, tokens // longest[start]), start + most_rows, len(longest))
            self.bounds.append((start, stop))
            self.widths.append(longest[start])
            start = stop

    def in_order(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``'s rows in the order the chunks take them."""
        return tensor if self.order is None or tensor.dim() == 0 else tensor.index_select(0, self.order)

    def in_batch_order(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rows in the chunks' order put back in the batch's."""
        if self.order is None:
            return tensor
        return torch.empty_like(tensor).index_copy_(0, self.order, tensor)

    def cut(self, tensor: Any, index: int) -> Any:
        """Chunk ``index``'s rows of ``tensor`` (in the chunks' order), cut to its width; anything else whole."""
        if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
            return tensor
        start, stop = self.bounds[index]
        if self.widths and tensor.dim() > 1 and tensor.shape[1] == self.columns:
            return tensor[start:stop, : self.widths[index]]
        return tensor[start:stop]

    def unflatten(self, flat: list[torch.Tensor]) -> Any:
        assert self.output_spec is not None, "the first pass sets the structure of the outputs"
        tensors = iter(flat)
        leaves = [
            self.constants[i] if i in self.constants else next(tensors) for i in range(self.output_spec.num_leaves)
        ]
        return pytree.tree_unflatten(leaves, self.output_spec)

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
        """``output``'s tensors, each checked to hold ``rows`` rows, in the structure of the first chunk's outputs.

        What is not a tensor is kept from the first chunk (:attr:`constants`).
        """
        found, spec = tree_flatten_with_path(output)
        for path, leaf in found:
            if isinstance(leaf, torch.Tensor) and (leaf.dim() == 0 or leaf.shape[0] != rows):
                what = f"{leaf.shape[0]} rows" if leaf.dim() else "a tensor without dimensions"
                raise ValueError(
                    f"cached(): the module's output{pytree.keystr(path)} must be a tensor of the chunk's {rows} rows,"
                    f" not {what}: return only per-row tensors (a Hugging Face model: pass use_cache=False)"
                )
        if self.output_spec is None:
            self.output_spec = spec
            self.constants = {i: leaf for i, (_, leaf) in enumerate(found) if not isinstance(leaf, torch.Tensor)}
        elif spec != self.output_spec:
            raise ValueError(f"cached(): the module's outputs differ in structure between chunks: {spec}")
        return [leaf for _, leaf in found if isinstance(leaf, torch.Tensor)]

    def first_pass(self) -> list[torch.Tensor]:
        """Every chunk's output, run in the current grad mode and concatenated; each chunk's RNG state is kept."""
        leaves = [self.in_order(leaf) if isinstance(leaf, torch.Tensor) else leaf for leaf in self.leaves]
        parts = []
        for index, (start, stop) in enumerate(self.bounds):
            device_states = get_device_states(*self.representatives)[1] if self.representatives else []
            self.rng.append((torch.get_rng_state(), device_states))
            args, kwargs = pytree.tree_unflatten([self.cut(leaf, index) for leaf in leaves], self.spec)
            parts.append(self.outputs(self.module(*args, **kwargs), stop - start))
        return [self.in_batch_order(self._joined(pieces)) for pieces in zip(*parts, strict=True)]

    def _joined(self, pieces: tuple[torch.Tensor, ...]) -> torch.Tensor:
        shapes = {tuple(piece.shape[1:]) for piece in pieces}
        if len(shapes) > 1:
            why = " (chunk_tokens cuts each chunk to its longest row)" if self.widths else ""
            raise ValueError(
                f"cached(): an output of the module changes shape between chunks beyond its rows, {sorted(shapes)}"
                f"{why}: return only per-row outputs of one shape (a pooled embedding, not per-token states)"
            )
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0]

    def replay(
        self, inputs: list[torch.Tensor], wanted: list[bool], params: list[torch.Tensor], grads: tuple[Any, ...]
    ) -> list[torch.Tensor | None]:
        """The gradients of ``inputs`` (those ``wanted``) and of ``params``, summed over the replayed chunks.

        The chunks run on detached aliases of the parameters (one ``torch.func.functional_call`` around them all): a
        hook the user put on a parameter sees its summed gradient once, when autograd hands it over, never a chunk's
        share. Each chunk's backward accumulates into the aliases' ``.grad`` in place; gradients narrower than float32
        are summed in float32 instead and rounded once.
        """
        inputs = [self.in_order(x) for x in inputs]
        grads = tuple(g if g is None else self.in_order(g) for g in grads)
        aliases = [param.detach().requires_grad_() for param in params]
        shared = [x.detach().requires_grad_(w) if x.dim() == 0 else None for x, w in zip(inputs, wanted, strict=True)]
        sums: list[torch.Tensor | None] = [None] * (len(inputs) + len(params))  # inputs' rows, narrow parameters'

        def every_chunk() -> None:
            for index in range(len(self.bounds)):
                self._replay_chunk(index, inputs, wanted, shared, aliases, grads, sums)

        on_aliases = {f"module.{name}": alias for name, alias in zip(self.names, aliases, strict=True)}
        with torch.random.fork_rng(devices=self.devices, device_type=self.device_type):
            functional_call(_Holder(self.module), on_aliases, (every_chunk,))
        found: list[torch.Tensor | None] = [
            (None if total is None else self.in_batch_order(total)) if whole is None else whole.grad
            for total, whole in zip(sums[: len(inputs)], shared, strict=True)
        ]
        for alias, total in zip(aliases, sums[len(inputs) :], strict=True):
            found.append(alias.grad if total is None else total.to(alias.dtype))
        return found

    def _replay_chunk(
        self,
        index: int,
        inputs: list[torch.Tensor],
        wanted: list[bool],
        shared: list[torch.Tensor | None],
        aliases: list[torch.Tensor],
        grads: tuple[Any, ...],
        sums: list[torch.Tensor | None],
    ) -> None:
        """Chunk ``index`` again, from its random state, and its slice of ``grads`` backpropagated through it."""
        _restore_rng(*self.rng[index], self.devices, self.device_type)
        cut = [
            whole if whole is not None else self.cut(x, index).detach().requires_grad_(w)
            for x, w, whole in zip(inputs, wanted, shared, strict=True)
        ]
        start, stop = self.bounds[index]
        with torch.enable_grad(), contextlib.ExitStack() as autocast:
            for kind, state in self.autocast:
                autocast.enter_context(torch.autocast(kind, **state))
            tensors = iter(cut)
            args, kwargs = pytree.tree_unflatten(
                [next(tensors) if isinstance(x, torch.Tensor) else x for x in self.leaves], self.spec
            )
            outputs = self.outputs(self.module(*args, **kwargs), stop - start)
        pairs = [(o, g[start:stop]) for o, g in zip(outputs, grads, strict=True) if g is not None and o.requires_grad]
        sources = [x for x, w in zip(cut, wanted, strict=True) if w] + aliases
        if not pairs or not sources:
            return
        outs, slices = zip(*pairs, strict=True)
        torch.autograd.backward(outs, slices, inputs=sources)
        for i, x in enumerate(cut):
            if shared[i] is None and x.grad is not None:
                sums[i] = _placed(sums[i], x.grad, inputs[i], self.cut_index(x, index))
        for i, alias in enumerate(aliases, len(inputs)):
            if alias.dtype in _NARROW and alias.grad is not None:
                total = sums[i]
                sums[i] = alias.grad.float() if total is None else total.add_(alias.grad)
                alias.grad = None

    def cut_index(self, piece: torch.Tensor, index: int) -> tuple[slice, ...]:
        """Where chunk ``index``'s ``piece`` of a tensor lies in the whole (its rows, and its width if cut)."""
        start, stop = self.bounds[index]
        if self.widths and piece.dim() > 1 and piece.shape[1] == self.widths[index]:
            return slice(start, stop), slice(0, self.widths[index])
        return (slice(start, stop),)


class _Holder(nn.Module):
    """Holds the tower, so that one ``functional_call`` runs a whole replay on aliases of its parameters."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, replay: Callable[[], None]) -> None:
        replay()


def _placed(
    total: torch.Tensor | None, grad: torch.Tensor, whole: torch.Tensor, where: tuple[slice, ...]
) -> torch.Tensor:
    """``total`` (zeros shaped as ``whole`` at first) with one chunk's ``grad`` written at ``where``."""
    total = torch.zeros_like(whole) if total is None else total
    total[where] = grad
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
