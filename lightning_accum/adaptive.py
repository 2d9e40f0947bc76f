"""Adaptive accumulation: grow the factor when the measured noise scale says a larger batch pays.

McCandlish et al. 2018 find that training is most efficient (in both steps and samples) near the critical batch
``B_crit``, which the simple noise scale ``B_simple`` estimates, and that the noise scale grows as the loss falls.
This policy doubles the accumulation factor whenever ``target x B_simple`` has reached at least twice the current
effective batch on ``patience`` consecutive checks: power-of-two factors, increases only, never above
``max_factor``. Pure: no Lightning import; the callback evaluates it every ``interval`` optimizer steps on rank zero
and broadcasts the decision so that every rank takes the same one.
"""

from __future__ import annotations

import math
from typing import Any

from lightning_accum.schedule import check_int


class AdaptiveFactor:
    """Decide, from the noise scale, when to double the accumulation factor.

    Args:
        target: The wanted effective batch as a multiple of the noise scale (``B* = target x B_simple``).
        max_factor: The largest factor the policy may reach.
        interval: Optimizer steps between two checks.
        patience: Consecutive checks that must call for growth before the factor doubles (hysteresis against a
            noisy estimate).

    Raises:
        TypeError: If an integer argument is not an integer.
        ValueError: If ``target`` is not positive, or an integer argument is below 1.

    Example::

        >>> policy = AdaptiveFactor(target=1.0, max_factor=8, interval=10, patience=2)
        >>> policy.propose(factor=2, effective_batch=32, noise_scale=100.0)  # B* >= 64 once: wait
        2
        >>> policy.propose(factor=2, effective_batch=32, noise_scale=100.0)  # twice: double
        4
    """

    def __init__(self, target: float = 1.0, max_factor: int = 64, interval: int = 50, patience: int = 2) -> None:
        if isinstance(target, bool) or not isinstance(target, (int, float)) or not 0 < target < math.inf:
            raise ValueError(f"`adaptive_target` must be a positive finite number, got {target!r}")
        self.target = float(target)
        self.max_factor = check_int("adaptive_max_factor", max_factor, minimum=1)
        self.interval = check_int("adaptive_interval", interval, minimum=1)
        self.patience = check_int("adaptive_patience", patience, minimum=1)
        self._votes = 0

    def due(self, optimizer_steps: int) -> bool:
        """Whether a check is due before the window that starts at ``optimizer_steps``."""
        return optimizer_steps > 0 and optimizer_steps % self.interval == 0

    def propose(self, factor: int, effective_batch: float, noise_scale: float | None) -> int:
        """The factor to use from now on: ``factor``, or ``2 x factor`` once growth has been called for long enough."""
        if noise_scale is None or 2 * factor > self.max_factor:
            self._votes = 0
            return factor
        if self.target * noise_scale >= 2 * effective_batch:
            self._votes += 1
        else:
            self._votes = 0
        if self._votes >= self.patience:
            self._votes = 0
            return 2 * factor
        return factor

    def state_dict(self) -> dict[str, Any]:
        """The hysteresis counter, for checkpoints."""
        return {"votes": self._votes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        self._votes = int(state.get("votes", 0))
