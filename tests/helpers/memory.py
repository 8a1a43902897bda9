"""Live bytes of the CPU storages a block of code creates (the allocation peak a memory formula must predict)."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the CPU storages created inside the block (sampled at every op) less those of ``exclude`` (held
    before it) freed so far: the peak of what the block adds.

    A storage's Python object lives exactly as long as the storage (torch preserves it), so a weak reference's
    callback counts each free as it happens — no scan of every live storage at every op."""

    def __init__(self, exclude=()):
        super().__init__()
        self.current = self.peak = 0
        self.live: dict[int, weakref.ref] = {}
        self.exclude: dict[int, weakref.ref] = {}
        for t in exclude:
            self._track(self.exclude, t.untyped_storage())

    def _track(self, held: dict[int, weakref.ref], storage) -> None:
        key, nbytes = storage.data_ptr(), storage.nbytes()

        def freed(_ref) -> None:
            held.pop(key, None)
            self.current -= nbytes

        held[key] = weakref.ref(storage, freed)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.live and key not in self.exclude and storage.nbytes():
                    self._track(self.live, storage)
                    self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        return out


def cross_entropy_peak(
    vocab: int,
    hidden: int,
    tokens: int,
    block: int,
    dtype: torch.dtype = torch.bfloat16,
    autocast: torch.dtype | None = None,
    softcap: float | None = None,
    frozen: bool = False,
    loss_fn=None,
    exclude=(),
) -> int:
    """Peak bytes a forward + backward with grad of the chunked cross-entropy (or of ``loss_fn(hidden, head,
    targets, block)``) allocates on the CPU — its hidden states and targets made inside, as the engine makes them;
    the LM-head weight (``[vocab, hidden]``) and ``exclude`` not counted."""
    from lightning_oomb.engine.loss import LMHead, linear_cross_entropy

    loss_fn = loss_fn or linear_cross_entropy
    gen = torch.Generator().manual_seed(tokens)
    w = torch.randn(vocab, hidden, dtype=dtype, generator=gen, requires_grad=not frozen)
    h0 = torch.randn(tokens, hidden, dtype=dtype, generator=gen)
    t0 = torch.randint(0, vocab, (tokens,), generator=gen)
    with LiveBytes(exclude=[w, *exclude]) as live:
        h, t = h0.clone().requires_grad_(), t0.clone()
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            loss = loss_fn(h, LMHead(w, softcap=softcap), t, block)
        loss.backward()
    return live.peak
