"""Asynchronous, differentiable collectives on ``torch.distributed`` (gloo on CPU, NCCL on CUDA).

Each collective is a pair of autograd functions around one work handle:

    forward:   start  --(async collective in flight)-->  wait   (result enters the graph)
    backward:  wait.backward launches the reverse collective asynchronously;
               start.backward waits for it and returns the input's gradient.

so other work (the next batch's input dist, dense compute) can run while bytes move, in both
directions. The reverse of an all-to-all is the all-to-all with the splits swapped; the reverse
of a reduce-scatter is an all-gather.

On a gloo group whose ranks all live on this host, the all-to-alls and the all-reduce go
through shared memory instead (:mod:`recsys_core.distributed.shm_comm`: same values, a memcpy
instead of TCP loopback; ``RECSYS_SHM_COMM=0`` keeps them on gloo).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from recsys_core.distributed import shm_comm
from recsys_core.distributed.awaitable import Awaitable, FunctionAwaitable
from recsys_core.distributed.comm_ops import get_gradient_division
from recsys_core.distributed.qcomm_types import QuantizedCommCodecs
from recsys_core.distributed.shm_comm import ShmGroup, ShmWork
from recsys_core.kernels.packed import copy_runs

Launch = Callable[[torch.Tensor], tuple[torch.Tensor, "dist.Work | ShmWork | None"]]


@dataclass
class _InFlight:
    backward: Launch
    codecs: QuantizedCommCodecs | None = None
    group_size: int = 1  # the gradient is divided by this under gradient division
    work: dist.Work | ShmWork | None = None
    grad_work: dist.Work | ShmWork | None = None
    grad: torch.Tensor | None = None
    input_dtype: torch.dtype | None = None
    sent_shape: torch.Size | None = None
    sent_dtype: torch.dtype | None = None


class _Start(torch.autograd.Function):
    @staticmethod
    def forward(ctx, state: _InFlight, forward: Launch, x: torch.Tensor) -> torch.Tensor:
        codecs = state.codecs
        send = x if codecs is None else codecs.forward.encode(x)
        out, state.work = forward(send)
        state.input_dtype, state.sent_shape, state.sent_dtype = x.dtype, out.shape, out.dtype
        ctx.state = state
        return out

    @staticmethod
    def backward(ctx, _unfilled: torch.Tensor) -> tuple[None, None, torch.Tensor]:
        state: _InFlight = ctx.state
        if state.grad_work is not None:
            state.grad_work.wait()
        grad, state.grad, state.grad_work = state.grad, None, None
        if state.codecs is not None and grad is not None:
            grad = state.codecs.backward.decode(grad).to(state.input_dtype)
        if grad is not None and state.group_size > 1 and get_gradient_division():
            grad = grad.div_(state.group_size)  # a buffer of our own: the received gradient
        return None, None, grad


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, state: _InFlight, out: torch.Tensor) -> torch.Tensor:
        if state.work is not None:
            state.work.wait()
            # Drop the finished work: gloo's Work keeps its output tensor alive, whose grad_fn
            # holds this state, a cycle through C++ that Python's GC cannot see (it leaked
            # one step of collective buffers per step).
            state.work = None
        ctx.state = state
        if state.codecs is not None:
            return state.codecs.forward.decode(out).to(state.input_dtype)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        state: _InFlight = ctx.state
        codecs = state.codecs
        send = grad.contiguous() if codecs is None else codecs.backward.encode(grad.contiguous())
        state.grad, state.grad_work = state.backward(send)
        # autograd wants a gradient shaped like this node's input; the input's real gradient
        # is produced by _Start.backward once the reverse collective lands.
        if codecs is None:
            return None, grad
        # (the encoded payload's dtype differs: a zero-stride placeholder, no copy)
        return None, grad.new_zeros((), dtype=state.sent_dtype).expand(state.sent_shape)


class CollectiveAwaitable(Awaitable[torch.Tensor]):
    """A collective in flight; ``wait()`` returns its (differentiable) result. With
    ``codecs`` the payload travels encoded (``codecs.forward``) and arrives decoded to the
    input's dtype; so does the gradient in backward (``codecs.backward``). The gradient that
    reaches ``x`` is divided by ``group_size`` while gradient division is on
    (:mod:`recsys_core.distributed.comm_ops`)."""

    def __init__(
        self, x: torch.Tensor, forward: Launch, backward: Launch,
        codecs: QuantizedCommCodecs | None = None, group_size: int = 1,
    ) -> None:
        super().__init__()
        if torch.is_grad_enabled() and not x.requires_grad:
            # A rank with nothing to send (no local shard) must still take part in the
            # reverse collective in backward, or the ranks' collectives fall out of step.
            x = x.detach().requires_grad_()
        if codecs is not None and codecs.is_identity():
            codecs = None
        self._state = _InFlight(backward=backward, codecs=codecs, group_size=group_size)
        self._out = _Start.apply(self._state, forward, x)

    def _wait_impl(self) -> torch.Tensor:
        return _Wait.apply(self._state, self._out)


def _all_to_all(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, dist.Work | ShmWork | None]:
    if group is None or dist.get_world_size(group) == 1:
        return x.view_as(x), None  # nothing moves: no copy of tens of MB per step
    out = x.new_empty(sum(out_splits))
    shm = shm_comm.for_group(group, x.device)
    if shm is not None:  # every rank on this host: through shared memory, not TCP loopback
        return out, shm.all_to_all_single(out, x, out_splits, in_splits)
    work = dist.all_to_all_single(out, x, out_splits, in_splits, group=group, async_op=True)
    return out, work


def all_to_all_1d(
    x: torch.Tensor,
    in_splits: Sequence[int],
    out_splits: Sequence[int],
    group: dist.ProcessGroup | None,
    codecs: QuantizedCommCodecs | None = None,
) -> CollectiveAwaitable:
    """Differentiable uneven all-to-all of a 1-D tensor (``in_splits[r]`` elements go to r),
    its payload encoded by ``codecs`` (None: as is)."""
    send, recv = list(in_splits), list(out_splits)
    if x.numel() != sum(send):
        raise ValueError(f"all_to_all: tensor has {x.numel()} elements, splits sum to {sum(send)}")
    return CollectiveAwaitable(
        x.reshape(-1).contiguous(),
        forward=lambda t: _all_to_all(t, recv, send, group),
        backward=lambda g: _all_to_all(g, send, recv, group),
        codecs=codecs,
        group_size=1 if group is None else dist.get_world_size(group),
    )


Run = tuple[int, int, int, int]
"""A column run: (source rank, its first column, the output's first column, columns)."""


def _runs_between(wide: torch.Tensor, part: torch.Tensor, runs: Sequence[Run],
                  to_part: bool) -> None:
    """Copy ``runs`` (all of one part, given as part 0) between ``wide`` and ``part``."""
    copy_runs(wide, [part], runs, to_part)


@functools.lru_cache(maxsize=64)
def _runs_by_rank(runs: tuple[Run, ...], dims: tuple[int, ...]) -> tuple[tuple[Run, ...], ...]:
    """``runs`` grouped by source rank, each group's runs naming their part as part 0 (the
    form :func:`_runs_between` copies), once checked to place every output column once and
    read inside their parts (a layout is checked and grouped once, not every batch)."""
    by_rank: list[list[Run]] = [[] for _ in dims]
    covered = 0
    for run in sorted(runs, key=lambda r: r[2]):
        p, src, dst, cols = run
        if not (0 <= p < len(dims) and 0 <= src <= dims[p] - cols and dst == covered
                and cols > 0):
            raise ValueError(f"pooled all-to-all: the runs {list(runs)} do not place the "
                             f"received columns (widths {list(dims)}) on every output column "
                             f"once (at run {run})")
        covered += cols
        by_rank[p].append((0, src, dst, cols))
    if covered != sum(dims):
        raise ValueError(f"pooled all-to-all: the runs {list(runs)} cover {covered} of the "
                         f"{sum(dims)} output columns")
    return tuple(tuple(r) for r in by_rank)


@dataclass
class _Exchange:
    """One pooled exchange through shared memory, forward and backward."""

    shm: ShmGroup
    send_rows: list[int]  # rows of the input that go to each rank (rank order)
    batch: int  # rows received from every rank: this rank's batch
    dims: list[int]  # columns received from each rank
    runs: tuple[tuple[Run, ...], ...]  # per source rank, its runs into the output
    total: int
    group_size: int
    seq: int = 0
    local: torch.Tensor | None = None  # this rank's own rows of the input (forward)
    grad: torch.Tensor | None = None  # the input's gradient, filled in backward
    grad_seq: int = 0


class _ExchangeStart(torch.autograd.Function):
    @staticmethod
    def forward(ctx, state: _Exchange, pooled: torch.Tensor) -> torch.Tensor:
        shm, rank = state.shm, state.shm.rank
        blocks = list(pooled.contiguous().split(state.send_rows))
        state.seq = shm.next_seq()
        shm.post(state.seq, [None if r == rank else b for r, b in enumerate(blocks)],
                  pooled.dtype)
        state.local = blocks[rank]
        ctx.state = state
        return pooled.new_empty(0)  # orders the wait after this start in the graph

    @staticmethod
    def backward(ctx, _token: torch.Tensor) -> tuple[None, torch.Tensor]:
        state: _Exchange = ctx.state
        grad, state.grad = state.grad, None
        assert grad is not None
        blocks = grad.split(state.send_rows)
        for peer in state.shm.peers():
            state.shm.receive(state.grad_seq, peer, blocks[peer],
                               "all_to_all (pooled gradients)")
        if state.group_size > 1 and get_gradient_division():
            grad.div_(state.group_size)
        return None, grad


class _ExchangeWait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, state: _Exchange, token: torch.Tensor) -> torch.Tensor:
        shm, rank = state.shm, state.shm.rank
        local, state.local = state.local, None
        assert local is not None
        out = local.new_empty(state.batch, state.total)
        _runs_between(out, local, state.runs[rank], to_part=False)
        for peer in shm.peers():
            shape = (state.batch, state.dims[peer])
            shm.read_part(state.seq, peer, state.batch * state.dims[peer], local.dtype,
                          "all_to_all (pooled embeddings)",
                          lambda part, p=peer, shape=shape: _runs_between(
                              out, part.view(shape), state.runs[p], to_part=False))
        ctx.state = state
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        state: _Exchange = ctx.state
        shm, rank = state.shm, state.shm.rank
        state.grad = grad.new_empty(sum(state.send_rows), state.dims[rank])
        own = state.grad.split(state.send_rows)[rank]
        _runs_between(grad, own, state.runs[rank], to_part=True)
        state.grad_seq = shm.next_seq()
        shm.post_filled(
            state.grad_seq, [state.batch * d for d in state.dims], grad.dtype,
            lambda peer, part: _runs_between(
                grad, part.view(state.batch, state.dims[peer]), state.runs[peer], to_part=True))
        return None, grad.new_empty(0)


class _ExchangeAwaitable(Awaitable[torch.Tensor]):
    def __init__(self, state: _Exchange, pooled: torch.Tensor) -> None:
        super().__init__()
        if torch.is_grad_enabled() and not pooled.requires_grad:
            pooled = pooled.detach().requires_grad_()  # the reverse exchange must still run
        self._state = state
        self._token = _ExchangeStart.apply(state, pooled)

    def _wait_impl(self) -> torch.Tensor:
        return _ExchangeWait.apply(self._state, self._token)


def pooled_all_to_all_assembled(
    pooled: torch.Tensor,
    send_rows: Sequence[int],
    batch: int,
    dims: Sequence[int],
    runs: Sequence[Run],
    group: dist.ProcessGroup | None,
) -> Awaitable[torch.Tensor] | None:
    """The table-wise output dist in one step, or None where it does not apply (the caller
    then runs :func:`all_to_all_1d` and assembles the received buffer).

    ``pooled`` (``[sum(send_rows), dims[rank]]``) sends its ``send_rows[r]`` rows (in rank
    order) to rank r; rank p's ``[batch, dims[p]]`` part lands in the ``[batch, sum(dims)]``
    output by ``runs`` (``(p, p's column, output column, columns)``; together they must cover
    every output column once). Through shared memory (every rank of ``group`` on this host),
    a peer's part is read in place and copied straight to its output columns, and the
    gradient's columns go straight into the segment: no received buffer and no staging copy,
    two of the four copies of the pooled bytes each way. The values are those of the
    all-to-all followed by the assembly, bit for bit."""
    if group is None or dist.get_world_size(group) == 1 or not pooled.is_cpu:
        return None
    shm = shm_comm.for_group(group, pooled.device)
    if shm is None:
        return None
    if pooled.dim() != 2 or tuple(pooled.shape) != (sum(send_rows), dims[shm.rank]):
        raise ValueError(f"pooled all-to-all: rank {shm.rank} sends {sum(send_rows)} rows of "
                         f"{dims[shm.rank]} columns, got a tensor of shape {list(pooled.shape)}")
    by_rank = _runs_by_rank(tuple(map(tuple, runs)), tuple(dims))
    state = _Exchange(shm=shm, send_rows=list(send_rows), batch=batch, dims=list(dims),
                      runs=by_rank, total=sum(dims), group_size=shm.world)
    return _ExchangeAwaitable(state, pooled)


def reduce_scatter_dim0(
    x: torch.Tensor, group: dist.ProcessGroup | None,
    codecs: QuantizedCommCodecs | None = None,
) -> Awaitable[torch.Tensor]:
    """Sum ``x`` over the group and keep this rank's equal chunk of dim 0 (backward: all-gather).
    With ``codecs`` the chunks travel encoded; on gloo the decoded chunks are summed (in the
    input's dtype), on NCCL the collective sums the encoded ones, as TorchRec does.

    On gloo it runs as an all-to-all of the chunks plus a local sum (whose backward is the
    all-to-all that all-gathers): measured 2-3x faster there than gloo's reduce-scatter and
    all-gather, which torch 2.13 also deprecates for gloo.
    """
    size = 1 if group is None else dist.get_world_size(group)
    if x.shape[0] % size:
        raise ValueError(f"reduce_scatter: dim 0 ({x.shape[0]}) is not divisible by {size} ranks")
    chunk_shape = (x.shape[0] // size, *x.shape[1:])
    if size > 1 and dist.get_backend(group) == "gloo":
        n = x.numel() // size
        inflight = all_to_all_1d(x, [n] * size, [n] * size, group, codecs)
        return FunctionAwaitable(lambda: inflight.wait().view(size, *chunk_shape).sum(dim=0))

    def forward(t: torch.Tensor) -> tuple[torch.Tensor, dist.Work | None]:
        out = t.new_empty(chunk_shape)
        if size == 1:
            return out.copy_(t), None
        return out, dist.reduce_scatter_tensor(out, t, group=group, async_op=True)

    def backward(g: torch.Tensor) -> tuple[torch.Tensor, dist.Work | None]:
        out = g.new_empty(x.shape)
        if size == 1:
            return out.copy_(g), None
        return out, dist.all_gather_into_tensor(out, g, group=group, async_op=True)

    return CollectiveAwaitable(x.contiguous(), forward, backward, codecs, group_size=size)


class TensorAllToAll(Awaitable[torch.Tensor]):
    """Non-differentiable uneven all-to-all (ids, lengths, split sizes)."""

    def __init__(
        self,
        x: torch.Tensor,
        in_splits: Sequence[int],
        out_splits: Sequence[int],
        group: dist.ProcessGroup | None,
    ) -> None:
        super().__init__()
        self._out, self._work = _all_to_all(x.contiguous(), list(out_splits), list(in_splits), group)

    def _wait_impl(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._out


def all_reduce_sum_(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """In-place sum over the group (synchronous: used inside the fused backward)."""
    if group is not None and dist.get_world_size(group) > 1:
        shm = shm_comm.for_group(group, x.device) if x.is_contiguous() else None
        if shm is not None:
            shm.all_reduce(x).wait()
        else:
            dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


# ---- TorchRec's topology helpers (``torchrec.distributed.comm``) -----------------------------
# Ranks per host and process subgroups, read from torchrun's environment (LOCAL_WORLD_SIZE,
# LOCAL_RANK) or MPI's, else one host. The subgroups are module state, as TorchRec's.

_INTRA_PG: dist.ProcessGroup | None = None  # this rank's host
_CROSS_PG: dist.ProcessGroup | None = None  # the ranks of this local index on every host


def _env2int(names: Sequence[str], default: int = -1) -> int:
    import os

    for name in names:
        value = os.environ.get(name)
        if value is not None:
            if not value.isdigit():
                raise ValueError(f"{name}={value!r} is not a non-negative integer")
            return int(value)
    return default


def get_local_size(world_size: int | None = None) -> int:
    """Ranks per host: LOCAL_WORLD_SIZE (torchrun) or MPI's local size; the whole world when
    unset or when it does not divide ``world_size`` (default: the default group's size)."""
    if world_size is None:
        world_size = dist.get_world_size()
    local_size = _env2int(
        ["LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE",
         "MV2_COMM_WORLD_LOCAL_SIZE"],
    )
    if local_size <= 0 or world_size % local_size:
        return world_size
    return local_size


def get_local_rank(world_size: int | None = None, rank: int | None = None) -> int:
    """This rank's index on its host: LOCAL_RANK (torchrun) or MPI's, else ``rank %
    get_local_size()``."""
    local_rank = _env2int(
        ["LOCAL_RANK", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK",
         "MV2_COMM_WORLD_LOCAL_RANK"],
    )
    local_size = get_local_size(world_size)
    if local_rank < 0 or local_rank >= local_size:
        local_rank = (dist.get_rank() if rank is None else rank) % local_size
    return local_rank


def get_group_rank(world_size: int | None = None, rank: int | None = None) -> int:
    """The host index of ``rank`` (default: this process's rank)."""
    return (dist.get_rank() if rank is None else rank) // get_local_size(world_size)


def get_num_groups(world_size: int | None = None) -> int:
    """The number of hosts."""
    if world_size is None:
        world_size = dist.get_world_size()
    return world_size // get_local_size(world_size)


def intra_and_cross_node_pg(
    device: torch.device | None = None, backend: str | None = None
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """This rank's host group and cross-host group (created once, on every rank in the same
    order; ``dist.new_group`` is collective). World 4 with 2 ranks per host: rank 3's host
    group is ranks [2, 3], its cross group [1, 3]. ``(None, None)`` on the meta device."""
    global _INTRA_PG, _CROSS_PG
    if device is not None and device.type == "meta":
        return None, None
    world_size, rank = dist.get_world_size(), dist.get_rank()
    local_size = get_local_size(world_size)
    hosts = world_size // local_size
    backend = backend or dist.get_backend()
    if _INTRA_PG is None:
        for host in range(hosts):
            group = dist.new_group(ranks=[host * local_size + r for r in range(local_size)],
                                   backend=backend)
            if rank // local_size == host:
                _INTRA_PG = group
        dist.barrier()
    if _CROSS_PG is None:
        for local in range(local_size):
            group = dist.new_group(ranks=[local + h * local_size for h in range(hosts)],
                                   backend=backend)
            if rank % local_size == local:
                _CROSS_PG = group
        dist.barrier()
    return _INTRA_PG, _CROSS_PG
