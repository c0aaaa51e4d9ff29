"""``dlrm-app``: the application's command line.

Every subcommand is defined here; each parses its arguments into its typed config
(``dlrm_app.config``: one dataclass per command) and calls library functions (``recsys_core``
never sees argparse). Every argument is generated from a config field (``dlrm_app.flags``): a
new field is one edit, with its docstring as the help line and its default shown.

Parsing imports nothing heavy (the configs and flags are plain Python): ``--help`` and argument
errors answer at once. Each command checks its input paths first (``dlrm_app.inputs``: a
missing file or run answers at once too), then imports torch, pyarrow and ``recsys_core``.
"""

from __future__ import annotations

import argparse
import errno
import math
import os
import platform
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from dlrm_app import inputs, jsonline
from dlrm_app.config import (
    CriteoConfig,
    DemoConfig,
    EvaluateConfig,
    ExportConfig,
    GenerateConfig,
    InfoConfig,
    MovieLensConfig,
    ReportConfig,
    ServeCommand,
)
from dlrm_app.flags import (
    HelpFormatter,
    add_config_flags,
    config_from_values,
    config_values,
    short_usage,
)
from dlrm_app.training import resume
from dlrm_app.training.config import TrainCommand, TrainConfig

if TYPE_CHECKING:
    import torch

    from dlrm_app.data.schema import DatasetSpec


def environment_report(device: torch.device) -> dict[str, object]:
    """What this machine offers: versions, FBGEMM status, the kernel each optimizer gets."""
    import torch

    from recsys_core.kernels import fbgemm_status, fbgemm_version
    from recsys_core.kernels.config import EmbOptimType, FusedOptimizerConfig, KernelBackend
    from recsys_core.kernels.tbe import fbgemm_missing, select_backend

    kernels = {}
    for opt in EmbOptimType:
        if opt is EmbOptimType.SGD:
            continue  # alias of EXACT_SGD
        config = FusedOptimizerConfig(optimizer=opt)
        backend = select_backend(KernelBackend.AUTO, device, config, dims=[128])
        reason = fbgemm_missing(device, config, dims=[128])
        kernels[opt.name] = backend.value + (f" ({reason})" if reason else "")
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "fbgemm_gpu": fbgemm_version(),
        "fbgemm_status": fbgemm_status(),
        "cuda_available": torch.cuda.is_available(),
        "device": str(device),
        "fused_kernels": kernels,
    }


def _cmd_info(args: InfoConfig) -> int:
    import torch

    report = environment_report(torch.device(args.device))
    if args.json:
        print(jsonline.dumps(report))
        return 0
    for key, value in report.items():
        if isinstance(value, dict):
            print(f"{key}:")
            for k, v in value.items():
                print(f"  {k:<24} {v}")
        else:
            print(f"{key:<16} {value}")
    return 0


def _per_feature(text: str, count: int, kind: type, flag: str,
                 command: str = "generate") -> list:
    """One value for every feature, or a comma list with exactly ``count`` values."""
    try:
        values = [kind(v) for v in text.split(",")]
    except ValueError:
        raise SystemExit(f"dlrm-app {command}: {flag} {text!r} is not a {kind.__name__} "
                         f"or a comma list of them") from None
    if len(values) == 1:
        return values * count
    if len(values) != count:
        raise SystemExit(f"dlrm-app {command}: {flag} has {len(values)} values but there are "
                         f"{count} sparse features; pass one value or {count}")
    return values


def _cmd_generate(args: GenerateConfig) -> int:
    from dlrm_app.data.synthetic import generate

    cardinalities = _per_feature(args.cardinalities, args.num_sparse, int, "--cardinalities")
    pooling = _per_feature(args.pooling_factors, args.num_sparse, float, "--pooling-factors")
    start = time.perf_counter()
    spec = generate(
        args.out, rows=args.rows, num_dense=args.num_dense, cardinalities=cardinalities,
        pooling_factors=pooling, zipf_alpha=args.zipf_alpha, seed=args.seed,
        rows_per_shard=args.rows_per_shard, row_group_size=args.row_group_size,
        days=args.days, drift=args.drift,
    )
    seconds = time.perf_counter() - start
    print(jsonline.dumps({
        "out": str(args.out),
        "rows": sum(s.rows for s in spec.splits),
        "shards": sum(len(s.shards) for s in spec.splits),
        "seconds": round(seconds, 3),
        "rows_per_s": round(args.rows / seconds),
        "teacher_auc": spec.teacher_auc,
    }))
    return 0


def _tables_report(spec: DatasetSpec) -> None:
    """The table sizes and the memory they need, for a person (stderr; stdout stays JSON); a
    warning for each split whose rows all carry one label."""
    from dlrm_app.data.tables import format_table_summary

    print(format_table_summary(spec.tables or {}), file=sys.stderr)
    for split in spec.splits:
        if (note := split.one_label_note()) is not None:
            refused = " (`dlrm-app train` refuses it)" if split.name == "validation" else ""
            print(f"warning: {note}{refused}; preprocess more rows (more of the input) so "
                  "that every split has both labels", file=sys.stderr)


def _cut_short(path: Path) -> str | None:
    """A warning when an uncompressed input does not end with a line end: a file cut short
    (``head -c``, an interrupted copy) ends in a partial row, which would be read as a row
    whose missing fields are empty, like the rows of a file with trailing fields stripped."""
    if path.suffix == ".gz" or not path.is_file() or path.stat().st_size == 0:
        return None
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) == b"\n":
            return None
    return (f"warning: {path} does not end with a line end (cut short?): its last line is read "
            "as a row, missing fields empty; if the file was cut, drop that line")


def _cmd_preprocess_criteo(args: CriteoConfig) -> int:
    inputs.check_criteo_inputs(args.inputs)  # before numpy and pyarrow: a typo answers at once
    hashed = caps = None
    if args.num_embeddings_per_feature is not None:
        hashed = _per_feature(args.num_embeddings_per_feature, 26, int,
                              "--num-embeddings-per-feature", "preprocess criteo")
    if args.max_embeddings_per_feature is not None:
        caps = _per_feature(args.max_embeddings_per_feature, 26, int,
                            "--max-embeddings-per-feature", "preprocess criteo")
    for path in map(Path, args.inputs):
        if (note := _cut_short(path)) is not None:
            print(note, file=sys.stderr)
    from dlrm_app.data.criteo import preprocess_criteo

    start = time.perf_counter()
    spec = preprocess_criteo(
        args.inputs, args.out, fmt=args.format, num_embeddings_per_feature=hashed,
        frequency_threshold=args.frequency_threshold, max_embeddings_per_feature=caps,
        rows_per_shard=args.rows_per_shard, row_group_size=args.row_group_size,
        on_bad_row=args.on_bad_row, like=args.like, one_split=args.one_split,
        workers=args.workers, id_mapping=args.id_mapping,
        max_bad_row_fraction=args.max_bad_row_fraction, days=args.days, add_day=args.add_day)
    _tables_report(spec)
    if skipped := spec.skipped_rows:
        print(f"skipped {skipped} bad row{'s' if skipped > 1 else ''} (--on-bad-row skip); "
              f"{args.out}/dataset.json records the count", file=sys.stderr)
    seconds = time.perf_counter() - start
    rows = sum(s.rows for s in spec.splits)
    print(jsonline.dumps({
        "out": str(args.out),
        "rows": rows,
        "skipped": spec.skipped_rows,
        "shards": sum(len(s.shards) for s in spec.splits),
        "seconds": round(seconds, 3),
        "rows_per_s": round(rows / seconds),
    }))
    return 0


def _cmd_preprocess_movielens(args: MovieLensConfig) -> int:
    inputs.check_movielens_source(args.src)
    from dlrm_app.data.movielens import preprocess_movielens

    start = time.perf_counter()
    spec = preprocess_movielens(
        args.src, args.out, positive_rating=args.positive_rating, split=args.split_method,
        test_fraction=args.test_fraction, seed=args.seed,
        rows_per_shard=args.rows_per_shard, row_group_size=args.row_group_size,
        id_mapping=args.id_mapping, num_embeddings_per_feature=args.num_embeddings_per_feature)
    _tables_report(spec)
    seconds = time.perf_counter() - start
    print(jsonline.dumps({
        "out": str(args.out),
        "release": spec.release,
        "rows": {s.name: s.rows for s in spec.splits},
        "shards": sum(len(s.shards) for s in spec.splits),
        "num_embeddings": {f.name: f.num_embeddings for f in spec.sparse_features},
        "seconds": round(seconds, 3),
    }))
    return 0


HELP_FORMAT = HelpFormatter


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The CLI namespace -> TrainConfig. With ``--resume`` of an existing run the saved config
    is the base and only the flags given on the command line change it (a flag that would
    change the model or the data is an error naming it)."""
    given = config_values(args, TrainConfig)
    if (resumed := resume.from_command_line(given)) is not None:
        return resumed
    if "data" not in given:
        raise ValueError("--data is required (it may be left out only with --resume of an "
                         "existing run, whose config names its data)")
    return TrainConfig.from_json_dict(given, where="the command line")


INTERRUPTED_STARTING = (" while starting, before its first step (this start trained nothing): "
                        "rerun the same command")
"""How a Ctrl-C before the first step ends ``train`` (after it: ``Trainer.interrupted_at``)."""


def _cmd_train(command: TrainCommand) -> int:
    config = command.config
    inputs.check_dataset(config.data)  # before torch: 3.6 s to say that a path is mistyped
    try:
        from dlrm_app.training.runtime import shutdown_distributed, world
        from dlrm_app.training.trainer import train

        summary = train(config, progress=not command.quiet)
    except KeyboardInterrupt as stop:
        if not hasattr(stop, "where"):  # before the trainer was made: nothing trained
            stop.where = INTERRUPTED_STARTING  # type: ignore[attr-defined]
        raise
    if world()[0] == 0:
        if not command.quiet:  # for a person (stderr); stdout keeps the one JSON line
            print(train_summary(summary, config.out), file=sys.stderr)
        print(jsonline.dumps(summary))
    shutdown_distributed()
    return 0


def train_summary(summary: dict, out: str) -> str:
    """A few readable lines at the end of ``train``: the kept model's validation, why
    training stopped, the speed, where the report is, and what to run next."""
    validation = summary.get("validation") or {}
    auc, ne = validation.get("auc"), validation.get("ne")
    best = (f"best validation AUC {auc:.4f} (NE {ne:.4f}) at step {summary.get('best_step'):,}"
            if isinstance(auc, float) and isinstance(ne, float) else "no validation AUC")
    if summary.get("follow"):
        best = follow_summary(summary)
    teacher = (summary.get("teacher_auc") or {}).get("validation")
    if isinstance(teacher, float) and isinstance(auc, float):
        best += f"; the teacher's (best achievable) {teacher:.4f}"
    lines = [
        f"trained {summary.get('trained_steps', 0):,} steps ({summary.get('steps', 0):,} in "
        f"all) on {summary.get('world_size', 1)} rank(s), "
        f"{summary.get('samples_per_s', 0):,.0f} samples/s; stopped: {summary.get('stopped')}",
        best,
        f"kept: {summary.get('checkpoint')}",
    ]
    if summary.get("report"):
        lines.append(f"report: {summary['report']}")
    if summary.get("follow"):
        lines.append("next: a new day (dlrm-app preprocess criteo NEW_DAY --add-day --out DATA), "
                     "then this same command: the new day only")
    else:
        lines.append(f"next: dlrm-app evaluate {out}   (the kept checkpoint on the test split)")
    return "\n".join(lines)


def follow_summary(summary: dict) -> str:
    """``train --follow``'s line: the days done and the last days' progressive AUC (each day
    by the model of the days before it)."""
    shown = [f"day {d['day']} {d['progressive_auc']:.4f}" for d in summary.get("days") or []
             if isinstance(d.get("progressive_auc"), float)][-7:]
    mean = summary.get("mean_progressive_auc")
    return (f"days done: {summary.get('days_done')}; progressive AUC "
            + (", ".join(shown) + (f"; mean {mean:.4f}" if isinstance(mean, float) else "")
               if shown else "none yet (the first day is trained on, not evaluated)"))


def evaluate_summary(result: dict) -> str:
    """The readable line of ``evaluate``: where, how many rows, and the metrics (4 digits); a
    metric that cannot be computed says why."""
    where = f"{result.get('split')} split, {result.get('num_examples', 0):,} rows, " \
            f"{Path(str(result.get('checkpoint'))).name}"
    parts = []
    for key, name in (("auc", "AUC"), ("ne", "NE"), ("logloss", "logloss"),
                      ("accuracy", "accuracy"), ("calibration", "calibration")):
        value = result.get(key)
        parts.append(f"{name} {value:.4f}" if isinstance(value, float) and math.isfinite(value)
                     else f"{name} n/a")
    line = f"{where}: {', '.join(parts)}"
    teacher = result.get("teacher_auc")
    if isinstance(teacher, float):
        line += f" (the teacher's AUC {teacher:.4f})"
    undefined = jsonline.json_ready(result).get("undefined")
    if undefined:
        line += "; n/a: " + "; ".join(sorted(set(undefined.values())))
    return line


def _cmd_evaluate(args: EvaluateConfig) -> int:
    inputs.check_run(args.run)
    from dlrm_app.training.evaluate import evaluate_checkpoint
    from dlrm_app.training.runtime import shutdown_distributed, world

    result = evaluate_checkpoint(args.run, split=args.split, checkpoint=args.checkpoint,
                                 data=args.data, batch_size=args.batch_size)
    if world()[0] == 0:
        print(evaluate_summary(result), file=sys.stderr)  # for a person; stdout keeps JSON
        if result.get("note"):
            print(f"note: {result['note']}", file=sys.stderr)
        print(jsonline.dumps(result))
    shutdown_distributed()
    return 0


def _stop_on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # unwinds like Ctrl-C: the export's staging folder is removed


def _cmd_export(args: ExportConfig) -> int:
    inputs.check_run(args.run)
    # SIGTERM (a scheduler, torchrun stopping a --publish run's process group) ends the export
    # as Ctrl-C does, its partial files removed, instead of leaving them behind
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    from dlrm_app.serving.export import export_model, stage_printer

    meta = export_model(args.run, args.out, args.dtype, checkpoint=args.checkpoint,
                        quantize_dense=args.quantize_dense, fmt=args.format,
                        lookup=args.lookup, full=args.full,
                        progress=stage_printer("dlrm-app export"))
    print(jsonline.dumps({k: meta.get(k) for k in ("published", "why", "path", "bytes",
                                                 "format", "embedding_dtype",
                                                 "dense_dtype", "lookup", "raw_input",
                                                 "needs_fbgemm", "checkpoint", "sha256")}))
    return 0


def _cmd_demo(args: DemoConfig) -> int:
    from dlrm_app.demo import run_demo

    result = run_demo(Path(args.out), rows=args.rows, steps=args.max_steps,
                      progress=not args.quiet, threads=args.threads)
    print(jsonline.dumps(result))
    return 0


def _cmd_serve(args: ServeCommand) -> int:
    inputs.check_model_file(args.model)
    from dlrm_app.serving.server import serve_forever

    return serve_forever(args.model, args.server, expect_sha256=args.expect_sha256)


def _cmd_report(args: ReportConfig) -> int:
    try:
        inputs.check_run_to_report(args.run)
        from dlrm_app.reporting.report import write_report, write_tensorboard

        path = write_report(args.run)
        logdir = write_tensorboard(args.run) if args.tensorboard else None
    except (ValueError, ImportError, OSError) as e:
        raise SystemExit(f"dlrm-app report: {e}") from None
    print(path)
    if logdir is not None:
        print(f"tensorboard --logdir {logdir}", file=sys.stderr)
    return 0


COMMANDS: dict[str, tuple[str, type, object]] = {
    "info": ("show versions, FBGEMM status and kernel choices", InfoConfig, _cmd_info),
    "generate": ("write a synthetic Criteo-shaped dataset", GenerateConfig, _cmd_generate),
    "preprocess criteo": ("Criteo Kaggle / 1TB TSV (plain or .gz)", CriteoConfig,
                          _cmd_preprocess_criteo),
    "preprocess movielens": ("MovieLens 100k / 1m / 20m / 25m / latest folder", MovieLensConfig,
                             _cmd_preprocess_movielens),
    "train": ("train a DLRM (one process or under torchrun)", TrainCommand, _cmd_train),
    "evaluate": ("AUC, NE, logloss... of a checkpoint on a split", EvaluateConfig, _cmd_evaluate),
    "export": ("a checkpoint -> one serving artifact (.pt2: torch.export + AOTInductor)",
               ExportConfig, _cmd_export),
    "serve": ("HTTP prediction endpoint for an exported model", ServeCommand, _cmd_serve),
    "report": ("write RUN/report.md with plots (loss, validation AUC/NE, samples/s, ROC, "
               "calibration)", ReportConfig, _cmd_report),
    "demo": ("generate data, train, evaluate, export: the quick start", DemoConfig, _cmd_demo),
}
"""Every command: its one-line help, its config class (each field one argument) and the
function that runs it with the parsed config."""


class _Parser(argparse.ArgumentParser):
    """An argument error is one line naming the command and where its flags are listed (not
    the command's whole usage, 28 lines for ``train``, before it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the flags)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dlrm-app", description=__doc__.splitlines()[0],
                     formatter_class=HELP_FORMAT)
    parser.add_argument("--version", action=_VersionAction)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    groups: dict[str, argparse._SubParsersAction] = {}
    for name, (help_text, cls, func) in COMMANDS.items():
        words = name.split()
        where = sub
        if len(words) == 2:  # a command with subcommands: preprocess criteo | movielens
            if words[0] not in groups:
                group = sub.add_parser(words[0], help="raw dataset files -> Parquet shards",
                                       formatter_class=HELP_FORMAT)
                groups[words[0]] = group.add_subparsers(dest="dataset", required=True,
                                                        parser_class=_Parser)
            where = groups[words[0]]
        command = where.add_parser(words[-1], help=help_text, formatter_class=HELP_FORMAT)
        add_config_flags(command, cls)
        command.usage = short_usage(command)
        command.set_defaults(func=func, config_cls=cls)
    return parser


class _VersionAction(argparse._VersionAction):
    """``--version``: the installed project's version, looked up only when asked (reading the
    package metadata took 58 ms of every command's start, ``--help``'s included)."""

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> NoReturn:
        print(f"{parser.prog} {_version()}")
        parser.exit()


def _version() -> str:
    """The installed project's version (no torch needed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("recsys-dlrm")
    except PackageNotFoundError:
        return "(not installed: run from a source tree)"


def parsed_config(args: argparse.Namespace) -> object:
    """The command's typed config from its parsed arguments. ``train``'s run config comes from
    ``config_from_args`` (a resumed run starts from its saved config)."""
    if args.config_cls is TrainCommand:
        return TrainCommand(quiet=getattr(args, "quiet", False), config=config_from_args(args))
    return config_from_values(args.config_cls, config_values(args, args.config_cls))


TRACEBACK_ENV = "DLRM_APP_TRACEBACK"
"""Set to 1 to get Python's traceback instead of the one-line error (for bug reports)."""


def describe_error(exc: BaseException) -> str:
    """One line for a person: what failed, on which path, and what to do (the planner's
    refusal: a first line of that, then a few lines of figures and fixes)."""
    path = getattr(exc, "filename", None)
    where = f" ({path})" if path else ""
    # tables kept on disk: their errors name --offload-dir (loaded only by runs that built them)
    resources = sys.modules.get("dlrm_app.training.resources")
    offload = resources.offload_error_for_user(exc) if resources is not None else None
    if resources is not None and isinstance(exc, resources.DoesNotFit):
        # the planner's refusal: its first line says what and the fix, the next ones the
        # figures and the other fixes (one line of ~1,700 characters was unreadable)
        return "\n".join(line[:len(line) - len(line.lstrip())] + " ".join(line.split())
                         for line in str(exc).splitlines() if line.strip())
    if offload is not None:
        text = offload
    elif isinstance(exc, ValueError):
        text = str(exc)
    elif isinstance(exc, PermissionError):
        text = (f"no permission to write or read{where}: choose another --out, or fix the "
                f"folder's permissions")
    elif isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        text = (f"the disk is full{where} ({exc.strerror}): free space, or choose an --out "
                f"on another disk; finished files are kept and a rerun continues")
    elif isinstance(exc, (FileExistsError, NotADirectoryError)):
        text = (f"a file is in the way{where}: the output path or one of its parent folders is "
                f"a file, not a folder; choose another --out")
    elif isinstance(exc, IsADirectoryError):
        text = f"a folder is where a file is expected{where}: pass the file's path"
    elif isinstance(exc, FileNotFoundError):
        text = f"not found{where}: check the path"
    elif isinstance(exc, OSError):
        text = f"{exc.strerror or exc}{where}"
    elif isinstance(exc, RuntimeError) and any(
            word in str(exc).lower() for word in ("connection closed by peer",
                                                  "connection reset by peer", "broken pipe")):
        text = ("another rank stopped (its own error is above), so this one cannot go on; fix "
                "that error and rerun (--resume continues from the last checkpoint)")
    elif isinstance(exc, RuntimeError) and any(
            word in str(exc).lower() for word in ("timed out", "timeout")):  # gloo's, nccl's
        runtime = sys.modules.get("dlrm_app.training.runtime")  # loaded by whatever ran a collective
        silent = runtime.stalled_ranks_text() if runtime is not None else ""
        who = f"{silent} stopped answering" if silent else "one stalled or died"
        site = runtime.collective_site(exc) if runtime is not None else ""
        text = (f"a collective operation{' ' + site if site else ''} timed out waiting for the "
                f"other ranks ({who}): check "
                "that rank's host and output; if a legitimate step is that slow, raise "
                "--timeout")
    else:
        text = (f"{type(exc).__name__}: {str(exc)[:300]} (a bug? rerun with {TRACEBACK_ENV}=1 "
                f"and report the traceback)")
    return " ".join(text.split())


def _command(args: argparse.Namespace) -> str:
    words = [args.command]
    if getattr(args, "dataset", None) and args.command == "preprocess":
        words.append(args.dataset)
    return " ".join(words)


def main(argv: Sequence[str] | None = None) -> int:
    """Run a subcommand. Errors end the process with one line on stderr naming the command,
    what failed and the fix (``DLRM_APP_TRACEBACK=1`` shows the traceback); under torchrun the
    line names the rank."""
    args = build_parser().parse_args(argv)
    name = f"dlrm-app {_command(args)}"
    rank = os.environ.get("RANK") if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None
    prefix = name + (f" (rank {rank})" if rank else "")
    try:
        return int(args.func(parsed_config(args)))
    except SystemExit as exc:  # a command's own one-line error: name the rank in it too
        if rank and isinstance(exc.code, str) and exc.code.startswith(name + ":"):
            raise SystemExit(prefix + exc.code[len(name):]) from None
        raise
    except (Exception, KeyboardInterrupt) as exc:
        if os.environ.get(TRACEBACK_ENV) == "1":
            raise
        if isinstance(exc, KeyboardInterrupt):
            print(f"{prefix}: interrupted{getattr(exc, 'where', '')}", file=sys.stderr)
            raise SystemExit(130) from None  # the shell's code for a command ended by Ctrl-C
        exit_code = getattr(exc, "exit_code", None)
        if isinstance(exit_code, int):  # a stop, not a failure (SIGTERM)
            print(f"{prefix}: {exc}", file=sys.stderr)
            raise SystemExit(exit_code) from None
        raise SystemExit(f"{prefix}: {describe_error(exc)}") from None


if __name__ == "__main__":
    sys.exit(main())
