"""Which compute kernels a plan may name, and the checks of a plan's kernel choices.

Every :class:`EmbeddingComputeKernel` member of TorchRec 1.8 parses, but only some run here:

- training: DENSE (the table's weights are parameters; an optimizer outside the module steps
  them from their ``.grad``), FUSED, FUSED_UVM, FUSED_UVM_CACHING (the optimizer is fused into
  the backward pass);
- inference: QUANT.

:func:`check_runnable_kernel` refuses the rest with an error that names the kernel and says
why; :func:`compute_kernel_violations` is the logic of TorchRec's planner check
``validate_compute_kernels`` (the planner wraps it to raise its ``PlannerError``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from recsys_core.plan.types import EmbeddingComputeKernel, ShardingType

K = EmbeddingComputeKernel

TRAINING_KERNELS = frozenset({K.DENSE, K.FUSED, K.FUSED_UVM, K.FUSED_UVM_CACHING})
"""Kernels a training plan may use."""
FUSED_KERNELS = frozenset({K.FUSED, K.FUSED_UVM, K.FUSED_UVM_CACHING})
"""Training kernels whose optimizer runs inside the backward pass."""
INFERENCE_KERNELS = frozenset({K.QUANT})
"""Kernels an inference plan may use."""
CACHING_KERNELS = frozenset({K.FUSED_UVM_CACHING, K.QUANT_UVM_CACHING})
"""Kernels that hold a table behind a cache (a ``cache_load_factor`` applies)."""

_WHY_NOT: dict[EmbeddingComputeKernel, str] = {
    K.QUANT_UVM: "quantized tables are held by FBGEMM's int-n-bit kernel in device or host "
    "memory, not in UVM",
    K.QUANT_UVM_CACHING: "quantized tables have no UVM cache here",
    K.KEY_VALUE: "it needs an SSD key-value store (FBGEMM's SSD TBE), which this library does "
    "not build",
    K.CUSTOMIZED_KERNEL: "it names a user kernel registered with TorchRec's internals",
    K.SSD_VIRTUAL_TABLE: "virtual tables need FBGEMM's SSD key-value backend",
    K.DRAM_VIRTUAL_TABLE: "virtual tables need FBGEMM's DRAM key-value backend",
    K.DRAM_SSD_VIRTUAL_TABLE: "virtual tables need FBGEMM's key-value backends",
    K.FUSED_TRITON: "it needs TorchRec's Triton kernels",
}


def check_runnable_kernel(where: str, kernel: EmbeddingComputeKernel, *, inference: bool) -> None:
    """Raise ValueError (naming ``where`` and the kernel) unless ``kernel`` runs here."""
    kernel = EmbeddingComputeKernel(kernel)
    if kernel in _WHY_NOT:
        fix = "quant" if inference else "fused (or dense, fused_uvm_caching)"
        raise ValueError(
            f"{where}: compute kernel {kernel.value} is not available in recsys_core: "
            f"{_WHY_NOT[kernel]}; use {fix}"
        )
    if inference and kernel not in INFERENCE_KERNELS:
        raise ValueError(
            f"{where}: compute kernel {kernel.value} in an inference plan; quantized inference "
            "shards use EmbeddingComputeKernel.QUANT"
        )
    if not inference and kernel not in TRAINING_KERNELS:
        raise ValueError(
            f"{where}: compute kernel {kernel.value} is for inference (quantized tables cannot "
            "train); use EmbeddingComputeKernel.FUSED or DENSE for training"
        )


def _value(x: Any) -> Any:
    return getattr(x, "value", x)


def compute_kernel_violations(options: Iterable[Any]) -> list[str]:
    """TorchRec's kernel checks of a planner's chosen sharding options, one message each.

    Each option needs ``fqn``, ``compute_kernel``, ``sharding_type``, ``cache_load_factor`` and
    ``total_storage`` (with ``hbm`` and ``ddr``). Checked: the kernel is a known one; DENSE only
    with DATA_PARALLEL (the planner's rule; hand-written plans may use DENSE with every sharding
    type); a caching kernel's load factor, when set, lies strictly between 0 and 1; no negative
    storage.
    """
    known = {k.value for k in EmbeddingComputeKernel}
    violations: list[str] = []
    for so in options:
        fqn, kernel = so.fqn, _value(so.compute_kernel)
        if kernel not in known:
            violations.append(f"{fqn}: unknown compute kernel '{kernel}'")
            continue
        if kernel == K.DENSE.value and _value(so.sharding_type) != ShardingType.DATA_PARALLEL.value:
            violations.append(
                f"{fqn}: DENSE kernel requires DATA_PARALLEL sharding, got "
                f"'{_value(so.sharding_type)}'"
            )
        if kernel in {k.value for k in CACHING_KERNELS}:
            clf = so.cache_load_factor
            if clf is not None and not 0 < clf < 1:
                violations.append(
                    f"{fqn}: {kernel} requires cache_load_factor strictly between 0 and 1, "
                    f"got {clf}"
                )
        storage = so.total_storage
        if storage.hbm < 0:
            violations.append(f"{fqn}: {kernel} has negative HBM storage ({storage.hbm})")
        if storage.ddr < 0:
            violations.append(f"{fqn}: {kernel} has negative DDR storage ({storage.ddr})")
    return violations


def validate_compute_kernels(
    options: Iterable[Any], error: Callable[[str], Exception] = ValueError
) -> None:
    """Raise ``error(message)`` listing every :func:`compute_kernel_violations` entry."""
    violations = compute_kernel_violations(options)
    if violations:
        raise error(
            f"Compute kernel validation failed with {len(violations)} violation(s):\n"
            + "\n".join(f"  - {v}" for v in violations)
        )
