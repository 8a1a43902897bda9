"""Data modules: the needle retrieval task (determinism, layout, labels, baseline) and local documents (text,
JSON lines, records) tokenized and packed, in the HF packing convention, with a train loader that resumes mid-epoch."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from transformers import AutoTokenizer

from lightning_oomb import OOMBConfigError
from lightning_oomb.data import (
    NeedleRetrievalDataModule,
    NeedleRetrievalDataset,
    PackedRows,
    ResumableLoader,
    RowSampler,
    TextFileDataModule,
    concatenate,
    expand_paths,
    split_at_starts,
)
from lightning_oomb.models import CausalLMModule
from tests.helpers.lightning import TinyLM, make_trainer

TEXT = "the quick brown fox jumps over the lazy dog . " * 40
REPO = Path(__file__).resolve().parents[1]


def make_tokenizer(
    directory: Path, corpus: list[str], eos: bool = True, bos: str | None = None, sep: bool = False
) -> Path:
    """A word-level tokenizer trained on ``corpus`` and saved as a Hugging Face tokenizer (no download). ``bos``:
    ``"adds"``, a BOS ``<s>`` that the tokenizer adds at a sequence start (its ``tokenizer.json`` post-processor, as
    Llama's and Gemma's), ``"has"``, one it has but does not add (as GPT-2's); ``sep``: a SEP token ``<sep>``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "</s>"] + ["<s>"] * bool(bos) + ["<sep>"] * sep
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(corpus, trainer=trainers.WordLevelTrainer(special_tokens=specials))
    if bos == "adds":
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
        )
    special = {"eos_token": "</s>"} if eos else {}
    special |= ({"bos_token": "<s>"} if bos else {}) | ({"sep_token": "<sep>"} if sep else {})
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", **special).save_pretrained(directory)
    return directory


def texts_of_lengths(*lengths: int) -> list[str]:
    """One text per length, ``length`` distinct-looking bytes each (ASCII: one byte-tokenizer id per character)."""
    return [(f"doc{i}:" + "abcdefghij" * 10)[:n] for i, n in enumerate(lengths)]


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


def test_needle_training_resumes_mid_epoch():
    """A checkpoint in the middle of the epoch (here after 4 of 6 batches: inside the full-length part) resumes at
    the next batch, not at the warm-up's first (which would train the warm-up again and never reach the rest); a
    state of another epoch resumes nothing; other batches are refused."""
    settings = dict(seq_len=256, num_values=5, train_samples=3, short_seq_len=64, short_samples=5,
                    short_batch_size=2)  # fmt: skip
    epoch = [b["input_ids"] for b in NeedleRetrievalDataModule(**settings).train_dataloader()]
    interrupted = NeedleRetrievalDataModule(**settings).train_dataloader()
    batches = iter(interrupted)
    seen = [next(batches)["input_ids"] for _ in range(4)]
    state = interrupted.state_dict()
    assert state == {"epoch": 0, "batches": 4, "num_batches": 6}
    resumed = NeedleRetrievalDataModule(**settings).train_dataloader()
    resumed.load_state_dict(state)
    assert len(resumed) == 6  # the whole epoch's length, as Lightning expects
    assert all(map(torch.equal, seen + [b["input_ids"] for b in resumed], epoch))
    resumed.load_state_dict(state)
    resumed.batch_sampler.set_epoch(1)
    assert len(list(resumed)) == 6
    with pytest.raises(OOMBConfigError, match="other settings \\(num_batches 6 -> 8\\)"):
        NeedleRetrievalDataModule(**(settings | {"short_batch_size": 1})).train_dataloader().load_state_dict(
            state
        )


def test_needle_data_module_rejects_empty_batches():
    with pytest.raises(OOMBConfigError, match="at least one"):
        NeedleRetrievalDataModule(short_batch_size=0)


# ------------------------------------------------------------------------------------------------ text files
def test_text_files_are_tokenized_and_concatenated_without_packing(text_corpus, caplog):
    files, tok_dir = text_corpus
    dm = TextFileDataModule(
        [str(files[0].parent / "**" / "*.txt")], str(tok_dir), seq_len=16, val_rows=1, pack=False
    )
    dm.setup("fit")
    tok = dm.tokenizer
    expected = []
    for f in sorted(files):  # glob order, each file followed by EOS
        expected += tok(f.read_text(), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    rows = [b["input_ids"] for b in dm.train_dataloader()] + [b["input_ids"] for b in dm.val_dataloader()]
    assert all(r.shape == (1, 16) for r in rows)
    # the held-out row is the stream's last 16 tokens; the shuffled training rows every full row before it
    training = expected[:-16]
    left = len(training) % 16
    assert left and f"{left} of the {len(training)} training tokens fill no row" in caplog.text
    full_rows = torch.tensor(training[: len(training) - left] + expected[-16:]).view(-1, 16)
    assert torch.equal(rows[-1][0], full_rows[-1])
    assert sorted(map(tuple, torch.cat(rows).tolist())) == sorted(map(tuple, full_rows.tolist()))
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"input_ids", "labels"} and torch.equal(batch["labels"], batch["input_ids"])
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


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"seq_len": 1}, "seq_len=1 leaves no token"),
        ({"batch_size": 0}, "batch_size=0"),
        ({"val_rows": -1}, "val_rows=-1"),
        ({"tokenizer": None}, "no tokenizer"),
        ({"files": None}, "no documents"),
        ({"records": [{"text": "a"}]}, "both files and records"),
    ],
)
def test_text_options_are_refused_at_construction(kwargs, match):
    with pytest.raises(OOMBConfigError, match=match):
        TextFileDataModule(**{"files": "x.txt", "tokenizer": "bytes", **kwargs})


@pytest.mark.parametrize(
    ("lines", "match"),
    [
        (['{"text": "a"}', '{"body": "b"}'], r"docs.jsonl:2 has no field 'text' \(its fields: body\)"),
        (['{"text": "a"}', "", "{not json"], r"docs.jsonl:3 is not JSON"),
        (['{"text": 3}'], r"docs.jsonl:1 holds a int under 'text', not a string"),
        (['["a list"]'], r"docs.jsonl:1 is a list, not a mapping"),
        ([""], "the corpus is empty"),
    ],
)
def test_bad_jsonl_names_file_and_line_before_any_tokenizer_is_loaded(tmp_path, lines, match):
    (tmp_path / "docs.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    # a tokenizer that cannot load: the error must come first
    dm = TextFileDataModule(str(tmp_path / "docs.jsonl"), str(tmp_path / "no-tokenizer-here"))
    with pytest.raises(OOMBConfigError, match=match):
        dm.setup("fit")


@pytest.mark.parametrize(
    ("name", "content", "match"),
    [
        ("docs.json", b'[{"text": "a"}]', r"docs.json is a .json file .* to a .jsonl file"),
        ("latin.txt", "caf\xe9".encode("latin-1"), r"latin.txt is not UTF-8 text .* iconv"),
        ("dir", None, r"names a directory, not files .*\*\*"),
    ],
)
def test_files_it_cannot_read_are_named_with_the_fix(tmp_path, name, content, match):
    """A .json array was read as one raw text document, a Latin-1 file raised a bare UnicodeDecodeError, a
    directory said the corpus was empty."""
    path = tmp_path / name
    if content is None:
        (path / "sub").mkdir(parents=True)
    else:
        path.write_bytes(content)
    with pytest.raises(OOMBConfigError, match=match):
        TextFileDataModule(str(path), tokenizer="bytes", seq_len=2).setup("fit")


def test_a_tokenizer_that_reads_nothing_is_named(tmp_path):
    """Every document tokenized to nothing (a tokenizer for other text): said so, not 'the corpus holds 0 rows'."""

    class Blind:
        eos_token_id = 0

        def __call__(self, texts, **kwargs):
            return {"input_ids": [[] for _ in texts]}

    dm = TextFileDataModule(records=[{"text": "abc"}], tokenizer="bytes", seq_len=2)
    dm._tokenizer = Blind()
    with pytest.raises(OOMBConfigError, match="turned the corpus's 1 document.s. into no tokens"):
        dm.setup("fit")


@pytest.mark.parametrize(
    ("records", "match"),
    [([{"text": "a"}, "b"], "record 1 is a str, not a mapping"), ([], "the corpus is empty")],
)
def test_bad_records_are_named(records, match):
    with pytest.raises(OOMBConfigError, match=match):
        TextFileDataModule(records=records, tokenizer="bytes", seq_len=2).setup("fit")


@pytest.mark.parametrize("pack", [True, False])
def test_documents_need_an_end_token(tmp_path, pack):
    """Without an EOS, ``pack=False`` joined the documents with nothing between them, silently; a tokenizer's SEP
    (how BERT-style tokenizers end a sequence) ends them when it has no EOS; with neither it is refused."""
    records = [{"text": TEXT}, {"text": TEXT}]
    bare = make_tokenizer(tmp_path / "bare", [TEXT], eos=False)
    with pytest.raises(OOMBConfigError, match="has no EOS token \\(nor a SEP token\\) .*tokenizer.eos_token"):
        TextFileDataModule(records=records, tokenizer=str(bare), seq_len=8, pack=pack).setup("fit")
    sep = make_tokenizer(tmp_path / "sep", [TEXT], eos=False, sep=True)
    dm = TextFileDataModule(records=records, tokenizer=str(sep), seq_len=8, pack=pack)
    words = dm.tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert [d.tolist() for d in dm.documents()] == [words + [dm.tokenizer.sep_token_id]] * 2


def test_a_byte_order_mark_is_no_text(tmp_path):
    """A file saved with a UTF-8 byte-order mark (Windows editors) had it tokenized as text (a .jsonl file was
    refused as not JSON); it is dropped, from the file's start only."""
    texts = ["a mark mid-text\ufeff is kept", "second"]
    (tmp_path / "bom.txt").write_text(texts[0], encoding="utf-8-sig")
    (tmp_path / "bom.jsonl").write_text(
        "\n".join(json.dumps({"text": t}) for t in texts), encoding="utf-8-sig"
    )
    for name, want in (("bom.txt", texts[:1]), ("bom.jsonl", texts)):
        assert (tmp_path / name).read_bytes().startswith(b"\xef\xbb\xbf")
        dm = TextFileDataModule(str(tmp_path / name), tokenizer="bytes", seq_len=2)
        assert [d.tolist() for d in dm.documents()] == [[b + 3 for b in t.encode()] + [1] for t in want], name
    # records made from such files read raw (e.g. a datasets.Dataset) start with it too
    dm = TextFileDataModule(records=[{"text": "\ufeff" + t} for t in texts], tokenizer="bytes", seq_len=2)
    assert [d.tolist() for d in dm.documents()] == [[b + 3 for b in t.encode()] + [1] for t in texts]


def test_a_jsonl_file_that_is_not_utf8_names_the_byte_from_the_files_start(tmp_path):
    """Read line by line, the error counted from the start of the decoder's buffer, not the file's."""
    lines = b"".join(b'{"text": "%d"}\n' % i for i in range(2000)) + '{"text": "caf\xe9"}'.encode("latin-1")
    (tmp_path / "latin.jsonl").write_bytes(lines)
    at = lines.index(b"\xe9")
    with pytest.raises(OOMBConfigError, match=rf"latin.jsonl is not UTF-8 text \(.* at byte {at}\)"):
        TextFileDataModule(str(tmp_path / "latin.jsonl"), tokenizer="bytes", seq_len=2).setup("fit")


def test_byte_tokenizer_needs_no_files():
    dm = TextFileDataModule(records=[{"text": "héllo"}, {"text": ""}], tokenizer="bytes", seq_len=2)
    assert dm.vocab_size == 259 and dm.tokenizer.eos_token_id == 1
    # UTF-8 bytes shifted by 3 (pad, EOS, unk come first), EOS after the document; the empty one is dropped
    assert [doc.tolist() for doc in dm.documents()] == [[b + 3 for b in "héllo".encode()] + [1]]


def test_documents_start_as_the_tokenizer_starts_a_sequence(tmp_path):
    """A tokenizer that adds a BOS (Llama, Gemma: here through its tokenizer.json, while its ``add_bos_token``
    says False) got documents without one, which its model never saw; ``add_bos`` turns it off, or on for one that
    has a BOS but does not add it. In packed rows the BOS is position 0: no target, the first word's context."""
    records = [{"text": "the quick fox"}, {"text": "the lazy dog"}]
    adds = AutoTokenizer.from_pretrained(make_tokenizer(tmp_path / "adds", [TEXT], bos="adds"))
    assert not adds.add_bos_token and adds("the")["input_ids"][0] == adds.bos_token_id

    def documents(tok: str, **options) -> list[list[int]]:
        dm = TextFileDataModule(records=records, tokenizer=tok, seq_len=4, shuffle=False, **options)
        return [d.tolist() for d in dm.documents()]

    words = [adds(r["text"], add_special_tokens=False)["input_ids"] for r in records]
    bos, eos = adds.bos_token_id, adds.eos_token_id
    assert documents(str(tmp_path / "adds")) == [[bos, *w, eos] for w in words]
    assert documents(str(tmp_path / "adds"), add_bos=False) == [[*w, eos] for w in words]
    has = str(make_tokenizer(tmp_path / "has", [TEXT], bos="has"))  # the same vocabulary, nothing added
    assert documents(has) == [[*w, eos] for w in words]
    assert documents(has, add_bos=True) == [[bos, *w, eos] for w in words]
    assert documents("bytes") == [[b + 3 for b in r["text"].encode()] + [1] for r in records]  # unchanged
    with pytest.raises(OOMBConfigError, match="add_bos=True, but tokenizer 'bytes' has no BOS token"):
        documents("bytes", add_bos=True)
    dm = TextFileDataModule(records=records, tokenizer=str(tmp_path / "adds"), seq_len=5, shuffle=False)
    dm.setup("fit")
    row = dm.train_set[0]  # <s> the quick fox </s>
    assert row["input_ids"].tolist() == [bos, *words[0], eos] and row["position_ids"].tolist() == [
        0,
        1,
        2,
        3,
        4,
    ]
    assert row["labels"].tolist() == [-100, *words[0], eos]


def test_a_sequence_start_that_cannot_be_read_off_is_asked_for():
    """Special tokens that change a text's own tokens, or no probe with tokens (the text before its 1000th
    character, and ``Hello``, tokenized to nothing): ``add_bos`` is asked for rather than guessed."""

    class Odd:
        eos_token_id = 0

        def __init__(self, reads) -> None:
            self.reads = reads

        def __call__(self, texts, add_special_tokens, **kwargs):
            return {"input_ids": [self.reads(t, add_special_tokens) for t in texts]}

    def documents(reads, **options):
        dm = TextFileDataModule(records=[{"text": "x" * 1001}], tokenizer="odd", seq_len=2, **options)
        dm._tokenizer = Odd(reads)
        return [d.tolist() for d in dm.documents()]

    def late(text, special):  # tokens only past the 1000th character
        return [5] * (len(text) > 1000)

    def merging(text, special):  # one token with special tokens, two without
        return [1, 6] if special else [5, 5]

    with pytest.raises(
        OOMBConfigError, match="no tokens for the probe texts .* set add_bos=True .* or add_bos=False"
    ):
        documents(late)
    assert documents(late, add_bos=False) == [[5, 0]]
    with pytest.raises(OOMBConfigError, match="as \\[5, 5\\] without special tokens but \\[1, 6\\] with"):
        documents(merging)


def test_file_paths_name_each_file_once_and_literally(tmp_path, monkeypatch):
    """``doc[1].txt`` is that file (as a glob it matched ``doc1.txt``); a file named by two paths is read once."""
    for name in ("doc[1].txt", "doc1.txt", "a.txt"):
        (tmp_path / name).write_text(name)
    monkeypatch.chdir(tmp_path)
    assert expand_paths("doc[1].txt") == [Path("doc[1].txt")]
    assert expand_paths(["doc1.txt", tmp_path / "doc1.txt", "*.txt"]) == [
        Path("doc1.txt"),
        Path("a.txt"),
        Path("doc[1].txt"),
    ]


def test_special_token_text_inside_a_document_is_text():
    """``</s>`` (an HTML strikethrough tag) or ``<pad>`` written in a document are its bytes, not an EOS mid-document
    (the model would learn to end there) or a pad target; only the appended EOS is one."""
    text = "a</s>b<pad>c"
    dm = TextFileDataModule(records=[{"text": text}], tokenizer="bytes", seq_len=2)
    assert [doc.tolist() for doc in dm.documents()] == [[b + 3 for b in text.encode()] + [1]]


def test_packed_rows_are_hf_flattened_documents():
    """Every row (training and validation, in source order) is what ``DataCollatorWithFlattening`` makes of the
    document pieces that fall into it; a document split across rows restarts at position 0 in the next row. The
    validation row is the stream's last 24 tokens; the training tokens before it that fill no row are not trained."""
    from transformers import DataCollatorWithFlattening

    texts = texts_of_lengths(
        5, 30, 2, 9, 14, 1, 40, 7
    )  # +1 EOS each: 116 tokens: 3 training rows of 24, 20 left, 1 held out
    dm = TextFileDataModule(
        records=[{"text": t} for t in texts],
        tokenizer="bytes",
        seq_len=24,
        batch_size=3,
        val_rows=1,
        shuffle=False,
    )
    dm.setup("fit")
    docs = [[b + 3 for b in t.encode()] + [1] for t in texts]
    ends = torch.tensor([len(d) for d in docs]).cumsum(0).tolist()
    spans = list(zip([0, *ends[:-1]], ends))
    stream = sum(docs, [])
    samples = [dm.train_set[i] for i in range(len(dm.train_set))] + [dm.val_set[0]]
    assert len(samples) == len(stream) // 24 == 4 and len(dm.val_set) == 1
    collate = DataCollatorWithFlattening(return_tensors="pt")
    for r, sample in enumerate(samples):
        lo = r * 24 if r < 3 else len(stream) - 24
        hi = lo + 24
        pieces = [stream[max(a, lo) : min(b, hi)] for a, b in spans if a < hi and b > lo]
        want = collate([{"input_ids": p, "labels": p} for p in pieces])
        for key in ("input_ids", "labels", "position_ids"):
            assert torch.equal(sample[key], want[key][0]), (r, key)
    # the 30-token document starts at token 6 of row 0 and ends in row 1, which starts again at position 0
    assert samples[1]["position_ids"][:13].tolist() == list(range(13))
    assert samples[1]["labels"][0] == -100 and samples[1]["input_ids"][12] == 1
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"input_ids", "labels", "position_ids"}
    assert all(v.dtype == torch.long and v.shape == (3, 24) for v in batch.values())
    # every -100 label is a document (or row) start: nothing else is masked
    assert torch.equal(batch["labels"] == -100, batch["position_ids"] == 0)


def test_documents_from_text_files_jsonl_and_records_agree(tmp_path):
    texts = ["première ligne du texte", "a second, longer document " * 3, "third"]
    for i, text in enumerate(texts):
        (tmp_path / "txt" / f"{i}.txt").parent.mkdir(exist_ok=True)
        (tmp_path / "txt" / f"{i}.txt").write_text(text, encoding="utf-8")
    lines = [json.dumps({"id": i, "body": t}) for i, t in enumerate(texts)]
    (tmp_path / "docs.jsonl").write_text(
        "\n".join(lines) + "\n\n", encoding="utf-8"
    )  # blank lines are skipped

    class Records:  # duck-typed like a datasets.Dataset: iterable mappings, not a list
        def __iter__(self):
            return iter({"id": i, "body": t} for i, t in enumerate(texts))

    (tmp_path / "DOCS.NDJSON").write_text("\n".join(lines), encoding="utf-8")  # any case, .ndjson too
    sources = [
        {"files": str(tmp_path / "txt" / "*.txt")},
        {"files": [str(tmp_path / "docs.jsonl")]},
        {"files": tmp_path / "DOCS.NDJSON"},  # a Path alone
        {"records": Records()},
    ]
    rows = []
    for source in sources:
        dm = TextFileDataModule(**source, tokenizer="bytes", text_field="body", seq_len=8, val_rows=2)
        dm.setup("fit")
        rows.append(
            [dm.train_set[i]["input_ids"] for i in range(len(dm.train_set))] + [dm.val_set[1]["input_ids"]]
        )
        assert "records" not in dm.hparams  # a data set is no hyperparameter
        for tensor in (dm.val_set.rows, dm.val_set.starts):  # its own storage: a view kept the corpus alive
            assert tensor is None or tensor.untyped_storage().nbytes() == tensor.nbytes
    assert all(len(r) == len(rows[0]) and all(map(torch.equal, r, rows[0])) for r in rows[1:])


def test_packing_shuffles_documents_by_seed_and_keeps_validation_fixed():
    records = [{"text": t} for t in texts_of_lengths(*[3 + 7 * i % 45 for i in range(24)])]

    def split(**options) -> tuple[PackedRows, PackedRows]:
        dm = TextFileDataModule(records=records, tokenizer="bytes", seq_len=32, val_rows=3, **options)
        dm.setup("fit")
        return dm.train_set, dm.val_set

    def pieces(rows: PackedRows) -> list[tuple[int, ...]]:
        return [tuple(p.tolist()) for p in split_at_starts(rows.rows, rows.starts)]

    (a, val_a), (b, _), (c, val_c), (plain, val_plain) = split(), split(), split(seed=1), split(shuffle=False)
    assert torch.equal(a.rows, b.rows) and not torch.equal(a.rows, c.rows)
    assert a.rows.shape == c.rows.shape == plain.rows.shape
    # the training documents (the one cut by the validation boundary keeps its head) in the seed's order, but for
    # the tail that fills no row (fewer than 32 tokens): the seed decides which documents it ends
    dm = TextFileDataModule(records=records, tokenizer="bytes", seq_len=32, val_rows=3)
    tokens, starts = concatenate(dm.documents())
    docs = [tuple(d.tolist()) for d in split_at_starts(tokens[: -3 * 32], starts[: -3 * 32])]
    left_out = []
    for rows in (a, c, plain, split(seed=2)[0]):
        got = pieces(rows)
        rest = list(docs)
        for piece in got[:-1]:
            rest.remove(piece)
        last = next(d for d in rest if d[: len(got[-1])] == got[-1])  # the last row ends inside a document
        rest.remove(last)
        assert 0 < sum(map(len, rest)) + len(last) - len(got[-1]) < 32
        left_out.append((got[-1], sorted(rest)))
    assert len({cut for cut, _ in left_out}) > 1 and pieces(a) != pieces(plain)
    # validation: the last rows of the source-order stream whatever the seed, shuffle or pack
    _, val_unpacked = split(pack=False)
    for val in (val_c, val_plain, val_unpacked):
        assert torch.equal(val.rows, val_a.rows)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_state_counts_the_rows_handed_out(num_workers):
    rows = PackedRows(torch.arange(70).view(7, 10))

    def loader() -> ResumableLoader:
        made = ResumableLoader(rows, batch_size=2, shuffle=True, seed=3, num_workers=num_workers)
        made.sampler.set_epoch(1)  # what Lightning does at every epoch start
        return made

    epoch = [b["input_ids"] for b in loader()]
    assert len(epoch) == 4 and not torch.equal(torch.cat(epoch), rows.rows)  # shuffled
    interrupted = loader()
    batches = iter(interrupted)
    seen = [next(batches)["input_ids"] for _ in range(2)]
    # workers have prefetched more; only what left the loader counts
    state = interrupted.state_dict()
    assert state == {"epoch": 1, "rows": 4, "num_rows": 7, "batch_size": 2, "num_replicas": 1, "seed": 3,
                     "shuffle": True, "data": rows.fingerprint}  # fmt: skip
    resumed = loader()
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state and len(resumed) == 4  # a whole epoch's length, as Lightning expects
    rest = [b["input_ids"] for b in resumed]
    assert len(rest) == 2 and all(map(torch.equal, seen + rest, epoch))
    assert len(list(resumed)) == 4  # the state applies to one iteration only
    resumed.load_state_dict(state)
    resumed.sampler.set_epoch(2)  # a state of an earlier epoch (saved at its end) resumes nothing
    assert len(list(resumed)) == 4
    with pytest.raises(OOMBConfigError, match="other settings \\(num_rows 7 -> 6"):
        ResumableLoader(PackedRows(rows.rows[:6]), batch_size=2, shuffle=True, seed=3).load_state_dict(state)


@pytest.mark.parametrize(
    "change",
    [{"batch_size": 4}, {"num_replicas": 2}, {"seed": 4}, {"shuffle": False}],
    ids=["batch-size", "replicas", "seed", "order"],
)
def test_a_resume_under_other_settings_is_refused(change):
    """Lightning counts the epoch's done batches of the old size and ``rows`` counts one replica's rows of one
    order: resumed with a larger batch the epoch's end was skipped (rows 12-15 of 16), on other replicas rows were
    repeated or skipped, with another seed or order the position fell in another order."""
    rows = PackedRows(torch.arange(160).view(16, 10))
    settings = {"batch_size": 2, "shuffle": True, "seed": 3, "num_replicas": 1}
    saved = ResumableLoader(rows, **settings)
    next(iter(saved))
    state = saved.state_dict()
    ResumableLoader(rows, **settings).load_state_dict(state)  # the same settings resume
    with pytest.raises(OOMBConfigError, match=f"other settings \\({next(iter(change))} "):
        ResumableLoader(rows, **(settings | change)).load_state_dict(state)
    old = {k: v for k, v in state.items() if k in ("epoch", "rows", "num_rows")}  # a checkpoint of before
    ResumableLoader(rows, **(settings | change)).load_state_dict(old)


def test_a_resume_over_other_rows_of_the_same_count_is_refused():
    """Other files, tokenizer or ``add_bos`` (a BOS now added) can give as many rows of other tokens: the position
    would fall in other data. The rows' digest is saved with it (a checkpoint of before, without one, resumes)."""
    rows = PackedRows(torch.arange(160).view(16, 10), torch.zeros(16, 10, dtype=torch.bool))
    saved = ResumableLoader(rows, batch_size=2)
    next(iter(saved))
    state = saved.state_dict()
    same = PackedRows(rows.rows.clone(), rows.starts.clone())
    ResumableLoader(same, batch_size=2).load_state_dict(state)
    other = PackedRows(rows.rows.clone(), rows.starts.clone())
    other.rows[3, 0] = 1  # one token differs
    with pytest.raises(OOMBConfigError, match="other settings \\(data [0-9a-f]{16} -> [0-9a-f]{16}\\)"):
        ResumableLoader(other, batch_size=2).load_state_dict(state)
    ResumableLoader(other, batch_size=2).load_state_dict({k: v for k, v in state.items() if k != "data"})


class BatchRecorder(L.Callback):
    def __init__(self) -> None:
        self.rows: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.rows.append(batch["input_ids"].clone())


@pytest.fixture
def one_thread():
    """The tiny model's steps take milliseconds: a second thread only adds waits (seconds on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize(
    ("pack", "lm"),
    [(True, "tiny"), (False, "tiny"), (True, "causal_lm")],  # False: rows reshuffled every epoch
)
def test_fit_resumed_mid_epoch_sees_the_rows_an_uninterrupted_fit_sees(
    text_corpus, tmp_path, pack, lm, one_thread
):
    """``causal_lm``: CausalLMModule with ``max_epochs`` set, whose LR schedule reads the step count (read in
    configure_optimizers it built the train loader too early, Lightning issue #20550: the resumed fit started the
    epoch again from its first row)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    _, tok_dir = text_corpus
    words = TEXT.split()[:10]
    records = [{"text": " ".join(words[i % 7 :] * (1 + i % 3))} for i in range(11)]

    def data() -> TextFileDataModule:
        return TextFileDataModule(
            records=records, tokenizer=str(tok_dir), seq_len=32, batch_size=2, pack=pack
        )

    def module() -> L.LightningModule:
        if lm == "tiny":
            return TinyLM()
        vocab = len(AutoTokenizer.from_pretrained(tok_dir))
        shape = dict(model_type="qwen2", vocab_size=vocab, hidden_size=32, intermediate_size=32,
                     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
        return CausalLMModule(config=shape, warmup_steps=1)

    def fit(callbacks, ckpt_path=None) -> None:
        trainer = make_trainer("auto", steps=8, callbacks=callbacks, default_root_dir=tmp_path,
                               enable_checkpointing=True, max_epochs=None if lm == "tiny" else 10)  # fmt: skip
        trainer.fit(module(), data(), ckpt_path=ckpt_path)

    probe = data()
    probe.setup("fit")
    assert len(probe.train_set) == 5  # 3 batches an epoch (2, 2, 1 rows): steps 2 and 4 are mid-epoch
    full = BatchRecorder()
    fit([full, ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)])
    assert len(full.rows) == 8
    if not pack:
        assert not torch.equal(torch.cat(full.rows[:3]), torch.cat(full.rows[3:6]))  # a new order each epoch
    for step in (2, 4, 6):  # mid epoch 0, mid epoch 1, the end of epoch 1
        resumed = BatchRecorder()
        fit([resumed], ckpt_path=next((tmp_path / "ckpt").glob(f"*step={step}.ckpt")))
        assert len(resumed.rows) == 8 - step
        assert all(map(torch.equal, resumed.rows, full.rows[step:])), step


def test_example_packed_config_builds_its_data(monkeypatch, one_thread):  # the config sets num_threads
    """examples/configs/textfiles-packed-cpu.yaml: its files exist, its model's vocabulary is the tokenizer's."""
    from lightning_oomb.cli import build_cli

    monkeypatch.chdir(REPO)  # the config's paths are relative to the repository root
    monkeypatch.setattr(sys, "argv", ["oomb"])
    cli = build_cli(["--config", "examples/configs/textfiles-packed-cpu.yaml"], run=False)
    dm = cli.datamodule
    dm.setup("fit")
    assert dm.pack and cli.model.hparams.config["vocab_size"] == dm.vocab_size == 259
    assert len(dm.train_set) >= 8 and len(dm.val_set) == 2
    assert dm.train_set[0]["position_ids"].shape == (dm.seq_len,)
    # every document of proverbs.jsonl trains (they were held out or fell in the corpus's dropped tail), but for at
    # most the one the tail that fills no row cuts
    stream = bytes((dm.train_set.rows.flatten() - 3).clamp(min=0).tolist())
    lines = (REPO / "examples" / "data" / "proverbs.jsonl").read_text().splitlines()
    trained = [json.loads(line)["text"].encode() in stream for line in lines]
    assert sum(trained) >= len(lines) - 1, trained


def test_rows_are_shared_out_over_data_replicas_and_resume_per_replica():
    """Each data replica takes every ``replicas``-th row of the epoch's order (alike on every replica: the same
    ``(seed, epoch)``), padded as ``DistributedSampler`` pads (wrapping around to the order's first rows) so that
    every replica takes as many; a resumed replica skips its own rows."""
    shards = [RowSampler(7, shuffle=True, seed=3, num_replicas=2, rank=r) for r in range(2)]
    for s in shards:
        s.set_epoch(1)
    rows = [list(s) for s in shards]
    order = shards[0].order()
    assert len(rows[0]) == len(rows[1]) == len(shards[0]) == 4
    assert rows[0] + rows[1] == order[0::2] + order[1::2] + [order[0]]  # row 7 of 8: the order's first again
    shards[1].skip(2)
    assert list(shards[1]) == rows[1][2:] and list(shards[1]) == rows[1]  # the skip holds for one iteration
    few = [list(RowSampler(2, num_replicas=5, rank=r)) for r in range(5)]  # more replicas than rows
    assert few == [[0], [1], [0], [1], [0]]


@pytest.mark.parametrize("replicas", [2, 3])
def test_every_row_is_trained_on_under_data_replicas(replicas):
    """Packed rows come in one order every epoch: the uneven tail the replicas dropped was the same rows every
    epoch, never trained on. Now every row is, each epoch, and a replica resumed mid-epoch (its own position) goes
    on with its own next rows."""
    records = [{"text": t} for t in texts_of_lengths(*[3 + 7 * i % 45 for i in range(24)])]
    dm = TextFileDataModule(records=records, tokenizer="bytes", seq_len=30, batch_size=2)
    dm.setup("fit")
    num_rows = len(dm.train_set)
    assert num_rows % replicas  # an uneven tail
    shape = (num_rows + replicas - 1) // replicas, dm.seq_len
    # each row by its index (its tokens are unique to it here)
    index = {tuple(dm.train_set[i]["input_ids"].tolist()): i for i in range(num_rows)}
    assert len(index) == num_rows
    for epoch in range(2):
        seen = []
        for rank in range(replicas):
            loader = ResumableLoader(dm.train_set, batch_size=2, num_replicas=replicas, rank=rank)
            loader.sampler.set_epoch(epoch)
            mine = torch.cat([b["input_ids"] for b in loader])
            assert mine.shape == shape
            seen += [index[tuple(r)] for r in mine.tolist()]
            interrupted = ResumableLoader(dm.train_set, batch_size=2, num_replicas=replicas, rank=rank)
            interrupted.sampler.set_epoch(epoch)
            first = next(iter(interrupted))["input_ids"]
            resumed = ResumableLoader(dm.train_set, batch_size=2, num_replicas=replicas, rank=rank)
            resumed.load_state_dict(interrupted.state_dict())
            resumed.sampler.set_epoch(epoch)
            assert torch.equal(torch.cat([first, *(b["input_ids"] for b in resumed)]), mine)
        assert sorted(set(seen)) == list(range(num_rows)), epoch  # every row trained on
        assert len(seen) - num_rows == -num_rows % replicas  # the padding: a few rows twice


def test_the_needle_task_refuses_data_parallel_replicas():
    """It draws one stream of batches: replicas would all train on it (Lightning cannot shard its batch sampler)."""
    from types import SimpleNamespace

    data = NeedleRetrievalDataModule(seq_len=64, train_samples=4)
    data.trainer = SimpleNamespace(
        strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 2, "rank": 1})
    )
    with pytest.raises(OOMBConfigError, match="one stream of batches, not one per data replica \\(2 here\\)"):
        data.train_dataloader()


def test_the_text_loader_takes_its_replicas_share_from_the_strategy(text_corpus):
    """Under ``oomb_cp`` with data parallelism the strategy's ``distributed_sampler_kwargs`` name the data replica;
    Lightning keeps the loader's own sampler (a ``DistributedSampler``), which resumes."""
    from types import SimpleNamespace

    _, tok_dir = text_corpus
    data = TextFileDataModule(records=[{"text": TEXT}] * 4, tokenizer=str(tok_dir), seq_len=16)
    data.trainer = SimpleNamespace(
        strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 2, "rank": 1})
    )
    data.setup("fit")
    sampler = data.train_dataloader().sampler
    assert (sampler.num_replicas, sampler.rank, len(sampler)) == (2, 1, math.ceil(sampler.num_rows / 2))
