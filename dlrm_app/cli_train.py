"""The ``train``, ``evaluate``, ``export``, ``serve`` and ``demo`` subcommands of ``dlrm-app``."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from dlrm_app.config import DenseOptimizer, EmbeddingOptimizer, TrainConfig
from dlrm_app.demo import DEMO_ROWS
from dlrm_app.model import Interaction, ModelConfig
from dlrm_app.serve import add_serve_command

_DEFAULT = TrainConfig(data="-", out="-")
_MODEL = ModelConfig()


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(v) for v in text.replace(",", "-").split("-") if v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of layer sizes like "
                                         "512-256-128") from None
    if not sizes:
        raise argparse.ArgumentTypeError("empty layer size list")
    return sizes


def add_model_flags(p: argparse.ArgumentParser, defaults: ModelConfig = _MODEL) -> None:
    p.add_argument("--embedding-dim", type=int, default=defaults.embedding_dim)
    p.add_argument("--dense-arch-layer-sizes", type=_sizes,
                   default=defaults.dense_arch_layer_sizes,
                   help="bottom MLP, e.g. 512-256-128 (last = --embedding-dim)")
    p.add_argument("--over-arch-layer-sizes", type=_sizes, default=defaults.over_arch_layer_sizes,
                   help="top MLP, e.g. 1024-1024-512-256-1 (last = 1)")
    p.add_argument("--interaction", choices=[i.value for i in Interaction],
                   default=defaults.interaction.value)
    p.add_argument("--dcn-num-layers", type=int, default=defaults.dcn_num_layers)
    p.add_argument("--dcn-low-rank-dim", type=int, default=defaults.dcn_low_rank_dim)


def add_train_flags(p: argparse.ArgumentParser, d: TrainConfig = _DEFAULT) -> None:
    add_model_flags(p, d.model)
    p.add_argument("--epochs", type=int, default=d.epochs)
    p.add_argument("--max-steps", type=int, default=d.max_steps)
    p.add_argument("--batch-size", type=int, default=d.batch_size,
                   help="rows per rank per step (global batch = this x world size)")
    p.add_argument("--embedding-optimizer", choices=[o.value for o in EmbeddingOptimizer],
                   default=d.embedding_optimizer.value, help="fused into backward")
    p.add_argument("--embedding-learning-rate", type=float, default=d.embedding_learning_rate)
    p.add_argument("--dense-optimizer", choices=[o.value for o in DenseOptimizer],
                   default=d.dense_optimizer.value)
    p.add_argument("--learning-rate", type=float, default=d.learning_rate, help="dense rate")
    p.add_argument("--eps", type=float, default=d.eps)
    p.add_argument("--lr-warmup-steps", type=int, default=d.lr_warmup_steps)
    p.add_argument("--lr-decay-start", type=int, default=d.lr_decay_start)
    p.add_argument("--lr-decay-steps", type=int, default=d.lr_decay_steps)
    p.add_argument("--no-pipeline", dest="pipelined", action="store_false",
                   help="plain loop (same results; easier to debug)")
    p.add_argument("--amp", action="store_true", help="bfloat16 autocast of dense layers (CUDA)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--validate-every", type=int, default=d.validate_every,
                   help="steps between validations (0: at epoch end)")
    p.add_argument("--val-batches", type=int, default=d.val_batches,
                   help="cap on validation batches per rank (0: whole split)")
    p.add_argument("--target-auc", type=float, default=d.target_auc,
                   help="stop once validation AUC reaches this")
    p.add_argument("--save-every", type=int, default=d.save_every,
                   help="steps between checkpoints (0: only at the end)")
    p.add_argument("--keep-checkpoints", type=int, default=d.keep_checkpoints)
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest complete checkpoint of --out")
    p.add_argument("--plan", default=d.plan, help="a plan.json to use instead of planning")
    p.add_argument("--log-every", type=int, default=d.log_every)
    p.add_argument("--no-shuffle", dest="shuffle", action="store_false")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The CLI namespace -> TrainConfig (flags named as the fields)."""
    model = ModelConfig(
        embedding_dim=args.embedding_dim,
        dense_arch_layer_sizes=tuple(args.dense_arch_layer_sizes),
        over_arch_layer_sizes=tuple(args.over_arch_layer_sizes),
        interaction=Interaction(args.interaction),
        dcn_num_layers=args.dcn_num_layers,
        dcn_low_rank_dim=args.dcn_low_rank_dim,
    )
    fields = {f.name for f in dataclasses.fields(TrainConfig)} - {"model"}
    values = {name: getattr(args, name) for name in fields if hasattr(args, name)}
    values["embedding_optimizer"] = EmbeddingOptimizer(values["embedding_optimizer"])
    values["dense_optimizer"] = DenseOptimizer(values["dense_optimizer"])
    return TrainConfig(model=model, **values)


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


def add_commands(sub: argparse._SubParsersAction) -> None:
    train = sub.add_parser("train", help="train a DLRM (one process or under torchrun)")
    train.add_argument("--data", required=True, help="dataset directory (dataset.json)")
    train.add_argument("--out", required=True, help="run directory: logs, plan, checkpoints")
    train.add_argument("--quiet", action="store_true", help="no progress bar or plan print")
    add_train_flags(train)
    train.set_defaults(func=_cmd_train)

    ev = sub.add_parser("evaluate", help="AUC, NE, logloss... of a checkpoint on a split")
    ev.add_argument("run", help="run directory written by `dlrm-app train` (its --out)")
    ev.add_argument("--checkpoint", default=None,
                    help="a step_* directory (default: the run's newest checkpoint)")
    ev.add_argument("--split", choices=("train", "validation", "test"), default="test")
    ev.add_argument("--data", default=None, help="dataset directory (default: the run's)")
    ev.add_argument("--batch-size", type=int, default=8192, help="rows per rank per batch")
    ev.set_defaults(func=_cmd_evaluate)

    ex = sub.add_parser("export", help="a checkpoint -> one TorchScript file for serving")
    ex.add_argument("run", help="run directory written by `dlrm-app train` (its --out)")
    ex.add_argument("--out", required=True, help="the artifact to write, e.g. model.pt")
    ex.add_argument("--dtype", choices=("fp32", "fp16", "int8", "int4"), default="int8",
                    help="embedding table storage (row-wise scale/bias for int8/int4)")
    ex.add_argument("--checkpoint", default=None,
                    help="a step_* directory (default: the run's newest checkpoint)")
    ex.add_argument("--quantize-dense", action="store_true",
                    help="also dynamic-int8 quantize the MLPs' linear layers")
    ex.set_defaults(func=_cmd_export)

    add_serve_command(sub)

    demo = sub.add_parser("demo", help="generate data, train, evaluate, export: the quick start")
    demo.add_argument("--out", default="runs/demo", help="where data and the run go")
    demo.add_argument("--rows", type=int, default=DEMO_ROWS, help="synthetic rows")
    demo.add_argument("--max-steps", type=int, default=None, help="cap on training steps")
    demo.add_argument("--quiet", action="store_true")
    demo.set_defaults(func=_cmd_demo)

