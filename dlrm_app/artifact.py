"""The exported model artifact: one TorchScript file a serving process loads with torch (and
FBGEMM, for quantized tables) only.

File: ``torch.jit.save`` archive with an extra file ``metadata.json``. Load it with::

    import torch, json
    import fbgemm_gpu  # registers the quantized lookup op (not needed for "torch" artifacts)
    extra = {"metadata.json": ""}
    model = torch.jit.load("model.pt", _extra_files=extra)
    meta = json.loads(extra["metadata.json"])

The scripted module's methods (``B`` rows, ``D`` dense and ``F`` sparse features, in the
metadata's order):

``forward(dense [B, D] float32, values [N] int64, offsets [F*B + 1] int64) -> [B] float32``
    Probabilities from *encoded* inputs: dense values already transformed, ids already in
    ``[0, num_embeddings)``, bags key-major (feature 0's B bags, then feature 1's, ...) as
    in a KeyedJaggedTensor's ``values()`` / ``offsets()``.
``encode(dense_raw [B, D] float32, cat_raw [B, F] int64) -> (dense, values, offsets)``
    The dataset's preprocessing for one-hot raw rows (``metadata["raw_input"]`` is true): dense
    NaN (missing) -> 0, negatives -> 0, ``log(x + 1)``; categorical raw integers (Criteo: the
    parsed hex value; missing -> 0) hashed modulo the table size or mapped through the
    training vocabulary (rare / unseen -> 0). For datasets without a raw format it checks
    ranges and passes values through.
``predict_raw(dense_raw, cat_raw) -> [B] float32``
    ``forward(*encode(dense_raw, cat_raw))``.

Metadata keys: ``format_version``, ``dataset`` (name), ``kind``, ``dense_features``,
``sparse_features`` (``name``, ``num_embeddings``, ``multi_hot``), ``raw_input`` (bool),
``raw_format`` (``"criteo_tsv"`` or null), ``embedding_dtype`` (``fp32``, ``fp16``, ``int8``,
``int4``), ``needs_fbgemm`` (bool), ``preprocessing`` (the dataset's transform parameters),
``checkpoint``, ``created_by``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from recsys_core.kernels import fbgemm_available

ARTIFACT_FORMAT_VERSION = 1
METADATA_FILE = "metadata.json"


def load_artifact(path: str | Path) -> tuple[torch.jit.ScriptModule, dict[str, Any]]:
    """(scripted model, metadata) of an exported artifact; loads FBGEMM's ops when needed."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such model file; create one with `dlrm-app export`")
    extra = {METADATA_FILE: ""}
    fbgemm_available()  # registers FBGEMM's ops (the quantized lookup) before deserializing
    try:
        model = torch.jit.load(str(path), map_location="cpu", _extra_files=extra)
    except RuntimeError as e:
        raise ValueError(f"{path}: not a loadable exported model ({str(e).splitlines()[0]}); "
                         f"re-export it with `dlrm-app export`") from None
    if not extra[METADATA_FILE]:
        raise ValueError(f"{path}: has no {METADATA_FILE}; it was not written by "
                         f"`dlrm-app export`")
    meta = json.loads(extra[METADATA_FILE])
    if meta.get("format_version") != ARTIFACT_FORMAT_VERSION:
        raise ValueError(f"{path}: artifact format {meta.get('format_version')}, this reader "
                         f"understands {ARTIFACT_FORMAT_VERSION}; re-export it")
    model.eval()
    return model, meta
