"""Quantized TBE kernels: our quantizer and layout == FBGEMM's, FBGEMM lookup == torch lookup."""

from __future__ import annotations

import pytest
import torch

from recsys_core.inference import QuantTBEBag
from recsys_core.kernels import fbgemm_available
from recsys_core.kernels.quant_tbe import (
    QuantTableSpec,
    WeightType,
    build_fbgemm_int_nbit_tbe,
    dequantize_rows,
    quantize_rows,
    row_error_bound,
    table_offsets,
)

needs_fbgemm = pytest.mark.skipif(not fbgemm_available(), reason="fbgemm_gpu is not importable")
W = WeightType

# Every type, odd and even dims, a table shared by two features.
SPECS = [
    QuantTableSpec("a", 10, 8, W.INT8),
    QuantTableSpec("b", 7, 6, W.INT4),
    QuantTableSpec("c", 5, 3, W.FP16),
    QuantTableSpec("d", 9, 4, W.INT2),
    QuantTableSpec("e", 3, 5, W.INT8),
    QuantTableSpec("f", 4, 3, W.FP32),
]
FEATURE_TABLE_MAP = [0, 1, 1, 2, 3, 4, 5]
NAMES = [f"f{i}" for i in range(len(FEATURE_TABLE_MAP))]


def quantized_tables(seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(s.rows, s.dim, generator=gen) for s in SPECS]
    return weights, [quantize_rows(w, s.weight_type, s.name) for w, s in zip(weights, SPECS, strict=True)]


def batch(seed: int, size: int, weighted: bool, dtype: torch.dtype = torch.int64):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 5, (len(FEATURE_TABLE_MAP) * size,), generator=gen)
    lengths[0] = 0
    ids = torch.cat([
        torch.randint(0, SPECS[t].rows, (int(lengths[f * size : (f + 1) * size].sum()),), generator=gen)
        for f, t in enumerate(FEATURE_TABLE_MAP)
    ])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    psw = torch.rand(ids.numel(), generator=gen) if weighted else None
    return ids.to(dtype), offsets.to(dtype), psw


def bag(tables: list[torch.Tensor], use_fbgemm: bool | None, mean: bool = False, **kw) -> QuantTBEBag:
    return QuantTBEBag(SPECS, FEATURE_TABLE_MAP, NAMES, [mean] * len(NAMES), tables=tables,
                       use_fbgemm=use_fbgemm, **kw)


# ---- quantization numerics ---------------------------------------------------------------------
@needs_fbgemm
@pytest.mark.parametrize("weight_type", [W.INT8, W.INT4, W.INT2])
@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 300.0])
def test_quantizer_matches_fbgemm_bit_for_bit(weight_type: WeightType, magnitude: float) -> None:
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(300, 16, generator=gen) * magnitude
    weight[0] = 0.3  # a constant row (scale 1 by convention)
    ours = quantize_rows(weight, weight_type)
    # FBGEMM's stand-alone format puts [scale, bias] after the codes; the TBE format before.
    theirs = torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(weight, weight_type.bits)
    codes = 16 * weight_type.bits // 8
    assert torch.equal(ours[:, 4:], theirs[:, :codes])
    assert torch.equal(ours[:, :4], theirs[:, codes : codes + 4])


def test_int4_row_format_by_hand() -> None:
    """Row [0, 0.1, 0.2, 1.5]: scale fp16(1.5 / 15), bias 0, codes [0, 1, 2, 15], two per byte
    with the lower index in the low nibble."""
    row = torch.tensor([[0.0, 0.1, 0.2, 1.5]])
    rows = quantize_rows(row, W.INT4)
    scale, bias = rows[:, :4].view(torch.float16)[0].tolist()
    assert scale == pytest.approx(0.1, rel=1e-3) and bias == 0.0
    assert rows[0, 4:].tolist() == [0x10, 0xF2]  # (1 << 4) | 0, (15 << 4) | 2
    assert torch.allclose(dequantize_rows(rows, 4, int(W.INT4)), row, atol=0.05)


@pytest.mark.parametrize("weight_type", list(W))
def test_dequantize_error_within_row_bound(weight_type: WeightType) -> None:
    gen = torch.Generator().manual_seed(2)
    weight = torch.cat([
        torch.randn(200, 8, generator=gen),
        torch.rand(50, 8, generator=gen) * 1e-2 + 3.0,  # narrow rows far from 0: the bias term
        torch.randn(50, 8, generator=gen) * 1e-6,  # fp16-subnormal scales
    ])
    rows = quantize_rows(weight, weight_type)
    error = (dequantize_rows(rows, 8, int(weight_type)) - weight).abs().max(dim=1).values
    bound = row_error_bound(weight, rows, weight_type)
    assert bool((error <= bound).all()), (error - bound).max()


@pytest.mark.parametrize(
    "spec_args, match",
    [
        (("t", 10, 5, W.INT4), r"table 't': INT4 packs 2 values per byte.*multiple of 2; got 5"),
        (("t", 10, 6, W.INT2), r"INT2 packs 4 values per byte.*multiple of 4; got 6"),
        (("t", 0, 4, W.INT8), r"rows and dim must be > 0"),
    ],
)
def test_bad_table_specs(spec_args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        QuantTableSpec(*spec_args)


def test_quantize_refuses_what_fp16_cannot_hold() -> None:
    with pytest.raises(ValueError, match=r"table 'x': the weight has inf or NaN"):
        quantize_rows(torch.tensor([[1.0, float("nan")]]), W.INT8, "x")
    with pytest.raises(ValueError, match=r"table 'x': values reach 1e\+06, beyond fp16's range"):
        quantize_rows(torch.tensor([[1e6, 0.0]]), W.FP16, "x")
    with pytest.raises(ValueError, match=r"row scales"):
        quantize_rows(torch.tensor([[0.0, 0.0, 0.0, 3e5]]), W.INT2, "x")


# ---- layout and lookups ------------------------------------------------------------------------
@needs_fbgemm
@pytest.mark.parametrize("row_alignment", [1, 16])
def test_layout_is_fbgemms(row_alignment: int) -> None:
    _, tables = quantized_tables()
    ours = bag(tables, use_fbgemm=True, row_alignment=row_alignment)
    theirs = build_fbgemm_int_nbit_tbe(SPECS, FEATURE_TABLE_MAP, tables, pooling_mean=False,
                                       device=torch.device("cpu"), row_alignment=row_alignment)
    offsets = table_offsets(SPECS, row_alignment)
    assert offsets[:-1] == theirs.weights_physical_offsets
    assert offsets[-1] == theirs.host_size
    assert torch.equal(ours.weights, theirs.weights_host)


@needs_fbgemm
@pytest.mark.parametrize("row_alignment", [1, 16])
@pytest.mark.parametrize("mean", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_fbgemm_equals_torch_and_fbgemm_module(
    row_alignment: int, mean: bool, weighted: bool, dtype: torch.dtype
) -> None:
    _, tables = quantized_tables()
    ids, offsets, psw = batch(3, 6, weighted, dtype)
    fbgemm = bag(tables, use_fbgemm=True, mean=mean, row_alignment=row_alignment)
    fallback = bag(tables, use_fbgemm=False, mean=mean, row_alignment=row_alignment)
    reference = build_fbgemm_int_nbit_tbe(SPECS, FEATURE_TABLE_MAP, tables, pooling_mean=mean,
                                          device=torch.device("cpu"), row_alignment=row_alignment)
    out = fbgemm(ids, offsets, psw)
    assert out.shape == (6, sum(SPECS[t].dim for t in FEATURE_TABLE_MAP))
    torch.testing.assert_close(fallback(ids, offsets, psw), out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(reference(ids, offsets, psw), out, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("use_fbgemm", [pytest.param(True, marks=needs_fbgemm), False])
def test_lookup_equals_dequantized_embedding_bag(use_fbgemm: bool) -> None:
    _, tables = quantized_tables()
    ids, offsets, psw = batch(4, 5, weighted=True)
    out = bag(tables, use_fbgemm)(ids, offsets, psw)
    expected = []
    for f, t in enumerate(FEATURE_TABLE_MAP):
        spec = SPECS[t]
        dense = dequantize_rows(tables[t], spec.dim, int(spec.weight_type))
        bag_offsets = offsets[f * 5 : (f + 1) * 5 + 1]
        lo, hi = int(bag_offsets[0]), int(bag_offsets[-1])
        expected.append(torch.nn.functional.embedding_bag(
            ids[lo:hi], dense, bag_offsets - lo, mode="sum", per_sample_weights=psw[lo:hi],
            include_last_offset=True,
        ))
    torch.testing.assert_close(out, torch.cat(expected, dim=1), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("use_fbgemm", [pytest.param(True, marks=needs_fbgemm), False])
def test_empty_batch_and_empty_bags(use_fbgemm: bool) -> None:
    _, tables = quantized_tables()
    lookup = bag(tables, use_fbgemm, mean=True)
    total = sum(SPECS[t].dim for t in FEATURE_TABLE_MAP)
    empty = torch.zeros(0, dtype=torch.int64)
    assert lookup(empty, torch.zeros(1, dtype=torch.int64)).shape == (0, total)
    out = lookup(empty, torch.zeros(len(NAMES) * 3 + 1, dtype=torch.int64))
    assert torch.equal(out, torch.zeros(3, total))


@pytest.mark.parametrize("use_fbgemm", [pytest.param(True, marks=needs_fbgemm), False])
@pytest.mark.parametrize(
    "bad_id",
    [
        -1,  # FBGEMM 1.8 reads -1 as a pruned row (zeros) even in FATAL mode
        -5,
        7,  # table "b" has 7 rows; FBGEMM's kernel alone accepts ids up to its 128-byte padding
        1000,
    ],
)
def test_out_of_range_ids_raise(use_fbgemm: bool, bad_id: int) -> None:
    _, tables = quantized_tables()
    lookup = bag(tables, use_fbgemm)
    ids = torch.ones(len(NAMES), dtype=torch.int64)
    ids[1] = bad_id  # feature f1 -> table "b"
    offsets = torch.arange(len(NAMES) + 1)
    with pytest.raises((RuntimeError, IndexError)):
        lookup(ids, offsets)


def test_offsets_must_cover_every_feature() -> None:
    _, tables = quantized_tables()
    with pytest.raises(ValueError, match=r"num_features \* B \+ 1 entries \(7 features\); got 5"):
        bag(tables, use_fbgemm=False)(torch.zeros(4, dtype=torch.int64), torch.arange(5))

