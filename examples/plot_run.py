"""Plot a run's accumulation dashboard and its noise scale: a TensorBoard run directory in, two PNGs out.

    python examples/plot_run.py lightning_logs/version_0 docs/img

writes ``dashboard.png`` (the Custom Scalars charts the callback sets up, as one figure) and ``noise_scale.png``
(the noise scale against the effective batch). Needs matplotlib.
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

CHARTS = [
    ("factor and effective batch", ["accum/factor", "accum/effective_batch_size"], "log"),
    ("learning rate as used", ["accum/lr"], "linear"),
    ("window loss", ["accum/window_loss"], "linear"),
    ("throughput (samples/s)", ["accum/samples_per_second"], "linear"),
    ("memory (MiB)", ["accum/memory_rss_mb", "accum/memory_allocated_mb", "accum/memory_peak_mb"], "linear"),
    ("noise scale and effective batch", ["accum/noise_scale", "accum/effective_batch_size"], "log"),
]


def main(run: Path, out: Path) -> None:
    events = EventAccumulator(str(run), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])

    def series(tag: str) -> tuple[list[int], list[float]]:
        points = events.Scalars(tag)
        return [p.step for p in points], [p.value for p in points]

    out.mkdir(parents=True, exist_ok=True)
    figure, axes = plt.subplots(2, 3, figsize=(14, 7))
    for axis, (title, chart_tags, scale) in zip(axes.flat, CHARTS, strict=True):
        for tag in chart_tags:
            if tag in tags:
                axis.plot(*series(tag), label=tag.removeprefix("accum/"))
        axis.set_title(title)
        axis.set_yscale(scale)
        axis.set_xlabel("optimizer step")
        axis.legend(fontsize=8)
    figure.suptitle("accum/ metrics of the main example (TensorBoard's Custom Scalars charts)")
    figure.tight_layout()
    figure.savefig(out / "dashboard.png", dpi=90)

    figure, axis = plt.subplots(figsize=(7, 4))
    axis.plot(*series("accum/noise_scale"), label="noise scale B_simple (samples)")
    axis.plot(*series("accum/effective_batch_size"), label="effective batch (samples)", linestyle="--")
    axis.set_yscale("log")
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("samples")
    axis.set_title("Gradient noise scale over the main example")
    axis.legend()
    figure.tight_layout()
    figure.savefig(out / "noise_scale.png", dpi=110)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
