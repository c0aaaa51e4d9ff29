"""Multi-probe zero-collision hashing: the torch kernel against FBGEMM's CPU op and an
independent MurmurHash3, insertion, TTL eviction, and bad input."""

from unittest.mock import patch

import pytest
import torch

from recsys_core import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from recsys_core.kernels import fbgemm_available
from recsys_core.kernels.zch_hash import murmur_hash3, zero_collision_hash
from recsys_core.modules.hash_mc_evictions import HashZchEvictionConfig, HashZchEvictionPolicyName
from recsys_core.modules.hash_mc_modules import HashZchManagedCollisionModule
from recsys_core.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
from recsys_core.modules.mc_modules import ManagedCollisionCollection
from recsys_core.sparse import JaggedTensor

CPU = torch.device("cpu")
M64 = (1 << 64) - 1


def _murmur_reference(x: int) -> int:
    """MurmurHash3 x64 of (x, 0) with seed 0, on Python ints (the published algorithm)."""
    def rotl(v: int, r: int) -> int:
        return ((v << r) | (v >> (64 - r))) & M64

    def fmix(h: int) -> int:
        h ^= h >> 33
        h = (h * 0xFF51AFD7ED558CCD) & M64
        h ^= h >> 33
        h = (h * 0xC4CEB9FE1A85EC53) & M64
        return h ^ (h >> 33)

    k1 = rotl((x & M64) * 0x87C37B91114253D5 & M64, 31) * 0x4CF5AD432745937F & M64
    h1 = (rotl(k1, 27) * 5 + 0x52DCE729) & M64
    h2 = (h1 * 5 + 0x38495AB5) & M64
    h1, h2 = h1 ^ 16, h2 ^ 16
    h1 = (h1 + h2) & M64
    h2 = (h2 + h1) & M64
    h1, h2 = fmix(h1), fmix(h2)
    h1 = (h1 + h2) & M64
    h2 = (h2 + h1) & M64
    out = h1 ^ h2
    return out - (1 << 64) if out >= 1 << 63 else out


def test_murmur_hash_matches_reference() -> None:
    ids = [0, 1, 2, 17, 123456789, 2**40 + 3, 2**63 - 1, -1, -(2**63)]
    assert murmur_hash3(torch.tensor(ids)).tolist() == [_murmur_reference(i) for i in ids]


@pytest.mark.skipif(not fbgemm_available(), reason="needs fbgemm_gpu")
@pytest.mark.parametrize("disable_fallback", [False, True])
def test_read_only_lookup_equals_fbgemm(disable_fallback: bool) -> None:
    g = torch.Generator().manual_seed(0)
    identities = torch.full((50, 1), -1, dtype=torch.int64)
    filled = torch.randperm(50, generator=g)[:30]
    identities[filled, 0] = torch.randperm(200, generator=g)[:30]
    ids = torch.randint(0, 200, (300,), generator=g)
    sizes = torch.tensor([20, 30])[ids % 2]
    starts = torch.tensor([0, 20])[ids % 2]
    for local_sizes, offsets in ((None, None), (sizes, starts)):
        expected, _ = torch.ops.fbgemm.zero_collision_hash(
            input=ids, identities=identities, max_probe=6, circular_probe=True, exp_hours=-1,
            readonly=True, local_sizes=local_sizes, offsets=offsets, metadata=None,
            output_on_uvm=False, disable_fallback=disable_fallback,
            _modulo_identity_DPRECATED=False, input_metadata=None, eviction_threshold=-1,
            eviction_policy=0, opt_in_prob=-1, num_reserved_slots=-1, opt_in_rands=None,
            runtime_meta=None,
        )
        ours, _ = zero_collision_hash(
            ids, identities, 6, True, local_sizes, offsets, None, disable_fallback, None, -1, 0,
            -1, -1, None, None,
        )
        assert torch.equal(ours, expected)


def _jt(ids: list[int]) -> dict[str, JaggedTensor]:
    return {"f": JaggedTensor(values=torch.tensor(ids), lengths=torch.ones(len(ids), dtype=torch.int64))}


def test_training_inserts_into_each_ids_bucket_and_ids_keep_their_rows() -> None:
    m = HashZchManagedCollisionModule(zch_size=20, device=CPU, total_num_buckets=2)
    even = m(_jt(list(range(0, 20, 2))))["f"].values()
    odd = m(_jt(list(range(1, 20, 2))))["f"].values()
    # input_hash_size 0: bucket = id % 2; 10 ids fill each 10-row bucket without collisions.
    assert sorted(even.tolist()) == list(range(10))
    assert sorted(odd.tolist()) == list(range(10, 20))
    identities = m._hash_zch_identities.view(-1)
    assert identities[even].tolist() == list(range(0, 20, 2))
    assert identities[odd].tolist() == list(range(1, 20, 2))
    assert m(_jt([4, 3]))["f"].values().tolist() == [even[2].item(), odd[1].item()]
    m.eval()
    assert torch.equal(m(_jt(list(range(0, 20, 2))))["f"].values(), even)
    assert m.evict() is None  # no eviction policy: nothing evicted


def test_full_bucket_falls_back_or_drops() -> None:
    m = HashZchManagedCollisionModule(zch_size=4, device=CPU, total_num_buckets=1, max_probe=4)
    m(_jt([1, 2, 3, 4]))
    before = m._hash_zch_identities.clone()
    row = m(_jt([99]))["f"].values()
    assert torch.equal(m._hash_zch_identities, before)  # not inserted: the table is full
    assert row.tolist() == [_murmur_reference(99) % (1 << 64) % 4]  # FBGEMM's fallback row
    dropping = HashZchManagedCollisionModule(
        zch_size=4, device=CPU, total_num_buckets=1, max_probe=4, disable_fallback=True
    )
    dropping.load_state_dict(m.state_dict())
    dropping.eval()
    out = dropping({"f": JaggedTensor(values=torch.tensor([1, 99, 2]), lengths=torch.tensor([2, 1]))})
    assert out["f"].lengths().tolist() == [1, 1]  # 99 dropped from the first bag
    assert out["f"].values().tolist() == m(_jt([1, 2]))["f"].values().tolist()


def test_ttl_eviction_resets_the_evicted_rows_in_an_mc_ebc() -> None:
    config = HashZchEvictionConfig(features=["f"], single_ttl=1)
    mc = HashZchManagedCollisionModule(
        zch_size=4, device=CPU, total_num_buckets=1, max_probe=4,
        eviction_policy_name=HashZchEvictionPolicyName.SINGLE_TTL_EVICTION,
        eviction_config=config,
    )
    tables = [EmbeddingBagConfig(name="t", embedding_dim=2, num_embeddings=4, feature_names=["f"])]
    ebc = EmbeddingBagCollection(tables=tables, device=CPU)
    mc_ebc = ManagedCollisionEmbeddingBagCollection(
        ebc, ManagedCollisionCollection({"t": mc}, tables), return_remapped_features=True
    )

    def kjt(ids: list[int]) -> KeyedJaggedTensor:
        return KeyedJaggedTensor.from_lengths_sync(
            keys=["f"], values=torch.tensor(ids), lengths=torch.ones(len(ids), dtype=torch.int64)
        )

    with patch("time.time", return_value=3600.0 * 1000):
        _, first = mc_ebc(kjt([1, 2, 3, 4]))
        assert sorted(first.values().tolist()) == [0, 1, 2, 3]
        assert mc._hash_zch_metadata.view(-1).tolist() == [1001] * 4  # hour + ttl
        with torch.no_grad():
            ebc.embedding_bags["t"].weight.fill_(7.0)
        _, again = mc_ebc(kjt([5]))  # nothing expired: 5 collides, no row is reset
        assert bool((ebc.embedding_bags["t"].weight == 7.0).all())
    with patch("time.time", return_value=3600.0 * 1002):  # every id's TTL is over
        _, later = mc_ebc(kjt([5, 6]))
    rows = later.values().tolist()
    assert len(set(rows)) == 2
    assert sorted(mc._hash_zch_identities.view(-1)[rows].tolist()) == [5, 6]
    weight = ebc.embedding_bags["t"].weight.detach()
    for r in range(4):  # evicted rows re-initialised (|w| <= 0.5), the others untouched
        assert bool((weight[r].abs() <= 0.5).all()) if r in rows else bool((weight[r] == 7.0).all())


def test_bad_input_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="zch_size"):
        HashZchManagedCollisionModule(zch_size=0, device=CPU, total_num_buckets=1)
    with pytest.raises(ValueError, match="multiple of total_num_buckets"):
        HashZchManagedCollisionModule(zch_size=10, device=CPU, total_num_buckets=3)
    m = HashZchManagedCollisionModule(
        zch_size=8, device=CPU, total_num_buckets=2, input_hash_size=100
    )
    with pytest.raises(ValueError, match="feature 'f' has negative id -3"):
        m(_jt([1, -3]))
    with pytest.raises(ValueError, match="feature 'f' has id 100 outside"):
        m(_jt([100]))
    bad = {"f": JaggedTensor(values=torch.tensor([1.0]), lengths=torch.tensor([1]))}
    with pytest.raises(TypeError, match="feature 'f' has ids of dtype torch.float32"):
        m(bad)


def test_import_prints_no_torchscript_deprecation_notice():
    """Importing the library scripts TorchRec's eviction config class and imports
    ``torch.distributed.optim`` (which scripts torch's functional optimizers); torch 2.14 prints
    ``torch.jit``'s deprecation as a FutureWarning (shown by default) in every program that does,
    e.g. under each ``dlrm-app train``. Turned into errors here, the imports must still succeed
    (fails without the library's filters, on torch 2.13 too, where it is a DeprecationWarning)."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-W", "error:`torch.jit", "-c",
         "import recsys_core, dlrm_app.training.trainer; import recsys_core.modules.hash_mc_modules as m; "
         "print(m.HashZchEvictionConfig(features=['f'], single_ttl=3).single_ttl)"],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "3"
