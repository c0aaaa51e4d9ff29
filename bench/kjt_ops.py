"""KeyedJaggedTensor / KeyedTensor op latency against a naive per-key Python loop.

Criteo-like batch: B=4096, 26 keys, the first 13 one-hot (every bag has 1 id), the last 13
multi-hot with bag sizes uniform in [0, 40] (mean pooling factor 20, empty bags included).

Ops (median microseconds of many reps after warmup; implementations alternate in rounds so
that drift and allocator state hit them equally):

  construct         from_lengths_sync (construct + length_per_key, as TorchRec: no validation)
                                                                   vs  per-key slices + .item()
  construct_nosync  plain constructor (stores its inputs)          vs  the same naive loop
  validate          KeyedJaggedTensor.validate() (the explicit full check)  vs  the same naive loop
  permute           keys in reverse order                          vs  per-key slices + torch.cat
  split             two parts of 13 keys (views)                   vs  per-part, per-key cat
  to_dict           26 JaggedTensors (views; offsets on demand)    vs  per-key slices + JaggedTensor
  to_dict_offsets   to_dict, then values() + offsets() of every key (what an embedding-bag
                    lookup reads)                                  vs  the naive dict, same reads
  regroup           KeyedTensor.regroup, 26 keys x dim 128 -> even/odd keys  vs  per-group cat
  regroup_fwd_bwd   the same plus backward of a fixed output gradient
  *_fresh           length_per_key / permute / split / to_dict on a KJT built fresh each rep
                    the way TorchRec users and pipelines build them (``built_with``: lengths
                    only, offsets only, or both lengths and offsets): the first op pays the
                    one-pass safety proof (lengths in range, offsets agreeing with them)

Reference lines (``impl``): ``fbgemm_forced`` is the FBGEMM kernel where the library picked
torch (shows why; TorchRec's CPU permute runs this kernel), ``copy_floor`` is one ``clone()`` of
the data the op must move, ``recsys_core_torch_path`` is the library with its optional C helper
switched off (what an install without a C compiler runs).
Prints one JSON line per (op, impl).
Usage: python bench/kjt_ops.py [--batch-size 4096] [--only permute construct]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from recsys_core.kernels import sparse_ops
from recsys_core.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor, _native_lib

NUM_KEYS = 26
ONE_HOT_KEYS = 13
MAX_BAG = 40
EMBEDDING_DIM = 128
OPS = [
    "construct",
    "construct_nosync",
    "validate",
    "permute",
    "split",
    "to_dict",
    "to_dict_offsets",
    "regroup",
    "regroup_fwd_bwd",
    "length_per_key_fresh",
    "permute_fresh",
    "split_fresh",
    "to_dict_fresh",
]
BUILT_WITH = ("lengths", "both", "offsets")


def make_batch(batch: int, seed: int = 0) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    keys = [f"cat_{i}" for i in range(NUM_KEYS)]
    lengths = torch.cat(
        [
            torch.ones(batch, dtype=torch.int64)
            if k < ONE_HOT_KEYS
            else torch.randint(0, MAX_BAG + 1, (batch,), generator=gen)
            for k in range(NUM_KEYS)
        ]
    )
    values = torch.randint(0, 1_000_000, (int(lengths.sum()),), generator=gen)
    return keys, values, lengths


def measure(impls: dict[str, Callable[[], object]], budget_s: float) -> dict[str, float]:
    """Median microseconds per impl; impls run alternately in rounds after a warmup."""
    for fn in impls.values():
        for _ in range(3):
            fn()
    probe = {}
    for name, fn in impls.items():
        start = time.perf_counter()
        fn()
        probe[name] = max(time.perf_counter() - start, 1e-6)
    rounds = 10
    samples: dict[str, list[float]] = {name: [] for name in impls}
    for _ in range(rounds):
        for name, fn in impls.items():
            reps = max(3, int(budget_s / rounds / len(impls) / probe[name]))
            for _ in range(reps):
                start = time.perf_counter()
                fn()
                samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) * 1e6 for name, s in samples.items()}


def result_lines(op: str, timings: dict[str, float], extra: dict[str, object]) -> list[dict]:
    """One result line per impl of ``op``: its microseconds and its speedup over the naive loop."""
    naive = timings["naive_loop"]
    return [{"bench": "kjt_ops", "op": op, "impl": impl, "us": round(us, 1),
             "speedup_vs_naive": round(naive / us, 2), **extra} for impl, us in timings.items()]


def naive_extents(keys: list[str], lengths: torch.Tensor, batch: int) -> list[tuple[int, int]]:
    """What a per-key loop does without cached metadata: one reduction + .item() per key."""
    extents, start = [], 0
    for k in range(len(keys)):
        count = int(lengths[k * batch : (k + 1) * batch].sum().item())
        extents.append((start, start + count))
        start += count
    return extents


def torch_path(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` with the optional C helper (``recsys_core/sparse/_native.c``) switched off."""

    def run() -> object:
        with _native_lib.torch_path_only():
            return fn()

    return run


def bench_ops(batch: int, budget_s: float, only: set[str] | None = None) -> list[dict[str, object]]:
    keys, values, lengths = make_batch(batch)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys, values, lengths)
    lpk = kjt.length_per_key()
    opk = kjt.offset_per_key()
    reverse = list(range(NUM_KEYS - 1, -1, -1))
    half = NUM_KEYS // 2

    def naive_construct() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        extents = naive_extents(keys, lengths, batch)
        return {
            key: (values[lo:hi], lengths[k * batch : (k + 1) * batch])
            for k, (key, (lo, hi)) in enumerate(zip(keys, extents, strict=True))
        }

    def naive_permute() -> tuple[list[str], torch.Tensor, torch.Tensor]:
        # Given the same cached Python-int offsets as the library: only the loop differs.
        new_keys = [keys[i] for i in reverse]
        new_values = torch.cat([values[opk[i] : opk[i + 1]] for i in reverse])
        new_lengths = torch.cat([lengths[i * batch : (i + 1) * batch] for i in reverse])
        return new_keys, new_values, new_lengths

    def naive_split() -> list[tuple[list[str], torch.Tensor, torch.Tensor]]:
        parts = []
        for lo_key, hi_key in ((0, half), (half, NUM_KEYS)):
            part = range(lo_key, hi_key)
            parts.append(
                (
                    keys[lo_key:hi_key],
                    torch.cat([values[opk[i] : opk[i + 1]] for i in part]),
                    torch.cat([lengths[i * batch : (i + 1) * batch] for i in part]),
                )
            )
        return parts

    def naive_to_dict() -> dict[str, JaggedTensor]:
        return {
            key: JaggedTensor(
                values=values[opk[i] : opk[i + 1]], lengths=lengths[i * batch : (i + 1) * batch]
            )
            for i, key in enumerate(keys)
        }

    def fresh_to_dict() -> dict[str, JaggedTensor]:
        # A new KJT each rep: to_dict() caches its result on the instance.
        return KeyedJaggedTensor(keys, values, lengths=lengths, length_per_key=lpk).to_dict()

    def read_offsets(jts: dict[str, JaggedTensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(jt.values(), jt.offsets()) for jt in jts.values()]

    perm_tensor = torch.tensor(reverse, dtype=torch.int32)
    lengths_2d = lengths.view(NUM_KEYS, batch)

    results = []

    def record(op: str, impls: dict[str, Callable[[], object]], extra: dict[str, object]) -> None:
        if only is not None and op not in only:
            return
        results.extend(result_lines(op, measure(impls, budget_s), extra))

    shape = {"batch": batch, "keys": NUM_KEYS, "values": values.numel()}
    record(
        "construct",
        {
            "recsys_core": lambda: KeyedJaggedTensor.from_lengths_sync(keys, values, lengths),
            "recsys_core_torch_path": torch_path(
                lambda: KeyedJaggedTensor.from_lengths_sync(keys, values, lengths)
            ),
            "naive_loop": naive_construct,
        },
        shape,
    )
    record(
        "construct_nosync",
        {
            "recsys_core": lambda: KeyedJaggedTensor(keys, values, lengths=lengths),
            "naive_loop": naive_construct,
        },
        shape,
    )
    record("validate", {"recsys_core": kjt.validate, "naive_loop": naive_construct}, shape)
    record(
        "permute",
        {
            "recsys_core": lambda: kjt.permute(reverse),
            "recsys_core_torch_path": torch_path(lambda: kjt.permute(reverse)),
            "naive_loop": naive_permute,
            "fbgemm_forced": lambda: sparse_ops.permute_2d_sparse_data(
                perm_tensor, lengths_2d, values, None, values.numel(), use_fbgemm=True
            ),
            "copy_floor": values.clone,
        },
        shape,
    )
    record(
        "split", {"recsys_core": lambda: kjt.split([half, half]), "naive_loop": naive_split}, shape
    )
    record("to_dict", {"recsys_core": fresh_to_dict, "naive_loop": naive_to_dict}, shape)
    record(
        "to_dict_offsets",
        {
            "recsys_core": lambda: read_offsets(fresh_to_dict()),
            "naive_loop": lambda: read_offsets(naive_to_dict()),
        },
        shape,
    )
    offsets = torch.zeros(lengths.numel() + 1, dtype=lengths.dtype)
    offsets[1:] = torch.cumsum(lengths, 0)

    def build(mode: str) -> KeyedJaggedTensor:
        return KeyedJaggedTensor(
            keys,
            values,
            lengths=None if mode == "offsets" else lengths,
            offsets=None if mode == "lengths" else offsets,
        )

    fresh_ops: dict[str, tuple[Callable[[KeyedJaggedTensor], object], Callable[[], object]]] = {
        "length_per_key_fresh": (lambda k: k.length_per_key(), naive_construct),
        "permute_fresh": (lambda k: k.permute(reverse), naive_permute),
        "split_fresh": (lambda k: k.split([half, half]), naive_split),
        "to_dict_fresh": (lambda k: k.to_dict(), naive_to_dict),
    }
    for op, (fn, naive) in fresh_ops.items():
        for mode in BUILT_WITH:
            record(
                op,
                {
                    "recsys_core": lambda fn=fn, mode=mode: fn(build(mode)),
                    "naive_loop": naive,
                },
                {**shape, "built_with": mode},
            )
    if only is None or only & {"regroup", "regroup_fwd_bwd"}:
        # both regroup ops are measured together; keep the lines asked for
        regroup = bench_regroup(batch, budget_s)
        results.extend(line for line in regroup if only is None or line["op"] in only)
    return results


def bench_regroup(batch: int, budget_s: float) -> list[dict[str, object]]:
    keys = [f"cat_{i}" for i in range(NUM_KEYS)]
    dim = EMBEDDING_DIM
    values = torch.randn(batch, NUM_KEYS * dim, requires_grad=True)
    kt = KeyedTensor(keys, [dim] * NUM_KEYS, values)
    groups = [keys[0::2], keys[1::2]]
    index = {key: i for i, key in enumerate(keys)}
    grads = [torch.randn(batch, len(g) * dim) for g in groups]

    def naive() -> list[torch.Tensor]:
        return [
            torch.cat([values[:, index[k] * dim : (index[k] + 1) * dim] for k in g], dim=1)
            for g in groups
        ]

    def ours() -> list[torch.Tensor]:
        return KeyedTensor.regroup([kt], groups)

    def fbgemm() -> list[torch.Tensor]:
        return sparse_ops.regroup_keyed_tensor(
            [values], [keys], [[dim] * NUM_KEYS], groups, use_fbgemm=True
        )

    def with_backward(fn: Callable[[], list[torch.Tensor]]) -> Callable[[], None]:
        def step() -> None:
            values.grad = None
            torch.autograd.backward(fn(), grads)

        return step

    extra = {"batch": batch, "keys": NUM_KEYS, "dim": dim, "groups": len(groups)}
    with torch.no_grad():
        forward = measure(
            {
                "recsys_core": ours,
                "naive_loop": naive,
                "fbgemm_forced": fbgemm,
                "copy_floor": values.clone,
            },
            budget_s,
        )
    both = measure(
        {
            "recsys_core": with_backward(ours),
            "naive_loop": with_backward(naive),
            "fbgemm_forced": with_backward(fbgemm),
        },
        budget_s * 2,
    )
    return result_lines("regroup", forward, extra) + result_lines("regroup_fwd_bwd", both, extra)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--budget-s", type=float, default=2.0, help="seconds per op")
    parser.add_argument(
        "--only", nargs="+", choices=OPS, help="run only these ops (default: all of them)"
    )
    args = parser.parse_args()
    only = None if args.only is None else set(args.only)
    for line in bench_ops(args.batch_size, args.budget_s, only):
        line["threads"] = torch.get_num_threads()
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
