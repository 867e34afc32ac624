"""Human units for bytes and seconds (binary units: 1 MiB = 1,048,576 B)."""

from __future__ import annotations

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
KiB, MiB, GiB = 1024, 1024**2, 1024**3


def mib(n: int | float) -> float:
    """Bytes as a float count of MiB, for the axes of plots (text uses `fmt_bytes`)."""
    return n / MiB


def fmt_bytes(n: int | None, signed: bool = False) -> str:
    """``4000000`` -> ``"3.81 MiB"``; with ``signed``, ``"+3.81 MiB"`` / ``"-3.81 MiB"``."""
    if n is None:
        return "n/a"
    sign = ("+" if n > 0 else "-" if n < 0 else "±") if signed else ("-" if n < 0 else "")
    v = float(abs(n))
    unit = 0
    while v >= 1024 and unit < len(_UNITS) - 1:
        v /= 1024
        unit += 1
    if unit == 0:
        return f"{sign}{int(v)} B"
    digits = 2 if v < 10 else 1 if v < 100 else 0
    return f"{sign}{v:.{digits}f} {_UNITS[unit]}"


def fmt_seconds(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:.0f} µs"
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    if s < 120:
        return f"{s:.2f} s"
    return f"{s / 60:.1f} min"


#: The most characters of a label a report, a table row or a plot shows (the label is kept whole
#: in the report's data: ``report.label``, ``to_dict()``).
MAX_SHOWN_LABEL = 80


def fmt_label(label: str, most: int = MAX_SHOWN_LABEL) -> str:
    """A label as shown: one line, at most ``most`` characters (cut with "…", and the length
    said, where it is longer: a label made from a variable may hold a whole file)."""
    one = " ".join(label.splitlines())
    if len(one) <= most:
        return one
    return f"{one[: most - 20]}… ({len(one):,} characters)"
