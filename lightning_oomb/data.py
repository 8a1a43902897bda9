"""Data for long-context training: a synthetic long-range retrieval task and packed local documents.

Both data modules yield batches ``{"input_ids": LongTensor[B, N], "labels": LongTensor[B, N]}`` of equal-length
rows (no padding, no attention mask), plus ``position_ids: LongTensor[B, N]`` for packed documents (the Hugging
Face packing convention: positions restart at every document), so a LightningModule can call
``self.model(**batch)`` unchanged under any strategy.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import glob
import hashlib
import itertools
import json
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import ConcatDataset, DataLoader, Dataset, DistributedSampler, Sampler

from lightning_oomb.engine.errors import OOMBConfigError
from lightning_oomb.engine.loss import IGNORE_INDEX

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Batch = dict[str, torch.Tensor]


class NeedleRetrievalDataset(Dataset):
    """Synthetic sequences whose last token can only be predicted by looking back at least half the sequence.

    Vocabulary (``vocab_size = num_filler + 1 + num_values`` ids): ``[0, num_filler)`` filler,
    ``num_filler`` the query marker, then ``num_values`` value tokens. Each sequence draws one value ``v``; the
    first half is random filler with ``v`` written at a random ``needle_fraction`` of its positions (one
    position when the fraction is 0: the classic single needle); the second half is filler only and ends with
    ``query, v``. Labels are ``-100`` except the final ``v``, so the loss is the answer's cross-entropy alone and
    a model that ignores the context cannot beat :attr:`baseline_loss` = ``ln(num_values)``. The nearest copy of
    the answer is at least ``seq_len // 2 - 1`` tokens before the query.

    Sample ``i`` depends only on ``(seed, i)``: deterministic, generated on the fly, nothing downloaded.
    """

    def __init__(
        self,
        num_samples: int,
        seq_len: int = 16384,
        num_values: int = 8,
        num_filler: int = 16,
        needle_fraction: float = 0.0,
        seed: int = 0,
    ) -> None:
        if seq_len < 8:
            raise OOMBConfigError(
                f"seq_len={seq_len} is too short for a needle task — the needle half, the filler half and the "
                "query need room — use seq_len >= 8."
            )
        if num_values < 2 or num_filler < 1 or num_samples < 0:
            raise OOMBConfigError(
                f"num_values={num_values}, num_filler={num_filler}, num_samples={num_samples}: a retrieval task "
                "needs at least 2 values to choose from and 1 filler token — raise them."
            )
        if not 0.0 <= needle_fraction <= 1.0:
            raise OOMBConfigError(
                f"needle_fraction={needle_fraction} is not a fraction — it is the share of first-half positions "
                "holding the answer — use a value in [0, 1] (0 = a single needle)."
            )
        self.num_samples = num_samples
        self.seq_len = seq_len
        self.num_values = num_values
        self.num_filler = num_filler
        self.needle_fraction = needle_fraction
        self.seed = seed

    @property
    def vocab_size(self) -> int:
        return self.num_filler + 1 + self.num_values

    @property
    def query_token(self) -> int:
        return self.num_filler

    @property
    def baseline_loss(self) -> float:
        """Loss (nats) of the best prediction without the context: uniform over the values."""
        return math.log(self.num_values)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> Batch:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range for {self.num_samples} samples")
        rng = np.random.default_rng([self.seed, index])  # every (seed, index) its own stream
        n, half = self.seq_len, self.seq_len // 2
        input_ids = rng.integers(0, self.num_filler, n)
        value = self.num_filler + 1 + int(rng.integers(self.num_values))
        copies = max(1, round(self.needle_fraction * half))
        input_ids[rng.choice(half, copies, replace=False)] = value
        input_ids[-2:] = self.query_token, value
        input_ids = torch.from_numpy(input_ids)
        labels = torch.full_like(input_ids, IGNORE_INDEX)
        labels[-1] = value
        return {"input_ids": input_ids, "labels": labels}


class NeedleRetrievalDataModule(LightningDataModule):
    """Train / held-out splits of :class:`NeedleRetrievalDataset` (disjoint random streams), with an optional
    short-context warm-up (a length curriculum) before the full-length training sequences.

    Args:
        seq_len: tokens per sequence.
        num_values: candidate answers; the no-context baseline loss is ``ln(num_values)``.
        num_filler: distinct filler tokens.
        needle_fraction: share of the first half's positions that hold the answer (0: a single needle).
            More copies make the task easier to learn; the distance to the query does not change.
        train_samples: full-length training sequences.
        val_samples: held-out full-length sequences.
        batch_size: sequences per full-length batch.
        seed: the training stream; the held-out stream uses ``seed + 1``, the warm-up ``seed + 2``.
        short_seq_len: length of the warm-up sequences (``None``: no warm-up).
        short_samples: warm-up sequences; they come first, in batches of ``short_batch_size``.
        short_batch_size: sequences per warm-up batch (short sequences are cheap: large batches give smoother
            gradients for the same time).
    """

    def __init__(
        self,
        seq_len: int = 16384,
        num_values: int = 8,
        num_filler: int = 16,
        needle_fraction: float = 0.0,
        train_samples: int = 64,
        val_samples: int = 4,
        batch_size: int = 1,
        seed: int = 0,
        short_seq_len: int | None = None,
        short_samples: int = 0,
        short_batch_size: int = 1,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if batch_size < 1 or short_batch_size < 1:
            raise OOMBConfigError(
                f"batch_size={batch_size}, short_batch_size={short_batch_size}: batches need at least one "
                "sequence — use positive sizes."
            )
        task = {"num_values": num_values, "num_filler": num_filler, "needle_fraction": needle_fraction}
        short = short_samples if short_seq_len is not None else 0
        self.train_set = ConcatDataset(
            [
                NeedleRetrievalDataset(short, short_seq_len or seq_len, seed=seed + 2, **task),
                NeedleRetrievalDataset(train_samples, seq_len, seed=seed, **task),
            ]
        )
        self.val_set = NeedleRetrievalDataset(val_samples, seq_len, seed=seed + 1, **task)
        # batches never mix the two lengths
        self.train_batches = _batches(0, short, short_batch_size) + _batches(short, train_samples, batch_size)
        self.batch_size = batch_size
        # the training steps' shapes, for the memory plan (the warm-up's can take more: a larger batch)
        self.step_sizes = [(short_seq_len, short_batch_size)] * bool(short) + [(seq_len, batch_size)]

    @property
    def vocab_size(self) -> int:
        return self.val_set.vocab_size

    @property
    def largest_token_id(self) -> int:
        """The largest token id of the batches: a model's embedding must hold it."""
        return self.vocab_size - 1

    @property
    def baseline_loss(self) -> float:
        return self.val_set.baseline_loss

    def train_dataloader(self) -> DataLoader:
        # in order (warm-up first); the samples are random already
        if (replicas := data_replicas(self)[0]) > 1:
            raise OOMBConfigError(
                f"NeedleRetrievalDataModule draws one stream of batches, not one per data replica ({replicas} here) "
                "— train it on one device or one context group (oomb_cp with context_parallel_size = devices), or "
                "shard your data with TextFileDataModule."
            )
        return ResumableBatchLoader(self.train_set, self.train_batches)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)

    def test_dataloader(self) -> DataLoader:
        """The held-out sequences (``trainer.test`` / ``oomb test``: no split of its own)."""
        return self.val_dataloader()


class ResumableIteration(DataLoader, abc.ABC):
    """A ``DataLoader`` that a checkpoint can stop and resume mid-epoch, at the next :attr:`unit` of its order.

    Lightning saves ``state_dict()`` of every train dataloader that has one with the checkpoint and gives it back
    through ``load_state_dict()`` on resume (before the first batch is drawn; then ``set_epoch``). The state is
    ``{"epoch", unit: how many of the epoch's order have left the loader, ...}`` — counted in the main process as
    batches are handed out (what workers prefetched does not count) — with what that position means something
    under (:meth:`_setting`): a resume that changes one is refused, as it would skip or repeat data. A state of
    another epoch (saved at an epoch's end) resumes nothing."""

    unit: str  # what the position counts

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._position = {"epoch": 0, self.unit: 0}
        self._resume: dict[str, int] | None = None

    @abc.abstractmethod
    def _order(self):
        """The sampler (or batch sampler) of the epoch's order: its ``epoch``, ``skip(n)`` of its next iteration."""

    @abc.abstractmethod
    def _setting(self) -> dict[str, int | bool | str]:
        """What a saved position means something under."""

    @abc.abstractmethod
    def _handed_out(self, done: int) -> int:
        """The position after one more batch, from ``done``."""

    def state_dict(self) -> dict[str, int]:
        position = self._resume if self._resume is not None else self._position
        return {**position, **self._setting()}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        # (a checkpoint from before a key was saved is checked for the keys it has)
        changed = [
            f"{k} {state_dict[k]} -> {v}" for k, v in self._setting().items() if state_dict.get(k, v) != v
        ]
        if changed:
            raise OOMBConfigError(
                f"the checkpoint's training data position was saved under other settings ({', '.join(changed)}), "
                f"so resumed here it would skip or repeat data — resume with the same data and data module "
                f"settings{self._same}, or start a new fit from the checkpoint's weights."
            )
        self._resume = {"epoch": state_dict["epoch"], self.unit: state_dict[self.unit]}

    _same = ""  # what else a resume keeps, for the refusal

    def __iter__(self) -> Iterator[Batch]:
        # A generator: nothing below runs before the first batch is asked for, after load_state_dict and set_epoch
        order = self._order()
        resume, self._resume = self._resume, None
        done = resume[self.unit] if resume is not None and resume["epoch"] == order.epoch else 0
        order.skip(done)
        self._position = {"epoch": order.epoch, self.unit: done}
        for batch in super().__iter__():
            self._position[self.unit] = self._handed_out(self._position[self.unit])
            yield batch


class FixedBatches(Sampler[list[int]]):
    """The same batches of indices every epoch, the next iteration starting part-way (:meth:`skip`); Lightning
    sets its epoch (``set_epoch``)."""

    def __init__(self, batches: list[list[int]]) -> None:
        self.batches, self.epoch, self._skip = batches, 0, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def skip(self, batches: int) -> None:
        """Start the next iteration after the epoch's first ``batches`` batches."""
        self._skip = batches

    def __iter__(self) -> Iterator[list[int]]:
        start, self._skip = self._skip, 0
        return iter(self.batches[start:])

    def __len__(self) -> int:
        return len(
            self.batches
        )  # the whole epoch's, also when resumed: Lightning counts the skipped ones as done


class ResumableBatchLoader(ResumableIteration):
    """A ``DataLoader`` over :class:`FixedBatches` that a checkpoint can stop and resume mid-epoch: its state is
    ``{"epoch", "batches", "num_batches"}``, the batches of the epoch handed out (:class:`ResumableIteration`)."""

    unit = "batches"

    def __init__(self, dataset: Dataset, batches: list[list[int]]) -> None:
        super().__init__(dataset, batch_sampler=FixedBatches(batches))

    def _order(self) -> FixedBatches:
        return self.batch_sampler

    def _setting(self) -> dict[str, int | bool]:
        return {"num_batches": len(self.batch_sampler)}

    def _handed_out(self, done: int) -> int:
        return done + 1


def _batches(start: int, count: int, size: int) -> list[list[int]]:
    """Indices ``[start, start + count)`` in consecutive batches of ``size`` (the last may be smaller)."""
    return [list(range(i, min(i + size, start + count))) for i in range(start, start + count, size)]


def pack(tokens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """A 1-D token stream as consecutive rows ``[len // seq_len, seq_len]`` (the tail is dropped)."""
    return tokens[: len(tokens) // seq_len * seq_len].view(-1, seq_len)


def concatenate(docs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Documents (1-D token tensors) as one stream: ``tokens [T]`` (the dtype of ``docs``) and ``starts [T]`` (bool,
    True at each document's first token)."""
    if not docs:
        return torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.bool)
    tokens = torch.cat(list(docs))
    lengths = torch.tensor([len(d) for d in docs])
    starts = torch.zeros(len(tokens), dtype=torch.bool)
    starts[lengths.cumsum(0)[:-1]] = True
    starts[0] = True
    return tokens, starts


def pack_documents(docs: Sequence[torch.Tensor], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Documents concatenated in order (:func:`concatenate`) and cut into rows: ``tokens [R, seq_len]`` and
    ``starts [R, seq_len]``; the tail is dropped."""
    tokens, starts = concatenate(docs)
    return pack(tokens, seq_len), pack(starts, seq_len)


def split_at_starts(rows: torch.Tensor, starts: torch.Tensor) -> list[torch.Tensor]:
    """The inverse of :func:`pack_documents`: rows ``[R, N]`` (or a stream ``[T]``) back into 1-D pieces, cut before
    every start (the first token is taken as a start)."""
    cuts = starts.flatten().nonzero().flatten()
    return list(torch.tensor_split(rows.flatten(), cuts[cuts > 0]))


def document_positions(starts: torch.Tensor) -> torch.Tensor:
    """Position ids ``LongTensor[N]`` of one row: 0 at every document start (``starts``, bool ``[N]``) and at the
    row's first token, then counting up."""
    index = torch.arange(len(starts))
    last_start = torch.where(starts, index, 0).cummax(0).values
    return index - last_start


class PackedRows(Dataset):
    """Rows ``[R, N]`` of token ids as samples ``{"input_ids", "labels"}`` (``LongTensor[N]``; labels = inputs, the
    model shifts them). With ``starts`` (bool ``[R, N]``, True at document starts) samples are packed documents in
    the Hugging Face convention: ``position_ids`` from :func:`document_positions` and ``labels = -100`` wherever
    ``position_ids == 0`` (no token predicts the first token of the next document)."""

    def __init__(self, rows: torch.Tensor, starts: torch.Tensor | None = None) -> None:
        self.rows = rows
        self.starts = starts

    @functools.cached_property
    def fingerprint(self) -> str:
        """A digest of the rows (and document starts): what a resumed position was counted over (other files,
        tokenizer or ``add_bos`` give other rows)."""
        digest = hashlib.blake2b(self.rows.contiguous().numpy().tobytes(), digest_size=8)
        if self.starts is not None:
            digest.update(self.starts.contiguous().numpy().tobytes())
        return digest.hexdigest()

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Batch:
        row = self.rows[index].long()
        if self.starts is None:
            return {"input_ids": row, "labels": row}
        position_ids = document_positions(self.starts[index])
        labels = row.masked_fill(position_ids == 0, IGNORE_INDEX)
        return {"input_ids": row, "labels": labels, "position_ids": position_ids}


class RowSampler(DistributedSampler):
    """Row indices of one epoch: ``0 .. num_rows - 1`` in order, or (``shuffle``) a permutation that depends only on
    ``(seed, epoch)``. Under data parallelism (``num_replicas`` > 1) the order is padded as ``DistributedSampler``
    pads it by default (``drop_last=False``): by wrapping around to its first rows until it divides among the
    replicas; replica ``rank`` then takes every ``num_replicas``-th row from its ``rank``-th. So every row is trained
    on every epoch and every replica takes as many rows (``ceil(num_rows / num_replicas)``), at the cost of up to
    ``num_replicas - 1`` rows seen twice in an epoch (the order's first: other rows each epoch when shuffled, the
    same with packed rows, whose order is fixed). Dropping the tail instead would, with a fixed order, leave the
    same rows out every epoch: never trained on. The next iteration can start part-way into the replica's rows
    (:meth:`skip`). A ``DistributedSampler``, so Lightning keeps it rather than injecting its own."""

    def __init__(
        self, num_rows: int, shuffle: bool = False, seed: int = 0, num_replicas: int = 1, rank: int = 0
    ):
        super().__init__(range(num_rows), num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=False)  # fmt: skip
        self.num_rows = num_rows
        self._skip = 0

    def skip(self, rows: int) -> None:
        """Start the next iteration after the replica's first ``rows`` rows of the epoch."""
        self._skip = rows

    def order(self) -> list[int]:
        """The epoch's rows in order, unpadded: alike on every replica."""
        if not self.shuffle:
            return list(range(self.num_rows))
        return np.random.default_rng([self.seed, self.epoch]).permutation(self.num_rows).tolist()

    def __iter__(self) -> Iterator[int]:
        order = self.order()
        if padding := self.total_size - len(order):  # wrap around (more than once if replicas > rows)
            order += (order * math.ceil(padding / len(order)))[:padding]
        mine = order[self.rank : self.total_size : self.num_replicas]
        rows, self._skip = mine[self._skip :], 0
        return iter(rows)

    def __len__(self) -> int:
        # the replica's whole epoch, also when resumed: Lightning counts the skipped batches as done already
        return self.num_samples


def data_replicas(datamodule: LightningDataModule) -> tuple[int, int]:
    """``(replicas, rank)``: how the Trainer's strategy shards data (its ``distributed_sampler_kwargs``: under
    ``oomb_cp`` the data-parallel replicas, a context group reading the same rows); ``(1, 0)`` without."""
    trainer = getattr(datamodule, "trainer", None)
    shards = getattr(getattr(trainer, "strategy", None), "distributed_sampler_kwargs", None) or {}
    return int(shards.get("num_replicas", 1)), int(shards.get("rank", 0))


class ResumableLoader(ResumableIteration):
    """A ``DataLoader`` over a :class:`RowSampler` that a checkpoint can stop and resume mid-epoch, at the next row
    (:class:`ResumableIteration`). The state is ``{"epoch", "rows", ...}`` and what that position means something
    under: the row count and (for :class:`PackedRows`) a digest of the rows, ``batch_size`` (Lightning counts the
    epoch's done batches), the data replicas and the order's ``seed`` and ``shuffle``. Under data parallelism each replica draws its share of the rows
    (:class:`RowSampler`: every row, the order padded to divide; ``rows``: the replica's, alike on every replica), a
    context group the same ones. (A position saved when the uneven tail was dropped still resumes right: each
    replica's rows before the padding are the same.)
    """

    unit = "rows"
    _same = " (batch_size, seed, shuffle) and devices"

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int = 1,
        shuffle: bool = False,
        seed: int = 0,
        num_workers: int = 0,
        num_replicas: int = 1,
        rank: int = 0,
    ) -> None:
        sampler = RowSampler(len(dataset), shuffle=shuffle, seed=seed, num_replicas=num_replicas, rank=rank)
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers)

    def _order(self) -> RowSampler:
        return self.sampler

    def _setting(self) -> dict[str, int | bool | str]:
        sampler = self.sampler
        setting = {"num_rows": sampler.num_rows, "batch_size": self.batch_size, "num_replicas": sampler.num_replicas,
                   "seed": sampler.seed, "shuffle": sampler.shuffle}  # fmt: skip
        fingerprint = getattr(self.dataset, "fingerprint", None)  # PackedRows'
        return setting if fingerprint is None else {**setting, "data": fingerprint}

    def _handed_out(self, done: int) -> int:
        return min(done + self.batch_size, len(self.sampler))


def expand_paths(files: str | Path | Sequence[str | Path]) -> list[Path]:
    """Paths and glob patterns to the existing files they name, each once (a file named twice, by two paths too,
    is read once), sorted within each pattern, in the patterns' order; raise if none match (or a pattern names only
    a directory). A path to an existing file is that file, even if it has glob characters (``doc[1].txt``)."""
    patterns = [files] if isinstance(files, (str, Path)) else list(files)
    found: dict[Path, Path] = {}
    for pattern in patterns:
        path = Path(pattern).expanduser()
        matches = [str(path)] if path.is_file() else sorted(glob.glob(str(path), recursive=True))
        if not matches:
            raise OOMBConfigError(
                f"no file matches {str(pattern)!r} — TextFileDataModule reads local text and .jsonl files — check "
                "the path or glob (e.g. 'data/**/*.txt')."
            )
        files_found = [Path(m) for m in matches if Path(m).is_file()]
        if not files_found:
            raise OOMBConfigError(
                f"{str(pattern)!r} names a directory, not files — TextFileDataModule reads the files a path or glob "
                f"names — use e.g. '{Path(pattern) / '**' / '*.txt'}'."
            )
        for m in files_found:
            found.setdefault(m.resolve(), m)
    return list(found.values())


JSON_LINES = (".jsonl", ".ndjson")  # one JSON record per line (any case)


def _text_of(record: Any, text_field: str, where: str) -> str:
    """The document text of one record, or an error naming the record (``where``)."""
    if not isinstance(record, Mapping):
        problem = f"is a {type(record).__name__}, not a mapping"
    elif text_field not in record:
        problem = f"has no field {text_field!r} (its fields: {', '.join(map(str, record)) or 'none'})"
    elif not isinstance(record[text_field], str):
        problem = f"holds a {type(record[text_field]).__name__} under {text_field!r}, not a string"
    else:
        return record[text_field].removeprefix("\ufeff")  # a byte-order mark (a file's, read raw) is no text
    raise OOMBConfigError(
        f"{where} {problem} — each record must be a mapping whose text_field ({text_field!r}) is the document's "
        "text — fix the record, or set text_field to the field that holds the text."
    )


def read_documents(
    files: str | Sequence[str] | None = None,
    records: Iterable[Mapping[str, Any]] | None = None,
    text_field: str = "text",
) -> list[str]:
    """Document texts in source order: ``records`` in order, or the files sorted by path, a text file being one
    document and a JSON Lines file (``.jsonl`` / ``.ndjson``, any case) one document per non-blank line (the JSON
    record's ``text_field``); a ``.json`` file is refused (not one record per line). A UTF-8 byte-order mark at a
    file's or a record's start (Windows editors write one) is no text: it is dropped."""
    if records is not None:
        return [_text_of(record, text_field, f"record {i}") for i, record in enumerate(records)]
    texts: list[str] = []
    for path in expand_paths(files or []):
        kind = path.suffix.lower()
        if kind == ".json":
            raise OOMBConfigError(
                f"{path} is a .json file — TextFileDataModule reads text files (one document each) and JSON Lines "
                "(.jsonl: one record per line) — write its records one per line to a .jsonl file, or pass them "
                "as records=."
            )
        try:  # decoded whole: an error's byte counts from the file's start ("utf-8-sig" counts after the mark)
            text = path.read_text(encoding="utf-8").removeprefix("\ufeff")
        except UnicodeDecodeError as error:
            raise OOMBConfigError(
                f"{path} is not UTF-8 text ({error.reason} at byte {error.start}) — TextFileDataModule reads UTF-8 "
                "— convert it (e.g. iconv -f latin1 -t utf-8) or leave it out of files."
            ) from None
        texts.extend(_records_of(path, text, text_field) if kind in JSON_LINES else [text])
    return texts


def _records_of(path: Path, text: str, text_field: str) -> list[str]:
    """The documents of a JSON Lines file's ``text``: each non-blank line's record's ``text_field``."""
    texts = []
    for number, line in enumerate(text.split("\n"), 1):  # not splitlines(): JSON strings may hold U+2028 raw
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise OOMBConfigError(
                f"{path}:{number} is not JSON ({error.msg}) — a .jsonl file holds one JSON record per line "
                "— fix the line, or rename the file if it is plain text."
            ) from None
        texts.append(_text_of(record, text_field, f"{path}:{number}"))
    return texts


BYTE_TOKENIZER = "bytes"


def check_local_dir(path: str | None, name: str, holds: str) -> None:
    """Refuse a local path (``/``, ``.`` or ``~`` first) that is no directory, before transformers reads it as a hub
    id ('Repo id must be in the form ...')."""
    if path is not None and str(path).startswith(("/", ".", "~")) and not Path(path).expanduser().is_dir():
        raise OOMBConfigError(
            f"{name}={path!r} is not a directory (a local path: it should hold {holds}) — give an existing "
            "directory, or a hub id such as 'Qwen/Qwen2.5-7B'."
        )


def load_tokenizer(name: str) -> PreTrainedTokenizerBase:
    """``AutoTokenizer.from_pretrained(name)``; ``"bytes"`` is a byte-level tokenizer that needs no files (ByT5's:
    ids 0, 1, 2 are pad, EOS, unk and byte ``b`` of the UTF-8 text is id ``b + 3``, 259 ids in all)."""
    if name == BYTE_TOKENIZER:
        from transformers import ByT5Tokenizer

        return ByT5Tokenizer(extra_ids=0)
    check_local_dir(name, "tokenizer", "the tokenizer's files")
    from transformers import AutoTokenizer

    with hub_errors_named(name, "tokenizer"):
        return AutoTokenizer.from_pretrained(name)


@contextlib.contextmanager
def hub_errors_named(name: str, what: str) -> Iterator[None]:
    """Turn transformers' ``OSError`` for a hub id it cannot fetch (no network, a wrong id, a gated model) into an
    :class:`OOMBConfigError` that names the id and the fix."""
    try:
        yield
    except OSError as error:
        raise OOMBConfigError(
            f"{what} {name!r} could not be loaded ({type(error).__name__}: {str(error).splitlines()[0]}) — no "
            "network, a wrong id or a gated model — pass a local directory (save_pretrained) or, with the files in "
            "the Hugging Face cache, set HF_HUB_OFFLINE=1."
        ) from error


def tokenize_documents(
    tokenizer: PreTrainedTokenizerBase,
    texts: Sequence[str],
    eos_token_id: int | None,
    batch: int = 1024,
    start_ids: Sequence[int] = (),
) -> list[torch.Tensor]:
    """Each text's token ids without special tokens, after ``start_ids`` (a BOS: :func:`sequence_start`) and
    followed by ``eos_token_id`` (when given), as ``IntTensor``s; texts without tokens are dropped. A special
    token's text inside a document (``</s>``, an HTML strikethrough tag; ``<|endoftext|>`` in a text about
    tokenizers) is tokenized as text, not as that token (``split_special_tokens``: an EOS mid-document would teach
    the model to end there). Tokenized ``batch`` texts at a time (fast tokenizers work on batches in parallel)."""
    start = list(start_ids)
    eos = [] if eos_token_id is None else [eos_token_id]
    docs = []
    for i in range(0, len(texts), batch):
        encoded = _encode(tokenizer, list(texts[i : i + batch]), special=False)
        docs += [torch.tensor(start + ids + eos, dtype=torch.int32) for ids in encoded if ids]
    return docs


def _encode(tokenizer: PreTrainedTokenizerBase, texts: list[str], special: bool) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=special, split_special_tokens=True, verbose=False)["input_ids"]


PROBE = "Hello"  # a text nearly every tokenizer has tokens for


def sequence_start(tokenizer: PreTrainedTokenizerBase, texts: Iterable[str] = ()) -> list[int] | None:
    """The ids ``tokenizer`` puts before a text's own tokens when it adds special tokens: its BOS for Llama, Mistral
    or Gemma, ``[CLS]`` for BERT, nothing for GPT-2, Qwen or ``"bytes"``. Read off what it makes of a probe text
    (:data:`PROBE`, else the first 1000 characters of each of ``texts`` in turn) with and without special tokens:
    what the tokenizer does, whatever its class (in transformers 5 ``add_bos_token`` can be False for a tokenizer
    whose ``tokenizer.json`` adds a BOS, and ``build_inputs_with_special_tokens`` is gone from fast tokenizers).
    ``None`` when no probe has tokens; raises when the special tokens change the text's own tokens."""
    for probe in itertools.chain([PROBE], (text[:1000] for text in texts)):
        plain = _encode(tokenizer, [probe], special=False)[0]
        if not plain:
            continue
        full = _encode(tokenizer, [probe], special=True)[0]
        for k in range(len(full) - len(plain) + 1):
            if full[k : k + len(plain)] == plain:
                return full[:k]
        raise OOMBConfigError(
            f"the tokenizer tokenizes {probe[:40]!r} as {plain[:8]} without special tokens but {full[:8]} with "
            "them, so what it adds at a sequence start cannot be read off — set add_bos=True (its bos_token before "
            "every document) or add_bos=False (none)."
        )
    return None


class TextFileDataModule(LightningDataModule):
    """Documents from local text or JSON-lines files (or Python records), tokenized and packed into rows of exactly
    ``seq_len`` tokens.

    Documents: a text file (read whole, UTF-8) is one document; a ``*.jsonl`` (or ``.ndjson``) file holds one JSON
    record per line, the document under ``text_field``; ``records`` is any iterable of mappings with that field,
    e.g. a Hugging Face ``datasets.Dataset``. Each document is tokenized without special tokens, preceded by what
    the tokenizer itself adds at a sequence start (``add_bos``; Llama's and Gemma's BOS, nothing for GPT-2, Qwen or
    ``bytes``: the model sees documents start as in its own training) and followed by the tokenizer's EOS token, or,
    for a tokenizer without one, its SEP token (how BERT-style tokenizers end a sequence). A tokenizer with neither
    is refused, with ``pack=False`` too (documents would run into each other unmarked).

    Batches with ``pack=True`` (the default) are ``{"input_ids", "labels", "position_ids"}``, each
    ``LongTensor[batch_size, seq_len]``, in the Hugging Face packing convention (``DataCollatorWithFlattening``):
    ``position_ids`` are 0 at every document start and count up from there; ``labels`` equal ``input_ids`` except
    -100 wherever ``position_ids == 0``, so no token is trained to predict the first token of the next document.
    A document's BOS is its position 0: an input, never a target (as in unpacked training, where the shift drops
    the first label); the model is trained to predict the document's first token from it.
    A document longer than the rest of its row continues in the next row, where its positions restart at 0, as if
    its remainder were a document of its own (with no BOS: it is no document start): every row is self-contained
    (the model never sees the previous row, and positions continuing from it would describe context that is not
    there). HF models given ``position_ids``, no ``attention_mask`` and ``use_cache=False`` keep packed documents
    apart (a new document wherever positions do not step by 1; with transformers' default KV cache they do not:
    :class:`~lightning_oomb.models.CausalLMModule` passes it); so does the OOMB strategy.
    With ``pack=False`` documents form one plain stream, batches are ``{"input_ids", "labels"}`` with labels equal
    to input ids (a BOS is a target too, after the previous document's EOS), and attention crosses document ends.

    Splits: the documents in source order (files sorted by path, lines and records in order) form one stream; its
    last ``val_rows * seq_len`` tokens are the validation rows, the same whatever ``seed``, ``shuffle`` and
    ``pack``; the tokens before them are the training set. With ``pack=True`` the training documents (a document
    cut by the validation boundary keeps its training part) are shuffled by ``seed`` (if ``shuffle``) and packed
    once, so training rows come in the same order every epoch; with ``pack=False`` the training rows are shuffled
    each epoch by ``(seed, epoch)`` (if ``shuffle``). The training tokens that fill no row (fewer than ``seq_len``:
    the end of the shuffled documents, or of the training text in source order) are not trained, and ``setup`` says
    how many; the seed decides which documents they end.

    Data parallelism: each replica trains on its share of every epoch's rows; when they do not divide evenly, the
    order wraps around to its first rows (``DistributedSampler``'s default), so every row is trained on and up to
    ``replicas - 1`` rows twice an epoch (:class:`RowSampler`).

    Resuming: the train dataloader (:class:`ResumableLoader`) is saved with every checkpoint (epoch and rows
    handed out), so a fit resumed from a mid-epoch checkpoint continues at the next row, not at the epoch's start.

    Everything is held in memory (5 bytes a token: the id and whether a document starts there): this is for corpora of up to a few hundred million tokens;
    stream bigger ones from your own data module.

    Args:
        files: text and ``.jsonl`` files: paths or glob patterns (``**`` recurses). Give ``files`` or ``records``.
        tokenizer: local directory or hub id for ``AutoTokenizer.from_pretrained``, or ``bytes``: a byte-level
            tokenizer that needs no files (UTF-8 bytes as ids 3-258, EOS 1; ``vocab_size`` 259), for models
            trained from scratch.
        seq_len: tokens per row (at least 2).
        batch_size: rows per batch.
        val_rows: rows held out for validation (0: no validation).
        shuffle: with ``pack=True``, shuffle the training documents (once, by ``seed``) before packing; with
            ``pack=False``, shuffle the training rows each epoch.
        num_workers: DataLoader worker processes.
        pack: pack documents with ``position_ids`` and boundary labels (above); ``False``: a plain token stream.
        seed: the training order (``seed_everything`` does not change it).
        text_field: the field of a JSON-lines record (or of a ``records`` item) that holds the document's text.
        records: instead of ``files``, an iterable of mappings with ``text_field``: from Python e.g. a Hugging
            Face ``datasets.Dataset``, from YAML a list. Read once, in :meth:`setup`; not saved in ``hparams``.
        add_bos: what starts each document. ``None``: what the tokenizer adds at a sequence start
            (:func:`sequence_start`), ``True``: its ``bos_token`` (refused without one; e.g. GPT-2's
            ``<|endoftext|>``, which it does not add itself), ``False``: nothing.
    """

    def __init__(
        self,
        files: str | list[str] | None = None,
        tokenizer: str | None = None,
        seq_len: int = 16384,
        batch_size: int = 1,
        val_rows: int = 0,
        shuffle: bool = True,
        num_workers: int = 0,
        pack: bool = True,
        seed: int = 0,
        text_field: str = "text",
        records: Iterable[Mapping[str, Any]] | None = None,
        add_bos: bool | None = None,
    ) -> None:
        super().__init__()
        if (files is None) == (records is None):
            raise OOMBConfigError(
                f"TextFileDataModule got {'both files and records' if files is not None else 'no documents'} — "
                "it reads one source — pass files (paths or globs of text/.jsonl files) or records (an iterable "
                "of mappings, from Python)."
            )
        if tokenizer is None:
            raise OOMBConfigError(
                "TextFileDataModule has no tokenizer — token ids must be the model's — pass tokenizer: the model's "
                "hub id or local directory (or 'bytes' for a byte-level tokenizer when training from scratch)."
            )
        if seq_len < 2:
            raise OOMBConfigError(
                f"seq_len={seq_len} leaves no token to predict — a row needs a token and its successor — use "
                "seq_len >= 2."
            )
        if batch_size < 1 or val_rows < 0 or num_workers < 0:
            raise OOMBConfigError(
                f"batch_size={batch_size}, val_rows={val_rows}, num_workers={num_workers}: batches need a row and "
                "counts cannot be negative — use batch_size >= 1, val_rows >= 0 and num_workers >= 0."
            )
        self.save_hyperparameters(ignore=["records"])
        self.files = files
        self.records = records
        self.tokenizer_name = tokenizer
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.val_rows = val_rows
        self.shuffle = shuffle
        self.num_workers = num_workers
        self.pack = pack
        self.seed = seed
        self.text_field = text_field
        self.add_bos = add_bos
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self.train_set: PackedRows | None = None
        self.val_set: PackedRows | None = None

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.tokenizer_name)
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """Token ids the tokenizer can produce (added tokens included): the embedding rows a model needs."""
        return len(self.tokenizer)

    @property
    def largest_token_id(self) -> int | None:
        """The largest token id of the rows (``None`` before ``setup``): a model's embedding must hold it (a
        tokenizer's added tokens the text never uses need no row)."""
        if self.train_set is None:
            return None
        return max(int(rows.rows.max()) for rows in (self.train_set, self.val_set) if rows.rows.numel())

    def documents(self) -> list[torch.Tensor]:
        """Every document's token ids (``IntTensor``: sequence-start tokens first, EOS last) in source order; bad
        input raises before tokenizing."""
        texts = read_documents(self.files, self.records, self.text_field)
        if not any(texts):
            source = "the records" if self.records is not None else f"files {self.files!r}"
            raise OOMBConfigError(
                f"the corpus is empty: {source} hold no text — there is nothing to train on — check the paths (or "
                "records) and text_field."
            )
        tok = self.tokenizer
        end = self._document_end()
        start = self._document_start(texts)
        docs = tokenize_documents(tok, texts, end, start_ids=start or ())
        if not docs:
            raise OOMBConfigError(
                f"tokenizer {self.tokenizer_name!r} turned the corpus's {len(texts)} document(s) into no tokens — it "
                "cannot read this text (e.g. a vocabulary without these characters) — pass the model's own "
                "tokenizer, or tokenizer='bytes'."
            )
        if start is None:  # some text has tokens, but no probe has: rare enough to ask rather than guess
            raise OOMBConfigError(
                f"tokenizer {self.tokenizer_name!r} has no tokens for the probe texts (the start of the corpus's "
                "documents), so what it adds at a sequence start cannot be read off — set add_bos=True (its "
                "bos_token before every document) or add_bos=False (none)."
            )
        return docs

    def _document_end(self) -> int:
        """The token after every document: the EOS, else the SEP; refused without either."""
        tok = self.tokenizer
        for end in (tok.eos_token_id, getattr(tok, "sep_token_id", None)):
            if end is not None:
                return end
        raise OOMBConfigError(
            f"tokenizer {self.tokenizer_name!r} has no EOS token (nor a SEP token) — every document ends with one, "
            "so the model learns where documents end (and, with pack=False, documents do not run into each other "
            "unmarked) — use the model's own tokenizer, or save this one with an EOS (tokenizer.eos_token = ...; "
            "tokenizer.save_pretrained(directory)) and pass that directory."
        )

    def _document_start(self, texts: Sequence[str]) -> list[int] | None:
        """The tokens before every document (``add_bos``); ``None``: the tokenizer's could not be read off."""
        if self.add_bos is False:
            return []
        if self.add_bos is None:
            return sequence_start(self.tokenizer, texts)
        bos = getattr(self.tokenizer, "bos_token_id", None)
        if bos is None:
            raise OOMBConfigError(
                f"add_bos=True, but tokenizer {self.tokenizer_name!r} has no BOS token — there is nothing to put "
                "before each document — use add_bos=None (what the tokenizer adds at a sequence start) or False."
            )
        return [bos]

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        tokens, starts = concatenate(self.documents())
        held = (
            self.val_rows * self.seq_len
        )  # the validation rows: the stream's last tokens, whatever the seed
        split = len(tokens) - held
        if split < self.seq_len:
            raise OOMBConfigError(
                f"the corpus holds {len(tokens):,} tokens, not enough for {self.val_rows} validation row(s) plus a "
                f"training row of seq_len={self.seq_len} — add text, lower seq_len or val_rows."
            )
        # the validation rows get storage of their own: a view would keep the whole corpus alive
        val_rows, val_starts = (
            pack(tokens[split:], self.seq_len).clone(),
            pack(starts[split:], self.seq_len).clone(),
        )
        if not self.pack:
            self.train_set, self.val_set = (
                PackedRows(pack(tokens[:split], self.seq_len)),
                PackedRows(val_rows),
            )
        else:
            pieces = split_at_starts(tokens[:split], starts[:split])
            if self.shuffle:
                pieces = [pieces[i] for i in np.random.default_rng(self.seed).permutation(len(pieces))]
            self.train_set = PackedRows(*pack_documents(pieces, self.seq_len))
            self.val_set = PackedRows(val_rows, val_starts)
        left = split % self.seq_len
        if left:
            rank_zero_info(
                f"TextFileDataModule: {left:,} of the {split:,} training tokens fill no row of seq_len={self.seq_len} "
                "and are not trained: the end of the "
                + (
                    "documents shuffled by seed"
                    if self.pack and self.shuffle
                    else "training text in source order"
                )
            )

    def train_dataloader(self) -> ResumableLoader:
        shuffle_rows = self.shuffle and not self.pack  # packed rows keep the order of the shuffled documents
        replicas, rank = data_replicas(self)
        return ResumableLoader(
            self.train_set,
            self.batch_size,
            shuffle=shuffle_rows,
            seed=self.seed,
            num_workers=self.num_workers,
            num_replicas=replicas,
            rank=rank,
        )

    def val_dataloader(self) -> DataLoader | list:
        if not self.val_rows:
            return []
        return DataLoader(self.val_set, batch_size=self.batch_size, num_workers=self.num_workers)

    def test_dataloader(self) -> DataLoader | list:
        """The held-out rows (``trainer.test`` / ``oomb test``: no split of its own)."""
        return self.val_dataloader()
