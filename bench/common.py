"""What several benches share (bench/ is a folder of scripts: each imports this as a sibling).

``add_flags``: a bench's plain flags (a number or a string with a default, no help text) from one
table, in place of an ``add_argument`` line apiece; ``fill_unset``: the flags left unset taken
from a table of sizes (a bench's --quick or full one). ``cpu_model``: the CPU's name that the
benches' lines carry (``lscpu`` and ``lscpu_field`` for those that read more of lscpu's output).
``log`` and ``load_avg``: a progress line on stderr, the host's load beside a timing.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Mapping


def add_flags(parser: argparse.ArgumentParser, defaults: Mapping[str, int | float | str]) -> None:
    """Adds each flag of ``defaults`` (``{"--batch-size": 4096, ...}``) to ``parser``, in order,
    with that default, parsed as the default's type (int, float or str)."""
    for flag, default in defaults.items():
        if type(default) not in (int, float, str):
            raise TypeError(f"{flag}: default {default!r} is not an int, float or str")
        parser.add_argument(flag, type=type(default), default=default)


def fill_unset(args: argparse.Namespace, defaults: Mapping[str, object]) -> None:
    """Sets each attribute of ``args`` named in ``defaults`` that is None (its flag not given)
    to its value there."""
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def log(message: str) -> None:
    """A progress line on stderr (stdout holds the JSON lines)."""
    print(message, file=sys.stderr, flush=True)


def load_avg() -> float:
    """The host's 1-minute load average: other jobs on the cores (noise in the timings)."""
    return round(os.getloadavg()[0], 2)


def lscpu() -> str:
    """lscpu's output ("" where it does not run)."""
    try:
        return subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def lscpu_field(out: str, name: str) -> str | None:
    """The value of the first ``name:`` line of lscpu's output ``out`` (None: there is none)."""
    return next((line.split(":", 1)[1].strip() for line in out.splitlines()
                 if line.startswith(f"{name}:")), None)


def cpu_model() -> str:
    """The CPU's model name, as lscpu prints it ("unknown" where it does not)."""
    model = lscpu_field(lscpu(), "Model name")
    return "unknown" if model is None else model
