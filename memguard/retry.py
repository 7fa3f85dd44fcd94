"""``oom_retry``: recover from out-of-memory at a smaller batch, with every rank in step.

The order of things between two attempts is the point of this module. The decision is taken
inside ``except`` (is it an out-of-memory? is there a smaller size left?), and the exception's
finished frames are cleared there; the memory is freed outside it, once the exception object
is no longer referenced: a collection inside ``except`` cannot free what the traceback holds.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import os
import time
from contextvars import ContextVar
from typing import Any, Callable, Optional, TypeVar, Union

from ._checks import optional_positive_int
from ._decorate import function_kind, name_of, with_statistics
from ._events import emit
from ._locks import ForkSafeLock
from ._units import format_bytes
from .backends import level_field, torch_state
from .backends.budget import available as budget_available
from .cleanup import drop_frames, free_memory
from .distributed import FAILED, OK, OOM, Agreement, Sync, check_sync
from .errors import (
    OOM_MESSAGES,
    MemguardError,
    OutOfMemoryError,
    oom_kind,
)
from .history import dump, start_recording, stop_recording
from .sizes import (
    Factor,
    Gauge,
    SizeFile,
    check_path,
    check_policy,
    check_start,
    next_size,
    size_key,
)
from .snapshot import MemorySnapshot, snapshot

log = logging.getLogger("memguard")
F = TypeVar("F", bound=Callable[..., Any])


@dataclasses.dataclass(frozen=True)
class Attempt:
    """One attempt of an ``oom_retry`` call (and one trial of ``find_batch_size``, one retried
    batch of ``map_batches``, one pass of ``auto_microbatch``).

    ``batch_size`` and ``accumulation_steps`` (``None`` unless ``keep_effective_batch``) it ran
    with; ``ok``; ``error``, the out-of-memory's text (or why a peer rank failed); ``seconds``;
    ``memory``, a snapshot taken at the failure, while the failed attempt still held its
    memory (``None`` for a success); ``snapshot_path``, the CUDA memory snapshot written for
    the failure with ``oom_retry(snapshot_dir=...)``; ``next_batch_size``, the size the next
    attempt runs at after this one failed (``None`` for a success, and for a failure after
    which no smaller size was tried).

    >>> from memguard import Attempt
    >>> str(Attempt(64, None, True, None, 0.5, None))
    'batch_size=64: ok in 0.500 s'
    >>> str(Attempt(64, None, False, "out of memory", 0.5, next_batch_size=16))
    'batch_size=64: out of memory after 0.500 s; next batch_size=16'
    """

    batch_size: int
    accumulation_steps: Optional[int]
    ok: bool
    error: Optional[str]
    seconds: float
    memory: Optional[MemorySnapshot] = None
    snapshot_path: Optional[str] = None
    next_batch_size: Optional[int] = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (the snapshot as its own ``to_dict()``)."""
        data = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        data["memory"] = self.memory.to_dict() if self.memory is not None else None
        return data

    def __str__(self) -> str:
        steps = "" if self.accumulation_steps is None else f" x{self.accumulation_steps} steps"
        if self.ok:
            return f"batch_size={self.batch_size}{steps}: ok in {self.seconds:.3f} s"
        upcoming = "" if self.next_batch_size is None else \
            f"; next batch_size={self.next_batch_size}"
        return (f"batch_size={self.batch_size}{steps}: {self.error} after {self.seconds:.3f} s"
                f"{upcoming}")


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
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    line = next((line for line in lines if any(needle in line for _, needle in OOM_MESSAGES)),
                lines[0] if lines else type(exc).__name__)
    if len(line) > 240:
        line = line[:237] + "..."
    return f"out of memory ({oom_kind(exc)}): {line}"


def exhausted(who: str, tried: str, attempts: list[Attempt], minimum: str) -> OutOfMemoryError:
    """The error when every size allowed ran out of memory: ``"{who}: out of memory at every
    {tried}: "`` and each size tried with the memory at its failure."""
    sizes = "; ".join(f"{a.batch_size} ({memory_summary(a.memory)})" for a in attempts)
    return OutOfMemoryError(f"{who}: out of memory at every {tried}: {sizes}. Lower {minimum}, "
                            f"free memory held elsewhere, or use a smaller model", attempts)


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


class _Config:
    def __init__(self, func: Callable[..., Any], batch_size: Optional[int], arg: str,
                 min_batch_size: int, factor: Factor, max_attempts: Optional[int],
                 keep_effective_batch: bool, accumulation_arg: str, cache: Any, sync: Sync,
                 on_retry: Optional[Callable[[Attempt], Any]],
                 snapshot_dir: Optional[str], restore: tuple[Any, ...] = ()) -> None:
        self.name = name_of(func)
        self.func = func
        target = getattr(func, "__func__", func)
        params = inspect.signature(target).parameters
        if arg not in params:
            raise TypeError(f"oom_retry: {self.name}() has no parameter {arg!r} to pass the "
                            f"batch size through; name it with arg=...")
        if keep_effective_batch and accumulation_arg not in params:
            raise TypeError(f"oom_retry: keep_effective_batch needs a parameter "
                            f"{accumulation_arg!r} in {self.name}(); name it with "
                            f"accumulation_arg=...")
        default = params[arg].default
        self.default = None if default is inspect.Parameter.empty else default
        self.batch_size = batch_size
        self.arg = arg
        self.min_batch_size = min_batch_size
        self.factor = factor
        self.max_attempts = max_attempts
        self.keep_effective_batch = keep_effective_batch
        self.accumulation_arg = accumulation_arg
        self.cache = bool(cache)
        self.file = None if isinstance(cache, bool) else SizeFile(cache)
        self.restore = restore
        self.sync = sync
        self.on_retry = on_retry
        self.snapshot_dir = snapshot_dir
        check_sync(sync, "oom_retry")
        if on_retry is not None and not callable(on_retry):
            raise TypeError(f"oom_retry: on_retry must be callable, got {on_retry!r}")


class _State(GuardState):
    """What an ``oom_retry`` function remembers: the working size for each start size, the
    last one that worked, the last call's attempts."""

    def forget(self) -> None:
        self.cache: dict[int, int] = {}
        self.batch_size: Optional[int] = None


class _Nest:
    """The ``oom_retry`` calls running in one context, outermost first, and the size at which
    each guard gave up (while nested) during the outermost call."""

    def __init__(self, states: tuple[_State, ...], gave_up: dict[GuardState, int]) -> None:
        self.states = states
        self.gave_up = gave_up


# Per task and per thread, as contexts are: a guard called by another guard is nested in it.
_NEST: ContextVar[Optional[_Nest]] = ContextVar("memguard_oom_retry_nest", default=None)


def nested_gave_up() -> Optional[dict[GuardState, int]]:
    """Inside an ``oom_retry`` call: the sizes at which guards nested in it gave up during
    its outermost call, by guard state (another guard, ``auto_microbatch``, reads and records
    its own there to walk its sizes once per outermost call); ``None`` outside any.

    >>> nested_gave_up() is None
    True
    """
    nest = _NEST.get()
    return nest.gave_up if nest is not None else None


class _Run:
    """One call of an ``oom_retry`` function: its sizes, attempts and agreement, as one state
    machine that the plain and the async wrapper drive alike (``await`` is all they differ
    by)::

        with _Run(cfg, state, wrapped, args, kwargs) as run:   # close() however it ends
            for call_args, call_kwargs in run:  # from the 2nd: recover(), outside except
                with run.attempt():             # __exit__ decides, inside except
                    run.result = wrapped(*call_args, **call_kwargs)
            return run.result

    ``attempt()``'s ``__exit__`` runs inside the exception handling: it records the failure,
    clears the failed frames, takes the decision and suppresses an out-of-memory that will be
    retried (anything else propagates untouched, with its traceback). The next ``next()`` of
    the loop frees the memory, once the ``with`` block is over and the exception object is no
    longer referenced.
    """

    def __init__(self, cfg: _Config, state: _State, wrapped: Callable[..., Any],
                 args: tuple, kwargs: dict) -> None:
        self.cfg, self.state = cfg, state
        self.bound = inspect.signature(wrapped).bind_partial(*args, **kwargs)
        given = self.bound.arguments.get(cfg.arg)
        requested = given if given is not None else (cfg.batch_size or cfg.default)
        if requested is None:
            raise TypeError(f"{cfg.name}() got no {cfg.arg}: pass it, give the parameter a "
                            f"default, or decorate with oom_retry(batch_size=...)")
        check_start(requested, cfg.min_batch_size, "oom_retry", cfg.arg)
        self.requested: int = requested
        nest = _NEST.get()
        self.nested = nest is not None
        # A call of the function inside its own call (recursion) leaves the sizes, the cache
        # and the history to the outermost call.
        self.recursive = nest is not None and state in nest.states
        self.gave_up = nest.gave_up if nest is not None else {}
        resumed = self.gave_up.get(state)
        self.final = resumed is not None  # it gave up earlier in this outermost call
        with state.lock:
            cached = (state.cache.get(self.requested)
                      if cfg.cache and not self.recursive else None)
        self.key: Optional[str] = None
        if cfg.file is not None and not self.recursive:
            self.key = size_key("oom_retry", cfg.func, self.requested)
            if cached is None:
                stored = cfg.file.get(self.key)
                cached = min(stored, self.requested) if stored is not None else None
                if cached is not None and cached < cfg.min_batch_size:
                    cached = None
        self.agreement = Agreement(cfg.sync)
        self.gauge = Gauge(cfg.name) if cfg.factor == "auto" else None
        self.estimate: Optional[int] = None
        start = min(resumed, self.requested) if resumed is not None else cached
        self.size = self.agreement.smallest(start or self.requested)
        # last: nothing below may raise before the caller's ``with`` owns the copy
        self.saved = (torch_state.copy_states(cfg.restore, budget_available("host"))
                      if cfg.restore and not self.recursive else None)
        self.attempts: list[Attempt] = []
        if not self.recursive:
            state.history = self.attempts
        self.started = 0.0
        self.result: Any = None  # what the attempt that ran last returned
        self.retrying = False  # the last attempt failed: recover before the next one
        self.done = False  # every rank succeeded: the loop is over
        self.recording = bool(cfg.snapshot_dir) and start_recording(100_000)
        self.token = _NEST.set(_Nest((nest.states if nest else ()) + (state,), self.gave_up))

    def __enter__(self) -> _Run:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def close(self) -> None:
        """The call is over, however it ended."""
        self.result = None
        _NEST.reset(self.token)
        if self.saved is not None:
            self.saved.discard()
            self.saved = None
        if self.recording:
            self.recording = False
            stop_recording()

    def _dump(self) -> Optional[str]:
        if not self.recording:
            return None
        name = self.cfg.name.replace("<", "").replace(">", "").replace(".", "-")
        path = os.path.join(str(self.cfg.snapshot_dir),
                            f"{name}-attempt{len(self.attempts) + 1}-{self.cfg.arg}{self.size}"
                            f".pickle")
        return dump(path)

    # -- the loop ---------------------------------------------------------------------------
    def __iter__(self) -> _Run:
        return self

    def __next__(self) -> tuple[tuple, dict]:
        """The next attempt's arguments, after freeing the failed one's memory."""
        if self.done:
            raise StopIteration
        if self.retrying:
            self.retrying = False
            self.recover()
        return self.arguments()

    def attempt(self) -> _Attempting:
        """The ``with`` block around one call of the function."""
        return _Attempting(self)

    # -- one attempt -----------------------------------------------------------------------
    def steps(self) -> Optional[int]:
        if not self.cfg.keep_effective_batch:
            return None
        return math.ceil(self.requested / self.size)

    def arguments(self) -> tuple[tuple, dict]:
        self.bound.arguments[self.cfg.arg] = self.size
        if self.cfg.keep_effective_batch:
            self.bound.arguments[self.cfg.accumulation_arg] = self.steps()
        if self.gauge is not None:
            self.gauge.start()
        self.started = time.perf_counter()
        return self.bound.args, self.bound.kwargs

    def _next_size(self) -> Optional[int]:
        if self.final:
            return None
        if self.cfg.max_attempts is not None and len(self.attempts) >= self.cfg.max_attempts:
            return None
        if self.size <= self.cfg.min_batch_size:
            return None
        upcoming = next_size(self.cfg.factor, self.size, self.cfg.min_batch_size,
                             self.estimate)
        if self.cfg.factor == "auto" or callable(self.cfg.factor):
            upcoming = self.agreement.smallest(upcoming)  # sizes measured per rank
        return upcoming

    def failed(self, exc: BaseException) -> bool:
        """Inside ``except``: record and decide. False: not an out-of-memory, let it go."""
        seconds = time.perf_counter() - self.started
        mine = OOM if oom_kind(exc) is not None else FAILED
        worst, _ = self.agreement.agree(mine, self.size)
        if mine == FAILED:
            return False
        self.attempts.append(failure(exc, self.size, self.steps(), seconds,
                                     snapshot_path=self._dump()))
        emit(f"OOM at {self.cfg.arg}={self.size}")
        if self.gauge is not None:  # while the failed attempt still holds its memory
            self.estimate = self.gauge.size_after(exc, self.size)
        drop_frames(exc)  # before any raise: the error's __cause__ must not keep the frames
        if worst == FAILED:
            raise MemguardError(f"{self.cfg.name}: another rank failed with an error that is "
                                f"not an out-of-memory while this one ran out of memory at "
                                f"{self.cfg.arg}={self.size}; see that rank's log") from exc
        self._decide(exc)
        return True

    def returned(self) -> None:
        """After a return: done when every rank succeeded too, else drop the result and
        retry (or raise)."""
        seconds = time.perf_counter() - self.started
        worst, _ = self.agreement.agree(OK, self.size)
        if worst == OK:
            self.attempts.append(Attempt(self.size, self.steps(), True, None, seconds))
            self.done = True
            if self.recursive:
                return
            with self.state.lock:
                self.state.batch_size = self.size
                if self.cfg.cache:
                    self.state.cache[self.requested] = self.size
            if self.cfg.file is not None and self.key is not None:
                self.cfg.file.put(self.key, self.size)
            return
        self.result = None
        why = ("another rank ran out of memory" if worst == OOM else
               "another rank failed with an error that is not an out-of-memory")
        self.attempts.append(Attempt(self.size, self.steps(), False, why, seconds,
                                     safe_snapshot()))
        if worst == FAILED:
            raise MemguardError(f"{self.cfg.name}: {why}; see that rank's log")
        self.estimate = None  # nothing measured here: "auto" halves
        self._decide(None)

    def _decide(self, exc: Optional[BaseException]) -> None:
        """After a failed attempt (recorded last): the size of the next one, or the error."""
        upcoming = self._next_size()
        if upcoming is None:
            if self.nested:
                self.gave_up[self.state] = self.size
            error = exhausted(self.cfg.name, f"{self.cfg.arg} tried", self.attempts,
                              "min_batch_size")
            if exc is not None:
                raise error from exc
            raise error
        self.attempts[-1] = dataclasses.replace(self.attempts[-1], next_batch_size=upcoming)
        self.size = upcoming
        self.retrying = True

    # -- between attempts ------------------------------------------------------------------
    def recover(self) -> None:
        """Outside ``except``: free the failed attempt's memory, log, call ``on_retry``."""
        freed = free_memory()
        if self.saved is not None:
            self.saved.load()  # the next attempt starts from the state the first one did
        last = self.attempts[-1]
        log.warning("%s: %s at %s=%d; %s; freed %s; retrying at %s=%d",
                    self.cfg.name, last.error, self.cfg.arg, last.batch_size,
                    memory_summary(last.memory), format_bytes(freed), self.cfg.arg, self.size)
        if self.cfg.on_retry is not None:
            self.cfg.on_retry(last)


class _Attempting:
    """The ``with`` block around one attempt (see :class:`_Run`)."""

    __slots__ = ("run",)

    def __init__(self, run: _Run) -> None:
        self.run = run

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Optional[type], exc: Optional[BaseException],
                 traceback: Any) -> bool:
        """Inside the exception handling: True suppresses an out-of-memory to retry."""
        if exc is None:
            self.run.returned()
            return False
        return self.run.failed(exc)


def safe_snapshot() -> Optional[MemorySnapshot]:
    """A snapshot, or ``None`` when reading fails (at an out-of-memory, say)."""
    try:
        return snapshot()
    except Exception:  # noqa: BLE001 - a reading must never mask the out-of-memory
        return None


def failure(exc: BaseException, batch_size: int, steps: Optional[int], seconds: float,
            next_batch_size: Optional[int] = None,
            snapshot_path: Optional[str] = None) -> Attempt:
    """The record of an attempt that ran out of memory with ``exc``, made inside ``except``
    while it still holds its memory: the error's text and a snapshot of the memory."""
    return Attempt(batch_size, steps, False, error_text(exc), seconds, safe_snapshot(),
                   snapshot_path, next_batch_size)


def _wrap(func: F, cfg: _Config) -> F:
    """The wrapt wrapper, with the statistics reachable on the decorated function."""
    state = _State()
    kind = function_kind(func)
    if kind not in ("sync", "async"):
        raise TypeError(f"oom_retry cannot decorate {kind} function {cfg.name}; it takes "
                        f"plain and async functions and methods")

    def sync_wrapper(wrapped, instance, args, kwargs):  # type: ignore[no-untyped-def]
        with _Run(cfg, state, wrapped, args, kwargs) as run:
            for call_args, call_kwargs in run:
                with run.attempt():
                    run.result = wrapped(*call_args, **call_kwargs)
            return run.result

    async def async_wrapper(wrapped, instance, args, kwargs):  # type: ignore[no-untyped-def]
        with _Run(cfg, state, wrapped, args, kwargs) as run:
            for call_args, call_kwargs in run:
                with run.attempt():
                    run.result = await wrapped(*call_args, **call_kwargs)
            return run.result

    return with_statistics(
        func, async_wrapper if kind == "async" else sync_wrapper,
        {"history": (lambda: state.history, "The last call's attempts."),
         "batch_size": (lambda: state.batch_size,
                        "The last size that worked (None before any success).")},
        state.reset)


def oom_retry(func: Optional[F] = None, /, *, batch_size: Optional[int] = None,
              arg: str = "batch_size", min_batch_size: int = 1, factor: Factor = 0.5,
              max_attempts: Optional[int] = None, keep_effective_batch: bool = False,
              accumulation_arg: str = "accumulation_steps",
              cache: Union[bool, str, "os.PathLike[str]"] = True,
              sync: Sync = "auto", on_retry: Optional[Callable[[Attempt], Any]] = None,
              snapshot_dir: Optional[str] = None, restore: Any = None) -> Any:
    """Retry the decorated function at a smaller batch size when it runs out of memory.

    The batch size travels through the parameter ``arg``. A call starts at the caller's value,
    else ``batch_size``, else the parameter's default; with ``cache=True`` at the size that
    last worked for that same start. On an out-of-memory (see :func:`is_oom_error`) the
    failed attempt's frames are cleared, garbage is collected and every cache emptied, and the
    next attempt runs at ``max(min_batch_size, floor(size * factor))``; any other exception
    propagates untouched. ``factor="auto"`` measures instead: the failed attempt took
    ``used`` bytes of the budget that binds on the device that ran out (a ``memory_limit``, a
    soft ``RLIMIT_AS``, a cgroup's ``memory.max``, CUDA's free plus reserved-but-unused
    memory) before an allocation of ``asked`` bytes failed (the size torch's, TensorFlow's
    and numpy's messages state), where ``available`` bytes were free when it began; the next
    size is ``size * available * 0.95 / (used + asked)``, kept between ``size * 0.25`` and
    ``size * 0.9`` (halving when the message states no size). ``factor`` may also be a
    callable ``size -> next size``; what it returns must be a positive int below ``size``
    (else ``ValueError`` naming the value).

    ``restore=(model, optimizer, ...)``: objects with ``state_dict``/``load_state_dict``
    (modules, optimizers, LR schedulers, a ``GradScaler``) whose state, with a module's
    gradients, is copied to host memory when the call begins (to a temporary file when
    larger than half the host's available memory) and loaded back before each retry, so
    every attempt starts from the state the first one did.

    ``cache`` may be a file path: the working sizes are then also kept in that JSON file,
    keyed by the function's qualified name, the start size and the device (name and total
    memory), written atomically under a lock so that several ranks or processes may share
    it; a restarted job starts at the size that worked. A corrupt or unreadable file is a
    warning. When the attempt at ``min_batch_size`` (or the ``max_attempts``-th)
    fails too, :class:`OutOfMemoryError` lists every size tried with the memory at each
    failure. ``keep_effective_batch=True`` also passes ``accumulation_arg =
    ceil(start / size)`` so that ``size * steps >= start`` (BatchNorm statistics still see
    the smaller batches). Each retry is logged at WARNING; ``on_retry(attempt)`` runs after
    the cleanup, before the next attempt.

    In a distributed job (``sync="auto"`` with more than one rank, or ``sync=True``) every
    rank reports after each attempt on a gloo group of memguard's own: if any rank ran out of
    memory, all retry at the same smaller size, and all finish at the same size after the
    same number of attempts. A ``tf.function`` retraces for each new batch shape.

    Nested guards (a decorated function called, directly or not, by another one, or by
    itself): the innermost guard that can still shrink owns an out-of-memory. Once it has
    given up, the guard around it receives the :class:`OutOfMemoryError` and retries at its
    own smaller size; for the rest of that outermost call the guard that gave up makes a
    single attempt per call, at the size it gave up at, and passes an out-of-memory straight
    on as :class:`OutOfMemoryError`. So each guard walks its sizes once per outermost call: a
    body that never fits runs ``inner + outer - 1`` times (7 + 6 - 1 = 12 for sizes 64..1
    inside 32..1), not ``inner * outer``. In a recursion only the outermost call reads and
    records sizes (``batch_size``, the cache, ``history``); inner calls start at the size
    they are given. Nesting is tracked per thread and per asyncio task.

    With ``snapshot_dir`` CUDA allocations are recorded during the call and a memory snapshot
    is written there for each failed attempt (see :func:`record_history`).

    The decorated function exposes ``history`` (the last call's :class:`Attempt` records),
    ``batch_size`` (the last working size) and ``reset()``.

    >>> import memguard
    >>> @memguard.oom_retry(batch_size=256)
    ... def train(batch_size):
    ...     return batch_size
    >>> train()
    256
    >>> train.history[-1].ok
    True
    """
    check_start(batch_size, min_batch_size, "oom_retry")
    factor = check_policy(factor)
    optional_positive_int(max_attempts, "max_attempts")
    if not isinstance(cache, bool):
        cache = check_path(cache)
    objects = torch_state.check_restorable(restore)

    def decorate(f: F) -> F:
        cfg = _Config(f, batch_size, arg, min_batch_size, factor, max_attempts,
                      keep_effective_batch, accumulation_arg, cache, sync, on_retry,
                      snapshot_dir, objects)
        return _wrap(f, cfg)

    return decorate if func is None else decorate(func)
