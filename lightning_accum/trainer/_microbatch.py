"""Micro-batching inside a loader batch: ``micro_batch_size=m``, ``micro_batch_size="auto"``, the noise scale's halves.

Lightning runs ``training_step`` once per loader batch. While a fit runs with splitting, :class:`MicroBatcher`
shadows the module's ``training_step`` with one that slices the loader batch into micro-batches of ``size`` rows
(:func:`lightning_accum.core.split.split_batch`) and, for each, tells its :class:`Owner` (the coordinator) that a
micro-batch starts, runs the user's ``training_step`` and backpropagates its loss through Lightning's own
``strategy.backward`` (the AMP loss scale, the ``on_before_backward`` / ``on_after_backward`` hooks of every callback
and of the module, as for any backward) with gradient synchronisation skipped. Each micro-batch is a micro-step for
the features; the factor still counts loader batches. Each loss is divided as Lightning divides the loss it
backpropagates (by ``trainer.accumulate_grad_batches``, the window's size) and weighed by its share of the loader
batch's rows under ``normalize_by="micro_batch"`` (so the step is the step on the whole batch); under ``"sample"``
and ``"token"`` the item weighting does it.

- ``m``: the last micro-batch goes back to Lightning as the step's loss, so Lightning runs its backward (with the
  window's synchronisation) as for any micro-step.
- ``"auto"``: every micro-batch's backward runs here, under ``try``; the step's loss handed to Lightning is an anchor,
  ``sum(0 x p)`` over the trainable parameters, whose backward adds exact zeros and so lets DDP all-reduce the
  accumulated gradients where the window ends (it is no micro-batch: :attr:`MicroBatcher.anchored`). After each
  loader batch, every rank learns (one all-reduce) whether any rank ran out of memory; if one did, every rank drops the
  window in progress, frees what the attempt held, halves the micro-batch size (the smallest over ranks) and trains
  the same loader batch again as the first of a new window. The size never grows back: a size that once ran out of
  memory may do so again on a longer batch, and a fixed size keeps a run reproducible. The size found belongs to its
  run: a fit resumed from a checkpoint takes the checkpoint's, a fit that continues (global step above 0) keeps it,
  and a new run (global step 0, no checkpoint) searches again from the loader batch's size.
- the noise scale's halves (``adaptive=True`` at factor 1 on one process): installed with no ``size``, it hands each
  loader batch on whole, except in a window the noise scale measures, whose loader batch it splits in ``parts()``
  (two) as ``m`` does. A window it hands on whole is zeroed by Lightning as always; one it splits, through the same
  public hooks, by the micro-batcher (:attr:`MicroBatcher.zeroes`).

- a coupled loss (the step calls :func:`lightning_accum.cached`): the loader batch is the batch the loss couples, so
  it is never split; :meth:`MicroBatcher.listen` hears each ``cached`` call and lends it ``size`` as the chunk size. A
  call inside the first part of a split batch (the fit's first call) stops that part before any forward, and before
  it began as a micro-batch (a part begins after its ``training_step``); the batch is then trained whole, and so is
  every later one (under ``"auto"`` still through the out-of-memory retries, which halve the chunk size). The
  window's earlier loader batches keep what they trained.

Lightning glue: it shadows ``training_step`` on the module instance for the fit and removes the shadow after it.
"""

from __future__ import annotations

import contextlib
import gc
import math
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_accum.compat.lightning import trainer_names
from lightning_accum.core.events import Context
from lightning_accum.core.monitor import split_summary
from lightning_accum.core.split import batch_rows, is_out_of_memory, split_batch, split_problem
from lightning_accum.core.window import Window
from lightning_accum.distributed.coupled import add_listener
from lightning_accum.distributed.sync import skip_gradient_sync
from lightning_accum.strategies.mixin import AccumulationStrategyMixin
from lightning_accum.trainer._ranks import any_rank, smallest
from lightning_accum.trainer._run import print_line

AUTO = "auto"


class Owner(Protocol):
    """The coordinator's side of the micro-batches of a split loader batch."""

    def _start_micro_batch(self, batch: Any, share: float = 1.0, last: bool = True) -> tuple[Any, float]:
        """A micro-batch carrying ``share`` of its loader batch's rows begins (``last``: the batch's last part).

        Returns its items (``None`` when every micro-batch weighs the same) and the share of the loader batch's loss
        its loss is weighed by (``1.0`` where item weighting weighs it).
        """

    def _restart_window(self, trainer: Any) -> None:
        """Out of memory: drop the window in progress (and what it holds), open one at this loader batch."""

    def _couple(self) -> None:
        """The step couples its batch's rows (it calls ``cached``): no loader batch is split from now on."""


class MicroBatcher:
    """Split each loader batch into micro-batches, and in ``"auto"`` mode find the size that fits.

    Args:
        size: Rows per micro-batch; ``None``: ``"auto"`` starts at the loader batch's size, otherwise a loader batch is
            split only into the parts the noise scale asks for (``ctx.noise_parts``).
        auto: Halve the size on an out-of-memory error and retry the loader batch.

    Example::

        batcher = MicroBatcher(size=4, auto=False)
        batcher.start(trainer, module, owner=coordinator, ctx=ctx)  # at the fit's start, as ctx.plan says
        ...
        batcher.release()                                           # at its end
    """

    def __init__(self, size: int | None, auto: bool) -> None:
        self.size = size
        self.auto = auto
        self._module: Any = None
        self._original: Any = None
        self._trainer: Any = None
        self._owner: Owner | None = None
        self._window: Window | None = None
        self._parts: Callable[[], int] = _whole
        self.changes: list[tuple[int, int]] = []  # (old size, new size), for the summary
        self.anchored = False  # the backward Lightning runs now is the anchor's: no micro-batch's
        self._inspected = False  # whether this fit's first loader batch was checked (:meth:`inspect`)
        self.coupled: tuple[int, int] | None = None  # the step calls `cached`: (its batch's rows, the chunk size)
        self._in_part = False  # a part of a split loader batch runs the user's training_step
        self._unlisten: Callable[[], None] | None = None
        # the loader batch's mean loss and its items; None for a batch handed on whole
        self._report: tuple[torch.Tensor | None, Any] | None = (None, None)

    def start(self, trainer: Any, module: Any, owner: Owner, ctx: Context) -> None:
        """At the fit's start, as ``ctx.plan`` says: install where loader batches are split, and hear ``cached`` calls.

        Sets ``ctx.can_split`` (a coupled step's batch is never split) and starts ``ctx.summary`` with the split.
        """
        split = ctx.plan.splitting or self.auto
        if split:
            self.install(trainer, module, owner, ctx)
        ctx.can_split = self.listen(ctx.plan.resumed) and ctx.can_split
        ctx.summary = [split_summary(self.size)] if split else []  # the features add their phrases

    def start_halves(self, trainer: Any, module: Any, owner: Owner, ctx: Context) -> None:
        """After ``FIT_START``: install where nothing splits but the noise scale measures one loader batch in halves."""
        if ctx.noise_parts > 1 and not self.installed:
            self.install(trainer, module, owner, ctx)

    def install(self, trainer: Any, module: Any, owner: Owner, ctx: Context) -> None:
        """Shadow ``module.training_step`` for this fit; ``ctx.window`` says when a loader batch opens a window.

        ``ctx.noise_parts`` says, for each loader batch, into how many parts at least to split it (the noise scale
        measures a window of one loader batch in two halves); with no ``size`` a batch is split only so.
        With ``"auto"``, a new run (``ctx.plan.resumed`` false) forgets the size an earlier fit found.
        """
        self._unshadow()
        if self.auto and not ctx.plan.resumed:
            self.size = None
        self._trainer, self._module, self._original = trainer, module, module.training_step
        self._owner, self._window, self._parts = owner, ctx.window, lambda: ctx.noise_parts
        self._inspected = False
        module.training_step = self._training_step

    def inspect(self, batch: Any, halves: bool) -> None:
        """Check the fit's first loader batch, before its window opens: say now what splitting it could not do.

        ``halves``: the noise scale will measure windows of one loader batch in two halves (``adaptive=True`` from
        factor 1 on one process). A batch the splitter cannot cut (:func:`~lightning_accum.core.split.split_problem`) is
        refused where every batch, or the measured ones, must be cut (a fixed size, the halves), before any weight
        changes; under ``"auto"``, which cuts only after an out-of-memory error, it is warned about once.

        Raises:
            ValueError: If ``batch`` cannot be split while a fixed ``micro_batch_size`` or the halves need it, naming
                the argument, the batch's type and why.
        """
        if self._inspected or not self.installed:
            return
        self._inspected = True
        rows = batch_rows(batch)
        fixed = not self.auto and self.size is not None and (rows is None or rows > self.size)
        if not (fixed or halves or self.auto):
            return
        problem = split_problem(batch)
        if problem is None:
            return
        kind = type(batch).__name__
        remedy = (
            f"teach the splitter the batch with `lightning_accum.core.split.register_splitter({kind}, fn)` (see"
            " docs/microbatching.md)"
        )
        if fixed:
            raise ValueError(
                f"micro_batch_size={self.size}: a loader batch of type {kind} cannot be split into micro-batches:"
                f" {problem}. Either {remedy}, or give the loader batch_size={self.size} and no micro_batch_size"
            )
        if halves:
            raise ValueError(
                f"adaptive=True measures a window of one loader batch (factor 1, one process) in two halves, but a"
                f" loader batch of type {kind} cannot be split: {problem}. Either {remedy}, or start the schedule at"
                " factor 2 (scheduling={0: 2}), where a window has two micro-batches to compare"
            )
        rank_zero_warn(
            f"AccumulationScheduler: micro_batch_size='auto', but a loader batch of type {kind} cannot be split"
            f" into micro-batches: {problem}. An out-of-memory error will end the run instead of halving the"
            f" micro-batch: {remedy}"
        )

    def listen(self, resumed: bool) -> bool:
        """Hear the :func:`~lightning_accum.cached` calls of this fit's training steps (until :meth:`release`).

        A new run learns again whether its step couples its rows; a ``resumed`` one knows from the checkpoint, so that
        a window it resumes inside is never opened again. Returns whether a loader batch may be split (no coupled step
        known).
        """
        if not resumed:
            self.coupled = None
        if self._unlisten is None:
            self._unlisten = add_listener(self._heard)
        return self.coupled is None

    def _heard(self, rows: int, chunk_size: int | None) -> int | None:
        """A ``cached`` call: a part of a split batch stops here; lend the micro-batch size as the chunk size."""
        if self._in_part:
            raise _Coupled
        self.coupled = (rows, chunk_size or self.size or rows)
        return self.size

    @property
    def installed(self) -> bool:
        """Whether this fit splits (from ``install`` to ``release``)."""
        return self._module is not None

    @property
    def zeroes(self) -> bool:
        """Whether the micro-batcher zeroes the gradients of a window it starts.

        It does where it splits: the parts' backwards run inside ``training_step``, before Lightning would zero them.
        A window of loader batches it hands on whole is zeroed by Lightning, as always.
        """
        return self.installed and (self.size is not None or self.auto or self._parts() > 1)

    def metrics(self) -> dict[str, float]:
        """``accum/micro_batch_size`` while this fit splits by a size (none for the noise scale's halves alone).

        A coupled step instead: ``accum/coupled_batch`` and ``accum/chunk_size`` of its latest ``cached`` call.
        """
        if self.coupled is not None:
            return {"accum/coupled_batch": float(self.coupled[0]), "accum/chunk_size": float(self.coupled[1])}
        return {"accum/micro_batch_size": float(self.size)} if self.installed and self.size is not None else {}

    def report(self) -> tuple[torch.Tensor | None, Any] | None:
        """The loader batch's mean loss and its items, after its ``training_step``; ``None`` when it was not split."""
        return self._report if self.installed else None

    def state_dict(self) -> dict[str, Any]:
        """With ``"auto"``: the size found, which a resumed run keeps (it does not search again); a coupled step's."""
        state: dict[str, Any] = {"micro_batch_size_found": self.size} if self.auto and self.size is not None else {}
        return {**state, "coupled": list(self.coupled)} if self.coupled is not None else state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (from the callback's whole state): a checkpoint without a size searches again."""
        if self.auto:
            found = state.get("micro_batch_size_found")
            self.size = int(found) if found else None
        coupled = state.get("coupled")
        self.coupled = (int(coupled[0]), int(coupled[1])) if coupled else None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()  # one fit's, one process's:
        state.update(_module=None, _original=None, _trainer=None, _owner=None, _window=None, _report=(None, None))
        state.update(_inspected=False, _in_part=False, _unlisten=None)
        state["_parts"] = _whole
        return state

    def release(self) -> None:
        """Give the module its own ``training_step`` back, and stop hearing ``cached`` calls."""
        self._unshadow()
        if self._unlisten is not None:
            self._unlisten()
            self._unlisten = None

    def _unshadow(self) -> None:
        if self._module is not None and "training_step" in vars(self._module):
            del self._module.training_step
        self._module = self._original = self._trainer = self._owner = self._window = None
        self._parts = _whole
        self.anchored = False

    # ------------------------------------------------------------------ one loader batch

    def _training_step(self, batch: Any, *args: Any, **kwargs: Any) -> Any:
        self.anchored = False  # set again when this batch hands Lightning an anchor
        assert self._window is not None
        assert self._owner is not None
        if not self.zeroes:  # a window the noise scale does not measure in halves: the batch goes on as it came
            self._report = None
            self._owner._start_micro_batch(batch)
            return self._original(batch, *args, **kwargs)
        try:
            return self._train(batch, args, kwargs)
        except _Coupled:  # the fit's first `cached` call, in the first part of a split batch: that part never began
            rows = batch_rows(batch) or 1
            self._in_part, self._report, self.coupled = False, (None, None), (rows, self.size or rows)
            self._owner._couple()
            print_line(
                self._trainer,
                f"AccumulationScheduler: the training step couples its batch's rows (lightning_accum.cached): loader"
                f" batches of {rows} are trained whole, never split into micro-batches; cached() runs them in chunks"
                f" of {self.size or rows} rows unless given chunk_size",
            )
            return self._train(batch, args, kwargs)

    def _train(self, batch: Any, args: Any, kwargs: Any) -> Any:
        """The loader batch in parts (as one part if coupled), the ``"auto"`` retries around them."""
        assert self._window is not None
        if self._window.is_first:  # Lightning would zero them after training_step, too late
            self._zero_grad()
        rows = batch_rows(batch)
        if self.size is None and self.auto:  # "auto" starts at the loader batch's size
            self.size = smallest(self._trainer, rows or 1)
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
            if not any_rank(self._trainer, failed):
                return result
            self._retry_smaller()

    def _zero_grad(self) -> None:
        """Zero the gradients through the hooks Lightning calls for it.

        Every callback's and the module's ``on_before_zero_grad``, then the module's ``optimizer_zero_grad``.
        """
        trainer, module = self._trainer, self._module
        epoch, index = trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_idx
        for optimizer in trainer.optimizers:
            for callback in trainer.callbacks:
                callback.on_before_zero_grad(trainer, module, optimizer)
            module.on_before_zero_grad(optimizer)
            module.optimizer_zero_grad(epoch, index, optimizer)

    def _retry_smaller(self) -> None:
        assert self.size is not None
        for param in self._module.parameters():
            param.grad = None
        self._report = (None, None)
        if self.size <= 1:
            raise RuntimeError(
                "micro_batch_size='auto': a micro-batch of one sample does not fit in memory; reduce the model, the"
                " sequence length or the precision"
            )
        old, self.size = self.size, smallest(self._trainer, max(1, self.size // 2))
        self.changes.append((old, self.size))
        print_line(
            self._trainer,
            f"AccumulationScheduler: out of memory with micro-batches of {old}; training this batch again, as the"
            f" first of a new window, with micro-batches of {self.size} (optimizer step {self._trainer.global_step})",
        )
        assert self._owner is not None
        self._owner._restart_window(self._trainer)  # drops what the coordinator held of the failed attempt
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _split(self, batch: Any, rows: int | None, args: Any, kwargs: Any, anchor: bool) -> Any:
        assert self._owner is not None
        size = self.size or rows or 1
        if rows is not None and self._parts() > 1:
            size = min(size, math.ceil(rows / self._parts()))
        whole = self.coupled is not None or rows is None or rows <= size
        parts = [batch] if whole else split_batch(batch, size)
        report_loss: torch.Tensor | None = None
        report_items: Any = None
        output: Any = None
        for index, part in enumerate(parts):
            weight = (batch_rows(part) or 1) / (rows or 1)
            self._in_part = len(parts) > 1
            try:
                output = self._original(part, *args, **kwargs)
            except _Coupled:
                if index:
                    raise RuntimeError(
                        f"lightning_accum.cached() was first called in part {index + 1} of a loader batch split into"
                        f" micro-batches of {size} rows, after its earlier parts had trained: a step that couples its"
                        " batch's rows must call cached() from the batch's start (or run with micro_batch_size=None)"
                    ) from None
                raise
            finally:
                self._in_part = False
            # after the step, so that a part `cached` stopped never began: the micro-batch's items and weight
            items, share = self._owner._start_micro_batch(part, weight, last=index == len(parts) - 1)
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
            if index == len(parts) - 1 and not anchor:
                self._report = _mean(report_loss, report_items), report_items
                # Lightning divides it by the window's size and runs its backward, with the window's synchronisation
                return _with_loss(output, _shown_as(loss * share, self._report[0]))
            with self._no_sync():  # divided as Lightning divides the loss it backpropagates
                self._trainer.strategy.backward(loss * share / self._trainer.accumulate_grad_batches, None)
        self._report = _mean(report_loss, report_items), report_items
        if not anchor:
            return output
        # the parameters that received a gradient (one no micro-batch used keeps None, as in plain PyTorch)
        params = [p for p in self._module.parameters() if p.requires_grad and p.grad is not None]
        zero = sum((p * 0).sum() for p in params) if params else torch.zeros((), requires_grad=True)
        self.anchored = True
        return _with_loss(output, _shown_as(zero, self._report[0]))

    @contextlib.contextmanager
    def _no_sync(self) -> Iterator[None]:
        strategy: Any = self._trainer.strategy
        if isinstance(strategy, AccumulationStrategyMixin):
            with skip_gradient_sync(strategy.model, strategy.gradient_sync):  # type: ignore[attr-defined]
                yield
        elif isinstance(strategy, trainer_names(strategy).ParallelStrategy):
            with strategy.block_backward_sync():
                yield
        else:
            yield


class _Coupled(Exception):  # noqa: N818 (a signal, not an error: it never leaves the micro-batcher)
    """A part of a split loader batch called ``cached``: the batch must be trained whole."""


def _whole() -> int:
    """No split asked for: a loader batch is split only by the micro-batch size."""
    return 1


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
