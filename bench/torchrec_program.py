"""Like for like with TorchRec: one TorchRec-style DLRM training program, run on TorchRec and on
recsys_core with only the import root changed, interleaved in one run.

The program is what a TorchRec user writes (TorchRec's tutorial and its DLRM example):
``torchrec.models.dlrm.DLRMTrain`` over an ``EmbeddingBagCollection`` on the meta device,
``RowWiseAdagrad`` applied in backward to the tables, ``DistributedModelParallel`` with the
default planner and sharders, dense ``Adagrad`` through ``KeyedOptimizerWrapper`` +
``CombinedOptimizer``, ``TrainPipelineSparseDist``, batches of ``RandomRecDataset`` (made before
timing and cycled), ``--precision bf16`` as ``torch.autocast`` around each step. Reference sizes
(bench/train.py's): 26 one-hot tables of ``--rows-per-table`` rows, dim 128, bottom MLP
512-256-128, top 1024-1024-512-256-1, batch 2048 per rank, one intra-op thread per rank, gloo.

TorchRec must not be installed next to this project: give an interpreter of another environment
that has it with ``--torchrec-python`` (e.g. a venv with torch==2.13.0, fbgemm-gpu-cpu==1.8.0
and torchrec==1.8.0). Without it only the recsys_core lines run.

One JSON line per (library, world size, precision, repeat): samples/s over all ranks, the wall
step and the CPU time per rank-step (process time, mean over ranks), the first and last step's
loss (rank 0); then per (world size, precision, repeat) a line with recsys_core / TorchRec
samples/s. Libraries alternate within each repeat (TorchRec first, then recsys_core), so both
see the same background load. Every line names the CPU.

Usage: python bench/torchrec_program.py [--torchrec-python PATH] [--world-sizes 1,2]
       [--precisions fp32,bf16] [--repeats 2] [--steps 15]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

from common import fill_unset, lscpu, lscpu_field

LIBS = ("torchrec", "recsys_core")
QUICK = {"rows_per_table": 1000, "batch_size": 64, "steps": 3, "warmup": 1, "dim": 16,
         "bottom": "32,16", "top": "32,1"}
FULL = {"rows_per_table": 100_000, "batch_size": 2048, "steps": 15, "warmup": 3, "dim": 128,
        "bottom": "512,256,128", "top": "1024,1024,512,256,1"}


def cpu_name() -> str:
    """The CPU's model name (lscpu) and its widest vector extension."""
    out = lscpu()
    if not out:
        return "unknown"
    model = lscpu_field(out, "Model name")
    flags = (lscpu_field(out, "Flags") or "").split()
    vector = ("AVX-512 BF16" if "avx512_bf16" in flags else "AVX-512" if "avx512f" in flags
              else "AVX2" if "avx2" in flags else "no AVX2")
    return f"{'unknown' if model is None else model} ({vector})"


def worker(args: argparse.Namespace) -> None:
    """One rank of the program under torchrun, on ``args.lib``."""
    import importlib
    import itertools

    import torch
    import torch.distributed as dist
    from torch.distributed.optim import _apply_optimizer_in_backward

    def lib(path: str) -> object:
        return importlib.import_module(f"{args.lib}.{path}")

    RandomRecDataset = lib("datasets.random").RandomRecDataset
    TrainPipelineSparseDist = lib("distributed").TrainPipelineSparseDist
    DistributedModelParallel = lib("distributed.model_parallel").DistributedModelParallel
    dlrm = lib("models.dlrm")
    EmbeddingBagConfig = lib("modules.embedding_configs").EmbeddingBagConfig
    EmbeddingBagCollection = lib("modules.embedding_modules").EmbeddingBagCollection
    keyed = lib("optim.keyed")
    in_backward_optimizer_filter = lib("optim.optimizers").in_backward_optimizer_filter
    RowWiseAdagrad = lib("optim.rowwise_adagrad").RowWiseAdagrad

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    keys = [f"cat_{i}" for i in range(26)]
    bottom = [int(x) for x in args.bottom.split(",")]
    top = [int(x) for x in args.top.split(",")]
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=f"t_{k}", embedding_dim=args.dim, num_embeddings=args.rows_per_table,
                           feature_names=[k]) for k in keys], device=torch.device("meta"))
    model = dlrm.DLRMTrain(dlrm.DLRM(embedding_bag_collection=ebc, dense_in_features=13,
                                     dense_arch_layer_sizes=bottom, over_arch_layer_sizes=top,
                                     dense_device=device))
    _apply_optimizer_in_backward(RowWiseAdagrad, model.model.sparse_arch.parameters(),
                                 {"lr": 0.05})
    dmp = DistributedModelParallel(module=model, device=device)
    dense = keyed.KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                        lambda params: torch.optim.Adagrad(params, lr=0.01))
    optimizer = keyed.CombinedOptimizer([dmp.fused_optimizer, dense])
    pipeline = TrainPipelineSparseDist(dmp, optimizer, device)
    data = RandomRecDataset(keys=keys, batch_size=args.batch_size, hash_size=args.rows_per_table,
                            ids_per_feature=1, num_dense=13, manual_seed=rank)
    batches = itertools.cycle(list(itertools.islice(iter(data), 8)))
    amp = args.precision == "bf16"
    losses: list[float] = []

    def run(steps: int, pipeline: object, batches: object) -> None:
        for _ in range(steps):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                out = pipeline.progress(batches)
            losses.append(float(out[0].detach()) if isinstance(out, tuple) else float("nan"))

    run(args.warmup, pipeline, batches)
    dist.barrier()
    start, cpu_start = time.perf_counter(), time.process_time()
    run(args.steps, pipeline, batches)
    dist.barrier()
    wall = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    cpu = torch.tensor([time.process_time() - cpu_start], dtype=torch.float64)
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    dist.all_reduce(cpu)
    if rank == 0:
        print(json.dumps({
            "bench": "torchrec_program", "lib": args.lib, "world_size": world,
            "precision": args.precision, "batch_size_per_rank": args.batch_size,
            "rows_per_table": args.rows_per_table, "dim": args.dim, "steps": args.steps,
            "samples_per_s": round(args.steps * args.batch_size * world / wall.item(), 1),
            "step_ms": round(wall.item() / args.steps * 1e3, 2),
            "cpu_ms_per_rank_step": round(cpu.item() / world / args.steps * 1e3, 2),
            "first_step_loss": round(losses[0], 6), "last_step_loss": round(losses[-1], 6),
            "load_avg_1m": round(os.getloadavg()[0], 2),
        }), flush=True)
    # Let go of everything holding the group before destroying it, so that the group (and
    # its gloo threads) dies here, not at interpreter exit (see tests/distributed/
    # test_group_lifetime.py: a thread freeing a finished collective then aborts the process)
    del pipeline, optimizer, dense, dmp, model, ebc, data, batches
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def run_job(args: argparse.Namespace, python: str, lib: str, world: int, precision: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    if lib == "torchrec":  # the other environment: nothing of this checkout on its path
        env.pop("PYTHONPATH", None)
    sizes = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in FULL]
    cmd = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           os.path.abspath(__file__), "--worker", f"--lib={lib}", f"--precision={precision}",
           *sizes]
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, timeout=args.timeout)
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{lib} at world size {world} ({precision}): the torchrun job failed "
                         f"(exit code {proc.returncode}; its stderr is above)")
    return lines[0]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--torchrec-python", help="an interpreter whose environment has torchrec")
    p.add_argument("--world-sizes", default="1,2")
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--quick", action="store_true", help=f"tiny sizes for a smoke test: {QUICK}")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per torchrun job")
    for name, value in FULL.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=None,
                       help=f"default {value}")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--lib", choices=LIBS, default="recsys_core", help=argparse.SUPPRESS)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    fill_unset(args, QUICK if args.quick else FULL)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    return args


def main() -> None:
    args = parse_args(sys.argv[1:])
    if args.worker:
        worker(args)
        return
    cpu = cpu_name()
    libs = [("torchrec", args.torchrec_python)] if args.torchrec_python else []
    libs.append(("recsys_core", sys.executable))
    for repeat in range(args.repeats):
        for world in (int(w) for w in args.world_sizes.split(",")):
            for precision in args.precisions.split(","):
                got = {}
                for lib, python in libs:
                    got[lib] = line = run_job(args, python, lib, world, precision)
                    line.update(repeat=repeat, cpu=cpu)
                    print(json.dumps(line), flush=True)
                if len(got) == 2:
                    print(json.dumps({
                        "bench": "torchrec_program_ratio", "world_size": world,
                        "precision": precision, "repeat": repeat, "cpu": cpu,
                        "recsys_core_over_torchrec": round(got["recsys_core"]["samples_per_s"]
                                                           / got["torchrec"]["samples_per_s"], 3),
                    }), flush=True)


if __name__ == "__main__":
    main()
