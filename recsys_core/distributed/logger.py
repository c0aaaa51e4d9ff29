"""TorchRec's distributed loggers at its module path (``torchrec.distributed.logger``).

Each is a plain :mod:`logging` logger that does not propagate to the root logger and has no
output of its own (TorchRec's open-source build routes them to ``NullHandler``), so library
messages stay quiet unless a user attaches a handler, e.g.
``static_logger.addHandler(logging.StreamHandler())``; ``unittest``'s ``assertLogs`` sees them.

- ``static_logger``: messages meant once per job (TorchRec: rank 0 only).
- ``all_rank_logger``: messages of every rank.
- ``capped_logger`` / ``one_time_logger`` / ``one_time_rank0_logger``: rate-limited ones.
- ``method_logger`` / ``unfiltered_logger``: what :func:`_torchrec_method_logger` writes.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from torch import distributed as dist

__all__: list[str] = []

_T = TypeVar("_T")
ARG_SIZE_LIMIT = 800000
"""Arguments whose ``str`` is longer than this are left out of a method log record."""


class LazyStr:
    """A message computed only when a handler formats it: ``LazyStr(lambda: f"{costly()}")``."""

    __slots__ = ("_fn", "_str")

    def __init__(self, fn: Callable[[], str]) -> None:
        self._fn = fn
        self._str: str | None = None

    def __str__(self) -> str:
        if self._str is None:
            self._str = self._fn()
        return self._str


def _get_or_create_logger(destination: str) -> logging.Logger:
    """The logger of ``destination`` (named as TorchRec's: ``"<destination>-NullHandler"``),
    DEBUG level, not propagating, with a NullHandler."""
    handler = logging.NullHandler()
    logger = logging.getLogger(f"{destination}-{type(handler).__name__}")
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    if not logger.handlers:
        logger.addHandler(handler)
    return logger


unfiltered_logger = _get_or_create_logger("UnfilteredLogger")
method_logger = _get_or_create_logger("MethodLogger")
static_logger = _get_or_create_logger("SingleRankStaticLogger")
all_rank_logger = _get_or_create_logger("AllRankStaticLogger")
capped_logger = _get_or_create_logger("CappedLogger")
one_time_logger = _get_or_create_logger("Cap1Logger")
one_time_rank0_logger = _get_or_create_logger("Cap01Logger")


def _get_msg_dict(func_name: str, **kwargs: Any) -> dict[str, Any]:
    """The record of one call: the function's name and, under torch.distributed, the group,
    world size and rank."""
    msg: dict[str, Any] = {"func_name": func_name}
    if dist.is_available() and dist.is_initialized():
        group = kwargs.get("group") or kwargs.get("process_group")
        msg["group"] = f"{group}"
        msg["world_size"] = f"{dist.get_world_size(group)}"
        msg["rank"] = f"{dist.get_rank(group)}"
    return msg


def _get_input_from_func(func: Callable[..., Any], msg_dict: dict[str, Any], *args: Any,
                         **kwargs: Any) -> str:
    """The call's arguments (defaults included) as a string; numbers as they are, the rest as
    ``str`` (over :data:`ARG_SIZE_LIMIT` characters: only its size)."""
    try:
        signature = inspect.signature(func)
        bound = signature.bind_partial(*args, **kwargs)
        bound.apply_defaults()
        inputs: dict[str, Any] = {p.name: p.default for p in signature.parameters.values()}
        for key, value in bound.arguments.items():
            if key == "self" and func.__name__ == "__init__":
                msg_dict["func_name"] = f"{type(value).__name__}.{msg_dict['func_name']}"
            if isinstance(value, int | float):
                inputs[key] = value
            else:
                text = str(value)
                inputs[key] = (text if len(text) <= ARG_SIZE_LIMIT else
                               f"Argument removed due to size limit. Original size: {len(text)}")
        return str(inputs)
    except Exception as error:  # a logging failure never breaks the call it describes
        unfiltered_logger.error(f"recsys_core logger: cannot read the inputs: {error}")
        return f"Error in _get_input_from_func: {error}"


def _torchrec_method_logger(**wrapper_kwargs: Any) -> Callable[[Callable[..., _T]],
                                                               Callable[..., _T]]:
    """Decorator logging each call's inputs and output to ``method_logger`` (INFO), or its
    inputs and error (ERROR) before re-raising it."""

    def decorator(func: Callable[..., _T]) -> Callable[..., _T]:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> _T:
            msg = _get_msg_dict(func.__name__, **kwargs)
            try:
                result = func(*args, **kwargs)
            except BaseException as error:
                msg["error"] = f"{error}"
                msg["input"] = _get_input_from_func(func, msg, *args, **kwargs)
                method_logger.error(msg)
                raise
            try:
                msg["input"] = _get_input_from_func(func, msg, *args, **kwargs)
                msg["output"] = str(result)
                method_logger.info(msg)
            except Exception as error:
                unfiltered_logger.fatal(f"recsys_core logger: method_logger failed: {error}")
            return result

        return wrapper

    return decorator
