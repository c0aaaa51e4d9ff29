"""Pure-torch table-batched embedding bag with the optimizer fused into backward.

Same contract and numerics as FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen`` with an
``EXACT_*`` optimizer: gradients of all occurrences of a row (across the batch and across
features sharing the table) are summed first, then each touched row is updated once. Rows that
were not looked up are not touched (no decay, no state change), as in FBGEMM.

Used where FBGEMM is missing, where it has no kernel for the optimizer on the device (Adam and
LAMB on CPU), on ``device="meta"``, and by tests as an independent implementation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from recsys_core.kernels.config import EmbOptimType, FusedOptimizerConfig, WeightDecayMode


class TorchTableBatchedEmbedding(nn.Module):
    """Tables stored in one flat buffer; ``forward(indices, offsets)`` -> ``[B, sum(dims)]``.

    ``offsets`` is feature-major (``len == num_features * B + 1``), exactly a KJT's offsets.
    """

    def __init__(
        self,
        *,
        rows: Sequence[int],
        dims: Sequence[int],
        feature_table_map: Sequence[int],
        pooling_mean: bool,
        optimizer: FusedOptimizerConfig,
        device: torch.device,
        weights_dtype: torch.dtype = torch.float32,
    ) -> None:
        """``weights_dtype``: float32 or float16 weights (optimizer states stay float32; bags
        are summed and returned in float32, as FBGEMM's FP16 tables)."""
        super().__init__()
        if weights_dtype not in (torch.float32, torch.float16):
            raise ValueError(f"TorchTableBatchedEmbedding: weights_dtype {weights_dtype} is not "
                             "float32 or float16")
        self.rows = list(rows)
        self.dims = list(dims)
        self.feature_table_map = list(feature_table_map)
        self.pooling_mean = pooling_mean
        self.optimizer = optimizer
        self._lr = optimizer.learning_rate
        self.weights_offsets = _cumsum([r * d for r, d in zip(self.rows, self.dims, strict=True)])
        self.register_buffer(
            "weights", torch.zeros(self.weights_offsets[-1], device=device, dtype=weights_dtype),
            persistent=False,
        )
        self.state_offsets: dict[str, list[int]] = {}
        opt = optimizer.optimizer
        for name in opt.state_names:
            sizes = self.rows if opt.state_is_rowwise(name) else [
                r * d for r, d in zip(self.rows, self.dims, strict=True)
            ]
            self.state_offsets[name] = _cumsum(sizes)
            self.register_buffer(
                name, torch.zeros(self.state_offsets[name][-1], device=device), persistent=False
            )
        self.register_buffer("iter", torch.zeros(1, dtype=torch.int64), persistent=False)
        # each feature's first row in the flat buffers, for tables of one dim (_backward_one_dim)
        first_row = _cumsum(self.rows)
        self.register_buffer("feature_first_row", torch.tensor(
            [first_row[t] for t in self.feature_table_map], dtype=torch.int64, device=device),
            persistent=False)
        # Optional hook run once per backward before the updates: given (rows of the table,
        # touched rows, their summed grads) per table, or once for all tables seen as one of
        # sum(rows) rows when they share a dim, returns each entry's (rows, grads) to apply;
        # data-parallel sharding sets it to sum the gradients over ranks (all at once).
        self.gradient_reducer: (
            Callable[[list[tuple[int, torch.Tensor, torch.Tensor]]],
                     list[tuple[torch.Tensor, torch.Tensor]]] | None
        ) = None
        # Tables of one dim are updated in one pass (``_backward_one_dim``); False forces the
        # table-by-table update, which gives the same bits (tests compare the two).
        self.one_dim_pass = True
        # Gives autograd a leaf to differentiate so that backward (and the fused update) runs. A
        # buffer, not a Parameter: the kernel exposes no parameters of its own (the collection
        # exposes per-table weight views).
        self.register_buffer(
            "placeholder_autograd_tensor",
            torch.zeros(0, device=device, requires_grad=True),
            persistent=False,
        )

    # ---- views -------------------------------------------------------------------------------
    def split_embedding_weights(self) -> list[torch.Tensor]:
        return [
            self.weights[self.weights_offsets[t] : self.weights_offsets[t + 1]].view(r, d)
            for t, (r, d) in enumerate(zip(self.rows, self.dims, strict=True))
        ]

    def split_optimizer_states(self) -> list[dict[str, torch.Tensor]]:
        out: list[dict[str, torch.Tensor]] = [{} for _ in self.rows]
        opt = self.optimizer.optimizer
        for name, offs in self.state_offsets.items():
            flat = getattr(self, name)
            for t, (r, d) in enumerate(zip(self.rows, self.dims, strict=True)):
                view = flat[offs[t] : offs[t + 1]]
                out[t][name] = view if opt.state_is_rowwise(name) else view.view(r, d)
        return out

    def set_learning_rate(self, lr: float) -> None:
        self._lr = float(lr)

    def get_learning_rate(self) -> float:
        return self._lr

    # ---- compute -----------------------------------------------------------------------------
    def forward(
        self,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.training and torch.is_grad_enabled():
            self.iter.add_(1)
        return _FusedLookup.apply(
            self, self.placeholder_autograd_tensor, indices, offsets, per_sample_weights
        )

    def pooled(
        self,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None,
    ) -> torch.Tensor:
        return pooled_lookup(
            indices, offsets, self.split_embedding_weights(), self.feature_table_map,
            self.pooling_mean, per_sample_weights, accumulate_fp32=True,
        )

    def backward_and_update(
        self,
        grad_out: torch.Tensor,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None,
        want_psw_grad: bool,
    ) -> torch.Tensor | None:
        if (self.one_dim_pass and not want_psw_grad and len(set(self.dims)) == 1
                and self.feature_table_map):
            self._backward_one_dim(grad_out, indices, offsets, per_sample_weights)
            return None
        batch, starts = feature_bounds(offsets, len(self.feature_table_map))
        tables = self.split_embedding_weights()
        dim_offsets = _cumsum([self.dims[t] for t in self.feature_table_map])
        per_table: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        psw_grads = []
        for f, t in enumerate(self.feature_table_map):
            lo, hi = starts[f], starts[f + 1]
            lengths = offsets[f * batch + 1 : (f + 1) * batch + 1] - offsets[f * batch : (f + 1) * batch]
            bag_of_index = torch.repeat_interleave(
                torch.arange(batch, device=grad_out.device), lengths.long(), output_size=hi - lo
            )
            g = grad_out[:, dim_offsets[f] : dim_offsets[f + 1]].index_select(0, bag_of_index)
            if self.pooling_mean:
                g = g / lengths.clamp(min=1).to(g.dtype).index_select(0, bag_of_index).unsqueeze(1)
            idx = indices[lo:hi].long()
            if want_psw_grad:
                psw_grads.append((g * tables[t].index_select(0, idx)).sum(dim=1))
            if per_sample_weights is not None:
                g = g * per_sample_weights[lo:hi].unsqueeze(1)
            per_table.setdefault(t, []).append((idx, g))
        touched = []
        for t, parts in per_table.items():
            idx = torch.cat([p[0] for p in parts])
            grads = torch.cat([p[1] for p in parts])
            rows, inverse = torch.unique(idx, return_inverse=True)
            touched.append((self.rows[t], rows, grads.new_zeros(rows.numel(), grads.shape[1])
                            .index_add_(0, inverse, grads)))
        # collective when set: every rank reaches it once per backward, tables in feature order
        reduced = (self.gradient_reducer(touched) if self.gradient_reducer is not None
                   else [(rows, summed) for _, rows, summed in touched])
        for t, (rows, summed) in zip(per_table, reduced, strict=True):
            if rows.numel():
                self._apply_update(t, rows, summed)
        return torch.cat(psw_grads) if want_psw_grad else None

    @torch.no_grad()
    def _backward_one_dim(self, grad_out: torch.Tensor, indices: torch.Tensor,
                          offsets: torch.Tensor, per_sample_weights: torch.Tensor | None) -> None:
        """:meth:`backward_and_update` for tables of one dim, all at once: the ids of every
        feature as rows of the flat buffers seen as ``[total rows, dim]``, one ``unique`` and
        one update instead of one per table (many small tables, e.g. dim-1 ones, spent most of
        their step in the per-table loop). Each row gets the same sum, in the same order, and
        the same update as there."""
        dim, features = self.dims[0], len(self.feature_table_map)
        batch, starts = feature_bounds(offsets, features)
        count = starts[-1] - starts[0]
        lengths = offsets[1 : features * batch + 1] - offsets[: features * batch]
        bag_of_index = torch.repeat_interleave(
            torch.arange(features * batch, device=grad_out.device), lengths.long(), output_size=count
        )
        # bag f * B + i's gradient is columns f*D:(f+1)*D of row i
        bags = grad_out.view(batch, features, dim).transpose(0, 1).reshape(features * batch, dim)
        g = bags.index_select(0, bag_of_index)
        if self.pooling_mean:
            g = g / lengths.clamp(min=1).to(g.dtype).index_select(0, bag_of_index).unsqueeze(1)
        if per_sample_weights is not None:
            g = g * per_sample_weights[starts[0] : starts[-1]].unsqueeze(1)
        rows = indices[starts[0] : starts[-1]].long() + self.feature_first_row.index_select(
            0, torch.div(bag_of_index, max(batch, 1), rounding_mode="floor"))
        rows, inverse = torch.unique(rows, return_inverse=True)
        summed = g.new_zeros(rows.numel(), dim).index_add_(0, inverse, g)
        if self.gradient_reducer is not None:  # collective: reached even without ids
            ((rows, summed),) = self.gradient_reducer([(sum(self.rows), rows, summed)])
        if rows.numel() == 0:
            return
        opt = self.optimizer.optimizer
        states = {name: getattr(self, name) if opt.state_is_rowwise(name)
                  else getattr(self, name).view(-1, dim) for name in self.state_offsets}
        self._update_rows(self.weights.view(-1, dim), states, rows, summed)

    @torch.no_grad()
    def _apply_update(self, t: int, rows: torch.Tensor, g: torch.Tensor) -> None:
        self._update_rows(self.split_embedding_weights()[t], self.split_optimizer_states()[t],
                          rows, g)

    @torch.no_grad()
    def _update_rows(self, weight: torch.Tensor, states: dict[str, torch.Tensor],
                     rows: torch.Tensor, g: torch.Tensor) -> None:
        """The fused optimizer's step on ``rows`` of ``weight`` and its ``states``."""
        cfg = self.optimizer
        opt = cfg.optimizer.canonical
        lr, eps, wd = self._lr, cfg.eps, cfg.weight_decay
        w = weight.index_select(0, rows).float()
        # An FP16 table is updated in float32 and rounded once to nearest, except that SGD and
        # Adagrad round their step to FP16 first, then add it (FBGEMM's CPU kernels, measured).
        if opt is EmbOptimType.EXACT_SGD:
            new_w = w + _rounded_step(-lr * g, weight.dtype)
        elif opt is EmbOptimType.EXACT_ADAGRAD:
            m = states["momentum1"].index_select(0, rows) + g * g
            states["momentum1"].index_copy_(0, rows, m)
            new_w = w + _rounded_step(-lr * g / (m.sqrt() + eps), weight.dtype)
        elif opt is EmbOptimType.EXACT_ROWWISE_ADAGRAD:
            l2 = cfg.weight_decay_mode is WeightDecayMode.L2
            g_decayed = g + wd * w if l2 else g
            m = states["momentum1"].index_select(0, rows) + (g_decayed * g_decayed).mean(dim=1)
            states["momentum1"].index_copy_(0, rows, m)
            multiplier = (lr / (m.sqrt() + eps)).unsqueeze(1)
            if l2:
                correction = 1.0 - multiplier * wd
            elif cfg.weight_decay_mode is WeightDecayMode.DECOUPLED:
                correction = 1.0 - lr * wd
            else:
                correction = 1.0
            new_w = correction * w - multiplier * g
        else:
            new_w = self._adam_family_update(opt, rows, w, g, states)
        weight.index_copy_(0, rows, new_w.to(weight.dtype))

    def _adam_family_update(
        self,
        opt: EmbOptimType,
        rows: torch.Tensor,
        w: torch.Tensor,
        g: torch.Tensor,
        states: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        cfg = self.optimizer
        lr, eps, wd, b1, b2 = self._lr, cfg.eps, cfg.weight_decay, cfg.beta1, cfg.beta2
        step = int(self.iter.item())
        rowwise = opt in (EmbOptimType.PARTIAL_ROWWISE_ADAM, EmbOptimType.PARTIAL_ROWWISE_LAMB)
        m1 = b1 * states["momentum1"].index_select(0, rows) + (1.0 - b1) * g
        states["momentum1"].index_copy_(0, rows, m1)
        g2 = (g * g).mean(dim=1) if rowwise else g * g
        m2 = b2 * states["exp_avg_sq"].index_select(0, rows) + (1.0 - b2) * g2
        states["exp_avg_sq"].index_copy_(0, rows, m2)
        v_hat = m2 / (1.0 - b2**step)
        if rowwise:
            v_hat = v_hat.unsqueeze(1)
        update = m1 / (1.0 - b1**step) / (v_hat.sqrt() + eps) + wd * w
        if opt in (EmbOptimType.ADAM, EmbOptimType.PARTIAL_ROWWISE_ADAM):
            return w - lr * update
        # LAMB: trust ratio ||w|| / ||update|| per row.
        ratio = w.norm(dim=1, keepdim=True) / update.norm(dim=1, keepdim=True)
        return w - lr * ratio * update


class _FusedLookupCtx(torch.autograd.function.FunctionCtx):
    """The autograd context of :class:`_FusedLookup` as its methods use it (torch's
    ``FunctionCtx`` declares neither what forward stores nor the backward-time attributes)."""

    kernel: TorchTableBatchedEmbedding
    saved_tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
    needs_input_grad: tuple[bool, ...]


class _FusedLookup(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: _FusedLookupCtx,
        kernel: TorchTableBatchedEmbedding,
        placeholder: torch.Tensor,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None,
    ) -> torch.Tensor:
        ctx.kernel = kernel
        ctx.save_for_backward(indices, offsets, per_sample_weights)
        with torch.no_grad():
            return kernel.pooled(indices, offsets, per_sample_weights)

    @staticmethod
    def backward(
        ctx: _FusedLookupCtx, grad_out: torch.Tensor
    ) -> tuple[None, None, None, None, torch.Tensor | None]:
        indices, offsets, psw = ctx.saved_tensors
        want_psw_grad = bool(ctx.needs_input_grad[4])
        psw_grad = ctx.kernel.backward_and_update(
            grad_out.contiguous(), indices, offsets, psw, want_psw_grad
        )
        return None, None, None, None, psw_grad


def _rounded_step(step: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``step`` as the table's dtype would hold it (itself for a float32 table)."""
    return step if dtype == torch.float32 else step.to(dtype).float()


def feature_bounds(offsets: torch.Tensor, num_features: int) -> tuple[int, list[int]]:
    """The batch size ``B`` of feature-major ``offsets`` (``num_features * B + 1`` long, a KJT's)
    and where each feature's ids start, ``num_features + 1`` positions into the ids."""
    batch = (offsets.numel() - 1) // max(num_features, 1)
    starts = offsets[::batch].tolist() if batch > 0 else [0] * (num_features + 1)
    return batch, [int(s) for s in starts]


def pooled_lookup(
    indices: torch.Tensor,
    offsets: torch.Tensor,
    tables: Sequence[torch.Tensor],
    feature_table_map: Sequence[int],
    pooling_mean: bool,
    per_sample_weights: torch.Tensor | None = None,
    accumulate_fp32: bool = False,
) -> torch.Tensor:
    """``[B, sum of the features' dims]``: each feature's bags pooled from its table.

    Example: tables of 3 x 2 and 4 x 1 rows, features ``(f0 -> table 0, f1 -> table 1)``,
    batch 2, ids ``f0: [0, 2] | [1]``, ``f1: [] | [3]``: offsets ``[0, 2, 3, 3, 4]``, output
    row 0 is ``[w0[0] + w0[2], 0]``, row 1 ``[w0[1], w1[3]]`` (MEAN divides each bag by its
    length). Per-sample weights take each table's dtype; the output is float32 (an FP16
    table's too). ``accumulate_fp32``: an FP16 table's rows are summed in float32, with float32
    per-sample weights (FBGEMM's FP16 kernels), instead of in float16.
    """
    batch, starts = feature_bounds(offsets, len(feature_table_map))
    outs = []
    for f, t in enumerate(feature_table_map):
        lo, hi = starts[f], starts[f + 1]
        bags = offsets[f * batch : (f + 1) * batch + 1] - lo
        weight, ids = tables[t], indices[lo:hi].long()
        if accumulate_fp32 and weight.dtype != torch.float32:
            weight = weight.index_select(0, ids).float()
            ids = torch.arange(hi - lo, device=weight.device)
        sample_weights = None
        if per_sample_weights is not None:
            sample_weights = per_sample_weights[lo:hi]
            if sample_weights.dtype != weight.dtype:
                sample_weights = sample_weights.to(weight.dtype)
        out = nn.functional.embedding_bag(
            ids,
            weight,
            bags.long(),
            mode="sum",
            per_sample_weights=sample_weights,
            include_last_offset=True,
        )
        if out.dtype != torch.float32:  # an FP16 table's bags, in float32
            out = out.float()
        if pooling_mean:
            out = out / bags.diff().clamp(min=1).unsqueeze(1).to(out.dtype)
        outs.append(out)
    if not outs:
        return torch.zeros(batch, 0, device=offsets.device)
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def _cumsum(sizes: Sequence[int]) -> list[int]:
    out = [0]
    for s in sizes:
        out.append(out[-1] + int(s))
    return out
