"""The suite's interpreter speed-ups (``tests/helpers/interpreter.py``) are installed on this stack, and a launch
still leaves ``triton.language`` as it found it."""

import os

import pytest
import torch
import triton
import triton.language as tl

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter only")


@triton.jit
def _twice(x):
    return x * 2


@triton.jit
def _double_kernel(src, dst, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(dst + offsets, _twice(tl.load(src + offsets, mask=mask)), mask=mask)


def test_speed_ups_are_installed_and_a_launch_restores_the_language():
    from triton.runtime import interpreter

    assert getattr(interpreter._patch_lang, "once", False), (
        "the per-helper re-patching is back: see the helper"
    )
    assert interpreter.interpreter_builder.options.sanitize_overflow is False
    before = {name: getattr(tl, name) for name in ("load", "store", "arange")}
    x = torch.arange(5, dtype=torch.float32)
    y = torch.zeros(5)
    for _ in range(2):  # the second launch finds the language as the first did
        _double_kernel[(1,)](x, y, 5, BLOCK=8)
        assert torch.equal(y, 2 * x)
        assert {name: getattr(tl, name) for name in before} == before
