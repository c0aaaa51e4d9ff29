"""``dlrm-app``: the application's command line.

Every subcommand is defined here; each parses its flags into typed arguments and calls library
functions (``recsys_core`` never sees argparse). The flags of ``train`` and ``serve`` are
generated from ``TrainConfig`` and ``ServeConfig`` (``dlrm_app.flags``): a new config field is
one edit, with its docstring as the help line and its default shown.

Parsing imports nothing heavy (the configs and flags are plain Python): ``--help`` and argument
errors answer at once, and each command imports torch, pyarrow and ``recsys_core`` in its body.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from dlrm_app.config import (
    DEFAULT_FREQUENCY_THRESHOLD,
    DEFAULT_MAX_EMBEDDINGS_PER_FEATURE,
    DEMO_ROWS,
    ServeConfig,
    TrainConfig,
    resume_config,
)
from dlrm_app.flags import HelpFormatter, add_config_flags, config_values

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


def _cmd_info(args: argparse.Namespace) -> int:
    import torch

    report = environment_report(torch.device(args.device))
    if args.json:
        print(json.dumps(report))
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


def _cmd_generate(args: argparse.Namespace) -> int:
    from dlrm_app.data.synthetic import generate

    cardinalities = _per_feature(args.cardinalities, args.num_sparse, int, "--cardinalities")
    pooling = _per_feature(args.pooling_factors, args.num_sparse, float, "--pooling-factors")
    start = time.perf_counter()
    spec = generate(
        args.out, rows=args.rows, num_dense=args.num_dense, cardinalities=cardinalities,
        pooling_factors=pooling, zipf_alpha=args.zipf_alpha, seed=args.seed,
        rows_per_shard=args.rows_per_shard, row_group_size=args.row_group_size,
    )
    seconds = time.perf_counter() - start
    print(json.dumps({
        "out": str(args.out),
        "rows": sum(s.rows for s in spec.splits),
        "shards": sum(len(s.shards) for s in spec.splits),
        "seconds": round(seconds, 3),
        "rows_per_s": round(args.rows / seconds),
        "teacher_auc": spec.parameters["teacher_auc"],
    }))
    return 0


def _tables_report(spec: DatasetSpec) -> None:
    """The table sizes and the memory they need, for a person (stderr; stdout stays JSON)."""
    from dlrm_app.data.tables import format_table_summary

    print(format_table_summary(spec.parameters["tables"]), file=sys.stderr)


def _cmd_preprocess_criteo(args: argparse.Namespace) -> int:
    from dlrm_app.data.criteo import preprocess_criteo

    hashed = caps = None
    if args.num_embeddings_per_feature is not None:
        hashed = _per_feature(args.num_embeddings_per_feature, 26, int,
                              "--num-embeddings-per-feature", "preprocess criteo")
    if args.max_embeddings_per_feature is not None:
        caps = _per_feature(args.max_embeddings_per_feature, 26, int,
                            "--max-embeddings-per-feature", "preprocess criteo")
    start = time.perf_counter()
    spec = preprocess_criteo(
        args.inputs, args.out, fmt=args.format, num_embeddings_per_feature=hashed,
        frequency_threshold=args.frequency_threshold, max_embeddings_per_feature=caps,
        rows_per_shard=args.rows_per_shard, row_group_size=args.row_group_size,
        on_bad_row=args.on_bad_row, like=args.like, one_split=args.one_split,
        workers=args.workers, id_mapping=args.id_mapping,
        max_bad_row_fraction=args.max_bad_row_fraction)
    _tables_report(spec)
    seconds = time.perf_counter() - start
    rows = sum(s.rows for s in spec.splits)
    print(json.dumps({
        "out": str(args.out),
        "rows": rows,
        "skipped": spec.parameters["skipped_rows"],
        "shards": sum(len(s.shards) for s in spec.splits),
        "seconds": round(seconds, 3),
        "rows_per_s": round(rows / seconds),
    }))
    return 0


def _cmd_preprocess_movielens(args: argparse.Namespace) -> int:
    from dlrm_app.data.movielens import preprocess_movielens

    start = time.perf_counter()
    spec = preprocess_movielens(
        args.src, args.out, positive_rating=args.positive_rating, split=args.split_method,
        test_fraction=args.test_fraction, seed=args.seed,
        rows_per_shard=args.rows_per_shard, row_group_size=args.row_group_size,
        id_mapping=args.id_mapping, num_embeddings_per_feature=args.num_embeddings_per_feature)
    _tables_report(spec)
    seconds = time.perf_counter() - start
    print(json.dumps({
        "out": str(args.out),
        "release": spec.parameters["release"],
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
    saved = Path(given["out"]) / "config.json"
    if given.get("resume") and saved.is_file():
        return resume_config(TrainConfig.load(saved), given, where=str(saved))
    if "data" not in given:
        raise ValueError("--data is required (it may be left out only with --resume of an "
                         "existing run, whose config names its data)")
    return TrainConfig.from_json_dict(given, where="the command line")


def _cmd_train(args: argparse.Namespace) -> int:
    from dlrm_app.runtime import shutdown_distributed, world
    from dlrm_app.train import train

    config = config_from_args(args)
    summary = train(config, progress=not args.quiet)
    if world()[0] == 0:
        if not args.quiet:  # for a person (stderr); stdout keeps the one JSON line
            print(train_summary(summary, config.out), file=sys.stderr)
        print(json.dumps(summary))
    shutdown_distributed()
    return 0


def train_summary(summary: dict, out: str) -> str:
    """A few readable lines at the end of ``train``: the kept model's validation, why
    training stopped, the speed, where the report is, and what to run next."""
    validation = summary.get("validation") or {}
    auc, ne = validation.get("auc"), validation.get("ne")
    best = (f"best validation AUC {auc:.4f} (NE {ne:.4f}) at step {summary.get('best_step'):,}"
            if isinstance(auc, float) and isinstance(ne, float) else "no validation AUC")
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
    lines.append(f"next: dlrm-app evaluate {out}   (the kept checkpoint on the test split)")
    return "\n".join(lines)


def _cmd_evaluate(args: argparse.Namespace) -> int:
    from dlrm_app.evaluate import evaluate_checkpoint
    from dlrm_app.runtime import shutdown_distributed, world

    result = evaluate_checkpoint(args.run, split=args.split, checkpoint=args.checkpoint,
                                 data=args.data, batch_size=args.batch_size)
    if world()[0] == 0:
        print(json.dumps(result))
    shutdown_distributed()
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from dlrm_app.export import export_model, stage_printer

    meta = export_model(args.run, args.out, args.dtype, checkpoint=args.checkpoint,
                        quantize_dense=args.quantize_dense, fmt=args.format,
                        lookup=args.lookup, progress=stage_printer("dlrm-app export"))
    print(json.dumps({k: meta.get(k) for k in ("path", "bytes", "format", "embedding_dtype",
                                                 "dense_dtype", "lookup", "raw_input",
                                                 "needs_fbgemm", "checkpoint", "sha256")}))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from dlrm_app.demo import run_demo

    result = run_demo(Path(args.out), rows=args.rows, steps=args.max_steps,
                      progress=not args.quiet, threads=args.threads)
    print(json.dumps(result))
    return 0


CHECKPOINT_HELP = ("best (the best validation AUC; the newest checkpoint where none was "
                   "recorded), latest, or a step_* directory")


def _cmd_serve(args: argparse.Namespace) -> int:
    from dlrm_app.serve import serve_forever

    config = ServeConfig(**config_values(args, ServeConfig))
    return serve_forever(args.model, config, expect_sha256=args.expect_sha256)


def _cmd_report(args: argparse.Namespace) -> int:
    from dlrm_app.report import write_report, write_tensorboard

    try:
        path = write_report(args.run)
        logdir = write_tensorboard(args.run) if args.tensorboard else None
    except (ValueError, ImportError, OSError) as e:
        raise SystemExit(f"dlrm-app report: {e}") from None
    print(path)
    if logdir is not None:
        print(f"tensorboard --logdir {logdir}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dlrm-app", description=__doc__.splitlines()[0],
                                     formatter_class=HELP_FORMAT)
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="show versions, FBGEMM status and kernel choices",
        formatter_class=HELP_FORMAT)
    info.add_argument("--device", default="cpu", help="device to report kernel choices for")
    info.add_argument("--json", action="store_true", help="print one JSON object")
    info.set_defaults(func=_cmd_info)
    gen = sub.add_parser("generate", help="write a synthetic Criteo-shaped dataset",
        formatter_class=HELP_FORMAT)
    gen.add_argument("--out", required=True, help="output directory (shards + dataset.json)")
    gen.add_argument("--rows", type=int, default=100_000, help="total rows over all splits")
    gen.add_argument("--num-dense", type=int, default=13, help="number of dense features")
    gen.add_argument("--num-sparse", type=int, default=26, help="number of sparse features")
    gen.add_argument("--cardinalities", default="10000",
                     help="ids per sparse feature: one int or a comma list of --num-sparse")
    gen.add_argument("--pooling-factors", default="1",
                     help="mean ids per row (1 = one-hot): one float or a comma list")
    gen.add_argument("--zipf-alpha", type=float, default=1.05, help="id popularity skew")
    gen.add_argument("--seed", type=int, default=0, help="same seed -> identical files")
    gen.add_argument("--rows-per-shard", type=int, default=1_000_000, help="rows per file")
    gen.add_argument("--row-group-size", type=int, default=65_536,
                     help="rows per Parquet row group (the generated rows do not depend on it)")
    gen.set_defaults(func=_cmd_generate)
    prep = sub.add_parser("preprocess", help="raw dataset files -> Parquet shards",
        formatter_class=HELP_FORMAT)
    prep_sub = prep.add_subparsers(dest="dataset", required=True)
    crit = prep_sub.add_parser("criteo", help="Criteo Kaggle / 1TB TSV (plain or .gz)",
        formatter_class=HELP_FORMAT)
    crit.add_argument("inputs", nargs="+", help="TSV files in order (terabyte: one per day)")
    crit.add_argument("--out", required=True, help="output directory (shards + dataset.json)")
    crit.add_argument("--format", choices=("kaggle", "terabyte"), default="kaggle",
                      help="kaggle: split by row order 6/7, 1/14, 1/14; terabyte: last day "
                           "halves are validation/test")
    crit.add_argument("--num-embeddings-per-feature", default=None,
                      help="hash ids modulo this many rows instead of a vocabulary: one int or "
                           "a comma list of 26 (the reference DLRM uses 40000000 for Criteo "
                           "1TB)")
    crit.add_argument("--frequency-threshold", type=int, default=None,
                      help="vocabulary of the ids seen >= K times in the train split; the rest "
                           f"share row 0 (default: {DEFAULT_FREQUENCY_THRESHOLD})")
    crit.add_argument("--max-embeddings-per-feature", default=None,
                      help="cap on vocabulary rows per table, the most frequent ids kept: one "
                           f"int or a comma list of 26 (default: {DEFAULT_MAX_EMBEDDINGS_PER_FEATURE})")
    crit.add_argument("--id-mapping", choices=("vocabulary", "hash", "zch"), default=None,
                      help="how raw ids become table rows: vocabulary (default) or hash here, "
                           "or zch: keep the raw ids and let the model map them at training "
                           "time with zero-collision hashing (tables sized by train "
                           "--zch-rows; new ids keep arriving in later files)")
    crit.add_argument("--one-split", choices=("train", "validation", "test"), default=None,
                      help="with --like: every row into this split (a held-out file to score "
                           "whole with `dlrm-app evaluate RUN --data OUT --split test`)")
    crit.add_argument("--rows-per-shard", type=int, default=1_000_000, help="rows per file")
    crit.add_argument("--row-group-size", type=int, default=65_536,
                      help="rows per Parquet row group")
    crit.add_argument("--on-bad-row", choices=("error", "skip"), default="error",
                      help="error: stop at the first bad row; skip: drop and count them")
    crit.add_argument("--max-bad-row-fraction", type=float, default=0.5,
                      help="with --on-bad-row skip: refuse the input when more than this "
                           "fraction of its rows are bad (most likely not Criteo files)")
    crit.add_argument("--like", default=None,
                      help="encode with this existing dataset's hashing or vocabulary (so its "
                           "model reads the output)")
    crit.add_argument("--workers", type=int, default=1,
                      help="processes that parse, encode and write (default 1, the least "
                           "memory: each worker adds about 0.4 GB); the output is "
                           "byte-identical for every N; up to the number of cores pays off")
    crit.set_defaults(func=_cmd_preprocess_criteo)
    ml = prep_sub.add_parser("movielens", help="MovieLens 100k / 1m / 20m / 25m / latest folder",
        formatter_class=HELP_FORMAT)
    ml.add_argument("src", help="unpacked release folder (u.data, ratings.dat or ratings.csv)")
    ml.add_argument("--out", required=True, help="output directory (shards + dataset.json)")
    ml.add_argument("--positive-rating", type=float, default=4.0,
                    help="label is 1 when rating >= this")
    ml.add_argument("--split-method", choices=("leave_last_out", "fraction"),
                    default="leave_last_out",
                    help="per user by time: last rating test, one before validation; or the "
                         "last --test-fraction test and as many before validation")
    ml.add_argument("--test-fraction", type=float, default=0.1,
                    help="fraction of each user's ratings in test (--split fraction)")
    ml.add_argument("--id-mapping", choices=("vocabulary", "hash", "zch"), default="vocabulary",
                    help="user_id and movie_id: vocabulary (ids 0..n-1 of the ids in the "
                         "ratings), hash (raw id modulo --num-embeddings-per-feature rows) or "
                         "zch (the raw ids kept, mapped by the model at training time with "
                         "zero-collision hashing; tables sized by train --zch-rows)")
    ml.add_argument("--num-embeddings-per-feature", type=int, default=None,
                    help="with --id-mapping hash: rows of the user_id and movie_id tables")
    ml.add_argument("--seed", type=int, default=0, help="row order inside each split")
    ml.add_argument("--rows-per-shard", type=int, default=1_000_000, help="rows per file")
    ml.add_argument("--row-group-size", type=int, default=65_536,
                    help="rows per Parquet row group")
    ml.set_defaults(func=_cmd_preprocess_movielens)
    train = sub.add_parser("train", help="train a DLRM (one process or under torchrun)",
                           formatter_class=HELP_FORMAT)
    train.add_argument("--quiet", action="store_true", help="no progress bar or plan print")
    add_config_flags(train, TrainConfig, required=("out",))
    train.set_defaults(func=_cmd_train)

    ev = sub.add_parser("evaluate", help="AUC, NE, logloss... of a checkpoint on a split",
                        formatter_class=HELP_FORMAT)
    ev.add_argument("run", help="run directory written by `dlrm-app train` (its --out)")
    ev.add_argument("--checkpoint", default="best", help=CHECKPOINT_HELP)
    ev.add_argument("--split", choices=("train", "validation", "test"), default="test",
                    help="which split of the dataset to score")
    ev.add_argument("--data", default=None,
                    help="dataset directory (default: the run's); encode other files with "
                         "`dlrm-app preprocess ... --like RUN_DATA`")
    ev.add_argument("--batch-size", type=int, default=8192, help="rows per rank per batch")
    ev.set_defaults(func=_cmd_evaluate)

    ex = sub.add_parser("export", help="a checkpoint -> one serving artifact (.pt2: "
                        "torch.export + AOTInductor)", formatter_class=HELP_FORMAT)
    ex.add_argument("run", help="run directory written by `dlrm-app train` (its --out)")
    ex.add_argument("--out", required=True,
                    help="the artifact to write, e.g. model.pt2 (model.pt with --format "
                         "torchscript)")
    ex.add_argument("--format", choices=("pt2", "torchscript"), default="pt2",
                    help="pt2: AOTInductor-compiled torch.export programs + manifest; "
                         "torchscript: one TorchScript file, for stacks that cannot load .pt2 "
                         "yet (TorchScript is deprecated in PyTorch)")
    ex.add_argument("--lookup", choices=("auto", "fbgemm", "torch"), default="auto",
                    help=".pt2 embedding lookups: FBGEMM's int-n-bit op (the loader imports "
                         "fbgemm_gpu) or plain torch ops (loads with torch alone); auto: "
                         "FBGEMM where it loads")
    ex.add_argument("--dtype", choices=("fp32", "fp16", "int8", "int4"), default="int8",
                    help="embedding table storage (row-wise scale/bias for int8/int4)")
    ex.add_argument("--checkpoint", default="best", help=CHECKPOINT_HELP)
    ex.add_argument("--quantize-dense", action="store_true",
                    help="also dynamic-int8 quantize the MLPs' linear layers (--format "
                         "torchscript only)")
    ex.set_defaults(func=_cmd_export)

    serve = sub.add_parser("serve", help="HTTP prediction endpoint for an exported model",
                           formatter_class=HELP_FORMAT)
    serve.add_argument("model", help="exported model file (dlrm-app export)")
    serve.add_argument("--expect-sha256", default=None, metavar="HEX",
                       help="the model file's sha256 (as `dlrm-app export` printed it); a "
                            "mismatch refuses the file before anything in it is loaded. "
                            "Default: the digest in <model>.sha256 beside it, if any")
    add_config_flags(serve, ServeConfig)
    serve.set_defaults(func=_cmd_serve)

    report = sub.add_parser("report", help="write RUN/report.md with plots (loss, validation "
                            "AUC/NE, samples/s, ROC, calibration)", formatter_class=HELP_FORMAT)
    report.add_argument("run", help="run directory written by `dlrm-app train` (its --out)")
    report.add_argument("--tensorboard", action="store_true",
                        help='also write TensorBoard event files to RUN/tensorboard (needs pip '
                             'install -e ".[tensorboard]")')
    report.set_defaults(func=_cmd_report)

    demo = sub.add_parser("demo", help="generate data, train, evaluate, export: the quick start",
                          formatter_class=HELP_FORMAT)
    demo.add_argument("--out", default="runs/demo", help="where data and the run go")
    demo.add_argument("--rows", type=int, default=DEMO_ROWS, help="synthetic rows")
    demo.add_argument("--max-steps", type=int, default=None, help="cap on training steps")
    demo.add_argument("--quiet", action="store_true", help="no progress bars")
    demo.add_argument("--threads", type=int, default=None,
                      help="torch threads (default: chosen from the CPUs this process may use, "
                           "as `train --threads` is)")
    demo.set_defaults(func=_cmd_demo)
    return parser


TRACEBACK_ENV = "DLRM_APP_TRACEBACK"
"""Set to 1 to get Python's traceback instead of the one-line error (for bug reports)."""


def describe_error(exc: BaseException) -> str:
    """One line for a person: what failed, on which path, and what to do."""
    path = getattr(exc, "filename", None)
    where = f" ({path})" if path else ""
    # tables kept on disk: their errors name --offload-dir (loaded only by runs that built them)
    offload = (sys.modules["dlrm_app.resources"].offload_error_for_user(exc)
               if "dlrm_app.resources" in sys.modules else None)
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
        text = ("a collective operation timed out waiting for the other ranks (one stalled or "
                "died): check the other ranks' output; if a legitimate step is that slow, raise "
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
        return int(args.func(args))
    except SystemExit as exc:  # a command's own one-line error: name the rank in it too
        if rank and isinstance(exc.code, str) and exc.code.startswith(name + ":"):
            raise SystemExit(prefix + exc.code[len(name):]) from None
        raise
    except (Exception, KeyboardInterrupt) as exc:
        if os.environ.get(TRACEBACK_ENV) == "1":
            raise
        if isinstance(exc, KeyboardInterrupt):
            raise SystemExit(f"{prefix}: interrupted") from None
        raise SystemExit(f"{prefix}: {describe_error(exc)}") from None


if __name__ == "__main__":
    sys.exit(main())
