"""Held-out AUC of the three id mappings at the same table memory: zero-collision hashing
(``--id-mapping zch``) against plain modulo hashing and the train-split vocabulary.

For each dataset, raw ids are kept (``zch``) and the number of distinct train ids ``D_f`` of
each raw-id feature counted. At a memory fraction ``p`` (default 10% and 50%) both mappings get
``p * sum(D_f)`` rows over those features: ``zch`` as ``--zch-rows ceil(p * sum(D_f) / n)`` per
table (ids admitted by the remapping, the rest share one row), ``hash`` as ``ceil(p * D_f)``
rows per feature (``raw % rows``). ``vocabulary`` (a row for every train id, the default
preprocessing) is the reference with all the memory it wants. Every run trains with the
defaults (the app's derived batch size, early stopping on validation AUC) and is scored on the
test split, which training never reads. One JSON line per (dataset, mapping, fraction, seed).

Datasets: the Criteo Kaggle sample (10k rows, 26 raw-id features), MovieLens 100K (user and
movie ids raw; genres and user attributes keep their vocabularies), and a teacher-labelled
synthetic dataset whose ids (5 features, 20k-100k values each, Zipf) outnumber the tables.

Usage: python bench/zch_quality.py [--seeds 0,1,2] [--fractions 0.1,0.5]
       [--datasets kaggle,movielens,synthetic] [--work DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from common import cpu_model

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dlrm_app.data.schema import DatasetSpec, sha256_file  # noqa: E402
from dlrm_app.training.config import TrainConfig  # noqa: E402
from dlrm_app.training.evaluate import evaluate_checkpoint  # noqa: E402
from dlrm_app.training.trainer import train  # noqa: E402

SHARED = ROOT.parent / "shared" / "data"


def distinct_train_ids(data: Path) -> dict[str, int]:
    """Distinct ids of each raw-id feature in the train split."""
    spec = DatasetSpec.load(data)
    raw = [f.name for f in spec.sparse_features if f.raw_ids]
    seen: dict[str, set[int]] = {n: set() for n in raw}
    for shard in spec.split("train").shards:
        table = pq.read_table(data / shard.file, columns=raw)
        for n in raw:
            seen[n].update(pc.list_flatten(table.column(n)).to_pylist())
    return {n: len(s) for n, s in seen.items()}


def rewrite(src: Path, out: Path, features: dict[str, tuple[bool, int]],
            transform: dict[str, int] | None = None) -> Path:
    """A copy of dataset ``src`` whose features ``name -> (raw_ids, num_embeddings)`` change,
    optionally with ids taken ``% transform[name]`` (modulo hashing)."""
    spec = DatasetSpec.load(src)
    out.mkdir(parents=True, exist_ok=True)
    splits = []
    for split in spec.splits:
        shards = []
        for shard in split.shards:
            table = pq.read_table(src / shard.file)
            for name, modulus in (transform or {}).items():
                col = table.column(name).combine_chunks()
                values = pa.array(np.asarray(col.flatten()) % modulus)
                table = table.set_column(table.schema.get_field_index(name), name,
                                         pa.ListArray.from_arrays(col.offsets, values))
            pq.write_table(table, out / shard.file, row_group_size=shard.row_group_size)
            shards.append(dataclasses.replace(shard, sha256=sha256_file(out / shard.file)))
        splits.append(dataclasses.replace(split, shards=tuple(shards)))
    sparse = tuple(dataclasses.replace(f, raw_ids=features[f.name][0],
                                       num_embeddings=features[f.name][1])
                   if f.name in features else f for f in spec.sparse_features)
    dataclasses.replace(spec, sparse_features=sparse, splits=tuple(splits)).save(out)
    return out


def prepare(name: str, work: Path) -> tuple[Path, Path]:
    """``(raw-id dataset, vocabulary dataset)`` of one bench dataset."""
    from dlrm_app.data.criteo import preprocess_criteo
    from dlrm_app.data.movielens import preprocess_movielens
    from dlrm_app.data.synthetic import generate

    if name == "kaggle":
        src = SHARED / "criteo" / "kaggle_head_10k.tsv"
        preprocess_criteo([src], work / "kaggle_zch", id_mapping="zch")
        preprocess_criteo([src], work / "kaggle_vocab")
        return work / "kaggle_zch", work / "kaggle_vocab"
    if name == "movielens":
        src = SHARED / "movielens" / "ml-100k"
        preprocess_movielens(src, work / "ml_zch", id_mapping="zch")
        preprocess_movielens(src, work / "ml_vocab")
        return work / "ml_zch", work / "ml_vocab"
    cards = [100_000, 60_000, 40_000, 20_000, 20_000]
    generate(work / "synth_vocab", rows=200_000, num_dense=4, cardinalities=cards,
             pooling_factors=[1.0] * len(cards), zipf_alpha=1.05, seed=0)
    spec = DatasetSpec.load(work / "synth_vocab")
    raw = {f.name: (True, f.num_embeddings) for f in spec.sparse_features}
    return rewrite(work / "synth_vocab", work / "synth_zch", raw), work / "synth_vocab"


def run(data: Path, out: Path, seed: int, zch_rows: int | None = None) -> dict[str, float]:
    config = TrainConfig.from_json_dict(
        {"data": str(data), "out": str(out), "seed": seed, "overwrite": True,
         "model": {"zch_rows": zch_rows}}, where="bench")
    summary = train(config, progress=False)
    test = evaluate_checkpoint(out, split="test")
    return {"validation_auc": round(summary["validation"]["auc"], 4),
            "test_auc": round(test["auc"], 4), "steps": summary["steps"],
            "samples_per_s": round(summary["samples_per_s"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--fractions", default="0.1,0.5")
    parser.add_argument("--datasets", default="kaggle,movielens,synthetic")
    parser.add_argument("--work", default=None, help="scratch directory (default: a temp dir)")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    fractions = [float(f) for f in args.fractions.split(",")]
    cpu = cpu_model()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        for name in args.datasets.split(","):
            zch, vocab = prepare(name, work / name)
            distinct = distinct_train_ids(zch)
            base = {"bench": "zch_quality", "dataset": name, "cpu": cpu,
                    "raw_features": len(distinct), "distinct_train_ids": sum(distinct.values())}
            for seed in seeds:
                print(json.dumps({**base, "mapping": "vocabulary", "fraction": None,
                                  "seed": seed, **run(vocab, work / "run", seed)}), flush=True)
            for p in fractions:
                total = math.ceil(p * sum(distinct.values()))
                per_feature = {n: max(2, math.ceil(p * d)) for n, d in distinct.items()}
                hashed = rewrite(zch, work / name / f"hash_{p}",
                                 {n: (False, r) for n, r in per_feature.items()}, per_feature)
                zch_rows = max(2, math.ceil(total / len(distinct)))
                for seed in seeds:
                    common = {**base, "fraction": p, "rows_total": total, "seed": seed}
                    print(json.dumps({**common, "mapping": "zch", "zch_rows": zch_rows,
                                      **run(zch, work / "run", seed, zch_rows)}), flush=True)
                    print(json.dumps({**common, "mapping": "hash",
                                      **run(hashed, work / "run", seed)}), flush=True)


if __name__ == "__main__":
    main()
