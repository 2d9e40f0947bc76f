"""The window events, the context they carry, and the base class of a feature.

:class:`~lightning_accum.AccumulationScheduler` owns the window, the schedule and Lightning's loop; everything optional
(LR scaling, item weighting, the noise scale, adaptive growth, metrics) is a :class:`Feature` that handles some of the
:class:`Event` s below and keeps its own state. At each event the callback updates the :class:`Context` and calls the
features that handle it, in the order they were registered; a feature reads the context, may publish into it for the
features after it, and never touches another feature.

This module holds no behaviour of its own and imports no Lightning, so a feature can be driven through its events in
a test without a Trainer.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar

import torch

from lightning_accum.core.fit import FitPlan
from lightning_accum.core.noise import NoiseReading
from lightning_accum.core.window import Window


class Event(str, Enum):
    """The points of a fit at which features act, in the order they happen.

    ========================  =========================================  =============================================
    event                     Lightning hook                             what the context holds
    ========================  =========================================  =============================================
    ``SETUP``                 ``setup("fit")``                           ``trainer``, ``module``: check, refuse early
    ``FIT_START``             ``on_train_start``                         the run's sizes, ``factor`` of the first window
    ``EPOCH_STARTED``         ``on_train_epoch_start``                   ``run.epoch``: a new epoch begins
    ``WINDOW_OPENING``        ``on_train_batch_start`` at a boundary     ``factor``: the schedule's; may be raised
    ``WINDOW_OPENED``         the same, once the window is open          ``window``, ``factor``; ``summary`` to add to
    ``MICRO_BATCH_STARTED``   ``on_train_batch_start``                   ``batch``
    ``BEFORE_BACKWARD``       ``on_before_backward``                     ``loss`` (backward runs on it), its divisor
    ``AFTER_BACKWARD``        ``on_after_backward``
    ``WINDOW_CLOSING``        ``on_before_optimizer_step``               ``optimizer``, ``gradient_scale`` to set
    ``GRADIENT_READY``        the same, the gradient is the window mean  ``optimizer``; before clipping and the step
    ``MICRO_BATCH_ENDED``     ``on_train_batch_end``                     ``loss``: what ``training_step`` returned
    ``WINDOW_CLOSED``         the same, after the optimizer step         ``metrics`` to add to
    ``FIT_END``               ``teardown("fit")`` or ``on_exception``    release hooks
    ========================  =========================================  =============================================
    """

    SETUP = "setup"
    FIT_START = "fit_start"
    EPOCH_STARTED = "epoch_started"
    WINDOW_OPENING = "window_opening"
    WINDOW_OPENED = "window_opened"
    MICRO_BATCH_STARTED = "micro_batch_started"
    BEFORE_BACKWARD = "before_backward"
    AFTER_BACKWARD = "after_backward"
    WINDOW_CLOSING = "window_closing"
    GRADIENT_READY = "gradient_ready"
    MICRO_BATCH_ENDED = "micro_batch_ended"
    WINDOW_CLOSED = "window_closed"
    FIT_END = "fit_end"


def takes_dataloader_iter(module: Any) -> bool:
    """Whether ``module.training_step`` fetches its own batches: then no hook sees a batch before its backward."""
    step = getattr(module, "training_step", None)  # a Fabric loop's plain module has none: the loop fetches
    return step is not None and "dataloader_iter" in inspect.signature(step).parameters


def _local_reduce(tensor: torch.Tensor, reduce_op: str) -> torch.Tensor:
    return tensor


def _local_broadcast(obj: Any) -> Any:
    return obj


@dataclass(frozen=True)
class DataParallel:
    """How the model's gradients travel between ranks, as the Trainer's strategy set it up (read at ``FIT_START``).

    Attributes:
        wrapper: What reduces the gradients: ``"none"`` (one process, or a strategy with no gradient communication of
            its own), ``"ddp"`` (``DistributedDataParallel``), ``"fsdp1"`` (``FullyShardedDataParallel``) or
            ``"fsdp2"`` (modules with ``fully_shard`` applied) or ``"deepspeed"`` (a ``DeepSpeedEngine``, which holds
            the window's gradient itself, partitioned from ZeRO stage 2 on).
        strategy: The strategy's class name, for messages.
        gradient_sync: The policy of an :class:`~lightning_accum.AccumulationStrategyMixin` strategy (``"last"``,
            ``"every"``, ``"reduce_scatter"``); ``None`` under a stock strategy.
        static_graph: Whether DDP was built with ``static_graph=True``.
        shards_parameters: Whether the strategy shards parameters (FSDP, ``ModelParallelStrategy``): a gradient hook
            then sees a shard, not a micro-batch's gradient.
        zero_stage: The ZeRO stage under DeepSpeed, else ``None``.
    """

    wrapper: str = "none"
    strategy: str = ""
    gradient_sync: str | None = None
    static_graph: bool = False
    shards_parameters: bool = False
    zero_stage: int | None = None


class Run:
    """What the Trainer knows, read-only, and the few actions a feature may ask of the coordinator.

    Features never hold the Trainer: the coordinator hands them a view of it
    (``lightning_accum.trainer._run.TrainerRun``) as ``Context.run``. This base class describes a run without one (one
    process, no logger, no progress bar, full precision), which a feature's own tests use; its actions do nothing.

    Example::

        >>> run = Run()
        >>> run.epoch, run.loggers, run.loss_scale()
        (0, [], None)
    """

    @property
    def owner(self) -> str:
        """What the user set up, named in messages: ``"AccumulationScheduler"``, or ``"Accumulator"`` (Fabric)."""
        return "AccumulationScheduler"

    @property
    def names(self) -> Any:
        """The Lightning names of the run's namespace (:mod:`~lightning_accum.compat.lightning`), or ``None``."""
        return None

    @property
    def epoch(self) -> int:
        """The current epoch (``trainer.current_epoch``)."""
        return 0

    @property
    def batches_per_epoch(self) -> float:
        """The train dataloader's batches per epoch (``inf`` when unknown)."""
        return float("inf")

    @property
    def max_steps(self) -> int:
        """``Trainer(max_steps)``; ``-1`` without a limit."""
        return -1

    @property
    def log_every_n_steps(self) -> int:
        """``Trainer(log_every_n_steps)``."""
        return 1

    @property
    def loggers(self) -> list[Any]:
        """The Trainer's loggers (the same on every rank; each writes on rank zero only)."""
        return []

    @property
    def lr_schedulers(self) -> list[tuple[Any, str, int]]:
        """``(scheduler, interval, frequency)`` of each LR scheduler ``configure_optimizers`` returned."""
        return []

    @property
    def has_progress_bar(self) -> bool:
        """Whether the Trainer shows one of Lightning's train progress bars (TQDM or Rich)."""
        return False

    @property
    def data_parallel(self) -> DataParallel:
        """How gradients travel between ranks."""
        return DataParallel()

    def loss_scale(self) -> float | None:
        """The float16 AMP loss scale in effect (``GradScaler.get_scale()``), or ``None`` without loss scaling."""
        return None

    def set_progress_total(self, total: int) -> None:
        """Make the train progress bar count ``total`` batches this epoch (kept when the bar resets at its start)."""

    def show_in_progress_bar(self, values: dict[str, Any]) -> None:
        """Show ``values`` beside the train progress bar's count, each as ``str(value)`` writes it."""

    def print(self, text: str) -> None:
        """Print ``text`` on rank zero as a line of its own: above the train progress bar while one is drawn."""

    def reduce_gradients_elsewhere(self, elsewhere: bool) -> None:
        """Turn DDP's own gradient reduction off for whole windows (``elsewhere``), or give it back.

        Only under an :class:`~lightning_accum.AccumulationStrategyMixin` strategy wrapping the model in DDP.
        """

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the data-parallel ranks, in place (DDP's process group)."""

    def release(self) -> None:
        """Undo what the actions left in place for the fit (at its end)."""


@dataclass(eq=False)
class Context:
    """What the callback knows at an event, and what features publish for the features after them.

    The callback sets the first three groups; a feature writes only the last group, and only the fields its
    documentation names. Without a Trainer (a feature's own tests) the defaults describe one process.

    Attributes:
        world_size: Number of ranks.
        is_global_zero: Whether this is rank zero.
        can_split: Whether a loader batch can be split into parts at all (``training_step`` takes the batch, not
            ``dataloader_iter``). Set at ``SETUP``.
        reduce: ``reduce(tensor, "sum" | "mean")`` over ranks (the strategy's).
        broadcast: ``broadcast(obj)`` from rank zero to every rank (the strategy's).
        module: The LightningModule (any ``nn.Module`` in a test).
        optimizers: The optimizers, from ``FIT_START``.
        run: What the Trainer knows, read-only, and the actions a feature may ask for (:class:`Run`).
        plan: The fit's plan, from ``FIT_START``: the micro-batch size the ranks share, whether loader batches are
            split, the schedule, the planned steps and samples, where the fit starts
            (:class:`~lightning_accum.core.fit.FitPlan`; before it, one process that knows nothing yet).
        optimizer_steps: Optimizer steps taken (``trainer.global_step``), current at window events.
        samples_seen: Samples consumed by all ranks together (``micro_batch_size x world_size`` per micro-step).
        tokens_seen: Published by the token count (``unit="token"``): loss-bearing tokens consumed by all ranks.
        micro_steps: Micro-batches trained on by one rank.
        window: The window in progress.
        factor: The factor the window is opened with (the schedule's, or a feature's at ``WINDOW_OPENING``).
        factor_floor: Published at ``FIT_START`` and ``WINDOW_OPENING`` by adaptive growth: the adaptive factor in
            force (at least 1).
        lr_cap_factor: Published at ``FIT_START`` by LR scaling: the largest factor whose LR scale the rule reaches
            within ``lr_scale_max`` (``None``: no cap, or the rule ``"none"``); past it a larger batch lowers the LR
            per sample as a decay would.
        batch: The micro-batch in progress.
        batch_idx: The index in the epoch of the loader batch in progress (the loop's own).
        loss: At ``BEFORE_BACKWARD`` the tensor backward runs on (the micro-batch's loss divided by
            ``loss_divisor``, times the AMP loss scale; a feature may re-weigh it in place); at
            ``MICRO_BATCH_ENDED`` the loss ``training_step`` returned, divided by the window's size, or ``None``.
        loss_divisor: What the micro-batch's mean loss is divided by in its backward: the window's size (over the
            micro-batch's share of a split loader batch), or what a feature re-weighed it to; ``1`` when
            ``weights_in_float32``.
        weights_in_float32: Published at ``FIT_START`` by wide accumulation when it sums the window's gradients in
            float32 itself: every micro-batch then backpropagates its unscaled loss (Lightning divides by 1), and its
            weight (``micro_weight``) is applied in float32 as its gradient is added, never to the narrow loss.
        micro_weight: With ``weights_in_float32``: what the micro-batch's gradient weighs in the window's sum (set at
            ``MICRO_BATCH_STARTED`` to its share over the window's size; item weighting multiplies it by the
            micro-batch's items over the typical count at ``BEFORE_BACKWARD``).
        last_backward: Set at ``MICRO_BATCH_STARTED``: whether the micro-batch's backward is the window's last (the
            one that reduces its gradient across ranks).
        scale_in_backward: Published at ``FIT_START`` by wide accumulation under FSDP2: the window's gradient is
            reduced and rounded to the parameters' dtype inside its last backward, so ``gradient_scale`` is wanted
            before it: the shell sets it to the window's correction at ``MICRO_BATCH_STARTED``; a feature that
            replaces it at ``WINDOW_CLOSING`` replaces it at the ``BEFORE_BACKWARD`` of ``last_backward`` too, where
            wide accumulation takes it; at ``WINDOW_CLOSING`` the feature publishes the same value again.
        optimizer: The optimizer about to step (``WINDOW_CLOSING``, ``GRADIENT_READY``).
        gradient_scale: At ``WINDOW_CLOSING``: what turns the accumulated gradient into the window's mean. The
            callback sets the correction for a window cut short; a feature that weighs micro-batches otherwise
            replaces it; the callback applies it once before ``GRADIENT_READY``. A 0-d tensor where the count it
            comes from stays on the device (item weighting): never read it to the host.
        items: Published at ``MICRO_BATCH_STARTED`` by item weighting: the micro-batch's samples or tokens on this
            rank (``None`` when every micro-batch weighs the same).
        window_items: Published at ``WINDOW_CLOSING`` by item weighting: the window's items on all ranks (a 0-d
            tensor on the device between the windows it reads, see :mod:`~lightning_accum.features.item_weighting`).
        noise: Published by the noise scale at ``FIT_START`` and at each measured window's ``GRADIENT_READY``: the
            estimate after the latest measured window, with that window's batch
            (:class:`~lightning_accum.core.noise.NoiseReading`), or ``None`` before the first.
        noise_parts: Published by the noise scale at ``WINDOW_OPENED``: into how many parts each loader batch of the
            window is split, so that the window holds enough micro-batch gradients to measure (1: not split); at
            ``FIT_START``, the most it will ask for, which the coordinator reads to install the micro-batcher.
        log_every: Published at ``FIT_START`` by the metrics: the optimizer steps between two logged steps, the same
            on every rank (``0``: nothing is logged).
        metrics: Cleared before ``WINDOW_CLOSED``; each feature adds its ``accum/...`` values of the step (numbers,
            or 0-d tensors that the metrics read to the host only for a logged step).
        summary: Cleared before ``FIT_START`` and ``WINDOW_OPENED``; a feature adds a phrase for the run's summary
            (at ``FIT_START``) or for what changed with this window (at ``WINDOW_OPENED``).
    """

    world_size: int = 1
    is_global_zero: bool = True
    can_split: bool = True
    reduce: Callable[[torch.Tensor, str], torch.Tensor] = _local_reduce
    broadcast: Callable[[Any], Any] = _local_broadcast
    module: Any = None
    optimizers: list[Any] = field(default_factory=list)
    run: Run = field(default_factory=Run)

    plan: FitPlan = field(default_factory=FitPlan)
    optimizer_steps: int = 0
    samples_seen: int = 0
    tokens_seen: int = 0
    micro_steps: int = 0

    window: Window = field(default_factory=Window)
    factor: int = 1
    factor_floor: int = 1
    lr_cap_factor: int | None = None
    batch: Any = None
    batch_idx: int = 0
    loss: torch.Tensor | None = None
    loss_divisor: float | torch.Tensor = 1.0
    weights_in_float32: bool = False
    micro_weight: float | torch.Tensor = 1.0
    last_backward: bool = False
    scale_in_backward: bool = False
    optimizer: Any = None
    gradient_scale: float | torch.Tensor = 1.0

    items: Any = None
    window_items: float | torch.Tensor | None = None
    noise: NoiseReading | None = None
    noise_parts: int = 1
    log_every: int = 0
    metrics: dict[str, float | torch.Tensor] = field(default_factory=dict)
    summary: list[str] = field(default_factory=list)

    def release(self) -> None:
        """Drop every reference to the Trainer, the model, the optimizers and the last micro-batch (after fit)."""
        self.run.release()
        self.module = self.batch = self.loss = self.optimizer = None
        self.optimizers, self.run = [], Run()
        self.reduce, self.broadcast = _local_reduce, _local_broadcast

    def start(self, plan: FitPlan) -> None:
        """Begin the fit ``plan`` describes: its position, and the factor the schedule gives its first window.

        A checkpoint without lightning_accum's state resumes at the micro-steps and samples the plan counted.
        """
        self.plan, self.optimizer_steps = plan, plan.optimizer_steps
        if plan.counted is not None:
            self.micro_steps, self.samples_seen = plan.counted
        self.factor = self.scheduled_factor(plan.epoch)

    def scheduled_factor(self, epoch: int) -> int:
        """The factor the plan's schedule gives at ``epoch`` and the optimizer steps, samples or tokens counted."""
        schedule = self.plan.schedule
        assert schedule is not None, "the fit's plan holds it"
        position = {"epoch": epoch, "step": self.optimizer_steps, "sample": self.samples_seen}
        return schedule.factor_at(position.get(schedule.unit, self.tokens_seen))

    def effective_batch(self, micro_batches: int) -> int:
        """Samples in a window of ``micro_batches`` on every rank (micro-batches when the size is unknown)."""
        return (self.plan.micro_batch_size or 1) * micro_batches * self.world_size

    @property
    def samples_per_micro_step(self) -> int:
        """Samples all ranks consume together in one micro-step (0 when the micro-batch size is unknown)."""
        return (self.plan.micro_batch_size or 0) * self.world_size


class Feature:
    """One optional concern of the callback: the events it handles, its state, its metrics.

    A subclass sets :attr:`name` (its key in the checkpoint) and overrides the event methods it needs; the callback
    calls only those. Each event method takes the :class:`Context`. See ``docs/architecture.md`` for how to add one.

    Example::

        class StepCounter(Feature):
            name = "step_counter"

            def __init__(self) -> None:
                self.steps = 0

            def window_closed(self, ctx: Context) -> None:
                self.steps += 1
                ctx.metrics["accum/my_steps"] = float(self.steps)

            def state_dict(self) -> dict[str, Any]:
                return {"steps": self.steps}

            def load_state_dict(self, state: dict[str, Any]) -> None:
                self.steps = int(state.get("steps", 0))
    """

    name: ClassVar[str]

    def handles(self, event: Event) -> bool:
        """Whether this feature overrides ``event``'s method."""
        return getattr(type(self), event.value) is not getattr(Feature, event.value)

    @property
    def idle(self) -> bool:
        """Whether this fit gives the feature nothing to do at the window events (asked once, after ``FIT_START``).

        An idle feature still gets ``SETUP``, ``FIT_START`` and ``FIT_END``; the events in between skip it, which
        saves a call per event on every micro-step (e.g. wide accumulation when every parameter is float32).
        """
        return False

    def reset(self) -> None:
        """Forget the state of an earlier run: a new fit starts from optimizer step 0 (a checkpoint loads after)."""

    def setup(self, ctx: Context) -> None:
        """``SETUP``: refuse a Trainer this feature cannot run with, before any weight changes."""

    def fit_start(self, ctx: Context) -> None:
        """``FIT_START``: the run's sizes are known."""

    def epoch_started(self, ctx: Context) -> None:
        """``EPOCH_STARTED``: an epoch begins at its first batch (not for an epoch resumed in its middle)."""

    def window_opening(self, ctx: Context) -> None:
        """``WINDOW_OPENING``: a window is about to open with ``ctx.factor``, which a feature may raise."""

    def window_opened(self, ctx: Context) -> None:
        """``WINDOW_OPENED``: a window of ``ctx.window.size`` micro-steps opened."""

    def micro_batch_started(self, ctx: Context) -> None:
        """``MICRO_BATCH_STARTED``: ``ctx.batch`` is about to be trained on."""

    def before_backward(self, ctx: Context) -> None:
        """``BEFORE_BACKWARD``: backward is about to run on ``ctx.loss``."""

    def after_backward(self, ctx: Context) -> None:
        """``AFTER_BACKWARD``: the micro-batch's gradient has been added."""

    def window_closing(self, ctx: Context) -> None:
        """``WINDOW_CLOSING``: the window's gradient is complete but not yet its mean; set ``ctx.gradient_scale``."""

    def gradient_ready(self, ctx: Context) -> None:
        """``GRADIENT_READY``: the gradient is the window's mean; clipping and the optimizer step follow."""

    def micro_batch_ended(self, ctx: Context) -> None:
        """``MICRO_BATCH_ENDED``: the micro-step is over; ``ctx.loss`` is what it returned."""

    def window_closed(self, ctx: Context) -> None:
        """``WINDOW_CLOSED``: the optimizer stepped; add this step's metrics to ``ctx.metrics``."""

    def fit_end(self, ctx: Context) -> None:
        """``FIT_END``: the fit ended, normally or not; release what was attached to the model or optimizers."""

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs; stored in the checkpoint under :attr:`name`.

        New containers on every call, holding plain values (numbers, strings, ``None``): the callback keeps the state
        from a window's start as it is, to write into a checkpoint taken inside the window.
        """
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (read with defaults, so older checkpoints load)."""

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Amend the whole checkpoint being written (Lightning's dict), e.g. to keep a transient change out of it."""


_EVERY_FEATURE = (Event.SETUP, Event.FIT_START, Event.FIT_END)  # events no feature is ever left out of


class Features(Mapping[str, Feature]):
    """The enabled features by name, in dispatch order, with the handlers of each event resolved once.

    Example::

        >>> features = Features([])
        >>> features.dispatch(Event.WINDOW_CLOSED, Context()); len(features)
        0
    """

    def __init__(self, features: Iterable[Feature]) -> None:
        self._features = {feature.name: feature for feature in features}
        self._handlers = self._resolve(self._features.values())

    @staticmethod
    def _resolve(features: Iterable[Feature]) -> dict[Event, tuple[Callable[[Context], None], ...]]:
        listed = list(features)
        return {event: tuple(getattr(f, event.value) for f in listed if f.handles(event)) for event in Event}

    def settle(self) -> None:
        """Leave the features that are :attr:`~Feature.idle` for this fit out of the window events.

        Called after ``FIT_START``; the next fit's ``FIT_START`` asks again.
        """
        every = self._resolve(self._features.values())
        busy = self._resolve(feature for feature in self._features.values() if not feature.idle)
        self._handlers = {event: every[event] if event in _EVERY_FEATURE else busy[event] for event in Event}

    def dispatch(self, event: Event, ctx: Context) -> None:
        """Call every feature that handles ``event``, in order."""
        for handler in self._handlers[event]:
            handler(ctx)

    def handle(self, event: Event) -> bool:
        """Whether any feature handles ``event``."""
        return bool(self._handlers[event])

    def reset(self) -> None:
        """Reset every feature for a new run."""
        for feature in self._features.values():
            feature.reset()

    def state_dict(self) -> dict[str, dict[str, Any]]:
        """Every feature's state under its name."""
        return {name: feature.state_dict() for name, feature in self._features.items()}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Let every feature amend the checkpoint being written."""
        for feature in self._features.values():
            feature.on_save_checkpoint(checkpoint)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Give each feature its entry of ``state`` (an empty one if the checkpoint has none)."""
        for name, feature in self._features.items():
            feature.load_state_dict(dict(state.get(name, {})))

    def __getitem__(self, name: str) -> Feature:
        return self._features[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._features)

    def __len__(self) -> int:
        return len(self._features)
