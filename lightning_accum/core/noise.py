"""The gradient noise scale from the micro-batch gradients that accumulation computes anyway.

McCandlish, Kaplan, Amodei et al. 2018, "An Empirical Model of Large-Batch Training" (arXiv:1812.06162): the simple
noise scale ``B_simple = tr(Sigma) / |G|^2`` estimates the critical batch size, beyond which a larger batch buys
little. With ``n`` micro-gradients ``g_i`` of batch ``b`` and their mean ``g`` (batch ``n b``), let
``S_small = mean |g_i|^2`` and ``S_big = |g|^2``. Their Appendix A.1 gives unbiased estimates

    |G|^2    = (n S_big - S_small) / (n - 1)
    tr(Sigma) = b n (S_small - S_big) / (n - 1)

Micro-batches of different sizes ``b_i`` (a short last batch, token counts) generalize this: since
``E|g_i|^2 = |G|^2 + tr(Sigma) / b_i`` and ``E|g|^2 = |G|^2 + tr(Sigma) / B`` for the big batch ``B``,

    tr(Sigma) = (S_small - S_big) / (mean(1 / b_i) - 1 / B)
    |G|^2    = S_big - tr(Sigma) / B

which is the pair above when every ``b_i = b`` and ``B = n b``.

Each is noisy on one step, so each is smoothed by its own bias-corrected exponential moving average, and the noise
scale is the ratio of the two averages (the ratio of averages, not the average of ratios, as the paper advises). The
decay is per optimizer step: a measurement ``k`` steps after the previous one weighs ``1 - decay ** k`` against it,
so the averages reach back the same number of steps whether every window is measured or every tenth.

Pure: no Lightning import; :func:`window_sums` adds up a measured window's squared norms (over the ranks too), and
:class:`NoiseScaleEstimator` takes the two squared norms of each measured step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

import torch


@dataclass(frozen=True)
class NoiseScaleEstimate:
    """The smoothed estimates after an update, and how much evidence stands behind them.

    Attributes:
        grad_sq: ``|G|^2``, the squared norm of the true gradient.
        trace: ``tr(Sigma)``, the per-sample gradient variance summed over parameters, in the batch's unit.
        noise_scale: ``trace / grad_sq`` (the critical batch, in samples or tokens); ``None`` while the smoothed
            ``grad_sq`` is not positive.
        measurements: The effective number of measured steps behind the averages (Kish's ``(sum w)^2 / sum w^2`` of
            their weights): 1 after the first, growing towards ``(1 + decay^k) / (1 - decay^k)`` when every ``k``-th
            step is measured.
        grad_sq_var: The variance of the ``grad_sq`` average, from the scatter of the measurements around it (``nan``
            with fewer than 2 effective measurements).
        trace_var: The same for ``trace``.
        covariance: The covariance of the two averages (``nan`` with fewer than 2 effective measurements).
    """

    grad_sq: float
    trace: float
    noise_scale: float | None
    measurements: float = 0.0
    grad_sq_var: float = math.nan
    trace_var: float = math.nan
    covariance: float = math.nan

    def interval(self, confidence: float) -> tuple[float, float] | None:
        """Bounds that each hold the noise scale with probability ``confidence`` (one-sided), or ``None``.

        ``None`` where there is no scatter to judge from (fewer than 2 effective measurements), and where the
        ``grad_sq`` or ``trace`` average is below 0 by more than ``z`` standard errors: neither can be negative, so such
        measurements contradict each other (the averages lag a fast-moving gradient) and say nothing to act on.
        Otherwise Fieller's interval for a ratio of two correlated means (Fieller 1954): the set of ``rho`` for which
        ``trace - rho x grad_sq`` is within ``z`` standard errors of 0, ``z`` the quantile of Student's t with
        ``measurements - 1`` degrees of freedom (the scatter is itself estimated from those measurements). Where
        ``grad_sq`` is within ``z`` standard errors of 0 the upper bound is infinite, and a ``grad_sq`` average at or
        below 0 (noise larger than the gradient) still gives a lower bound.

        Example::

            >>> estimate = NoiseScaleEstimate(1.0, 32.0, 32.0, 10.0, grad_sq_var=0.01, trace_var=4.0, covariance=0.0)
            >>> low, high = estimate.interval(0.9)
            >>> round(low, 1), round(high, 1)
            (27.3, 37.9)
        """
        if not (self.measurements >= 2 and math.isfinite(self.grad_sq_var) and math.isfinite(self.trace_var)):
            return None
        z = t_quantile(confidence, self.measurements - 1)
        g, t, z2 = self.grad_sq, self.trace, z * z
        a = g * g - z2 * self.grad_sq_var
        half_b = t * g - z2 * self.covariance
        c = t * t - z2 * self.trace_var
        disc = half_b * half_b - a * c
        if (a > 0 and g < 0) or (c > 0 and t < 0):  # grad_sq or trace clearly below 0
            return None
        if a > 0:  # grad_sq clearly above 0: a bounded interval
            root = math.sqrt(max(disc, 0.0))
            return max(0.0, (half_b - root) / a), (half_b + root) / a
        # grad_sq may be 0: the ratio may be arbitrarily large; the set is (-inf, r1] U [r2, inf) or everything, and
        # holds 0 where the trace may be 0 too (c <= 0): then nothing bounds the ratio from below
        low = (half_b - math.sqrt(disc)) / a if disc > 0 and a < 0 and c > 0 else 0.0
        return max(0.0, low), math.inf


def t_quantile(probability: float, dof: float) -> float:
    """The ``probability`` quantile (above 0.5) of Student's t with ``dof`` degrees of freedom (at least 1).

    Hill's algorithm (G. W. Hill, "Algorithm 396: Student's t-quantiles", Communications of the ACM 13, 1970), for
    real degrees of freedom: within 1e-6 of the exact quantile.

    Example::

        >>> round(t_quantile(0.9, 2), 4), round(t_quantile(0.99, 3), 4), round(t_quantile(0.9, 1e9), 4)
        (1.8856, 4.5407, 1.2816)
    """
    n, tails = max(float(dof), 1.0), 2.0 * (1.0 - probability)  # Hill's algorithm takes both tails' probability
    if n == 1.0:
        return 1.0 / math.tan(tails * math.pi / 2)
    if n == 2.0:
        return math.sqrt(2.0 / (tails * (2.0 - tails)) - 2.0)
    a = 1.0 / (n - 0.5)
    b = 48.0 / a**2
    c = ((20700.0 * a / b - 98.0) * a - 16.0) * a + 96.36
    d = ((94.5 / (b + c) - 3.0) / b + 1.0) * math.sqrt(a * math.pi / 2) * n
    y = (d * tails) ** (2.0 / n)
    if y > 0.05 + a:  # the normal quantile, corrected (Cornish-Fisher-like)
        x = NormalDist().inv_cdf(tails / 2)
        y = x * x
        if n < 5:
            c += 0.3 * (n - 4.5) * (x + 0.6)
        c = (((0.05 * d * x - 5.0) * x - 7.0) * x - 2.0) * x + b + c
        y = (((((0.4 * y + 6.3) * y + 36.0) * y + 94.5) / c - y - 3.0) / b + 1.0) * x
        y = math.expm1(a * y * y)
    else:  # far in the tail, few degrees of freedom: an asymptotic series
        y = ((1 / (((n + 6) / (n * y) - 0.089 * d - 0.822) * (n + 2) * 3) + 0.5 / (n + 4)) * y - 1) * (n + 1) / (
            n + 2
        ) + 1 / y
    return math.sqrt(n * y)


@dataclass(frozen=True)
class NoiseMeasurement:
    """What one measured window gave the estimator (:meth:`NoiseScaleEstimator.update`'s arguments).

    Attributes:
        small_sq: The mean squared norm of the micro-batch gradients (each of its micro-batch's mean loss), over the
            micro-batches that hold items, on every rank.
        big_sq: The squared norm of the window's gradient, as the optimizer gets it.
        inverse_small_batch: ``mean(1 / b_i)`` over those micro-batches, ``b_i`` their samples or tokens.
        big_batch: The items the window's gradient is the mean over.
        micro_batches: The micro-batches behind ``small_sq``.
    """

    small_sq: float
    big_sq: float
    inverse_small_batch: float
    big_batch: float
    micro_batches: int


@dataclass(frozen=True)
class NoiseReading:
    """The noise scale as a measured window left it, for what acts on it (adaptive growth).

    Attributes:
        estimate: The smoothed estimate after the window.
        items: The window's items (samples or tokens) on all ranks, in the estimate's unit.
        micro_steps: The window's micro-steps (loader batches on one rank): ``items / micro_steps`` is the batch one
            unit of factor holds.
        step: The optimizer step the window ended in (1 for the first step).
        evidence: With adaptive growth: the same measurements averaged per measured window rather than per step (so
            that a decision stands on as many measurements however sparsely windows are measured); else ``None``.
    """

    estimate: NoiseScaleEstimate
    items: float
    micro_steps: int
    step: int
    evidence: NoiseScaleEstimate | None = None


class NoiseScaleEstimator:
    """Bias-corrected moving averages of ``|G|^2`` and ``tr(Sigma)``, decaying per optimizer step, and their scatter.

    Besides the two averages it keeps the averages of their squares and product and the sum of the squared weights,
    so that each estimate says how many measurements stand behind it and how far it may be off
    (:meth:`NoiseScaleEstimate.interval`).

    Args:
        decay: The moving averages' decay per optimizer step, in ``[0, 1)``; ``0`` keeps only the latest measurement.

    Raises:
        ValueError: If ``decay`` is outside ``[0, 1)``.

    Example::

        >>> estimator = NoiseScaleEstimator(decay=0.0)
        >>> # 4 micro-batches of 8: mean squared micro-gradient norm 5.0, squared norm of their mean 2.0
        >>> estimate = estimator.update(small_sq=5.0, big_sq=2.0, inverse_small_batch=1 / 8, big_batch=32)
        >>> estimate.grad_sq, estimate.trace, estimate.noise_scale, estimate.measurements
        (1.0, 32.0, 32.0, 1.0)
    """

    _MOMENTS = ("grad_sq", "trace", "grad_sq2", "trace2", "product")

    def __init__(self, decay: float = 0.95) -> None:
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 <= decay < 1.0:
            raise ValueError(f"`noise_scale_decay` must be a number in [0, 1), got {decay!r}")
        self.decay = float(decay)
        self._sums = dict.fromkeys(self._MOMENTS, 0.0)  # weighted sums of each measurement's moments
        self._weight = 0.0  # what the averages' weights add up to: the bias correction
        self._weight_sq = 0.0  # the sum of the squared weights: how many measurements they amount to
        self._updates = 0

    def update(
        self, small_sq: float, big_sq: float, inverse_small_batch: float, big_batch: float, steps: int = 1
    ) -> NoiseScaleEstimate | None:
        """Fold in one measured optimizer step.

        Args:
            small_sq: Mean squared norm of the micro-batch gradients (each the gradient of its micro-batch's mean).
            big_sq: Squared norm of the step's gradient, the gradient of the mean over the big batch.
            inverse_small_batch: ``mean(1 / b_i)`` over the micro-batches, ``b_i`` their items (samples or tokens).
            big_batch: Items in the big batch.
            steps: Optimizer steps since the previous measurement: the averages decay by ``decay ** steps``.

        Returns:
            The smoothed estimates, or ``None`` when the step carries no information (one micro-batch only) or a
            non-finite value (a step that AMP's loss scaler skips), which is left out.
        """
        if not (math.isfinite(small_sq) and math.isfinite(big_sq)) or big_batch <= 0:
            return None
        spread = inverse_small_batch - 1.0 / big_batch
        if spread <= 1e-12 * inverse_small_batch:
            return None
        trace = (small_sq - big_sq) / spread
        grad_sq = big_sq - trace / big_batch
        kept = self.decay ** max(1, steps)
        new = 1.0 - kept
        moments = {"grad_sq": grad_sq, "trace": trace, "grad_sq2": grad_sq**2, "trace2": trace**2}
        moments["product"] = grad_sq * trace
        for name, value in moments.items():
            self._sums[name] = kept * self._sums[name] + new * value
        self._weight = kept * self._weight + new
        self._weight_sq = kept * kept * self._weight_sq + new * new
        self._updates += 1
        return self.estimate

    @property
    def estimate(self) -> NoiseScaleEstimate:
        """The current bias-corrected estimates, with their effective number of measurements and variances."""
        if not self._updates:
            return NoiseScaleEstimate(0.0, 0.0, None)
        mean = {name: total / self._weight for name, total in self._sums.items()}
        grad_sq, trace = mean["grad_sq"], mean["trace"]
        measurements = self._weight**2 / self._weight_sq if self._weight_sq > 0 else 0.0
        variances = (math.nan, math.nan, math.nan)
        if measurements >= 2:
            # the scatter of the measurements (reliability weights), over the measurements: a mean's variance
            scale = 1.0 / (measurements - 1.0)
            variances = (
                max(mean["grad_sq2"] - grad_sq**2, 0.0) * scale,
                max(mean["trace2"] - trace**2, 0.0) * scale,
                (mean["product"] - grad_sq * trace) * scale,
            )
        noise_scale = trace / grad_sq if grad_sq > 0 else None
        return NoiseScaleEstimate(grad_sq, trace, noise_scale, measurements, *variances)

    def state_dict(self) -> dict[str, float]:
        """The moving averages, for checkpoints."""
        return {**self._sums, "weight": self._weight, "weight_sq": self._weight_sq, "updates": float(self._updates)}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore what :meth:`state_dict` saved (a checkpoint without the second moments has no scatter yet)."""
        self._updates = int(state.get("updates", 0))
        self._weight = float(state.get("weight", 1.0 - self.decay**self._updates))
        self._sums = {name: float(state.get(name, 0.0)) for name in self._MOMENTS}
        if "weight_sq" not in state:  # an older checkpoint: the averages count as one measurement, with no scatter
            weight = self._weight or 1.0
            self._sums["grad_sq2"], self._sums["trace2"] = (
                self._sums["grad_sq"] ** 2 / weight,
                self._sums["trace"] ** 2 / weight,
            )
            self._sums["product"] = self._sums["grad_sq"] * self._sums["trace"] / weight
        self._weight_sq = float(state.get("weight_sq", self._weight**2))


def window_sums(
    backwards: list[tuple[int, Any, Any]],
    parts: bool,
    entries: list[torch.Tensor],
    first_mean: int,
    reduce: Callable[[torch.Tensor, str], torch.Tensor] | None = None,
    window_items: torch.Tensor | None = None,
    sharded: bool = False,
) -> list[float]:
    """A measured window's sums, over the ranks: ``[sum |g_i|^2, bearing, sum 1 / b_i, micro-batches, parts, |g|^2]``.

    ``window_items``, a tensor of the window's items already summed over the ranks, is read with them (last).
    ``sharded``: each rank holds a shard of the step's gradient (FSDP2), whose squares are summed over the ranks too.

    ``bearing`` counts the micro-batches with items, ``parts`` the ranks where a gradient came in parts.
    ``backwards`` holds ``(first entry, loss divisor, items)`` of each micro-batch's backward, ``parts`` whether a
    gradient reached its hook in parts in one of them.

    ``entries`` holds each backward's squared gradients, from its first entry on, then from ``first_mean`` the step's.
    ``g_i`` is micro-batch ``i``'s gradient of its mean loss (its backward's, times its loss divisor); only the
    micro-batches that hold items count in the first three. All but the last summed over the ranks: one all-reduce
    with ``reduce(tensor, "sum")`` on several ranks, and one read to the host.
    """
    device = entries[0].device if entries else torch.device("cpu")
    dtype = torch.float32 if device.type == "mps" else torch.float64
    squared = torch.stack(entries).to(dtype) if entries else torch.zeros(0, dtype=dtype, device=device)
    local = torch.zeros(6, dtype=dtype, device=device)
    if backwards:
        firsts = [first for first, _, _ in backwards]
        sizes = [end - first for first, end in zip(firsts, [*firsts[1:], first_mean], strict=True)]
        owner = torch.repeat_interleave(torch.arange(len(sizes), device=device), torch.tensor(sizes, device=device))
        squares = torch.zeros(len(sizes), dtype=dtype, device=device).index_add_(0, owner, squared[:first_mean])

        def column(values: list[Any]) -> torch.Tensor:
            if all(isinstance(v, (int, float)) for v in values):  # host numbers: one tensor, not one per value
                return torch.tensor(values, dtype=dtype, device=device)
            return torch.stack([torch.as_tensor(v, device=device).to(dtype).reshape(()) for v in values])

        divisors, items = column([d for _, d, _ in backwards]), column([n for _, _, n in backwards])
        bearing = (items > 0).to(dtype)
        local[0] = (squares * divisors.square() * bearing).sum()
        local[1] = bearing.sum()
        local[2] = (bearing / items.clamp(min=1e-12)).sum()
        local[3] = len(backwards)
    local[4] = float(parts)
    big = squared[first_mean:].sum().reshape(1)
    if sharded:  # each rank squared its shard of the step's gradient: summed with the rest
        local[5] = big[0]
    if reduce is not None:
        local = reduce(local, "sum")
    read = [local[:5], local[5:] if sharded else big]
    if window_items is not None:
        read.append(window_items.detach().to(device=device, dtype=dtype).reshape(1))
    return torch.cat(read).tolist()
