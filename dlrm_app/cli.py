"""``dlrm-app``: the application's command line.

Subcommands are added as they work end to end; each parses its flags into typed arguments and
calls library functions (``recsys_core`` never sees argparse).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Sequence

import torch

from recsys_core.kernels import fbgemm_status, fbgemm_version
from recsys_core.kernels.config import EmbOptimType, FusedOptimizerConfig, KernelBackend
from recsys_core.kernels.tbe import fbgemm_missing, select_backend


def environment_report(device: torch.device) -> dict[str, object]:
    """What this machine offers: versions, FBGEMM status, the kernel each optimizer gets."""
    kernels = {}
    for opt in EmbOptimType:
        if opt is EmbOptimType.SGD:
            continue  # alias of EXACT_SGD
        config = FusedOptimizerConfig(optimizer=opt)
        backend = select_backend(KernelBackend.AUTO, device, config, dims=[128])
        reason = fbgemm_missing(device, config, dims=[128])
        kernels[opt.name] = backend.value + (f" ({reason})" if reason else "")
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "fbgemm_gpu": fbgemm_version(),
        "fbgemm_status": fbgemm_status(),
        "cuda_available": torch.cuda.is_available(),
        "device": str(device),
        "fused_kernels": kernels,
    }


def _cmd_info(args: argparse.Namespace) -> int:
    report = environment_report(torch.device(args.device))
    if args.json:
        print(json.dumps(report))
        return 0
    for key, value in report.items():
        if isinstance(value, dict):
            print(f"{key}:")
            for k, v in value.items():
                print(f"  {k:<24} {v}")
        else:
            print(f"{key:<16} {value}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dlrm-app", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="show versions, FBGEMM status and kernel choices")
    info.add_argument("--device", default="cpu", help="device to report kernel choices for")
    info.add_argument("--json", action="store_true", help="print one JSON object")
    info.set_defaults(func=_cmd_info)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
