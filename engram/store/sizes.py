"""``fmt_bytes``: byte counts in messages (preflight, the shared copies), in the largest binary unit they reach."""
from __future__ import annotations


def fmt_bytes(n: int) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"
