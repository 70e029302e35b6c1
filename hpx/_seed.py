"""Seeds for hpx's own generators, derived from the user's seed and a stream's identity."""

from __future__ import annotations

__all__ = ["derive_seed"]

_MASK64 = 2**64 - 1


def derive_seed(*parts: int) -> int:
    """A 32-bit seed that depends on every bit of every part.

    torch's CPU generator keeps only the low 32 bits of a seed, so seeds that
    differ only above bit 31 (``s`` and ``s + 2**32``, or ``-1`` and ``2**64 - 1``)
    would draw the same stream. Each part is folded in with a splitmix64 round.
    """
    x = 0x9E3779B97F4A7C15
    for part in parts:
        x = (x ^ (int(part) & _MASK64)) * 0xBF58476D1CE4E5B9 & _MASK64
        x ^= x >> 31
        x = x * 0x94D049BB133111EB & _MASK64
        x ^= x >> 29
        x ^= int(part) >> 64 & _MASK64  # bits beyond 64 still count
    return (x ^ (x >> 32)) & 0xFFFFFFFF
