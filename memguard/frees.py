"""``frees_memory``: clean up after every call of a function (sync, async, generator), each
call judged against its own entry readings for what it kept.
"""

from __future__ import annotations

import functools
import logging
from contextvars import ContextVar
from time import perf_counter, thread_time
from typing import Any, Callable, Optional, TypeVar, Union, overload

from ._checks import flag, positive_int
from ._decorate import function_kind, guard, name_of
from ._locks import ForkSafeLock
from ._units import Size, parse_optional_size
from .backends import UNKNOWN, Reading, host, resolve_devices
from .census import TensorInfo, created_since, live_tensors, tensor_ids
from .cleanup import (
    MAX_GAP,
    Cleanup,
    Pairs,
    Readings,
    cleanup_mode,
    collect_until_clean,
    interrupts_after,
    on_full_collection,
    read_all,
    settler_for,
)
from .scope import (
    beyond,
    census_alone_passes,
    census_needed,
    growth,
    in_use,
    leak_error,
    leak_line,
    leak_message,
)

log = logging.getLogger("memguard")
F = TypeVar("F", bound=Callable[..., Any])

CHECK_SHARE = 0.004
"""The most of a process's time that ``cleanup="auto"``'s readings for one ``@frees_memory``
function may take where no verdict rests on them (no ``max_leak``, no ``track_tensors``):
memory is read around a call once ``1 / CHECK_SHARE`` times as long as the previous reading
took has passed since it (each reading times itself; never more than ``MAX_GAP`` seconds
apart). Time, not calls: memory a call leaves was allocated by it or before it, and
allocating takes time (filling 40 MiB, milliseconds; a reading, microseconds). So a call that
comes that long after a reading is read at both ends, one that ends that long after it at its
exit; of a run of short calls, every few. Next to a step of 0.5 ms, reading memory at both
ends of every call took 3.5-6% of it in the reads alone."""

CALL_SHARE = 0.03
"""Of ``frees_memory``'s paced readings (``CHECK_SHARE``): a call whose own run took
``1 / CALL_SHARE`` times a reading or longer is read at its exit whenever it ends. Such a
call had the time to allocate more than the host's 4 MiB tolerance (0.6-1 ms here, filling
memory at several GB/s), so what it leaves in cycles never waits for a later call; a shorter
call can leave about the tolerance, which a cleanup that read every call did not collect
either."""

_collections = [0]  # full collections memguard has run: a level read before one is stale


def _collected() -> None:
    _collections[0] += 1


on_full_collection.append(_collected)


def _lower(a: Readings, b: Readings) -> Readings:
    """Per device and field, the lower of two readings (``b`` may lack devices)."""
    out = {}
    for device, reading in a.items():  # a loop, not a comprehension: one call less a step
        other = b.get(device)
        out[device] = reading if other is None else reading.lower(other)
    return out


def _held_lower(after: Readings, reference: Readings) -> Readings:
    """``after`` with each device's ``allocated`` the lower of it and ``reference``'s: the
    level a cleanup that did nothing leaves (the cache, ``reserved``, as read: one that
    grew by use is left to the next call)."""
    out = {}
    for device, reading in after.items():
        other = reference.get(device)
        if other is not None and other.allocated is not None and (
                reading.allocated is None or other.allocated < reading.allocated):
            reading = Reading(other.allocated, reading.reserved)
        out[device] = reading
    return out


def _per_call(pairs: Pairs, recent: Readings, unread: int) -> Readings:
    """``recent`` with each device's ``allocated`` raised by its tolerance for each of the
    ``unread`` calls since: memory held over it is more than a call at a time left, read at
    every call (the growth a full collection is run for; less is looked for in the young
    generations only)."""
    if not unread:
        return recent
    out = dict(recent)
    for backend, device in pairs:
        reading = recent.get(device)
        if reading is not None and reading.allocated is not None:
            out[device] = Reading(reading.allocated + unread * backend.hold_tolerance,
                                  reading.reserved)
    return out


class _FreesMemory:
    """What the calls of one ``@frees_memory`` function share: the cleanup policy (with its
    back-off), the level the last cleanup left (``baseline``) and the count of outermost calls.

    Each call keeps its own entry readings (:class:`_Call`), so calls that overlap (threads,
    asyncio tasks, generators) never measure against one another's entry. The policy compares
    the memory after a call with the lower of its entry level and the baseline: a step whose
    inputs were allocated before the call and end up in a reference cycle made by it leaves no
    growth over its own entry, yet is caught. ``max_leak`` counts only what the call itself
    kept over its entry, on the allocators' in-use figure; the first ``warmup`` calls are not
    judged.
    """

    def __init__(self, what: str, every: int, cleanup: Cleanup, max_leak: Optional[int],
                 recursion: bool, warmup: int = 0, track_tensors: bool = False) -> None:
        self.what = what
        self.every = every
        self.max_leak = max_leak
        self.warmup = warmup
        self.track_tensors = track_tensors
        self.settler = settler_for(cleanup, adaptive=True)
        # "auto" with no verdict reads on a share of the calls' time (CHECK_SHARE)
        self.paced = cleanup == "auto" and max_leak is None and not track_tensors
        self.last = 0.0  # perf_counter() after the last reading
        self.due = 0.0  # seconds after it at which the next is due: 0, at once
        self.long = 0.0  # seconds from which a call's own run is read at its exit
        self.read_at = -1  # _collections[0] at the last reading
        self.recent: Readings = {}  # the last reading, where baseline was kept lower
        self.unread = 0  # calls that ended unread since it
        # reentrant: a finaliser that the cleanup's collection runs may call the function
        self.lock = ForkSafeLock(reentrant=True)
        self.calls = 0
        self.baseline: Readings = {}
        self.baseline_kind = "in use"  # what the baseline's readings are (read_all's kind)
        # Calls of this function running in the current thread or asyncio task: a recursive
        # call sees the outer one's and leaves the cleanup to it. Generators do not count:
        # their bodies run in whichever context steps them and may stay suspended for ever.
        self.depth: Optional[ContextVar[int]] = (
            ContextVar(f"frees_memory {what}", default=0) if recursion else None)


class _Call:
    """One call of a ``@frees_memory`` function: its depth and its own entry readings."""

    __slots__ = ("shared", "depth", "pairs", "entry", "tensors", "census", "kind", "start")

    def __init__(self, shared: _FreesMemory) -> None:
        self.shared = shared
        self.depth = 0
        # None: not read on entry (a paced call not due then); the rest is set where read
        self.entry: Optional[Readings] = None

    def __enter__(self) -> None:
        shared = self.shared
        counter = shared.depth
        if counter is not None:
            self.depth = counter.get()
            counter.set(self.depth + 1)
        if self.depth == 0:
            if shared.paced:
                self.start = now = perf_counter()
                if now - shared.last < shared.due and shared.read_at == _collections[0]:
                    return  # not due on entry: the exit compares with the baseline
            self.pairs: Pairs = resolve_devices(None)
            self.census = shared.track_tensors or census_needed(shared.max_leak)
            self.tensors: dict[int, Any] = tensor_ids() if self.census else {}
            # the readings' kind: where no verdict rests on them, the cheap one (the resident
            # set where mallinfo2 is slow)
            self.kind = "in use" if shared.max_leak is not None or shared.track_tensors \
                else host.quick_kind()
            self.entry = read_all(self.pairs, self.kind)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        shared = self.shared
        if shared.depth is not None:
            shared.depth.set(self.depth)
        if self.depth > 0:
            return
        if self.entry is None and shared.every == 1:
            now = perf_counter()
            if now - shared.last < shared.due and now - self.start < shared.long:
                shared.unread += 1
                return  # paced, and not due (with every=1 no count matters: no verdict)
        with shared.lock:
            shared.calls += 1
            judged = shared.calls > shared.warmup
            if shared.calls % shared.every:
                return
            cpu = 0.0
            if shared.paced:
                if self.entry is None:
                    now = perf_counter()
                    if now - shared.last < shared.due and now - self.start < shared.long:
                        shared.unread += 1
                        return
                    # read at the exit alone: of the baseline's kind, its one reference
                    # (a switch to the resident set on a slow heap waits for an entry)
                    self.pairs = resolve_devices(None)
                    self.kind = shared.baseline_kind if shared.baseline else host.quick_kind()
                # the reading's cost in this thread's CPU time: waiting for the interpreter
                # lock or the CPU, which a busy thread beside it makes milliseconds, is not
                # the reading's, and would space the readings out 250 times that
                cpu = thread_time()
            try:
                baseline = shared.baseline if shared.baseline_kind == self.kind else {}
                collected = False  # in full, finding no garbage, just before ``after``
                level = after = read_all(self.pairs, self.kind) if shared.settler is None \
                    else {}  # cleanup="never": measure only
                if shared.settler is not None:
                    reference = baseline if self.entry is None else _lower(self.entry,
                                                                           baseline)
                    recent = _per_call(self.pairs, shared.recent, shared.unread) \
                        if shared.baseline_kind == self.kind else {}
                    shared.unread = 0
                    outcome = shared.settler.settle(self.pairs, reference, self.kind,
                                                    recent or None)
                    after, collected = outcome.after, outcome.full
                    # Where it did nothing (every device within its tolerance of the
                    # reference) the level stays the lower of the two: calls that each leave
                    # less than the tolerance in cycles must not raise it, or their sum is
                    # never collected. After a cleanup, what it could not free is in use.
                    level = _held_lower(after, reference) if outcome.idle else after
                    shared.recent = after
                    if shared.paced:
                        shared.last, shared.read_at = perf_counter(), _collections[0]
                        if outcome.idle:
                            took = thread_time() - cpu
                            shared.due = min(took / CHECK_SHARE, MAX_GAP)
                            shared.long = min(took / CALL_SHARE, MAX_GAP)
                        else:  # a cleanup that acted: read the next call at once
                            shared.due = shared.long = 0.0
            except Exception:
                if exc_type is None:
                    raise
                log.exception("cleanup after %s failed while it raised", shared.what)
                return
            shared.baseline, shared.baseline_kind = level, self.kind
        if not judged or (shared.max_leak is None and not shared.track_tensors):
            return
        limit = shared.max_leak
        over = self._over(after, limit)
        leaks: list[TensorInfo] = []
        if over and limit is not None:
            passed = census_alone_passes(over, limit, lambda: created_since(
                self.tensors, live_tensors())) if self.census else None
            if passed is not None:
                self.census = False
                leaks.extend(passed)
            elif not collected:
                # The verdict never rests on a cleanup the policy skipped or cut short (a
                # backed-off or young-generation collection): before blaming the call,
                # collect in full.
                with interrupts_after():
                    collected = collect_until_clean()
                with shared.lock:
                    shared.baseline = after = read_all(self.pairs)
                if not collected:
                    log.warning("%s not judged for max_leak: no full collection could run "
                                "before the verdict (see the log line above)", shared.what)
                    self.tensors = {}
                    return
                over = self._over(after, limit)

        def created() -> list[TensorInfo]:
            if self.census:
                self.census = False
                leaks.extend(created_since(self.tensors, live_tensors()))
            return leaks

        if over and limit is not None:
            over = beyond(over, limit, created)
        if shared.track_tensors and (over or limit is None):
            created()
            if limit is None and leaks:
                log.debug("%s kept %s", shared.what, leak_line(leaks, {}))
        self.tensors = {}
        if over and limit is not None:
            message = leak_message(shared.what, over, limit, {
                d: growth((self.entry or {}).get(d, UNKNOWN).reserved,
                          after.get(d, UNKNOWN).reserved)
                for d in over})
            if leaks:
                message += "; " + leak_line(leaks, over)
            if exc_type is None:
                raise leak_error(message, over, limit, leaks)
            log.warning("%s (not raised: it raised %s)", message, exc_type.__name__)

    def _over(self, after: Readings, limit: Optional[int]) -> dict[str, int]:
        """The devices whose in-use bytes grew by more than ``limit`` since the call's entry."""
        over: dict[str, int] = {}
        if limit is None:
            return over
        for backend, device in self.pairs:
            kept = growth(in_use(backend, (self.entry or {}).get(device)),
                          in_use(backend, after.get(device)))
            if kept is not None and kept > limit:
                over[device] = kept
        return over


@overload
def frees_memory(func: F, /) -> F: ...
@overload
def frees_memory(func: None = None, /, *, every: int = 1, cleanup: Cleanup = "auto",
                 max_leak: Optional[Size] = None, warmup: int = 1,
                 track_tensors: bool = False) -> Callable[[F], F]: ...


def frees_memory(func: Optional[F] = None, /, *, every: int = 1, cleanup: Cleanup = "auto",
                 max_leak: Optional[Size] = None, warmup: int = 1,
                 track_tensors: bool = False) -> Union[F, Callable[[F], F]]:
    """Clean up after every call (or every ``every``-th call) of the decorated function.

    Works as ``@frees_memory`` and ``@frees_memory(...)`` on functions, methods,
    classmethods, staticmethods, ``async def`` functions (cleanup after the await) and
    generator functions (cleanup when the generator finishes or is closed). Cleanup runs
    whether the call returned or raised. ``cleanup="auto"`` reads memory first (microseconds)
    and collects garbage or empties caches only when memory is above the level the previous
    cleanup left (or the call's entry, where read), backing off from work that keeps proving
    useless; without ``max_leak`` or ``track_tensors`` it reads on a share of the time
    (``memguard.frees.CHECK_SHARE``, 0.4%): a call that comes long after the previous
    reading is read at both ends, one that runs long enough to allocate more than the
    tolerance at its exit, and of back-to-back short calls every few, so what they leave in
    cycles waits for the next reading, milliseconds later. ``"always"`` collects and empties
    every cache every time; ``"never"`` only measures (for ``max_leak`` or ``track_tensors``
    alone).
    ``max_leak`` raises
    :class:`MemoryLeakError` when a device kept more over the call's own run (with
    ``every > 1``, checked on the calls that clean up), on what the allocators hand out
    (``allocated``; glibc's in-use bytes on the host), never on the resident set; before
    raising it collects in full, so a collection the policy skipped never decides a verdict;
    a ``max_leak`` below ``MIN_LEAK`` is judged as ``memory_scope`` judges it.
    The first ``warmup`` calls (default 1) clean up but are not judged: a training step's
    first call creates what every later one reuses (optimizer moments,
    autograd's and the kernels' one-time state); ``warmup=0`` judges from the first call.
    ``track_tensors=True`` records the live tensors at each call's entry and, for a call that
    kept too much, names the tensors it created and left alive, grouped by what keeps them
    (a graph kept by a ``loss`` named once, by its holder), in the error (and its ``leaks``);
    without ``max_leak`` it logs them at DEBUG. It costs a census of the live tensors per call.

    Each call keeps its own entry readings: calls that overlap (threads, asyncio tasks,
    interleaved generators, a generator closed on another thread) each clean up after
    themselves and are judged against their own entry, never another call's. Memory is per
    process, so a call is charged with what others allocated *during* its run and still hold.
    Recursive calls (in one thread or task) clean up once, when the outermost returns; each
    generator cleans up when it finishes or is closed, wherever that happens.

    Args:
        func: the function to decorate, for the bare ``@frees_memory``; left out when the
            decorator is given arguments. Default ``None``.
        every: clean up after every ``every``-th call (a positive int). Default ``1``.
        cleanup: ``"auto"``, ``"always"`` or ``"never"`` (see above).
        max_leak: the most a call may keep on a device, in bytes or a size such as
            ``"256MiB"``; ``None`` judges nothing.
        warmup: how many first calls clean up without being judged against ``max_leak``.
            Default ``1``.
        track_tensors: name the tensors that a call which kept too much created and left alive.
            Default ``False``.

    Returns:
        The decorated function, with its signature, name and docstring (``@frees_memory``), or
        a decorator (``@frees_memory(...)``).

    Raises:
        MemoryLeakError: after a judged call that kept more than ``max_leak`` on a device.
        ValueError: a bad ``every``, ``warmup``, ``cleanup`` or ``max_leak``, named with its
            value.
        TypeError: an async generator function, which cannot be cleaned up after.

    >>> import memguard
    >>> @memguard.frees_memory
    ... def train_step(batch):
    ...     return sum(batch)
    >>> train_step([1, 2, 3])
    6
    """
    positive_int(every, "every", who="frees_memory")
    mode = cleanup_mode(cleanup, "frees_memory")
    positive_int(warmup, "warmup", minimum=0, who="frees_memory",
                 hint=" (the calls not judged for max_leak)")
    flag(track_tensors, "track_tensors", who="frees_memory")
    limit = parse_optional_size(max_leak, "frees_memory: max_leak")

    def decorate(f: F) -> F:
        shared = _FreesMemory(name_of(f), every, mode, limit,
                              recursion=function_kind(f) != "generator", warmup=warmup,
                              track_tensors=track_tensors)
        # each call's context made by the class itself: one Python call less a step
        return guard(f, functools.partial(_Call, shared), "frees_memory")

    return decorate if func is None else decorate(func)
