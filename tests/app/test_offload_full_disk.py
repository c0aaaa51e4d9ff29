"""A disk too small for the offloaded tables is a clear error when the model is built, never a
SIGBUS or a second traceback later.

Small filesystems: a tmpfs mounted by the test (root in the container; the tests that need one
skip where mounting is impossible). Simulated where noted: ``os.posix_fallocate`` monkeypatched
to raise ENOSPC or EOPNOTSUPP, and a file-size limit (RLIMIT_FSIZE in a child process: writes
past it fail with EFBIG)."""

from __future__ import annotations

import contextlib
import errno
import gc
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from recsys_core.kernels import offload_store
from recsys_core.kernels.cached_tbe import OffloadSpaceError, TableCache
from recsys_core.kernels.config import EmbOptimType, FusedOptimizerConfig, KernelBackend
from recsys_core.kernels.tbe import build_table_batched_embedding
from tests.shared_data import KAGGLE_10K, REPO_ROOT

ROW_BYTES = 4 * (16 + 1)  # dim 16, row-wise Adagrad


@contextlib.contextmanager
def small_fs(size: str) -> Iterator[Path | None]:
    """A tmpfs of ``size`` (e.g. "1m"), or None where this process may not mount one."""
    where = Path(tempfile.mkdtemp(prefix="small_fs_"))
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                             capture_output=True, check=False).returncode == 0
    try:
        yield where if mounted else None
    finally:
        if mounted:
            subprocess.run(["umount", str(where)], check=False)
        where.rmdir()


def kernel(rows: int, directory: str):
    return build_table_batched_embedding(
        rows=[rows, rows], dims=[16, 16], feature_table_map=[0, 1], pooling_mean=False,
        optimizer=FusedOptimizerConfig(optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                                       learning_rate=0.05),
        device=torch.device("cpu"), backend=KernelBackend.TORCH,
        caches=[TableCache(slots=rows // 8), TableCache(slots=rows // 8)], offload_dir=directory,
    )


def test_a_directory_without_room_fails_at_construction_naming_it() -> None:
    with small_fs("1m") as fs:  # a real 1 MiB tmpfs
        if fs is None:
            pytest.skip("cannot mount a tmpfs here (the simulated tests below still run)")
        rows = 8000  # 2 tables x 8000 x 68 bytes = 1.04 MiB
        with pytest.raises(OffloadSpaceError) as e:
            kernel(rows, str(fs))
        err = e.value
        assert (err.directory, err.needed, err.free) == (str(fs), 2 * rows * ROW_BYTES, 1 << 20)
        assert err.errno == errno.ENOSPC
        assert str(err).startswith(f"offload directory {fs}: the tables kept there need 1.0 MiB "
                                   f"(1088000 bytes) but its disk has 1.0 MiB (1048576 bytes)")
        assert list(fs.iterdir()) == []


def test_a_failed_reservation_is_the_same_error_and_frees_what_it_took(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # simulated: the second file's posix_fallocate finds the disk full (ENOSPC)
    calls = []
    real = os.posix_fallocate

    def fallocate(fd: int, offset: int, size: int) -> None:
        calls.append(size)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, offset, size)

    monkeypatch.setattr(offload_store.os, "posix_fallocate", fallocate)
    with pytest.raises(OffloadSpaceError, match=f"offload directory {tmp_path}: the tables kept "
                                                "there need 1.0 MiB"):
        kernel(8000, str(tmp_path))
    assert calls[:2] == [8000 * 16 * 4, 8000 * 4]
    assert list(tmp_path.iterdir()) == []


def test_without_fallocate_the_space_is_written_with_zeros(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # simulated: a filesystem without fallocate (EOPNOTSUPP)
    def unsupported(fd: int, offset: int, size: int) -> None:
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    monkeypatch.setattr(offload_store.os, "posix_fallocate", unsupported)
    k = kernel(5000, str(tmp_path))
    for ts in k._tables.values():
        for f in ts.store.files:
            st = os.fstat(f._fd)
            assert st.st_size == f.tensor.numel() * 4 and st.st_blocks * 512 >= st.st_size
    # and it trains
    out = k(torch.arange(0, 64), torch.arange(0, 65, 2))
    out.sum().backward()
    k.flush()


def _child(code: str, **kw: object) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, cwd=REPO_ROOT, timeout=300, check=False, **kw)


def test_a_file_size_limit_is_a_clear_error_in_a_child(tmp_path: Path) -> None:
    # simulated: RLIMIT_FSIZE of 256 KiB in a child process; fallocate past it fails with EFBIG
    result = _child(f"""
        import resource
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, 256 << 10))
        from tests.app.test_offload_full_disk import kernel
        from recsys_core.kernels.cached_tbe import OffloadSpaceError
        try:
            kernel(8000, {str(tmp_path)!r})
        except OffloadSpaceError as e:
            print(e)
        """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"offload directory {tmp_path}: the tables kept there need "
                                    "1.0 MiB (1088000 bytes) but reserving them failed (File "
                                    "too large"), result.stdout


@pytest.mark.slow
def test_a_disk_that_fills_after_the_files_were_made_trains_on_in_a_child() -> None:
    # a real 2 MiB tmpfs: the tables (1.04 MiB) are made, then another file takes the rest of
    # the disk, then the tables are filled through their mappings and trained with evictions.
    # Sparse files died here with SIGBUS; reserved ones cannot run out of blocks.
    with small_fs("2m") as fs:
        if fs is None:
            pytest.skip("cannot mount a tmpfs here")
        result = _child(f"""
            import errno, os, torch
            from tests.app.test_offload_full_disk import kernel
            k = kernel(8000, {str(fs)!r})
            with open({str(fs / "filler")!r}, "wb") as f:
                try:
                    while True:
                        f.write(bytes(65536)); f.flush()
                except OSError as e:
                    assert e.errno == errno.ENOSPC
            with torch.no_grad():
                for w in k.split_embedding_weights():
                    w.copy_(torch.rand(w.shape))
            g = torch.Generator().manual_seed(0)
            for step in range(30):
                ids = torch.randint(0, 8000, (2 * 200,), generator=g)
                k(ids, torch.arange(0, 401, 2)).sum().backward()
            k.flush()
            print("trained", k.stats.writebacks)
            """)
        assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
        assert result.stdout.startswith("trained ") and int(result.stdout.split()[1]) > 1000


def test_closing_the_pipeline_after_a_failed_prefetch_raises_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from torch import nn

    from dlrm_app.training.pipeline import device_batches

    class Failing(nn.Module):
        """A sharded collection whose prefetched rows could not be moved (the disk is full):
        the error comes out of the forward, and its cleanup would raise it again."""

        def input_dist(self, *_: object) -> None: ...

        def prefetch(self, *_: object) -> None: ...

        def drop_prefetched(self) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

    class B:
        sparse = None

        def to(self, *_: object, **__: object) -> B:
            return self

    unraisable: list[object] = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    batches = device_batches([B(), B(), B()], torch.device("cpu"), Failing(), pipelined=True)
    next(batches)
    batches.close()  # the loop's own close
    batches = device_batches([B(), B(), B()], torch.device("cpu"), Failing(), pipelined=True)
    next(batches)
    del batches  # collected, as after an error that ended the loop
    gc.collect()
    assert unraisable == []


def _plan(data: Path, dim: int) -> dict:
    """Every table of the dataset table-wise on rank 0 behind a cache (the wide part's dim-1
    tables in memory): the plan a run made when the offload disk still had room."""
    spec = json.loads((data / "dataset.json").read_text())
    tables, wide = {}, {}
    for feature in spec["sparse_features"]:
        rows = feature["num_embeddings"]
        for plan, name, width, cached in ((tables, "t_", dim, True), (wide, "w_", 1, False)):
            plan[name + feature["name"]] = {
                "sharding_type": "table_wise",
                "compute_kernel": "fused_uvm_caching" if cached else "fused", "ranks": [0],
                "sharding_spec": [{"shard_offsets": [0, 0], "shard_sizes": [rows, width],
                                   "placement": "rank:0/cpu"}],
                "cache_params": {"algorithm": "lru", "load_factor": 1.0, "reserved_memory": None,
                                 "precision": None, "prefetch_pipeline": None} if cached else None,
                "enforce_hbm": None, "stochastic_rounding": None, "bounds_check_mode": None,
                "output_dtype": None,
            }
    return {"sparse_arch.embedding_bag_collection": tables, "wide.tables": wide}


@pytest.mark.shared_data(KAGGLE_10K)
@pytest.mark.parametrize("small", ["tmpfs", "file_size_limit"])
@pytest.mark.slow
def test_train_on_a_full_offload_dir_ends_with_one_line(small: str, tmp_path: Path) -> None:
    """End to end: `dlrm-app train --plan P --offload-dir SMALL` on the Kaggle sample, where the
    plan was made while SMALL had room. tmpfs: a real small filesystem; file_size_limit:
    simulated by RLIMIT_FSIZE in the child."""
    from dlrm_app.data.criteo import preprocess_criteo

    sample = tmp_path / "sample.tsv"
    sample.write_bytes(b"\n".join(KAGGLE_10K.read_bytes().split(b"\n")[:2000]) + b"\n")
    data = tmp_path / "criteo"
    preprocess_criteo([sample], data)
    plan = _plan(data, 64)
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    needed = sum(t["sharding_spec"][0]["shard_sizes"][0] * 65 * 4
                 for t in plan["sparse_arch.embedding_bag_collection"].values())
    # tmpfs: half the room needed; the file size limit: half of the largest file
    largest = max(t["sharding_spec"][0]["shard_sizes"][0] * 64 * 4
                  for t in plan["sparse_arch.embedding_bag_collection"].values())
    limit = (needed if small == "tmpfs" else largest) // 2 // 4096 * 4096
    with small_fs(str(limit)) if small == "tmpfs" else contextlib.nullcontext(None) as fs:
        if small == "tmpfs" and fs is None:
            pytest.skip("cannot mount a tmpfs here")
        offload = fs if fs is not None else tmp_path / "offload"
        preexec = None
        if small == "file_size_limit":
            import resource

            def preexec() -> None:
                resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

        result = subprocess.run(
            [sys.executable, "-m", "dlrm_app", "train", "--data", str(data), "--out",
             str(tmp_path / "run"), "--embedding-dim", "64", "--plan", str(tmp_path / "plan.json"),
             "--offload-dir", str(offload), "--max-steps", "2", "--quiet"],
            capture_output=True, text=True, cwd=REPO_ROOT, timeout=300, check=False,
            preexec_fn=preexec,
        )
    assert result.returncode == 1, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr[-3000:]
    (line,) = lines
    assert line.startswith(f"dlrm-app train: --offload-dir {offload}: the tables kept on disk "
                           f"need "), line
    assert f"({needed} bytes)" in line and "--offload-dir DIR" in line, line
    if small == "tmpfs":
        assert f"its disk has {offload_store.format_bytes(limit)} ({limit} bytes) free" in line
    else:
        assert "reserving them failed (File too large" in line
