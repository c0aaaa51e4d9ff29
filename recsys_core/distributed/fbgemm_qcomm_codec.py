"""Reduced-precision communication of embeddings (TorchRec's "qcomms").

The pooled and sequence embeddings a sharded collection sends back to each sample's rank, and
their gradients in backward, are usually the largest tensors a sharded step moves. A
``QCommsConfig`` picks the precision each direction travels in::

    registry = get_qcomm_codecs_registry(
        QCommsConfig(forward_precision=CommType.BF16, backward_precision=CommType.BF16))
    sharder = EmbeddingBagCollectionSharder(qcomm_codecs_registry=registry)

Every collective of the listed ``CommOp`` then encodes its float32 input before sending (a cast,
after a multiply by ``*_loss_scale`` if given, and for FP16 a clamp to its finite range) and
decodes what it receives back to float32 (a cast, then the divide). Reductions of received
blocks (row-wise's reduce-scatter on gloo) add the decoded float32 blocks.

BF16 halves the bytes and keeps float32's range; under bf16 autocast of the dense part (where
the pooled embeddings are cast to bf16 anyway and their gradients come back from bf16
products) it changes no value. FP16 keeps more mantissa but overflows past 65504 (clamped) and
flushes tiny gradients (``backward_loss_scale`` lifts them).

FP8, INT8 and MX4 codecs (FBGEMM's formats, :mod:`recsys_core.kernels.quant_comm`) work on CPU
as TorchRec's: ``ctx = codec.create_context()``, ``codec.encode(x, ctx)``, ``decode(q, ctx)``,
``calc_quantized_size(n, ctx)``, ``padded_size(...)``. FP8 without ``fp8_quantize_dim`` is
FBGEMM's hfp8 (1-4-3, bias 15, magnitudes clamped to 0.9375, one byte per element, shape kept);
with it, blocks of that many elements are FP8 row-wise (per-block scale; backward 1-5-2 unless
``fp8_bwd_uses_143``). INT8 is FBGEMM's fused 8-bit row-wise over blocks of ``ctx.row_dim``
(32) elements. Their payloads change size (row-wise) or are integer bytes that autograd cannot
carry through this library's sharded collectives, so sharders refuse them at construction
(``check_collective_support``), naming the collective.

Differences from TorchRec: on CPU (gloo), TorchRec falls back from BF16 to FP16; gloo moves
bf16 here, so BF16 stays BF16. ``fp8_quantize_dim`` / ``mx4_quantize_dim`` without that
precision raise (TorchRec logs a warning); a loss scale with FP8/INT8/MX4 is dropped with a
warning, as FBGEMM does. FP8 row-wise runs on CPU (FBGEMM has only a CUDA kernel) and decodes
to exactly ``row_dim`` columns.
"""

from __future__ import annotations

import copy
import logging
import os
from dataclasses import dataclass, field
from enum import unique

import torch

from recsys_core.distributed.types import CommOp, QuantizedCommCodec, QuantizedCommCodecs
from recsys_core.kernels import quant_comm
from recsys_core.types import ValueStrEnum

logger = logging.getLogger(__name__)


@unique
class CommType(ValueStrEnum):
    """The precision a collective's payload travels in (``str()``: its value, as in TorchRec)."""

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"
    FP8 = "fp8"
    INT8 = "int8"
    MX4 = "mx4"


_DTYPES = {CommType.FP32: torch.float32, CommType.FP16: torch.float16, CommType.BF16: torch.bfloat16}


@dataclass
class QCommsConfig:
    """Precisions of the embedding collectives' forward and backward payloads.

    ``forward_loss_scale`` / ``backward_loss_scale`` multiply a payload before it is encoded and
    divide it after it is decoded (FP16/BF16 only). ``fp8_quantize_dim`` (``_bwd``: backward,
    default the forward one): FP8 row-wise over blocks of that many elements instead of hfp8.
    ``fp8_bwd_uses_143``: backward FP8 row-wise in 1-4-3 instead of 1-5-2. ``mx4_quantize_dim``
    (``_bwd``): the MX4 group size (default 32); ``mx4_rounding_mode``: FBGEMM's RoundingMode.
    ``output_dtype`` (``fp8_output_dtype``, deprecated): accepted for TorchRec's signature;
    decoded payloads are float32 here."""

    forward_precision: CommType = CommType.FP32
    backward_precision: CommType = CommType.FP32
    forward_loss_scale: float | None = None
    backward_loss_scale: float | None = None
    fp8_quantize_dim: int | None = None
    fp8_quantize_dim_bwd: int | None = None
    fp8_bwd_uses_143: bool | None = False
    fp8_output_dtype: object | None = None
    mx4_quantize_dim: int | None = None
    mx4_quantize_dim_bwd: int | None = None
    mx4_rounding_mode: object | None = None
    output_dtype: object | None = None

    def __post_init__(self) -> None:
        for name in ("forward_precision", "backward_precision"):
            value = getattr(self, name)
            if isinstance(value, str):
                try:
                    value = CommType(value.lower())
                except ValueError:
                    raise ValueError(
                        f"QCommsConfig: {name}={value!r} is not one of "
                        f"{[t.value for t in CommType]}."
                    ) from None
                setattr(self, name, value)
            if not isinstance(value, CommType):
                raise ValueError(f"QCommsConfig: {name} must be a CommType, got {value!r}.")
        if self.fp8_output_dtype is not None and self.output_dtype is None:
            self.output_dtype = self.fp8_output_dtype
        precisions = (self.forward_precision, self.backward_precision)
        for kind, names in ((CommType.FP8, ("fp8_quantize_dim", "fp8_quantize_dim_bwd")),
                            (CommType.MX4, ("mx4_quantize_dim", "mx4_quantize_dim_bwd"))):
            for name in names:
                dim = getattr(self, name)
                if dim is None:
                    continue
                if kind not in precisions:
                    raise ValueError(
                        f"QCommsConfig: {name}={dim} is set but neither precision is {kind}; "
                        f"drop it or use {kind}."
                    )
                if isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0:
                    raise ValueError(f"QCommsConfig: {name} must be a positive int, got {dim!r}.")
        if self.backward_precision is CommType.FP8 and self.fp8_quantize_dim_bwd is None:
            self.fp8_quantize_dim_bwd = self.fp8_quantize_dim
        if self.backward_precision is CommType.MX4 and self.mx4_quantize_dim_bwd is None:
            self.mx4_quantize_dim_bwd = self.mx4_quantize_dim
        for name in ("forward_loss_scale", "backward_loss_scale"):
            scale = getattr(self, name)
            if scale is not None and not (float(scale) > 0 and float(scale) < float("inf")):
                raise ValueError(f"QCommsConfig: {name} must be a positive finite number, got {scale}.")


@dataclass
class QuantizationContext:
    """Per-collective state of an FP8 / INT8 / MX4 codec (FBGEMM's): ``row_dim`` elements per
    quantized block (FP8: <= 0 means hfp8, no blocks), ``row_dim_quant`` bytes per encoded
    block (set by ``encode``), the MX4 group size and rounding, and the padded feature dims
    per rank (set by ``padded_size``)."""

    row_dim: int = 32
    row_dim_quant: int = -1
    mx_group_size: int = 32
    rounding_mode: object | None = None
    padded_dim_sum_per_rank: list[int] | None = field(default=None)


def _fp8_rowwise_padding_enabled() -> bool:
    return os.environ.get("TORCHREC_ENABLE_FP8_ROWWISE_PADDING", "0") not in ("", "0")


def _blocks_of(n: int, row_dim: int) -> int:
    if n % row_dim:
        raise RuntimeError(
            f"input_len {n} is not a multiple of row dim {row_dim}: pad each rank's payload to "
            f"whole rows (padded_size) or pick a batch size that makes it one."
        )
    return n // row_dim


class _ByteCommCodec(QuantizedCommCodec):
    """Shared parts of the FP8 / INT8 / MX4 codecs (uint8 payloads)."""

    comm_type: CommType

    def __init__(self, loss_scale: float | None) -> None:
        if loss_scale is not None:
            logger.warning("QCommsConfig: a loss scale with %s is not supported; ignored (as "
                           "FBGEMM).", self.comm_type)

    @property
    def quantized_dtype(self) -> torch.dtype:
        return torch.uint8

    @property
    def collective_support(self) -> str | None:
        return (f"{self.comm_type} payloads are uint8 (sized per row block), which the sharded "
                f"collectives here cannot split or differentiate through.")

    def _ctx(self, ctx: QuantizationContext | None) -> QuantizationContext:
        return ctx if ctx is not None else self.create_context()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.comm_type})"


class Fp8CommCodec(_ByteCommCodec):
    """FP8: hfp8 per element without a row dim; FP8 row-wise over ``row_dim`` blocks with one."""

    comm_type = CommType.FP8

    def __init__(self, row_dim: int | None = None, is_fwd: bool = True,
                 loss_scale: float | None = None) -> None:
        super().__init__(loss_scale)
        self._row_dim = -1 if row_dim is None else int(row_dim)
        self._is_fwd = is_fwd

    def create_context(self) -> QuantizationContext:
        return QuantizationContext(row_dim=self._row_dim)

    def encode(self, input_tensor: torch.Tensor, ctx: QuantizationContext | None = None) -> torch.Tensor:
        ctx = self._ctx(ctx)
        if ctx.row_dim <= 0:
            return quant_comm.hfp8_encode(input_tensor, *quant_comm.HFP8_FWD)
        rows = input_tensor.reshape(-1)
        _blocks_of(rows.numel(), ctx.row_dim)
        q = quant_comm.fp8_rowwise_encode(rows.view(-1, ctx.row_dim), self._is_fwd)
        ctx.row_dim_quant = q.shape[1]
        return q.view(-1)

    def decode(self, input_grad: torch.Tensor, ctx: QuantizationContext | None = None) -> torch.Tensor:
        ctx = self._ctx(ctx)
        if ctx.row_dim <= 0:
            return quant_comm.hfp8_decode(input_grad, *quant_comm.HFP8_FWD[:2])
        width = quant_comm.aligned_row_bytes(ctx.row_dim)
        rows = input_grad.reshape(-1, width)
        return quant_comm.fp8_rowwise_decode(rows, ctx.row_dim, self._is_fwd).view(-1)

    def calc_quantized_size(self, input_len: int, ctx: QuantizationContext | None = None) -> int:
        ctx = self._ctx(ctx)
        if self._row_dim <= 0:
            return input_len
        return _blocks_of(input_len, ctx.row_dim) * quant_comm.aligned_row_bytes(ctx.row_dim)

    def padded_size(self, input_tensor: torch.Tensor, dim_per_rank: list[int], my_rank: int,
                    qcomm_ctx: QuantizationContext) -> tuple[int, int]:
        """With FP8 row-wise and ``TORCHREC_ENABLE_FP8_ROWWISE_PADDING=1`` (TorchRec's switch),
        every rank's feature dim is padded to a multiple of the row dim (recorded in
        ``qcomm_ctx.padded_dim_sum_per_rank``); returns (this rank's padded dim, padding)."""
        if input_tensor.ndim == 1 or self._row_dim <= 0 or not _fp8_rowwise_padding_enabled():
            return super().padded_size(input_tensor, dim_per_rank, my_rank, qcomm_ctx)
        return _pad_to_multiple(input_tensor, dim_per_rank, my_rank, qcomm_ctx, qcomm_ctx.row_dim)


class Int8CommCodec(_ByteCommCodec):
    """FBGEMM's fused 8-bit row-wise over blocks of ``ctx.row_dim`` elements (default 32)."""

    comm_type = CommType.INT8

    def __init__(self, loss_scale: float | None = None) -> None:
        super().__init__(loss_scale)

    def create_context(self) -> QuantizationContext:
        return QuantizationContext()

    def encode(self, input_tensor: torch.Tensor, ctx: QuantizationContext | None = None) -> torch.Tensor:
        ctx = self._ctx(ctx)
        flat = input_tensor.reshape(-1)
        _blocks_of(flat.numel(), ctx.row_dim)
        q = quant_comm.int8_rowwise_encode(flat.view(-1, ctx.row_dim))
        ctx.row_dim_quant = q.shape[1]
        return q.view(-1)

    def decode(self, input_grad: torch.Tensor, ctx: QuantizationContext | None = None) -> torch.Tensor:
        ctx = self._ctx(ctx)
        rows = input_grad.reshape(-1, quant_comm.aligned_row_bytes(ctx.row_dim))
        return quant_comm.int8_rowwise_decode(rows, ctx.row_dim).view(-1)

    def calc_quantized_size(self, input_len: int, ctx: QuantizationContext | None = None) -> int:
        ctx = self._ctx(ctx)
        return _blocks_of(input_len, ctx.row_dim) * quant_comm.aligned_row_bytes(ctx.row_dim)


class Mx4CommCodec(_ByteCommCodec):
    """MX4 (FBGEMM's reference implementation) over groups of ``group_size`` elements; each
    row's last dimension is padded to whole groups."""

    comm_type = CommType.MX4

    def __init__(self, group_size: int | None = None, rounding_mode: object | None = None,
                 loss_scale: float | None = None) -> None:
        super().__init__(loss_scale)
        self._group = 32 if group_size is None else int(group_size)
        self._rounding = rounding_mode

    def create_context(self) -> QuantizationContext:
        return QuantizationContext(row_dim=self._group, mx_group_size=self._group,
                                   rounding_mode=self._rounding)

    def encode(self, input_tensor: torch.Tensor, ctx: QuantizationContext | None = None) -> torch.Tensor:
        ctx = self._ctx(ctx)
        return quant_comm.mx4_encode(input_tensor, ctx.mx_group_size, ctx.rounding_mode)

    def decode(self, input_grad: torch.Tensor, ctx: QuantizationContext | None = None) -> torch.Tensor:
        return quant_comm.mx4_decode(input_grad, self._ctx(ctx).mx_group_size)

    def calc_quantized_size(self, input_len: int, ctx: QuantizationContext | None = None) -> int:
        group = self._ctx(ctx).mx_group_size
        return _blocks_of(input_len, group) * (group // 2 + 1)

    def padded_size(self, input_tensor: torch.Tensor, dim_per_rank: list[int], my_rank: int,
                    qcomm_ctx: QuantizationContext) -> tuple[int, int]:
        if input_tensor.ndim == 1:
            return super().padded_size(input_tensor, dim_per_rank, my_rank, qcomm_ctx)
        return _pad_to_multiple(input_tensor, dim_per_rank, my_rank, qcomm_ctx,
                                qcomm_ctx.mx_group_size)


def _pad_to_multiple(input_tensor: torch.Tensor, dim_per_rank: list[int], my_rank: int,
                     ctx: QuantizationContext, multiple: int) -> tuple[int, int]:
    dim = dim_per_rank[my_rank]
    if input_tensor.ndim != 2 or input_tensor.shape[1] != dim:
        raise ValueError(
            f"padded_size: expected a (batch, {dim}) payload for rank {my_rank}, got shape "
            f"{tuple(input_tensor.shape)}."
        )
    ctx.padded_dim_sum_per_rank = [d + (-d) % multiple for d in dim_per_rank]
    return ctx.padded_dim_sum_per_rank[my_rank], (-dim) % multiple


class CastCommCodec(QuantizedCommCodec):
    """Float32 <-> ``comm_type`` by a cast (round to nearest even), with an optional scale."""

    def __init__(self, comm_type: CommType, loss_scale: float | None = None) -> None:
        if comm_type not in _DTYPES:
            raise ValueError(f"CastCommCodec: {comm_type} is not a cast; use get_qcomm_codecs.")
        self._comm_type = comm_type
        self._dtype = _DTYPES[comm_type]
        self._scale = None if loss_scale is None else float(loss_scale)

    @property
    def comm_type(self) -> CommType:
        return self._comm_type

    @property
    def quantized_dtype(self) -> torch.dtype:
        return self._dtype

    def encode(self, input_tensor: torch.Tensor, ctx: object | None = None) -> torch.Tensor:
        x = input_tensor
        if self._scale is not None:
            x = x * self._scale
        if self._dtype == torch.float16:
            info = torch.finfo(torch.float16)
            x = x.clamp(info.min, info.max)
        return x.to(self._dtype)

    def decode(self, input_grad: torch.Tensor, ctx: object | None = None) -> torch.Tensor:
        x = input_grad.to(torch.float32)
        if self._scale is not None:
            x = x / self._scale
        return x

    def calc_quantized_size(self, input_len: int, ctx: object | None = None) -> int:
        return input_len

    def create_context(self) -> None:
        return None

    def __repr__(self) -> str:
        scale = "" if self._scale is None else f", loss_scale={self._scale}"
        return f"CastCommCodec({self._comm_type}{scale})"


def _codec(precision: CommType, loss_scale: float | None, row_dim: int | None, is_fwd: bool,
           rounding_mode: object | None) -> QuantizedCommCodec:
    if precision is CommType.FP8:
        return Fp8CommCodec(row_dim, is_fwd, loss_scale)
    if precision is CommType.INT8:
        return Int8CommCodec(loss_scale)
    if precision is CommType.MX4:
        return Mx4CommCodec(row_dim, rounding_mode, loss_scale)
    return CastCommCodec(precision, loss_scale)


def get_qcomm_codecs(qcomms_config: QCommsConfig | None) -> QuantizedCommCodecs:
    """The forward and backward codecs of one collective (FP32 where the config says so or
    is None). Backward FP8 row-wise is 1-5-2 unless ``fp8_bwd_uses_143``."""
    if qcomms_config is None:
        return QuantizedCommCodecs()
    c = qcomms_config
    dims = {CommType.FP8: (c.fp8_quantize_dim, c.fp8_quantize_dim_bwd),
            CommType.MX4: (c.mx4_quantize_dim, c.mx4_quantize_dim_bwd)}
    fwd_dim = dims.get(c.forward_precision, (None, None))[0]
    bwd_dim = dims.get(c.backward_precision, (None, None))[1]
    return QuantizedCommCodecs(
        forward=_codec(c.forward_precision, c.forward_loss_scale, fwd_dim, True,
                       c.mx4_rounding_mode),
        backward=_codec(c.backward_precision, c.backward_loss_scale, bwd_dim,
                        bool(c.fp8_bwd_uses_143), c.mx4_rounding_mode),
    )


def get_qcomm_codecs_registry(
    qcomms_config: QCommsConfig,
    comm_ops: list[CommOp] | None = None,
    device: torch.device | None = None,
) -> dict[str, QuantizedCommCodecs] | None:
    """The codecs of ``comm_ops`` (default: the pooled all-to-all, the pooled reduce-scatter and
    the sequence all-to-all), keyed by ``CommOp.name``, for a sharder's
    ``qcomm_codecs_registry``. None when both precisions are FP32 (nothing to encode).
    ``device`` is accepted for TorchRec's signature. FP8 / MX4 of the reduce-scatter fall back
    to FP16 forward and BF16 backward (as TorchRec)."""
    if (
        qcomms_config.forward_precision is CommType.FP32
        and qcomms_config.backward_precision is CommType.FP32
    ):
        return None
    if comm_ops is None:
        comm_ops = [
            CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL,
            CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER,
            CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL,
        ]
    registry = {}
    for op in comm_ops:
        config = copy.deepcopy(qcomms_config)
        if op is CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER:
            # a reduction cannot sum FP8 / MX4 bytes: TorchRec's fallbacks
            if config.forward_precision in (CommType.FP8, CommType.MX4):
                config.forward_precision = CommType.FP16
            if config.backward_precision in (CommType.FP8, CommType.MX4):
                config.backward_precision = CommType.BF16
        registry[op.name] = get_qcomm_codecs(config)
    return registry
