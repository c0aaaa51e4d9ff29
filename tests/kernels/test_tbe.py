"""Table-batched kernels: FBGEMM == torch fallback; Adam/LAMB family == independent references."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from recsys_core.kernels import fbgemm_available
from recsys_core.kernels.config import (
    EmbOptimType,
    FusedOptimizerConfig,
    KernelBackend,
    WeightDecayMode,
)
from recsys_core.kernels.fbgemm_tbe import FbgemmTableBatchedEmbedding
from recsys_core.kernels.tbe import (
    IdOutOfRangeError,
    build_table_batched_embedding,
    checked_lookup,
    select_backend,
)
from recsys_core.optim import RowWiseAdagrad

needs_fbgemm = pytest.mark.skipif(not fbgemm_available(), reason="fbgemm_gpu is not importable")

ROWS = [13, 7, 29]
DIMS = [4, 8, 4]
FEATURE_TABLE_MAP = [0, 1, 1, 2]  # table 1 is shared by two features


def make_batch(
    gen: torch.Generator, batch: int, weighted: bool, dtype: torch.dtype = torch.int64
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Random feature-major batch with empty bags and repeated ids (exercises dedup)."""
    lengths = torch.randint(0, 5, (len(FEATURE_TABLE_MAP) * batch,), generator=gen)
    lengths[0] = 0  # an empty bag for sure
    ids = []
    for f, t in enumerate(FEATURE_TABLE_MAP):
        n = int(lengths[f * batch : (f + 1) * batch].sum())
        # small id range so that ids repeat within and across bags
        ids.append(torch.randint(0, min(ROWS[t], 5), (n,), generator=gen))
    indices = torch.cat(ids).to(dtype)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(dtype)
    psw = torch.rand(indices.numel(), generator=gen) if weighted else None
    return indices, offsets, psw


def build(
    backend: KernelBackend, config: FusedOptimizerConfig, mean: bool, weighted: bool = False
) -> nn.Module:
    kernel = build_table_batched_embedding(
        rows=ROWS, dims=DIMS, feature_table_map=FEATURE_TABLE_MAP, pooling_mean=mean,
        optimizer=config, device=torch.device("cpu"), backend=backend, weighted=weighted,
    )
    gen = torch.Generator().manual_seed(7)
    for w in kernel.split_embedding_weights():
        w.copy_(torch.rand(w.shape, generator=gen) - 0.5)
    return kernel


def run_steps(kernel: nn.Module, steps: int, weighted: bool) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(123)
    outs = []
    for _ in range(steps):
        indices, offsets, psw = make_batch(gen, batch=6, weighted=weighted)
        out = kernel(indices, offsets, psw)
        target = torch.randn(out.shape, generator=gen)
        (out * target).sum().backward()
        outs.append(out.detach().clone())
    return outs


def reference_bags(kernel: nn.Module, mode: str) -> list[nn.EmbeddingBag]:
    """Plain sparse-gradient EmbeddingBags holding copies of the kernel's tables."""
    bags = [
        nn.EmbeddingBag(r, d, mode=mode, sparse=True, include_last_offset=True)
        for r, d in zip(ROWS, DIMS, strict=True)
    ]
    for bag, w in zip(bags, kernel.split_embedding_weights(), strict=True):
        bag.weight.data.copy_(w)
    return bags


def reference_forward(
    bags: list[nn.EmbeddingBag], indices: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    batch = (offsets.numel() - 1) // len(FEATURE_TABLE_MAP)
    return torch.cat([
        bags[t](indices[int(offsets[f * batch]) : int(offsets[(f + 1) * batch])],
                offsets[f * batch : (f + 1) * batch + 1] - offsets[f * batch])
        for f, t in enumerate(FEATURE_TABLE_MAP)
    ], dim=1)


FBGEMM_CPU_CONFIGS = [
    FusedOptimizerConfig(optimizer=EmbOptimType.EXACT_SGD, learning_rate=0.1),
    FusedOptimizerConfig(optimizer=EmbOptimType.EXACT_ADAGRAD, learning_rate=0.1, eps=1e-3),
    FusedOptimizerConfig(optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.1, eps=1e-3),
]


@needs_fbgemm
@pytest.mark.parametrize("config", FBGEMM_CPU_CONFIGS, ids=lambda c: f"{c.optimizer.name}-{c.weight_decay_mode.name}")
# weighted MEAN is left out: FBGEMM's CPU backward for it is inconsistent (pinned below).
@pytest.mark.parametrize(
    "mean, weighted",
    [(False, False), (True, False), (False, True)],
    ids=["sum", "mean", "sum-weighted"],
)
def test_torch_fallback_equals_fbgemm_after_steps(
    config: FusedOptimizerConfig, mean: bool, weighted: bool
) -> None:
    fb = build(KernelBackend.FBGEMM, config, mean)
    pt = build(KernelBackend.TORCH, config, mean)
    outs_fb = run_steps(fb, 5, weighted)
    outs_pt = run_steps(pt, 5, weighted)
    for a, b in zip(outs_fb, outs_pt, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for a, b in zip(fb.split_embedding_weights(), pt.split_embedding_weights(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for sa, sb in zip(fb.split_optimizer_states(), pt.split_optimizer_states(), strict=True):
        assert sa.keys() == sb.keys()
        for k in sa:
            torch.testing.assert_close(sa[k], sb[k], atol=1e-5, rtol=1e-5)
    # weights really moved (the test would pass vacuously otherwise)
    assert not torch.allclose(pt.split_embedding_weights()[1], build(KernelBackend.TORCH, config, mean).split_embedding_weights()[1])


@needs_fbgemm
def test_fbgemm_cpu_weighted_mean_backward_is_still_inconsistent() -> None:
    """Pins the FBGEMM 1.8 CPU defect that makes AUTO pick the torch kernel for weighted MEAN:
    forward divides by the bag length, backward does not. If this starts failing, FBGEMM fixed
    it and the routing rule in ``fbgemm_missing`` can go."""
    config = FusedOptimizerConfig(optimizer=EmbOptimType.EXACT_SGD, learning_rate=1.0)
    kernel = build_table_batched_embedding(
        rows=[4], dims=[4], feature_table_map=[0], pooling_mean=True, optimizer=config,
        device=torch.device("cpu"), backend=KernelBackend.FBGEMM,
    )
    w = kernel.split_embedding_weights()[0]
    w.copy_(torch.eye(4))
    psw = torch.tensor([2.0, 3.0])
    out = kernel(torch.tensor([0, 1]), torch.tensor([0, 2]), psw)
    torch.testing.assert_close(out, torch.tensor([[1.0, 1.5, 0.0, 0.0]]))  # sum(w*e) / 2
    out.backward(torch.ones(1, 4))
    # consistent gradient would be psw / 2 = [1.0, 1.5]; FBGEMM applies [2.0, 3.0]
    torch.testing.assert_close(w[0, 1:], torch.full((3,), -2.0))
    torch.testing.assert_close(w[1, [0, 2, 3]], torch.full((3,), -3.0))
    assert build(KernelBackend.AUTO, config, mean=True, weighted=True).__class__.__name__ == (
        "TorchTableBatchedEmbedding"
    )


@needs_fbgemm
def test_fbgemm_cpu_adagrad_needs_adjacent_features_of_a_table() -> None:
    """Pins the FBGEMM 1.8 CPU defect behind the ``feature_table_map`` routing rule: with a
    table's features not adjacent ([0, 1, 0, 1]) exact Adagrad differs from the exact result
    (the torch kernel); with them adjacent it matches. AUTO must pick torch for the former."""
    config = FusedOptimizerConfig(optimizer=EmbOptimType.EXACT_ADAGRAD, learning_rate=0.5, eps=1e-3)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, 4, (4 * 6,), generator=gen)
    indices = torch.randint(0, 11, (int(lengths.sum()),), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    grad = torch.randn(6, 16, generator=gen)

    def trained(ftm: list[int], backend: KernelBackend | None) -> torch.Tensor:
        args = {
            "rows": [11, 11], "dims": [4, 4], "feature_table_map": ftm, "pooling_mean": False,
            "optimizer": config, "device": torch.device("cpu"),
        }
        # None: the raw FBGEMM wrapper, bypassing backend selection
        kernel = FbgemmTableBatchedEmbedding(**args) if backend is None else (
            build_table_batched_embedding(**args, backend=backend)
        )
        for w in kernel.split_embedding_weights():
            w.copy_(torch.arange(44.0).view(11, 4) / 44)
        kernel(indices, offsets).backward(grad)
        return torch.cat([w.flatten() for w in kernel.split_embedding_weights()])

    exact = trained([0, 1, 0, 1], KernelBackend.TORCH)
    assert not torch.allclose(trained([0, 1, 0, 1], None), exact, atol=1e-3)
    torch.testing.assert_close(trained([0, 0, 1, 1], None), trained([0, 0, 1, 1], KernelBackend.TORCH))
    torch.testing.assert_close(trained([0, 1, 0, 1], KernelBackend.AUTO), exact)
    with pytest.raises(ValueError, match="adjacent in feature_table_map"):
        trained([0, 1, 0, 1], KernelBackend.FBGEMM)


@needs_fbgemm
def test_int32_indices_and_offsets_match_int64() -> None:
    config = FBGEMM_CPU_CONFIGS[2]
    gen = torch.Generator().manual_seed(3)
    indices, offsets, _ = make_batch(gen, batch=5, weighted=False)
    for backend in (KernelBackend.FBGEMM, KernelBackend.TORCH):
        k64 = build(backend, config, False)
        k32 = build(backend, config, False)
        torch.testing.assert_close(k64(indices, offsets), k32(indices.int(), offsets.int()))


def test_pooled_output_matches_nn_embedding_bag_by_hand() -> None:
    kernel = build(KernelBackend.TORCH, FBGEMM_CPU_CONFIGS[0], mean=False)
    tables = [w.clone() for w in kernel.split_embedding_weights()]
    # batch 2: f0 [[1, 2], []], f1 [[3], [3, 4]], f2 [[], [0]], f3 [[5], [6]]
    indices = torch.tensor([1, 2, 3, 3, 4, 0, 5, 6])
    offsets = torch.tensor([0, 2, 2, 3, 5, 5, 6, 7, 8])
    out = kernel(indices, offsets)
    expected_row0 = torch.cat([tables[0][1] + tables[0][2], tables[1][3], torch.zeros(8), tables[2][5]])
    expected_row1 = torch.cat([torch.zeros(4), tables[1][3] + tables[1][4], tables[1][0], tables[2][6]])
    torch.testing.assert_close(out, torch.stack([expected_row0, expected_row1]))


def _adam_reference(
    opt: EmbOptimType, steps_inputs: list, lr: float, b1: float, b2: float, eps: float, wd: float
) -> list[torch.Tensor]:
    """Row-by-row Python reference written from the optimizer definitions."""
    kernel = build(KernelBackend.TORCH, FusedOptimizerConfig(optimizer=EmbOptimType.EXACT_SGD, learning_rate=0.0), False)
    tables = [w.clone().double() for w in kernel.split_embedding_weights()]
    m1 = [torch.zeros_like(t) for t in tables]
    rowwise = opt in (EmbOptimType.PARTIAL_ROWWISE_ADAM, EmbOptimType.PARTIAL_ROWWISE_LAMB)
    m2 = [torch.zeros(t.shape[0], dtype=torch.double) if rowwise else torch.zeros_like(t) for t in tables]
    for step, (indices, offsets, target) in enumerate(steps_inputs, start=1):
        batch = (offsets.numel() - 1) // len(FEATURE_TABLE_MAP)
        grads = [torch.zeros_like(t) for t in tables]
        touched = [set() for _ in tables]
        col = 0
        for f, t in enumerate(FEATURE_TABLE_MAP):
            for b in range(batch):
                lo, hi = int(offsets[f * batch + b]), int(offsets[f * batch + b + 1])
                for i in range(lo, hi):
                    r = int(indices[i])
                    grads[t][r] += target[b, col : col + DIMS[t]].double()
                    touched[t].add(r)
            col += DIMS[t]
        for t in range(len(tables)):
            for r in sorted(touched[t]):
                g, w = grads[t][r], tables[t][r].clone()
                m1[t][r] = b1 * m1[t][r] + (1 - b1) * g
                if rowwise:
                    m2[t][r] = b2 * m2[t][r] + (1 - b2) * (g * g).mean()
                else:
                    m2[t][r] = b2 * m2[t][r] + (1 - b2) * g * g
                update = (m1[t][r] / (1 - b1**step)) / ((m2[t][r] / (1 - b2**step)).sqrt() + eps) + wd * w
                if opt in (EmbOptimType.LAMB, EmbOptimType.PARTIAL_ROWWISE_LAMB):
                    update = update * (w.norm() / update.norm())
                tables[t][r] = w - lr * update
    return [t.float() for t in tables]


@pytest.mark.parametrize(
    "opt",
    [EmbOptimType.ADAM, EmbOptimType.PARTIAL_ROWWISE_ADAM, EmbOptimType.LAMB, EmbOptimType.PARTIAL_ROWWISE_LAMB],
)
def test_adam_family_matches_reference(opt: EmbOptimType) -> None:
    lr, b1, b2, eps, wd = 0.05, 0.8, 0.95, 1e-4, 0.01
    config = FusedOptimizerConfig(optimizer=opt, learning_rate=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd)
    kernel = build(KernelBackend.AUTO, config, mean=False)  # CPU FBGEMM has none: torch kernel
    gen = torch.Generator().manual_seed(11)
    inputs = []
    for _ in range(4):
        indices, offsets, _ = make_batch(gen, batch=4, weighted=False)
        out = kernel(indices, offsets)
        target = torch.randn(out.shape, generator=gen)
        (out * target).sum().backward()
        inputs.append((indices, offsets, target))
    expected = _adam_reference(opt, inputs, lr, b1, b2, eps, wd)
    for got, want in zip(kernel.split_embedding_weights(), expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def _steps_beside(kernel: nn.Module, bags: list[nn.EmbeddingBag],
                  ref_opt: torch.optim.Optimizer, seed: int) -> None:
    """4 steps of ``kernel`` (its fused optimizer) and of ``bags`` under ``ref_opt`` on the
    same batches and losses: each step's outputs are equal, and every table after them."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(4):
        indices, offsets, _ = make_batch(gen, batch=4, weighted=False)
        out = kernel(indices, offsets)
        target = torch.randn(out.shape, generator=gen)
        (out * target).sum().backward()
        ref_out = reference_forward(bags, indices, offsets)
        torch.testing.assert_close(out, ref_out.detach(), atol=1e-5, rtol=1e-5)
        ref_opt.zero_grad()
        (ref_out * target).sum().backward()
        ref_opt.step()
    for bag, w in zip(bags, kernel.split_embedding_weights(), strict=True):
        torch.testing.assert_close(w, bag.weight.detach(), atol=1e-5, rtol=1e-5)


def test_adam_matches_torch_sparse_adam() -> None:
    lr = 0.03
    config = FusedOptimizerConfig(optimizer=EmbOptimType.ADAM, learning_rate=lr)
    kernel = build(KernelBackend.TORCH, config, mean=False)
    bags = reference_bags(kernel, "sum")
    _steps_beside(kernel, bags, torch.optim.SparseAdam([b.weight for b in bags], lr=lr), seed=5)


def test_rowwise_adagrad_optimizer_matches_fused_kernel_with_l2_decay() -> None:
    config = FusedOptimizerConfig(
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.1, eps=1e-3,
        weight_decay=0.05, weight_decay_mode=WeightDecayMode.L2,
    )
    kernel = build(KernelBackend.TORCH, config, mean=True)
    bags = reference_bags(kernel, "mean")
    ref_opt = RowWiseAdagrad([b.weight for b in bags], lr=0.1, eps=1e-3, weight_decay=0.05)
    _steps_beside(kernel, bags, ref_opt, seed=9)


def test_per_sample_weight_gradient_matches_autograd() -> None:
    kernel = build(KernelBackend.TORCH, FusedOptimizerConfig(learning_rate=0.0), mean=False)
    gen = torch.Generator().manual_seed(2)
    indices, offsets, psw = make_batch(gen, batch=3, weighted=True)
    psw.requires_grad_(True)
    out = kernel(indices, offsets, psw)
    target = torch.randn(out.shape, generator=gen)
    (out * target).sum().backward()
    tables = [w.clone() for w in kernel.split_embedding_weights()]
    psw_ref = psw.detach().clone().requires_grad_(True)
    batch = 3
    ref = torch.cat([
        nn.functional.embedding_bag(
            indices[int(offsets[f * batch]) : int(offsets[(f + 1) * batch])], tables[t],
            offsets[f * batch : (f + 1) * batch + 1] - offsets[f * batch], mode="sum",
            per_sample_weights=psw_ref[int(offsets[f * batch]) : int(offsets[(f + 1) * batch])],
            include_last_offset=True,
        ) for f, t in enumerate(FEATURE_TABLE_MAP)
    ], dim=1)
    (ref * target).sum().backward()
    torch.testing.assert_close(psw.grad, psw_ref.grad)


@pytest.mark.parametrize(
    "backend",
    [pytest.param(KernelBackend.FBGEMM, marks=needs_fbgemm), KernelBackend.TORCH],
)
@pytest.mark.parametrize("bad_id", [29, -1])
def test_out_of_range_id_names_feature_and_id(backend: KernelBackend, bad_id: int) -> None:
    kernel = build(backend, FBGEMM_CPU_CONFIGS[0], mean=False)
    # feature f3 (table of 29 rows) gets the bad id at batch position 1
    indices = torch.tensor([1, 2, 3, 4, 0, 5, bad_id])
    offsets = torch.tensor([0, 1, 2, 3, 4, 5, 5, 6, 7])
    names = ["f0", "f1", "f2", "f3"]
    rows = [ROWS[t] for t in FEATURE_TABLE_MAP]
    before = [w.clone() for w in kernel.split_embedding_weights()]
    with pytest.raises(IdOutOfRangeError, match=rf"feature 'f3': id {bad_id} \(batch position 1\).*\[0, 29\)"):
        checked_lookup(kernel, indices, offsets, None, feature_names=names, rows_per_feature=rows)
    for a, b in zip(before, kernel.split_embedding_weights(), strict=True):
        assert torch.equal(a, b)  # nothing was clamped or written


def test_backend_selection() -> None:
    cpu = torch.device("cpu")
    sgd = FusedOptimizerConfig(optimizer=EmbOptimType.EXACT_SGD)
    adam = FusedOptimizerConfig(optimizer=EmbOptimType.ADAM)
    rowwise = FusedOptimizerConfig(optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD)
    rowwise_decay = FusedOptimizerConfig(
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, weight_decay=0.1,
        weight_decay_mode=WeightDecayMode.DECOUPLED,
    )
    assert select_backend(KernelBackend.TORCH, cpu, sgd) is KernelBackend.TORCH
    assert select_backend(KernelBackend.AUTO, cpu, adam) is KernelBackend.TORCH
    assert select_backend(KernelBackend.AUTO, cpu, rowwise_decay) is KernelBackend.TORCH
    assert select_backend(KernelBackend.AUTO, torch.device("meta"), sgd) is KernelBackend.TORCH
    if fbgemm_available():
        assert select_backend(KernelBackend.AUTO, cpu, rowwise) is KernelBackend.FBGEMM
        with pytest.raises(ValueError, match="no ADAM kernel on cpu"):
            select_backend(KernelBackend.FBGEMM, cpu, adam)
        with pytest.raises(ValueError, match="ignore weight_decay"):
            select_backend(KernelBackend.FBGEMM, cpu, rowwise_decay)


def test_rowwise_adagrad_decoupled_decay_by_hand() -> None:
    """One step on one row, computed by hand from the rule in FusedOptimizerConfig's docs."""
    lr, eps, wd = 0.1, 1e-3, 0.5
    config = FusedOptimizerConfig(
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=lr, eps=eps,
        weight_decay=wd, weight_decay_mode=WeightDecayMode.DECOUPLED,
    )
    kernel = build_table_batched_embedding(
        rows=[4], dims=[4], feature_table_map=[0], pooling_mean=False, optimizer=config,
        device=torch.device("cpu"),
    )
    w = kernel.split_embedding_weights()[0]
    w.copy_(torch.arange(16.0).view(4, 4) / 10)
    kernel(torch.tensor([1]), torch.tensor([0, 1])).backward(torch.tensor([[1.0, -1.0, 2.0, 0.5]]))
    # m = mean(g^2) = (1 + 1 + 4 + 0.25) / 4 = 1.5625; multiplier = 0.1 / (1.25 + 0.001)
    multiplier = 0.1 / 1.251
    row = torch.tensor([0.4, 0.5, 0.6, 0.7])
    expected = (1 - lr * wd) * row - multiplier * torch.tensor([1.0, -1.0, 2.0, 0.5])
    torch.testing.assert_close(w[1], expected)
    torch.testing.assert_close(kernel.split_optimizer_states()[0]["momentum1"][1], torch.tensor(1.5625))
    torch.testing.assert_close(w[0], torch.arange(4.0) / 10)  # untouched row: no decay


@pytest.mark.parametrize("opt", [EmbOptimType.EXACT_SGD, EmbOptimType.EXACT_ADAGRAD,
                                 EmbOptimType.EXACT_ROWWISE_ADAGRAD, EmbOptimType.ADAM,
                                 EmbOptimType.PARTIAL_ROWWISE_ADAM])
@pytest.mark.parametrize("mean,weighted", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("dim", [1, 4])
def test_one_dim_tables_update_at_once_as_table_by_table(
        opt: EmbOptimType, mean: bool, weighted: bool, dim: int) -> None:
    """The torch kernel's update of tables of one dim in one pass (every feature's ids as rows
    of the flat buffers) gives the bits of its table-by-table update, a shared table
    included; so does either with a gradient reducer that changes nothing (the hook
    data-parallel sharding sets), which sees one entry per table or one for all."""
    from recsys_core.kernels.torch_tbe import TorchTableBatchedEmbedding

    config = FusedOptimizerConfig(optimizer=opt, learning_rate=0.05, eps=1e-3)

    def kernel() -> TorchTableBatchedEmbedding:
        k = TorchTableBatchedEmbedding(rows=ROWS, dims=[dim] * 3,
                                       feature_table_map=FEATURE_TABLE_MAP, pooling_mean=mean,
                                       optimizer=config, device=torch.device("cpu"))
        k.weights.copy_(torch.rand(k.weights.shape, generator=torch.Generator().manual_seed(7)))
        return k

    at_once, by_table, reduced_at_once, reduced_by_table = (kernel() for _ in range(4))
    by_table.one_dim_pass = reduced_by_table.one_dim_pass = False
    seen: dict[int, list[list[int]]] = {id(reduced_at_once): [], id(reduced_by_table): []}

    def unchanged(k):  # type: ignore[no-untyped-def]
        def reduce(entries):  # type: ignore[no-untyped-def]
            seen[id(k)].append([rows for rows, _, _ in entries])
            return [(touched, grads) for _, touched, grads in entries]
        return reduce

    for k in (reduced_at_once, reduced_by_table):
        k.gradient_reducer = unchanged(k)
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        indices, offsets, psw = make_batch(gen, batch=6, weighted=weighted)
        target = torch.randn(6, dim * len(FEATURE_TABLE_MAP), generator=gen)
        for k in (at_once, by_table, reduced_at_once, reduced_by_table):
            (k(indices, offsets, psw) * target).sum().backward()
    # the reducer sees one entry of all rows at once, or one per table in feature order
    assert seen[id(reduced_at_once)] == [[sum(ROWS)]] * 3
    assert seen[id(reduced_by_table)] == [[ROWS[0], ROWS[1], ROWS[2]]] * 3
    for other in (by_table, reduced_at_once, reduced_by_table):
        assert torch.equal(at_once.weights, other.weights)
        for name in at_once.state_offsets:
            assert torch.equal(getattr(at_once, name), getattr(other, name)), name
    assert not torch.equal(at_once.weights, kernel().weights)  # it did train
