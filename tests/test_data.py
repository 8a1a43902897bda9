"""Data modules: the needle retrieval task (determinism, layout, labels, baseline) and packed local text files."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from lightning_oomb import OOMBConfigError
from lightning_oomb.data import NeedleRetrievalDataModule, NeedleRetrievalDataset, TextFileDataModule

TEXT = "the quick brown fox jumps over the lazy dog . " * 40


def make_tokenizer(directory: Path, corpus: list[str]) -> Path:
    """A word-level tokenizer trained on ``corpus`` and saved as a Hugging Face tokenizer (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(corpus, trainer=trainers.WordLevelTrainer(special_tokens=["<unk>", "</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>").save_pretrained(
        directory
    )
    return directory


@pytest.fixture
def text_corpus(tmp_path) -> tuple[list[Path], Path]:
    """Two small text files and a tokenizer trained on them."""
    files = [tmp_path / "docs" / "a.txt", tmp_path / "docs" / "sub" / "b.txt"]
    for i, path in enumerate(files):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(TEXT if i == 0 else TEXT.upper(), encoding="utf-8")
    return files, make_tokenizer(tmp_path / "tok", [f.read_text() for f in files])


# ------------------------------------------------------------------------------------------------ needle task
@pytest.mark.parametrize("fraction", [0.0, 1 / 64])
def test_needle_layout_and_labels(fraction):
    ds = NeedleRetrievalDataset(
        8, seq_len=1024, num_values=8, num_filler=16, needle_fraction=fraction, seed=3
    )
    assert ds.vocab_size == 25 and ds.query_token == 16
    for i in range(len(ds)):
        ids, labels = ds[i]["input_ids"], ds[i]["labels"]
        assert ids.shape == labels.shape == (1024,) and ids.dtype == labels.dtype == torch.long
        value = int(ids[-1])
        assert 17 <= value < 25 and int(ids[-2]) == ds.query_token
        # only the answer is scored, and it is only written in the first half
        assert (labels[:-1] == -100).all() and int(labels[-1]) == value
        assert (ids[512:-2] < 16).all()
        assert int((ids[:512] == value).sum()) == max(1, round(fraction * 512))
        assert ((ids[:512] < 16) | (ids[:512] == value)).all()


def test_needle_is_deterministic_per_seed_and_index():
    a = NeedleRetrievalDataset(4, seq_len=256, seed=1)
    b = NeedleRetrievalDataset(4, seq_len=256, seed=1)
    c = NeedleRetrievalDataset(4, seq_len=256, seed=2)
    for i in range(4):
        assert torch.equal(a[i]["input_ids"], b[i]["input_ids"])
    assert not torch.equal(a[0]["input_ids"], a[1]["input_ids"])
    assert not torch.equal(a[0]["input_ids"], c[0]["input_ids"])
    with pytest.raises(IndexError):
        a[4]


def test_needle_answers_are_spread_over_the_values():
    ds = NeedleRetrievalDataset(200, seq_len=64, num_values=4)
    counts = torch.bincount(torch.stack([ds[i]["labels"][-1] for i in range(len(ds))]) - ds.query_token - 1)
    assert len(counts) == 4 and counts.min() > 25


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"seq_len": 4}, "seq_len=4"),
        ({"num_values": 1}, "at least 2 values"),
        ({"needle_fraction": 1.5}, "needle_fraction=1.5"),
    ],
)
def test_needle_rejects_bad_options(kwargs, match):
    with pytest.raises(OOMBConfigError, match=match):
        NeedleRetrievalDataset(1, **kwargs)


def test_needle_data_module_splits_and_warm_up():
    dm = NeedleRetrievalDataModule(
        seq_len=256,
        num_values=5,
        train_samples=3,
        val_samples=2,
        short_seq_len=64,
        short_samples=5,
        short_batch_size=2,
    )
    assert dm.baseline_loss == pytest.approx(math.log(5)) and dm.vocab_size == 16 + 1 + 5
    train = [batch["input_ids"] for batch in dm.train_dataloader()]
    assert [t.shape for t in train] == [(2, 64), (2, 64), (1, 64)] + [(1, 256)] * 3
    val = [batch["input_ids"] for batch in dm.val_dataloader()]
    assert len(val) == 2 and not any(torch.equal(v, t) for v in val for t in train[3:])
    # the warm-up has its own stream: adding it leaves the full-length samples unchanged
    plain = NeedleRetrievalDataModule(seq_len=256, num_values=5, train_samples=3)
    assert all(
        torch.equal(a, b["input_ids"]) for a, b in zip(train[3:], plain.train_dataloader(), strict=True)
    )


def test_needle_data_module_rejects_empty_batches():
    with pytest.raises(OOMBConfigError, match="at least one"):
        NeedleRetrievalDataModule(short_batch_size=0)


# ------------------------------------------------------------------------------------------------ text files
def test_text_files_are_tokenized_and_packed(text_corpus):
    files, tok_dir = text_corpus
    dm = TextFileDataModule([str(files[0].parent / "**" / "*.txt")], str(tok_dir), seq_len=16, val_rows=1)
    dm.setup("fit")
    tok = dm.tokenizer
    expected = []
    for f in sorted(files):  # glob order, each file followed by EOS
        expected += tok(f.read_text(), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    rows = [b["input_ids"] for b in dm.train_dataloader()] + [b["input_ids"] for b in dm.val_dataloader()]
    assert all(r.shape == (1, 16) for r in rows)
    # shuffled training rows + the held-out last row = every full row of the stream, nothing else
    full_rows = torch.tensor(expected[: len(expected) // 16 * 16]).view(-1, 16)
    assert torch.equal(rows[-1][0], full_rows[-1])
    assert sorted(map(tuple, torch.cat(rows).tolist())) == sorted(map(tuple, full_rows.tolist()))
    batch = next(iter(dm.train_dataloader()))
    assert torch.equal(batch["labels"], batch["input_ids"])
    assert dm.vocab_size == len(tok)


def test_text_without_validation_rows(text_corpus):
    files, tok_dir = text_corpus
    dm = TextFileDataModule([str(f) for f in files], str(tok_dir), seq_len=32, shuffle=False)
    dm.setup("fit")
    assert dm.val_dataloader() == [] and len(dm.train_set) > 0


def test_text_errors_name_the_fix(text_corpus, tmp_path):
    files, tok_dir = text_corpus
    with pytest.raises(OOMBConfigError, match="no file matches"):
        TextFileDataModule(str(tmp_path / "missing*.txt"), str(tok_dir)).setup("fit")
    with pytest.raises(OOMBConfigError, match="not enough"):
        TextFileDataModule(str(files[0]), str(tok_dir), seq_len=100_000, val_rows=1).setup("fit")
