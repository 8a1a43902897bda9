"""Kernel tests: compiled kernels on CUDA, the Triton interpreter elsewhere (``tests/conftest.py`` sets
``TRITON_INTERPRET=1`` before triton is imported).

On a GPU each kernel runs with its default tile (``OOMB_TRITON_AUTOTUNE=0``): tuning every small test shape
would only cost compiles.
"""

import os

import torch

if torch.cuda.is_available():
    os.environ.setdefault("OOMB_TRITON_AUTOTUNE", "0")
