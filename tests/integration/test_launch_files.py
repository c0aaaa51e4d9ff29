"""The cluster launch files run as written: ``launch/train.sbatch`` under stand-ins for Slurm's
``srun`` and ``scontrol`` (one "node": this host), the Kubeflow PyTorchJob manifest's container
command with the environment the training operator gives it, and an elastic two-"node" job
(``--nnodes 1:2``) that loses a node and finishes on the one left."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from process_tree import kill_tree

from dlrm_app.data.synthetic import generate
from dlrm_app.training.checkpoint import verify_checkpoint
from recsys_core.testing import find_free_port

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "launch"
SMALL = ["--embedding-dim", "8", "--dense-arch-layer-sizes", "16-8", "--over-arch-layer-sizes",
         "16-1", "--batch-size", "64", "--log-every", "1", "--patience", "0", "--quiet"]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("launch") / "data"
    generate(out, rows=20_000, num_dense=2, cardinalities=[100, 50], pooling_factors=[1.0, 1.0],
             seed=0, rows_per_shard=5_000, row_group_size=64)
    return out


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **extra}
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"  # torchrun, python
    return env


def _events(run: Path, name: str) -> list[dict]:
    lines = [json.loads(s) for s in (run / "metrics.jsonl").read_text().splitlines()]
    return [e for e in lines if e["event"] == name]


@pytest.mark.slow
def test_sbatch_script_runs_its_torchrun_command(data: Path, tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "srun.args"
    # srun runs the command once on this "node" (its own options dropped); scontrol names it
    (bin_dir / "srun").write_text(
        f"#!/usr/bin/env bash\necho \"$@\" > {log}\nwhile [[ $1 == --* ]]; do shift; done\n"
        "exec \"$@\"\n")
    (bin_dir / "scontrol").write_text("#!/usr/bin/env bash\necho 127.0.0.1\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    run = tmp_path / "run"
    env = _env(SLURM_JOB_NODELIST="localhost", SLURM_NNODES="1", SLURM_GPUS_ON_NODE="2",
               SLURM_JOB_ID="4242", RDZV_PORT=str(find_free_port()), OMP_NUM_THREADS="1")
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    proc = subprocess.run(["bash", str(LAUNCH / "train.sbatch"), str(data), str(run),
                           *SMALL, "--max-steps", "12"], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    args = log.read_text().split()
    assert args[:2] == ["--kill-on-bad-exit=1", "torchrun"]
    flags = dict(zip(args[2::2], args[3::2], strict=False))
    assert flags["--nnodes"] == "1:1" and flags["--max-restarts"] == "3"
    assert flags["--rdzv-backend"] == "c10d" and flags["--rdzv-id"] == "4242"
    # torchrun waits longer than the ranks' grace period before it kills them
    assert int(flags["--shutdown-timeout"]) > 60
    assert args[args.index("--grace-period") + 1] == "60"
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 12 and summary["world_size"] == 2


@pytest.mark.slow
def test_pytorchjob_manifest_command_runs_under_the_operators_environment(
        data: Path, tmp_path: Path) -> None:
    job = yaml.safe_load((LAUNCH / "pytorchjob.yaml").read_text())
    assert job["kind"] == "PyTorchJob" and job["apiVersion"] == "kubeflow.org/v1"
    elastic = job["spec"]["elasticPolicy"]
    assert elastic["rdzvBackend"] == "c10d" and elastic["maxRestarts"] >= 1
    assert 1 <= elastic["minReplicas"] < elastic["maxReplicas"]
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert worker["restartPolicy"] == "OnFailure"
    assert elastic["minReplicas"] <= worker["replicas"] <= elastic["maxReplicas"]
    pod = worker["template"]["spec"]
    (container,) = pod["containers"]
    command = container["command"]
    assert command[0] == "torchrun" and command[command.index("-m") + 1] == "dlrm_app"
    grace = float(command[command.index("--grace-period") + 1])
    shutdown = float(command[command.index("--shutdown-timeout") + 1])
    assert grace < shutdown < pod["terminationGracePeriodSeconds"]
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    out = command[command.index("--out") + 1]
    assert any(out.startswith(m + "/") for m in mounts)  # the run on a shared volume
    # the command itself, as the operator starts it (its PET_* variables are torchrun's flags),
    # on this host: one pod of 2 ranks, the volumes' paths here
    run = tmp_path / "run"
    here = [str(data) if a == command[command.index("--data") + 1] else
            str(run) if a == out else a for a in command]
    env = _env(PET_NNODES="1:1", PET_NPROC_PER_NODE="2", PET_MAX_RESTARTS=str(
        elastic["maxRestarts"]), PET_RDZV_BACKEND=elastic["rdzvBackend"],
        PET_RDZV_ENDPOINT=f"127.0.0.1:{find_free_port()}",
        **{e["name"]: e["value"] for e in container.get("env", [])})
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([*here, *SMALL, "--max-steps", "12"], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 12 and summary["world_size"] == 2


@pytest.mark.slow
def test_elastic_job_loses_a_node_and_finishes_on_the_other(data: Path, tmp_path: Path) -> None:
    """``train_multinode.sh 1:2``: two "nodes" of one rank each train together; one is lost
    (its agent and rank SIGKILLed after a checkpoint); the other's rank fails, its agent
    restarts the group on the node left (1 of at least 1), which resumes from the newest
    checkpoint on world size 1 and trains to the end."""
    run = tmp_path / "run"
    endpoint = f"127.0.0.1:{find_free_port()}"
    env = _env(RDZV_CONF="last_call_timeout=3,join_timeout=120", MAX_RESTARTS="2")
    args = [*SMALL, "--max-steps", "150", "--save-every", "10", "--keep-checkpoints", "50"]

    def node(rank: int) -> subprocess.Popen:
        return subprocess.Popen(
            [str(LAUNCH / "train_multinode.sh"), "1:2", str(rank), endpoint, "1", str(data),
             str(run), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=env, start_new_session=True)

    first = node(0)
    time.sleep(2.0)  # the first node's agent hosts the rendezvous store
    second = node(1)
    try:
        latest, deadline = run / "checkpoints" / "latest", time.monotonic() + 240
        while not latest.exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert first.poll() is None and second.poll() is None, "a node ended early"
        assert _events(run, "start")[0]["world_size"] == 2
        kill_tree(second.pid)  # the node is gone: its agent and its rank at once
        second.wait(timeout=30)
        out, err = first.communicate(timeout=600)
    finally:
        kill_tree(first.pid)
        kill_tree(second.pid)
    assert first.returncode == 0, err[-6000:]
    starts = _events(run, "start")
    assert [s["world_size"] for s in starts] == [2, 1], starts
    assert starts[1]["start_step"] >= 10 and starts[1]["resumed_from"] is not None
    verify_checkpoint(Path(starts[1]["resumed_from"]))  # complete and intact, never a partial
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["steps"] == 150 and summary["world_size"] == 1
    steps = {e["step"] for e in _events(run, "train")}
    assert steps == set(range(1, 151))  # every step trained, before or after the loss
    for path in (run / "checkpoints").glob("step_*"):
        assert not path.name.endswith(".partial")
