"""The frozen id mapping of a model trained on raw ids (``preprocess --id-mapping zch``), for
evaluation-free serving: export turns the trained managed-collision tables into

* a plain DLRM whose every table is an ordinary one (the raw-id tables with their ``zch_rows``
  rows), in the dataset's feature order, and
* :class:`FrozenIdMap`, which maps each raw id to the row the trained remapping gave it. An id
  that never got a row of its own (unseen, or evicted) maps to its table's LAST row, the row
  training shared among such ids: the documented fallback. Nothing is admitted or evicted
  at inference.

``FrozenIdMap`` is a plain module (TorchScript-able, ``torch.export``-able): one sorted array of
``feature << 32 | scrambled id`` keys for all raw-id features and the row of each key.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from dlrm_app.config import ModelConfig
from dlrm_app.data.schema import DatasetSpec
from dlrm_app.model import DLRM, ZCH_HASH_MULTIPLIER, build_dlrm, raw_id_space

KEY_BITS = 32
"""Scrambled raw ids lie below ``2**32`` (``MAX_RAW_ID_SPACE``): a key packs the feature above."""
_FREE = torch.iinfo(torch.int64).max  # an MCH table entry no id owns


class FrozenIdMap(nn.Module):
    """``(values [N], offsets [F*B + 1], batch) -> values`` with every raw-id feature's ids
    replaced by their rows; other features' ids pass unchanged. Bags key-major, as a
    KeyedJaggedTensor's ``values()`` / ``offsets()``; values past the last bag are left as they
    are. A raw id outside its feature's raw id space fails a runtime assertion.

    Args:
        num_features: F, all sparse features.
        raw: per feature, None (ids are rows) or ``(input_hash_size, sorted scrambled ids,
            their rows, fallback rows)``: one fallback row for ids without a row of their own,
            or one per row block of the training's row-wise shards (an id then gets the one
            of the block it was routed to there: ``scrambled // ceil(input_hash_size /
            blocks)``).
    """

    def __init__(self, num_features: int,
                 raw: list[tuple[int, Tensor, Tensor, int | list[int]] | None]) -> None:
        super().__init__()
        if len(raw) != num_features:
            raise ValueError(f"{len(raw)} entries for {num_features} features")
        self.enabled = any(r is not None for r in raw)
        keys, rows = [torch.zeros(0, dtype=torch.int64)], [torch.zeros(0, dtype=torch.int64)]
        space = torch.zeros(num_features, dtype=torch.int64)
        misses = [[0] if e is None else [e[3]] if isinstance(e[3], int) else list(e[3])
                  for e in raw]
        fallback = torch.zeros(num_features, max(len(m) for m in misses), dtype=torch.int64)
        block_size = torch.ones(num_features, dtype=torch.int64)
        for k, entry in enumerate(raw):
            if entry is None:
                continue
            size, ids, slots, _ = entry
            owned = ids != _FREE
            keys.append(ids[owned].to(torch.int64) + (k << KEY_BITS))
            rows.append(slots[owned].to(torch.int64))
            space[k] = size
            fallback[k, :len(misses[k])] = torch.tensor(misses[k])
            block_size[k] = max(-(-size // len(misses[k])), 1)
        all_keys = torch.cat(keys)
        order = torch.argsort(all_keys)
        # one key past every real key, so a search never runs off the end
        self.register_buffer("keys", torch.cat([all_keys[order],
                                                torch.tensor([num_features << KEY_BITS])]))
        self.register_buffer("rows", torch.cat([torch.cat(rows)[order],
                                                torch.zeros(1, dtype=torch.int64)]))
        self.register_buffer("space", space)
        self.register_buffer("fallback", fallback)
        self.register_buffer("block_size", block_size)
        self.register_buffer("is_raw", space > 0)
        self.num_features = num_features
        self.multiplier = ZCH_HASH_MULTIPLIER  # attributes: TorchScript reads no globals
        self.key_bits = KEY_BITS

    def forward(self, values: Tensor, offsets: Tensor, batch: int) -> Tensor:
        if not self.enabled:
            return values
        bags = self.num_features * batch
        position = torch.arange(values.size(0), device=values.device)
        bag = torch.bucketize(position, offsets[1:], right=True)
        in_bag = bag < bags
        feature = torch.where(in_bag, bag // max(batch, 1), 0)
        raw = self.is_raw[feature] & in_bag
        size = self.space[feature]
        torch._assert_async((((values >= 0) & (values < size)) | ~raw).all(),
                            "a raw id lies outside its feature's raw id space")
        scrambled = (values * self.multiplier) & (size - 1).clamp(min=0)
        key = scrambled + (feature << self.key_bits)
        position = torch.searchsorted(self.keys, key)
        hit = self.keys[position] == key
        block = torch.div(scrambled, self.block_size[feature], rounding_mode="floor")
        mapped = torch.where(hit, self.rows[position], self.fallback[feature, block])
        return torch.where(raw, mapped, values)


def freeze_raw_ids(model: DLRM, spec: DatasetSpec, config: ModelConfig
                   ) -> tuple[DLRM, FrozenIdMap]:
    """``model`` (unsharded, trained on ``spec``) as a plain DLRM with the same weights and the
    frozen mapping of its raw ids (see the module doc); a model without raw-id features is
    returned as it is, with a mapping that passes ids through."""
    names = [f.name for f in spec.sparse_features]
    managed = model.sparse_arch.managed_collision_collection
    if managed is None:
        return model, FrozenIdMap(len(names), [None] * len(names))
    modules = managed._managed_collision_collection._managed_collision_modules
    rows = {c.name: c.num_embeddings for c in managed.embedding_bag_configs()}
    plain_spec = dataclasses.replace(spec, sparse_features=tuple(
        dataclasses.replace(f, raw_ids=False, num_embeddings=rows[f"t_{f.name}"])
        if f.raw_ids else f for f in spec.sparse_features))
    wide = None if model.wide is None else model.wide.feature_names  # those it was trained with
    plain = build_dlrm(plain_spec, config, device="cpu", wide_features=wide)
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("sparse_arch.")}
    tables: dict[str, Tensor] = {}
    for collection in (model.sparse_arch.embedding_bag_collection, managed._embedding_module):
        if collection is not None:
            for name, bag in collection.embedding_bags.items():
                tables[name] = bag.weight.detach()
    for name in plain.sparse_arch.embedding_bag_collection.embedding_bags:
        state[f"sparse_arch.embedding_bag_collection.embedding_bags.{name}.weight"] = tables[name]
    plain.load_state_dict(state)
    plain.eval()
    raw: list[tuple[int, Tensor, Tensor, int] | None] = []
    for f in spec.sparse_features:
        if not f.raw_ids:
            raw.append(None)
            continue
        mc = modules[f"t_{f.name}"]
        # ids without a row: the row they had in training (per row block when it was sharded)
        segments = mc._miss_segments
        miss = mc.output_size() - 1 if segments is None else [e - 1 for e in segments[1:]]
        raw.append((raw_id_space(f), mc._mch_sorted_raw_ids.detach().clone(),
                    mc._mch_remapped_ids_mapping.detach().clone(), miss))
    return plain, FrozenIdMap(len(names), raw)
