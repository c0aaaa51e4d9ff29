"""The codec types of reduced-precision collectives (TorchRec's ``CommOp``,
``QuantizedCommCodec``, ``QuantizedCommCodecs``; re-exported by ``types``). The codecs
themselves and their configuration are in ``fbgemm_qcomm_codec``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum, unique

import torch


@unique
class CommOp(Enum):
    """The collectives a codec registry is keyed by (``CommOp.X.name``)."""

    POOLED_EMBEDDINGS_ALL_TO_ALL = "pooled_embeddings_all_to_all"
    POOLED_EMBEDDINGS_REDUCE_SCATTER = "pooled_embeddings_reduce_scatter"
    SEQUENCE_EMBEDDINGS_ALL_TO_ALL = "sequence_embeddings_all_to_all"


class QuantizedCommCodec:
    """Encodes a float32 payload before a collective sends it and decodes what arrives. This
    base class is the identity (float32 travels as is)."""

    @property
    def quantized_dtype(self) -> torch.dtype:
        return torch.float32

    def encode(self, input_tensor: torch.Tensor, ctx: object | None = None) -> torch.Tensor:
        return input_tensor

    def decode(self, input_grad: torch.Tensor, ctx: object | None = None) -> torch.Tensor:
        return input_grad

    def calc_quantized_size(self, input_len: int, ctx: object | None = None) -> int:
        return input_len

    def create_context(self) -> object | None:
        return None

    def padded_size(
        self, input_tensor: torch.Tensor, dim_per_rank: list[int], my_rank: int, qcomm_ctx: object
    ) -> tuple[int, int]:
        """(padded feature dim, padding) of this rank's (batch, dim) payload; no padding here."""
        if input_tensor.ndim == 1:
            return input_tensor.shape[0], 0
        return input_tensor.shape[1], 0

    @property
    def collective_support(self) -> str | None:
        """None when this codec can travel through this library's sharded collectives (which
        call ``encode`` / ``decode`` without a context and split payloads by element count);
        otherwise why not."""
        return None

    def is_identity(self) -> bool:
        return type(self) is QuantizedCommCodec


NoOpQuantizedCommCodec = QuantizedCommCodec


@dataclass
class QuantizedCommCodecs:
    """The codec of a collective's forward payload and the one of its backward (gradient)."""

    forward: QuantizedCommCodec = field(default_factory=QuantizedCommCodec)
    backward: QuantizedCommCodec = field(default_factory=QuantizedCommCodec)

    def is_identity(self) -> bool:
        return self.forward.is_identity() and self.backward.is_identity()


def check_collective_support(registry: Mapping[str, QuantizedCommCodecs] | None) -> None:
    """Raise (at sharder construction) if a codec of ``registry`` cannot run in the sharded
    collectives, naming the collective, the direction and the reason."""
    for op, codecs in (registry or {}).items():
        for direction in ("forward", "backward"):
            reason = getattr(getattr(codecs, direction), "collective_support", None)
            if reason is not None:
                raise ValueError(
                    f"qcomm_codecs_registry[{op!r}].{direction}: {reason} Use FP32, FP16 or BF16 "
                    f"for the sharded collectives."
                )
