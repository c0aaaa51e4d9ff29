"""Where preprocessing tasks run: in this process, or in worker processes (a fork server).

Both runners return results in task order, so everything downstream (the rows written, their
order, the bytes) is the same for any number of workers and threads. In this process, tasks
run on up to ``threads`` threads (two by default where two CPUs are usable): the heavy parts
of a task (the C parser, id counts and lookups through ctypes, numpy, pyarrow's Parquet
writer) release the GIL, so a second thread uses the second core without a second process
(measured on 1M rows, 2-core EPYC: 2.6-2.8 s -> 1.6-1.8 s, faster than two worker processes'
2.0 s; ``bench/preprocess.py``).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any, Protocol

import pyarrow as pa

from dlrm_app.threads import allowed_cpus, cgroup_cpu_quota, usable_cpus


class Runner(Protocol):
    """Runs tasks in order: in this process or in worker processes."""

    def map(self, fn: Callable[..., Any], tasks: Iterable[tuple]) -> Iterator[Any]:
        """``fn(*task)`` for each task, results in task order."""
        ...


IN_PROCESS_THREADS = 2
"""Tasks at a time in one process at most (fewer where fewer CPUs are usable). Two keep both
cores of a 2-core machine busy; past that, Python between the C calls holds the GIL: use
worker processes (``workers``) for more cores."""


def default_threads() -> int:
    """Threads for tasks in this process: ``IN_PROCESS_THREADS``, at most the CPUs usable
    (affinity mask and cgroup quota)."""
    return min(IN_PROCESS_THREADS, usable_cpus(allowed_cpus(), cgroup_cpu_quota()))


def task_threads(paths: Sequence[Path], workers: int) -> int:
    """Tasks at a time in each process that preprocesses ``paths``: one in each of several
    workers; in one process :func:`default_threads`, but one for gzip input, where one
    decompressing thread sets the pace and a second task thread only competes with it for
    the cores (1M rows: 2.05-2.26 s on one thread, 2.3-2.6 s on two)."""
    if workers > 1 or any(p.suffix == ".gz" for p in paths):
        return 1
    return default_threads()


class InProcess:
    """Tasks in this process: one at a time (``threads=1``), or on ``threads`` threads with
    at most ``2 * threads`` tasks in flight, results in task order."""

    def __init__(self, threads: int = 1) -> None:
        self.pool = ThreadPoolExecutor(threads, "preprocess") if threads > 1 else None
        self.depth = 2 * threads

    def map(self, fn: Callable[..., Any], tasks: Iterable[tuple]) -> Iterator[Any]:
        if self.pool is None:
            return (fn(*t) for t in tasks)
        return self._threaded(self.pool, fn, tasks)

    def _threaded(self, pool: ThreadPoolExecutor, fn: Callable[..., Any],
                  tasks: Iterable[tuple]) -> Iterator[Any]:
        window: deque[Future] = deque()
        try:
            for t in tasks:
                window.append(pool.submit(fn, *t))
                if len(window) >= self.depth:
                    yield window.popleft().result()
            while window:
                yield window.popleft().result()
        finally:
            # an error, or the caller stopped early: drop the queued tasks and let the running
            # ones end, so no thread writes after the caller has moved on (or cleaned up)
            # (a cancelled future is never waited for: once the pool has shut down, no thread
            # would mark it done; the running ones' own errors are dropped, the caller gets
            # the first one)
            wait([f for f in window if not f.cancel()])

    def shutdown(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


def _parent_of(pid: int) -> int:
    """The parent pid of ``pid`` (Linux /proc), or -1 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def _die_with(main_pid: int) -> None:
    """Kill this worker once the main process is gone (SIGKILL, a crash, an OOM kill): its
    parent is the fork server, whose parent is the main process until the main process exits
    (then the server is re-parented, even while the main process is an unreaped zombie)."""
    while True:
        time.sleep(WATCH_S)
        server = os.getppid()
        if main_pid not in (server, _parent_of(server)):
            os.kill(os.getpid(), signal.SIGKILL)


WATCH_S = 0.2
"""How often a worker checks that the main process is alive."""


def _init_worker(threads: int, main_pid: int) -> None:
    # The parent handles Ctrl-C (it cancels queued tasks and waits for running ones); pyarrow's
    # CSV reader gets an equal share of the cores instead of a full pool per worker.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pa.set_cpu_count(threads)
    if os.path.isdir("/proc"):
        threading.Thread(target=_die_with, args=(main_pid,), daemon=True).start()


class Processes:
    """``workers`` processes started by a fork server (a clean process: no threads or torch
    state of the parent are inherited; it imports this package once, so workers start in about
    0.1 s); at most ``2 * workers`` tasks (blocks) in flight, so the input is read only as fast
    as it is consumed."""

    def __init__(self, workers: int) -> None:
        context = multiprocessing.get_context("forkserver")
        # the package holds every task function (once the server starts)
        context.set_forkserver_preload(["__main__", __package__ or __name__])
        threads = max(1, (os.cpu_count() or 1) // workers)
        self.pool = ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker,
                                        initargs=(threads, os.getpid()))
        self.depth = 2 * workers

    def map(self, fn: Callable[..., Any], tasks: Iterable[tuple]) -> Iterator[Any]:
        window: deque[Future] = deque()
        try:
            for t in tasks:
                window.append(self.pool.submit(fn, *t))
                if len(window) >= self.depth:
                    yield window.popleft().result()
            while window:
                yield window.popleft().result()
        except BrokenProcessPool as e:
            raise RuntimeError(f"a preprocessing worker process died ({e}); if it ran out of "
                               f"memory, pass fewer workers or a smaller block_bytes") from e


@contextlib.contextmanager
def runner(workers: int, threads: int | None = None) -> Iterator[Runner]:
    """``workers`` processes, or this process alone (``workers=1``) on ``threads`` threads
    (None: :func:`default_threads`)."""
    if workers == 1:
        local = InProcess(default_threads() if threads is None else threads)
        try:
            yield local
        finally:
            local.shutdown()
        return
    processes = Processes(workers)
    try:
        yield processes
    finally:
        # an error or interrupt: queued tasks are dropped, running ones finish (a block each)
        processes.pool.shutdown(wait=True, cancel_futures=True)
