"""TorchRec's ``torchrec.types``: small mixins shared by modules, and ``DataType``.

``DataType`` is defined here, on the ground floor, and re-exported by
``recsys_core.modules.embedding_configs`` (as TorchRec does: one enum, so ``is`` holds).
"""

from __future__ import annotations

import abc
from enum import Enum, unique
from typing import Any

import torch
from torch import nn


class ValueStrEnum(Enum):
    """An enum whose ``str()`` is its value, as TorchRec's enums print (a base for the enums
    here and in ``recsys_core.plan.types``; with a ``str`` mixin it stays a str enum)."""

    def __str__(self) -> str:
        return self.value


def enum_member(enum: type[Enum], value: Any) -> Any:
    """``value`` as a member of ``enum``: a member, another enum's member with the same value
    (FBGEMM's and TorchRec's enums), or a raw value; None where it is none of them (the caller
    raises, naming what it configures)."""
    if isinstance(value, enum):
        return value
    try:
        return enum(getattr(value, "value", value))
    except ValueError:
        return None


@unique
class DataType(ValueStrEnum):
    """Storage precision of an embedding table (TorchRec's members and order; INT64/INT32
    name id dtypes, NFP8 an 8-bit float storage of quantized inference)."""

    FP32 = "FP32"
    FP16 = "FP16"
    BF16 = "BF16"
    INT64 = "INT64"
    INT32 = "INT32"
    INT8 = "INT8"
    UINT8 = "UINT8"
    INT4 = "INT4"
    INT2 = "INT2"
    NFP8 = "NFP8"


class CacheMixin(abc.ABC):
    """A module that caches computation and can drop that cache."""

    @abc.abstractmethod
    def clear_cache(self) -> None:
        """Forget everything cached."""


class CopyMixIn(abc.ABC):
    """A module that decides how ``DistributedModelParallel`` copies it to a device."""

    @abc.abstractmethod
    def copy(self, device: torch.device) -> nn.Module:
        """Return this module for ``device``."""


class ModuleCopyMixin(CopyMixIn):
    """Copy by moving: ``module.to(device)``."""

    def copy(self, device: torch.device) -> nn.Module:
        assert isinstance(self, nn.Module), "ModuleCopyMixin is for nn.Module subclasses"
        return self.to(device)


class ModuleNoCopyMixin(CopyMixIn):
    """Never copied: the same module is used on every device."""

    def copy(self, device: torch.device) -> nn.Module:
        assert isinstance(self, nn.Module), "ModuleNoCopyMixin is for nn.Module subclasses"
        return self


__all__ = ["CacheMixin", "CopyMixIn", "DataType", "ModuleCopyMixin", "ModuleNoCopyMixin"]
