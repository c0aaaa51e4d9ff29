"""Sparse data types: JaggedTensor, KeyedJaggedTensor, KeyedTensor (TorchRec-compatible)."""

from recsys_core.sparse.conversions import (
    ComputeJTDictToKJT,
    ComputeKJTToJTDict,
    jt_is_equal,
    kjt_is_equal,
)
from recsys_core.sparse.jagged import JaggedTensor
from recsys_core.sparse.keyed_jagged_tensor import KeyedJaggedTensor
from recsys_core.sparse.keyed_tensor import KeyedTensor

__all__ = [
    "ComputeJTDictToKJT",
    "ComputeKJTToJTDict",
    "JaggedTensor",
    "KeyedJaggedTensor",
    "KeyedTensor",
    "jt_is_equal",
    "kjt_is_equal",
]
