"""Preprocessing under bad input and kills: rows the CSV parser cannot read become ``file:line``
errors or counted skips (never a parser message without a place, never an abort), echoed text is
cut short, and worker processes die with the main process."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.csv as pacsv
import pytest
from process_tree import descendants, kill_tree
from shared_data import KAGGLE_10K, ML100K

from dlrm_app.data.criteo import parse, preprocess_criteo
from dlrm_app.data.criteo.format import MAX_LINE_BYTES
from dlrm_app.data.movielens import preprocess_movielens

REPO = Path(__file__).resolve().parents[2]
BAD_LINE = 51  # 1-based line number of the damaged row


def _bad_kaggle(tmp_path: Path, kind: str) -> Path:
    lines = KAGGLE_10K.read_bytes().split(b"\n")[:200]
    fields = lines[10].split(b"\t")
    if kind == "dense_beyond_int64":
        fields[3] = b"99999999999999999999"
    elif kind == "not_utf8":
        fields[20] = b"\xff\xfe\xfd\xfc"
    elif kind == "huge_field":
        fields[20] = b"a" * (10 << 20)
    if kind == "binary_garbage":
        rng = random.Random(0)
        bad = bytes(rng.choice([b for b in range(256) if b != 10]) for _ in range(3000))
    else:
        bad = b"\t".join(fields)
    lines[BAD_LINE - 1] = bad
    path = tmp_path / f"{kind}.tsv"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


EXPECTED = {
    "dense_beyond_int64": r"integer feature int_2 = '99999999999999999999' has 20 digits "
                          r"\(beyond int64\)",
    "not_utf8": r"bytes that are not UTF-8 text at column \d+",
    "binary_garbage": r"a carriage return inside the row \(binary data\?\)|bytes that are not "
                      r"UTF-8 text",
    "huge_field": r"a line of 10,486,\d+ bytes, longer than 262,144 \(not a Criteo row\)",
}


@pytest.mark.shared_data(KAGGLE_10K)
@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_unparsable_row_is_named_or_skipped(tmp_path: Path, kind: str) -> None:
    path = _bad_kaggle(tmp_path, kind)
    with pytest.raises(ValueError) as info:
        preprocess_criteo([path], tmp_path / "out_error")
    message = str(info.value)
    assert message.startswith(f"{path}:{BAD_LINE}: "), message
    assert re.search(EXPECTED[kind], message), message
    assert len(message) < 400  # the 10 MB field is not echoed
    spec = preprocess_criteo([path], tmp_path / "out_skip", on_bad_row="skip")
    assert spec.parameters["skipped_rows"] == 1
    assert sum(s.rows for s in spec.splits) == 199


def test_long_lines_never_reach_the_csv_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    real = pacsv.read_csv

    def spy(source, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        data = source.getvalue()
        seen.append(max(len(line) for line in data.split(b"\n")))
        return real(source, *args, **kwargs)

    monkeypatch.setattr(parse.pacsv, "read_csv", spy)
    row = b"0\t" + b"\t".join([b"1"] * 13) + b"\t" + b"\t".join([b"68fd1e64"] * 26)
    huge = b"0\t1\t" + b"a" * (3 * MAX_LINE_BYTES)
    block = b"\n".join([row] * 1000 + [huge] + [row] * 1000) + b"\n"
    rows, skipped = parse.parse_block(block, 1, Path("x.tsv"), "skip")
    assert skipped == 1 and len(rows.label) == 2000
    assert seen and max(seen) <= MAX_LINE_BYTES
    assert parse._has_long_line(block) and not parse._has_long_line(b"\n".join([row] * 5000))


@pytest.mark.shared_data(ML100K)
def test_movielens_bad_rating_line_is_named(tmp_path: Path) -> None:
    src = tmp_path / "ml-100k"
    src.mkdir()
    for f in ML100K.iterdir():
        if f.is_file():
            (src / f.name).write_bytes(f.read_bytes())
    lines = (src / "u.data").read_bytes().split(b"\n")
    lines[99] = b"12\t\xff\xfe\t3\t881250949" + b"x" * 500
    (src / "u.data").write_bytes(b"\n".join(lines))
    with pytest.raises(ValueError, match=rf"{src / 'u.data'}:100: bytes that are not UTF-8 "
                                         r"text in '12\\t.*\.\.\.'; expected user, movie"):
        preprocess_movielens(src, tmp_path / "out")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie holds no memory and writes nothing


def _snapshot(folder: Path) -> list[tuple[str, int]]:
    return sorted((str(p.relative_to(folder)), p.stat().st_size)
                  for p in folder.rglob("*") if p.is_file())


@pytest.mark.shared_data(KAGGLE_10K)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
@pytest.mark.slow
def test_workers_die_with_the_main_process(tmp_path: Path, sig: signal.Signals) -> None:
    big = tmp_path / "big.tsv"
    big.write_bytes(KAGGLE_10K.read_bytes() * 60)  # ~145 MB: seconds of work for 2 workers
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "dlrm_app", "preprocess", "criteo", str(big), "--out", str(out),
         "--workers", "2"], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        workers: list[int] = []
        while time.monotonic() < deadline and proc.poll() is None:
            workers = descendants(proc.pid)
            if len(workers) >= 4:  # resource tracker, fork server, 2 workers
                break
            time.sleep(0.05)
        assert proc.poll() is None and len(workers) >= 4, "no workers seen before the run ended"
        time.sleep(0.5)  # the workers are parsing
        workers = descendants(proc.pid)
        proc.send_signal(sig)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 5
        while any(_alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p for p in workers if _alive(p)], "workers outlived the main process"
        before = _snapshot(out)
        time.sleep(1.0)
        assert _snapshot(out) == before  # nothing writes into the output any more
    finally:
        kill_tree(proc.pid)


@pytest.mark.shared_data(ML100K)
def test_input_of_mostly_bad_rows_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    """MovieLens' u.data given to the Criteo preprocessor with --on-bad-row skip: 99,728 of its
    100,000 lines are not Criteo rows. Refused (the first bad line named, the limit flag named),
    and the output folder it would have made is not left behind; a raised limit keeps the rest."""
    source = ML100K / "u.data"
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"99,728 of the 100,000 rows \(100%\) are bad rows, more "
                       r"than --max-bad-row-fraction 0\.5 .*u\.data:1\)"):
        preprocess_criteo([source], out, on_bad_row="skip")
    assert not out.exists()
    spec = preprocess_criteo([source], out, on_bad_row="skip", max_bad_row_fraction=1.0,
                             num_embeddings_per_feature=100)
    assert spec.parameters["skipped_rows"] == 99_728
    assert sum(s.rows for s in spec.splits) == 272


@pytest.mark.shared_data(ML100K)
def test_movielens_given_a_file_says_so(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"u\.data is a file; pass the unpacked MovieLens folder"):
        preprocess_movielens(ML100K / "u.data", tmp_path / "ml")
