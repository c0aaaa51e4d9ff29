"""Quantized table-batched embedding bags for inference: FBGEMM's int-n-bit layout and lookup,
and a pure-torch lookup with the same numerics.

Every table is stored in one flat ``uint8`` buffer laid out exactly as FBGEMM's
``IntNBitTableBatchedEmbeddingBagsCodegen`` lays it out, so the bytes can be handed to FBGEMM's
kernel (or module) unchanged. One row per id; integer rows carry their fp16 scale and bias first::

    INT8 dim 6  | scale fp16 | bias fp16 | q0 | q1 | q2 | q3 | q4 | q5 |      10 bytes
    INT4 dim 6  | scale fp16 | bias fp16 | q1 q0 | q3 q2 | q5 q4 |             7 bytes
    INT2 dim 8  | scale fp16 | bias fp16 | q3 q2 q1 q0 | q7 q6 q5 q4 |         6 bytes
    FP16 dim 6  | h0 | h1 | h2 | h3 | h4 | h5 |                              12 bytes

    value = scale * q + bias      (q unsigned, 0 .. 2^bits - 1; in a packed byte the lower
                                   index sits in the low bits: byte = q0 | q1 << 4)

Rows are padded to a multiple of ``row_alignment`` bytes (FBGEMM uses 1 on CPU, 16 on CUDA) and
each table starts on a 128-byte boundary. Quantization is FBGEMM's own, bit for bit
(``FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf``): per row, ``bias = fp16(min)``,
``scale = fp16((max - bias) / (2^bits - 1))`` (1 for a constant row),
``q = clamp(round_half_even((x - bias) / scale), 0, 2^bits - 1)``.

Error of one dequantized value (``x`` in a row with minimum ``m``; ``s* = (max - bias) / n``,
``n = 2^bits - 1``)::

    |x - x_hat| <= max(scale / 2, n * (s* - scale)+, (bias - m)+) + 2^-21 (|bias| + n * scale)

The second term is the clamp at the top of a row when fp16 rounded the scale down, the third
the values below a bias that fp16 rounded up, the last fp32 arithmetic. As fp16 rounding is
relative 2^-11 (normal range), for typical rows this is ``max(scale / 2, 2^-11 |m|)``: INT8 with
``n * 2^-11 < 1/8`` keeps the clamp term under ``scale / 2``. Pooling adds up the errors of the
pooled rows, times ``|weight|`` (divided by the length for MEAN). FP16 tables:
``|x - x_hat| <= 2^-11 |x|`` (``2^-25`` below fp16's normal range).
:func:`row_error_bound` evaluates the bound from the stored row.

The lookup functions below are TorchScript-compatible (plain tensors, ints and lists), so a
scripted module that calls them loads with torch (+ ``fbgemm_gpu`` for the FBGEMM one) only.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum, unique

import torch
from torch import Tensor, nn

from recsys_core.kernels._fbgemm import fbgemm_status, fbgemm_supports, tbe_training_module

SCALE_BIAS_BYTES = 4  # fp16 scale + fp16 bias at the start of each integer row
TABLE_ALIGNMENT = 128  # FBGEMM starts every table on a cache line
FP16_MAX = 65504.0


@unique
class WeightType(IntEnum):
    """Storage type of a quantized table; the values are FBGEMM's ``SparseType.as_int()``."""

    FP32 = 0
    FP16 = 1
    INT8 = 2
    INT4 = 3
    INT2 = 4

    @property
    def bits(self) -> int:
        return (32, 16, 8, 4, 2)[self.value]

    @property
    def is_int(self) -> bool:
        return self.value >= WeightType.INT8.value


# FBGEMM's EmbeddingLocation values for ``weights_placements``.
PLACEMENT_DEVICE = 0
PLACEMENT_HOST = 3


def default_row_alignment(device: torch.device) -> int:
    """FBGEMM's default: rows unpadded on CPU, 16-byte rows on CUDA."""
    return 1 if device.type == "cpu" else 16


def unpadded_row_bytes(dim: int, weight_type: WeightType) -> int:
    if weight_type.is_int:
        return dim * weight_type.bits // 8 + SCALE_BIAS_BYTES
    return dim * weight_type.bits // 8


def row_bytes(dim: int, weight_type: WeightType, row_alignment: int) -> int:
    return _round_up(unpadded_row_bytes(dim, weight_type), row_alignment)


@dataclass(frozen=True)
class QuantTableSpec:
    """One quantized table.

    Attributes:
        name: table name (used in error messages).
        rows: number of rows.
        dim: embedding dimension.
        weight_type: storage type.
    """

    name: str
    rows: int
    dim: int
    weight_type: WeightType

    def __post_init__(self) -> None:
        if not isinstance(self.weight_type, WeightType):
            raise ValueError(f"table {self.name!r}: weight_type must be a WeightType")
        if self.rows <= 0 or self.dim <= 0:
            raise ValueError(
                f"table {self.name!r}: rows and dim must be > 0, got {self.rows} x {self.dim}"
            )
        per_byte = 8 // self.weight_type.bits if self.weight_type.is_int else 1
        if self.dim % per_byte:
            raise ValueError(
                f"table {self.name!r}: {self.weight_type.name} packs {per_byte} values per byte, "
                f"so embedding_dim must be a multiple of {per_byte}; got {self.dim}. Quantize this "
                "table to INT8 or FP16 instead (or change its embedding_dim)"
            )


def table_offsets(specs: Sequence[QuantTableSpec], row_alignment: int) -> list[int]:
    """Byte offset of each table in the flat buffer, then the buffer size (as FBGEMM on HOST)."""
    out = [0]
    for s in specs:
        size = s.rows * row_bytes(s.dim, s.weight_type, row_alignment)
        out.append(out[-1] + _round_up(size, TABLE_ALIGNMENT))
    return out


def quantize_rows(weight: Tensor, weight_type: WeightType, name: str = "") -> Tensor:
    """``[rows, dim]`` float weights -> ``[rows, unpadded_row_bytes]`` uint8 in FBGEMM's format."""
    where = f"table {name!r}" if name else "quantize_rows"
    w = weight.detach().float()
    if w.dim() != 2:
        raise ValueError(f"{where}: expected a [rows, dim] weight, got shape {list(w.shape)}")
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"{where}: the weight has inf or NaN values; fix the checkpoint first")
    rows, dim = w.shape
    if weight_type is WeightType.FP32:
        return w.contiguous().view(torch.uint8).view(rows, 4 * dim)
    if weight_type is WeightType.FP16:
        _check_fp16_range(where, w.abs().max() if w.numel() else w.new_zeros(()), "values")
        return w.half().contiguous().view(torch.uint8).view(rows, 2 * dim)
    QuantTableSpec(name or "?", rows, dim, weight_type)  # checks rows > 0 and dim packing
    levels = (1 << weight_type.bits) - 1
    minimum, maximum = w.min(dim=1).values, w.max(dim=1).values
    _check_fp16_range(where, minimum.abs().max(), "row minima")
    bias = minimum.half()
    spread = maximum - bias.float()
    scale = torch.where(spread == 0, torch.ones_like(spread), spread / levels)
    _check_fp16_range(where, scale.max(), "row scales (max - min) / levels")
    scale = scale.half()
    # A scale that rounds to 0 in fp16 (a nearly constant row) is replaced by 1, as FBGEMM does.
    scale = torch.where(scale.float() == 0, torch.ones_like(scale), scale)
    inverse = 1.0 / scale.float()
    codes = torch.round((w - bias.float().unsqueeze(1)) * inverse.unsqueeze(1))
    codes = codes.clamp_(0, levels).to(torch.uint8)
    per_byte = 8 // weight_type.bits
    if per_byte > 1:
        shifts = torch.arange(0, 8, weight_type.bits, dtype=torch.uint8)
        codes = (codes.view(rows, dim // per_byte, per_byte) << shifts).sum(-1, dtype=torch.uint8)
    qparams = torch.stack([scale, bias], dim=1).view(torch.uint8)
    return torch.cat([qparams, codes], dim=1)


def dequantize_rows(rows: Tensor, dim: int, weight_type: int) -> Tensor:
    """``[n, >= unpadded_row_bytes]`` uint8 rows -> ``[n, dim]`` float32 (TorchScript-able)."""
    # view_copy: TorchScript resolves ``Tensor.view(dtype)`` to ``view(size)``.
    if rows.shape[0] == 0:  # a dtype view needs an even row stride, which an empty slice may lack
        return torch.zeros(0, dim, device=rows.device)
    if weight_type == 0:
        return torch.view_copy(rows[:, : 4 * dim].contiguous(), dtype=torch.float32)
    if weight_type == 1:
        return torch.view_copy(rows[:, : 2 * dim].contiguous(), dtype=torch.float16).float()
    bits = 8 >> (weight_type - 2)
    per_byte = 8 // bits
    qparam_bytes = 4  # SCALE_BIAS_BYTES (TorchScript cannot read module globals)
    qparams = torch.view_copy(rows[:, :qparam_bytes].contiguous(), dtype=torch.float16).float()
    codes = rows[:, qparam_bytes : qparam_bytes + dim // per_byte]
    if per_byte > 1:
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=rows.device)
        codes = ((codes.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(rows.shape[0], dim)
    return codes.float() * qparams[:, :1] + qparams[:, 1:]


def row_error_bound(weight: Tensor, rows: Tensor, weight_type: WeightType) -> Tensor:
    """Per-row bound on ``|x - dequantized x|`` for ``rows = quantize_rows(weight, ...)``."""
    w = weight.detach().float()
    if weight_type is WeightType.FP32:
        return torch.zeros(w.shape[0])
    if weight_type is WeightType.FP16:
        return w.abs().max(dim=1).values * 2.0**-11 + 2.0**-25  # half ulp; 2^-25: subnormals
    qparams = torch.view_copy(rows[:, :SCALE_BIAS_BYTES].contiguous(), dtype=torch.float16).float()
    scale, bias = qparams[:, 0], qparams[:, 1]
    levels = (1 << weight_type.bits) - 1
    exact_scale = (w.max(dim=1).values - bias) / levels
    top = levels * (exact_scale - scale).clamp(min=0)
    bottom = (bias - w.min(dim=1).values).clamp(min=0)
    fp32_rounding = 2.0**-21 * (bias.abs() + levels * scale)
    return torch.maximum(torch.maximum(scale / 2, top), bottom) + fp32_rounding


def pack_tables(
    specs: Sequence[QuantTableSpec],
    quantized: Sequence[Tensor],
    row_alignment: int,
    device: torch.device | None = None,
) -> Tensor:
    """The flat buffer holding ``quantized[t]`` (``[rows, >= unpadded bytes]``) for every table."""
    offsets = table_offsets(specs, row_alignment)
    flat = torch.zeros(offsets[-1], dtype=torch.uint8, device=device)
    for view, rows in zip(table_views(flat, specs, row_alignment), quantized, strict=True):
        view.copy_(rows[:, : view.shape[1]])
    return flat


def table_views(flat: Tensor, specs: Sequence[QuantTableSpec], row_alignment: int) -> list[Tensor]:
    """``[rows, unpadded_row_bytes]`` views of each table in ``flat`` (padding left out)."""
    offsets = table_offsets(specs, row_alignment)
    views = []
    for s, start in zip(specs, offsets, strict=False):
        stride = row_bytes(s.dim, s.weight_type, row_alignment)
        block = flat.narrow(0, start, s.rows * stride).view(s.rows, stride)
        views.append(block[:, : unpadded_row_bytes(s.dim, s.weight_type)])
    return views


# ---- lookups (TorchScript-compatible) ---------------------------------------------------------
def feature_rows(
    weights: Tensor,
    weights_offset: int,
    row_stride: int,
    dim: int,
    weight_type: int,
    rows: int,
    feature_name: str,
    ids: Tensor,
) -> Tensor:
    """``[len(ids), dim]`` float32: the dequantized rows ``ids`` of one feature's table (at
    ``weights_offset`` in the flat buffer); an id outside ``[0, rows)`` raises IndexError."""
    ids = ids.long()
    if ids.numel() > 0:
        bad = (ids < 0) | (ids >= rows)
        if bool(bad.any()):
            first = int(ids[bad.nonzero()[0, 0]])
            raise IndexError(
                "feature '" + feature_name + "': id " + str(first) + " is outside [0, "
                + str(rows) + ") of its table. Hash or clip ids to the table size."
            )
    table = weights.narrow(0, weights_offset, rows * row_stride).view(rows, row_stride)
    return dequantize_rows(table.index_select(0, ids), dim, weight_type)


def torch_quant_lookup(
    weights: Tensor,
    weights_offsets: list[int],
    row_strides: list[int],
    dims: list[int],
    weights_tys: list[int],
    rows_per_feature: list[int],
    feature_names: list[str],
    indices: Tensor,
    offsets: Tensor,
    per_sample_weights: Tensor | None,
    pooled: bool,
) -> Tensor:
    """Each feature's rows gathered and dequantized (in float32), then

    - ``pooled``: SUM-pooled per bag, ``[B, sum(dims)]`` (weighted by ``per_sample_weights``);
    - not ``pooled``: unpooled ``[N, D]``, every id's row in ``indices`` order (every feature
      has the same dim ``D``; ``per_sample_weights`` is not used).

    ``offsets`` is feature-major (``num_features * B + 1`` entries), as FBGEMM takes it.
    """
    num_features = len(dims)
    batch = (offsets.numel() - 1) // num_features
    outs: list[Tensor] = []
    for f in range(num_features):
        lo = int(offsets[f * batch])
        hi = int(offsets[(f + 1) * batch])
        vectors = feature_rows(weights, weights_offsets[f], row_strides[f], dims[f],
                               weights_tys[f], rows_per_feature[f], feature_names[f],
                               indices[lo:hi])
        if pooled:
            psw = None if per_sample_weights is None else per_sample_weights[lo:hi].float()
            # embedding_bag over the gathered rows (index_add_ is ~1000x slower on CPU when
            # many rows land in one bag, as at batch size 1).
            vectors = torch.nn.functional.embedding_bag(
                torch.arange(hi - lo, device=weights.device), vectors,
                offsets[f * batch : (f + 1) * batch + 1] - lo, mode="sum",
                per_sample_weights=psw, include_last_offset=True,
            )
        outs.append(vectors)
    if not pooled and not outs:
        return torch.zeros(0, 0, device=weights.device)
    return torch.cat(outs, dim=1 if pooled else 0)


def fbgemm_quant_pooled(
    weights: Tensor,
    weights_placements: Tensor,
    weights_offsets: Tensor,
    weights_tys: Tensor,
    D_offsets: Tensor,  # noqa: N803 (FBGEMM's name)
    rows_per_feature: Tensor,
    bounds_check_warning: Tensor,
    max_dims: list[int],
    row_alignment: int,
    indices: Tensor,
    offsets: Tensor,
    per_sample_weights: Tensor | None,
    pooling_mode: int = 0,
) -> Tensor:
    """SUM-pooled ``[B, total_D]`` from FBGEMM's int-n-bit kernel, ids bounds-checked (FATAL);
    with ``pooling_mode=2`` (FBGEMM's NONE, every table one dim) the unpooled rows ``[N, D]``.

    ``max_dims`` is ``[total_D, max_int2_D, max_int4_D, max_int8_D, max_float16_D,
    max_float32_D]``.
    """
    # FBGEMM reads id -1 as a pruned row (a zero vector) even in FATAL mode; we refuse it. Its
    # kernel's own range check allows ids into a table's alignment padding, hence the FATAL check.
    if indices.numel() > 0 and int(indices.min()) < 0:
        raise IndexError(
            "negative id " + str(int(indices.min())) + " in a quantized lookup; ids must lie in "
            "[0, rows) of their table"
        )
    torch.ops.fbgemm.bounds_check_indices(
        rows_per_feature, indices, offsets, 0, bounds_check_warning, per_sample_weights
    )
    return torch.ops.fbgemm.int_nbit_split_embedding_codegen_lookup_function(
        dev_weights=weights,
        uvm_weights=weights.new_empty(0),
        weights_placements=weights_placements,
        weights_offsets=weights_offsets,
        weights_tys=weights_tys,
        D_offsets=D_offsets,
        total_D=max_dims[0],
        max_int2_D=max_dims[1],
        max_int4_D=max_dims[2],
        max_int8_D=max_dims[3],
        max_float16_D=max_dims[4],
        max_float32_D=max_dims[5],
        indices=indices,
        offsets=offsets,
        pooling_mode=pooling_mode,  # SUM or NONE; MEAN is applied by the caller, identically
        # for both kernels
        indice_weights=per_sample_weights,
        output_dtype=0,  # FP32
        lxu_cache_weights=weights.new_empty(0, 0),
        lxu_cache_locations=offsets.new_empty(0, dtype=torch.int32),
        row_alignment=row_alignment,
    )


def max_dims(specs: Sequence[QuantTableSpec], feature_table_map: Sequence[int]) -> list[int]:
    """The ``max_dims`` argument of :func:`fbgemm_quant_pooled`."""
    def widest(wt: WeightType) -> int:
        return max((s.dim for s in specs if s.weight_type is wt), default=0)

    total = sum(specs[t].dim for t in feature_table_map)
    order = (WeightType.INT2, WeightType.INT4, WeightType.INT8, WeightType.FP16, WeightType.FP32)
    return [total, *(widest(wt) for wt in order)]


def quant_fbgemm_missing(device: torch.device) -> str | None:
    """Why FBGEMM's int-n-bit kernel cannot run on ``device``, or None if it can."""
    if not fbgemm_supports(device):
        status = fbgemm_status()
        return status if status != "ok" else f"FBGEMM has no kernels for {device.type} tensors"
    return None


def build_fbgemm_int_nbit_tbe(
    specs: Sequence[QuantTableSpec],
    feature_table_map: Sequence[int],
    quantized: Sequence[Tensor],
    *,
    pooling_mean: bool,
    device: torch.device,
    row_alignment: int | None = None,
) -> nn.Module:
    """FBGEMM's own ``IntNBitTableBatchedEmbeddingBagsCodegen`` holding these quantized tables.

    For interoperability (TorchRec serves this module) and as the reference for the layout.
    """
    tbe_training_module()  # raises with the reason if FBGEMM is unavailable
    from fbgemm_gpu.split_embedding_configs import SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
        BoundsCheckMode,
        EmbeddingLocation,
        PoolingMode,
    )
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import (
        IntNBitTableBatchedEmbeddingBagsCodegen,
    )

    location = EmbeddingLocation.HOST if device.type == "cpu" else EmbeddingLocation.DEVICE
    sparse = {wt: SparseType.from_int(wt.value) for wt in WeightType}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tbe = IntNBitTableBatchedEmbeddingBagsCodegen(
            [(s.name, s.rows, s.dim, sparse[s.weight_type], location) for s in specs],
            feature_table_map=list(feature_table_map),
            pooling_mode=PoolingMode.MEAN if pooling_mean else PoolingMode.SUM,
            device=device,
            bounds_check_mode=BoundsCheckMode.FATAL,
            output_dtype=SparseType.FP32,
            row_alignment=row_alignment,
        )
        tbe.initialize_weights()
    for (padded, _), rows in zip(
        tbe.split_embedding_weights(split_scale_shifts=False), quantized, strict=True
    ):
        padded[:, : rows.shape[1]].copy_(rows)
    return tbe


def _round_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


def _check_fp16_range(where: str, largest: Tensor, what: str) -> None:
    value = float(largest)
    if not math.isfinite(value) or value > FP16_MAX:
        raise ValueError(
            f"{where}: {what} reach {value:g}, beyond fp16's range ({FP16_MAX:g}) in which FBGEMM "
            "stores them; rescale the table or keep it in a wider type"
        )
