"""TorchRec's ``torchrec.sparse.jagged_tensor`` path: every sparse type and the helpers TorchRec
users and tests import from it, re-exported from where they are defined (``jagged``,
``keyed_jagged_tensor``, ``keyed_tensor``, ``conversions``). Nothing in the library imports this
module: it is the face, not the engine."""

from recsys_core.sparse import _jit_ops
from recsys_core.sparse._fx import SparseTypeMeta
from recsys_core.sparse._kjt_ops import sum_by_splits as _sum_by_splits
from recsys_core.sparse.conversions import (
    ComputeJTDictToKJT,
    ComputeKJTToJTDict,
    flatten_kjt_list,
    jt_is_equal,
    kjt_is_equal,
    unflatten_kjt_list,
)
from recsys_core.sparse.jagged import (
    BatchedRows,
    JaggedTensor,
    _jt_from_dense_lengths,
    jagged_view,
    row_views_eager,
)
from recsys_core.sparse.keyed_jagged_tensor import KeyedJaggedTensor, _kjt_concat
from recsys_core.sparse.keyed_tensor import (
    KeyedTensor,
    _all_keys_used_once,
    _desugar_keyed_tensors,
    _fbgemm_permute_pooled_embs,
    _kt_regroup_arguments,
    _regroup_keyed_tensors,
    permute_multi_embedding,
    regroup_kts,
)

# TorchRec's private helpers under their names there (its tests and some users import them).
_safe_tolist = _jit_ops.safe_tolist
_cuda_to_cpu_safe = _jit_ops.cuda_to_cpu_safe
_pin_and_move = _jit_ops.pin_and_move
_to_offsets = _jit_ops.lengths_to_offsets
_cumsum = _jit_ops.cumsum
JaggedTensorMeta = SparseTypeMeta  # the metaclass of the sparse types (fx-proxyable)

__all__ = [
    "BatchedRows",
    "ComputeJTDictToKJT",
    "ComputeKJTToJTDict",
    "JaggedTensor",
    "JaggedTensorMeta",
    "KeyedJaggedTensor",
    "KeyedTensor",
    "_all_keys_used_once",
    "_cuda_to_cpu_safe",
    "_cumsum",
    "_desugar_keyed_tensors",
    "_fbgemm_permute_pooled_embs",
    "_jt_from_dense_lengths",
    "_kjt_concat",
    "_kt_regroup_arguments",
    "_pin_and_move",
    "_regroup_keyed_tensors",
    "_safe_tolist",
    "_sum_by_splits",
    "_to_offsets",
    "flatten_kjt_list",
    "jagged_view",
    "jt_is_equal",
    "kjt_is_equal",
    "permute_multi_embedding",
    "regroup_kts",
    "row_views_eager",
    "unflatten_kjt_list",
]
