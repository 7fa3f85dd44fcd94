"""Sizes in bytes: parse ``"512MiB"`` / ``"1.5GB"`` and format byte counts in binary units."""

from __future__ import annotations

import re
import reprlib
from typing import Any, Union

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
MAX_SIZE = 2**63 - 1
"""The largest size memguard reads (what a signed 64-bit byte count holds): no memory is larger."""


def parse_size(value: Size, name: str = "size") -> int:
    """Return ``value`` in bytes.

    ``value`` is a non-negative int (bytes) or a string with a unit: binary units
    (``KiB``, ``MiB``, ``GiB``, ``TiB``, or the short ``K``/``M``/``G``/``T``), decimal units
    (``kB``, ``MB``, ``GB``, ``TB``) or ``B``. Units are case-insensitive. A wrong type is a
    ``TypeError``, an unreadable, negative or impossibly large value (over :data:`MAX_SIZE`) a
    ``ValueError``; both name ``name`` and the value.

    >>> parse_size("1.5GiB")
    1610612736
    >>> parse_size("64MB")
    64000000
    >>> parse_size("9" * 400, "max_leak")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: max_leak: '999...999' is more bytes than any memory holds (at most ...
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(
            f"{name} must be an int (bytes) or a string such as '512MiB', got {value!r} "
            f"of type {type(value).__name__}"
        )
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{name} must not be negative, got {value}")
        nbytes = value
    else:
        match = _SIZE_RE.match(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _FACTORS:
            raise ValueError(
                f"{name}: cannot read {reprlib.repr(value)} as a size; write a number with an "
                f"optional unit, such as '512MiB', '1.5GB', '64KiB' or '1048576'"
            )
        whole, _, decimals = match.group(1).partition(".")  # exact, however many digits
        scale = 10 ** len(decimals)
        nbytes = (int(whole or 0) * scale + int(decimals or 0)) * _FACTORS[unit] // scale
    if nbytes > MAX_SIZE:
        raise ValueError(f"{name}: {reprlib.repr(value)} is more bytes than any memory holds "
                         f"(at most {MAX_SIZE}, 8 EiB); give a size in bytes or with a unit, "
                         f"such as '16GiB'")
    return nbytes


def parse_optional_size(value: Size | None, name: str) -> int | None:
    """:func:`parse_size`, passing ``None`` through."""
    return None if value is None else parse_size(value, name)


def positive_int(value: Any, name: str) -> int:
    """``value`` if it is an int (not a bool) of at least 1, else a ``ValueError`` naming ``name``
    and the value: the one check for counts such as ``top`` or a batch size.

    >>> positive_int(3, "top")
    3
    >>> positive_int(True, "top")
    Traceback (most recent call last):
    ...
    ValueError: top must be a positive int, got True
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


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
