"""The sharded DLRM and its optimizers, built the same way by ``train``, ``evaluate`` and the
benchmarks.

Initialization is independent of the plan: tables from (seed, table, row block), dense layers
from ``torch.manual_seed(seed)`` after sharding, drawn on the CPU whatever the device
(one seed, one initial model on a CPU and a GPU). Dense gradients are summed over ranks by a DDP
comm hook (the default averages), as the embedding gradients are; see ``dlrm_app.training.trainer``.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dlrm_app.config import ModelConfig
from dlrm_app.data.schema import DatasetSpec
from dlrm_app.model import Interaction, WideBagCollection, build_dlrm, table_initializer
from dlrm_app.training.config import (
    CommPrecision,
    DenseOptimizer,
    EmbeddingOptimizer,
    OptimizerConfig,
    ParallelConfig,
    TrainConfig,
)
from dlrm_app.training.resources import (
    planning_error_for_user,
    table_memory_bytes,
    topology_for_run,
)
from dlrm_app.training.runtime import amp_enabled
from recsys_core.distributed import (
    DistributedModelParallel,
    EmbeddingBagCollectionSharder,
    ShardingEnv,
    ShardingPlan,
    shm_comm,
)
from recsys_core.distributed.comm_ops import set_gradient_division
from recsys_core.distributed.embeddingbag import ShardedEmbeddingBagCollection
from recsys_core.distributed.fbgemm_qcomm_codec import (
    CommOp,
    CommType,
    QCommsConfig,
    get_qcomm_codecs_registry,
)
from recsys_core.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
from recsys_core.distributed.types import QuantizedCommCodecs
from recsys_core.kernels.config import EmbOptimType, FusedOptimizerConfig
from recsys_core.modules.embedding_modules import EmbeddingBagCollection
from recsys_core.optim import CombinedOptimizer, KeyedOptimizerWrapper, in_backward_optimizer_filter
from recsys_core.planner import ParameterConstraints, PlannerError, plan_for_env
from recsys_core.planner.constants import BATCH_SIZE


def fused_optimizer(config: OptimizerConfig) -> FusedOptimizerConfig:
    """The tables' optimizer, typed from the flags to the kernel: ``--embedding-optimizer``,
    ``--embedding-learning-rate`` and ``--embedding-eps``."""
    return FusedOptimizerConfig(optimizer=EmbOptimType[config.embedding_optimizer.kernel],
                                learning_rate=config.embedding_learning_rate,
                                eps=config.embedding_eps)


REPLICATE_COLLECTION_BYTES = 4 * 1024**2
"""On several ranks of one CPU host, an embedding collection whose tables take at most this many
bytes in all (weights and fused optimizer state) is replicated on every rank: see
:func:`replicated_collections`."""
REPLICATE_MEMORY_FRACTION = 0.01
"""... as long as the replicas take at most this fraction of a rank's memory."""


def collection_bytes(collection: EmbeddingBagCollection, optimizer: EmbeddingOptimizer) -> int:
    """Bytes of a collection's fp32 weights and its fused optimizer's state
    (:func:`dlrm_app.training.resources.table_memory_bytes` of each table)."""
    return sum(table_memory_bytes([c.num_embeddings], c.embedding_dim, optimizer)
               for c in collection.embedding_bag_configs())


def replicated_collections(model: nn.Module, env: ShardingEnv, device: torch.device,
                           optimizer: EmbeddingOptimizer, memory_per_rank: float,
                           ) -> dict[str, ParameterConstraints]:
    """Planner constraints that make the DLRM's small collections data-parallel.

    This applies to the embeddings and the wide part, on several ranks of one CPU host. A
    collection of at most REPLICATE_COLLECTION_BYTES gets a full replica on every rank, and so
    does no exchange of ids or pooled embeddings at all. Each backward then does one exchange of
    its tables' touched rows' gradients. The planner's cost model counts bytes and prefers to
    spread such tables table-wise; at small batches a step is then bound by the ranks waiting
    on each other in every collective, not by bytes. Measured at 2 ranks on a 2-core EPYC:
    Kaggle sample (64 rows per rank), 5.9k -> 8.1k samples/s; MovieLens 100K, 51-54k -> 66k;
    the demo's data (26 tables of 1,000 rows, 1,024 rows per rank), level (40.9k and 40.7k).
    Collections are replicated in that order while the replicas take at most
    REPLICATE_MEMORY_FRACTION of ``memory_per_rank`` (bytes), so that where memory is tight the
    planner keeps its freedom to spread them. Tables of raw ids (zero-collision hashing) keep
    their row-wise plan. ``--plan`` overrides this."""
    if env.world_size == 1 or device.type != "cpu" or env.num_hosts > 1:
        return {}
    constraints, replicated = {}, 0
    for collection in (model.sparse_arch.embedding_bag_collection,
                       None if model.wide is None else model.wide.tables):
        if collection is None:
            continue
        size = collection_bytes(collection, optimizer)
        if size > REPLICATE_COLLECTION_BYTES or \
                replicated + size > REPLICATE_MEMORY_FRACTION * memory_per_rank:
            continue
        replicated += size
        constraints.update((c.name, ParameterConstraints(sharding_types=["data_parallel"]))
                           for c in collection.embedding_bag_configs())
    return constraints


def _sum_allreduce_hook(group, bucket):  # type: ignore[no-untyped-def]
    """DDP comm hook: sum gradients over ranks (the default averages); see the module docs.

    Unannotated on purpose: DDP rejects annotations that are not literally ``dist.GradBucket``,
    and ``from __future__ import annotations`` turns them into strings. Ranks on one host sum
    through shared memory (``recsys_core.distributed.shm_comm``), others through gloo/NCCL."""
    shm = shm_comm.for_group(group, bucket.buffer().device)
    if shm is not None and bucket.buffer().is_contiguous():
        return shm.all_reduce_future(bucket.buffer())
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


class WideSharder(EmbeddingBagCollectionSharder):
    """Shards the wide part's :class:`WideBagCollection` as the embeddings' sharder does, with
    no ``qcomm_codecs_registry``: its dim-1 sums stay fp32 on the wire."""

    @property
    def module_type(self) -> type[nn.Module]:
        return WideBagCollection


def _existing_ancestor(path: Path) -> Path:
    for candidate in (path, *path.parents):
        if candidate.is_dir():
            return candidate
    return Path.cwd()


def comm_precision(config: ParallelConfig, model: ModelConfig, device: torch.device,
                   hosts: int) -> CommPrecision:
    """``--comm-precision`` resolved (see the field). auto is bf16 only where that changes no
    value (the dot interaction under autocast rounds the pooled embeddings to bf16 anyway, and
    their gradients come from its bf16 products) and where it pays: across hosts. On one host
    the exchange goes over loopback or shared memory, the fastest transport there is, and the
    four extra casts per step cost what the halved bytes save (measured: 2 ranks on one host,
    bf16 comms 0.95x of fp32's samples/s, within noise)."""
    if config.comm_precision is not CommPrecision.AUTO:
        return config.comm_precision
    lossless = amp_enabled(device, config.amp) and model.interaction is Interaction.DOT
    return CommPrecision.BF16 if lossless and hosts > 1 else CommPrecision.FP32


def world_hosts() -> int:
    """Hosts the ranks of this process group span (1 outside ``torch.distributed``)."""
    if not dist.is_initialized():
        return 1
    return ShardingEnv.from_process_group(dist.GroupMember.WORLD).num_hosts


def comm_codecs(precision: CommPrecision) -> dict[str, QuantizedCommCodecs] | None:
    """The sharder's ``qcomm_codecs_registry`` for a resolved precision (None: fp32): the
    all-to-all of finished pooled embeddings (and of their gradients) in that precision. The
    reduce-scatter that sums row-wise tables' partial results stays fp32: summing rounded
    partials would change values that rounding the finished sum does not."""
    comm_type = {CommPrecision.FP32: CommType.FP32, CommPrecision.BF16: CommType.BF16,
                 CommPrecision.FP16: CommType.FP16}[precision]
    return get_qcomm_codecs_registry(
        QCommsConfig(forward_precision=comm_type, backward_precision=comm_type),
        comm_ops=[CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL])


def build_model(config: TrainConfig, spec: DatasetSpec, device: torch.device,
                batch_size: int | None = None) -> DistributedModelParallel:
    """The DLRM sharded over the world (plan from ``config.parallel.plan`` or the planner),
    initialized from ``config.seed`` the same way for any plan. The planner sizes traffic and
    caches for ``batch_size`` rows per rank (None: ``config.schedule.batch_size``; where that is
    not decided yet, the planner's default, TorchRec's 512)."""
    plan = None
    if config.parallel.plan:
        try:
            plan = ShardingPlan.from_json(Path(config.parallel.plan).read_text())
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"--plan {config.parallel.plan}: cannot read a sharding plan ({e}); "
                             "pass a "
                             f"plan.json written by an earlier run") from None
    offload_dir = None
    if config.parallel.offload:
        offload_dir = (Path(config.parallel.offload_dir) if config.parallel.offload_dir
                       else Path(config.out) / "offload")
    env = (ShardingEnv.from_process_group(dist.GroupMember.WORLD) if dist.is_initialized()
           else ShardingEnv.from_local(1, 0))
    tables = {"fused_params": fused_optimizer(config.optimizer),
              "table_init": table_initializer(config.seed),
              "offload_dir": None if offload_dir is None else str(offload_dir)}
    precision = comm_precision(config.parallel, config.model, device, env.num_hosts)
    sharder = EmbeddingBagCollectionSharder(qcomm_codecs_registry=comm_codecs(precision), **tables)
    # the wide part's tables first (DMP takes the first sharder whose type matches): the
    # same layouts and optimizer, their pooled sums always exchanged in fp32
    sharders: list[Any] = [WideSharder(**tables), sharder]
    if any(f.raw_ids for f in spec.sparse_features):
        # the raw-id tables: row-wise, in memory (--zch-rows sizes them), ids routed to the
        # rank that owns their rows
        sharders.append(ManagedCollisionEmbeddingBagCollectionSharder(sharder))
    model = build_dlrm(spec, config.model, device="meta")
    if plan is None:
        # the disk free where the files would go (the directory is made only when needed)
        disk = None if offload_dir is None else _existing_ancestor(offload_dir)
        topology = topology_for_run(env.world_size, env.local_world_size, device,
                                    config.parallel.memory_per_rank, disk)
        try:
            constraints = replicated_collections(
                model, env, device, config.optimizer.embedding_optimizer,
                topology.ddr_per_rank)
            plan = plan_for_env(model, env, sharders, device, topology=topology,
                                batch_size=batch_size or config.schedule.batch_size or BATCH_SIZE,
                                constraints=constraints or None)
        except PlannerError as e:
            raise planning_error_for_user(e, config.parallel.offload,
                                          config.parallel.memory_per_rank) from None
    if offload_dir is not None and any(
            ps.compute_kernel == "fused_uvm_caching"
            for module in plan.plan.values() for ps in module.values()):
        try:
            offload_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"--offload-dir {offload_dir}: cannot create the directory for the "
                             f"tables kept on disk ({e.strerror}); pass a writable directory on a "
                             "local disk") from None
    dmp = DistributedModelParallel(model, device=device, env=env, plan=plan, sharders=sharders)
    torch.manual_seed(config.seed)
    for module in dmp.module.modules():
        if not isinstance(module, ShardedEmbeddingBagCollection) and hasattr(module, "reset_parameters"):
            reset_on_cpu(module)
    # Each rank's loss is its rows' summed loss over the GLOBAL batch (train.py), so gradients
    # are summed over ranks, not averaged: the embedding collectives without TorchRec's gradient
    # division, the dense part through a summing DDP hook.
    set_gradient_division(False)
    ddp = dmp.data_parallel
    if ddp is not None:
        ddp.register_comm_hook(dmp.env.pg, _sum_allreduce_hook)
    return dmp


def reset_on_cpu(module: nn.Module) -> None:
    """``module.reset_parameters()`` drawn from the CPU's generator wherever the module lives,
    so that one seed gives one initial model on a CPU and on a GPU (CUDA's generator draws
    other numbers): a CPU twin of the layer is reset and its values copied into the module's
    own tensors (the parameter objects stay the ones DDP and the optimizers hold; on a CPU the
    same numbers as resetting in place). A module with submodules is reset where it is (the
    dense layers are leaves)."""
    if next(module.children(), None) is not None:
        module.reset_parameters()  # type: ignore[operator]
        return
    twin = copy.deepcopy(module).to("cpu")
    twin.reset_parameters()  # type: ignore[operator]
    drawn = dict(twin.named_parameters(recurse=False)) | dict(twin.named_buffers(recurse=False))
    with torch.no_grad():
        for name, tensor in [*module.named_parameters(recurse=False),
                             *module.named_buffers(recurse=False)]:
            tensor.copy_(drawn[name])


def plan_summary(plan: ShardingPlan, world_size: int) -> str:
    """The plan in one line for the console (the per-table tables are in RUN/plan.json and the
    report), e.g. ``plan: 26 tables on 2 ranks: 20 table_wise/fused, 6 row_wise/fused``."""
    kinds: dict[str, int] = {}
    for module in plan.plan.values():
        for ps in module.values():
            kind = f"{ps.sharding_type.value}/{ps.compute_kernel.value}"
            kinds[kind] = kinds.get(kind, 0) + 1
    tables = sum(kinds.values())
    parts = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items(), key=lambda kv: -kv[1]))
    return (f"plan: {tables} table{'s' * (tables != 1)} on {world_size} "
            f"rank{'s' * (world_size != 1)}: {parts}")


def build_optimizer(config: OptimizerConfig, dmp: DistributedModelParallel) -> CombinedOptimizer:
    """Fused table optimizer (already applied in backward) + the dense optimizer, combined."""
    dense_params = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    # fused=True: one kernel over all parameters (CPU and CUDA); on a CPU Adagrad's step over
    # the reference MLPs' 2.7M parameters takes 0.8 ms instead of 2.4 ms (per-tensor loop) or
    # 10.5 ms (foreach), Adam's 1.2 ms instead of 6.7 ms, with the same values to fp32 rounding
    if config.dense_optimizer is DenseOptimizer.SGD:
        def factory(ps: Any) -> torch.optim.Optimizer:
            return torch.optim.SGD(ps, lr=config.learning_rate, fused=True)
    elif config.dense_optimizer is DenseOptimizer.ADAGRAD:
        def factory(ps: Any) -> torch.optim.Optimizer:
            return torch.optim.Adagrad(ps, lr=config.learning_rate, eps=config.eps, fused=True)
    else:
        def factory(ps: Any) -> torch.optim.Optimizer:
            return torch.optim.Adam(ps, lr=config.learning_rate, eps=config.eps, fused=True)
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
