"""Quick start: the TorchRec tutorial's flow with recsys_core imports, on generated data.

1. a KeyedJaggedTensor and an EmbeddingBagCollection (the tutorial's product/user tables);
2. the same tables in a FusedEmbeddingBagCollection with the tutorial's fused_params
   (EXACT_ROWWISE_ADAGRAD, lr 0.02, eps 0.002): the update happens inside backward;
3. a tiny click model (fused tables + a dense layer, CombinedOptimizer) trained for a few
   hundred steps on generated clicks; prints the loss falling.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from recsys_core import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbOptimType,
    FusedEmbeddingBagCollection,
    JaggedTensor,
    KeyedJaggedTensor,
    PoolingType,
)
from recsys_core.optim import CombinedOptimizer, KeyedOptimizerWrapper, in_backward_optimizer_filter

TABLES = [
    EmbeddingBagConfig(name="product_table", embedding_dim=64, num_embeddings=4096,
                       feature_names=["product"], pooling=PoolingType.SUM),
    EmbeddingBagConfig(name="user_table", embedding_dim=64, num_embeddings=4096,
                       feature_names=["user"], pooling=PoolingType.SUM),
]


class ClickModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.sparse = FusedEmbeddingBagCollection(
            TABLES, EmbOptimType.EXACT_ROWWISE_ADAGRAD, {"learning_rate": 0.1, "eps": 1e-3}
        )
        self.over = nn.Sequential(nn.Linear(128, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.over(self.sparse(kjt).values()).squeeze(1)


def generated_clicks(gen: torch.Generator, batch: int) -> tuple[KeyedJaggedTensor, torch.Tensor]:
    """A click happens when product id and user id share parity, with 10% of labels flipped:
    learnable from embeddings, with a loss floor of about 0.325 (the noise's entropy)."""
    products = torch.randint(0, 64, (batch,), generator=gen)
    users = torch.randint(0, 64, (batch,), generator=gen)
    flip = torch.rand(batch, generator=gen) < 0.1
    labels = (((products + users) % 2 == 0) ^ flip).float()
    ones = torch.ones(batch, dtype=torch.long)
    kjt = KeyedJaggedTensor.from_jt_dict({
        "product": JaggedTensor(values=products, lengths=ones),
        "user": JaggedTensor(values=users, lengths=ones),
    })
    return kjt, labels


def main() -> None:
    parser = argparse.ArgumentParser(description="recsys_core quick start on generated data")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=256)
    args = parser.parse_args()
    torch.manual_seed(0)

    # 1. KJT + EBC, as in the tutorial
    kjt = KeyedJaggedTensor.from_jt_dict({
        "product": JaggedTensor(values=torch.tensor([1, 2, 1, 5]), lengths=torch.tensor([3, 1])),
        "user": JaggedTensor(values=torch.tensor([2, 3, 4, 1]), lengths=torch.tensor([2, 2])),
    })
    print(kjt)
    ebc = EmbeddingBagCollection(tables=TABLES, device="cpu")
    print(ebc.embedding_bags)
    result = ebc(kjt)
    print("keys:", result.keys(), "values:", tuple(result.values().shape))

    # 2. fused optimizer: backward updates the tables, no optimizer.step() needed
    fused = FusedEmbeddingBagCollection(TABLES, EmbOptimType.EXACT_ROWWISE_ADAGRAD, {"learning_rate": 0.02, "eps": 0.002})
    print(fused.fused_optimizer())
    for i in range(2):
        out = fused(kjt).values()
        loss = torch.sum(torch.ones_like(out) - out)
        print(f"iteration {i} loss: {loss.item():.4f}")
        loss.backward()

    # 3. a click model: fused tables + dense layers under one CombinedOptimizer
    model = ClickModel()
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())),
        lambda params: torch.optim.Adam(params, lr=0.01),
    )
    optimizer = CombinedOptimizer([("sparse", model.sparse.fused_optimizer()), dense])
    gen = torch.Generator().manual_seed(0)
    loss_fn = nn.BCEWithLogitsLoss()
    window: list[float] = []
    for step in range(1, args.steps + 1):
        batch, labels = generated_clicks(gen, args.batch_size)
        optimizer.zero_grad()
        loss = loss_fn(model(batch), labels)
        loss.backward()
        optimizer.step()
        window.append(loss.item())
        if step % 50 == 0 or step == args.steps:
            print(f"step {step:4d}  train loss {sum(window) / len(window):.4f}")
            window.clear()


if __name__ == "__main__":
    main()
