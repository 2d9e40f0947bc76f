"""SampleDrivenLR: a torch LR scheduler moved by the samples (or tokens) a run consumes, not by its optimizer steps.

A schedule sized in optimizer steps (``OneCycleLR(total_steps=...)``, warmup then cosine) ends where the run ends only
if the run takes the steps it was sized for. Under adaptive growth, or any schedule whose factor is not known up
front, the run takes fewer steps than that and stops with the learning rate never annealed. Megatron-LM
(``--lr-decay-samples``) and OLMo-core (scheduler units in tokens) size their schedules in samples and tokens for this
reason. :class:`SampleDrivenLR` does it for any torch scheduler: the scheduler stays sized in ``steps`` steps, and
after each window the wrapper steps it until it stands at ``steps x consumed / total``, so it reaches its end when the
run has consumed ``total`` samples (or tokens), however many optimizer steps that took.

Pure: torch only. :class:`~lightning_accum.AccumulationScheduler` attaches it at the fit's start (the run's samples,
the steps it was sized with, where to read what was consumed) and advances it after each optimizer step; Lightning's
own calls to :meth:`SampleDrivenLR.step` then do nothing. Without the callback it steps like the scheduler it wraps.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable
from numbers import Integral, Real
from typing import Any, Literal

from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

Unit = Literal["sample", "token"]


class SampleDrivenLR(LRScheduler):
    """Move ``scheduler`` by samples (or tokens) consumed, so it ends where the run's data ends.

    Size ``scheduler`` as usual, with ``lightning_accum.estimated_stepping_batches(trainer)`` steps (the steps the run
    takes at the factors known up front; an upper bound under adaptive growth), and return the wrapper in its place,
    with ``"interval": "step"`` (or give ``steps``): the callback moves it after each optimizer step, to the position
    the samples consumed so far call for.

    Args:
        scheduler: A torch LR scheduler sized in optimizer steps.
        steps: The steps ``scheduler`` is sized for; by default ``estimated_stepping_batches`` at the fit's start.
        total: The samples (or tokens, all ranks together) over which those steps are spread; by default, for samples,
            the samples the fit consumes (its epochs, ``limit_train_batches`` or ``max_steps``, at the factors known up
            front). Required for tokens, which are not known ahead.
        unit: ``"sample"`` or ``"token"`` (tokens as ``AccumulationScheduler(unit="token")`` counts them).

    Raises:
        TypeError: If ``scheduler`` is not a torch LR scheduler, or is ``ReduceLROnPlateau`` (moved by a metric).
        ValueError: If ``unit`` is unknown, ``steps`` is not an integer >= 1, ``total`` not a number >= 1, or
            ``unit="token"`` has no ``total``.

    Example::

        >>> import torch
        >>> optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        >>> schedule = SampleDrivenLR(torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.0, total_iters=4))
        >>> consumed = [0]
        >>> schedule.attach(lambda: consumed[0], steps=4, total=64)  # what the callback does at the fit's start
        >>> for samples in (32, 64):  # two optimizer steps of 32 samples: the schedule sized for 4 steps of 16 ends
        ...     optimizer.step()
        ...     consumed[0] = samples
        ...     schedule.advance()
        >>> schedule.get_last_lr()
        [0.0]
    """

    def __init__(
        self, scheduler: LRScheduler, steps: int | None = None, total: float | None = None, unit: Unit = "sample"
    ) -> None:
        if not isinstance(scheduler, LRScheduler):
            raise TypeError(f"`scheduler` must be a torch LR scheduler (torch.optim.lr_scheduler), got {scheduler!r}")
        if isinstance(scheduler, ReduceLROnPlateau):
            raise TypeError(
                "`scheduler` must follow the steps it was sized for; ReduceLROnPlateau follows a monitored metric, not"
                " the data consumed: give it to Lightning unwrapped"
            )
        if unit not in ("sample", "token"):
            raise ValueError(f"`unit` must be 'sample' or 'token', got {unit!r}")
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, Integral) or steps < 1):
            raise ValueError(f"`steps` must be an integer >= 1 or None, got {steps!r}")
        if total is not None and (isinstance(total, bool) or not isinstance(total, Real) or not 1 <= total < math.inf):
            raise ValueError(f"`total` must be a number >= 1 or None, got {total!r}")
        if unit == "token" and total is None:
            raise ValueError("SampleDrivenLR(unit='token') needs `total`: the tokens the run trains on")
        # LRScheduler.__init__ is not called: it would step the optimizer's learning rates; the wrapped scheduler did
        self.scheduler = scheduler
        self.optimizer = scheduler.optimizer
        # SequentialLR and ChainedScheduler keep no base rates of their own: the param groups' initial ones
        initial = [group.get("initial_lr", group["lr"]) for group in self.optimizer.param_groups]
        self.base_lrs = getattr(scheduler, "base_lrs", initial)
        self.unit: Unit = unit
        self.steps: int | None = None if steps is None else int(steps)
        self.total: float | None = None if total is None else float(total)
        self.last_epoch = 0  # the optimizer steps Lightning has reported (torch's name for its counter)
        self.taken = 0  # the steps of ``scheduler`` taken
        self._consumed: Callable[[], float] | None = None
        self._last_lr = scheduler.get_last_lr()

    @property
    def attached(self) -> bool:
        """Whether a callback moves it (from :meth:`attach` to :meth:`detach`)."""
        return self._consumed is not None

    def attach(self, consumed: Callable[[], float], steps: float, total: float) -> None:
        """Move by ``consumed()`` from now on; ``steps`` and ``total`` (finite) fill what the constructor left out."""
        self._consumed = consumed
        self.steps = self.steps if self.steps is not None else max(1, int(steps))
        self.total = self.total if self.total is not None else max(1.0, float(total))

    def detach(self) -> None:
        """Step like the wrapped scheduler again."""
        self._consumed = None

    def advance(self) -> None:
        """Step the wrapped scheduler to where the samples consumed so far put it (never past ``steps``)."""
        assert self._consumed is not None, "attach first"
        assert self.steps is not None, "attach sets it"
        assert self.total is not None, "attach sets it"
        target = min(self.steps, math.floor(self._consumed() * self.steps / self.total))
        while self.taken < target:
            self.scheduler.step()
            self.taken += 1
        self._last_lr = self.scheduler.get_last_lr()

    def planned_lrs(self) -> list[float]:
        """The first param group's LR at each step of the wrapped scheduler, from where it stands to ``steps``.

        Read by stepping the scheduler ahead and putting it back as it was (its state and the param groups' rates),
        so the run's schedule is untouched: what Seesaw and adaptive growth read the LR schedule's shape from. Entry
        ``j`` is the rate after ``taken + j`` steps.

        Example::

            >>> import torch
            >>> optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
            >>> schedule = SampleDrivenLR(torch.optim.lr_scheduler.StepLR(optimizer, 2, gamma=0.5), steps=5, total=50)
            >>> schedule.planned_lrs(), optimizer.param_groups[0]["lr"]
            ([1.0, 1.0, 0.5, 0.5, 0.25, 0.25], 1.0)
        """
        assert self.steps is not None, "given, or set by attach"
        state = copy.deepcopy(self.scheduler.state_dict())
        groups = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
        lrs = [float(self.scheduler.get_last_lr()[0])]
        try:
            with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": no update is taken
                warnings.simplefilter("ignore")
                for _ in range(self.taken, self.steps):
                    self.scheduler.step()
                    lrs.append(float(self.scheduler.get_last_lr()[0]))
        finally:
            self.scheduler.load_state_dict(state)
            for group, saved in zip(self.optimizer.param_groups, groups, strict=True):
                group.update(saved)  # the rates, and the momentum or betas a cycling scheduler moves
        return lrs

    def step(self, epoch: Any = None) -> None:
        """Lightning's call after an optimizer step: one step of the wrapped scheduler, unless a callback moves it."""
        self.last_epoch += 1
        if not self.attached:
            self.scheduler.step()
            self.taken += 1
        self._last_lr = self.scheduler.get_last_lr()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()  # what moves it belongs to one fit, in one process
        state["_consumed"] = None
        return state

    def get_lr(self) -> list[Any]:
        """The wrapped scheduler's current learning rates."""
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        """The wrapped scheduler's state and how far it has been moved."""
        return {
            "scheduler": self.scheduler.state_dict(),
            "taken": self.taken,
            "last_epoch": self.last_epoch,
            "steps": self.steps,
            "total": self.total,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`: a resumed run continues the schedule at the position it was written at."""
        self.scheduler.load_state_dict(state_dict["scheduler"])
        self.taken = int(state_dict.get("taken", 0))
        self.last_epoch = int(state_dict.get("last_epoch", 0))
        self.steps = state_dict.get("steps", self.steps)
        self.total = state_dict.get("total", self.total)
        self._last_lr = self.scheduler.get_last_lr()
