"""lightning_accum: exact, scheduled and visible gradient accumulation for PyTorch Lightning."""

from lightning_accum.__about__ import __version__
from lightning_accum.callback import AccumulationScheduler, estimated_stepping_batches

__all__ = ["AccumulationScheduler", "__version__", "estimated_stepping_batches"]
