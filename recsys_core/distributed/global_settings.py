"""TorchRec's ``torchrec.distributed.global_settings``: process-wide switches (read by TorchRec's
inference sharding; this library's sharders take devices explicitly and do not read it)."""

from __future__ import annotations

PROPOGATE_DEVICE: bool = False


def set_propogate_device(val: bool) -> None:
    """Whether quantized inference modules follow the device of their input (TorchRec's flag)."""
    global PROPOGATE_DEVICE
    PROPOGATE_DEVICE = bool(val)


def get_propogate_device() -> bool:
    return PROPOGATE_DEVICE


__all__ = ["PROPOGATE_DEVICE", "get_propogate_device", "set_propogate_device"]
