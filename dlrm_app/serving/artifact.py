"""The exported model artifact, which a serving process loads with torch (and FBGEMM, where the
manifest says ``needs_fbgemm``) only. Two formats, one contract.

``.pt2`` (the default of ``dlrm-app export``): a PT2 archive (zip) of AOTInductor-compiled
programs, ``model`` and (when ``raw_input``) ``encode``, with ``extra/manifest.json``. Load it
without this project::

    import json, zipfile, torch
    from torch.export.pt2_archive._package import load_pt2
    # import fbgemm_gpu       # first, when manifest["needs_fbgemm"] (registers its op)
    contents = load_pt2("model.pt2")
    manifest = json.loads(contents.extra_files["manifest.json"])
    model, encode = contents.aoti_runners["model"], contents.aoti_runners.get("encode")
    probabilities = model(*encode(dense_raw, cat_raw))           # raw Criteo rows

In C++: ``torch::inductor::AOTIModelPackageLoader("model.pt2", "model").run(inputs)``.
The compiled programs do not check their inputs' shapes unless ``AOTI_RUNTIME_CHECK_INPUTS=1``
is set in the environment before the first call (:func:`load_artifact` sets it, and checks
shapes itself); values outside a table fail an assertion in the program.

``.pt`` (``--format torchscript``): a ``torch.jit.save`` archive with ``metadata.json`` (the
same keys as the manifest), for stacks that cannot load ``.pt2`` yet; TorchScript is deprecated
in PyTorch. Load it with ``torch.jit.load(path, _extra_files={"metadata.json": ""})``.

The entry points (``B`` rows, ``D`` dense and ``F`` sparse features, in the manifest's order;
:func:`load_artifact` gives both formats these methods):

``forward(dense [B, D] float32, values [N] int64, offsets [F*B + 1] int64) -> [B] float32``
    (the ``.pt2``'s ``model``) Probabilities from *encoded* inputs: dense values already
    transformed, ids already in ``[0, num_embeddings)``, bags key-major (feature 0's B bags,
    then feature 1's, ...) as in a KeyedJaggedTensor's ``values()`` / ``offsets()``.
``encode(dense_raw [B, D] float32, cat_raw [B, F] int64) -> (dense, values, offsets)``
    (the ``.pt2``'s ``encode``) The dataset's preprocessing for one-hot raw rows
    (``raw_input`` is true): dense NaN (missing) -> 0, negatives -> 0, ``log(x + 1)``;
    categorical raw integers (Criteo: the parsed hex value; missing -> 0) hashed modulo the
    table size or mapped through the training vocabulary (rare / unseen -> 0). For datasets
    without a raw format it checks ranges and passes values through.
``predict_raw(dense_raw, cat_raw) -> [B] float32``
    ``forward(*encode(dense_raw, cat_raw))``.

Manifest keys: ``format_version``, ``format`` (``pt2`` / ``torchscript``), ``dataset`` (name),
``kind``, ``dense_features``, ``sparse_features`` (``name``, ``num_embeddings``,
``multi_hot``), ``raw_input`` (bool), ``raw_format`` (``"criteo_tsv"`` or null),
``embedding_dtype`` (``fp32``, ``fp16``, ``int8``, ``int4``), ``embedding_dim``,
``table_bytes`` (per table), ``dense_dtype``, ``needs_fbgemm`` (bool), ``lookup`` (.pt2:
``fbgemm`` or ``torch``), ``programs`` (.pt2: each program's inputs and output),
``preprocessing`` (the dataset's transform parameters), ``checkpoint``, ``training`` (run,
step, the validation metrics recorded at that step, model config), ``created_by``.

Integrity: an artifact is code (loading a ``.pt2`` runs its compiled library; a TorchScript
file runs its program), so ``dlrm-app export`` writes its sha256 beside it, ``<artifact>.sha256``
in ``sha256sum`` format (``HEX  model.pt2``; ``sha256sum -c`` in its folder checks it), and
:func:`load_artifact` compares the file's digest with ``expect_sha256``, or else with that
file, before anything inside the artifact is read. An artifact with neither loads unverified.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dlrm_app.data.schema import sha256_file
from dlrm_app.inputs import check_model_file
from recsys_core.kernels import fbgemm_available

ARTIFACT_FORMAT_VERSION = 1
METADATA_FILE = "metadata.json"
"""The TorchScript archive's metadata (extra file)."""
MANIFEST_FILE = "manifest.json"
"""The .pt2 archive's manifest (under ``extra/``)."""
MODEL_PROGRAM = "model"
ENCODE_PROGRAM = "encode"
MAX_BATCH = 1 << 20
"""The largest batch the .pt2 programs accept."""
PROGRAM_SIGNATURES = {
    MODEL_PROGRAM: {"inputs": ["dense [B, D] float32", "values [N] int64",
                               "offsets [F*B + 1] int64"], "output": "probabilities [B] float32"},
    ENCODE_PROGRAM: {"inputs": ["dense_raw [B, D] float32", "cat_raw [B, F] int64"],
                     "output": ["dense [B, D] float32", "values [F*B] int64",
                                "offsets [F*B + 1] int64"]},
}


DIGEST_SUFFIX = ".sha256"
"""``<artifact>.sha256`` beside the artifact: its digest, one ``sha256sum`` line."""
_HEX = re.compile(r"[0-9a-f]{64}")


def load_artifact(path: str | Path, *, expect_sha256: str | None = None
                  ) -> tuple[Any, dict[str, Any]]:
    """(model, manifest) of an exported artifact of either format; the model has ``forward``
    (also its call), ``predict_raw`` and ``encode``. Loads FBGEMM's ops when needed.

    First the file's sha256 is checked (:func:`verify_artifact`: against ``expect_sha256``,
    else ``<path>.sha256``); a mismatch raises ``ValueError`` before anything inside is read.
    The manifest gains ``sha256`` (the verified digest, or None) and ``verified`` (what was
    checked, one line for a log)."""
    path = Path(path)
    check_model_file(path)
    check = verify_artifact(path, expect_sha256)
    if not zipfile.is_zipfile(path):  # both formats are zip archives
        raise ValueError(f"{path}: not a model exported by `dlrm-app export` (a .pt2 or "
                         "TorchScript file is a zip archive); pass the --out of an export")
    model, meta = _load_pt2(path) if _is_pt2(path) else _load_torchscript(path)
    meta["sha256"], meta["verified"] = check.sha256, check.note
    return model, meta


def digest_path(path: str | Path) -> Path:
    """Where an artifact's digest is kept: ``<artifact>.sha256`` beside it."""
    path = Path(path)
    return path.with_name(path.name + DIGEST_SUFFIX)


def write_digest(path: str | Path) -> str:
    """Hash the artifact and write ``<artifact>.sha256`` (``HEX  name``, the line
    ``sha256sum -c`` reads; written to a temporary name and renamed). Returns the hex."""
    path = Path(path)
    digest = sha256_file(path)
    target = digest_path(path)
    partial = target.with_name(f".{target.name}.partial")
    partial.write_text(f"{digest}  {path.name}\n")
    partial.replace(target)
    return digest


@dataclasses.dataclass(frozen=True)
class ArtifactCheck:
    """What :func:`verify_artifact` found."""

    sha256: str | None
    """The file's digest when it was checked (and matched); None when nothing was expected."""
    note: str
    """One line for a log: what the digest was checked against, or that it was not."""


def verify_artifact(path: str | Path, expect_sha256: str | None = None) -> ArtifactCheck:
    """Check the artifact's sha256 before anything in it is loaded: against ``expect_sha256``
    when given (a digest from a record you trust), else against ``<path>.sha256`` when that
    exists. A mismatch (or a malformed digest) is a ``ValueError`` naming the file, both
    digests and the fix. Neither given nor beside it: nothing is checked (the note says so).

    The ``.sha256`` beside a model catches a file damaged or replaced since export (disk, copy,
    a partial transfer); whoever can rewrite both files can pass it, which only
    ``expect_sha256`` from elsewhere rules out."""
    path = Path(path)
    sidecar = digest_path(path)
    if expect_sha256 is not None:
        expected = expect_sha256.strip().lower()
        if not _HEX.fullmatch(expected):
            raise ValueError(f"--expect-sha256 {expect_sha256.strip()[:80]!r}: not a sha256 (64 "
                             f"hex digits); pass the digest `dlrm-app export` printed for {path}")
        source = "--expect-sha256"
    elif sidecar.is_file():
        expected = _read_digest(sidecar, path)
        source = str(sidecar)
    else:
        return ArtifactCheck(None, f"not verified: no {DIGEST_SUFFIX} beside it and no "
                                   f"--expect-sha256")
    actual = sha256_file(path)
    if actual != expected:
        raise ValueError(
            f"{path}: sha256 {actual} differs from {expected} ({source}), so it was not loaded "
            f"(a damaged or replaced file, or another file's digest); export it again "
            f"(`dlrm-app export`), or pass --expect-sha256 with the digest its export recorded")
    return ArtifactCheck(actual, f"sha256 {actual} matches {source}")


def _read_digest(sidecar: Path, artifact: Path) -> str:
    """The digest of a ``sha256sum`` line (``HEX  name`` or ``HEX *name``); the name in it is
    not compared (a renamed pair still checks)."""
    try:
        fields = sidecar.read_text(errors="replace").split()
    except OSError as e:
        raise ValueError(f"{sidecar}: cannot be read ({e.strerror}); fix its permissions, or "
                         f"pass --expect-sha256") from None
    first = fields[0] if fields else ""
    if not _HEX.fullmatch(first.lower()):
        raise ValueError(f"{sidecar}: starts with {first[:80]!r}, not the sha256 (64 hex "
                         f"digits) of {artifact.name}; export the model again, or pass "
                         f"--expect-sha256 with the digest its export recorded")
    return first.lower()


def _is_pt2(path: Path) -> bool:
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as z:
        return any(n.endswith("/archive_format") or n == "archive_format" for n in z.namelist())


def _check_version(path: Path, meta: dict[str, Any]) -> dict[str, Any]:
    if meta.get("format_version") != ARTIFACT_FORMAT_VERSION:
        raise ValueError(f"{path}: artifact format {meta.get('format_version')}, this reader "
                         f"understands {ARTIFACT_FORMAT_VERSION}; re-export it")
    return meta


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of a .pt2 artifact (read from the zip; nothing is loaded)."""
    path = Path(path)
    with zipfile.ZipFile(path) as z:
        names = [n for n in z.namelist() if n.split("/", 1)[-1] == f"extra/{MANIFEST_FILE}"]
        if not names:
            raise ValueError(f"{path}: has no {MANIFEST_FILE}; it was not written by "
                             f"`dlrm-app export`")
        return _check_version(path, json.loads(z.read(names[0])))


def _load_pt2(path: Path) -> tuple[CompiledArtifact, dict[str, Any]]:
    from torch.export.pt2_archive._package import load_pt2

    meta = read_manifest(path)
    if meta.get("needs_fbgemm") and not fbgemm_available():
        raise ValueError(f"{path}: its lookups use FBGEMM's op, and fbgemm_gpu does not load "
                         f"here; install it, or re-export with `dlrm-app export --lookup torch`")
    # the compiled programs check their inputs' shapes only when this is set at the first call
    os.environ.setdefault("AOTI_RUNTIME_CHECK_INPUTS", "1")
    try:
        contents = load_pt2(str(path))
    except (RuntimeError, OSError, KeyError) as e:
        raise ValueError(f"{path}: not a loadable .pt2 model ({str(e).splitlines()[0][:200]}); "
                         f"re-export it with `dlrm-app export`") from None
    runners = contents.aoti_runners
    if MODEL_PROGRAM not in runners or (meta["raw_input"] and ENCODE_PROGRAM not in runners):
        raise ValueError(f"{path}: lacks the programs {sorted(meta.get('programs', {}))} its "
                         f"manifest names; re-export it with `dlrm-app export`")
    return CompiledArtifact(runners[MODEL_PROGRAM], runners.get(ENCODE_PROGRAM), meta), meta


def _load_torchscript(path: Path) -> tuple[torch.jit.ScriptModule, dict[str, Any]]:
    import warnings

    extra = {METADATA_FILE: ""}
    fbgemm_available()  # registers FBGEMM's ops (the quantized lookup) before deserializing
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit's notice
            model = torch.jit.load(str(path), map_location="cpu", _extra_files=extra)
    except RuntimeError as e:
        raise ValueError(f"{path}: not a loadable exported model ({str(e).splitlines()[0]}); "
                         f"re-export it with `dlrm-app export`") from None
    if not extra[METADATA_FILE]:
        raise ValueError(f"{path}: has no {METADATA_FILE}; it was not written by "
                         f"`dlrm-app export`")
    meta = _check_version(path, json.loads(extra[METADATA_FILE]))
    meta.setdefault("format", "torchscript")
    model.eval()
    return model, meta


class CompiledArtifact:
    """A .pt2 artifact's compiled programs behind the TorchScript artifact's methods, with the
    shape checks the compiled programs leave out (a ``ValueError`` naming the input)."""

    def __init__(self, model: Any, encoder: Any, meta: dict[str, Any]) -> None:
        self._model = model
        self._encoder = encoder
        self.num_dense = len(meta["dense_features"])
        self.num_sparse = len(meta["sparse_features"])

    def eval(self) -> CompiledArtifact:
        return self

    @property
    def programs(self) -> dict[str, Any]:
        """The compiled programs by name (``model``, and ``encode`` where there is one)."""
        return {MODEL_PROGRAM: self._model,
                **({ENCODE_PROGRAM: self._encoder} if self._encoder is not None else {})}

    def _rows(self, dense: Tensor, name: str) -> int:
        if dense.dim() != 2 or dense.size(1) != self.num_dense:
            raise ValueError(f"{name} must be [B, {self.num_dense}], got {list(dense.shape)}")
        if dense.size(0) > MAX_BATCH:
            raise ValueError(f"{name}: {dense.size(0)} rows, more than the {MAX_BATCH} a call "
                             f"takes; split the batch")
        return dense.size(0)

    def forward(self, dense: Tensor, values: Tensor, offsets: Tensor) -> Tensor:
        batch = self._rows(dense, "dense")
        if values.dim() != 1 or offsets.dim() != 1:
            raise ValueError(f"values and offsets must be 1-D, got {list(values.shape)} and "
                             f"{list(offsets.shape)}")
        if offsets.numel() != self.num_sparse * batch + 1:
            raise ValueError(f"offsets must have num_sparse * B + 1 = "
                             f"{self.num_sparse * batch + 1} entries, got {offsets.numel()}")
        if batch == 0:
            return torch.zeros(0)
        return self._model(dense.to(torch.float32).contiguous(),
                           values.to(torch.int64).contiguous(),
                           offsets.to(torch.int64).contiguous())

    __call__ = forward

    def encode(self, dense_raw: Tensor, cat_raw: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if self._encoder is None:
            raise ValueError("this model has no raw-row encoder (its dataset has no raw "
                             "format); send encoded inputs")
        batch = self._rows(dense_raw, "dense_raw")
        if cat_raw.dim() != 2 or cat_raw.size(0) != batch or cat_raw.size(1) != self.num_sparse:
            raise ValueError(f"cat_raw must be [B, {self.num_sparse}], got "
                             f"{list(cat_raw.shape)}")
        if batch == 0:
            return (torch.zeros(0, self.num_dense), torch.zeros(0, dtype=torch.int64),
                    torch.zeros(1, dtype=torch.int64))
        return tuple(self._encoder(dense_raw.to(torch.float32).contiguous(),
                                   cat_raw.to(torch.int64).contiguous()))

    def predict_raw(self, dense_raw: Tensor, cat_raw: Tensor) -> Tensor:
        dense, values, offsets = self.encode(dense_raw, cat_raw)
        if dense.size(0) == 0:
            return torch.zeros(0)
        return self._model(dense, values, offsets)
