"""The README's measured numbers, checked against the benches that measure them.

Each claim names the bench command(s) that measure it and where in the README the numbers
stand (a pattern with one named group per number). ``--run NAME ...`` runs a claim's commands
and records their JSON lines in ``bench/results/NAME.jsonl`` (with the CPU and the date); the
check (no arguments; ``tests/test_readme_numbers.py`` runs it) computes each number from the
recorded lines, formats it as the README does and compares: a README number that is not what
its bench recorded, a claim the README no longer states, or a number in the README's prose
that no claim covers (other than the fixed facts listed in ``FACTS``) fails it.

Usage: python bench/readme_numbers.py                 # check the README against bench/results
       python bench/readme_numbers.py --run demo checkpoint ...   # measure again, then check
       python bench/readme_numbers.py --record-ci LOG  # the test counts and times of a CI log
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS = Path(__file__).resolve().parent / "results"
TORCHREC_PYTHON = "TORCHREC_PYTHON"  # placeholder in a command: --torchrec-python's value

Records = list[dict[str, Any]]


@dataclass(frozen=True)
class Claim:
    name: str
    commands: tuple[tuple[str, ...], ...]
    """Each prints JSON lines (``{bench}`` is this folder, ``{python}`` the interpreter)."""
    pattern: str
    """A regex on the README's prose (whitespace collapsed), one named group per number."""
    expect: Callable[[Records], dict[str, str | None]]
    """Each group's text, from the recorded lines (None: the README must not state it)."""
    source: str = ""
    """The recorded results' name (``bench/results/SOURCE.jsonl``) if not the claim's."""


def _lines(records: Records, **match: Any) -> Records:
    return [r for r in records if all(r.get(k) == v for k, v in match.items())]


def _one(records: Records, **match: Any) -> dict[str, Any]:
    found = _lines(records, **match)
    if len(found) != 1:
        raise ValueError(f"expected one recorded line with {match}, found {len(found)}")
    return found[0]


def _mean(values: list[float]) -> float:
    if not values:
        raise ValueError("no recorded values to average")
    return statistics.fmean(values)


def _thousands(x: float) -> str:
    return f"{round(x):,}"


# ---- the claims ------------------------------------------------------------------------------

def _about(seconds: float) -> str:
    """How the README rounds a wall time."""
    if seconds < 75:
        return "about a minute"
    if seconds < 105:
        return "about a minute and a half"
    return f"about {seconds / 60:.0f} minutes"


def _demo(records: Records) -> dict[str, str]:
    r = _one(records, bench="demo")
    auc, teacher = r["test_auc"], r["best_achievable_test_auc"]
    return {
        "minute": _about(r["seconds"]),
        "seconds": f"{r['seconds']:.0f}", "rss": f"{r['peak_rss_gb']:.2f}",
        "auc": f"{auc:.3f}", "teacher": f"{teacher:.3f}",
        "share": f"{100 * (auc - 0.5) / (teacher - 0.5):.0f}",
    }


def _quality(records: Records) -> dict[str, str]:
    def dlrm(dataset: str, nproc: int) -> str:
        lines = _lines(records, system="dlrm_defaults", dataset=dataset, nproc=nproc)
        if sorted(r["seed"] for r in lines) != [0, 1, 2]:
            raise ValueError(f"expected seeds 0-2 of the DLRM on {dataset} at {nproc} rank(s), "
                             f"found {len(lines)} lines")
        return f"{_mean([r['auc'] for r in lines]):.3f}"

    def logistic(dataset: str) -> str:  # fitted once per command, the same rows each time
        lines = _lines(records, system="logistic_regression", dataset=dataset)
        if not lines or len({round(r["auc"], 6) for r in lines}) != 1:
            raise ValueError(f"expected one logistic regression AUC on {dataset}")
        return f"{lines[0]['auc']:.3f}"

    return {
        "kaggle1": dlrm("criteo_kaggle_10k", 1), "kaggle2": dlrm("criteo_kaggle_10k", 2),
        "kaggle_lr": logistic("criteo_kaggle_10k"),
        "ml1": dlrm("movielens_100k", 1), "ml2": dlrm("movielens_100k", 2),
        "ml_lr": logistic("movielens_100k"),
    }


def _kfold(records: Records) -> dict[str, str]:
    dlrm = _one(records, system="dlrm_defaults", kfold_mean=True)
    lr = _one(records, system="logistic_regression", kfold_mean=True)
    return {"dlrm": f"{dlrm['auc']:.3f}", "dlrm_std": f"{dlrm['auc_std']:.3f}",
            "lr": f"{lr['auc']:.3f}", "lr_std": f"{lr['auc_std']:.3f}"}


def _torchrec(records: Records) -> dict[str, str]:
    def ratio(world: int, precision: str) -> str:
        lines = _lines(records, bench="torchrec_program_ratio", world_size=world,
                       precision=precision)
        return f"{_mean([r['recsys_core_over_torchrec'] for r in lines]):.2f}"

    return {"fp32_1": ratio(1, "fp32"), "bf16_1": ratio(1, "bf16"),
            "fp32_2": ratio(2, "fp32"), "bf16_2": ratio(2, "bf16")}


def _checkpoint(records: Records) -> dict[str, str]:
    def ms(world: int, impl: str) -> str:
        return _thousands(_one(records, bench="sharded_checkpoint", world=world, impl=impl,
                               timing="save_ms")["ms"])

    return {"ours2": ms(2, "layouts"), "base2": ms(2, "per_tensor"),
            "ours4": ms(4, "layouts"), "base4": ms(4, "per_tensor")}


def _zch(records: Records) -> dict[str, str]:
    return {"remap": f"{_one(records, case='mc_ebc', eviction_interval=16)['ms_per_batch']:.1f}",
            "plain": f"{_one(records, case='ebc_in_range')['ms_per_batch']:.1f}"}


def _ranks(records: Records) -> dict[str, str]:
    def k(dataset: str, busy: int, ranks: int) -> str:
        rate = _one(records, bench="ranks", dataset=dataset, busy_loops=busy, ranks=ranks)
        return f"{rate['samples_per_s'] / 1000:.1f}"

    return {f"{tag}{busy}_{n}": k(dataset, busy, n)
            for tag, dataset in (("ml", "movielens_100k"), ("kg", "criteo_kaggle_10k"))
            for busy in (0, 1) for n in (1, 2)}


def _days(records: Records) -> dict[str, str]:
    """The summary of the run at the defaults: the first header whose command adds no flag but
    ``--work`` (the file also holds runs with other flags, each after its own header)."""
    at_defaults = False
    for r in records:
        if r.get("bench") == "days_header":
            flags = r["command"].split()[2:]
            at_defaults = flags == [] or (len(flags) == 2 and flags[0] == "--work")
        elif r.get("bench") == "days_summary" and at_defaults:
            auc, ratio = r["mean_progressive_auc"], r["cpu_ratio_to_follow"]
            return {"follow": f"{auc['follow']:.3f}", "retrain": f"{auc['retrain']:.3f}",
                    "ratio": f"{ratio['retrain']:.1f}", "frozen": f"{auc['frozen']:.3f}"}
    raise ValueError("no days_summary of a run at the defaults is recorded")


def _ci(records: Records) -> dict[str, str]:
    full, t213, nofb = (_one(records, leg=leg) for leg in
                        ("full", "fast_torch213", "fast_without_fbgemm"))
    total = _lines(records, leg="ci")  # only in logs of .ci/run runs that print it
    return {"full_tests": _thousands(full["tests"]), "full_min": f"{full['seconds'] / 60:.0f}",
            "t213_s": f"{t213['seconds']:.0f}", "nofb_s": f"{nofb['seconds']:.0f}",
            "ci_min": f"{total[0]['seconds'] / 60:.0f}" if total else None}


def _ci_setup(records: Records) -> dict[str, str]:
    return {"setup_s": f"{_one(records, leg='setup')['seconds']}",
            "setup213_s": f"{_one(records, leg='setup_torch213')['seconds']}"}


CLAIMS = (
    Claim("demo", (("{python}", "{bench}/readme_numbers.py", "--demo-line"),),
          r"on a 2-core CPU it takes (?P<minute>about [a-z0-9 ]+?) \(measured: (?P<seconds>\d+) s "
          r"on the 2-core EPYC, generation, training, evaluation and export included, peak RSS "
          r"(?P<rss>[\d.]+) GB\)\. Measured: test AUC (?P<auc>[\d.]+) against the teacher's "
          r"(?P<teacher>[\d.]+) \((?P<share>\d+)% of the way from chance",
          _demo),
    Claim("quality", tuple(("{python}", "{bench}/quality.py", "--seeds", "0", "1", "2",
                            "--nproc", str(n)) for n in (1, 2)),
          r"Kaggle sample (?P<kaggle1>[\d.]+) on 1 rank, (?P<kaggle2>[\d.]+) on 2 ranks \(a "
          r"logistic regression on the same rows: (?P<kaggle_lr>[\d.]+)\); MovieLens 100K "
          r"(?P<ml1>[\d.]+) and (?P<ml2>[\d.]+) \((?P<ml_lr>[\d.]+)\)",
          _quality),
    Claim("kfold", (("{python}", "{bench}/quality.py", "--kfold", "5", "--seeds", "0", "1", "2",
                     "--datasets", "criteo_kaggle_10k"),),
          r"the default DLRM scores (?P<dlrm>[\d.]+) \(std (?P<dlrm_std>[\d.]+) over 5 folds x 3 "
          r"seeds\) and the logistic regression (?P<lr>[\d.]+) \(std (?P<lr_std>[\d.]+) over",
          _kfold),
    Claim("torchrec_program", (("{python}", "{bench}/torchrec_program.py", "--torchrec-python",
                                TORCHREC_PYTHON),),
          r"runs (?P<fp32_1>[\d.]+)x \(fp32\) and (?P<bf16_1>[\d.]+)x \(bf16\) TorchRec's "
          r"samples/s on one rank, (?P<fp32_2>[\d.]+)x and (?P<bf16_2>[\d.]+)x on two \(means "
          r"of 2 repeats\)",
          _torchrec),
    Claim("checkpoint", tuple(("{python}", "{bench}/checkpoint.py", "--world", str(w))
                              for w in (2, 4)),
          r"a checkpoint of 52 tables saves in (?P<ours2>[\d,]+) ms instead of (?P<base2>[\d,]+) "
          r"on 2 ranks, and in (?P<ours4>[\d,]+) ms instead of (?P<base4>[\d,]+) on 4",
          _checkpoint),
    Claim("zch", (("{python}", "{bench}/zch.py", "--zch-size", "103000", "--dim", "16",
                   "--eviction-intervals", "1,16,100"),),
          r"a training step with the remap takes (?P<remap>[\d.]+) ms against (?P<plain>[\d.]+) "
          r"ms without",
          _zch),
    Claim("ranks", (("{python}", "{bench}/ranks.py"),),
          r"MovieLens 100K trains at (?P<ml0_1>[\d.]+)k samples/s on 1 rank and (?P<ml0_2>[\d.]+)k "
          r"on 2, the Kaggle sample at (?P<kg0_1>[\d.]+)k and (?P<kg0_2>[\d.]+)k; with one core "
          r"taken by another process, (?P<ml1_1>[\d.]+)k and (?P<ml1_2>[\d.]+)k, "
          r"(?P<kg1_1>[\d.]+)k and (?P<kg1_2>[\d.]+)k\.",
          _ranks),
    Claim("days", (("{python}", "{bench}/days.py"),),
          r"following them scores a mean progressive AUC of (?P<follow>\d\.\d+) against "
          r"(?P<retrain>\d\.\d+) for retraining from scratch on all days so far, with "
          r"(?P<ratio>\d+\.\d)x less CPU, while the first day's model, frozen, falls to "
          r"(?P<frozen>\d\.\d+)",
          _days),
    Claim("ci_setup", (),  # recorded from a CI log (--record-ci)
          r"took (?P<setup_s>\d+) s in the recorded CI run \(torch 2\.14\.1\), "
          r"(?P<setup213_s>\d+) s for torch 2\.13\.0",
          _ci_setup, source="ci"),
    Claim("ci", (),  # recorded from a CI log (--record-ci)
          r"\((?P<full_tests>[\d,]+) tests: (?P<full_min>\d+) minutes on a 2-core AVX-512 "
          r"EPYC\).*?fast tier there \((?P<t213_s>\d+) s[;)].*?\((?P<nofb_s>\d+) "
          r"s(?:; CI in all: (?P<ci_min>\d+) minutes)?\)",
          _ci),
)

FACTS = (
    # versions and names
    r"Python 3\.10\+", r"torch(?:==|>=| )2\.1[34](?:\.\d)?(?:\+cpu)?", r"FBGEMM 1\.[89](?:\.0)?",
    r"fbgemm-gpu(?:-cpu)?==1\.[89]\.0", r"the newest \(2\.14\.1 here\)", r"PyPI's 2\.14\.1 build",
    r"medians of 3 runs", r"TorchRec 1\.8", r"CUDA 12\.8", r"cu128", r"1TB",
    r"2-core", r"Zen 4", r"AVX-512", r"\bC\b",
    # the data the README describes
    r"500k rows, 13 dense and 26 sparse features of 1,000 ids", r"first 10,000 rows",
    r"kaggle_head_10k", r"kaggle_1k", r"terabyte_day_sample_1k", r"ml-100k", r"ml100k",
    r"100K", r"kaggle2", r"1 and 2 ranks", r"1 rank", r"2 ranks", r"on two", r"on one rank",
    r"(?:port|--port) 8080", r"127\.0\.0\.1", r"\.pt2", r"int8", r"bf16", r"fp32", r"FP16",
    r"world sizes 1, 2 and 4", r"52 tables", r"5 folds x 3 seeds", r"5 folds", r"3 seeds",
    r"seeds 0-2", r"--kfold 5", r"26 features and batch 4096", r"torch\.Size\(\[2, 4\]\)",
    r"\bt1\b", r"\bf1\b", r"\[1, 2, 3\]", r"\[2, 1\]", r"embedding_dim=4", r"num_embeddings=10",
    r"\bp[0-9]\b", r"DISABLE_FBGEMM=1", r"--seeds 0 1 2", r"each took 3 s or more",
)


def _prose(text: str) -> str:
    """The README without its code blocks, whitespace collapsed."""
    text = re.sub(r"```.*?```", " ", text, flags=re.S)
    return re.sub(r"\s+", " ", text)


def load(name: str) -> Records:
    path = RESULTS / f"{name}.jsonl"
    if not path.is_file():
        how = "--record-ci LOG" if name == "ci" else f"--run {name}"
        raise FileNotFoundError(f"no recorded results for {name!r}: run "
                                f"python bench/readme_numbers.py {how}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


def check(readme: str | None = None) -> list[str]:
    """Every problem found (empty: the README's numbers are what the benches recorded)."""
    prose = _prose(README.read_text() if readme is None else readme)
    problems, covered = [], []
    for claim in CLAIMS:
        m = re.search(claim.pattern, prose)
        if m is None:
            problems.append(f"{claim.name}: the README no longer states it (pattern "
                            f"{claim.pattern[:60]!r}...); update CLAIMS in bench/readme_numbers.py")
            continue
        covered.append(m.span())
        try:
            expected = claim.expect(load(claim.source or claim.name))
        except (FileNotFoundError, ValueError, KeyError) as exc:
            problems.append(f"{claim.name}: {exc}")
            continue
        for group, want in expected.items():
            if m.group(group) != want:
                problems.append(f"{claim.name}: the README says {m.group(group)!r} for {group}, "
                                f"the recorded bench gives {want!r}")
    for fact in FACTS:
        covered += [m.span() for m in re.finditer(fact, prose)]
    for m in re.finditer(r"(?<![\w.\-/])\d[\d,.]*\d?%?", prose):
        if not any(a <= m.start() and m.end() <= b for a, b in covered):
            context = prose[max(0, m.start() - 40):m.end() + 20]
            problems.append(f"number {m.group()!r} is in no claim: ...{context}...")
    return problems


# ---- measuring -------------------------------------------------------------------------------

def cpu_name() -> str:
    """The sibling bench's CPU name (lscpu's model and widest vector extension)."""
    from torchrec_program import cpu_name as name  # this folder is on sys.path when run

    return name()


def demo_line() -> None:
    """``dlrm-app demo`` with every default, in a fresh folder: its seconds, peak RSS and
    summary as one JSON line."""
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "dlrm_app", "demo", "--out", tmp,
                               "--quiet"], capture_output=True, text=True, check=True)
        seconds = time.perf_counter() - start
    peak_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps({"bench": "demo", "seconds": round(seconds, 1),
                      "peak_rss_gb": round(peak_kb / 1024**2, 3), "cpu": cpu_name(),
                      **{k: summary[k] for k in ("test_auc", "best_achievable_test_auc",
                                                 "train_seconds", "steps")}}))


def run(name: str, torchrec_python: str | None) -> None:
    claim = next(c for c in CLAIMS if c.name == name)
    commands = []
    for command in claim.commands:
        argv = [a.format(python="python", bench="bench") for a in command]
        commands.append(" ".join("PATH" if a == TORCHREC_PYTHON else a for a in argv))
    lines = [json.dumps({"recorded": datetime.date.today().isoformat(), "cpu": cpu_name(),
                         "commands": commands})]
    for command in claim.commands:
        argv = [a.format(python=sys.executable, bench=Path(__file__).parent) for a in command]
        if TORCHREC_PYTHON in argv:
            if torchrec_python is None:
                raise SystemExit(f"{name} needs --torchrec-python PATH (an environment with "
                                 "torchrec==1.8.0)")
            argv[argv.index(TORCHREC_PYTHON)] = torchrec_python
        proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(argv)} failed:\n{proc.stderr[-3000:]}")
        lines += [line for line in proc.stdout.splitlines() if line.startswith("{")]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.jsonl").write_text("\n".join(lines) + "\n")


def record_ci(log: Path) -> None:
    """The test counts and times of a ``.ci/run`` log (pytest's summary lines, and the
    ``CI seconds`` line the script prints at its end)."""
    text = log.read_text()
    legs = []
    for m in re.finditer(r"^=*\s*(?P<summary>(?:\d+ failed, )?\d+ passed[^=\n]*) in "
                         r"(?P<s>[\d.]+)s", text, re.M):
        counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|skipped|failed|deselected)",
                                                    m.group("summary"))}
        legs.append({"tests": counts.get("passed", 0) + counts.get("skipped", 0)
                     + counts.get("failed", 0), "seconds": float(m.group("s")), **counts})
    if len(legs) < 3:
        raise SystemExit(f"{log}: expected the summary lines of the full suite and of the two "
                         "fast tiers (torch 2.13, without FBGEMM)")
    total = re.search(r"CI seconds: (\d+)", text)
    names = ["full", "fast_torch213", "fast_without_fbgemm"]
    out = [json.dumps({"recorded": datetime.date.today().isoformat(), "cpu": cpu_name(),
                       "log": log.name})]
    out += [json.dumps({"leg": n, **leg}) for n, leg in zip(names, legs[-3:], strict=True)]
    for name, pattern in (("setup", r"Setup seconds: (\d+)"),
                          ("setup_torch213", r"Setup seconds \(torch 2\.13\): (\d+)")):
        if (m := re.search(pattern, text)) is not None:
            out.append(json.dumps({"leg": name, "seconds": int(m.group(1))}))
    RESULTS.mkdir(exist_ok=True)
    if total:
        out.append(json.dumps({"leg": "ci", "seconds": int(total.group(1))}))
    (RESULTS / "ci.jsonl").write_text("\n".join(out) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", nargs="+", default=[], choices=[c.name for c in CLAIMS if c.commands])
    parser.add_argument("--torchrec-python", default=None)
    parser.add_argument("--record-ci", type=Path, default=None)
    parser.add_argument("--demo-line", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.demo_line:
        demo_line()
        return 0
    for name in args.run:
        run(name, args.torchrec_python)
    if args.record_ci is not None:
        record_ci(args.record_ci)
    problems = check()
    for claim in CLAIMS:
        print(json.dumps({"bench": "readme_numbers", "claim": claim.name,
                          "ok": not any(p.startswith(f"{claim.name}:") for p in problems)}))
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
