"""Table-batched embedding kernels: one small interface, two implementations.

``build_table_batched_embedding`` picks FBGEMM where it has a kernel for the device and
optimizer, else the pure-torch kernel with the same numerics. ``checked_lookup`` turns any
kernel's anonymous out-of-range failure into an error that names the feature and the id.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import nn

from recsys_core.kernels._fbgemm import fbgemm_status, fbgemm_supports
from recsys_core.kernels.cached_tbe import CachedTableBatchedEmbedding, TableCache
from recsys_core.kernels.config import FusedOptimizerConfig, KernelBackend
from recsys_core.kernels.fbgemm_tbe import FBGEMM_OPTIMIZERS, FbgemmTableBatchedEmbedding
from recsys_core.kernels.id_check import IdOutOfRangeError as IdOutOfRangeError
from recsys_core.kernels.id_check import describe_bad_ids as describe_bad_ids
from recsys_core.kernels.torch_tbe import TorchTableBatchedEmbedding


class TableBatchedKernel(Protocol):
    """What a sharded or fused collection needs from a table-batched kernel."""

    optimizer: FusedOptimizerConfig

    def __call__(
        self,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def split_embedding_weights(self) -> list[torch.Tensor]: ...

    def split_optimizer_states(self) -> list[dict[str, torch.Tensor]]: ...

    def set_learning_rate(self, lr: float) -> None: ...

    def get_learning_rate(self) -> float: ...


def fbgemm_missing(
    device: torch.device,
    optimizer: FusedOptimizerConfig,
    dims: Sequence[int] = (),
    weighted_mean: bool = False,
    feature_table_map: Sequence[int] = (),
) -> str | None:
    """Why FBGEMM cannot run these tables exactly, or None if it can."""
    if not fbgemm_supports(device):
        status = fbgemm_status()
        return status if status != "ok" else f"FBGEMM has no kernels for {device.type} tensors"
    opt = optimizer.optimizer.canonical
    if opt not in FBGEMM_OPTIMIZERS.get(device.type, frozenset()):
        return f"FBGEMM has no {opt.name} kernel on {device.type}"
    if device.type == "cpu" and optimizer.weight_decay > 0:
        # Measured: FBGEMM 1.8's CPU row-wise Adagrad ignores weight_decay in every mode.
        return "FBGEMM's CPU kernels ignore weight_decay"
    if device.type == "cpu" and weighted_mean:
        # Measured: FBGEMM 1.8's CPU backward for weighted MEAN pooling omits the 1/length
        # factor that its forward applies, so its gradient does not match its output.
        return "FBGEMM's CPU weighted MEAN backward is inconsistent with its forward"
    bad_dims = sorted({d for d in dims if d % 4})
    if bad_dims:
        return f"FBGEMM needs embedding_dim % 4 == 0, got {bad_dims}"
    if not _features_grouped_by_table(feature_table_map):
        # Measured: FBGEMM 1.8's CPU exact Adagrad updates a row once per run of adjacent
        # features, so a table whose features are not adjacent gets a wrong update.
        return "FBGEMM needs each table's features adjacent in feature_table_map"
    return None


def _features_grouped_by_table(feature_table_map: Sequence[int]) -> bool:
    seen: set[int] = set()
    previous = None
    for t in feature_table_map:
        if t != previous:
            if t in seen:
                return False
            seen.add(t)
            previous = t
    return True


def select_backend(
    requested: KernelBackend,
    device: torch.device,
    optimizer: FusedOptimizerConfig,
    dims: Sequence[int] = (),
    weighted_mean: bool = False,
    feature_table_map: Sequence[int] = (),
) -> KernelBackend:
    """Resolve AUTO; refuse an explicit FBGEMM request that cannot be honoured."""
    if requested is KernelBackend.TORCH:
        return requested
    why = fbgemm_missing(device, optimizer, dims, weighted_mean, feature_table_map)
    if why is None:
        return KernelBackend.FBGEMM
    if requested is KernelBackend.FBGEMM:
        raise ValueError(
            f"backend FBGEMM requested but unavailable: {why}; use KernelBackend.AUTO to fall "
            "back to the torch kernel (same numerics)"
        )
    return KernelBackend.TORCH


def build_table_batched_embedding(
    *,
    rows: Sequence[int],
    dims: Sequence[int],
    feature_table_map: Sequence[int],
    pooling_mean: bool,
    optimizer: FusedOptimizerConfig,
    device: torch.device,
    backend: KernelBackend = KernelBackend.AUTO,
    weighted: bool = False,
    caches: Sequence[TableCache | None] = (),
    offload_dir: str | None = None,
    table_names: Sequence[str] | None = None,
    weights_dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """A kernel module (FBGEMM or torch) holding ``len(rows)`` tables, zero-initialized.

    ``weighted`` says whether per-sample weights will be passed (it matters for the choice).
    ``caches`` (per table, None for an uncached one) puts tables in a slower tier behind a cache:
    FBGEMM's UVM caching where FBGEMM has CUDA kernels for these tables, else
    :class:`CachedTableBatchedEmbedding` (backing files under ``offload_dir`` on CPU).
    ``weights_dtype``: float32 or float16 weights (a kernel with cached tables is float32).
    """
    if weights_dtype != torch.float32 and any(c is not None for c in caches):
        raise ValueError("build_table_batched_embedding: cached tables are kept in float32; "
                         f"pass weights_dtype=torch.float32, not {weights_dtype}")
    chosen = select_backend(
        backend, device, optimizer, dims, weighted and pooling_mean, feature_table_map
    )
    cls = FbgemmTableBatchedEmbedding if chosen is KernelBackend.FBGEMM else TorchTableBatchedEmbedding

    def build(table_rows: Sequence[int], **extra: object) -> nn.Module:
        return cls(
            rows=table_rows,
            dims=dims,
            feature_table_map=feature_table_map,
            pooling_mean=pooling_mean,
            optimizer=optimizer,
            device=device,
            weights_dtype=weights_dtype,
            **extra,
        )

    if not any(c is not None for c in caches):
        return build(rows)
    if chosen is KernelBackend.FBGEMM and device.type == "cuda":
        cached = [c for c in caches if c is not None]
        cached_rows = sum(r for r, c in zip(rows, caches, strict=True) if c is not None)
        return build(
            rows,
            managed_caching=[c is not None for c in caches],
            cache_load_factor=sum(c.slots for c in cached) / max(cached_rows, 1),
            cache_algorithm=cached[0].algorithm,
        )
    return CachedTableBatchedEmbedding(
        rows=rows,
        dims=dims,
        feature_table_map=feature_table_map,
        optimizer=optimizer,
        caches=caches,
        device=device,
        inner_factory=build,
        offload_dir=offload_dir,
        table_names=table_names,
    )


def kernel_backend(kernel: nn.Module) -> KernelBackend:
    if isinstance(kernel, CachedTableBatchedEmbedding):
        kernel = kernel.inner
    if isinstance(kernel, FbgemmTableBatchedEmbedding):
        return KernelBackend.FBGEMM
    return KernelBackend.TORCH


def checked_lookup(
    kernel: TableBatchedKernel,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    *,
    feature_names: Sequence[str],
    rows_per_feature: Sequence[int],
) -> torch.Tensor:
    """Run the kernel; if it rejects an id, raise :class:`IdOutOfRangeError` saying which.

    The check costs nothing on the good path: FBGEMM's FATAL bounds check (or torch's own) does
    the work, and only a failure pays for the diagnosis.
    """
    try:
        return kernel(indices, offsets, per_sample_weights)
    except (RuntimeError, IndexError) as exc:
        message = describe_bad_ids(indices, offsets, feature_names, rows_per_feature)
        if message is None:
            raise
        raise IdOutOfRangeError(message) from exc
