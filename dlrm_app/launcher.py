"""The ``dlrm-app`` entry point (``python -m dlrm_app`` and the console script), free of heavy
imports: worker processes re-import the program's main script when they start
(multiprocessing's forkserver and spawn do, for the preprocessing workers), and through this
module they do so in milliseconds instead of importing torch and the whole command line."""

from __future__ import annotations

from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from dlrm_app.cli import main as cli_main

    return cli_main(argv)
