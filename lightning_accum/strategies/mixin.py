"""AccumulationStrategyMixin: one gradient reduction per optimizer step, whatever the data-parallel backend.

Lightning's automatic optimization wraps every non-final micro-step of a window in the strategy's public
``block_backward_sync()``; stock Lightning only acts there on modules that have ``no_sync`` (DDP, FSDP1), so FSDP2
modules (``ModelParallelStrategy``) reduce-scatter on every micro-step. The mixin overrides that one context manager
to skip or defer communication for DDP, FSDP1 and FSDP2 alike (see :mod:`lightning_accum.distributed.sync`), with a
policy the user chooses, and checks that no optimizer step ever runs on gradients whose reduction was skipped.

The strategy decides nothing about boundaries: Lightning asks ``_should_accumulate``, which the
:class:`~lightning_accum.AccumulationScheduler` routes to its window (or, without the callback, Lightning's own
``trainer.accumulate_grad_batches`` arithmetic). When the callback is attached it hands the window to the strategy so
that a disagreement raises instead of silently training on unreduced gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer

from lightning_accum.compat.lightning import trainer_names
from lightning_accum.compat.torch import require_fsdp2
from lightning_accum.distributed.sync import (
    CheckCollectives,
    FSDP2CollectiveGuard,
    GradientSync,
    can_control,
    check_gradient_sync,
    checked_windows,
    drop_fsdp2_pending_gradients,
    fsdp2_modules,
    fsdp2_pending_gradients,
    skip_gradient_sync,
)


class AccumulationStrategyMixin:
    r"""Skip gradient communication on the non-final micro-steps of each accumulation window.

    Mix it in *before* a Lightning data-parallel strategy; every argument of that strategy passes through, and the
    mixin adds ``gradient_sync``. Ready-made: :class:`DDPAccumulationStrategy`, :class:`FSDPAccumulationStrategy`,
    :class:`ModelParallelAccumulationStrategy` (over ``lightning.pytorch``'s strategies; the same names in
    :mod:`lightning_accum.pytorch_lightning` are over ``pytorch_lightning``'s). The mixin itself serves both: it
    takes Lightning's names from the strategy it is mixed into.

    What happens on a non-final micro-step:

    ========================  =======================================================  ============================
    backend                   ``gradient_sync="last"`` (default)                        ``gradient_sync="every"``
    ========================  =======================================================  ============================
    DDP                       ``no_sync()``: no all-reduce                             all-reduce every micro-step
    FSDP1                     ``no_sync()``: no reduce-scatter; unsharded gradients    reduce-scatter every step;
                              kept on every rank until the window's end                sharded gradients
    FSDP2 (``fully_shard``)   ``set_requires_gradient_sync(False)``; unsharded         reduce-scatter every step;
                              gradients kept until the window's end                    sharded gradients
    ========================  =======================================================  ============================

    ``gradient_sync="reduce_scatter"`` is ``"every"`` with HSDP's all-reduce across replicas deferred to the window's
    end (every sharded unit must take part in the window's last backward; a step that would miss a deferred sum
    raises, on every rank).

    Under FSDP2 on 2 or more ranks the ranks also agree before each FSDP2 collective in the first windows of every
    fit (``check_collectives``): a ``fully_shard`` unit that only some ranks run (conditional compute) raises the same
    error on every rank, before the collective that would hang or crash the run.

    Args:
        *args: Passed to the strategy the mixin is combined with.
        gradient_sync: ``"last"``: one gradient reduction per optimizer step (least communication; under FSDP each
            rank holds the unsharded gradients of the model between micro-steps). ``"every"``: reduce-scatter on
            every micro-step so each rank holds only its gradient shard (least memory; one reduction per
            micro-step). ``"reduce_scatter"``: as ``"every"``, with HSDP's all-reduce across replicas deferred to the
            window's end. See ``docs/strategies.md`` for the memory arithmetic.
        check_collectives: Under FSDP2 on several ranks, make the ranks agree before each FSDP2 collective (one
            small CPU collective each, on a gloo group of the strategy's own), so that a ``fully_shard`` unit that
            only some ranks run raises the same error on every rank instead of hanging or crashing the run (see
            :class:`~lightning_accum.distributed.sync.FSDP2CollectiveGuard`). ``True``: in the first 3 windows
            (optimizer steps) of every fit, a resumed one included, then the check steps aside and costs nothing. A
            number n: the first n windows. ``"always"``: every window, for models whose units run conditionally (a
            mixture of experts, early exit), where a rare batch may skip a unit on one rank. ``False`` (or 0): never,
            trusting every rank to run every unit, as stock FSDP2 does. In ``validate``, ``test`` or ``predict`` run on
            their own (no optimizer steps) the check, unless ``False``, stays on. No effect on DDP and FSDP1.
        **kwargs: Passed to the strategy the mixin is combined with.

    Raises:
        TypeError: If the mixin is combined with a strategy that is not a Lightning ``ParallelStrategy``.
        ValueError: If ``gradient_sync`` is unknown, ``check_collectives`` is none of ``True``, ``False``,
            ``"always"`` or a number of windows, or the strategy accumulates gradients by itself (DeepSpeed).

    Example::

        from lightning.pytorch.strategies import DDPStrategy
        from lightning_accum import AccumulationScheduler, AccumulationStrategyMixin

        class MyDDP(AccumulationStrategyMixin, DDPStrategy):
            pass

        trainer = Trainer(
            devices=4,
            strategy=MyDDP(gradient_sync="last", find_unused_parameters=True),
            callbacks=[AccumulationScheduler(target_batch_size=512)],
        )
    """

    _gradient_sync: GradientSync
    _sync_blocked: bool  # inside block_backward_sync
    _reduction_skipped: bool  # the latest backward ran with its gradient reduction skipped
    _window_ends: Callable[[], bool] | None
    _checked_windows: int | None  # windows the guard checks at the start of each fit; None: every window
    _guard: FSDP2CollectiveGuard | None  # FSDP2 on several ranks: the ranks agree before each collective
    _guard_windows_left: int | None  # in this fit, before the guard steps aside

    def __init__(
        self,
        *args: Any,
        gradient_sync: GradientSync = "last",
        check_collectives: CheckCollectives = True,
        **kwargs: Any,
    ) -> None:
        self._gradient_sync = check_gradient_sync(gradient_sync)
        self._checked_windows = checked_windows(check_collectives)
        self._sync_blocked = False
        self._reduction_skipped = False
        self._window_ends = None
        self._guard = None
        self._guard_windows_left = None
        super().__init__(*args, **kwargs)
        if not isinstance(self, trainer_names(self).ParallelStrategy):
            raise TypeError(
                f"AccumulationStrategyMixin controls data-parallel gradient communication, so it must be combined with"
                f" a Lightning ParallelStrategy (DDPStrategy, FSDPStrategy, ModelParallelStrategy, ...);"
                f" {type(self).__name__} is not one"
            )
        if self.handles_gradient_accumulation:
            raise ValueError(
                f"{type(self).__name__} accumulates gradients by itself (as DeepSpeed does), so"
                " AccumulationStrategyMixin cannot control its gradient communication: use the strategy's own"
                " accumulation setting instead"
            )

    @property
    def gradient_sync(self) -> GradientSync:
        """The policy for non-final micro-steps: ``"last"``, ``"every"`` or ``"reduce_scatter"``."""
        return self._gradient_sync

    def connect_window(self, ends_window: Callable[[], bool] | None) -> None:
        """Let the accumulation callback hand over its window ("does the micro-step in progress end it?").

        With a window connected, a skipped sync on a micro-step that ends the window raises. ``None`` disconnects.
        """
        self._window_ends = ends_window

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Skip (``"last"``) or defer (``"reduce_scatter"``: HSDP's all-reduce) gradient sync on a non-final micro-step.

        Raises:
            RuntimeError: If the connected accumulation window says this micro-step ends the window: its gradients
                must be reduced before the optimizer steps.
        """
        if self._window_ends is not None and self._window_ends():
            raise RuntimeError(
                "Gradient sync was about to be skipped on the micro-step that ends the AccumulationScheduler's window:"
                " something other than the AccumulationScheduler decides Lightning's accumulation boundaries"
                " (another accumulation callback or loop patch?)"
            )
        strategy: Any = self
        with skip_gradient_sync(strategy.model, self._gradient_sync):
            self._sync_blocked = True
            try:
                yield
            finally:
                self._sync_blocked = False

    def reduce_gradients_elsewhere(self, elsewhere: bool) -> None:
        """Let the accumulation callback reduce the window's gradients itself (in a wider dtype), or give it back.

        While ``elsewhere`` is true, DDP does not all-reduce gradients in any backward, the window's last included
        (``require_backward_grad_sync`` is off, as inside ``no_sync()``); the callback all-reduces its float32 sums
        once per window. Only DDP is supported: FSDP2 accumulates in its own reduce dtype, FSDP1 is refused.

        Raises:
            ValueError: If the model is not wrapped in DDP.
        """
        from torch.nn.parallel import DistributedDataParallel

        strategy: Any = self
        model = strategy.model
        if not isinstance(model, DistributedDataParallel):
            if not elsewhere:  # after teardown the model is unwrapped: nothing to give back
                return
            raise ValueError(
                f"{type(self).__name__} can hand its gradient reduction to the callback only under DDP, not"
                f" {type(model).__name__}"
            )
        model.require_backward_grad_sync = not elsewhere

    def drop_unreduced_gradients(self) -> None:
        """Forget gradients kept for a reduction that will not happen, when a window is abandoned before its end.

        DDP and FSDP1 accumulate in ``.grad``, which the next window's ``zero_grad`` clears; FSDP2 accumulates in
        buffers of its own that ``zero_grad`` does not reach.
        """
        strategy: Any = self
        drop_fsdp2_pending_gradients(strategy.model)
        self._reduction_skipped = False

    def setup(self, trainer: pl.Trainer) -> None:
        """Set up the parent strategy, then warn if there is no gradient communication to control.

        Under FSDP2 on several ranks, also make the ranks agree before each FSDP2 collective for the first windows
        of this fit (see :class:`~lightning_accum.distributed.sync.FSDP2CollectiveGuard`): a unit that only some ranks
        run raises on every rank instead of hanging or crashing the run.
        """
        super().setup(trainer)  # type: ignore[misc]
        strategy: Any = self
        self._remove_guard()
        fsdp2 = bool(fsdp2_modules(strategy.model))
        if fsdp2:  # before any forward: FSDP2 on a torch whose FSDP2 state is not known
            require_fsdp2(
                f"{type(self).__name__} with `fully_shard` (FSDP2) units",
                "use stock ModelParallelStrategy with `Trainer(accumulate_grad_batches=k)` (FSDP2 then"
                f" reduce-scatters on every micro-step), or train the model with {trainer_names(trainer).home}."
                "DDPAccumulationStrategy or FSDPAccumulationStrategy (FSDP1)",
            )
        if self._checked_windows != 0 and trainer.world_size > 1 and fsdp2:
            self._guard = FSDP2CollectiveGuard(strategy.model)
            self._guard_windows_left = self._checked_windows
        # Lightning wraps the model in DDP only to fit
        fitting = trainer.state.fn == trainer_names(trainer).TrainerFn.FITTING
        if fitting and trainer.world_size > 1 and not can_control(strategy.model):
            rank_zero_warn(
                f"{type(self).__name__}: the model is neither wrapped in DDP/FSDP nor has `fully_shard` applied"
                " (in `configure_model`), so there is no gradient communication to control"
            )

    def teardown(self) -> None:
        """Give FSDP2 its own collectives back, then tear the parent strategy down."""
        self._remove_guard()
        super().teardown()  # type: ignore[misc]

    def _remove_guard(self) -> None:
        if self._guard is not None:
            self._guard.remove()
            self._guard = None

    def _guard_window_checked(self) -> None:
        """Step aside after the last window to check: every rank agreed on this optimizer step, so all do it here."""
        if self._guard is None or self._guard_windows_left is None:
            return
        self._guard_windows_left -= 1
        if self._guard_windows_left <= 0:
            self._remove_guard()

    def post_backward(self, closure_loss: Tensor) -> None:
        """Remember whether this backward's gradient reduction was skipped; under FSDP2, agree that it ended.

        Raises:
            RuntimeError: Under FSDP2 on several ranks, on every rank, if another rank is still in its backward
                (about to reduce-scatter the gradients of a unit that this rank did not run).
        """
        super().post_backward(closure_loss)  # type: ignore[misc]
        if self._guard is not None:
            self._guard.backward_ended()
        strategy: Any = self
        self._reduction_skipped = (
            self._sync_blocked
            and self._gradient_sync == "last"
            and strategy.world_size > 1
            and can_control(strategy.model)
        )

    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """Step, after checking that the gradients were reduced (the closure runs the window's last backward).

        After the last window that ``check_collectives`` checks, the ranks stop agreeing on FSDP2's collectives.

        Raises:
            RuntimeError: If the latest backward skipped its gradient reduction.
        """
        strategy: Any = self

        def checked_closure() -> Any:
            result = closure()
            pending = self._reduction_skipped or (strategy.world_size > 1 and fsdp2_pending_gradients(strategy.model))
            where = ""
            if self._guard is not None:  # every rank learns whether any rank holds such gradients
                ranks = self._guard.pending_ranks(pending)
                pending = bool(ranks)
                where = f" (on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})"
            if pending:
                raise RuntimeError(
                    f"The optimizer is about to step on gradients whose reduction across ranks has not run{where}:"
                    " the last backward ran inside `block_backward_sync()` (in manual optimization, run the window's"
                    " last micro-step outside it: see lightning_accum.ManualAccumulation), or, with"
                    " gradient_sync='reduce_scatter' on HSDP, a sharded unit took no part in the window's last"
                    " backward (use gradient_sync='last' or 'every')"
                )
            return result

        result = super().optimizer_step(optimizer, checked_closure, model, **kwargs)  # type: ignore[misc]
        self._guard_window_checked()
        return result
