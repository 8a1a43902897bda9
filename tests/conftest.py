"""Test session set-up (shared code lives in ``tests/helpers``): the Triton interpreter on machines without a GPU,
the tiny-model fixture and the one-thread fixture."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton picks compile vs interpret when a function is decorated, incl. its own library at `import triton`
    # (lightning imports it): set the switch before any test module is collected.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config) -> None:
    """Refuse a stack whose Triton interpreter cannot run the kernel tests, naming the fix."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import numpy
    import triton

    old_triton = tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 7)
    if old_triton and tuple(int(x) for x in numpy.__version__.split(".")[:2]) >= (2, 4):
        raise pytest.UsageError(
            f"Triton {triton.__version__}'s interpreter (TRITON_INTERPRET=1, how the kernel tests run without a GPU) "
            f"fails with NumPy {numpy.__version__} ('only 0-dimensional arrays can be converted to Python scalars', "
            "fixed in Triton 3.7) — pip install 'numpy<2.4', or Triton >= 3.7."
        )
    from tests.helpers.interpreter import speed_up_interpreter

    speed_up_interpreter()


@pytest.fixture
def causal_lm():
    from tests.helpers.models import build_causal_lm

    return build_causal_lm


@pytest.fixture
def one_thread():
    """One torch thread for the test (``pytestmark = pytest.mark.usefixtures("one_thread")``): bf16 rounding then
    does not depend on how matmuls split their sums, and tiny models run fastest (two OpenMP threads on a busy
    2-core machine: ~15x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
