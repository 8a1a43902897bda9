"""What a recompute replays of the computation it repeats: the RNG state (dropout masks) and the autocast state
(autocast is off in backward; docs/design.md, "Lightning")."""

from __future__ import annotations

import contextlib

import torch


class AutocastState:
    """Autocast (of ``device``'s type and the CPU's) and the default dtype now; calling it re-enters them."""

    def __init__(self, device: torch.device):
        self.default_dtype = torch.get_default_dtype()
        self.modes = [
            (t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t))
            for t in dict.fromkeys((device.type, "cpu"))
        ]

    @contextlib.contextmanager
    def __call__(self):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.default_dtype)
        try:
            with contextlib.ExitStack() as stack:
                for device_type, enabled, dtype in self.modes:
                    stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))
                yield
        finally:
            torch.set_default_dtype(previous)


class RNGState:
    """The CPU (+ CUDA ``device``) RNG state now; :meth:`restore` sets it again (the same dropout masks)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)
