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


_UNITS = {"": 1, "b": 1, "k": 2 ** 10, "kib": 2 ** 10, "m": 2 ** 20, "mib": 2 ** 20,
          "g": 2 ** 30, "gib": 2 ** 30, "t": 2 ** 40, "tib": 2 ** 40}
BYTES_EXPECTED = "a byte count such as 536870912, 512MiB or 1.5GiB (units B, KiB, MiB, GiB, TiB; k, m, g, t as Docker's --shm-size)"


def parse_bytes(text: str) -> int:
    """'512MiB', '1.5 GiB', '2g', '4096' -> bytes (binary units, as format_bytes writes
    them); ValueError naming BYTES_EXPECTED for anything else, zero and negatives
    included."""
    raw = text.strip()
    number = raw.rstrip("BbKkMmGgTtIi ").strip()
    unit = raw[len(number):].strip().lower()
    try:
        value = float(number) * _UNITS[unit]
    except (ValueError, KeyError):
        raise ValueError(BYTES_EXPECTED) from None
    if not (value >= 1 and value < 2 ** 63):  # NaN and inf fail too
        raise ValueError(BYTES_EXPECTED)
    return int(value)
