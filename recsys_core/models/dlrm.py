"""DLRM (arXiv:1906.00091) and its DCN-v2 and projection variants, as TorchRec's
``torchrec.models.dlrm``: same constructor arguments, submodule names and state-dict keys.

Shapes (B samples, F sparse features, D embedding dim)::

    dense_features [B, in] --DenseArch--> [B, D] -----------------------+
    sparse_features (KJT)  --SparseArch-> [B, F, D] --InteractionArch-> [B, D + F + F(F-1)/2]
                                                                        --OverArch--> [B, out]

The dot interaction stacks the dense vector with the F pooled embeddings (F + 1 vectors) and
keeps the pairwise dot products above the diagonal, in row-major order
``(0,1), (0,2), ..., (0,F), (1,2), ...``, after the dense vector itself.
"""

from typing import Any

import torch
from torch import nn
from torch.fx._symbolic_trace import is_fx_tracing

from recsys_core.datasets.utils import Batch
from recsys_core.models._dot_interaction import (
    dot_interaction_with_grad,
    flat_pair_indices,
    pair_runs,
)
from recsys_core.modules.crossnet import LowRankCrossNet
from recsys_core.modules.embedding_modules import EmbeddingBagCollection
from recsys_core.modules.mlp import MLP
from recsys_core.sparse import KeyedJaggedTensor, KeyedTensor


class ModelConfigError(ValueError, AssertionError):
    """A model was built from tables it cannot use. A ``ValueError``; also an
    ``AssertionError``, the type TorchRec raises for these checks, so callers catching
    either keep working."""


def choose(n: int, k: int) -> int:
    """Binomial coefficient ``n choose k`` (0 when k is out of range)."""
    if not 0 <= k <= n:
        return 0
    num, den = 1, 1
    for t in range(1, min(k, n - k) + 1):
        num *= n - t + 1
        den *= t
    return num // den


@torch.jit.unused
def _eager_in_order(pooled: KeyedTensor, names: list[str]) -> bool:
    """Eager (not traced) and the collection's keys already in feature order."""
    return not is_fx_tracing() and pooled.keys() == names


class SparseArch(nn.Module):
    """Pooled embeddings of every feature, stacked: KJT -> ``[B, F, D]`` (feature order of the
    collection's configs). All tables must share one embedding dim."""

    def __init__(self, embedding_bag_collection: EmbeddingBagCollection) -> None:
        super().__init__()
        configs = embedding_bag_collection.embedding_bag_configs()
        if not configs:
            raise ModelConfigError("SparseArch: the embedding bag collection has no tables")
        self.embedding_bag_collection: EmbeddingBagCollection = embedding_bag_collection
        self.D: int = configs[0].embedding_dim
        self._sparse_feature_names: list[str] = [
            name for conf in configs for name in conf.feature_names
        ]
        self.F: int = len(self._sparse_feature_names)

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.embedding_bag_collection(features)
        if not torch.jit.is_scripting() and _eager_in_order(pooled, self._sparse_feature_names):
            # already in feature order (an unsharded collection's output, and a sharded one's):
            # its values are the stack, no per-feature copy
            return pooled.values().reshape(-1, self.F, self.D)
        by_name = pooled.to_dict()
        values = [by_name[name] for name in self._sparse_feature_names]
        return torch.cat(values, dim=1).reshape(-1, self.F, self.D)

    @property
    def sparse_feature_names(self) -> list[str]:
        return self._sparse_feature_names


class DenseArch(nn.Module):
    """Bottom MLP (relu after every layer): ``[B, in_features] -> [B, layer_sizes[-1]]``."""

    def __init__(
        self, in_features: int, layer_sizes: list[int], device: torch.device | None = None
    ) -> None:
        super().__init__()
        self.model: nn.Module = MLP(
            in_features, layer_sizes, bias=True, activation="relu", device=device
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.model(features)


@torch.jit.unused
def _eager_training(dense: torch.Tensor, sparse: torch.Tensor) -> bool:
    """Eager (not scripted, traced or exported) with a gradient to compute."""
    return (not is_fx_tracing() and not torch.compiler.is_compiling() and torch.is_grad_enabled()
            and (dense.requires_grad or sparse.requires_grad))


class InteractionArch(nn.Module):
    """Dot interaction: ``[B, D], [B, F, D] -> [B, D + F(F+1)/2]`` (dense, then the dot product
    of every pair among the F + 1 vectors, upper triangle row-major)."""

    def __init__(self, num_sparse_features: int) -> None:
        super().__init__()
        self.F: int = num_sparse_features
        self.register_buffer(
            "triu_indices",
            torch.triu_indices(self.F + 1, self.F + 1, offset=1),
            persistent=False,
        )
        self.register_buffer("_flat_pairs", flat_pair_indices(self.F + 1), persistent=False)
        self._pair_runs: list[tuple[int, int, int]] = pair_runs(self.F + 1)

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
        if self.F <= 0:
            return dense_features
        if not torch.jit.is_scripting() and _eager_training(dense_features, sparse_features):
            # the same values (the stack in the dtype autocast's product would use, the pairs
            # above the diagonal, the output in cat's promoted dtype), each buffer written
            # once, a one-product backward
            kind = sparse_features.device.type
            stacked = torch.promote_types(dense_features.dtype, sparse_features.dtype)
            dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else stacked
            return dot_interaction_with_grad(dense_features, sparse_features, dtype,
                                             self._flat_pairs, self._pair_runs,
                                             torch.promote_types(dense_features.dtype, dtype))
        combined = torch.cat((dense_features.unsqueeze(1), sparse_features), dim=1)
        gram = torch.bmm(combined, combined.transpose(1, 2))
        pairs = gram[:, self.triu_indices[0], self.triu_indices[1]]
        return torch.cat((dense_features, pairs), dim=1)


class InteractionDCNArch(nn.Module):
    """DCN-v2 interaction: ``crossnet`` over the flattened ``[B, (F + 1) * D]`` stack."""

    def __init__(self, num_sparse_features: int, crossnet: nn.Module) -> None:
        super().__init__()
        self.F: int = num_sparse_features
        self.crossnet = crossnet

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
        if self.F <= 0:
            return dense_features
        B = dense_features.shape[0]
        combined = torch.cat((dense_features.unsqueeze(1), sparse_features), dim=1)
        return self.crossnet(combined.reshape([B, -1]))


class InteractionProjectionArch(nn.Module):
    """Projection interaction (DLRM_Projection): two MLP branches project the flattened stack
    to ``[B, F1, D]`` and ``[B, D, F2]``; their batched product ``[B, F1 * F2]`` follows the
    dense vector."""

    def __init__(
        self,
        num_sparse_features: int,
        interaction_branch1: nn.Module,
        interaction_branch2: nn.Module,
    ) -> None:
        super().__init__()
        self.F: int = num_sparse_features
        self.interaction_branch1 = interaction_branch1
        self.interaction_branch2 = interaction_branch2

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
        if self.F <= 0:
            return dense_features
        B, D = dense_features.shape
        flat = torch.cat((dense_features.unsqueeze(1), sparse_features), dim=1).reshape(B, -1)
        left = self.interaction_branch1(flat).reshape([B, -1, D])
        right = self.interaction_branch2(flat).reshape([B, D, -1])
        return torch.cat((dense_features, torch.bmm(left, right).reshape(B, -1)), dim=1)


class OverArch(nn.Module):
    """Top MLP: relu layers ``layer_sizes[:-1]`` then a plain linear layer to ``layer_sizes[-1]``
    (logits: no activation at the end)."""

    def __init__(
        self, in_features: int, layer_sizes: list[int], device: torch.device | None = None
    ) -> None:
        super().__init__()
        if len(layer_sizes) <= 1:
            raise ValueError(f"OverArch must have multiple layers, got layer_sizes={layer_sizes}")
        self.model: nn.Module = nn.Sequential(
            MLP(in_features, layer_sizes[:-1], bias=True, activation="relu", device=device),
            nn.Linear(layer_sizes[-2], layer_sizes[-1], bias=True, device=device),
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.model(features)


def _common_embedding_dim(ebc: EmbeddingBagCollection, model: str) -> int:
    configs = ebc.embedding_bag_configs()
    if not configs:
        raise ModelConfigError(f"{model}: at least one embedding bag table is required")
    dims = {c.name: c.embedding_dim for c in configs}
    if len(set(dims.values())) != 1:
        raise ModelConfigError(
            f"{model}: all EmbeddingBagConfigs must have the same embedding_dim, got {dims}"
        )
    return configs[0].embedding_dim


class _FourArches(nn.Module):
    """A model of four arches (set by the subclass): the dense arch over the dense features and
    the sparse arch over the KJT, their interaction, then the over arch (DLRM, DeepFM)."""

    def forward(
        self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor
    ) -> torch.Tensor:
        embedded_dense = self.dense_arch(dense_features)
        embedded_sparse = self.sparse_arch(sparse_features)
        interacted = self.inter_arch(dense_features=embedded_dense, sparse_features=embedded_sparse)
        return self.over_arch(interacted)


class DLRM(_FourArches):
    """DLRM with dot interaction.

    Args:
        embedding_bag_collection: the sparse tables (one embedding dim for all).
        dense_in_features: width of the dense input.
        dense_arch_layer_sizes: bottom MLP widths; the last must equal the embedding dim.
        over_arch_layer_sizes: top MLP widths; the last is the output width.
        dense_device: where the dense parameters live.

    ``forward(dense_features [B, in], sparse_features KJT) -> logits [B, out]``.
    """

    def __init__(
        self,
        embedding_bag_collection: EmbeddingBagCollection,
        dense_in_features: int,
        dense_arch_layer_sizes: list[int],
        over_arch_layer_sizes: list[int],
        dense_device: torch.device | None = None,
    ) -> None:
        super().__init__()
        embedding_dim = _common_embedding_dim(embedding_bag_collection, type(self).__name__)
        if dense_arch_layer_sizes[-1] != embedding_dim:
            raise ValueError(
                f"embedding_bag_collection dimension ({embedding_dim}) and final dense "
                f"arch layer size ({dense_arch_layer_sizes[-1]}) must match."
            )
        self._cuda_graph_enabled: bool = False
        self.sparse_arch: SparseArch = SparseArch(embedding_bag_collection)
        num_sparse = len(self.sparse_arch.sparse_feature_names)
        self.dense_arch = DenseArch(dense_in_features, dense_arch_layer_sizes, dense_device)
        self.inter_arch: nn.Module = InteractionArch(num_sparse_features=num_sparse)
        over_in = embedding_dim + choose(num_sparse, 2) + num_sparse
        self.over_arch = OverArch(over_in, over_arch_layer_sizes, dense_device)

    def compile_dense_path(self, compile_mode: str = "reduce-overhead") -> None:
        """``torch.compile`` the dense, interaction and over arches (once)."""
        if self._cuda_graph_enabled:
            return
        self.dense_arch = torch.compile(self.dense_arch, mode=compile_mode)
        self.inter_arch = torch.compile(self.inter_arch, mode=compile_mode)
        self.over_arch = torch.compile(self.over_arch, mode=compile_mode)
        self._cuda_graph_enabled = True


class DLRM_Projection(DLRM):
    """DLRM whose interaction is :class:`InteractionProjectionArch`; both branch widths must
    end in a multiple of the embedding dim."""

    def __init__(
        self,
        embedding_bag_collection: EmbeddingBagCollection,
        dense_in_features: int,
        dense_arch_layer_sizes: list[int],
        over_arch_layer_sizes: list[int],
        interaction_branch1_layer_sizes: list[int],
        interaction_branch2_layer_sizes: list[int],
        dense_device: torch.device | None = None,
    ) -> None:
        super().__init__(
            embedding_bag_collection,
            dense_in_features,
            dense_arch_layer_sizes,
            over_arch_layer_sizes,
            dense_device,
        )
        D = self.sparse_arch.D
        num_sparse = len(self.sparse_arch.sparse_feature_names)
        branch_in = num_sparse * D + dense_arch_layer_sizes[-1]
        branches = []
        for i, sizes in enumerate((interaction_branch1_layer_sizes, interaction_branch2_layer_sizes)):
            if sizes[-1] % D != 0:
                raise ValueError(
                    f"Final interaction branch{i + 1} layer size ({sizes[-1]}) is not a "
                    f"multiple of embedding size ({D})"
                )
            branches.append(DenseArch(branch_in, sizes, dense_device))
        self.inter_arch = InteractionProjectionArch(num_sparse, branches[0], branches[1])
        projected = (interaction_branch1_layer_sizes[-1] // D) * (
            interaction_branch2_layer_sizes[-1] // D
        )
        self.over_arch = OverArch(D + projected, over_arch_layer_sizes, dense_device)


class DLRM_DCN(DLRM):
    """DLRM whose interaction is a :class:`LowRankCrossNet` over the ``(F + 1) * D`` stack."""

    def __init__(
        self,
        embedding_bag_collection: EmbeddingBagCollection,
        dense_in_features: int,
        dense_arch_layer_sizes: list[int],
        over_arch_layer_sizes: list[int],
        dcn_num_layers: int,
        dcn_low_rank_dim: int,
        dense_device: torch.device | None = None,
    ) -> None:
        super().__init__(
            embedding_bag_collection,
            dense_in_features,
            dense_arch_layer_sizes,
            over_arch_layer_sizes,
            dense_device,
        )
        D = self.sparse_arch.D
        num_sparse = len(self.sparse_arch.sparse_feature_names)
        crossnet = LowRankCrossNet(
            in_features=(num_sparse + 1) * D, num_layers=dcn_num_layers, low_rank=dcn_low_rank_dim
        )
        self.inter_arch = InteractionDCNArch(num_sparse_features=num_sparse, crossnet=crossnet)
        self.over_arch = OverArch((num_sparse + 1) * D, over_arch_layer_sizes, dense_device)


class DLRMTrain(nn.Module):
    """Training wrapper: ``forward(batch) -> (loss, (loss, logits, labels))`` with mean
    binary cross-entropy on the squeezed logits (all three detached in the second item)."""

    def __init__(self, dlrm_module: DLRM) -> None:
        super().__init__()
        self.model = dlrm_module
        self.loss_fn: nn.Module = nn.BCEWithLogitsLoss()

    def forward(
        self, batch: Batch
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        logits = self.model(batch.dense_features, batch.sparse_features).squeeze(-1)
        loss = self.loss_fn(logits, batch.labels.float())
        return loss, (loss.detach(), logits.detach(), batch.labels.detach())


class DLRMWrapper(DLRM):
    """DLRM over a ``ModelInput``-like batch (``float_features``, ``idlist_features``,
    ``label``): training returns ``(BCE-with-logits loss, logits)``, eval the logits."""

    def forward(self, model_input) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
        pred = super().forward(model_input.float_features, model_input.idlist_features)
        return _model_input_output(pred, model_input, self.training)


def _model_input_output(
    pred: torch.Tensor, model_input: Any, training: bool
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """What TorchRec's ``*Wrapper`` models return for ``pred``, the wrapped model's output:
    in training ``(BCE-with-logits of pred.squeeze() against model_input.label, pred)``, in
    eval ``pred`` (the label is not read)."""
    if training:
        loss = nn.functional.binary_cross_entropy_with_logits(pred.squeeze(), model_input.label)
        return loss, pred
    return pred


__all__ = [
    "DLRM",
    "DLRMTrain",
    "DLRMWrapper",
    "DLRM_DCN",
    "DLRM_Projection",
    "DenseArch",
    "InteractionArch",
    "InteractionDCNArch",
    "InteractionProjectionArch",
    "ModelConfigError",
    "OverArch",
    "SparseArch",
    "choose",
]
