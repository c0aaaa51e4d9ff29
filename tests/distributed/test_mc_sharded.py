"""Managed collisions (zero-collision hashing) sharded row-wise under DMP, on real gloo ranks.

Oracle: per table, the sharded module is one unsharded MCH module per row block, each fed the
ids of its input block (``id // ceil(input_hash_size / world_size)``, TorchRec's routing); the
test builds that out of unsharded modules and a plain torch routing, puts it in front of an
unsharded FusedEmbeddingBagCollection with the same optimizer, and runs the global batch.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from gloo_setup import concat_ranks, world_env
from torch import nn

from recsys_core import EmbeddingBagConfig, EmbeddingConfig, KeyedJaggedTensor
from recsys_core.distributed import (
    DistributedModelParallel,
    EmbeddingBagCollectionSharder,
    ShardingPlan,
    checkpoint,
    construct_module_sharding_plan,
    row_wise,
    table_wise,
)
from recsys_core.distributed.mc_embedding import ManagedCollisionEmbeddingCollectionSharder
from recsys_core.distributed.mc_embeddingbag import (
    ManagedCollisionEmbeddingBagCollectionSharder,
    ShardedManagedCollisionEmbeddingBagCollection,
)
from recsys_core.distributed.mc_modules import route_ids
from recsys_core.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from recsys_core.modules.fused_embedding_modules import FusedEmbeddingBagCollection
from recsys_core.modules.mc_embedding_modules import (
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
)
from recsys_core.modules.mc_modules import (
    DistanceLFU_EvictionPolicy,
    LFU_EvictionPolicy,
    ManagedCollisionCollection,
    MCHManagedCollisionModule,
)
from recsys_core.optim import EmbOptimType
from recsys_core.sparse import JaggedTensor
from recsys_core.testing import run_gloo

MAX = torch.iinfo(torch.int64).max
FUSED = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1, "eps": 1e-3}
INPUT = 1000  # input_hash_size: with 2 ranks, ids < 500 go to rank 0, the others to rank 1


def reset_init(t: torch.Tensor) -> torch.Tensor:
    return t.fill_(0.25)  # evicted rows get this (deterministic on every rank and the oracle)


def tables(rows: dict[str, int] | None = None) -> list[EmbeddingBagConfig]:
    rows = rows or {"t0": 8, "t1": 12}
    return [
        EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=rows["t0"],
                           feature_names=["f0"], init_fn=reset_init),
        EmbeddingBagConfig(name="t1", embedding_dim=3, num_embeddings=rows["t1"],
                           feature_names=["f1", "f2"], init_fn=reset_init),
    ]


def mc_modules(zch: dict[str, int]) -> dict[str, MCHManagedCollisionModule]:
    return {
        "t0": MCHManagedCollisionModule(
            zch_size=zch["t0"], device=torch.device("cpu"), eviction_policy=LFU_EvictionPolicy(),
            eviction_interval=1, input_hash_size=INPUT),
        # every other step, and ids hashed first (preprocess runs before routing)
        "t1": MCHManagedCollisionModule(
            zch_size=zch["t1"], device=torch.device("cpu"),
            eviction_policy=DistanceLFU_EvictionPolicy(), eviction_interval=2,
            input_hash_size=INPUT, input_hash_func=lambda ids, n: (ids * 7) % n),
    }


def plan_for(mc: nn.Module, world: int):
    gens = {c.name: row_wise(compute_kernel="fused") for c in mc._embedding_module.embedding_bag_configs()} \
        if hasattr(mc._embedding_module, "embedding_bag_configs") else \
        {c.name: row_wise(compute_kernel="fused") for c in mc._embedding_module.embedding_configs()}
    return construct_module_sharding_plan(mc._embedding_module, gens, world_size=world)


# ---- hand-computed routing and remapping ---------------------------------------------------------
def hand_worker(rank: int, world: int) -> dict:
    cfg = [EmbeddingBagConfig(name="t0", embedding_dim=2, num_embeddings=8, feature_names=["f0"],
                              init_fn=reset_init)]
    mcc = ManagedCollisionCollection({"t0": MCHManagedCollisionModule(
        zch_size=8, device=torch.device("cpu"), eviction_policy=LFU_EvictionPolicy(),
        eviction_interval=1, input_hash_size=INPUT)}, cfg)
    torch.manual_seed(0)
    mc = ManagedCollisionEmbeddingBagCollection(EmbeddingBagCollection(cfg), mcc,
                                                return_remapped_features=True)
    with torch.no_grad():
        mc._embedding_module.embedding_bags["t0"].weight.uniform_(-1, 1)
    weight = mc._embedding_module.embedding_bags["t0"].weight.detach().clone()
    sharded = ManagedCollisionEmbeddingBagCollectionSharder().shard(mc, plan_for(mc, world), world_env())
    bags = [[[10, 520, 10], [30, 540]], [[510, 20], [510, 530, 40, 50, 550]]][rank]
    kjt = KeyedJaggedTensor(keys=["f0"], values=torch.tensor([i for b in bags for i in b]),
                            lengths=torch.tensor([len(b) for b in bags]))
    pooled, remapped = sharded(kjt)
    return {"rows": remapped.wait().values().tolist(), "pooled": pooled.wait().values().detach(),
            "weight": weight}


def small_cases_worker(rank: int, world: int) -> dict:
    """The small cases share one launch of 2 ranks (each launch costs seconds)."""
    return {"bag": hand_worker(rank, world), "seq": ec_worker(rank, world),
            "errors": bad_worker(rank, world)}


@pytest.fixture(scope="module")
def small_cases() -> list[dict]:
    return run_gloo(2, small_cases_worker)


def test_ids_are_routed_by_input_block_and_remapped_on_their_rank(small_cases) -> None:
    r0, r1 = (r["bag"] for r in small_cases)
    # Rows 0-3 on rank 0 (ids < 500), 4-7 on rank 1; each block is an unsharded zch_size-4
    # module fed the global batch's ids of its block: 10 x2, 20, 30, 40, 50 -> rows 0, 1, 2
    # (ties: smaller id first), 40 and 50 miss (row 3); likewise 510 x2, 520, 530 -> 4, 5, 6.
    assert r0["rows"] == [0, 5, 0, 2, 7]
    assert r1["rows"] == [4, 1, 4, 6, 3, 3, 7]
    # rows handed to new ids are re-initialised (init_fn: 0.25) before the lookup; the miss
    # rows 3 and 7 keep their weights
    w, new = r0["weight"], torch.full((2,), 0.25)
    torch.testing.assert_close(r0["pooled"], torch.stack([3 * new, new + w[7]]))
    torch.testing.assert_close(r1["pooled"], torch.stack([2 * new, 2 * new + 2 * w[3] + w[7]]))


def test_route_ids_rule() -> None:
    ids = torch.tensor([0, 499, 500, 999, 1000, 1003, -1, -4])
    assert route_ids(ids, INPUT, 2).tolist() == [0, 0, 1, 1, 0, 1, 1, 0]  # outside: id mod 2
    assert route_ids(ids, INPUT, 1).tolist() == [0] * 8
    big = torch.tensor([2**62 - 1, 2**62, MAX])
    assert route_ids(big, MAX, 2).tolist() == [0, 1, 1]  # the default input_hash_size


# ---- equal to the block-partitioned unsharded oracle over steps with evictions -------------------
class BlockOracle(nn.Module):
    """Unsharded: ``world`` MCH modules over the row blocks, ids routed by input block."""

    def __init__(self, module: MCHManagedCollisionModule, segments: list[int]) -> None:
        super().__init__()
        self.parts = nn.ModuleList([
            module.rebuild_with_output_id_range((segments[r], segments[r + 1]), segments)
            for r in range(len(segments) - 1)
        ])
        self._rows, self._block = segments[-1], -(-INPUT // (len(segments) - 1))
        self.evicted = 0

    def output_size(self) -> int:
        return self._rows

    def forward(self, features: dict[str, JaggedTensor], mutate_miss_lengths: bool = True) -> dict:
        ((name, feature),) = features.items()
        ids = self.parts[0].preprocess({name: feature})[name].values()
        out = torch.empty_like(ids)
        for r, part in enumerate(self.parts):
            mine = ids // self._block == r
            sub = {name: JaggedTensor(values=ids[mine], lengths=mine.sum().view(1))}
            out[mine] = part.remap(part.profile(sub))[name].values()
        return {name: JaggedTensor(values=out, lengths=feature.lengths())}

    def evict(self) -> torch.Tensor | None:
        rows = [r for r in (p.evict() for p in self.parts) if r is not None]
        self.evicted += sum(r.numel() for r in rows)
        return torch.cat(rows) if rows else None


def batch(rank: int, step: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    lengths = torch.randint(0, 4, (3 * 4,), generator=g)
    # few distinct ids per block so that the tables fill and evict
    values = torch.randint(0, 9, (int(lengths.sum()),), generator=g) * 111 + rank
    return KeyedJaggedTensor(keys=["f0", "f1", "f2"], values=values, lengths=lengths)


def global_batch(world: int, step: int) -> KeyedJaggedTensor:
    return concat_ranks([batch(r, step) for r in range(world)])


def build_mc(zch: dict[str, int], seed: int = 0) -> ManagedCollisionEmbeddingBagCollection:
    torch.manual_seed(seed)
    ebc = EmbeddingBagCollection(tables(zch))
    with torch.no_grad():
        for p in ebc.parameters():
            p.uniform_(-1, 1)  # varied start (evicted rows are reset to 0.25)
    return ManagedCollisionEmbeddingBagCollection(
        ebc, ManagedCollisionCollection(mc_modules(zch), tables(zch)), return_remapped_features=True)


def oracle_of(mc: ManagedCollisionEmbeddingBagCollection, world: int):
    segments = {c.name: [c.num_embeddings // world * r for r in range(world)] + [c.num_embeddings]
                for c in tables()}
    fused = FusedEmbeddingBagCollection(tables(), optimizer_type=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                                        optimizer_kwargs={"learning_rate": 0.1, "eps": 1e-3})
    fused.load_state_dict(mc._embedding_module.state_dict())
    mods = mc._managed_collision_collection._managed_collision_modules
    mcc = ManagedCollisionCollection({t: BlockOracle(mods[t], segments[t]) for t in mods}, tables())
    return ManagedCollisionEmbeddingBagCollection(fused, mcc, return_remapped_features=True)


def loss_scale(rank: int) -> torch.Tensor:
    return torch.linspace(0.5, 1.5, 40).view(4, 10) * (rank + 1)


def parity_worker(rank: int, world: int) -> dict:
    mc = build_mc({"t0": 8, "t1": 12})
    oracle = oracle_of(mc, world)
    model = DistributedModelParallel(
        nn.ModuleDict({"mc": mc}), env=world_env(),
        plan=ShardingPlan({"mc": plan_for(mc, world)}),
        sharders=[ManagedCollisionEmbeddingBagCollectionSharder(
            EmbeddingBagCollectionSharder(fused_params=FUSED))],
    )
    sharded = model.module["mc"]
    assert isinstance(sharded, ShardedManagedCollisionEmbeddingBagCollection)
    for step in range(4):
        pooled, remapped = sharded(batch(rank, step))
        values = pooled.wait().values()
        (values * loss_scale(rank)).sum().backward()
        g_pooled, g_remapped = oracle(global_batch(world, step))
        rows = [g_pooled.values()[4 * r : 4 * (r + 1)] for r in range(world)]
        # the sharded step is the step of the mean of the ranks' losses
        (sum((rows[r] * loss_scale(r)).sum() for r in range(world)) / world).backward()
        mine = rows[rank]
        torch.testing.assert_close(values, mine, msg=f"pooled, step {step}")
        for key in ["f0", "f1", "f2"]:
            got = remapped.wait()[key]
            want = g_remapped[key].to_dense()[4 * rank : 4 * (rank + 1)]
            assert [t.tolist() for t in got.to_dense()] == [t.tolist() for t in want], (step, key)
        mcc = sharded._managed_collision_collection
        for t, local in mcc._managed_collision_modules.items():
            part = oracle._managed_collision_collection._managed_collision_modules[t].parts[rank]
            for buf in ("_mch_sorted_raw_ids", "_mch_remapped_ids_mapping", "_mch_counts"):
                assert torch.equal(getattr(local, buf), getattr(part, buf)), (step, t, buf)
    shards = sharded._embedding_module.table_shards()
    oracle_state = oracle._embedding_module.fused_optimizer.state_dict()["state"]
    for t, (shard,) in shards.items():
        lo, n = shard.spec.row_offset, shard.spec.rows
        ref = oracle._embedding_module.state_dict()[f"embedding_bags.{t}.weight"][lo : lo + n]
        torch.testing.assert_close(shard.weight, ref, msg=f"{t} weights")
        momentum = oracle_state[f"embedding_bags.{t}.weight"][f"{t}.momentum1"][lo : lo + n]
        torch.testing.assert_close(shard.state["momentum1"], momentum, msg=f"{t} momentum")
    mods = oracle._managed_collision_collection._managed_collision_modules
    return {t: mods[t].evicted for t in mods}


def test_sharded_mc_ebc_equals_block_oracle_over_steps_with_evictions() -> None:
    results = run_gloo(2, parity_worker)
    assert all(n > 0 for n in results[0].values())  # rows were given to new ids (and reset)


# ---- the sequence collection ----------------------------------------------------------------------
def ec_worker(rank: int, world: int) -> dict:
    cfg = [EmbeddingConfig(name="t0", embedding_dim=3, num_embeddings=8, feature_names=["f0"],
                           init_fn=reset_init)]
    torch.manual_seed(0)
    mc = ManagedCollisionEmbeddingCollection(
        EmbeddingCollection(tables=cfg),
        ManagedCollisionCollection({"t0": MCHManagedCollisionModule(
            zch_size=8, device=torch.device("cpu"), eviction_policy=LFU_EvictionPolicy(),
            eviction_interval=1, input_hash_size=INPUT)}, cfg),
        return_remapped_features=True)
    with torch.no_grad():
        mc._embedding_module.embeddings["t0"].weight.uniform_(-1, 1)
    weight = mc._embedding_module.embeddings["t0"].weight.detach().clone()
    weight[[0, 1, 2, 4, 5, 6]] = 0.25  # the rows handed to new ids are re-initialised
    sharded = ManagedCollisionEmbeddingCollectionSharder().shard(mc, plan_for(mc, world), world_env())
    ids = [[10, 520, 10, 30, 540], [510, 20, 510, 530, 40, 50, 550]][rank]
    kjt = KeyedJaggedTensor(keys=["f0"], values=torch.tensor(ids), lengths=torch.tensor([2, len(ids) - 2]))
    out, remapped = sharded(kjt)
    rows = remapped.wait().values()
    torch.testing.assert_close(out.wait()["f0"].values(), weight[rows])
    return rows.tolist()


def test_sharded_mc_ec_looks_up_the_remapped_rows(small_cases) -> None:
    assert [r["seq"] for r in small_cases] == [[0, 5, 0, 2, 7], [4, 1, 4, 6, 3, 3, 7]]


# ---- checkpoints across world sizes ----------------------------------------------------------------
def _probe(sharded: nn.Module, live: dict[str, list[int]]) -> dict:
    """Embedding (single-id SUM bags) and rowwise optimizer state of every live raw id."""
    sharded.eval()
    n = max(len(v) for v in live.values())
    # t1's table holds hashed ids h = 7 * id mod 1000: probe with id = 143 * h mod 1000
    f0 = (live["t0"] + [0] * n)[:n]
    f1 = ([h * 143 % INPUT for h in live["t1"]] + [0] * n)[:n]
    kjt = KeyedJaggedTensor(keys=["f0", "f1", "f2"], values=torch.tensor(f0 + f1),
                            lengths=torch.tensor([1] * (2 * n) + [0] * n))
    pooled = sharded(kjt)[0].wait()
    emb = {("t0", i): pooled["f0"][j].detach() for j, i in enumerate(live["t0"])}
    emb.update({("t1", i): pooled["f1"][j].detach() for j, i in enumerate(live["t1"])})
    sharded.train()
    return emb


def _live_and_momentum(sharded: nn.Module) -> tuple[dict[str, list[int]], dict]:
    mcc = sharded._managed_collision_collection
    shards = sharded._embedding_module.table_shards()
    live, momentum = {}, {}
    for t in mcc._managed_collision_modules:
        raw = mcc.row_state(t)["raw"]
        rows = (raw != MAX).nonzero().squeeze(1)
        live[t] = raw[rows].tolist()
        for i, r in zip(live[t], rows.tolist(), strict=True):
            momentum[(t, i)] = shards[t][0].state["momentum1"][r].item()
    return live, momentum


def _gather(obj, world: int) -> list:
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


def _union(dicts: list[dict]) -> dict:
    out: dict = {}
    for d in dicts:
        for k, v in d.items():
            out.setdefault(k, []).extend(v) if isinstance(v, list) else out.__setitem__(k, v)
    return {k: sorted(v) if isinstance(v, list) else v for k, v in out.items()}


def ckpt_worker(rank: int, world: int, load: str | None, save: str, steps: int, seed: int) -> dict:
    mc = build_mc({"t0": 48, "t1": 48}, seed=seed)
    sharded = ManagedCollisionEmbeddingBagCollectionSharder(
        EmbeddingBagCollectionSharder(fused_params=FUSED)).shard(mc, plan_for(mc, world), world_env())
    out: dict = {}
    if load is not None:
        checkpoint.load(load, model=sharded, optimizer=sharded.fused_optimizer)
        mcc = sharded._managed_collision_collection
        out["movers"] = sum(
            int(((raw != MAX) & (mcc.route(t, raw) != rank)).sum())
            for t in mcc._managed_collision_modules for raw in [mcc.row_state(t)["raw"]]
        )
        live = _union(_gather(_live_and_momentum(sharded)[0], world))
        out["loaded"] = _probe(sharded, live)  # the first forward installs the loaded state
        out["loaded_momentum"] = _union(_gather(_live_and_momentum(sharded)[1], world))
        out["loaded_live"] = live
    for step in range(steps):
        kjt = batch(rank, step + 10 * seed)
        kjt = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values() % 997 + 3 * seed, lengths=kjt.lengths())
        pooled, _ = sharded(kjt)
        pooled.wait().values().sum().backward()
    live, momentum = (_union(x) for x in zip(*_gather(_live_and_momentum(sharded), world), strict=True))
    out["saved"] = _probe(sharded, live)
    out["saved_momentum"] = momentum
    out["saved_live"] = live
    checkpoint.save(save, model=sharded, optimizer=sharded.fused_optimizer)
    return out


def _same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        torch.testing.assert_close(a[k], b[k], msg=f"{what} {k}")


@pytest.mark.slow
def test_remapping_state_reloads_2_to_1_and_1_to_2(tmp_path) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    (saved2, _) = run_gloo(2, ckpt_worker, None, a, 3, 0)
    (on1,) = run_gloo(1, ckpt_worker, a, b, 2, 1)  # load at 1 rank, train on new ids, save
    assert on1["loaded_live"] == saved2["saved_live"]
    _same(on1["loaded"], saved2["saved"], "2 -> 1 embedding")
    assert on1["loaded_momentum"] == pytest.approx(saved2["saved_momentum"])
    assert on1["saved_live"] != on1["loaded_live"]  # new ids entered on one rank
    back = run_gloo(2, ckpt_worker, b, str(tmp_path / "c"), 0, 2)
    assert sum(r["movers"] for r in back) > 0  # ids whose rows went to the other rank moved
    for r in back:
        assert r["loaded_live"] == on1["saved_live"]
        _same(r["loaded"], on1["saved"], "1 -> 2 embedding")
        assert r["loaded_momentum"] == pytest.approx(on1["saved_momentum"])


def eval_worker(rank: int, world: int, load: str, sharded_module: bool) -> torch.Tensor:
    """Pooled embeddings of every id 0-999 (hits and misses; the same batch on every rank) in
    eval mode, from the checkpoint ``load``: sharded over ``world`` ranks, or the plain module."""
    mc = build_mc({"t0": 48, "t1": 48}, seed=5)
    if sharded_module:
        mc = ManagedCollisionEmbeddingBagCollectionSharder(
            EmbeddingBagCollectionSharder(fused_params=FUSED)).shard(
                mc, plan_for(mc, world), world_env())
    checkpoint.load(load, model=mc)
    mc.eval()
    ids = torch.arange(INPUT)
    kjt = KeyedJaggedTensor(keys=["f0", "f1", "f2"], values=torch.cat([ids, ids, ids]),
                            lengths=torch.ones(3 * INPUT, dtype=torch.int64))
    pooled = mc(kjt)[0]
    pooled = pooled.wait() if hasattr(pooled, "wait") else pooled
    return pooled.values().detach()


@pytest.mark.slow
def test_an_id_without_a_row_scores_as_in_training_on_any_world_size(tmp_path) -> None:
    """Trained on 2 ranks, each row block keeps its own row for ids without one; evaluated on 1
    rank (or unsharded: what export and serving load) such an id gets its training block's
    row, so every id scores as on the 2 ranks (not the one last row of the table)."""
    a = str(tmp_path / "a")
    run_gloo(2, ckpt_worker, None, a, 3, 0)
    two = run_gloo(2, eval_worker, a, True)
    (one,) = run_gloo(1, eval_worker, a, True)
    (plain,) = run_gloo(1, eval_worker, a, False)
    torch.testing.assert_close(two[0], two[1])
    torch.testing.assert_close(one, two[0], rtol=0, atol=0)
    torch.testing.assert_close(plain, two[0], rtol=0, atol=0)


# ---- bad plans and input ----------------------------------------------------------------------------
def bad_worker(rank: int, world: int) -> list[str]:
    mc = build_mc({"t0": 8, "t1": 12})
    sharder = ManagedCollisionEmbeddingBagCollectionSharder()
    errors = []
    tw = construct_module_sharding_plan(
        mc._embedding_module, {"t0": table_wise(rank=0, compute_kernel="fused"),
                               "t1": row_wise(compute_kernel="fused")}, world_size=world)
    for plan in (tw,):
        try:
            sharder.shard(mc, plan, world_env())
        except ValueError as e:
            errors.append(str(e))
    sharded = sharder.shard(mc, plan_for(mc, world), world_env())
    try:
        sharded(KeyedJaggedTensor(keys=["f0", "f1", "f2"], values=torch.tensor([1.0, 2.0, 3.0]),
                                  lengths=torch.tensor([1, 0, 1, 0, 1, 0])))
    except TypeError as e:
        errors.append(str(e))
    return errors


def test_bad_plans_and_ids_are_clear_errors(small_cases) -> None:
    errors = small_cases[0]["errors"]
    assert "'t0' is planned table_wise" in errors[0] and "row_wise only" in errors[0]
    assert "dtype torch.float32" in errors[1] and "'t0'" in errors[1]


def test_sharder_lists_row_wise_fused_only() -> None:
    sharder = ManagedCollisionEmbeddingBagCollectionSharder()
    assert sharder.sharding_types("cpu") == ["row_wise"]
    assert sharder.compute_kernels("row_wise", "cpu") == ["fused"]
    mc = build_mc({"t0": 8, "t1": 12})
    assert sorted(sharder.shardable_parameters(mc)) == ["t0", "t1"]


def unsharded_state_worker(rank: int, world: int) -> None:
    mc = build_mc({"t0": 32, "t1": 32})
    for step in range(2):  # the unsharded module hands out rows regardless of input blocks
        mc(global_batch(world, step))[0].values().sum().backward()
    sharded = ManagedCollisionEmbeddingBagCollectionSharder().shard(
        build_mc({"t0": 32, "t1": 32}, seed=5), plan_for(mc, world), world_env())
    sharded.load_state_dict(mc.state_dict())
    mods = mc._managed_collision_collection._managed_collision_modules
    live = {t: sorted(int(i) for i in m._mch_sorted_raw_ids if i != MAX) for t, m in mods.items()}
    got = _probe(sharded, live)
    mc.eval()
    want = _probe_unsharded(mc, live)
    _same(got, want, "unsharded state")


def _probe_unsharded(mc: nn.Module, live: dict[str, list[int]]) -> dict:
    n = max(len(v) for v in live.values())
    f0 = (live["t0"] + [0] * n)[:n]
    f1 = ([h * 143 % INPUT for h in live["t1"]] + [0] * n)[:n]
    kjt = KeyedJaggedTensor(keys=["f0", "f1", "f2"], values=torch.tensor(f0 + f1),
                            lengths=torch.tensor([1] * (2 * n) + [0] * n))
    pooled = mc(kjt)[0]
    emb = {("t0", i): pooled["f0"][j].detach() for j, i in enumerate(live["t0"])}
    emb.update({("t1", i): pooled["f1"][j].detach() for j, i in enumerate(live["t1"])})
    return emb


def test_sharded_module_loads_an_unsharded_state_dict() -> None:
    # each id goes to its input block's rank with its row (15 usable rows a rank: room for all)
    run_gloo(2, unsharded_state_worker)


# ---- DistributedModelParallel's defaults ----------------------------------------------------------
def dmp_default_worker(rank: int, world: int) -> list[float]:
    cfg = [EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=8, feature_names=["f0"])]
    torch.manual_seed(0)
    mc = ManagedCollisionEmbeddingBagCollection(
        EmbeddingBagCollection(tables=cfg),
        ManagedCollisionCollection({"t0": MCHManagedCollisionModule(
            zch_size=8, device=torch.device("cpu"), eviction_policy=LFU_EvictionPolicy(),
            eviction_interval=1, input_hash_size=INPUT)}, cfg))
    explicit = ManagedCollisionEmbeddingBagCollectionSharder()
    dmp = DistributedModelParallel(nn.ModuleDict({"mc": mc}))  # default sharders and planner
    sharded = dmp.module["mc"]
    assert isinstance(sharded, ShardedManagedCollisionEmbeddingBagCollection)
    (ps,) = dmp.plan.plan["mc"].values()
    assert ps.sharding_type == "row_wise" and ps.ranks == [0, 1]
    assert "row_wise" in explicit.sharding_types("cpu")
    kjt = KeyedJaggedTensor(keys=["f0"], values=torch.tensor([10, 520, 10]), lengths=torch.tensor([2, 1]))
    pooled, _ = sharded(kjt)
    return pooled.wait().values().sum(dim=1).tolist()


def test_dmp_default_sharders_plan_and_shard_mc_collections() -> None:
    # both ranks feed the same ids: id 10 twice and 520 once, the same rows on both
    first, second = run_gloo(2, dmp_default_worker)
    assert first == second
