"""The server's batching worker (:class:`Batcher`: queued requests merged into model calls of
at most ``max_batch_rows`` rows, one model instance per call) and its ``/metrics`` counters
(:class:`Metrics`); see :mod:`dlrm_app.serving.server`."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import queue
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch

from dlrm_app.serving.request import Inputs, RequestError


# ---- batching -------------------------------------------------------------------------------
@dataclasses.dataclass
class _Pending:
    inputs: Inputs
    future: Future = dataclasses.field(default_factory=Future)


class ModelError(Exception):
    """The model raised on a request's rows (HTTP 500)."""


_STOP = object()


class Batcher:
    """One worker thread running queued requests in merged model calls."""

    def __init__(self, model: torch.jit.ScriptModule, max_batch_rows: int,
                 max_wait_ms: float) -> None:
        self.model = model
        self.max_batch_rows = max_batch_rows
        self.max_wait_s = max_wait_ms / 1e3
        self.batches = 0
        self.batch_rows = 0
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="dlrm-serve-batcher",
                                        daemon=True)
        self._stopped = False
        self._lock = threading.Lock()
        self._running = threading.Lock()  # held while a batch runs
        self._arriving = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._lock:  # nothing is queued after _STOP
            self._stopped = True
            self._queue.put(_STOP)
        self._thread.join()

    def submit(self, inputs: Inputs) -> Future:
        pending = _Pending(inputs)
        with self._lock:
            if self._stopped:
                raise RequestError(503, "the server is shutting down; retry elsewhere")
            self._queue.put(pending)
        return pending.future

    @contextlib.contextmanager
    def arriving(self) -> Iterator[None]:
        """Marks a request being read and parsed: the worker waits for it (up to max_wait_ms),
        and does not wait when none is (a lone request runs at once)."""
        with self._lock:
            self._arriving += 1
        try:
            yield
        finally:
            with self._lock:
                self._arriving -= 1

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    def _loop(self) -> None:
        carry: Any = None
        while True:
            first = carry if carry is not None else self._queue.get()
            carry = None
            if first is _STOP:
                break
            batch, rows = [first], first.inputs.rows
            deadline = time.perf_counter() + self.max_wait_s
            while rows < self.max_batch_rows:
                if self._arriving == 0 and self._queue.empty():
                    break  # nothing on its way: waiting would only add latency
                try:
                    item = self._queue.get(timeout=max(deadline - time.perf_counter(), 0))
                except queue.Empty:
                    break
                if (item is _STOP or type(item.inputs) is not type(first.inputs)
                        or rows + item.inputs.rows > self.max_batch_rows):
                    carry = item
                    break
                batch.append(item)
                rows += item.inputs.rows
            with self._running:
                self._run(batch)

    def switch(self, model: Any) -> None:
        """Run the next batches on ``model``; returns once no batch runs on the previous one
        (which may then be changed)."""
        self.model = model  # read once per batch by the worker
        with self._running:
            pass

    def _run(self, batch: list[_Pending]) -> None:
        rows = sum(p.inputs.rows for p in batch)
        try:
            with torch.inference_mode():
                probs = type(batch[0].inputs).predict(self.model, [p.inputs for p in batch])
            if tuple(probs.shape) != (rows,):
                raise RuntimeError(f"the model returned shape {tuple(probs.shape)} for {rows} "
                                   f"rows, expected ({rows},)")
        except Exception as e:
            if len(batch) > 1:  # find the request at fault; the others still get answers
                for p in batch:
                    self._run([p])
                return
            lines = str(e).strip().splitlines() or [type(e).__name__]
            batch[0].future.set_exception(ModelError(f"the model failed: {lines[-1]}"))
            return
        self.batches += 1
        self.batch_rows += rows
        out = probs.numpy()
        start = 0
        for p in batch:
            p.future.set_result(out[start:start + p.inputs.rows])
            start += p.inputs.rows


# ---- metrics --------------------------------------------------------------------------------
class Metrics:
    """Request counts per path and status, and recent successful prediction latencies."""

    def __init__(self, window: int) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, collections.Counter] = collections.defaultdict(
            collections.Counter)
        self._latency_ms: collections.deque[float] = collections.deque(maxlen=window)
        self.rows_served = 0
        self.started = time.monotonic()

    def record(self, path: str, status: int, seconds: float, rows: int = 0) -> None:
        with self._lock:
            self._counts[path][str(status)] += 1
            if path == "/predict" and status == 200:
                self._latency_ms.append(seconds * 1e3)
                self.rows_served += rows

    def snapshot(self, batcher: Batcher) -> dict[str, Any]:
        with self._lock:
            counts = {p: dict(c) for p, c in self._counts.items()}
            latency = np.array(self._latency_ms)
            rows = self.rows_served
        by_status: collections.Counter = collections.Counter()
        for c in counts.values():
            by_status.update(c)
        pct = ({f"p{q}": round(float(np.percentile(latency, q)), 3) for q in (50, 90, 99)}
               if len(latency) else dict.fromkeys(("p50", "p90", "p99")))
        batches = batcher.batches
        return {
            "uptime_s": round(time.monotonic() - self.started, 3),
            "requests": counts,
            "responses_by_status": dict(by_status),
            "rows_served": rows,
            "batches": batches,
            "mean_batch_rows": round(batcher.batch_rows / batches, 3) if batches else None,
            "queue_depth": batcher.queue_depth,
            "latency_ms": {"window": len(latency), **pct},
        }
