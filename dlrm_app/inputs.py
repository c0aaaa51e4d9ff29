"""The checks of a command's input paths that need nothing heavy.

Each command of ``dlrm-app`` runs its check before it imports torch, numpy or pyarrow, so a
mistyped path is answered at once: ``preprocess criteo`` on a missing file in 0.1 s instead of
0.6 s (numpy and pyarrow first), ``train --data`` on a missing dataset instead of 3.6 s (torch
first). The library functions run the same checks, the one place their messages are worded:
they are called without the command line too.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Sequence
from pathlib import Path

DATASET_JSON = "dataset.json"
"""The file that makes a directory a dataset (``dlrm_app.data.schema``)."""
MOVIELENS_FILES = ("u.data", "ratings.dat", "ratings.csv")
"""A MovieLens release's ratings file: one of these is in its folder."""


def check_criteo_inputs(paths: Sequence[str | os.PathLike[str]]) -> None:
    """Each path is a file: a folder (MovieLens' named) or a missing path is a ValueError."""
    for p in map(Path, paths):
        if p.is_dir():
            hint = ("it holds MovieLens files: use `dlrm-app preprocess movielens`"
                    if any((p / name).exists() for name in MOVIELENS_FILES)
                    else "pass the Criteo TSV file(s) in it (train.txt or day_N)")
            raise ValueError(f"{p}: a directory, not a Criteo file; {hint}")
        if not p.is_file():
            raise ValueError(f"{p}: input file not found")


def check_movielens_source(src: str | os.PathLike[str]) -> None:
    """``src`` is a folder (a MovieLens release unpacked)."""
    src = Path(src)
    if src.is_file():
        raise ValueError(f"{src} is a file; pass the unpacked MovieLens folder that holds it "
                         f"({src.parent}), with u.data, ratings.dat or ratings.csv inside")
    if not src.is_dir():
        raise ValueError(f"{src}: source folder not found; pass the unpacked MovieLens folder")


def check_dataset(directory: str | os.PathLike[str]) -> None:
    """``directory`` holds a ``dataset.json`` (its contents are read by ``DatasetSpec.load``)."""
    directory = Path(directory)
    if not (directory / DATASET_JSON).is_file():
        raise ValueError(missing_dataset(directory))


def missing_dataset(directory: Path) -> str:
    """Why ``directory`` is no dataset, and the fix: a near name that is one (a typo), its
    parent missing, or which command makes one."""
    if not directory.exists():
        parent = directory.parent
        near = sorted(p.name for p in parent.iterdir() if (p / DATASET_JSON).is_file()
                      ) if parent.is_dir() else []
        close = difflib.get_close_matches(directory.name, near, n=1)
        if close:
            return (f"{directory}: no such directory; did you mean {parent / close[0]}? "
                    "(it holds a dataset)")
        return (f"{directory}: no such directory; pass the --out of `dlrm-app preprocess` or "
                "`dlrm-app generate`" + (f" (datasets in {parent}: {', '.join(near)})"
                                          if near else ""))
    return (f"{directory / DATASET_JSON}: not found, so {directory} is no dataset; make one "
            f"with `dlrm-app preprocess ... --out {directory}` or `dlrm-app generate --out "
            f"{directory}`")


def check_run(run: str | os.PathLike[str]) -> Path:
    """``run`` is a training run's directory (its ``config.json``); returns that file."""
    config = Path(run) / "config.json"
    if not config.is_file():
        raise ValueError(f"{run} is not a run directory (no config.json); pass the --out of "
                         f"`dlrm-app train`")
    return config


def check_run_to_report(run: str | os.PathLike[str]) -> None:
    """``run`` is a folder with what a report reads (its config or its metrics log)."""
    path = Path(run)
    if not path.is_dir():
        raise ValueError(f"{path}: no such run directory; pass the --out of `dlrm-app train`")
    if not (path / "config.json").is_file() and not (path / "metrics.jsonl").is_file():
        raise ValueError(f"{path}: neither config.json nor metrics.jsonl is there; pass the "
                         "--out directory of `dlrm-app train`")


def check_model_file(path: str | os.PathLike[str]) -> None:
    """``path`` is a file (what is in it is checked when it is loaded, after ``serve`` has
    bound its port: a busy port is said first)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such model file; create one with `dlrm-app export`")
