"""The scattered page copy kernel against its torch oracle (the interpreter on CPU; on CUDA also from page-locked
host memory, as offload's gathered staging uses it)."""

from __future__ import annotations

import pytest
import torch

from csrc_triton.page_copy import BLOCK, copy_rows, copy_rows_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def tensors(slots: int, row: tuple[int, ...], dtype: torch.dtype, seed: int, device=DEVICE) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(slots, *row, generator=gen).to(dtype).to(device)


@pytest.mark.parametrize(
    ("row", "dtype", "two"),
    [
        ((2, 4, 8), torch.bfloat16, True),
        ((3, 5, 7), torch.float32, False),
        ((BLOCK + 13,), torch.float32, True),
    ],
    ids=["bf16-pair", "fp32-one-ragged", "row-over-a-block"],
)
def test_copy_rows_matches_index_copy(row, dtype, two):
    """Scattered rows (unsorted, every other destination untouched) equal torch's index_select / index_copy_, bit
    for bit, for one pair and for two."""
    src = [tensors(11, row, dtype, seed) for seed in (0, 1)]
    rows = torch.tensor([[7, 0, 3, 9], [2, 10, 5, 2]], dtype=torch.int64, device=DEVICE)
    got = [tensors(10, row, dtype, seed) for seed in (2, 3)]
    want = [t.clone() for t in got]
    n = 2 if two else 1
    copy_rows(list(zip(got, src))[:n], rows)
    copy_rows_reference(list(zip(want, src))[:n], rows)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert torch.equal(got[0][rows[0]], src[0][rows[1]])


def test_copy_rows_refuses_mismatched_tensors():
    a, b = torch.zeros(4, 3), torch.zeros(4, 5)
    rows = torch.zeros(2, 1, dtype=torch.int64)
    with pytest.raises(ValueError, match="one row size"):
        copy_rows([(a, b)], rows)
    with pytest.raises(ValueError, match=r"int64 \[2, n\]"):
        copy_rows([(a, a)], rows.int())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locked host memory mapped into a GPU")
def test_copy_rows_reads_and_writes_mapped_host_memory():
    """Host -> device and device -> host through the kernel, the host side page-locked as the host tier is."""
    from lightning_oomb.engine.pages import page_locked_bytes

    owner = type("Owner", (), {})()
    storage, unpin = page_locked_bytes(6 * 64 * 4, owner, mapped=True)
    host = storage.view(torch.float32).view(6, 64)
    host.copy_(torch.randn(6, 64))
    device = torch.zeros(4, 64, device="cuda")
    rows = torch.tensor([[0, 1, 3], [5, 0, 2]], device="cuda")
    copy_rows([(device, host)], rows)
    torch.cuda.synchronize()
    assert torch.equal(device[[0, 1, 3]].cpu(), host[[5, 0, 2]])
    back = torch.tensor([[4, 1], [3, 0]], device="cuda")
    copy_rows([(host, device)], back)
    torch.cuda.synchronize()
    assert torch.equal(host[[4, 1]], device[[3, 0]].cpu())
    unpin()
