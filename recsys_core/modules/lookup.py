"""What the unsharded collections share around their lookups: input checks, error diagnosis, and
the small steps of a forward that ``torch.fx`` must record as leaf calls.

The forward functions here are scriptable and are registered with ``torch.fx.wrap`` by the module
that calls them (``torch.fx.wrap`` patches the caller's globals), so a traced graph calls them as
one node each instead of tracing into data-dependent Python.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Optional, TypeVar

import torch

from recsys_core.kernels.id_check import IdOutOfRangeError
from recsys_core.sparse import JaggedTensor, KeyedJaggedTensor

_Out = TypeVar("_Out")


def check_features(
    features: KeyedJaggedTensor, needed: Sequence[str], module: str, is_weighted: bool
) -> None:
    """The input carries every feature a module needs, as integer ids (and weights if weighted)."""
    if not isinstance(features, KeyedJaggedTensor):
        raise TypeError(f"{module}: expected a KeyedJaggedTensor, got {type(features).__name__}")
    keys = set(features.keys())
    missing = [f for f in dict.fromkeys(needed) if f not in keys]
    if missing:
        raise ValueError(
            f"{module}: input KeyedJaggedTensor lacks feature(s) {missing}; it has "
            f"{list(features.keys())}. Add them (empty bags are fine) or remove the tables."
        )
    values = features.values()
    if values.is_floating_point() or values.dtype == torch.bool or values.is_complex():
        raise ValueError(
            f"{module}: feature ids must be int32 or int64, got values of dtype {values.dtype} "
            f"(features {list(features.keys())}); cast with .long()"
        )
    if is_weighted and features.weights_or_none() is None:
        raise ValueError(
            f"{module}: the collection is weighted (is_weighted=True) but the input "
            f"KeyedJaggedTensor has no weights; pass weights= for features {list(needed)}"
        )
    # Lengths/offsets reach the kernels next: prove them in bounds (cached on the KJT).
    features._ensure_safe()


def lookup_error(feature: str, num_embeddings: int, ids: torch.Tensor) -> IdOutOfRangeError | None:
    """An error naming ``feature`` and its first id outside ``[0, num_embeddings)``, or None."""
    bad = ((ids < 0) | (ids >= num_embeddings)).nonzero()
    if bad.numel() == 0:
        return None
    return IdOutOfRangeError(
        f"feature {feature!r}: id {int(ids[int(bad[0, 0])])} is outside [0, {num_embeddings}) of "
        f"its table; {bad.numel()} bad id(s) in this feature. Hash or clip ids to the table size."
    )


def diagnose_lookup_failure(
    features: KeyedJaggedTensor,
    rows_per_feature: Sequence[tuple[str, int]],
    module: str,
    exc: Exception,
) -> Exception:
    """After a lookup failed: the clearest error we can name (malformed KJT, id out of range,
    variable batch without inverse indices), or ``exc`` itself."""
    features.validate()  # lengths/offsets that do not fit the values raise here, naming the key
    jts = features.to_dict()
    for name, rows in rows_per_feature:
        error = lookup_error(name, rows, jts[name].values())
        if error is not None:
            return error
    if features.variable_stride_per_key() and features.inverse_indices_or_none() is None:
        return ValueError(
            f"{module}: the input has a different batch size per key "
            f"({dict(zip(features.keys(), features.stride_per_key(), strict=True))}) and no "
            "inverse_indices, so pooled outputs cannot form one batch; build the "
            "KeyedJaggedTensor with inverse_indices=(keys, indices [num_keys, batch])"
        )
    return exc


def lookup_or_diagnose(
    lookup: Callable[[KeyedJaggedTensor], _Out],
    features: KeyedJaggedTensor,
    rows_per_feature: Sequence[tuple[str, int]],
    module: str,
) -> _Out:
    """``lookup(features)``; where it fails (IndexError, RuntimeError), the error
    :func:`diagnose_lookup_failure` names is raised instead, from the original."""
    try:
        return lookup(features)
    except (IndexError, RuntimeError) as exc:
        error = diagnose_lookup_failure(features, rows_per_feature, module, exc)
        if error is exc:
            raise
        raise error from exc


def bag_offsets(jt: JaggedTensor) -> torch.Tensor:
    """A feature's offsets for ``embedding_bag(include_last_offset=True)``: a batch of 0 has
    no offsets at all (as in TorchRec), where the kernel needs the single ``[0]``."""
    offsets = jt.offsets()
    if offsets.numel() == 0:
        return torch.zeros(1, dtype=jt.values().dtype, device=offsets.device)
    return offsets


def check_lengths(features: KeyedJaggedTensor) -> None:
    """Unpooled lookups read only the values, so a negative length would pass silently into the
    output; a KJT with one is validated, which raises naming its key."""
    if not torch.jit.is_scripting():
        lengths = features.lengths()
        if lengths.numel() > 0 and bool((lengths < 0).any()):
            features.validate()


def validate_features(
    features: KeyedJaggedTensor, needed: list[str], module: str, is_weighted: bool
) -> None:
    """``check_features`` as one leaf call in an fx graph (skipped once the graph is scripted)."""
    if not torch.jit.is_scripting():
        check_features(features, needed, module, is_weighted)


def reorder_inverse_indices(
    inverse_indices: Optional[tuple[list[str], torch.Tensor]],  # noqa: UP045 (TorchScript)
    feature_names: list[str],
) -> torch.Tensor:
    """The rows of a variable-batch KJT's inverse indices in ``feature_names`` order (a name
    ``f@t`` uses feature ``f``'s row); an empty tensor when the KJT has none."""
    if inverse_indices is None:
        return torch.empty(0)
    row_of: dict[str, int] = {}
    for i, key in enumerate(inverse_indices[0]):
        row_of[key] = i
    rows: list[int] = []
    for name in feature_names:
        base = name.split("@")[0]
        if base not in row_of:
            raise ValueError(
                "inverse_indices of the input KeyedJaggedTensor have no row for feature " + base
            )
        rows.append(row_of[base])
    index = torch.tensor(rows, dtype=torch.long, device=inverse_indices[1].device)
    return inverse_indices[1].index_select(0, index)


def combine_pooled(pooled: list[torch.Tensor], inverse_indices: torch.Tensor) -> torch.Tensor:
    """Concatenate per-feature pooled outputs ``[B_f, D_f]`` into ``[B, sum D_f]``; with inverse
    indices (variable batch), feature ``f``'s rows are first expanded to the full batch."""
    if inverse_indices.numel() > 0:
        pooled = [p.index_select(0, inverse_indices[i].long()) for i, p in enumerate(pooled)]
    return torch.cat(pooled, dim=1)


def meta_jagged(
    features: KeyedJaggedTensor, key_index: int, embedding_dim: int
) -> JaggedTensor:
    """A feature's unpooled output on the meta device: ``[ids of the key, dim]`` rows (the id
    count must be known, from ``length_per_key``, since meta tensors hold no lengths)."""
    per_key = features.length_per_key_or_none()
    if per_key is None:
        raise ValueError(
            "a meta-device KeyedJaggedTensor has no data to count its ids per key; construct it "
            "with length_per_key=[...] to run an EmbeddingCollection on meta tensors"
        )
    stride_offsets = [0]
    for stride in features.stride_per_key():
        stride_offsets.append(stride_offsets[-1] + stride)
    lengths = features.lengths()[stride_offsets[key_index] : stride_offsets[key_index + 1]]
    values = torch.empty(per_key[key_index], embedding_dim, device="meta")
    return JaggedTensor(values=values, lengths=lengths)
