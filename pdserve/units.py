"""Units: byte units, a byte count as a person reads it, and whole blocks of a token count (ceil_div)."""

from __future__ import annotations

KIB, MIB, GIB = 2**10, 2**20, 2**30


def human_bytes(n: int, decimals: int = 1) -> str:
    """1536 -> '1.5 KiB'; below 1 KiB, whole bytes ('512 B')."""
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if n >= size:
            return f"{n / size:,.{decimals}f} {unit}"
    return f"{n} B"


def ceil_div(n: int, d: int) -> int:
    """n / d rounded up, for non-negative n and positive d: the blocks of d tokens that n tokens fill."""
    return -(-n // d)
