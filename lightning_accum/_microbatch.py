"""Micro-batching inside a loader batch: ``micro_batch_size=m`` and ``micro_batch_size="auto"``.

Lightning runs ``training_step`` once per loader batch. While a fit runs with splitting, :class:`MicroBatcher`
shadows the module's ``training_step`` with one that slices the loader batch into micro-batches of ``size`` rows
(:func:`lightning_accum.split.split_batch`) and, for each, runs the user's ``training_step``, dispatches the
micro-batch events to the features (each micro-batch is a micro-step for them: its items, its loss, its gradient)
and runs its backward with gradient synchronisation skipped. The factor still counts loader batches.

- ``m``: the last micro-batch goes back to Lightning as the step's loss, so Lightning runs its backward (with the
  window's synchronisation, its GradScaler and its hooks) as for any micro-step. Under ``normalize_by="micro_batch"``
  each micro-batch's loss is weighed by its share of the loader batch's rows, so the step is the step on the whole
  batch; under ``"sample"`` and ``"token"`` the item weighting does it.
- ``"auto"``: every micro-batch's backward runs here, under ``try``; the step's loss handed to Lightning is an anchor,
  ``sum(0 x p)`` over the trainable parameters, whose backward adds exact zeros and so lets DDP all-reduce the
  accumulated gradients where the window ends. After each loader batch, every rank learns (one all-reduce) whether
  any rank ran out of memory; if one did, every rank drops the window in progress, frees what the attempt held,
  halves the micro-batch size (the smallest over ranks) and trains the same loader batch again as the first of a new
  window. The size never grows back: a size that once ran out of memory may do so again on a longer batch, and a
  fixed size keeps a run reproducible.

Lightning glue: it shadows ``training_step`` on the module instance for the fit and removes the shadow after it.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from typing import Any

import torch
from lightning.pytorch.strategies import ParallelStrategy

from lightning_accum.split import batch_rows, is_out_of_memory, split_batch
from lightning_accum.strategies.mixin import AccumulationStrategyMixin
from lightning_accum.sync import skip_gradient_sync

AUTO = "auto"


class MicroBatcher:
    """Split each loader batch into micro-batches, and in ``"auto"`` mode find the size that fits.

    Args:
        size: Rows per micro-batch, or ``None`` to start ``"auto"`` at the loader batch's size.
        auto: Halve the size on an out-of-memory error and retry the loader batch.
        hooks: The coordinator's side of a micro-batch, as callables: ``start(batch)`` (before its forward),
            ``before_backward(loss, divisor)`` (returns the tensor to backpropagate), ``after_backward()``,
            ``restart_window()`` (drop the window in progress and open one at this loader batch) and
            ``any_rank(flag) -> bool``, ``smallest(size) -> int`` (agreement across ranks).

    Example::

        batcher = MicroBatcher(size=4, auto=False, hooks=coordinator_hooks)
        batcher.install(trainer, module)   # at the fit's start
        ...
        batcher.release()                  # at its end
    """

    def __init__(self, size: int | None, auto: bool, hooks: dict[str, Callable[..., Any]]) -> None:
        self.size = size
        self.auto = auto
        self._hooks = hooks
        self._module: Any = None
        self._original: Any = None
        self._trainer: Any = None
        self.changes: list[tuple[int, int]] = []  # (old size, new size), for the summary
        self.share = 1.0  # the share of the loader batch's loss the micro-batch in progress carries
        self.anchored = False  # the loss handed to Lightning is the anchor: its backward is no micro-batch's
        self.report: tuple[torch.Tensor | None, Any] = (None, None)  # the loader batch's mean loss and its items

    def install(self, trainer: Any, module: Any) -> None:
        """Shadow ``module.training_step`` for this fit."""
        self.release()
        self._trainer, self._module, self._original = trainer, module, module.training_step
        module.training_step = self._training_step

    @property
    def installed(self) -> bool:
        """Whether this fit splits (from ``install`` to ``release``)."""
        return self._module is not None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_module=None, _original=None, _trainer=None, report=(None, None))  # one fit's, one process's
        return state

    def release(self) -> None:
        """Give the module its own ``training_step`` back."""
        if self._module is not None and "training_step" in vars(self._module):
            del self._module.training_step
        self._module = self._original = self._trainer = None

    # ------------------------------------------------------------------ one loader batch

    def _training_step(self, batch: Any, *args: Any, **kwargs: Any) -> Any:
        self.anchored = False  # set again when this batch hands Lightning an anchor
        rows = batch_rows(batch)
        if self.size is None:  # "auto" starts at the loader batch's size
            self.size = self._hooks["smallest"](rows or 1)
        if not self.auto:
            return self._split(batch, rows, args, kwargs, anchor=False)
        while True:
            failed = False
            try:
                result = self._split(batch, rows, args, kwargs, anchor=True)
            except BaseException as error:  # noqa: BLE001 (only out-of-memory is handled; anything else re-raised)
                if not is_out_of_memory(error):
                    raise
                failed, result = True, None
                _forget(error)
                del error
            if not self._hooks["any_rank"](failed):
                return result
            self._retry_smaller()

    def _retry_smaller(self) -> None:
        assert self.size is not None
        for param in self._module.parameters():
            param.grad = None
        self.report = (None, None)
        if self.size <= 1:
            raise RuntimeError(
                "micro_batch_size='auto': a micro-batch of one sample does not fit in memory; reduce the model, the"
                " sequence length or the precision"
            )
        old, self.size = self.size, self._hooks["smallest"](max(1, self.size // 2))
        self.changes.append((old, self.size))
        self._hooks["restart_window"]()  # drops what the coordinator held of the failed attempt (its loss too)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _split(self, batch: Any, rows: int | None, args: Any, kwargs: Any, anchor: bool) -> Any:
        assert self.size is not None
        parts = split_batch(batch, self.size) if rows is not None and rows > self.size else [batch]
        weights = [(batch_rows(part) or 1) / (rows or 1) for part in parts]
        report_loss: torch.Tensor | None = None
        report_items: Any = None
        output: Any = None
        for index, (part, weight) in enumerate(zip(parts, weights, strict=True)):
            last = index == len(parts) - 1
            items, share = self._hooks["start"](part, weight)
            output = self._original(part, *args, **kwargs)
            loss = _loss_of(output)
            if loss is None:
                continue  # a skipped micro-batch (training_step returned None)
            detached = loss.detach()
            if items is None:
                report_loss = detached * weight if report_loss is None else report_loss + detached * weight
            else:
                weighted = detached * torch.as_tensor(items, dtype=detached.dtype, device=detached.device)
                report_loss = weighted if report_loss is None else report_loss + weighted
                report_items = items if report_items is None else report_items + items
            if last and not anchor:
                self.report = _mean(report_loss, report_items), report_items
                returned = loss * share  # Lightning divides it by the window's size, then runs its backward
                return _with_loss(output, _shown_as(returned, self.report[0]))
            with self._no_sync():
                tensor = self._hooks["before_backward"](loss, share)
                tensor.backward()
                self._hooks["after_backward"]()
        self.report = _mean(report_loss, report_items), report_items
        if not anchor:
            return output
        # the parameters that received a gradient (one no micro-batch used keeps None, as in plain PyTorch)
        params = [p for p in self._module.parameters() if p.requires_grad and p.grad is not None]
        zero = sum((p * 0).sum() for p in params) if params else torch.zeros((), requires_grad=True)
        self.anchored = True
        return _with_loss(output, _shown_as(zero, self.report[0]))

    @contextlib.contextmanager
    def _no_sync(self) -> Iterator[None]:
        strategy: Any = self._trainer.strategy
        if isinstance(strategy, AccumulationStrategyMixin):
            with skip_gradient_sync(strategy.model, strategy.gradient_sync):  # type: ignore[attr-defined]
                yield
        elif isinstance(strategy, ParallelStrategy):
            with strategy.block_backward_sync():
                yield
        else:
            yield


def _mean(loss: torch.Tensor | None, items: Any) -> torch.Tensor | None:
    """The loader batch's loss: the rows-weighted sum as it is, an items-weighted sum over its items."""
    if loss is None or items is None:
        return loss
    return loss / torch.as_tensor(items, dtype=loss.dtype, device=loss.device).clamp(min=1)


def _shown_as(loss: Any, value: torch.Tensor | None) -> Any:
    """``loss`` with the gradient of ``loss`` and the value ``value``.

    The value is the loader batch's loss, for what Lightning shows of the step's loss (outputs, progress bar).
    """
    if value is None or not isinstance(loss, torch.Tensor):
        return loss
    return loss + (value.to(loss.dtype) - loss.detach())


def _loss_of(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict):
        return output.get("loss")
    return None


def _with_loss(output: Any, loss: Any) -> Any:
    if isinstance(output, dict):
        return {**output, "loss": loss}
    return loss


def _forget(error: BaseException) -> None:
    """Drop the frames an exception holds, so the tensors of the failed attempt can be freed."""
    traceback = error.__traceback__
    while traceback is not None:
        with contextlib.suppress(RuntimeError):  # a frame still executing cannot be cleared
            traceback.tb_frame.clear()
        traceback = traceback.tb_next
    error.__traceback__ = None
