"""The numbers of a run's log as the report and its plots read them: a logged value is a number
only if it is an int or float (not a bool); missing ones are NaN in columns, "n/a" in text."""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def as_float(value: Any) -> float:
    n = number(value)
    return math.nan if n is None else n


def column(records: list[dict[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values of ``key``) of step records, NaN where a record lacks a number."""
    return (np.array([r["step"] for r in records], dtype=np.float64),
            np.array([as_float(r.get(key)) for r in records], dtype=np.float64))


def fmt(value: Any, digits: int = 4) -> str:
    n = number(value)
    return "n/a" if n is None or math.isnan(n) else f"{n:.{digits}f}"
