"""DistributedModelParallel, the tutorial's sharding examples, and resharding checkpoints."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from gloo_setup import assert_sharded_tensor_blocks, world_env
from table_configs import one_feature_tables
from torch import nn

from recsys_core import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbOptimType,
    KeyedJaggedTensor,
    KeyedTensor,
)
from recsys_core.distributed import (
    DistributedModelParallel,
    EmbeddingBagCollectionSharder,
    LazyAwaitable,
    ShardingEnv,
    ShardingPlan,
    checkpoint,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from recsys_core.optim import (
    CombinedOptimizer,
    KeyedOptimizerWrapper,
    apply_optimizer_in_backward,
    in_backward_optimizer_filter,
)
from recsys_core.testing import run_gloo


def tutorial_kjt() -> KeyedJaggedTensor:
    return KeyedJaggedTensor(keys=["product", "user"], values=torch.tensor([1, 2, 1, 5, 2, 3, 4, 1]),
                             lengths=torch.tensor([3, 1, 2, 2]))


def tutorial_worker(rank: int, world: int, tables: list[EmbeddingBagConfig]) -> dict:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(device="cpu", tables=tables)
    kjt = tutorial_kjt()
    expected = ebc(kjt).values().detach()
    plan = construct_module_sharding_plan(ebc, {"product_table": table_wise(rank=0, compute_kernel="fused"), "user_table": table_wise(rank=0, compute_kernel="fused")}, world)
    out: dict = {"plan": str(ShardingPlan({"": plan}))}
    env = world_env()
    sharder = EmbeddingBagCollectionSharder()
    sharded_ebc = sharder.shard(ebc, plan, env, torch.device("cpu"))
    output = sharded_ebc(kjt)
    out["lazy"] = isinstance(output, LazyAwaitable)
    kt = output.wait()
    out["kt"] = (type(kt) is KeyedTensor, kt.keys(), tuple(kt.values().shape), {k: tuple(v.shape) for k, v in kt.to_dict().items()})
    torch.testing.assert_close(kt.values(), expected)
    out["default_optimizer"] = repr(sharded_ebc.fused_optimizer)

    fused_params = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.02, "eps": 0.002}
    sharded_fused = EmbeddingBagCollectionSharder(fused_params=fused_params).shard(ebc, plan, env, torch.device("cpu"))
    out["fused_optimizer"] = repr(sharded_fused.fused_optimizer)
    ebc_apply_opt = copy.deepcopy(ebc)
    for _, param in ebc_apply_opt.named_parameters():
        apply_optimizer_in_backward(torch.optim.SGD, [param], {"lr": 0.5})
    sharded_apply = sharder.shard(ebc_apply_opt, plan, env, torch.device("cpu"))
    out["apply_optimizer"] = repr(sharded_apply.fused_optimizer)
    out["non_fused"] = list(dict(in_backward_optimizer_filter(sharded_fused.named_parameters())))
    values = sharded_fused(kjt).wait().values()
    loss1 = torch.sum(torch.ones_like(values) - values)
    loss1.backward()
    values = sharded_fused(kjt).wait().values()
    out["losses"] = (loss1.item(), torch.sum(torch.ones_like(values) - values).item())

    model = DistributedModelParallel(ebc, device=torch.device("cpu"))
    out["dmp_plan"] = str(model.plan)
    torch.testing.assert_close(model(kjt).wait().values(), expected)
    return out


def test_tutorial_sharding_examples(tutorial_tables: list[EmbeddingBagConfig],
                                    tutorial_plan_lines: dict[str, list[str]]) -> None:
    (out,) = run_gloo(1, tutorial_worker, tutorial_tables)
    plan = "\n".join(["module: ", *tutorial_plan_lines["cpu"]])
    assert out["plan"] == plan
    assert out["dmp_plan"] == plan
    assert out["lazy"]
    assert out["kt"] == (True, ["product", "user"], (2, 128), {"product": (2, 64), "user": (2, 64)})
    assert out["default_optimizer"] == "EmbeddingFusedOptimizer (\nParameter Group 0\n    lr: 0.01\n)"
    assert out["fused_optimizer"] == "EmbeddingFusedOptimizer (\nParameter Group 0\n    lr: 0.02\n)"
    assert out["apply_optimizer"] == "EmbeddingFusedOptimizer (\nParameter Group 0\n    lr: 0.5\n)"
    assert out["non_fused"] == []
    first, second = out["losses"]
    assert second < first - 1.0  # backward updated the sharded tables, no step() called


DENSE_TABLES = one_feature_tables(EmbeddingBagConfig, {"a": (20, 8), "b": (9, 8)}, mean={"b"})


class TinyModel(nn.Module):
    def __init__(self, device: str = "cpu") -> None:
        super().__init__()
        self.sparse = EmbeddingBagCollection(DENSE_TABLES, device=device)
        self.over = nn.Linear(16, 1, device=device)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        kt = self.sparse(kjt)
        values = kt.wait().values() if isinstance(kt, LazyAwaitable) else kt.values()
        return self.over(values).squeeze(1)


def batches(world: int, step: int) -> tuple[list[KeyedJaggedTensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    kjts = []
    for _ in range(world):
        lengths = torch.randint(0, 3, (2 * 4,), generator=gen)
        values = torch.cat([torch.randint(0, 20, (int(lengths[:4].sum()),), generator=gen),
                            torch.randint(0, 9, (int(lengths[4:].sum()),), generator=gen)])
        kjts.append(KeyedJaggedTensor(keys=["fa", "fb"], values=values, lengths=lengths))
    return kjts, torch.rand(world * 4, generator=gen)


def dmp_worker(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = TinyModel()
    reference = copy.deepcopy(model)
    plan = ShardingPlan({"sparse": construct_module_sharding_plan(
        model.sparse, {"a": row_wise(compute_kernel="fused"), "b": data_parallel(compute_kernel="fused")}, world)})
    sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dmp = DistributedModelParallel(model, plan=plan, sharders=[sharder])
    # the dense part is in DDP with TorchRec's broadcast_buffers=False, and says nothing about it
    assert dmp.data_parallel is not None and not dmp.data_parallel.broadcast_buffers
    assert not [w for w in caught if "broadcast_buffers" in str(w.message)]
    assert sorted(dict(in_backward_optimizer_filter(dmp.named_parameters()))) == ["over.bias", "over.weight"]
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                  lambda ps: torch.optim.SGD(ps, lr=0.1))
    optimizer = CombinedOptimizer([dmp.fused_optimizer, dense])
    # per-rank mean loss: DDP averages the dense grads and the embedding collectives divide
    # theirs by the world size (TorchRec's gradient division), so the single-process reference
    # is the global mean loss with the same learning rate everywhere
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        kjts, labels = batches(world, step)
        optimizer.zero_grad()
        logits = dmp(kjts[rank])
        loss = nn.functional.binary_cross_entropy_with_logits(logits, labels[rank * 4 : (rank + 1) * 4])
        loss.backward()
        optimizer.step()
        ref_opt.zero_grad()
        ref_logits = torch.cat([reference(k) for k in kjts])
        nn.functional.binary_cross_entropy_with_logits(ref_logits, labels).backward()
        ref_opt.step()
        torch.testing.assert_close(logits.detach(), ref_logits[rank * 4 : (rank + 1) * 4].detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dmp.module.over.weight.detach(), reference.over.weight.detach(), atol=1e-5, rtol=1e-5)
    state = dmp.state_dict()
    full_b = state["sparse.embedding_bags.b.weight"]  # data-parallel: a plain replicated tensor
    torch.testing.assert_close(full_b, reference.sparse.embedding_bags["b"].weight.detach(), atol=1e-5, rtol=1e-5)
    assert_sharded_tensor_blocks(state["sparse.embedding_bags.a.weight"],
                                 reference.sparse.embedding_bags["a"].weight.detach(),
                                 atol=1e-5, rtol=1e-5)


def test_dmp_trains_like_the_unsharded_model() -> None:
    run_gloo(2, dmp_worker)


def meta_worker(rank: int, world: int) -> dict:
    torch.manual_seed(rank)  # different seeds: DDP must make the dense part equal
    model = TinyModel(device="meta")
    plan = ShardingPlan({"sparse": construct_module_sharding_plan(
        model.sparse, {"a": table_wise(rank=1, compute_kernel="fused"), "b": table_wise(rank=0, compute_kernel="fused")}, world)})
    dmp = DistributedModelParallel(model, plan=plan)
    kjts, _ = batches(world, 0)
    out = dmp(kjts[rank])
    local = {t: [tuple(s.weight.shape) for s in shards] for t, shards in dmp.module.sparse.table_shards().items()}
    return {"local": local, "weight": dmp.module.over.weight.detach().clone(), "shape": tuple(out.shape)}


def test_dmp_on_meta_module_allocates_only_local_shards() -> None:
    r0, r1 = run_gloo(2, meta_worker)
    assert r0["local"] == {"b": [(9, 8)]} and r1["local"] == {"a": [(20, 8)]}
    assert r0["shape"] == r1["shape"] == (4,)
    torch.testing.assert_close(r0["weight"], r1["weight"])


CKPT_TABLES = one_feature_tables(EmbeddingBagConfig, {"x": (10, 8), "y": (6, 4)}, mean={"y"})
CKPT_FUSED = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.3, "eps": 1e-3}


def _full_tables(sharded) -> dict:
    """This rank's pieces: {(table, what): [(row_offset, tensor)]}."""
    out: dict = {}
    for table, shards in sharded.table_shards().items():
        for s in shards:
            out.setdefault((table, "weight"), []).append((s.spec.row_offset, s.spec.col_offset, s.weight.clone()))
            out.setdefault((table, "momentum1"), []).append((s.spec.row_offset, s.spec.col_offset, s.state["momentum1"].clone()))
    return out


def save_worker(rank: int, world: int, path: str) -> dict:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(CKPT_TABLES)
    plan = construct_module_sharding_plan(ebc, {"x": row_wise(compute_kernel="fused"), "y": row_wise(compute_kernel="fused")}, world)
    env = world_env()
    sharded = EmbeddingBagCollectionSharder(fused_params=CKPT_FUSED).shard(ebc, plan, env)
    for step in range(2):
        gen = torch.Generator().manual_seed(10 * step + rank)
        kjt = KeyedJaggedTensor(keys=["fx", "fy"], values=torch.cat([torch.randint(0, 10, (4,), generator=gen), torch.randint(0, 6, (4,), generator=gen)]),
                                lengths=torch.tensor([2, 2, 3, 1]))
        sharded(kjt).wait().values().sum().backward()
    checkpoint.save(path, model=sharded, optimizer=sharded.fused_optimizer, extra={"step": 2})
    return _full_tables(sharded)


def load_worker(rank: int, world: int, path: str) -> dict:
    torch.manual_seed(123)  # different init: everything must come from the checkpoint
    ebc = EmbeddingBagCollection(CKPT_TABLES)
    plan = construct_module_sharding_plan(ebc, {"x": table_wise(rank=1, compute_kernel="fused"), "y": table_wise(rank=0, compute_kernel="fused")}, world)
    env = world_env()
    sharded = EmbeddingBagCollectionSharder(fused_params=CKPT_FUSED).shard(ebc, plan, env)
    extra = checkpoint.load(path, model=sharded, optimizer=sharded.fused_optimizer, extra={"step": 0})
    assert extra == {"step": 2}
    return _full_tables(sharded)


def _assemble(per_rank: list[dict]) -> dict:
    pieces: dict = {}
    for result in per_rank:
        for key, parts in result.items():
            pieces.setdefault(key, []).extend(parts)
    return {key: torch.cat([t for _, _, t in sorted(parts, key=lambda p: (p[0], p[1]))]) for key, parts in pieces.items()}


@pytest.mark.slow
def test_checkpoint_saved_row_wise_on_4_ranks_loads_table_wise_on_2(tmp_path) -> None:
    saved = _assemble(run_gloo(4, save_worker, str(tmp_path)))
    loaded = _assemble(run_gloo(2, load_worker, str(tmp_path)))
    assert saved.keys() == loaded.keys()
    for key in saved:
        torch.testing.assert_close(loaded[key], saved[key], msg=f"{key} differs after resharding")
    assert saved[("x", "momentum1")].abs().sum() > 0  # the optimizer state is not trivially zero


def unsharded_load_worker(rank: int, world: int) -> None:
    torch.manual_seed(0)
    source = EmbeddingBagCollection(CKPT_TABLES)
    torch.manual_seed(1)
    ebc = EmbeddingBagCollection(CKPT_TABLES)
    plan = construct_module_sharding_plan(ebc, {"x": row_wise(compute_kernel="fused"), "y": table_wise(rank=1, compute_kernel="fused")}, world)
    sharded = EmbeddingBagCollectionSharder().shard(ebc, plan, world_env())
    sharded.load_state_dict(source.state_dict())
    kjt = KeyedJaggedTensor(keys=["fx", "fy"], values=torch.tensor([9, 0, 5]), lengths=torch.tensor([1, 1, 1, 0]))
    torch.testing.assert_close(sharded(kjt).wait().values(), source(kjt).values().detach())


def test_sharded_module_loads_an_unsharded_state_dict() -> None:
    run_gloo(2, unsharded_load_worker)


def test_bad_plan_is_rejected_before_communication() -> None:
    ebc = EmbeddingBagCollection(CKPT_TABLES, device="meta")
    env = ShardingEnv.from_local(2, 0)  # no process group: any communication would fail
    bad = construct_module_sharding_plan(ebc, {"x": table_wise(rank=1, compute_kernel="fused"), "y": table_wise(rank=0, compute_kernel="fused")}, 2)
    bad["x"].ranks = [5]
    bad["x"].sharding_spec.shards[0].placement = torch.distributed._remote_device("rank:5/cpu")
    with pytest.raises(ValueError, match="'x'.*rank 5"):
        DistributedModelParallel(ebc, env=env, plan=ShardingPlan({"": bad}))
    good = construct_module_sharding_plan(ebc, {"x": table_wise(rank=1, compute_kernel="fused")}, 2)
    with pytest.raises(ValueError, match=r"no entry for table\(s\) \['y'\]"):
        DistributedModelParallel(ebc, env=env, plan=ShardingPlan({"": good}))


def test_kernel_placement_checks() -> None:
    from recsys_core.distributed import EmbeddingComputeKernel
    from recsys_core.distributed.sharding.kernel_plan import check_kernel_placement

    ebc = EmbeddingBagCollection(CKPT_TABLES, device="meta")
    cached = construct_module_sharding_plan(
        ebc, {"x": table_wise(rank=0, compute_kernel=EmbeddingComputeKernel.FUSED_UVM_CACHING),
              "y": table_wise(rank=0, compute_kernel="fused")}, 1,
    )
    # the cached kernel runs on both devices
    check_kernel_placement(cached, torch.device("cpu"))
    check_kernel_placement(cached, torch.device("cuda"))
    uvm = construct_module_sharding_plan(
        ebc, {"x": table_wise(rank=0, compute_kernel=EmbeddingComputeKernel.FUSED_UVM),
              "y": table_wise(rank=0, compute_kernel="fused")}, 1,
    )
    check_kernel_placement(uvm, torch.device("cpu"))  # host memory either way: accepted
    with pytest.raises(ValueError, match="'x'.*fused_uvm .*use fused_uvm_caching or fused"):
        check_kernel_placement(uvm, torch.device("cuda"))
    dp = construct_module_sharding_plan(
        ebc, {"x": data_parallel(compute_kernel=EmbeddingComputeKernel.FUSED_UVM_CACHING),
              "y": table_wise(rank=0, compute_kernel="fused")}, 1,
    )
    with pytest.raises(ValueError, match="'x': a data-parallel table cannot be cached"):
        check_kernel_placement(dp, torch.device("cpu"))


def test_sharding_over_several_ranks_without_process_group_is_refused() -> None:
    ebc = EmbeddingBagCollection(CKPT_TABLES)
    plan = construct_module_sharding_plan(ebc, {"x": row_wise(compute_kernel="fused"), "y": table_wise(rank=1, compute_kernel="fused")}, 2)
    with pytest.raises(ValueError, match="sharding over 2 ranks needs a process group"):
        EmbeddingBagCollectionSharder().shard(ebc, plan, ShardingEnv.from_local(2, 0))


def bad_id_worker(rank: int, world: int) -> str:
    ebc = EmbeddingBagCollection(CKPT_TABLES)
    plan = construct_module_sharding_plan(ebc, {"x": row_wise(compute_kernel="fused"), "y": table_wise(rank=1, compute_kernel="fused")}, world)
    sharded = EmbeddingBagCollectionSharder().shard(ebc, plan, world_env())
    bad = 10 if rank == 0 else -1
    kjt = KeyedJaggedTensor(keys=["fx", "fy"], values=torch.tensor([bad, 0]), lengths=torch.tensor([1, 1]))
    try:
        sharded(kjt)
    except Exception as exc:  # the error must come before any communication, on every rank
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_sharded_bad_id_raises_before_communication() -> None:
    r0, r1 = run_gloo(2, bad_id_worker)
    assert r0.startswith("IdOutOfRangeError: feature 'fx': id 10 is outside [0, 10)")
    assert r1.startswith("IdOutOfRangeError: feature 'fx': id -1 is outside [0, 10)")
