"""Plot the noise scale a run logged against its effective batch: a TensorBoard run directory in, a PNG out.

python examples/plot_noise_scale.py lightning_logs/version_0 noise_scale.png
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402


def main(run: Path, out: Path) -> None:
    events = EventAccumulator(str(run), size_guidance={"scalars": 0})
    events.Reload()

    def series(tag: str) -> tuple[list[int], list[float]]:
        points = events.Scalars(tag)
        return [p.step for p in points], [p.value for p in points]

    figure, axis = plt.subplots(figsize=(7, 4))
    axis.plot(*series("accum/noise_scale"), label="noise scale B_simple (samples)")
    axis.plot(*series("accum/effective_batch_size"), label="effective batch (samples)", linestyle="--")
    axis.set_yscale("log")
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("samples")
    axis.set_title("Gradient noise scale over the main example")
    axis.legend()
    figure.tight_layout()
    figure.savefig(out, dpi=110)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
