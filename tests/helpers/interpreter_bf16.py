"""bf16 in Triton's interpreter as on a GPU (test-only: the kernels and their results on a GPU are unchanged).

The interpreter (``TRITON_INTERPRET=1``, how the kernel tests run without a GPU) holds a bf16 tensor as its uint16
bit patterns, and Triton 3.9's gets two operations on them wrong:

- ``dot``: ``tl.dot`` on bf16 operands multiplies the bit patterns as integers (``np.matmul`` on the uint16
  arrays), so every bf16 attention tile is off by ~1e10. A GPU's MMA multiplies the values (exactly: a product of
  two bf16 fits fp32) and sums in fp32; the fix widens bf16 operands to fp32 (exact) before the interpreter's
  fp32 matmul.
- ``cast``: fp32 -> bf16 (``x.to(tl.bfloat16)``, ``create_fp_trunc``) truncates the low 16 bits; a GPU
  (``cvt.rn.bf16.f32``) and torch round to nearest, ties to even. Truncation biases each rounded P and dS toward
  zero (the kernels' ``p.to(v.dtype)`` before the second matmul) and doubles the output's rounding error; the fix
  rounds as torch and a GPU do.

:func:`bf16_defects` runs one tiny kernel under the interpreter that shows each defect; :func:`fix_bf16_interpreter`
patches only those it shows (a Triton that fixed them is left alone, and a compiled run on a GPU never gets here),
checks the fix with the same probe (undoing it where the interpreter's layout makes it not work), and returns the
defects left. Only bf16 operands and fp32 -> bf16 casts take another path; every other dtype runs the interpreter's
own code. The kernel tests apply it once per session (``tests/kernels/conftest.py``).
"""

from __future__ import annotations

import contextlib
import os

import numpy as np

_METHODS = {"dot": "create_dot", "cast": "cast_impl"}  # the InterpreterBuilder method each fix wraps
_patched: dict[str, object] = {}  # defect -> the interpreter's own method, while the fix is installed


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def round_to_bf16(x: np.ndarray) -> np.ndarray:
    """fp32 values -> bf16 bit patterns (uint16), rounded to nearest, ties to even, as ``torch.bfloat16`` and a
    GPU's ``cvt.rn.bf16.f32`` (overflow to +-inf, subnormals kept, NaN -> 0x7FFF, a GPU's canonical NaN)."""
    x = np.asarray(x, dtype=np.float32)
    bits = x.reshape(-1).view(np.uint32)  # (1-d: array arithmetic wraps silently where NaN's bits overflow)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    return np.where(np.isnan(x.reshape(-1)), np.uint16(0x7FFF), rounded).reshape(x.shape)


def _to_fp32(handle):
    """A bf16 tensor handle widened to fp32 (exact: the bits become the high half); others unchanged."""
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle

    if handle.dtype.scalar != tl.bfloat16:
        return handle
    return TensorHandle((handle.data.astype(np.uint32) << 16).view(np.float32), tl.float32)


def _fixed(defect: str, original):
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle

    if defect == "dot":

        def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
            if tl.bfloat16 in (a.dtype.scalar, b.dtype.scalar):
                a, b = _to_fp32(a), _to_fp32(b)
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)

        return create_dot

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return TensorHandle(round_to_bf16(src.data), tl.bfloat16)
        return original(self, src, dst_type)

    return cast_impl


def bf16_defects() -> frozenset[str]:
    """Which defects (``"dot"``, ``"cast"``) the interpreter shows now: one launch of a 16 x 16 bf16 ``tl.dot`` of
    small integers (exact in any order) and casts of fp32 values that truncation rounds down and a GPU rounds up.
    Empty where kernels are compiled (not interpreting)."""
    if not interpreting():
        return frozenset()
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def probe(A, B, C, X, Y, N: tl.constexpr):
        r = tl.arange(0, N)
        tile = r[:, None] * N + r[None, :]
        tl.store(C + tile, tl.dot(tl.load(A + tile), tl.load(B + tile)))
        tl.store(Y + r, tl.load(X + r).to(tl.bfloat16))

    n = 16
    grid = torch.arange(n * n, dtype=torch.float32).view(n, n)
    a, b = (grid % 5 - 2).bfloat16(), (grid.T.contiguous() % 3 - 1).bfloat16()
    # 1 + 3/512: truncation gives 1, round-to-nearest 1 + 1/128 (and alike for the other signs and scales)
    x = (1 + 3 / 512) * torch.tensor([1.0, -1.0, 2.0**-20, -(2.0**30)]).repeat(n // 4)
    c, y = torch.empty(n, n), torch.empty(n, dtype=torch.bfloat16)
    probe[(1,)](a, b, c, x, y, N=n)
    found = set()
    if not torch.equal(c, a.float() @ b.float()):
        found.add("dot")
    if not torch.equal(y.view(torch.int16), x.bfloat16().view(torch.int16)):
        found.add("cast")
    return frozenset(found)


def fix_bf16_interpreter() -> frozenset[str]:
    """Patch the defects :func:`bf16_defects` shows (none on a GPU or a fixed Triton); returns those still shown
    after (empty: the interpreter's bf16 is a GPU's). Idempotent."""
    found, done = bf16_defects(), set(_patched)
    if not found - done:
        return found
    from triton.runtime.interpreter import InterpreterBuilder

    for defect in found - done:
        name = _METHODS[defect]
        original = getattr(InterpreterBuilder, name, None)
        if original is None:
            continue
        _patched[defect] = original
        setattr(InterpreterBuilder, name, _fixed(defect, original))
    left = bf16_defects()
    for defect in left & set(_patched):  # the interpreter is laid out otherwise: leave it as it was
        setattr(InterpreterBuilder, _METHODS[defect], _patched.pop(defect))
    return left


def patched() -> frozenset[str]:
    """The defects whose fix is installed."""
    return frozenset(_patched)


@contextlib.contextmanager
def unpatched():
    """The interpreter's own bf16 dot and cast inside the block (to probe what the installed Triton does)."""
    from triton.runtime.interpreter import InterpreterBuilder

    fixes = {d: getattr(InterpreterBuilder, _METHODS[d]) for d in _patched}
    for defect, original in _patched.items():
        setattr(InterpreterBuilder, _METHODS[defect], original)
    try:
        yield
    finally:
        for defect, fix in fixes.items():
            setattr(InterpreterBuilder, _METHODS[defect], fix)
