"""A batch's layout: where each token sits (packed documents, right padding) and which targets count.

Hugging Face's conventions, so a ``DataCollatorWithFlattening`` batch or a padded one works unchanged:

- **Packed documents**: ``position_ids [B, N]`` restart at each document (a new document starts wherever a position does
  not exceed the previous one: ``DataCollatorWithFlattening``'s restarts at 0). A position that jumps *forward*
  continues its document (PoSE-style skipped positions, positions with a stride: RoPE takes them as given), as Hugging
  Face's training call reads them with its cache on (``transformers.masking_utils`` splits there only without a cache
  and mask; it read a stride of 2 as one-token documents, whose targets were all dropped). Attention never crosses a
  document boundary (``doc_start``: each token's document start) and RoPE uses the given positions. A document's last
  token predicts the next document's first *label* only where that label is an explicit target: one that differs from
  the input id there (``DataCollatorWithFlattening(separator_id=EOS)`` puts the separator there, so each document's last
  token learns to predict it, as transformers trains it). A label equal to the input id there (labels copied from
  ``input_ids``, or defaulted to them: the usual packed recipe) is the next document's first token, and no token is
  trained to predict it: documents stay apart.
- **Right padding**: an ``attention_mask`` that is ones then zeros per row (rows of a batch may differ in length):
  padded positions have no target (labels there are ignored) and real tokens never see them (they come after).
  Left padding and masks with holes are refused — they would need every real token to skip keys.
- **A lone last token**: for a model whose layers carry a state, a batch one token longer than a multiple of the chunk
  is right-padded by one token (:func:`pad_a_lone_last_token`).

Everything is decided here, before any chunk runs; :class:`Layout` is what the step uses.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from lightning_oomb.engine.errors import OOMBConfigError
from lightning_oomb.engine.loss import IGNORE_INDEX, shift_labels


@dataclass
class Layout:
    """``positions [1 | B, N]``: each token's RoPE position; ``doc_start [B, N]`` int32 (``None``: one document per
    row): the position in the row where its document starts; ``targets [B, N]``: what each position predicts
    (``IGNORE_INDEX``: nothing); ``tokens [B, N]`` bool (``None``: no padding): the real (not padded) tokens;
    ``span``: the largest position + 1 (the length unless packed documents restart positions), what a
    full-sequence call's length-dependent RoPE reads."""

    positions: torch.Tensor
    doc_start: torch.Tensor | None
    targets: torch.Tensor
    tokens: torch.Tensor | None = None
    span: int = 0


def _documents(position_ids: torch.Tensor, tokens: torch.Tensor | None) -> torch.Tensor | None:
    """int32 ``[B, N]`` document starts, or ``None`` if no row has a boundary after its first token. ``tokens``
    (``None``: all real): restarts in a row's padding are none (transformers fills padded positions with 1s)."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    # a restart starts a document; a forward jump continues it
    starts[:, 1:] = position_ids[:, 1:] <= position_ids[:, :-1]
    if tokens is not None:
        starts[:, 1:] &= tokens[:, 1:]
    if not bool(starts[:, 1:].any()):
        return None
    index = torch.arange(position_ids.shape[1], device=position_ids.device).expand_as(position_ids)
    return torch.where(starts, index, 0).cummax(1).values.to(torch.int32)


def plan_layout(
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
) -> Layout:
    """Validate ``position_ids`` / ``attention_mask`` of ``input_ids [B, N]`` and lay the batch out.

    ``labels`` (``input_ids`` when the caller has none): the target of position ``t`` is ``labels[t + 1]``. Across
    a document boundary (``t`` a document's last token) the targets are dropped when every boundary's label in the
    batch equals ``input_ids[t + 1]`` (labels copied or defaulted from ``input_ids``: the next document's first
    token, which documents trained apart never see) and kept when one differs (explicit targets, e.g.
    ``DataCollatorWithFlattening(separator_id=EOS)``'s separator: each document learns to end, as transformers
    trains it — also where the next document happens to start with the separator's id); ``-100`` there is ignored
    either way."""
    batch, seq_len = input_ids.shape
    labels = labels.clone()
    tokens = None
    if attention_mask is not None:
        if tuple(attention_mask.shape) != (batch, seq_len):
            raise OOMBConfigError(
                f"attention_mask {tuple(attention_mask.shape)} does not match input_ids {(batch, seq_len)} — give one "
                "mask value per token."
            )
        keep = attention_mask.bool()
        if bool((keep[:, 1:] & ~keep[:, :-1]).any()):
            raise OOMBConfigError(
                "attention_mask is not right padding — OOMB accepts a mask of ones then zeros per row (padding at "
                "the end; rows may differ in length), not left padding or holes — pad on the right "
                "(tokenizer.padding_side='right') or pack documents with position_ids that restart at 0."
            )
        labels[~keep] = IGNORE_INDEX
        tokens = None if bool(keep.all()) else keep
    if position_ids is None:
        positions = torch.arange(seq_len, device=input_ids.device)[None]
        return Layout(positions, None, shift_labels(labels), tokens, seq_len)
    if position_ids.dim() != 2 or position_ids.shape[1] != seq_len or position_ids.shape[0] not in (1, batch):
        raise OOMBConfigError(
            f"position_ids {tuple(position_ids.shape)} do not match input_ids {(batch, seq_len)} — pass [batch, "
            "tokens] (or [1, tokens]) positions, restarting at 0 where a packed document starts."
        )
    low, high = (0, 0) if position_ids.is_floating_point() else torch.aminmax(position_ids)  # one sync
    if position_ids.is_floating_point() or int(low) < 0:
        raise OOMBConfigError(
            "position_ids must be non-negative integers — they are RoPE positions, restarting at 0 per document."
        )
    positions = position_ids.expand(batch, -1)
    doc_start = _documents(positions, tokens)
    targets = shift_labels(labels)
    if doc_start is not None:
        # a document's last token predicts the next document's first label only if the labels are explicit targets
        # there (a collator's separator: one boundary label differs from its input id, the batch's labels are no
        # copy); labels copied or defaulted from input_ids would train it on another document's first token: dropped
        boundary = torch.zeros_like(targets, dtype=torch.bool)
        boundary[:, :-1] = doc_start[:, 1:] == torch.arange(1, seq_len, device=doc_start.device)
        copied = labels[:, 1:] == input_ids[:, 1:]
        explicit = boundary[:, :-1] & ~copied & (labels[:, 1:] != IGNORE_INDEX)
        if not bool(explicit.any()):
            kept = targets.masked_fill(boundary, IGNORE_INDEX)
            if bool((kept == IGNORE_INDEX).all()) and not bool((targets == IGNORE_INDEX).all()):
                warnings.warn(
                    "position_ids restart at every token the labels train: each document is one token, so no "
                    "token has a target in its own document and the loss is 0 — pass positions counting up within "
                    "each document (0, 1, 2, ...), restarting at 0 where a packed document starts.",
                    UserWarning,
                    stacklevel=2,
                )
            targets = kept
    return Layout(position_ids, doc_start, targets, tokens, int(high) + 1)


def pad_a_lone_last_token(
    chunk_size: int,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    position_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor] | None:
    """For a model whose layers carry a state: a batch whose last chunk would hold a single token, with one padded
    token after it, so that the last chunk holds two (transformers' recurrent layers take a single token with a state
    as a decoding step: an in-place update, not differentiable). Exact: the padded token comes after every real one
    (none sees it), has no target, and the last real token had none either. ``None`` if the batch needs no pad,
    else ``(input_ids, labels, position_ids, attention_mask)`` padded (the caller keeps its unpadded positions'
    span for length-dependent RoPE)."""
    seq_len = input_ids.shape[1]
    if seq_len <= chunk_size or seq_len % chunk_size != 1:
        return None
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    positions = None if position_ids is None else torch.cat([position_ids, position_ids[:, -1:] + 1], 1)
    return (
        torch.cat([input_ids, input_ids[:, -1:]], 1),
        torch.cat([labels, torch.full_like(labels[:, -1:], IGNORE_INDEX)], 1),
        positions,
        torch.cat([mask, torch.zeros_like(mask[:, -1:])], 1),
    )


def key_floors(doc_start: torch.Tensor | None, starts: list[int]) -> list[int]:
    """Per chunk starting at ``starts[i]``: the first key any of its queries can see through its document (document
    starts never decrease along a row, so it is the earliest start of the chunk's first tokens); 0 without
    documents. One host sync for the whole step."""
    if doc_start is None:
        return [0] * len(starts)
    return doc_start[:, starts].min(0).values.tolist()
