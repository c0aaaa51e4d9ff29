"""What several benches share (bench/ is a folder of scripts: each imports this as a sibling).

``add_flags``: a bench's plain flags (a number or a string with a default, no help text) from one
table, in place of an ``add_argument`` line apiece.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping


def add_flags(parser: argparse.ArgumentParser, defaults: Mapping[str, int | float | str]) -> None:
    """Adds each flag of ``defaults`` (``{"--batch-size": 4096, ...}``) to ``parser``, in order,
    with that default, parsed as the default's type (int, float or str)."""
    for flag, default in defaults.items():
        if type(default) not in (int, float, str):
            raise TypeError(f"{flag}: default {default!r} is not an int, float or str")
        parser.add_argument(flag, type=type(default), default=default)
