"""KeyedOptimizer and KeyedOptimizerWrapper: TorchRec 1.8's state-dict layout, strict loading,
init_state, save_param_groups; updates checked against plain torch.optim."""

from __future__ import annotations

import copy
import io
from collections import defaultdict
from typing import Any

import pytest
import torch
from optim_steps import assert_resumes_exactly, power_loss_steps

from recsys_core.optim.keyed import KeyedOptimizer, KeyedOptimizerWrapper


class Stateful:
    """An object with the PyTorch stateful protocol (like a sub-optimizer module)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def state_dict(self) -> dict[str, Any]:
        return {"tensor": self.tensor}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.tensor.copy_(state_dict["tensor"])


def make_keyed() -> tuple[KeyedOptimizer, torch.Tensor, torch.Tensor]:
    p1, p2 = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])
    opt = KeyedOptimizer(
        {"param_1": p1, "param_2": p2},
        {
            p1: {
                "one": 1.0,
                "tensor": torch.tensor([5.0, 6.0]),
                "nested": {"tensor": torch.tensor([7.0, 8.0])},
                "module": Stateful(torch.tensor([9.0, 10.0])),
            },
            p2: {"two": 2.0},
        },
        [{"params": [p2, p1], "lr": 3.0, "momentum": 4.0}],
    )
    return opt, p1, p2


def test_state_dict_is_keyed_by_name_without_param_groups_by_default() -> None:
    opt, p1, _ = make_keyed()
    sd = opt.state_dict()
    assert set(sd) == {"state"}
    assert sd["state"]["param_2"] == {"two": 2.0}
    s1 = sd["state"]["param_1"]
    assert s1["one"] == 1.0
    assert s1["tensor"] is opt.state[p1]["tensor"]  # the optimizer's own tensor: DCP fills it
    torch.testing.assert_close(s1["nested"]["tensor"], torch.tensor([7.0, 8.0]))
    torch.testing.assert_close(s1["module"]["tensor"], torch.tensor([9.0, 10.0]))


def test_save_param_groups_adds_sorted_names() -> None:
    opt, _, _ = make_keyed()
    opt.save_param_groups(True)
    groups = opt.state_dict()["param_groups"]
    assert groups == [{"params": ["param_1", "param_2"], "lr": 3.0, "momentum": 4.0}]
    assert list(groups[0]) == ["params", "lr", "momentum"]


def test_load_state_dict_copies_in_place_and_loads_groups() -> None:
    opt, p1, p2 = make_keyed()
    opt.save_param_groups(True)
    tensor_before = opt.state[p1]["tensor"]
    sd = copy.deepcopy(opt.state_dict())
    sd["state"]["param_1"]["one"] = 10.0
    sd["state"]["param_1"]["tensor"] = torch.tensor([50.0, 60.0])
    sd["state"]["param_1"]["nested"]["tensor"] = torch.tensor([70.0, 80.0])
    sd["state"]["param_1"]["module"]["tensor"] = torch.tensor([90.0, 100.0])
    sd["state"]["param_2"]["two"] = 20.0
    sd["param_groups"][0]["lr"] = 8.0
    opt.load_state_dict(sd)
    assert opt.state[p1]["one"] == 10.0 and opt.state[p2]["two"] == 20.0
    assert opt.state[p1]["tensor"] is tensor_before
    torch.testing.assert_close(tensor_before, torch.tensor([50.0, 60.0]))
    torch.testing.assert_close(opt.state[p1]["nested"]["tensor"], torch.tensor([70.0, 80.0]))
    torch.testing.assert_close(opt.state[p1]["module"].tensor, torch.tensor([90.0, 100.0]))
    assert opt.param_groups[0]["lr"] == 8.0


def test_param_groups_are_kept_when_not_saved() -> None:
    opt, _, _ = make_keyed()
    opt.save_param_groups(True)
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][0]["lr"] = 8.0
    opt.save_param_groups(False)
    opt.load_state_dict(sd)  # groups in the dict are ignored
    assert opt.param_groups[0]["lr"] == 3.0
    opt.load_state_dict({"state": copy.deepcopy(opt.state_dict()["state"])})
    opt.save_param_groups(True)
    with pytest.raises(ValueError, match="no 'param_groups'"):
        opt.load_state_dict({"state": copy.deepcopy(opt.state_dict()["state"])})


def test_load_validation_errors() -> None:
    opt, _, _ = make_keyed()
    good = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match="Different parameter count: 2 vs 1"):
        opt.load_state_dict({"state": {"param_1": good["state"]["param_1"]}})
    with pytest.raises(ValueError, match="Parameter param_2 not found"):
        opt.load_state_dict({"state": {"param_1": good["state"]["param_1"], "other": {}}})
    bad = copy.deepcopy(good)
    bad["state"]["param_2"]["extra"] = 1.0
    with pytest.raises(ValueError, match="Different state size: 1 vs 2"):
        opt.load_state_dict(bad)
    bad = copy.deepcopy(good)
    bad["state"]["param_2"] = {"three": 2.0}
    with pytest.raises(ValueError, match="has no entry 'two'"):
        opt.load_state_dict(bad)
    bad = copy.deepcopy(good)
    bad["state"]["param_1"]["tensor"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"shape \(3,\) in the state_dict, \(2,\) here"):
        opt.load_state_dict(bad)
    with pytest.raises(RuntimeError):  # TorchRec's copy_ raised RuntimeError: both are caught
        opt.load_state_dict(bad)


def test_param_group_validation_on_load() -> None:
    opt, _, _ = make_keyed()
    opt.save_param_groups(True)
    good = copy.deepcopy(opt.state_dict())
    for groups, message in [
        ([], "Different param_groups count: 1 vs 0"),
        ([{"params": ["param_1"], "lr": 1.0, "momentum": 0.0}], "Group param_1/param_2 not found"),
        ([{"params": ["param_2", "param_1"], "lr": 1.0}], "Different param_group size: 3 vs 2"),
        ([{"params": ["param_1", "param_2"], "lr": 1.0, "beta": 0.0}], "Group key momentum not found"),
    ]:
        with pytest.raises(ValueError, match=message):
            opt.load_state_dict({"state": good["state"], "param_groups": groups})


def test_state_keys_must_be_params() -> None:
    p = torch.tensor([1.0, 2.0])
    with pytest.raises(ValueError, match="All state keys must be params"):
        KeyedOptimizer({"param_1": p}, {p: 1.0, "non_param_state_key": 2.0}, [{"params": [p]}])


def test_base_step_and_add_param_group_are_not_implemented() -> None:
    opt, p1, _ = make_keyed()
    with pytest.raises(NotImplementedError):
        opt.step()
    with pytest.raises(NotImplementedError, match="fixed at construction"):
        opt.add_param_group({"params": [p1]})


def test_wrapper_steps_like_torch_and_shares_state() -> None:
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(3, 2))
    ref = torch.nn.Parameter(w.detach().clone())
    opt = KeyedOptimizerWrapper({"w": w}, lambda ps: torch.optim.Adam(ps, lr=0.1))
    ref_opt = torch.optim.Adam([ref], lr=0.1)
    for i in range(3):
        for p, o in ((w, opt), (ref, ref_opt)):
            o.zero_grad()
            ((p * (i + 1)) ** 2).sum().backward()
            o.step()
    torch.testing.assert_close(w.detach(), ref.detach(), rtol=0, atol=0)
    sd = opt.state_dict()
    assert set(sd["state"]["w"]) == {"step", "exp_avg", "exp_avg_sq"}
    assert float(sd["state"]["w"]["step"]) == 3.0
    assert opt.state is opt._optimizer.state and opt.param_groups is opt._optimizer.param_groups


def test_wrapper_pass_params_dict() -> None:
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    seen: list[Any] = []

    def factory(params: dict[str, torch.Tensor]) -> torch.optim.Optimizer:
        seen.append(params)
        return torch.optim.SGD([{"params": [params["a"]], "lr": 1.0}, {"params": [params["b"]], "lr": 0.5}])

    opt = KeyedOptimizerWrapper({"a": a, "b": b}, factory, pass_params_dict=True)
    assert seen == [{"a": a, "b": b}]
    a.grad, b.grad = torch.ones(2), torch.ones(2)
    opt.step()
    torch.testing.assert_close(a.detach(), torch.zeros(2))
    torch.testing.assert_close(b.detach(), torch.full((2,), 0.5))
    opt.save_param_groups(True)
    assert [g["params"] for g in opt.state_dict()["param_groups"]] == [["a"], ["b"]]


def test_wrapper_zero_grad_sets_none_as_torchrec_does() -> None:
    p = torch.nn.Parameter(torch.ones(2))
    opt = KeyedOptimizerWrapper({"p": p}, lambda ps: torch.optim.SGD(ps, lr=0.1))
    p.grad = torch.ones(2)
    opt.zero_grad(set_to_none=False)  # TorchRec does not forward the flag
    assert p.grad is None


@pytest.mark.parametrize("momentum", [0.0, 0.1])
def test_init_state_dense_and_sparse(momentum: float) -> None:
    dense = torch.nn.Parameter(torch.ones((2, 3)))
    sparse = torch.nn.Parameter(torch.ones((1, 4)))
    opt = KeyedOptimizerWrapper(
        {"dense": dense, "sparse": sparse}, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=momentum)
    )
    opt.init_state({"sparse"})
    assert dense.grad is not None and not dense.grad.is_sparse
    assert sparse.grad is not None and sparse.grad.is_sparse
    torch.testing.assert_close(dense.grad, torch.zeros(2, 3))
    torch.testing.assert_close(dense.detach(), torch.ones(2, 3))
    state = opt.state_dict()["state"]
    if momentum:
        torch.testing.assert_close(state["dense"]["momentum_buffer"], torch.zeros(2, 3))
        assert "momentum_buffer" in state["sparse"]
    else:
        assert state == {}


def test_init_state_steps_at_the_configured_lr() -> None:
    # TorchRec's init_state is a real step with zero gradients: Adam's step becomes 1 and
    # weight decay (independent of the gradient) is applied once: w <- w - lr * wd * w.
    w = torch.nn.Parameter(torch.full((2,), 2.0))
    opt = KeyedOptimizerWrapper({"w": w}, lambda ps: torch.optim.SGD(ps, lr=0.5, weight_decay=0.1))
    opt.init_state()
    torch.testing.assert_close(w.detach(), torch.full((2,), 2.0 - 0.5 * 0.1 * 2.0))
    v = torch.nn.Parameter(torch.full((2,), 2.0))
    adam = KeyedOptimizerWrapper({"v": v}, lambda ps: torch.optim.Adam(ps, lr=0.5))
    adam.init_state()
    assert float(adam.state_dict()["state"]["v"]["step"]) == 1.0
    torch.testing.assert_close(v.detach(), torch.full((2,), 2.0))


def test_init_state_then_load_checkpoint_resumes_exactly() -> None:
    torch.manual_seed(1)
    w = torch.nn.Parameter(torch.randn(4))
    opt = KeyedOptimizerWrapper({"w": w}, lambda ps: torch.optim.Adam(ps, lr=0.3))
    power_loss_steps(opt, w, 3, steps=2)
    sd = copy.deepcopy(opt.state_dict())
    w2 = torch.nn.Parameter(w.detach().clone())
    opt2 = KeyedOptimizerWrapper({"w": w2}, lambda ps: torch.optim.Adam(ps, lr=0.3))
    with pytest.raises(ValueError, match="Different parameter count: 0 vs 1"):
        opt2.load_state_dict(sd)
    opt2.init_state()
    opt2.load_state_dict(sd)
    assert_resumes_exactly((w, opt), (w2, opt2), 3)


def test_pickle_round_trip() -> None:
    p = torch.nn.Parameter(torch.ones(2, 3))
    opt = KeyedOptimizerWrapper({"p": p}, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    opt.init_state()
    buf = io.BytesIO()
    torch.save(opt, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    torch.testing.assert_close(
        loaded.state_dict()["state"]["p"]["momentum_buffer"],
        opt.state_dict()["state"]["p"]["momentum_buffer"],
    )
    assert loaded.param_groups[0]["lr"] == 0.1


def test_lr_scheduler_drives_a_wrapper() -> None:
    p = torch.nn.Parameter(torch.zeros(1))
    opt = KeyedOptimizerWrapper({"p": p}, lambda ps: torch.optim.SGD(ps, lr=1.0))
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    lrs = []
    for _ in range(3):
        p.grad = torch.ones(1)
        opt.step()
        scheduler.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs == [0.5, 0.25, 0.125]
    torch.testing.assert_close(p.detach(), torch.tensor([-(1.0 + 0.5 + 0.25)]))


def test_keyed_optimizer_accepts_defaultdict_state() -> None:
    p = torch.tensor([1.0])
    state: defaultdict[Any, dict[str, Any]] = defaultdict(dict)
    opt = KeyedOptimizer({"p": p}, state, [{"params": [p]}])
    assert opt.state is state and opt.state_dict() == {"state": {}}
