"""Input distribution: sparse features (KJT pieces) all-to-all between ranks.

Every rank sends, to each destination, the bags that the destination's shards must look up
(whole bags for table/column-wise shards, row-bucketed bags for row-wise shards). Three steps:

    1. split sizes      (W x 3 ints: lengths, values and the local batch size per destination)
    2. lengths, values (and weights), uneven splits, asynchronously
    3. on arrival: reorder source-major -> feature-major, so the result is one KJT over the
       global batch (source rank 0's samples first), ready for the table-batched kernel.

Ranks may use different local batch sizes (a last partial batch, an empty one): the sizes
travel with the split sizes, so this costs no extra collective. The global batch is then
``sum(batch_size_per_rank)`` and the output dists send each rank back its own rows.

Example, 2 ranks, batch 2 on rank 0 and 1 on rank 1, destination rank 0 looks up feature "f":

    from rank 0: f lengths [1, 2]    from rank 1: f lengths [3]
    result on rank 0: KJT keys ["f"], lengths [1, 2, 3] (stride 3), batch_size_per_rank [2, 1]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from recsys_core.distributed.awaitable import Awaitable
from recsys_core.distributed.comm import TensorAllToAll
from recsys_core.distributed.types import ShardingEnv
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
        batch_size: the local batch size.
        variable_batch: whether other ranks may use other batch sizes (the receiver then reads
            each source's size, :attr:`batch_size_per_rank`); False: a different size is an
            error (for callers whose output dist assumes equal batches).

    After ``wait()``, :attr:`batch_size_per_rank` holds every source rank's batch size.
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
        *,
        variable_batch: bool = False,
    ) -> None:
        super().__init__()
        self._group, self._world = group, world_size
        self._keys, self._batch, self._variable = list(recv_keys), batch_size, variable_batch
        self._lengths, self._values, self._weights = lengths, values, weights
        self._send_lengths, self._send_values = list(lengths_per_dest), list(values_per_dest)
        self.batch_size_per_rank: list[int] = [batch_size] * world_size
        sizes = torch.tensor(
            [self._send_lengths, self._send_values, [batch_size] * world_size], dtype=torch.int64
        ).t()
        self._splits = TensorAllToAll(
            sizes.reshape(-1), [3] * world_size, [3] * world_size, group
        )

    def _wait_impl(self) -> KeyedJaggedTensor:
        recv = self._splits.wait().view(self._world, 3).tolist()
        recv_lengths = [n for n, _, _ in recv]
        recv_values = [n for _, n, _ in recv]
        batches = [b for _, _, b in recv]
        k = len(self._keys)
        for src, (n, b) in enumerate(zip(recv_lengths, batches, strict=True)):
            if n != k * b:
                raise ValueError(
                    f"sharded input dist: rank {src} sent {n} lengths for {k} feature(s) and "
                    f"its batch size {b} (expected {k * b}); its KeyedJaggedTensor is "
                    "malformed: give every key stride() lengths"
                )
            if b != self._batch and not self._variable:
                raise ValueError(
                    f"sharded input dist: rank {src} uses batch size {b}, this rank "
                    f"{self._batch}; this module needs the same batch size on every rank "
                    "(drop the last partial batch)"
                )
        self.batch_size_per_rank = batches
        lengths = TensorAllToAll(self._lengths, self._send_lengths, recv_lengths, self._group)
        values = TensorAllToAll(self._values, self._send_values, recv_values, self._group)
        weights = (
            None if self._weights is None
            else TensorAllToAll(self._weights, self._send_values, recv_values, self._group)
        )
        got_lengths, got_values = lengths.wait(), values.wait()
        got_weights = None if weights is None else weights.wait()
        world = self._world
        if k and world > 1:
            # rows are (source, feature) -> reorder to (feature, source)
            perm = torch.arange(world * k).view(world, k).t().reshape(-1)
            if all(b == batches[0] for b in batches):
                rows = got_lengths.view(world * k, batches[0])
                got_lengths, got_values, got_weights = sparse_ops.permute_2d_sparse_data(
                    perm, rows, got_values, got_weights
                )
                got_lengths = got_lengths.reshape(-1)
            else:
                got_lengths, got_values, got_weights = _reorder_uneven(
                    perm, got_lengths, got_values, got_weights, batches, k
                )
        return KeyedJaggedTensor(
            keys=self._keys,
            values=got_values,
            lengths=got_lengths,
            weights=got_weights,
            stride=sum(batches),
        )


def batch_sizes(inflight: Awaitable[Any]) -> list[int] | None:
    """Every rank's batch size, read from a finished input dist (None for a strategy without
    one, e.g. data-parallel: it needs only its own)."""
    return inflight.batch_size_per_rank if isinstance(inflight, SparseFeaturesAllToAll) else None


def _reorder_uneven(
    perm: torch.Tensor,
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor | None,
    batches: Sequence[int],
    k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The (source, feature) -> (feature, source) reorder when sources sent different batch
    sizes: each (source, feature) block of ``batches[source]`` lengths is one segment, moved
    whole (values by their per-segment counts, lengths by the batch sizes)."""
    sizes = torch.tensor([b for b in batches for _ in range(k)], device=lengths.device)
    segment = torch.repeat_interleave(torch.arange(sizes.numel(), device=lengths.device), sizes)
    counts = torch.zeros(sizes.numel(), dtype=lengths.dtype, device=lengths.device)
    counts.index_add_(0, segment, lengths)
    _, values, weights = sparse_ops.permute_2d_sparse_data(
        perm, counts.view(-1, 1), values, weights
    )
    _, lengths, _ = sparse_ops.permute_2d_sparse_data(
        perm, sizes.to(lengths.dtype).view(-1, 1), lengths
    )
    return lengths, values, weights


def send_whole_bags(
    features: KeyedJaggedTensor,
    send_order: Sequence[int],
    send_counts: Sequence[int],
    recv_keys: Sequence[str],
    env: ShardingEnv,
    with_weights: bool,
    variable_batch: bool = False,
) -> SparseFeaturesAllToAll:
    """All-to-all of whole bags: ``features`` permuted by ``send_order`` (repeats allowed) holds
    ``send_counts[d]`` consecutive keys for each destination ``d``; this rank receives
    ``recv_keys`` (table- and column-wise shards look up every id of their features)."""
    sent = features.permute(list(send_order))
    per_key = sent.length_per_key()
    batch = features.stride()
    values_per_dest, k = [], 0
    for count in send_counts:
        values_per_dest.append(sum(per_key[k : k + count]))
        k += count
    return SparseFeaturesAllToAll(
        sent.lengths(), sent.values(), sent.weights_or_none() if with_weights else None,
        [c * batch for c in send_counts], values_per_dest, recv_keys, batch, env.pg,
        env.world_size, variable_batch=variable_batch,
    )


@dataclass
class RowBuckets:
    """Ids routed to the ranks owning their rows (see :func:`bucketize_by_row`)."""

    exchange: SparseFeaturesAllToAll
    orders: list[torch.Tensor]  # per feature: stable permutation grouping its ids by owner
    ids_per_dest: list[list[int]]  # per feature: how many of its ids each rank receives


def bucketize_by_row(
    features: KeyedJaggedTensor,
    starts: Sequence[torch.Tensor],
    owners: Sequence[torch.Tensor],
    features_per_dest: Sequence[Sequence[int]],
    recv_keys: Sequence[str],
    env: ShardingEnv,
    with_weights: bool,
    variable_batch: bool = False,
) -> RowBuckets:
    """Send each id to the rank owning its row, shifted to that shard's local rows.

    ``starts[i]`` / ``owners[i]``: first row and rank of each non-empty row block of feature
    ``i``'s table; ``features_per_dest[r]``: the features rank ``r`` looks up, in its order.
    Within a destination, lengths are per (feature, sample) and ids keep their input order.
    """
    world, batch = env.world_size, features.stride()
    values, lengths_all = features.values(), features.lengths()
    weights_all = features.weights_or_none() if with_weights else None
    offsets = features.offset_per_key()
    counts, ids_split, weights_split, orders, ids_per_dest = [], [], [], [], []
    for i in range(len(features.keys())):
        lo, hi = offsets[i], offsets[i + 1]
        ids = values[lo:hi]
        first = starts[i].to(ids.device)
        block = torch.searchsorted(first, ids, right=True) - 1
        dest = owners[i].to(ids.device)[block]
        sample = torch.repeat_interleave(
            torch.arange(batch, device=ids.device),
            lengths_all[i * batch : (i + 1) * batch].long(),
            output_size=hi - lo,
        )
        counts.append(
            torch.bincount(dest * batch + sample, minlength=world * batch).view(world, batch)
        )
        order = torch.argsort(dest, stable=True)
        per_dest = torch.bincount(dest, minlength=world).tolist()
        ids_split.append((ids - first[block].to(ids.dtype))[order].split(per_dest))
        if weights_all is not None:
            weights_split.append(weights_all[lo:hi][order].split(per_dest))
        orders.append(order)
        ids_per_dest.append(per_dest)

    def gather(parts: list, empty: torch.Tensor) -> list[torch.Tensor]:
        return [
            torch.cat([parts[i][r] for i in feats]) if feats else empty
            for r, feats in enumerate(features_per_dest)
        ]

    send_lengths = [
        t.to(lengths_all.dtype) for t in gather(counts, lengths_all.new_zeros(0))
    ]
    send_values = gather(ids_split, values.new_zeros(0))
    send_weights = None
    if weights_all is not None:
        send_weights = torch.cat(gather(weights_split, weights_all.new_zeros(0)))
    exchange = SparseFeaturesAllToAll(
        torch.cat(send_lengths), torch.cat(send_values), send_weights,
        [t.numel() for t in send_lengths], [t.numel() for t in send_values],
        recv_keys, batch, env.pg, world, variable_batch=variable_batch,
    )
    return RowBuckets(exchange, orders, ids_per_dest)
