"""ManualAccumulation: exact, communication-cheap accumulation for ``training_step`` under manual optimization.

With ``automatic_optimization = False`` Lightning leaves accumulation to the user, and its only help,
``optimizer.toggle_model(sync_grad=False)``, does nothing for FSDP2. This helper gives such a ``training_step`` what
:class:`~lightning_accum.AccumulationScheduler` gives automatic optimization: the window boundaries (a schedule by
epoch or optimizer step; the last window of an epoch holds what is left), the divisor for each loss, and gradient
communication skipped on the window's non-final micro-steps through the strategy's ``block_backward_sync()``
(an :class:`~lightning_accum.AccumulationStrategyMixin` strategy handles DDP, FSDP1 and FSDP2 with its
``gradient_sync`` policy; stock Lightning strategies handle DDP and FSDP1).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_accum.compat.lightning import trainer_names
from lightning_accum.compat.torch import has_fsdp2_mechanics
from lightning_accum.core.schedule import Schedule, check_int
from lightning_accum.core.window import Window
from lightning_accum.distributed.sync import fsdp2_pending_gradients
from lightning_accum.strategies.deepspeed import zero_stage
from lightning_accum.strategies.mixin import AccumulationStrategyMixin
from lightning_accum.trainer._loop import ends_epoch


@dataclass(frozen=True)
class MicroStep:
    """Where the micro-batch in progress sits in its window.

    Attributes:
        size: Micro-batches in the window: divide each loss by it (or call :meth:`scale`).
        index: The micro-batch's position in the window, from 0.
    """

    size: int
    index: int

    @property
    def should_step(self) -> bool:
        """Whether this micro-batch ends the window: call ``optimizer.step()`` and ``zero_grad()`` after it."""
        return self.index == self.size - 1

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss / size``: the micro-batch's share of the window's mean loss."""
        return loss / self.size


def _grad_versions(params: Any) -> dict[int, tuple[int, int] | None]:
    """Each parameter's gradient (identity, in-place version), to tell whether a backward has written it since."""
    return {id(p): None if p.grad is None else (id(p.grad), p.grad._version) for p in params if p.requires_grad}


class ManualAccumulation:
    """Window boundaries, loss divisor and sync skipping for manual optimization.

    Args:
        scheduling: A constant factor, or ``{position: factor}`` (positions before the first key use factor 1).
        unit: What the keys count: ``"step"`` (optimizer steps, ``trainer.global_step``) or ``"epoch"``.

    Raises:
        TypeError: If a factor or key is not an integer.
        ValueError: If a factor is below 1, a key is negative, or ``unit`` is unknown.
        RuntimeError: On misuse, with what to do instead: ``micro_step`` under automatic optimization, nested, or
            entered twice in one batch; ``optimizer.step()`` before the window's last micro-step, or for a window
            that ran no backward.

    Example::

        class Model(LightningModule):
            def __init__(self):
                super().__init__()
                self.automatic_optimization = False
                self.accumulation = ManualAccumulation(scheduling={0: 2, 1000: 8}, unit="step")

            def training_step(self, batch, batch_idx):
                optimizer = self.optimizers()
                with self.accumulation.micro_step(self) as micro:
                    self.manual_backward(micro.scale(self.loss(batch)))
                if micro.should_step:
                    optimizer.step()
                    optimizer.zero_grad()
    """

    def __init__(self, scheduling: int | dict[int, int] = 1, unit: Literal["step", "epoch"] = "step") -> None:
        if unit not in ("step", "epoch"):
            raise ValueError(f"ManualAccumulation `unit` must be 'step' or 'epoch', got {unit!r}")
        if isinstance(scheduling, dict):
            self._schedule = Schedule.from_mapping(scheduling, unit)
        else:
            self._schedule = Schedule.constant(check_int("scheduling", scheduling, minimum=1))
        self._unit = unit
        self._window = Window()
        self._warned = False
        self._where: tuple[int, int, int] | None = None  # (trainer, epoch, batch) of the last micro-step taken
        self._active = False  # inside a `micro_step` block
        self._hooked: int | None = None  # id of the Trainer whose optimizers carry the step check
        self._handles: list[Any] = []
        self._model: weakref.ref[torch.nn.Module] | None = None  # the strategy's model, for its pending gradients
        self._grads_at_open: dict[int, tuple[int, int] | None] = {}  # each parameter's gradient when the window opened

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        # the hooks and what they compare belong to one process
        state.update(_hooked=None, _handles=[], _grads_at_open={}, _active=False, _model=None)
        return state

    @property
    def factor(self) -> int:
        """The size of the window in progress."""
        return self._window.size

    @contextmanager
    def micro_step(self, module: pl.LightningModule) -> Iterator[MicroStep]:
        """Place the current micro-batch in its window; wrap its forward and ``manual_backward``.

        On a non-final micro-step the strategy's gradient communication is skipped for the duration of the block.
        When an epoch of unknown length ends a window early, the accumulated gradients are rescaled on leaving the
        block, so the step is still on the mean over the micro-batches taken. A window never spans epochs or fits:
        one left open (an epoch cut short, a fit that raised) is dropped with its gradients.

        Args:
            module: The LightningModule whose ``training_step`` this is (``self``).

        Yields:
            The micro-step's place in its window.
        """
        trainer = module.trainer
        if module.automatic_optimization:
            raise RuntimeError(
                "ManualAccumulation.micro_step is for manual optimization, but the module has"
                " `automatic_optimization = True`: set `self.automatic_optimization = False` in `__init__`, or drop"
                " ManualAccumulation and add `AccumulationScheduler` to the Trainer's callbacks"
            )
        names = trainer_names(trainer)
        if isinstance(trainer.strategy, names.DeepSpeedStrategy):
            raise ValueError(
                f"ManualAccumulation is not supported under {type(trainer.strategy).__name__} (ZeRO stage"
                f" {zero_stage(trainer.strategy)}): DeepSpeed keeps the window's gradient in its own partitions, where"
                " the window cannot check or correct it. Use automatic"
                " optimization with AccumulationScheduler and DeepSpeedAccumulationStrategy"
            )
        if self._active:
            raise RuntimeError(
                "ManualAccumulation.micro_step was entered inside another `micro_step` block: enter it once per"
                " `training_step`, around the micro-batch's forward and `manual_backward`"
            )
        batch_idx = trainer.fit_loop.epoch_loop.batch_idx
        where = (id(trainer), trainer.current_epoch, batch_idx)
        if where == self._where:
            raise RuntimeError(
                f"ManualAccumulation.micro_step was entered twice for batch {batch_idx}: each `training_step` is one"
                " micro-step; to split a batch, loop over its parts inside one `micro_step` block"
            )
        self._check_steps(trainer)
        if not self._window.closed and (self._where is None or where[:2] != self._where[:2] or where <= self._where):
            # a window left open by an epoch cut short, or by a fit that ended early: it never stepped
            self._discard(module)
        self._where = where
        if self._window.closed:
            position = trainer.current_epoch if self._unit == "epoch" else trainer.global_step
            self._window.open(int(min(self._schedule.factor_at(position), trainer.num_training_batches - batch_idx)))
            self._grads_at_open = _grad_versions(module.parameters())
        self._window.take(ends_epoch=ends_epoch(trainer, batch_idx))
        window = self._window
        micro = MicroStep(size=window.size, index=window.size - 1 if window.closed else window.taken - 1)
        strategy = trainer.strategy
        self._warn_if_uncontrolled(strategy)
        skip = not micro.should_step and isinstance(strategy, names.ParallelStrategy)
        self._active = True
        try:
            with strategy.block_backward_sync() if skip else nullcontext():  # type: ignore[attr-defined]
                yield micro
        except BaseException:
            self._where = None  # a retry of this batch (a second fit on the same Trainer) is not a second entry
            raise
        finally:
            self._active = False
        if window.closed and window.gradient_correction != 1.0:
            with torch.no_grad():
                for param in module.parameters():
                    if param.grad is not None:
                        param.grad.mul_(window.gradient_correction)

    def _check_steps(self, trainer: pl.Trainer) -> None:
        """Give the optimizer a step pre-hook that refuses a step the window does not allow.

        Only with one optimizer: with several, one may step outside the accumulation (a GAN's discriminator on every
        batch), which a hook cannot tell from misuse.
        """
        if self._hooked == id(trainer):
            return
        for handle in self._handles:
            handle.remove()
        optimizers = trainer.optimizers if len(trainer.optimizers) == 1 else []
        self._handles = [optimizer.register_step_pre_hook(self._before_step) for optimizer in optimizers]
        self._hooked = id(trainer)
        self._model = weakref.ref(trainer.strategy.model) if trainer.strategy.model is not None else None

    def _before_step(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        window = self._window
        if window.size == 0:  # no micro-step yet: a step outside the accumulation is the user's business
            return None
        if not window.closed:
            raise RuntimeError(
                f"optimizer.step() was called on micro-step {window.taken} of a window of {window.size}: the"
                " gradient holds only part of the window. Step only when `micro.should_step` is true"
            )
        # torch hands a pre-hook the step's own arguments: (optimizer, closure?) and its keywords
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None:
            self._check_backward(optimizer)
            return None

        def checked_closure() -> Any:  # L-BFGS and Lightning's closures: the backward may run inside
            result = closure()
            self._check_backward(optimizer)
            return result

        if "closure" in kwargs:
            return args, {**kwargs, "closure": checked_closure}
        return (args[0], checked_closure, *args[2:]), kwargs

    def _check_backward(self, optimizer: torch.optim.Optimizer) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        now = _grad_versions(params)
        model = self._model() if self._model is not None else None
        if all(now[key] is None or now[key] == self._grads_at_open.get(key) for key in now):
            if fsdp2_pending_gradients(model):
                return  # a backward ran, but its gradients await a reduction: the strategy's step check says so
            raise RuntimeError(
                "optimizer.step() was called for a window that ran no backward: call"
                " `self.manual_backward(micro.scale(loss))` inside `with accumulation.micro_step(self) as micro:`"
            )

    def _discard(self, module: pl.LightningModule) -> None:
        self._window.discard()
        module.zero_grad(set_to_none=True)
        strategy = module.trainer.strategy
        if isinstance(strategy, AccumulationStrategyMixin):
            strategy.drop_unreduced_gradients()

    def _warn_if_uncontrolled(self, strategy: object) -> None:
        if self._warned:
            return
        self._warned = True
        names = trainer_names(strategy)
        stock = isinstance(strategy, names.ModelParallelStrategy) and not isinstance(
            strategy, AccumulationStrategyMixin
        )
        if stock and has_fsdp2_mechanics():  # below the FSDP2 floor the strategy it would name refuses FSDP2
            rank_zero_warn(
                "ManualAccumulation: ModelParallelStrategy does not skip FSDP2's reduce-scatter on non-final"
                f" micro-steps; use {names.home}.ModelParallelAccumulationStrategy to reduce once per window"
            )
