"""``dlrm-app export``: a trained checkpoint -> one self-contained TorchScript file.

    dlrm-app export runs/a --out model.pt --dtype int8

Steps: rebuild the run's DLRM unsharded on CPU, load the checkpoint into it (DCP gathers the
sharded tables), quantize the tables (``recsys_core.inference``: FBGEMM's int-n-bit TBE layout,
INT8 / INT4 / FP16, or FP32 unchanged), then script :class:`ExportedDLRM`: the dense arch,
interaction and over arch as they are (optionally dynamic-int8 linears), the tables as one
``QuantTBEBag``, and the dataset's preprocessing as tensors (hash moduli or the training
vocabulary). The archive's ``metadata.json`` names the features and table sizes. The contract
(methods, input layout, metadata keys) is documented in :mod:`dlrm_app.artifact`; loading needs
torch, plus ``fbgemm_gpu`` when the tables were packed for FBGEMM's op.
"""

from __future__ import annotations

import importlib.metadata
import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from dlrm_app.artifact import ARTIFACT_FORMAT_VERSION, METADATA_FILE
from dlrm_app.checkpoint import resolve_run, verify_checkpoint
from dlrm_app.config import TrainConfig
from dlrm_app.data.criteo.vocabulary import VOCABULARY_FILE
from dlrm_app.data.integrity import verify_file
from dlrm_app.data.schema import DatasetKind, DatasetSpec
from dlrm_app.model import DLRM, build_dlrm
from recsys_core.distributed import checkpoint as dcp_checkpoint
from recsys_core.inference import QuantEmbeddingBagCollection, quantize_inference_model
from recsys_core.modules.embedding_configs import DataType

DTYPES = {"fp32": DataType.FP32, "fp16": DataType.FP16, "int8": DataType.INT8,
          "int4": DataType.INT4}


class ExportedDLRM(nn.Module):
    """The scripted serving model (see :mod:`dlrm_app.artifact` for the methods' contract)."""

    def __init__(self, model: DLRM, num_dense: int, moduli: Tensor, vocab_values: Tensor,
                 vocab_offsets: Tensor, use_vocabulary: bool, log_transform: bool) -> None:
        super().__init__()
        ebc = model.sparse_arch.embedding_bag_collection
        if not isinstance(ebc, QuantEmbeddingBagCollection):
            raise TypeError("quantize the model's embedding collection before exporting")
        self.tbe = ebc.tbe
        self.dense_arch = model.dense_arch
        self.inter_arch = model.inter_arch
        self.over_arch = model.over_arch
        self.num_dense = num_dense
        self.num_sparse = len(model.sparse_arch.feature_names)
        self.embedding_dim = model.sparse_arch.embedding_dim
        self.use_vocabulary = use_vocabulary
        self.log_transform = log_transform
        self.register_buffer("moduli", moduli)
        self.register_buffer("vocab_values", vocab_values)
        self.register_buffer("vocab_offsets", vocab_offsets)

    def forward(self, dense: Tensor, values: Tensor, offsets: Tensor) -> Tensor:
        batch = dense.size(0)
        if dense.dim() != 2 or dense.size(1) != self.num_dense:
            raise ValueError(f"dense must be [B, {self.num_dense}], got {list(dense.shape)}")
        if offsets.numel() != self.num_sparse * batch + 1:
            raise ValueError(f"offsets must have num_sparse * B + 1 = "
                             f"{self.num_sparse * batch + 1} entries, got {offsets.numel()}")
        pooled = self.tbe(values, offsets)
        sparse = pooled.view(batch, self.num_sparse, self.embedding_dim)
        logits = self.over_arch(self.inter_arch(self.dense_arch(dense), sparse))
        return torch.sigmoid(logits.squeeze(1))

    @torch.jit.export
    def encode(self, dense_raw: Tensor, cat_raw: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        batch = dense_raw.size(0)
        if dense_raw.dim() != 2 or dense_raw.size(1) != self.num_dense:
            raise ValueError(f"dense_raw must be [B, {self.num_dense}], got "
                             f"{list(dense_raw.shape)}")
        if cat_raw.dim() != 2 or cat_raw.size(0) != batch or cat_raw.size(1) != self.num_sparse:
            raise ValueError(f"cat_raw must be [B, {self.num_sparse}], got {list(cat_raw.shape)}")
        if self.log_transform:
            x = torch.nan_to_num(dense_raw.to(torch.float64), nan=0.0).clamp(min=0.0)
            dense = torch.log1p(x).to(torch.float32)
        else:
            dense = dense_raw.to(torch.float32)
        cat = cat_raw.to(torch.int64)
        if bool((cat < 0).any()):
            raise ValueError("categorical raw values must be >= 0 (missing is 0)")
        columns: list[Tensor] = []
        for k in range(self.num_sparse):
            raw = cat[:, k]
            if self.use_vocabulary:
                start = int(self.vocab_offsets[k])
                end = int(self.vocab_offsets[k + 1])
                vocab = self.vocab_values[start:end]
                if end > start:
                    pos = torch.searchsorted(vocab, raw)
                    hit = vocab[pos.clamp(max=end - start - 1)] == raw
                    columns.append(torch.where(hit, pos + 1, torch.zeros_like(pos)))
                else:
                    columns.append(torch.zeros_like(raw))
            else:
                modulus = int(self.moduli[k])
                if modulus > 0:
                    columns.append(torch.remainder(raw, modulus))
                else:  # already encoded ids: check the range
                    if bool((raw >= -modulus).any()):
                        raise ValueError(f"feature {k}: id outside [0, {-modulus})")
                    columns.append(raw)
        values = torch.stack(columns, dim=0).reshape(-1)  # key-major
        offsets = torch.arange(self.num_sparse * batch + 1, dtype=torch.int64)
        return dense, values, offsets

    @torch.jit.export
    def predict_raw(self, dense_raw: Tensor, cat_raw: Tensor) -> Tensor:
        dense, values, offsets = self.encode(dense_raw, cat_raw)
        return self.forward(dense, values, offsets)


def load_unsharded(run: Path, checkpoint: str | Path | None = None) -> tuple[DLRM, TrainConfig,
                                                                        DatasetSpec, Path]:
    """The run's DLRM on CPU, unsharded, with the checkpoint's weights (single process)."""
    config, path = resolve_run(run, checkpoint)
    spec = DatasetSpec.load(config.data)
    model = build_dlrm(spec, config.model, device="cpu")
    verify_checkpoint(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's "assuming a single process" notice
        dcp_checkpoint.load(str(path), model=model)
    model.eval()
    return model, config, spec, path


def _preprocessing_tensors(spec: DatasetSpec, data_dir: Path
                           ) -> tuple[Tensor, Tensor, Tensor, bool, bool, bool]:
    """(moduli, vocab values, vocab offsets, use_vocabulary, log_transform, raw_input)."""
    sizes = [f.num_embeddings for f in spec.sparse_features]
    one_hot = not any(f.multi_hot for f in spec.sparse_features)
    empty = torch.zeros(0, dtype=torch.int64)
    no_vocab_offsets = torch.zeros(len(sizes) + 1, dtype=torch.int64)
    if spec.kind is DatasetKind.CRITEO:
        encoding = spec.parameters["encoding"]
        if encoding["mode"] == "vocabulary":
            from dlrm_app.data.criteo import load_vocabulary

            verify_file(data_dir / VOCABULARY_FILE, encoding.get("vocabulary_sha256"))
            vocab = load_vocabulary(data_dir)
            offsets = np.cumsum([0] + [len(v) for v in vocab])
            return (torch.zeros(len(sizes), dtype=torch.int64),
                    torch.from_numpy(np.concatenate(vocab).astype(np.int64)),
                    torch.from_numpy(offsets.astype(np.int64)), True, True, True)
        return (torch.tensor(sizes, dtype=torch.int64), empty, no_vocab_offsets, False, True,
                True)
    # generated / MovieLens data: inputs are already encoded; negative moduli mean "check only"
    return (-torch.tensor(sizes, dtype=torch.int64), empty, no_vocab_offsets, False, False,
            one_hot)


def export_model(run: str | Path, out: str | Path, dtype: str = "int8", *,
                 checkpoint: str | Path | None = None, quantize_dense: bool = False
                 ) -> dict[str, Any]:
    """Write the artifact for the run's (newest or given) checkpoint; returns its metadata."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    run, out = Path(run), Path(out)
    model, config, spec, path = load_unsharded(run, checkpoint)
    quantize_inference_model(model, DTYPES[dtype], quantize_dense=quantize_dense)
    ebc = model.sparse_arch.embedding_bag_collection
    if list(ebc.tbe.feature_names) != [f.name for f in spec.sparse_features]:
        raise ValueError("the quantized tables' feature order differs from the dataset's")
    moduli, vocab_values, vocab_offsets, use_vocab, log_transform, raw_input = \
        _preprocessing_tensors(spec, Path(config.data))
    exported = ExportedDLRM(model, len(spec.dense_features), moduli, vocab_values,
                            vocab_offsets, use_vocab, log_transform)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit's notice in 2.13
        scripted = torch.jit.script(exported)
    meta = {
        "format_version": ARTIFACT_FORMAT_VERSION,
        "dataset": spec.name,
        "kind": spec.kind.value,
        "dense_features": list(spec.dense_features),
        "sparse_features": [{"name": f.name, "num_embeddings": f.num_embeddings,
                             "multi_hot": f.multi_hot} for f in spec.sparse_features],
        "raw_input": raw_input,
        "raw_format": "criteo_tsv" if spec.kind is DatasetKind.CRITEO else None,
        "embedding_dtype": dtype,
        "dense_dtype": "int8_dynamic" if quantize_dense else "fp32",
        "needs_fbgemm": ebc.kernel_backend().value == "fbgemm",
        "preprocessing": {k: spec.parameters.get(k) for k in
                          ("dense_transform", "categorical_transform", "encoding")
                          if k in spec.parameters},
        "checkpoint": str(path),
        "created_by": f"dlrm_app {importlib.metadata.version('recsys-dlrm')}",
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.save(scripted, str(tmp), _extra_files={METADATA_FILE: json.dumps(meta)})
    tmp.replace(out)
    return {**meta, "path": str(out), "bytes": out.stat().st_size}
