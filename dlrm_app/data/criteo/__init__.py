"""Criteo (Kaggle display-ads and 1TB click logs) TSV -> Parquet shards + ``dataset.json``.

Modules, in the order data flows through them:

=================  =========================================================================
``format``         the row format (fields, columns, kaggle vs terabyte splits), shared with
                   serving
``parse``          blocks of raw lines -> validated typed columns (vectorized)
``fastparse``      the optional C parser of rows in the strict format (same rows, one pass)
``lines``          reading blocks of whole lines; line counts and line indexes
``vocabulary``     the train-split vocabulary that sizes the tables (count, select, save, load)
``encoding``       vocabulary, hashing or ``like``: raw ids -> table rows; the block encoder
``workers``        running tasks in this process or in worker processes
``staging``        the single streaming pass into staging shards
``shard_tasks``    whole staging shards as worker tasks (bad rows are errors)
``finalize``       staging shards -> train / validation / test shards
``preprocess``     :func:`preprocess_criteo`, which ties them together
``add_day``        :func:`add_criteo_days`: a new day appended to a dataset, the others kept
=================  =========================================================================
"""

from dlrm_app.config import DEFAULT_FREQUENCY_THRESHOLD, DEFAULT_MAX_EMBEDDINGS_PER_FEATURE
from dlrm_app.data.criteo.add_day import add_criteo_days
from dlrm_app.data.criteo.encoding import EncodingRequest
from dlrm_app.data.criteo.format import (
    DENSE_NAMES,
    FORMATS,
    LABEL,
    NUM_DENSE,
    NUM_FIELDS,
    NUM_SPARSE,
    SPARSE_NAMES,
)
from dlrm_app.data.criteo.parse import count_lines
from dlrm_app.data.criteo.preprocess import preprocess_criteo
from dlrm_app.data.criteo.staging import STAGING_DIR
from dlrm_app.data.criteo.vocabulary import (
    DEFAULT_VOCABULARY_MEMORY_BYTES,
    RARE_ID,
    VOCABULARY_FILE,
    load_vocabulary,
)

__all__ = [
    "DEFAULT_FREQUENCY_THRESHOLD",
    "DEFAULT_MAX_EMBEDDINGS_PER_FEATURE",
    "DEFAULT_VOCABULARY_MEMORY_BYTES",
    "DENSE_NAMES",
    "FORMATS",
    "LABEL",
    "NUM_DENSE",
    "NUM_FIELDS",
    "NUM_SPARSE",
    "RARE_ID",
    "SPARSE_NAMES",
    "STAGING_DIR",
    "VOCABULARY_FILE",
    "EncodingRequest",
    "add_criteo_days",
    "count_lines",
    "load_vocabulary",
    "preprocess_criteo",
]
