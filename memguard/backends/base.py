"""The interface every memory backend implements, and the record it reads."""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, Literal, NamedTuple, Optional

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

    Attributes:
        device: the device's name (``"host"``, ``"cuda:0"``, ``"GPU:0"``).
        allocated: bytes handed out to live objects.
        reserved: bytes the allocator holds from the system.
        peak: the high-water mark since the last reset.
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
    """A cheap reading of one device (:meth:`Backend.read_fast`), in bytes; ``None`` where the
    backend cannot tell.

    Args:
        allocated: the bytes the allocator has handed out to live objects, or ``None``.
        reserved: the bytes the allocator holds from the system (the resident set on the
            host), or ``None``.

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
        return Reading(_pick(min, self.allocated, other.allocated),
                       _pick(min, self.reserved, other.reserved))

    def higher(self, other: "Reading") -> "Reading":
        """Per field, the higher of two readings (the known one where only one is known).

        Args:
            other: the reading to compare with.
        """
        return Reading(_pick(max, self.allocated, other.allocated),
                       _pick(max, self.reserved, other.reserved))


def _pick(choose: Callable[[int, int], int], x: Optional[int], y: Optional[int]) -> Optional[int]:
    return y if x is None else x if y is None else choose(x, y)


class TensorRow(NamedTuple):
    """One live tensor as a framework's census sees it: what :class:`memguard.TensorInfo`
    reads, and a weak reference to the tensor (``None`` where it takes none)."""

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

    Subclasses implement the abstract methods (:meth:`devices`, :meth:`owns`, :meth:`read`,
    :meth:`reset_peak`, :meth:`empty_cache`); :meth:`read_fast` and :meth:`read_peak` derive
    from :meth:`read` unless a backend has a cheaper way. None may initialise a device just to
    look at it. ``hold_tolerance`` is the growth in ``allocated`` that counts as "still held"
    for the automatic cleanup policy, ``reserve_tolerance`` the growth of unused cache that is
    worth emptying without a garbage collection. Leak verdicts (``retained``, ``max_leak``)
    are always on :meth:`in_use`.
    """

    name: str = "?"
    hold_tolerance: int = 1 << 20
    reserve_tolerance: int = 64 << 20
    level_field: LevelField = "allocated"
    """The figure a device's peak counter follows and its memory budgets count, ``allocated``
    on devices and ``reserved`` (the resident set) on the host."""

    @staticmethod
    def in_use(reading: Reading) -> Optional[int]:
        """The bytes a reading says the allocator has handed out, which leak verdicts are
        taken on: ``allocated`` (glibc's ``mallinfo2`` on the host, the caching allocator's
        ``allocated`` on a GPU), ``reserved`` where the backend cannot tell ``allocated``.

        Args:
            reading: a reading of one device (:meth:`read_fast`), in bytes.

        >>> Backend.in_use(Reading(100, 4096)), Backend.in_use(Reading(None, 4096))
        (100, 4096)
        """
        return reading.reserved if reading.allocated is None else reading.allocated

    def level(self, memory: Reading | DeviceMemory) -> Optional[int]:
        """The figure of ``memory`` (a reading or a :class:`DeviceMemory`) that this backend's
        peak counter follows and budgets count (see ``level_field``).

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
        """What :meth:`in_use` takes from a reading, read alone where that is cheaper than
        :meth:`read_fast` (on the host: ``mallinfo2`` without the resident set)."""
        return self.in_use(self.read_fast(device))

    def quick_kind(self, device: Optional[str] = None) -> str:
        """The kind :meth:`read_quick` reads now when not asked for one: ``"in use"`` here;
        the host's changes while its heap is slow to read."""
        return "in use"

    def read_quick(self, device: str, kind: Optional[str] = None) -> tuple[str, Optional[int]]:
        """A level to compare with another of the same kind, for a decision taken on every
        call (``inference_mode``'s cleanup): ``(kind, bytes)``, where two readings of
        different kinds are not comparable; ``kind`` asks for a reading of that kind (the
        one a first reading had). By default :meth:`read_in_use`."""
        return "in use", self.read_in_use(device)

    def read_fast_as(self, kind: str, device: str) -> Reading:
        """:meth:`read_fast`, or the cheaper reading ``kind`` names where this backend has one
        (the host's ``"resident"``: the resident set for both fields)."""
        return self.read_fast(device)

    def read_with(self, device: str, reading: Reading, peak: Optional[int]) -> DeviceMemory:
        """:meth:`read`, where ``reading`` (:meth:`read_fast`) and ``peak`` (:meth:`read_peak`)
        were just taken and nothing ran since: a backend that can use them reads only the
        rest (the host: its physical memory); by default everything is read again.

        Args:
            device: a device name this backend answers for (``"host"``, ``"cuda:0"``...).
            reading: the device's ``(allocated, reserved)`` just read.
            peak: the device's peak counter just read (``None``: not read).
        """
        return self.read(device)

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
        """The peak counter just after :meth:`reset_peak`: :meth:`read_peak` unless the
        backend knows it without reading the counter again.

        Args:
            device: a device name this backend answers for (``"host"``, ``"cuda:0"``...).
        """
        return self.read_peak(device)

    @abc.abstractmethod
    def empty_cache(self) -> None:
        """Hand the allocator's unused cache back to the system (or driver)."""


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
