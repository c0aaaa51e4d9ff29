"""The ``train``, ``evaluate``, ``export``, ``serve`` and ``demo`` subcommands of ``dlrm-app``.

``train``'s flags are generated from ``TrainConfig`` (``dlrm_app.flags``): a new config field is
one edit, with its docstring as the help line and its default shown.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dlrm_app.config import TrainConfig, resume_config
from dlrm_app.demo import DEMO_ROWS
from dlrm_app.flags import add_config_flags, config_values
from dlrm_app.report import add_report_command
from dlrm_app.serve import add_serve_command

HELP_FORMAT = argparse.ArgumentDefaultsHelpFormatter


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

    try:
        config = config_from_args(args)
        summary = train(config, progress=not args.quiet)
    except ValueError as e:
        raise SystemExit(f"dlrm-app train: {e}") from None
    if world()[0] == 0:
        print(json.dumps(summary))
    shutdown_distributed()
    return 0


def _cmd_evaluate(args: argparse.Namespace) -> int:
    from dlrm_app.evaluate import evaluate_checkpoint
    from dlrm_app.runtime import shutdown_distributed, world

    try:
        result = evaluate_checkpoint(args.run, split=args.split, checkpoint=args.checkpoint,
                                     data=args.data, batch_size=args.batch_size)
    except ValueError as e:
        raise SystemExit(f"dlrm-app evaluate: {e}") from None
    if world()[0] == 0:
        print(json.dumps(result))
    shutdown_distributed()
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from dlrm_app.export import export_model

    try:
        meta = export_model(args.run, args.out, args.dtype, checkpoint=args.checkpoint,
                            quantize_dense=args.quantize_dense)
    except ValueError as e:
        raise SystemExit(f"dlrm-app export: {e}") from None
    print(json.dumps({k: meta[k] for k in ("path", "bytes", "embedding_dtype", "dense_dtype",
                                             "raw_input", "needs_fbgemm", "checkpoint")}))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from dlrm_app.demo import run_demo

    try:
        result = run_demo(Path(args.out), rows=args.rows, steps=args.max_steps,
                          progress=not args.quiet)
    except ValueError as e:
        raise SystemExit(f"dlrm-app demo: {e}") from None
    print(json.dumps(result))
    return 0


CHECKPOINT_HELP = ("best (the best validation AUC; the newest checkpoint where none was "
                   "recorded), latest, or a step_* directory")


def add_commands(sub: argparse._SubParsersAction) -> None:
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

    ex = sub.add_parser("export", help="a checkpoint -> one TorchScript file for serving",
                        formatter_class=HELP_FORMAT)
    ex.add_argument("run", help="run directory written by `dlrm-app train` (its --out)")
    ex.add_argument("--out", required=True, help="the artifact to write, e.g. model.pt")
    ex.add_argument("--dtype", choices=("fp32", "fp16", "int8", "int4"), default="int8",
                    help="embedding table storage (row-wise scale/bias for int8/int4)")
    ex.add_argument("--checkpoint", default="best", help=CHECKPOINT_HELP)
    ex.add_argument("--quantize-dense", action="store_true",
                    help="also dynamic-int8 quantize the MLPs' linear layers")
    ex.set_defaults(func=_cmd_export)

    add_serve_command(sub)
    add_report_command(sub)

    demo = sub.add_parser("demo", help="generate data, train, evaluate, export: the quick start",
                          formatter_class=HELP_FORMAT)
    demo.add_argument("--out", default="runs/demo", help="where data and the run go")
    demo.add_argument("--rows", type=int, default=DEMO_ROWS, help="synthetic rows")
    demo.add_argument("--max-steps", type=int, default=None, help="cap on training steps")
    demo.add_argument("--quiet", action="store_true", help="no progress bars")
    demo.set_defaults(func=_cmd_demo)
