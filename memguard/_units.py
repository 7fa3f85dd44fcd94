"""Sizes in bytes: parse ``"512MiB"`` / ``"1.5GB"`` and format byte counts in binary units."""

from __future__ import annotations

import re
from typing import Union

Size = Union[int, str]

_FACTORS = {
    "": 1, "b": 1,
    "k": 1024, "kib": 1024, "kb": 1000,
    "m": 1024**2, "mib": 1024**2, "mb": 1000**2,
    "g": 1024**3, "gib": 1024**3, "gb": 1000**3,
    "t": 1024**4, "tib": 1024**4, "tb": 1000**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def parse_size(value: Size, name: str = "size") -> int:
    """Return ``value`` in bytes.

    ``value`` is a non-negative int (bytes) or a string with a unit: binary units
    (``KiB``, ``MiB``, ``GiB``, ``TiB``, or the short ``K``/``M``/``G``/``T``), decimal units
    (``kB``, ``MB``, ``GB``, ``TB``) or ``B``. Units are case-insensitive.

    >>> parse_size("1.5GiB")
    1610612736
    >>> parse_size("64MB")
    64000000
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(
            f"{name} must be an int (bytes) or a string such as '512MiB', got {value!r} "
            f"of type {type(value).__name__}"
        )
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{name} must not be negative, got {value}")
        return value
    match = _SIZE_RE.match(value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _FACTORS:
        raise ValueError(
            f"{name}: cannot read {value!r} as a size; write a number with an optional unit, "
            f"such as '512MiB', '1.5GB', '64KiB' or '1048576'"
        )
    return int(float(match.group(1)) * _FACTORS[unit])


def parse_optional_size(value: Size | None, name: str) -> int | None:
    """:func:`parse_size`, passing ``None`` through."""
    return None if value is None else parse_size(value, name)


def format_bytes(n: int | None, signed: bool = False) -> str:
    """Format a byte count in binary units: ``format_bytes(41943040) == '40.0 MiB'``.

    ``None`` formats as ``'-'``; with ``signed=True`` positive values get a ``+``.
    """
    if n is None:
        return "-"
    sign = "-" if n < 0 else ("+" if signed and n > 0 else "")
    value = float(abs(n))
    for unit in _UNITS:
        if value < 1024 or unit == _UNITS[-1]:
            break
        value /= 1024
    return f"{sign}{int(value)} B" if unit == "B" else f"{sign}{value:.1f} {unit}"
