"""Offload: host-tier layers streamed through fixed-size device staging buffers.

The pool (:mod:`lightning_oomb.engine.kv_pool`) places whole layers in the HBM tier or the host tier. A host layer
is cut into **blocks** of one chunk each (block ``j`` = the pages of chunk ``j``) and used through
``staging_buffers`` device buffers that each hold one block (K, V, dK, dV). The attention op attends a group of
staged blocks per kernel call and merges the parts by log-sum-exp, so the device memory of offload is
``staging_buffers * block_bytes``, fixed by the chunk size, whatever the sequence length: the Qwen2.5-7B shape (4 KV
heads, head dim 128, bf16 K/V, fp32 gradients) at C = 4096 needs 24 MiB per buffer, 216 MiB for the 9 that
``staging_buffers="auto"`` takes for it (:meth:`~lightning_oomb.engine.config.OOMBConfig.staging_count`).

**A layer's stream** (one attention call, chunk ``s``): the chunk's own block ``s`` first — its K/V are written by
the compute stream, never copied in — then the prefix blocks ``0 .. s-1`` from the host, in groups of up to
``(staging_buffers - 1) // 2`` consecutive blocks, each attended by one kernel call over one page table (so a
call's fixed costs — launch, carried softmax state or dQ read and written — are paid once per group, and the
buffers left hold the next group's copies). Forward and eval sweeps:
each chunk's new K/V go to the host right after they are written (the only write-back of K/V ever). Backward
sweep: the recompute and the backward restage the chunk's K/V from the op's saved tensors (no host traffic); a
prefix group comes in with its gradient pages, the kernels add into them and they go back to the host at once. The
chunk's own gradient pages come in (accumulated by later chunks) or are zero-filled on the device while the host
holds none, and are handed to autograd, not written back.

Three parts, one job each:

- :mod:`.schedule` — where the sweeps are and which block uses come next (pure Python; prefetch's prediction);
- :mod:`.staging` — the staging-buffer cache: what each buffer holds, eviction, dirty tracking, copies and the
  events that order them;
- :mod:`.transport` — how copies run: CUDA side streams and events, synchronous copies on CPU, or random delays
  for race checks;

joined by :class:`~.offloader.Offloader`, the object the pool calls. Two buffers work (the chunk's block and one
prefix block, copied on demand); three overlap copies in with compute; four also overlap write-backs (one block
per call); nine attend four blocks per call (``"auto"``: nine where they take at most 256 MiB, else four).

A sparse call stages only its selected pages: runs of consecutive pages, a copy call each — hundreds per block,
which can cost the host more time than the copy engine needs for the bytes. ``OOMB_OFFLOAD_GATHER=1``
(experimental, :func:`.transport.offload_gather`) moves such scattered pages with one kernel per block and part
instead, reading and writing the host tier mapped into the GPU's address space.
"""

from lightning_oomb.engine.offload.offloader import Offloader
from lightning_oomb.engine.offload.staging import TRACE_LIMIT, StagingCache, Transfer
from lightning_oomb.engine.offload.tails import HostBytes, HostTails, host_tail_bytes
from lightning_oomb.engine.offload.transport import (
    CudaTransport,
    SyncTransport,
    Transport,
    default_transport,
    delaying_transport,
    offload_gather,
)

__all__ = [
    "TRACE_LIMIT",
    "CudaTransport",
    "HostBytes",
    "HostTails",
    "Offloader",
    "StagingCache",
    "SyncTransport",
    "Transfer",
    "Transport",
    "default_transport",
    "delaying_transport",
    "host_tail_bytes",
    "offload_gather",
]
