"""What a ``.pt2`` export costs, stage by stage: ``export_model`` (int8, the CLI's default) on
two trained models, with a warm and a cold inductor cache, in this process and in a new one.

The models (``--models``), each trained ``--steps`` steps (only the exported model's shape
matters, and that comes from the data and the default flags, not from training longer):

  main_job  the README's main job: ``preprocess criteo`` of the Kaggle sample
            (../shared/data/criteo/kaggle_head_10k.tsv from the repository's root) and
            ``train`` with the default flags
  demo      ``dlrm-app demo``'s generated dataset (``--demo-rows``, the demo's by default) and
            training flags

Each export runs in this process (``export_model``; the CLI adds its imports) and is cut into
stages by the ``progress`` callback that ``export_model`` calls as each stage starts: load the
checkpoint, quantize the tables, then per program (``model``, and ``encode`` for raw rows)
``torch.export`` and the AOTInductor compile (nearly all of it g++), then ``package`` (the PT2
archive, the reproducible serialization id, the sha256, the renames and the run's export
record) up to the return; ``total`` is the call's own time, from before its argument checks.

Caches (the ``cache`` of a line): all exports use one inductor cache directory of this run
(its path is compiled into the library, so one path keeps the digests comparable).

  warm              ``--repeats`` exports per model in this process, interleaved over the
                    models, after ``--warmup`` untimed ones (the first export in a process also
                    pays for inductor's imports and first uses)
  cold              (unless ``--no-cold``) per model, first: one export in a new process with
                    the directory emptied (inductor probes the CPU's vector instruction sets
                    once per directory and memoizes them in the process: a cold run needs a new
                    process)
  warm_new_process  (unless ``--no-cold``) right after it, one more in a new process, the
                    directory as the cold one left it: what ``dlrm-app export`` pays, less the
                    CLI's imports

The precompiled header, kept outside the cache directory, is warm in all three.

Threads: every export runs with torch's thread count as this process started with it (what
``dlrm-app export`` runs with: ``train`` sets its own, and inductor generates OpenMP loops only
for more than one thread, so the count changes the compiled code and the digest).

Output (stdout; progress goes to stderr): a header line (CPU from lscpu with its widest vector
extension, the CPUs usable, torch, FBGEMM, the C++ compiler inductor calls, the 1-minute load
average), one line per (model, cache, stage) with the median seconds, every run's seconds and
the load averages seen at their starts, and one line per model with the .pt2's bytes and
whether every export of it (in all caches) gave the same sha256, as it should.

Usage: python bench/export.py [--models main_job demo] [--repeats 3] [--warmup 1] [--no-cold]
                              [--steps 20] [--demo-rows 500000]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import load_avg, log
from torchrec_program import cpu_name  # the sibling bench's (lscpu model + vector extension)

ROOT = Path(__file__).resolve().parents[1]
KAGGLE = ROOT.parent / "shared" / "data" / "criteo" / "kaggle_head_10k.tsv"
MODELS = ("main_job", "demo")
CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
CACHES = ("warm", "warm_new_process", "cold")

# export_model's progress messages (dlrm_app/serving/export.py) -> this bench's stages
STAGE_MESSAGES = (
    (re.compile(r"loading "), "load", None),
    (re.compile(r"quantizing "), "quantize", None),
    (re.compile(r"torch\.export: program '(\w+)'"), "torch_export", 1),
    (re.compile(r"AOTInductor: compiling '(\w+)'"), "aot_compile", 1),
    (re.compile(r"packaging "), "package", None),
    (re.compile(r"wrote "), "package", None),  # the digest's renames: still packaging
)


@dataclass
class StageClock:
    """A ``Progress`` for ``export_model`` that timestamps each stage as it starts."""

    marks: list[tuple[float, str, str | None]] = field(default_factory=list)

    def __call__(self, message: str) -> None:
        now = time.perf_counter()
        for pattern, stage, group in STAGE_MESSAGES:
            found = pattern.match(message)
            if found:
                self.marks.append((now, stage, found.group(group) if group else None))
                return
        raise ValueError(f"bench/export.py: export_model reported a stage this bench does not "
                         f"know ({message!r}); add its message to STAGE_MESSAGES")

    def stages(self, end: float) -> dict[str, float]:
        """Seconds per stage (``stage`` or ``stage:program``), each until the next stage's
        start or ``end``; stages reported twice in a row (package) are one."""
        out: dict[str, float] = {}
        ends = [t for t, _, _ in self.marks[1:]] + [end]
        for (start, stage, program), stop in zip(self.marks, ends, strict=True):
            key = f"{stage}:{program}" if program else stage
            out[key] = out.get(key, 0.0) + stop - start
        return out


def timed_export(run: Path, out: Path) -> dict[str, Any]:
    """One int8 .pt2 export of ``run``'s best checkpoint: stage seconds, total, bytes, sha256."""
    from dlrm_app.serving.export import export_model

    clock = StageClock()
    loadavg = load_avg()
    start = time.perf_counter()
    result = export_model(run, out, "int8", progress=clock)
    end = time.perf_counter()
    return {"stages": {**clock.stages(end), "total": end - start}, "load_avg_1m": loadavg,
            "bytes": result["bytes"], "sha256": result["sha256"]}


def new_process_export(run: Path, out: Path, cache: Path, threads: int, *, empty: bool
                       ) -> dict[str, Any]:
    """``timed_export`` with ``threads`` torch threads in a new process whose inductor cache
    directory is ``cache`` (emptied first if ``empty``)."""
    if empty:
        shutil.rmtree(cache, ignore_errors=True)
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child-export",
                           str(run), str(out), str(threads)],
                          env={**os.environ, CACHE_ENV: str(cache)}, capture_output=True,
                          text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"bench/export.py: the new process's export of {run} failed (exit "
                         f"{proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.splitlines()[-1])


# ---- the models ------------------------------------------------------------------------------
def train_main_job(root: Path, steps: int) -> Path:
    """The README's main job: preprocess the Kaggle sample and train with the default flags."""
    from dlrm_app.data.criteo import preprocess_criteo
    from dlrm_app.training.config import TrainConfig
    from dlrm_app.training.trainer import train

    if not KAGGLE.is_file():
        raise SystemExit(f"bench/export.py: {KAGGLE} not found (the shared samples are expected "
                         "in ../shared/data beside the repository); pass --models demo to "
                         "measure the demo's model only")
    preprocess_criteo([KAGGLE], root / "data")
    train(TrainConfig.from_flags(data=str(root / "data"), out=str(root / "run"), max_steps=steps),
          progress=False)
    return root / "run"


def train_demo(root: Path, steps: int, rows: int) -> Path:
    """``dlrm-app demo``'s dataset and training flags (run_demo's), stopped after ``steps``."""
    from dlrm_app.demo import demo_data
    from dlrm_app.training.config import TrainConfig
    from dlrm_app.training.trainer import train

    demo_data(root / "data", rows, progress=False)
    train(TrainConfig.from_flags(data=str(root / "data"), out=str(root / "run"), max_steps=steps,
                                 log_every=20, overwrite=True), progress=False)
    return root / "run"


# ---- the report ------------------------------------------------------------------------------
def header(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from torch._inductor.cpp_builder import get_cpp_compiler

    from dlrm_app.threads import allowed_cpus
    from recsys_core.kernels import fbgemm_version

    compiler = get_cpp_compiler()
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                                 timeout=10).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        version = "unknown"
    return {"bench": "export_header", "cpu": cpu_name(), "cpus_usable": allowed_cpus(),
            "torch": torch.__version__, "fbgemm_gpu": fbgemm_version(), "compiler": version,
            "torch_threads": torch.get_num_threads(), "load_avg_1m": load_avg(), "models": args.models, "repeats": args.repeats,
            "warmup": args.warmup, "new_process_runs": not args.no_cold, "dtype": "int8",
            "train_steps": args.steps}


def stage_lines(cpu: str, model: str, cache: str, runs: list[dict[str, Any]]
                ) -> list[dict[str, Any]]:
    """One line per stage of ``runs`` (same model and cache), in the order they ran."""
    names = list(runs[0]["stages"])
    if any(list(r["stages"]) != names for r in runs):
        raise ValueError(f"{model} ({cache}): the exports went through different stages: "
                         f"{[list(r['stages']) for r in runs]}")
    lines = []
    for name in names:
        stage, _, program = name.partition(":")
        values = [r["stages"][name] for r in runs]
        lines.append({"bench": "export", "cpu": cpu, "model": model, "cache": cache,
                      "stage": stage, "program": program or None,
                      "median_s": round(statistics.median(values), 3),
                      "runs_s": [round(v, 3) for v in values],
                      "load_avg_1m": [r["load_avg_1m"] for r in runs]})
    return lines


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--repeats", type=int, default=3, help="timed warm-cache exports per model")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed exports in this process before the timed ones")
    p.add_argument("--no-cold", action="store_true", help="skip the exports in new processes (cold and warm_new_process)")
    p.add_argument("--steps", type=int, default=20, help="training steps per model")
    p.add_argument("--demo-rows", type=int, default=None,
                   help="rows of the demo's generated dataset (default: the demo's)")
    p.add_argument("--child-export", nargs=3, metavar=("RUN", "OUT", "THREADS"),
                   help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0 or args.steps < 1:
        p.error("--repeats and --steps must be >= 1, --warmup >= 0")
    return args


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    import torch

    if args.child_export:  # the child of new_process_export: one line on stdout
        run, out, threads = args.child_export
        torch.set_num_threads(int(threads))
        print(json.dumps(timed_export(Path(run), Path(out))))
        return
    from dlrm_app.config import DEMO_ROWS

    info = header(args)
    threads = info["torch_threads"]
    print(json.dumps(info), flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-export-") as tmp:
        root = Path(tmp)
        cache = root / "inductor"
        os.environ[CACHE_ENV] = str(cache)  # read by inductor at each use
        runs: dict[str, Path] = {}
        for model in args.models:
            log(f"training {model} ({args.steps} steps) in {root / model}")
            runs[model] = (train_main_job(root / model, args.steps) if model == "main_job"
                           else train_demo(root / model, args.steps,
                                           args.demo_rows or DEMO_ROWS))
        torch.set_num_threads(threads)  # training chose its own
        results: dict[tuple[str, str], list[dict[str, Any]]] = {}
        if not args.no_cold:
            for model in args.models:
                for state, empty in (("cold", True), ("warm_new_process", False)):
                    log(f"exporting {model}, {state}")
                    results[model, state] = [new_process_export(
                        runs[model], root / f"{state}.pt2", cache, threads, empty=empty)]
        for i in range(args.warmup):
            model = args.models[i % len(args.models)]
            log(f"exporting {model}, warm-up {i + 1}/{args.warmup} (not timed)")
            timed_export(runs[model], root / "warmup.pt2")
        for rep in range(args.repeats):
            for model in args.models:
                log(f"exporting {model}, warm cache, {rep + 1}/{args.repeats}")
                results.setdefault((model, "warm"), []).append(
                    timed_export(runs[model], root / f"{model}_{rep}.pt2"))
    for model in args.models:
        for cache_state in CACHES:
            if (model, cache_state) in results:
                for line in stage_lines(info["cpu"], model, cache_state,
                                        results[model, cache_state]):
                    print(json.dumps(line))
        every = [r for c in CACHES for r in results.get((model, c), [])]
        print(json.dumps({"bench": "export_artifact", "cpu": info["cpu"], "model": model,
                          "bytes": every[0]["bytes"], "mb": round(every[0]["bytes"] / 2**20, 2),
                          "exports": len(every),
                          "same_sha256": len({r["sha256"] for r in every}) == 1,
                          "sha256": sorted({r["sha256"] for r in every})}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
