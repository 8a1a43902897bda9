"""A backward sweep's gradients of 16-bit parameters, summed over its chunks in float32 (on the device, or in host
memory).

Autograd adds each chunk's parameter gradient into ``.grad`` in the parameter's dtype, so under ``bf16-true`` the
running sum is rounded to bf16 once per chunk and its error grows with the number of chunks (at 1024 chunks 3.7x
that of ordinary bf16 training, 32x on the final norm's weight: ``benchmarks/bf16_grad_fidelity.py``).
:class:`Float32GradSums` keeps one float32 sum per trainable 16-bit parameter in place of its ``.grad`` while the
sweep runs: a post-accumulate-grad hook moves each chunk's gradient into the sum as soon as autograd has made it,
and on exit the sum is written back into ``.grad``, rounded once — what ``.grad`` held before (earlier
micro-batches of gradient accumulation) added to it exactly once. Cost: during the sweep a parameter's gradient takes 4 bytes instead of 2, nothing outside it. (A
compensated bf16 pair — ``.grad`` plus a bf16 error term — would cost the same 2 bytes for fewer bits.)
Parameters of other dtypes (float32, float64, frozen ones) are left to autograd.

:class:`HostGradSums` (``grad_accumulation="float32-host"``) costs no device memory for the matrices: their chunk
gradients accumulate in the 16-bit ``.grad`` for up to ``every`` chunks (rounded per chunk, as autograd does, over a
window that does not grow with the sequence), then the window's sum is added to a float32 sum in host memory and
``.grad`` dropped; when the sweep ends each host sum is copied back to the device, added to the last window there and
rounded once into ``.grad``. What ``.grad`` holds when the sweep starts (earlier micro-batches of gradient
accumulation) goes to the host sum first, so no window rounds on top of it. A sweep of at most ``every`` chunks that
starts without ``.grad`` never flushes: it is ``"native"``. Vectors (norm weights, biases: tiny, and summed over every
token, so the most sensitive) take :class:`Float32GradSums` on the device.

Cost: 4 host bytes per matrix element (page-locked on a GPU), and per flush one device-to-host copy of the matrices'
gradients (2 bytes each) and a host add (4 bytes read and written per element: the slow part). On a GPU whose host
memory has room (:func:`mirror_fits`) the copy goes to a page-locked mirror of all the matrices' 16-bit gradients (2
more host bytes per element) and a worker thread adds it while the device computes on: the compute waits for the
copy only. Without a mirror it goes through two page-locked slabs, the copy of one overlapping the add of the other,
and the compute waits for the adds. At the end: the sums copied in (4 bytes per element), in slabs, on the device.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from lightning_oomb.engine.memory import HOST_RESERVE_BYTES, host_memory_available
from lightning_oomb.engine.pages import page_locked_bytes
from lightning_oomb.engine.user_hooks import engine_hook

HALF_DTYPES = (torch.bfloat16, torch.float16)
HOST_FLUSH_CHUNKS = 16  # float32-host: chunks a 16-bit .grad sums before a flush to host memory
STAGING_ELEMENTS = 2**25  # float32-host: elements of each of the two staging slabs (64 MiB in bf16)


def one_window(chunks: int, accumulating: bool) -> bool:
    """Whether a ``float32-host`` sweep of ``chunks`` chunks never flushes (``accumulating``: ``.grad`` holds earlier
    micro-batches' sum, which goes to the host first): then it needs no host memory and no copies."""
    return chunks <= HOST_FLUSH_CHUNKS and not accumulating


def host_flushes(chunks: int, accumulating: bool, every: int = HOST_FLUSH_CHUNKS) -> int:
    """Flushes of a ``float32-host`` sweep of ``chunks`` chunks (:class:`HostGradSums`): the earlier micro-batches'
    ``.grad`` first (``accumulating``), one per window of ``every`` chunks that more chunks follow, and — if any of
    those — the last window when the sweep ends (which then also writes the sums back into ``.grad``)."""
    flushed = (chunks - 1) // every + accumulating
    return flushed + 1 if flushed else 0


def earlier_sums(params: list[torch.Tensor]) -> tuple[bool, list[torch.Tensor]]:
    """Whether a ``.grad`` of ``params`` holds an earlier micro-batch's sum, and the parameters whose all-zero
    ``.grad`` (``zero_grad(set_to_none=False)``) holds none and was set to ``None``: adding it changes nothing, and
    dropping it frees its memory while the sweep makes the new gradients (:func:`restore_zeros` gives zeros back
    where the sweep made none). One read of the gradients, one device synchronisation."""
    held = [p for p in params if p.grad is not None]
    if not held:
        return False, []
    nonzero = torch.stack([p.grad.any() for p in held]).tolist()
    cleared = [p for p, keep in zip(held, nonzero, strict=True) if not keep]
    for p in cleared:
        p.grad = None
    return any(nonzero), cleared


def restore_zeros(cleared: list[torch.Tensor]) -> None:
    """Give the parameters :func:`earlier_sums` cleared that got no gradient a zero ``.grad`` back, as autograd
    leaves it (an optimizer skips a parameter whose ``.grad`` is ``None``: no weight decay, no momentum step)."""
    for p in cleared:
        if p.grad is None:
            p.grad = torch.zeros_like(p)


def half_trainable(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The trainable 16-bit parameters among ``params``, each once."""
    return [p for p in dict.fromkeys(params) if p.requires_grad and p.dtype in HALF_DTYPES]


class Float32GradSums:
    """Context manager: inside it, the chunk gradients of ``params`` that are trainable and 16-bit are summed in
    float32 and ``.grad`` is ``None``; on exit ``.grad`` = previous ``.grad`` + the sum, rounded once to the
    parameter's dtype (a parameter that got no gradient keeps its ``.grad`` unchanged)."""

    def __init__(self, params: Iterable[torch.Tensor]):
        self.params = half_trainable(params)
        self._sums: dict[int, torch.Tensor | None] = {}
        self._handles: list = []

    def __enter__(self) -> Float32GradSums:
        for p in self.params:  # the old .grad joins the sum with the first chunk's gradient
            self._sums[id(p)], p.grad = p.grad, None
            self._handles.append(p.register_post_accumulate_grad_hook(engine_hook(self._take)))
        return self

    def _take(self, p: torch.Tensor) -> None:
        grad, p.grad = p.grad, None
        if grad is None:  # autograd got no gradient for it (e.g. one added in place into the sum)
            return
        held = self._sums[id(p)]
        if held is not None and held.dtype == torch.float32:
            held.add_(grad)
        else:
            self._sums[id(p)] = grad.float() if held is None else held.float().add_(grad)

    def accumulator(self, p: torch.Tensor) -> torch.Tensor | None:
        """``p``'s float32 sum, for a caller that adds a gradient into it in place (made now from the earlier
        ``.grad`` or zeros); ``None`` if ``p`` is not one of the summed parameters."""
        if id(p) not in self._sums:
            return None
        held = self._sums[id(p)]
        if held is None or held.dtype != torch.float32:
            held = self._sums[id(p)] = (
                torch.zeros_like(p, dtype=torch.float32) if held is None else held.float()
            )
        return held

    def chunk_done(self, more: bool) -> None:
        """After a chunk's backward (``more``: chunks follow): nothing to do, each gradient is summed as it comes."""

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for p in self.params:  # one parameter at a time: at most one extra 16-bit copy exists at once
            total = self._sums.pop(id(p))
            p.grad = total if total is None or total.dtype == p.dtype else total.to(p.dtype)


class HostGradSums:
    """Context manager for ``grad_accumulation="float32-host"`` (see the module docstring); one per engine, kept
    across steps with its host memory. :meth:`sweep` names the parameters of the next ``with``; the backward sweep
    calls :meth:`chunk_done` after every chunk. ``mirror``: stage a flush through a copy of all the matrices' 16-bit
    gradients in host memory and add it into the sums on a worker thread while the device computes on (``None``: on
    a GPU when host memory has room for it, :func:`mirror_fits`; the strategies set their memory plan's choice, made
    in the process's share of the host memory); else through two slabs, the compute waiting for the adds. The sums
    and the mirror are one allocation, page-locked on a GPU (``cudaHostRegister``: exact sizes)."""

    def __init__(
        self, every: int = HOST_FLUSH_CHUNKS, slab: int = STAGING_ELEMENTS, mirror: bool | None = None
    ):
        self.every, self.slab, self.mirror = every, slab, mirror
        self.matrices: list[torch.Tensor] = []
        self.vectors = Float32GradSums(())
        self._host: dict[int, torch.Tensor] = {}  # per matrix: its flat float32 sum
        self._mirror: dict[int, torch.Tensor] = {}  # per matrix: its flat 16-bit copy (mirrored)
        self._memory: torch.Tensor | None = None  # the bytes of both
        self._unpin = None  # unregisters a page-locked _memory
        self._staging: list[torch.Tensor] = []
        self._pending: Future | None = None  # the worker's adds of the last flush through the mirror
        self._worker: ThreadPoolExecutor | None = None
        self._chunks, self.flushes, self._written = 0, 0, set()

    @property
    def host_bytes(self) -> int:
        """Host memory held: the float32 sums, the mirror and the staging slabs."""
        held = (*([] if self._memory is None else [self._memory]), *self._staging)
        return sum(t.numel() * t.element_size() for t in held)

    def sweep(self, params: Iterable[torch.Tensor]) -> HostGradSums:
        """Sum ``params``' gradients in the next ``with`` (the host memory is laid out anew when their matrices
        change, or ``mirror`` was set to another choice than the layout's)."""
        self._settle()
        params = half_trainable(params)
        matrices = [p for p in params if p.dim() >= 2]

        def layout(ms: list[torch.Tensor]) -> list[tuple]:
            return [(id(m), m.shape, m.dtype) for m in ms]

        chosen = self._memory is not None and self.mirror is not None and self.mirror != bool(self._mirror)
        if layout(matrices) != layout(self.matrices) or chosen:  # other matrices, or another mirror choice
            self._release()
        self.matrices = matrices
        self.vectors = Float32GradSums(p for p in params if p.dim() < 2)
        self._chunks, self.flushes, self._written = 0, 0, set()
        return self

    def __enter__(self) -> HostGradSums:
        self.vectors.__enter__()
        if any(p.grad is not None for p in self.matrices):  # earlier micro-batches' sum: to the host first
            self._flush()
        return self

    def accumulator(self, p: torch.Tensor) -> torch.Tensor | None:
        """A vector's float32 sum (:meth:`Float32GradSums.accumulator`); ``None`` for a matrix (its ``.grad``)."""
        return self.vectors.accumulator(p)

    def chunk_done(self, more: bool) -> None:
        """After a chunk's backward: every ``every`` chunks, if more follow, move the window's sums to the host."""
        self._chunks += 1
        if more and self._chunks % self.every == 0:
            self._flush()

    def __exit__(self, *exc) -> None:
        self.vectors.__exit__(*exc)
        self._settle()
        # no flush: a single window, which .grad holds as autograd made it; an exception: a failed sweep
        if self.flushes and exc[0] is None:
            self._merge()

    def _flush(self) -> None:
        """Move the matrices' ``.grad`` (a window's sums) into the host sums and drop it: through the mirror (the
        compute waits for the copies into it; the worker adds) or through the slabs (the compute waits for the
        adds)."""
        self.flushes += 1
        self._settle()  # the previous flush's adds are done: the mirror is free again
        jobs = []
        for p in self.matrices:
            grad, p.grad = p.grad, None
            if grad is None:
                continue
            if self._memory is None:
                self._allocate(grad.device)
            first = id(p) not in self._written  # the step's first window writes over an earlier step's sum
            self._written.add(id(p))
            jobs.append((grad.contiguous().view(-1), self._host[id(p)], first, self._mirror.get(id(p))))
        if not jobs:
            return
        device = jobs[0][0].device
        if not self._mirror:
            self._through_slabs([(grad, held, first) for grad, held, first, _ in jobs])
            return
        for grad, _, _, staged in jobs:
            staged.copy_(grad, non_blocking=True)
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="oomb-host-sums")
        adds = [(staged, held, first) for _, held, first, staged in jobs]
        self._pending = self._worker.submit(_add_staged, _record(device), adds)

    def _allocate(self, device: torch.device) -> None:
        """The host memory of the matrices' float32 sums and (where chosen) their mirror, as one allocation."""
        sums = sum(p.numel() for p in self.matrices) * 4
        copies = sum(p.numel() * p.element_size() for p in self.matrices)
        mirrored = (
            self.mirror if self.mirror is not None else device.type == "cuda" and mirror_fits(sums + copies)
        )
        total = sums + copies * mirrored
        if device.type == "cuda":
            self._memory, self._unpin = page_locked_bytes(total, self, device)
        else:
            self._memory = torch.empty(total, dtype=torch.uint8)
        offset, mirror_at = 0, sums
        for p in self.matrices:
            self._host[id(p)] = self._memory[offset : offset + 4 * p.numel()].view(torch.float32)
            offset += 4 * p.numel()
            if mirrored:
                size = p.numel() * p.element_size()
                self._mirror[id(p)] = self._memory[mirror_at : mirror_at + size].view(p.dtype)
                mirror_at += size

    def _release(self) -> None:
        """Give the host memory back (page-locked: once the device's copies are done)."""
        self._host, self._mirror, self._memory, self._staging = {}, {}, None, []
        if self._unpin is not None:
            self._unpin()
            self._unpin = None

    def _settle(self) -> None:
        """Wait for the worker's adds (and raise what failed in them)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def _merge(self) -> None:
        """The last flush, on the device: each matrix's ``.grad`` (the last window, or none) plus its host sum,
        slab by slab (the sum copied in as float32), rounded once into ``.grad``."""
        self.flushes += 1
        for p in self.matrices:
            if id(p) not in self._written:  # no earlier window: .grad is the step's sum, as autograd made it
                continue
            held, window = self._host[id(p)], p.grad is not None
            out = p.grad.contiguous() if window else torch.empty(p.shape, dtype=p.dtype, device=p.device)
            flat = out.view(-1)
            for i in range(0, held.numel(), self.slab):
                total = torch.empty(min(self.slab, held.numel() - i), dtype=torch.float32, device=p.device)
                total.copy_(held[i : i + self.slab], non_blocking=p.device.type == "cuda")
                if window:
                    total += flat[i : i + self.slab]
                flat[i : i + self.slab].copy_(total)
            p.grad = out

    def _through_slabs(self, pairs: list[tuple[torch.Tensor, torch.Tensor, bool]]) -> None:
        """Copy each ``(src, dst, first)`` pair's ``src`` to the host through the two staging slabs, added into
        (``first``: written over) the float32 ``dst``, slab by slab over all pairs in one pipeline: the device's copy
        of one slab overlaps the host's add of the previous one, across the pairs' boundaries too (most matrices are
        smaller than a slab)."""
        device = pairs[0][0].device
        slabs = (
            (src[i : i + self.slab], dst[i : i + self.slab], first)
            for src, dst, first in pairs
            for i in range(0, src.numel(), self.slab)
        )
        pending = None  # the slab whose copy is in flight, to add next
        for index, (src, dst, first) in enumerate(slabs):
            buffer = self._slab(index % 2, src.numel(), src.dtype, device)
            buffer.copy_(src, non_blocking=True)
            event = _record(device)
            if pending is not None:
                _add_staged(*pending)
            pending = (event, [(buffer, dst, first)])
        if pending is not None:
            _add_staged(*pending)

    def _slab(self, which: int, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Staging slab ``which`` (of two, each :func:`staging_elements` 16-bit elements) as ``numel`` elements of
        ``dtype``; page-locked for a CUDA ``device``."""
        size = staging_elements(max(p.numel() for p in self.matrices), self.slab) * 2
        if len(self._staging) < 2 or self._staging[0].numel() < size:
            pinned = device.type == "cuda"
            self._staging = [torch.empty(size, dtype=torch.uint8, pin_memory=pinned) for _ in range(2)]
        return self._staging[which][: numel * dtype.itemsize].view(dtype)


def _add_staged(event, jobs: list[tuple[torch.Tensor, torch.Tensor, bool]]) -> None:
    """Once ``event`` (after the copies into the staged tensors) has passed: each ``(staged, dst, first)``'s 16-bit
    ``staged`` added into (``first``: written over) its float32 ``dst``."""
    _wait(event)
    for staged, dst, first in jobs:
        dst.copy_(staged) if first else dst.add_(staged)


def mirror_fits(size: int) -> bool:
    """Whether host memory has room for a ``float32-host`` mirror of ``size`` bytes beside what the system keeps
    (:data:`~lightning_oomb.engine.memory.HOST_RESERVE_BYTES`); unreadable host memory counts as unlimited."""
    available = host_memory_available()
    return available is None or available >= size + HOST_RESERVE_BYTES


def staging_elements(largest: int, slab: int = STAGING_ELEMENTS) -> int:
    """Elements of each float32-host staging slab: ``slab``, or the largest matrix's if that is smaller."""
    return min(slab, largest)


def _record(device: torch.device):
    """An event after the work queued so far on ``device``'s current stream (``None`` on a CPU: copies are done)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def _wait(event) -> None:
    if event is not None:
        event.synchronize()


def gradient_accumulator(p: torch.Tensor, sums: Float32GradSums | HostGradSums | None) -> torch.Tensor | None:
    """Where a gradient of ``p`` may be added in place, as autograd would accumulate it: its float32 sum while
    ``sums`` runs for it, else ``.grad`` (made zero if ``None``); ``None`` for a tensor autograd would not
    accumulate into (frozen, or computed from others: not a leaf)."""
    if not (p.requires_grad and p.is_leaf):
        return None
    held = None if sums is None else sums.accumulator(p)
    if held is None:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        held = p.grad
    return held
