"""Kernel tests: compiled kernels on CUDA, the Triton interpreter elsewhere (``tests/conftest.py`` sets
``TRITON_INTERPRET=1`` before triton is imported).

On a GPU each kernel runs with its default tile (``OOMB_TRITON_AUTOTUNE=0``): tuning every small test shape
would only cost compiles. Under the interpreter, bf16 runs as on a GPU where the installed Triton's interpreter
gets it wrong (``tests/helpers/interpreter_bf16.py``: its ``tl.dot`` multiplies bf16 bit patterns, its fp32 -> bf16
casts truncate): a probe launch finds which, and only those are patched, for the rest of the session.
"""

import os

import pytest
import torch

if torch.cuda.is_available():
    os.environ.setdefault("OOMB_TRITON_AUTOTUNE", "0")


@pytest.fixture(scope="session", autouse=True)
def bf16_as_on_gpu() -> frozenset[str]:
    """The bf16 defects the interpreter still shows after the fix (empty on a GPU, a fixed Triton, or once fixed)."""
    from tests.helpers.interpreter_bf16 import fix_bf16_interpreter

    return fix_bf16_interpreter()
