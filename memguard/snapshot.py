"""Point-in-time memory snapshots of every watched device, and their differences."""

from __future__ import annotations

import dataclasses
import time
import types
from typing import Any, Iterator, Mapping, Optional

from ._units import format_bytes, format_table
from .backends import UNKNOWN, Backend, DeviceMemory, Devices, Reading, resolve_devices
from .backends.budget import Budget, budgets

_FIELDS = ("allocated", "reserved", "peak", "free", "total")


def _sub(a: Optional[int], b: Optional[int]) -> Optional[int]:
    return None if a is None or b is None else a - b


@dataclasses.dataclass(frozen=True)
class MemorySnapshot:
    """Memory of several devices at one moment (or, with ``delta=True``, a difference).

    ``snap["host"]`` reads one device, ``later - earlier`` gives a delta (devices in both, no
    budgets), ``str(snap)`` an aligned table and one line per budget. Snapshots pickle.

    Attributes:
        devices: device name -> :class:`DeviceMemory`.
        time: ``time.time()`` when it was taken.
        delta: whether it is a difference of two snapshots.
        budgets: device name -> the :class:`Budget` that binds there (a ``memory_limit``,
            ``RLIMIT_AS``, a cgroup's ``memory.max``, physical or CUDA memory).

    >>> import memguard
    >>> before = memguard.snapshot()
    >>> after = memguard.snapshot()
    >>> print(after - before)  # doctest: +SKIP
    device  allocated   reserved  peak  free  total
    host      +1.2 MiB  +1.3 MiB     -     -      -
    """

    devices: Mapping[str, DeviceMemory]
    time: float
    delta: bool = False
    budgets: Mapping[str, Budget] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", types.MappingProxyType(dict(self.devices)))
        object.__setattr__(self, "budgets", types.MappingProxyType(dict(self.budgets)))

    def __reduce__(self) -> tuple[Any, ...]:
        # The read-only mappings are rebuilt from plain dicts: a snapshot pickles and
        # deep-copies (an out-of-memory's attempts carry them across processes).
        return (type(self),
                (dict(self.devices), self.time, self.delta, dict(self.budgets)))

    def __getitem__(self, device: str) -> DeviceMemory:
        try:
            return self.devices[device]
        except KeyError:
            raise KeyError(f"no device {device!r} in this snapshot; it has "
                           f"{', '.join(self.devices) or 'none'}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self.devices)

    def __len__(self) -> int:
        return len(self.devices)

    def __sub__(self, other: "MemorySnapshot") -> "MemorySnapshot":
        if not isinstance(other, MemorySnapshot):
            return NotImplemented
        devices = {
            name: DeviceMemory(name, **{f: _sub(getattr(mem, f), getattr(other[name], f))
                                        for f in _FIELDS})
            for name, mem in self.devices.items() if name in other.devices
        }
        return MemorySnapshot(devices, self.time - other.time, delta=True)

    def to_dict(self) -> dict[str, Any]:
        """``{"time": ..., "delta": ..., "devices": {name: {field: bytes}}, "budgets": {name:
        {"kind", "limit", "used", "available", ...}}}``, JSON-ready."""
        return {"time": self.time, "delta": self.delta,
                "devices": {name: mem.to_dict() for name, mem in self.devices.items()},
                "budgets": {name: b.to_dict() for name, b in self.budgets.items()}}

    def __str__(self) -> str:
        rows: list[tuple[str, ...]] = [("device", *_FIELDS)]
        rows += [(name, *(format_bytes(getattr(mem, f), signed=self.delta) for f in _FIELDS))
                 for name, mem in self.devices.items()]
        lines = [format_table(rows)]
        lines += [f"budget {b}" for b in self.budgets.values()]
        return "\n".join(lines)


def snapshot(devices: Devices = None) -> MemorySnapshot:
    """Read the memory of ``devices``.

    Args:
        devices: a device name (``"host"``, ``"cuda:0"``, ``"GPU:0"``), a list of names, or
            ``None`` for every active device.

    Returns:
        A :class:`MemorySnapshot`, with the budget that binds each device.

    Raises:
        ValueError: an unknown device name.
        TypeError: ``devices`` that is neither a name nor a list of names.

    >>> import memguard
    >>> snap = memguard.snapshot()
    >>> snap["host"].reserved > 0
    True
    """
    when = time.time()
    read = {d: b.read(d) for b, d in resolve_devices(devices)}
    return MemorySnapshot(read, when, budgets=_budgets(read))


def measured(pairs: list[tuple[Backend, str]], readings: Mapping[str, Reading],
             peaks: Mapping[str, Optional[int]], when: float) -> MemorySnapshot:
    """A snapshot of what a measurement took, reading nothing more: ``allocated``,
    ``reserved`` and ``peak`` from ``readings`` and ``peaks``; ``free``, ``total`` and the
    budgets, the machine's rather than the block's, are left unknown (reading them costs a
    scope on a 0.5 ms step more than a tenth of it)."""
    read = {}
    for backend, device in pairs:
        reading = readings.get(device, UNKNOWN)
        peak, level = peaks.get(device), backend.level(reading)
        read[device] = DeviceMemory(device, allocated=reading.allocated,
                                    reserved=reading.reserved,
                                    peak=peak if peak is None or level is None
                                    else max(peak, level))
    return MemorySnapshot(read, when)


def _budgets(devices: Mapping[str, DeviceMemory]) -> dict[str, Budget]:
    found = {}
    for name, mem in devices.items():
        if name == "host" or name.startswith("cuda:"):
            # the host's physical memory as the reading just took it: /proc/meminfo read once
            physical = (mem.total, mem.free) if name == "host" and mem.total is not None \
                and mem.free is not None else None
            try:
                known = budgets(name, physical=physical)  # as budget(name): tightest first
            except Exception:  # noqa: BLE001 - a budget that cannot be read is not known
                known = []
            if known:
                found[name] = known[0]
    return found
