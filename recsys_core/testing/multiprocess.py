"""Run a function on N real gloo ranks (fresh processes) and collect what each rank returns.

Distributed code is tested the way it runs: separate processes, a real process group, real
collectives. Example::

    def all_sum(rank: int, world_size: int) -> torch.Tensor:
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t)
        return t

    run_gloo(2, all_sum)  # -> [tensor([3.]), tensor([3.])]

``fn`` must be a top-level (picklable) function; it is called as ``fn(rank, world_size, *args,
**kwargs)`` and should return something small and picklable (e.g. a dict of CPU tensors).
"""

from __future__ import annotations

import functools
import gc
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.process import BaseProcess
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

T = TypeVar("T")

# Ranks start as forks of a server process that has imported these once (about 0.1 s a rank
# instead of the seconds a fresh interpreter spends importing torch). The server is this
# module's own, not multiprocessing's shared one, whose preload list is fixed by whoever
# starts it first.
_PRELOAD = ["torch", "torch.distributed", "recsys_core", "recsys_core.testing.multiprocess"]
_server: Any = None


def _context() -> Any:
    """A multiprocessing context whose processes fork from this module's fork server, where
    the platform has fork servers (Linux, macOS); spawn elsewhere."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    return _ForkServerContext()


class _ForkServerContext:
    """Just what run_gloo uses of a context: Process and Queue."""

    def __init__(self) -> None:
        self._base = mp.get_context("forkserver")

    def Queue(self) -> Any:  # noqa: N802  (multiprocessing's name)
        return self._base.Queue()

    def Process(self, **kwargs: Any) -> Any:  # noqa: N802
        return _RankProcess(**kwargs)


def _own_server() -> Any:
    global _server
    if _server is None:
        from multiprocessing import forkserver

        _server = forkserver.ForkServer()
        _server.set_forkserver_preload(_PRELOAD)
    return _server


@functools.cache
def _make_popen() -> Any:
    from multiprocessing import forkserver, popen_forkserver

    class _Popen(popen_forkserver.Popen):
        def _launch(self, process_obj: Any) -> None:
            # The base class asks the module-level server for the new process; point that at
            # ours for the duration of the launch.
            server = _own_server()
            server.ensure_running()
            shared = forkserver.connect_to_new_process
            forkserver.connect_to_new_process = server.connect_to_new_process
            try:
                super()._launch(process_obj)
            finally:
                forkserver.connect_to_new_process = shared

    return _Popen


class _RankProcess(BaseProcess):
    _start_method = "forkserver"

    @staticmethod
    def _Popen(process_obj: Any) -> Any:  # noqa: N802
        return _make_popen()(process_obj)


_POLL_S = 0.2  # how often the parent checks for ranks that died without reporting
_GRACE_S = 1.0  # after a failure, how long to wait for other ranks' reports (to show them too)


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (another process may still take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _worker(
    rank: int,
    world_size: int,
    local_world_size: int,
    port: int,
    timeout_s: float,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    results: Any,
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(local_world_size),
        LOCAL_RANK=str(rank % local_world_size),
    )
    # Up to 4 ranks share a 2-core CI machine: intra-op threads would only oversubscribe it.
    torch.set_num_threads(1)
    timeout = timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=timeout
        )
        # Plain pickle copies tensors into the bytes; torch's queue pickler would instead share
        # them through memory that disappears when this process exits.
        message = (rank, True, pickle.dumps(fn(rank, world_size, *args, **kwargs)))
    except BaseException:
        message = (rank, False, traceback.format_exc())
    # Report (and flush the queue's feeder thread) before tearing down: peers blocked on this
    # rank fail only once its sockets close, so the root cause reaches the parent first.
    results.put(message)
    results.close()
    results.join_thread()
    if dist.is_initialized():
        gc.collect()  # fn's objects in reference cycles: the group must die here, not at exit
        dist.destroy_process_group()


def run_gloo(
    world_size: int,
    fn: Callable[..., T],
    *args: Any,
    local_world_size: int | None = None,
    timeout_s: float = 120.0,
    **kwargs: Any,
) -> list[T]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks; results by rank.

    Each rank is a fresh process (forked from a server that imported torch and recsys_core
    once; spawned where fork servers do not exist) with MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE,
    LOCAL_WORLD_SIZE (default ``world_size``: one host) and LOCAL_RANK set and the default
    process group initialized. If a rank raises (or dies), the others are terminated and a
    RuntimeError carries the rank and its traceback; ``timeout_s`` bounds the whole run.
    """
    local_world_size = world_size if local_world_size is None else local_world_size
    if world_size < 1 or local_world_size < 1 or world_size % local_world_size:
        raise ValueError(
            f"run_gloo: world_size {world_size} must be >= 1 and a multiple of "
            f"local_world_size {local_world_size}; pass ranks per host that divide world_size"
        )
    if timeout_s <= 0:
        raise ValueError(f"run_gloo: timeout_s must be > 0, got {timeout_s}")
    timeout = timedelta(seconds=timeout_s)
    # The parent owns the rendezvous store: binding port 0 cannot race with other processes
    # the way "find a free port, then let rank 0 bind it" can.
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout, wait_for_workers=False)
    ctx = _context()
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_worker,
            args=(rank, world_size, local_world_size, store.port, timeout_s, fn, args, kwargs,
                  results),
            # Not daemonic: a rank may start its own workers (a DataLoader with num_workers > 0);
            # the finally below terminates every rank instead.
            daemon=False,
        )
        for rank in range(world_size)
    ]
    try:
        for proc in procs:
            proc.start()  # pickles fn and args: a lambda or local function fails here
        payloads = _collect(procs, results, timeout_s)
    finally:
        started = [proc for proc in procs if proc.pid is not None]
        for proc in started:
            if proc.is_alive():
                proc.terminate()
        for proc in started:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        results.close()
        del store
    return [pickle.loads(payloads[rank]) for rank in range(world_size)]


def _collect(procs: list[Any], results: Any, timeout_s: float) -> dict[int, bytes]:
    world_size = len(procs)
    payloads: dict[int, bytes] = {}
    raised: dict[int, str] = {}  # in arrival order: the first one is usually the root cause
    deadline = time.monotonic() + timeout_s
    grace_end: float | None = None  # after a failure, wait briefly for the other ranks' reports
    while len(payloads) + len(raised) < world_size:
        now = time.monotonic()
        if now > deadline or (grace_end is not None and now > grace_end):
            break
        try:
            rank, ok, payload = results.get(timeout=_POLL_S)
        except queue.Empty:
            # A rank killed by a signal or os._exit never reports; do not wait out the timeout.
            if grace_end is None and _crashed(procs, payloads, raised):
                grace_end = time.monotonic() + _GRACE_S
            continue
        if ok:
            payloads[rank] = payload
        else:
            raised[rank] = payload
            grace_end = grace_end or time.monotonic() + _GRACE_S
    crashed = _crashed(procs, payloads, raised)
    if crashed or raised:
        # A crashed rank comes first: its peers' errors (connection reset) are only symptoms.
        lines = [
            f"rank {rank} exited with code {code} without reporting a result (crashed, killed "
            "or could not load fn; its stderr says why)"
            for rank, code in crashed
        ] + [f"rank {rank} raised:\n{text}" for rank, text in raised.items()]
        raise RuntimeError(f"run_gloo ({world_size} ranks): " + "\n".join(lines))
    if len(payloads) < world_size:
        missing = [rank for rank in range(world_size) if rank not in payloads]
        raise RuntimeError(
            f"run_gloo: ranks {missing} of {world_size} did not finish within {timeout_s}s (a rank "
            "waiting on a collective that another rank never called?); raise timeout_s if the "
            "work is just slow"
        )
    return payloads


def _crashed(
    procs: list[Any], payloads: dict[int, bytes], raised: dict[int, str]
) -> list[tuple[int, int]]:
    # _worker always reports and then exits 0, so an unreported non-zero exit is a crash.
    return [
        (rank, proc.exitcode)
        for rank, proc in enumerate(procs)
        if rank not in payloads and rank not in raised and proc.exitcode not in (None, 0)
    ]
