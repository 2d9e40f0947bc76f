"""Item weighting (``normalize_by="sample"|"token"``): each micro-batch weighs its samples or loss-bearing tokens.

Lightning divides each micro-batch's mean loss by the window's size, so every micro-batch weighs the same. Here the
loss is re-weighed in place before its backward by ``items / typical_items`` (a constant common to all ranks keeps the
weighted losses near Lightning's), and at the window's end the accumulated gradient is scaled by the ratio of the
typical window's items to the window's items on all ranks (one scalar all-reduce per optimizer step), so the step is
that of the mean loss over every sample or token of the window. A window whose micro-batches all hold the typical
count needs no scaling: the gradient is left as backward wrote it. Counting is in :mod:`lightning_accum.core.items`.

Counts the device holds (tokens, a ``count_items`` tensor, any count on several ranks) stay there: the window's total
and the gradient's scale are 0-d tensors, and the host waits for them only where it reads them anyway, on the fit's
first :data:`CHECKED_WINDOWS` windows and on every logged step, which is also where a count is checked (negative,
NaN or infinite; a window without items). Host counts on one process (samples) are checked on every window.

Under FSDP2 with wide accumulation (``ctx.scale_in_backward``) the window's gradient is reduced and rounded inside its
last backward, so the window's counts are reduced, and its scale set, at that backward's ``BEFORE_BACKWARD``: every
count of the window is known there.

Publishes ``ctx.items`` (``MICRO_BATCH_STARTED``), ``ctx.loss_divisor`` (``BEFORE_BACKWARD``), ``ctx.window_items``
and ``ctx.gradient_scale`` (``WINDOW_CLOSING``; also at the window's last ``BEFORE_BACKWARD`` under
``ctx.scale_in_backward``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_accum.core.events import Context, Feature, takes_dataloader_iter
from lightning_accum.core.items import (
    check_count,
    check_normalize_by,
    invalid_counts,
    label_warning,
    make_counter,
    token_counter,
)
from lightning_accum.core.schedule import check_int

CHECKED_WINDOWS = 3
"""Windows of each fit whose device counts are read and checked before the step, besides the logged steps'."""


class ItemWeighting(Feature):
    """Weigh each micro-batch by its items, over the window and all ranks.

    Args:
        normalize_by: ``"sample"`` or ``"token"`` (``"micro_batch"`` is accepted and weighs nothing: the callback
            then leaves this feature out).
        token_key: Where ``"token"`` finds the labels: a mapping key or a tuple position.
        ignore_index: The label value that bears no loss.
        count_items: ``batch -> int or tensor``, replacing the two rules above.
        shift_labels: Under ``"token"`` without ``count_items``: count ``labels[..., 1:]`` (a causal LM's loss on
            shifted labels), instead of as a Hugging Face head in the module weighs them.

    Raises:
        TypeError: If ``token_key``, ``ignore_index`` or ``count_items`` has the wrong type.
        ValueError: If ``normalize_by`` is unknown.

    Example::

        >>> import torch
        >>> from lightning_accum.core.events import Context, Event, Features
        >>> from lightning_accum.core.window import Window
        >>> features, ctx = Features([ItemWeighting("sample")]), Context(window=Window(size=2, taken=0, closed=False))
        >>> for rows in (3, 1):  # two micro-batches of 3 and 1 samples
        ...     ctx.batch, ctx.loss = torch.zeros(rows, 2), torch.ones(())
        ...     features.dispatch(Event.MICRO_BATCH_STARTED, ctx)
        ...     features.dispatch(Event.BEFORE_BACKWARD, ctx)
        >>> features.dispatch(Event.WINDOW_CLOSING, ctx); ctx.window_items, ctx.gradient_scale  # typical: 2 x 3
        (4.0, 1.5)
    """

    name = "item_weighting"

    def __init__(
        self,
        normalize_by: str = "sample",
        token_key: str | int = "labels",
        ignore_index: int = -100,
        count_items: Callable[[Any], Any] | None = None,
        shift_labels: bool = False,
    ) -> None:
        self.normalize_by = check_normalize_by(normalize_by)
        if not isinstance(token_key, (str, int)) or isinstance(token_key, bool):
            raise TypeError(f"`token_key` must be a str (a mapping key) or an int (a position), got {token_key!r}")
        check_int("ignore_index", ignore_index, minimum=-(2**63))
        if count_items is not None and not callable(count_items):
            raise TypeError(f"`count_items` must be a callable `batch -> int`, got {count_items!r}")
        self._count = make_counter(self.normalize_by, token_key, ignore_index, count_items)
        self._rule = (token_key, ignore_index) if self.normalize_by == "token" and count_items is None else None
        self._shift = bool(shift_labels)
        self._check_labels = False  # whether the fit's first batch is yet to be checked for labels a model shifts
        self._per_micro_batch: float | None = None  # the same on every rank: the scale the losses are put on
        self._window_items: Any = 0  # this rank's items in the window so far (a tensor once counted)
        self._backwards = 0  # this rank's micro-steps in the window that ran a backward
        self._custom = count_items is not None  # the built-in counters cannot return a bad count
        # the tensor counts from `count_items` not yet checked, as (step, batch_idx, count): the window's, and those of
        # earlier windows kept on the device until the next logged step
        self._counts: list[tuple[int, int, torch.Tensor]] = []
        self._invalid: torch.Tensor | None = None  # how many of them are negative, NaN or infinite (on the device)
        self._carried = False  # whether the counts of a window not read are carried to the next check
        self._device = torch.device("cpu")
        self._early: tuple[Any, Any] | None = None  # (window's items, scale) taken at its last backward (FSDP2)
        self._checks_left = CHECKED_WINDOWS  # windows of this fit whose device counts are still to be read

    @override
    def setup(self, ctx: Context) -> None:
        if takes_dataloader_iter(ctx.module):
            raise ValueError(
                f"normalize_by={self.normalize_by!r} counts each micro-batch's items before its backward, but"
                " `training_step(self, dataloader_iter)` hides the batch from callbacks: use `training_step(self,"
                " batch, batch_idx)` or normalize_by='micro_batch'"
            )
        self._per_micro_batch = None  # once per fit, from its first micro-batch
        self._checks_left = CHECKED_WINDOWS

    @override
    def fit_start(self, ctx: Context) -> None:
        if self._rule is None:
            return
        # the labels shifted as the user said, or as a Hugging Face model weighs them
        self._count, phrase = token_counter(ctx.module, *self._rule, shift=True if self._shift else None)
        if phrase is not None and phrase not in ctx.summary:
            ctx.summary.append(phrase)
        self._check_labels = not self._shift

    @override
    def window_opened(self, ctx: Context) -> None:
        self._early = None
        self._window_items = 0
        self._backwards = 0
        if not self._carried:
            self._counts, self._invalid = [], None
        self._carried = False

    @override
    def micro_batch_started(self, ctx: Context) -> None:
        assert self._count is not None, "the callback leaves normalize_by='micro_batch' out"
        if self._check_labels and self._rule is not None:  # the fit's first micro-batch
            self._check_labels = False
            warning = label_warning(ctx.module, ctx.batch, *self._rule, purpose="token", owner=ctx.run.owner)
            if warning is not None:
                rank_zero_warn(warning)
        items = check_count(self._count(ctx.batch), ctx.batch_idx)
        if self._custom and isinstance(items, torch.Tensor):
            # a tensor's value is checked with the window's other counts at its end, without waiting for the device
            bad = (~torch.isfinite(items) | (items < 0)).to(torch.float32)
            self._invalid = bad if self._invalid is None else self._invalid + bad
            self._counts.append((ctx.optimizer_steps + 1, ctx.batch_idx, items))
        ctx.items = items

    @override
    def before_backward(self, ctx: Context) -> None:
        loss, items = ctx.loss, ctx.items
        assert loss is not None
        if self._per_micro_batch is None:
            first = torch.as_tensor(items, dtype=torch.float32, device=loss.device)
            self._per_micro_batch = max(float(ctx.reduce(first, "mean")), 1.0)
        # Lightning divided the loss by the window's size; weigh it by items / (typical items), in place: the tensor
        # handed to this hook is the fresh quotient that backward runs on. A window of typical micro-batches then
        # needs no correction at its end.
        divided = ctx.window.size * self._per_micro_batch
        if ctx.weights_in_float32:  # the weight goes in with the gradient, in float32, never on the narrow loss
            ctx.micro_weight = ctx.micro_weight * (items / self._per_micro_batch)
        elif isinstance(items, torch.Tensor):  # counted on the device: stay there
            loss.mul_(items.to(loss.dtype) / self._per_micro_batch)
            # a micro-batch without items has a zero gradient: any positive divisor serves
            ctx.loss_divisor = divided / items.float().clamp(min=1.0)
        else:  # a host number: no copy to the device, and no multiplication by one (a typical micro-batch)
            weight = items / self._per_micro_batch
            if weight != 1.0:
                loss.mul_(weight)
            ctx.loss_divisor = divided / max(items, 1.0)
        self._window_items = self._window_items + items
        if not self._backwards:  # the window's first: where its counts are reduced
            self._device = loss.device
        self._backwards += 1
        if ctx.last_backward and ctx.scale_in_backward:  # FSDP2 rounds the gradient in this backward: scale now
            self._scale(ctx)
            self._early = ctx.window_items, ctx.gradient_scale

    @override
    def window_closing(self, ctx: Context) -> None:
        if self._early is not None:  # the window's last backward took the scale already
            (ctx.window_items, ctx.gradient_scale), self._early = self._early, None
            return
        self._scale(ctx)

    def _scale(self, ctx: Context) -> None:
        """Set ``ctx.window_items`` and ``ctx.gradient_scale`` from the window's counts on every rank."""
        if self._per_micro_batch is None:  # no backward yet in this fit (training_step returned None)
            return
        # the gradient holds the rank average of sum(items_i * grad_i) / (size * typical items): exactly the mean
        # over the window's items, with nothing to scale, when every micro-batch has the typical count
        typical = ctx.world_size * ctx.window.size * self._per_micro_batch
        if ctx.world_size == 1 and self._invalid is None and not isinstance(self._window_items, torch.Tensor):
            total = float(self._window_items)  # host numbers: nothing to wait for
            self._check(ctx, total, 0.0, float(self._backwards))
        else:
            counts = self._reduce_counts(ctx)
            step = ctx.optimizer_steps + 1  # the step this window ends in
            if self._checks_left <= 0 and not (ctx.log_every > 0 and step % ctx.log_every == 0):
                # kept on the device: a window without items (gradient zero) steps on a zero gradient; its counts are
                # checked at the next logged step
                self._carried = ctx.log_every > 0
                total_on_device = counts[0]
                ctx.window_items = total_on_device
                scale = typical / total_on_device
                ctx.gradient_scale = torch.where(total_on_device > 0, scale, torch.zeros_like(scale))
                return
            self._checks_left -= 1
            total, ranks_with_bad_counts, backwards = counts.tolist()
            self._check(ctx, total, ranks_with_bad_counts, backwards)
        ctx.window_items = total
        ctx.gradient_scale = typical / total if total > 0 else 0.0

    def _check(self, ctx: Context, total: float, ranks_with_bad_counts: float, backwards: float) -> None:
        """Raise on every rank, before the step, if a count was bad or the window held no item on any rank."""
        if ranks_with_bad_counts:
            self._raise_bad_count(ctx, int(ranks_with_bad_counts))
        if backwards and total <= 0:
            first = ctx.batch_idx - ctx.window.taken + 1
            raise ValueError(
                f"{'`count_items` counted' if self._custom else 'Counted'} 0 {self.normalize_by}s in the window of"
                f" batches {first}-{ctx.batch_idx}"
                f" (normalize_by={self.normalize_by!r}, on every rank): the window's mean loss is undefined. Check"
                " `count_items`, `token_key` and `ignore_index`, or drop batches without a loss-bearing item"
            )

    def _reduce_counts(self, ctx: Context) -> torch.Tensor:
        """The window's items, ranks with a bad count, and backwards, summed over the ranks: one collective."""
        dtype = torch.float32 if self._device.type == "mps" else torch.float64
        local = torch.stack(
            [
                torch.as_tensor(self._window_items, dtype=dtype, device=self._device).reshape(()),
                torch.as_tensor(0.0 if self._invalid is None else self._invalid, device=self._device)
                .clamp(max=1.0)
                .to(dtype),
                torch.tensor(float(self._backwards), dtype=dtype, device=self._device),
            ]
        )
        return ctx.reduce(local, "sum")  # the one collective this adds per step

    def _raise_bad_count(self, ctx: Context, ranks: int) -> None:
        """Every rank raises before the step: the rank with the bad count names it, the others say where it is."""
        mine = invalid_counts([(index, count) for index, (_, _, count) in enumerate(self._counts)])
        step = ctx.optimizer_steps + 1
        if mine:
            index, value = mine[0]
            found, batch_idx, _ = self._counts[index]
            late = ""
            if found < step:  # a window whose counts stayed on the device (docs/normalization.md)
                late = (
                    f", in the window of optimizer step {found}, read at the check of step {step} (device counts are"
                    f" read on a fit's first {CHECKED_WINDOWS} windows and on logged steps): the steps in between were"
                    " taken with it"
                )
            raise ValueError(
                f"`count_items` returned {value} for batch {batch_idx}{late}: a micro-batch's count must be a finite"
                f" number >= 0 (optimizer step {step} was not taken)"
            )
        raise ValueError(
            f"`count_items` returned a negative, NaN or infinite count on {ranks} other rank(s) up to the window ending"
            f" at batch {ctx.batch_idx}: see that rank's error (the optimizer step was not taken)"
        )

    @override
    def state_dict(self) -> dict[str, Any]:
        # the scale the losses are put on: a resumed run keeps it, so its weighted losses round as before
        return {} if self._per_micro_batch is None else {"per_micro_batch": self._per_micro_batch}

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("per_micro_batch") is not None:
            self._per_micro_batch = float(state["per_micro_batch"])

    @override
    def window_closed(self, ctx: Context) -> None:
        # a tensor is read only if the step is logged
        ctx.metrics[f"accum/window_{self.normalize_by}s"] = ctx.window_items if ctx.window_items is not None else 0.0
