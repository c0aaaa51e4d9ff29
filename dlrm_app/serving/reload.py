"""Taking a new model, or new weights for the model being served, without a restart or a failed
request (``dlrm-app serve``; :class:`dlrm_app.serving.server.PredictionServer`).

Two things can be published beside a served ``model.pt2``:

- a new program (``model.pt2`` and ``model.pt2.sha256`` renamed over the served pair):
  :func:`swap_program` loads it (its digest checked before anything in it is read), checks
  that it takes the same inputs, loads the weights published beside it when they were made for
  it, warms it up, and switches between batches.
- new weights for the same program (``model.weights`` and ``model.weights.sha256``, written by
  ``dlrm-app export`` when the program is unchanged: :mod:`dlrm_app.serving.weights`):
  :func:`swap_weights` reads and verifies them, checks their program fingerprint against the
  program being served, loads them into a second instance of the compiled program beside the
  live one (``load_constants`` of each AOTInductor program), warms it up and switches between
  batches; the instance that served before becomes the spare for the next weights.

The :class:`Reloader` decides which, on SIGHUP or when it sees the files change. A request is
answered by one batch, and a batch by one instance: never by a mix of two models or weights.
TorchScript models take new programs only (weights published alone are refused: export the
TorchScript model in full and it is reloaded as a program).
"""

from __future__ import annotations

import datetime
import json
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dlrm_app.serving.artifact import digest_path, load_artifact
from dlrm_app.serving.weights import check_weights, read_weights, weights_path

if TYPE_CHECKING:
    from dlrm_app.serving.server import PredictionServer


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")


def load_unchanged(path: str | Path, expect_sha256: str | None
                   ) -> tuple[Any, dict[str, Any], float]:
    """``load_artifact`` (its digest checked before anything in the file is read), timed; a
    file replaced or rewritten meanwhile is refused: the digest and the load each open the
    path, so the model loaded would not be the file whose digest was checked."""
    before = file_state(Path(path))
    start = time.perf_counter()
    model, metadata = load_artifact(path, expect_sha256=expect_sha256)
    seconds = time.perf_counter() - start
    if file_state(Path(path)) != before:
        raise ValueError(f"{path} was replaced or rewritten while its digest was checked and it "
                         "was loaded, so it was not taken (what was loaded may not be the file "
                         "that was checked); publish models by renaming them into place (mv), "
                         "then load it again")
    return model, metadata, seconds


def file_state(path: Path) -> tuple[int, ...] | None:
    """What changes when a file is renamed over ``path`` or rewritten: (device, inode, size,
    mtime in ns); None when there is no file."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def inputs_of(metadata: dict[str, Any]) -> tuple[Any, ...]:
    """What a request must hold for a model: its features and raw row format."""
    return (tuple(metadata["dense_features"]),
            tuple((f["name"], f["num_embeddings"], f.get("multi_hot")) for f in
                  metadata["sparse_features"]),
            metadata.get("raw_format"))


class WeightsLoadError(ValueError):
    """Loading checked weights into a program failed part way: that instance is unusable."""


def load_weights_into(model: Any, path: Path, metadata: dict[str, Any]) -> dict[str, Any]:
    """Read the weights at ``path`` (every byte hashed and checked against its ``.sha256``
    before any is interpreted), check that they were made for the program of ``metadata``, and
    load them as the constants of ``model``'s compiled programs (a ``.pt2`` instance that is
    not serving). Returns what ``/health`` shows of them. ``ValueError`` when refused."""
    _check_pt2(path, metadata)
    start = time.perf_counter()
    weights = read_weights(path)
    check_weights(weights, path, metadata)
    maps = {}
    for name, runner in model.programs.items():  # all checked before any is loaded
        given = weights.of(name)
        needed = runner.get_constant_fqns()
        missing = [fqn for fqn in needed if fqn not in given]
        if missing:
            raise ValueError(f"{path}: lacks {name}'s constants {missing[:5]}; publish the "
                             "weights again")
        maps[name] = {fqn: given[fqn] for fqn in needed}
    model.weights_storage = weights.buffer  # the constants below are views of it
    for name, runner in model.programs.items():
        # user_managed: the program keeps pointers into weights.buffer (no copy). Should this
        # raise, the instance holds a mix: the callers then drop it (never serve it).
        try:
            runner.load_constants(maps[name], check_full_update=True, user_managed=True)
        except Exception as e:
            last = (str(e).strip().splitlines() or [type(e).__name__])[-1]
            raise WeightsLoadError(f"{path}: program {name!r} refused the weights ({last}); "
                                   "publish them again, or export the program in full") from e
    training = weights.header.get("training") or {}
    return {"file": str(path), "sha256": weights.sha256, "verified": weights.note,
            "checkpoint": weights.header.get("checkpoint"), "step": training.get("step"),
            "loaded_at": now(), "load_seconds": round(time.perf_counter() - start, 3)}


def _check_pt2(path: Path, metadata: dict[str, Any]) -> None:
    if metadata.get("format") != "pt2":
        raise ValueError(f"{path}: weights published alone load into a .pt2 program; the model "
                         "being served is TorchScript: export it in full (`dlrm-app export "
                         "--format torchscript`) and publish that")


def _beside(program: Path, model: Any, metadata: dict[str, Any]
            ) -> tuple[dict[str, Any] | None, str | None]:
    """The weights published beside a ``.pt2`` program, loaded into ``model`` when they are
    there and were made for it: (what /health shows of them or None, why they were not taken
    or None)."""
    path = weights_path(program)
    if metadata.get("format") != "pt2" or not path.is_file():
        return None, None
    try:
        return load_weights_into(model, path, metadata), None
    except WeightsLoadError:
        raise  # the instance holds a mix: the program's load fails as a whole
    except ValueError as e:  # refused before anything was loaded: the program's own serve
        return None, str(e)


def load_program(path: str | Path, expect_sha256: str | None
                 ) -> tuple[Any, dict[str, Any], float, dict[str, Any] | None, str | None]:
    """A program as the server starts or reloads it: (model, manifest, load seconds, its
    published weights or None, why those were not taken or None)."""
    model, metadata, seconds = load_unchanged(path, expect_sha256)
    weights, refused = _beside(Path(path), model, metadata)
    return model, metadata, seconds, weights, refused


def _failed(server: PredictionServer, kind: str, path: Path, e: Exception) -> None:
    server.last_reload = {"ok": False, "kind": kind, "at": now(), "file": str(path),
                          "reason": str(e).strip() or type(e).__name__}


def _warm(server: PredictionServer, model: Any, path: Path) -> None:
    try:
        server.warm_up(model)
    except Exception as e:
        last = (str(e).strip().splitlines() or [type(e).__name__])[-1]
        raise ValueError(f"{path}: its warm-up calls failed ({last}); export it again") from e


def swap_program(server: PredictionServer, path: str | Path, *,
                 expect_sha256: str | None = None) -> dict[str, Any]:
    """See :meth:`PredictionServer.swap`."""
    path = Path(path)
    with server.swapping:  # one swap at a time
        try:
            model, metadata, seconds, weights, refused = load_program(path, expect_sha256)
            if inputs_of(metadata) != inputs_of(server.metadata):
                raise ValueError(f"{path} takes other inputs than the model being served "
                                 "(its features or raw row format differ); start a server "
                                 "for it")
            _warm(server, model, path)
        except Exception as e:
            _failed(server, "program", path, e)
            raise
        server.batcher.switch(model)
        server.model, server.metadata, server.name, server.path = model, metadata, path.name, path
        server.standby = None  # another program: the spare instance is of the old one
        server.weights, server.weights_refused = weights, refused
        server.loaded_at, server.load_seconds = now(), seconds
        server.reloads += 1
        server.last_reload = {"ok": True, "kind": "program", "at": server.loaded_at,
                              "file": str(path)}
        return server.health()


def swap_weights(server: PredictionServer, path: str | Path) -> dict[str, Any]:
    """See :meth:`PredictionServer.swap_weights`."""
    path = Path(path)
    with server.swapping:
        try:
            _check_pt2(path, server.metadata)
            spare = server.standby
            server.standby = None  # until it holds a whole set of weights again
            if spare is None:
                spare = _second_instance(server)
            weights = load_weights_into(spare, path, server.metadata)
            _warm(server, spare, path)
        except Exception as e:
            _failed(server, "weights", path, e)
            raise
        old = server.model
        server.batcher.switch(spare)  # returns once no batch runs on the old instance
        server.model, server.standby = spare, old
        server.weights, server.weights_refused = weights, None
        server.reloads += 1
        server.last_reload = {"ok": True, "kind": "weights", "at": weights["loaded_at"],
                              "file": str(path)}
        return server.health()


def _second_instance(server: PredictionServer) -> Any:
    """Another instance of the program being served, loaded from its file (the same digest)."""
    if server.path is None:
        raise ValueError("weights published alone load into a second instance of the program, "
                         "loaded from its file; this server was given a loaded model: start it "
                         "with PredictionServer.from_file")
    model, metadata, _ = load_unchanged(server.path, server.metadata.get("sha256"))
    if metadata.get("program_fingerprint") != server.metadata.get("program_fingerprint"):
        raise ValueError(f"{server.path} now holds another program than the one being served; "
                         "it is taken as a program (renamed with its .sha256, or on SIGHUP), "
                         "then weights for it")
    return model


_SETTLE_S = 1.0
"""A changed file (or ``.sha256``) is taken once all watched files have been unchanged this
long: a publisher renames the file and then its digest, or the reverse."""

_FileStates = tuple[tuple[int, ...] | None, ...]


class Reloader:
    """Takes what was published at the served path: a new program (:func:`swap_program`) when
    the model file or its ``.sha256`` changed, else new weights (:func:`swap_weights`) when the
    weights file beside it or its ``.sha256`` changed; on :meth:`request` (SIGHUP) at once
    (the program if it changed or no weights file is there, else the weights), or when a
    thread that checks the files every ``interval_s`` (0: only on request) sees one change and
    then all unchanged for ``settle_s``. A refused file is not tried again until one of them
    changes again; weights removed (a full export replacing the program) are nothing to take.
    One JSON line on stdout per attempt: ``reloaded`` or ``reload_failed`` (the current model
    serves on)."""

    def __init__(self, server: PredictionServer, path: str | Path, *,
                 expect_sha256: str | None = None, interval_s: float = 0.5,
                 settle_s: float = _SETTLE_S, files: _FileStates | None = None) -> None:
        self.server = server
        self.path = Path(path)
        self.weights = weights_path(path)
        self.expect_sha256 = expect_sha256
        self.interval_s = interval_s
        self.settle_s = settle_s
        self._program_files = 1 if expect_sha256 is not None else 2
        self._tried = self.watched_files(path, expect_sha256) if files is None else files
        """The files as they were when the serving model was loaded, or at the last attempt."""
        self._requested = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="dlrm-serve-reload",
                                        daemon=True)

    @staticmethod
    def watched_files(path: str | Path, expect_sha256: str | None) -> _FileStates:
        """The model file's state and its ``.sha256``'s (only read when no ``expect_sha256``
        pins the digest), then the weights file's and its ``.sha256``'s."""
        paths = ([Path(path)] + ([digest_path(path)] if expect_sha256 is None else [])
                 + [weights_path(path), digest_path(weights_path(path))])
        return tuple(file_state(p) for p in paths)

    def start(self) -> None:
        self._thread.start()

    def request(self) -> None:
        """Reload now (from a signal handler too: it only sets an event)."""
        self._requested.set()

    def stop(self) -> None:
        self._stopped.set()
        self._requested.set()
        self._thread.join()

    def _loop(self) -> None:
        seen, since = self._tried, time.monotonic()
        while True:
            requested = self._requested.wait(self.interval_s or None)
            if self._stopped.is_set():
                return
            if requested:
                self._requested.clear()
                self._reload("SIGHUP")
                continue
            now_ = self.watched_files(self.path, self.expect_sha256)
            if now_ != seen:  # changing: wait for the publisher to finish
                seen, since = now_, time.monotonic()
            elif now_ != self._tried and time.monotonic() - since >= self.settle_s:
                self._reload("file changed")

    def _reload(self, cause: str) -> None:
        files = self.watched_files(self.path, self.expect_sha256)
        n = self._program_files
        program_changed = files[:n] != self._tried[:n]
        self._tried = files
        weights_there = files[n] is not None
        if program_changed or (cause == "SIGHUP" and not weights_there):
            kind, path = "program", self.path
        elif weights_there:
            kind, path = "weights", self.weights
        else:
            return  # the weights were removed: a full export is replacing the program
        start = time.perf_counter()
        server = self.server
        try:
            if kind == "program":
                health = server.swap(path, expect_sha256=self.expect_sha256)
            else:
                health = server.swap_weights(path)
        except Exception as e:  # anything a new file does leaves the current model serving
            print(json.dumps({"reload_failed": str(e), "kind": kind, "on": cause,
                              "serving": server.name, "sha256": server.metadata.get("sha256"),
                              "weights_sha256": (server.weights or {}).get("sha256")}),
                  flush=True)
            return
        line = {"reloaded": str(path), "kind": kind, "on": cause}
        if kind == "program":
            line.update(sha256=health["sha256"], verified=server.metadata.get("verified"))
            if health["weights"] or server.weights_refused:
                line.update(weights=health["weights"], weights_refused=server.weights_refused)
        else:
            line.update(sha256=health["weights"]["sha256"], verified=health["weights"]["verified"])
        print(json.dumps({**line, "seconds": round(time.perf_counter() - start, 2)}), flush=True)
