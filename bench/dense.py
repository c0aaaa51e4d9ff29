"""The DLRM's dense part alone, eager or ``torch.compile``d, in fp32 or bf16 autocast.

One train step of the dense part of ``dlrm_app.model`` (bottom MLP, dot interaction, top MLP,
log loss, backward to the pooled embeddings and the dense weights, fused Adagrad), on one
thread by default, at the reference 1TB sizes (26 features, dim 128, bottom 512-256-128, top
1024-1024-512-256-1, batch 2048). One JSON line per (precision, mode):

  step_ms          median of ``--repeats`` timings of ``--steps`` steps each
  compile_s        (compiled only) the first step's wall time: tracing and code generation
  ratio_to_eager   eager step_ms / this step_ms at the same precision (> 1: faster)

``torch.compile`` wraps the module (``DenseArch``, ``InteractionArch``, ``OverArch``); the
optimizer is not compiled. Measured here it did not pay (see docs/benchmarks.md), so the app trains
eagerly.

Usage: python bench/dense.py [--batch-size 2048] [--threads 1] [--no-compile]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from common import add_flags
from torch import nn

from dlrm_app.model import DenseArch, InteractionArch, OverArch


class Dense(nn.Module):
    def __init__(self, num_dense: int, features: int, dim: int, bottom: tuple[int, ...],
                 top: tuple[int, ...]) -> None:
        super().__init__()
        self.dense_arch = DenseArch(num_dense, (*bottom, dim))
        self.inter_arch = InteractionArch(features)
        self.over_arch = OverArch(self.inter_arch.output_dim(dim), (*top, 1))

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        return self.over_arch(self.inter_arch(self.dense_arch(dense), pooled)).squeeze(1)


def measure(args: argparse.Namespace, precision: str, compiled: bool) -> dict:
    torch.manual_seed(0)
    model = Dense(13, args.features, args.dim, (512, 256), (1024, 1024, 512, 256))
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.01, fused=True)
    run = torch.compile(model) if compiled else model
    dense = torch.rand(args.batch_size, 13)
    pooled = torch.randn(args.batch_size, args.features, args.dim, requires_grad=True)
    labels = torch.randint(0, 2, (args.batch_size,)).float()

    def step() -> float:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            logits = run(dense, pooled)
        loss = F.binary_cross_entropy_with_logits(logits.float(), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.item()

    start = time.perf_counter()
    first_loss = step()
    first_s = time.perf_counter() - start
    step()
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        times.append((time.perf_counter() - start) / args.steps * 1e3)
    line = {"bench": "dlrm_dense", "precision": precision,
            "mode": "compiled" if compiled else "eager", "batch_size": args.batch_size,
            "features": args.features, "dim": args.dim, "threads": torch.get_num_threads(),
            "step_ms": round(statistics.median(times), 2), "first_step_loss": round(first_loss, 6)}
    if compiled:
        line["compile_s"] = round(first_s, 1)
    return line


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_flags(p, {"--batch-size": 2048, "--features": 26, "--dim": 128, "--threads": 1,
                  "--steps": 3, "--repeats": 5})
    p.add_argument("--no-compile", action="store_true", help="eager only")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    for precision in ("fp32", "bf16"):
        eager = measure(args, precision, compiled=False)
        print(json.dumps(eager), flush=True)
        if not args.no_compile:
            line = measure(args, precision, compiled=True)
            line["ratio_to_eager"] = round(eager["step_ms"] / line["step_ms"], 3)
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
