"""Input distribution: sparse features (KJT pieces) all-to-all between ranks.

Every rank sends, to each destination, the bags that the destination's shards must look up
(whole bags for table/column-wise shards, row-bucketed bags for row-wise shards). Three steps:

    1. split sizes      (W x 2 ints: lengths and values per destination)
    2. lengths, values (and weights), uneven splits, asynchronously
    3. on arrival: reorder source-major -> feature-major, so the result is one KJT over the
       global batch (source rank 0's samples first), ready for the table-batched kernel.

Example, 2 ranks, batch 2 each, destination rank 0 looks up feature "f":

    from rank 0: f lengths [1, 2]    from rank 1: f lengths [0, 1]
    result on rank 0: KJT keys ["f"], lengths [1, 2, 0, 1] (stride 4)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from recsys_core.distributed.awaitable import Awaitable
from recsys_core.distributed.comm import TensorAllToAll
from recsys_core.kernels import sparse_ops
from recsys_core.sparse import KeyedJaggedTensor


class SparseFeaturesAllToAll(Awaitable[KeyedJaggedTensor]):
    """Sends per-destination jagged pieces; ``wait()`` returns this rank's feature-major KJT.

    Args:
        lengths: concatenation over destinations of each destination's ``[k_d * B]`` lengths
            (feature-major within a destination).
        values / weights: the matching values (and optional weights), destination-major.
        lengths_per_dest / values_per_dest: split sizes of ``lengths`` / ``values``.
        recv_keys: the features this rank receives, in the order each source sends them.
        batch_size: the local batch size (every rank must use the same one).
    """

    def __init__(
        self,
        lengths: torch.Tensor,
        values: torch.Tensor,
        weights: torch.Tensor | None,
        lengths_per_dest: Sequence[int],
        values_per_dest: Sequence[int],
        recv_keys: Sequence[str],
        batch_size: int,
        group: dist.ProcessGroup | None,
        world_size: int,
    ) -> None:
        super().__init__()
        self._group, self._world = group, world_size
        self._keys, self._batch = list(recv_keys), batch_size
        self._lengths, self._values, self._weights = lengths, values, weights
        self._send_lengths, self._send_values = list(lengths_per_dest), list(values_per_dest)
        sizes = torch.tensor([self._send_lengths, self._send_values], dtype=torch.int64).t()
        self._splits = TensorAllToAll(
            sizes.reshape(-1), [2] * world_size, [2] * world_size, group
        )

    def _wait_impl(self) -> KeyedJaggedTensor:
        recv = self._splits.wait().view(self._world, 2).tolist()
        recv_lengths = [n for n, _ in recv]
        recv_values = [n for _, n in recv]
        k = len(self._keys)
        expected = k * self._batch
        for src, n in enumerate(recv_lengths):
            if n != expected:
                raise ValueError(
                    f"sharded input dist: rank {src} sent {n} lengths for {k} feature(s), "
                    f"expected {expected} (batch size {self._batch}); every rank must use the "
                    "same batch size (drop the last partial batch)"
                )
        lengths = TensorAllToAll(self._lengths, self._send_lengths, recv_lengths, self._group)
        values = TensorAllToAll(self._values, self._send_values, recv_values, self._group)
        weights = (
            None if self._weights is None
            else TensorAllToAll(self._weights, self._send_values, recv_values, self._group)
        )
        got_lengths, got_values = lengths.wait(), values.wait()
        got_weights = None if weights is None else weights.wait()
        world, batch = self._world, self._batch
        if k and world > 1:
            # rows are (source, feature) -> reorder to (feature, source)
            rows = got_lengths.view(world * k, batch)
            perm = torch.arange(world * k).view(world, k).t().reshape(-1)
            got_lengths, got_values, got_weights = sparse_ops.permute_2d_sparse_data(
                perm, rows, got_values, got_weights
            )
            got_lengths = got_lengths.reshape(-1)
        return KeyedJaggedTensor(
            keys=self._keys,
            values=got_values,
            lengths=got_lengths,
            weights=got_weights,
            stride=world * batch,
        )
