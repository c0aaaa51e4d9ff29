"""FBGEMM ``SplitTableBatchedEmbeddingBagsCodegen`` behind the same small interface as the torch
fallback (``forward``, ``split_embedding_weights``, ``split_optimizer_states``, learning rate)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from torch import nn

from recsys_core.kernels._fbgemm import fbgemm_optim_type, fbgemm_sparse_type, tbe_training_module
from recsys_core.kernels.config import EmbOptimType, FusedOptimizerConfig

# Optimizers with an FBGEMM kernel, per device type (FBGEMM 1.8; the CPU build refuses the rest).
FBGEMM_OPTIMIZERS: dict[str, frozenset[EmbOptimType]] = {
    "cpu": frozenset(
        {EmbOptimType.EXACT_SGD, EmbOptimType.EXACT_ADAGRAD, EmbOptimType.EXACT_ROWWISE_ADAGRAD}
    ),
    "cuda": frozenset(m.canonical for m in EmbOptimType),
}


class FbgemmTableBatchedEmbedding(nn.Module):
    """All tables in one FBGEMM TBE; ids are bounds-checked in FATAL mode (never clamped)."""

    def __init__(
        self,
        *,
        rows: Sequence[int],
        dims: Sequence[int],
        feature_table_map: Sequence[int],
        pooling_mean: bool,
        optimizer: FusedOptimizerConfig,
        device: torch.device,
        managed_caching: Sequence[bool] = (),
        cache_load_factor: float = 0.2,
        cache_algorithm: str = "lru",
        weights_dtype: torch.dtype = torch.float32,
    ) -> None:
        """``managed_caching`` (CUDA only): per table, keep it in UVM behind FBGEMM's device
        cache of ``cache_load_factor`` of the cached tables' rows (FBGEMM has one cache per
        kernel), evicting by ``cache_algorithm``. ``weights_dtype``: float32 or float16 weights
        (FBGEMM's ``weights_precision``); outputs are float32 either way."""
        super().__init__()
        tbe = tbe_training_module()
        on_cuda = device.type == "cuda"
        location = tbe.EmbeddingLocation.DEVICE if on_cuda else tbe.EmbeddingLocation.HOST
        compute = tbe.ComputeDevice.CUDA if on_cuda else tbe.ComputeDevice.CPU
        caching = list(managed_caching) or [False] * len(rows)
        if any(caching) and not on_cuda:
            raise ValueError("FBGEMM's managed (UVM) caching needs CUDA tables")
        locations = [
            tbe.EmbeddingLocation.MANAGED_CACHING if c else location for c in caching
        ]
        cache_kwargs = {}
        if any(caching):
            cache_kwargs = {
                "cache_load_factor": float(cache_load_factor),
                "cache_algorithm": getattr(tbe.CacheAlgorithm, cache_algorithm.upper()),
            }
        cfg = optimizer
        fbgemm_optim = fbgemm_optim_type(cfg.optimizer.canonical.value)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            emb_module = tbe.SplitTableBatchedEmbeddingBagsCodegen(
                [(r, d, loc, compute) for r, d, loc in zip(rows, dims, locations, strict=True)],
                feature_table_map=list(feature_table_map),
                optimizer=fbgemm_optim,
                learning_rate=cfg.learning_rate,
                eps=cfg.eps,
                beta1=cfg.beta1,
                beta2=cfg.beta2,
                weight_decay=cfg.weight_decay,
                weight_decay_mode=tbe.WeightDecayMode(cfg.weight_decay_mode.value),
                pooling_mode=tbe.PoolingMode.MEAN if pooling_mean else tbe.PoolingMode.SUM,
                bounds_check_mode=tbe.BoundsCheckMode.FATAL,
                weights_precision=fbgemm_sparse_type(weights_dtype),
                output_dtype=fbgemm_sparse_type(torch.float32),
                stochastic_rounding=False,
                device=device,
                **cache_kwargs,
            )
        # Held outside ``_modules``: FBGEMM registers its storage as Parameters, which would show
        # up in ``model.parameters()`` and ``state_dict()`` beside the per-table weight views the
        # collection exposes. The kernel lives on its construction device; train() is forwarded.
        object.__setattr__(self, "_emb_module", emb_module)
        self.optimizer = optimizer
        self.managed_caching = any(caching)
        self._state_names = optimizer.optimizer.state_names

    def train(self, mode: bool = True) -> FbgemmTableBatchedEmbedding:
        super().train(mode)
        self._emb_module.train(mode)
        return self

    def forward(
        self,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self._emb_module(indices, offsets, per_sample_weights)

    def split_embedding_weights(self) -> list[torch.Tensor]:
        """Per table a view of its weights; for a managed-caching table, of the UVM copy, which
        is current only after :meth:`flush` (FBGEMM's cache holds trained rows until then)."""
        return list(self._emb_module.split_embedding_weights())

    def flush(self) -> None:
        """Write the rows trained in FBGEMM's device cache back to UVM (managed caching)."""
        if self.managed_caching:
            self._emb_module.flush()

    def invalidate(self) -> None:
        """After the UVM weights were written from outside (a checkpoint load): write back what
        the cache trained, then forget its rows so that lookups read UVM again."""
        if self.managed_caching:
            self._emb_module.flush()
            self._emb_module.reset_cache_states()

    def split_optimizer_states(self) -> list[dict[str, torch.Tensor]]:
        if not self._state_names:
            return [{} for _ in self._emb_module.embedding_specs]
        return [
            dict(zip(self._state_names, states, strict=True))
            for states in self._emb_module.split_optimizer_states()
        ]

    def set_learning_rate(self, lr: float) -> None:
        self._emb_module.set_learning_rate(float(lr))

    def get_learning_rate(self) -> float:
        return float(self._emb_module.get_learning_rate())

    @property
    def iter(self) -> torch.Tensor:
        return self._emb_module.iter
