"""Wide accumulation (``grad_accum_dtype``): a window of bfloat16 gradients summed in float32, rounded once.

Where the gradients are narrower than ``grad_accum_dtype`` (``bf16-true``, ``16-true``, FSDP2 with a bfloat16
``param_dtype``), this feature makes the window's gradient the correctly rounded mean of its micro-batch gradients:

- one device: every micro-batch backpropagates its unscaled loss (``ctx.weights_in_float32``: Lightning divides by
  1), and its gradient is moved into a float32 buffer, times its weight (``ctx.micro_weight``: 1 / the window's size,
  a split batch's share, the item weight), before the next backward
  (:class:`~lightning_accum.core.precision.WideAccumulator`; ``on_after_backward`` hooks see the micro-batch's own
  gradient); the window's sum is written back once before the step, for every trainable parameter (float32 ones too:
  their weights must not be applied to a narrow loss either);
- DDP (:class:`~lightning_accum.DDPAccumulationStrategy`): the same, with DDP's own
  reduction off for the whole window and given back at its end (``ctx.run.reduce_gradients_elsewhere``), and the
  float32 sums all-reduced once per window (``ctx.run.all_reduce_sum``; float32 communication: twice the bytes of
  bfloat16);
- FSDP2 (``fully_shard``): the units' reduce dtype is widened, so FSDP2 itself keeps the unreduced gradients of
  ``gradient_sync="last"`` in float32 and reduce-scatters them in float32, casting each shard once; where the units
  compute narrower gradients, every micro-batch backpropagates its unscaled loss too, and its unsharded gradient is
  moved into FSDP2's float32 sum times its weight as autograd writes it, and the window's scale multiplies the reduced
  float32 shards inside the window's last backward, before their one rounding
  (:class:`~lightning_accum.distributed.fsdp2_precision.FSDP2Weights`; ``ctx.scale_in_backward``).

Publishes ``ctx.weights_in_float32`` and ``ctx.scale_in_backward`` (``FIT_START``); reads ``ctx.micro_weight`` and,
at the window's last backward under FSDP2, ``ctx.gradient_scale`` (``BEFORE_BACKWARD``). Consumes
``ctx.gradient_scale`` at ``WINDOW_CLOSING`` where it accumulates: the scale is applied in float32 before the one
rounding, and to the gradients of the parameters it does not hold.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_accum.core.events import Context, DataParallel, Feature
from lightning_accum.core.precision import WideAccumulator, narrower, scale_in_place
from lightning_accum.distributed.fsdp2_precision import FSDP2Weights, computes_narrower, widen_reduce_dtype


class WideAccumulation(Feature):
    """Accumulate the window's gradients in ``dtype`` where the parameters are narrower.

    Args:
        dtype: The accumulation dtype (``torch.float32``), from
            :func:`~lightning_accum.core.precision.check_grad_accum_dtype`.
        strict: Raise where the strategy cannot accumulate in ``dtype`` (the user asked for it); else warn and
            accumulate in the parameters' dtype there (``grad_accum_dtype="auto"``).

    Example::

        >>> from lightning_accum.core.events import Event, Features
        >>> from lightning_accum.core.window import Window
        >>> net = torch.nn.Linear(2, 1, bias=False).to(torch.bfloat16)
        >>> features = Features([WideAccumulation(torch.float32)])
        >>> ctx = Context(module=net, window=Window(size=3, taken=0, closed=False))
        >>> features.dispatch(Event.FIT_START, ctx); features.dispatch(Event.WINDOW_OPENED, ctx)
        >>> for value in (1.0, 2.0**-8, 2.0**-8):
        ...     features.dispatch(Event.BEFORE_BACKWARD, ctx)  # the previous micro-batch's gradient moves out
        ...     net.weight.grad = torch.full((1, 2), value, dtype=torch.bfloat16)  # this one's backward
        >>> features.dispatch(Event.WINDOW_CLOSING, ctx); net.weight.grad.float().tolist()
        [[1.0078125, 1.0078125]]
    """

    name = "wide_accumulation"

    def __init__(self, dtype: torch.dtype, strict: bool = True) -> None:
        self.dtype = dtype
        self.strict = strict
        self._accumulator: WideAccumulator | None = None
        self._reduces = False  # whether this feature all-reduces the window's sums, DDP's own reduction off
        self._restore: Any = None  # gives FSDP2 its reduce dtypes back
        self._weights: FSDP2Weights | None = None  # FSDP2: each micro-batch weighed as its gradient accumulates
        self._active = False  # whether the window in progress accumulates here
        self._weight: float | torch.Tensor = 1.0  # the weight of the gradient that moves next

    @override
    def fit_start(self, ctx: Context) -> None:
        self._release(ctx)
        parallel = ctx.run.data_parallel
        narrow = self._narrow(ctx)
        name = _name(self.dtype)
        fsdp2 = parallel.wrapper == "fsdp2"
        try:
            if fsdp2:
                self._check_fsdp2(parallel, narrow)
            elif narrow and parallel.wrapper == "deepspeed":
                raise ValueError(
                    f"DeepSpeed (ZeRO stage {parallel.zero_stage}) accumulates the gradients of {narrow[0].dtype}"
                    " parameters itself, in the dtype of its config's `data_types.grad_accum_dtype` (DeepSpeed takes"
                    " fp32 there for bf16 parameters at ZeRO stage 1 only): set grad_accum_dtype=None here"
                )
            elif narrow and parallel.wrapper in ("ddp", "fsdp1"):
                self._check_ddp(parallel)
                self._reduces = True
        except ValueError as error:
            if self.strict:
                raise
            rank_zero_warn(f"{ctx.run.owner}: gradients are accumulated in {narrow[0].dtype}: {error}")
            return
        if fsdp2:
            self._restore = widen_reduce_dtype(ctx.module, self.dtype)
            if not computes_narrower(ctx.module, self.dtype):  # gradients as wide as the sums: nothing to weigh
                ctx.summary.append(f"FSDP2 reduces and accumulates gradients in {name}")
                return
            # each micro-batch's unscaled gradient weighed in the wide dtype as FSDP2 accumulates it; with one
            # reduction per window ("last"), the window's scale applied to the reduced shards before their rounding
            self._weights = FSDP2Weights(ctx.module, self.dtype)
            ctx.scale_in_backward = parallel.gradient_sync == "last"
            ctx.summary.append(f"FSDP2 weighs, reduces and accumulates gradients in {name}")
        elif not narrow:
            return
        self._accumulator = self._build(ctx)
        ctx.weights_in_float32 = True  # the losses are backpropagated unscaled: weighed here, in the wide dtype
        if self._accumulator is not None:
            ctx.summary.append(f"gradients accumulated in {name} (+{self._accumulator.nbytes / 2**20:.1f} MiB)")

    def _narrow(self, ctx: Context) -> list[torch.Tensor]:
        return [p for p in ctx.module.parameters() if p.requires_grad and narrower(p.dtype, self.dtype)]

    def _covered(self, ctx: Context) -> list[torch.Tensor]:
        # every trainable parameter (the losses are backpropagated unscaled, so the float32 ones are weighed here too,
        # and under DDP its own reduction is off for the window) but those FSDP2 weighs as it accumulates them
        managed = set() if self._weights is None else {id(p) for p in self._weights.params}
        return [p for p in ctx.module.parameters() if p.requires_grad and id(p) not in managed]

    def _build(self, ctx: Context) -> WideAccumulator | None:
        covered = self._covered(ctx)
        return WideAccumulator(covered, self.dtype) if covered or self._weights is None else None

    def _check_fsdp2(self, parallel: DataParallel, narrow: list[torch.Tensor]) -> None:
        policy = parallel.gradient_sync or "every"  # a stock strategy reduce-scatters every micro-step
        if narrow and policy != "last":
            raise ValueError(
                f"grad_accum_dtype={_name(self.dtype)!r} with FSDP2 sharded parameters in {narrow[0].dtype}: with"
                f" gradient_sync={policy!r} FSDP2 casts every micro-step's reduced gradient to the parameters' dtype"
                " before it can be accumulated. Use ModelParallelAccumulationStrategy(gradient_sync='last'), keep"
                " float32 sharded parameters (`MixedPrecisionPolicy(param_dtype=torch.bfloat16)`), or set"
                " grad_accum_dtype=None to accumulate in the parameters' dtype"
            )

    def _check_ddp(self, parallel: DataParallel) -> None:
        name = _name(self.dtype)
        if parallel.wrapper == "fsdp1":
            raise ValueError(
                f"grad_accum_dtype={name!r} is not supported with FSDP1 ({parallel.strategy}): use FSDP2"
                " (ModelParallelAccumulationStrategy) or grad_accum_dtype=None"
            )
        if parallel.gradient_sync is None:
            raise ValueError(
                f"grad_accum_dtype={name!r} under {parallel.strategy}: DDP would all-reduce only each window's"
                " last micro-batch gradient, in the parameters' dtype. Use lightning_accum.DDPAccumulationStrategy"
                " (it all-reduces the float32 sums once per window), or set grad_accum_dtype=None"
            )
        if parallel.static_graph:
            raise ValueError(
                f"grad_accum_dtype={name!r} with DDP(static_graph=True): the float32 sums are all-reduced by the"
                " callback, so DDP's own reduction is off for whole windows, which a static graph does not allow."
                " Set static_graph=False, or grad_accum_dtype=None"
            )

    @property
    @override
    def idle(self) -> bool:
        return self._accumulator is None and not self._reduces and self._restore is None

    @override
    def window_opened(self, ctx: Context) -> None:
        if self._weights is not None:
            self._weights.disarm()  # a window abandoned before its last backward
        if self._accumulator is not None:
            covered = self._covered(ctx)
            if [id(p) for p in covered] != [id(p) for p in self._accumulator.params]:
                # parameters were frozen or unfrozen (a backbone fine-tuning)
                self._accumulator = WideAccumulator(covered, self.dtype)
        # every window, one backward's too: its unscaled gradient is weighed here
        self._active = self._accumulator is not None
        self._weight = 1.0
        if self._reduces:
            ctx.run.reduce_gradients_elsewhere(self._active)
        if self._active:
            assert self._accumulator is not None
            self._accumulator.zero()

    @override
    def before_backward(self, ctx: Context) -> None:
        if self._weights is not None:  # FSDP2: weighed as autograd writes it, before any hook sees it
            self._weights.watch()
            self._weights.weight = ctx.micro_weight
            if ctx.last_backward and ctx.scale_in_backward:
                self._weights.arm(ctx.gradient_scale)
        # the previous micro-batch's gradient moves into the buffers now, not right after its backward: every
        # on_after_backward hook (the LightningModule's, other callbacks') sees the micro-batch's own gradient
        if self._active:
            assert self._accumulator is not None
            self._accumulator.add(self._weight)
            self._weight = ctx.micro_weight  # this micro-batch's, for when its gradient moves

    @override
    def window_closing(self, ctx: Context) -> None:
        scaled = self._weights is not None and self._weights.disarm()  # FSDP2 applied the scale before rounding
        if not self._active and not scaled:
            return  # the shell scales every gradient
        done: set[int] = set()  # the parameters whose gradient holds the scale
        if self._active:
            accumulator = self._accumulator
            assert accumulator is not None
            accumulator.add(self._weight)  # the window's last micro-batch
            if self._reduces:
                accumulator.reduce(ctx.run.all_reduce_sum, ctx.world_size)
                ctx.run.reduce_gradients_elsewhere(False)  # DDP's own again until the next window: a backward between
            accumulator.write(ctx.gradient_scale)  # the scale in float32, then the one rounding
            done = {id(p) for p in accumulator.params}
        if scaled:
            assert self._weights is not None
            done |= {id(p) for p in self._weights.params}
        if ctx.optimizer is not None:  # parameters accumulated in place, as usual
            rest = [
                p.grad
                for group in ctx.optimizer.param_groups
                for p in group["params"]
                if p.grad is not None and id(p) not in done
            ]
            scale_in_place(rest, ctx.gradient_scale)
        ctx.gradient_scale = 1.0

    @override
    def fit_end(self, ctx: Context) -> None:
        self._release(ctx)

    def _release(self, ctx: Context) -> None:
        if self._reduces:
            ctx.run.reduce_gradients_elsewhere(False)
        if self._weights is not None:
            self._weights.remove()
        if self._restore is not None:
            self._restore()
        self._accumulator = self._restore = self._weights = None
        self._active = self._reduces = ctx.weights_in_float32 = ctx.scale_in_backward = False


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
