"""``dlrm-app export``: a trained checkpoint -> one self-contained serving artifact.

    dlrm-app export runs/a --out model.pt2 --dtype int8                 # the default: .pt2
    dlrm-app export runs/a --out model.pt --format torchscript          # for older stacks

Steps: rebuild the run's DLRM unsharded on CPU, load the checkpoint into it (DCP gathers the
sharded tables), quantize the tables (``recsys_core.inference``: FBGEMM's int-n-bit layout,
INT8 / INT4 / FP16, or FP32 unchanged), then

- ``pt2`` (default): ``torch.export`` the predictor (quantized lookups, dense arch, interaction,
  over arch; :mod:`dlrm_app.serving.program`) and, for datasets with a raw row format, the
  preprocessing, each with a dynamic batch dimension; AOTInductor compiles both for CPU into one
  ``.pt2`` package (models ``model`` and ``encode``) with ``manifest.json`` beside them.
- ``torchscript``: script :class:`ExportedDLRM` (the same computation, optionally with
  dynamic-int8 linears) into one file with ``metadata.json``. TorchScript is deprecated in
  PyTorch; this format stays for stacks that cannot load ``.pt2`` yet.

The contract (entry points, input layout, manifest keys) is documented in
:mod:`dlrm_app.serving.artifact`; loading needs torch, plus ``fbgemm_gpu`` when the lookups use FBGEMM's
op (``needs_fbgemm`` in the manifest).

The artifact's sha256 is written beside it (``model.pt2.sha256``, ``sha256sum`` format), into the
returned manifest (``sha256``) and, as an ``export`` event, into the run's ``metrics.jsonl``;
``dlrm-app serve`` checks it before loading the artifact.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import shutil
import sys
import time
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from dlrm_app.data.criteo.vocabulary import GROWN_VOCABULARY, vocabulary_for_tables
from dlrm_app.data.schema import DatasetKind, DatasetSpec
from dlrm_app.id_map import FrozenIdMap, freeze_raw_ids
from dlrm_app.model import DLRM, WidePart, build_dlrm
from dlrm_app.serving.artifact import (
    ARTIFACT_FORMAT_VERSION,
    ENCODE_PROGRAM,
    MANIFEST_FILE,
    MAX_BATCH,
    METADATA_FILE,
    MODEL_PROGRAM,
    PROGRAM_SIGNATURES,
    digest_path,
    read_manifest,
    write_digest,
)
from dlrm_app.serving.program import LOOKUPS, EncodedPredictor, RawEncoder, WideLookup
from dlrm_app.serving.reproducible import (
    ARCHIVE_FILE,
    normalized_sources,
    settle_serialization_id,
)
from dlrm_app.serving.weights import (
    constant_specs,
    program_constants,
    program_fingerprint,
    weights_path,
    write_weights,
)
from dlrm_app.training.checkpoint import (
    BEST,
    best_checkpoint,
    latest_checkpoint,
    resolve_run,
    verify_checkpoint,
)
from dlrm_app.training.config import TrainConfig
from dlrm_app.training.tables import run_model_spec
from recsys_core.distributed import checkpoint as dcp_checkpoint
from recsys_core.inference import QuantEmbeddingBagCollection, quantize_inference_model
from recsys_core.modules.embedding_configs import DataType

DTYPES = {"fp32": DataType.FP32, "fp16": DataType.FP16, "int8": DataType.INT8,
          "int4": DataType.INT4}


class ExportedDLRM(nn.Module):
    """The scripted serving model (see :mod:`dlrm_app.serving.artifact` for the methods'
    contract). Raw rows are encoded by the same ``RawEncoder`` the ``.pt2``'s encode program
    is compiled from."""

    def __init__(self, model: DLRM, encoder: RawEncoder, id_map: FrozenIdMap) -> None:
        super().__init__()
        self.id_map = id_map
        ebc = model.sparse_arch.embedding_bag_collection
        if not isinstance(ebc, QuantEmbeddingBagCollection):
            raise TypeError("quantize the model's embedding collection before exporting")
        self.tbe = ebc.tbe
        self.dense_arch = model.dense_arch
        self.inter_arch = model.inter_arch
        self.over_arch = model.over_arch
        self.wide = model.wide  # a WideLookup (see serving_form) or None
        self.encoder = encoder
        self.num_dense = encoder.num_dense
        self.num_sparse = len(model.sparse_arch.feature_names)
        self.embedding_dim = model.sparse_arch.embedding_dim

    def forward(self, dense: Tensor, values: Tensor, offsets: Tensor) -> Tensor:
        batch = dense.size(0)
        if dense.dim() != 2 or dense.size(1) != self.num_dense:
            raise ValueError(f"dense must be [B, {self.num_dense}], got {list(dense.shape)}")
        if offsets.numel() != self.num_sparse * batch + 1:
            raise ValueError(f"offsets must have num_sparse * B + 1 = "
                             f"{self.num_sparse * batch + 1} entries, got {offsets.numel()}")
        ids = self.id_map(values, offsets, batch)
        pooled = self.tbe(ids, offsets)
        sparse = pooled.view(batch, self.num_sparse, self.embedding_dim)
        logits = self.over_arch(self.inter_arch(self.dense_arch(dense), sparse))
        if self.wide is not None:
            logits = logits + self.wide(dense, ids, offsets, batch)
        return torch.sigmoid(logits.squeeze(1))

    @torch.jit.export
    def encode(self, dense_raw: Tensor, cat_raw: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        batch = dense_raw.size(0)
        if dense_raw.dim() != 2 or dense_raw.size(1) != self.num_dense:
            raise ValueError(f"dense_raw must be [B, {self.num_dense}], got "
                             f"{list(dense_raw.shape)}")
        if cat_raw.dim() != 2 or cat_raw.size(0) != batch or cat_raw.size(1) != self.num_sparse:
            raise ValueError(f"cat_raw must be [B, {self.num_sparse}], got {list(cat_raw.shape)}")
        # the encoder's own checks are asynchronous asserts, which TorchScript drops
        cat = cat_raw.to(torch.int64)
        if bool((cat < 0).any()):
            raise ValueError("categorical raw values must be >= 0 (missing is 0)")
        if not self.encoder.use_vocabulary and bool((cat >= self.encoder.limit).any()):
            raise ValueError("an already-encoded id lies outside [0, num_embeddings)")
        return self.encoder(dense_raw, cat)

    @torch.jit.export
    def predict_raw(self, dense_raw: Tensor, cat_raw: Tensor) -> Tensor:
        dense, values, offsets = self.encode(dense_raw, cat_raw)
        return self.forward(dense, values, offsets)


def serving_form(model: DLRM, spec: DatasetSpec) -> None:
    """Replace the model's trained wide part (if any) by its float32 serving form, a
    :class:`WideLookup` over the dataset's features, before the tables are quantized (its
    dim-1 tables stay float32; quantizing one value per row would save nothing)."""
    if isinstance(model.wide, WidePart):
        model.wide = WideLookup(model.wide, [f.name for f in spec.sparse_features])


def load_unsharded(run: Path, checkpoint: str | Path | None = None) -> tuple[DLRM, TrainConfig,
                                                                        DatasetSpec, Path]:
    """The run's DLRM on CPU, unsharded, with the checkpoint's weights (single process), and
    its dataset's spec with the model's table sizes (those of the run's start,
    ``dlrm_app.training.tables``)."""
    config, path = resolve_run(run, checkpoint)
    spec = run_model_spec(DatasetSpec.load(config.data), Path(run))
    model = build_dlrm(spec, config.model, device="cpu")
    verify_checkpoint(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's "assuming a single process" notice
        dcp_checkpoint.load(str(path), model=model)
    model.eval()
    return model, config, spec, path


@dataclasses.dataclass(frozen=True)
class Preprocessing:
    """How raw rows become model inputs (see :class:`RawEncoder`)."""

    moduli: Tensor  # [F]: > 0 hash modulo; < 0 already an id below -modulus
    vocabulary: list[Tensor] | None  # per feature, sorted raw values with their own row
    log_transform: bool
    raw_input: bool  # one-hot rows that ``encode`` / ``predict_raw`` accept
    rows: list[Tensor] | None = None  # per feature, the vocabulary values' rows (None: i + 1)
    encoding: dict[str, Any] | None = None  # the dataset's id encoding as the program serves it
    vocabulary_source: dict[str, Any] | None = None  # the vocabulary file, ids left out


def dataset_preprocessing(spec: DatasetSpec, data_dir: Path) -> Preprocessing:
    """The preprocessing of ``spec``'s dataset (in ``data_dir``) for a model whose tables have
    ``spec``'s sizes (a run's may be smaller than its grown dataset's: ids whose
    vocabulary row lies past them read row 0, as they did in training)."""
    sizes = [f.num_embeddings for f in spec.sparse_features]
    one_hot = not any(f.multi_hot for f in spec.sparse_features)
    if spec.kind is DatasetKind.CRITEO:
        encoding = spec.encoding
        if encoding is None:
            raise ValueError(f"dataset '{spec.name}' ({data_dir}) records no id encoding "
                             "(preprocessed by an old release): preprocess it again")
        if encoding["mode"] == "vocabulary":
            served = vocabulary_for_tables(data_dir, sizes, encoding)
            vocab = [torch.from_numpy(np.asarray(v).astype(np.int64)) for v in served.ids]
            rows = None if served.rows is None else \
                [torch.from_numpy(np.asarray(r).astype(np.int64)) for r in served.rows]
            # the program maps ids as the model's tables read them: what the dataset's growth
            # since (new rows, the grown file) changes does not change the program
            program_encoding = {k: v for k, v in encoding.items() if k != GROWN_VOCABULARY}
            program_encoding["num_embeddings"] = sizes
            source = {"file": served.file, "ids": sum(len(v) for v in served.ids),
                      "ids_past_tables": sum(served.past_tables)}
            return Preprocessing(torch.zeros(len(sizes), dtype=torch.int64), vocab, True, True,
                                 rows, program_encoding, source)
        return Preprocessing(torch.tensor(sizes, dtype=torch.int64), None, True, True,
                             encoding=dict(encoding))
    # generated / MovieLens data: inputs are already encoded; negative moduli mean "check only"
    return Preprocessing(-torch.tensor(sizes, dtype=torch.int64), None, False, one_hot,
                         encoding=None if spec.encoding is None else dict(spec.encoding))


Progress = Callable[[str], None]
"""Told each stage of an export as it starts (a .pt2 takes tens of seconds, nearly all of it
g++ compiling what AOTInductor generates: docs/serving.md measures it)."""


def _ignore(stage: str) -> None:
    pass


def stage_printer(prefix: str) -> Progress:
    """A ``Progress`` that prints ``<prefix>: [seconds since the first stage] <stage>`` lines
    to stderr (stdout stays for the result)."""
    start = time.perf_counter()

    def show(stage: str) -> None:
        print(f"{prefix}: [{time.perf_counter() - start:5.1f} s] {stage}", file=sys.stderr,
              flush=True)
    return show


FORMATS = ("pt2", "torchscript")
LOOKUP_CHOICES = ("auto",) + LOOKUPS


def _check_chosen(run: Path, checkpoint: str | Path | None) -> None:
    """The default (``best``) needs a checkpoint that validation chose: a run whose
    validations gave no AUC (a split of one label) has none, and shipping its newest
    checkpoint must be asked for."""
    if str(checkpoint or BEST) != BEST or not (run / "config.json").is_file():
        return
    root = run / "checkpoints"
    if best_checkpoint(root) is None and latest_checkpoint(root) is not None:
        raise ValueError(
            f"{run}: no validation of this run gave an AUC, so no checkpoint was chosen as the "
            "best; to export the newest one anyway pass --checkpoint latest (or a step_* "
            "directory)")


def export_model(run: str | Path, out: str | Path, dtype: str = "int8", *,
                 checkpoint: str | Path | None = None, quantize_dense: bool = False,
                 fmt: str = "pt2", lookup: str = "auto", full: bool = False,
                 progress: Progress | None = None) -> dict[str, Any]:
    """Write the artifact for the run's (newest or given) checkpoint and its ``.sha256``
    beside it; returns its manifest (with ``path``, ``bytes``, ``sha256`` and ``published``),
    also recorded as an ``export`` event in the run's ``metrics.jsonl``. ``progress`` is told
    each stage as it starts.

    A ``.pt2`` whose program is the one ``out`` already holds (the same program fingerprint,
    :mod:`dlrm_app.serving.weights`) is published as its weights alone, no compile:
    ``model.weights`` (and ``.sha256``) beside ``out``, which is left as it is; the result's
    ``published`` is ``"weights"`` and its ``path`` the weights file. Otherwise, or with
    ``full``, the program is compiled and ``out`` replaced (``published``: ``"program"``), and
    the weights published for the previous program beside it are removed first."""
    progress = progress or _ignore
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if fmt not in FORMATS:
        raise ValueError(f"--format must be one of {FORMATS}, got {fmt!r}")
    if lookup not in LOOKUP_CHOICES:
        raise ValueError(f"--lookup must be one of {LOOKUP_CHOICES}, got {lookup!r}")
    run, out = Path(run), Path(out)
    _check_chosen(run, checkpoint)
    if fmt == "pt2":
        if out.suffix != ".pt2":
            raise ValueError(f"--out {out}: a .pt2 artifact's name must end in .pt2 (for a "
                             f"TorchScript file add --format torchscript)")
        if quantize_dense:
            raise ValueError("--quantize-dense (dynamic int8 linears) exists for --format "
                             "torchscript only; drop it for a .pt2 export")
    progress(f"loading the {checkpoint or 'best'} checkpoint of {run} (unsharded, CPU)")
    model, config, spec, path = load_unsharded(run, checkpoint)
    # raw ids (--id-mapping zch): a plain model plus the frozen mapping of the trained ids
    model, id_map = freeze_raw_ids(model, spec, config.model)
    serving_form(model, spec)
    progress(f"quantizing the tables of {path.name} to {dtype}"
             + (" and the linear layers to int8" if quantize_dense else ""))
    quantize_inference_model(model, DTYPES[dtype], quantize_dense=quantize_dense)
    ebc = model.sparse_arch.embedding_bag_collection
    if list(ebc.tbe.feature_names) != [f.name for f in spec.sparse_features]:
        raise ValueError("the quantized tables' feature order differs from the dataset's")
    prep = dataset_preprocessing(spec, Path(config.data))
    fbgemm = ebc.kernel_backend().value == "fbgemm"
    if lookup == "auto":
        lookup = "fbgemm" if fbgemm else "torch"
    elif lookup == "fbgemm" and not fbgemm:
        raise ValueError("--lookup fbgemm needs fbgemm_gpu, which does not load here; use "
                         "--lookup torch (same numerics)")
    meta = {
        "format_version": ARTIFACT_FORMAT_VERSION,
        "format": fmt,
        "dataset": spec.name,
        "kind": spec.kind.value,
        "dense_features": list(spec.dense_features),
        "sparse_features": [{"name": f.name, "num_embeddings": f.num_embeddings,
                             "multi_hot": f.multi_hot, **({"raw_ids": True} if f.raw_ids else {})}
                            for f in spec.sparse_features],
        "raw_input": prep.raw_input,
        "raw_format": "criteo_tsv" if spec.kind is DatasetKind.CRITEO else None,
        "embedding_dtype": dtype,
        "embedding_dim": model.sparse_arch.embedding_dim,
        "table_bytes": dict(ebc.table_bytes()),
        "dense_dtype": "int8_dynamic" if quantize_dense else "fp32",
        "needs_fbgemm": (lookup == "fbgemm") if fmt == "pt2" else fbgemm,
        "preprocessing": {k: prep.encoding if k == "encoding" else spec.parameters.get(k)
                          for k in ("dense_transform", "categorical_transform", "encoding")
                          if k in spec.parameters},
        **({"vocabulary": prep.vocabulary_source} if prep.vocabulary_source else {}),
        "checkpoint": str(path),
        "training": _training_summary(run, config, path),
        "created_by": f"dlrm_app {importlib.metadata.version('recsys-dlrm')}",
    }
    programs: dict[str, tuple[torch.export.ExportedProgram, tuple]] = {}
    if fmt == "pt2":
        meta["lookup"] = lookup
        programs = _export_programs(model, spec, prep, lookup, id_map, progress)
        meta["programs"] = {name: PROGRAM_SIGNATURES[name] for name in programs}
        exported = {name: program for name, (program, _) in programs.items()}
        constants = program_constants(exported)
        meta["program_fingerprint"] = program_fingerprint(exported, meta, AOTI_OPTIONS)
        meta["constants"] = constant_specs(constants)
        held = _fingerprint_at(out)
        if held == meta["program_fingerprint"] and not full:
            return _publish_weights(run, out, meta, constants, progress)
        reason = ("--full" if full else f"the program differs from the one in {out}" if held
                  else f"{out} holds no program with a fingerprint")
    else:
        reason = "TorchScript is exported in full"
    # written in a folder beside it, then moved into place: an interrupted export leaves no
    # partial file
    staging = out.parent / f".{out.name}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        if fmt == "pt2":
            _write_pt2(programs, meta, staging / out.name, progress)
            # weights published for the program being replaced would not fit the new one
            for stale in (weights_path(out), digest_path(weights_path(out))):
                stale.unlink(missing_ok=True)
        else:
            progress("scripting the model (TorchScript)")
            _write_torchscript(model, spec, prep, meta, staging / out.name, id_map)
        digest = write_digest(staging / out.name)
        # the artifact first: a crash between the renames leaves a stale .sha256 beside the
        # new file, which serve refuses (re-export), never a new digest vouching for an old file
        (staging / out.name).replace(out)
        digest_path(staging / out.name).replace(digest_path(out))
        progress(f"wrote {out} (sha256 {digest}, also in {digest_path(out).name})")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    result = {**meta, "published": "program", "why": reason, "path": str(out),
              "bytes": out.stat().st_size, "sha256": digest}
    _record_export(run, result)
    return result


def _fingerprint_at(out: Path) -> str | None:
    """The program fingerprint recorded in the .pt2 at ``out``; None when there is none (no
    file, not a .pt2, exported before fingerprints). Its digest is not checked here: the server
    checks it, and a weights file only ever loads into the program it was made for."""
    try:
        return read_manifest(out).get("program_fingerprint") if out.is_file() else None
    except (ValueError, OSError, KeyError, zipfile.BadZipFile, json.JSONDecodeError):
        return None


def _publish_weights(run: Path, out: Path, meta: dict[str, Any], constants: dict[str, Tensor],
                     progress: Progress) -> dict[str, Any]:
    """The weights of ``out``'s program from this checkpoint, written beside it."""
    target = weights_path(out)
    progress(f"the program in {out} is unchanged (fingerprint {meta['program_fingerprint'][:16]}"
             f"): writing the weights alone to {target}")
    header = {"program_fingerprint": meta["program_fingerprint"],
              **{k: meta[k] for k in ("dataset", "embedding_dtype", "checkpoint", "training",
                                      "created_by")}}
    digest = write_weights(target, constants, header)
    progress(f"wrote {target} (sha256 {digest}, also in {digest_path(target).name})")
    result = {**meta, "published": "weights", "why": "the program is unchanged",
              "path": str(target), "program": str(out),
              "bytes": target.stat().st_size, "sha256": digest}
    _record_export(run, result)
    return result


def _record_export(run: Path, result: dict[str, Any]) -> None:
    """Append an ``export`` event to the run's ``metrics.jsonl`` (one write of one line, as the
    trainer appends its own): the run then records which artifact, by digest, came of which
    checkpoint. A run directory that cannot be written keeps no record; a warning says so."""
    event = {"event": "export", "time": round(time.time(), 3),
             "path": str(Path(result["path"]).resolve()), "sha256": result["sha256"],
             **{k: result.get(k) for k in ("published", "bytes", "format", "embedding_dtype",
                                            "dense_dtype", "lookup", "checkpoint")}}
    try:
        with open(run / "metrics.jsonl", "a") as log:
            log.write(json.dumps(event) + "\n")
    except OSError as e:
        warnings.warn(f"{run / 'metrics.jsonl'}: the export's record (sha256 "
                      f"{result['sha256']}) was not appended ({e.strerror}); it is in "
                      f"{digest_path(result['path'])}", stacklevel=3)


def _training_summary(run: Path, config: TrainConfig, checkpoint: Path) -> dict[str, Any]:
    """The run, the checkpoint's step, and the validation metrics recorded at that step."""
    step = int(checkpoint.name.split("_")[-1]) if checkpoint.name.startswith("step_") else None
    metrics = None
    log = run / "metrics.jsonl"
    if step is not None and log.is_file():
        for line in log.read_text().splitlines():
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a crash
            if event.get("event") == "validation" and event.get("step") == step:
                metrics = {k: v for k, v in event.items() if k not in ("event", "step", "epoch")}
    return {"run": str(run), "step": step, "validation": metrics,
            "model": config.to_json_dict().get("model")}


def _write_torchscript(model: DLRM, spec: DatasetSpec, prep: Preprocessing,
                       meta: dict[str, Any], out: Path, id_map: FrozenIdMap | None = None
                       ) -> None:
    sizes = len(spec.sparse_features)
    encoder = RawEncoder(len(spec.dense_features), prep.moduli, prep.vocabulary,
                         prep.log_transform, prep.rows)
    exported = ExportedDLRM(model, encoder, id_map or FrozenIdMap(sizes, [None] * sizes))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit's notice in 2.13
        scripted = torch.jit.script(exported)
        torch.jit.save(scripted, str(out), _extra_files={METADATA_FILE: json.dumps(meta)})


AOTI_OPTIONS = {
    "aot_inductor.package": True,
    # torch.export traces sizes as >= 2; the programs hold for 1-row batches (and 0 values)
    # too, which AOTInductor's input check (AOTI_RUNTIME_CHECK_INPUTS=1) would refuse
    "aot_inductor.check_lowerbound": False,
    # one checkpoint, one digest, whichever process exports it: inductor would compile in the
    # exporting process's torch.get_num_threads() (train leaves torch at 1 thread, a bare export
    # at its default), serial kernels at 1. Kernels with parallel regions (as for any count
    # above 1) that read the thread count when they run (the server's --threads) instead.
    "cpp.threads": 2,
    "cpp.dynamic_threads": True,
    # every parameter and buffer stays a constant of the compiled program, replaceable when
    # weights are published alone (inductor would otherwise write 0-d and 1-d tensors of up to
    # 8 values, biases for instance, into the generated code as literals)
    "always_keep_tensor_constants": True,
}

EXAMPLE_BATCH = 3
"""Rows of the example inputs the programs are traced with (not 0 or 1, which torch.export
would specialize on)."""


def serving_programs(model: DLRM, spec: DatasetSpec, prep: Preprocessing, lookup: str,
                     id_map: FrozenIdMap | None = None
                     ) -> dict[str, tuple[nn.Module, tuple, Any]]:
    """The .pt2's programs as eager modules: ``{name: (module, example inputs, dynamic
    shapes)}`` (``model``, and ``encode`` for datasets with raw rows)."""
    from torch.export import Dim

    num_dense, num_sparse = len(spec.dense_features), len(spec.sparse_features)
    batch = Dim("batch", min=1, max=MAX_BATCH)
    num_values = Dim("num_values", min=0, max=MAX_BATCH * 1024)
    b = EXAMPLE_BATCH
    lengths = torch.ones(num_sparse * b, dtype=torch.int64)
    lengths[0] = 2  # so that the number of values is not F * B (kept a free size)
    offsets = torch.zeros(num_sparse * b + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    programs: dict[str, tuple[nn.Module, tuple, Any]] = {
        MODEL_PROGRAM: (EncodedPredictor(model, lookup, id_map),
                        (torch.zeros(b, num_dense), torch.zeros(int(offsets[-1]),
                                                                dtype=torch.int64), offsets),
                        ({0: batch}, {0: num_values}, {0: num_sparse * batch + 1})),
    }
    if prep.raw_input:
        programs[ENCODE_PROGRAM] = (
            RawEncoder(num_dense, prep.moduli, prep.vocabulary, prep.log_transform, prep.rows),
            (torch.zeros(b, num_dense), torch.zeros(b, num_sparse, dtype=torch.int64)),
            ({0: batch}, {0: batch}))
    for module, _, _ in programs.values():
        module.eval()
    return programs


def _export_programs(model: DLRM, spec: DatasetSpec, prep: Preprocessing, lookup: str,
                     id_map: FrozenIdMap | None, progress: Progress
                     ) -> dict[str, tuple[torch.export.ExportedProgram, tuple]]:
    """``torch.export`` each program: ``{name: (exported program, example inputs)}``."""
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, (module, args, dynamic) in serving_programs(model, spec, prep, lookup,
                                                               id_map).items():
            with torch.no_grad():
                progress(f"torch.export: program {name!r}")
                out[name] = torch.export.export(module, args, dynamic_shapes=dynamic), args
    return out


def _write_pt2(programs: dict[str, tuple[torch.export.ExportedProgram, tuple]],
               meta: dict[str, Any], out: Path, progress: Progress) -> None:
    """AOT-compile the exported programs, package them with the manifest into ``out`` (a
    path in a private folder: the sources are normalized beside it). The same checkpoint gives
    the same bytes whatever the inductor cache held and whatever ``out`` is named
    (:mod:`dlrm_app.serving.reproducible`)."""
    from torch.export.pt2_archive._package import package_pt2

    files: dict[str, list] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, (program, args) in programs.items():
            with torch.no_grad():
                progress(f"AOTInductor: compiling {name!r} for CPU")
                compiled = torch._inductor.aot_compile(program.module(), args,
                                                       options=AOTI_OPTIONS)
            files[name] = normalized_sources(compiled, out.parent / "sources" / name)
        progress("packaging the programs and the manifest")
        archive = out.with_name(ARCHIVE_FILE)  # the archive's top folder: "archive/"
        package_pt2(str(archive), aoti_files=files,
                    extra_files={MANIFEST_FILE: json.dumps(meta)})
    settle_serialization_id(archive)
    archive.replace(out)
