"""``memory_scope`` and ``frees_memory``: measure a block, clean up after it, report.

Peaks of scopes that are open at the same time (nested, or in several threads) are kept by one
book per process: before a scope resets a device's peak counter, the counter's value is folded
into the running peak of every scope already open on that device, so no scope loses the peak
that happened before a newer one reset the counter.
"""

from __future__ import annotations

import logging
import time
from contextvars import ContextVar
from typing import Any, Callable, Optional, TypeVar, Union, overload

from ._decorate import function_kind, guard, name_of
from ._events import emit
from ._locks import ForkSafeLock
from ._units import Size, format_bytes, parse_optional_size
from .backends import Backend, Devices, check_devices
from .cleanup import POLICIES, Pairs, Policy, Readings, Settler, read_all
from .errors import MemoryLeakError
from .snapshot import MemorySnapshot, snapshot
from .tensors import TensorInfo, created_since, live_tensors, tensor_ids

log = logging.getLogger("memguard")
F = TypeVar("F", bound=Callable[..., Any])


class _PeakBook:
    """Running peaks of the scopes open on each device."""

    def __init__(self) -> None:
        self._lock = ForkSafeLock()
        self._open: dict[str, dict[int, int]] = {}

    def enter(self, token: int, pairs: Pairs) -> None:
        with self._lock:
            for backend, device in pairs:
                running = self._open.setdefault(device, {})
                counter = _safe(backend.read_peak, device)
                if counter is not None:
                    for other, value in running.items():
                        running[other] = max(value, counter)
                _safe(backend.reset_peak, device)
                start = _safe(backend.read_peak, device)
                running[token] = -1 if start is None else start

    def exit(self, token: int, pairs: Pairs) -> dict[str, Optional[int]]:
        peaks: dict[str, Optional[int]] = {}
        with self._lock:
            for backend, device in pairs:
                running = self._open.get(device, {})
                value = running.pop(token, -1)
                if not running:
                    self._open.pop(device, None)
                counter = _safe(backend.read_peak, device)
                best = max(value, -1 if counter is None else counter)
                peaks[device] = None if best < 0 else best
        return peaks


def _safe(method: Callable[[str], Any], device: str) -> Any:
    try:
        return method(device)
    except Exception as exc:  # noqa: BLE001 - a reading must never break the program
        log.warning("%s(%s) failed: %s", method.__name__, device, exc)
        return None


_book = _PeakBook()


def _level(backend: Backend, reading: tuple[Optional[int], Optional[int]]) -> Optional[int]:
    return reading[backend.level_field]


def _policy(cleanup: Union[bool, str]) -> Optional[Policy]:
    if cleanup is True:
        return "auto"
    if cleanup is False:
        return None
    if cleanup in POLICIES:
        return cleanup  # type: ignore[return-value]
    raise ValueError(f"cleanup must be True, False, 'auto' or 'always', got {cleanup!r}")


def _leak_message(what: str, retained: dict[str, int], limit: int) -> str:
    worst = ", ".join(f"{format_bytes(n)} on {d}" for d, n in retained.items())
    return (f"{what} retained {worst} after cleanup, above max_leak={format_bytes(limit)}; "
            f"something still references memory the block allocated")


class MemoryScope:
    """A measured block: what it used at its peak, what it left behind, what cleanup freed.

    Create it with :func:`memory_scope`. After the block: ``before`` / ``after``
    (:class:`MemorySnapshot`), ``peak`` and ``retained`` (device -> bytes), ``freed`` (bytes
    released by the exit cleanup), ``elapsed`` (seconds). On the host, whose allocator cannot
    split allocated from reserved memory, ``peak`` and ``retained`` are on the resident set.
    """

    def __init__(self, name: Optional[str] = None, *, devices: Devices = None,
                 cleanup: Union[bool, str] = True, max_leak: Optional[Size] = None,
                 track_tensors: bool = False) -> None:
        self.name = name
        self.devices = check_devices(devices)
        self.track_tensors = track_tensors
        self.leaks: list[TensorInfo] = []
        self._tensors_before: dict[int, Any] = {}
        self.cleanup = cleanup
        self._policy = _policy(cleanup)
        self.max_leak = parse_optional_size(max_leak, "max_leak")
        self.before: Optional[MemorySnapshot] = None
        self.after: Optional[MemorySnapshot] = None
        self.peak: dict[str, Optional[int]] = {}
        self.retained: dict[str, int] = {}
        self.freed = 0
        self.elapsed: Optional[float] = None
        self._pairs: Pairs = []
        self._start = 0.0
        self._active = False

    # -- context manager -----------------------------------------------------------------------
    def __enter__(self) -> "MemoryScope":
        if self._active:
            raise RuntimeError(f"{self._title()} is already open; use a new memory_scope() "
                               f"for each block (as a decorator it makes one per call)")
        from .backends import resolve_devices

        self._pairs = resolve_devices(self.devices)
        self._active = True
        if self.track_tensors:
            self._tensors_before = tensor_ids()
        self.before = snapshot([d for _, d in self._pairs])
        _book.enter(id(self), self._pairs)
        emit(f"enter {self._title()}")
        self._start = time.perf_counter()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            self._finish()
        except Exception:  # noqa: BLE001
            if exc_type is None:
                raise
            log.exception("measuring %s failed while the block raised", self._title())
            return
        if self.max_leak is not None:
            over = {d: n for d, n in self.retained.items() if n > self.max_leak}
            if over:
                message = _leak_message(self._title(), over, self.max_leak)
                if self.leaks:
                    message += "; " + self.biggest_leak()
                if exc_type is None:
                    raise MemoryLeakError(message, over, self.max_leak)
                log.warning("%s (not raised: the block raised %s)", message,
                            exc_type.__name__)

    def _finish(self) -> None:
        self.elapsed = time.perf_counter() - self._start
        self._active = False
        emit(f"exit {self._title()}")
        self.peak = _book.exit(id(self), self._pairs)
        assert self.before is not None
        entry: Readings = {d: (m.allocated, m.reserved) for d, m in self.before.devices.items()}
        if self._policy is not None:
            self.freed = Settler(self._policy).settle(self._pairs, entry).freed
        self.after = snapshot([d for _, d in self._pairs])
        for backend, device in self._pairs:
            start = _level(backend, entry[device])
            end = _level(backend, (self.after[device].allocated, self.after[device].reserved))
            self.retained[device] = 0 if start is None or end is None else max(0, end - start)
            if self.peak.get(device) is None and start is not None and end is not None:
                self.peak[device] = max(start, end)
        if self.track_tensors:
            self.leaks = created_since(self._tensors_before, live_tensors())
            self._tensors_before = {}
        log.debug("%s", self)

    # -- decorator -----------------------------------------------------------------------------
    def __call__(self, func: F) -> F:
        name = self.name or name_of(func)
        return guard(func, lambda: MemoryScope(name, devices=self.devices, cleanup=self.cleanup,
                                               max_leak=self.max_leak,
                                               track_tensors=self.track_tensors),
                     "memory_scope")

    # -- reporting -----------------------------------------------------------------------------
    def biggest_leak(self) -> str:
        """``retained 40.0 MiB on host: float32[10000, 1024] held by module __main__, global
        CACHE``: the largest tensor created in the scope and still alive, and its holder
        (``track_tensors=True``; empty without leaks)."""
        if not self.leaks:
            return ""
        leak = self.leaks[0]
        device = "host" if leak.device == "cpu" else leak.device
        amount = self.retained.get(device, leak.nbytes)
        holders = leak.holders
        held = f"held by {holders[0]}" if holders else "holder not found"
        return f"retained {format_bytes(amount)} on {device}: {leak.describe()} {held}"

    def close(self) -> None:
        """End an open scope now: clean up and measure, as leaving the ``with`` block does."""
        if self._active:
            self.__exit__(None, None, None)

    def _title(self) -> str:
        return f"memory_scope {self.name!r}" if self.name else "memory_scope"

    def to_dict(self) -> dict[str, Any]:
        """The results as a JSON-ready dict."""
        return {
            "name": self.name, "elapsed": self.elapsed, "peak": dict(self.peak),
            "retained": dict(self.retained), "freed": self.freed,
            "leaks": [leak.to_dict() for leak in self.leaks],
            "before": self.before.to_dict() if self.before else None,
            "after": self.after.to_dict() if self.after else None,
        }

    def __str__(self) -> str:
        if self.after is None:
            return f"{self._title()} ({'open' if self._active else 'not entered'})"
        parts = [f"{d} peak {format_bytes(self.peak.get(d))}, retained "
                 f"{format_bytes(self.retained.get(d, 0))}" for _, d in self._pairs]
        leak = f"; {self.biggest_leak()}" if self.leaks else ""
        return (f"{self._title()}: {'; '.join(parts) or 'no device'}; freed "
                f"{format_bytes(self.freed)} in {self.elapsed:.3f} s{leak}")

    def __repr__(self) -> str:
        return f"<MemoryScope {self}>"


@overload
def memory_scope(name: F) -> F: ...
@overload
def memory_scope(name: Optional[str] = None, *, devices: Devices = None,
                 cleanup: Union[bool, str] = True, max_leak: Optional[Size] = None,
                 track_tensors: bool = False) -> MemoryScope: ...


def memory_scope(name: Any = None, *, devices: Devices = None, cleanup: Union[bool, str] = True,
                 max_leak: Optional[Size] = None, track_tensors: bool = False) -> Any:
    """Measure a block's memory and clean up after it; a context manager and a decorator.

    On entry it snapshots every watched device (``devices``: a name, a list, or all active
    ones) and starts peak tracking; on exit it cleans up (``cleanup=True`` is the fast
    ``"auto"`` policy, ``"always"`` collects and empties every cache, ``False`` only measures)
    and fills ``before``, ``after``, ``peak``, ``retained`` and ``freed``. With ``max_leak``
    (bytes or a string such as ``"64MiB"``) it raises :class:`MemoryLeakError` when a device
    retained more, unless the block itself raised. With ``track_tensors=True`` it records the
    live tensors on entry and, after cleanup, lists in ``leaks`` the tensors created inside and
    still alive, largest first, each with its ``holders``; ``str(scope)`` and the leak error
    then name the biggest and who holds it.

    >>> import memguard
    >>> with memguard.memory_scope("load") as scope:
    ...     data = bytearray(50 * 2**20)
    >>> scope.retained["host"] > 40 * 2**20
    True
    >>> @memguard.memory_scope(max_leak="64MiB")
    ... def step():
    ...     return sum(range(1000))
    """
    options = dict(devices=devices, cleanup=cleanup, max_leak=max_leak,
                   track_tensors=track_tensors)
    if callable(name) and not isinstance(name, str):
        return MemoryScope(None, **options)(name)  # type: ignore[arg-type]
    if name is not None and not isinstance(name, str):
        raise TypeError(f"memory_scope: name must be a string, got {name!r}")
    return MemoryScope(name, **options)  # type: ignore[arg-type]


def _lower(a: Readings, b: Readings) -> Readings:
    """Per device and field, the lower of two readings (``b`` may lack devices)."""
    def low(x: Optional[int], y: Optional[int]) -> Optional[int]:
        return x if y is None else (y if x is None else min(x, y))

    return {d: (low(r[0], b[d][0]), low(r[1], b[d][1])) if d in b else r for d, r in a.items()}


class _FreesMemory:
    """What the calls of one ``@frees_memory`` function share: the cleanup policy (with its
    back-off), the level the last cleanup left (``baseline``) and the count of outermost calls.

    Each call keeps its own entry readings (:class:`_Call`), so calls that overlap (threads,
    asyncio tasks, generators) never measure against one another's entry. The policy compares
    the memory after a call with the lower of its entry level and the baseline: a step whose
    inputs were allocated before the call and end up in a reference cycle made by it leaves no
    growth over its own entry, yet is caught. ``max_leak`` counts only what the call itself
    kept over its entry.
    """

    def __init__(self, what: str, every: int, policy: Policy, max_leak: Optional[int],
                 recursion: bool) -> None:
        self.what = what
        self.every = every
        self.max_leak = max_leak
        self.settler = Settler(policy, adaptive=True)
        self.lock = ForkSafeLock()
        self.calls = 0
        self.baseline: Readings = {}
        # Calls of this function running in the current thread or asyncio task: a recursive
        # call sees the outer one's and leaves the cleanup to it. Generators do not count:
        # their bodies run in whichever context steps them and may stay suspended for ever.
        self.depth: Optional[ContextVar[int]] = (
            ContextVar(f"frees_memory {what}", default=0) if recursion else None)

    def call(self) -> "_Call":
        """The context manager of one call."""
        return _Call(self)


class _Call:
    """One call of a ``@frees_memory`` function: its depth and its own entry readings."""

    __slots__ = ("shared", "depth", "pairs", "entry")

    def __init__(self, shared: _FreesMemory) -> None:
        self.shared = shared
        self.depth = 0
        self.pairs: Pairs = []
        self.entry: Readings = {}

    def __enter__(self) -> None:
        counter = self.shared.depth
        if counter is not None:
            self.depth = counter.get()
            counter.set(self.depth + 1)
        if self.depth == 0:
            from .backends import resolve_devices

            self.pairs = resolve_devices(None)
            self.entry = read_all(self.pairs)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        shared = self.shared
        if shared.depth is not None:
            shared.depth.set(self.depth)
        if self.depth > 0:
            return
        with shared.lock:
            shared.calls += 1
            if shared.calls % shared.every:
                return
            try:
                outcome = shared.settler.settle(self.pairs, _lower(self.entry, shared.baseline))
            except Exception:  # noqa: BLE001
                if exc_type is None:
                    raise
                log.exception("cleanup after %s failed while it raised", shared.what)
                return
            shared.baseline = outcome.after
        if shared.max_leak is None:
            return
        over = {}
        for backend, device in self.pairs:
            start = _level(backend, self.entry.get(device, (None, None)))
            end = _level(backend, outcome.after.get(device, (None, None)))
            if start is not None and end is not None and end - start > shared.max_leak:
                over[device] = end - start
        if over:
            message = _leak_message(shared.what, over, shared.max_leak)
            if exc_type is None:
                raise MemoryLeakError(message, over, shared.max_leak)
            log.warning("%s (not raised: it raised %s)", message, exc_type.__name__)


def frees_memory(func: Optional[F] = None, /, *, every: int = 1, policy: Policy = "auto",
                 max_leak: Optional[Size] = None) -> Any:
    """Clean up after every call (or every ``every``-th call) of the decorated function.

    Works as ``@frees_memory`` and ``@frees_memory(...)`` on functions, methods,
    classmethods, staticmethods, ``async def`` functions (cleanup after the await) and
    generator functions (cleanup when the generator finishes or is closed). Cleanup runs
    whether the call returned or raised. ``policy="auto"`` reads memory first (microseconds) and
    collects garbage or empties caches only when the call left memory above its entry level,
    backing off from work that keeps proving useless; ``"always"`` collects and empties every
    cache every time. ``max_leak`` raises :class:`MemoryLeakError` when a device kept more
    over the call's own run (with ``every > 1``, checked on the calls that clean up).

    Each call keeps its own entry readings: calls that overlap (threads, asyncio tasks,
    interleaved generators, a generator closed on another thread) each clean up after
    themselves and are judged against their own entry, never another call's. Memory is per
    process, so a call is charged with what others allocated *during* its run and still hold.
    Recursive calls (in one thread or task) clean up once, when the outermost returns; each
    generator cleans up when it finishes or is closed, wherever that happens.

    >>> import memguard
    >>> @memguard.frees_memory
    ... def train_step(batch):
    ...     return sum(batch)
    >>> train_step([1, 2, 3])
    6
    """
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"frees_memory: every must be a positive int, got {every!r}")
    if policy not in POLICIES:
        raise ValueError(f"frees_memory: policy must be 'auto' or 'always', got {policy!r}")
    limit = parse_optional_size(max_leak, "max_leak")

    def decorate(f: F) -> F:
        shared = _FreesMemory(name_of(f), every, policy, limit,
                              recursion=function_kind(f) != "generator")
        return guard(f, shared.call, "frees_memory")

    return decorate if func is None else decorate(func)
