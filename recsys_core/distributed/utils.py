"""TorchRec's ``torchrec.distributed.utils`` helpers: small pure functions on names, optionals,
state dicts and devices, and :class:`CopyableMixin` (a module that copies itself to a device)."""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, TypeVar

import torch
from torch import nn

_T = TypeVar("_T")


def get_device_type() -> str:
    """"cuda" when CUDA is available, else "cpu"."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def get_class_name(obj: object) -> str:
    return "None" if obj is None else type(obj).__name__


def assert_instance(obj: object, t: type[_T]) -> _T:
    if not isinstance(obj, t):
        raise AssertionError(f"Got {get_class_name(obj)}, expected {t.__name__}")
    return obj


def none_throws(optional: _T | None, message: str = "Unexpected `None`") -> _T:
    """``optional`` itself; an AssertionError (TorchRec's type) with ``message`` if None."""
    if optional is None:
        raise AssertionError(message)
    return optional


def append_prefix(prefix: str, name: str) -> str:
    """``prefix.name``, or whichever of the two is not empty."""
    return f"{prefix}.{name}" if prefix and name else prefix + name


def filter_state_dict(state_dict: Mapping[str, Any], name: str) -> OrderedDict[str, Any]:
    """The entries under ``name.``, with that prefix removed."""
    return OrderedDict(
        (key[len(name) + 1 :], value) for key, value in state_dict.items()
        if key.startswith(name + ".")
    )


def add_prefix_to_state_dict(state_dict: dict[str, Any], prefix: str) -> None:
    """Prefix every key (and the ``_metadata`` keys) in place."""
    for key in sorted(k for k in state_dict if k != "_metadata"):
        state_dict[prefix + key] = state_dict.pop(key)
    metadata = state_dict.get("_metadata")
    if metadata is not None:
        for key in [k for k in metadata if k]:
            metadata[prefix + key] = metadata.pop(key)


class CopyableMixin(nn.Module):
    """A module that copies itself to a device: ``copy(device)`` returns a deep copy whose
    CPU parameters and buffers are moved to ``device`` (tensors on other devices stay)."""

    def copy(self, device: torch.device) -> nn.Module:
        clone = copy.deepcopy(self)
        cpu = torch.device("cpu")
        return clone._apply(lambda t: t.to(device) if t.device == cpu else t)


__all__ = [
    "CopyableMixin",
    "add_prefix_to_state_dict",
    "append_prefix",
    "assert_instance",
    "filter_state_dict",
    "get_class_name",
    "get_device_type",
    "none_throws",
]
