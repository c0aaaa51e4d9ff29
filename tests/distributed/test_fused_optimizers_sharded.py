"""Every fused optimizer, sharded every way, against its update rule written out by hand.

One collection holds a table per sharding type (table-, row-, column-, table-row-,
table-column-wise and data-parallel), all on the fused kernel with the optimizer given as the
sharder's ``fused_params``. Three steps on different batches per rank; after each, every local
shard equals the reference: the unsharded module's gradient of the MEAN of the ranks' losses
(autograd), then the optimizer's rule as FBGEMM defines it, applied here in plain torch:

- only the rows some rank looked up move (the kernels are row-sparse: an untouched row keeps
  its weight and its state, Adam's moments do not decay);
- row-wise states (row-wise Adagrad's sum, the partial row-wise forms' second moment) and
  LAMB's trust ratio are per row OF A SHARD: a column-wise table keeps one per column block,
  as FBGEMM and TorchRec do;
- Adam and LAMB correct their moments' bias with the step count and apply weight decay
  decoupled (``update + decay * w``, times the rate); row-wise Adagrad's decay is L2 (added
  to the gradient).
"""

from __future__ import annotations

import copy

import pytest
import torch
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
from recsys_core.kernels.config import EmbOptimType, WeightDecayMode
from recsys_core.testing import run_gloo

ROWS = ONE_PER_TYPE_ROWS
DIM, BATCH, STEPS = 8, 3, 3
LR, EPS, B1, B2 = 0.05, 1e-3, 0.8, 0.9
ROWWISE = {EmbOptimType.EXACT_ROWWISE_ADAGRAD, EmbOptimType.PARTIAL_ROWWISE_ADAM,
           EmbOptimType.PARTIAL_ROWWISE_LAMB}


def _column_blocks(name: str, world: int) -> int:
    """How many column shards the plan gives a table (each keeps its own row-wise state)."""
    return {"cw": 2, "twcw": world}.get(name, 1)


class _Reference:
    """The optimizer's rule on one whole table, its row-wise quantities per column block."""

    def __init__(self, opt: EmbOptimType, decay: float, weight: torch.Tensor, blocks: int):
        self.opt, self.decay, self.w, self.blocks = opt, decay, weight.clone(), blocks
        rows = weight.shape[0]
        self.m1 = torch.zeros_like(weight)
        self.m2 = torch.zeros(rows, blocks) if opt in ROWWISE else torch.zeros_like(weight)

    def _per_block(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, dim] -> [rows, blocks]: the mean over each column block."""
        return x.view(x.shape[0], self.blocks, -1).mean(2)

    def _spread(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, blocks] -> [rows, dim]: each block's value over its columns."""
        return x.repeat_interleave(DIM // self.blocks, dim=1)

    def step(self, grad: torch.Tensor, touched: torch.Tensor, t: int) -> None:
        w, g, opt = self.w[touched], grad[touched], self.opt
        if opt is EmbOptimType.EXACT_SGD:
            w = w - LR * g
        elif opt is EmbOptimType.EXACT_ADAGRAD:
            self.m1[touched] += g * g
            w = w - LR * g / (self.m1[touched].sqrt() + EPS)
        elif opt is EmbOptimType.EXACT_ROWWISE_ADAGRAD:
            g = g + self.decay * w  # L2
            self.m2[touched] += self._per_block(g * g)
            w = w - LR * g / (self._spread(self.m2[touched]).sqrt() + EPS)
        else:  # the Adam and LAMB families
            m1 = B1 * self.m1[touched] + (1 - B1) * g
            self.m1[touched] = m1
            if opt in ROWWISE:
                m2 = B2 * self.m2[touched] + (1 - B2) * self._per_block(g * g)
                self.m2[touched] = m2
                m2 = self._spread(m2)
            else:
                m2 = B2 * self.m2[touched] + (1 - B2) * g * g
                self.m2[touched] = m2
            update = (m1 / (1 - B1 ** t)) / ((m2 / (1 - B2 ** t)).sqrt() + EPS) + self.decay * w
            if opt in (EmbOptimType.LAMB, EmbOptimType.PARTIAL_ROWWISE_LAMB):
                # trust ratio per row of each column block
                wn = w.view(len(w), self.blocks, -1).norm(dim=2)
                un = update.view(len(w), self.blocks, -1).norm(dim=2)
                ratio = torch.where((wn > 0) & (un > 0), wn / un, torch.ones_like(wn))
                update = update * self._spread(ratio)
            w = w - LR * update
        self.w[touched] = w


def _worker(rank: int, world: int, opt_name: str, decay: float, kind: str = "ebc") -> None:
    set_gradient_division(True)
    opt = EmbOptimType[opt_name]
    torch.manual_seed(0)
    ebc = one_table_per_type_module(kind)
    # "ec": the sequence collection's sharding types (table-, column-, row-wise)
    names, sharder, prefix = one_table_per_type_kind(kind)
    unsharded = copy.deepcopy(ebc)
    tables = getattr(unsharded, prefix)
    params = {"optimizer": opt, "learning_rate": LR, "eps": EPS, "beta1": B1, "beta2": B2,
              "weight_decay": decay}
    if decay and opt is EmbOptimType.EXACT_ROWWISE_ADAGRAD:
        params["weight_decay_mode"] = WeightDecayMode.L2
    plan = construct_module_sharding_plan(
        ebc, one_table_per_type(world, names, compute_kernel="fused"), world)
    dmp = DistributedModelParallel(ebc, plan=ShardingPlan({"": plan}),
                                   sharders=[sharder(fused_params=params)])
    refs = {n: _Reference(opt, decay, tables[n].weight.detach(), _column_blocks(n, world))
            for n in names}
    for step in range(STEPS):
        batches = one_table_per_type_batches(300 + step, world, names, BATCH)
        half_squares_loss(dmp(batches[rank]).wait()).backward()
        # the reference's gradient: autograd through the unsharded module at the current weights
        with torch.no_grad():
            for n in names:
                tables[n].weight.copy_(refs[n].w)
        unsharded.zero_grad()
        (sum(half_squares_loss(unsharded(b)) for b in batches) / world).backward()
        for n in names:
            touched = torch.zeros(ROWS[n], dtype=torch.bool)
            for b in batches:
                touched[b.to_dict()[f"f_{n}"].values()] = True
            refs[n].step(tables[n].weight.grad, touched, step + 1)
        state = dmp.state_dict()
        for n in names:
            value = state[f"{prefix}.{n}.weight"]
            if n == "dp":
                torch.testing.assert_close(value, refs[n].w, atol=1e-5, rtol=1e-4)
            else:
                assert_sharded_tensor_blocks(value, refs[n].w, atol=1e-5, rtol=1e-4)


CASES = [
    ("EXACT_SGD", 0.0), ("EXACT_ADAGRAD", 0.0), ("EXACT_ROWWISE_ADAGRAD", 0.0),
    ("EXACT_ROWWISE_ADAGRAD", 0.1), ("ADAM", 0.0), ("ADAM", 0.1),
    ("PARTIAL_ROWWISE_ADAM", 0.1), ("LAMB", 0.0), ("LAMB", 0.1), ("PARTIAL_ROWWISE_LAMB", 0.1),
]


@pytest.mark.parametrize(("opt", "decay"), CASES)
def test_every_fused_optimizer_sharded_every_way_follows_its_rule(opt: str, decay: float) -> None:
    run_gloo(2, _worker, opt, decay)


@pytest.mark.parametrize(("opt", "decay"), [("EXACT_ROWWISE_ADAGRAD", 0.1), ("ADAM", 0.1),
                                            ("PARTIAL_ROWWISE_LAMB", 0.1)])
def test_sequence_collection_too(opt: str, decay: float) -> None:
    run_gloo(2, _worker, opt, decay, "ec")


@pytest.mark.slow
@pytest.mark.parametrize(("opt", "decay"), [("PARTIAL_ROWWISE_ADAM", 0.1), ("LAMB", 0.1),
                                            ("EXACT_ROWWISE_ADAGRAD", 0.1)])
def test_at_four_ranks(opt: str, decay: float) -> None:
    run_gloo(4, _worker, opt, decay)
