"""Memory budgets: how much each device can still give this process, and which limit says so.

The host's budgets are, in turn: a soft ``RLIMIT_AS`` (set by :func:`memguard.memory_limit`,
``ulimit -v`` or a launcher; counts address space, of which what malloc holds free is
available too), a cgroup v2 ``memory.max`` (containers;
counts the cgroup's memory) and the machine's physical memory (psutil's ``available``). A CUDA
device's budget is the driver's free memory plus the caching allocator's reserved-but-unused
bytes, capped by a per-process memory fraction. The one that binds is the one with the least
left: :func:`budget`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from .._units import format_bytes
from . import tensorflow as tensorflow_backend, torch as torch_backend
from .host import address_space_budget, cgroup_memory_budget, malloc_free

# What each kind of budget counts, for messages.
MEASURES = {"memory_limit": "address space", "RLIMIT_AS": "address space",
            "cgroup memory.max": "cgroup memory", "physical memory": "physical memory",
            "CUDA memory fraction": "allocator memory", "CUDA device": "device memory"}
# The kinds that are a device's whole memory rather than a limit set on it: "995.0 MiB of
# 23.5 GiB physical memory", not "of the 23.5 GiB physical memory".
WHOLE = ("physical memory", "CUDA device")


@dataclasses.dataclass(frozen=True)
class Budget:
    """One limit on a device's memory: ``kind`` (``"memory_limit"``, ``"RLIMIT_AS"``,
    ``"cgroup memory.max"``, ``"physical memory"``, ``"CUDA memory fraction"``,
    ``"CUDA device"``), its ``limit`` and what of it is ``used``, in bytes, and
    ``reusable``: the part of ``used`` the allocator holds free for the next allocations
    (under an address-space limit, what glibc's malloc keeps mapped after a ``free``);
    ``available`` is what is left for new allocations.

    Each kind reads once in messages: what it counts is added where its name does not say
    it already.

    Attributes:
        device: the device it limits.
        kind: what it is (see above).
        limit: its size in bytes.
        used: the bytes of it in use.
        reusable: the part of ``used`` the allocator holds free for the next allocations.
        available: what is left for new allocations (``limit - used + reusable``, at least 0).

    >>> str(Budget("host", "memory_limit", 60 * 2**20, 42 * 2**20))
    'host: memory_limit 60.0 MiB (address space), 42.0 MiB used, 18.0 MiB available'
    >>> str(Budget("host", "physical memory", 8 * 2**30, 2**30))
    'host: physical memory 8.0 GiB, 1.0 GiB used, 7.0 GiB available'
    >>> Budget("host", "memory_limit", 60 * 2**20, 42 * 2**20, reusable=30 * 2**20).short()
    '42.0 MiB of the 60.0 MiB memory_limit (address space; 30.0 MiB of it free in the allocator)'
    >>> Budget("host", "memory_limit", 60 * 2**20, 42 * 2**20, reusable=30 * 2**20).available
    50331648
    """

    device: str
    kind: str
    limit: int
    used: int
    reusable: int = 0

    @property
    def available(self) -> int:
        """``limit - used + reusable``, never below 0: new address space and what the
        allocator holds free (which can exceed ``limit`` when it held free memory mapped
        before the limit was set)."""
        return max(0, self.limit - self.used + self.reusable)

    @property
    def measure(self) -> str:
        """The kind of memory the limit counts (address space, cgroup memory, device memory...)."""
        return MEASURES.get(self.kind, "memory")

    def to_dict(self) -> dict[str, Any]:
        """The fields and ``available``, JSON-ready."""
        return dict(dataclasses.asdict(self), available=self.available, measure=self.measure)

    def _counts(self) -> str:
        """`` (address space)``: what the limit counts, where the kind's name does not say
        it (``""`` for ``physical memory``, ``cgroup memory.max`` and unknown kinds), and what
        of it the allocator holds free, when it holds some."""
        known = self.kind in MEASURES and self.measure not in self.kind
        parts = [self.measure] if known else []
        if self.reusable:
            parts.append(f"{format_bytes(self.reusable)} of it free in the allocator")
        return f" ({'; '.join(parts)})" if parts else ""

    def short(self) -> str:
        """What of the budget is used, for a message: ``"42.0 MiB of the 60.0 MiB
        memory_limit (address space)"``, ``"995.0 MiB of 23.5 GiB physical memory"``,
        ``"30.1 GiB of 31.7 GiB device memory"``.

        Returns:
            The used bytes, the limit and what it is, each said once.

        >>> Budget("host", "cgroup memory.max", 2**31, 2**30).short()
        '1.0 GiB of the 2.0 GiB cgroup memory.max'
        """
        used, limit = format_bytes(self.used), format_bytes(self.limit)
        if self.kind in WHOLE:
            return f"{used} of {limit} {self.measure}"
        return f"{used} of the {limit} {self.kind}{self._counts()}"

    def __str__(self) -> str:
        return (f"{self.device}: {self.kind} {format_bytes(self.limit)}{self._counts()}, "
                f"{format_bytes(self.used)} used, {format_bytes(self.available)} available")


def budgets(device: str = "host", *,
            physical: Optional[tuple[int, int]] = None) -> list[Budget]:
    """Every budget known to be in force on ``device`` (``"host"`` or ``"cuda:N"``; other
    devices have none known), tightest first. Reading takes microseconds and never
    initialises a device.

    Args:
        device: ``"host"`` or ``"cuda:N"``. Default ``"host"``.
        physical: the host's physical memory ``(total, available)`` in bytes, where the
            caller has just read it (a snapshot reads it once); ``None`` reads it.

    Returns:
        The budgets, the one with the least available first.

    >>> budgets("host")[-1].kind
    'physical memory'
    """
    found: list[Budget] = []
    if device == "host":
        space = address_space_budget()
        if space is not None:  # blocks malloc freed are mapped, yet the next ones use them
            # what malloc and TensorFlow's CPU pool hold free: mapped, yet reused next
            free = (malloc_free() or 0) + tensorflow_backend.cpu_pool_free()
            if space[0] == "memory_limit":
                # a rehearsed device reuses only what it mapped itself: what was free before
                # it opened (the pieces too small to be taken out of reach) is not its own
                free = min(free, space[2])
            found.append(Budget(device, space[0], space[1], space[2], free))
        group = cgroup_memory_budget()
        if group is not None:
            found.append(Budget(device, "cgroup memory.max", group[0], group[1]))
        if physical is None:
            from .. import backends  # the package's host backend (not the module host.py)

            physical = backends.host.physical()
        total, free = physical  # psutil's figures, without its open and parse
        found.append(Budget(device, "physical memory", total, total - free))
    elif device.startswith("cuda"):
        index = int(device.partition(":")[2] or 0)
        cuda = torch_backend.cuda_budget(index)
        if cuda is not None:  # pragma: gpu
            found.append(Budget(device, cuda[0], cuda[1], cuda[2]))
    found.sort(key=lambda b: b.available)
    return found


def budget(device: str = "host") -> Optional[Budget]:
    """The budget that binds on ``device`` (the least available), or ``None`` if none is
    known.

    >>> budget("host").available > 0
    True
    """
    found = budgets(device)
    return found[0] if found else None


def available(device: str = "host") -> Optional[int]:
    """Bytes ``device`` can still give this process under the budget that binds."""
    found = budget(device)
    return None if found is None else found.available


def watched_devices() -> list[str]:
    """The devices whose budgets matter now: the host, and each CUDA device once this process
    has initialised CUDA."""
    devices = ["host"]
    if torch_backend.cuda_initialised():  # pragma: gpu
        devices += [f"cuda:{i}" for i in range(torch_backend.cuda_device_count())]
    return devices


def device_identity() -> str:
    """The device a job's sizes are remembered for: the current CUDA device's name and total
    memory once CUDA is initialised, else the host's processor and total memory.

    >>> device_identity().startswith(("host", "cuda"))
    True
    """
    cuda = torch_backend.available_cuda_device() if torch_backend.cuda_initialised() else None
    if cuda is not None:  # pragma: gpu
        name = torch_backend.cuda_identity(int(cuda.partition(":")[2]))
        if name is not None:
            return f"cuda {name}"
    import platform

    import psutil

    return f"host {platform.machine()} ({int(psutil.virtual_memory().total)} bytes)"
