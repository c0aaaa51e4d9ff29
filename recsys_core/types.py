"""TorchRec's ``torchrec.types``: small mixins shared by modules, and ``DataType``.

``DataType`` is the same enum as ``recsys_core.modules.embedding_configs.DataType`` (TorchRec
defines it here and re-exports it there; identity, not a copy, so ``is`` comparisons hold).
"""

from __future__ import annotations

import abc

import torch
from torch import nn

from recsys_core.modules.embedding_configs import DataType


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
