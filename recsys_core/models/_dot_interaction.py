"""The dot interaction's training form, shared by ``recsys_core.models.dlrm`` (TorchRec's DLRM)
and ``dlrm_app.model``: ``[dense, pairs]`` of ``z = [dense, e_1..e_F]`` with every intermediate
written once and a one-product backward (see :class:`DotInteraction`). Eager training only:
inference, TorchScript and export keep the plain ``cat`` / ``bmm`` / indexing form."""

from __future__ import annotations

from typing import Any

import torch


def flat_pair_indices(n: int) -> torch.Tensor:
    """Positions of the pairs above the diagonal in a row-major ``[n, n]`` Gram matrix, in the
    output's order ``(0,1), (0,2), ..., (0,n-1), (1,2), ...``."""
    rows, cols = torch.triu_indices(n, n, 1)
    return rows * n + cols


def pair_runs(n: int) -> list[tuple[int, int, int]]:
    """Row ``i`` of the ``[n, n]`` Gram matrix holds the pairs ``(i, i+1..n-1)``, which are the
    output's ``n-1-i`` consecutive columns from ``offset``: ``(i, offset, n-1-i)`` per row."""
    runs, offset = [], 0
    for i in range(n - 1):
        runs.append((i, offset, n - 1 - i))
        offset += n - 1 - i
    return runs


class DotInteraction(torch.autograd.Function):
    """Training form of the dot interaction, ``[dense, pairs]`` from ``dense [B, D]`` and
    ``sparse [B, F, D]`` in ``dtype`` (bf16 under autocast), with each intermediate written
    once:

    * forward: ``z = [dense, e_1..e_F]`` is one ``[B, n, D]`` buffer of ``dtype`` that both
      inputs are copied into (the fp32 embeddings are rounded in that copy: no separate cast,
      no cat); ``z z^T`` is one batched product, whose entries above the diagonal are gathered
      straight into the output after the dense vector (no index_select, no second cat).
    * backward: ``dz = (G + G^T) z``, one batched product, for ``G`` the pairs' gradient
      placed in ``[n, n]`` by one slice copy per row and per column (autograd's own backward
      of ``bmm(z, z^T)`` does two products, a strided copy of the transpose and a sum); the
      dense vector's two gradients (its own output columns and row 0 of ``dz``) are added
      here, and the embeddings' gradient is cast back to their dtype.

    The values and the gradients are bitwise those of ``cat``, ``bmm``, ``index_select`` with
    the one-product backward (``tests/app/test_model.py``); against autograd's own two-product
    backward the gradients agree within rounding (``tests/models/test_dlrm_interaction.py``)."""

    @staticmethod
    def forward(ctx: Any, dense: torch.Tensor, sparse: torch.Tensor, dtype: torch.dtype,
                flat: torch.Tensor, runs: list[tuple[int, int, int]],
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
        batch, n, dim = sparse.shape[0], sparse.shape[1] + 1, dense.shape[1]
        z = dense.new_empty((batch, n, dim), dtype=dtype)
        z[:, 0].copy_(dense)
        z[:, 1:].copy_(sparse)
        gram = torch.bmm(z, z.transpose(1, 2))
        out = z.new_empty((batch, dim + flat.numel()), dtype=out_dtype or dtype)
        out[:, :dim].copy_(dense)
        if out.dtype == gram.dtype:
            torch.gather(gram.view(batch, n * n), 1, flat.expand(batch, -1), out=out[:, dim:])
        else:  # (gather writes only its own dtype)
            out[:, dim:].copy_(torch.gather(gram.view(batch, n * n), 1, flat.expand(batch, -1)))
        ctx.save_for_backward(z)
        ctx.runs, ctx.dtypes = runs, (dense.dtype, sparse.dtype)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (z,) = ctx.saved_tensors
        batch, n, dim = z.shape
        # in the product's dtype (the pairs' gradient rounded to it, as autograd would)
        sym = grad.new_empty((batch, n, n), dtype=z.dtype)
        sym.diagonal(dim1=1, dim2=2).zero_()
        for i, offset, count in ctx.runs:  # G at (i, j) and (j, i): every entry written once
            pairs = grad[:, dim + offset: dim + offset + count]
            sym[:, i, i + 1:].copy_(pairs)
            sym[:, i + 1:, i].copy_(pairs)
        dz = torch.bmm(sym, z)
        dense_dtype, sparse_dtype = ctx.dtypes
        d_dense = d_sparse = None
        if ctx.needs_input_grad[0]:
            d_dense = (dz[:, 0].to(grad.dtype) + grad[:, :dim]).to(dense_dtype)
        if ctx.needs_input_grad[1]:
            d_sparse = dz[:, 1:].to(sparse_dtype)
        return d_dense, d_sparse, None, None, None, None


@torch.jit.unused
def dot_interaction_with_grad(dense: torch.Tensor, sparse: torch.Tensor, dtype: torch.dtype,
                              flat: torch.Tensor, runs: list[tuple[int, int, int]],
                              out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """:class:`DotInteraction`: the stack and its products in ``dtype``, the output in
    ``out_dtype`` (default ``dtype``; its first ``D`` columns are ``dense`` as is)."""
    return DotInteraction.apply(dense, sparse, dtype, flat, runs, out_dtype)
