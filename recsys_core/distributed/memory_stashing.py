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
    """Class-level switchboard of memory stashing (TorchRec's names); never enabled here.

    The planner's choice of tables to stash (TorchRec 1.9's ``set_stashed_tables`` /
    ``get_stashed_tables`` / ``resolve_stash_weights``) is kept, as data: nothing is stashed."""

    _stashed_tables: set[str] | None = None

    @classmethod
    def is_enabled(cls) -> bool:
        return False

    @classmethod
    def reset(cls) -> None:
        cls._stashed_tables = None

    @classmethod
    def set_stashed_tables(cls, tables: set[str] | None) -> None:
        """The tables selected for stashing, or None to clear the selection."""
        cls._stashed_tables = None if tables is None else set(tables)

    @classmethod
    def get_stashed_tables(cls) -> set[str] | None:
        return cls._stashed_tables

    @classmethod
    def resolve_stash_weights(cls, table_name: str, config: Any) -> bool:
        """Whether ``table_name`` is selected for stashing: by the selected set when there is
        one, else by the config's ``stash_weights``."""
        if cls._stashed_tables is not None:
            return table_name in cls._stashed_tables
        return bool(getattr(config, "stash_weights", False))

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
