"""Serving benchmark: artifact size per format and embedding dtype, in-process latency of the
.pt2 (AOTInductor) against TorchScript and eager PyTorch, HTTP load.

The model (``--model``):

  dlrm      (the default) random Criteo-format rows (random labels: this measures serving, not
            accuracy) are preprocessed with modulo hashing into ``--rows-per-table`` rows per
            feature, a DLRM (``--dim``, ``--bottom``, ``--top``) trains ``--train-steps`` steps
            and is exported per ``--dtypes`` (default fp32, int8, int4) in each ``--formats``:
              pt2          the default export: AOTInductor programs, FBGEMM's int-n-bit lookup
              pt2_torch    the same with the plain-torch lookup (``--lookup torch``)
              torchscript  ``--format torchscript``
              eager        no file: the .pt2's programs run as eager PyTorch modules (FBGEMM
                           lookup), what the export compiles
  standin   a scripted stand-in with the artifact's methods (hashed embedding bags of the same
            size, summed, and the same MLPs), fp32 TorchScript; for a checkout without the
            exporter

One JSON line per result on stdout (progress goes to stderr):

  serve_size     (dlrm only) bytes of each exported file, and the ratio to the same format's
                 fp32 file
  serve_latency  per format, dtype and batch size (``--batch-sizes``, default 1,64,512):
                 ``predict_raw`` on parsed rows under ``torch.inference_mode`` in this process
                 (``--threads`` torch threads, default 1 like the server's), ``--iters`` calls
                 after warm-up: p50 / p99 ms and rows/s; ``parse_p50_ms`` is the server's
                 parsing of the same rows as a JSON body (JSON, TSV fields, hex ids);
                 ``max_abs_diff_vs_torchscript``: the largest difference of this format's
                 answers from the TorchScript file's on the same rows
  serve_http     per ``--http-formats`` format and concurrency level (``--concurrency``, default
                 1,16), for the ``--http-dtype`` artifact: a ``dlrm-app serve`` process on
                 loopback (``--server-threads`` torch threads, ``--max-batch-rows``,
                 ``--max-wait-ms``) and that many client threads here, each with one keep-alive
                 connection, sending ``--requests`` requests in all of ``--rows-per-request``
                 rows: requests/s, rows/s, client-side p50 / p99 ms, errors, the server's mean
                 batch rows over the level, and the largest difference of the HTTP answers for
                 the first body from this process's own ``predict_raw`` (should be 0)

Every line also carries the table shape and the host's cores; timing lines the 1-minute load
average (other jobs on the host are noise). The clients are Python threads sharing this
process's GIL, and client and server share the host's cores: on a small host the load
generator is part of what is measured.

Usage:  python bench/serve.py [--quick] [--model dlrm|standin] [--rows-per-table 50000]
                              [--dim 64] [--iters 200] [--dtypes fp32,int8,int4]
                              [--formats pt2,pt2_torch,torchscript,eager] [--concurrency 1,16]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import fill_unset, load_avg, log
from torch import nn

from dlrm_app.serving.artifact import ARTIFACT_FORMAT_VERSION, METADATA_FILE, load_artifact
from dlrm_app.serving.server import RequestParser

NUM_DENSE, NUM_SPARSE = 13, 26
FULL = {"rows_per_table": 50_000, "dim": 64, "bottom": "512,256", "top": "512,256",
        "train_rows": 20_000, "train_steps": 20, "iters": 200, "requests": 2000,
        "dtypes": "fp32,int8,int4", "formats": "pt2,pt2_torch,torchscript,eager",
        "http_formats": "pt2,torchscript"}
QUICK = {"rows_per_table": 1000, "dim": 8, "bottom": "16", "top": "16", "train_rows": 2000,
         "train_steps": 3, "iters": 5, "requests": 48, "dtypes": "int8",
         "formats": "pt2,torchscript,eager", "http_formats": "pt2"}
FORMATS = ("pt2", "pt2_torch", "torchscript", "eager")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help=f"tiny defaults for a smoke test: {QUICK}")
    p.add_argument("--model", choices=("dlrm", "standin"),
                   default="dlrm", help="dlrm: a trained, exported DLRM; standin: a small "
                   "scripted model with the artifact's methods")
    p.add_argument("--rows-per-table", type=int, help=f"default {FULL['rows_per_table']}")
    p.add_argument("--dim", type=int, help=f"embedding dim (default {FULL['dim']})")
    p.add_argument("--bottom", help=f"bottom MLP before the last (= dim) layer ({FULL['bottom']})")
    p.add_argument("--top", help=f"top MLP before the 1-logit layer (default {FULL['top']})")
    p.add_argument("--train-rows", type=int, help=f"default {FULL['train_rows']}")
    p.add_argument("--train-steps", type=int, help=f"default {FULL['train_steps']}")
    p.add_argument("--batch-sizes", default="1,64,512")
    p.add_argument("--iters", type=int, help=f"timed calls per batch size ({FULL['iters']})")
    p.add_argument("--dtypes", help=f"embedding dtypes to export (default {FULL['dtypes']})")
    p.add_argument("--formats", help=f"of {FORMATS} (default {FULL['formats']})")
    p.add_argument("--http-dtype", default="int8", help="artifact the HTTP load runs on (dlrm)")
    p.add_argument("--http-formats", help=f"formats served over HTTP ({FULL['http_formats']})")
    p.add_argument("--concurrency", default="1,16", help="client threads, one level each")
    p.add_argument("--requests", type=int, help=f"per level, in all ({FULL['requests']})")
    p.add_argument("--rows-per-request", type=int, default=1)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads for the in-process latency (more than the idle cores: "
                        "each parallel region waits for a descheduled thread)")
    p.add_argument("--server-threads", type=int, default=1, help="the server's torch threads")
    p.add_argument("--max-batch-rows", type=int, default=512)
    p.add_argument("--max-wait-ms", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    fill_unset(args, QUICK if args.quick else FULL)
    unknown = set(args.formats.split(",")) - set(FORMATS)
    if unknown or "torchscript" not in args.formats.split(","):
        p.error(f"--formats: of {FORMATS}, torchscript included (the reference for the others)")
    return args


def sizes(text: str) -> tuple[int, ...]:
    return tuple(int(s) for s in text.split(",") if s)


def random_rows(rng: np.random.Generator, n: int) -> list[str]:
    """Criteo-like raw rows without label: ~20% missing dense values, 8-digit hex ids."""
    dense = rng.integers(0, 2000, (n, NUM_DENSE)).astype(str)
    dense[rng.random((n, NUM_DENSE)) < 0.2] = ""
    cats = np.char.zfill(np.char.mod("%x", rng.integers(0, 2**32, (n, NUM_SPARSE))), 8)
    return ["\t".join(r) for r in np.concatenate([dense, cats], axis=1).tolist()]


def load() -> dict[str, float]:
    """The host's 1-minute load average: other jobs on the cores (noise in the timings)."""
    return {"load_avg_1m": load_avg()}


# ---- the models -----------------------------------------------------------------------------
def export_dlrms(args: argparse.Namespace, tmp: Path) -> dict[tuple[str, str], Any]:
    """Train a small DLRM on random Criteo rows and export it per format and dtype:
    {(format, dtype): file, or the eager programs for "eager"}."""
    from dlrm_app.data.criteo import preprocess_criteo
    from dlrm_app.model import ModelConfig
    from dlrm_app.serving.export import export_model
    from dlrm_app.training.config import TrainConfig
    from dlrm_app.training.trainer import train

    rng = np.random.default_rng(args.seed)
    rows = random_rows(rng, args.train_rows)
    labels = rng.integers(0, 2, len(rows))
    (tmp / "day.tsv").write_text("".join(f"{y}\t{r}\n" for y, r in zip(labels, rows,
                                                                       strict=True)))
    log(f"preprocessing {len(rows)} rows, training {args.train_steps} steps in {tmp}")
    preprocess_criteo([tmp / "day.tsv"], tmp / "data",
                      num_embeddings_per_feature=[args.rows_per_table] * NUM_SPARSE)
    model = ModelConfig(embedding_dim=args.dim,
                        dense_arch_layer_sizes=(*sizes(args.bottom), args.dim),
                        over_arch_layer_sizes=(*sizes(args.top), 1),
                        wide=False)  # the reference DLRM, as in docs/serving.md
    batch = max(1, min(512, args.train_rows // (2 * args.train_steps)))
    train(TrainConfig.from_flags(data=str(tmp / "data"), out=str(tmp / "run"), model=model,
                                 batch_size=batch, max_steps=args.train_steps, val_batches=1),
          progress=False)
    out: dict[tuple[str, str], Any] = {}
    for dtype in args.dtypes.split(","):
        for fmt in args.formats.split(","):
            if fmt == "eager":
                out[fmt, dtype] = EagerPrograms(tmp / "run", dtype)
                continue
            path = tmp / f"model_{dtype}_{fmt}.{'pt' if fmt == 'torchscript' else 'pt2'}"
            log(f"exporting {fmt} {dtype}")
            start = time.perf_counter()
            export_model(tmp / "run", path, dtype,
                         fmt="torchscript" if fmt == "torchscript" else "pt2",
                         lookup="torch" if fmt == "pt2_torch" else "auto")
            log(f"  {time.perf_counter() - start:.1f} s")
            out[fmt, dtype] = path
    return out


class EagerPrograms:
    """The .pt2's programs (FBGEMM lookup) as eager modules, with the artifact's methods."""

    def __init__(self, run: Path, dtype: str) -> None:
        from dlrm_app.serving.export import (
            DTYPES,
            dataset_preprocessing,
            load_unsharded,
            serving_programs,
        )
        from recsys_core.inference import quantize_inference_model

        model, config, spec, _ = load_unsharded(run)
        quantize_inference_model(model, DTYPES[dtype])
        programs = serving_programs(model, spec, dataset_preprocessing(spec, Path(config.data)),
                                    "fbgemm")
        self.model, self.encoder = programs["model"][0], programs["encode"][0]

    def predict_raw(self, dense_raw: torch.Tensor, cat_raw: torch.Tensor) -> torch.Tensor:
        return self.model(*self.encoder(dense_raw, cat_raw))


class StandIn(nn.Module):
    """The artifact's methods over hashed embedding bags (summed) and a DLRM's two MLPs."""

    def __init__(self, rows: int, dim: int, bottom: tuple[int, ...], top: tuple[int, ...]
                 ) -> None:
        super().__init__()
        self.rows = rows
        self.num_sparse = NUM_SPARSE
        self.bags = nn.EmbeddingBag(NUM_SPARSE * rows, dim, mode="sum", include_last_offset=True)
        self.bottom = mlp([NUM_DENSE, *bottom, dim])
        self.top = mlp([2 * dim, *top, 1])

    def forward(self, dense: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor
                ) -> torch.Tensor:
        b = dense.shape[0]
        lengths = offsets[1:] - offsets[:-1]
        table = torch.arange(self.num_sparse * b) // max(b, 1)
        pooled = self.bags(values + (table * self.rows).repeat_interleave(lengths), offsets)
        sparse = pooled.view(self.num_sparse, b, -1).sum(0)
        return torch.sigmoid(self.top(torch.cat([self.bottom(dense), sparse], 1)).squeeze(1))

    @torch.jit.export
    def encode(self, dense_raw: torch.Tensor, cat_raw: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dense = torch.log1p(torch.nan_to_num(dense_raw, nan=0.0).clamp(min=0.0))
        values = torch.remainder(cat_raw, self.rows).t().reshape(-1)
        return dense, values, torch.arange(values.numel() + 1)

    @torch.jit.export
    def predict_raw(self, dense_raw: torch.Tensor, cat_raw: torch.Tensor) -> torch.Tensor:
        dense, values, offsets = self.encode(dense_raw, cat_raw)
        return self.forward(dense, values, offsets)


def mlp(widths: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in zip(widths[:-1], widths[1:], strict=True):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def save_standin(args: argparse.Namespace, tmp: Path) -> dict[tuple[str, str], Path]:
    module = StandIn(args.rows_per_table, args.dim, sizes(args.bottom), sizes(args.top))
    meta = {"format_version": ARTIFACT_FORMAT_VERSION, "dataset": "random", "kind": "criteo",
            "dense_features": [f"int_{i}" for i in range(NUM_DENSE)],
            "sparse_features": [{"name": f"cat_{i}", "num_embeddings": args.rows_per_table,
                                 "multi_hot": False} for i in range(NUM_SPARSE)],
            "raw_input": True, "raw_format": "criteo_tsv", "embedding_dtype": "fp32",
            "needs_fbgemm": False, "preprocessing": {}, "checkpoint": None,
            "created_by": "bench/serve.py"}
    path = tmp / "standin_fp32.pt"
    torch.jit.save(torch.jit.script(module), str(path),
                   _extra_files={METADATA_FILE: json.dumps(meta)})
    return {("torchscript", "fp32"): path}


# ---- measurements ---------------------------------------------------------------------------
def percentiles_ms(seconds: list[float]) -> dict[str, float]:
    ms = np.array(seconds) * 1e3
    return {"p50_ms": round(float(np.percentile(ms, 50)), 3),
            "p99_ms": round(float(np.percentile(ms, 99)), 3)}


def latency_lines(model: Any, meta: dict[str, Any], args: argparse.Namespace,
                  rows: list[str], reference: np.ndarray | None) -> tuple[list[dict],
                                                                           np.ndarray]:
    """Latency lines of one model, and its answers for the largest batch's rows."""
    parser = RequestParser(meta, max_rows=max(sizes(args.batch_sizes)))
    lines = []
    for batch in sizes(args.batch_sizes):
        body = json.dumps({"rows": rows[:batch]}).encode()
        parse_s, call_s = [], []
        with torch.inference_mode():
            for i in range(args.iters + 3):  # 3 warm-up calls: TorchScript optimizes on them
                start = time.perf_counter()
                parsed = parser.parse(body)
                parsed_at = time.perf_counter()
                model.predict_raw(torch.from_numpy(parsed.dense_raw),
                                  torch.from_numpy(parsed.cat_raw))
                if i >= 3:
                    parse_s.append(parsed_at - start)
                    call_s.append(time.perf_counter() - parsed_at)
        lines.append({"bench": "serve_latency", "model": args.model,
                      "embedding_dtype": meta["embedding_dtype"], "batch": batch,
                      "iters": args.iters, **percentiles_ms(call_s),
                      "rows_per_s": round(batch * len(call_s) / sum(call_s), 1),
                      "parse_p50_ms": percentiles_ms(parse_s)["p50_ms"],
                      "torch_threads": torch.get_num_threads()})
    with torch.inference_mode():
        answers = model.predict_raw(torch.from_numpy(parsed.dense_raw),
                                    torch.from_numpy(parsed.cat_raw)).numpy()
    if reference is not None:
        for line in lines:
            line["max_abs_diff_vs_torchscript"] = float(np.abs(answers - reference).max())
    return lines, answers


def start_server(path: Path, args: argparse.Namespace, stderr: Any) -> tuple[subprocess.Popen,
                                                                            int]:
    cmd = [sys.executable, "-m", "dlrm_app", "serve", str(path), "--port", "0",
           "--threads", str(args.server_threads), "--max-batch-rows", str(args.max_batch_rows),
           "--max-wait-ms", str(args.max_wait_ms)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True)
    first = proc.stdout.readline() if proc.stdout else ""
    if not first.startswith("{"):
        proc.kill()
        raise SystemExit(f"the server did not start (exit code {proc.wait()}); its stderr is in "
                         f"{stderr.name}")
    return proc, int(json.loads(first)["port"])


def call(conn: http.client.HTTPConnection, method: str, path: str,
         body: bytes | None = None) -> tuple[int, dict]:
    conn.request(method, path, body, {"Content-Type": "application/json"} if body else {})
    response = conn.getresponse()
    return response.status, json.loads(response.read())


def http_load(port: int, bodies: list[bytes], concurrency: int, total: int
              ) -> tuple[list[float], int, float]:
    """(latencies, errors, wall seconds) of ``total`` requests from ``concurrency`` clients."""
    latencies: list[list[float]] = [[] for _ in range(concurrency)]
    errors = [0] * concurrency
    ready = threading.Barrier(concurrency + 1)

    def client(k: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        conn.connect()
        ready.wait()
        for i in range(k, total, concurrency):
            start = time.perf_counter()
            status, _ = call(conn, "POST", "/predict", bodies[i % len(bodies)])
            latencies[k].append(time.perf_counter() - start)
            errors[k] += status != 200
        conn.close()

    threads = [threading.Thread(target=client, args=(k,)) for k in range(concurrency)]
    for t in threads:
        t.start()
    ready.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    return [x for per in latencies for x in per], sum(errors), time.perf_counter() - start


def http_lines(path: Path, args: argparse.Namespace, rows: list[str], tmp: Path) -> list[dict]:
    model, meta = load_artifact(path)
    r = args.rows_per_request
    bodies = [json.dumps({"rows": rows[i:i + r]}).encode() for i in range(0, len(rows) - r + 1, r)]
    parsed = RequestParser(meta, max_rows=r).parse(bodies[0])
    with torch.inference_mode():
        expected = model.predict_raw(torch.from_numpy(parsed.dense_raw),
                                     torch.from_numpy(parsed.cat_raw)).numpy()
    lines = []
    with open(tmp / "server.stderr", "w") as stderr:
        proc, port = start_server(path, args, stderr)
        try:
            admin = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            status, answer = call(admin, "POST", "/predict", bodies[0])
            if status != 200:
                raise SystemExit(f"the server refused a benchmark request: {answer}")
            error = float(np.abs(np.array(answer["probabilities"]) - expected).max())
            for concurrency in sizes(args.concurrency):
                before = call(admin, "GET", "/metrics")[1]
                latencies, errors, seconds = http_load(port, bodies, concurrency, args.requests)
                after = call(admin, "GET", "/metrics")[1]
                batches = after["batches"] - before["batches"]
                served = after["rows_served"] - before["rows_served"]
                lines.append({
                    "bench": "serve_http", "model": args.model,
                    "embedding_dtype": meta["embedding_dtype"], "concurrency": concurrency,
                    "rows_per_request": r, "requests": len(latencies), "errors": errors,
                    "seconds": round(seconds, 6),
                    "requests_per_s": round(len(latencies) / seconds, 1),
                    "rows_per_s": round(len(latencies) * r / seconds, 1),
                    **percentiles_ms(latencies),
                    "server_batches": batches, "server_rows": served,
                    "server_mean_batch_rows": round(served / batches, 2) if batches else None,
                    "max_batch_rows": args.max_batch_rows, "max_wait_ms": args.max_wait_ms,
                    "server_threads": args.server_threads,
                    "max_abs_diff_vs_in_process": error,
                })
            admin.close()
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    return lines


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = random_rows(np.random.default_rng(args.seed + 1),
                       max(max(sizes(args.batch_sizes)), 64 * args.rows_per_request))
    with tempfile.TemporaryDirectory(prefix="bench_serve_") as tmp_name:
        tmp = Path(tmp_name)
        artifacts = export_dlrms(args, tmp) if args.model == "dlrm" else save_standin(args, tmp)
        common = {"tables": NUM_SPARSE, "rows_per_table": args.rows_per_table, "dim": args.dim,
                  "cores": len(os.sched_getaffinity(0))}
        if args.model == "dlrm":
            for (fmt, dtype), path in artifacts.items():
                if fmt == "eager":
                    continue
                size = path.stat().st_size
                fp32 = artifacts.get((fmt, "fp32"))
                print(json.dumps({"bench": "serve_size", "format": fmt, "embedding_dtype": dtype,
                                  "bytes": size, "mb": round(size / 2**20, 2),
                                  "ratio_to_fp32": round(size / fp32.stat().st_size, 4)
                                  if fp32 else None, **common}), flush=True)
        # TorchScript first per dtype: the reference the other formats' answers are compared to
        order = sorted(artifacts, key=lambda k: (k[1], k[0] != "torchscript"))
        metas: dict[str, dict] = {}
        reference: dict[str, np.ndarray] = {}
        for fmt, dtype in order:
            log(f"in-process latency: {fmt} {dtype}")
            item = artifacts[fmt, dtype]
            if fmt == "eager":
                model, meta = item, metas[dtype]
            else:
                model, meta = load_artifact(item)
                metas[dtype] = meta
            lines, answers = latency_lines(model, meta, args, rows, reference.get(dtype))
            reference.setdefault(dtype, answers)
            for line in lines:
                print(json.dumps({**line, "format": fmt, **common, **load()}), flush=True)
        http_dtype = args.http_dtype if any(d == args.http_dtype for _, d in artifacts) \
            else "fp32"
        for fmt in (args.http_formats.split(",") if args.model == "dlrm" else ["torchscript"]):
            if (fmt, http_dtype) not in artifacts or fmt == "eager":
                continue
            log(f"HTTP load: {fmt} {http_dtype}, concurrency {args.concurrency}")
            for line in http_lines(artifacts[fmt, http_dtype], args, rows, tmp):
                print(json.dumps({**line, "format": fmt, **common, **load()}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
