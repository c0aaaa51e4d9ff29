"""DLRM training throughput with a per-phase time split, against the same model in plain PyTorch.

Two implementations of one DLRM (26 one-hot sparse features, 13 dense, reference layer sizes:
bottom 512-256-128, top 1024-1024-512-256-1, dot interaction) train on the same synthetic
Parquet dataset, read with ``ParquetLoader`` (so data time is real loading), in the same run:

  recsys_core_dmp   the training step of ``dlrm_app/training/trainer.py`` (built by ``dlrm_app/training/build.py``): DistributedModelParallel with the
                    planner's plan, fused row-wise Adagrad on the tables (applied in backward),
                    dense Adagrad, DDP with a summing comm hook, pipelined batches (the next
                    batch's ids all-to-all overlaps this batch's compute)
  pytorch_ddp       26 ``nn.EmbeddingBag(mode="sum", sparse=True)`` + the same dense arch, the
                    whole model in DDP (tables replicated on every rank, their sparse gradients
                    all-reduced by DDP), ``torch.optim.Adagrad`` on both (sparse Adagrad on the
                    tables, lr as ours); no DDP at world size 1, as DMP

Same seed, same data order and the same initial weights, so ``first_step_loss`` matches.

``python bench/train.py`` generates the dataset in a temporary directory and runs one torchrun
job per (world size, implementation), baseline first (``--world-sizes 1,2``; gloo on CPU with
``--threads-per-rank`` intra-op threads, default 1 as in launch/bench_sharded_ebc.sh, so each
rank has a core of its own on a 2-core host; NCCL on CUDA, where world sizes above the GPU count
are skipped). Rank 0 of each job prints one JSON line, which the driver relays:

  samples_per_s / step_ms  the real loop: ``--steps`` steps after ``--warmup``, wall time from a
                           barrier to a barrier on the slowest rank (global samples: world *
                           batch per step)
  phase_ms                 mean over ``--phased-steps`` instrumented steps that call the phases
                           one by one, each followed by a device sync and a barrier, so nothing
                           overlaps and each phase includes waiting for the slowest rank; they
                           sum to ``phased_step_ms`` (which is not step_ms: no overlap, barriers)
  peak_memory_mb           rank 0's (and ``_per_rank``) peak RSS on CPU, the whole process's (one
                           implementation per job), or ``torch.cuda.max_memory_allocated``
  ratio_to_baseline        (recsys_core_dmp only) its samples/s over pytorch_ddp's, same world
                           and precision; ratio_to_fp32_baseline: over pytorch_ddp in fp32
  precision                fp32, or bf16: bfloat16 autocast of the dense arch, interaction and
                           top MLP (``dlrm-app train --amp``) in both implementations
  comm_precision           (ours) what the pooled embeddings and their gradients travel in
                           between ranks (``dlrm-app train --comm-precision``, resolved; one job
                           per value of ``--comm-precisions``)
  floor_ms / step_over_floor  the machine's limit for the model's dense part: a
                           ``dlrm_train_floor`` line per precision times exactly the matrix
                           products a training step computes (each Linear's forward and weight
                           gradient, its input gradient where the input needs one: not the
                           first layer's; the interaction's Z Z^T and its one-product
                           gradient) on one rank's threads, alone; step_over_floor = step_ms /
                           floor_ms (1.0 would be the limit). floor_cpu_ms: the same products'
                           CPU time (thread time), and cpu_over_floor = cpu_ms_per_step /
                           floor_cpu_ms: the ratio a shared, loaded machine changes least
                           (cpu_ms_per_step also counts the loader's and gloo's threads)

  cpu_ms_per_step          CPU time (all threads of the process: compute, loader, gloo's and
                           the transport's) per step, mean over ranks; samples_per_cpu_s = batch
                           per rank / that: how much work a sample costs, which a loaded
                           machine changes far less than wall time (it misses time spent idle
                           waiting for a peer)
  transport                how ranks exchanged bytes: local (one rank), shm (recsys_core's
                           collectives and the dense all-reduce through shared memory, all ranks on
                           this host; the baseline's DDP stays on gloo) or gloo (RECSYS_SHM_COMM=0);
                           ``--transports shm,gloo`` runs ours once per transport, and with
                           ``--ab-rounds N`` both in one job, taking turns every ``--steps`` steps
                           (samples_per_s: the median round; samples_per_s_rounds: every round)

Phases: data (next batch from a loader without a prefetch thread, to device), input_dist (ids
all-to-all, start + wait), lookup (local TBE forward), output_dist (pooled all-to-all),
dense_forward (bottom MLP + interaction + top MLP + loss), dense_backward (to the pooled
embeddings), embedding_backward (output-dist backward + TBE backward with the fused update),
grad_allreduce (the dense gradients, one flat all-reduce, as DDP's hook sums them; the baseline
also all-reduces its sparse table gradients, as DDP does), optimizer (dense step; the baseline's
Adagrad also updates the tables here). The baseline has no input_dist / output_dist.

Both implementations run with the allocator setting of ``dlrm-app`` (``init_distributed`` ->
``dlrm_app.training.runtime.reuse_freed_memory``: per-step buffers stay on the heap for reuse).

Default tables: 100_000 rows each (dim 128: 1.3 GB of fp32 weights per full model; the baseline
holds a replica plus its Adagrad state per rank, 2.7 GB, so 2 of its ranks fit in ~7 GB).

Usage:  python bench/train.py [--steps 20] [--warmup 3] [--rows-per-table 100000] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import fill_unset
from criteo_sizes import CRITEO_1TB_ROWS
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dlrm_app.data.loader import Batch, ParquetLoader
from dlrm_app.data.schema import DatasetSpec
from dlrm_app.data.synthetic import generate
from dlrm_app.model import (
    DenseArch,
    InteractionArch,
    ModelConfig,
    OverArch,
    fill_table_region,
    table_name,
)
from dlrm_app.training.build import (
    build_model,
    build_optimizer,
    comm_precision,
    reset_on_cpu,
    set_learning_rates,
    world_hosts,
)
from dlrm_app.training.config import CommPrecision, TrainConfig
from dlrm_app.training.pipeline import device_batches
from dlrm_app.training.runtime import autocast, init_distributed
from recsys_core.distributed import DistributedModelParallel, shm_comm
from recsys_core.distributed.comm import all_reduce_sum_
from recsys_core.optim import CombinedOptimizer, in_backward_optimizer_filter

FULL = {"batch_size": 2048, "rows_per_table": 100_000, "dim": 128, "bottom": "512,256",
        "top": "1024,1024,512,256", "steps": 20, "warmup": 3, "phased_steps": 5}
QUICK = {"batch_size": 128, "rows_per_table": 1000, "dim": 16, "bottom": "32",
         "top": "64,32", "steps": 3, "warmup": 1, "phased_steps": 2}
OURS, BASELINE = "recsys_core_dmp", "pytorch_ddp"
PRECISIONS = ("fp32", "bf16")
TRANSPORTS = ("shm", "gloo")
PHASES_MEASURED = ("mean of instrumented steps on rank 0; each phase ends with a device sync and "
                   "a barrier, so phases do not overlap and include waiting for the slowest rank")


# ---- config -------------------------------------------------------------------------------------
def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, help=f"rows per rank (default {FULL['batch_size']})")
    p.add_argument("--rows-per-table", type=int, help=f"default {FULL['rows_per_table']}")
    p.add_argument("--dim", type=int, help=f"embedding dim (default {FULL['dim']})")
    p.add_argument("--bottom", help="bottom MLP sizes before the last (= dim) layer "
                                    f"(default {FULL['bottom']})")
    p.add_argument("--top", help=f"top MLP sizes before the 1-logit layer (default {FULL['top']})")
    p.add_argument("--steps", type=int, help=f"timed steps (default {FULL['steps']})")
    p.add_argument("--warmup", type=int, help=f"untimed steps first (default {FULL['warmup']})")
    p.add_argument("--phased-steps", type=int, help=f"default {FULL['phased_steps']}")
    p.add_argument("--quick", action="store_true", help=f"tiny defaults for a smoke test: {QUICK}")
    p.add_argument("--tables", type=int, default=26)
    p.add_argument("--criteo-1tb-sizes", action="store_true",
                   help="table i gets min(Criteo 1TB's cardinality of feature i, --rows-per-table) "
                        "rows (26 tables) instead of --rows-per-table each")
    p.add_argument("--num-dense", type=int, default=13)
    p.add_argument("--world-sizes", default="1,2")
    p.add_argument("--precisions", default="fp32,bf16",
                   help="fp32: no autocast; bf16: bfloat16 autocast of the dense arch, "
                        "interaction and top MLP (dlrm-app train --amp), both implementations")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32", help=argparse.SUPPRESS)
    p.add_argument("--comm-precisions", default="auto",
                   help="comma list of dlrm-app's --comm-precision values to run ours with, one "
                        f"job each (choices {[c.value for c in CommPrecision]}; auto: bf16 "
                        "payloads across hosts in bf16, fp32 otherwise)")
    p.add_argument("--comm-precision", default="auto", help=argparse.SUPPRESS)
    p.add_argument("--transports", default="shm",
                   help="comma list, one job of ours per value at each world size above 1: shm "
                        "(gloo groups on one host exchange through shared memory, the default) "
                        "or gloo (RECSYS_SHM_COMM=0: everything over gloo's TCP loopback)")
    p.add_argument("--repeats", type=int, default=1,
                   help="run each job this many times, interleaved (transport, then the next "
                        "round), to see the spread on a shared machine")
    p.add_argument("--ab-rounds", type=int, default=0,
                   help="A/B the --transports inside one job instead (world sizes above 1): "
                        "this many rounds of --steps steps per transport, order flipped every "
                        "round; samples_per_s is the median round, samples_per_s_rounds all")
    p.add_argument("--no-baseline", action="store_true",
                   help="skip the pytorch_ddp jobs (no ratio_to_baseline)")
    p.add_argument("--threads-per-rank", type=int, default=1,
                   help="intra-op threads per rank (more than cores / world oversubscribes)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", help="use this dataset directory instead of generating one")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--impl", choices=[OURS, BASELINE], default=OURS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    fill_unset(args, QUICK if args.quick else FULL)
    for name in ("batch_size", "rows_per_table", "dim", "steps", "phased_steps", "tables",
                 "num_dense", "threads_per_rank"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.criteo_1tb_sizes and args.tables != len(CRITEO_1TB_ROWS):
        p.error(f"--criteo-1tb-sizes needs --tables {len(CRITEO_1TB_ROWS)}, got {args.tables}")
    bad = sorted(set(args.comm_precisions.split(",")) - {c.value for c in CommPrecision})
    if bad:
        p.error(f"--comm-precisions: unknown {bad}; choose from {[c.value for c in CommPrecision]}")
    bad = sorted(set(args.transports.split(",")) - set(TRANSPORTS))
    if bad:
        p.error(f"--transports: unknown {bad}; choose from {list(TRANSPORTS)}")
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    bad = sorted(set(args.precisions.split(",")) - set(PRECISIONS))
    if bad:
        p.error(f"--precisions: unknown {bad}; choose from {list(PRECISIONS)}")
    if args.warmup < 1:
        p.error(f"--warmup must be >= 1 (its first step gives first_step_loss), got {args.warmup}")
    return args


def table_rows(args: argparse.Namespace) -> list[int]:
    if args.criteo_1tb_sizes:
        return [min(r, args.rows_per_table) for r in CRITEO_1TB_ROWS]
    return [args.rows_per_table] * args.tables


def model_config(args: argparse.Namespace) -> ModelConfig:
    def sizes(text: str) -> tuple[int, ...]:
        return tuple(int(s) for s in text.split(",") if s)

    # the reference DLRM, no wide part: the same model as the plain PyTorch baseline
    return ModelConfig(embedding_dim=args.dim,
                       dense_arch_layer_sizes=(*sizes(args.bottom), args.dim),
                       over_arch_layer_sizes=(*sizes(args.top), 1), wide=False)


# ---- measurement --------------------------------------------------------------------------------
class PhaseClock:
    """Splits one step into phases: ``mark(name)`` waits for the device and for every rank,
    then charges the time since the previous mark to ``name``."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._last = 0.0
        self.ms: dict[str, float] = {}

    def _sync(self) -> float:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()
        return time.perf_counter()

    def start(self) -> None:
        self.ms = {}
        self._last = self._sync()

    def mark(self, name: str) -> None:
        now = self._sync()
        self.ms[name] = (now - self._last) * 1e3
        self._last = now


def peak_memory_mb(device: torch.device) -> float:
    """This process's peak: its whole RSS high-water mark on CPU (one implementation per job)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def gather(value: float) -> list[float]:
    out: list[float] = [value] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def forever(loader: ParquetLoader) -> Iterator[Batch]:
    """The loader's batches, epoch after epoch."""
    epoch = 0
    while True:
        loader.set_epoch(epoch)
        yield from loader
        epoch += 1


def all_reduce_grads(params: list[nn.Parameter], average: bool) -> None:
    """Dense gradients in one flat all-reduce (DDP buckets them); sparse ones one by one.
    ``average``: DDP's default hook (gloo); else the sum through ``comm.all_reduce_sum_``."""
    world = dist.get_world_size()
    if world == 1:
        return
    dense = [p.grad for p in params if p.grad is not None and not p.grad.is_sparse]
    if dense:
        flat = torch.cat([g.reshape(-1) for g in dense])
        if average:
            dist.all_reduce(flat)
            flat /= world
        else:  # the sum, as dlrm_app's DDP comm hook takes it (shared memory on one host)
            all_reduce_sum_(flat, dist.group.WORLD)
        for g, part in zip(dense, flat.split([g.numel() for g in dense]), strict=True):
            g.copy_(part.view_as(g))
    for p in params:
        if p.grad is not None and p.grad.is_sparse:
            dist.all_reduce(p.grad)
            if average:
                p.grad /= world


def dense_logits(model: nn.Module, dense: torch.Tensor, pooled: torch.Tensor,
                 amp: bool) -> torch.Tensor:
    """Bottom MLP, interaction and top MLP of either model on pooled ``[B, F, D]``, in fp32
    or under bf16 autocast; fp32 logits either way (the loss is computed in fp32)."""
    with autocast(pooled.device, amp):
        return model.over_arch(model.inter_arch(model.dense_arch(dense), pooled)).squeeze(1).float()


# ---- ours: DistributedModelParallel -------------------------------------------------------------
class Ours:
    """The model, optimizer and step of ``dlrm_app/training/trainer.py``."""

    def __init__(self, config: TrainConfig, spec: DatasetSpec, device: torch.device) -> None:
        self.dmp: DistributedModelParallel = build_model(config, spec, device)
        self.optimizer: CombinedOptimizer = build_optimizer(config.optimizer, self.dmp)
        self.base_lrs = [float(g["lr"]) for g in self.optimizer.param_groups]
        self.device = device
        self.global_batch = config.schedule.batch_size * dist.get_world_size()
        self.model = self.dmp.module
        self.ebc = self.model.sparse_arch.embedding_bag_collection
        self.config = config
        self.amp = bool(config.parallel.amp)
        named = self.dmp.named_parameters()
        self.dense_params = [p for _, p in in_backward_optimizer_filter(named)]
        names = self.model.sparse_arch.feature_names
        order = [f for s in self.ebc.strategies for f in s.output_features]
        self.to_key_order = None if order == names else torch.tensor(
            [order.index(f) for f in names], device=device)

    def run(self, loader: ParquetLoader, steps: int) -> list[float]:
        """``steps`` steps of the real (pipelined) loop; each step's mean loss on this rank."""
        losses = []
        batches = device_batches(forever(loader), self.device, self.dmp, pipelined=True)
        for _ in range(steps):
            batch = next(batches)
            set_learning_rates(self.dmp, self.optimizer, self.base_lrs, 1.0)
            with autocast(self.device, self.amp):  # as dlrm_app/training/trainer.py
                logits = self.dmp(batch.dense, batch.sparse).squeeze(1)
            loss_sum = F.binary_cross_entropy_with_logits(logits.float(), batch.labels,
                                                          reduction="sum")
            self.optimizer.zero_grad()
            (loss_sum / self.global_batch).backward()
            self.optimizer.step()
            losses.append(loss_sum.item() / len(batch.labels))
        batches.close()  # type: ignore[attr-defined]  # finishes the prefetched input dist
        return losses

    def phased_step(self, batches: Iterator[Batch], clock: PhaseClock) -> None:
        clock.start()
        batch = next(batches).to(self.device)
        clock.mark("data")
        strategies = self.ebc.strategies
        inputs = self.ebc.input_dist(batch.sparse)
        received = [a.wait() for a in inputs]
        clock.mark("input_dist")
        pooled = [s.lookup(kjt) for s, kjt in zip(strategies, received, strict=True)]
        clock.mark("lookup")
        parts = [s.output_dist(p, local).wait()
                 for s, p, local in zip(strategies, pooled, inputs.local_features, strict=True)]
        dim = self.model.sparse_arch.embedding_dim
        values = torch.cat(parts, dim=1).view(len(batch.labels), -1, dim)
        if self.to_key_order is not None:
            values = values.index_select(1, self.to_key_order)
        clock.mark("output_dist")
        emb = values.detach().requires_grad_()
        logits = dense_logits(self.model, batch.dense, emb, self.amp)
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels, reduction="sum")
        loss = loss / self.global_batch
        clock.mark("dense_forward")
        self.optimizer.zero_grad()
        loss.backward()
        clock.mark("dense_backward")
        values.backward(emb.grad)
        clock.mark("embedding_backward")
        all_reduce_grads(self.dense_params, average=False)  # the comm hook sums
        clock.mark("grad_allreduce")
        set_learning_rates(self.dmp, self.optimizer, self.base_lrs, 1.0)
        self.optimizer.step()
        clock.mark("optimizer")

    def describe(self) -> dict[str, object]:
        counts: dict[str, int] = {}  # tables per sharding type
        for module_plan in self.dmp.plan.plan.values():
            for sharding in module_plan.values():
                kind = sharding.sharding_type.value
                counts[kind] = counts.get(kind, 0) + 1
        return {"plan": counts, "dense_optimizer": self.config.optimizer.dense_optimizer.value,
                "embedding_optimizer": f"fused {self.config.optimizer.embedding_optimizer.value}, "
                                       "applied in backward"}


# ---- the baseline: nn.EmbeddingBag + DDP --------------------------------------------------------
class PlainDLRM(nn.Module):
    """The DLRM of ``dlrm_app.model`` with one ``nn.EmbeddingBag(mode="sum", sparse=True)`` per
    sparse feature instead of an EmbeddingBagCollection."""

    def __init__(self, spec: DatasetSpec, config: ModelConfig, device: torch.device) -> None:
        super().__init__()
        dim = config.embedding_dim
        self.embedding_bags = nn.ModuleList(
            nn.EmbeddingBag(f.num_embeddings, dim, mode="sum", sparse=True,
                            include_last_offset=True, device=device)
            for f in spec.sparse_features)
        self.dense_arch = DenseArch(len(spec.dense_features), config.dense_arch_layer_sizes,
                                    device)
        self.inter_arch = InteractionArch(len(spec.sparse_features)).to(device)
        self.over_arch = OverArch(self.inter_arch.output_dim(dim), config.over_arch_layer_sizes,
                                  device)

    def embed(self, ids: list[torch.Tensor], offsets: list[torch.Tensor]) -> torch.Tensor:
        bags = zip(self.embedding_bags, ids, offsets, strict=True)
        return torch.stack([bag(i, o) for bag, i, o in bags], dim=1)

    def forward(self, dense: torch.Tensor, ids: list[torch.Tensor],
                offsets: list[torch.Tensor], amp: bool) -> torch.Tensor:
        return dense_logits(self, dense, self.embed(ids, offsets), amp)


def bags(batch: Batch) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per feature, ids and ``[B + 1]`` offsets of the batch's KJT (what nn.EmbeddingBag takes)."""
    kjt = batch.sparse
    lengths = kjt.lengths().view(len(kjt.keys()), -1).long()
    offsets = F.pad(lengths.cumsum(1), (1, 0))
    return list(kjt.values().split(kjt.length_per_key())), list(offsets.unbind(0))


class Baseline:
    """Plain PyTorch: replicated tables, DDP, sparse Adagrad on the tables, Adagrad on the rest."""

    def __init__(self, config: TrainConfig, spec: DatasetSpec, device: torch.device) -> None:
        model = PlainDLRM(spec, config.model, device)
        # the same initial weights as ours: tables from (seed, table, row block), dense layers
        # reset after torch.manual_seed(seed) in module order, drawn on the CPU on any device
        with torch.no_grad():
            for bag, f in zip(model.embedding_bags, spec.sparse_features, strict=True):
                fill_table_region(bag.weight, table_name(f.name), f.num_embeddings,
                                  config.model.embedding_dim, 0, 0, config.seed)
        torch.manual_seed(config.seed)
        for module in model.modules():
            if not isinstance(module, nn.EmbeddingBag) and hasattr(module, "reset_parameters"):
                reset_on_cpu(module)
        self.model = model
        self.ddp: nn.Module = model
        if dist.get_world_size() > 1:
            device_ids = [device] if device.type == "cuda" else None
            self.ddp = DistributedDataParallel(model, device_ids=device_ids)
        tables = list(model.embedding_bags.parameters())
        dense = [p for name, p in model.named_parameters() if not name.startswith("embedding_bags")]
        self.params = tables + dense
        self.optimizers = [
            torch.optim.Adagrad(tables, lr=config.optimizer.embedding_learning_rate,
                                eps=config.optimizer.eps),
            torch.optim.Adagrad(dense, lr=config.optimizer.learning_rate, eps=config.optimizer.eps),
        ]
        self.device = device
        self.amp = bool(config.parallel.amp)

    def _zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad()

    def _step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def run(self, loader: ParquetLoader, steps: int) -> list[float]:
        losses = []
        batches = forever(loader)
        for _ in range(steps):
            batch = next(batches).to(self.device, non_blocking=True)
            ids, offsets = bags(batch)
            loss = F.binary_cross_entropy_with_logits(self.ddp(batch.dense, ids, offsets, self.amp),
                                                      batch.labels)
            self._zero_grad()
            loss.backward()
            self._step()
            losses.append(loss.item())
        return losses

    def phased_step(self, batches: Iterator[Batch], clock: PhaseClock) -> None:
        clock.start()
        batch = next(batches).to(self.device)
        ids, offsets = bags(batch)
        clock.mark("data")
        pooled = self.model.embed(ids, offsets)
        clock.mark("lookup")
        emb = pooled.detach().requires_grad_()
        loss = F.binary_cross_entropy_with_logits(dense_logits(self.model, batch.dense, emb, self.amp),
                                                  batch.labels)
        clock.mark("dense_forward")
        self._zero_grad()
        loss.backward()
        clock.mark("dense_backward")
        pooled.backward(emb.grad)
        clock.mark("embedding_backward")
        all_reduce_grads(self.params, average=True)  # DDP's default: the mean over ranks
        clock.mark("grad_allreduce")
        self._step()
        clock.mark("optimizer")

    def describe(self) -> dict[str, object]:
        return {"dense_optimizer": "adagrad",
                "embedding_optimizer": "torch.optim.Adagrad on sparse gradients"}


# ---- one job (under torchrun): one implementation at one world size -----------------------------
IMPLS = {OURS: Ours, BASELINE: Baseline}


def worker(args: argparse.Namespace) -> None:
    # comm.py calls reduce_scatter_tensor / all_gather_into_tensor, which torch 2.13 deprecates
    # for gloo: a note about the library, not about this run
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    # torch.optim.Adagrad's sparse update notes, every step, that it skips invariant checks
    warnings.filterwarnings("ignore", message="Sparse invariant checks")
    device = init_distributed()
    if not dist.is_initialized():
        raise SystemExit("--worker runs under torchrun; run `python bench/train.py` instead")
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = DatasetSpec.load(args.data)
    # tables in memory (no run directory to keep offloaded tables in)
    config = TrainConfig.from_flags(data=args.data, out=os.devnull, model=model_config(args),
                                    batch_size=args.batch_size, seed=args.seed, offload=False,
                                    amp=args.precision == "bf16",
                                    comm_precision=CommPrecision(args.comm_precision))
    bench = IMPLS[args.impl](config, spec, device)

    def loader(prefetch: int) -> ParquetLoader:  # the order of train(): same for both impls
        return ParquetLoader(config.data, "train", batch_size=config.schedule.batch_size, rank=rank,
                             world_size=world, shuffle=config.schedule.shuffle, seed=config.seed,
                             drop_last=True, prefetch=prefetch)

    train_loader = loader(prefetch=2)
    first = bench.run(train_loader, args.warmup)[0]
    # A/B: the transports take turns in one job, ``--ab-rounds`` rounds of ``--steps`` steps
    # each (the order flips every round), so both see the same background load
    vias: list[str | None] = [None]
    if args.ab_rounds and world > 1 and args.impl == OURS and device.type == "cpu":
        vias = list(args.transports.split(","))
    slowest: dict[str | None, list[float]] = {via: [] for via in vias}
    cpu: dict[str | None, list[float]] = {via: [] for via in vias}  # CPU s per step, rank mean
    losses: list[float] = []
    for round_ in range(max(args.ab_rounds, 1) if vias != [None] else 1):
        for via in vias if round_ % 2 == 0 else vias[::-1]:
            if via is not None:
                shm_comm.pause(via != "shm")
            dist.barrier()
            start, cpu_start = time.perf_counter(), time.process_time()
            losses += bench.run(train_loader, args.steps)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dist.barrier()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            used = torch.tensor([time.process_time() - cpu_start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            dist.all_reduce(used)
            slowest[via].append(elapsed.item())
            cpu[via].append(used.item() / world / args.steps)
    clock, phases = PhaseClock(device), {via: [] for via in vias}
    batches = forever(loader(prefetch=0))  # "data" is then the whole read + decode of a batch
    for via in vias:
        if via is not None:
            shm_comm.pause(via != "shm")
        for _ in range(args.phased_steps):
            bench.phased_step(batches, clock)
            phases[via].append(clock.ms)
    shm_comm.pause(False)
    mean_loss = torch.tensor([sum(losses) / len(losses)], dtype=torch.float64)
    dist.all_reduce(mean_loss)
    peaks = gather(round(peak_memory_mb(device), 1))
    # on every rank: the first look sets the group's transport up, a collective (the baseline
    # never used it before this line)
    how = transport(device)
    for via in vias if rank == 0 else []:
        rows = sorted({f.num_embeddings for f in spec.sparse_features})
        phase_ms = {k: round(sum(p[k] for p in phases[via]) / len(phases[via]), 2)
                    for k in phases[via][0]}
        rates = [args.steps * config.schedule.batch_size * world / t for t in slowest[via]]
        median = sorted(slowest[via])[len(slowest[via]) // 2]
        line = {
            "bench": "dlrm_train", "impl": args.impl, "precision": args.precision,
            "comm_precision": (comm_precision(config.parallel, config.model, device,
                                              world_hosts()).value
                               if args.impl == OURS else None),
            "world_size": world,
            "device": device.type, "backend": dist.get_backend(),
            "transport": via or how,
            "batch_size_per_rank": config.schedule.batch_size,
            "global_batch": config.schedule.batch_size * world,
            "tables": len(spec.sparse_features),
            "rows_per_table": rows[0] if len(rows) == 1 else rows,
            "dim": config.model.embedding_dim,
            "bottom_mlp": list(config.model.dense_arch_layer_sizes),
            "top_mlp": list(config.model.over_arch_layer_sizes),
            "steps": args.steps, "warmup": args.warmup, "phased_steps": args.phased_steps,
            "threads_per_rank": torch.get_num_threads(),
            "samples_per_s": round(args.steps * config.schedule.batch_size * world / median, 1),
            "step_ms": round(median / args.steps * 1e3, 2),
            **({"ab_rounds": len(rates), "samples_per_s_rounds": [round(r, 1) for r in rates]}
               if via is not None else {}),
            "cpu_ms_per_step": round(sorted(cpu[via])[len(cpu[via]) // 2] * 1e3, 2),
            **({"cpu_ms_per_step_rounds": [round(c * 1e3, 1) for c in cpu[via]]}
               if via is not None else {}),
            "samples_per_cpu_s": round(
                config.schedule.batch_size / sorted(cpu[via])[len(cpu[via]) // 2], 1),
            "phase_ms": phase_ms,
            "phased_step_ms": round(sum(phase_ms.values()), 2),
            "phases_measured": PHASES_MEASURED,
            "peak_memory_mb": peaks[0],
            "peak_memory_mb_per_rank": peaks,
            "first_step_loss": round(first, 6),
            "mean_loss": round(mean_loss.item() / world, 6),
            **bench.describe(),
            "load_avg_1m": round(os.getloadavg()[0], 2),  # other jobs on the host: noise
        }
        print(json.dumps(line), flush=True)
    # Free the model (its DDP reducer holds the process group) while the group is alive: a
    # reducer left to die after destroy_process_group tears the group down with the GIL held
    # while a gloo thread still needs it to free a finished sparse all-reduce (a hang at exit).
    del bench, batches, train_loader
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def transport(device: torch.device) -> str:
    """How ranks exchange bytes: local (one rank), shm (shared memory, recsys_core's
    collectives and dense all-reduce; the baseline's DDP stays on gloo) or the backend."""
    if dist.get_world_size() == 1:
        return "local"
    return "shm" if shm_comm.for_group(dist.group.WORLD, device) is not None else dist.get_backend()


# ---- driver -------------------------------------------------------------------------------------
def matmul_floor(args: argparse.Namespace, precision: str, device: torch.device) -> dict:
    """The machine's limit for this model's dense part: the time of exactly the matrix
    products its training step computes (each Linear's forward and weight-gradient GEMM at the
    batch size, its input-gradient GEMM except the first layer's, whose input, the dense
    features, needs none; the interaction's Z Z^T and its gradient, one product (G + G^T) Z),
    run back to back on ``--threads-per-rank`` threads in ``precision``, with nothing else (no
    bias, activations, loss, optimizer, embeddings, data). ``floor_ms`` is wall time,
    ``floor_cpu_ms`` this thread's CPU time, each the second best of 7 rounds."""
    config, batch = model_config(args), args.batch_size
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    sizes = [args.num_dense, *config.dense_arch_layer_sizes]
    pairs = args.tables * (args.tables + 1) // 2
    top = [config.embedding_dim + pairs, *config.over_arch_layer_sizes]
    gemms = []  # (m, k, n) of each product: [m, k] @ [k, n]
    for widths in (sizes, top):
        for i, (k, n) in enumerate(zip(widths, widths[1:], strict=False)):
            gemms += [(batch, k, n), (k, batch, n)]  # forward, dW
            if widths is top or i > 0:  # dX (the dense features need no gradient)
                gemms.append((batch, n, k))
    f, d = args.tables + 1, config.embedding_dim
    bmms = [(f, d, f), (f, f, d)]  # Z Z^T and its gradient (G + G^T) Z, per row
    operands = [(torch.randn(m, k, dtype=dtype, device=device),
                 torch.randn(k, n, dtype=dtype, device=device)) for m, k, n in gemms]
    operands += [(torch.randn(batch, m, k, dtype=dtype, device=device),
                  torch.randn(batch, k, n, dtype=dtype, device=device)) for m, k, n in bmms]
    flops = 2 * sum(m * k * n for m, k, n in gemms) + 2 * batch * sum(m * k * n
                                                                      for m, k, n in bmms)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads_per_rank)
    try:
        times, cpu_times = [], []
        for _ in range(7):
            start, cpu_start = time.perf_counter(), time.thread_time()
            for a, b in operands:
                torch.matmul(a, b)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
            cpu_times.append(time.thread_time() - cpu_start)
    finally:
        torch.set_num_threads(threads)
    best = sorted(times)[1]  # second best of 7: the floor, not a lucky outlier
    return {"bench": "dlrm_train_floor", "precision": precision, "device": device.type,
            "threads": args.threads_per_rank, "batch_size_per_rank": batch,
            "floor_ms": round(best * 1e3, 3), "floor_cpu_ms": round(sorted(cpu_times)[1] * 1e3, 3),
            "gflop_per_step": round(flops / 1e9, 4),
            "gflop_per_s": float(f"{flops / best / 1e9:.3g}"),
            "measures": "the matrix products of the dense part's training step alone, per rank and "
                        "step"}



def run_job(args: argparse.Namespace, argv: list[str], data: str, world: int, impl: str,
            cuda: bool, transport: str = "shm") -> list[dict[str, object]]:
    """One torchrun job; its rank 0's JSON lines (one, or one per transport under
    --ab-rounds; the job's stderr passes through)."""
    env = dict(os.environ)
    env[shm_comm.ENV_SWITCH] = "1" if transport == "shm" else "0"
    env["OMP_NUM_THREADS"] = str(args.threads_per_rank)
    if not cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={world}", __file__, *argv,
           "--worker", "--impl", impl, "--data", data]
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{impl} at world size {world}: the torchrun job failed (exit code "
                         f"{proc.returncode}; its stderr is above); stdout:\n{proc.stdout}")
    return lines


def launch(args: argparse.Namespace, argv: list[str]) -> None:
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    worlds = [int(w) for w in args.world_sizes.split(",")]
    cores = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory(prefix="bench_train_") as tmp:
        data = args.data
        if data is None:
            data = tmp
            # every rank's batches for every step of the largest world size, in row groups of
            # 4 batches (at least one per rank); validation and test are minimal
            need = (args.warmup + args.steps + args.phased_steps + 2) * args.batch_size
            train_rows = max(need * max(worlds), 4 * args.batch_size * max(worlds))
            print(f"generating {train_rows} rows in {tmp}", file=sys.stderr, flush=True)
            generate(tmp, rows=int(train_rows / 0.98) + 2, num_dense=args.num_dense,
                     cardinalities=table_rows(args),
                     pooling_factors=[1.0] * args.tables, splits=(0.98, 0.01, 0.01),
                     row_group_size=4 * args.batch_size, seed=args.seed)
        precisions = args.precisions.split(",")
        device = torch.device("cuda" if cuda else "cpu")
        floors = {p: matmul_floor(args, p, device) for p in precisions}
        for line in floors.values():
            print(json.dumps(line), flush=True)
        for world in worlds:
            if cuda and world > torch.cuda.device_count():
                print(f"world size {world} skipped: {torch.cuda.device_count()} GPU(s)",
                      file=sys.stderr, flush=True)
                continue
            if args.threads_per_rank * world > cores:
                print(f"note: {world} ranks x {args.threads_per_rank} threads on {cores} cores",
                      file=sys.stderr, flush=True)
            transports = args.transports.split(",") if world > 1 and not cuda else ["shm"]
            fp32_base = None
            for precision in precisions:
                job = [*argv, "--precision", precision]
                base = None if args.no_baseline else run_job(args, job, data, world, BASELINE,
                                                             cuda)[0]
                fp32_base = fp32_base or (base if precision == "fp32" else None)
                lines = [] if base is None else [base]
                jobs = transports if args.ab_rounds == 0 else ["shm"]  # A/B: all in one job
                for repeat in range(args.repeats):
                    for comm in args.comm_precisions.split(","):
                        for ours in (line for via in jobs for line in run_job(
                                args, [*job, "--comm-precision", comm], data, world, OURS, cuda,
                                via)):
                            ours["repeat"] = repeat
                            if base is not None:
                                ours["ratio_to_baseline"] = round(
                                    ours["samples_per_s"] / base["samples_per_s"], 3)
                            if fp32_base is not None:
                                ours["ratio_to_fp32_baseline"] = round(
                                    ours["samples_per_s"] / fp32_base["samples_per_s"], 3)
                            lines.append(ours)
                for line in lines:
                    line["floor_ms"] = floors[precision]["floor_ms"]
                    line["step_over_floor"] = round(line["step_ms"] / line["floor_ms"], 2)
                    line["floor_cpu_ms"] = floors[precision]["floor_cpu_ms"]
                    line["cpu_over_floor"] = round(
                        line["cpu_ms_per_step"] / line["floor_cpu_ms"], 2)
                    print(json.dumps(line), flush=True)


def main() -> None:
    argv = sys.argv[1:]
    args = parse_args(argv)
    if args.worker:
        worker(args)
    else:
        launch(args, argv)


if __name__ == "__main__":
    main()
