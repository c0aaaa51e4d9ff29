"""``dlrm-app serve``: an HTTP prediction endpoint for an exported model, ``.pt2`` (the default
export) or TorchScript (see ``artifact.py``).

Endpoints (JSON in and out; the server binds 127.0.0.1 unless told otherwise)::

    POST /predict   {"rows": ["<raw row>", ...], "labeled": false}   (Criteo models)
                    {"instances": [{"dense": [x0, .., x12],
                                    "sparse": {"cat_0": [id, ..], .., "cat_25": id}}, ..]}
                    -> 200 {"probabilities": [p0, p1, ..]}       one per row, in order
    GET  /health    -> {"status": "ok", "model": .., "format": .., "embedding_dtype": ..,
                        "sha256": .., "loaded_at": .., "load_seconds": .., "reloads": ..,
                        "last_reload": .., ..}
    GET  /metrics   -> request counts per path and status, rows served, batches run, mean
                       batch rows, latency p50/p90/p99 (ms) of the last ``latency_window``
                       successful predictions

``rows`` (models whose metadata has ``raw_format: "criteo_tsv"``): one raw Criteo line per
row, tab-separated, *without* the label: 13 decimal integers then 26 categorical values of 1-8
hex digits; an empty field is missing; a row with fewer than 39 fields has its trailing fields
missing (as the preprocessor pads short lines). Lines copied from a training file start with a
label: send ``"labeled": true`` and every row's first field is dropped (unlabeled rows with 40
fields are refused rather than guessed at). The rows are parsed here (missing dense -> NaN,
missing categorical -> 0, as ``encode`` expects) and the model's ``predict_raw`` applies the
training preprocessing (log transform, hashing or vocabulary). ``instances`` (any model):
already-encoded inputs for ``forward``: dense values as the model consumes them (transformed),
every sparse feature of the metadata by name with ids in ``[0, num_embeddings)``: a list (a
bag; exactly one id unless the feature is multi-hot) or one id.

Errors are ``{"error": "..."}``: 400 for bad JSON or bad rows (naming the row and field), 411
without a Content-Length, 413 for a body over ``max_body_bytes`` (refused from its headers,
before reading it) or more than ``max_rows`` rows, 404 / 405 for other paths / methods, 500
when the model raises (the rest of its batch is retried alone). The server keeps serving.

Batching: handler threads parse and validate their request, then queue it; one worker thread
merges queued requests of one kind into a model call of at most ``max_batch_rows`` rows (a
larger request runs alone), waiting at most ``max_wait_ms`` after the first for more while
other requests are being read or parsed (not at all when none is), and hands each request its
slice of the result.

A new model, or new weights for the model (``model.weights`` beside ``model.pt2``), is taken
without a restart (:mod:`dlrm_app.serving.reload`): on SIGHUP, or when a new file is renamed over
the served path (and its ``.sha256`` beside it).
"""

from __future__ import annotations

import errno
import json
import signal
import socket
import threading
import time
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import torch

from dlrm_app.config import ServeConfig
from dlrm_app.serving.batching import Batcher, Metrics, ModelError
from dlrm_app.serving.reload import Reloader, load_program, now, swap_program, swap_weights
from dlrm_app.serving.request import (
    EncodedRows,
    Inputs,
    RawRows,
    RequestError,
    RequestParser,
)


# ---- HTTP -----------------------------------------------------------------------------------
class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128
    app: PredictionServer


class _Handler(BaseHTTPRequestHandler):
    server: _HTTPServer
    protocol_version = "HTTP/1.1"  # keep-alive: load generators reuse connections
    # headers and body are two writes: with Nagle's algorithm the body waits for the client's
    # delayed ACK of the headers (40 ms on Linux) on a kept-alive connection
    disable_nagle_algorithm = True

    def setup(self) -> None:
        self.timeout = self.server.app.config.request_timeout_s
        super().setup()

    def parse_request(self) -> bool:
        """A request line and headers read: from here until its answer is sent the request
        counts as in flight, so that a graceful stop waits for it."""
        ok = super().parse_request()
        if ok and hasattr(self, "do_" + self.command):
            self.server.app.in_flight(+1)
        return ok

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
        pass  # one line per request on stderr is too much at serving rates; see /metrics

    def _dispatch(self) -> None:
        self._handle(self.command)

    # Every verb goes to one handler, which answers 405 with Allow for those a path lacks.
    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _dispatch

    def _handle(self, method: str) -> None:
        start = time.perf_counter()
        app = self.server.app
        path = urlsplit(self.path).path
        known = {"/predict": "POST", "/health": "GET", "/metrics": "GET"}
        try:
            self._answer(method, start, path, known)
        finally:
            app.in_flight(-1)  # counted from parse_request

    def _answer(self, method: str, start: float, path: str, known: dict[str, str]) -> None:
        app = self.server.app
        rows = 0
        self.body_left_unread = self.body_read = False
        self.allow = known.get(path)
        try:
            if path not in known:
                raise RequestError(404, f"no endpoint {path}; use POST /predict, GET /health "
                                        f"or GET /metrics")
            if method == "OPTIONS":
                status, body = 204, {}
            elif method != known[path] and not (method == "HEAD" and known[path] == "GET"):
                raise RequestError(405, f"{path} takes {known[path]}, not {method}")
            elif path == "/health":
                status, body = 200, app.health()
            elif path == "/metrics":
                status, body = 200, app.metrics.snapshot(app.batcher)
            else:
                with app.batcher.arriving():  # from before the body is read
                    future = app.submit_body(self._read_body())
                probs = future.result()
                bad = np.flatnonzero(~np.isfinite(probs))
                if len(bad):
                    raise RequestError(400, f"the model's output is not finite for row(s) "
                                            f"{bad[:10].tolist()}: their inputs are far outside "
                                            f"anything it was trained on")
                status, body, rows = 200, {"probabilities": probs.tolist()}, len(probs)
        except RequestError as e:
            status, body = e.status, {"error": e.message}
        except ModelError as e:
            status, body = 500, {"error": str(e)}
        except Exception as e:  # a bug of ours: answer, keep serving
            status, body = 500, {"error": f"internal error: {type(e).__name__}: {e}"}
        if path not in known:
            path = "other"
        if not self.body_read:
            self._skip_body()  # a body left unread would be parsed as the next request
        if app.draining:
            self.close_connection = True  # kept-alive clients reconnect elsewhere
        app.metrics.record(path, status, time.perf_counter() - start, rows)
        self._send(status, body, head=method == "HEAD")

    def _skip_body(self) -> None:
        """Read and drop the body of a request answered without it (404, 405, GET with a body);
        one that cannot be skipped safely (chunked, unreadable length, over the limit) ends the
        connection after the answer instead."""
        length = self.headers.get("Content-Length")
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower() or (
                length is not None and not _byte_count(length)):
            self.close_connection = True
        elif length is not None and int(length) > 0:
            if int(length) > self.server.app.config.max_body_bytes:
                self.close_connection = self.body_left_unread = True
                return
            try:
                self.rfile.read(int(length))
            except (TimeoutError, OSError):
                self.close_connection = True

    def _read_body(self) -> bytes:
        self.body_read = True
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            self.close_connection = True
            raise RequestError(411, "chunked bodies are not accepted; send a Content-Length")
        length = self.headers.get("Content-Length")
        if length is None:
            self.close_connection = True
            raise RequestError(411, "send the body with a Content-Length header")
        self.body_read = True
        if not _byte_count(length):
            self.close_connection = True
            raise RequestError(400, f"Content-Length {length[:40]!r} is not a byte count")
        limit = self.server.app.config.max_body_bytes
        if int(length) > limit:
            self.close_connection = self.body_left_unread = True
            raise RequestError(413, f"body of {length} bytes is over the limit of {limit} "
                                    f"(--max-body-bytes); split the request")
        try:
            body = self.rfile.read(int(length))
        except TimeoutError:
            body = b""
        if len(body) != int(length):
            self.close_connection = True
            raise RequestError(400, f"the body ended or stalled (request_timeout_s) before its "
                                    f"{length} bytes (Content-Length) arrived")
        return body

    def _send(self, status: int, body: dict[str, Any], head: bool = False) -> None:
        try:
            data = json.dumps(body, allow_nan=False).encode() if status != 204 else b""
        except ValueError:  # never NaN or Infinity on the wire: that is not JSON
            status, data = 500, b'{"error": "internal error: a non-finite number in the answer"}'
        try:
            self.send_response(status)
            if status == 204 or (status == 405 and self.allow):
                allow = "OPTIONS" if self.allow is None else (
                    f"{self.allow}, HEAD, OPTIONS" if self.allow == "GET" else
                    f"{self.allow}, OPTIONS")
                self.send_header("Allow", allow)
            if status != 204:
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            if not head:
                self.wfile.write(data)
            self.wfile.flush()
        except OSError:  # the client went away
            self.close_connection = True
            return
        if self.body_left_unread:
            self._discard_input()

    def _discard_input(self, seconds: float = 1.0, limit: int = 64 << 20) -> None:
        """Read and drop what the client still sends, briefly: closing a socket with unread
        data resets the connection, and the client would see that instead of the 413."""
        deadline = time.monotonic() + seconds
        try:
            self.connection.shutdown(socket.SHUT_WR)
            self.connection.settimeout(0.1)
            while limit > 0 and time.monotonic() < deadline:
                chunk = self.connection.recv(1 << 16)
                if not chunk:
                    break
                limit -= len(chunk)
        except OSError:
            pass


_QUIET_S = 0.2
"""A graceful stop ends once no request has been in flight for this long (or at the drain
timeout)."""


def _byte_count(text: str) -> bool:
    """A Content-Length value we accept: ASCII digits only, at most 18 of them (``'²'`` is a
    digit to ``str.isdigit``, and 5,000 digits exceed ``int()``'s limit)."""
    return 0 < len(text) <= 18 and text.isascii() and text.isdigit()


class PredictionServer:
    """The HTTP endpoint over one scripted model; ``start()`` serves from a background thread.

    >>> server = PredictionServer.from_file("model.pt", ServeConfig(port=0))
    >>> port = server.start()      # then POST http://127.0.0.1:{port}/predict
    >>> server.stop()
    """

    def __init__(self, model: torch.jit.ScriptModule, metadata: dict[str, Any],
                 config: ServeConfig, name: str = "model", *,
                 load_seconds: float | None = None) -> None:
        self.model = model
        self.metadata = metadata
        self.config = config
        self.name = name
        self.loaded_at = now()
        """When the model serving now was loaded (ISO 8601, UTC)."""
        self.load_seconds = load_seconds
        """How long checking its digest and loading it took (None: not loaded from a file)."""
        self.last_reload: dict[str, Any] | None = None
        """The last :meth:`swap`'s outcome: ``ok``, ``at``, and ``reason`` when refused."""
        self.parser = RequestParser(metadata, config.max_rows)
        self.batcher = Batcher(model, config.max_batch_rows, config.max_wait_ms)
        self.metrics = Metrics(config.latency_window)
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.draining = False
        self._in_flight = 0
        self._last_change = 0.0
        self._idle = threading.Lock()
        self.reloads = 0
        """Models or weights taken in place of the first ones (:meth:`swap`,
        :meth:`swap_weights`)."""
        self.swapping = threading.Lock()
        self.path: Path | None = None
        """The program's file (None: not loaded from one)."""
        self.weights: dict[str, Any] | None = None
        """The published weights serving in the program (None: the program's own)."""
        self.weights_refused: str | None = None
        """Why the weights beside the program were not taken when it was loaded."""
        self.standby: Any = None
        """A second instance of the .pt2 program, the next weights' place (after the first)."""

    @classmethod
    def from_file(cls, path: str | Path, config: ServeConfig, *,
                  expect_sha256: str | None = None) -> PredictionServer:
        """Load an exported model, its sha256 checked first against ``expect_sha256`` or
        ``<path>.sha256`` (see :func:`dlrm_app.serving.artifact.verify_artifact`)."""
        model, metadata, seconds, weights, refused = load_program(path, expect_sha256)
        server = cls(model, metadata, config, name=Path(path).name, load_seconds=seconds)
        server.path, server.weights, server.weights_refused = Path(path), weights, refused
        return server

    @property
    def port(self) -> int:
        if self._httpd is None:
            raise RuntimeError("the server is not started; call start() first")
        return int(self._httpd.server_address[1])

    def start(self, bound: _HTTPServer | None = None) -> int:
        """Bind (or take ``bound``, a socket bound before the model loaded: see
        :func:`bind`), start the batcher and the HTTP thread; returns the bound port."""
        if self.config.threads is not None:
            torch.set_num_threads(self.config.threads)
        self.warm_up()
        self._httpd = bound or bind(self.config)
        self._httpd.app = self
        self.batcher.start()
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="dlrm-serve-http",
                                        daemon=True)
        self._thread.start()
        return self.port

    def in_flight(self, change: int) -> None:
        """Count requests between their first byte read and their answer sent."""
        with self._idle:
            self._in_flight += change
            self._last_change = time.monotonic()

    def stop(self) -> int:
        """Stop accepting connections, answer the requests already received (for at most
        ``drain_timeout_s``), then stop the batcher. Answers sent while draining close their
        connection. Returns how many received requests were left unanswered (0 unless the
        drain timed out).

        A kept-alive client that sends its next request after the drain has gone quiet finds
        the connection closed with no byte of an answer: the server never read that request,
        and HTTP clients retry such a request on a new connection (here: refused, the server
        is gone)."""
        if self._httpd is None:
            return 0
        self.draining = True
        self._httpd.shutdown()  # the accept loop ends
        # connections the kernel already accepted (the listen backlog) are served too; then
        # the socket closes and new clients are refused at once
        self._httpd.socket.setblocking(False)
        while True:
            try:
                request, address = self._httpd.get_request()
            except OSError:  # BlockingIOError: the backlog is empty
                break
            request.setblocking(True)
            self._httpd.process_request(request, address)
        self._httpd.socket.close()
        deadline = time.monotonic() + self.config.drain_timeout_s
        # quiet for a moment, not just idle once: a kept-alive client may be sending its next
        # request right now (its answer will say Connection: close)
        while time.monotonic() < deadline:
            with self._idle:
                if self._in_flight == 0 and time.monotonic() - self._last_change >= _QUIET_S:
                    break
            time.sleep(0.02)
        with self._idle:
            unanswered = self._in_flight
        self._httpd.server_close()
        self.batcher.stop()
        self._httpd = None
        return unanswered

    def warm_up(self, model: torch.jit.ScriptModule | None = None) -> None:
        """Calls of 1, 2 and 3 rows: TorchScript profiles and optimizes a method on its first
        calls and shapes (tens of ms), and a .pt2's first calls allocate, which would otherwise
        land on the first clients."""
        model = self.model if model is None else model
        d, f = len(self.parser.dense_names), len(self.parser.sparse)
        with torch.inference_mode():
            for b in (1, 2, 3):
                inputs: Inputs = (
                    RawRows(np.zeros((b, d), np.float32), np.zeros((b, f), np.int64))
                    if self.parser.accepts_rows else
                    EncodedRows(np.zeros((b, d), np.float32), [np.zeros(b, np.int64)] * f,
                                np.ones((f, b), np.int64)))
                type(inputs).predict(model, [inputs])

    def swap(self, path: str | Path, *, expect_sha256: str | None = None) -> dict[str, Any]:
        """Serve the model at ``path`` from now on, without a failed or lost request: it is
        loaded (its sha256 checked as at start), checked to take the same inputs, given the
        weights published beside it when they were made for it, and warmed up while the
        current model serves; then the next batch runs on it (a batch already running finishes
        on the old one). Raises ``ValueError`` (or ``OSError``) for a model that fails its
        digest, cannot be loaded, takes other inputs or fails its warm-up, and the current
        model goes on serving; ``/health``'s ``last_reload`` says why. Returns what
        ``/health`` will show (:mod:`dlrm_app.serving.reload`)."""
        return swap_program(self, path, expect_sha256=expect_sha256)

    def swap_weights(self, path: str | Path) -> dict[str, Any]:
        """Serve the weights at ``path`` (``dlrm-app export`` of an unchanged program) from now
        on, in the program being served: verified (digest before anything in the file is
        read, then its program fingerprint), loaded into a second instance of the compiled
        program, warmed up, then switched to between batches. Raises ``ValueError`` when
        refused (the current weights serve on; ``last_reload`` says why)."""
        return swap_weights(self, path)

    def __enter__(self) -> PredictionServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def submit_body(self, body: bytes) -> Future:
        """Parse and queue one ``/predict`` body; the future's result is its probabilities."""
        inputs = self.parser.parse(body)
        if inputs.rows == 0:
            done: Future = Future()
            done.set_result(np.zeros(0, np.float32))
            return done
        return self.batcher.submit(inputs)

    def health(self) -> dict[str, Any]:
        meta = self.metadata
        return {"status": "ok", "model": self.name, "format": meta.get("format", "torchscript"),
                "embedding_dtype": meta.get("embedding_dtype"), "dataset": meta.get("dataset"),
                "sha256": meta.get("sha256"), "loaded_at": self.loaded_at,
                "load_seconds": (None if self.load_seconds is None else
                                 round(self.load_seconds, 3)),
                "program_fingerprint": meta.get("program_fingerprint"),
                "weights": self.weights, "weights_refused": self.weights_refused,
                "reloads": self.reloads, "last_reload": self.last_reload,
                "accepts": ["rows", "instances"] if self.parser.accepts_rows else ["instances"],
                "dense_features": len(meta["dense_features"]),
                "sparse_features": len(meta["sparse_features"])}


# ---- command line ---------------------------------------------------------------------------
def bind(config: ServeConfig) -> _HTTPServer:
    """The listening socket of ``config.host``:``config.port``; a port in use is an error
    naming it and the flag (before seconds are spent loading a model)."""
    try:
        return _HTTPServer((config.host, config.port), _Handler)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise ValueError(f"port {config.port} on {config.host} is in use (another server?); "
                             "pass another --port, or --port 0 for a free one") from None
        raise ValueError(f"cannot listen on {config.host}:{config.port}: {e.strerror}; check "
                         "--host and --port") from None


def serve_forever(model: str | Path, config: ServeConfig, *,
                  expect_sha256: str | None = None) -> int:
    """``dlrm-app serve``: check ``model``'s sha256 (against ``expect_sha256``, else its
    ``.sha256`` file), load it, print where it listens and what was verified (one JSON line),
    serve until SIGTERM or Ctrl-C, taking a new model on SIGHUP or when one is renamed over
    ``model`` (:class:`Reloader`, one JSON line each), then stop and print how many received
    requests went unanswered (one JSON line; 0 unless ``--drain-timeout-s`` ran out)."""
    try:
        bound = bind(config)  # first: a busy port fails at once, not after loading
        # what the files were before loading: a model renamed over the path during the load
        # is taken next (the load itself refuses a file replaced while it read it)
        files = Reloader.watched_files(model, expect_sha256)
        server = PredictionServer.from_file(model, config, expect_sha256=expect_sha256)
        port = server.start(bound)
    except (ValueError, OSError) as e:
        raise SystemExit(f"dlrm-app serve: {e}") from None
    reloader = Reloader(server, model, expect_sha256=expect_sha256,
                        interval_s=config.watch_interval_s, files=files)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGHUP, lambda *_: reloader.request())
    reloader.start()
    print(json.dumps({"listening": f"http://{config.host}:{port}", "port": port,
                      "model": str(model),
                      "embedding_dtype": server.metadata.get("embedding_dtype"),
                      "verified": server.metadata.get("verified"),
                      **({"weights": server.weights} if server.weights else {}),
                      **({"weights_refused": server.weights_refused}
                         if server.weights_refused else {})}), flush=True)
    try:
        # woken often: a signal the kernel hands to another thread does not interrupt this
        # wait, and Python runs its handler only when the main thread runs again
        while not stop.wait(0.1):
            pass
    except KeyboardInterrupt:
        pass
    reloader.stop()  # a reload under way finishes first
    unanswered = server.stop()
    print(json.dumps({"stopped": True, "unanswered": unanswered}), flush=True)
    return 0
