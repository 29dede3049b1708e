"""Display units: pick seconds/ms/µs and GiB/MiB for axes and tables (SI inside, converted only here)."""

from __future__ import annotations

GIB = 2**30
MIB = 2**20


def time_unit(seconds: float) -> tuple[float, str]:
    """(multiplier, unit name) that shows ``seconds`` with 1-3 digits before the point.

    >>> time_unit(0.25)
    (1000.0, 'ms')
    """
    if seconds >= 1:
        return 1.0, "s"
    if seconds >= 1e-3:
        return 1e3, "ms"
    return 1e6, "µs"


def bytes_unit(n_bytes: float) -> tuple[float, str]:
    """(multiplier, unit name) for a byte count: GiB from 1 GiB up, MiB below, KiB below 1 MiB."""
    if n_bytes >= GIB:
        return 1 / GIB, "GiB"
    if n_bytes >= MIB:
        return 1 / MIB, "MiB"
    return 1 / 1024, "KiB"


def fmt_seconds(seconds: float) -> str:
    """``"412 ms"`` style text for a duration."""
    scale, unit = time_unit(abs(seconds) if seconds else 1.0)
    return f"{seconds * scale:.3g} {unit}"


def fmt_bytes(n_bytes: float) -> str:
    """``"37.2 GiB"`` style text for a byte count."""
    scale, unit = bytes_unit(abs(n_bytes) if n_bytes else 1.0)
    return f"{n_bytes * scale:.3g} {unit}"
