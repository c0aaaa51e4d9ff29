"""One preprocessing process on two threads: the same bytes as on one thread on every path
(shard tasks of plain input with the default vocabulary or hashing, the streaming path that
skips bad rows), results in task order, errors raised in order after the tasks in flight
have ended, and the thread count chosen from the CPUs usable."""

from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path

import pytest
from test_criteo_workers import write_rows

from dlrm_app.data.criteo import job, preprocess_criteo, workers
from dlrm_app.data.criteo.workers import InProcess, default_threads, runner, task_threads

SMALL = dict(rows_per_shard=700, row_group_size=256, block_bytes=20_000)


def digest(out: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.iterdir())
            if p.suffix in (".parquet", ".json")}


@pytest.mark.parametrize("kwargs", [{}, dict(num_embeddings_per_feature=97),
                                    dict(on_bad_row="skip")])
def test_two_threads_write_the_bytes_of_one(tmp_path: Path, kwargs: dict) -> None:
    inputs = [tmp_path / "a.tsv", tmp_path / "b.tsv"]
    write_rows(inputs[0], 2_500, seed=1, bad=(7, 1999) if kwargs.get("on_bad_row") else ())
    write_rows(inputs[1], 1_800, seed=2)
    one = preprocess_criteo(inputs, tmp_path / "one", threads=1, **SMALL, **kwargs)
    two = preprocess_criteo(inputs, tmp_path / "two", threads=2, **SMALL, **kwargs)
    assert len(one.split("train").shards) >= 4  # several shard tasks ran side by side
    assert digest(tmp_path / "one") == digest(tmp_path / "two")
    assert two.parameters == one.parameters


def test_results_come_in_task_order_with_two_tasks_at_once() -> None:
    running, most = 0, 0
    lock = threading.Lock()

    def task(i: int, delay: float) -> int:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        time.sleep(delay)
        with lock:
            running -= 1
        return i * i

    local = InProcess(2)
    try:  # the later tasks finish first; the results still come in task order
        got = list(local.map(task, [(i, 0.05 if i % 2 == 0 else 0.0) for i in range(8)]))
    finally:
        local.shutdown()
    assert got == [i * i for i in range(8)]
    assert most == 2


def test_an_error_is_raised_in_order_once_the_running_tasks_have_ended() -> None:
    ended: list[int] = []

    def task(i: int) -> int:
        if i == 1:
            raise ValueError("task 1 failed")
        time.sleep(0.05)
        ended.append(i)
        return i

    local = InProcess(2)
    results = []
    try:
        with pytest.raises(ValueError, match="task 1 failed"):
            for r in local.map(task, [(i,) for i in range(20)]):
                results.append(r)
        # nothing runs on after the error reached the caller: the queued tasks were dropped
        after = list(ended)
        time.sleep(0.2)
        assert ended == after
    finally:
        local.shutdown()
    assert results == [0]
    assert len(ended) <= 2 * 2  # at most the tasks in flight ran


def test_one_thread_runs_the_tasks_in_the_callers_thread() -> None:
    local = InProcess(1)
    assert local.pool is None
    assert list(local.map(lambda: threading.current_thread(), [(), ()])) == \
        [threading.current_thread()] * 2


def test_default_threads_follow_the_usable_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    for cpus, quota, want in [(8, None, 2), (2, None, 2), (1, None, 1), (8, 1.5, 1),
                              (8, 0.5, 1), (4, 3.0, 2)]:
        monkeypatch.setattr(workers, "allowed_cpus", lambda cpus=cpus: cpus)
        monkeypatch.setattr(workers, "cgroup_cpu_quota", lambda quota=quota: quota)
        assert default_threads() == want, (cpus, quota)


def test_gzip_input_runs_on_one_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import gzip

    seen: list[int | None] = []
    real = workers.runner

    def recording(n: int, threads: int | None = None):
        seen.append(threads)
        return real(n, threads)

    monkeypatch.setattr(job, "runner", recording)
    plain = tmp_path / "a.tsv"
    write_rows(plain, 300, seed=3)
    gz = tmp_path / "a.tsv.gz"
    gz.write_bytes(gzip.compress(plain.read_bytes()))
    preprocess_criteo([gz], tmp_path / "gz", **SMALL)
    preprocess_criteo([plain], tmp_path / "plain", **SMALL)
    preprocess_criteo([gz], tmp_path / "gz2", threads=2, **SMALL)
    assert seen == [1, default_threads(), 2]
    assert task_threads([plain], workers=2) == 1  # each worker process runs one task at a time


def test_runner_waits_for_its_threads() -> None:
    ended = []

    def task(i: int) -> None:
        time.sleep(0.05)
        ended.append(i)

    with runner(1, 2) as run:
        it = run.map(task, [(i,) for i in range(6)])
        next(it)
        it.close()  # the caller stops early: queued tasks dropped, running ones end
        count = len(ended)
    time.sleep(0.3)  # a task still running after close() would end in this time
    assert len(ended) == count  # none did: close() waited for the running ones
    assert 2 <= count <= 4  # the first, and those running when the caller stopped


def test_threads_must_be_positive(tmp_path: Path) -> None:
    path = tmp_path / "in.tsv"
    write_rows(path, 10, seed=7)
    with pytest.raises(ValueError, match="threads must be a positive int or None"):
        preprocess_criteo([path], tmp_path / "out", threads=0)


def test_results_closed_after_the_runner_ended_do_not_wait_forever() -> None:
    # a consumer that raised leaves its results open until they are collected, after the
    # runner shut its pool down: the tasks it cancelled must not be waited for
    with runner(1, 2) as run:
        it = run.map(time.sleep, [(0.05,)] * 6)
        next(it)
    closer = threading.Thread(target=it.close)
    closer.start()
    closer.join(timeout=10)
    assert not closer.is_alive()
