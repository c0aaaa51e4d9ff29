"""FP16 tables on the fused kernels, as TorchRec keeps them (``weights_precision`` from the
table's data_type): float16 weights, float32 optimizer states, bags summed and returned in
float32. The torch kernel gives FBGEMM's bits, and both follow the rounding rule written out by
hand here: SGD and Adagrad round their step to float16 and add it; the other optimizers update
in float32 and round once to nearest."""

from __future__ import annotations

import pytest
import torch

from recsys_core.kernels import fbgemm_available
from recsys_core.kernels.config import EmbOptimType, FusedOptimizerConfig, KernelBackend
from recsys_core.kernels.tbe import build_table_batched_embedding

needs_fbgemm = pytest.mark.skipif(not fbgemm_available(), reason="fbgemm_gpu is not importable")
ROWS, DIMS, FEATURES = [50, 30], [8, 4], [0, 1, 1]


def kernel(backend: KernelBackend, opt: EmbOptimType, mean: bool = False,
           weighted: bool = False) -> torch.nn.Module:
    k = build_table_batched_embedding(
        rows=ROWS, dims=DIMS, feature_table_map=FEATURES, pooling_mean=mean,
        optimizer=FusedOptimizerConfig(optimizer=opt, learning_rate=0.1, eps=1e-3),
        device=torch.device("cpu"), backend=backend, weighted=weighted,
        weights_dtype=torch.float16)
    gen = torch.Generator().manual_seed(3)
    for w in k.split_embedding_weights():
        assert w.dtype == torch.float16
        w.copy_(torch.randn(w.shape, generator=gen))
    return k


def batch(gen: torch.Generator, weighted: bool) -> tuple[torch.Tensor, ...]:
    lengths = torch.randint(0, 4, (len(FEATURES) * 5,), generator=gen)
    ids = torch.cat([torch.randint(0, 10, (int(lengths[f * 5:(f + 1) * 5].sum()),), generator=gen)
                     for f in range(len(FEATURES))])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    psw = torch.rand(ids.numel(), generator=gen) if weighted else None
    return ids, offsets, psw, torch.randn(5, sum(DIMS[t] for t in FEATURES), generator=gen)


def train(k: torch.nn.Module, steps: int, weighted: bool) -> list[torch.Tensor]:
    gen, outs = torch.Generator().manual_seed(11), []
    for _ in range(steps):
        ids, offsets, psw, target = batch(gen, weighted)
        out = k(ids, offsets, psw)
        (out * target).sum().backward()
        outs.append(out.detach())
    return outs


@needs_fbgemm
@pytest.mark.parametrize("opt", [EmbOptimType.EXACT_SGD, EmbOptimType.EXACT_ADAGRAD,
                                 EmbOptimType.EXACT_ROWWISE_ADAGRAD])
@pytest.mark.parametrize("mean, weighted", [(False, False), (True, False), (False, True)])
def test_torch_fp16_kernel_gives_fbgemms_bits(opt: EmbOptimType, mean: bool, weighted: bool) -> None:
    ours, theirs = kernel(KernelBackend.TORCH, opt, mean, weighted), kernel(
        KernelBackend.FBGEMM, opt, mean, weighted)
    for a, b in zip(train(ours, 4, weighted), train(theirs, 4, weighted), strict=True):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    for a, b in zip(ours.split_embedding_weights(), theirs.split_embedding_weights(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(ours.split_optimizer_states(), theirs.split_optimizer_states(), strict=True):
        for name in a:
            assert a[name].dtype == torch.float32
            torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("opt", [EmbOptimType.EXACT_SGD, EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                                 EmbOptimType.ADAM])
def test_fp16_update_follows_the_rounding_rule_by_hand(opt: EmbOptimType) -> None:
    k = kernel(KernelBackend.TORCH, opt)
    w0 = k.split_embedding_weights()[0].clone()
    ids, offsets = torch.tensor([1, 2, 1]), torch.tensor([0, 2, 3, 3, 3, 3, 3])  # batch of 2
    out = k(ids, offsets)
    # bags summed in float32 from float16 rows
    torch.testing.assert_close(out[:, :8], torch.stack([w0[1].float() + w0[2].float(), w0[1].float()]),
                               atol=0, rtol=0)
    grad = torch.zeros_like(out)
    grad[:, :8] = torch.tensor([[0.3] * 8, [-0.7] * 8])
    out.backward(grad)
    g = torch.zeros(50, 8)
    g[1], g[2] = 0.3 - 0.7, 0.3  # row 1 is in both bags
    rows = torch.tensor([1, 2])
    w, gr = w0[rows].float(), g[rows]
    if opt is EmbOptimType.EXACT_SGD:
        expected = (w + (-0.1 * gr).half().float()).half()
    elif opt is EmbOptimType.EXACT_ROWWISE_ADAGRAD:
        m = (gr * gr).mean(dim=1, keepdim=True)
        expected = (w - 0.1 * gr / (m.sqrt() + 1e-3)).half()
    else:  # Adam, step 1: the bias-corrected moments are g and g * g
        expected = (w - 0.1 * gr / ((gr * gr).sqrt() + 1e-3)).half()
    after = k.split_embedding_weights()[0]
    assert torch.equal(after[rows], expected)
    untouched = torch.ones(50, dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(after[untouched], w0[untouched])


def test_cached_tables_refuse_fp16_weights() -> None:
    from recsys_core.kernels.cached_tbe import TableCache

    with pytest.raises(ValueError, match="cached tables are kept in float32"):
        build_table_batched_embedding(
            rows=[10], dims=[4], feature_table_map=[0], pooling_mean=False,
            optimizer=FusedOptimizerConfig(), device=torch.device("cpu"),
            caches=[TableCache(slots=2)], weights_dtype=torch.float16)
