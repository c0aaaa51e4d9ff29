"""TorchRec users' recipes under DistributedModelParallel, compared with the unsharded module.

Built the way a TorchRec program builds them: a lone collection (so DMP's forward returns the
collection's own awaitable, no dense layer after it), ``construct_module_sharding_plan`` with
its defaults (the DENSE kernel and a torch optimizer over ``dmp.parameters()``), with
``compute_kernel="fused"`` and the sharder's ``fused_params``, and with
``apply_optimizer_in_backward`` (a sharder's own ``fused_params`` must not replace it). Every
sharding type the collection supports is in one model, one table each; several steps on
different batches per rank at 2 and 4 ranks.

Oracle: the unsharded module stepping on the MEAN of the ranks' losses with torch's own
optimizer (TorchRec's gradient division). After every step each rank's local blocks equal the
oracle's tables, and data-parallel replicas are bitwise equal across ranks (they drifted apart
when their gradients were never averaged).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from gloo_setup import (
    ONE_PER_TYPE_ROWS,
    assert_sharded_tensor_blocks,
    half_squares_loss,
    one_table_per_type,
    one_table_per_type_batches,
    one_table_per_type_kind,
    one_table_per_type_module,
)

from recsys_core.distributed import (
    DistributedModelParallel,
    ShardingPlan,
)
from recsys_core.distributed.comm_ops import set_gradient_division
from recsys_core.distributed.sharding_plan import construct_module_sharding_plan
from recsys_core.distributed.types import EmbeddingComputeKernel
from recsys_core.kernels.config import EmbOptimType
from recsys_core.optim import apply_optimizer_in_backward, in_backward_optimizer_filter
from recsys_core.testing import run_gloo

ROWS = ONE_PER_TYPE_ROWS
DIM = 8
BATCH = 3
STEPS = 3
LR = 0.1


def _generators(kind: str, world: int, kernel: str | None) -> dict[str, Any]:
    """One generator per table, TorchRec's defaults unless ``kernel`` is given."""
    names, _, _ = one_table_per_type_kind(kind)
    return one_table_per_type(world, names, **({} if kernel is None else {"compute_kernel": kernel}))


def _recipe_worker(rank: int, world: int, kind: str, recipe: str, weighted: bool,
                   division: bool = True) -> None:
    set_gradient_division(division)
    torch.manual_seed(0)
    module = one_table_per_type_module(kind, weighted)
    names, sharder_type, prefix = one_table_per_type_kind(kind)
    reference = copy.deepcopy(module)
    if recipe == "dense":  # TorchRec's defaults: DENSE kernel, the optimizer outside
        plan = construct_module_sharding_plan(module, _generators(kind, world, None), world)
        sharder = sharder_type()
        expected_kernel = EmbeddingComputeKernel.DENSE
        ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    elif recipe == "fused":  # fused kernel, the optimizer given to the sharder
        plan = construct_module_sharding_plan(module, _generators(kind, world, "fused"), world)
        sharder = sharder_type(fused_params={
            "optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": LR, "eps": 1e-8})
        expected_kernel = EmbeddingComputeKernel.FUSED
        ref_opt = torch.optim.Adagrad(reference.parameters(), lr=LR, eps=1e-8)
    else:  # in backward: wins over a sharder's fused_params, as in TorchRec
        apply_optimizer_in_backward(torch.optim.Adagrad, module.parameters(), {"lr": LR})
        plan = construct_module_sharding_plan(module, _generators(kind, world, None), world)
        sharder = sharder_type(fused_params={
            "optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.05})
        expected_kernel = EmbeddingComputeKernel.FUSED
        # the plan generators give a data-parallel table the DENSE kernel (as TorchRec's): its
        # replica is a plain parameter that the dense optimizer steps, here SGD
        tables = getattr(reference, prefix)
        ref_opt = _Both(
            torch.optim.Adagrad([tables[n].weight for n in names if n != "dp"], lr=LR, eps=1e-8),
            torch.optim.SGD([tables[n].weight for n in names if n == "dp"] or [_unused()], lr=LR),
        )
    kernels = {n: ps.compute_kernel for n, ps in plan.items()}
    assert {k for n, k in kernels.items() if n != "dp" or recipe != "in_backward"} == {
        expected_kernel.value}
    dmp = DistributedModelParallel(module, plan=ShardingPlan({"": plan}), sharders=[sharder])
    dense_opt = None
    if recipe == "dense":
        dense_opt = torch.optim.SGD(dmp.parameters(), lr=LR)
    elif recipe == "in_backward" and "dp" in names:
        dense = dict(in_backward_optimizer_filter(dmp.named_parameters()))
        assert sum(p.numel() for p in dense.values()) == ROWS["dp"] * DIM  # the replica only
        dense_opt = torch.optim.SGD(dense.values(), lr=LR)
    for step in range(STEPS):
        batches = one_table_per_type_batches(1000 + step, world, names, BATCH, weighted=weighted)
        if dense_opt is not None:
            dense_opt.zero_grad()
        out = dmp(batches[rank])
        out = out.wait() if hasattr(out, "wait") else out
        half_squares_loss(out).backward()
        if dense_opt is not None:
            dense_opt.step()
        ref_opt.zero_grad()
        ref_loss = sum(half_squares_loss(reference(b)) for b in batches) / (world if division else 1)
        ref_loss.backward()
        ref_opt.step()
        state = dmp.state_dict()
        for name in names:
            full = getattr(reference, prefix)[name].weight.detach()
            value = state[f"{prefix}.{name}.weight"]
            if name == "dp":
                torch.testing.assert_close(value, full, atol=1e-5, rtol=1e-5)
                replicas = [torch.empty_like(value) for _ in range(world)]
                dist.all_gather(replicas, value.contiguous())
                assert all(torch.equal(r, replicas[0]) for r in replicas), (
                    f"data-parallel replicas differ after step {step}")
            else:
                assert_sharded_tensor_blocks(value, full, atol=1e-5, rtol=1e-5)


class _Both:
    """Two optimizers stepped as one (the oracle of the in-backward recipe)."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = optimizers

    def zero_grad(self) -> None:
        for o in self.optimizers:
            o.zero_grad()

    def step(self) -> None:
        for o in self.optimizers:
            o.step()


def _unused() -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.zeros(1))


RECIPES = ["dense", "fused", "in_backward"]


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_lone_ebc_every_sharding_type_trains_like_the_unsharded_module(
    world: int, recipe: str
) -> None:
    run_gloo(world, _recipe_worker, "ebc", recipe, False)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_lone_ec_trains_like_the_unsharded_module(world: int, recipe: str) -> None:
    run_gloo(world, _recipe_worker, "ec", recipe, False)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["dense", "in_backward"])
def test_weighted_ebc_at_four_ranks(recipe: str) -> None:
    run_gloo(4, _recipe_worker, "ebc", recipe, True)


def test_without_gradient_division_every_table_steps_on_the_summed_losses() -> None:
    """``set_gradient_division(False)`` (what dlrm-app train runs with): every table, DENSE
    data-parallel replicas included, steps on the gradient of the SUM of the ranks' losses."""
    run_gloo(2, _recipe_worker, "ebc", "dense", False, False)
