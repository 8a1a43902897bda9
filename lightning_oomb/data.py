"""Data for long-context training: a synthetic long-range retrieval task and packed local text files.

Both data modules yield batches ``{"input_ids": LongTensor[B, N], "labels": LongTensor[B, N]}`` of equal-length
rows (what ``OOMBStrategy`` trains on: no padding, no attention mask), so a LightningModule can call
``self.model(**batch)`` unchanged under any strategy.
"""

from __future__ import annotations

import glob
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import ConcatDataset, DataLoader, Dataset

from lightning_oomb.engine.errors import OOMBConfigError
from lightning_oomb.engine.loss import IGNORE_INDEX

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

    @property
    def vocab_size(self) -> int:
        return self.val_set.vocab_size

    @property
    def baseline_loss(self) -> float:
        return self.val_set.baseline_loss

    def train_dataloader(self) -> DataLoader:
        # in order (warm-up first); the samples are random already
        return DataLoader(self.train_set, batch_sampler=self.train_batches)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)


def _batches(start: int, count: int, size: int) -> list[list[int]]:
    """Indices ``[start, start + count)`` in consecutive batches of ``size`` (the last may be smaller)."""
    return [list(range(i, min(i + size, start + count))) for i in range(start, start + count, size)]


def pack(tokens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """A 1-D token stream as consecutive rows ``[len // seq_len, seq_len]`` (the tail is dropped)."""
    return tokens[: len(tokens) // seq_len * seq_len].view(-1, seq_len)


class PackedRows(Dataset):
    """Rows ``[R, N]`` of token ids as samples (labels = inputs; the model shifts them)."""

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Batch:
        row = self.rows[index]
        return {"input_ids": row, "labels": row}


def expand_paths(files: str | Sequence[str]) -> list[Path]:
    """Paths and glob patterns to a sorted, de-duplicated list of existing files; raise if none match."""
    patterns = [files] if isinstance(files, str) else list(files)
    found: dict[Path, None] = {}
    for pattern in patterns:
        matches = sorted(glob.glob(str(Path(pattern).expanduser()), recursive=True))
        if not matches:
            raise OOMBConfigError(
                f"no file matches {pattern!r} — TextFileDataModule reads local text files — check the path or "
                "glob (e.g. 'data/**/*.txt')."
            )
        found.update((Path(m), None) for m in matches if Path(m).is_file())
    return list(found)


class TextFileDataModule(LightningDataModule):
    """Local text files, tokenized with a Hugging Face tokenizer and packed into rows of ``seq_len`` tokens.

    Files are read whole (UTF-8), tokenized without special tokens and concatenated in order, with the
    tokenizer's EOS token (when it has one) after each file; the tail that does not fill a row is dropped. The
    last ``val_rows`` rows are held out for validation. Everything is kept in memory: this is for corpora of
    up to a few hundred million tokens; stream bigger ones from your own data module.

    Args:
        files: paths or glob patterns (``**`` recurses).
        tokenizer: local directory or hub id, loaded with ``AutoTokenizer.from_pretrained``.
        seq_len: tokens per row.
        batch_size: rows per batch.
        val_rows: rows held out for validation (0: no validation).
        shuffle: shuffle training rows each epoch.
        num_workers: DataLoader worker processes.
    """

    def __init__(
        self,
        files: str | list[str],
        tokenizer: str,
        seq_len: int = 16384,
        batch_size: int = 1,
        val_rows: int = 0,
        shuffle: bool = True,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.files = files
        self.tokenizer_name = tokenizer
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.val_rows = val_rows
        self.shuffle = shuffle
        self.num_workers = num_workers
        self._tokenizer = None
        self.train_set: PackedRows | None = None
        self.val_set: PackedRows | None = None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_name)
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """Token ids the tokenizer can produce (added tokens included): the embedding rows a model needs."""
        return len(self.tokenizer)

    def tokenize(self) -> torch.Tensor:
        """All files as one 1-D LongTensor of token ids."""
        tok = self.tokenizer
        ids: list[int] = []
        for path in expand_paths(self.files):
            ids += tok(path.read_text(encoding="utf-8"), add_special_tokens=False, verbose=False)["input_ids"]
            if tok.eos_token_id is not None:
                ids.append(tok.eos_token_id)
        return torch.tensor(ids, dtype=torch.long)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        tokens = self.tokenize()
        rows = pack(tokens, self.seq_len)
        if len(rows) <= self.val_rows:
            raise OOMBConfigError(
                f"the files hold {len(tokens)} tokens = {len(rows)} rows of seq_len={self.seq_len}, not enough "
                f"for {self.val_rows} validation row(s) plus training — add text, lower seq_len or val_rows."
            )
        split = len(rows) - self.val_rows
        self.train_set, self.val_set = PackedRows(rows[:split]), PackedRows(rows[split:])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set, batch_size=self.batch_size, shuffle=self.shuffle, num_workers=self.num_workers
        )

    def val_dataloader(self) -> DataLoader | list:
        if not self.val_rows:
            return []
        return DataLoader(self.val_set, batch_size=self.batch_size, num_workers=self.num_workers)
