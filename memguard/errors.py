"""memguard's exceptions."""

from __future__ import annotations

from typing import Mapping


class MemguardError(Exception):
    """Base class of the errors memguard raises itself."""


class MemoryLeakError(MemguardError):
    """Memory still held after a guarded block and its cleanup exceeded ``max_leak``.

    ``retained`` maps each offending device to the bytes it kept; ``limit`` is the
    ``max_leak`` in bytes.

    >>> import memguard
    >>> try:
    ...     with memguard.memory_scope(max_leak="1MiB"):
    ...         pass
    ... except memguard.MemoryLeakError as err:
    ...     print(err.retained)
    """

    def __init__(self, message: str, retained: Mapping[str, int], limit: int) -> None:
        super().__init__(message)
        self.retained = dict(retained)
        self.limit = limit
