"""Short fits with Lightning's progress bars, as a user runs them on a terminal.

    python tests/scripts/console_fit.py tqdm rich auto    # one fit per name, each after a line `== <name> ==`

``tqdm`` and ``rich``: nine micro-batches of 4 samples under that bar: two windows of factor 2, then (from optimizer
step 2) a window of factor 4 and the epoch's last window, cut short to one micro-batch. ``auto``: the TQDM bar over
``micro_batch_size="auto"`` with a model that runs out of memory above 4 rows, so the first loader batch of 16 is
retried with micro-batches of 8, then 4. ``tests/test_console.py`` runs it on a pseudo-terminal and reads the screen it
leaves: the summary, the factor-change and out-of-memory lines, the bar's ``factor`` and ``eff_batch``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lightning_accum import AccumulationScheduler  # noqa: E402
from tests.helpers import RegressionModule, loader, make_data, trainer  # noqa: E402


class OutOfMemoryAbove4(RegressionModule):
    """Raises torch.OutOfMemoryError for more than 4 rows, as the CUDA allocator would."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if len(batch[0]) > 4:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {len(batch[0])} rows")
        return super().training_step(batch, batch_idx)


if __name__ == "__main__":
    x, y = make_data(36)
    for name in sys.argv[1:]:
        print(f"== {name} ==", flush=True)
        if name == "auto":
            callback, bar = AccumulationScheduler({0: 2}, micro_batch_size="auto"), TQDMProgressBar()
            module, batch_size = OutOfMemoryAbove4(), 16
        else:
            callback = AccumulationScheduler({0: 2, 2: 4}, unit="step")
            bar = TQDMProgressBar() if name == "tqdm" else RichProgressBar()
            module, batch_size = RegressionModule(), 4
        trainer([callback, bar], max_epochs=1, enable_progress_bar=True).fit(module, loader(x, y, batch_size))
