"""Reduced-precision embedding collectives (``fbgemm_qcomm_codec``, TorchRec's qcomms).

Codecs against plain torch casts; the registry's keys and TorchRec's validation; and sharded
collections over real gloo ranks against the unsharded module: with BF16 codecs every output
the all-to-all carries is the reference rounded to bf16, the gradient reaching the tables is the
reference gradient rounded to bf16 (so one SGD step equals the reference's step on that
rounded gradient), and the payloads on the wire are bf16 (half the bytes).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from gloo_setup import (
    concat_ranks,
    rank_batches,
    rank_rows,
    shard_beside_reference,
    sum_and_mean_tables,
    two_table_plans,
)

from recsys_core import EmbeddingBagCollection, EmbOptimType
from recsys_core.distributed import EmbeddingBagCollectionSharder, shm_comm, table_wise
from recsys_core.distributed.fbgemm_qcomm_codec import (
    CastCommCodec,
    CommType,
    QCommsConfig,
    get_qcomm_codecs,
    get_qcomm_codecs_registry,
)
from recsys_core.distributed.types import CommOp, QuantizedCommCodecs
from recsys_core.kernels import quant_comm
from recsys_core.testing import run_gloo

# -- codecs ------------------------------------------------------------------------------------


def test_cast_codecs_equal_torch_casts_with_scale_and_fp16_clamp() -> None:
    x = torch.tensor([1.0 + 2**-10, -3.0e5, 7.0e4, 1e-9, -0.0, 123.456])
    bf16 = CastCommCodec(CommType.BF16)
    assert bf16.encode(x).dtype == torch.bfloat16
    assert torch.equal(bf16.decode(bf16.encode(x)), x.to(torch.bfloat16).float())
    fp16 = CastCommCodec(CommType.FP16)
    # past fp16's range: clamped to +-65504 instead of becoming inf
    assert fp16.decode(fp16.encode(x)).tolist()[1:3] == [-65504.0, 65504.0]
    scaled = CastCommCodec(CommType.FP16, loss_scale=2.0**20)
    # 1e-9 flushes to 0 in fp16; scaled by 2^20 first it survives, and decode divides again
    assert fp16.decode(fp16.encode(x))[3] == 0
    got = scaled.decode(scaled.encode(x))[3].item()
    assert got == pytest.approx(1e-9, rel=1e-3)
    # ... while a large value scaled past fp16's range is clamped
    assert scaled.encode(x)[0].item() == 65504.0
    assert CastCommCodec(CommType.FP32).encode(x) is not None
    assert torch.equal(CastCommCodec(CommType.FP32).decode(CastCommCodec(CommType.FP32).encode(x)), x)


def test_registry_keys_defaults_and_validation() -> None:
    assert get_qcomm_codecs_registry(QCommsConfig()) is None  # FP32 both ways: nothing to do
    registry = get_qcomm_codecs_registry(
        QCommsConfig(forward_precision=CommType.BF16, backward_precision=CommType.FP16))
    assert registry is not None
    assert sorted(registry) == sorted(op.name for op in CommOp)
    codecs = registry["POOLED_EMBEDDINGS_ALL_TO_ALL"]
    assert codecs.forward.quantized_dtype == torch.bfloat16
    assert codecs.backward.quantized_dtype == torch.float16
    only = get_qcomm_codecs_registry(
        QCommsConfig(forward_precision="bf16"), comm_ops=[CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL])
    assert list(only) == ["POOLED_EMBEDDINGS_ALL_TO_ALL"]
    assert only["POOLED_EMBEDDINGS_ALL_TO_ALL"].backward.quantized_dtype == torch.float32
    assert QuantizedCommCodecs().is_identity()
    assert str(CommType.BF16) == "bf16"
    assert QCommsConfig(backward_precision=CommType.FP8, fp8_quantize_dim=8).fp8_quantize_dim_bwd == 8
    with pytest.raises(ValueError, match="positive int"):
        QCommsConfig(forward_precision=CommType.FP8, fp8_quantize_dim=0)
    with pytest.raises(ValueError, match="fp8_quantize_dim"):
        QCommsConfig(forward_precision=CommType.BF16, fp8_quantize_dim=4)
    with pytest.raises(ValueError, match="not one of"):
        QCommsConfig(backward_precision="bf17")
    with pytest.raises(ValueError, match="positive"):
        QCommsConfig(forward_precision=CommType.FP16, forward_loss_scale=0.0)


def test_int8_rowwise_hand_computed_on_fbgemm_and_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.tensor([[0.0, 1.0, 2.0, 3.0],      # range 3: inverse 255 / (3 + 1e-8) = 85 in fp32
                      [-1.0, 0.5, 1.0, 2.0],     # (0.5 + 1) * 85 = 127.5: a tie, to even 128
                      [0.0, 2.5, 3.5, 255.0]])   # inverse 1: 2.5 -> 2, 3.5 -> 4 (ties to even)
    want_codes = [[0, 85, 170, 255], [0, 128, 170, 255], [0, 2, 4, 255]]
    want_scale = torch.tensor([3.0, 3.0, 255.0]) / 255.0
    want_bias = [0.0, -1.0, 0.0]
    codec = get_qcomm_codecs(QCommsConfig(forward_precision=CommType.INT8)).forward
    for fbgemm in (True, False):
        if not fbgemm:
            monkeypatch.setattr(quant_comm, "fbgemm_available", lambda: False)
        ctx = codec.create_context()
        assert ctx.row_dim == 32  # FBGEMM's default block
        ctx.row_dim = 4
        q = codec.encode(x, ctx).view(3, 12)
        assert ctx.row_dim_quant == 12 and q.dtype == torch.uint8
        assert q[:, :4].tolist() == want_codes
        floats = q[:, 4:].contiguous().view(torch.float32)
        assert torch.equal(floats[:, 0], want_scale) and floats[:, 1].tolist() == want_bias
        got = codec.decode(q.view(-1), ctx).view(3, 4)
        want = torch.tensor(want_codes).float() * want_scale[:, None] + torch.tensor(want_bias)[:, None]
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_hfp8_values_and_fallback_parity(monkeypatch: pytest.MonkeyPatch) -> None:
    codec = get_qcomm_codecs(QCommsConfig(forward_precision=CommType.FP8)).forward
    assert codec.create_context().row_dim == -1  # no row dim: hfp8, one byte per element
    x = torch.tensor([[0.5, 1.0, -3.0, 2.0**-17, 2.0**-18, 2.0**-14, float("nan"), -0.0]])
    # 1-4-3, bias 15: max 0.9375 (clamped, NaN too), smallest subnormal 2^-17 (2^-18 ties to 0)
    want = [0.5, 0.9375, -0.9375, 2.0**-17, 0.0, 2.0**-14, 0.9375, -0.0]
    q = codec.encode(x)
    assert q.dtype == torch.uint8 and q.shape == x.shape
    assert codec.decode(q).tolist() == [want]
    assert q[0, 1].item() == 0b0_1110_111 and q[0, 7].item() == 0b1000_0000
    # the pure-torch encoder and decoder equal FBGEMM's on every code and every midpoint
    codes = torch.arange(256, dtype=torch.uint8)
    for ebits, bias, max_pos in (quant_comm.HFP8_FWD, quant_comm.HFP8_BWD):
        grid = quant_comm._hfp8_decode_torch(codes, ebits, bias)
        probe = torch.cat([grid, (grid[:-1] + grid[1:]) / 2, torch.randn(4000) * 0.1])
        assert torch.equal(quant_comm.hfp8_decode(codes, ebits, bias), grid)
        assert torch.equal(quant_comm.hfp8_encode(probe, ebits, bias, max_pos),
                           quant_comm._hfp8_encode_torch(probe, ebits, bias, max_pos))


@pytest.mark.parametrize("precision, row_dim", [(CommType.FP8, None), (CommType.FP8, 8),
                                                (CommType.FP8, 6), (CommType.INT8, None)])
def test_fp8_int8_round_trips_and_sizes(precision: CommType, row_dim: int | None) -> None:
    torch.manual_seed(0)
    x = torch.rand(12, 16)
    codecs = get_qcomm_codecs(QCommsConfig(forward_precision=precision, backward_precision=precision,
                                           fp8_quantize_dim=row_dim))
    for codec, tol in ((codecs.forward, 0.05), (codecs.backward, 0.1)):
        ctx = codec.create_context()
        q = codec.encode(x, ctx)
        assert q.numel() == codec.calc_quantized_size(x.numel(), ctx)
        got = codec.decode(q, ctx).view(x.shape)
        # TorchRec's FP8 tolerance; backward FP8 row-wise is 1-5-2 (one mantissa bit fewer)
        torch.testing.assert_close(got, x, atol=tol, rtol=tol)
    if row_dim == 6:
        assert codecs.forward.calc_quantized_size(12, codecs.forward.create_context()) == 2 * 16
        with pytest.raises(RuntimeError, match="multiple of row dim 6"):
            codecs.forward.calc_quantized_size(13, codecs.forward.create_context())


def test_fp8_rowwise_scale_and_padding(monkeypatch: pytest.MonkeyPatch) -> None:
    codec = get_qcomm_codecs(QCommsConfig(forward_precision=CommType.FP8, fp8_quantize_dim=4)).forward
    x = torch.tensor([1.0, -2.0, 0.5, 0.25])  # scale = 0.9375 / 2: every value exact in 1-4-3
    ctx = codec.create_context()
    q = codec.encode(x, ctx)
    assert q.numel() == 12 and q[4:8].view(torch.float32).item() == 0.9375 / 2
    assert torch.equal(codec.decode(q, ctx), x)
    payload = torch.zeros(3, 10)
    monkeypatch.setenv("TORCHREC_ENABLE_FP8_ROWWISE_PADDING", "1")
    assert codec.padded_size(payload, [10, 3], 0, ctx) == (12, 2)
    assert ctx.padded_dim_sum_per_rank == [12, 4]
    monkeypatch.setenv("TORCHREC_ENABLE_FP8_ROWWISE_PADDING", "0")
    assert codec.padded_size(payload, [10, 3], 0, codec.create_context()) == (10, 0)


def test_mx4_round_trip_and_size() -> None:
    if not quant_comm.fbgemm_available():
        pytest.skip("MX4 uses fbgemm_gpu's reference implementation")
    codec = get_qcomm_codecs(QCommsConfig(forward_precision=CommType.MX4)).forward
    ctx = codec.create_context()
    x = torch.rand(4, 64) * 2 - 1
    q = codec.encode(x, ctx)
    assert q.numel() == codec.calc_quantized_size(x.numel(), ctx) == 4 * 64 // 2 + 4 * 64 // 32
    torch.testing.assert_close(codec.decode(q, ctx).view(4, 64), x, atol=0.15, rtol=0.1)


def test_sharders_refuse_byte_codecs_and_reduce_scatter_falls_back() -> None:
    registry = get_qcomm_codecs_registry(
        QCommsConfig(forward_precision=CommType.FP8, backward_precision=CommType.FP8))
    assert registry is not None
    rs = registry["POOLED_EMBEDDINGS_REDUCE_SCATTER"]  # TorchRec's fallback for a reduction
    assert (rs.forward.quantized_dtype, rs.backward.quantized_dtype) == (torch.float16, torch.bfloat16)
    with pytest.raises(ValueError, match="POOLED_EMBEDDINGS_ALL_TO_ALL.*fp8 payloads"):
        EmbeddingBagCollectionSharder(qcomm_codecs_registry=registry)
    sharder = EmbeddingBagCollectionSharder()
    with pytest.raises(ValueError, match="int8"):
        sharder.qcomm_codecs_registry = get_qcomm_codecs_registry(
            QCommsConfig(backward_precision=CommType.INT8))
    assert sharder.qcomm_codecs_registry is None


# -- sharded, over gloo ------------------------------------------------------------------------

TABLES = sum_and_mean_tables()
LR, BATCH = 0.5, 3


def _plan(kind: str, world: int, local: int) -> dict:
    plans = two_table_plans("t_sum", "t_mean", world, local)
    plans["column_wise"]["t_mean"] = table_wise(rank=world - 1, compute_kernel="fused")
    return plans[kind]


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


def qcomm_worker(rank: int, world: int, kind: str) -> dict[str, object]:
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    torch.manual_seed(0)
    registry = get_qcomm_codecs_registry(
        QCommsConfig(forward_precision=CommType.BF16, backward_precision=CommType.BF16))
    sharded, reference = shard_beside_reference(
        EmbeddingBagCollection(TABLES), _plan(kind, world, local), world, local,
        fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR},
        qcomm_codecs_registry=registry)

    sent_dtypes: list[torch.dtype] = []
    original = dist.all_to_all_single
    original_shm = shm_comm.ShmGroup.all_to_all_single  # ranks on one host: shared memory

    def spy(output, input, *args, **kwargs):  # noqa: A002 (torch's names)
        if input.is_floating_point():
            sent_dtypes.append(input.dtype)
        return original(output, input, *args, **kwargs)

    def shm_spy(self, output, input, *args):  # noqa: A002
        if input.is_floating_point():
            sent_dtypes.append(input.dtype)
        return original_shm(self, output, input, *args)

    dist.all_to_all_single = spy
    shm_comm.ShmGroup.all_to_all_single = shm_spy
    try:
        kjts = rank_batches(7, world, ["f0", "f1", "f2"], [13, 13, 7], BATCH, empty_first=True)
        out = sharded(kjts[rank]).wait()
        values = out.values()
        upstream = torch.randn(world * BATCH, values.shape[1], generator=torch.Generator().manual_seed(3))
        values.backward(upstream[rank_rows(rank, BATCH)])
    finally:
        dist.all_to_all_single = original
        shm_comm.ShmGroup.all_to_all_single = original_shm

    ref_values = reference(concat_ranks(kjts)).values()
    expected = ref_values[rank_rows(rank, BATCH)].detach()
    if kind in ("table_wise", "column_wise"):
        # each pooled value travels once: the reference rounded to bf16
        torch.testing.assert_close(values.detach(), _bf16(expected), atol=1e-6, rtol=0)
        assert torch.equal(values.detach(), _bf16(values.detach()))
    else:
        # row-wise: the partial sums travel in bf16 and are added in fp32 after decoding
        torch.testing.assert_close(values.detach(), expected, atol=0.02, rtol=0.01)
        assert not torch.equal(values.detach(), expected)  # the payload was rounded
    # The reference's step on the bf16-rounded upstream gradient of the mean of the ranks'
    # losses (gradient division; dividing by 2 or 4 is exact): what the tables must hold
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    ref_values.backward(_bf16(upstream) / world)
    ref_opt.step()
    checked = 0
    for local_kernels in sharded.lookups:
        for shard, weight, _state in local_kernels.local_shards():
            full = reference.embedding_bags[shard.table].weight.detach()
            rows = slice(shard.row_offset, shard.row_offset + shard.rows)
            cols = slice(shard.col_offset, shard.col_offset + shard.cols)
            if kind.endswith("row_wise") and shard.table == "t_mean":
                # row-wise divides by the bag size before the gradient is encoded: the
                # rounding differs from the reference's by up to a bf16 step
                torch.testing.assert_close(weight, full[rows, cols], atol=0.01, rtol=0)
            else:
                torch.testing.assert_close(weight, full[rows, cols], atol=1e-6, rtol=1e-6)
            checked += 1
    return {"checked": checked, "sent": sorted({str(d) for d in sent_dtypes})}


@pytest.mark.parametrize("kind, world", [("table_wise", 2), ("column_wise", 2), ("row_wise", 2),
                                         ("table_row_wise", 4)])
@pytest.mark.slow
def test_bf16_comms_round_outputs_and_gradients_only(kind: str, world: int) -> None:
    local = 2 if kind == "table_row_wise" else world
    out = run_gloo(world, qcomm_worker, kind, local_world_size=local)
    assert sum(r["checked"] for r in out) >= len(TABLES)
    for r in out:
        assert r["sent"] == ["torch.bfloat16"], r  # every float payload on the wire was bf16


def test_sharder_accepts_the_registry_positionally_as_torchrec() -> None:
    registry = get_qcomm_codecs_registry(QCommsConfig(forward_precision=CommType.FP16))
    sharder = EmbeddingBagCollectionSharder(None, registry)
    assert sharder.qcomm_codecs_registry is registry
