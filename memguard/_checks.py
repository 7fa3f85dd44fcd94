"""Argument checks: each returns the value it accepted or raises an error naming the
parameter, the value and, where given, the caller (``who``) and a hint."""

from __future__ import annotations

import logging
import math
import numbers
import operator
import os
import sys
import warnings
from typing import Any, Optional

log = logging.getLogger("memguard")


def _prefix(who: Optional[str]) -> str:
    return f"{who}: " if who else ""


def integral(value: Any) -> Optional[int]:
    """``value`` as an ``int`` when ``operator.index`` takes it (numpy's, 0-d tensors), else
    ``None``; never a bool.

    >>> integral(7), integral(True), integral(2.0)
    (7, None, None)
    """
    if isinstance(value, bool) or type(value).__name__ == "bool_":  # numpy's bool too
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def real(value: Any) -> Optional[float]:
    """``value`` as a finite ``float`` when it is a ``numbers.Real`` or integral, else ``None``;
    never a bool, NaN or infinity.

    >>> real(0.5), real(True), real(float("nan")), real("0.5")
    (0.5, None, None, None)
    """
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return None
    if not isinstance(value, numbers.Real):
        whole = integral(value)
        if whole is None:
            return None
        value = whole
    number = float(value)
    return number if math.isfinite(number) else None


def positive_int(value: Any, name: str, *, minimum: int = 1, who: Optional[str] = None,
                 hint: str = "") -> int:
    """``value`` as an ``int`` if it is integral (:func:`integral`) and at least ``minimum``,
    else a ``ValueError`` naming ``name`` and the value.

    >>> positive_int(3, "top")
    3
    >>> positive_int(-1, "warmup", minimum=0, who="frees_memory")
    Traceback (most recent call last):
    ValueError: frees_memory: warmup must be an int >= 0, got -1
    """
    number = integral(value)
    if number is None or number < minimum:
        what = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"{_prefix(who)}{name} must be {what}, got {value!r}{hint}")
    return number


def optional_positive_int(value: Any, name: str, *, who: Optional[str] = None) -> Optional[int]:
    """:func:`positive_int`, passing ``None`` through.

    >>> optional_positive_int(None, "log_every_n_steps") is None
    True
    """
    if value is None:
        return None
    return positive_int(value, name, who=who, hint="" if who is None else " (or None)")


def fraction(value: Any, name: str, *, include_zero: bool = False,
             who: Optional[str] = None) -> float:
    """``value`` as a float strictly between 0 and 1 (from 0 with ``include_zero``), else a
    ``ValueError``.

    >>> fraction(1, "factor")
    Traceback (most recent call last):
    ValueError: factor must be a number between 0 and 1 (exclusive), got 1
    """
    number = real(value)
    if number is None or not ((number >= 0 if include_zero else number > 0) and number < 1):
        span = "in [0, 1)" if include_zero else "between 0 and 1 (exclusive)"
        raise ValueError(f"{_prefix(who)}{name} must be a number {span}, got {value!r}")
    return number


def positive_number(value: Any, name: str, *, unit: str = "", who: Optional[str] = None,
                    hint: str = "") -> float:
    """``value`` as a float if it is a positive, finite number (of ``unit``), else a
    ``ValueError``."""
    number = real(value)
    if number is None or number <= 0:
        of = f" of {unit}" if unit else ""
        raise ValueError(f"{_prefix(who)}{name} must be a positive, finite number{of}, got "
                         f"{value!r}{hint}")
    return number


def flag(value: Any, name: str, *, who: Optional[str] = None) -> bool:
    """``value`` if it is ``True`` or ``False``, else a ``TypeError`` naming ``name``.

    >>> flag(1, "track_tensors", who="frees_memory")
    Traceback (most recent call last):
    ...
    TypeError: frees_memory: track_tensors must be True or False, got 1
    """
    if not isinstance(value, bool):
        raise TypeError(f"{_prefix(who)}{name} must be True or False, got {value!r}")
    return value


_INTERNAL = (os.path.dirname(os.path.abspath(__file__)) + os.sep,)


def warn_at_caller(message: str) -> None:
    """Warn (``RuntimeWarning``) at the first caller outside memguard, so it names the user's
    line. Under ``-W error`` it is logged at WARNING instead: a diagnostic never breaks a call.

    Args:
        message: the warning's text.
    """
    internal = _INTERNAL + _wrapt_folder()
    level, frame = 1, sys._getframe(0)  # noqa: SLF001 - the caller's frames: no public way to walk them
    while frame is not None and frame.f_code.co_filename.startswith(internal):
        frame, level = frame.f_back, level + 1  # type: ignore[assignment]
    try:
        warnings.warn(message, RuntimeWarning, stacklevel=level)
    except Warning:  # the warning filter turned it into an error
        log.warning("%s", message)
    else:
        log.debug("%s", message)


def _wrapt_folder() -> tuple[str, ...]:
    wrapt = sys.modules.get("wrapt")
    path = getattr(wrapt, "__file__", None)
    return (os.path.dirname(os.path.abspath(path)) + os.sep,) if path else ()
