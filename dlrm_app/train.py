"""``dlrm-app train``: DLRM training as one process or under ``torchrun``.

    torchrun --nproc-per-node 2 -m dlrm_app train --data data/synthetic --out runs/a

Process group: ``torchrun`` sets RANK/WORLD_SIZE/MASTER_ADDR...; the backend is NCCL when CUDA
is available, else gloo. Without those variables the job runs as a single process.

Gradients: each rank's loss is its rows' summed log loss divided by the *global* batch
(``batch_size * world_size``), and both the embedding gradients (through the sharded
collections' output dist) and the dense gradients (DDP, with a summing comm hook) are summed over
ranks. Every step therefore applies exactly the gradient of the global batch's mean loss, so N
ranks with ``batch_size`` rows each follow the same trajectory as one rank with
``N * batch_size`` rows (up to float summation order). With row groups of exactly
``batch_size`` rows (the loader deals row groups round-robin) the global batches even hold the
same rows.

Initialization is independent of the plan: tables from (seed, table, row block), dense layers
from ``torch.manual_seed(seed)`` after sharding.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import resource
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from dlrm_app.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from dlrm_app.config import DenseOptimizer, EmbeddingOptimizer, TrainConfig, lr_scale
from dlrm_app.data.loader import Batch, ParquetLoader
from dlrm_app.data.schema import DatasetSpec
from dlrm_app.metrics import BinaryClassificationMetrics
from dlrm_app.model import Interaction, ModelConfig, build_dlrm, init_embedding_tables
from recsys_core.distributed import (
    DistributedModelParallel,
    EmbeddingBagCollectionSharder,
    ShardingPlan,
)
from recsys_core.distributed.embeddingbag import ShardedEmbeddingBagCollection
from recsys_core.kernels.config import EmbOptimType
from recsys_core.optim import CombinedOptimizer, KeyedOptimizerWrapper, in_backward_optimizer_filter

_FUSED = {
    EmbeddingOptimizer.SGD: EmbOptimType.EXACT_SGD,
    EmbeddingOptimizer.ADAGRAD: EmbOptimType.EXACT_ADAGRAD,
    EmbeddingOptimizer.ROWWISE_ADAGRAD: EmbOptimType.EXACT_ROWWISE_ADAGRAD,
}
PHASES = ("data", "forward", "backward", "optimizer")


# ---- setup --------------------------------------------------------------------------------------
def init_distributed() -> torch.device:
    """Join the process group torchrun describes (if any); the device this rank uses."""
    cuda = torch.cuda.is_available()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def shutdown_distributed() -> None:
    """Leave the process group cleanly at the end of a command. Without it a rank can abort
    at interpreter exit ("terminate called without an active exception") while gloo's threads
    still hold finished work: free the models first, then wait for every rank, then destroy."""
    if dist.is_initialized():
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


def world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _sum_allreduce_hook(group, bucket):  # type: ignore[no-untyped-def]
    """DDP comm hook: sum gradients over ranks (the default averages); see the module docs.

    Unannotated on purpose: DDP rejects annotations that are not literally ``dist.GradBucket``,
    and ``from __future__ import annotations`` turns them into strings."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def build_model(config: TrainConfig, spec: DatasetSpec, device: torch.device
                ) -> DistributedModelParallel:
    """The DLRM sharded over the world (plan from ``config.plan`` or the planner), initialized
    from ``config.seed`` the same way for any plan."""
    plan = None
    if config.plan:
        try:
            plan = ShardingPlan.from_json(Path(config.plan).read_text())
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"--plan {config.plan}: cannot read a sharding plan ({e}); pass a "
                             f"plan.json written by an earlier run") from None
    sharder = EmbeddingBagCollectionSharder(fused_params={
        "optimizer": _FUSED[config.embedding_optimizer],
        "learning_rate": config.embedding_learning_rate,
        "eps": config.eps,
    })
    model = build_dlrm(spec, config.model, device="meta")
    dmp = DistributedModelParallel(model, device=device, plan=plan, sharders=[sharder])
    torch.manual_seed(config.seed)
    for module in dmp.module.modules():
        if not isinstance(module, ShardedEmbeddingBagCollection) and hasattr(module, "reset_parameters"):
            module.reset_parameters()
    init_embedding_tables(dmp.module, config.seed)
    ddp = dmp.data_parallel
    if ddp is not None:
        ddp.register_comm_hook(dmp.env.pg, _sum_allreduce_hook)
    return dmp


def build_optimizer(config: TrainConfig, dmp: DistributedModelParallel) -> CombinedOptimizer:
    """Fused table optimizer (already applied in backward) + the dense optimizer, combined."""
    dense_params = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    if config.dense_optimizer is DenseOptimizer.SGD:
        def factory(ps: Any) -> torch.optim.Optimizer:
            return torch.optim.SGD(ps, lr=config.learning_rate)
    elif config.dense_optimizer is DenseOptimizer.ADAGRAD:
        def factory(ps: Any) -> torch.optim.Optimizer:
            return torch.optim.Adagrad(ps, lr=config.learning_rate, eps=config.eps)
    else:
        def factory(ps: Any) -> torch.optim.Optimizer:
            return torch.optim.Adam(ps, lr=config.learning_rate, eps=config.eps)
    dense = KeyedOptimizerWrapper(dense_params, factory)
    dense.init_state()  # state exists before a checkpoint is loaded into it
    return CombinedOptimizer([("sparse", dmp.fused_optimizer), ("dense", dense)])


def set_learning_rates(dmp: DistributedModelParallel, optimizer: CombinedOptimizer,
                       base: list[float], scale: float) -> None:
    """Scale every group's rate; the fused kernels take theirs on ``fused_optimizer.step()``
    (which only forwards the rate: their update already happened in backward)."""
    for group, lr in zip(optimizer.param_groups, base, strict=True):
        group["lr"] = lr * scale
    dmp.fused_optimizer.step()


# ---- batches ------------------------------------------------------------------------------------
def device_batches(batches: Iterable[Batch], device: torch.device, model: nn.Module,
                   pipelined: bool) -> Iterator[Batch]:
    """Batches on ``device``. Pipelined (TorchRec's ``TrainPipelineSparseDist`` idea): batch
    i+1 is copied (on a side CUDA stream) and its sparse input all-to-all started before batch i
    is handed out, so both overlap batch i's forward and backward. Results are identical to the
    plain loop: only ids move early, embeddings are looked up at batch i+1's forward."""
    if not pipelined:
        for batch in batches:
            yield batch.to(device, non_blocking=True)
        return
    sharded = [m for m in model.modules() if isinstance(m, ShardedEmbeddingBagCollection)]
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def stage(batch: Batch) -> Batch:
        if stream is not None:
            with torch.cuda.stream(stream):
                batch = batch.to(device, non_blocking=True)
            torch.cuda.current_stream(device).wait_stream(stream)
        else:
            batch = batch.to(device)
        for module in sharded:
            module.prefetch(batch.sparse)
        return batch

    iterator = iter(batches)
    try:
        current = next(iterator, None)
        if current is None:
            return
        current = stage(current)
        for upcoming in iterator:
            upcoming = stage(upcoming)
            yield current
            current = upcoming
        yield current
    finally:
        for module in sharded:
            module.drop_prefetched()


# ---- evaluation ---------------------------------------------------------------------------------
def evaluate_model(dmp: nn.Module, loader: ParquetLoader, device: torch.device,
                   max_batches: int = 0, amp: bool = False) -> dict[str, float]:
    """AUC, NE, logloss... of ``dmp`` on ``loader``'s split, exact over all ranks."""
    metrics = BinaryClassificationMetrics()
    was_training = dmp.training
    dmp.eval()
    autocast = _autocast(device, amp)
    with torch.no_grad():
        for i, batch in enumerate(loader):
            if max_batches and i >= max_batches:
                break
            batch = batch.to(device, non_blocking=True)
            with autocast:
                logits = dmp(batch.dense, batch.sparse).squeeze(1)
            valid = len(batch.labels) if batch.valid_rows is None else batch.valid_rows
            metrics.update(logits[:valid].float(), batch.labels[:valid])
    dmp.train(was_training)
    return metrics.compute()


def _autocast(device: torch.device, amp: bool) -> Any:
    if amp and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()


# ---- bookkeeping --------------------------------------------------------------------------------
class _Log:
    """Appends JSON lines to ``metrics.jsonl`` (rank 0 only)."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self._file = path.open("a") if enabled else None

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def _global_mean(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return t.tolist()


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _gather(value: Any) -> list[Any]:
    if not dist.is_initialized():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


# ---- the loop -----------------------------------------------------------------------------------
def train(config: TrainConfig, progress: bool = True) -> dict[str, Any]:
    """Train (and validate, checkpoint) as configured; returns the summary rank 0 prints."""
    device = init_distributed()
    rank, world_size = world()
    spec = DatasetSpec.load(config.data)
    out = Path(config.out)
    ckpt_dir = out / "checkpoints"
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        config.save(out / "config.json")
    torch.manual_seed(config.seed)

    dmp = build_model(config, spec, device)
    optimizer = build_optimizer(config, dmp)
    base_lrs = [float(g["lr"]) for g in optimizer.param_groups]
    if rank == 0:
        (out / "plan.json").write_text(dmp.plan.to_json() + "\n")
        if progress:
            print(dmp.plan, file=sys.stderr)

    train_loader = ParquetLoader(config.data, "train", batch_size=config.batch_size, rank=rank,
                                 world_size=world_size, shuffle=config.shuffle, seed=config.seed,
                                 drop_last=True)
    val_loader = ParquetLoader(config.data, "validation", batch_size=config.batch_size,
                               rank=rank, world_size=world_size, drop_last=False,
                               pad_last=True)
    steps_per_epoch = len(train_loader)
    if steps_per_epoch == 0:
        raise ValueError(f"the train split of {config.data} has fewer than --batch-size "
                         f"({config.batch_size}) rows per rank; use a smaller batch size")
    total_steps = steps_per_epoch * config.epochs
    if config.max_steps is not None:
        total_steps = min(total_steps, config.max_steps)

    step = 0
    resumed_from = None
    if config.resume:
        path = latest_checkpoint(ckpt_dir)
        if path is not None:
            extra = load_checkpoint(path, model=dmp, optimizer=optimizer, extra={
                "step": 0, "epoch": 0, "batches_yielded": 0, "world_size": 0, "batch_size": 0,
                "rng": torch.get_rng_state()})
            step = int(extra["step"])
            torch.set_rng_state(extra["rng"])
            batches = int(extra["batches_yielded"])
            if (int(extra["world_size"]), int(extra["batch_size"])) != (world_size, config.batch_size):
                # another world size: resume at the same number of global rows into the epoch
                rows = batches * int(extra["batch_size"]) * int(extra["world_size"])
                batches = rows // (config.batch_size * world_size)
            train_loader.load_state_dict({"epoch": int(extra["epoch"]),
                                          "batches_yielded": min(batches, steps_per_epoch)})
            resumed_from = str(path)

    log = _Log(out / "metrics.jsonl", rank == 0)
    log.write({"event": "start", "world_size": world_size, "device": str(device),
               "steps_per_epoch": steps_per_epoch, "total_steps": total_steps,
               "resumed_from": resumed_from, "start_step": step})
    phase_s = dict.fromkeys(PHASES, 0.0)
    bar = tqdm(total=total_steps, initial=step, disable=not (progress and rank == 0),
               unit="step", dynamic_ncols=True)
    autocast = _autocast(device, config.amp)
    global_batch = config.batch_size * world_size
    start_step, started = step, time.perf_counter()
    window_loss: torch.Tensor | float = 0.0
    window_start, window_steps = time.perf_counter(), 0
    val_metrics: dict[str, float] | None = None
    stopped_early = False

    def validate() -> dict[str, float]:
        metrics = evaluate_model(dmp, val_loader, device, config.val_batches, config.amp)
        log.write({"event": "validation", "step": step, **metrics})
        return metrics

    # batches of the current epoch trained so far (the pipelined loop pulls one batch ahead,
    # so the loader's own count can be one higher)
    epoch_batches = train_loader.state_dict()["batches_yielded"]

    def checkpoint() -> None:
        save_checkpoint(ckpt_dir, step, model=dmp, optimizer=optimizer,
                        keep=config.keep_checkpoints, extra={
                            "step": step, "epoch": train_loader.epoch,
                            "batches_yielded": epoch_batches,
                            "world_size": world_size, "batch_size": config.batch_size,
                            "rng": torch.get_rng_state()})

    dmp.train()
    epoch = train_loader.epoch
    while step < total_steps and epoch < config.epochs and not stopped_early:
        if epoch_batches >= steps_per_epoch:
            epoch += 1  # resumed exactly at an epoch's end
            train_loader.set_epoch(epoch)
            epoch_batches = 0
            continue
        batches = device_batches(train_loader, device, dmp, config.pipelined)
        t0 = time.perf_counter()
        for batch in batches:
            t1 = time.perf_counter()
            set_learning_rates(dmp, optimizer, base_lrs, lr_scale(
                step, config.lr_warmup_steps, config.lr_decay_start, config.lr_decay_steps))
            with autocast:
                logits = dmp(batch.dense, batch.sparse).squeeze(1)
            loss_sum = F.binary_cross_entropy_with_logits(logits.float(), batch.labels,
                                                          reduction="sum")
            t2 = time.perf_counter()
            optimizer.zero_grad()
            (loss_sum / global_batch).backward()
            t3 = time.perf_counter()
            optimizer.step()
            t4 = time.perf_counter()
            for name, seconds in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                phase_s[name] += seconds
            step += 1
            epoch_batches += 1
            # a device tensor: no host sync per step, only at log steps
            window_loss = window_loss + loss_sum.detach() / len(batch.labels)
            window_steps += 1
            bar.update(1)
            if step % config.log_every == 0 or step == total_steps:
                (loss,) = _global_mean([float(window_loss) / window_steps], device)
                rate = window_steps * global_batch / (time.perf_counter() - window_start)
                log.write({"event": "train", "step": step, "epoch": epoch, "loss": loss,
                           "lr": optimizer.param_groups[-1]["lr"], "samples_per_s": rate})
                bar.set_postfix(loss=f"{loss:.4f}", samples_per_s=f"{rate:,.0f}")
                window_loss, window_start, window_steps = 0.0, time.perf_counter(), 0
            if config.validate_every and step % config.validate_every == 0:
                val_metrics = validate()
                if config.target_auc is not None and val_metrics["auc"] >= config.target_auc:
                    stopped_early = True
            if config.save_every and step % config.save_every == 0:
                checkpoint()
            if stopped_early or step >= total_steps:
                break
            t0 = time.perf_counter()
        batches.close()  # type: ignore[attr-defined]
        if epoch_batches >= steps_per_epoch or step >= total_steps:
            if not (config.validate_every and step % config.validate_every == 0):
                val_metrics = validate()
                if config.target_auc is not None and val_metrics["auc"] >= config.target_auc:
                    stopped_early = True
            if step < total_steps and not stopped_early:
                epoch += 1
                train_loader.set_epoch(epoch)
                epoch_batches = 0
    bar.close()
    elapsed = time.perf_counter() - started
    if step > start_step and not (config.save_every and step % config.save_every == 0):
        checkpoint()
    if val_metrics is None:
        val_metrics = validate()
    busy = sum(phase_s.values()) or 1.0
    summary = {
        "event": "summary",
        "steps": step,
        "trained_steps": step - start_step,
        "world_size": world_size,
        "global_batch": global_batch,
        "samples_per_s": (step - start_step) * global_batch / elapsed if elapsed > 0 else 0.0,
        "seconds": elapsed,
        "phase_fraction": {k: v / busy for k, v in phase_s.items()},
        "peak_memory_mb_per_rank": _gather(round(_peak_memory_mb(device), 1)),
        "stopped_early": stopped_early,
        "validation": val_metrics,
        "teacher_auc": spec.parameters.get("teacher_auc"),
        "checkpoint": str(latest_checkpoint(ckpt_dir)) if rank == 0 else None,
    }
    log.write(summary)
    log.close()
    return summary


def config_from_args(args: Any) -> TrainConfig:
    """The CLI namespace -> TrainConfig (flags named as the fields)."""
    model = ModelConfig(
        embedding_dim=args.embedding_dim,
        dense_arch_layer_sizes=tuple(args.dense_arch_layer_sizes),
        over_arch_layer_sizes=tuple(args.over_arch_layer_sizes),
        interaction=Interaction(args.interaction),
        dcn_num_layers=args.dcn_num_layers,
        dcn_low_rank_dim=args.dcn_low_rank_dim,
    )
    fields = {f.name for f in dataclasses.fields(TrainConfig)} - {"model"}
    values = {name: getattr(args, name) for name in fields if hasattr(args, name)}
    values["embedding_optimizer"] = EmbeddingOptimizer(values["embedding_optimizer"])
    values["dense_optimizer"] = DenseOptimizer(values["dense_optimizer"])
    return TrainConfig(model=model, **values)

