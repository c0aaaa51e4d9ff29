"""GradientClippingOptimizer: norm and value clipping with hand-computed gradients, the tracked
total norm, and the norm helpers (TorchRec 1.8's torchrec.optim.clipping)."""

from __future__ import annotations

import math
from typing import Any
from unittest.mock import patch

import pytest
import torch

from recsys_core.optim.clipping import (
    GradientClipping,
    GradientClippingOptimizer,
    _batch_cal_norm,
    _compute_total_norm,
    _get_grads,
)
from recsys_core.optim.keyed import KeyedOptimizer, KeyedOptimizerWrapper


class NoStep(KeyedOptimizer):
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        return None


def clipper(grads: list[list[float]], **kwargs: Any) -> tuple[GradientClippingOptimizer, list[torch.Tensor]]:
    params = [torch.zeros(len(g), requires_grad=True) for g in grads]
    keyed = NoStep({f"p{i}": p for i, p in enumerate(params)}, {}, [{"params": [p]} for p in params])
    opt = GradientClippingOptimizer(keyed, **kwargs)
    for p, g in zip(params, grads, strict=True):
        p.grad = torch.tensor(g)
    return opt, params


@pytest.mark.parametrize(
    ("grads", "max_gradient", "expected"),
    [
        ([[1.0, 2.0]], 0.0, [[0.0, 0.0]]),
        ([[0.5, 0.5]], 1.0, [[0.5, 0.5]]),
        ([[3.0, 4.0]], 1.0, [[0.6, 0.8]]),  # norm 5: scaled by 1/5
        # total norm sqrt(4 + 16 + 16 + 64) = 10; scaled by 2/10
        ([[2.0, 4.0], [4.0, 8.0]], 2.0, [[0.4, 0.8], [0.8, 1.6]]),
    ],
)
def test_norm_clipping(grads: list[list[float]], max_gradient: float, expected: list[list[float]]) -> None:
    opt, params = clipper(grads, clipping=GradientClipping.NORM, max_gradient=max_gradient)
    opt.step()
    for p, e in zip(params, expected, strict=True):
        torch.testing.assert_close(p.grad, torch.tensor(e), rtol=1e-5, atol=1e-6)


def test_norm_clipping_with_inf_and_l1_norms() -> None:
    opt, (p,) = clipper([[3.0, -4.0]], clipping=GradientClipping.NORM, max_gradient=2.0, norm_type="inf")
    opt.step()  # inf-norm 4: scaled by 2 / 4
    torch.testing.assert_close(p.grad, torch.tensor([1.5, -2.0]), rtol=1e-5, atol=1e-6)
    opt, (p,) = clipper([[3.0, -4.0]], clipping=GradientClipping.NORM, max_gradient=1.4, norm_type=1.0)
    opt.step()  # 1-norm 7: scaled by 0.2
    torch.testing.assert_close(p.grad, torch.tensor([0.6, -0.8]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("grads", "max_gradient", "expected"),
    [
        ([[1.0, 2.0]], 0.0, [[0.0, 0.0]]),
        ([[0.5, 0.5]], 1.0, [[0.5, 0.5]]),
        ([[2.0, -4.0]], 1.0, [[1.0, -1.0]]),
        ([[2.0, 4.0], [4.0, 8.0]], 2.0, [[2.0, 2.0], [2.0, 2.0]]),
    ],
)
def test_value_clipping(grads: list[list[float]], max_gradient: float, expected: list[list[float]]) -> None:
    opt, params = clipper(grads, clipping=GradientClipping.VALUE, max_gradient=max_gradient)
    opt.step()
    for p, e in zip(params, expected, strict=True):
        torch.testing.assert_close(p.grad, torch.tensor(e), rtol=0, atol=0)


def test_last_total_grad_norm() -> None:
    opt, (p,) = clipper([[3.0, 4.0]], clipping=GradientClipping.NORM, max_gradient=10.0)
    assert opt.last_total_grad_norm is None
    opt.step()
    torch.testing.assert_close(opt.last_total_grad_norm, torch.tensor(5.0))
    p.grad = torch.tensor([6.0, 8.0])
    opt.step()
    torch.testing.assert_close(opt.last_total_grad_norm, torch.tensor(10.0))
    for clipping in (GradientClipping.VALUE, GradientClipping.NONE):
        opt, _ = clipper([[3.0, 4.0], [0.0, 12.0]], clipping=clipping, max_gradient=1.0, track_grad_norm=True)
        opt.step()
        torch.testing.assert_close(opt.last_total_grad_norm, torch.tensor(13.0))
    opt, (p,) = clipper([[3.0, 4.0]], clipping=GradientClipping.NONE, max_gradient=1.0)
    opt.step()
    assert opt.last_total_grad_norm is None
    torch.testing.assert_close(p.grad, torch.tensor([3.0, 4.0]))


def test_clipping_then_inner_step_matches_torch() -> None:
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(5))
    ref = torch.nn.Parameter(w.detach().clone())
    opt = GradientClippingOptimizer(
        KeyedOptimizerWrapper({"w": w}, lambda ps: torch.optim.SGD(ps, lr=0.1)),
        clipping=GradientClipping.NORM, max_gradient=0.5,
    )
    ref_opt = torch.optim.SGD([ref], lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        (w**2).sum().backward()
        opt.step()
        ref_opt.zero_grad()
        (ref**2).sum().backward()
        torch.nn.utils.clip_grad_norm_([ref], max_norm=0.5)
        ref_opt.step()
    torch.testing.assert_close(w.detach(), ref.detach(), rtol=0, atol=0)


def test_meta_parameters_skip_clipping() -> None:
    p = torch.zeros(2, device="meta", requires_grad=True)
    opt = GradientClippingOptimizer(NoStep({"p": p}, {}, [{"params": [p]}]), clipping=GradientClipping.NORM)
    with patch("torch.nn.utils.clip_grad_norm_") as clip:
        opt.step()
    clip.assert_not_called()
    assert opt.last_total_grad_norm is None


def test_empty_gradients_with_inf_norm() -> None:
    opt, params = clipper([[1.0, 2.0], []], clipping=GradientClipping.NORM, max_gradient=1.0, norm_type=float("inf"))
    opt.step()  # inf-norm 2: scaled by 1/2 (the empty gradient is left out)
    torch.testing.assert_close(params[0].grad, torch.tensor([0.5, 1.0]), rtol=1e-5, atol=1e-6)
    opt, _ = clipper([[]], clipping=GradientClipping.NORM, max_gradient=1.0, norm_type=float("inf"))
    opt.step()
    assert opt.last_total_grad_norm is None


def test_value_clipping_of_sharded_params_is_refused() -> None:
    p = torch.zeros(2, requires_grad=True)
    with pytest.raises(NotImplementedError, match="sharded parameters"):
        GradientClippingOptimizer(
            NoStep({"p": p}, {}, [{"params": [p]}]), clipping=GradientClipping.VALUE,
            enable_global_grad_clip=True, param_to_pgs={p: [object()]},  # type: ignore[list-item]
        )


def test_sharded_params_norm_is_all_reduced() -> None:
    # One sharded parameter (its |g|^2 is summed over the group: all_reduce is an identity here)
    # and one replicated: total = sqrt(3^2 + 4^2 + 12^2) = 13, coefficient 1.3 / 13.
    a, b = torch.zeros(2, requires_grad=True), torch.zeros(1, requires_grad=True)
    keyed = NoStep({"a": a, "b": b}, {}, [{"params": [a, b]}])
    group = object()
    opt = GradientClippingOptimizer(
        keyed, clipping=GradientClipping.NORM, max_gradient=1.3,
        enable_global_grad_clip=True, param_to_pgs={a: [group]},  # type: ignore[list-item]
    )
    assert opt._replicate_params == [b] and list(opt._sharded_params.values()) == [[a]]
    a.grad, b.grad = torch.tensor([3.0, 4.0]), torch.tensor([12.0])
    with patch("torch.distributed.all_reduce") as all_reduce:
        opt.step()
    assert all_reduce.call_count == 1 and all_reduce.call_args.kwargs["group"] is group
    torch.testing.assert_close(opt.last_total_grad_norm, torch.tensor(13.0))
    scale = 1.3 / (13.0 + 1e-6)
    torch.testing.assert_close(a.grad, torch.tensor([3.0, 4.0]) * scale)
    torch.testing.assert_close(b.grad, torch.tensor([12.0]) * scale)


def test_norm_helpers() -> None:
    g1, g2 = torch.tensor([3.0, 4.0]), torch.tensor([6.0, 8.0])
    torch.testing.assert_close(_batch_cal_norm([g1, g2], 1.0, 2.0), torch.tensor(125.0))
    torch.testing.assert_close(_batch_cal_norm([g1, g2], 1.0, 1.0), torch.tensor(21.0))
    torch.testing.assert_close(_batch_cal_norm([g1, torch.tensor([])], 1.0, torch.inf), torch.tensor(4.0))
    assert _batch_cal_norm([torch.tensor([])], 1.0, torch.inf).item() == float("-inf")
    torch.testing.assert_close(_compute_total_norm([g1, g2], {}, 2.0), torch.tensor(math.sqrt(125.0)))
    torch.testing.assert_close(_compute_total_norm([g1, g2], {}, torch.inf), torch.tensor(8.0))
    torch.testing.assert_close(_compute_total_norm([], {}, 2.0), torch.tensor(0.0))
    p, q = torch.zeros(2, requires_grad=True), torch.zeros(0, requires_grad=True)
    p.grad, q.grad = torch.tensor([0.5, 0.25]), torch.tensor([])
    grads = _get_grads([p, q, torch.zeros(1, requires_grad=True)])
    assert len(grads) == 1 and grads[0] is p.grad


def test_64bit_grad_norm_flag() -> None:
    import recsys_core.optim.clipping as clipping

    g = torch.rand(10000, generator=torch.Generator().manual_seed(0))
    exact = float((g.double() ** 2).sum())
    with patch.object(clipping, "use_64bit_grad_norm", True):
        result = _batch_cal_norm([g, g[:10]], 1.0, 2.0)
    assert result.dtype == torch.float32
    assert result.item() == pytest.approx(exact + float((g[:10].double() ** 2).sum()), rel=1e-7)


def test_dedup_to_base_tensors_keeps_each_storage_once() -> None:
    from recsys_core.optim.clipping import _dedup_to_base_tensors, _get_grads

    flat = torch.arange(6.0)
    a, b = flat[:2], flat[2:]
    other = torch.ones(3)
    out = _dedup_to_base_tensors([a, other, b, other])
    assert len(out) == 2 and out[0] is flat and out[1] is other
    # the norm over the bases equals the norm over the views when they tile the base
    assert float(torch.linalg.vector_norm(out[0])) == float(
        torch.linalg.vector_norm(torch.cat([a, b]))
    )
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.ones(2)
    assert _get_grads(param_list=[p, torch.nn.Parameter(torch.zeros(1))])[0] is p.grad
