"""Published weights: the constants of a ``.pt2``'s compiled programs, apart from the program.

A ``.pt2`` is a compiled program plus the weights it was compiled with. Another day of
training changes the weights only, so ``dlrm-app export`` compares the *program fingerprint*
of the checkpoint it exports with the one recorded in the ``.pt2`` at ``--out`` and, when they
agree, writes the weights alone beside it (``model.pt2`` -> ``model.weights`` and
``model.weights.sha256``) instead of compiling again; ``dlrm-app serve`` loads them into a
second instance of the compiled program and switches between batches
(:mod:`dlrm_app.serving.reload`).

The fingerprint (sha256 of one canonical JSON document) covers what decides the compiled code:
each program's ``torch.export`` graph (its code, signature and the ranges of its dynamic
sizes), the name, shape and dtype of every constant (parameters and buffers: the values are not
in it), the manifest's description of the inputs and preprocessing, the AOTInductor options,
and the torch, FBGEMM and dlrm_app versions. Equal fingerprints mean that the program compiled
from one checkpoint computes the other's predictions once its constants are replaced.

File layout (little-endian)::

    "DLRMWGT1"  8 bytes
    header length  8 bytes (unsigned)
    header  JSON: format, format_version, program_fingerprint, checkpoint, training,
            created_by, tensors {"<program>/<constant fqn>": {dtype, shape, offset, bytes}}
    (spaces up to a multiple of 64 bytes)
    tensor data  each tensor's bytes at ``offset`` from here, 64-byte aligned, C order

It is written to a temporary name, fsynced and renamed over the path, then its sha256 likewise
(``model.weights.sha256``, ``sha256sum`` format). A reader hashes every byte before it
interprets any (:func:`read_weights`); the same checkpoint gives the same bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dlrm_app.serving.artifact import _HEX, DIGEST_SUFFIX, _read_digest, digest_path

WEIGHTS_SUFFIX = ".weights"
WEIGHTS_FORMAT = "dlrm-app weights"
WEIGHTS_FORMAT_VERSION = 1
_MAGIC = b"DLRMWGT1"
_ALIGN = 64
_CHUNK = 64 << 20
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.uint8, torch.int8,
    torch.int16, torch.int32, torch.int64, torch.bool)}

FINGERPRINT_KEYS = ("format_version", "format", "dataset", "kind", "dense_features",
                    "sparse_features", "raw_input", "raw_format", "embedding_dtype",
                    "embedding_dim", "table_bytes", "dense_dtype", "needs_fbgemm", "lookup",
                    "programs", "preprocessing")
"""The manifest keys that describe the program (the rest, ``checkpoint`` and ``training``,
describe the weights)."""


def weights_path(program: str | Path) -> Path:
    """Where a program's published weights are kept: ``model.pt2`` -> ``model.weights``."""
    program = Path(program)
    return program.with_name(program.stem + WEIGHTS_SUFFIX)


def program_constants(programs: Mapping[str, torch.export.ExportedProgram]
                      ) -> dict[str, Tensor]:
    """Every tensor constant of the exported programs (parameters, buffers, lifted constants),
    keyed ``<program>/<fqn>``: what the compiled programs may hold."""
    out: dict[str, Tensor] = {}
    for name, program in sorted(programs.items()):
        tensors = {**program.state_dict, **program.constants}
        for fqn, value in sorted(tensors.items()):
            if isinstance(value, Tensor):
                out[f"{name}/{fqn}"] = value.detach()
    return out


def constant_specs(constants: Mapping[str, Tensor]) -> dict[str, dict[str, Any]]:
    """``{key: {"dtype", "shape"}}`` of :func:`program_constants` (recorded in the manifest)."""
    return {k: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
            for k, t in sorted(constants.items())}


def program_fingerprint(programs: Mapping[str, torch.export.ExportedProgram],
                        manifest: Mapping[str, Any], compile_options: Mapping[str, Any]) -> str:
    """The sha256 of what decides the compiled code (see the module's docstring)."""
    from recsys_core.kernels import fbgemm_available

    described = {
        "graphs": {name: {"code": p.graph_module.code, "signature": str(p.graph_signature),
                          "ranges": sorted(f"{k}: {v}" for k, v in
                                           ((str(k), str(v)) for k, v in
                                            p.range_constraints.items()))}
                   for name, p in sorted(programs.items())},
        "constants": constant_specs(program_constants(programs)),
        "manifest": {k: manifest.get(k) for k in FINGERPRINT_KEYS},
        "compile_options": dict(compile_options),
        "torch": torch.__version__,
        "fbgemm": ((_version("fbgemm-gpu-cpu") or _version("fbgemm-gpu"))
                   if fbgemm_available() else None),
        "dlrm_app": _version("recsys-dlrm"),
    }
    text = json.dumps(described, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def write_weights(path: str | Path, constants: Mapping[str, Tensor],
                  header: Mapping[str, Any]) -> str:
    """Write ``constants`` (keyed ``<program>/<fqn>``) with ``header`` to ``path`` and its
    ``.sha256``, each to a temporary name, fsynced, then renamed (the weights first: a crash
    between the renames leaves a digest that refuses the new file, never one vouching for a
    file it was not made of). Returns the sha256, computed as the bytes are written."""
    path = Path(path)
    tensors, offset = {}, 0
    ordered = sorted(constants.items())
    for key, t in ordered:
        if str(t.dtype).removeprefix("torch.") not in _DTYPES:
            raise ValueError(f"weights {key}: dtype {t.dtype} cannot be published "
                             f"(supported: {sorted(_DTYPES)})")
        nbytes = t.numel() * t.element_size()
        tensors[key] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                        "offset": offset, "bytes": nbytes}
        offset += -(-nbytes // _ALIGN) * _ALIGN
    head = json.dumps({**header, "format": WEIGHTS_FORMAT,
                       "format_version": WEIGHTS_FORMAT_VERSION, "tensors": tensors},
                      sort_keys=True).encode()
    head += b" " * (-(len(_MAGIC) + 8 + len(head)) % _ALIGN)
    digest = hashlib.sha256()
    partial = path.with_name(f".{path.name}.partial")
    with open(partial, "wb") as f:
        def put(data: bytes | memoryview) -> None:
            f.write(data)
            digest.update(data)

        put(_MAGIC + len(head).to_bytes(8, "little") + head)
        for key, t in ordered:
            raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
            put(memoryview(raw))
            put(bytes(-tensors[key]["bytes"] % _ALIGN))
        f.flush()
        os.fsync(f.fileno())
    hexdigest = digest.hexdigest()
    sidecar = digest_path(path)
    sidecar_partial = sidecar.with_name(f".{sidecar.name}.partial")
    with open(sidecar_partial, "w") as f:
        f.write(f"{hexdigest}  {path.name}\n")
        f.flush()
        os.fsync(f.fileno())
    partial.replace(path)
    sidecar_partial.replace(sidecar)
    _fsync_dir(path.parent)
    return hexdigest


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclasses.dataclass(frozen=True)
class Weights:
    """A weights file read and verified by :func:`read_weights`."""

    header: dict[str, Any]
    """The header (``program_fingerprint``, ``checkpoint``, ``training``, ...)."""
    tensors: dict[str, Tensor]
    """``<program>/<fqn>`` -> a view into ``buffer``."""
    buffer: Tensor
    """The file's bytes (64-byte aligned): the tensors' storage, kept alive with them."""
    sha256: str | None
    """The verified digest; None when nothing was expected (no .sha256, no pin)."""
    note: str
    """What the digest was checked against, one line for a log."""

    def of(self, program: str) -> dict[str, Tensor]:
        """The constants of one program, by fqn."""
        prefix = f"{program}/"
        return {k[len(prefix):]: t for k, t in self.tensors.items() if k.startswith(prefix)}


def read_weights(path: str | Path, expect_sha256: str | None = None) -> Weights:
    """Read a weights file into memory and check its sha256 (against ``expect_sha256``, else
    ``<path>.sha256``; neither: unverified, the note says so) before any byte of it is
    interpreted; then check its layout. Every problem is a ``ValueError`` naming the file and
    the fix. The bytes checked are the bytes used (one read)."""
    path = Path(path)
    if expect_sha256 is not None:
        expected: str | None = expect_sha256.strip().lower()
        if not _HEX.fullmatch(expected or ""):
            raise ValueError(f"{expect_sha256.strip()[:80]!r}: not a sha256 (64 hex digits)")
        source = "the expected digest"
    elif digest_path(path).is_file():
        expected, source = _read_digest(digest_path(path), path), str(digest_path(path))
    else:
        expected, source = None, ""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            buffer = torch.empty(size, dtype=torch.uint8)
            view = memoryview(buffer.numpy())
            digest, done = hashlib.sha256(), 0
            while done < size:
                n = f.readinto(view[done:done + _CHUNK])
                if not n:
                    break
                digest.update(view[done:done + n])
                done += n
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({e.strerror}); publish the weights again "
                         "(`dlrm-app export`)") from None
    actual = digest.hexdigest()
    if done != size:
        raise ValueError(f"{path}: shrank while it was read; publish weights by renaming them "
                         "into place (`dlrm-app export` does)")
    if expected is not None and actual != expected:
        raise ValueError(f"{path}: sha256 {actual} differs from {expected} ({source}), so it was "
                         "not loaded (a damaged or replaced file, or another file's digest); "
                         "publish the weights again (`dlrm-app export`)")
    note = (f"sha256 {actual} matches {source}" if expected is not None else
            f"not verified: no {DIGEST_SUFFIX} beside it")
    header, tensors = _parse(path, buffer)
    return Weights(header, tensors, buffer, actual if expected is not None else None, note)


def _parse(path: Path, buffer: Tensor) -> tuple[dict[str, Any], dict[str, Tensor]]:
    def bad(what: str) -> ValueError:
        return ValueError(f"{path}: {what}; it is not a weights file written by `dlrm-app "
                          "export`, publish the weights again")

    data = buffer.numpy()
    if len(data) < 16 or bytes(data[:8]) != _MAGIC:
        raise bad("does not start with the weights file's mark")
    head_len = int.from_bytes(bytes(data[8:16]), "little")
    start = 16 + head_len
    if start > len(data) or start % _ALIGN:
        raise bad(f"its header length {head_len} does not fit the file's {len(data)} bytes")
    try:
        header = json.loads(bytes(data[16:start]))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise bad("its header is not JSON") from None
    if not isinstance(header, dict) or header.get("format") != WEIGHTS_FORMAT:
        raise bad("its header does not name the weights format")
    if header.get("format_version") != WEIGHTS_FORMAT_VERSION:
        raise ValueError(f"{path}: weights format {header.get('format_version')}, this reader "
                         f"understands {WEIGHTS_FORMAT_VERSION}; export the weights again")
    tensors: dict[str, Tensor] = {}
    for key, spec in (header.get("tensors") or {}).items():
        try:
            dtype = _DTYPES[spec["dtype"]]
            shape = [int(s) for s in spec["shape"]]
            offset, nbytes = int(spec["offset"]), int(spec["bytes"])
        except (KeyError, TypeError, ValueError):
            raise bad(f"tensor {key!r} is described wrongly") from None
        numel = 1
        for s in shape:
            numel *= s
        itemsize = torch.empty(0, dtype=dtype).element_size()
        if (min(shape, default=0) < 0 or nbytes != numel * itemsize or offset < 0
                or offset % _ALIGN or start + offset + nbytes > len(data)):
            raise bad(f"tensor {key!r} ({spec['dtype']} {shape} at {offset}) lies outside the "
                      "file or does not match its size")
        raw = buffer[start + offset:start + offset + nbytes]
        tensors[key] = raw.view(dtype).view(shape)
    return header, tensors


def check_weights(weights: Weights, path: str | Path, manifest: Mapping[str, Any]) -> None:
    """The weights fit the program of ``manifest``: the same fingerprint, and every constant
    the manifest lists with its shape and dtype. A ``ValueError`` says which and the fix."""
    theirs, ours = weights.header.get("program_fingerprint"), manifest.get("program_fingerprint")
    if ours is None:
        raise ValueError(f"{path}: the program being served records no fingerprint (exported "
                         "before weights could be published alone); export it in full once "
                         "(`dlrm-app export --full`), then publish weights")
    if theirs != ours:
        raise ValueError(f"{path}: weights for program {str(theirs)[:16]}..., the program being "
                         f"served is {ours[:16]}... (another model config, tables or export "
                         "options); export the program in full (`dlrm-app export`) instead")
    for key, spec in manifest.get("constants", {}).items():
        t = weights.tensors.get(key)
        if t is None:
            raise ValueError(f"{path}: lacks the constant {key}; publish the weights again")
        if list(t.shape) != spec["shape"] or str(t.dtype).removeprefix("torch.") != spec["dtype"]:
            raise ValueError(f"{path}: constant {key} is {str(t.dtype)} {list(t.shape)}, the "
                             f"program takes {spec['dtype']} {spec['shape']}; publish the "
                             "weights again")
