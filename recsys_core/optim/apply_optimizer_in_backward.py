"""``torchrec.optim.apply_optimizer_in_backward``'s import path."""

from recsys_core.optim.optimizers import apply_optimizer_in_backward

__all__ = ["apply_optimizer_in_backward"]
