"""Model quality with default flags on real data, against a logistic regression on the same rows.

For each dataset the CLI runs as a new user would, with no tuning flag:

    dlrm-app preprocess <criteo|movielens> SRC --out DATA
    dlrm-app train --data DATA --out RUN                    (1 rank, or torchrun with --nproc)
    dlrm-app evaluate RUN --split test

and prints one JSON line per system and dataset (test AUC, NE, logloss, rows, seconds):

  dlrm_defaults        the DLRM above (its best checkpoint, chosen on the validation split);
                       its ``amp`` says whether the default --amp trained it in bfloat16
  dlrm_fp32            the same with --no-amp (the default's fp32 reference: with --amp on,
                       ``auc_minus_fp32`` is the bf16 fast path's cost in test AUC)
  logistic_regression  the same encoded dataset, same splits: one weight per categorical id (the
                       preprocessor's vocabulary) + the dense features as the loader gives them
                       (log-transformed for Criteo), standardized on train; L2 chosen on the
                       validation split from a small grid; full-batch L-BFGS in plain PyTorch
                       (at most 100 iterations, 125 evaluations per fit; the weights are
                       gathered with index_select and summed with index_add, 0.3 s a full-batch
                       forward + backward on 1M rows x 26 one-hot features on 2 CPU cores, so
                       1M rows need no mini-batches: synthetic_1m's 6 fits took 10 min on 2
                       busy cores). The cap is nearly free there: the chosen L2=100 converged
                       in 77 iterations; L2=10, which it stops early, converges in 217 to a
                       validation AUC 0.0001 higher (test 0.7349 instead of 0.7342)
  base_rate            predicts the train split's positive rate (AUC 0.5; NE 1 by definition
                       on the train rate)
  teacher              generated datasets only: the AUC of the hidden teacher's probabilities on
                       the same test rows (``parameters.teacher_auc.test`` in dataset.json), the
                       best any model can expect; the generator keeps no probabilities, so its
                       NE and logloss are null
  teacher_form         generated datasets only: the teacher's own functional form (one vector
                       per id of the teacher's dim, summed over the features, a bilinear term
                       with a linear map of the dense features, two linear terms and a bias:
                       the generator's model with unknown weights, nothing left to discover)
                       fitted to the same train rows, plain PyTorch Adagrad (lr 0.05, batch
                       256), up to 3 epochs, the epoch with the best validation AUC scored on
                       test: what learning from this many rows reaches with the right model

Datasets (found beside the repository: ../shared/data from its root, or --criteo/--movielens):
the Criteo Kaggle 10k-row sample and MovieLens 100K. Generated, only when named in
``--datasets`` (each takes minutes):

  synthetic_1m   ``dlrm-app generate --rows 1250000`` with the generator's other defaults (13
                 dense, 26 one-hot features of 10,000 ids; 0.8/0.1/0.1 split: 1M train rows)
  demo           the data ``dlrm-app demo`` trains on (``dlrm_app.demo.demo_data``, DEMO_ROWS)

Their DLRM trains with the defaults only (``--fp32-twin`` adds the --no-amp run), and ``--rows``
generates fewer rows (all splits), e.g. for a quick look.

``--kfold K`` (Criteo): a held-out protocol that cannot leak, on more rows than the sample's
own 715-row test split. Fold k's rows (row index mod K == k) are written to a file of their
own and training never reads them: the other rows are preprocessed (their train / validation /
test split as usual), the fold is encoded like them (``preprocess --like DATA --one-split
test``), the DLRM trains with the defaults and is scored on the fold (``evaluate RUN --data
FOLD``), and the logistic regression is fitted on exactly the same encoded train rows (L2 on
the same validation rows) and scored on the same fold. One JSON line per fold and seed, then a
``kfold_mean`` line per system.

Usage: python bench/quality.py [--nproc 1] [--seeds 0] [--datasets criteo_kaggle_10k movielens_100k]
       python bench/quality.py --datasets criteo_kaggle_10k --kfold 5 --seeds 0 1 2
       python bench/quality.py --datasets synthetic_1m demo --seeds 0 1 2 [--rows N] [--fp32-twin]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from dlrm_app.config import DEMO_ROWS
from dlrm_app.data.loader import ParquetLoader
from dlrm_app.data.schema import DatasetSpec
from dlrm_app.demo import demo_data
from dlrm_app.training.config import flatten
from recsys_core.metrics import BinaryClassificationMetrics

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
SOURCES = {
    "criteo_kaggle_10k": ("criteo", SHARED / "criteo" / "kaggle_head_10k.tsv"),
    "movielens_100k": ("movielens", SHARED / "movielens" / "ml-100k"),
}
GENERATED = {"synthetic_1m": 1_250_000, "demo": DEMO_ROWS}
"""Generated datasets (--datasets only) and their rows over all splits (train is 80%)."""
L2_GRID = (1e-2, 1e-1, 1.0, 10.0, 100.0)


def _cli(nproc: int, *args: str) -> dict:
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(nproc), "-m", "dlrm_app", *args]
    else:
        cmd = [sys.executable, "-m", "dlrm_app", *args]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


class _Ids(NamedTuple):
    """A split's categorical ids as one sparse design matrix: ``ids[j]`` (the feature's id
    shifted past the tables before it, so every (feature, id) has its own weight) is in row
    ``rows[j]``; a multi-hot bag is several entries of one row, an empty bag none."""

    ids: torch.Tensor
    rows: torch.Tensor


def _split_tensors(data: Path, split: str, spec: DatasetSpec) -> tuple[torch.Tensor, _Ids,
                                                                        torch.Tensor]:
    """(dense [n, d], the ids in ``spec``'s id space, labels [n]) of ``data``'s split, every
    column the loader reads (Criteo and MovieLens encodings, generated datasets' fixed-size
    ``dense`` lists and list<int64> bags alike)."""
    loader = ParquetLoader(data, split, batch_size=1 << 30, drop_last=False, shuffle=False,
                           prefetch=0)
    (batch,) = list(loader)
    sparse = batch.sparse.to_dict()
    rows = torch.arange(len(batch.labels))
    ids, where, shift = [], [], 0
    for feature in spec.sparse_features:
        bag = sparse[feature.name]
        ids.append(bag.values().long() + shift)
        where.append(torch.repeat_interleave(rows, bag.lengths().long()))
        shift += feature.num_embeddings
    return batch.dense, _Ids(torch.cat(ids), torch.cat(where)), batch.labels


class _LogReg(torch.nn.Module):
    """A weight per (feature, id), in one vector, + a linear map of the dense features; a bag
    adds its ids' weights. Gathered with index_select and summed into rows with index_add, the
    same function as one ``nn.EmbeddingBag(n, 1, mode="sum")`` per feature, 30x faster on CPU:
    0.3 s instead of 10 s per forward + backward on 1M rows x 26 one-hot features."""

    def __init__(self, num_ids: int, num_dense: int) -> None:
        super().__init__()
        self.sparse = torch.nn.Parameter(torch.zeros(num_ids))
        self.dense = torch.nn.Linear(num_dense, 1)
        torch.nn.init.zeros_(self.dense.weight)
        torch.nn.init.zeros_(self.dense.bias)

    def forward(self, dense: torch.Tensor, ids: _Ids) -> torch.Tensor:
        return self.dense(dense).squeeze(1).index_add(0, ids.rows,
                                                      self.sparse.index_select(0, ids.ids))

    def l2(self) -> torch.Tensor:
        return (self.sparse ** 2).sum() + (self.dense.weight ** 2).sum()


def _auc_ne(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    metrics = BinaryClassificationMetrics()
    metrics.update(logits.detach(), labels)
    found = metrics.compute()
    return {"auc": found["auc"], "ne": found["ne"], "logloss": found["logloss"]}


def logistic_regression(data: Path, held_out: Path | None = None) -> dict:
    """Fitted on ``data``'s train split, L2 chosen on its validation split, scored on its test
    split (or on ``held_out``'s, a dataset encoded like ``data``)."""
    spec = DatasetSpec.load(data)
    num_ids = sum(f.num_embeddings for f in spec.sparse_features)
    train, val = (_split_tensors(data, s, spec) for s in ("train", "validation"))
    test = _split_tensors(held_out or data, "test", spec)
    mean, std = train[0].mean(0), train[0].std(0).clamp_min(1e-6)

    def fit(l2: float) -> _LogReg:
        torch.manual_seed(0)
        model = _LogReg(num_ids, train[0].shape[1])
        opt = torch.optim.LBFGS(model.parameters(), lr=1, max_iter=100, history_size=20,
                                line_search_fn="strong_wolfe")
        x, bags, y = (train[0] - mean) / std, train[1], train[2]

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = F.binary_cross_entropy_with_logits(model(x, bags), y) + l2 * model.l2() / len(y)
            loss.backward()
            return loss

        opt.step(closure)
        return model

    def score(model: _LogReg, split: tuple) -> dict[str, float]:
        with torch.no_grad():
            return _auc_ne(model((split[0] - mean) / std, split[1]), split[2])

    start = time.perf_counter()
    chosen = max(L2_GRID, key=lambda l2: score(fit(l2), val)["auc"])
    test_metrics = score(fit(chosen), test)
    base = train[2].mean()
    base_logit = torch.full_like(test[2], float(torch.logit(base)))
    return {"logistic_regression": {**test_metrics, "l2": chosen,
                                    "seconds": time.perf_counter() - start},
            "base_rate": _auc_ne(base_logit, test[2]),
            "rows": {"train": len(train[2]), "validation": len(val[2]), "test": len(test[2])}}


def _dlrm(data: Path, run_dir: Path, nproc: int, seed: int, *flags: str,
          held_out: Path | None = None) -> dict:
    start = time.perf_counter()
    summary = _cli(nproc, "train", "--data", str(data), "--out", str(run_dir), "--quiet",
                   "--seed", str(seed), *flags)
    where = ["--data", str(held_out)] if held_out is not None else []
    test = _cli(1, "evaluate", str(run_dir), "--split", "test", *where)
    return {"nproc": nproc, "seed": seed, "amp": summary["amp"], "auc": test["auc"],
            "ne": test["ne"], "logloss": test["logloss"],
            "validation_auc": summary["validation"]["auc"], "steps": summary["steps"],
            "stopped": summary["stopped"], "samples_per_s": round(summary["samples_per_s"]),
            "seconds": round(time.perf_counter() - start, 1), "config": _train_config(run_dir)}


def _train_config(run_dir: Path) -> dict:
    """The hyper-parameters the run trained with (its config.json less paths and seed): the
    defaults move while they are tuned, so a line names the ones that gave its numbers."""
    config = flatten(json.loads((run_dir / "config.json").read_text()))  # keyed as the flags
    return {k: v for k, v in config.items() if k not in ("data", "out", "seed", "overwrite",
                                                          "resume", "offload_dir", "log_every")}


def run(name: str, work: Path, nproc: int, seeds: list[int], extra: Extra | None = None,
        fp32_twin: bool = True) -> list[dict]:
    """The dataset's own split: the DLRM per seed (and its --no-amp twin unless not
    ``fp32_twin``), the logistic regression and the base rate; ``extra`` flags added to
    preprocess and train."""
    extra = extra or Extra()
    kind, src = SOURCES[name]
    if not src.exists():
        raise SystemExit(f"{src} not found: pass --criteo / --movielens")
    data = work / f"{name}_data"
    _cli(1, "preprocess", kind, str(src), "--out", str(data), *extra.preprocess)
    baselines = logistic_regression(data)
    common = {"dataset": name, "rows": baselines["rows"]}
    if extra.preprocess or extra.train:
        common["extra_flags"] = {"preprocess": extra.preprocess, "train": extra.train}
    lines = []
    for seed in seeds:
        default = _dlrm(data, work / f"{name}_run_{seed}", nproc, seed, *extra.train)
        if not fp32_twin:
            lines.append({**common, "system": "dlrm_defaults", **default})
            continue
        fp32 = _dlrm(data, work / f"{name}_fp32_{seed}", nproc, seed, "--no-amp", *extra.train)
        lines.append({**common, "system": "dlrm_defaults", **default,
                      "auc_minus_fp32": default["auc"] - fp32["auc"]})
        lines.append({**common, "system": "dlrm_fp32", **fp32})
    for system in ("logistic_regression", "base_rate"):
        lines.append({**common, "system": system, **baselines[system]})
    return lines


class _TeacherForm(torch.nn.Module):
    """``logit = <z, h> + <z, u> + <h, v> + b`` with ``z`` the sum of the row's id vectors over
    ``sqrt(features)`` and ``h`` a linear map of the dense features: the generator's teacher
    (``dlrm_app.data.synthetic``; its temperature is a scale the weights absorb)."""

    def __init__(self, num_ids: int, num_features: int, num_dense: int, dim: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.nn.Parameter(torch.randn(num_ids, dim, generator=gen) * 0.01)
        self.dense = torch.nn.Linear(num_dense, dim, bias=False)
        self.u = torch.nn.Parameter(torch.zeros(dim))
        self.v = torch.nn.Parameter(torch.zeros(dim))
        self.bias = torch.nn.Parameter(torch.zeros(1))
        self.scale = num_features ** -0.5

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        z = self.ids[ids].sum(1) * self.scale  # ids [n, features], one per feature
        h = self.dense(dense)
        return (z * h).sum(1) + z @ self.u + h @ self.v + self.bias


def teacher_form(data: Path, epochs: int = 3, batch: int = 256) -> dict:
    """The ``teacher_form`` line of a generated dataset of one-hot features (see the module
    docs): fitted on the train split, the epoch chosen on validation, scored on test."""
    spec = DatasetSpec.load(data)
    num_ids = sum(f.num_embeddings for f in spec.sparse_features)
    splits = {}
    for name in ("train", "validation", "test"):
        dense, ids, labels = _split_tensors(data, name, spec)
        n, features = len(labels), len(spec.sparse_features)
        if len(ids.ids) != n * features:
            raise SystemExit(f"{data}: teacher_form takes one-hot features only")
        splits[name] = (dense, ids.ids.view(features, n).t().contiguous(), labels)
    start = time.perf_counter()
    torch.manual_seed(0)
    model = _TeacherForm(num_ids, len(spec.sparse_features), splits["train"][0].shape[1],
                         int((spec.teacher or {})["dim"]))
    opt = torch.optim.Adagrad(model.parameters(), lr=0.05)
    dense, ids, labels = splits["train"]
    best: dict = {"validation_auc": -1.0}
    for epoch in range(epochs):
        for rows in torch.randperm(len(labels)).split(batch):
            loss = F.binary_cross_entropy_with_logits(model(dense[rows], ids[rows]),
                                                      labels[rows])
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            val = _auc_ne(model(*splits["validation"][:2]), splits["validation"][2])
            if val["auc"] > best["validation_auc"]:
                best = {**_auc_ne(model(*splits["test"][:2]), splits["test"][2]),
                        "validation_auc": val["auc"], "epochs": epoch + 1}
    return {**best, "seconds": round(time.perf_counter() - start, 1)}


def generated_data(name: str, data: Path, rows: int | None = None) -> DatasetSpec:
    """``name``'s generated dataset in ``data`` (``rows`` in all splits; None: its own size):
    ``dlrm-app generate --rows R`` with the generator's defaults, or the demo's data."""
    rows = rows or GENERATED[name]
    if name == "demo":
        return demo_data(data, rows, progress=False)
    _cli(1, "generate", "--out", str(data), "--rows", str(rows))
    return DatasetSpec.load(data)


def run_generated(name: str, work: Path, nproc: int, seeds: list[int], rows: int | None = None,
                  fp32_twin: bool = False, train_flags: tuple[str, ...] = ()) -> list[dict]:
    """``run`` on a generated dataset, plus the ``teacher`` line. ``train_flags`` are added to
    every ``dlrm-app train`` (tests pass ``--max-steps``; the bench passes none)."""
    data = work / f"{name}_data"
    start = time.perf_counter()
    spec = generated_data(name, data, rows)
    generated_s = round(time.perf_counter() - start, 1)
    baselines = logistic_regression(data)
    common = {"dataset": name, "rows": baselines["rows"], "generated_seconds": generated_s}
    lines = []
    for seed in seeds:
        default = _dlrm(data, work / f"{name}_run_{seed}", nproc, seed, *train_flags)
        if not fp32_twin:
            lines.append({**common, "system": "dlrm_defaults", **default})
            continue
        fp32 = _dlrm(data, work / f"{name}_fp32_{seed}", nproc, seed, "--no-amp", *train_flags)
        lines.append({**common, "system": "dlrm_defaults", **default,
                      "auc_minus_fp32": default["auc"] - fp32["auc"]})
        lines.append({**common, "system": "dlrm_fp32", **fp32})
    for system in ("logistic_regression", "base_rate"):
        lines.append({**common, "system": system, **baselines[system]})
    # the generator keeps the teacher's AUC per split, not its probabilities: no NE or logloss
    lines.append({**common, "system": "teacher", "auc": (spec.teacher_auc or {})["test"],
                  "ne": None, "logloss": None, "seconds": None})
    lines.append({**common, "system": "teacher_form", **teacher_form(data)})
    return lines


def fold_rows(lines: list[str], folds: int, k: int) -> tuple[list[str], list[str]]:
    """(the rows training may read, fold ``k``'s held-out rows): row i is held out in fold
    ``i % folds``, so the folds partition the file."""
    rest = [x for i, x in enumerate(lines) if i % folds != k]
    return rest, [x for i, x in enumerate(lines) if i % folds == k]


class Extra(NamedTuple):
    """Flags added to every preprocess / train of the held-out protocols (to measure a change
    of defaults before making it one; empty for the defaults)."""

    preprocess: tuple[str, ...] = ()
    train: tuple[str, ...] = ()


NO_EXTRA = Extra()


def _held_out_runs(name: str, work: Path, nproc: int, seeds: list[int], rest: list[str],
                   held_out: list[str], common: dict, extra: Extra) -> list[dict]:
    """Preprocess ``rest`` (its own train / validation / test split), encode ``held_out`` like
    it, fit the logistic regression and train the DLRM per seed on exactly the same rows, and
    score both on the held-out rows."""
    kind, _ = SOURCES[name]
    work.mkdir(parents=True)
    (work / "rest.tsv").write_text("".join(rest))
    (work / "held_out.tsv").write_text("".join(held_out))
    data, held = work / "data", work / "held_out"
    _cli(1, "preprocess", kind, str(work / "rest.tsv"), "--out", str(data), *extra.preprocess)
    _cli(1, "preprocess", kind, str(work / "held_out.tsv"), "--out", str(held),
         "--like", str(data), "--one-split", "test")
    lr = logistic_regression(data, held)
    common = {**common, "held_out_rows": lr["rows"]["test"]}
    if extra.preprocess or extra.train:
        common["extra_flags"] = {"preprocess": extra.preprocess, "train": extra.train}
    results = [{**common, "system": "logistic_regression", **lr["logistic_regression"]}]
    for seed in seeds:
        results.append({**common, "system": "dlrm_defaults",
                        **_dlrm(data, work / f"run_{seed}", nproc, seed, *extra.train,
                                held_out=held)})
    for line in results:
        print(json.dumps(line), flush=True)
    return results


def _means(results: list[dict], common: dict) -> list[dict]:
    means = []
    for system in ("dlrm_defaults", "logistic_regression"):
        aucs = [r["auc"] for r in results if r["system"] == system]
        mean = sum(aucs) / len(aucs)
        spread = (sum((a - mean) ** 2 for a in aucs) / max(len(aucs) - 1, 1)) ** 0.5
        means.append({**common, "system": system, "mean": True, "auc": mean,
                      "auc_std": spread, "runs": len(aucs)})
    return means


def _criteo_lines(name: str, protocol: str) -> list[str]:
    kind, src = SOURCES[name]
    if kind != "criteo":
        raise SystemExit(f"--{protocol} is for the Criteo sample (its rows are in log order); "
                         f"{name} keeps its own split")
    if not src.exists():
        raise SystemExit(f"{src} not found: pass --criteo")
    return src.read_text().splitlines(keepends=True)


def run_kfold(name: str, work: Path, nproc: int, seeds: list[int], folds: int,
              extra: Extra = NO_EXTRA) -> list[dict]:
    lines = _criteo_lines(name, "kfold")
    results: list[dict] = []
    for k in range(folds):
        rest, held_out = fold_rows(lines, folds, k)
        results += _held_out_runs(name, work / f"{name}_fold{k}", nproc, seeds, rest, held_out,
                                  {"dataset": name, "protocol": f"kfold{folds}", "fold": k}, extra)
    return [{**m, "kfold_mean": True} for m in _means(
        results, {"dataset": name, "protocol": f"kfold{folds}"})]


def forward_rows(lines: list[str], fraction: float) -> tuple[list[str], list[str]]:
    """(the earlier rows training may read, the later ``fraction`` of the log held out): the
    log's order is time's, so the held-out rows all come after every training row."""
    cut = len(lines) - round(len(lines) * fraction)
    if not 0 < cut < len(lines):
        raise SystemExit(f"--forward {fraction}: holds out {len(lines) - cut} of {len(lines)} "
                         "rows; give a fraction in (0, 1)")
    return lines[:cut], lines[cut:]


def run_forward(name: str, work: Path, nproc: int, seeds: list[int], fraction: float,
                extra: Extra = NO_EXTRA) -> list[dict]:
    """Quality forward in time: train on the earlier rows of the log, score on the later ones
    (what a deployed model meets), DLRM and logistic regression on the same rows."""
    rest, held_out = forward_rows(_criteo_lines(name, "forward"), fraction)
    common = {"dataset": name, "protocol": f"forward{fraction:g}"}
    results = _held_out_runs(name, work / f"{name}_forward", nproc, seeds, rest, held_out,
                             common, extra)
    return _means(results, common)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", nargs="+", default=list(SOURCES),
                        choices=[*SOURCES, *GENERATED],
                        help=f"default: {' '.join(SOURCES)}; {' and '.join(GENERATED)} take "
                             f"minutes each")
    parser.add_argument("--nproc", type=int, default=1, help="ranks for dlrm-app train")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0],
                        help="train seeds; each trains with the defaults and with --no-amp (the "
                             "generated datasets: with --fp32-twin)")
    parser.add_argument("--kfold", type=int, default=0,
                        help="K > 1: the held-out K-fold protocol (Criteo; see the docs above)")
    parser.add_argument("--forward", type=float, default=0.0,
                        help="F in (0, 1): train on the log's earlier rows, score on its last "
                             "fraction F (Criteo; quality forward in time)")
    parser.add_argument("--preprocess-flags", default="",
                        help="flags added to preprocess (one string; not the generated data)")
    parser.add_argument("--train-flags", default="",
                        help="flags added to train (one string; not the generated data)")
    parser.add_argument("--work", type=Path, default=None,
                        help="keep the datasets and runs in this new folder (default: a "
                             "temporary one, deleted at the end), e.g. to evaluate the runs again")
    parser.add_argument("--criteo", type=Path, default=None, help="a Criteo Kaggle TSV")
    parser.add_argument("--movielens", type=Path, default=None, help="an ml-100k folder")
    parser.add_argument("--rows", type=int, default=None,
                        help="rows (all splits) of the generated datasets instead of "
                             + ", ".join(f"{k}'s {v:,}" for k, v in GENERATED.items()))
    parser.add_argument("--fp32-twin", action=argparse.BooleanOptionalAction, default=None,
                        help="also train each seed with --no-amp (default: the small datasets "
                             "do, the generated ones do not)")
    args = parser.parse_args()
    extra = Extra(tuple(args.preprocess_flags.split()), tuple(args.train_flags.split()))
    if args.criteo:
        SOURCES["criteo_kaggle_10k"] = ("criteo", args.criteo)
    if args.movielens:
        SOURCES["movielens_100k"] = ("movielens", args.movielens)
    if args.work is not None:
        args.work.mkdir(parents=True)  # a new folder: never mixes runs of two invocations
    with (contextlib.nullcontext(str(args.work)) if args.work is not None
          else tempfile.TemporaryDirectory()) as tmp:
        for name in args.datasets:
            if name in GENERATED:
                if args.kfold > 1:
                    raise SystemExit(f"--kfold is for the Criteo sample; {name} has its own "
                                     f"generated test split")
                lines = run_generated(name, Path(tmp), args.nproc, args.seeds, args.rows,
                                      bool(args.fp32_twin))
            elif args.forward:
                lines = run_forward(name, Path(tmp), args.nproc, args.seeds, args.forward, extra)
            elif args.kfold > 1:
                lines = run_kfold(name, Path(tmp), args.nproc, args.seeds, args.kfold, extra)
            else:
                lines = run(name, Path(tmp), args.nproc, args.seeds, extra,
                            fp32_twin=args.fp32_twin is not False)
            for line in lines:
                print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
