"""Labelled moments (a scope opening, an out-of-memory at some size) for whoever listens.

Running :class:`memguard.MemoryMonitor` instances listen, to draw them on their timeline.
With no listener, emitting costs one truth test.
"""

from __future__ import annotations

from typing import Callable

from ._locks import ForkSafeLock

_listeners: list[Callable[[str], None]] = []
_lock = ForkSafeLock()


def listen(callback: Callable[[str], None]) -> None:
    """Receive every label emitted from now on."""
    with _lock:
        _listeners.append(callback)


def unlisten(callback: Callable[[str], None]) -> None:
    """Stop receiving labels."""
    with _lock:
        if callback in _listeners:
            _listeners.remove(callback)


LISTENERS = _listeners
"""The listeners themselves, for a hot path to test without a call (``if LISTENERS:``)."""


def listening() -> bool:
    """Whether anything listens (a label need not be made otherwise)."""
    return bool(_listeners)


def emit(label: str) -> None:
    """Hand ``label`` to every listener."""
    if _listeners:
        for callback in list(_listeners):
            callback(label)
