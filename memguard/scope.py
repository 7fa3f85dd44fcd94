"""``memory_scope``: measure a block (peaks, what it kept), clean up after it, report; and the
leak verdicts and messages that ``frees_memory`` shares.

Peaks of scopes that are open at the same time (nested, or in several threads) are kept by one
book per process: before a scope resets a device's peak counter, the counter's value is folded
into the running peak of every scope already open on that device, so no scope loses the peak
that happened before a newer one reset the counter.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any, Callable, Optional, TypeVar, Union, overload

from ._checks import flag
from ._decorate import guard, name_of
from ._events import LISTENERS, emit
from ._locks import ForkSafeLock
from ._units import Size, format_bytes, parse_optional_size
from .backends import UNKNOWN, Backend, Devices, Reading, check_devices, resolve_devices
from .backends.base import safely
from .census import TensorInfo, created_since, live_tensors, tensor_ids
from .cleanup import (
    Cleanup,
    Pairs,
    Readings,
    Settler,
    beyond_tolerance,
    cleanup_mode,
    collect_until_clean,
    interrupts_after,
    read_all,
    settler_for,
)
from .errors import MemoryLeakError
from .holders import describe_leaks
from .snapshot import MemorySnapshot, measured

log = logging.getLogger("memguard")
F = TypeVar("F", bound=Callable[..., Any])


class _PeakBook:
    """Running peaks of the scopes open on each device."""

    def __init__(self) -> None:
        self._lock = ForkSafeLock()
        self._open: dict[str, dict[int, int]] = {}

    def enter(self, token: int, pairs: Pairs,
              counters: Optional[dict[str, Optional[int]]] = None) -> None:
        """Open ``token``'s running peaks; ``counters`` (where given) receives each device's
        peak counter as read before its reset."""
        self.visit(token, pairs, counters, True)

    def exit(self, token: int, pairs: Pairs,
             counters: Optional[dict[str, Optional[int]]] = None) -> dict[str, Optional[int]]:
        """Close ``token``'s running peaks: each device's peak over the scope; ``counters``
        (where given) receives each device's peak counter as read."""
        return self.visit(token, pairs, counters, False)

    def visit(self, token: int, pairs: Pairs, counters: Optional[dict[str, Optional[int]]],
              opening: bool) -> dict[str, Optional[int]]:
        """:meth:`enter` (``opening``) or :meth:`exit`, each device's counter read once."""
        peaks: dict[str, Optional[int]] = {}
        # no collection while locked: a finaliser it runs could open a scope in this thread
        # and wait for ever on the lock (no_collection(), inline: a scope's every call)
        collecting = gc.isenabled()
        try:
            gc.disable()
            with self._lock:
                for backend, device in pairs:
                    if opening:
                        running = self._open.setdefault(device, {})
                        if running:  # the counter folded into the scopes open before the
                            # reset: a Ctrl-C raised between the two must not lose their peaks
                            counter = safely(backend.read_peak, device)
                            if counter is not None:
                                for other, older in running.items():
                                    running[other] = max(older, counter)
                            safely(backend.reset_peak, device)
                            start = safely(backend.peak_after_reset, device)
                        else:  # none open: read, reset and read again in one call
                            counter, start = backend.swap_peak(device)
                        running[token] = -1 if start is None else start
                    else:
                        running = self._open.get(device, {})
                        value = running.pop(token, -1)
                        if not running:
                            self._open.pop(device, None)
                        counter = safely(backend.read_peak, device)
                        best = max(value, -1 if counter is None else counter)
                        peaks[device] = None if best < 0 else best
                    if counters is not None:
                        counters[device] = counter
        finally:
            if collecting:
                gc.enable()
        return peaks


#: The settler of each ``cleanup`` mode a scope applies (``None``: only measure). Shared: a
#: settler that does not adapt keeps no state between blocks.
_SETTLERS: dict[str, Optional[Settler]] = {
    mode: settler_for(mode) for mode in ("auto", "always", "never")}

#: The process's one book of peaks: every scope, and each measured trial of
#: ``find_batch_size(mode="predict")``, enters and leaves it.
peak_book = _PeakBook()


def in_use(backend: Backend, reading: Optional[Reading]) -> Optional[int]:
    return None if reading is None else backend.in_use(reading)


def growth(before: Optional[int], after: Optional[int]) -> Optional[int]:
    return None if before is None or after is None else after - before


def _reserved_words(device: str) -> str:
    return "resident set" if device == "host" else "reserved"


def leak_message(what: str, retained: dict[str, int], limit: int,
                 reserved: Optional[dict[str, Optional[int]]] = None) -> str:
    worst = []
    for device, n in retained.items():
        change = (reserved or {}).get(device)
        beside = ("" if change is None else
                  f" ({_reserved_words(device)} {format_bytes(change, signed=True)})")
        worst.append(f"{format_bytes(n)} on {device}{beside}")
    return (f"{what} retained {', '.join(worst)} after cleanup, above "
            f"max_leak={format_bytes(limit)}; something still references memory the block "
            f"allocated")


#: The smallest growth a ``max_leak`` verdict takes from the allocators' figures alone. Below
#: it, a block that keeps nothing still moves them (a few hundred bytes of the interpreter's
#: and the allocator's own bookkeeping, measured on glibc; 5 KiB on a process's first
#: snapshot): a device that retained more than a smaller ``max_leak`` but at most this is
#: judged by the census instead, on the bytes of the tensors created in the block and still
#: alive there.
MIN_LEAK = 64 << 10


def _tensor_bytes(leaks: list[TensorInfo]) -> dict[str, int]:
    """Bytes of ``leaks`` per device (a CPU tensor's device is the host)."""
    out: dict[str, int] = {}
    for info in leaks:
        device = "host" if info.device == "cpu" else info.device
        out[device] = out.get(device, 0) + info.nbytes
    return out


def census_needed(limit: Optional[int]) -> bool:
    """Whether a verdict under ``limit`` may rest on the census (a limit below MIN_LEAK)."""
    return limit is not None and limit < MIN_LEAK


def beyond(kept: dict[str, int], limit: int,
           created: Callable[[], list[TensorInfo]]) -> dict[str, int]:
    """The devices that kept more than ``limit``: on the allocators' figures where they
    can tell (the limit or the growth at least ``MIN_LEAK``), else on the bytes of the
    tensors ``created()`` lists (called only then)."""
    over = {d: n for d, n in kept.items() if n > limit}
    unsure = [d for d, n in over.items() if n <= MIN_LEAK] if limit < MIN_LEAK else []
    if unsure:
        found = _tensor_bytes(created())
        for device in unsure:
            if found.get(device, 0) <= limit:
                log.debug("%s grew by %d bytes with max_leak=%d, under the %s the "
                          "allocators' figures can tell; no tensor created there is alive: "
                          "not a leak", device, over[device], limit, format_bytes(MIN_LEAK))
                del over[device]
    return over


def census_alone_passes(over: dict[str, int], limit: int,
                        take: Callable[[], list[TensorInfo]]) -> Optional[list[TensorInfo]]:
    """The census ``take()`` returns, where it alone decides the verdict on ``over`` (every
    device under ``MIN_LEAK``) and passes it (no tensor made since is alive there beyond
    ``limit``); else None. A full collection frees, never adds: it could only confirm such a
    pass, and with torch imported it walks every object (0.3-0.5 s on a 2-core machine), once
    per test under the pytest plugin's ``max_leak=0``."""
    if not census_needed(limit) or any(n > MIN_LEAK for n in over.values()):
        return None
    census = take()
    found = _tensor_bytes(census)
    return None if any(found.get(d, 0) > limit for d in over) else census


def leak_error(message: str, over: dict[str, int], limit: int,
               leaks: list[TensorInfo]) -> MemoryLeakError:
    error = MemoryLeakError(message, over, limit)
    error.leaks = leaks  # type: ignore[attr-defined]
    return error


class MemoryScope:
    """A measured block: what it used at its peak, what it left behind, what cleanup freed.

    Create it with :func:`memory_scope`. After the block: ``before`` / ``after``
    (:class:`MemorySnapshot` of what the scope reads: each device's allocated, reserved and
    peak), ``peak`` and ``retained`` (device -> bytes), ``reserved_growth``
    (device -> signed bytes), ``freed`` (bytes released by the exit cleanup), ``elapsed``
    (seconds). ``retained`` is on what the allocators hand out (``allocated``: glibc's in-use
    bytes on the host, mmapped blocks included), so neither an untrimmed heap nor allocator
    churn moves it; ``reserved_growth`` is the change of ``reserved`` beside it (the resident
    set on the host, the allocator's cache on a GPU). On the host ``peak`` is the resident
    set's high-water mark. A closed (or unused) scope pickles and deep-copies with its
    results; an open one raises ``TypeError``.

    Attributes:
        name: the scope's label, or ``None``.
        peak: device -> the highest allocation seen during the scope, in bytes.
        retained: device -> the bytes still handed out after cleanup, over the entry level.
        reserved_growth: device -> the change of ``reserved``, in signed bytes.
        freed: the bytes the exit cleanup released.
        elapsed: the block's duration, in seconds.
        leaks: with ``track_tensors=True``, the :class:`TensorInfo` of the tensors created
            inside and still alive, largest first.

    >>> import memguard
    >>> scope = memguard.memory_scope("epoch", cleanup="never")
    >>> with scope:
    ...     block = bytearray(8 * 2**20)
    >>> scope.retained["host"] >= 8 * 2**20, scope.freed
    (True, 0)
    """

    def __init__(self, name: Optional[str] = None, *, devices: Devices = None,
                 cleanup: Cleanup = "auto", max_leak: Optional[Size] = None,
                 track_tensors: bool = False) -> None:
        self.name = name
        # each value checked where it is not the default (a scope a call, next to the step)
        self.devices = None if devices is None else check_devices(devices)
        self.track_tensors = track_tensors if track_tensors is False else flag(
            track_tensors, "track_tensors", who="memory_scope")
        self.leaks: list[TensorInfo] = []
        self._tensors_before: dict[int, Any] = {}
        self.cleanup: Cleanup = "auto" if cleanup == "auto" and type(cleanup) is str \
            else cleanup_mode(cleanup, "memory_scope")
        self.max_leak = None if max_leak is None else parse_optional_size(
            max_leak, "memory_scope: max_leak")
        # the snapshots are made when first read, from what the scope took: (readings, peak
        # counters, time) under "before" and "after"
        self._taken: dict[str, tuple[Readings, dict[str, Optional[int]], float]] = {}
        self._snapshots: dict[str, MemorySnapshot] = {}
        self.peak: dict[str, Optional[int]] = {}
        self.retained: dict[str, int] = {}
        self.reserved_growth: dict[str, Optional[int]] = {}
        self.freed = 0
        self.elapsed: Optional[float] = None
        self._pairs: Pairs = []
        self._entry: Readings = {}
        self._census = False  # tensors recorded on entry: a census can tell what was created
        self._uncollected = False  # the verdict's collection could not run: no verdict
        self._start = 0.0
        self._active = False

    # -- context manager -----------------------------------------------------------------------
    def __enter__(self) -> "MemoryScope":
        if self._active:
            raise RuntimeError(f"{self._title()} is already open; use a new memory_scope() "
                               f"for each block (as a decorator it makes one per call)")
        self._pairs = resolve_devices(self.devices)
        self._active = True
        if self._taken or self._snapshots:  # entered again (a copy of a closed scope keeps
            # only its snapshots): the last block's results are not this one's
            self._taken, self._snapshots, self.leaks = {}, {}, []
            self.peak, self.retained, self.reserved_growth = {}, {}, {}
            self.freed, self.elapsed = 0, None
        self._census = self.track_tensors or census_needed(self.max_leak)
        self._uncollected = False
        if self._census:
            self._tensors_before = tensor_ids()
        when = time.time()
        counters: dict[str, Optional[int]] = {}
        peak_book.visit(id(self), self._pairs, counters, True)  # enter(), without its call
        if LISTENERS:
            emit(f"enter {self._title()}")
        # what the block keeps is measured from here, after the scope's own entry work; the
        # snapshot on entry is this reading and the peak counters the book read before its
        # reset (any other read costs microseconds a small step feels)
        self._entry = read_all(self._pairs)
        self._taken["before"] = (self._entry, counters, when)  # _took(), inline
        self._start = time.perf_counter()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            self._finish()
        except Exception:
            self._tensors_before = {}
            if exc_type is None:
                raise
            log.exception("measuring %s failed while the block raised", self._title())
            return
        try:
            if self.max_leak is not None:
                self._judge(exc_type)
        finally:
            self._tensors_before = {}

    def _judge(self, exc_type: Any) -> None:
        """Raise (or, when the block raised, log) the ``max_leak`` verdict."""
        if self.max_leak is not None and not self._uncollected:
            over = beyond(self.retained, self.max_leak, self._created)
            if over:
                message = leak_message(self._title(), over, self.max_leak,
                                       self.reserved_growth)
                if self.leaks:
                    message += "; " + self.biggest_leak()
                if exc_type is None:
                    raise leak_error(message, over, self.max_leak, self.leaks)
                log.warning("%s (not raised: the block raised %s)", message,
                            exc_type.__name__)

    def _finish(self) -> None:
        self.elapsed = time.perf_counter() - self._start
        self._active = False
        if LISTENERS:
            emit(f"exit {self._title()}")
        counters: dict[str, Optional[int]] = {}
        self.peak = peak_book.visit(id(self), self._pairs, counters, False)  # exit()
        entry = self._entry
        # a mode set on the attribute since is checked as the constructor checks it
        settler = _SETTLERS[self.cleanup] if self.cleanup in _SETTLERS else settler_for(
            cleanup_mode(self.cleanup, "memory_scope"))
        when = time.time()
        collected = False  # in full, finding no garbage, just before ``after``
        now = read_all(self._pairs)
        # the settler only where it acts ("always", or memory held or a cache swollen)
        if settler is not None and (settler.cleanup == "always"
                                    or any(beyond_tolerance(self._pairs, now, entry))):
            outcome = settler.settle(self._pairs, entry, now=now)
            collected, self.freed, now = outcome.full, outcome.freed, outcome.after
        self._taken["after"] = (now, counters, when)  # _took(), inline
        self._snapshots.pop("after", None)
        self._measure(entry)
        census: Optional[list[TensorInfo]] = None
        if self.max_leak is not None and any(n > self.max_leak for n in self.retained.values()):
            if self._census:
                over = {d: n for d, n in self.retained.items() if n > self.max_leak}
                census = census_alone_passes(over, self.max_leak, lambda: created_since(
                    self._tensors_before, live_tensors()))
            if census is None and not collected:
                # A verdict never rests on a collection the policy skipped ("never") or
                # found unneeded (growth under its tolerance, a young-generation pass):
                # collect in full before blaming the block.
                with interrupts_after():
                    self._uncollected = not collect_until_clean()
                self._took("after", read_all(self._pairs), counters, time.time())
                self._measure(entry)
                if self._uncollected:
                    log.warning("%s not judged for max_leak: no full collection could run "
                                "before the verdict (see the log line above)", self._title())
        if census is not None:
            self.leaks, self._census, self._tensors_before = census, False, {}
        elif self.track_tensors:
            self.leaks = created_since(self._tensors_before, live_tensors())
            self._tensors_before = {}
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s", self)

    def _created(self) -> list[TensorInfo]:
        """The tensors created in the block and still alive (the census a verdict under a
        ``max_leak`` below ``MIN_LEAK`` rests on), kept in ``leaks``."""
        if self._census:
            self._census = False
            if not self.track_tensors:  # with it, _finish took the census
                self.leaks = created_since(self._tensors_before, live_tensors())
        self._tensors_before = {}
        return self.leaks

    def _took(self, when: str, readings: Readings, counters: dict[str, Optional[int]],
              at: float) -> None:
        self._taken[when] = (readings, counters, at)
        self._snapshots.pop(when, None)

    def _snapshot(self, when: str) -> Optional[MemorySnapshot]:
        if when not in self._snapshots and when in self._taken:
            self._snapshots[when] = measured(self._pairs, *self._taken[when])
        return self._snapshots.get(when)

    @property
    def before(self) -> Optional[MemorySnapshot]:
        """The :class:`MemorySnapshot` taken on entry (``None`` before it): each device's
        ``allocated``, ``reserved`` and peak counter; ``free``, ``total`` and budgets, the
        machine's, are :func:`memguard.snapshot`'s to read."""
        return self._snapshot("before")

    @property
    def after(self) -> Optional[MemorySnapshot]:
        """The :class:`MemorySnapshot` taken after the exit cleanup (``None`` before it), as
        :attr:`before`."""
        return self._snapshot("after")

    def _measure(self, entry: Readings) -> None:
        readings = self._taken["after"][0]
        peak = self.peak
        for backend, device in self._pairs:
            before, after = entry[device], readings.get(device, UNKNOWN)
            # in_use() and growth(), inline: a scope's every exit
            start = before.reserved if before.allocated is None else before.allocated
            end = after.reserved if after.allocated is None else after.allocated
            self.retained[device] = 0 if start is None or end is None else max(0, end - start)
            self.reserved_growth[device] = None if before.reserved is None \
                or after.reserved is None else after.reserved - before.reserved
            # a peak is at least every level the scope read (the kernel's own mark, reset to
            # an approximate sum of the resident set, can be some 100 kB under it)
            field = backend.level_field
            high, low, now = peak.get(device), getattr(before, field), getattr(after, field)
            if high is not None:
                if low is not None and low > high:
                    high = low
                if now is not None and now > high:
                    high = now
                peak[device] = high
            elif low is not None and now is not None:
                peak[device] = max(low, now)

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
        CACHE[0] (40.0 MiB)``: the tensors created in the scope and still alive, grouped by
        what keeps them, largest first (``track_tensors=True``; empty without leaks). A graph
        is named once, by the tensor that owns it, with all it keeps: ``float32[1024, 4096]
        and 5 more saved by the graph of float32[] held by module __main__, global
        losses[2] (21.0 MiB)``."""
        return leak_line(self.leaks, self.retained)

    def close(self, *, cleanup: Optional[Cleanup] = None, judge: bool = True) -> None:
        """End an open scope now: clean up and measure, as leaving the ``with`` block does.

        ``cleanup`` overrides the scope's own for this exit: ``"never"`` only measures (for a
        scope closed inside an ``except``, where the traceback still holds what a collection
        would have to free); ``judge=False`` skips the ``max_leak`` verdict (a run that
        failed is not judged).

        Args:
            cleanup: ``"auto"``, ``"always"`` or ``"never"`` for this exit. Default ``None``:
                the scope's own.
            judge: apply the ``max_leak`` verdict. Default ``True``.

        >>> import memguard
        >>> scope = memguard.memory_scope("step", max_leak="1GiB").__enter__()
        >>> scope.close(cleanup="never", judge=False)
        >>> scope.freed
        0
        """
        if not self._active:
            return
        if cleanup is not None:
            self.cleanup = cleanup_mode(cleanup, "MemoryScope.close")
        if not judge:
            self.max_leak = None
        self.__exit__(None, None, None)

    def _title(self) -> str:
        return f"memory_scope {self.name!r}" if self.name else "memory_scope"

    def to_dict(self) -> dict[str, Any]:
        """The results as a JSON-ready dict."""
        return {
            "name": self.name, "elapsed": self.elapsed, "peak": dict(self.peak),
            "retained": dict(self.retained), "reserved_growth": dict(self.reserved_growth),
            "freed": self.freed,
            "leaks": [leak.to_dict() for leak in self.leaks],
            "before": self.before.to_dict() if self.before else None,
            "after": self.after.to_dict() if self.after else None,
        }

    def __str__(self) -> str:
        if self.after is None:
            return f"{self._title()} ({'open' if self._active else 'not entered'})"
        parts = []
        # The devices measured, in order: from the backends here, from the results in a copy.
        for d in [d for _, d in self._pairs] or list(self.retained):
            change = self.reserved_growth.get(d)
            beside = ("" if change is None else
                      f" ({_reserved_words(d)} {format_bytes(change, signed=True)})")
            parts.append(f"{d} peak {format_bytes(self.peak.get(d))}, retained "
                         f"{format_bytes(self.retained.get(d, 0))}{beside}")
        leak = f"; {self.biggest_leak()}" if self.leaks else ""
        return (f"{self._title()}: {'; '.join(parts) or 'no device'}; freed "
                f"{format_bytes(self.freed)} in {self.elapsed:.3f} s{leak}")

    def __repr__(self) -> str:
        return f"<MemoryScope {self}>"

    # -- pickling ------------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        """The results and options, without the backends (this process's readers): a closed
        or unused scope pickles and deep-copies; an open one is refused."""
        if self._active:
            raise TypeError(f"{self._title()} is open: a scope cannot be pickled or copied "
                            f"while it measures; close it first (leave its with block, or "
                            f"call close())")
        return dict(self.__dict__, _pairs=[], _tensors_before={}, _taken={},
                    _snapshots={w: s for w in ("before", "after")
                                 if (s := self._snapshot(w)) is not None})


@overload
def memory_scope(name: F) -> F: ...
@overload
def memory_scope(name: Optional[str] = None, *, devices: Devices = None,
                 cleanup: Cleanup = "auto", max_leak: Optional[Size] = None,
                 track_tensors: bool = False) -> MemoryScope: ...


def memory_scope(name: Union[str, F, None] = None, *, devices: Devices = None,
                 cleanup: Cleanup = "auto", max_leak: Optional[Size] = None,
                 track_tensors: bool = False) -> Union[MemoryScope, F]:
    """Measure a block's memory and clean up after it; a context manager and a decorator.

    On entry it snapshots every watched device (``devices``: a name, a list, or all active
    ones) and starts peak tracking; on exit it cleans up (``cleanup="auto"``, the default, reads
    first and collects or empties caches only where memory is still held, ``"always"`` collects
    and empties every cache, ``"never"`` only measures)
    and fills ``before``, ``after``, ``peak``, ``retained``, ``reserved_growth`` and ``freed``.
    ``retained`` is on what the allocators hand out (glibc's in-use bytes on the host, mmapped
    blocks included; ``allocated`` on GPUs), never on the resident set, which
    ``reserved_growth`` reports beside it. With ``max_leak`` (bytes or a string such as
    ``"64MiB"``) it raises :class:`MemoryLeakError` when a device retained more (after a full
    collection, whatever the policy), unless the block itself raised; under a ``max_leak``
    below ``MIN_LEAK`` (64 KiB) a growth of at most 64 KiB, where a block that keeps
    nothing still moves the allocators' figures, is judged by the tensors created in the
    block and still alive (a census on entry and exit). With
    ``track_tensors=True`` it records the live tensors on entry and, after cleanup, lists in
    ``leaks`` the tensors created inside and still alive, largest first, each with its
    ``holders`` and ``held_by``; ``str(scope)`` and the leak error (``.leaks`` too) then say
    what keeps them, a graph kept by a ``loss`` named once by the loss's holder.

    Args:
        name: a label for the scope, in its summary, its log line and a monitor's marks. Given
            a function (bare ``@memory_scope``), the scope decorates it.
            Default ``None``: unnamed.
        devices: the device name or names to watch (``"host"``, ``"cuda:0"``, ...); ``None``
            for every active device.
        cleanup: ``"auto"``, ``"always"`` or ``"never"``: what to do on exit (see above).
        max_leak: the most a device may retain, in bytes or a size such as ``"64MiB"``;
            ``None`` judges nothing.
        track_tensors: record the live tensors on entry and list in ``leaks`` those created
            inside and still alive, with their holders. Default ``False``.

    Returns:
        A :class:`MemoryScope`: a context manager whose figures are filled on exit, and a
        decorator that opens a new scope per call.

    Raises:
        MemoryLeakError: on exit, when a device retained more than ``max_leak`` and the block
            itself raised nothing (then a warning is logged instead).
        ValueError: a bad ``cleanup``, ``max_leak`` or device name, named with its value.
        TypeError: ``devices`` that is neither a name nor a list of names.

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


def leak_line(leaks: list[TensorInfo], retained: dict[str, int]) -> str:
    """``retained 40.0 MiB on host: <what keeps it>; ...``, or ``""`` without leaks."""
    if not leaks:
        return ""
    device = "host" if leaks[0].device == "cpu" else leaks[0].device
    amount = retained.get(device, leaks[0].nbytes)
    return f"retained {format_bytes(amount)} on {device}: " + "; ".join(describe_leaks(leaks))
