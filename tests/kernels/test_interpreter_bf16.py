"""The test-only bf16 fix of Triton's interpreter (``tests/helpers/interpreter_bf16.py``, installed for the kernel
tests by ``conftest.py``): its probe finds both defects on the Triton the suite runs (3.9), exactly those are
patched, and the fixed ``tl.dot`` and fp32 -> bf16 casts give torch's bf16 results."""

import os

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from tests.helpers.interpreter_bf16 import bf16_defects, patched, round_to_bf16, unpatched

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter only")
KNOWN_DEFECTIVE = (3, 9)  # the newest Triton whose interpreter was seen with both defects


@triton.jit
def _dot_and_casts(A, B, C, D, X, Y, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr, L: tl.constexpr):
    rm, rk, rn = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
    c = tl.dot(tl.load(A + rm[:, None] * K + rk[None, :]), tl.load(B + rk[:, None] * N + rn[None, :]))
    tl.store(C + rm[:, None] * N + rn[None, :], c)
    tl.store(D + rm[:, None] * N + rn[None, :], c.to(tl.bfloat16))
    r = tl.arange(0, L)
    tl.store(Y + r, tl.load(X + r).to(tl.bfloat16))


def run(a, b, x):
    """``a @ b`` in fp32, the same rounded to bf16, and ``x`` cast to bf16, all in one interpreted launch."""
    (m, k), n = a.shape, b.shape[1]
    c, d, y = torch.empty(m, n), torch.empty(m, n, dtype=torch.bfloat16), x.bfloat16()
    _dot_and_casts[(1,)](a, b, c, d, x, y, M=m, K=k, N=n, L=x.numel())
    return c, d, y


def same_bf16(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal bit patterns, NaN for NaN (payloads aside: a GPU's canonical NaN is 0x7FFF, torch's CPU gives
    0xFFFF)."""
    nan = want.isnan()
    bits = (x[~nan].view(torch.int16) for x in (got, want))
    return torch.equal(got.isnan(), nan) and torch.equal(*bits)


def test_the_probe_finds_what_is_patched():
    with unpatched():
        found = bf16_defects()
    if tuple(int(v) for v in triton.__version__.split(".")[:2]) <= KNOWN_DEFECTIVE:
        assert found == {"dot", "cast"}, f"Triton {triton.__version__}: the probe misses a defect"
    assert patched() == found  # a Triton that fixed one keeps its own
    assert bf16_defects() == frozenset()


def test_fixed_dot_and_casts_give_torch_bf16_results():
    gen = torch.Generator().manual_seed(0)
    # integers: fp32 sums exact in any order (up to 32 * 256 = 8192, 13 bits), so rounding them to bf16 (8 bits)
    # must give torch's bf16 matmul exactly
    a = torch.randint(-16, 17, (16, 32), generator=gen).bfloat16()
    b = torch.randint(-16, 17, (32, 16), generator=gen).bfloat16()
    # ties to even (down, up), overflow to infinity, subnormals, infinities, NaN
    edges = [0.0, -0.0, 1 + 2**-8, 1 + 3 * 2**-8, -(1 + 3 * 2**-8), 3.4e38, -3.4e38, 1e-39, -1e-40, 1e-45]
    edges += [float("inf"), -float("inf"), float("nan")]
    x = torch.cat([torch.tensor(edges), torch.randn(64 - len(edges), generator=gen) * 1e3])
    c, d, y = run(a, b, x)
    assert torch.equal(c, a.float() @ b.float())
    assert same_bf16(d, a @ b)
    assert same_bf16(y, x.bfloat16())
    # random values: fp32 accumulation as torch's (up to the order of the sums)
    a, b = (torch.randn(16, 16, generator=gen).bfloat16() for _ in "ab")
    c, _, _ = run(a, b, x)
    torch.testing.assert_close(c, a.float() @ b.float(), rtol=1e-6, atol=1e-6)
    with unpatched():  # what the fix replaces, where the installed Triton has it
        c_own, _, y_own = run(a, b, x)
    assert torch.equal(c_own, c) != ("dot" in patched())
    assert same_bf16(y_own, y) != ("cast" in patched())


def test_rounding_matches_torch_on_every_exponent():
    """The cast's rounding on random fp32 bit patterns (every exponent, NaNs, infinities, subnormals)."""
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 16,), generator=torch.Generator().manual_seed(1))
    x = bits.int().view(torch.float32)
    got = torch.from_numpy(round_to_bf16(x.numpy()).view(np.int16)).view(torch.bfloat16)
    assert same_bf16(got, x.bfloat16())
