"""Byte counts as people read them: one helper for every message and log line."""

from __future__ import annotations


def format_bytes(n: float) -> str:
    """1.50 GiB, 12.00 MiB, 3.00 KiB, 7 B: the largest unit the value reaches, so that a
    4 MiB file system does not read as 0.0 GiB."""
    for unit, size in (("TiB", 2 ** 40), ("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def format_shortfall(need: int, have: int, had: str = "free") -> str:
    """'need 6.00 MiB, 4.00 MiB free (2.00 MiB short)': the difference shown on its own
    too, whatever the two sizes round to."""
    return (f"need {format_bytes(need)}, {format_bytes(have)} {had} "
            f"({format_bytes(need - have)} short)")
