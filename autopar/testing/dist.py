"""A pool of gloo CPU worker processes, started once and reused, that runs a function on every rank.

    pool = get_pool(4)                       # cached: one pool per world size per Python process
    results = pool.run(fn, plan_json, ...)   # fn(*args) on ranks 0..3, returns [result of rank 0, ...]

`fn` must be importable by module and name (a module-level function) and its arguments and results
picklable; ship plans as JSON. Each worker has `torch.distributed` initialized (gloo, localhost) and one
intra-op thread. A function that fails on one rank fails the call with that rank's traceback; a call that
does not finish within `timeout` seconds (a collective waiting for a rank that died) kills the pool.

A worker killed by a signal (a crash in native code, with no Python exception) is different: the pool starts
fresh processes and runs the call once more, with a warning that names the signal, and fails only if the rerun
fails too. A wrong program raises or returns wrong numbers, which fail at once; a crashed process says nothing
about the program. Workers print a Python stack on such a crash (faulthandler) for diagnosis.
"""
from __future__ import annotations

import atexit
import functools
import os
import socket
import time
import traceback
import warnings
from typing import Any, Callable

import torch.multiprocessing as mp

_POOLS: dict[int, "WorkerPool"] = {}


class WorkerError(RuntimeError):
    """A function raised on a worker rank."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Imported by every worker while the parent is still busy (planning): the first real call then only runs.
PRELOAD = ("torch.distributed.tensor", "torch._functorch.aot_autograd", "torch._dynamo", "autopar.runtime",
           "autopar.passes")


def _context(preload: tuple[str, ...]):
    """Workers fork from one server process that imported torch and `preload` once (3.5-4.7 s of CPU less per
    worker than a fresh interpreter each) and, as a fresh interpreter would, the script's main module (guarded
    by its `if __name__ == '__main__':`). Fresh interpreters where the platform has no fork server."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["__main__", "torch", *preload])
    return ctx


def _worker(rank: int, world_size: int, port: int, conn, threads: int, preload: tuple[str, ...]) -> None:
    import datetime
    import importlib

    import faulthandler

    import torch
    import torch.distributed as dist

    faulthandler.enable()  # a crash in native code prints each thread's Python stack to stderr
    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=300))
    for mod in preload:
        try:
            importlib.import_module(mod)
        except ImportError:
            pass
    conn.send(("ready", rank))
    while True:
        msg = conn.recv()
        if msg is None:
            break
        fn, args, kwargs = msg
        try:
            conn.send(("ok", fn(*args, **kwargs)))
        except BaseException as e:  # noqa: BLE001 - report every failure to the parent
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    dist.destroy_process_group()
    conn.close()


class WorkerPool:
    """`world_size` processes forming one gloo process group."""

    def __init__(self, world_size: int, *, threads: int = 1, start_timeout: float = 180.0,
                 preload: tuple[str, ...] = PRELOAD):
        """Starts the processes and returns at once; the first `run` waits until they are ready."""
        self.world_size = world_size
        self._options = (threads, tuple(preload))
        self._start_timeout = start_timeout
        self._start()

    def _start(self) -> None:
        threads, preload = self._options
        world_size = self.world_size
        self._ready = False
        self._dead = False  # a worker process died: the pool closes after the call
        self._crash = ""  # how a worker died by a signal in the last call
        ctx = _context(preload)
        port = _free_port()
        self._conns = []
        self._procs = []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(rank, world_size, port, child, threads, tuple(preload)),
                            daemon=True)
            p.start()
            self._conns.append(parent)
            self._procs.append(p)

    def _wait_ready(self) -> None:
        if self._ready:
            return
        deadline = time.monotonic() + self._start_timeout
        for rank, c in enumerate(self._conns):
            try:
                ok = c.poll(max(0.0, deadline - time.monotonic()))
                if ok:
                    c.recv()
            except (EOFError, OSError):
                ok = False
            if not ok:
                self.close()
                raise RuntimeError(f"worker {rank} of {self.world_size} did not start within {self._start_timeout:.0f} s "
                                   "(a script that starts a pool must guard its entry point with "
                                   "`if __name__ == '__main__':`)")
        self._ready = True

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def run(self, fn: Callable, *args: Any, timeout: float = 600.0, **kwargs: Any) -> list[Any]:
        """fn(*args, **kwargs) on every rank; the list of results by rank. Once more on fresh processes when a
        worker was killed by a signal (see the module's doc)."""
        try:
            return self._run(fn, args, kwargs, timeout)
        except WorkerError:
            crash = self._crash
            if not crash:
                raise
        warnings.warn(f"a gloo worker of {getattr(fn, '__name__', fn)} died ({crash}) without a Python exception; "
                      "the call runs once more on fresh worker processes", RuntimeWarning, stacklevel=2)
        self._start()
        _POOLS[self.world_size] = self
        return self._run(fn, args, kwargs, timeout)

    def _run(self, fn: Callable, args: tuple, kwargs: dict, timeout: float) -> list[Any]:
        if not self.alive:
            raise RuntimeError("the worker pool is closed")
        self._crash = ""
        self._wait_ready()
        for c in self._conns:
            c.send((fn, args, kwargs))
        results: list[Any] = [None] * self.world_size
        pending = set(range(self.world_size))
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while pending:
            for rank in list(pending):
                if self._conns[rank].poll(0.01):
                    status, value = self._receive(rank)
                    pending.discard(rank)
                    if status == "ok":
                        results[rank] = value
                    else:
                        errors[rank] = value
            if errors and pending:
                # The other ranks may wait forever in a collective the failed rank never joins.
                grace = time.monotonic() + 5.0
                while pending and time.monotonic() < grace:
                    for rank in list(pending):
                        if self._conns[rank].poll(0.01):
                            status, value = self._receive(rank)
                            pending.discard(rank)
                            if status != "ok":
                                errors[rank] = value
                if pending:
                    self.close()
                break
            if pending and time.monotonic() > deadline:
                self.close()
                raise TimeoutError(f"{getattr(fn, '__name__', fn)} did not finish on ranks {sorted(pending)} within "
                                   f"{timeout:.0f} s; the pool was shut down")
        if self._dead:
            self.close()
        if errors:
            rank = min(errors)
            raise WorkerError(f"{getattr(fn, '__name__', fn)} failed on rank {rank} (ranks failing: "
                              f"{sorted(errors)}):\n{errors[rank]}")
        return results

    def _receive(self, rank: int) -> tuple[str, Any]:
        """The message of `rank`; ("error", how it ended) when its process died instead of answering (a crash in
        native code: a signal such as SIGABRT or SIGSEGV, with no Python traceback)."""
        try:
            return self._conns[rank].recv()
        except (EOFError, OSError):
            proc = self._procs[rank]
            proc.join(timeout=5)
            code = proc.exitcode
            how = f"exit code {code}" if code is None or code >= 0 else f"signal {_signal_name(-code)}"
            self._dead = True
            if code is not None and code < 0:
                self._crash = f"rank {rank}: {how}"
            return "error", f"worker process died ({how}) without a Python exception"

    def close(self) -> None:
        for c in self._conns:
            try:
                c.send(None)
            except (OSError, BrokenPipeError):
                pass
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._procs, self._conns = [], []
        for k, v in list(_POOLS.items()):
            if v is self:
                del _POOLS[k]


def _signal_name(n: int) -> str:
    import signal

    try:
        return f"{signal.Signals(n).name} ({n})"
    except ValueError:
        return str(n)


@functools.lru_cache(maxsize=None)
def cpu_mesh(shape: tuple[int, ...], names: tuple[str, ...]):
    """The worker's DeviceMesh of `shape` over its gloo group, one per (shape, names) in the process: every
    init_device_mesh creates gloo subgroups, whose polling threads would pile up over a session of tests (a
    worker had 474 threads by mid-suite) and slow every later test."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", tuple(shape), mesh_dim_names=tuple(names))


def get_pool(world_size: int, **kwargs: Any) -> WorkerPool:
    """The shared pool of this world size, started on first use (other sizes' pools stay up). Starting
    returns at once: call it early (before planning) so the workers boot while the parent works."""
    pool = _POOLS.get(world_size)
    if pool is None or not pool.alive:
        pool = _POOLS[world_size] = WorkerPool(world_size, **kwargs)
    return pool


def close_pools() -> None:
    for pool in list(_POOLS.values()):
        pool.close()


atexit.register(close_pools)
