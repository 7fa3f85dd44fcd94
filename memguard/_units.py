"""Sizes in bytes and their text: parse ``"512MiB"`` / ``"1.5GB"``, format byte counts in binary
units, lay rows out as a table."""

from __future__ import annotations

import re
import reprlib
from typing import Sequence, Union

from ._checks import integral

Size = Union[int, str]

_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}
# What a user's size means: "K"/"KiB" binary, "kB" decimal, "B" or nothing bytes.
_FACTORS = {"": 1, "b": 1, **{prefix + suffix: (1000 if suffix == "b" else 1024) ** power
                               for prefix, power in _POWERS.items() if prefix
                               for suffix in ("", "ib", "b")}}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
MAX_SIZE = 2**63 - 1
"""The largest size memguard reads (what a signed 64-bit byte count holds): no memory is larger."""


def parse_size(value: Size, name: str = "size") -> int:
    """Return ``value`` in bytes.

    Args:
        value: bytes (an integral number) or a string with a case-insensitive unit: binary
            (``KiB``, ``MiB``, ``GiB``, ``TiB``, or ``K``/``M``/``G``/``T``), decimal (``kB``,
            ``MB``, ``GB``, ``TB``) or ``B``, such as ``"512MiB"`` or ``"1.5GB"``.
        name: the parameter's name, quoted by the error messages. Default ``"size"``.

    Returns:
        The size in bytes.

    Raises:
        TypeError: a value that is neither an int nor a string.
        ValueError: an unreadable, negative or impossibly large value (over ``MAX_SIZE``).

    >>> parse_size("1.5GiB")
    1610612736
    >>> parse_size("64MB")
    64000000
    >>> parse_size("9" * 400, "max_leak")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: max_leak: '999...999' is more bytes than any memory holds (at most ...
    """
    whole_bytes = None if isinstance(value, str) else integral(value)
    if whole_bytes is None and not isinstance(value, str):
        raise TypeError(
            f"{name} must be an int (bytes) or a string such as '512MiB', got {value!r} "
            f"of type {type(value).__name__}"
        )
    if whole_bytes is not None:
        if whole_bytes < 0:
            raise ValueError(f"{name} must not be negative, got {value}")
        nbytes = whole_bytes
    else:
        match = _SIZE_RE.match(str(value))
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


def binary_unit(unit: str) -> int:
    """Bytes in one ``unit`` as the frameworks' messages mean it: binary whatever the spelling
    (MPS writes ``MB`` for MiB); ``KeyError`` for an unknown unit.

    >>> binary_unit("MiB"), binary_unit("MB"), binary_unit("bytes")
    (1048576, 1048576, 1)
    """
    key = unit.lower()
    key = "" if key in ("b", "bytes") else key.removesuffix("ib").removesuffix("b")
    return 1024 ** _POWERS[key]


def format_bytes(n: int | None, signed: bool = False) -> str:
    """Format a byte count in binary units.

    Args:
        n: a count of bytes, or ``None`` (formatted as ``'-'``).
        signed: put a ``+`` before positive values (for differences). Default ``False``.

    Returns:
        The count in the largest binary unit that keeps it at least 1 (``"1.5 GiB"``).

    >>> from memguard import format_bytes
    >>> format_bytes(41943040), format_bytes(2**20, signed=True), format_bytes(None)
    ('40.0 MiB', '+1.0 MiB', '-')
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


def format_table(rows: Sequence[Sequence[str]], *, left: int = 1) -> str:
    """Rows of cells as aligned columns two spaces apart: the first ``left`` flush left, the
    others flush right.

    >>> print(format_table([("device", "used"), ("host", "1.0 MiB"), ("cuda:0", "12 B")]))
    device     used
    host    1.0 MiB
    cuda:0     12 B
    """
    if not rows:
        return ""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ("  ".join(cell.ljust(w) if i < left else cell.rjust(w)
                       for i, (cell, w) in enumerate(zip(row, widths, strict=True)))
             for row in rows)
    return "\n".join(line.rstrip() for line in lines)
