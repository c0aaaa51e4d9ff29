"""recsys_core.fx: TorchRec's symbolic_trace / Tracer on models over the sparse types.

No ``from __future__ import annotations``: fx reads the modules' real annotations.
"""

import torch

from recsys_core.distributed.awaitable import LazyNoWait
from recsys_core.fx import Tracer, is_fx_tracing, symbolic_trace
from recsys_core.sparse import KeyedJaggedTensor, KeyedTensor


def features() -> KeyedJaggedTensor:
    """user: [1, 2], [3]   item: [], [4, 5, 6]"""
    return KeyedJaggedTensor(
        keys=["user", "item"],
        values=torch.tensor([1, 2, 3, 4, 5, 6]),
        lengths=torch.tensor([2, 1, 0, 3]),
    )


class PoolSum(torch.nn.Module):
    """Sum of each bag's ids per key (a tiny stand-in for an embedding bag)."""

    def forward(self, values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        bags = offsets.numel() - 1
        ids = torch.repeat_interleave(torch.arange(bags), offsets[1:] - offsets[:-1])
        return torch.zeros(bags, dtype=values.dtype).index_add(0, ids, values)


class SparseModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pool = PoolSum()

    def forward(self, kjt: KeyedJaggedTensor) -> KeyedTensor:
        user = kjt["user"]
        item = kjt["item"]
        pooled = torch.stack(
            [
                self.pool(user.values(), user.offsets()),
                self.pool(item.values(), item.offsets()),
            ],
            dim=1,
        )
        return KeyedTensor(keys=["user", "item"], length_per_key=[1, 1], values=pooled)


def test_symbolic_trace_matches_eager_with_hand_values() -> None:
    model = SparseModel()
    traced = symbolic_trace(model)
    assert isinstance(traced, torch.fx.GraphModule)
    out = traced(features())
    # user bags [1, 2] -> 3, [3] -> 3; item bags [] -> 0, [4, 5, 6] -> 15
    assert out.keys() == ["user", "item"]
    assert out.values().tolist() == [[3, 0], [3, 15]]
    assert torch.equal(out.values(), model(features()).values())
    # PoolSum was traced through: its ops are in the graph, not a call to the submodule.
    assert "index_add" in traced.code
    assert not [n for n in traced.graph.nodes if n.op == "call_module"]


def test_leaf_modules_are_called_not_traced() -> None:
    traced = symbolic_trace(SparseModel(), leaf_modules=["PoolSum"])
    calls = [n.target for n in traced.graph.nodes if n.op == "call_module"]
    assert calls == ["pool", "pool"]
    assert "index_add" not in traced.code
    assert traced(features()).values().tolist() == [[3, 0], [3, 15]]


def test_is_leaf_module() -> None:
    tracer = Tracer(leaf_modules=["PoolSum"])
    assert tracer.is_leaf_module(PoolSum(), "pool")
    assert not tracer.is_leaf_module(SparseModel(), "")
    assert tracer.is_leaf_module(torch.nn.Linear(2, 2), "linear")  # torch.nn stays a leaf
    assert not Tracer().is_leaf_module(PoolSum(), "pool")


class Scaled(torch.nn.Module):
    def forward(self, kjt: KeyedJaggedTensor, double: bool) -> torch.Tensor:
        values = kjt.values()
        if double:
            return values * 2
        return values + 1


def test_concrete_args_fix_control_flow() -> None:
    traced = symbolic_trace(Scaled(), concrete_args={"double": False})
    assert traced(features(), False).tolist() == [2, 3, 4, 5, 6, 7]
    assert "* 2" not in traced.code


class ReturnsAwaitable(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return LazyNoWait(x + 2)


class UsesAwaitable(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.sparse = ReturnsAwaitable()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.sparse(x) * 10


def test_awaitables_are_waited_in_the_graph() -> None:
    traced = symbolic_trace(ReturnsAwaitable())
    assert traced(torch.tensor([1.0, 2.0])).tolist() == [3.0, 4.0]
    traced = symbolic_trace(UsesAwaitable())
    assert traced(torch.tensor([1.0, 2.0])).tolist() == [30.0, 40.0]


class RecordsTracing(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(is_fx_tracing())
        return x


def test_is_fx_tracing_only_while_tracing() -> None:
    module = RecordsTracing()
    symbolic_trace(module)
    module(torch.ones(1))
    assert module.seen == [True, False]


def test_traced_model_scripts() -> None:
    scripted = torch.jit.script(symbolic_trace(SparseModel(), leaf_modules=["PoolSum"]))
    assert scripted(features()).values().tolist() == [[3, 0], [3, 15]]
