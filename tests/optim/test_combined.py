"""CombinedOptimizer and OptimizerWrapper: TorchRec 1.8's key prefixes, state-dict layout,
delegation of step / zero_grad / set_optimizer_step / update_hyper_parameters."""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch
from optim_steps import assert_resumes_exactly, power_loss_steps

from recsys_core.optim.keyed import (
    CombinedOptimizer,
    KeyedOptimizer,
    KeyedOptimizerWrapper,
    OptimizerWrapper,
)


class Recording(KeyedOptimizer):
    """A KeyedOptimizer whose step / hyper-parameter calls are recorded."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.calls: list[Any] = []

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.calls.append(("step", closure))

    def set_optimizer_step(self, step: int) -> None:
        self.calls.append(("set_optimizer_step", step))

    def update_hyper_parameters(self, params_dict: dict[str, Any]) -> None:
        self.calls.append(("update_hyper_parameters", params_dict))


def two_keyed() -> tuple[Recording, Recording, torch.Tensor, torch.Tensor]:
    p1, p2 = torch.tensor([1.0, 2.0]), torch.tensor([-1.0, -2.0])
    k1 = Recording({"param_1": p1}, {p1: {"one": 1.0}}, [{"params": [p1], "val": 2.0}])
    k2 = Recording({"param_2": p2}, {p2: {"two": -1.0}}, [{"params": [p2], "val": -2.0}])
    return k1, k2, p1, p2


def test_prefixed_names_views_and_state_dict_layout() -> None:
    k1, k2, p1, p2 = two_keyed()
    combined = CombinedOptimizer([("ko1", k1), k2])
    assert combined.optimizers == [("ko1", k1), ("", k2)]
    assert combined.params == {"ko1.param_1": p1, "param_2": p2}
    assert combined.state == {p1: {"one": 1.0}, p2: {"two": -1.0}}
    assert [g["val"] for g in combined.param_groups] == [2.0, -2.0]
    assert combined.state_dict() == {"state": {"ko1.param_1": {"one": 1.0}, "param_2": {"two": -1.0}}}
    combined.save_param_groups(True)
    assert k1.defaults["_save_param_groups"] and k2.defaults["_save_param_groups"]
    assert combined.state_dict()["param_groups"] == [
        {"params": ["ko1.param_1"], "val": 2.0},
        {"params": ["param_2"], "val": -2.0},
    ]
    assert CombinedOptimizer.prepend_opt_key("w", "") == "w"
    assert CombinedOptimizer.prepend_opt_key("", "sparse") == "sparse"


def test_load_state_dict_reaches_members() -> None:
    k1, k2, p1, p2 = two_keyed()
    combined = CombinedOptimizer([("ko1", k1), ("", k2)])
    combined.save_param_groups(True)
    sd = combined.state_dict()
    sd["state"]["ko1.param_1"] = {"one": 999}
    sd["state"]["param_2"] = {"two": 998}
    sd["param_groups"][0]["val"] = 997
    sd["param_groups"][1]["val"] = 996
    combined.load_state_dict(sd)
    assert k1.state[p1] == {"one": 999} and k2.state[p2] == {"two": 998}
    assert k1.param_groups[0]["val"] == 997 and k2.param_groups[0]["val"] == 996


def test_load_rejects_unknown_and_missing_entries() -> None:
    k1, k2, _, _ = two_keyed()
    combined = CombinedOptimizer([("ko1", k1), ("ko2", k2)])
    sd = copy.deepcopy(combined.state_dict())
    with pytest.raises(ValueError, match="belongs to none of the optimizers"):
        combined.load_state_dict({"state": {**sd["state"], "other.x": {}}})
    del sd["state"]["ko2.param_2"]
    with pytest.raises(ValueError, match="Different parameter count: 1 vs 0"):
        combined.load_state_dict(sd)


def test_members_with_the_same_prefix_are_told_apart_by_name() -> None:
    k1, k2, p1, p2 = two_keyed()
    combined = CombinedOptimizer([k1, k2])
    combined.load_state_dict({"state": {"param_1": {"one": 5.0}, "param_2": {"two": 6.0}}})
    assert k1.state[p1] == {"one": 5.0} and k2.state[p2] == {"two": 6.0}


def test_duplicate_keys_and_mixed_flags_are_errors() -> None:
    k1, _, _, _ = two_keyed()
    with pytest.raises(ValueError, match="Duplicate param key param_1"):
        CombinedOptimizer([k1, k1])
    k3, k4, _, _ = two_keyed()
    k3.save_param_groups(True)
    with pytest.raises(ValueError, match="disagree on save_param_groups"):
        CombinedOptimizer([k3, k4])


def test_step_zero_grad_and_hyper_parameters_are_delegated() -> None:
    k1, k2, _, _ = two_keyed()
    combined = CombinedOptimizer([("a", k1), ("b", k2)])

    def closure() -> float:
        return 1.0

    combined.step(closure)
    combined.set_optimizer_step(7)
    combined.update_hyper_parameters({"lr": 0.5})
    expected = [("step", closure), ("set_optimizer_step", 7), ("update_hyper_parameters", {"lr": 0.5})]
    assert k1.calls == expected and k2.calls == expected


def test_combined_steps_members_like_their_torch_optimizers() -> None:
    torch.manual_seed(2)
    a, b = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2, 2))
    ra, rb = (torch.nn.Parameter(t.detach().clone()) for t in (a, b))
    combined = CombinedOptimizer([
        ("sgd", KeyedOptimizerWrapper({"a": a}, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))),
        ("adam", KeyedOptimizerWrapper({"b": b}, lambda ps: torch.optim.Adam(ps, lr=0.01))),
    ])
    ref = [torch.optim.SGD([ra], lr=0.1, momentum=0.9), torch.optim.Adam([rb], lr=0.01)]
    for _ in range(3):
        combined.zero_grad()
        ((a**2).sum() + (b**3).sum()).backward()
        combined.step()
        for o in ref:
            o.zero_grad()
        ((ra**2).sum() + (rb**3).sum()).backward()
        for o in ref:
            o.step()
    torch.testing.assert_close(a.detach(), ra.detach(), rtol=0, atol=0)
    torch.testing.assert_close(b.detach(), rb.detach(), rtol=0, atol=0)
    sd = combined.state_dict()["state"]
    assert set(sd) == {"sgd.a", "adam.b"}
    torch.testing.assert_close(sd["sgd.a"]["momentum_buffer"], ref[0].state[ra]["momentum_buffer"])


def test_combined_checkpoint_resume() -> None:
    def build(a: torch.Tensor) -> CombinedOptimizer:
        return CombinedOptimizer([("d", KeyedOptimizerWrapper({"a": a}, lambda ps: torch.optim.Adam(ps, lr=0.1)))])

    a = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = build(a)
    power_loss_steps(opt, a, 2, steps=2)
    a2 = torch.nn.Parameter(a.detach().clone())
    opt2 = build(a2)
    opt2.init_state()
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert_resumes_exactly((a, opt), (a2, opt2), 2)


def test_pickle_round_trip() -> None:
    k1, k2, _, _ = two_keyed()
    combined = CombinedOptimizer([("ko1", k1), ("", k2)])
    buf = io.BytesIO()
    torch.save(combined, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert loaded.state_dict() == combined.state_dict()


def test_optimizer_wrapper_delegates_load_and_groups() -> None:
    p = torch.tensor([1.0, 2.0])
    keyed = Recording({"param_1": p}, {p: {"one": 1.0}}, [{"params": [p], "val": 2.0}])
    wrapper = OptimizerWrapper(keyed)
    wrapper.save_param_groups(True)
    assert keyed.defaults["_save_param_groups"]
    sd = wrapper.state_dict()
    sd["state"]["param_1"] = {"one": 999}
    sd["param_groups"][0]["val"] = 998
    wrapper.load_state_dict(sd)
    assert keyed.state[p] == {"one": 999} and wrapper.state[p] == {"one": 999}
    assert keyed.param_groups[0]["val"] == 998 and wrapper.param_groups[0]["val"] == 998
    wrapper.step()
    wrapper.set_optimizer_step(3)
    wrapper.update_hyper_parameters({"lr": 1.0})
    assert keyed.calls == [("step", None), ("set_optimizer_step", 3), ("update_hyper_parameters", {"lr": 1.0})]
    assert repr(wrapper) == repr(keyed)
