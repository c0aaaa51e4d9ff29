"""RowWiseAdagrad (TorchRec 1.8's torchrec.optim.rowwise_adagrad): equal to torch Adagrad on
rows of equal entries, lr_decay / initial_accumulator_value / maximize, hand-computed rows."""

from __future__ import annotations

import math

import pytest
import torch

from recsys_core.optim import RowWiseAdagrad
from recsys_core.optim.rowwise_adagrad import RowWiseAdagrad as FromModule

INDEX, OFFSETS = torch.tensor([0, 3]), torch.tensor([0, 1])
UNIFORM = torch.tensor([[1.0] * 4, [2.0] * 4, [3.0] * 4, [4.0] * 4])


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"lr": 0.3, "lr_decay": 0.5}, {"initial_accumulator_value": 0.7}, {"maximize": True},
     {"weight_decay": 0.1}],
)
def test_equals_adagrad_on_uniform_rows(kwargs: dict) -> None:
    rowwise = torch.nn.EmbeddingBag(4, 4, mode="sum")
    plain = torch.nn.EmbeddingBag(4, 4, mode="sum")
    rowwise.load_state_dict({"weight": UNIFORM})
    plain.load_state_dict({"weight": UNIFORM})
    row_opt = RowWiseAdagrad(rowwise.parameters(), **kwargs)
    opt = torch.optim.Adagrad(plain.parameters(), **kwargs)
    for _ in range(5):
        for bag, o in ((rowwise, row_opt), (plain, opt)):
            o.zero_grad()
            bag(INDEX, OFFSETS).sum().backward()
            o.step()
        torch.testing.assert_close(rowwise.weight, plain.weight)
    assert float(row_opt.state[rowwise.weight]["step"]) == 5.0
    assert FromModule is RowWiseAdagrad


def test_row_accumulator_is_the_mean_square() -> None:
    w = torch.nn.Parameter(torch.zeros(2, 2))
    opt = RowWiseAdagrad([w], lr=1.0, eps=0.0, initial_accumulator_value=0.5)
    assert opt.state[w]["sum"].tolist() == [0.5, 0.5]
    w.grad = torch.tensor([[3.0, 1.0], [0.0, 0.0]])
    opt.step()
    # row 0: sum = 0.5 + (9 + 1) / 2 = 5.5, w -= g / sqrt(5.5); row 1: no gradient, unchanged
    assert opt.state[w]["sum"].tolist() == pytest.approx([5.5, 0.5])
    expected = torch.tensor([[-3.0, -1.0], [0.0, 0.0]]) / torch.tensor([[math.sqrt(5.5)], [1.0]])
    torch.testing.assert_close(w.detach(), expected)


def test_sparse_gradient_touches_only_present_rows() -> None:
    bag = torch.nn.EmbeddingBag(4, 4, mode="sum", sparse=True)
    bag.load_state_dict({"weight": UNIFORM})
    opt = RowWiseAdagrad(bag.parameters(), lr=0.5, weight_decay=0.1)
    bag(INDEX, OFFSETS).sum().backward()
    opt.step()
    # rows 0 and 3: g = 1 + 0.1 w, sum = g^2, w -= 0.5 * g / |g| = w - 0.5; rows 1, 2 untouched
    torch.testing.assert_close(bag.weight[[0, 3]], UNIFORM[[0, 3]] - 0.5)
    torch.testing.assert_close(bag.weight[[1, 2]], UNIFORM[[1, 2]])


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="'lr_decay': -1.0"):
        RowWiseAdagrad([torch.nn.Parameter(torch.zeros(2, 2))], lr_decay=-1.0)
    with pytest.raises(ValueError, match="must be 2-D"):
        RowWiseAdagrad([torch.nn.Parameter(torch.zeros(3))])


def test_torchrec_shaped_accumulator_and_functional_form() -> None:
    from recsys_core.optim.rowwise_adagrad import adagrad

    # TorchRec keeps the accumulator as [rows, 1]; a state dict saved there must update the
    # same rows here (a [rows] + [rows, 1] sum would silently broadcast to [rows, rows]).
    w = torch.nn.Parameter(torch.zeros(2, 2))
    opt = RowWiseAdagrad([w], lr=1.0, eps=0.0)
    state = opt.state_dict()
    state["state"][0]["sum"] = torch.tensor([[0.5], [0.5]])
    opt.load_state_dict(state)
    w.grad = torch.tensor([[3.0, 1.0], [0.0, 0.0]])
    opt.step()
    assert opt.state[w]["sum"].shape == (2, 1)
    assert opt.state[w]["sum"].view(-1).tolist() == pytest.approx([5.5, 0.5])
    expected = torch.tensor([[-3.0, -1.0], [0.0, 0.0]]) / torch.tensor([[math.sqrt(5.5)], [1.0]])
    torch.testing.assert_close(w.detach(), expected)
    # the functional form, hand-computed: sum = 0 + (4 + 0) / 2 = 2, w -= 0.5 * g / sqrt(2)
    p, sums, step = torch.zeros(1, 2), torch.zeros(1), torch.tensor(0.0)
    adagrad([p], [torch.tensor([[2.0, 0.0]])], [sums], [step], lr=0.5, weight_decay=0.0,
            lr_decay=0.0, eps=0.0, maximize=False)
    torch.testing.assert_close(p, torch.tensor([[-1.0 / math.sqrt(2.0), 0.0]]))
    assert sums.tolist() == [2.0] and float(step) == 1.0
    with pytest.raises(ValueError, match="3 entries for a table of 1 rows"):
        adagrad([p], [p.clone()], [torch.zeros(3)], [step], lr=0.5, weight_decay=0.0,
                lr_decay=0.0, eps=0.0, maximize=False)
