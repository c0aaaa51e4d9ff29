"""TorchRec's ``torchrec.distributed.comm_ops`` switches for the embedding collectives.

Gradient division (on by default, as in TorchRec): the gradients that flow back through the
embedding collectives (pooled all-to-all, reduce-scatter, sequence all-to-all) are divided by
the size of the collective's process group, and data-parallel tables average their gradients
(as DistributedDataParallel does for the dense part). A sharded step is then the step of the
MEAN of the ranks' losses, the same step the dense parameters take under DDP:

    rank 0 loss l0, rank 1 loss l1  ->  every table steps on  d((l0 + l1) / 2) / dW

With ``set_gradient_division(False)`` the embedding collectives pass gradients through
undivided: the tables step on ``d(l0 + l1)/dW``, this library's fused data-parallel replicas
included, DENSE ones too (TorchRec's DENSE replicas still average there: its per-lookup
DistributedDataParallel averages whatever this switch says). The switch is read when the
backward runs, so it can be flipped between steps.
"""

from __future__ import annotations

_GRADIENT_DIVISION = True


def set_gradient_division(val: bool) -> None:
    """Divide the embedding collectives' gradients by their group size (True: TorchRec's default)."""
    global _GRADIENT_DIVISION
    _GRADIENT_DIVISION = bool(val)


def get_gradient_division() -> bool:
    """Whether the embedding collectives divide their gradients by the group size."""
    return _GRADIENT_DIVISION


__all__ = ["get_gradient_division", "set_gradient_division"]
