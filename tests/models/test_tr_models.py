"""DLRM (and variants) and SimpleDeepFMNN against their composition written out by hand."""

import itertools
from types import SimpleNamespace

import pytest
import torch

from recsys_core import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from recsys_core.datasets.utils import Batch
from recsys_core.fx import symbolic_trace
from recsys_core.models.deepfm import SimpleDeepFMNN, SimpleDeepFMNNWrapper
from recsys_core.models.dlrm import (
    DLRM,
    DLRM_DCN,
    DLRM_Projection,
    DLRMTrain,
    DLRMWrapper,
    InteractionArch,
    ModelConfigError,
    choose,
)


def _ebc(dim: int = 4) -> EmbeddingBagCollection:
    return EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name="t1", embedding_dim=dim, num_embeddings=10, feature_names=["f1", "f3"]),
            EmbeddingBagConfig(name="t2", embedding_dim=dim, num_embeddings=10, feature_names=["f2"]),
        ]
    )


def _kjt(batch: int = 2) -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_lengths_sync(
        keys=["f1", "f3", "f2"],
        values=torch.tensor([1, 2, 4, 5, 4, 3, 2, 9][: 3 * batch + 2]),
        lengths=torch.tensor([2, 0, 1, 1, 1, 3][: 3 * batch]),
    )


def test_dot_interaction_is_every_pair_above_the_diagonal() -> None:
    torch.manual_seed(0)
    dense, sparse = torch.randn(3, 4), torch.randn(3, 5, 4)
    out = InteractionArch(num_sparse_features=5)(dense, sparse)
    stack = torch.cat([dense.unsqueeze(1), sparse], dim=1)
    pairs = [(stack[:, i] * stack[:, j]).sum(1) for i, j in itertools.combinations(range(6), 2)]
    torch.testing.assert_close(out, torch.cat([dense, torch.stack(pairs, 1)], dim=1))
    assert choose(5, 2) == 10 and choose(3, 4) == 0


def test_dlrm_forward_is_its_parts_composed() -> None:
    torch.manual_seed(0)
    model = DLRM(_ebc(), dense_in_features=3, dense_arch_layer_sizes=[5, 4], over_arch_layer_sizes=[6, 1])
    dense, kjt = torch.randn(2, 3), _kjt()
    pooled = model.sparse_arch.embedding_bag_collection(kjt).to_dict()
    sparse = torch.stack([pooled["f1"], pooled["f3"], pooled["f2"]], dim=1)
    inter = model.inter_arch(model.dense_arch(dense), sparse)
    assert inter.shape == (2, 4 + choose(3, 2) + 3)
    torch.testing.assert_close(model(dense, kjt), model.over_arch(inter))
    scripted = torch.jit.script(symbolic_trace(model))
    torch.testing.assert_close(scripted(dense, kjt), model(dense, kjt))


def test_dlrm_train_loss_is_bce_with_logits() -> None:
    torch.manual_seed(0)
    model = DLRM(_ebc(), dense_in_features=3, dense_arch_layer_sizes=[4], over_arch_layer_sizes=[2, 1])
    batch = Batch(dense_features=torch.randn(2, 3), sparse_features=_kjt(), labels=torch.tensor([0, 1]))
    loss, (loss_d, logits, labels) = DLRMTrain(model)(batch)
    z = model(batch.dense_features, batch.sparse_features).squeeze(-1)
    y = batch.labels.float()
    expected = -(y * torch.log(torch.sigmoid(z)) + (1 - y) * torch.log(1 - torch.sigmoid(z))).mean()
    torch.testing.assert_close(loss, expected)
    assert not loss_d.requires_grad and labels.tolist() == [0, 1]
    torch.testing.assert_close(logits, z.detach())


def test_dcn_and_projection_variants() -> None:
    torch.manual_seed(0)
    dense, kjt = torch.randn(2, 3), _kjt()
    dcn = DLRM_DCN(_ebc(), 3, [4], [5, 1], dcn_num_layers=2, dcn_low_rank_dim=2)
    stack = torch.cat(
        [dcn.dense_arch(dense).unsqueeze(1), dcn.sparse_arch(kjt)], dim=1
    ).reshape(2, -1)
    torch.testing.assert_close(dcn(dense, kjt), dcn.over_arch(dcn.inter_arch.crossnet(stack)))
    proj = DLRM_Projection(_ebc(), 3, [4], [5, 1], [8], [12])
    # TorchRec's projection interaction: branch 1 gives I1=8/4 rows of dim D=4, branch 2 gives
    # D x I2=12/4; their product per sample (B x I1 x I2) goes flat after the dense features
    d = proj.dense_arch(dense)
    flat = torch.cat([d.unsqueeze(1), proj.sparse_arch(kjt)], dim=1).reshape(2, -1)
    left = proj.inter_arch.interaction_branch1(flat).reshape(2, 2, 4)
    right = proj.inter_arch.interaction_branch2(flat).reshape(2, 4, 3)
    pairs = torch.einsum("bik,bkj->bij", left, right).reshape(2, 6)
    torch.testing.assert_close(proj(dense, kjt), proj.over_arch(torch.cat([d, pairs], dim=1)))
    with pytest.raises(ValueError, match="multiple of embedding size"):
        DLRM_Projection(_ebc(), 3, [4], [5, 1], [7], [8])


def test_bad_tables_raise_value_and_assertion_errors() -> None:
    with pytest.raises(ModelConfigError) as err:
        DLRM(EmbeddingBagCollection(tables=[]), 3, [4], [2, 1])
    assert isinstance(err.value, ValueError) and isinstance(err.value, AssertionError)
    mixed = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=5, feature_names=["a"]),
            EmbeddingBagConfig(name="b", embedding_dim=8, num_embeddings=5, feature_names=["b"]),
        ]
    )
    with pytest.raises(ValueError, match="same embedding_dim"):
        DLRM(mixed, 3, [4], [2, 1])
    with pytest.raises(ValueError, match="must match"):
        DLRM(_ebc(), 3, [5], [2, 1])


def test_simple_deepfm() -> None:
    torch.manual_seed(0)
    model = SimpleDeepFMNN(num_dense_features=3, embedding_bag_collection=_ebc(), hidden_layer_size=6, deep_fm_dimension=5)
    dense, kjt = torch.randn(2, 3), _kjt()
    out = model(dense, kjt)
    embedded = model.dense_arch(dense)
    pooled = model.sparse_arch(kjt)
    tensors = [embedded] + [pooled[n] for n in ["f1", "f3", "f2"]]
    flat = torch.cat(tensors, dim=1)
    fm = 0.5 * (flat.sum(1, keepdim=True) ** 2 - (flat * flat).sum(1, keepdim=True))
    inter = torch.cat([embedded, model.inter_arch.deep_fm.dense_module(flat), fm], dim=1)
    torch.testing.assert_close(out, model.over_arch(inter))
    assert ((out > 0) & (out < 1)).all()


@pytest.mark.parametrize("wrapper", [DLRMWrapper, SimpleDeepFMNNWrapper])
def test_model_input_wrappers_train_on_bce_with_logits_and_eval_to_the_output(wrapper: type) -> None:
    torch.manual_seed(0)
    if wrapper is DLRMWrapper:
        model = DLRMWrapper(_ebc(), 3, [4], [2, 1])
    else:
        model = SimpleDeepFMNNWrapper(3, _ebc(), hidden_layer_size=6, deep_fm_dimension=5)
    dense, kjt, y = torch.randn(2, 3), _kjt(), torch.tensor([0.0, 1.0])
    out = super(wrapper, model).forward(dense, kjt)  # the unwrapped model's output [B, 1]
    loss, pred = model(SimpleNamespace(float_features=dense, idlist_features=kjt, label=y))
    z = out.squeeze()
    expected = -(y * torch.log(torch.sigmoid(z)) + (1 - y) * torch.log(1 - torch.sigmoid(z))).mean()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(pred, out)
    model.eval()  # no loss, so no label needed
    torch.testing.assert_close(model(SimpleNamespace(float_features=dense, idlist_features=kjt)), out)
