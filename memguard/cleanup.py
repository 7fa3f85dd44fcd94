"""Freeing memory: garbage collection plus the allocators' caches, and when to bother.

A full ``gc.collect()`` costs ~100 ms once torch is imported while a memory reading costs a few
microseconds, so the ``"auto"`` policy reads first and acts only on what it sees:

1. some device's ``allocated`` grew past its backend's ``hold_tolerance`` since entry: collect
   the young generations (cheap; a cycle made by the block is young), then, if memory is still
   held, a full collection;
2. some device's ``reserved`` is above its entry level by more than ``reserve_tolerance``: empty
   that backend's cache (``empty_cache`` on GPUs, ``malloc_trim`` on the host); if it is still
   above (memory outside the allocators, such as Python objects), collect as in 1.

``"always"`` is the common recipe: a full collection and every cache emptied, every time.
``"never"`` only measures. Every guard that cleans up (``memory_scope``, ``frees_memory``,
``inference_mode``, the trainer callbacks) takes these three values as ``cleanup=``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import logging
import os
import signal
import threading
import time
import traceback
from typing import Any, Callable, Iterable, Iterator, Literal, Optional, TypeVar

from .backends import UNKNOWN, Backend, LevelField, Reading, active_backends, resolve_devices
from .backends.tensorflow import clear_keras_session
from .errors import chained

log = logging.getLogger("memguard")

Cleanup = Literal["auto", "always", "never"]
CLEANUPS = ("auto", "always", "never")
Acting = Literal["auto", "always"]
"""A cleanup that acts: what a :class:`Settler` applies."""
Readings = dict[str, Reading]
Pairs = list[tuple[Backend, str]]
R = TypeVar("R")  # a guard's readings


on_full_collection: list[Callable[[], None]] = []
"""Called after each full collection memguard runs (:func:`collect_all`): a level read before
one may be far above what is in use after it."""


MAX_GAP = 0.05
"""Seconds of guarded blocks after which a paced check (``inference_mode``'s, ``frees_memory``'s)
is due however long the previous one took (a reading of a slow heap, before the resident set
stands in for it)."""

_full_collections = [0]  # made through collect_all that found no garbage, so far

#: Seconds a collection memguard needs waits at most for another thread's to end (CPython
#: runs one at a time: ``gc.collect()`` returns 0 at once while another thread's runs its
#: finalisers or a program's ``gc.callbacks``).
COLLECTION_WAIT = 10.0
_stuck = [False]  # a child forked during a collection: CPython never collects there again
_interrupts = [0]  # Ctrl-C held back by interrupts_after so far: a wait gives way to one

# Collections as C-level callbacks record them: a Python callback in gc.callbacks would take
# a Ctrl-C that arrives during any collection of the program (its handler runs at the
# callback's first bytecode) and lose it, as CPython reports an exception raised in a
# callback and goes on (18 of 20 lost in a program that merely imported memguard).
# CPython's own "collecting" flag, which nothing reads, is up from the first "start"
# callback to the last "stop" one: callbacks at both ends of the list record it, and a child
# forked while it is up never collects again.
_first = collections.OrderedDict.fromkeys(("start", "stop"))  # last key: the latest phase begun
_last = collections.OrderedDict.fromkeys(("start", "stop"))  # last key: the latest phase ended
_latest: dict[str, dict[str, int]] = {}  # phase -> the latest collection's info for it
_mine = threading.local()  # .start: the info of the latest collection this thread began


def _under_way() -> bool:
    return next(reversed(_first)) == "start" or next(reversed(_last)) == "start"


def _forked() -> None:
    _stuck[0] = _under_way()


# Full collections, counted only while a verdict waits for another thread's (a Python
# callback, put in the list for the wait alone): which began after it asked, what it found.
_started = [0]  # full collections begun while counted
_ended = [(0, 0)]  # the latest full collection that ended: (its number, what it found)
_waiting: list[object] = []  # a token per wait under way


def _count_collections(phase: str, info: dict[str, int]) -> None:
    # no lock here: a callback runs inside any allocation of any thread
    if info.get("generation") == 2:
        if phase == "start":
            _started[0] += 1
        else:  # one collection at a time: it is the latest
            _ended[0] = (_started[0], info.get("collected", 0) + info.get("uncollectable", 0))


_HEAD: list[Any] = [_first.move_to_end,  # called (phase, info): info is a truthy ``last``
                    _latest.__setitem__, _mine.__setattr__]
_TAIL: list[Any] = [_last.move_to_end]
_COUNTING: list[Any] = [_count_collections, *_TAIL]


def _watch() -> None:
    """memguard's gc callbacks first and last in ``gc.callbacks`` (a program may have cleared
    the list or added its own at either end since), the counting one only while a wait needs
    it."""
    callbacks: list[Any] = gc.callbacks
    tail = _COUNTING if _waiting else _TAIL
    if callbacks[:len(_HEAD)] != _HEAD or callbacks[-len(tail):] != tail:
        callbacks[:] = _HEAD + [c for c in callbacks if c not in _HEAD + _COUNTING] + tail


_watch()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def _collect_full() -> Optional[int]:
    """One full collection begun after this call: the unreachable objects it found (this
    thread's ``gc.collect()``, or, where another thread's collection kept that from running,
    the next full one that thread begins); ``None`` where none could run (this thread is
    inside a collection: a finaliser called this; a child forked during one; a wait past
    :data:`COLLECTION_WAIT` seconds, or cut short by Ctrl-C)."""
    _watch()
    found = _run_collection()
    if found is not None:
        _stuck[0] = False  # a program's callbacks hid the end of the collection forked in
        return found
    if _stuck[0]:
        return None
    token = object()
    _waiting.append(token)
    try:
        return _wait_for_collection()
    finally:
        _waiting.remove(token)
        _watch()


def _run_collection() -> Optional[int]:
    """This thread's full ``gc.collect()``: what it found, or ``None`` where another collection
    under way kept it from running (it returned 0 at once: no collection of this thread
    began)."""
    mine = getattr(_mine, "start", None)
    found = gc.collect()
    return None if getattr(_mine, "start", None) is mine else found


def _wait_for_collection() -> Optional[int]:
    """:func:`_collect_full` where another collection kept this thread's from running."""
    asked, interrupts = _started[0], _interrupts[0]
    deadline = time.monotonic() + COLLECTION_WAIT
    while True:
        _watch()
        mine = getattr(_mine, "start", None)
        if _under_way() and mine is not None and mine is _latest.get("start"):
            log.debug("no full collection inside one: called by a finaliser it runs")
            return None
        ran = _run_collection()
        if ran is not None:
            return ran
        number, found = _ended[0]
        if number > asked:  # another thread's, begun after this call: it saw the same heap
            return found
        if _interrupts[0] != interrupts:
            return None
        if time.monotonic() > deadline:
            log.warning("a full collection could not run: another thread's has not ended in "
                        "%g s", COLLECTION_WAIT)
            return None
        time.sleep(0.001)  # another thread's collection is under way (rare): let it end


class _NoCollection:
    """:func:`no_collection`'s block (a class: a generator-based one costs every scope 3 us)."""

    __slots__ = ("collecting",)

    def __enter__(self) -> None:
        self.collecting = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc_info: Any) -> None:
        if self.collecting:
            gc.enable()


def no_collection() -> _NoCollection:
    """No garbage collection in the block (as the program had it after): for work that
    allocates per tensor (a census), or that holds a lock a finaliser could wait on."""
    return _NoCollection()


def full_collections() -> int:
    """How many full collections :func:`collect_all` has made that found no garbage: after
    one, a verdict's own collection could free nothing more. One that found some may have
    run finalisers that made new garbage, which only another collection frees."""
    return _full_collections[0]


def collect_until_clean(most: int = 3) -> bool:
    """Full collections until one finds no garbage (at most ``most``), for a leak verdict: a
    finaliser a collection runs can make new garbage that only the next one frees. One that
    another thread's collection kept from running waits for it. False where none could run
    (see :func:`_collect_full`): a verdict then has nothing to rest on."""
    for _ in range(most):
        found = _collect_full()
        if found is None:
            return False
        if found == 0:
            _full_collections[0] += 1
            return True
    return True


def collect_all() -> None:
    """A full ``gc.collect()``, then :data:`on_full_collection`."""
    if _collect_full() == 0:
        _full_collections[0] += 1
    for hook in on_full_collection:
        hook()


def collect_held(read: Callable[[], R], held: Callable[[R], bool],
                 freed: Callable[[R, R], bool], backoff: Optional["Backoff"],
                 gauge: Optional[Callable[[], R]] = None, full: bool = True) -> R:
    """The ``"auto"`` cleanup's collection, for every guard that has one: the young
    generations, then in full where ``held(readings)`` says memory is still held; the
    readings afterwards. ``backoff`` (where given) learns whether it was useful: useless
    only where memory stays held and nothing was ``freed(before, after)`` (a collection
    that frees a leaked cycle each call is useful while other growth stays held).

    ``gauge`` takes the readings that ``freed`` compares where ``read``'s cannot tell: the
    resident set, which a slow heap makes the guards read, does not drop when a collection
    hands blocks back to malloc, so judged on it every collection would look useless and be
    skipped while cycles pile up. Without it ``read``'s readings serve. ``full=False``: the
    young generations only."""
    start = (gauge or read)()
    gc.collect(1)
    now = read()
    if full and held(now):
        collect_all()
        now = read()
    if backoff is not None:
        end = now if gauge is None else gauge()
        (backoff.useless if held(now) and not freed(start, end) else backoff.useful)()
    return now


def cleanup_mode(value: Any, who: str) -> Cleanup:
    """``value`` checked as a ``cleanup=`` argument: ``"auto"``, ``"always"`` or ``"never"``;
    anything else (``True`` and ``False`` too, naming the word to write) is a ``ValueError``
    naming ``who`` and the value.

    >>> cleanup_mode("always", "memory_scope")
    'always'
    >>> cleanup_mode("yes", "memory_scope")
    Traceback (most recent call last):
    ...
    ValueError: memory_scope: cleanup must be 'auto', 'always' or 'never', got 'yes'
    """
    if isinstance(value, str) and value in CLEANUPS:
        return value  # type: ignore[return-value]
    hint = ""
    if value is True or value is False:
        hint = f" (write cleanup={'auto' if value else 'never'!r})"
    raise ValueError(f"{who}: cleanup must be 'auto', 'always' or 'never', got {value!r}{hint}")


def settler_for(cleanup: Cleanup, adaptive: bool = False) -> Optional["Settler"]:
    """The :class:`Settler` that applies ``cleanup``; ``None`` for ``"never"``."""
    return None if cleanup == "never" else Settler(cleanup, adaptive=adaptive)


def read_all(pairs: Pairs, kind: str = "in use") -> Readings:
    """Fast ``(allocated, reserved)`` readings of every ``(backend, device)`` pair; ``kind``
    ``"resident"`` takes the host's resident set for both (see ``HostBackend.quick_kind``):
    readings are compared only with readings of their own kind."""
    out: Readings = {}
    for backend, device in pairs:
        try:
            out[device] = backend.read_fast_as(kind, device)
        except Exception as exc:  # noqa: BLE001 - never let a reading break the program
            log.warning("cannot read %s: %s", device, exc)
            out[device] = UNKNOWN
    return out


def _growth(now: Readings, entry: Readings, field: LevelField, device: str) -> int:
    a = getattr(now.get(device, UNKNOWN), field)
    b = getattr(entry.get(device, UNKNOWN), field)
    return 0 if a is None or b is None else a - b


def beyond_tolerance(pairs: Pairs, now: Readings, entry: Readings
                     ) -> tuple[list[str], list[Backend]]:
    """The devices whose ``allocated`` grew past their backend's ``hold_tolerance`` since
    ``entry`` (memory held: a collection is due), and the backends, each once, with a device
    whose ``reserved`` grew past its ``reserve_tolerance`` (a cache swollen); in one pass, as
    every guard's exit asks it next to the step."""
    held: list[str] = []
    swollen: list[Backend] = []
    for backend, device in pairs:
        a, b = now.get(device, UNKNOWN), entry.get(device, UNKNOWN)
        if a.allocated is not None and b.allocated is not None \
                and a.allocated - b.allocated > backend.hold_tolerance:
            held.append(device)
        if a.reserved is not None and b.reserved is not None \
                and a.reserved - b.reserved > backend.reserve_tolerance \
                and backend not in swollen:
            swollen.append(backend)
    return held, swollen


def released(before: Readings, after: Readings) -> int:
    """Bytes of ``reserved`` memory given back between two readings (>= 0)."""
    return sum(max(0, -_growth(after, before, "reserved", d)) for d in after if d in before)


def empty_caches(backends: Iterable[Backend]) -> None:
    """Empty the cache of each backend (the host's ``malloc_trim`` last)."""
    ordered = sorted(set(backends), key=lambda b: b.name == "host")
    for backend in ordered:
        try:
            backend.empty_cache()
        except Exception as exc:  # noqa: BLE001
            log.warning("emptying the %s cache failed: %s", backend.name, exc)


def free_memory(*, keras: bool = False) -> int:
    """Free every byte that can be freed now; return the bytes given back.

    Runs a full ``gc.collect()``, then empties the cache of every active backend (torch's
    ``empty_cache`` and ``ipc_collect``), then glibc's ``malloc_trim(0)`` for the host. The
    result is the drop of ``reserved`` memory (the resident set on the host) summed over
    devices. TensorFlow cannot give GPU memory back to the driver within a process; with
    ``keras=True`` the Keras session is cleared first (global: every model built so far is
    forgotten by Keras). ``free_memory`` is not a decorator: ``@memguard.frees_memory`` is
    the one that frees after each call.

    Args:
        keras: also clear the Keras session (keyword-only). Default ``False``.

    Returns:
        The bytes given back, summed over devices.

    Raises:
        TypeError: a positional argument (it is not a decorator: use
            :func:`memguard.frees_memory`).

    >>> import memguard
    >>> memguard.free_memory() >= 0
    True
    """
    if not isinstance(keras, bool):
        raise TypeError(f"free_memory: keras must be True or False, got {keras!r}")
    pairs = resolve_devices(None)
    before = read_all(pairs)
    if keras:
        clear_keras_session()
    with interrupts_after():
        collect_all()
        empty_caches(active_backends())
    freed = released(before, read_all(pairs))
    log.debug("free_memory released %d bytes", freed)
    return freed


@contextlib.contextmanager
def interrupts_after() -> Iterator[None]:
    """Hold Ctrl-C back while the block runs and raise it once the block is over.

    A collection runs finalisers (``__del__``, weakref callbacks); a ``KeyboardInterrupt``
    raised inside one is printed as "Exception ignored in ..." and lost, so a program
    interrupted while memguard cleans up would go on. Where Python's own SIGINT handler is
    in force (the main thread), the signal is noted instead and ``KeyboardInterrupt`` is
    raised when the block ends; elsewhere the block runs as it is.
    """
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    caught: list[int] = []

    def hold(number: int, frame: Any) -> None:
        caught.append(number)
        _interrupts[0] += 1

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if caught:
        raise KeyboardInterrupt


def drop_frames(exc: BaseException) -> None:
    """Clear the local variables of every finished frame ``exc`` (and the exceptions chained
    to it) still holds through its traceback, so that what a failed call allocated can be
    freed while the exception object itself lives on (frames still running are left as
    they are). Call it inside ``except``; collect outside it, once ``exc`` is dropped.
    """
    for current in chained(exc, context=True):
        if current.__traceback__ is not None:
            traceback.clear_frames(current.__traceback__)


class Backoff:
    """Skips an action after it proved useless: 1, 3, 7 ... up to 63 windows."""

    def __init__(self) -> None:
        self.level = 0
        self.wait = 0

    def ready(self) -> bool:
        if self.wait:
            self.wait -= 1
            return False
        return True

    def useless(self) -> None:
        self.level = min(self.level + 1, 6)
        self.wait = 2**self.level - 1

    def useful(self) -> None:
        self.level = 0


@dataclasses.dataclass
class Outcome:
    """What one cleanup did: bytes released, whether it collected (``full``: in full, finding
    no garbage), readings afterwards, and whether it did nothing but read (``idle``: its
    readings are the memory as the block left it)."""

    freed: int
    collected: bool
    after: Readings
    idle: bool = False
    full: bool = False  # a full collection that found no garbage ran before ``after``


class Settler:
    """Applies a cleanup policy at the end of a guarded block, given the entry readings.

    One ``Settler`` serves one scope, or every call of one ``@frees_memory`` function; with
    ``adaptive=True`` it stops repeating a collection or a cache emptying that keeps proving
    useless (memory that is really in use, a cache the next call fills again), retrying it
    after 1, 3, 7 ... 63 calls.
    """

    def __init__(self, cleanup: Acting = "auto", adaptive: bool = False) -> None:
        if cleanup not in ("auto", "always"):
            raise ValueError(f"Settler: cleanup must be 'auto' or 'always', got {cleanup!r}")
        self.cleanup = cleanup
        self.adaptive = adaptive
        self._gc = Backoff()
        self._cache = Backoff()
        self._cache_last = False

    def settle(self, pairs: Pairs, entry: Readings, kind: str = "in use",
               recent: Optional[Readings] = None, now: Optional[Readings] = None) -> Outcome:
        """Clean up after a block that began with ``entry`` readings (of ``kind``, see
        :func:`read_all`); ``recent``: a later reading than ``entry`` where there is one
        (``frees_memory``'s last, where its reference is a lower level kept from before):
        memory held over ``entry`` but within the tolerance of ``recent`` crept up a little
        at a time, and is collected for in the young generations only (where a cycle a
        recent call made is; memory merely in use would cost full collections that free
        nothing). ``now``: the block's readings (of ``kind``) where the caller took them."""
        if now is None:
            now = read_all(pairs, kind)
        if self.cleanup == "always":
            fulls = full_collections()
            with interrupts_after():  # finalisers run: Ctrl-C in one is raised afterwards
                collect_all()
                empty_caches(b for b, _ in pairs)
            after = read_all(pairs, kind)
            return Outcome(released(now, after), True, after,
                           full=full_collections() != fulls)
        held, swollen = beyond_tolerance(pairs, now, entry)
        collect = bool(held) and self._gc_ready()
        if not collect and not swollen:
            self._cache_last = False
            return Outcome(0, False, now, idle=True)
        with interrupts_after():  # only where it acts: holding Ctrl-C costs ~10 us
            full = recent is None or bool(beyond_tolerance(pairs, now, recent)[0])
            return self._act(pairs, entry, kind, now, held if collect else [], full)

    def _act(self, pairs: Pairs, entry: Readings, kind: str, now: Readings,
             held: list[str], full: bool = True) -> Outcome:
        """The ``"auto"`` cleanup once a collection is due (``held``; in full only where
        ``full``) or a cache swollen."""
        start, collected, fulls = now, False, full_collections()
        if held:
            now = self._collect(pairs, held, entry, kind, full)
            collected = True
            if kind == "resident":  # blocks freed to malloc show in the resident set once
                # trimmed; untrimmed, the next call reuses them, seems to keep nothing, and
                # its cycle is left
                empty_caches(b for b, d in pairs if d in held and b.name == "host")
                now = read_all(pairs, kind)
        swollen = self._swollen(pairs, now, entry)
        if swollen and (collected or self._cache_ready(swollen)):
            empty_caches(swollen)
            now = read_all(pairs, kind)
            if not collected and self._swollen(pairs, now, entry) and self._gc_ready():
                now = self._collect(pairs, [d for b, d in pairs if b in swollen], entry, kind,
                                    full)
                empty_caches(swollen)
                now = read_all(pairs, kind)
                collected = True
        elif not swollen:
            self._cache_last = False
        return Outcome(released(start, now), collected, now,
                       full=full_collections() != fulls)

    # -- pieces ------------------------------------------------------------------------------
    @staticmethod
    def _held(pairs: Pairs, now: Readings, entry: Readings) -> list[str]:
        return beyond_tolerance(pairs, now, entry)[0]

    @staticmethod
    def _swollen(pairs: Pairs, now: Readings, entry: Readings) -> list[Backend]:
        return beyond_tolerance(pairs, now, entry)[1]

    def _gc_ready(self) -> bool:
        return not self.adaptive or self._gc.ready()

    def _cache_ready(self, swollen: list[Backend]) -> bool:
        if not self.adaptive:
            return True
        if not self._cache.ready():
            return False
        if self._cache_last:
            self._cache.useless()  # the previous call's emptying was refilled at once
        else:
            self._cache.useful()
        self._cache_last = True
        return True

    def _collect(self, pairs: Pairs, held: list[str], entry: Readings, kind: str,
                 full: bool = True) -> Readings:
        def still(now: Readings) -> list[str]:
            return [d for d in self._held(pairs, now, entry) if d in held]

        def freed(start: Readings, now: Readings) -> bool:
            return any(-_growth(now, start, "allocated", d) > b.hold_tolerance
                       for b, d in pairs if d in held)

        gauge = (lambda: read_all(pairs)) if kind != "in use" else None
        now = collect_held(lambda: read_all(pairs, kind), lambda now: bool(still(now)), freed,
                           self._gc if self.adaptive else None, gauge, full)
        still_held = still(now)
        log.debug("collected garbage; still held on %s", still_held or "no device")
        return now

