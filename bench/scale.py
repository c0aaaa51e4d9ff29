"""Cost as work grows: preprocessing time and memory against input rows, training throughput,
memory and disk traffic against table size, up to the Criteo 1TB model's tables.

Each sub-benchmark prints one JSON line per size; every measured command runs in a child
process, so its peak RSS is its own.

  --preprocess-rows N ...  ``dlrm-app preprocess criteo`` (the CLI, default vocabulary) on the
                           first N rows of generated Criteo TSV (Zipf-skewed ids, as
                           bench/preprocess.py's ``write_tsv(ids="skewed")``, in files of 1M rows
                           generated once and shared by every size), once per
                           ``--preprocess-workers`` count and ``--preprocess-encodings``
                           (vocabulary; hash: modulo 40M): seconds, rows/s, MB/s of input,
                           the largest single process's peak RSS (``wait4``), the peak PSS summed
                           over the process tree (workers included; sampled every 0.25 s) and
                           the tables the vocabulary made.
  --table-caps C ...       training of the DLRM of ``dlrm_app.training.build`` (the app's model, planner,
  --criteo-1tb             sharder and optimizers) at dim ``--dim`` on 26 tables of
                           min(Criteo 1TB's cardinality i, C) rows (``--criteo-1tb``: uncapped,
                           177.9M rows, 46.3 GB with row-wise Adagrad at dim 64), planned for
                           ``--memory-gib`` GiB: tables that do not fit go to files under the
                           work dir behind caches the planner sizes. Synthetic batches: ids
                           Zipf(``--zipf``)-ranked, hot ids scattered over the table, fresh
                           each step (their making is not timed). ``--warmup`` untimed steps,
                           then ``--steps`` timed ones: samples/s, step time, peak RSS, the
                           time to make the tables (setup_s), the cache hit rate (distinct rows
                           per batch found resident; also over the second half of the steps),
                           rows missed and MB read from / written to the backing files per step,
                           MB the process really read from storage (``/proc/self/io``: misses
                           the page cache did not serve) and the step time the drive's measured
                           random 4 KiB read rate implies for the misses (``disk_bound_ms``:
                           one read for a missed row's weights, one for its optimizer state).
                           Before the first size, one ``disk`` line: the drive under the work
                           dir read with O_DIRECT, sequentially (1 MiB) and at random (4 KiB, one
                           and two threads, as the cache's two copy threads).

Generated data, Parquet output and backing files live under ``--work-dir`` (default: a new
directory in the system's temporary directory; the full sizes need about 60 GB, so point it at
a disk that has them), which is deleted at the end unless ``--keep``.

Usage: python bench/scale.py [--preprocess-rows 1000000 10000000 50000000]
       [--preprocess-workers 1 2] [--table-caps 100000 1000000 ...] [--criteo-1tb]
       [--memory-gib 14] [--steps 200] [--warmup 20] [--batch 4096] [--dim 64]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from common import add_flags
from criteo_sizes import CRITEO_1TB_ROWS

CHUNK_ROWS = 1_000_000
GIB = 1024**3


# ---- sizes --------------------------------------------------------------------------------------
def criteo_1tb_tables(cap: int | None) -> list[int]:
    """Rows of the 26 tables: Criteo 1TB's cardinalities, each capped at ``cap`` (None: not)."""
    return [r if cap is None else min(r, cap) for r in CRITEO_1TB_ROWS]


def tables_bytes(rows: list[int], dim: int) -> int:
    """What the tables need in training: fp32 weights + row-wise Adagrad's one float per row."""
    from dlrm_app.training.resources import table_memory_bytes

    return table_memory_bytes(rows, dim, "rowwise_adagrad")


# ---- measuring a child process ------------------------------------------------------------------
def _tree_pss(pid: int) -> int:
    """PSS of ``pid`` and its descendants, in bytes (shared pages counted once)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
                    break
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue  # the process ended while being read
    return total


def run_measured(cmd: list[str], log: Path) -> dict:
    """Run ``cmd``: wall seconds, peak RSS of its largest process, peak PSS of its tree."""
    peak = [0]
    with open(log, "w") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        done = threading.Event()

        def sample() -> None:
            while not done.wait(0.25):
                peak[0] = max(peak[0], _tree_pss(proc.pid))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        done.set()
        sampler.join()
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd[:6])} ... failed ({proc.returncode}):\n"
                         f"{log.read_text()[-3000:]}")
    return {"seconds": seconds, "max_rss_gib": usage.ru_maxrss / 1024**2,
            "tree_pss_gib": peak[0] / GIB}


# ---- preprocessing ------------------------------------------------------------------------------
def write_chunk(path: Path, rows: int, seed: int) -> None:
    """The rows of bench/preprocess.py's ``write_tsv(path, rows, seed, ids="skewed")``, byte
    for byte (same draws in the same order), formatted by pyarrow's CSV writer instead of
    Python string joins: 1M rows in about 6 s instead of 41 s."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.csv as pacsv

    rng = np.random.default_rng(seed)
    alpha = 1.05 + 0.05 * np.arange(26)
    hexdigits = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
    shifts = np.arange(28, -1, -4, dtype=np.uint64)
    options = pacsv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none")
    null = pa.scalar(None, pa.string())
    with open(path, "wb") as f:
        for start in range(0, rows, 100_000):
            n = min(100_000, rows - start)
            label = rng.integers(0, 2, n)
            dense = rng.geometric(0.01, (n, 13))
            dense_missing = rng.random((n, 13)) < 0.05
            raw = (rng.zipf(alpha, (n, 26)).astype(np.uint64) * np.uint64(2654435761)
                   + np.arange(26, dtype=np.uint64)) % np.uint64(2**32)
            cat_missing = rng.random((n, 26)) < 0.05
            offsets = pa.py_buffer((np.arange(n + 1, dtype=np.int32) * 8).tobytes())
            columns = [pa.array(label)]
            columns += [pa.array(dense[:, j], mask=dense_missing[:, j]) for j in range(13)]
            for j in range(26):
                chars = hexdigits[(raw[:, j, None] >> shifts) & np.uint64(15)]
                text = pa.StringArray.from_buffers(n, offsets, pa.py_buffer(chars.tobytes()))
                columns.append(pc.if_else(pa.array(cat_missing[:, j]), null, text))
            table = pa.table(columns, names=[f"c{i}" for i in range(40)])
            pacsv.write_csv(table, f, options)


def bench_preprocess(args: argparse.Namespace, work: Path) -> None:
    chunks, reused = [], 0
    start = time.perf_counter()
    for i in range(-(-max(args.preprocess_rows) // CHUNK_ROWS)):
        chunk = work / f"rows_{i:03d}.tsv"
        if not chunk.exists():  # a kept work dir (--keep) holds them from an earlier run
            write_chunk(chunk.with_suffix(".part"), CHUNK_ROWS, seed=i)
            chunk.with_suffix(".part").rename(chunk)
        else:
            reused += 1
        chunks.append(chunk)
    print(json.dumps({"bench": "scale_generate", "rows": len(chunks) * CHUNK_ROWS,
                      "reused_files": reused,
                      "seconds": round(time.perf_counter() - start, 1),
                      "gb": round(sum(c.stat().st_size for c in chunks) / 1e9, 2)}), flush=True)
    for rows in args.preprocess_rows:
        if rows % CHUNK_ROWS:
            raise SystemExit(f"--preprocess-rows {rows}: give a multiple of {CHUNK_ROWS}")
        inputs = chunks[:rows // CHUNK_ROWS]
        mb = sum(c.stat().st_size for c in inputs) / 1e6
        for workers in args.preprocess_workers:
            for encoding in args.preprocess_encodings:
                _preprocess_once(work, inputs, rows, mb, workers, encoding)


def _preprocess_once(work: Path, inputs: list[Path], rows: int, mb: float, workers: int,
                     encoding: str) -> None:
    out = work / f"out_{rows}_{workers}_{encoding}"
    # hash: the reference DLRM's 40M rows per feature for Criteo 1TB, no counting pass
    sizing = ["--num-embeddings-per-feature", "40000000"] if encoding == "hash" else []
    cmd = [sys.executable, "-m", "dlrm_app", "preprocess", "criteo", *map(str, inputs),
           "--out", str(out), "--workers", str(workers), *sizing]
    m = run_measured(cmd, work / "preprocess.log")
    spec = json.loads((out / "dataset.json").read_text())
    shutil.rmtree(out)
    print(json.dumps({
        "bench": "scale_preprocess", "rows": rows, "workers": workers,
        "encoding": encoding,
        "input_gb": round(mb / 1e3, 2), "seconds": round(m["seconds"], 1),
        "rows_per_s": round(rows / m["seconds"]), "mb_per_s": round(mb / m["seconds"], 1),
        "max_rss_gib": round(m["max_rss_gib"], 3),
        "tree_pss_gib": round(m["tree_pss_gib"], 3),
        "table_rows": sum(f["num_embeddings"] for f in spec["sparse_features"]),
    }), flush=True)


# ---- the drive ----------------------------------------------------------------------------------
def measure_disk(work: Path, gib: float, seconds: float = 3.0) -> dict:
    """O_DIRECT reads of a fresh file under ``work`` (the page cache serves none of them)."""
    path, block = work / "disk_probe", 1 << 20
    size = int(gib * GIB) // block * block
    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(block))
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT)
    for off in range(0, size, block):
        os.pwritev(fd, [buf], off)
    os.fsync(fd)
    os.close(fd)
    write_s = time.perf_counter() - start
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    start = time.perf_counter()
    for off in range(0, size, block):
        os.preadv(fd, [buf], off)
    seq_s = time.perf_counter() - start

    def random_reads(counts: list[int], i: int, stop: float) -> None:
        page, rng, n = mmap.mmap(-1, 4096), random.Random(i), 0
        while time.perf_counter() < stop:
            for _ in range(64):
                os.preadv(fd, [page], rng.randrange(size // 4096) * 4096)
            n += 64
        counts[i] = n

    iops = {}
    for threads in (1, 2):
        counts, stop = [0] * threads, time.perf_counter() + seconds
        pool = [threading.Thread(target=random_reads, args=(counts, i, stop))
                for i in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        iops[threads] = sum(counts) / seconds
    os.close(fd)
    path.unlink()
    return {"bench": "scale_disk", "file_gib": round(size / GIB, 2),
            "write_mb_per_s": round(size / write_s / 1e6), "seq_read_mb_per_s": round(size / seq_s / 1e6),
            "rand_4k_iops_1thread": round(iops[1]), "rand_4k_iops_2threads": round(iops[2]),
            "rand_4k_us_1thread": round(1e6 / iops[1], 1)}


# ---- training (one size per child process) ------------------------------------------------------
def train_case(args: argparse.Namespace) -> dict:
    import torch
    import torch.nn.functional as F

    from dlrm_app.data.loader import Batch
    from dlrm_app.data.schema import SPLIT_NAMES, DatasetKind, DatasetSpec, SparseFeature, SplitSpec
    from dlrm_app.model import ModelConfig
    from dlrm_app.training.build import build_model, build_optimizer, plan_summary
    from dlrm_app.training.config import TrainConfig
    from dlrm_app.training.pipeline import device_batches
    from dlrm_app.training.runtime import amp_enabled, autocast
    from recsys_core import KeyedJaggedTensor

    torch.set_num_threads(args.threads)
    cap = args.case_cap or None
    rows = criteo_1tb_tables(cap)
    spec = DatasetSpec(
        name="scale", kind=DatasetKind.SYNTHETIC, dense_features=tuple(f"int_{i}" for i in range(13)),
        sparse_features=tuple(SparseFeature(name=f"cat_{i}", num_embeddings=r, multi_hot=False)
                              for i, r in enumerate(rows)),
        label="label", label_dtype="float32", created_by="bench/scale.py", parameters={},
        splits=tuple(SplitSpec(name=s, label_rate=0.5, shards=()) for s in SPLIT_NAMES))
    config = TrainConfig.from_flags(data=args.work_dir, out=args.work_dir, batch_size=args.batch,
                                    # the reference DLRM (no wide part), as in docs/scale.md
                                    model=ModelConfig(embedding_dim=args.dim, wide=False),
                                    memory_per_rank=args.memory_gib,
                                    offload=True, offload_dir=str(Path(args.work_dir) / "offload"))
    device = torch.device("cpu")
    amp = amp_enabled(device, config.parallel.amp)
    start = time.perf_counter()
    dmp = build_model(config, spec, device)
    setup_s = time.perf_counter() - start
    optimizer = build_optimizer(config.optimizer, dmp)
    ebc = dmp.module.sparse_arch.embedding_bag_collection
    kernels = [k for lookup in ebc.lookups for k in lookup.cached_kernels()]
    made = [0.0]
    # hot ids scattered: rank r -> r * p mod n, a bijection (p is a prime above every n)
    prime = 2654435761

    def batches():  # fresh ids every step, seeded by the step
        keys = [f.name for f in spec.sparse_features]
        for step in range(args.warmup + args.steps + 1):
            t = time.perf_counter()
            rng = np.random.default_rng(1000 + step)
            ids = [((rng.zipf(args.zipf, args.batch).astype(np.int64) - 1) % n) * prime % n
                   for n in rows]
            kjt = KeyedJaggedTensor(keys=keys, values=torch.from_numpy(np.concatenate(ids)),
                                    lengths=torch.ones(26 * args.batch, dtype=torch.int32))
            batch = Batch(dense=torch.from_numpy(rng.random((args.batch, 13), np.float32)),
                          sparse=kjt, labels=torch.from_numpy(
                              rng.integers(0, 2, args.batch).astype(np.float32)))
            made[0] += time.perf_counter() - t
            yield batch

    def io_read() -> int:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
        return 0

    def totals() -> dict:
        return {f: sum(getattr(k.stats, f) for k in kernels)
                for f in ("lookups", "misses", "ids", "id_hits", "bytes_read", "bytes_written")}

    stream = device_batches(batches(), device, dmp, pipelined=True)
    half = None
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            for k in kernels:
                k.reset_stats()
            t0, made0, io0 = time.perf_counter(), made[0], io_read()
        if step == args.warmup + args.steps // 2:
            half = totals()
        batch = next(stream)
        with autocast(device, amp):
            logits = dmp(batch.dense, batch.sparse).squeeze(1)
        loss = F.binary_cross_entropy_with_logits(logits.float(), batch.labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    elapsed = time.perf_counter() - t0 - (made[0] - made0)
    io_mb = (io_read() - io0) / 1e6
    stream.close()
    end, n = totals(), args.steps
    second = {f: end[f] - half[f] for f in end} if kernels else None
    return {
        "bench": "scale_train", "cap": cap, "total_rows": sum(rows), "dim": args.dim,
        "tables_gb": round(tables_bytes(rows, args.dim) / 1e9, 2), "memory_gib": args.memory_gib,
        "plan": plan_summary(dmp.plan, 1).removeprefix("plan: "),
        "cached_tables": sum(ps.compute_kernel == "fused_uvm_caching"
                             for module in dmp.plan.plan.values() for ps in module.values()),
        "batch": args.batch, "steps": n, "amp": amp,
        "samples_per_s": round(args.batch * n / elapsed, 1),
        "step_ms": round(1e3 * elapsed / n, 1),
        "hit_rate": round(1 - end["misses"] / end["lookups"], 4) if kernels else None,
        "hit_rate_2nd_half": round(1 - second["misses"] / second["lookups"], 4) if kernels else None,
        "id_hit_rate": round(end["id_hits"] / end["ids"], 4) if kernels else None,
        "misses_per_step": round(end["misses"] / n) if kernels else 0,
        "read_mb_per_step": round(end["bytes_read"] / n / 1e6, 2),
        "written_mb_per_step": round(end["bytes_written"] / n / 1e6, 2),
        "storage_read_mb_per_step": round(io_mb / n, 2),
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2, 3),
        "setup_s": round(setup_s, 1), "threads": args.threads,
    }


def bench_train(args: argparse.Namespace, work: Path) -> None:
    disk = measure_disk(work, args.disk_probe_gib)
    print(json.dumps(disk), flush=True)
    caps = [*args.table_caps, *([0] if args.criteo_1tb else [])]
    for cap in caps:
        cmd = [sys.executable, os.path.abspath(__file__), "--case-cap", str(cap),
               "--work-dir", str(work), "--memory-gib", str(args.memory_gib),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
               "--dim", str(args.dim), "--zipf", str(args.zipf), "--threads", str(args.threads)]
        log = work / "train.log"
        m = run_measured(cmd, log)
        line = json.loads([x for x in log.read_text().splitlines() if x.startswith("{")][-1])
        # each missed row: one random read for its weights, one for its optimizer state
        bound = 2 * line["misses_per_step"] / disk["rand_4k_iops_2threads"] * 1e3
        line |= {"disk_bound_ms": round(bound, 1),
                 "step_over_disk_bound": round(line["step_ms"] / bound, 2) if bound else None,
                 "wall_s": round(m["seconds"], 1)}
        print(json.dumps(line), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preprocess-rows", type=int, nargs="*", default=[])
    p.add_argument("--preprocess-workers", type=int, nargs="+", default=[1])
    p.add_argument("--preprocess-encodings", nargs="+", choices=("vocabulary", "hash"),
                   default=["vocabulary"], help="vocabulary: the default; hash: modulo 40M")
    p.add_argument("--table-caps", type=int, nargs="*", default=[],
                   help="per-table row caps on Criteo 1TB's cardinalities, one training run each")
    p.add_argument("--criteo-1tb", action="store_true", help="also the uncapped 1TB tables")
    p.add_argument("--memory-gib", type=float, default=14.0,
                   help="the planner's memory budget (the full 1TB tables plan from 14 GiB)")
    add_flags(p, {"--steps": 200, "--warmup": 20, "--batch": 4096, "--dim": 64, "--zipf": 1.05})
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of the training process (1: what dlrm-app train picks on "
                        "a 2-core host, its 2 CPUs less the loader's thread)")
    p.add_argument("--disk-probe-gib", type=float, default=4.0)
    p.add_argument("--work-dir", default=None,
                   help="where data and table files go (default: a new temporary directory)")
    p.add_argument("--keep", action="store_true", help="keep the work dir")
    p.add_argument("--case-cap", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.case_cap is not None:
        print(json.dumps(train_case(args)), flush=True)
        return
    if args.work_dir is None:
        args.work_dir = tempfile.mkdtemp(prefix="recsys-scale-")
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    try:
        if args.preprocess_rows:
            bench_preprocess(args, work)
        if args.table_caps or args.criteo_1tb:
            bench_train(args, work)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
