"""The DENSE compute kernel: a shard's weights are ``nn.Parameter`` s with gradients.

TorchRec's ``BatchedDenseEmbeddingBag``: nothing is fused into backward. ``loss.backward()``
fills each shard's ``.grad`` (through the collectives, like any other parameter), and an
optimizer outside the module steps it, e.g. the dense optimizer of a training loop::

    dense_opt = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: torch.optim.SGD(params, lr=0.1))

A data-parallel DENSE table is a replica per rank; ``DistributedModelParallel`` puts its
weights into the DistributedDataParallel of the dense part, which averages their gradients
over ranks (used standalone, a sharded module leaves that to the caller, as TorchRec's).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn


class DenseTableBatchedEmbedding(nn.Module):
    """Tables as parameters; ``forward(indices, offsets, per_sample_weights)`` ->
    ``[B, sum of the features' dims]`` (``offsets`` feature-major, ``F * B + 1`` long: a KJT's).

    Example: tables of 3 x 2 and 4 x 1 rows, features ``(f0 -> table 0, f1 -> table 1)``, batch
    2, ids ``f0: [0, 2] | [1]``, ``f1: [] | [3]``: offsets ``[0, 2, 3, 3, 4]``, output row 0 is
    ``[w0[0] + w0[2], 0]``, row 1 ``[w0[1], w1[3]]`` (MEAN divides each bag by its length).
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
        self.replicated = False
        """A data-parallel replica (set by its strategy)."""
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
        num_features = len(self.feature_table_map)
        batch = (offsets.numel() - 1) // max(num_features, 1)
        starts = offsets[::batch].tolist() if batch > 0 else [0] * (num_features + 1)
        outs = []
        for f, t in enumerate(self.feature_table_map):
            lo, hi = int(starts[f]), int(starts[f + 1])
            bags = offsets[f * batch : (f + 1) * batch + 1] - lo
            weight = self.weights[t]
            sample_weights = None
            if per_sample_weights is not None:  # must match the table's dtype (FP16 tables)
                sample_weights = per_sample_weights[lo:hi].to(weight.dtype)
            out = nn.functional.embedding_bag(
                indices[lo:hi].long(),
                weight,
                bags.long(),
                mode="sum",
                per_sample_weights=sample_weights,
                include_last_offset=True,
            ).float()
            if self.pooling_mean:
                out = out / bags.diff().clamp(min=1).unsqueeze(1).to(out.dtype)
            outs.append(out)
        if not outs:
            return torch.zeros(batch, 0, device=offsets.device)
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def data_parallel_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The weights of ``module``'s data-parallel DENSE tables (replicas whose gradients must
    be averaged over ranks, as DDP does for the dense part)."""
    return [
        p for sub in module.modules()
        if isinstance(sub, DenseTableBatchedEmbedding) and sub.replicated
        for p in sub.parameters()
    ]
