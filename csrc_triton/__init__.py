"""Triton kernels for lightning_oomb (no autograd, no Lightning); each has a torch reference in the engine."""
