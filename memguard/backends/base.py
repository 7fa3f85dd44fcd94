"""The interface every memory backend implements, and the record it reads."""

from __future__ import annotations

import abc
import dataclasses
import logging
from typing import Any, Callable, Literal, NamedTuple, Optional

from .._units import format_bytes

log = logging.getLogger("memguard")


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """Memory of one device at one moment, in bytes; ``None`` where the backend cannot tell.

    Attributes:
        device: the device's name (``"host"``, ``"cuda:0"``, ``"GPU:0"``).
        allocated: bytes handed out to live objects (tensors; malloc'd blocks on the host).
        reserved: bytes the allocator holds from the system (the CUDA caching allocator's
            segments; the resident set on the host).
        peak: the highest ``allocated`` since the last reset (resident set on the host).
        free: the device's free memory, across processes.
        total: the device's total memory.

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


class Reading(NamedTuple):
    """A cheap reading of one device (:meth:`Backend.read_fast`), in bytes.

    Args:
        allocated: the bytes handed out to live objects, or ``None`` (unknown).
        reserved: the bytes the allocator holds from the system (the resident set on the
            host), or ``None`` (unknown).

    >>> Reading(100, 4096).reserved
    4096
    """

    allocated: Optional[int]
    reserved: Optional[int]

    def lower(self, other: "Reading") -> "Reading":
        """Per field, the lower of two readings (the known one where only one is known).

        Args:
            other: the reading to compare with.

        >>> Reading(5, None).lower(Reading(7, 9))
        Reading(allocated=5, reserved=9)
        """
        a, b, r, q = self.allocated, other.allocated, self.reserved, other.reserved
        # in one call, no helper: every frees_memory call makes one next to its step
        return _new_reading(Reading, (a if b is None else b if a is None else min(a, b),
                                      r if q is None else q if r is None else min(r, q)))

    def higher(self, other: "Reading") -> "Reading":
        """Per field, the higher of two readings (the known one where only one is known).

        Args:
            other: the reading to compare with.
        """
        return Reading(_pick(max, self.allocated, other.allocated),
                       _pick(max, self.reserved, other.reserved))


_new_reading = tuple.__new__


def _pick(choose: Callable[[int, int], int], x: Optional[int], y: Optional[int]) -> Optional[int]:
    return y if x is None else x if y is None else choose(x, y)


class TensorRow(NamedTuple):
    """One live tensor as a framework's census sees it, with a weak reference (or ``None``)."""

    framework: str
    device: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    is_view: bool
    name: Optional[str]
    id: int
    ref: Any


UNKNOWN = Reading(None, None)
"""The reading of a device that could not be read."""

LevelField = Literal["allocated", "reserved"]


class Backend(abc.ABC):
    """One source of memory figures (a framework, or the host process).

    Subclasses implement :meth:`devices`, :meth:`owns`, :meth:`read`, :meth:`reset_peak` and
    :meth:`empty_cache`; the other reads derive from :meth:`read` unless a backend has a
    cheaper way. None may initialise a device just to look at it. ``hold_tolerance``: the
    growth in ``allocated`` that counts as still held for the automatic cleanup;
    ``reserve_tolerance``: the growth of unused cache worth emptying without a collection."""

    name: str = "?"
    hold_tolerance: int = 1 << 20
    reserve_tolerance: int = 64 << 20
    level_field: LevelField = "allocated"
    """The figure a device's peak counter follows and its memory budgets count, ``allocated``
    on devices and ``reserved`` (the resident set) on the host."""

    @staticmethod
    def in_use(reading: Reading) -> Optional[int]:
        """The bytes handed out, on which leak verdicts are taken: ``allocated`` (``mallinfo2`` on
        the host), else ``reserved``.

        Args:
            reading: a reading of one device (:meth:`read_fast`), in bytes.

        >>> Backend.in_use(Reading(100, 4096)), Backend.in_use(Reading(None, 4096))
        (100, 4096)
        """
        return reading.reserved if reading.allocated is None else reading.allocated

    def level(self, memory: Reading | DeviceMemory) -> Optional[int]:
        """The figure of ``memory`` the peak counter follows and budgets count (``level_field``).

        >>> from memguard.backends import host
        >>> host.level(Reading(100, 4096))
        4096
        """
        return getattr(memory, self.level_field)

    @abc.abstractmethod
    def devices(self) -> list[str]:
        """Names of the devices this backend can read now."""

    @abc.abstractmethod
    def owns(self, device: str) -> bool:
        """Whether ``device`` is a name this backend answers for.

        Args:
            device: a device name this backend answers for (``"host"``, ``"cuda:0"``...).
        """

    @abc.abstractmethod
    def read(self, device: str) -> DeviceMemory:
        """Everything known about ``device``'s memory.

        Args:
            device: a device name this backend answers for (``"host"``, ``"cuda:0"``...).
        """

    def read_fast(self, device: str) -> Reading:
        """``(allocated, reserved)`` of ``device``, as cheaply as possible (microseconds).

        Args:
            device: a device name this backend answers for (``"host"``, ``"cuda:0"``...).
        """
        mem = self.read(device)
        return Reading(mem.allocated, mem.reserved)

    def read_in_use(self, device: str) -> Optional[int]:
        """What :meth:`in_use` takes, read alone where that is cheaper than :meth:`read_fast`."""
        return self.in_use(self.read_fast(device))

    def quick_kind(self, device: Optional[str] = None) -> str:
        """The kind :meth:`read_quick` reads when not asked for one (``"in use"`` here)."""
        return "in use"

    def read_quick(self, device: str, kind: Optional[str] = None) -> tuple[str, Optional[int]]:
        """``(kind, bytes)``: a cheap level to compare with another of the same ``kind``, for a
        decision taken on every call. By default :meth:`read_in_use`."""
        return "in use", self.read_in_use(device)

    def read_fast_as(self, kind: str, device: str) -> Reading:
        """:meth:`read_fast`, or the cheaper reading ``kind`` names (the host's ``"resident"``)."""
        return self.read_fast(device)

    def read_peak(self, device: str) -> Optional[int]:
        """The device's peak counter (bytes), or ``None`` if it has none.

        Args:
            device: a device name this backend answers for (``"host"``, ``"cuda:0"``...).
        """
        return self.read(device).peak

    @abc.abstractmethod
    def reset_peak(self, device: str) -> bool:
        """Reset the device's peak counter to its current level; ``False`` if it cannot.

        Args:
            device: a device name this backend answers for (``"host"``, ``"cuda:0"``...).
        """

    def peak_after_reset(self, device: str) -> Optional[int]:
        """The peak counter just after :meth:`reset_peak` (:meth:`read_peak` by default)."""
        return self.read_peak(device)

    def swap_peak(self, device: str) -> tuple[Optional[int], Optional[int]]:
        """:meth:`read_peak`, :meth:`reset_peak`, then :meth:`peak_after_reset`: the counter
        before the reset and after it (``None`` for any read that failed or is unknown; each
        step's failure is logged and the next still runs). The entry of a scope with no other
        open on the device; a backend overrides it where it can do the three in fewer
        calls."""
        before = safely(self.read_peak, device)
        safely(self.reset_peak, device)
        return before, safely(self.peak_after_reset, device)

    @abc.abstractmethod
    def empty_cache(self) -> None:
        """Hand the allocator's unused cache back to the system (or driver)."""


def safely(method: Callable[[str], Any], device: str) -> Any:
    """``method(device)``, or ``None`` (logged) where it raises: a reading must never break
    the program."""
    try:
        return method(device)
    except Exception as exc:  # noqa: BLE001 - a reading must never break the program
        log.warning("%s(%s) failed: %s", method.__name__, device, exc)
        return None


def subclasses(*roots: type, excluding: frozenset[str] = frozenset()) -> set[type]:
    """The ``roots`` and every class derived from them now, less those named in ``excluding``
    (``module.QualName``; their subclasses stay)."""
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
    """Whether ``obj`` is a Keras model or layer, told by its classes' names (nothing imported).

    >>> is_keras_model(object())
    False
    """
    for cls in type(obj).__mro__:
        module = getattr(cls, "__module__", None) or ""
        if cls.__name__ in ("Model", "Layer") and module.split(".")[0] in _KERAS_MODULES:
            return True
    return False
