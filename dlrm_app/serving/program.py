"""The serving programs of a ``.pt2`` artifact: plain ``nn.Module`` s that ``torch.export``
traces with a dynamic batch and AOTInductor compiles (see :mod:`dlrm_app.serving.export`).

``EncodedPredictor``: ``(dense [B, D] f32, values [N] i64, offsets [F*B + 1] i64) -> [B] f32``
    The DLRM from encoded inputs, bags key-major as a KeyedJaggedTensor's ``values()`` /
    ``offsets()``. Its quantized tables are looked up by :class:`QuantLookup`; raw ids of a
    model trained with ``--id-mapping zch`` are first mapped to rows by the frozen mapping
    (:class:`dlrm_app.id_map.FrozenIdMap`).
``WideLookup``: the wide part of a DLRM trained with ``--wide`` (the default): each id's
    learned scalar summed per row, plus the linear term of the dense features, in float32.
``RawEncoder``: ``(dense_raw [B, D] f32, cat_raw [B, F] i64) -> (dense, values, offsets)``
    The dataset's preprocessing for one-hot raw rows (log transform; hashing or the training
    vocabulary), producing the predictor's inputs.

Inputs the program cannot serve (an id outside its table, malformed offsets, a negative raw
categorical value) fail a runtime assertion inside the compiled program (a ``RuntimeError``);
nothing reads outside a table. Shapes are checked by the loader (:mod:`dlrm_app.serving.artifact`)
before a call, and by AOTInductor itself when ``AOTI_RUNTIME_CHECK_INPUTS=1``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from recsys_core.inference import QuantEmbeddingBagCollection
from recsys_core.kernels.quant_tbe import dequantize_rows

VOCABULARY_KEY_BITS = 32
"""Raw categorical values below ``2**32`` (Criteo's 8 hex digits) can be in a vocabulary; the
encoder looks every feature up in one sorted array of ``feature << 32 | value`` keys."""

LOOKUPS = ("fbgemm", "torch")
"""``fbgemm``: FBGEMM's int-n-bit kernel (the loading process imports ``fbgemm_gpu``);
``torch``: gather + dequantize + sum in plain torch ops (the program needs torch only)."""


def value_bags(values: Tensor, offsets: Tensor, bags: int, batch: int
               ) -> tuple[Tensor, Tensor, Tensor]:
    """For each value of a key-major ``(values, offsets)`` input of ``bags`` bags: its bag,
    whether it lies in one (values past the last bag belong to none), and its feature."""
    position = torch.arange(values.size(0), device=values.device)
    bag = torch.bucketize(position, offsets[1:], right=True)
    in_bag = bag < bags
    return bag, in_bag, torch.where(in_bag, bag // batch, 0)


class WideLookup(nn.Module):
    """The serving form of a trained :class:`dlrm_app.model.WidePart`: ``(dense [B, N],
    values [N'], offsets [F*B + 1], batch) -> [B, 1]`` float32, the ids' scalars summed over
    every feature that has a wide table (all features in the model's order) plus the dense
    linear term. Ids are checked by the main lookup (the same tables' rows)."""

    def __init__(self, wide: nn.Module, feature_names: list[str]) -> None:
        super().__init__()
        tables = wide.tables
        weights = {} if tables is None else {
            c.feature_names[0]: tables.embedding_bags[c.name].weight.detach().float().reshape(-1)
            for c in tables.embedding_bag_configs()}
        self.num_features = len(feature_names)
        parts, first, has, start = [], [], [], 0
        for name in feature_names:
            first.append(start)
            has.append(name in weights)
            if name in weights:
                parts.append(weights[name])
                start += weights[name].numel()
        self.register_buffer("table", torch.cat(parts) if parts else torch.zeros(1))
        self.register_buffer("first_row", torch.tensor(first, dtype=torch.int64))
        self.register_buffer("has_table", torch.tensor(has, dtype=torch.bool))
        self.dense = wide.dense

    def forward(self, dense: Tensor, values: Tensor, offsets: Tensor, batch: int) -> Tensor:
        bags = self.num_features * batch
        bag, in_bag, feature = value_bags(values, offsets, bags, batch)
        use = in_bag & self.has_table[feature]
        row = torch.where(use, self.first_row[feature] + values, 0)
        scalars = self.table.index_select(0, row) * use
        sums = torch.zeros(bags, dtype=scalars.dtype, device=scalars.device)
        sums = sums.index_add(0, bag.clamp(max=bags - 1), scalars)
        return sums.view(self.num_features, batch).sum(0).unsqueeze(1) + \
            self.dense(dense).float()


class QuantLookup(nn.Module):
    """SUM/MEAN-pooled lookups over the quantized tables of a DLRM (one table per feature, one
    dim): ``(values [N], offsets [F*B + 1], batch) -> [B, F, D]`` float32."""

    def __init__(self, ebc: QuantEmbeddingBagCollection, lookup: str) -> None:
        super().__init__()
        if lookup not in LOOKUPS:
            raise ValueError(f"lookup must be one of {LOOKUPS}, got {lookup!r}")
        if ebc.is_weighted():
            raise ValueError("weighted embedding bags cannot be exported to .pt2 yet; use "
                             "--format torchscript")
        tbe = ebc.tbe
        if len(set(tbe.dims)) != 1 or len(set(tbe.tys)) != 1:
            raise ValueError(f"a .pt2 export needs one embedding dim and dtype for every table, "
                             f"got dims {sorted(set(tbe.dims))}, types {sorted(set(tbe.tys))}")
        self.lookup = lookup
        self.num_features = len(tbe.dims)
        self.dim = tbe.dims[0]
        self.weight_type = tbe.tys[0]
        pooling_mean = [bool(m) for m in tbe.column_is_mean.view(self.num_features, self.dim)[:, 0]]
        self.has_mean = any(pooling_mean)
        self.register_buffer("rows", torch.tensor(tbe.rows, dtype=torch.int64))
        self.register_buffer("is_mean", torch.tensor(pooling_mean))
        if lookup == "fbgemm":
            if not tbe.use_fbgemm:
                raise ValueError("the FBGEMM lookup needs fbgemm_gpu; export with --lookup torch")
            self.tbe = tbe
        else:
            # every feature's table, row after row, in one [sum of rows, row bytes] buffer
            views = [tbe.table_weights()[t] for t in tbe.feature_table_map]
            self.register_buffer("table", torch.cat(views).contiguous())
            starts = torch.tensor([0] + [v.shape[0] for v in views[:-1]]).cumsum(0)
            self.register_buffer("first_row", starts)

    def forward(self, values: Tensor, offsets: Tensor, batch: int) -> Tensor:
        num_values = values.size(0)
        bags = self.num_features * batch
        bag, in_bag, feature = value_bags(values, offsets, bags, batch)
        lengths = offsets[1:] - offsets[:-1]
        torch._assert_async((offsets[0] == 0) & (lengths >= 0).all() & (offsets[-1] <= num_values),
                            "offsets must start at 0, not decrease, and end within values")
        ok = ((values >= 0) & (values < self.rows[feature])) | ~in_bag
        torch._assert_async(ok.all(), "an id lies outside [0, num_embeddings) of its table")
        if self.lookup == "fbgemm":
            t = self.tbe
            pooled = torch.ops.fbgemm.int_nbit_split_embedding_codegen_lookup_function(
                dev_weights=t.weights, uvm_weights=t.weights.new_empty(0),
                weights_placements=t.weights_placements, weights_offsets=t.weights_offsets,
                weights_tys=t.weights_tys, D_offsets=t.D_offsets, total_D=t.max_dims[0],
                max_int2_D=t.max_dims[1], max_int4_D=t.max_dims[2], max_int8_D=t.max_dims[3],
                max_float16_D=t.max_dims[4], max_float32_D=t.max_dims[5], indices=values,
                offsets=offsets, pooling_mode=0, indice_weights=None, output_dtype=0,
                lxu_cache_weights=t.weights.new_empty(0, 0),
                lxu_cache_locations=offsets.new_empty(0, dtype=torch.int32),
                row_alignment=t.row_alignment)
            pooled = pooled.view(batch, self.num_features, self.dim)
        else:
            row = torch.where(in_bag, self.first_row[feature] + values, 0)
            vectors = dequantize_rows(self.table.index_select(0, row), self.dim, self.weight_type)
            sums = torch.zeros(bags, self.dim, dtype=vectors.dtype, device=vectors.device)
            sums = sums.index_add(0, bag.clamp(max=bags - 1), vectors * in_bag.unsqueeze(1))
            pooled = sums.view(self.num_features, batch, self.dim).transpose(0, 1)
        if self.has_mean:
            per_bag = lengths.view(self.num_features, batch).t().clamp(min=1).to(pooled.dtype)
            divisor = torch.where(self.is_mean, per_bag, torch.ones_like(per_bag))
            pooled = pooled / divisor.unsqueeze(2)
        return pooled


class EncodedPredictor(nn.Module):
    """``(dense, values, offsets) -> probabilities [B]`` of a quantized DLRM."""

    def __init__(self, model: nn.Module, lookup: str, id_map: nn.Module | None = None) -> None:
        super().__init__()
        ebc = model.sparse_arch.embedding_bag_collection
        if not isinstance(ebc, QuantEmbeddingBagCollection):
            raise TypeError("quantize the model's embedding collection before exporting")
        self.lookup = QuantLookup(ebc, lookup)
        self.id_map = id_map  # raw ids -> rows (dlrm_app.id_map.FrozenIdMap), or None
        self.dense_arch = model.dense_arch
        self.inter_arch = model.inter_arch
        self.over_arch = model.over_arch
        self.wide = model.wide  # a WideLookup (see serving_form) or None

    def forward(self, dense: Tensor, values: Tensor, offsets: Tensor) -> Tensor:
        if self.id_map is not None:
            values = self.id_map(values, offsets, dense.size(0))
        sparse = self.lookup(values, offsets, dense.size(0))
        logits = self.over_arch(self.inter_arch(self.dense_arch(dense), sparse))
        if self.wide is not None:
            logits = logits + self.wide(dense, values, offsets, dense.size(0))
        return torch.sigmoid(logits.squeeze(1))


class RawEncoder(nn.Module):
    """One-hot raw rows -> the predictor's inputs, as the dataset's preprocessing does.

    ``moduli[k] > 0``: hash feature k's raw value modulo its table size; ``moduli[k] < 0``: the
    raw value is already an id in ``[0, -moduli[k])`` (checked). ``vocabulary``: per feature,
    the sorted raw values that have their own row, ``rows[k][i]`` the row of
    ``vocabulary[k][i]`` (``rows`` None: position + 1); every other value reads row 0.
    """

    def __init__(self, num_dense: int, moduli: Tensor, vocabulary: list[Tensor] | None,
                 log_transform: bool, rows: list[Tensor] | None = None) -> None:
        super().__init__()
        self.num_dense = num_dense
        self.num_sparse = moduli.numel()
        self.key_bits = VOCABULARY_KEY_BITS
        self.log_transform = log_transform
        self.use_vocabulary = vocabulary is not None
        self.register_buffer("moduli", moduli.clamp(min=1))
        self.register_buffer("check_only", moduli < 0)
        self.register_buffer("limit", torch.where(moduli < 0, -moduli, torch.iinfo(torch.int64).max))
        if vocabulary is not None:
            if len(vocabulary) != self.num_sparse:
                raise ValueError(f"{len(vocabulary)} vocabularies for {self.num_sparse} features")
            if rows is not None and [r.numel() for r in rows] != [v.numel() for v in vocabulary]:
                raise ValueError("one row per vocabulary value, feature by feature")
            keys, starts = [], [0]
            for k, vocab in enumerate(vocabulary):
                vocab = vocab.to(torch.int64)
                if vocab.numel() and (int(vocab.min()) < 0 or
                                      int(vocab.max()) >= 1 << VOCABULARY_KEY_BITS or
                                      bool((vocab[1:] <= vocab[:-1]).any())):
                    raise ValueError(f"feature {k}: the vocabulary must be sorted, unique "
                                     f"values in [0, 2**{VOCABULARY_KEY_BITS})")
                keys.append(vocab + (k << VOCABULARY_KEY_BITS))
                starts.append(starts[-1] + vocab.numel())
            all_keys = torch.cat(keys) if keys else torch.zeros(0, dtype=torch.int64)
            # one key past every real key, so a search never runs off the end
            sentinel = torch.tensor([self.num_sparse << VOCABULARY_KEY_BITS])
            self.register_buffer("keys", torch.cat([all_keys, sentinel]))
            self.register_buffer("vocab_start", torch.tensor(starts[:-1], dtype=torch.int64))
        else:  # unused; present so that TorchScript compiles the vocabulary branch
            self.register_buffer("keys", torch.zeros(1, dtype=torch.int64))
            self.register_buffer("vocab_start", torch.zeros(self.num_sparse, dtype=torch.int64))
        # each key's row, where rows are not in key order (a vocabulary grown by added days):
        # int32 (rows < 2**31), 4 bytes per id beside the key's 8
        self.explicit_rows = vocabulary is not None and rows is not None
        if self.explicit_rows:
            assert rows is not None
            self.register_buffer("rows", torch.cat(
                [r.to(torch.int32) for r in rows] + [torch.zeros(1, dtype=torch.int32)]))
        else:
            self.register_buffer("rows", torch.zeros(1, dtype=torch.int32))

    def forward(self, dense_raw: Tensor, cat_raw: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        batch = dense_raw.size(0)
        if self.log_transform:
            x = torch.nan_to_num(dense_raw.to(torch.float64), nan=0.0).clamp(min=0.0)
            dense = torch.log1p(x).to(torch.float32)
        else:
            dense = dense_raw.to(torch.float32)
        cat = cat_raw.to(torch.int64)
        torch._assert_async((cat >= 0).all(), "categorical raw values must be >= 0 (missing is 0)")
        if self.use_vocabulary:
            feature = torch.arange(self.num_sparse, dtype=torch.int64, device=cat.device)
            small = cat < (1 << self.key_bits)
            key = torch.where(small, cat, torch.zeros_like(cat)) + (feature << self.key_bits)
            position = torch.searchsorted(self.keys, key)
            hit = (self.keys[position] == key) & small
            if self.explicit_rows:
                ids = torch.where(hit, self.rows[position].to(torch.int64), 0)
            else:
                ids = torch.where(hit, position - self.vocab_start + 1, 0)
        else:
            torch._assert_async((cat < self.limit).all(),
                                "an already-encoded id lies outside [0, num_embeddings)")
            ids = torch.where(self.check_only, cat, torch.remainder(cat, self.moduli))
        values = ids.t().reshape(-1)  # key-major: feature 0's B ids, then feature 1's, ...
        offsets = torch.arange(self.num_sparse * batch + 1, dtype=torch.int64,
                               device=cat.device)
        return dense, values, offsets
