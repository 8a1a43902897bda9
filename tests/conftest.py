"""Test session set-up (shared code lives in ``tests/helpers``): the Triton interpreter on machines without a GPU,
and the tiny-model fixture."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton picks compile vs interpret when a function is decorated, incl. its own library at `import triton`
    # (lightning imports it): set the switch before any test module is collected.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def causal_lm():
    from tests.helpers.models import build_causal_lm

    return build_causal_lm
