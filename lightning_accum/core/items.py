"""What a micro-batch weighs under sample or token normalization: counting its items from the batch itself.

Pure (torch only). Counts stay tensors on the batch's device, so counting never forces a host synchronisation; the
callback adds them up over the window and reduces the total across ranks once per optimizer step.
"""

from __future__ import annotations

import functools
import math
import numbers
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, cast

import torch

from lightning_accum.core.split import batch_rows

NormalizeBy = Literal["micro_batch", "sample", "token"]
NORMALIZE_BY: tuple[NormalizeBy, ...] = ("micro_batch", "sample", "token")


def check_normalize_by(value: object) -> NormalizeBy:
    """Return ``value`` if it is a known normalization mode.

    Raises:
        ValueError: If ``value`` is not ``"micro_batch"``, ``"sample"`` or ``"token"``.

    Example::

        >>> check_normalize_by("token")
        'token'
    """
    if value not in NORMALIZE_BY:
        raise ValueError(f"`normalize_by` must be one of {list(NORMALIZE_BY)}, got {value!r}")
    return cast(NormalizeBy, value)


def count_samples(batch: Any) -> int:
    """The length of the first tensor found in ``batch`` (a tensor, or mappings and sequences of them).

    Raises:
        ValueError: If the batch holds no tensor with a first dimension.

    Example::

        >>> count_samples({"input_ids": torch.zeros(3, 7), "labels": torch.zeros(3, 7)})
        3
    """
    tensor = _first_tensor(batch)
    if tensor is not None:
        return int(tensor.shape[0])
    rows = batch_rows(batch)  # a batch type taught to the splitter, a dataclass
    if rows is None:
        raise ValueError(
            f"normalize_by='sample' could not find a tensor with a batch dimension in a batch of type"
            f" {type(batch).__name__}: pass `count_items`"
        )
    return rows


def count_tokens(
    batch: Any, key: str | int = "labels", ignore_index: int = -100, shift: bool = False, purpose: str = "token"
) -> torch.Tensor:
    """The loss-bearing tokens of a batch: entries of ``batch[key]`` that are not ``ignore_index``.

    Args:
        batch: A mapping (``key`` is a name) or a sequence (``key`` is a position), as the dataloader yields it.
        key: Where the labels are.
        ignore_index: The label value that bears no loss (``cross_entropy``'s default is -100).
        shift: The model shifts the labels inside (a causal LM predicts token t + 1 at t): each sequence's first
            label bears no loss, so only ``labels[..., 1:]`` are counted; a batch's ``shift_labels``, which such a
            model takes as given, are counted instead.
        purpose: What counts: ``"token"`` (``normalize_by="token"``) or ``"schedule"`` (``unit="token"``), for the
            message of a batch without labels.

    Raises:
        KeyError: If ``batch`` has no entry ``key``.
        TypeError: If the entry is not a tensor.

    Example::

        >>> count_tokens({"labels": torch.tensor([[5, 6, -100], [7, -100, -100]])})
        tensor(3)
    """
    argument = "unit='token'" if purpose == "schedule" else "normalize_by='token'"
    try:
        labels = batch[key]
    except (KeyError, IndexError, TypeError) as error:
        kind = type(batch).__name__
        own_count = (
            "pass `count_items` (it counts the schedule's tokens, unless normalize_by='sample' makes it count samples)"
            if purpose == "schedule"
            else "pass `count_items`"
        )
        raise KeyError(
            f"{argument} reads the labels at `token_key={key!r}`, but the batch ({kind}) has no such entry: set"
            f" `token_key` to the labels' key or position, or, to count tokens another way, {own_count}"
        ) from error
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"{argument} expects a tensor at `token_key={key!r}`, got {type(labels).__name__}")
    if shift and isinstance(batch, Mapping) and isinstance(batch.get("shift_labels"), torch.Tensor):
        return (batch["shift_labels"] != ignore_index).sum()  # shifted already: the model takes them as given
    return ((labels[..., 1:] if shift else labels) != ignore_index).sum()


def make_counter(
    normalize_by: NormalizeBy,
    token_key: str | int = "labels",
    ignore_index: int = -100,
    count_items: Callable[[Any], Any] | None = None,
    shift: bool = False,
    purpose: str = "token",
) -> Callable[[Any], torch.Tensor | int] | None:
    """The function that weighs a micro-batch under ``normalize_by`` (``None`` for ``"micro_batch"``).

    ``purpose``: see :func:`count_tokens`.
    """
    if normalize_by == "micro_batch":
        return None
    if count_items is not None:
        return count_items
    if normalize_by == "sample":
        return count_samples
    # a partial, not a closure: picklable
    return functools.partial(count_tokens, key=token_key, ignore_index=ignore_index, shift=shift, purpose=purpose)


def token_head(module: Any) -> tuple[str, bool] | None:
    """The Hugging Face model in ``module`` whose loss is a mean over tokens: ``(its class, whether it shifts labels)``.

    A transformers model declares its task by its head's class, registered in transformers' auto mappings: a causal
    LM (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``: Llama, GPT-2, ...) shifts its labels inside, so one label per sequence
    bears no loss; a sequence-to-sequence or masked LM (T5, BART, BERT, ...) averages over its labels as given, and so
    do the few causal-LM heads that never shift (``_AS_GIVEN``: XLM, XLNet, ProphetNet). Only models with trainable
    parameters count (a frozen teacher's loss is not the one trained on). ``None`` when transformers is not imported,
    no such model is in ``module``, or trainable ones disagree.

    Example::

        >>> token_head(torch.nn.Linear(2, 2)) is None
        True
    """
    if "transformers" not in sys.modules:  # nothing to recognise; never imported here
        return None
    from transformers.models.auto import modeling_auto

    causal = _class_names(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    as_given = (
        _class_names(modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)
        | _class_names(modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES)
        | _AS_GIVEN
    )
    found: dict[str, bool] = {}
    for submodule in module.modules():
        kind = next(
            (
                k
                for k in type(submodule).__mro__
                if k.__module__.startswith("transformers.") and k.__name__ in causal | as_given
            ),
            None,
        )
        if kind is not None and any(p.requires_grad for p in submodule.parameters()):
            found[type(submodule).__name__] = kind.__name__ not in as_given
    if len(set(found.values())) != 1:  # none, or heads that count differently
        return None
    name = next(iter(found))
    return name, found[name]


def token_counter(
    module: Any, token_key: str | int, ignore_index: int, purpose: str = "token", shift: bool | None = None
) -> tuple[Callable[[Any], Any], str | None]:
    """The token counter for ``module``'s loss, and the summary phrase that says how it counts (``None``: as given).

    ``purpose``: see :func:`count_tokens`. ``shift``: whether the loss is on ``labels[..., 1:]``; ``None``: as the
    Hugging Face head in ``module`` weighs them (as given without one).

    Example::

        >>> counter, phrase = token_counter(torch.nn.Linear(2, 2), "labels", -100)
        >>> counter({"labels": torch.tensor([[1, 2, -100]])}), phrase
        (tensor(2), None)
    """
    if shift is not None:  # the user said
        counter = make_counter("token", token_key, ignore_index, shift=shift, purpose=purpose)
        assert counter is not None
        return counter, f"tokens counted as {token_key}[..., 1:] != {ignore_index} (shifted labels)" if shift else None
    head = token_head(module)
    shifts = head is not None and head[1]
    counter = make_counter("token", token_key, ignore_index, shift=shifts, purpose=purpose)
    assert counter is not None
    if head is None:
        return counter, None
    labels = f"{token_key}[..., 1:]" if shifts else str(token_key)
    return counter, f"tokens counted as {head[0]} weighs them ({labels} != {ignore_index})"


def label_warning(
    module: Any, batch: Any, token_key: str | int, ignore_index: int, purpose: str, owner: str = "AccumulationScheduler"
) -> str | None:
    """What a run's first batch says the token count may miss, as a warning (``None``: nothing).

    - labels that equal ``input_ids`` wherever they bear loss, with no Hugging Face causal LM in ``module`` to say
      that they are shifted inside (the count takes them as given: one token per sequence too many if a model of
      the user's own shifts them);
    - labels that are ``input_ids`` shifted by one already, beside a Hugging Face causal LM that shifts them again
      (the count follows the head: one token per sequence too few if ``training_step`` computes the loss on them
      itself, without the second shift).

    ``purpose``: ``"token"`` or ``"schedule"``, as in :func:`count_tokens`; ``owner``: what the user set up, for the
    message.
    """
    head = token_head(module)
    argument = "unit='token'" if purpose == "schedule" else "normalize_by='token'"
    with_weighting = " (with normalize_by='token')" if purpose == "schedule" else ""
    if head is None and labels_repeat_inputs(batch, token_key, ignore_index):
        return (
            f"{owner}({argument}): the labels equal `input_ids` wherever they bear loss, as for a causal"
            " LM that shifts them inside, but no Hugging Face causal LM was found in the module: if the model"
            " predicts token t + 1 at t, each sequence's first label bears no loss and the count is off by one per"
            f" sequence. Pass count_items=lambda batch: (batch[{token_key!r}][..., 1:] != {ignore_index}).sum()"
            f"{with_weighting} to count what such a model weighs"
        )
    if head is not None and head[1] and labels_shifted_already(batch, token_key, ignore_index):
        return (
            f"{owner}({argument}): the labels are `input_ids` shifted by one already (labels[t] =="
            f" input_ids[t + 1] wherever they bear loss), and {head[0]} shifts its labels again inside: tokens are"
            f" counted as that model weighs them ({token_key}[..., 1:] != {ignore_index}). If training_step computes"
            " the loss on these labels itself, without a second shift, each sequence's first label bears loss too and"
            f" the count is one token per sequence short: pass count_items=lambda batch: (batch[{token_key!r}] !="
            f" {ignore_index}).sum(){with_weighting}. If it hands them to the model, the model learns to predict two"
            " tokens ahead: pass the unshifted labels"
        )
    return None


def labels_shifted_already(batch: Any, key: str | int, ignore_index: int) -> bool:
    """Whether ``batch[key][..., t]`` equals ``batch["input_ids"][..., t + 1]`` wherever it bears loss (and ever does).

    Example::

        >>> ids = torch.tensor([[5, 6, 7]])
        >>> labels_shifted_already({"input_ids": ids, "labels": torch.tensor([[6, 7, -100]])}, "labels", -100)
        True
    """
    if not isinstance(batch, Mapping):
        return False
    labels, inputs = batch.get(key), batch.get("input_ids")
    if not isinstance(labels, torch.Tensor) or not isinstance(inputs, torch.Tensor) or labels.shape != inputs.shape:
        return False
    head, following = labels[..., :-1], inputs[..., 1:]
    bearing = head != ignore_index
    if not bool(bearing.any()) or not torch.equal(head[bearing], following[bearing]):
        return False
    return not labels_repeat_inputs(batch, key, ignore_index)  # a run of one token reads both ways: say nothing


def labels_repeat_inputs(batch: Any, key: str | int, ignore_index: int) -> bool:
    """Whether ``batch[key]`` equals ``batch["input_ids"]`` wherever it bears loss: labels a causal LM shifts inside.

    Example::

        >>> ids = torch.tensor([[5, 6, 7]])
        >>> labels_repeat_inputs({"input_ids": ids, "labels": torch.tensor([[5, 6, -100]])}, "labels", -100)
        True
    """
    if not isinstance(batch, Mapping):
        return False
    labels, inputs = batch.get(key), batch.get("input_ids")
    if not isinstance(labels, torch.Tensor) or not isinstance(inputs, torch.Tensor) or labels.shape != inputs.shape:
        return False
    bearing = labels != ignore_index
    return bool(bearing.any()) and torch.equal(labels[bearing], inputs[bearing])


# causal-LM heads (in transformers' causal registry) whose loss takes the labels as given (read in transformers 5.24)
_AS_GIVEN = {"XLMWithLMHeadModel", "XLNetLMHeadModel", "ProphetNetForCausalLM"}


def _class_names(mapping: Mapping[str, Any]) -> set[str]:
    return {name for value in mapping.values() for name in ([value] if isinstance(value, str) else value)}


def check_count(value: Any, batch_idx: int, source: str = "count_items") -> torch.Tensor | float:
    """Check what a counter returned for one micro-batch: one real number, and, if it is on the host, finite and >= 0.

    A tensor's value is not read here (that would wait for the device each micro-batch): :func:`invalid_counts`
    checks it with the window's other counts, once per optimizer step.

    Args:
        value: The count: a Python or NumPy number, or a one-element tensor.
        batch_idx: The micro-batch's index in its epoch, for the message.
        source: What produced the count (``count_items``, or the rule of ``normalize_by``), for the message.

    Raises:
        TypeError: If ``value`` is not a real number or a one-element real tensor.
        ValueError: If a host number is negative, NaN or infinite, or a tensor has more than one element.

    Example::

        >>> check_count(3, batch_idx=0)
        3.0
        >>> check_count(-1, batch_idx=4)
        Traceback (most recent call last):
        ...
        ValueError: `count_items` returned -1 for batch 4: a micro-batch's count must be a finite number >= 0
    """
    hint = "a micro-batch's count must be a finite number >= 0"
    if type(value) is int and 0 <= value < 1 << 53:  # the usual count (samples): no abstract base class checks
        return float(value)
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"`{source}` returned a tensor of shape {tuple(value.shape)} for batch {batch_idx}: return one number"
                " per micro-batch (a Python number or a one-element tensor)"
            )
        if value.dtype == torch.bool or value.is_complex():
            raise TypeError(f"`{source}` returned a {value.dtype} tensor for batch {batch_idx}: {hint}")
        if value.is_floating_point() and torch.finfo(value.dtype).bits < 32:
            value = value.float()  # a window's total of half-precision counts would round
        return value.reshape(())
    if not isinstance(value, (bool, numbers.Number)) and getattr(value, "size", None) == 1 and hasattr(value, "item"):
        value = value.item()  # a one-element NumPy array
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"`{source}` returned {value!r} ({type(value).__name__}) for batch {batch_idx}: {hint}"
            " (an int, a float or a one-element tensor)"
        )
    try:
        number = float(value)
    except OverflowError:  # an int beyond any float
        number = math.inf
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"`{source}` returned {value!r} for batch {batch_idx}: {hint}")
    return number


def invalid_counts(counts: Sequence[tuple[int, torch.Tensor | float]]) -> list[tuple[int, float]]:
    """The ``(batch_idx, value)`` of each count that is negative, NaN or infinite (reads tensors: once per window).

    Example::

        >>> invalid_counts([(0, torch.tensor(2.0)), (1, torch.tensor(float("nan")))])
        [(1, nan)]
    """
    values = [(batch_idx, float(count)) for batch_idx, count in counts]
    return [(batch_idx, value) for batch_idx, value in values if not math.isfinite(value) or value < 0]


def _first_tensor(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch if batch.dim() > 0 else None
    values: Sequence[Any] | None = None
    kind = type(batch)
    if kind is tuple or kind is list:  # the usual batches, without the abstract base classes' checks
        values = batch
    elif kind is dict or isinstance(batch, Mapping):
        values = list(batch.values())
    elif isinstance(batch, Sequence) and not isinstance(batch, str):
        values = batch
    for value in values or ():
        # the usual batch's first entry is a tensor: taken without a recursive call
        found = value if type(value) is torch.Tensor and value.dim() > 0 else _first_tensor(value)
        if found is not None:
            return found
    return None
