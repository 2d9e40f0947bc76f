"""Train the byte-level transformer of ``byte_lm.py`` through LightningCLI, with a batch-size ramp.

The configuration lives in YAML: the accumulation callback (and any Trainer setting) is given by ``class_path`` and
``init_args``. The main example::

    python examples/train_lm.py fit --config examples/configs/lm_ramp.yaml

ramps the global batch from 16 to 64 sequences while each micro-batch stays at 8, so the accumulation factor goes
2 -> 4 -> 6 -> 8 in the middle of the epoch, and the learning rate follows the square root of the effective batch.
Any value can be overridden on the command line (``--trainer.max_steps 50``) and ``--print_config`` prints the
resolved configuration. Logs go to ``./lightning_logs``: ``tensorboard --logdir lightning_logs``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from byte_lm import ByteLM, StdlibBytes  # noqa: E402

from lightning_accum.cli import AccumulationArgumentParser  # noqa: E402


class ByteLMCLI(LightningCLI):
    """LightningCLI with the model's context tied to the data's."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.context", "model.context")


def main(args: list[str] | None = None, run: bool = True) -> ByteLMCLI:
    return ByteLMCLI(
        ByteLM, StdlibBytes, args=args, run=run, seed_everything_default=0, parser_class=AccumulationArgumentParser
    )


if __name__ == "__main__":
    main()
