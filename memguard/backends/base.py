"""The interface every memory backend implements, and the record it reads."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from .._units import format_bytes


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """Memory of one device at one moment, in bytes; ``None`` where the backend cannot tell.

    - ``allocated``: bytes handed out to live objects (tensors, or malloc'd blocks on the host);
    - ``reserved``: bytes the allocator holds from the system (the CUDA caching allocator's
      segments; the process's resident set on the host);
    - ``peak``: the highest ``allocated`` since the device's peak counter was last reset
      (highest resident set on the host);
    - ``free`` / ``total``: the device's free and total memory, across all processes.

    >>> import memguard
    >>> mem = memguard.snapshot()["host"]
    >>> mem.reserved > 0
    True
    """

    device: str
    allocated: Optional[int] = None
    reserved: Optional[int] = None
    peak: Optional[int] = None
    free: Optional[int] = None
    total: Optional[int] = None

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain, JSON-ready dict."""
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        parts = [
            f"{field} {format_bytes(getattr(self, field))}"
            for field in ("allocated", "reserved", "peak", "free", "total")
            if getattr(self, field) is not None
        ]
        return f"{self.device}: " + (", ".join(parts) if parts else "nothing known")


Reading = tuple[Optional[int], Optional[int]]
"""A cheap reading of one device: ``(allocated, reserved)``."""


class Backend:
    """One source of memory figures (a framework, or the host process).

    Subclasses implement every method; none may initialise a device just to look at it.
    ``hold_tolerance`` is the growth in ``allocated`` that counts as "still held" for the
    automatic cleanup policy, ``reserve_tolerance`` the growth of unused cache that is worth
    emptying without a garbage collection. ``level_field`` says which reading a device's
    peak counter follows: ``allocated`` (0) on devices, the resident set (1) on the host.
    Leak verdicts (``retained``, ``max_leak``) are always on :meth:`in_use`.
    """

    name: str = "?"
    hold_tolerance: int = 1 << 20
    reserve_tolerance: int = 64 << 20
    level_field: int = 0
    """Which of ``(allocated, reserved)`` a device's peak counter follows."""

    @staticmethod
    def in_use(reading: Reading) -> Optional[int]:
        """The bytes a reading says the allocator has handed out, which leak verdicts are
        taken on: ``allocated`` (glibc's ``mallinfo2`` on the host, the caching allocator's
        ``allocated`` on a GPU), ``reserved`` where the backend cannot tell ``allocated``.

        >>> Backend.in_use((100, 4096)), Backend.in_use((None, 4096))
        (100, 4096)
        """
        allocated, reserved = reading
        return reserved if allocated is None else allocated

    def devices(self) -> list[str]:
        """Names of the devices this backend can read now."""
        raise NotImplementedError

    def owns(self, device: str) -> bool:
        """Whether ``device`` is a name this backend answers for."""
        raise NotImplementedError

    def read(self, device: str) -> DeviceMemory:
        """Everything known about ``device``'s memory."""
        raise NotImplementedError

    def read_fast(self, device: str) -> Reading:
        """``(allocated, reserved)`` of ``device``, as cheaply as possible (microseconds)."""
        mem = self.read(device)
        return mem.allocated, mem.reserved

    def read_peak(self, device: str) -> Optional[int]:
        """The device's peak counter (bytes), or ``None`` if it has none."""
        return self.read(device).peak

    def reset_peak(self, device: str) -> bool:
        """Reset the device's peak counter to its current level; ``False`` if it cannot."""
        raise NotImplementedError

    def empty_cache(self) -> None:
        """Hand the allocator's unused cache back to the system (or driver)."""
        raise NotImplementedError


def subclasses(*roots: type, excluding: frozenset[str] = frozenset()) -> set[type]:
    """The ``roots`` and every class derived from them that exists now, less the classes
    named (``module.QualName``) in ``excluding``; those classes' subclasses stay."""
    seen: set[type] = set()
    stack = list(roots)
    while stack:
        cls = stack.pop()
        if cls not in seen:
            seen.add(cls)
            stack.extend(cls.__subclasses__())
    return {cls for cls in seen if f"{cls.__module__}.{cls.__qualname__}" not in excluding}


_KERAS_MODULES = ("keras", "tf_keras", "tensorflow")


def is_keras_model(obj: Any) -> bool:
    """Whether ``obj`` is a Keras model or layer (Keras 3, ``tf_keras`` or ``tf.keras``), told
    by the names of its classes alone: no framework is imported to look.

    >>> is_keras_model(object())
    False
    """
    for cls in type(obj).__mro__:
        module = getattr(cls, "__module__", None) or ""
        if cls.__name__ in ("Model", "Layer") and module.split(".")[0] in _KERAS_MODULES:
            return True
    return False
