"""Typed configuration of the commands: a dataclass per command of ``dlrm-app``
(``InfoConfig``, ``GenerateConfig``, ``CriteoConfig``, ``MovieLensConfig``, ``EvaluateConfig``,
``ExportConfig``, ``ServeCommand`` with its ``ServeConfig``, ``ReportConfig``, ``DemoConfig``)
and the model's ``ModelConfig``; ``dlrm-app train``'s ``TrainCommand`` and its ``TrainConfig``
are in ``dlrm_app.training.config``. Every command-line argument is generated from a field
(``dlrm_app.flags``): the field's type parses it, its default is shown in ``--help``, and the
docstring under it is the help line.

This module imports nothing heavy (no torch, numpy or pyarrow): the command line builds its
parser from it, so ``--help`` and argument errors answer at once.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Literal

DEFAULT_FREQUENCY_THRESHOLD = 1
"""Criteo: train occurrences a raw id needs for a row of its own (1: every id seen in train)."""
DEFAULT_MAX_EMBEDDINGS_PER_FEATURE = 10_000_000
"""Criteo: rows per table at most (the out-of-vocabulary row included)."""
DEMO_ROWS = 500_000
"""Synthetic rows ``dlrm-app demo`` generates."""


def positional(nargs: str | None = None) -> Any:
    """A field given as a positional argument (``nargs="+"``: one or more)."""
    return dataclasses.field(metadata={"cli": "positional", "nargs": nargs})


def required(metavar: str | None = None) -> Any:
    """A field whose flag must be given."""
    return dataclasses.field(metadata={"cli": "required", **({"metavar": metavar} if metavar
                                                             else {})})


def check_kind(what: str, value: Any, kind: type) -> None:
    """``value`` is a ``kind`` (a config field's enum, a section), else a ValueError naming
    ``what`` (a config built in code with a plain value where the flag would have parsed one)."""
    if not isinstance(value, kind):
        article = "an" if kind.__name__[0] in "AEIOU" else "a"
        raise ValueError(f"{what} must be {article} {kind.__name__}, got {value!r}")


class Interaction(enum.Enum):
    DOT = "dot"
    DCN = "dcn"


DEFAULT_BOTTOM_HIDDEN = (512, 256, 64)

ZCH_MEMORY_BYTES = 256 << 20
"""Memory the raw-id (zero-collision hashing) tables of a model share when ``--zch-rows`` is
not given: weights, their optimizer state and the remapping table."""
ZCH_EVICTION_INTERVAL = 16
"""Training steps between updates of each raw-id table's remapping (new ids get rows then)."""
"""Hidden layers of the default bottom MLP, before its output layer of the embedding dim."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Layer sizes of a DLRM (defaults: the reference DLRM's Criteo Kaggle configuration: dim 16,
    bottom 512-256-64-16, top 512-256-1; its Criteo 1TB one is dim 128, bottom 512-256-128, top
    1024-1024-512-256-1)."""

    embedding_dim: int = 16
    """Width of every embedding table."""
    dense_arch_layer_sizes: tuple[int, ...] | None = None
    """Bottom MLP, ending at the embedding dim; None: 512-256-64-DIM."""
    over_arch_layer_sizes: tuple[int, ...] = (512, 256, 1)
    """Top MLP, ending at 1 (one logit)."""
    interaction: Interaction = Interaction.DOT
    """dot: pairwise dot products (DLRM); dcn: DCN-v2 cross layers."""
    dcn_num_layers: int = 3
    """Cross layers (dcn only)."""
    dcn_low_rank_dim: int = 512
    """Rank of a cross layer (dcn only)."""
    wide: bool = True
    """Add a wide (logistic regression) part."""
    zch_rows: int | None = None
    """Rows per raw-id table (--id-mapping zch); None: 256 MiB over them."""

    def __post_init__(self) -> None:
        if self.dense_arch_layer_sizes is None:
            object.__setattr__(self, "dense_arch_layer_sizes",
                               (*DEFAULT_BOTTOM_HIDDEN, self.embedding_dim))
        for name in ("embedding_dim", "dcn_num_layers", "dcn_low_rank_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        rows = self.zch_rows
        if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 2):
            raise ValueError(f"--zch-rows must be an int >= 2 (one row for ids that have none "
                             f"of their own, and at least one to give), got {rows!r}")
        for name in ("dense_arch_layer_sizes", "over_arch_layer_sizes"):
            sizes = getattr(self, name)
            if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 1
                                for s in sizes):
                raise ValueError(f"ModelConfig.{name} must be a non-empty tuple of positive "
                                 f"ints, got {sizes!r}")
        if self.dense_arch_layer_sizes[-1] != self.embedding_dim:
            raise ValueError(
                f"the bottom MLP's last layer ({self.dense_arch_layer_sizes[-1]}) must equal "
                f"the embedding dim ({self.embedding_dim}): its output is interacted with the "
                "embeddings; change --dense-arch-layer-sizes or --embedding-dim")
        if self.over_arch_layer_sizes[-1] != 1:
            raise ValueError(f"the top MLP's last layer must be 1 (one logit), got "
                             f"{self.over_arch_layer_sizes!r}")
        check_kind("ModelConfig.interaction", self.interaction, Interaction)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """How ``PredictionServer`` binds, batches and bounds requests."""

    host: str = "127.0.0.1"
    """Address to bind; the default answers this machine only."""
    port: int = 8080
    """TCP port; 0 picks a free one (``PredictionServer.start`` returns it)."""
    max_batch_rows: int = 512
    """Rows merged into one model call (a single larger request runs alone)."""
    max_wait_ms: float = 2.0
    """How long the worker waits after a request for more to batch with it (only while
    other requests are being read or parsed)."""
    max_body_bytes: int = 1 << 20
    """Larger request bodies are refused (413) from their Content-Length."""
    max_rows: int = 4096
    """Requests with more rows are refused (413)."""
    threads: int | None = None
    """torch intra-op threads for the model (process-wide); None keeps torch's default."""
    request_timeout_s: float = 30.0
    """A connection idle (or a body unsent) this long is closed."""
    latency_window: int = 10_000
    """``/metrics`` latency percentiles cover this many most recent predictions."""
    drain_timeout_s: float = 10.0
    """On SIGTERM (or ``stop()``): stop accepting, then answer the requests already received
    for at most this long before exiting."""
    watch_interval_s: float = 0.5
    """Seconds between checks for a new model renamed over the file (0: on SIGHUP only;
    docs/serving.md)."""

    def __post_init__(self) -> None:
        for name in ("max_batch_rows", "max_body_bytes", "max_rows", "latency_window"):
            if getattr(self, name) < 1:
                raise ValueError(f"ServeConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"ServeConfig.port must be in [0, 65535], got {self.port}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"ServeConfig.drain_timeout_s must be >= 0, got "
                             f"{self.drain_timeout_s}")
        if self.watch_interval_s < 0:
            raise ValueError(f"ServeConfig.watch_interval_s must be >= 0 (0: reload on SIGHUP "
                             f"only), got {self.watch_interval_s}")
        if self.max_wait_ms < 0 or self.request_timeout_s <= 0:
            raise ValueError(f"ServeConfig: max_wait_ms must be >= 0 and request_timeout_s > 0, "
                             f"got {self.max_wait_ms}, {self.request_timeout_s}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"ServeConfig.threads must be >= 1 or None, got {self.threads}")


# --- the other commands ----------------------------------------------------------------------

Split = Literal["train", "validation", "test"]
IdMapping = Literal["vocabulary", "hash", "zch"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class InfoConfig:
    """``dlrm-app info``."""

    device: str = "cpu"
    """Device to report kernel choices for."""
    json: bool = False
    """Print one JSON object."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerateConfig:
    """``dlrm-app generate``: a synthetic Criteo-shaped dataset."""

    out: str = required()
    """Output directory (shards + dataset.json)."""
    rows: int = 100_000
    """Total rows over all splits."""
    num_dense: int = 13
    """Number of dense features."""
    num_sparse: int = 26
    """Number of sparse features."""
    cardinalities: str = "10000"
    """Ids per sparse feature: one int or a comma list of --num-sparse."""
    pooling_factors: str = "1"
    """Mean ids per row (1 = one-hot): one float or a comma list."""
    zipf_alpha: float = 1.05
    """Id popularity skew."""
    seed: int = 0
    """Same seed -> identical files."""
    rows_per_shard: int = 1_000_000
    """Rows per file."""
    row_group_size: int = 65_536
    """Rows per Parquet row group (the generated rows do not depend on it)."""
    days: int = 1
    """Generate this many days (all but the last train, the last day's halves validation and
    test) that drift by --drift from day to day."""
    drift: float = 0.05
    """With --days: each day this share of every feature's popularity ranks passes to a new id,
    and the teacher's weights move by this fraction of their norm."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class CriteoConfig:
    """``dlrm-app preprocess criteo``."""

    inputs: tuple[str, ...] = positional("+")
    """TSV files in order (terabyte: one per day)."""
    out: str = required()
    """Output directory (shards + dataset.json)."""
    format: Literal["kaggle", "terabyte"] = "kaggle"
    """kaggle: split by row order 6/7, 1/14, 1/14; terabyte: the last day's halves are
    validation and test."""
    num_embeddings_per_feature: str | None = None
    """Hash ids modulo this many rows instead of a vocabulary: one int or a comma list of 26
    (the reference DLRM uses 40000000 for Criteo 1TB)."""
    frequency_threshold: int | None = None
    """Vocabulary of the ids seen >= K times in the train split; the rest share row 0 (default:
    1)."""
    max_embeddings_per_feature: str | None = None
    """Cap on vocabulary rows per table, the most frequent ids kept: one int or a comma list of
    26 (default: 10000000)."""
    id_mapping: IdMapping | None = None
    """How raw ids become rows: vocabulary (default), hash, or zch (raw ids, mapped while
    training; docs/zch.md)."""
    one_split: Split | None = None
    """With --like: every row into this split (a held-out file to score whole with `dlrm-app
    evaluate RUN --data OUT --split test`)."""
    rows_per_shard: int = 1_000_000
    """Rows per file."""
    row_group_size: int = 65_536
    """Rows per Parquet row group."""
    on_bad_row: Literal["error", "skip"] = "error"
    """error: stop at the first bad row; skip: drop and count them."""
    max_bad_row_fraction: float = 0.5
    """With --on-bad-row skip: refuse the input when more than this fraction of its rows are
    bad (most likely not Criteo files)."""
    like: str | None = None
    """Encode with this existing dataset's hashing or vocabulary (so its model reads the
    output)."""
    workers: int = 1
    """Processes that parse, encode and write (about 0.4 GB each; the same output for any N;
    docs/data.md)."""
    days: int | None = None
    """kaggle: cut the inputs' lines into this many days of consecutive lines (default: one
    day); terabyte inputs are one day each."""
    add_day: bool = False
    """Append each input as a new day to the dataset in --out, encoded as it is (new ids get
    rows within the tables' budget), without rewriting its files."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class MovieLensConfig:
    """``dlrm-app preprocess movielens``."""

    src: str = positional()
    """Unpacked release folder (u.data, ratings.dat or ratings.csv)."""
    out: str = required()
    """Output directory (shards + dataset.json)."""
    positive_rating: float = 4.0
    """Label is 1 when rating >= this."""
    split_method: Literal["leave_last_out", "fraction"] = "leave_last_out"
    """Per user by time: last rating test, one before validation; or the last --test-fraction
    test and as many before validation."""
    test_fraction: float = 0.1
    """Fraction of each user's ratings in test (--split-method fraction)."""
    id_mapping: IdMapping = "vocabulary"
    """user_id and movie_id: vocabulary, hash (--num-embeddings-per-feature rows) or zch (raw
    ids, docs/zch.md)."""
    num_embeddings_per_feature: int | None = None
    """With --id-mapping hash: rows of the user_id and movie_id tables."""
    seed: int = 0
    """Row order inside each split."""
    rows_per_shard: int = 1_000_000
    """Rows per file."""
    row_group_size: int = 65_536
    """Rows per Parquet row group."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvaluateConfig:
    """``dlrm-app evaluate``."""

    run: str = positional()
    """Run directory written by `dlrm-app train` (its --out)."""
    checkpoint: str = "best"
    """best (the best validation AUC; the newest checkpoint where none was recorded), latest,
    or a step_* directory."""
    split: Split = "test"
    """Which split of the dataset to score."""
    data: str | None = None
    """Dataset directory (None: the run's); encode other files with `dlrm-app preprocess ...
    --like RUN_DATA`."""
    batch_size: int = 8192
    """Rows per rank per batch."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExportConfig:
    """``dlrm-app export``."""

    run: str = positional()
    """Run directory written by `dlrm-app train` (its --out)."""
    out: str = required()
    """The artifact to write, e.g. model.pt2 (model.pt with --format torchscript)."""
    format: Literal["pt2", "torchscript"] = "pt2"
    """pt2: torch.export + AOTInductor programs and manifest; torchscript: one legacy
    TorchScript file."""
    lookup: Literal["auto", "fbgemm", "torch"] = "auto"
    """.pt2 lookups: FBGEMM's op, or plain torch (loads without FBGEMM); auto: FBGEMM where it
    loads."""
    dtype: Literal["fp32", "fp16", "int8", "int4"] = "int8"
    """Embedding table storage (row-wise scale/bias for int8/int4)."""
    checkpoint: str = "best"
    """best (the best validation AUC; the newest checkpoint where none was recorded), latest,
    or a step_* directory."""
    quantize_dense: bool = False
    """Also dynamic-int8 quantize the MLPs' linear layers (--format torchscript only)."""
    full: bool = False
    """Compile the program even when --out already holds it (a .pt2 with this checkpoint's
    program fingerprint: same model config, tables and export options), where the export
    otherwise writes the weights alone beside it (model.weights for model.pt2)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServeCommand:
    """``dlrm-app serve``: which artifact, and the server's ``ServeConfig``."""

    model: str = positional()
    """Exported model file (dlrm-app export)."""
    expect_sha256: str | None = dataclasses.field(default=None, metadata={"metavar": "HEX"})
    """The model file's sha256 (as export printed it), checked before loading; None:
    MODEL.sha256 if any."""
    server: ServeConfig = ServeConfig()
    """Binding, batching and bounds."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReportConfig:
    """``dlrm-app report``."""

    run: str = positional()
    """Run directory written by `dlrm-app train` (its --out)."""
    tensorboard: bool = False
    """Also write TensorBoard event files to RUN/tensorboard (needs pip install -e
    ".[tensorboard]")."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """``dlrm-app demo``: generate data, train, evaluate, export."""

    out: str = "runs/demo"
    """Where data and the run go."""
    rows: int = DEMO_ROWS
    """Synthetic rows."""
    max_steps: int | None = None
    """Cap on training steps (None: the run's own stopping rule)."""
    quiet: bool = False
    """No progress bars."""
    threads: int | None = None
    """torch threads (None: chosen from the CPUs this process may use, as `train --threads`
    is)."""

