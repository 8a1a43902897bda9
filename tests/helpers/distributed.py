"""Run a function on several CPU processes joined by a gloo process group (context-parallel tests)."""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, out: str, args: tuple, timeout_s: float) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s)
    )
    try:
        result = fn(rank, world, *args)
        torch.save(result, Path(out) / f"rank{rank}.pt")
    except BaseException:
        (Path(out) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world: int, tmp_path: Path, *args, timeout_s: float = 60.0) -> list:
    """``fn(rank, world, *args)`` on ``world`` spawned processes (gloo, collectives timing out after
    ``timeout_s``); returns each rank's result. ``fn`` must be a module-level function (pickled by reference)."""
    mp.start_processes(_entry, args=(world, _free_port(), fn, str(tmp_path), args, timeout_s), nprocs=world,
                       start_method="spawn")  # fmt: skip
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


def failing_ranks(fn, world: int, tmp_path: Path, *args, timeout_s: float = 10.0) -> list[str | None]:
    """Like :func:`run_ranks` for a run expected to fail: each rank's traceback (``None`` if it succeeded)."""
    with contextlib.suppress(Exception):  # the first failing process's error; every rank's is in its file
        run_ranks(fn, world, tmp_path, *args, timeout_s=timeout_s)
    errors = [tmp_path / f"rank{r}.err" for r in range(world)]
    return [e.read_text() if e.exists() else None for e in errors]
