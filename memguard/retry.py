"""``oom_retry``: a function retried at a smaller batch size when it runs out of memory, every
rank of a distributed job in step. A driver over :class:`memguard.loop.Loop`: what it adds
is where the size comes from (an argument, the function's default, the size that worked
before, a size file) and what each retry starts from (``restore=``)."""

from __future__ import annotations

import inspect
import logging
import math
import os
import time
import types
from typing import (
    Any,
    Callable,
    Concatenate,
    Literal,
    Optional,
    ParamSpec,
    Protocol,
    TypeVar,
    Union,
    overload,
)

from ._decorate import function_kind, name_of, with_statistics
from .backends.budget import available as budget_available, device_identity
from .backends.steps import torch_state
from .backends.torch_distributed import world
from .distributed import Sync
from .errors import oom_kind
from .history import dump, start_recording, stop_recording
from .loop import (
    Attempt,
    Factor,
    GuardState,
    Loop,
    Policy,
    enter_first,
    leave_first,
    running_here,
    succeeded,
)
from .sizefile import SizeFile, check_path, size_key

log = logging.getLogger("memguard")
P = ParamSpec("P")
Q = ParamSpec("Q")
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)
S = TypeVar("S")
W = TypeVar("W")
RestoreTo = Literal["auto", "memory", "file"]


class RetryingFunction(Protocol[P, R_co]):
    """What ``@oom_retry`` returns: the function, called as before (the batch size may be
    left out: the decorator passes it), returning what it returns, with its statistics.

    For a type checker it keeps the decorated function's parameters ``P`` and return type
    ``R_co``: a call is checked against them, a method's ``self`` is bound, and a call with
    no argument at all (the size, the only parameter, left to the decorator) is accepted too.
    A function with other parameters whose size parameter has no default is called with the
    size given, or declares a default for it (``batch_size: int = 64``).

    Attributes:
        history: the last call's :class:`Attempt` records.
        batch_size: the last size that worked (``None`` before any success).

    >>> import memguard
    >>> @memguard.oom_retry(batch_size=4)
    ... def train(batch_size):
    ...     return batch_size * 2
    >>> train(), train.batch_size, [a.size for a in train.history]
    (8, 4, [4])

    """

    @overload
    def __call__(self) -> R_co: ...
    @overload
    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R_co: ...

    # a decorated method, read from an instance, is bound as the function would be
    @overload
    def __get__(self: W, instance: None, owner: Any, /) -> W: ...
    @overload
    def __get__(self: RetryingFunction[Concatenate[S, Q], R], instance: S, owner: Any, /
                ) -> RetryingFunction[Q, R]: ...

    @property
    def history(self) -> list[Attempt]: ...

    @property
    def batch_size(self) -> Optional[int]: ...

    def reset(self) -> None:
        """Forget the sizes that worked (with ``cache=path``, this function's entries for
        this device in that file too) and the last call's attempts: the next call starts
        afresh."""


class _Config:
    def __init__(self, func: Callable[..., Any], batch_size: Optional[int], arg: str,
                 policy: Policy, keep_effective_batch: bool, accumulation_arg: str,
                 cache: Any, cuda_snapshot_dir: Optional[str], restore: tuple[Any, ...]) -> None:
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
        self.policy = policy
        self.keep_effective_batch = keep_effective_batch
        self.accumulation_arg = accumulation_arg
        self.cache = bool(cache)
        self.file = None if isinstance(cache, bool) else SizeFile(cache)
        self.restore = restore
        self.cuda_snapshot_dir = cuda_snapshot_dir
        # a call that nothing else surrounds may take _first_pass: none of these needs the
        # loop before an attempt fails
        self.quick = (self.file is None and not restore and not cuda_snapshot_dir
                      and not keep_effective_batch and policy.factor != "auto"
                      and policy.sync is not True)
        # the plain function's position of ``arg``: (function, its code and defaults, the
        # position); ``most``: how many parameters it has
        self._position: Optional[tuple[Any, tuple, int]] = None
        self.most = 0
        self.after: list[frozenset[str]] = []  # the names a keyword may take after n positional
        # the last signature computed: (function, bound, what it was computed from, the
        # signature, its parameters' names where every one is positional-or-keyword)
        self._signature: Optional[tuple[Any, bool, tuple, inspect.Signature,
                                        Optional[tuple[str, ...]]]] = None

    def start(self, bound: Union[inspect.BoundArguments, _PlainBinding]) -> tuple[Any, int]:
        """The size the call asks for, as given (a cache key) and checked."""
        given = bound.arguments.get(self.arg)
        requested = given if given is not None else (self.batch_size or self.default)
        return requested, self.checked(requested)

    def checked(self, requested: Any) -> int:
        """The size a call asks for (``requested``: what it gave, else the decorator's or
        the parameter's default) checked."""
        if requested is None:
            raise TypeError(f"oom_retry: {self.name}() got no {self.arg}: pass it, give the "
                            f"parameter a default, or decorate with oom_retry(batch_size=...)")
        start = self.policy.check_start(requested, "oom_retry", self.arg)
        assert start is not None
        return start

    def position(self, wrapped: Callable[..., Any]) -> Optional[int]:
        """The position of ``arg`` among the parameters of ``wrapped`` where it is the plain
        function decorated (no method, ``__signature__`` or ``__wrapped__``) and every one of
        them is positional-or-keyword (:attr:`most` of them, :attr:`after` the names left
        to keywords after each count of positional arguments); else ``None``. Checked against
        the function's code and defaults at each call, as :meth:`signature` is."""
        known = self._position
        if known is not None and known[0] is wrapped:
            code, defaults, kwdefaults = known[1]
            if code is wrapped.__code__ and defaults is wrapped.__defaults__ \
                    and kwdefaults is wrapped.__kwdefaults__ \
                    and "__signature__" not in wrapped.__dict__ \
                    and "__wrapped__" not in wrapped.__dict__:
                return known[2]
        if type(wrapped) is not types.FunctionType:
            return None
        names = self.signature(wrapped)[1]
        if names is None or self.arg not in names:
            return None
        index = names.index(self.arg)
        self.most = len(names)
        self.after = [frozenset(names[given:]) for given in range(len(names) + 1)]
        self._position = (wrapped, (wrapped.__code__, wrapped.__defaults__,
                                    wrapped.__kwdefaults__), index)
        return index

    def signature(self, wrapped: Callable[..., Any]
                  ) -> tuple[inspect.Signature, Optional[tuple[str, ...]]]:
        """``inspect.signature(wrapped)`` and, where every parameter is positional-or-keyword,
        their names; computed once per plain function or method of one (it costs ~8 us a
        call, a third of the guard's) and kept while the function's code, defaults and
        keyword defaults are those it was computed from. A callable of another kind, or one
        that names another signature (``__signature__``, ``__wrapped__``), is asked every
        call."""
        bound = isinstance(wrapped, types.MethodType)
        func: Any = wrapped.__func__ if isinstance(wrapped, types.MethodType) else wrapped
        if type(func) is not types.FunctionType or "__signature__" in func.__dict__ \
                or "__wrapped__" in func.__dict__:
            return inspect.signature(wrapped), None
        known = self._signature
        if known is not None and known[0] is func and known[1] == bound:
            code, defaults, kwdefaults = known[2]
            if code is func.__code__ and defaults is func.__defaults__ \
                    and kwdefaults is func.__kwdefaults__:
                return known[3], known[4]
        source = (func.__code__, func.__defaults__, func.__kwdefaults__)
        signature = inspect.signature(wrapped)
        plain = all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
                    for p in signature.parameters.values())
        names = tuple(signature.parameters) if plain else None
        self._signature = (func, bound, source, signature, names)
        return signature, names

    def bind(self, wrapped: Callable[..., Any], args: tuple, kwargs: dict
             ) -> Union[inspect.BoundArguments, _PlainBinding]:
        """``inspect.signature(wrapped).bind_partial(*args, **kwargs)``; for a signature of
        positional-or-keyword parameters and a call that binds (no extra or repeated
        argument), the same binding made directly."""
        signature, names = self.signature(wrapped)
        if names is not None and len(args) <= len(names):
            rest = names[len(args):]
            if not kwargs or kwargs.keys() <= set(rest):
                arguments = dict(zip(names, args, strict=False))  # args may be fewer
                for name in rest:
                    if name in kwargs:
                        arguments[name] = kwargs[name]
                return _PlainBinding(names, arguments)
        return signature.bind_partial(*args, **kwargs)


class _PlainBinding:
    """What ``Signature.bind_partial`` gives for a signature whose parameters are all
    positional-or-keyword, made without inspect's walk over every parameter kind: the
    ``arguments`` in parameter order; :meth:`split` gives the call's ``args`` and
    ``kwargs`` as ``BoundArguments`` has them."""

    __slots__ = ("names", "arguments")

    def __init__(self, names: tuple[str, ...], arguments: dict[str, Any]) -> None:
        self.names = names
        self.arguments = arguments

    def split(self) -> tuple[tuple, dict[str, Any]]:
        """``(args, kwargs)``: the values up to the first parameter not given, and those
        after it, in one pass over the names."""
        arguments, names = self.arguments, self.names
        count = 0
        for name in names:
            if name not in arguments:
                break
            count += 1
        if count == len(names):
            return tuple(map(arguments.__getitem__, names)), {}
        return (tuple(map(arguments.__getitem__, names[:count])),
                {name: arguments[name] for name in names[count:] if name in arguments})


def _call_arguments(bound: Union[inspect.BoundArguments, _PlainBinding]
                    ) -> tuple[tuple, dict[str, Any]]:
    """The ``args`` and ``kwargs`` a binding calls the function with."""
    if isinstance(bound, _PlainBinding):
        return bound.split()
    return bound.args, bound.kwargs


class _State(GuardState):
    """What an ``oom_retry`` function remembers: the working size for each start size, the
    last one that worked, the last call's attempts (and, with ``cache=path``, the sizes in
    that file)."""

    def __init__(self, cfg: _Config) -> None:
        self.cfg = cfg
        # the last call's attempts; (size, seconds) for a call whose first attempt
        # succeeded, its record made when asked for
        self.last: Union[list[Attempt], tuple[int, float]] = []
        # the record made for such a call: (its tuple, the history); only ever written
        # here, so a reader that made it late never replaces a newer call's attempts
        self._made: tuple[Any, list[Attempt]] = ((), [])
        super().__init__()

    @property
    def history(self) -> list[Attempt]:
        last = self.last
        if not isinstance(last, tuple):
            return last
        made = self._made
        if made[0] is not last:
            made = self._made = (last, [succeeded(last[0], "batch", None, last[1])])
        return made[1]

    @history.setter
    def history(self, attempts: list[Attempt]) -> None:
        self.last = attempts

    def forget(self) -> None:
        self.cache: dict[int, int] = {}
        self.batch_size: Optional[int] = None

    def reset(self) -> None:
        """Forget the sizes that worked (in this process, and with ``cache=path`` this
        function's entries for this device in that file) and the last call's attempts: the
        next call starts afresh, at its start size."""
        super().reset()
        if self.cfg.file is not None:
            # every start size and factor of this function's code on this device
            prefix = size_key("oom_retry", self.cfg.func, 0).split(" start=")[0] + " start="
            suffix = f" on {device_identity()}"
            self.cfg.file.forget(lambda key: not (key.startswith(prefix)
                                                  and key.endswith(suffix)))


class _Run(Loop):
    """One call of an ``oom_retry`` function: the loop, with the size read from the call and
    the caches, the state restored before each retry and the size that worked kept."""

    def __init__(self, cfg: _Config, state: _State, wrapped: Callable[..., Any],
                 args: tuple, kwargs: dict) -> None:
        self.cfg, self.state = cfg, state
        self.bound = cfg.bind(wrapped, args, kwargs)
        requested, start = cfg.start(self.bound)
        self.requested: int = start  # an int, whatever integral number was passed
        super().__init__(cfg.name, start, cfg.policy, owner=state)
        # A call of the function inside its own call (recursion) leaves the sizes, the cache
        # and the history to the outermost call.
        self.key: Optional[str] = None
        cached = None
        if not self.recursive:
            with state.lock:
                cached = state.cache.get(requested) if cfg.cache else None
                state.history = self.attempts
            if cfg.file is not None:
                self.key = size_key("oom_retry", cfg.func, requested, factor=cfg.policy.factor)
                if cached is None:
                    stored = cfg.file.get(self.key)
                    if stored is not None and stored >= cfg.policy.min_batch_size:
                        cached = min(stored, requested)
        if cached is not None and not self.final:
            self.size = cached
        self.size = self.agreement.smallest(self.size)
        self.worked = self.size  # the size that worked, as the recursion below it says
        # a recursion's records of the running attempt: (start, size that worked, records)
        self.inner: list[tuple[int, int, list[Attempt]]] = []
        self.result: Any = None  # what the attempt that ran last returned
        self.saved: Any = None
        self.recording = False
        # last: nothing below may raise before the caller's ``with`` owns the copy
        if cfg.restore and not self.recursive:
            self.saved = torch_state.copy_states(cfg.restore, budget_available("host"))
        self.recording = bool(cfg.cuda_snapshot_dir) and start_recording(100_000)

    def __enter__(self) -> _Run:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        """The call is over, however it ended."""
        self.result = None
        if self.saved is not None:
            self.saved.discard()
            self.saved = None
        if self.recording:
            self.recording = False
            stop_recording()

    def arguments(self) -> tuple[tuple, dict]:
        """The call's arguments at the current size."""
        bound, cfg = self.bound, self.cfg
        bound.arguments[cfg.arg] = self.size
        if cfg.keep_effective_batch:
            bound.arguments[cfg.accumulation_arg] = self.steps()
        return _call_arguments(bound)

    # -- the loop's hooks ------------------------------------------------------------------
    def steps(self) -> Optional[int]:
        if not self.cfg.keep_effective_batch:
            return None
        return math.ceil(self.requested / self.size)

    def snapshot_path(self) -> Optional[str]:
        if not self.recording:
            return None
        name = self.cfg.name.replace("<", "").replace(">", "").replace(".", "-")
        return dump(os.path.join(str(self.cfg.cuda_snapshot_dir),
                                 f"{name}-attempt{len(self.attempts) + 1}-{self.cfg.arg}"
                                 f"{self.size}.pickle"))

    def recover(self, retrying: bool) -> int:
        self.result = None
        freed = super().recover(retrying)
        if retrying and self.saved is not None:
            self.saved.load()  # the next attempt starts from the state the first one did
        return freed

    def _begin(self) -> None:
        self.inner = []
        super()._begin()

    def record_success(self, seconds: float) -> None:
        """The attempt succeeded; when the function called itself inside it and those calls
        had to shrink, what they ran at is what worked: their records stand for this
        attempt's, and the size that worked shrinks as theirs did (their own start to what
        worked)."""
        inner, self.inner = self.inner, []
        if not any(len(records) > 1 for _, _, records in inner):
            self.worked = self.size
            super().record_success(seconds)
            return
        self.worked = _through(self.size, inner, self.attempts)

    def after_ok(self) -> None:
        if self.recursive:  # the call around this one in the recursion reports it
            if isinstance(self.parent, _Run):
                self.parent.inner.append((self.requested, self.worked, self.attempts))
            return None
        _keep(self.cfg, self.state, self.requested, self.worked)
        if self.cfg.file is not None and self.key is not None:
            self.cfg.file.put(self.key, self.worked)
        return None


def _through(size: int, inner: list[tuple[int, int, list[Attempt]]],
             records: list[Attempt]) -> int:
    """The size that worked for an attempt at ``size`` inside which the function called
    itself and those calls had to shrink (``inner``: their start, the size that worked and
    their records): their records stand for the attempt's (added to ``records``), and the
    size shrinks as theirs did (their own start to what worked)."""
    worked = size
    for start, inner_worked, inner_records in inner:
        records.extend(inner_records)
        worked = min(worked, max(1, size * inner_worked // start))
    return worked


def _keep(cfg: _Config, state: _State, requested: Any, worked: int) -> None:
    """Remember ``worked`` as the last size that worked (for the start ``requested``)."""
    with state.lock:
        state.batch_size = worked
        if cfg.cache:
            state.cache[requested] = worked


def _first_pass(cfg: _Config, state: _State, wrapped: Callable[..., Any], args: tuple,
                kwargs: dict) -> tuple[bool, Any]:
    """The first attempt of a call that no other guard's attempt surrounds, on one rank,
    without the loop's objects (the common case: a call that fits, where the loop would
    cost several times what this does): ``(True, what the call returned)``, or ``(False,
    the loop)`` after an out-of-memory, which the loop has recorded as its first attempt's
    and goes on from. Any other exception propagates, as the loop would let it."""
    index = cfg.position(wrapped)
    requested: Any = None
    if index is not None and len(args) <= cfg.most \
            and (not kwargs or kwargs.keys() <= cfg.after[len(args)]):
        # a plain function called as it binds: its size read where it stands
        given = args[index] if len(args) > index else kwargs.get(cfg.arg)
        requested = given if given is not None else (cfg.batch_size or cfg.default)
        if type(requested) is not int or requested < cfg.policy.min_batch_size:
            index = None  # checked as the loop checks it, its error the same
    else:
        index = None  # bound as the loop binds it: a call that does not bind raises there
    if index is None:
        bound = cfg.bind(wrapped, args, kwargs)
        requested, start = cfg.start(bound)
    else:
        start = requested
    cached = state.cache.get(requested) if cfg.cache else None  # one read: no lock needed
    size = start if cached is None else cached
    if index is None:
        bound.arguments[cfg.arg] = size
        call_args, call_kwargs = _call_arguments(bound)
    elif len(args) > index:
        call_args, call_kwargs = (*args[:index], size, *args[index + 1:]), kwargs
    else:  # by name: the same call to a plain function
        call_args, call_kwargs = args, {**kwargs, cfg.arg: size}
    recursion = _Run.__new__(_Run)  # what a call of the function inside this one reports to
    recursion.inner = []
    state.last = []
    started = time.perf_counter()
    entry = enter_first(state, recursion)
    try:
        result = wrapped(*call_args, **call_kwargs)
    except BaseException as exc:
        leave_first(entry)
        if not isinstance(exc, Exception) or oom_kind(exc) is None:
            raise
        run = _Run(cfg, state, wrapped, args, kwargs)
        run.size = run.worked = size
        run.gave_up, run.started = entry.gave_up, started
        if not run._exit(exc):  # noqa: SLF001 - the loop's first attempt, run here
            raise
        return False, run
    seconds = time.perf_counter() - started
    leave_first(entry)
    inner = recursion.inner
    if inner and any(len(inner_records) > 1 for _, _, inner_records in inner):
        records: list[Attempt] = []
        worked = _through(size, inner, records)
        state.last = records
    else:
        worked = size
        state.last = (size, seconds)
    _keep(cfg, state, requested, worked)
    return True, result


def _wrap(func: Callable[..., Any], cfg: _Config) -> Any:
    """The wrapt wrapper, with the statistics reachable on the decorated function."""
    state = _State(cfg)
    kind = function_kind(func)
    if kind not in ("sync", "async"):
        raise TypeError(f"oom_retry cannot decorate {kind} function {cfg.name}; it takes "
                        f"plain and async functions and methods")

    def sync_wrapper(wrapped, instance, args, kwargs):  # type: ignore[no-untyped-def]
        if cfg.quick and not running_here() and (cfg.policy.sync is False or world() is None):
            # no guard around the call, one rank (a group of one takes the loop: rare)
            done, outcome = _first_pass(cfg, state, wrapped, args, kwargs)
            if done:
                return outcome
            loop = outcome
        else:
            loop = _Run(cfg, state, wrapped, args, kwargs)
        with loop as run:
            for attempt in run:
                with attempt:
                    call_args, call_kwargs = run.arguments()
                    run.result = wrapped(*call_args, **call_kwargs)
            return run.result

    async def async_wrapper(wrapped, instance, args, kwargs):  # type: ignore[no-untyped-def]
        with _Run(cfg, state, wrapped, args, kwargs) as run:
            for attempt in run:
                with attempt:
                    call_args, call_kwargs = run.arguments()
                    run.result = await wrapped(*call_args, **call_kwargs)
            return run.result

    return with_statistics(
        func, async_wrapper if kind == "async" else sync_wrapper,
        {"history": (lambda: state.history, "The last call's attempts."),
         "batch_size": (lambda: state.batch_size,
                        "The last size that worked (None before any success).")},
        state.reset)


@overload
def oom_retry(func: Callable[P, R], /) -> RetryingFunction[P, R]: ...


@overload
def oom_retry(func: None = None, /, *, batch_size: Optional[int] = None,
              arg: str = "batch_size", min_batch_size: int = 1, factor: Factor = 0.5,
              max_attempts: Optional[int] = None,
              on_retry: Optional[Callable[[Attempt], object]] = None, sync: Sync = "auto",
              keep_effective_batch: bool = False,
              accumulation_arg: str = "accumulation_steps",
              cache: Union[bool, str, "os.PathLike[str]"] = True,
              cuda_snapshot_dir: Optional[str] = None, restore: Any = None,
              restore_to: RestoreTo = "auto"
              ) -> Callable[[Callable[P, R]], RetryingFunction[P, R]]: ...


def oom_retry(func: Optional[Callable[P, R]] = None, /, *,
              batch_size: Optional[int] = None, arg: str = "batch_size",
              min_batch_size: int = 1, factor: Factor = 0.5,
              max_attempts: Optional[int] = None,
              on_retry: Optional[Callable[[Attempt], object]] = None, sync: Sync = "auto",
              keep_effective_batch: bool = False,
              accumulation_arg: str = "accumulation_steps",
              cache: Union[bool, str, "os.PathLike[str]"] = True,
              cuda_snapshot_dir: Optional[str] = None, restore: Any = None,
              restore_to: RestoreTo = "auto"
              ) -> Union[RetryingFunction[P, R],
                         Callable[[Callable[P, R]], RetryingFunction[P, R]]]:
    """Retry the decorated function at a smaller batch size when it runs out of memory.

    The batch size travels through the parameter ``arg``. A call starts at the caller's value,
    else ``batch_size``, else the parameter's default; with ``cache`` at the size that last
    worked for that same start. On an out-of-memory (see :func:`is_oom_error`) the failed
    attempt's frames are cleared, garbage is collected and every cache emptied (outside the
    exception handling), and the next attempt runs at a smaller size; any other exception
    propagates untouched. The policy arguments (``min_batch_size``, ``factor``,
    ``max_attempts``, ``on_retry``, ``sync``) mean the same to :func:`map_batches`,
    :func:`auto_microbatch`, :func:`find_batch_size` and :func:`attempts`.

    ``factor="auto"`` measures instead of halving: the failed attempt took ``used`` bytes of
    the budget that binds on the device that ran out (a ``memory_limit``, a soft
    ``RLIMIT_AS``, a cgroup's ``memory.max``, CUDA's free plus reserved-but-unused memory)
    before an allocation of ``asked`` bytes failed, where ``available`` bytes were free when
    it began; the next size is ``size * available * 0.95 / (used + asked)``, kept between
    ``size * 0.25`` and ``size * 0.9`` (halving when the message states no size).

    Nested guards (a decorated function called, directly or not, by another one, or by
    itself, and ``auto_microbatch`` steps inside one): the innermost guard that can still
    shrink owns an out-of-memory. Once it has given up, the guard around it receives the
    :class:`OutOfMemoryError` and retries at its own smaller size; for the rest of that
    outermost call the guard that gave up makes a single attempt per call, at the size it
    gave up at. So each guard walks its sizes once per outermost call: a body that never fits
    runs ``inner + outer - 1`` times (7 + 6 - 1 = 12 for sizes 64..1 inside 32..1), not
    ``inner * outer``. The same holds for the block form, :func:`attempts`, whose guard is
    the line of code that made it. In a recursion only the outermost call reads and records
    sizes; when the calls inside it had to shrink, their records stand for its attempt and
    the size it records is what they ran at (scaled by their start: a call at 16 whose inner
    call started at 16 and worked at 2 records 2).

    In a distributed job (``sync="auto"`` with more than one rank, or ``sync=True``) every
    rank reports after each attempt on a gloo group of memguard's own: if any rank ran out of
    memory, all retry at the same smaller size, and all finish at the same size after the
    same number of attempts. A ``tf.function`` retraces for each new batch shape.

    Args:
        func: the function to decorate, for the bare ``@oom_retry``; left out when the
            decorator is given arguments. Default ``None``.
        batch_size: the size to start at when the call passes none (else the parameter's
            default).
        arg: the parameter the size is passed through. Default ``"batch_size"``.
        min_batch_size: the smallest size tried. Default ``1``.
        factor: the next size is ``max(min_batch_size, floor(size * factor))``; ``"auto"``
            measures it (above); a callable ``size -> next size`` must return a positive
            integral number below ``size`` (else ``ValueError`` naming the value).
            Default ``0.5``.
        max_attempts: the most attempts in one call (``None``: until ``min_batch_size``).
        on_retry: called with the failed :class:`Attempt` after the cleanup, before the next
            attempt. Default ``None``: nothing is called.
        sync: agree with the other ranks of a distributed job (``"auto"``, ``True``,
            ``False``).
        keep_effective_batch: also pass ``accumulation_arg = ceil(start / size)`` so that
            ``size * steps >= start`` (BatchNorm statistics still see the smaller batches).
            Default ``False``.
        accumulation_arg: the parameter the accumulation steps are passed through.
            Default ``"accumulation_steps"``.
        cache: ``True``: start later calls of this process at the size that worked for the
            same start; ``False``: always start at the start size; a file path: also keep
            the sizes in that JSON file, shared by processes, ranks and restarted jobs,
            keyed by the function's code (``memguard.sizefile.code_identity``), the start
            size, ``factor`` and the device (written atomically under a lock; a file that is
            not memguard's is never written, a warning says why); ``reset()`` forgets this
            function's entries for this device there too.
        cuda_snapshot_dir: record CUDA allocations during the call and write PyTorch's
            memory snapshot of the allocator there for each failed attempt (see
            :func:`record_history`; :func:`snapshot` is memguard's reading of every device).
            Default ``None``: no snapshot.
        restore: objects with ``state_dict``/``load_state_dict`` (modules, optimizers, LR
            schedulers, a ``GradScaler``), Keras models (with their compiled optimizer's
            variables) and Keras optimizers, whose state, with a module's gradients, is
            copied when the call begins and loaded back before each retry, so every attempt
            starts from the state the first one did. Copying or restoring that runs out of
            memory raises :class:`OutOfMemoryError` saying what it needed (chained to the
            framework's error; a copy to host memory suggests ``restore_to="file"``).
            Default ``None``: nothing is restored.
        restore_to: where that copy is kept: ``"memory"`` (host memory, as fast as a tensor
            copy; the state's size held for the whole call), ``"file"`` (a temporary file in
            ``TMPDIR``, written one tensor at a time and read straight back into place: no
            second copy in host memory, at the cost of writing the state once per call and
            reading it once per retry at the disk's speed), ``"auto"`` (the file when the
            state exceeds half the host's available memory).

    Returns:
        The decorated function (a :class:`RetryingFunction`): it returns what the attempt
        that worked returned, and exposes ``history`` (the last call's :class:`Attempt`
        records), ``batch_size`` (the last working size) and ``reset()``.

    Raises:
        OutOfMemoryError: when the attempt at ``min_batch_size`` (or the
            ``max_attempts``-th) fails too; it lists every size tried with the memory at
            each failure.

    >>> import memguard
    >>> @memguard.oom_retry(batch_size=256)
    ... def train(batch_size):
    ...     if batch_size > 64:
    ...         raise MemoryError("out of memory")
    ...     return batch_size
    >>> train()
    64
    >>> [str(a).split(":")[0] for a in train.history]
    ['batch_size=256', 'batch_size=128', 'batch_size=64']
    """
    policy = Policy.checked("oom_retry", min_batch_size=min_batch_size, factor=factor,
                            max_attempts=max_attempts, on_retry=on_retry, sync=sync)
    batch_size = policy.check_start(batch_size, "oom_retry")
    if not isinstance(cache, bool):
        cache = check_path(cache)
    objects = torch_state.check_restorable(restore, restore_to)

    def decorate(f: Callable[P, R]) -> RetryingFunction[P, R]:
        cfg = _Config(f, batch_size, arg, policy, keep_effective_batch, accumulation_arg,
                      cache, cuda_snapshot_dir, objects)
        wrapped: RetryingFunction[P, R] = _wrap(f, cfg)
        return wrapped

    return decorate if func is None else decorate(func)
