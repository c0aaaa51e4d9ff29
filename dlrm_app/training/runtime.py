"""Process setup for the commands that run under ``torchrun``: the process group, this rank's
device, collectives on small host values, and clean teardown.

``torchrun`` sets RANK/WORLD_SIZE/MASTER_ADDR...; the backend is NCCL when CUDA is available,
else gloo. Without those variables a command runs as a single process.
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import datetime
import functools
import gc
import os
import resource
import sys
import threading
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 600.0
"""How long a collective waits for the other ranks (``--timeout``); torch's own is 30 min."""


def init_distributed(timeout_s: float = DEFAULT_TIMEOUT_S) -> torch.device:
    """Join the process group torchrun describes (if any); the device this rank uses. A
    collective that waits longer than ``timeout_s`` for the other ranks raises. Also sets the
    process's allocator to reuse per-step buffers (:func:`reuse_freed_memory`)."""
    reuse_freed_memory()
    cuda = torch.cuda.is_available()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        store = restart_store(timeout)
        if store is None:
            dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout)
        else:
            dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout, store=store,
                                    rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]))
        Heartbeat.start()
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


class Heartbeat:
    """Each rank's sign of life in torchrun's store, for naming the rank that stalled.

    A daemon thread writes the time to ``heartbeat/<rank>`` every ``INTERVAL_S``; a process
    that stops (SIGSTOP, a hung host, a swapped-out machine) stops writing with all its threads.
    When a collective times out, :meth:`stalled` reads every rank's last beat. A store of its
    own (a client of torchrun's), so that the beats never wait behind the training's
    collectives; nothing runs outside torchrun (no MASTER_ADDR)."""

    INTERVAL_S = 1.0
    _store: dist.Store | None = None
    _thread: threading.Thread | None = None
    _stop = threading.Event()

    @staticmethod
    def _client() -> dist.Store:
        return dist.PrefixStore(
            f"dlrm_app_heartbeat/{restart_count()}",
            dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=datetime.timedelta(seconds=10)))

    @classmethod
    def start(cls) -> None:
        if cls._thread is not None or "MASTER_ADDR" not in os.environ:
            return
        try:
            cls._store = cls._client()
        except (RuntimeError, ValueError):  # no store to reach: no heartbeats, nothing else
            return
        rank, store, stop = int(os.environ["RANK"]), cls._store, cls._stop
        stop.clear()

        def beat() -> None:
            while not stop.is_set():
                try:
                    store.set(f"{rank}", repr(time.time()))
                except (RuntimeError, OSError):
                    return  # the store went away (torchrun is ending the job)
                stop.wait(cls.INTERVAL_S)

        cls._thread = threading.Thread(target=beat, name="dlrm-app-heartbeat", daemon=True)
        cls._thread.start()
        # A daemon thread that is inside the store's C++ code when the interpreter finalizes
        # is unwound there and aborts the process ("terminate called without an active
        # exception", exit -6) after the work is done: stop it before that.
        atexit.register(cls.stop)

    @classmethod
    def stop(cls) -> None:
        """End the beats and wait for the thread (at most one store write, bounded by the
        store's own timeout)."""
        thread, cls._thread = cls._thread, None
        if thread is None:
            return
        cls._stop.set()
        thread.join(timeout=15)

    @classmethod
    def stalled(cls, world_size: int) -> list[tuple[int, float | None]]:
        """``(rank, seconds since its last beat or None if it never beat)`` of every rank
        silent for more than 3 intervals, the most silent first; empty without heartbeats."""
        if cls._store is None:
            return []
        try:  # a client of its own: the beating thread's is not shared across threads
            store = cls._client()
        except (RuntimeError, ValueError):
            return []
        now, silent = time.time(), []
        for rank in range(world_size):
            try:
                last = float(store.multi_get([str(rank)])[0].decode()) \
                    if store.check([str(rank)]) else None
            except (RuntimeError, OSError, ValueError):
                return []
            age = None if last is None else now - last
            if age is None or age > 3 * cls.INTERVAL_S:
                silent.append((rank, age))
        return sorted(silent, key=lambda r: -(r[1] if r[1] is not None else float("inf")))


def stalled_ranks_text() -> str:
    """``"rank 1 (silent for 12 s)"``-style words naming the ranks that stopped answering, or
    empty where none is known."""
    if not dist.is_initialized():
        return ""
    silent = Heartbeat.stalled(dist.get_world_size())
    return ", ".join(f"rank {r}" + (f" (silent for {age:.0f} s)" if age is not None else
                                    " (never answered)") for r, age in silent)


_REPO = Path(__file__).resolve().parents[2]
"""The source tree (dlrm_app/training/runtime.py -> the folder holding dlrm_app/)."""
_OURS = tuple(str(_REPO / name) + os.sep
              for name in ("dlrm_app", "recsys_core"))
_TRANSPORTS = (str(Path(dist.__file__).resolve().parent) + os.sep,
               str(_REPO / "recsys_core" / "distributed" / "shm_comm.py"))


def collective_site(exc: BaseException) -> str:
    """Where a failed collective was called, from ``exc``'s traceback: ``"in `all_reduce`,
    called by `all_reduce_sum_` (recsys_core/distributed/comm.py:120), during `Trainer.step`
    (dlrm_app/training/trainer.py:312)"``: the transport's collective (torch.distributed's, or the
    shared-memory one's), this project's frame that called it (else the innermost frame of this
    project), and the innermost frame of the application (training, validation, a save); empty
    without one."""
    codes, lines = [], []
    tb = exc.__traceback__
    while tb is not None:
        codes.append(tb.tb_frame.f_code)
        lines.append(tb.tb_lineno)
        tb = tb.tb_next
    ours = [i for i, code in enumerate(codes) if code.co_filename.startswith(_OURS)]
    if not ours:
        return ""
    root = _REPO

    def name(i: int) -> str:
        path = Path(codes[i].co_filename).relative_to(root).as_posix()
        return f"`{codes[i].co_qualname}` ({path}:{lines[i]})"

    # the collective: the first frame of a transport (torch.distributed, or this project's
    # shared-memory one) and the project's frame that called it
    transport = [t for t in range(ours[0] + 1, len(codes))
                 if codes[t].co_filename.startswith(_TRANSPORTS) and t - 1 in ours]
    i = transport[0] - 1 if transport else ours[-1]
    called = [c.co_qualname.split(".<locals>")[0] if c.co_filename.startswith(_TRANSPORTS)
              else c.co_name for c in codes[i + 1:]
              if c.co_name not in ("wrapper", "inner", "_fn", "wait")]
    text = f"in `{called[0]}`, called by {name(i)}" if called else f"in {name(i)}"
    # the application's step the library call came from (training, validation, a save)
    app = [j for j in ours if codes[j].co_filename.startswith(_OURS[0])
           and not codes[j].co_filename.endswith(("runtime.py", "cli.py", "__main__.py"))]
    if app and app[-1] != i:
        text += f", during {name(app[-1])}"
    return text


def restart_count() -> int:
    """How many times torchrun restarted this group (``TORCHELASTIC_RESTART_COUNT``; 0 outside
    torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def restart_store(timeout: datetime.timedelta) -> dist.Store | None:
    """Under a torchrun restart, the agent's store with a prefix of its own for this attempt;
    None otherwise (``init_process_group`` then reads the store from the environment).

    torchrun (2.13) hands the workers of a restarted group the same agent store as the failed
    attempt's, and the failed ranks' keys are still in it: the new ranks read their dead peers'
    addresses and gloo's connection hangs in ``init_process_group`` (a 2-rank program of plain
    torch does the same). Keys under ``attempt_N/`` start clean."""
    restarts = restart_count()
    if restarts == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"attempt_{restarts}", agent)


KEEP_FREED_BELOW = 64 << 20
"""Blocks up to this size come from the heap and are reused once freed. glibc's own threshold
moves as blocks are freed, and never above 32 MiB: a batch's pooled embeddings at dim 128 and
batch 2048 are 27 MiB, their gradient and all-to-all buffers as large, and until glibc's
threshold has caught up they are unmapped on free and faulted in again on every step."""
TRIM_ABOVE = 256 << 20
"""Free memory at the top of the heap goes back to the system only beyond this."""


@functools.cache
def reuse_freed_memory() -> bool:
    """Make glibc's malloc keep and reuse the per-step buffers of training (tens of MB each:
    pooled embeddings, their gradients, all-to-all buffers) instead of unmapping them when
    they are freed and page-faulting fresh zeroed pages for them on the next step. Larger
    blocks (tables, checkpoint buffers) still go back to the system when freed; free memory
    kept for reuse stays below ``TRIM_ABOVE`` plus fragments. Process-wide, set by
    :func:`init_distributed`. In ``bench/train.py`` the bf16 step at the reference sizes went
    127-174 -> 100-112 ms with the same peak RSS. False where the C library is not glibc
    (nothing changes there)."""
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name)
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None or not hasattr(libc, "gnu_get_libc_version"):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    return bool(mallopt(m_mmap_threshold, ctypes.c_int(KEEP_FREED_BELOW))
                and mallopt(m_trim_threshold, ctypes.c_int(TRIM_ABOVE)))


def shutdown_distributed() -> None:
    """Leave the process group cleanly at the end of a command. Without it a rank can abort
    at interpreter exit ("terminate called without an active exception") while gloo's threads
    still hold finished work: free the models first, then wait for every rank, then destroy."""
    Heartbeat.stop()
    if dist.is_initialized():
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


def world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def global_mean(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return t.tolist()


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def gather(value: Any) -> list[Any]:
    if not dist.is_initialized():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX-512 BF16 or AMX; Linux flags).
    Without it bf16 matmuls are emulated and no faster than fp32."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def amp_enabled(device: torch.device, amp: bool | None) -> bool:
    """``--amp`` resolved: ``None`` (the default) means on where the device computes bf16
    natively (a CUDA GPU with bf16, a CPU with AVX-512 BF16 or AMX) and off elsewhere."""
    if amp is not None:
        return amp
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and cpu_has_native_bf16()


def amp_warning(device: torch.device, amp: bool | None) -> str | None:
    """The warning for ``--amp`` asked for on a CPU that emulates bf16 (no AVX-512 BF16 or
    AMX), where the dense layers run many times slower than fp32; ``None`` elsewhere."""
    if amp is True and device.type == "cpu" and not cpu_has_native_bf16():
        return ("warning: --amp on a CPU without bf16 hardware (no AVX-512 BF16 or AMX): "
                "its bf16 matrix products are emulated, far slower than fp32; drop --amp "
                "(the default trains in fp32 on this CPU) or pass --no-amp")
    return None


def autocast(device: torch.device, amp: bool | None) -> Any:
    """bfloat16 autocast of the model's forward (weights, gradients, optimizer state and the
    loss stay fp32; the embedding lookups are not autocast ops and stay fp32 too)."""
    if amp_enabled(device, amp) and device.type in ("cuda", "cpu"):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()
