"""Token count (``unit="token"``): the loss-bearing tokens consumed by all ranks, the position of a token schedule.

Counts each micro-batch's tokens as ``normalize_by="token"`` does (labels at ``token_key`` that are not
``ignore_index``), or with ``count_items`` unless that counts samples (``normalize_by="sample"``), adds them up over the
window on the device,
and sums the window over ranks once per optimizer step (one scalar all-reduce), so every rank holds the same count and
opens the same windows. The count is checkpointed.

Publishes ``ctx.tokens_seen`` (``FIT_START`` and ``WINDOW_CLOSED``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_accum.core.events import Context, Feature, takes_dataloader_iter
from lightning_accum.core.items import check_count, label_warning, make_counter, token_counter


class TokenCount(Feature):
    """Count the loss-bearing tokens consumed, over all ranks.

    Args:
        token_key: Where the labels are: a mapping key or a tuple position.
        ignore_index: The label value that bears no loss.
        count_items: ``batch -> int or tensor`` counting a micro-batch's tokens instead (under
            ``normalize_by="token"`` the schedule so counts what the weighting counts); under ``normalize_by="sample"``
            it counts samples, and the tokens are read from the labels.
        normalize_by: The run's item weighting. Under ``"token"`` the weighting warns of labels its count may
            misread (:func:`~lightning_accum.core.items.label_warning`), so this feature does not warn again.
        shift_labels: Without ``count_items``: count ``labels[..., 1:]`` (a causal LM's loss on shifted labels),
            instead of as a Hugging Face head in the module weighs them.

    Example::

        >>> from lightning_accum.core.events import Event, Features
        >>> features, ctx = Features([TokenCount()]), Context()
        >>> features.dispatch(Event.WINDOW_OPENED, ctx)
        >>> for labels in ([[1, 2, -100]], [[-100, 3, 4]]):
        ...     ctx.batch = {"labels": torch.tensor(labels)}
        ...     features.dispatch(Event.MICRO_BATCH_STARTED, ctx)
        >>> features.dispatch(Event.WINDOW_CLOSING, ctx); features.dispatch(Event.WINDOW_CLOSED, ctx)
        >>> ctx.tokens_seen
        4
    """

    name = "token_count"

    def __init__(
        self,
        token_key: str | int = "labels",
        ignore_index: int = -100,
        count_items: Callable[[Any], Any] | None = None,
        normalize_by: str = "micro_batch",
        shift_labels: bool = False,
    ) -> None:
        count_items = None if normalize_by == "sample" else count_items  # there it counts samples
        self._warns = normalize_by != "token"
        counter = make_counter("token", token_key, ignore_index, count_items, purpose="schedule")
        assert counter is not None
        self._count = counter
        self._source = "count_items" if count_items is not None else "unit='token'"
        self._rule = None if count_items is not None else (token_key, ignore_index)  # counted as the model weighs
        self._shift = bool(shift_labels)
        self.tokens_seen = 0
        self._window: Any = 0  # this rank's tokens in the window so far (a tensor once counted)
        self._window_total = 0
        self._check_labels = False  # whether the fit's first micro-batch is yet to be checked for shifted labels

    @override
    def reset(self) -> None:
        self.tokens_seen = 0

    @override
    def setup(self, ctx: Context) -> None:
        if takes_dataloader_iter(ctx.module):
            raise ValueError(
                "unit='token' counts each micro-batch's tokens, but `training_step(self, dataloader_iter)` hides the"
                " batch from callbacks: use `training_step(self, batch, batch_idx)`, or another unit"
            )

    @override
    def fit_start(self, ctx: Context) -> None:
        ctx.tokens_seen = self.tokens_seen
        if self._rule is not None:  # a Hugging Face model in the module: its loss-bearing tokens
            shift = True if self._shift else None
            self._count, phrase = token_counter(ctx.module, *self._rule, purpose="schedule", shift=shift)
            if phrase is not None and phrase not in ctx.summary:
                ctx.summary.append(phrase)
            self._check_labels = self._warns and not self._shift

    @override
    def window_opened(self, ctx: Context) -> None:
        self._window = 0

    @override
    def micro_batch_started(self, ctx: Context) -> None:
        if self._check_labels and self._rule is not None:  # the fit's first micro-batch
            self._check_labels = False
            warning = label_warning(ctx.module, ctx.batch, *self._rule, purpose="schedule", owner=ctx.run.owner)
            if warning is not None:
                rank_zero_warn(warning)
        self._window = self._window + check_count(self._count(ctx.batch), ctx.batch_idx, self._source)

    @override
    def window_closing(self, ctx: Context) -> None:
        local = self._window
        device = local.device if isinstance(local, torch.Tensor) else _device(ctx)
        dtype = torch.float32 if device.type == "mps" else torch.float64
        self._window_total = round(float(ctx.reduce(torch.as_tensor(local, dtype=dtype, device=device), "sum")))

    @override
    def window_closed(self, ctx: Context) -> None:
        self.tokens_seen += self._window_total
        self._window_total = 0
        ctx.tokens_seen = self.tokens_seen
        ctx.metrics["accum/tokens_seen"] = float(self.tokens_seen)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"tokens_seen": self.tokens_seen}

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tokens_seen = int(state.get("tokens_seen", 0))


def _device(ctx: Context) -> torch.device:
    parameter = next(iter(ctx.module.parameters()), None) if ctx.module is not None else None
    return parameter.device if parameter is not None else torch.device("cpu")
