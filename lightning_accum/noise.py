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

Pure: no Lightning import; :class:`NoiseScaleEstimator` takes the two squared norms of each measured step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class NoiseScaleEstimate:
    """The smoothed estimates after an update.

    Attributes:
        grad_sq: ``|G|^2``, the squared norm of the true gradient.
        trace: ``tr(Sigma)``, the per-sample gradient variance summed over parameters, in the batch's unit.
        noise_scale: ``trace / grad_sq`` (the critical batch, in samples or tokens); ``None`` while the smoothed
            ``grad_sq`` is not positive.
    """

    grad_sq: float
    trace: float
    noise_scale: float | None


class NoiseScaleEstimator:
    """Bias-corrected moving averages of ``|G|^2`` and ``tr(Sigma)``, decaying per optimizer step.

    Args:
        decay: The moving averages' decay per optimizer step, in ``[0, 1)``; ``0`` keeps only the latest measurement.

    Raises:
        ValueError: If ``decay`` is outside ``[0, 1)``.

    Example::

        >>> estimator = NoiseScaleEstimator(decay=0.0)
        >>> # 4 micro-batches of 8: mean squared micro-gradient norm 5.0, squared norm of their mean 2.0
        >>> estimate = estimator.update(small_sq=5.0, big_sq=2.0, inverse_small_batch=1 / 8, big_batch=32)
        >>> estimate.grad_sq, estimate.trace, estimate.noise_scale
        (1.0, 32.0, 32.0)
    """

    def __init__(self, decay: float = 0.95) -> None:
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 <= decay < 1.0:
            raise ValueError(f"`noise_scale_decay` must be a number in [0, 1), got {decay!r}")
        self.decay = float(decay)
        self._grad_sq = 0.0
        self._trace = 0.0
        self._weight = 0.0  # what the averages' weights add up to: the bias correction
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
        self._grad_sq = kept * self._grad_sq + (1.0 - kept) * grad_sq
        self._trace = kept * self._trace + (1.0 - kept) * trace
        self._weight = kept * self._weight + (1.0 - kept)
        self._updates += 1
        return self.estimate

    @property
    def estimate(self) -> NoiseScaleEstimate:
        """The current bias-corrected estimates."""
        correction = self._weight if self._updates else 1.0
        grad_sq, trace = self._grad_sq / correction, self._trace / correction
        return NoiseScaleEstimate(grad_sq, trace, trace / grad_sq if grad_sq > 0 else None)

    def state_dict(self) -> dict[str, float]:
        """The moving averages, for checkpoints."""
        return {"grad_sq": self._grad_sq, "trace": self._trace, "weight": self._weight, "updates": float(self._updates)}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore what :meth:`state_dict` saved."""
        self._grad_sq = float(state.get("grad_sq", 0.0))
        self._trace = float(state.get("trace", 0.0))
        self._updates = int(state.get("updates", 0))
        self._weight = float(state.get("weight", 1.0 - self.decay**self._updates))
