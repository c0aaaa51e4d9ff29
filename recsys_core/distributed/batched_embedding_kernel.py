"""The DENSE compute kernel: a shard's weights are ``nn.Parameter`` s with gradients.

TorchRec's ``BatchedDenseEmbeddingBag``: nothing is fused into backward. ``loss.backward()``
fills each shard's ``.grad`` (through the collectives, like any other parameter), and an
optimizer outside the module steps it, e.g. the dense optimizer of a training loop::

    dense_opt = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: torch.optim.SGD(params, lr=0.1))

A data-parallel DENSE table is a replica per rank; its strategy
(``sharding.dense_data_parallel``) sums the replicas' gradients over the ranks at the end of
each backward (their mean under gradient division, as TorchRec's per-lookup DDP gives).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from recsys_core.kernels.packed import PackedKernelSpec
from recsys_core.kernels.torch_tbe import pooled_lookup


class DenseTableBatchedEmbedding(nn.Module):
    """Tables as parameters; ``forward(indices, offsets, per_sample_weights)`` ->
    ``[B, sum of the features' dims]`` (``offsets`` feature-major, ``F * B + 1`` long: a KJT's).

    The lookup is :func:`~recsys_core.kernels.torch_tbe.pooled_lookup` (its docstring has an
    example); gradients flow to the weights through autograd.
    """

    def __init__(
        self,
        *,
        rows: Sequence[int],
        dims: Sequence[int],
        feature_table_map: Sequence[int],
        pooling_mean: bool,
        device: torch.device,
        dtypes: Sequence[torch.dtype] | None = None,
    ) -> None:
        """``dtypes``: each table's weight dtype (default float32); TorchRec keeps an FP16
        table's DENSE weights in float16 (its ``weights_precision``), the output is float32."""
        super().__init__()
        self.rows, self.dims = list(rows), list(dims)
        self.feature_table_map = list(feature_table_map)
        self.pooling_mean = pooling_mean
        dtypes = [torch.float32] * len(self.rows) if dtypes is None else list(dtypes)
        for t, (r, d, dt) in enumerate(zip(rows, dims, dtypes, strict=True)):
            self.register_parameter(
                f"weight_{t}", nn.Parameter(torch.zeros(r, d, device=device, dtype=dt))
            )

    @property
    def weights(self) -> list[nn.Parameter]:
        """Each table's weight parameter, in table order."""
        return [getattr(self, f"weight_{t}") for t in range(len(self.rows))]

    # The collection's state dict holds whole tables (``embedding_bags.<table>.weight``), not
    # the kernels' parameters: they are saved and loaded through those.
    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        return None

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        return None

    def split_embedding_weights(self) -> list[torch.Tensor]:
        """Each table's weight (the parameter's data: writes go into the parameter)."""
        return [w.detach() for w in self.weights]

    def split_optimizer_states(self) -> list[dict[str, torch.Tensor]]:
        """No optimizer state lives in the kernel (the optimizer outside holds it)."""
        return [{} for _ in self.weights]

    def forward(
        self,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return pooled_lookup(
            indices, offsets, self.weights, self.feature_table_map, self.pooling_mean,
            per_sample_weights,
        )


def dense_kernel_builder(
    dtypes: Mapping[str, torch.dtype],
) -> Callable[[PackedKernelSpec, torch.device], DenseTableBatchedEmbedding]:
    """A ``BatchedTables`` builder of DENSE kernels for a spec's tables (its optimizer and
    backend are not used: nothing is fused); ``dtypes``: each table's weight dtype by name."""

    def build(spec: PackedKernelSpec, device: torch.device) -> DenseTableBatchedEmbedding:
        return DenseTableBatchedEmbedding(
            rows=[max(t.rows, 1) for t in spec.tables],
            dims=[t.dim for t in spec.tables],
            feature_table_map=list(spec.feature_table_map),
            pooling_mean=spec.pooling_mean,
            device=device,
            dtypes=[dtypes[t.name] for t in spec.tables],
        )

    return build

