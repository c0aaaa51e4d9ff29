"""Sizes in messages: bytes in the unit that fits them (``format_bytes(1.5 * 2**20)`` ->
``"1.50 MiB"``), so that a small model's figures read ``12.3 KiB``, not ``0.00 GiB``."""

from __future__ import annotations


def format_bytes(n: float) -> str:
    """``n`` bytes as B, KiB, MiB, GiB or TiB, whichever keeps the number below 1024 (two
    decimals from KiB on)."""
    if abs(n) < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if abs(n) < 1024:
            return f"{n:.2f} {unit}"
    return f"{n / 1024:.2f} TiB"


__all__ = ["format_bytes"]
