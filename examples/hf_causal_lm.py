"""Fine-tune a Hugging Face causal LM (built from a config: no download) with exact token weighting.

    pip install -c constraints.txt -e ".[hf]"
    python examples/hf_causal_lm.py fit --config examples/configs/hf_causal_lm.yaml

The model is a small ``LlamaForCausalLM`` over bytes; the data are lines of the Python standard library's sources,
right-padded to the longest line of each batch, so sequences bear different numbers of tokens. ``training_step``
returns the model's own ``.loss`` (a mean over the tokens it weighs: it shifts the labels inside). The callback
recognises the causal-LM head and counts ``labels[..., 1:] != -100`` with ``normalize_by: token`` alone, so every
optimizer step is the step of one big batch on the mean over its tokens (the transformers "gradient accumulation
bug" does not arise); loader batches are split by ``micro_batch_size``, the LR follows the square root of the
effective batch, and ``tensorboard --logdir lightning_logs`` shows the dashboard.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from byte_lm import read_corpus  # noqa: E402

from lightning_accum.cli import AccumulationArgumentParser  # noqa: E402

PAD, VOCAB = 256, 257  # bytes, and a padding token


class StdlibLines(pl.LightningDataModule):
    """Non-empty lines of the standard library's sources, as byte sequences of at most ``max_length`` tokens.

    Args:
        batch_size: Lines per loader batch.
        max_length: Longest sequence (longer lines are cut).
        lines: How many lines to train on.
    """

    def __init__(self, batch_size: int = 8, max_length: int = 64, lines: int = 4096) -> None:
        super().__init__()
        self.batch_size, self.max_length, self.lines = batch_size, max_length, lines

    def setup(self, stage: str) -> None:
        text = bytes(read_corpus(2_000_000).tolist())
        rows = [line.strip()[: self.max_length] for line in text.split(b"\n")]
        self.train_set = _Lines([row for row in rows if len(row) >= 4][: self.lines])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, collate_fn=_pad)


class _Lines(Dataset):
    def __init__(self, rows: list[bytes]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor(list(self.rows[index]))


def _pad(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Right-pad to the batch's longest row: labels are the inputs, -100 on the padding (the model shifts them)."""
    length = max(len(row) for row in rows)
    ids = torch.full((len(rows), length), PAD)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
    mask = ids != PAD
    return {"input_ids": ids, "attention_mask": mask.long(), "labels": torch.where(mask, ids, -100)}


class HFCausalLM(pl.LightningModule):
    """A ``transformers.LlamaForCausalLM`` from a config, trained on its own ``.loss`` with AdamW.

    Args:
        hidden_size: Model width.
        layers: Decoder layers.
        heads: Attention heads.
        lr: AdamW's learning rate, before the callback's LR scaling.
    """

    def __init__(self, hidden_size: int = 64, layers: int = 2, heads: int = 4, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        import transformers

        config = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=hidden_size,
            intermediate_size=4 * hidden_size,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            max_position_embeddings=256,
            pad_token_id=PAD,
        )
        self.model = transformers.LlamaForCausalLM(config)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def main(args: list[str] | None = None, run: bool = True) -> LightningCLI:
    return LightningCLI(
        HFCausalLM, StdlibLines, args=args, run=run, seed_everything_default=0, parser_class=AccumulationArgumentParser
    )


if __name__ == "__main__":
    main()
