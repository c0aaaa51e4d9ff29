"""The console script runs as installed, reports what the kernels layer decides, and answers
``--help`` and argument errors without importing torch."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from recsys_core.kernels import fbgemm_available


@pytest.mark.slow
def test_info_json_reports_kernel_choices() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "dlrm_app", "info", "--json"],
        check=True, capture_output=True, text=True,
    ).stdout
    report = json.loads(out)
    kernels = report["fused_kernels"]
    assert kernels["ADAM"].startswith("torch (FBGEMM has no ADAM kernel on cpu")
    if fbgemm_available():
        assert kernels["EXACT_ROWWISE_ADAGRAD"] == "fbgemm"
        assert report["fbgemm_status"] == "ok"
    else:
        assert kernels["EXACT_ROWWISE_ADAGRAD"].startswith("torch")


@pytest.mark.slow
def test_info_with_fbgemm_disabled_uses_torch_everywhere() -> None:
    env = {**os.environ, "RECSYS_CORE_DISABLE_FBGEMM": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "dlrm_app", "info", "--json"],
        check=True, capture_output=True, text=True, env=env,
    ).stdout
    report = json.loads(out)
    assert report["fbgemm_gpu"] is None
    assert "disabled by RECSYS_CORE_DISABLE_FBGEMM" in report["fbgemm_status"]
    assert all(v.startswith("torch") for v in report["fused_kernels"].values())


def test_worker_processes_reimport_the_entry_point_without_torch(tmp_path) -> None:
    """Preprocessing workers (multiprocessing forkserver/spawn) re-run the program's main
    script as ``__mp_main__`` when they start. Through ``dlrm_app.launcher`` that imports no
    torch (1.5 s per worker here before); the console script and ``python -m dlrm_app`` both
    enter there."""
    from pathlib import Path

    import tomllib

    root = Path(__file__).resolve().parents[2]
    scripts = tomllib.loads((root / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["dlrm-app"] == "dlrm_app.launcher:main"
    assert "from dlrm_app.launcher import main" in (root / "dlrm_app" / "__main__.py").read_text()
    # what pip writes for a console script
    script = tmp_path / "dlrm-app"
    script.write_text("import re\nimport sys\nfrom dlrm_app.launcher import main\n"
                      "if __name__ == '__main__':\n    sys.exit(main())\n")
    heavy = ("torch", "numpy", "pyarrow", "dlrm_app.cli", "recsys_core")
    code = (f"import runpy, sys; runpy.run_path({str(script)!r}, run_name='__mp_main__'); "
            f"print([m for m in {heavy!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True).stdout
    assert out.strip() == "[]"


# ---- a CLI that answers at once: parsing imports nothing heavy -------------------------------
HEAVY = ("torch", "numpy", "pyarrow", "recsys_core", "matplotlib")
"""What ``--help`` and argument errors must not import (torch alone takes 1.5 s)."""
COMMANDS = ("info", "generate", "preprocess", "preprocess criteo", "preprocess movielens",
            "train", "evaluate", "export", "serve", "report", "demo")


def _run_imports(*argv: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """``python -X importtime -m dlrm_app ARGV``: the process, and the top-level packages it
    imported (from the interpreter's own import log on stderr)."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "dlrm_app", *argv],
                          capture_output=True, text=True, env={**os.environ, "COLUMNS": "100"})
    imported = {line.rsplit("|", 1)[1].strip().split(".")[0]
                for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "dlrm_app" in imported, proc.stderr[-2000:]  # the log was read
    return proc, imported


def _subparser(parser: argparse.ArgumentParser, words: list[str]) -> argparse.ArgumentParser:
    for word in words:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[word]
    return parser


def test_top_level_help_imports_nothing_heavy() -> None:
    proc, imported = _run_imports("--help")
    assert proc.returncode == 0
    for command in ("info", "generate", "preprocess", "train", "evaluate", "export", "serve",
                    "report", "demo"):
        assert command in proc.stdout
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.slow
def test_command_help_lists_its_flags_without_importing_torch(command: str) -> None:
    from dlrm_app.cli import build_parser

    words = command.split()
    proc, imported = _run_imports(*words, "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(f"usage: dlrm-app {command} ")
    flags = [s for a in _subparser(build_parser(), words)._actions for s in a.option_strings]
    assert "--help" in flags
    missing = [f for f in flags if f not in proc.stdout]
    assert not missing, missing
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))


@pytest.mark.parametrize("argv, message", [
    (["train", "--out", "x", "--bogus"], "unrecognized arguments: --bogus"),
    (["train", "--out", "x", "--epochs", "three"], "argument --epochs: invalid int value"),
    (["train", "--out", "x", "--embedding-optimizer", "lamb"], "invalid choice: 'lamb'"),
    (["train", "--data", "d"], "the following arguments are required: --out"),
    (["export"], "the following arguments are required: run, --out"),
    (["preprocess", "criteo", "--format", "parquet", "f.tsv", "--out", "o"], "invalid choice"),
    (["fly"], "invalid choice: 'fly'"),
    ([], "the following arguments are required: command"),
])
@pytest.mark.slow
def test_argument_errors_answer_without_importing_torch(argv: list[str], message: str) -> None:
    proc, imported = _run_imports(*argv)
    assert proc.returncode == 2
    assert message in proc.stderr and proc.stdout == ""
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))


def test_version_answers_without_importing_torch() -> None:
    from importlib.metadata import version

    proc, imported = _run_imports("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"dlrm-app {version('recsys-dlrm')}"
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))


@pytest.mark.parametrize("argv, message", [
    (["preprocess", "criteo", "--out", "{tmp}/o", "{tmp}/day_0.tsv"],
     "dlrm-app preprocess criteo: {tmp}/day_0.tsv: input file not found"),
    (["preprocess", "criteo", "--out", "{tmp}/o", "{tmp}"],
     "dlrm-app preprocess criteo: {tmp}: a directory, not a Criteo file; pass the Criteo TSV "
     "file(s) in it (train.txt or day_N)"),
    (["preprocess", "movielens", "--out", "{tmp}/o", "{tmp}/ml-100k"],
     "dlrm-app preprocess movielens: {tmp}/ml-100k: source folder not found; pass the unpacked "
     "MovieLens folder"),
    (["train", "--data", "{tmp}/data", "--out", "{tmp}/run"],
     "dlrm-app train: {tmp}/data: no such directory; pass the --out of `dlrm-app preprocess` or "
     "`dlrm-app generate`"),
    (["evaluate", "{tmp}/run"], "dlrm-app evaluate: {tmp}/run is not a run directory (no "
     "config.json); pass the --out of `dlrm-app train`"),
    (["export", "{tmp}/run", "--out", "{tmp}/m.pt2"], "dlrm-app export: {tmp}/run is not a run "
     "directory (no config.json); pass the --out of `dlrm-app train`"),
    (["serve", "{tmp}/m.pt2"], "dlrm-app serve: {tmp}/m.pt2: no such model file; create one "
     "with `dlrm-app export`"),
    (["report", "{tmp}/run"], "dlrm-app report: {tmp}/run: no such run directory; pass the "
     "--out of `dlrm-app train`"),
])
def test_a_missing_input_answers_without_importing_torch(argv: list[str], message: str,
                                                         tmp_path) -> None:
    """Each command checks its input paths before its heavy imports (dlrm_app.inputs): a
    mistyped path was answered after 0.5 s (preprocess: numpy, pyarrow) to 4.6 s (torch)."""
    proc, imported = _run_imports(*(a.format(tmp=tmp_path) for a in argv))
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    assert errors == [message.format(tmp=tmp_path)] and proc.stdout == ""
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))


def test_the_parser_reads_each_config_module_once_and_no_version(monkeypatch) -> None:
    """Building the parser parses each module holding configs once for their field docstrings
    (inspect.getsource(cls) parsed config.py again for each of its 13 classes: 0.2 s of every
    start) and does not look the version up (58 ms) unless --version asks."""
    import ast

    from dlrm_app import cli, flags
    from dlrm_app.training import config as train_config

    parsed: list[int] = []
    real_parse = ast.parse
    monkeypatch.setattr(ast, "parse", lambda *a, **k: parsed.append(1) or real_parse(*a, **k))
    monkeypatch.setattr(cli, "_version", lambda: pytest.fail("looked the version up"))
    flags.field_docs.cache_clear()
    flags._module_docs.cache_clear()
    try:
        cli.build_parser()
        # dlrm_app/config.py and dlrm_app/training/config.py, once each
        assert len(parsed) == flags._module_docs.cache_info().currsize == 2
    finally:
        flags.field_docs.cache_clear()
        flags._module_docs.cache_clear()
    assert flags.field_docs(train_config.ScheduleConfig)["epochs"] == \
        "Passes; None: 1 on Criteo, else 3."


def test_train_help_fits_80_lines_of_80_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each flag's help is a line or two; the measurements behind the defaults live in
    docs/training.md ("dlrm-app train flags in detail"), not in --help."""
    from dlrm_app import cli

    monkeypatch.setenv("COLUMNS", "80")
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    text = sub.choices["train"].format_help()
    assert max(len(line) for line in text.splitlines()) <= 80
    assert len(text.splitlines()) <= 80, len(text.splitlines())
