"""Regroup pooled embeddings into named groups (TorchRec's ``torchrec.modules.regroup``).

``KTRegroupAsDict(groups=[["a", "c"], ["b"]], keys=["user", "item"])`` maps keyed tensors
holding a, b, c to ``{"user": cat(a, c), "item": b}``. The layout (which input holds each key,
and its width) is learned on the first eager call and reused; ``clear_cache()`` forgets it
(call it when the inputs' layout changes). A traced graph keeps the layout it was traced with.
"""


import torch

from recsys_core.modules.embedding_configs import data_type_to_dtype
from recsys_core.sparse import KeyedTensor
from recsys_core.sparse._fx import is_fx_tracing
from recsys_core.sparse.keyed_tensor import _regroup
from recsys_core.types import CacheMixin, DataType


@torch.fx.wrap
def _get_kts_values(kts: list[KeyedTensor]) -> list[torch.Tensor]:
    return [kt.values() for kt in kts]


# KeyedTensor's own regroup, a leaf of fx graphs (called here by this module's name for it)
torch.fx.wrap("_regroup")


@torch.fx.wrap
def _to_tensor_dict(keys: list[str], values: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: values[i] for i, key in enumerate(keys)}


@torch.fx.wrap
def _split_to_tensor_dict(keys: list[str], values: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: values[i] for i, key in enumerate(keys)}


class PermuteMultiEmbedding(torch.nn.Module):
    """Runs a regroup plan (``_kt_regroup_arguments``' output) on a list of value tensors.

    Until :meth:`init_tensors` gives it a plan, it returns its input unchanged. Each plan row
    ``[in_tensor, out_group, in_start, out_start, length, jump]`` copies one key's columns.
    """

    _rows: list[list[int]]

    def __init__(self, groups: list[list[str]], multi_device: bool = False) -> None:
        super().__init__()
        self._groups = groups
        self.register_buffer("_permutes", torch.empty(0), persistent=False)
        self.register_buffer("_in_shapes", torch.empty(0), persistent=False)
        self.register_buffer("_out_shapes", torch.empty(0), persistent=False)
        self._out_lengths: list[int] | None = None
        self._rows = torch.jit.annotate(list[list[int]], [])
        self._multi_device = multi_device

    def init_tensors(
        self,
        permute: torch.Tensor,
        in_shapes: torch.Tensor,
        out_shapes: torch.Tensor,
        out_lengths: list[int],
    ) -> None:
        self._permutes = permute
        self._in_shapes = in_shapes
        self._out_shapes = out_shapes
        self._out_lengths = out_lengths
        self._rows = permute.cpu().tolist()

    @torch.jit.export
    def set_device(self, device: str) -> None:
        self._permutes = self._permutes.to(device)
        self._in_shapes = self._in_shapes.to(device)
        self._out_shapes = self._out_shapes.to(device)

    def forward(self, values: list[torch.Tensor]) -> list[torch.Tensor]:
        out_lengths = self._out_lengths
        if out_lengths is None:
            return values
        parts: list[list[torch.Tensor]] = [[] for _ in range(len(out_lengths))]
        for row in self._rows:
            parts[row[1]].append(values[row[0]].narrow(1, row[2], row[4]))
        return [torch.cat(p, dim=1) for p in parts]


class KTRegroupAsDict(torch.nn.Module, CacheMixin):
    """Regroups a list of ``KeyedTensor`` into ``{keys[i]: cat(groups[i])}``.

    Args:
        groups: key names per output group (a key may be used in several groups or none).
        keys: the output name of each group (``len(keys) == len(groups)``).
        emb_dtype: cast the outputs to this ``DataType`` (None: keep the input dtype).
        multi_device: accepted for TorchRec compatibility (the layout here is plain Python
            data, valid on every device).
    """

    _in_keys: list[list[str]]
    _in_lengths: list[list[int]]
    _is_inited: bool

    def __init__(
        self,
        groups: list[list[str]],
        keys: list[str],
        emb_dtype: DataType | None = None,
        multi_device: bool = False,
    ) -> None:
        super().__init__()
        if len(groups) != len(keys):
            raise ValueError(
                f"KTRegroupAsDict: groups and keys should have same length, got "
                f"{len(groups)} groups and {len(keys)} keys"
            )
        self._groups = groups
        self._keys = keys
        self._emb_dtype = emb_dtype
        self._multi_device = multi_device
        self._is_inited = False
        self._dim: int = 1
        self._in_keys = torch.jit.annotate(list[list[str]], [])
        self._in_lengths = torch.jit.annotate(list[list[int]], [])

    def embedding_cast(self, embs: list[torch.Tensor]) -> list[torch.Tensor]:
        if self._emb_dtype is None:
            return embs
        dtype = data_type_to_dtype(self._emb_dtype)
        return [emb.to(dtype=dtype) for emb in embs]

    def forward(self, keyed_tensors: list[KeyedTensor]) -> dict[str, torch.Tensor]:
        if not torch.jit.is_scripting():
            if not is_fx_tracing():
                if not self._is_inited:
                    module_init(self, keyed_tensors)
        values = self.embedding_cast(_get_kts_values(keyed_tensors))
        out = _regroup(values, self._in_keys, self._in_lengths, self._groups, self._dim)
        return _to_tensor_dict(self._keys, out)

    def clear_cache(self) -> None:
        self._is_inited = False


@torch.jit.ignore
@torch.fx.wrap
def module_init(module: KTRegroupAsDict, keyed_tensors: list[KeyedTensor]) -> None:
    """Learn the inputs' layout (keys and widths per keyed tensor) and check they agree."""
    if len(keyed_tensors) == 0:
        raise ValueError("KTRegroupAsDict: empty list of keyed tensors provided")
    if any(kt.device() != keyed_tensors[0].device() for kt in keyed_tensors):
        raise ValueError("KTRegroupAsDict: all inputs should be on the same device")
    if any(kt.key_dim() != keyed_tensors[0].key_dim() for kt in keyed_tensors):
        raise ValueError("KTRegroupAsDict: all inputs should have the same key_dim")
    seen: set[str] = set()
    for kt in keyed_tensors:
        for key in kt.keys():
            if key in seen:
                raise ValueError(f"KTRegroupAsDict: key {key!r} is in more than one input")
            seen.add(key)
    missing = sorted({k for g in module._groups for k in g} - seen)
    if missing:
        raise ValueError(f"KTRegroupAsDict: groups ask for keys no input has: {missing}")
    module._dim = keyed_tensors[0].key_dim()
    module._in_keys = [list(kt.keys()) for kt in keyed_tensors]
    module._in_lengths = [list(kt.length_per_key()) for kt in keyed_tensors]
    module._is_inited = True


__all__ = [
    "KTRegroupAsDict",
    "PermuteMultiEmbedding",
    "module_init",
]
