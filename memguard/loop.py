"""The one sizing loop: every entry point that shrinks (or searches) a size on out-of-memory
drives it, and so can user code that is not a function (``memguard.attempts``).

The order of one attempt is the point of this module:

1. inside ``except`` (the ``with attempt:`` block's exit): is it an out-of-memory? The failure
   is recorded with a snapshot while the failed attempt still holds its memory, what
   ``factor="auto"`` measures is read, the finished frames are cleared and the next size is
   proposed; anything else propagates untouched (after telling the other ranks);
2. outside ``except`` (the next step of the loop), once the exception is no longer referenced:
   memory is freed, state restored, the ranks of a distributed job agree on the outcome and
   the size, ``on_retry`` runs; or, when no smaller size is left, :class:`OutOfMemoryError`.

``oom_retry``, ``map_batches``, ``auto_microbatch`` and ``find_batch_size`` are drivers over
:class:`Loop`: they differ in what one attempt runs and what follows a success, never in how an
out-of-memory is recognised, freed or agreed on. Their shared keyword arguments (the shrink
policy) mean the same everywhere: ``min_batch_size``, ``factor``, ``max_attempts``,
``on_retry``, ``sync``.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import sys
import time
from contextvars import ContextVar
from types import FrameType
from typing import Any, Callable, Iterator, Literal, NamedTuple, Optional, Union

from ._checks import integral, optional_positive_int, positive_int, real
from ._decorate import name_of
from ._events import emit
from ._locks import ForkSafeLock
from ._units import format_bytes
from .backends import level_field
from .cleanup import drop_frames, free_memory
from .distributed import FAILED, GAVE_UP, OK, OOM, Agreement, Sync, check_sync
from .errors import (
    OOM_MESSAGES,
    MemguardError,
    OutOfMemoryError,
    chained,
    oom_kind,
    oom_source,
    text_of,
)
from .sizes import Gauge
from .snapshot import MemorySnapshot, snapshot

log = logging.getLogger("memguard")

Unit = Literal["batch", "microbatch"]
"""What an attempt's size counts: the samples of a batch, or of one slice of a batch."""
Factor = Union[float, Literal["auto"], Callable[[int], int]]
"""How the size shrinks after an out-of-memory: a fraction, ``"auto"`` or ``size -> size``."""

NO_OPINION = 1 << 62
"""The size a rank proposes when its own attempt did not fail (the smallest proposal wins)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Attempt:
    """The record of one attempt: one call of an ``oom_retry`` function, one batch (or slice)
    of ``map_batches``, one pass of ``auto_microbatch`` over a batch, one trial of
    ``find_batch_size``, one block of ``memguard.attempts``.

    Attributes:
        size: the size the attempt ran at, counted in units of ``unit``.
        ok: whether it succeeded (on every rank).
        unit: ``"batch"``, or ``"microbatch"`` for ``auto_microbatch``, whose size is the
            slice size.
        steps: for ``unit="microbatch"`` the number of slices the batch was cut into; with
            ``oom_retry(keep_effective_batch=True)`` the accumulation steps passed; else
            ``None``.
        error: the out-of-memory's text, or why a peer rank failed; ``None`` for a success.
        seconds: how long the attempt ran.
        memory: a snapshot taken at the failure, while the failed attempt still held its
            memory (``None`` for a success).
        snapshot_path: the CUDA memory snapshot written for the failure
            (``oom_retry(cuda_snapshot_dir=...)``).
        next_size: the size the next attempt runs at after this one failed (``None`` for a
            success, and for a failure after which no smaller size was tried).
        recompute: ``auto_microbatch`` ran this pass with the model's activations
            recomputed in backward (its rung below one sample).
        offload: ``auto_microbatch`` ran this pass with the tensors saved for backward
            kept in pinned host memory (its rung after recompute, on an accelerator).

    >>> from memguard import Attempt
    >>> str(Attempt(size=64, ok=True, seconds=0.5))
    'batch_size=64: ok in 0.500 s'
    >>> str(Attempt(size=16, unit="microbatch", steps=4, ok=False, error="out of memory",
    ...             seconds=0.5, next_size=8))
    'microbatch_size=16 (4 slices): out of memory after 0.500 s; next microbatch_size=8'
    """

    size: int
    ok: bool
    unit: Unit = "batch"
    steps: Optional[int] = None
    error: Optional[str] = None
    seconds: float = 0.0
    memory: Optional[MemorySnapshot] = None
    snapshot_path: Optional[str] = None
    next_size: Optional[int] = None
    recompute: bool = False
    offload: bool = False

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (the snapshot as its own ``to_dict()``)."""
        data = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        data["memory"] = self.memory.to_dict() if self.memory is not None else None
        return data

    def __str__(self) -> str:
        name = f"{self.unit}_size"
        if self.steps is None:
            steps = ""
        elif self.unit == "microbatch":
            steps = f" ({self.steps} slices)"
        else:
            steps = f" x{self.steps} steps"
        rungs = [rung for rung, on in (("recompute", self.recompute),
                                       ("offload", self.offload)) if on]
        if rungs:
            steps += " with " + " and ".join(rungs)
        if self.ok:
            return f"{name}={self.size}{steps}: ok in {self.seconds:.3f} s"
        upcoming = "" if self.next_size is None else f"; next {name}={self.next_size}"
        return f"{name}={self.size}{steps}: {self.error} after {self.seconds:.3f} s{upcoming}"


_new_record = object.__new__
_RECORD_DEFAULTS = {field.name: field.default for field in dataclasses.fields(Attempt)}


def succeeded(size: int, unit: Unit, steps: Optional[int], seconds: float) -> Attempt:
    """``Attempt(size=size, ok=True, unit=unit, steps=steps, seconds=seconds)``, made
    without the frozen dataclass's eleven ``object.__setattr__`` calls (one a call of every
    guard: a third of its record's cost)."""
    record = _new_record(Attempt)
    record.__dict__.update(_RECORD_DEFAULTS, size=size, ok=True, unit=unit, steps=steps,
                           seconds=seconds)
    return record


# -- what every driver reports -----------------------------------------------------------------

def memory_summary(snap: Optional[MemorySnapshot]) -> str:
    """``"host 58.1 MiB of the 60.0 MiB memory_limit (address space), cuda:0 30.1 GiB of the
    31.7 GiB CUDA device (device memory)"``: a short line for logs, on the budget that binds
    on each device (what it counts, its limit, what of it was used) where one is known."""
    if snap is None:
        return "memory unknown"
    parts = []
    for name, mem in snap.devices.items():
        binding = snap.budgets.get(name)
        if binding is not None:
            parts.append(f"{name} {binding.short()}")
            continue
        used = getattr(mem, level_field(name))
        total = f" of {format_bytes(mem.total)}" if mem.total is not None else ""
        parts.append(f"{name} {format_bytes(used)}{total}")
    return ", ".join(parts)


def error_text(exc: BaseException) -> str:
    """The out-of-memory's kind and the line of its message that says what ran out (Keras
    puts "Graph execution error:" first and the allocation's shape further down), else its
    first line, shortened."""
    source = oom_source(exc)  # in a group, the out-of-memory itself, not the group's summary
    text = text_of(exc if source is None or source in chained(exc) else source)
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    line = next((line for line in lines if any(needle in line for _, needle in OOM_MESSAGES)),
                lines[0] if lines else type(exc).__name__)
    if len(line) > 240:
        line = line[:237] + "..."
    return f"out of memory ({oom_kind(exc)}): {line}"


_told_of_wait: list[bool] = []


def _tell_of_tensorflows_wait(exc: BaseException) -> None:
    """Once a process: TensorFlow's default CPU allocator on x86 (oneDNN's, ``mklcpu``, a
    BFC allocator) waits up to 10 s for memory to be freed before it reports an
    out-of-memory, so each failed attempt costs that much; the plain allocator fails at once
    (measured: 10.0 s against 2-8 ms an out-of-memory)."""
    if _told_of_wait:
        return
    source = oom_source(exc)  # in a group or a chain, the out-of-memory itself
    if any("by allocator mklcpu" in text_of(e) for e in (exc, *chained(exc), source)
           if e is not None):
        _told_of_wait.append(True)
        log.warning("TensorFlow's oneDNN CPU allocator (mklcpu) waits up to 10 s before it "
                    "reports an out-of-memory, each attempt that runs out; "
                    "TF_ENABLE_ONEDNN_OPTS=0, set before TensorFlow is imported, makes its "
                    "plain allocator fail at once (and return freed memory to the system)")


def exhausted(who: str, attempts: list[Attempt], what: str = "") -> OutOfMemoryError:
    """The error when every size allowed ran out of memory: each size tried with the memory
    at its failure, and what to change."""
    unit = attempts[-1].unit if attempts else "batch"
    sizes = "; ".join(f"{a.size} ({memory_summary(a.memory)})" for a in attempts)
    advice = ("Lower min_batch_size, raise max_attempts, free memory held elsewhere, or use "
              "a smaller model") if not attempts or attempts[-1].size > 1 else (
        "Not even one sample fits: free memory held elsewhere, or use a smaller model")
    return OutOfMemoryError(f"{who}: out of memory at every {unit}_size tried{what}: {sizes}. "
                            f"{advice}", attempts)


def safe_snapshot() -> Optional[MemorySnapshot]:
    """A snapshot, or ``None`` when reading fails (at an out-of-memory, say)."""
    try:
        return snapshot()
    except Exception:  # noqa: BLE001 - a reading must never mask the out-of-memory
        return None


class GuardState:
    """What a decorated function remembers between calls, under one lock: ``history``, the
    last call's attempts, and what a subclass's :meth:`forget` drops (the sizes that
    worked)."""

    def __init__(self) -> None:
        self.lock = ForkSafeLock()
        self.history: list[Attempt] = []
        self.forget()

    def forget(self) -> None:
        """Drop the remembered sizes (called with the lock held, or from ``__init__``)."""

    def reset(self) -> None:
        """Forget the sizes that worked and the last call's attempts: the next call starts
        afresh."""
        with self.lock:
            self.history = []
            self.forget()


# -- the shrink policy ---------------------------------------------------------------------------

def check_factor(factor: Any, who: str) -> Factor:
    """``factor`` checked: a number strictly between 0 and 1, ``"auto"`` or a callable.

    >>> check_factor(1.5, "oom_retry")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: oom_retry: factor must be a number between 0 and 1 (exclusive), 'auto' or a ...
    """
    if isinstance(factor, str) and factor == "auto":
        return "auto"
    if callable(factor):
        return factor
    number = real(factor)  # numpy's numbers too, never a bool or NaN
    if number is None or not 0 < number < 1:
        raise ValueError(f"{who}: factor must be a number between 0 and 1 (exclusive), 'auto' "
                         f"or a callable size -> next size, got {factor!r}")
    return number


def as_size(value: Any) -> Optional[int]:
    """``value`` as an int when it is an integral number (``numpy.int64``, a 0-d integer
    tensor, ``operator.index`` works), else ``None``; never a bool."""
    return integral(value)


@dataclasses.dataclass(frozen=True)
class Policy:
    """How a size shrinks after an out-of-memory, as every sizing entry point takes it.

    Attributes:
        min_batch_size: the smallest size tried.
        factor: the next size is ``floor(size * factor)``; ``"auto"`` measures it from the
            failed attempt's memory; a callable ``size -> next size`` decides.
        max_attempts: the most attempts in one loop (``None``: until ``min_batch_size``).
        on_retry: called with the failed :class:`Attempt` after the cleanup, before the next.
        sync: agree with the other ranks of a distributed job (``"auto"``, ``True``,
            ``False``).
    """

    min_batch_size: int = 1
    factor: Factor = 0.5
    max_attempts: Optional[int] = None
    on_retry: Optional[Callable[[Attempt], object]] = None
    sync: Sync = "auto"

    @classmethod
    def checked(cls, who: str, *, min_batch_size: Any = 1, factor: Any = 0.5,
                max_attempts: Any = None, on_retry: Any = None, sync: Any = "auto") -> Policy:
        """The policy, each value checked, errors naming ``who``, the parameter and value."""
        least = positive_int(min_batch_size, "min_batch_size", who=who)
        most = optional_positive_int(max_attempts, "max_attempts", who=who)
        if on_retry is not None and not callable(on_retry):
            raise TypeError(f"{who}: on_retry must be callable, got {on_retry!r}")
        return cls(least, check_factor(factor, who), most, on_retry, check_sync(sync, who))

    def check_start(self, size: Any, who: str, name: str = "batch_size") -> Optional[int]:
        """A starting ``size`` (``None``: not known yet) checked against ``min_batch_size``."""
        if size is None:
            return None
        size = positive_int(size, name, who=who)
        if self.min_batch_size > size:
            raise ValueError(f"{who}: min_batch_size={self.min_batch_size} is larger than the "
                             f"starting {name}={size}; lower min_batch_size or start larger")
        return size

    def next_size(self, size: int, estimate: Optional[int], who: str) -> int:
        """The size after an out-of-memory at ``size`` (above ``min_batch_size``):
        ``floor(size * factor)``, what a callable returns (a positive integral number below
        ``size``, else ``ValueError``), or for ``"auto"`` the measured ``estimate`` (half when
        nothing was measured); never below ``min_batch_size``.

        >>> Policy(factor=0.25).next_size(64, None, "f"), Policy(factor="auto").next_size(
        ...     64, None, "f"), Policy(40, lambda s: s - 30).next_size(64, None, "f")
        (16, 32, 40)
        """
        factor = self.factor
        if factor == "auto":
            upcoming = estimate if estimate is not None else size // 2
        elif callable(factor):
            returned = factor(size)
            upcoming = as_size(returned)  # type: ignore[assignment]
            if upcoming is None or not 0 < upcoming < size:
                raise ValueError(f"{who}: factor {name_of(factor)}({size}) returned "
                                 f"{returned!r}; it must return a positive int smaller than "
                                 f"{size}")
        else:
            upcoming = math.floor(size * factor)
        return max(self.min_batch_size, upcoming)


# -- nesting -------------------------------------------------------------------------------------

class _Entry(NamedTuple):
    """One attempt running in a context: whose loop (``owner``), the loop itself (``None``
    for a pass that is not a :class:`Loop`), the generator frame that entered it (``None``
    unless a generator did) and the size each owner gave up at during the outermost call."""

    owner: Any
    loop: Optional[Loop]
    frame: Optional[FrameType]
    gave_up: dict[Any, int]


_make_entry = tuple.__new__  # _Entry(...) without the named tuple's argument handling
_Nest = tuple[_Entry, ...]
"""The attempts running in one context, outermost first (a plain tuple: made at every
attempt)."""

# Per task and per thread, as contexts are: a loop started inside another's attempt nests.
_NEST: ContextVar[_Nest] = ContextVar("memguard_attempts_nest", default=())
# A generator runs in its consumer's context: one suspended (at a ``yield``) inside ``with
# attempt:`` leaves its entry there while the consumer goes on.
_SUSPENDABLE = inspect.CO_GENERATOR | inspect.CO_ASYNC_GENERATOR


def _live(nest: _Nest) -> _Nest:
    """``nest`` without the attempts of generators suspended inside them: an attempt entered
    by a generator runs only while that generator's frame is on the stack."""
    if all(entry.frame is None for entry in nest):
        return nest
    stack = set()
    frame: Optional[FrameType] = sys._getframe(1)  # noqa: SLF001 - the stack itself
    while frame is not None:
        stack.add(id(frame))
        frame = frame.f_back
    return tuple(entry for entry in nest if entry.frame is None or id(entry.frame) in stack)


def running() -> bool:
    """Whether an attempt of a sizing loop (``oom_retry``, ``auto_microbatch``,
    ``memguard.attempts``...) runs in this thread or task: an out-of-memory raised here will
    be logged and handled by that loop. An attempt that a generator entered and then left
    suspended at a ``yield`` does not run.

    >>> running()
    False
    """
    nest = _NEST.get()
    return bool(nest) and bool(_live(nest))


running_here: Callable[[], _Nest] = _NEST.get
"""The attempts' entries in this context, suspended generators' included: the cheap test
(a call of C, no Python frame), where an empty one says no guard surrounds the code."""


def enter_first(owner: Any, loop: Optional[Loop] = None) -> _Entry:
    """:func:`enter_attempt` for an attempt that no other attempt surrounds
    (:func:`running_here` gave none), entered by a frame that is not a generator's; its
    ``gave_up`` records what guards nested in it give up at. :func:`leave_first` ends it."""
    entry = _make_entry(_Entry, (owner, loop, None, {}))
    _NEST.set((entry,))
    return entry


def leave_first(entry: _Entry) -> None:
    """End what :func:`enter_first` started (:func:`leave_attempt`, quicker where the entry
    is alone, as it is unless a generator left its own there)."""
    nest = _NEST.get()
    if len(nest) == 1 and nest[0] is entry:
        _NEST.set(())
    else:
        leave_attempt(entry)


def enter_attempt(owner: Any, gave_up: dict[Any, int], loop: Optional[Loop] = None,
                  depth: int = 1) -> _Entry:
    """Mark an attempt of ``owner``'s loop (``loop``) as running in this context, entered by
    the frame ``depth`` calls up (loops started inside it nest; ``gave_up`` is the outermost
    call's record); :func:`leave_attempt` ends it."""
    frame = sys._getframe(depth)  # noqa: SLF001 - is it a generator's?
    entry = _make_entry(_Entry, (owner, loop, frame if frame.f_code.co_flags & _SUSPENDABLE
                                 else None, gave_up))
    _NEST.set(_NEST.get() + (entry,))
    return entry


def leave_attempt(entry: _Entry) -> None:
    """End what :func:`enter_attempt` started: its entry is removed wherever it stands (a
    generator may leave its attempt after its consumer entered another)."""
    nest = _NEST.get()
    if nest and nest[-1] is entry:
        _NEST.set(nest[:-1])
    elif any(other is entry for other in nest):
        _NEST.set(tuple(other for other in nest if other is not entry))


# -- the loop ------------------------------------------------------------------------------------

class Loop:
    """One sizing loop: its size, its attempts and its ranks' agreement, as one state machine
    that every driver runs the same way (``await`` is all an async driver adds)::

        loop = Loop("train", 256, policy)
        for attempt in loop:            # from the 2nd: free, restore, agree, on_retry
            with attempt:               # its exit decides, inside except
                result = work(attempt.batch_size)

    Nested loops (a loop started inside another's attempt, in the same thread or task): the
    innermost loop that can still shrink owns an out-of-memory. Once it has given up (raising
    :class:`OutOfMemoryError`), the loop around it retries at its own smaller size, and for the
    rest of that outermost call the loop that gave up (the same ``owner``) makes one attempt,
    at the size it gave up at. So each loop walks its sizes once per outermost call: a body
    that never fits runs ``inner + outer - 1`` times, not ``inner * outer``. The owner is the
    guard: a decorated function's state, the line of code that made a block form. An attempt
    a generator entered and left suspended at a ``yield`` is not around its consumer's code.

    ``peers``: what a rank whose attempt succeeded does when another rank ran out of memory:
    ``"redo"`` (all retry at the same smaller size: ``oom_retry``, ``map_batches``) or
    ``"wait"`` (keep what it did, wait for the others to finish: ``auto_microbatch``, whose
    ranks cut their own batches).
    """

    unit: Unit = "batch"
    peers: Literal["redo", "wait"] = "redo"
    retry_level = logging.WARNING  # how a retry is logged

    def __init__(self, who: str, size: int, policy: Policy, *, owner: Any = None,
                 history: Optional[list[Attempt]] = None) -> None:
        self.who = who
        self.policy = policy
        nest = _NEST.get()
        if nest:
            nest = _live(nest)
        self.owner = self if owner is None else owner
        self.nested = bool(nest)
        # a loop of the same owner inside its own attempt: a recursion; ``parent`` is the
        # loop of that owner's innermost attempt
        self.parent: Optional[Loop] = None
        self.recursive = False
        self.gave_up: dict[Any, int] = {}
        self.final = False
        if nest:
            self.parent = next(
                (entry.loop for entry in reversed(nest) if entry.owner == self.owner), None)
            self.recursive = any(entry.owner == self.owner for entry in nest)
            self.gave_up = nest[-1].gave_up
            resumed = self.gave_up.get(self.owner)
            self.final = resumed is not None  # it gave up earlier in this outermost call
            if resumed is not None:
                size = min(size, resumed)
        self.agreement = Agreement(policy.sync)
        self.size = size
        self.gauge = Gauge(who) if policy.factor == "auto" else None
        self.attempts: list[Attempt] = [] if history is None else history
        self.flags: list[int] = []  # what the last agreement said of the driver's flags
        self.started = 0.0
        self.status = OK  # of this rank's last attempt
        self.proposal = NO_OPINION  # the size this rank proposes next
        self.pending: Optional[BaseException] = None  # the out-of-memory it gave up on
        self.retrying = False  # the last attempt failed somewhere: recover before the next
        self.waiting = False  # this rank is done, a peer is not ("wait" peers)
        self.redoing = False  # a peer's attempt failed: recover before the next
        self.unused: Optional[AttemptBlock] = None  # the last block, until its with-block ends
        self.tries = 0  # attempts since the last success (what max_attempts counts)
        self.done = False

    # -- the driver's hooks ----------------------------------------------------------------
    def steps(self) -> Optional[int]:
        """What :attr:`Attempt.steps` records for an attempt at the current size."""
        return None

    def local_flags(self) -> list[int]:
        """Flags to OR over the ranks at every agreement (the same length on every rank)."""
        return []

    def snapshot_path(self) -> Optional[str]:
        """A file the failed attempt's memory was written to, if any (inside ``except``)."""
        return None

    def recover(self, retrying: bool) -> int:
        """Outside ``except``, after a failed attempt: free its memory (and, when
        ``retrying``, put back what the next attempt must start from); the bytes freed."""
        return free_memory()

    def after_ok(self) -> Optional[int]:
        """After an attempt that succeeded on every rank: the next size, or ``None`` when
        the loop is over (the default)."""
        return None

    def after_oom(self, agreed: int) -> Optional[int]:
        """After an attempt that ran out of memory on some rank, ``agreed`` the smallest size
        proposed: the next size (the default), or ``None`` to end the loop (a search that has
        its answer)."""
        return agreed

    def propose(self, estimate: Optional[int]) -> Optional[int]:
        """Inside ``except``: this rank's next size after its out-of-memory at ``size``
        (``estimate``: what ``factor="auto"`` measured), ``None`` when none is left."""
        policy = self.policy
        if self.final or self.size <= policy.min_batch_size:
            return None
        if policy.max_attempts is not None and self.tries >= policy.max_attempts:
            return None
        return policy.next_size(self.size, estimate, self.who)

    def record(self, attempt: Attempt) -> None:
        """Keep ``attempt`` in the history."""
        self.attempts.append(attempt)

    def out_of_sizes(self) -> OutOfMemoryError:
        """The error when this rank has no size left."""
        return exhausted(self.who, self.attempts)

    def peer_gave_up(self) -> OutOfMemoryError:
        """The error when another rank ran out of memory at its smallest size and this
        rank's attempt did not."""
        return exhausted(self.who, self.attempts,
                         " (another rank ran out of memory at its smallest size; this rank "
                         "did not run out itself)")

    # -- the loop --------------------------------------------------------------------------
    def __iter__(self) -> Iterator[AttemptBlock]:
        return self

    def __next__(self) -> AttemptBlock:
        if self.unused is not None:
            raise RuntimeError(f"{self.who}: {self.unused!r} was never run; run each attempt's "
                               f"work inside `with attempt:`")
        if self.waiting:
            self._wait()
        elif self.retrying:  # this rank ran out of memory
            self.retrying = False
            self._between()
        elif self.redoing:  # a peer did
            self.redoing = False
            self._announce(self.recover(True))
        if self.done:
            raise StopIteration
        self.unused = AttemptBlock(self)
        return self.unused

    def _begin(self) -> None:
        if self.gauge is not None:
            self.gauge.start()
        self.started = time.perf_counter()

    def _agree(self, status: int, proposal: int) -> tuple[int, int]:
        if not self.agreement.active:
            self.flags = self.local_flags()
            return status, proposal
        values = self.agreement.all_max([status, -proposal, *self.local_flags()])
        self.flags = values[2:]
        return values[0], -values[1]

    def _exit(self, exc: Optional[BaseException]) -> bool:
        """The ``with attempt:`` block's exit, inside the exception handling: True
        suppresses an out-of-memory that the next step of the loop deals with."""
        seconds = time.perf_counter() - self.started
        self.unused = None
        self.tries += 1
        if exc is None:
            self.status, self.proposal = OK, NO_OPINION
            worst, agreed = self._agree(OK, NO_OPINION)
            self._settle(worst, agreed, seconds)
            return False
        if not isinstance(exc, Exception):  # Ctrl-C, exit: leave at once
            return False
        if oom_kind(exc) is None:
            self._agree(FAILED, NO_OPINION)  # the peers raise too, instead of waiting
            return False
        emit(f"OOM at {self.unit}_size={self.size}")
        record = Attempt(size=self.size, ok=False, unit=self.unit, steps=self.steps(),
                         error=error_text(exc), seconds=seconds, memory=safe_snapshot(),
                         snapshot_path=self.snapshot_path())
        # while the failed attempt still holds its memory
        estimate = self.gauge.size_after(exc, self.size) if self.gauge is not None else None
        _tell_of_tensorflows_wait(exc)
        drop_frames(exc)  # the error kept below must not keep the frames
        self.record(record)
        upcoming = self.propose(estimate)
        self.status = OOM if upcoming is not None else GAVE_UP
        self.proposal = upcoming if upcoming is not None else NO_OPINION
        self.pending = exc
        self.retrying = True
        return True

    def _between(self) -> None:
        """Outside ``except``, after this rank's out-of-memory: free, agree, go on or raise."""
        gave_up = self.status == GAVE_UP
        freed = self.recover(not gave_up)
        worst, agreed = self._agree(self.status, self.proposal)
        error, self.pending = self.pending, None
        if gave_up:
            if self.nested:
                self.gave_up[self.owner] = self.size
            raise self.out_of_sizes() from error
        self._settle(worst, agreed, None)
        if not self.done:
            self._announce(freed)

    def _settle(self, worst: int, agreed: int, seconds: Optional[float]) -> None:
        """After an agreement: go on at the agreed size, finish, or raise what a peer's
        failure means here. ``seconds`` is given when this rank's attempt succeeded."""
        if worst == FAILED:
            raise MemguardError(f"{self.who}: another rank failed with an error that is not "
                                f"an out-of-memory; see that rank's log")
        if worst == GAVE_UP:
            if seconds is not None:
                self._record_peer(seconds)
            raise self.peer_gave_up()
        if worst == OK:
            self.tries = 0
            self.record_success(seconds or 0.0)
            upcoming = self.after_ok()
            if upcoming is None:
                self.done = True
            else:
                self.size = upcoming
            return
        # some rank ran out of memory
        if seconds is not None and self.peers == "wait":
            self.record_success(seconds)
            self.waiting = True
            log.info("%s: another rank ran out of memory; waiting for it", self.who)
            return
        if seconds is not None:  # this rank's attempt succeeded: its result is dropped
            self._record_peer(seconds)
        upcoming = self.after_oom(agreed)  # every rank decides on the same records
        self.redoing = seconds is not None and upcoming is not None
        if upcoming is not None:
            self.attempts[-1] = dataclasses.replace(self.attempts[-1], next_size=upcoming)
        if upcoming is None:
            self.done = True
        else:
            self.size = upcoming

    def _announce(self, freed: int) -> None:
        """Before the attempt after a failure: log it, call ``on_retry``."""
        last = self.attempts[-1]
        log.log(self.retry_level, "%s: %s at %s_size=%d; %s; freed %s; retrying at %s_size=%d",
                self.who,
                    last.error, self.unit, last.size, memory_summary(last.memory),
                    format_bytes(freed), self.unit, self.size)
        if self.policy.on_retry is not None:
            self.policy.on_retry(last)

    def record_success(self, seconds: float) -> None:
        """Record the attempt that succeeded (every rank's, or this rank's while it waits)."""
        self.record(succeeded(self.size, self.unit, self.steps(), seconds))

    def _record_peer(self, seconds: float) -> None:
        self.record(Attempt(size=self.size, ok=False, unit=self.unit, steps=self.steps(),
                            error="another rank ran out of memory", seconds=seconds,
                            memory=safe_snapshot()))

    def _wait(self) -> None:
        """This rank is done and a peer is redoing its attempt: join its agreements."""
        while True:
            worst, _ = self._agree(OK, NO_OPINION)
            if worst == OK:
                self.waiting, self.done = False, True
                return
            if worst == FAILED:
                raise MemguardError(f"{self.who}: another rank failed with an error that is "
                                    f"not an out-of-memory; see that rank's log")
            if worst == GAVE_UP:
                raise MemguardError(f"{self.who}: another rank ran out of memory at its "
                                    f"smallest {self.unit}_size; see that rank's log")


class AttemptBlock:
    """One attempt of a :class:`Loop` (what ``for attempt in memguard.attempts(...)``
    yields): use it as ``with attempt:`` around the work, at ``attempt.batch_size``.

    Attributes:
        batch_size: the size this attempt runs at.
        number: 1 for the first attempt of the loop, 2 for the second...
    """

    __slots__ = ("loop", "batch_size", "number", "_token")

    def __init__(self, loop: Loop) -> None:
        self.loop = loop
        self.batch_size = loop.size
        self.number = len(loop.attempts) + 1
        self._token: Any = None  # the running attempt's entry; False once it has run

    def __enter__(self) -> AttemptBlock:
        loop = self.loop
        if self._token is not None:
            raise RuntimeError(f"{loop.who}: {self!r} has already "
                               f"{'run' if self._token is False else 'been entered'}; each "
                               f"attempt runs once: run the next one the loop gives (`for "
                               f"attempt in loop: with attempt: ...`)")
        self._token = enter_attempt(loop.owner, loop.gave_up, loop, depth=2)
        loop._begin()  # noqa: SLF001 - the loop's own block
        return self

    def __exit__(self, kind: Optional[type], exc: Optional[BaseException],
                 traceback: Any) -> bool:
        leave_attempt(self._token)
        self._token = False
        return self.loop._exit(exc)  # noqa: SLF001 - the loop's own block

    def __repr__(self) -> str:
        return f"<attempt {self.number} of {self.loop.who} at batch_size={self.batch_size}>"


class AttemptLoop(Loop):
    """The loop of :func:`attempts`: iterate it, and run each attempt's work in ``with
    attempt:``. ``history`` holds the :class:`Attempt` records; ``batch_size`` the size of
    the attempt that succeeded (``None`` before one did).

    Attributes:
        history: the :class:`Attempt` records, in order.
        batch_size: the size of the attempt that succeeded (``None`` before one did).

    >>> import memguard
    >>> loop = memguard.attempts(batch_size=8)
    >>> for attempt in loop:
    ...     with attempt:
    ...         pass
    >>> loop.batch_size, [a.size for a in loop.history]
    (8, [8])

    """

    @property
    def history(self) -> list[Attempt]:
        """The attempts so far."""
        return self.attempts

    @property
    def batch_size(self) -> Optional[int]:
        """The size that succeeded, once one has."""
        return self.size if self.done else None

    def __repr__(self) -> str:
        count = len(self.attempts)
        state = "done" if self.done else "not done"
        return (f"<AttemptLoop {self.who!r}: batch_size={self.size}, {count} "
                f"attempt{'' if count == 1 else 's'}, {state}>")


def attempts(*, batch_size: int, min_batch_size: int = 1, factor: Factor = 0.5,
             max_attempts: Optional[int] = None,
             on_retry: Optional[Callable[[Attempt], object]] = None, sync: Sync = "auto",
             name: str = "attempts") -> AttemptLoop:
    """Retry a block of code at a smaller batch size when it runs out of memory: the block
    form of :func:`oom_retry`, for code that is not a function.

    Each ``with attempt:`` block runs at ``attempt.batch_size``; an out-of-memory inside it
    (see :func:`is_oom_error`) is recorded and suppressed, the loop frees the memory outside
    the exception handling and the next attempt runs at the smaller size. Any other exception
    leaves the loop untouched. The policy arguments mean what they mean to :func:`oom_retry`.
    Each attempt runs once: entering a block again is a ``RuntimeError``.

    Nested inside another guard's attempt (an ``oom_retry`` function, ``auto_microbatch``,
    another block form), a block form follows the one rule every guard follows (see
    :func:`oom_retry`): the loop made at one line of code is one guard, which walks its sizes
    once per outermost call and, once it has given up, makes a single attempt at that size
    for the rest of that call while the guard around it shrinks.

    Args:
        batch_size: the size of the first attempt.
        min_batch_size: the smallest size tried. Default ``1``.
        factor: the next size is ``floor(size * factor)``; ``"auto"`` measures it; a callable
            ``size -> next size`` decides. Default ``0.5``.
        max_attempts: the most attempts (``None``: until ``min_batch_size``).
        on_retry: called with each failed :class:`Attempt` after the cleanup.
            Default ``None``: nothing is called.
        sync: agree with the other ranks of a distributed job after each attempt.
            Default ``"auto"``.
        name: how logs and errors name the loop. Default ``"attempts"``.

    Returns:
        An iterable of attempts; after the loop, its ``batch_size`` is the size that worked
        and its ``history`` the :class:`Attempt` records.

    Raises:
        OutOfMemoryError: when the attempt at ``min_batch_size`` (or the
            ``max_attempts``-th) runs out of memory too.

    >>> import memguard
    >>> loop = memguard.attempts(batch_size=64)
    >>> for attempt in loop:
    ...     with attempt:
    ...         if attempt.batch_size > 16:
    ...             raise MemoryError("out of memory")
    >>> loop.batch_size, [a.size for a in loop.history]
    (16, [64, 32, 16])
    """
    policy = Policy.checked(name, min_batch_size=min_batch_size, factor=factor,
                            max_attempts=max_attempts, on_retry=on_retry, sync=sync)
    start = policy.check_start(batch_size, name)
    assert start is not None
    # The guard is the place in the code, as a decorated function is its code: a loop made
    # at the same line inside another guard's attempt is the same guard (see Loop: nesting).
    caller = sys._getframe(1)  # noqa: SLF001 - the caller's line
    return AttemptLoop(name, start, policy, owner=("attempts", caller.f_code, caller.f_lineno))
