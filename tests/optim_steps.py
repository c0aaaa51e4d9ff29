"""Stepping an optimizer on a parameter's power loss, and the check the checkpoint-resume tests
of the keyed and combined optimizers share: after a state dict round trip, one more step of the
original and of the resumed optimizer leaves the two parameters equal to the bit."""

from __future__ import annotations

from typing import Any

import torch


def power_loss_steps(opt: Any, param: torch.Tensor, power: int, steps: int = 1) -> None:
    """``steps`` steps of ``opt``: zero_grad, backward of ``(param ** power).sum()``, step."""
    for _ in range(steps):
        opt.zero_grad()
        (param**power).sum().backward()
        opt.step()


def assert_resumes_exactly(original: tuple[torch.Tensor, Any], resumed: tuple[torch.Tensor, Any],
                           power: int) -> None:
    """One more ``power_loss_steps`` of each (parameter, optimizer) pair, the original first:
    the resumed parameter equals the original's exactly (rtol=0, atol=0)."""
    for param, opt in (original, resumed):
        power_loss_steps(opt, param, power)
    torch.testing.assert_close(resumed[0].detach(), original[0].detach(), rtol=0, atol=0)
