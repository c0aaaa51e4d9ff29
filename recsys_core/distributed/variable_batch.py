"""Variable batch per feature (VBE) into a sharded pooled collection: expand, then shard as usual.

A VBE KJT carries ``stride_per_key()[k]`` (deduplicated) bags for key ``k`` and
``inverse_indices`` ``(keys, [K, B])`` mapping each of the ``B`` batch rows to one of them. The
unsharded EBC pools the deduplicated bags and index-selects its output rows; pooling the
selected bags themselves gives the same values and, summed over the duplicates, the same
gradients. So the sharded collection expands the input to the full batch before its input
dist::

    keys ["a", "b"], stride_per_key [2, 1], lengths [1, 2 | 3], values [x | y z | p q r]
    inverse_indices [[0, 1, 1], [0, 0, 0]]                                      (B = 3)
    -> lengths [1, 2, 2 | 3, 3, 3], values [x, y z, y z | p q r, p q r, p q r], stride 3

(TorchRec instead sends the deduplicated bags and expands after the output dist, which moves
fewer ids; the results are the same.)
"""

from __future__ import annotations

import torch

from recsys_core.sparse import KeyedJaggedTensor


def expand_variable_batch(features: KeyedJaggedTensor, module: str) -> KeyedJaggedTensor:
    """``features`` itself when every key has the same batch, else its full-batch expansion
    through ``inverse_indices`` (see the module docstring)."""
    if not features.variable_stride_per_key():
        return features
    inverse = features.inverse_indices_or_none()
    if inverse is None:
        raise ValueError(
            f"{module}: a variable-batch KeyedJaggedTensor (stride_per_key "
            f"{features.stride_per_key()}) needs inverse_indices to give every key the full "
            "batch; pass inverse_indices=(keys, [num_keys, batch] tensor)"
        )
    inverse_keys, inverse_rows = inverse
    row_of = {k: i for i, k in enumerate(inverse_keys)}
    missing = [k for k in features.keys() if k not in row_of]
    if missing:
        raise ValueError(f"{module}: inverse_indices have no row for feature(s) {missing}")
    lengths, values = features.lengths(), features.values()
    weights = features.weights_or_none()
    strides = features.stride_per_key()
    offsets = features.offsets()
    new_lengths, gather = [], []
    start = 0
    for key, stride in zip(features.keys(), strides, strict=True):
        rows = inverse_rows[row_of[key]].to(lengths.device).long()
        bag = rows + start  # the key's bags sit at lengths[start : start + stride]
        key_lengths = lengths[bag].long()
        total = int(key_lengths.sum())
        begin = offsets[bag].long()
        first_of_each = torch.repeat_interleave(
            torch.cumsum(key_lengths, 0) - key_lengths, key_lengths, output_size=total
        )
        gather.append(
            torch.repeat_interleave(begin, key_lengths, output_size=total)
            + torch.arange(total, device=lengths.device)
            - first_of_each
        )
        new_lengths.append(key_lengths.to(lengths.dtype))
        start += stride
    index = torch.cat(gather) if gather else torch.zeros(0, dtype=torch.long)
    return KeyedJaggedTensor(
        keys=features.keys(),
        values=values.index_select(0, index),
        weights=None if weights is None else weights.index_select(0, index),
        lengths=torch.cat(new_lengths) if new_lengths else lengths[:0],
        stride=int(inverse_rows.shape[-1]),
    )
