"""What the installed torch offers, asked by feature: the one place that knows torch releases apart.

lightning_accum supports torch 2.4 (the first release with FSDP2, and the floor of Lightning's
``ModelParallelStrategy``) to the newest. No module imports at load time a torch name that torch 2.4 lacks: a name
that moved between releases is found here, when it is first needed, and a feature that needs more than the installed
torch has is refused by :func:`require_fsdp2` before any optimizer step, with the release it needs and what to do
instead. The table of features and releases is in docs/compatibility.md; ``tests/test_torch_contract.py`` pins
each torch-private name lightning_accum reads, per release.

- FSDP2 (``fully_shard``, ``FSDPModule``, ``MixedPrecisionPolicy``): public in ``torch.distributed.fsdp`` from
  torch 2.6, in ``torch.distributed._composable.fsdp`` in 2.4 and 2.5.
- ``DTensor``: public in ``torch.distributed.tensor`` from torch 2.5, in ``torch.distributed._tensor`` in 2.4.
- pytree key paths: a node registered without them (by a library written for an older torch) is flattened by
  position (:func:`tree_flatten_with_path`).
- lightning_accum's FSDP2 mechanics (one reduction per window, float32 accumulation of narrow gradients, the noise
  scale on unsharded gradients, the collective guard) read FSDP2's private per-unit state; they are tested exact
  from :data:`FSDP2_FLOOR` on. Below it they are refused (:func:`require_fsdp2`).

Pure torch: no Lightning import.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from lightning_accum.compat.versions import release

# The oldest torch on which lightning_accum's FSDP2 mechanics are tested exact (2 gloo ranks against plain PyTorch:
# tests/test_distributed.py, test_precision.py, test_hsdp.py, test_skipped_unit.py, test_fsdp2_checkpoints.py, in
# .ci/run's stage fsdp2-floor on torch 2.9.1). Below it (docs/compatibility.md): torch 2.4 to 2.6 cannot run FSDP2 on
# the CPU at all (2.4 creates CUDA streams, 2.6 fails in `Stream.record_event`), 2.7 leaves gradients off by the world
# size on CPU/gloo, and 2.7 and 2.8 have no comm objects for the collective guard to wrap, so a unit that one rank
# skips would hang the ranks instead of raising.
FSDP2_FLOOR = (2, 9, 0)


@functools.cache
def torch_release() -> tuple[int, int, int]:
    """The installed torch's numeric release (``(2, 4, 1)`` for ``"2.4.1+cu121"``)."""
    return release(torch.__version__)


def _text(numbers: tuple[int, ...]) -> str:
    return ".".join(map(str, numbers))


def has_fsdp2_mechanics() -> bool:
    """Whether the installed torch is one on which lightning_accum's FSDP2 mechanics are tested exact."""
    return torch_release() >= FSDP2_FLOOR


def require_fsdp2(feature: str, instead: str) -> None:
    """Refuse ``feature``, which needs lightning_accum's FSDP2 mechanics, on a torch older than :data:`FSDP2_FLOOR`.

    Called where the feature is set up (a fit's start, the ``Accumulator``'s construction): before any optimizer
    step, so that no run trains on with inexact gradients or hangs in the middle of a fit.

    Args:
        feature: What the user asked for, as they wrote it (``"ModelParallelAccumulationStrategy"``).
        instead: What they can do on their torch instead.

    Raises:
        RuntimeError: On a torch older than :data:`FSDP2_FLOOR`, naming the feature, the installed torch, the
            release it needs and ``instead``.

    Example::

        >>> require_fsdp2("the noise scale under FSDP2", "set noise_scale=False") if has_fsdp2_mechanics() else None
    """
    if not has_fsdp2_mechanics():
        raise RuntimeError(
            f"{feature} needs torch>={_text(FSDP2_FLOOR)} (lightning_accum's FSDP2 mechanics read FSDP2 state that"
            f" is tested exact from that release on), but torch {torch.__version__} is installed: {instead}, or"
            f" upgrade torch (pip install 'torch>={_text(FSDP2_FLOOR)}')"
        )


@functools.cache
def _fsdp2() -> Any:
    """Torch's FSDP2 module: public from torch 2.6, composable (``torch.distributed._composable.fsdp``) before."""
    try:
        from torch.distributed import fsdp

        if hasattr(fsdp, "FSDPModule"):
            return fsdp
    except ImportError:  # a torch built without distributed support
        return None
    try:
        from torch.distributed._composable import fsdp as composable
    except ImportError:
        return None
    return composable


def fsdp_module_type() -> type | None:
    """The class ``fully_shard`` mixes into the modules it shards (``FSDPModule``), or ``None`` without FSDP2."""
    module = _fsdp2()
    return None if module is None else module.FSDPModule


def fully_shard(module: Any, **kwargs: Any) -> Any:
    """Torch's ``fully_shard`` (``torch.distributed.fsdp``; the composable one on torch 2.4 and 2.5).

    Example::

        fully_shard(model.layers[0], mesh=mesh)
    """
    return _fsdp2().fully_shard(module, **kwargs)


def fsdp2_reduces_unused_params() -> bool:
    """Whether FSDP2 units have ``set_reduce_scatter_unused_params`` (torch 2.13 on).

    It is the second fix the collective guard's error names: a unit that some ranks skip kept inside a unit every
    rank runs, whose parameters without gradients are then reduce-scattered too.
    """
    module = fsdp_module_type()
    return module is not None and hasattr(module, "set_reduce_scatter_unused_params")


def mixed_precision_policy(**kwargs: Any) -> Any:
    """An FSDP2 ``MixedPrecisionPolicy(**kwargs)`` (public from torch 2.6, composable before)."""
    return _fsdp2().MixedPrecisionPolicy(**kwargs)


def tree_flatten_with_path(tree: Any) -> tuple[list[tuple[Any, Any]], Any]:
    """``torch.utils._pytree.tree_flatten_with_path``, also where a node cannot name its children.

    A node type registered without a ``flatten_with_keys_fn`` (transformers 4's ``ModelOutput`` beside torch 2.4)
    makes torch's own function raise; here that node's children are named by their position (``[1]``) and every
    other node keeps its keys (``['attention_mask']``). The tree spec is ``tree_flatten``'s.
    """
    from torch.utils import _pytree as pytree

    try:
        return pytree.tree_flatten_with_path(tree)
    except ValueError:  # "Did not find a flatten_with_keys_fn for type ..."
        leaves, spec = pytree.tree_flatten(tree)
        paths: list[tuple[Any, ...]] = []
        _key_paths(tree, (), paths)
        return list(zip(paths, leaves, strict=True)), spec


def _key_paths(node: Any, path: tuple[Any, ...], paths: list[tuple[Any, ...]]) -> None:
    """Append the key path of every leaf under ``node``, in ``tree_flatten``'s order."""
    from torch.utils import _pytree as pytree

    if pytree._is_leaf(node):
        paths.append(path)
        return
    handler = pytree.SUPPORTED_NODES[pytree._get_node_type(node)]
    if handler.flatten_with_keys_fn is not None:
        keyed, _ = handler.flatten_with_keys_fn(node)
    else:
        children, _ = handler.flatten_fn(node)
        keyed = [(pytree.SequenceKey(index), child) for index, child in enumerate(children)]
    for key, child in keyed:
        _key_paths(child, (*path, key), paths)


@functools.cache
def dtensor_type() -> type | None:
    """Torch's ``DTensor`` class (``torch.distributed.tensor`` from torch 2.5, ``torch.distributed._tensor`` in 2.4)."""
    if not torch.distributed.is_available():
        return None
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        from torch.distributed._tensor import DTensor
    return DTensor
