"""recsys_core.models.dlrm's training path (the dot interaction's one-pass form, the sparse
arch reading a collection's output in place) against the plain TorchRec-form ops it stands for:
the same forward bits, gradients equal to autograd's within rounding, in fp32 and under bf16
autocast; the sparse arch's reordering when a collection's keys come in another order."""

from __future__ import annotations

import pytest
import torch

from recsys_core import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from recsys_core.models.dlrm import DLRM, InteractionArch, SparseArch
from recsys_core.sparse import KeyedTensor

B, F, D = 6, 4, 8


def plain_interaction(dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
    """TorchRec's form: stack, batched Gram product, the pairs above the diagonal, autograd."""
    combined = torch.cat((dense.unsqueeze(1), sparse), dim=1)
    gram = torch.bmm(combined, combined.transpose(1, 2))
    rows, cols = torch.triu_indices(F + 1, F + 1, 1)
    return torch.cat((dense, gram[:, rows, cols]), dim=1)


def inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    dense = torch.randn(B, D, generator=gen).requires_grad_()
    sparse = torch.randn(B, F, D, generator=gen).requires_grad_()
    return dense, sparse


@pytest.mark.parametrize(("amp", "dense_dtype"), [(False, torch.float32),
                                                  (True, torch.float32), (True, torch.bfloat16)])
def test_training_interaction_equals_the_plain_form(amp: bool, dense_dtype: torch.dtype) -> None:
    # under autocast the bottom MLP hands over bf16; fp32 dense makes cat's output fp32
    arch = InteractionArch(F)
    dense, sparse = inputs(0)
    dense = dense.detach().to(dense_dtype).requires_grad_()
    dense2, sparse2 = (t.detach().clone().requires_grad_() for t in (dense, sparse))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        got = arch(dense, sparse)
        want = plain_interaction(dense2, sparse2)
    assert got.dtype == want.dtype == dense_dtype
    assert torch.equal(got, want)  # the same rounding: the stack in the product's dtype
    grad = torch.randn(got.shape, generator=torch.Generator().manual_seed(1)).to(got.dtype)
    got.backward(grad)
    want.backward(grad)
    # (G + G^T) z in one product against autograd's G z + G^T z: equal up to rounding
    tol = dict(rtol=2e-2, atol=2e-2) if amp else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dense.grad, dense2.grad, **tol)
    torch.testing.assert_close(sparse.grad, sparse2.grad, **tol)
    assert dense.grad.dtype == dense_dtype and sparse.grad.dtype == torch.float32


def test_training_interaction_gradient_by_hand() -> None:
    # one pair (F = 1): out = [d, d.e]; d/dd = g_d + g_p e, d/de = g_p d
    arch = InteractionArch(1)
    dense = torch.tensor([[1.0, 2.0]], requires_grad=True)
    sparse = torch.tensor([[[3.0, -1.0]]], requires_grad=True)
    out = arch(dense, sparse)
    assert out.tolist() == [[1.0, 2.0, 1.0]]
    out.backward(torch.tensor([[0.5, -0.5, 2.0]]))
    assert dense.grad.tolist() == [[0.5 + 2.0 * 3.0, -0.5 + 2.0 * -1.0]]
    assert sparse.grad.tolist() == [[[2.0 * 1.0, 2.0 * 2.0]]]


def test_inference_keeps_the_plain_form() -> None:
    arch = InteractionArch(F)
    dense, sparse = inputs(2)
    with torch.no_grad():
        assert torch.equal(arch(dense, sparse), plain_interaction(dense, sparse))
    scripted = torch.jit.script(arch)
    with torch.no_grad():
        assert torch.equal(scripted(dense, sparse), plain_interaction(dense, sparse))


def ebc() -> EmbeddingBagCollection:
    torch.manual_seed(0)
    return EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=D, num_embeddings=10,
                           feature_names=[f"f{i}"]) for i in range(F)])


def kjt() -> KeyedJaggedTensor:
    return KeyedJaggedTensor(keys=[f"f{i}" for i in range(F)],
                             values=torch.tensor([1, 2, 3, 4, 5, 6, 7, 8]),
                             lengths=torch.tensor([1, 1, 2, 0, 1, 1, 1, 1]))


def test_sparse_arch_stacks_in_feature_order() -> None:
    collection = ebc()
    arch = SparseArch(collection)
    got = arch(kjt())
    by_name = collection(kjt()).to_dict()
    want = torch.stack([by_name[f"f{i}"] for i in range(F)], dim=1)
    assert got.shape == (2, F, D) and torch.equal(got, want)


class Reordered(torch.nn.Module):
    """A collection whose output lists its keys in another order (as a sharded one may)."""

    def __init__(self, inner: EmbeddingBagCollection) -> None:
        super().__init__()
        self.inner = inner

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self.inner.embedding_bag_configs()

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        by_name = self.inner(features).to_dict()
        keys = [f"f{i}" for i in reversed(range(F))]
        return KeyedTensor.from_tensor_list(keys, [by_name[k] for k in keys])


def test_sparse_arch_reorders_keys_that_come_in_another_order() -> None:
    collection = ebc()
    assert torch.equal(SparseArch(Reordered(collection))(kjt()), SparseArch(collection)(kjt()))


def test_dlrm_trains_to_the_plain_forms_gradients() -> None:
    torch.manual_seed(0)
    model = DLRM(embedding_bag_collection=ebc(), dense_in_features=3,
                 dense_arch_layer_sizes=[5, D], over_arch_layer_sizes=[7, 1])
    dense = torch.randn(2, 3)
    model(dense, kjt()).sum().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    # the same model through the plain forms: to_dict + cat, and autograd's interaction
    pooled = model.sparse_arch.embedding_bag_collection(kjt()).to_dict()
    sparse = torch.cat([pooled[f"f{i}"] for i in range(F)], dim=1).reshape(-1, F, D)
    embedded = model.dense_arch(dense)
    logits = model.over_arch(plain_interaction(embedded, sparse))
    logits.sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_sparse_arch_scripts_to_the_eager_values() -> None:
    collection = ebc()
    arch = SparseArch(collection)
    scripted = torch.jit.script(arch)
    assert torch.equal(scripted(kjt()), arch(kjt()))
