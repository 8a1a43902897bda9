"""The Triton page-score kernel (under the interpreter) against the torch rule it implements."""

from __future__ import annotations

import os

import pytest
import torch

from lightning_oomb.engine.sparse import _block_scores, _first_keys, select_pages, summarize

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="the Triton kernels need CUDA or TRITON_INTERPRET=1",
)


def case(seed, b, hkv, group, lq, past, d, page, score, window=None, docs=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hkv * group, lq, d, generator=gen)
    keys = torch.randn(b, hkv, past * page, d, generator=gen)
    summaries = summarize(keys, page, score)
    q_start = past * page
    doc_start = None
    if docs:
        doc_start = torch.randint(0, q_start, (b, 1), generator=gen).expand(b, lq).contiguous()
    return q, summaries, q_start, window, doc_start


@pytest.mark.parametrize(
    ("b", "hkv", "group", "lq", "past", "d", "page", "score", "window", "docs"),
    [
        (1, 1, 1, 16, 3, 16, 16, "mean", None, False),
        (
            2,
            2,
            7,
            40,
            21,
            24,
            16,
            "bound",
            None,
            False,
        ),  # GQA 7, ragged last block, head dim not a power of 2
        (1, 2, 2, 64, 40, 32, 32, "bound", 300, False),  # a window: early pages unseen by some rows
        (2, 1, 3, 32, 9, 16, 16, "mean", None, True),  # packed documents
    ],
)
def test_kernel_scores_equal_the_torch_rule(b, hkv, group, lq, past, d, page, score, window, docs):
    from csrc_triton.page_scores import block_scores

    q, summaries, q_start, window, doc_start = case(0, b, hkv, group, lq, past, d, page, score, window, docs)
    grouped = q.view(b, hkv, group, lq, d).sum(2)
    keys = summaries.permute(0, 3, 2, 4, 1)
    first = _first_keys(q_start, lq, b, window, doc_start, q.device)
    page_last = torch.arange(past) * page + page - 1
    visible = page_last[None, None] >= first[..., None]
    want = _block_scores(grouped.double(), keys.double(), visible, page, -(-lq // page))
    got = block_scores(grouped, keys, first, page)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-6)


def test_selection_with_the_kernel_equals_the_torch_selection():
    q, summaries, q_start, window, docs = case(3, 2, 2, 4, 48, 30, 16, 16, "bound")
    want = select_pages(q, summaries, q_start, 16, 4)
    got = select_pages(q, summaries, q_start, 16, 4, backend="triton")
    assert torch.equal(got.pages, want.pages) and torch.equal(got.candidates, want.candidates)
