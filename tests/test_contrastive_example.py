"""examples/contrastive.py as a user runs it: its pairs, its LightningCLI config, its compare mode, its exact step."""

from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path

import pytest
import yaml

from lightning_accum import AccumulationScheduler, cached

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
CONFIG = EXAMPLES / "configs" / "contrastive.yaml"
TINY = ["--batch_size=32", "--micro_batch_size=8", "--width=8", "--pool_size=32"]


@pytest.fixture(scope="module")
def contrastive():
    sys.path.insert(0, str(EXAMPLES))
    try:
        import contrastive

        yield contrastive
    finally:
        sys.path.remove(str(EXAMPLES))


def test_the_pairs_are_read_again_identically_and_hold_no_docstring(contrastive):
    email = Path(sysconfig.get_paths()["stdlib"]) / "email"
    first = contrastive.code_pairs(email)
    contrastive._code_pairs.cache_clear()
    assert contrastive.code_pairs(email) == first
    assert len(first) > 50
    assert len({pair.query for pair in first}) == len(first)
    for pair in first:
        assert pair.code.startswith(("def ", "async def ", "@")), pair.name
        assert pair.query not in " ".join(pair.code.split()), pair.name
        assert "\n" not in pair.query
        assert 24 <= len(pair.query) <= 320


def test_the_held_out_split_is_fixed_by_the_name(contrastive):
    pairs = contrastive.code_pairs()
    held_out = [pair for pair in pairs if contrastive.is_held_out(pair.name, 0.2)]
    assert 0.15 < len(held_out) / len(pairs) < 0.25
    # sha1, not hash(): the same on every machine and in every process
    names = ("json.decoder.JSONDecoder.decode", "json.dumps", "os.path.join")
    assert [contrastive.is_held_out(name, 0.2) for name in names] == [True, False, False]
    data = contrastive.CodeSearchData(val_fraction=0.2)
    data.setup("fit")
    assert len(data.val_set) == len(held_out)
    assert len(data.train_set) == len(pairs) - len(held_out)


def test_identifiers_are_split_into_the_words_of_a_docstring(contrastive):
    docstring, code = contrastive.hashed_words(["Return the fileName", "return self.file_name"], 6, 4096).tolist()
    assert docstring[0] == code[0]
    assert docstring[2:4] == code[2:4]
    assert docstring[1] != code[1]  # the, self
    assert 0 not in docstring[:4]
    assert docstring[4:] == [0, 0]


def test_the_cli_config_fits_through_cached(contrastive, tmp_path, monkeypatch):
    chunks = []

    def counted(module, *inputs, chunk_size=None, **kwargs):
        chunks.append(chunk_size)
        return cached(module, *inputs, chunk_size=chunk_size, **kwargs)

    monkeypatch.setattr(contrastive, "cached", counted)
    cli = contrastive.main(
        [
            "fit",
            f"--config={CONFIG}",
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.max_steps=3",
            "--trainer.val_check_interval=2",
            "--trainer.limit_val_batches=1",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false",
            "--model.width=8",
            "--model.chunk_size=8",
            "--data.batch_size=32",
            "--data.pool_size=32",
        ]
    )
    assert cli.trainer.global_step == 3
    assert cli.model.hparams.buckets == cli.datamodule.buckets  # linked
    (callback,) = [c for c in cli.trainer.callbacks if isinstance(c, AccumulationScheduler)]
    assert callback.factor == 1
    assert callback.samples_seen == 3 * 32
    assert chunks == [8] * 3 * 2  # each step: the queries and the code, each through cached()
    assert 0 <= cli.trainer.callback_metrics["val/top1"] <= 1


def test_compare_writes_its_table(contrastive, tmp_path):
    results = contrastive.main(["compare", "--seeds", "0", "--samples=64", *TINY, f"--out={tmp_path}"])
    assert [(row["variant"], row["optimizer_steps"], row["samples"]) for row in results] == [
        ("true", 2, 64),
        ("big", 2, 64),
        ("naive", 2, 64),
        ("small", 8, 64),
    ]
    text = (tmp_path / "results.md").read_text()
    for variant in ("true", "big", "naive", "small"):
        assert f"| {variant} | 0 |" in text
    assert json.loads((tmp_path / "results.json").read_text())["results"] == results
    assert (tmp_path / "results.png").stat().st_size > 0


def test_the_first_step_of_true_is_the_big_batchs(contrastive):
    """Dropout off: cached in chunks of 8 and one plain batch of 32 take the same first step, within float32."""
    settings = contrastive.Settings(samples=32, batch_size=32, micro_batch_size=8, width=8, dropout=0.0, pool_size=32)
    true, _ = contrastive.train_variant("true", 0, settings)
    big, _ = contrastive.train_variant("big", 0, settings)
    assert true.hparams.chunk_size == 8
    assert big.hparams.chunk_size is None
    for (name, found), expected in zip(true.named_parameters(), big.parameters(), strict=True):
        assert (found.grad - expected.grad).abs().max() <= 1e-6, name
        assert (found - expected).abs().max() <= 1e-6, name
    assert any((param.grad != 0).any() for param in big.parameters())


def test_the_config_round_trips_through_print_config(contrastive, tmp_path, capsys):
    def printed(path):
        with pytest.raises(SystemExit) as exit_info:
            contrastive.main(["fit", f"--config={path}", "--print_config"])
        assert exit_info.value.code in (None, 0)
        return capsys.readouterr().out

    first = printed(CONFIG)
    (tmp_path / "printed.yaml").write_text(first)
    assert printed(tmp_path / "printed.yaml") == first
    resolved = yaml.safe_load(first)
    assert resolved["model"]["chunk_size"] == 16
    assert resolved["data"]["batch_size"] == 256
