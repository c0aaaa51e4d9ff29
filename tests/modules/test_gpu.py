"""CUDA runs of the same modules (marked ``gpu``: skipped where torch has no CUDA device).

The fused collection uses FBGEMM's CUDA kernels where ``fbgemm-gpu`` is installed and the torch
kernel otherwise; either way it must equal the unfused module with a plain torch optimizer.
"""

from __future__ import annotations

import pytest
import torch

from recsys_core import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbOptimType,
    FusedEmbeddingBagCollection,
    KeyedJaggedTensor,
    PoolingType,
)
from recsys_core.optim import RowWiseAdagrad

TABLES = [
    EmbeddingBagConfig(name="a", embedding_dim=16, num_embeddings=100, feature_names=["fa"], pooling=PoolingType.SUM),
    EmbeddingBagConfig(name="b", embedding_dim=8, num_embeddings=50, feature_names=["fb", "fc"], pooling=PoolingType.MEAN),
]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "fused, ref_class",
    [(EmbOptimType.EXACT_SGD, torch.optim.SGD), (EmbOptimType.EXACT_ROWWISE_ADAGRAD, RowWiseAdagrad)],
)
def test_fused_equals_unfused_on_cuda(fused: EmbOptimType, ref_class: type) -> None:
    device = torch.device("cuda")
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(TABLES, device=device)
    model = FusedEmbeddingBagCollection(TABLES, fused, {"learning_rate": 0.1, "eps": 1e-3} if fused is not EmbOptimType.EXACT_SGD else {"learning_rate": 0.1}, device=device)
    model.load_state_dict(ebc.state_dict())
    ref_opt = ref_class(ebc.parameters(), lr=0.1, **({"eps": 1e-3} if ref_class is RowWiseAdagrad else {}))
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        lengths = torch.randint(0, 4, (3 * 8,), generator=gen)
        values = torch.randint(0, 50, (int(lengths.sum()),), generator=gen)
        kjt = KeyedJaggedTensor(keys=["fa", "fb", "fc"], values=values, lengths=lengths).to(device)
        target = torch.randn(8, 32, generator=gen).to(device)
        out_ref, out = ebc(kjt), model(kjt)
        torch.testing.assert_close(out.values(), out_ref.values(), atol=1e-5, rtol=1e-5)
        ref_opt.zero_grad()
        (out_ref.values() * target).sum().backward()
        ref_opt.step()
        (out.values() * target).sum().backward()
    for name, w in model.state_dict().items():
        torch.testing.assert_close(w, ebc.state_dict()[name], atol=1e-5, rtol=1e-5)
