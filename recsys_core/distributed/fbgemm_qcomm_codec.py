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
flushes tiny gradients (``backward_loss_scale`` lifts them). FP8 / INT8 / MX4, which TorchRec
runs through FBGEMM's GPU quantizers, are not supported: they raise at construction.

Differences from TorchRec: on CPU (gloo), TorchRec falls back from BF16 to FP16; gloo moves
bf16 here, so BF16 stays BF16.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from enum import Enum, unique

import torch

from recsys_core.distributed.types import CommOp, QuantizedCommCodec, QuantizedCommCodecs


@unique
class CommType(Enum):
    """The precision a collective's payload travels in."""

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"
    FP8 = "fp8"
    INT8 = "int8"
    MX4 = "mx4"

    def __str__(self) -> str:
        return self.value


_DTYPES = {CommType.FP32: torch.float32, CommType.FP16: torch.float16, CommType.BF16: torch.bfloat16}


@dataclass
class QCommsConfig:
    """Precisions of the embedding collectives' forward and backward payloads.

    ``forward_loss_scale`` / ``backward_loss_scale`` multiply a payload before it is encoded and
    divide it after it is decoded (for FP16 gradients that would underflow)."""

    forward_precision: CommType = CommType.FP32
    backward_precision: CommType = CommType.FP32
    forward_loss_scale: float | None = None
    backward_loss_scale: float | None = None
    fp8_quantize_dim: int | None = None
    fp8_quantize_dim_bwd: int | None = None
    fp8_bwd_uses_143: bool | None = False

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
            if value not in _DTYPES:
                raise NotImplementedError(
                    f"QCommsConfig: {name}={value} is not supported here (FBGEMM's GPU "
                    f"quantizers in TorchRec); use one of {[str(t) for t in _DTYPES]}."
                )
        if (self.fp8_quantize_dim is not None or self.fp8_quantize_dim_bwd is not None):
            raise ValueError(
                "QCommsConfig: fp8_quantize_dim / fp8_quantize_dim_bwd are set but no FP8 "
                "precision is used (FP8 is not supported here)."
            )
        for name in ("forward_loss_scale", "backward_loss_scale"):
            scale = getattr(self, name)
            if scale is not None and not (float(scale) > 0 and float(scale) < float("inf")):
                raise ValueError(f"QCommsConfig: {name} must be a positive finite number, got {scale}.")


class CastCommCodec(QuantizedCommCodec):
    """Float32 <-> ``comm_type`` by a cast (round to nearest even), with an optional scale."""

    def __init__(self, comm_type: CommType, loss_scale: float | None = None) -> None:
        if comm_type not in _DTYPES:
            raise NotImplementedError(f"CastCommCodec: {comm_type} is not supported.")
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


def get_qcomm_codecs(qcomms_config: QCommsConfig | None) -> QuantizedCommCodecs:
    """The forward and backward codecs of one collective (FP32 where the config says so or
    is None)."""
    if qcomms_config is None:
        return QuantizedCommCodecs()
    return QuantizedCommCodecs(
        forward=CastCommCodec(qcomms_config.forward_precision, qcomms_config.forward_loss_scale),
        backward=CastCommCodec(qcomms_config.backward_precision, qcomms_config.backward_loss_scale),
    )


def get_qcomm_codecs_registry(
    qcomms_config: QCommsConfig,
    comm_ops: list[CommOp] | None = None,
    device: torch.device | None = None,
) -> dict[str, QuantizedCommCodecs] | None:
    """The codecs of ``comm_ops`` (default: the pooled all-to-all, the pooled reduce-scatter and
    the sequence all-to-all), keyed by ``CommOp.name``, for a sharder's
    ``qcomm_codecs_registry``. None when both precisions are FP32 (nothing to encode).
    ``device`` is accepted for TorchRec's signature; every supported precision runs on both
    gloo and NCCL."""
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
    return {op.name: get_qcomm_codecs(copy.deepcopy(qcomms_config)) for op in comm_ops}
