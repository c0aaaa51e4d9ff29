"""The commands' one JSON line on stdout: always valid JSON (torch-free, like the CLI).

A metric that cannot be computed (an AUC on rows of one label, any metric of no rows) is
``null`` there, with the reason in the metrics' ``undefined`` entry, never ``NaN``.
"""

from __future__ import annotations

import json
import math
from typing import Any


def dumps(value: Any) -> str:
    """``value`` as one line of valid JSON (see :func:`json_ready`)."""
    return json.dumps(json_ready(value), allow_nan=False)


def json_ready(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None (JSON has no NaN), and in each
    metrics dict (one with ``auc`` and ``label_rate``) an ``undefined`` entry saying why each
    of its None values could not be computed."""
    if isinstance(value, dict):
        out = {k: json_ready(v) for k, v in value.items()}
        if "auc" in value and "label_rate" in value:
            reasons = {k: _why_undefined(k, value) for k, v in value.items()
                       if isinstance(v, float) and not math.isfinite(v)}
            if reasons:
                out["undefined"] = reasons
        return out
    if isinstance(value, list | tuple):
        return [json_ready(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _why_undefined(key: str, metrics: dict[str, Any]) -> str:
    rows, rate = metrics.get("num_examples", 0), metrics.get("label_rate")
    if not rows:
        return "no rows"
    if rate in (0.0, 1.0):
        label = int(rate)
        if key == "calibration":
            return f"all {rows} rows carry label {label}: calibration needs a positive label"
        return f"all {rows} rows carry label {label}: {key} needs both labels"
    return "not a finite number"
