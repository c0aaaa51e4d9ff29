"""Publish time: from the end of training to a running ``dlrm-app serve`` answering with the new
model, weights alone (the program unchanged) against a full export, on the README's main job
(``preprocess criteo`` of the Kaggle sample ../shared/data/criteo/kaggle_head_10k.tsv, ``train``
with the default flags), int8 tables (the export's default).

The run trains ``--steps`` steps and is exported in full to ``model.pt2``; ``dlrm-app serve
model.pt2`` starts (default flags: the files are checked every 0.5 s and taken once still for
1 s). Then, ``--repeats`` times, the run trains ``--steps`` more steps (``--resume``) and, the
clock started as training returns, is published:

  weights_watch    ``dlrm-app export RUN --out model.pt2 --checkpoint latest`` (a new process:
                   the program is unchanged, so it writes ``model.weights`` alone); the server
                   sees the renamed file
  weights_sighup   the same, then ``kill -HUP`` at once (no settle time)
  weights_inproc   ``export_model`` in this process (a pipeline that publishes as it trains),
                   then SIGHUP: the floor
  full_watch       (once per repeat, the same checkpoint as the last weights) ``dlrm-app export
                   --full``: the program compiled again and renamed over ``model.pt2``

``seconds`` ends when the server's ``/health`` shows the published digest (the switch to the
new model or weights happens before it does) and a probe of 8 raw rows then answers 200;
``export_s`` is the export alone (process start to exit, or the call), ``pickup_s`` the rest;
``server_load_s`` the server's own reading, checking and loading (``load_seconds``). Each
full line compares its probe answers with the weights-only answers of the same checkpoint
(``max_abs_diff_vs_weights``: 0 within float tolerance).

The Criteo 1TB estimate (``publish_estimate_1tb``): the bytes of the int8 tables of Criteo 1TB's
cardinalities at the main job's embedding dimension (and at 128, the reference DLRM's), and
this machine's measured rates for the steps that scale with them: quantizing fp32 rows to int8
(``quantize_rows``, one 1M-row table), writing the weights file (write, sha256 and fsync) and
reading it back in the server (read and sha256; the file is in the page cache here, so this is
the memory-bound rate, not a disk's); ``load_constants`` keeps pointers (``user_managed``) and
copies nothing. Reading the fp32 checkpoint is left out (its rate is the disk's).

One JSON line per result on stdout (progress on stderr), a header with the CPU first.

Usage: python bench/publish.py [--repeats 2] [--steps 20] [--rate-mib 512]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from common import load_avg, log
from criteo_sizes import CRITEO_1TB_ROWS
from torchrec_program import cpu_name  # the sibling bench's (lscpu model + vector extension)

ROOT = Path(__file__).resolve().parents[1]
KAGGLE = ROOT.parent / "shared" / "data" / "criteo" / "kaggle_head_10k.tsv"
PROBE_ROWS = 8


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "dlrm_app", *args]


def http(port: int, path: str, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def train_more(data: Path, run: Path, steps: int, first: bool) -> None:
    from dlrm_app.training.config import TrainConfig
    from dlrm_app.training.trainer import train

    train(TrainConfig.from_flags(data=str(data), out=str(run), max_steps=steps, resume=not first),
          progress=False)


def wait_for(port: int, ready: Any, timeout_s: float = 300) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        health = http(port, "/health")[1]
        if ready(health):
            return health
        if time.monotonic() > deadline:
            raise SystemExit(f"bench/publish.py: the server did not take it in {timeout_s} s: "
                             f"{health}")
        time.sleep(0.02)


def publish(mode: str, run: Path, program: Path, proc: subprocess.Popen, port: int,
            probe: dict) -> dict[str, Any]:
    """One publish of the run's latest checkpoint; the clock starts on entry."""
    start = time.perf_counter()
    if mode == "weights_inproc":
        from dlrm_app.serving.export import export_model

        result = export_model(run, program, checkpoint="latest")
    else:
        args = cli("export", str(run), "--out", str(program), "--checkpoint", "latest",
                   *(["--full"] if mode == "full_watch" else []))
        done = subprocess.run(args, capture_output=True, text=True, cwd=ROOT)
        if done.returncode != 0:
            raise SystemExit(f"bench/publish.py: {' '.join(args)} failed:\n{done.stderr[-3000:]}")
        result = json.loads(done.stdout.splitlines()[-1])
    exported = time.perf_counter()
    expected = "program" if mode == "full_watch" else "weights"
    if result["published"] != expected:
        raise SystemExit(f"bench/publish.py: {mode} published the {result['published']} "
                         f"({result.get('why')}), expected the {expected}")
    if mode.endswith("sighup") or mode == "weights_inproc":
        proc.send_signal(signal.SIGHUP)
    digest = result["sha256"]
    if expected == "weights":
        health = wait_for(port, lambda h: (h.get("weights") or {}).get("sha256") == digest)
    else:
        health = wait_for(port, lambda h: h.get("sha256") == digest)
    status, answer = http(port, "/predict", probe)
    end = time.perf_counter()
    if status != 200:
        raise SystemExit(f"bench/publish.py: the probe got {status}: {answer}")
    load = (health["weights"] or {}).get("load_seconds") if expected == "weights" else \
        health["load_seconds"]
    return {"seconds": round(end - start, 3), "export_s": round(exported - start, 3),
            "pickup_s": round(end - exported, 3), "server_load_s": load,
            "bytes": result["bytes"], "sha256": digest,
            "probabilities": answer["probabilities"]}


def rates(mib: int) -> dict[str, float]:
    """MB/s of quantizing fp32 rows to int8, writing a weights file and reading it back."""
    import torch

    from dlrm_app.serving.weights import read_weights, write_weights
    from recsys_core.kernels.quant_tbe import WeightType, quantize_rows

    table = torch.randn(1_000_000, 128)
    start = time.perf_counter()
    quantize_rows(table, WeightType.INT8)
    quantize = table.numel() * 4 / (time.perf_counter() - start) / 1e6
    blob = torch.randint(0, 256, (mib << 20,), dtype=torch.uint8)
    with tempfile.TemporaryDirectory(prefix="bench-publish-rate-", dir=ROOT) as tmp:
        path = Path(tmp) / "rate.weights"
        start = time.perf_counter()
        write_weights(path, {"model/blob": blob}, {"program_fingerprint": "0" * 64})
        write = blob.numel() / (time.perf_counter() - start) / 1e6
        start = time.perf_counter()
        read_weights(path)
        read = blob.numel() / (time.perf_counter() - start) / 1e6
    return {"quantize_fp32_mb_s": round(quantize), "write_mb_s": round(write),
            "read_mb_s": round(read)}


def estimate_1tb(dim: int, measured: dict[str, float], inproc_s: float) -> dict[str, Any]:
    from recsys_core.kernels.quant_tbe import WeightType, row_bytes

    out: dict[str, Any] = {"bench": "publish_estimate_1tb", "tables": len(CRITEO_1TB_ROWS),
                           "rows": sum(CRITEO_1TB_ROWS), "rates": measured,
                           "fixed_s": round(inproc_s, 2)}
    for d in sorted({dim, 128}):
        int8 = sum(CRITEO_1TB_ROWS) * row_bytes(d, WeightType.INT8, 1)
        fp32 = sum(CRITEO_1TB_ROWS) * d * 4
        steps = {"quantize_s": fp32 / 1e6 / measured["quantize_fp32_mb_s"],
                 "write_s": int8 / 1e6 / measured["write_mb_s"],
                 "server_read_s": int8 / 1e6 / measured["read_mb_s"]}
        out[f"dim_{d}"] = {"int8_bytes": int8, "fp32_checkpoint_bytes": fp32,
                           **{k: round(v, 1) for k, v in steps.items()},
                           "estimate_s": round(sum(steps.values()) + inproc_s, 1),
                           "server_memory_bytes": 2 * int8}
    return out


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--steps", type=int, default=20, help="training steps before each publish")
    p.add_argument("--rate-mib", type=int, default=512,
                   help="size of the weights file the write/read rates are measured on")
    args = p.parse_args(argv)
    import torch

    from dlrm_app.data.criteo import preprocess_criteo
    from recsys_core.kernels import fbgemm_version

    if not KAGGLE.is_file():
        raise SystemExit(f"bench/publish.py: {KAGGLE} not found (the shared samples are "
                         "expected in ../shared/data beside the repository)")
    cpu = cpu_name()
    print(json.dumps({"bench": "publish_header", "cpu": cpu, "cpus": os.cpu_count(),
                      "torch": torch.__version__, "fbgemm_gpu": fbgemm_version(),
                      "torch_threads": torch.get_num_threads(), "load_avg_1m": load_avg(),
                      "repeats": args.repeats, "steps": args.steps, "dtype": "int8"}),
          flush=True)
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory(prefix="bench-publish-") as tmp:
        root = Path(tmp)
        data, run, program = root / "data", root / "run", root / "model.pt2"
        preprocess_criteo([KAGGLE], data)
        train_more(data, run, args.steps, first=True)
        torch.set_num_threads(threads)  # training chose its own
        log("the first, full export")
        subprocess.run(cli("export", str(run), "--out", str(program), "--checkpoint", "latest"),
                       check=True, capture_output=True, cwd=ROOT)
        lines = KAGGLE.read_text().splitlines()[:PROBE_ROWS]
        probe = {"rows": lines, "labeled": True}
        proc = subprocess.Popen(cli("serve", str(program), "--port", "0", "--threads", "1"),
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                cwd=ROOT)
        try:
            port = json.loads(proc.stdout.readline())["port"]
            steps, inproc, last = args.steps, [], []
            for rep in range(args.repeats):
                for mode in ("weights_watch", "weights_sighup", "weights_inproc", "full_watch"):
                    if mode != "full_watch":  # full: the same checkpoint as the last weights
                        steps += args.steps
                        train_more(data, run, steps, first=False)
                        torch.set_num_threads(threads)
                    log(f"repeat {rep}: {mode} after step {steps}")
                    loadavg = load_avg()
                    got = publish(mode, run, program, proc, port, probe)
                    line = {"bench": "publish", "cpu": cpu, "mode": mode, "repeat": rep,
                            "step": steps, "load_avg_1m": loadavg,
                            **{k: v for k, v in got.items() if k != "probabilities"}}
                    if mode == "full_watch":
                        diff = max(abs(a - b) for a, b in zip(got["probabilities"], last,
                                                              strict=True))
                        line["max_abs_diff_vs_weights"] = diff
                    else:
                        last = got["probabilities"]
                    if mode == "weights_inproc":
                        inproc.append(got["seconds"])
                    print(json.dumps(line), flush=True)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
        dim = json.loads((run / "config.json").read_text())["model"]["embedding_dim"]
    print(json.dumps(estimate_1tb(dim, rates(args.rate_mib), min(inproc))), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
