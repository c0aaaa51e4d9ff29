"""TorchRec's ``torchrec.distributed.memory_stashing`` path.

TorchRec's memory stashing moves embedding weights, optimizer state and activations between GPU
memory and host memory on dedicated CUDA streams while a model is idle. This library does not
implement it: :meth:`MemoryStashingManager.is_enabled` is False, and the calls that would start
it raise an error that says so."""

from __future__ import annotations

from typing import Any, NoReturn


def _refuse(what: str) -> NoReturn:
    raise RuntimeError(
        f"MemoryStashingManager.{what}: memory stashing (moving embedding weights, optimizer "
        "state and activations to host memory on CUDA streams) is not implemented by recsys_core; "
        "leave it disabled (e.g. enable_activation_stashing=False)"
    )


class MemoryStashingManager:
    """Class-level switchboard of memory stashing (TorchRec's names); never enabled here."""

    @classmethod
    def is_enabled(cls) -> bool:
        return False

    @classmethod
    def reset(cls) -> None:
        return None

    @classmethod
    def set_streams(cls, *args: Any, **kwargs: Any) -> None:
        _refuse("set_streams")

    @classmethod
    def _stash_tensors(cls, *args: Any, **kwargs: Any) -> None:
        _refuse("_stash_tensors")

    @classmethod
    def stash_embedding_weights(cls, *args: Any, **kwargs: Any) -> None:
        _refuse("stash_embedding_weights")


__all__ = ["MemoryStashingManager"]
