"""DLRM model: interaction arithmetic by hand, the whole forward against plain PyTorch, configs,
and plan-independent table initialization."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
import torch.nn.functional as F

from dlrm_app.data.schema import DatasetKind, DatasetSpec, SparseFeature, SplitSpec
from dlrm_app.model import (
    DLRM,
    Interaction,
    InteractionArch,
    InteractionDCNArch,
    ModelConfig,
    build_dlrm,
    fill_table_region,
    init_embedding_tables,
)
from recsys_core import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType


def test_dot_interaction_by_hand() -> None:
    dense = torch.tensor([[1.0, 2.0], [0.0, 1.0]])
    sparse = torch.tensor([[[1.0, 0.0], [3.0, 1.0]],
                           [[2.0, 2.0], [-1.0, 1.0]]])  # [B=2, F=2, D=2]
    out = InteractionArch(num_sparse_features=2)(dense, sparse)
    # row 0: d=(1,2), e1=(1,0), e2=(3,1): d.e1=1, d.e2=5, e1.e2=3
    # row 1: d=(0,1), e1=(2,2), e2=(-1,1): d.e1=2, d.e2=1, e1.e2=0
    assert torch.equal(out, torch.tensor([[1.0, 2.0, 1.0, 5.0, 3.0],
                                          [0.0, 1.0, 2.0, 1.0, 0.0]]))
    assert InteractionArch(26).output_dim(128) == 128 + 27 * 26 // 2


def _pairs_by_loop(dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
    """Every dot product of [dense, e_1..e_F] above the diagonal, pair by pair."""
    vectors = [dense, *sparse.unbind(1)]
    pairs = [(vectors[i] * vectors[j]).sum(1) for i, j in
             itertools.combinations(range(len(vectors)), 2)]
    return torch.cat([dense, torch.stack(pairs, dim=1)], dim=1)


@pytest.mark.parametrize("grad", [True, False])
def test_dot_interaction_and_its_gradient_equal_a_loop_over_pairs(grad: bool) -> None:
    """The training path (one-product backward) and the inference path give the values and
    gradients of the pairwise loop in fp64; under bf16 autocast they stay within bf16
    rounding of it, with fp32 gradients for fp32 inputs."""
    torch.manual_seed(0)
    dense = torch.randn(5, 4, dtype=torch.float64, requires_grad=grad)
    sparse = torch.randn(5, 3, 4, dtype=torch.float64, requires_grad=grad)
    weights = torch.randn(5, 4 + 6, dtype=torch.float64)
    arch = InteractionArch(num_sparse_features=3)
    with torch.set_grad_enabled(grad):
        out, expected = arch(dense, sparse), _pairs_by_loop(dense, sparse)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    if grad:
        got = torch.autograd.grad((out * weights).sum(), (dense, sparse))
        want = torch.autograd.grad((expected * weights).sum(), (dense, sparse))
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    dense32, sparse32 = (t.detach().float().requires_grad_(grad) for t in (dense, sparse))
    with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=torch.bfloat16):
        low = arch(dense32, sparse32)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.double(), expected.detach(), rtol=0.02, atol=0.05)
    if grad:
        got = torch.autograd.grad((low.double() * weights).sum(), (dense32, sparse32))
        for g, w in zip(got, want, strict=True):
            assert g.dtype == torch.float32
            torch.testing.assert_close(g.double(), w, rtol=0.03, atol=0.1)


def _interaction_by_plain_ops(dense: torch.Tensor, sparse: torch.Tensor, low: torch.dtype,
                              grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The dot interaction in ``low`` and its one-product gradient for the output gradient
    ``grad``, by plain tensor ops (no autograd): ``dz = (G + G^T) z`` for ``G`` the pairs'
    gradient placed at (i, j) and (j, i), the dense vector's own columns added."""
    batch, dim, n = dense.shape[0], dense.shape[1], sparse.shape[1] + 1
    z = torch.cat([dense.to(low).unsqueeze(1), sparse.to(low)], dim=1)
    rows, cols = torch.triu_indices(n, n, 1)
    out = torch.cat([z[:, 0], torch.bmm(z, z.transpose(1, 2))[:, rows, cols]], dim=1)
    sym = torch.zeros(batch, n, n, dtype=low)
    sym[:, rows, cols] = grad[:, dim:]
    sym[:, cols, rows] = grad[:, dim:]
    dz = torch.bmm(sym, z)
    return out, (dz[:, 0] + grad[:, :dim]).to(dense.dtype), dz[:, 1:].to(sparse.dtype)


@pytest.mark.parametrize("amp", [False, True])
@pytest.mark.parametrize("dense_needs_grad", [True, False])
def test_dot_interaction_training_path_is_bitwise_the_plain_ops(amp: bool,
                                                                 dense_needs_grad: bool) -> None:
    """The training form (one buffer for z, pairs gathered into the output, slice-copy
    scatter of their gradient) gives bitwise the values and gradients of plain cat / bmm /
    indexing, in fp32 and under bf16 autocast (fp32 inputs, as the model feeds it), and the
    same values as the inference path."""
    torch.manual_seed(0)
    batch, num_sparse, dim = 33, 6, 16
    dense = torch.randn(batch, dim, requires_grad=dense_needs_grad)
    sparse = torch.randn(batch, num_sparse, dim, requires_grad=True)
    arch = InteractionArch(num_sparse_features=num_sparse)
    low = torch.bfloat16 if amp else torch.float32
    grad = torch.randn(batch, arch.output_dim(dim)).to(low)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        out = arch(dense, sparse)
        with torch.no_grad():
            inference = arch(dense, sparse)
    inputs = (dense, sparse) if dense_needs_grad else (sparse,)
    got = torch.autograd.grad(out, inputs, grad)
    want_out, want_dense, want_sparse = _interaction_by_plain_ops(dense.detach(),
                                                                  sparse.detach(), low, grad)
    assert out.dtype == low and torch.equal(out, want_out) and torch.equal(inference, want_out)
    want = (want_dense, want_sparse) if dense_needs_grad else (want_sparse,)
    for g, w, x in zip(got, want, inputs, strict=True):
        assert g.dtype == x.dtype == torch.float32
        assert torch.equal(g, w)


def test_dcn_interaction_matches_formula() -> None:
    torch.manual_seed(0)
    arch = InteractionDCNArch(num_sparse_features=3, embedding_dim=4, num_layers=2, low_rank=3)
    dense, sparse = torch.randn(5, 4), torch.randn(5, 3, 4)
    x0 = torch.cat([dense, sparse.reshape(5, 12)], dim=1)
    x = x0
    for layer in arch.crossnet.layers:
        x = x0 * (x @ layer.V.weight.T @ layer.W.weight.T + layer.W.bias) + x
    torch.testing.assert_close(arch(dense, sparse), x)
    assert arch.output_dim(4) == 16


def _ebc(dims: int = 4) -> EmbeddingBagCollection:
    return EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name="t_a", embedding_dim=dims, num_embeddings=10, feature_names=["a"],
                           pooling=PoolingType.SUM),
        EmbeddingBagConfig(name="t_b", embedding_dim=dims, num_embeddings=7, feature_names=["b"],
                           pooling=PoolingType.SUM),
    ])


@pytest.mark.parametrize("interaction", list(Interaction))
def test_dlrm_forward_equals_plain_pytorch(interaction: Interaction) -> None:
    torch.manual_seed(1)
    model = DLRM(_ebc(), dense_in_features=3, dense_arch_layer_sizes=(8, 4),
                 over_arch_layer_sizes=(6, 1), interaction=interaction, dcn_num_layers=2,
                 dcn_low_rank_dim=5)
    kjt = KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor([1, 2, 9, 0, 6, 6, 3]),
                            lengths=torch.tensor([2, 1, 0, 1, 2, 1]))  # B=3; a multi-hot + empty
    dense = torch.randn(3, 3)
    logits = model(dense, kjt)
    assert logits.shape == (3, 1)

    # reference: the same weights through functional ops
    d = dense
    for layer in model.dense_arch.model:
        d = layer(d)
    wa = model.sparse_arch.embedding_bag_collection.embedding_bags["t_a"].weight
    wb = model.sparse_arch.embedding_bag_collection.embedding_bags["t_b"].weight
    ea = F.embedding_bag(torch.tensor([1, 2, 9]), wa, torch.tensor([0, 2, 3]), mode="sum")
    eb = F.embedding_bag(torch.tensor([0, 6, 6, 3]), wb, torch.tensor([0, 1, 3]), mode="sum")
    assert torch.equal(ea[2], torch.zeros(4))  # the empty bag pools to zeros
    if interaction is Interaction.DOT:
        z = torch.stack([d, ea, eb], dim=1)
        pairs = [(z[:, i] * z[:, j]).sum(1) for i, j in itertools.combinations(range(3), 2)]
        x = torch.cat([d, torch.stack(pairs, dim=1)], dim=1)
    else:
        x = model.inter_arch.crossnet(torch.cat([d, ea, eb], dim=1))
    for layer in model.over_arch.model:
        x = layer(x)
    torch.testing.assert_close(logits, x)


def test_model_config_errors() -> None:
    with pytest.raises(ValueError, match="must equal the embedding dim"):
        ModelConfig(embedding_dim=64, dense_arch_layer_sizes=(128, 32))
    with pytest.raises(ValueError, match="must be 1"):
        ModelConfig(over_arch_layer_sizes=(64, 2))
    with pytest.raises(ValueError, match="positive int"):
        ModelConfig(embedding_dim=0)
    with pytest.raises(ValueError, match="one embedding dim"):
        DLRM(EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name="x", embedding_dim=4, num_embeddings=3),
            EmbeddingBagConfig(name="y", embedding_dim=8, num_embeddings=3)]),
            dense_in_features=2, dense_arch_layer_sizes=(4,), over_arch_layer_sizes=(1,))


def _spec() -> DatasetSpec:
    shard_free = tuple(SplitSpec(name=n, label_rate=0.5, shards=()) for n in
                       ("train", "validation", "test"))
    return DatasetSpec(name="tiny", kind=DatasetKind.SYNTHETIC, dense_features=("d0", "d1"),
                       sparse_features=(SparseFeature(name="u", num_embeddings=100, multi_hot=False),
                                        SparseFeature(name="g", num_embeddings=5000, multi_hot=True)),
                       label="label", label_dtype="float32", splits=shard_free, parameters={},
                       created_by="test")


def test_build_dlrm_from_dataset_on_meta() -> None:
    model = build_dlrm(_spec(), ModelConfig(embedding_dim=8, dense_arch_layer_sizes=(8,),
                                            over_arch_layer_sizes=(4, 1)), device="meta")
    configs = model.sparse_arch.embedding_bag_collection.embedding_bag_configs()
    assert [(c.name, c.num_embeddings, c.feature_names) for c in configs] == [
        ("t_u", 100, ["u"]), ("t_g", 5000, ["g"])]
    assert all(p.is_meta for p in model.parameters())  # nothing allocated
    assert model.over_arch.model[0].in_features == 8 + 3  # D + F(F+1)/2 with F=2


def test_table_init_does_not_depend_on_the_cut() -> None:
    whole = torch.empty(9000, 6)
    fill_table_region(whole, "t", 9000, 6, 0, 0, seed=3)
    bound = (1 / 9000) ** 0.5
    assert whole.abs().max() <= bound and whole.std() > bound / 3  # uniform in the bound
    # a row shard crossing a block boundary and a column shard give the same values
    piece = torch.empty(5000, 2)
    fill_table_region(piece, "t", 9000, 6, 3000, 4, seed=3)
    assert torch.equal(piece, whole[3000:8000, 4:6])
    other = torch.empty(9000, 6)
    fill_table_region(other, "t", 9000, 6, 0, 0, seed=4)
    assert not torch.equal(other, whole)


def test_init_embedding_tables_plain_ebc() -> None:
    ebc = _ebc()
    init_embedding_tables(ebc, seed=0)
    expected = torch.empty(7, 4)
    fill_table_region(expected, "t_b", 7, 4, 0, 0, seed=0)
    assert torch.equal(ebc.embedding_bags["t_b"].weight.detach(), expected)


def _wide_kjt(batch: int, seed: int) -> KeyedJaggedTensor:
    """A batch of ``_spec()``'s features: u one-hot, g multi-hot (some rows empty)."""
    gen = torch.Generator().manual_seed(seed)
    g_lengths = torch.randint(0, 4, (batch,), generator=gen)
    return KeyedJaggedTensor(
        keys=["u", "g"],
        values=torch.cat([torch.randint(0, 100, (batch,), generator=gen),
                          torch.randint(0, 5000, (int(g_lengths.sum()),), generator=gen)]),
        lengths=torch.cat([torch.ones(batch, dtype=torch.int64), g_lengths]))


def test_the_wide_part_adds_each_ids_scalar_and_the_dense_term_and_starts_at_zero() -> None:
    spec = _spec()
    config = ModelConfig(embedding_dim=8, dense_arch_layer_sizes=(8,), over_arch_layer_sizes=(4, 1))
    torch.manual_seed(0)
    model = build_dlrm(spec, config, device="cpu")
    init_embedding_tables(model, seed=1)
    assert [c.name for c in model.wide.tables.embedding_bag_configs()] == ["w_u", "w_g"]
    assert all(c.embedding_dim == 1 for c in model.wide.tables.embedding_bag_configs())
    torch.manual_seed(0)
    plain = build_dlrm(spec, dataclasses.replace(config, wide=False), device="cpu")
    init_embedding_tables(plain, seed=1)
    assert plain.wide is None
    dense, kjt = torch.rand(6, 2), _wide_kjt(6, seed=2)
    # zero at the start: the same logits as the plain DLRM with the same initialization
    assert torch.equal(model(dense, kjt), plain(dense, kjt))
    with torch.no_grad():
        for p in model.wide.parameters():
            p.uniform_(-1, 1)
    w_u = model.wide.tables.embedding_bags["w_u"].weight.detach().view(-1)
    w_g = model.wide.tables.embedding_bags["w_g"].weight.detach().view(-1)
    lin = model.wide.dense
    parts = kjt.to_dict()
    expected = torch.stack([
        w_u[parts["u"].to_dense()[i]].sum() + w_g[parts["g"].to_dense()[i]].sum()
        + dense[i] @ lin.weight[0] + lin.bias[0] for i in range(6)]).unsqueeze(1)
    torch.testing.assert_close(model(dense, kjt) - plain(dense, kjt), expected.detach())


def test_the_wide_parts_serving_form_equals_it() -> None:
    from dlrm_app.model import WidePart
    from dlrm_app.serving.program import WideLookup

    torch.manual_seed(3)
    # feature "r" (a raw-id feature, say) has no wide table: it adds nothing
    wide = WidePart([("u", 100), ("g", 5000)], num_dense=2)
    with torch.no_grad():
        for p in wide.parameters():
            p.uniform_(-1, 1)
    serving = WideLookup(wide, ["u", "g", "r"])
    dense, kjt = torch.rand(5, 2), _wide_kjt(5, seed=4)
    r_values = torch.randint(0, 7, (5,))
    values = torch.cat([kjt.values(), r_values, torch.tensor([3, 3])])  # 2 values past the bags
    offsets = torch.cat([kjt.offsets(), kjt.offsets()[-1] + torch.arange(1, 6)])
    got = serving(dense, values, offsets, 5)
    torch.testing.assert_close(got, wide(dense, kjt).detach())
    scripted = torch.jit.script(serving)
    torch.testing.assert_close(scripted(dense, values, offsets, 5), got)


@pytest.mark.slow
def test_the_wide_part_learns_first_order_effects_the_plain_dlrm_misses() -> None:
    """Labels from a logistic model of each id's own effect and a dense feature's (what a
    logistic regression fits): with the wide part the DLRM's held-out log loss comes within
    0.015 of a logistic regression's on the same rows; the plain DLRM, which sees ids only
    through dot products, stays at least 0.01 further off."""
    spec = dataclasses.replace(_spec(), sparse_features=tuple(
        SparseFeature(name=f"f{i}", num_embeddings=40, multi_hot=False) for i in range(4)))
    gen = torch.Generator().manual_seed(0)
    effects = torch.randn(4, 40, generator=gen) * 1.2
    rows = 24_000
    ids = torch.randint(0, 40, (rows, 4), generator=gen)
    dense = torch.rand(rows, 2, generator=gen)
    logit = effects.gather(1, ids.t()).sum(0) + 1.5 * dense[:, 0] - 1.0
    labels = torch.bernoulli(torch.sigmoid(logit), generator=gen)
    test = slice(20_000, rows)

    def kjt(part: slice) -> KeyedJaggedTensor:
        n = ids[part].shape[0]
        return KeyedJaggedTensor(keys=[f"f{i}" for i in range(4)], values=ids[part].t().reshape(-1),
                                 lengths=torch.ones(4 * n, dtype=torch.int64))

    def held_out_loss(wide: bool | None) -> float:
        """The DLRM with or without the wide part; None: the wide part alone (a logistic
        regression on the same inputs)."""
        torch.manual_seed(1)
        model = build_dlrm(spec, ModelConfig(embedding_dim=4, dense_arch_layer_sizes=(8, 4),
                                             over_arch_layer_sizes=(8, 1), wide=wide is not False),
                           device="cpu")
        init_embedding_tables(model, seed=1)
        if wide is None:
            model = model.wide
        optimizer = torch.optim.Adagrad(model.parameters(), lr=0.2)
        for _ in range(6):
            for start in range(0, 20_000, 200):
                part = slice(start, start + 200)
                loss = F.binary_cross_entropy_with_logits(
                    model(dense[part], kjt(part)).squeeze(1), labels[part])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        with torch.no_grad():
            return float(F.binary_cross_entropy_with_logits(
                model(dense[test], kjt(test)).squeeze(1), labels[test]))

    truth = float(F.binary_cross_entropy_with_logits(logit[test], labels[test]))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny products: more threads only wait on each other
    try:
        with_wide, plain, lr = held_out_loss(True), held_out_loss(False), held_out_loss(None)
    finally:
        torch.set_num_threads(threads)
    # measured: truth 0.416, logistic regression 0.420, with the wide part 0.430, plain 0.448
    assert lr < truth + 0.01, (lr, truth)  # the logistic regression nearly reaches the truth
    assert with_wide < lr + 0.015, (with_wide, lr)
    assert plain > with_wide + 0.01, (plain, with_wide)
