"""Run a function on several CPU processes joined by a gloo process group (context-parallel tests).

Workers fork from a server that imported torch, transformers and Lightning once (:data:`START_METHOD`; a spawned
process imports them anew: seconds each on 2 cores). Starting a group still costs more than a test step, so
:func:`run_ranks` keeps a group of worker processes per world size alive (its collectives time out after the
first call's ``timeout_s``) and hands each call to it; a call that fails on any rank ends that group (a rank may be
stuck in a collective) and the next call starts a fresh one. A function run there must leave the process as it
found it (restore what it patches, keep the process group) and start no processes of its own (the workers are
daemons). Workers end with the session, or when they find their parent gone. :func:`failing_ranks` always runs on
fresh processes.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import multiprocessing
import os
import pickle
import queue
import socket
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

START_METHOD = "forkserver"  # for the tests' own groups and the strategies' `start_method` alike
multiprocessing.set_forkserver_preload(
    ["torch", "transformers", "lightning", "lightning_oomb", "tests.helpers.models"]
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join(rank: int, world: int, port: int, timeout_s: float) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s)
    )


def _run(rank: int, world: int, fn, out: str, args: tuple) -> None:
    """``fn`` on this rank, its result saved to ``out``; the process's torch defaults restored after it."""
    dtype = torch.get_default_dtype()
    try:
        torch.save(fn(rank, world, *args), Path(out) / f"rank{rank}.pt")
    except BaseException:
        (Path(out) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        torch.set_default_dtype(dtype)


def _entry(rank: int, world: int, port: int, fn, out: str, args: tuple, timeout_s: float) -> None:
    _join(rank, world, port, timeout_s)
    try:
        _run(rank, world, fn, out, args)
    finally:
        dist.destroy_process_group()


def _serve(rank: int, world: int, port: int, timeout_s: float, tasks, done) -> None:
    """A pool worker: run the tasks ``(fn, out, args)`` until ``None``, reporting each one's traceback or None."""
    _join(rank, world, port, timeout_s)
    parent = multiprocessing.parent_process()
    while True:
        try:
            task = tasks.get(timeout=1.0)
        except queue.Empty:
            if parent.is_alive():
                continue
            break  # the test session was killed: nobody will send the end
        if task is None:
            break
        try:
            _run(rank, world, *task)
            done.put((rank, None))
        except BaseException:
            done.put((rank, traceback.format_exc()))
    dist.destroy_process_group()


class _Pool:
    """``world`` worker processes in one gloo group, reused call after call."""

    def __init__(self, world: int, timeout_s: float) -> None:
        context = mp.get_context(START_METHOD)
        self.world, self.timeout_s = world, timeout_s
        self.tasks = [context.Queue() for _ in range(world)]
        self.done = context.Queue()
        port = _free_port()
        self.processes = [
            context.Process(
                target=_serve, args=(r, world, port, timeout_s, self.tasks[r], self.done), daemon=True
            )
            for r in range(world)
        ]
        for p in self.processes:
            p.start()

    def run(self, fn, out: Path, args: tuple, timeout_s: float) -> None:
        task = (fn, str(out), args)
        pickle.dumps(task)  # what cannot be sent fails here, not in the queue's feeder thread
        for tasks in self.tasks:
            tasks.put(task)
        # start-up (imports), the call and a rank's wait in a collective
        deadline = time.monotonic() + timeout_s + self.timeout_s + 60
        pending = set(range(self.world))
        while pending:
            try:
                rank, error = self.done.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.processes) if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"ranks {dead or sorted(pending)} died or hung running {fn.__name__}"
                    ) from None
                continue
            if error is not None:
                raise RuntimeError(f"rank {rank} failed running {fn.__name__}:\n{error}")
            pending.discard(rank)

    def close(self) -> None:
        for tasks, p in zip(self.tasks, self.processes, strict=True):
            if p.is_alive():
                with contextlib.suppress(Exception):
                    tasks.put(None)
        for p in self.processes:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()


_pools: dict[int, _Pool] = {}  # per world size


@atexit.register
def _close_pools() -> None:
    while _pools:
        _pools.popitem()[1].close()


def run_ranks(fn, world: int, tmp_path: Path, *args, timeout_s: float = 60.0) -> list:
    """``fn(rank, world, *args)`` on the ``world`` processes of the session's gloo group of that size (a new group's
    collectives time out after ``timeout_s``); returns each rank's result. ``fn`` must be a module-level function
    (pickled by reference)."""
    if world not in _pools:
        _pools[world] = _Pool(world, timeout_s)
    try:
        _pools[world].run(fn, tmp_path, args, timeout_s)
    except BaseException:
        _pools.pop(world).close()  # a rank may be stuck in a collective: the next call starts a fresh group
        raise
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


def failing_ranks(fn, world: int, tmp_path: Path, *args, timeout_s: float = 10.0) -> list[str | None]:
    """For a run expected to fail, on fresh processes: each rank's traceback (``None`` if it succeeded)."""
    with contextlib.suppress(Exception):  # the first failing process's error; every rank's is in its file
        mp.start_processes(_entry, args=(world, _free_port(), fn, str(tmp_path), args, timeout_s), nprocs=world,
                           start_method=START_METHOD)  # fmt: skip
    errors = [tmp_path / f"rank{r}.err" for r in range(world)]
    return [e.read_text() if e.exists() else None for e in errors]
