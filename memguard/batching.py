"""``find_batch_size`` and ``map_batches``, drivers over :class:`memguard.loop.Loop`: the
largest batch that fits (one search per mode), and inference over a large input that shrinks
its batches on out-of-memory without redoing finished work."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from typing import Any, Callable, Generic, Iterable, Literal, Optional, TypeVar, Union, overload

from ._checks import fraction, positive_int
from ._slices import Plan, plan_batch
from .backends import resolve_devices, torch_state
from .backends.budget import available as budget_available, watched_devices
from .cleanup import free_memory
from .distributed import Sync
from .errors import OutOfMemoryError, oom_kind
from .loop import Attempt, Factor, Loop, Policy, exhausted
from .scope import peak_book
from .sizefile import SizeFile, check_path, size_key
from .sizes import AUTO_MARGIN, MemoryFit

log = logging.getLogger("memguard")
T = TypeVar("T")
C = TypeVar("C")
Mode = Literal["binsearch", "power", "predict"]

# sizes found with cache=True, for the life of the process
_FOUND: dict[str, int] = {}


class BatchSize(int):
    """The size :func:`find_batch_size` found: an ``int``, with ``history``, the
    :class:`Attempt` record of every trial.

    Args:
        value: the size found, in samples.
        history: the trials' records, kept as ``history``.

    Attributes:
        history: the :class:`Attempt` record of every trial, in order.

    >>> size = BatchSize(48, [])
    >>> size + 2, size.history
    (50, [])
    """

    history: list[Attempt]

    def __new__(cls, value: int, history: list[Attempt]) -> BatchSize:
        self = super().__new__(cls, value)
        self.history = history
        return self

    def __reduce__(self) -> Any:
        return BatchSize, (int(self), self.history)


class _Search(Loop):
    """A search for the largest size that fits: trials at growing sizes, each out-of-memory
    tried once more before it counts, the next size chosen after the ranks agree (so every
    rank tries the same sizes). ``good`` is the largest size seen to fit, ``bad`` the
    smallest seen to fail twice."""

    retry_level = logging.INFO  # a search meets out-of-memory by design

    def __init__(self, step: Callable[[int], Any], start: int, max_batch_size: Optional[int],
                 steps: int, policy: Policy, saved: Any) -> None:
        super().__init__("find_batch_size", start, policy)
        self.step, self.start, self.cap, self.repeat = step, start, max_batch_size, steps
        self.saved = saved
        self.good: Optional[int] = None
        self.bad: Optional[int] = None
        self.cut_short = False

    def trial(self) -> None:
        """The body of one attempt: ``step(size)``, ``steps`` times."""
        for _ in range(self.repeat):
            self.step(self.size)

    def _failures(self, size: int) -> int:
        return sum(1 for a in self.attempts if a.size == size and not a.ok)

    def _room(self) -> bool:
        limit = self.policy.max_attempts
        if limit is None or len(self.attempts) < limit:
            return True
        self.cut_short = True
        return False

    def propose(self, estimate: Optional[int]) -> Optional[int]:
        if self.size == self.start and self._failures(self.start) >= 2:
            return None  # even the start does not fit
        return self.size  # the search decides once the ranks agree

    def out_of_sizes(self) -> OutOfMemoryError:
        return OutOfMemoryError(f"find_batch_size: even start={self.start} ran out of memory, "
                                f"twice ({self.attempts[-1].error}); lower start or free "
                                f"memory held elsewhere", self.attempts)

    def recover(self, retrying: bool) -> int:
        freed = free_memory()
        if retrying and self.saved is not None:
            self.saved.load()
        return freed

    def after_ok(self) -> Optional[int]:
        self.good = self.size
        upcoming = self.grown() if self._room() else None
        if upcoming is not None and self.cap is not None:
            upcoming = min(upcoming, self.cap)
        if upcoming is None or upcoming <= self.size:
            return None
        if self.saved is not None:
            self.saved.load()  # trials that train change the weights
        return upcoming

    def after_oom(self, agreed: int) -> Optional[int]:
        if self._failures(self.size) < 2:
            return self.size if self._room() else None  # once more before it counts
        self.bad = self.size if self.bad is None else min(self.bad, self.size)
        if self.good is None or not self._room():
            return None
        upcoming = self.shrunk()
        return upcoming if upcoming is not None and self.good < upcoming < self.bad else None

    def grown(self) -> Optional[int]:
        """After a size fitted: the next size to try (``None``: done)."""
        if self.bad is not None:
            return self.shrunk()
        return self.size * 2

    def shrunk(self) -> Optional[int]:
        """After a size failed twice: the next size to try between ``good`` and ``bad``."""
        assert self.good is not None and self.bad is not None
        return (self.good + self.bad) // 2 if self.bad - self.good > 1 else None


class _Power(_Search):
    """``mode="power"``: doubling until the first size that does not fit."""

    def grown(self) -> Optional[int]:
        return None if self.bad is not None else self.size * 2

    def shrunk(self) -> Optional[int]:
        return None


class _Binsearch(_Search):
    """``mode="binsearch"``: doubling, then bisecting between the last size that fitted and
    the first that failed until they are adjacent."""


_SIGNIFICANT = 0.1  # a fit rests on measured memory of at least this share of the budget
_GROWTH = 16  # the most a size grows in one trial while no fit is reliable
_GAIN = 0.03  # a predicted size this little above the last one that fitted is not tried
_BACKOFF = 0.05  # after each size that failed, the next is this much further below it
_NOISE = 1 << 20  # how far one trial's measured peak may be off


class _Predict(_Search):
    """``mode="predict"``: each trial's peak memory measured and fitted as memory = fixed +
    per-sample x size; the next size is the largest the fit says the budget holds."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.probe = _Probe()
        self.fits: dict[str, MemoryFit] = {}
        self.room: dict[str, int] = {}

    def trial(self) -> None:
        free_memory()  # every measured trial starts from the same, trimmed, state
        for device, value in self.probe.available().items():
            self.room[device] = max(value, self.room.get(device, 0))
        for device, used in self.probe.run(super().trial).items():
            self.fits.setdefault(device, MemoryFit()).add(self.size, used)
            log.debug("find_batch_size: size %d took %d bytes on %s (%s could be given "
                      "when the search began)", self.size, used, device, self.room.get(device))

    def grown(self) -> Optional[int]:
        assert self.good is not None
        failures = sum(1 for a in self.attempts if not a.ok) // 2
        # What a trial's allocator keeps after it (heap and arenas still mapped, a cache
        # still reserved) is counted as used by the budget, yet the next trial reuses it:
        # the room is what the device could give before the first trial (or more, if
        # memory was freed since). A size predicted too big is caught by its trial.
        room = dict(self.room)
        for device, value in self.probe.available().items():
            room[device] = max(value, room.get(device, 0))
        return _predicted(self.fits, room, self.good, self.bad, failures)

    def shrunk(self) -> Optional[int]:
        return self.grown()


_SEARCHES: dict[str, type[_Search]] = {"binsearch": _Binsearch, "power": _Power,
                                       "predict": _Predict}


def find_batch_size(step: Callable[[int], Any], *, start: int = 1,
                    max_batch_size: Optional[int] = None, mode: Mode = "binsearch",
                    steps: int = 1, margin: float = 0.05, max_attempts: Optional[int] = 25,
                    on_retry: Optional[Callable[[Attempt], object]] = None, sync: Sync = "auto",
                    cache: Union[bool, str, "os.PathLike[str]"] = False,
                    restore: Any = None) -> BatchSize:
    """Probe ``step(batch_size)`` for the largest batch size that fits in memory.

    Each search is one mode:

    - ``"power"`` doubles from ``start`` until the first out-of-memory (or
      ``max_batch_size``);
    - ``"binsearch"`` then bisects between the last size that fitted and the first that
      failed until they are adjacent;
    - ``"predict"`` measures instead of guessing: each trial's peak memory on every device
      with a budget (CUDA's ``max_memory_allocated`` after a reset, the host's high-water
      mark), fitted as memory = fixed + per-sample x size; while the measured memory spans
      under a tenth of what the budget that binds can give, the size grows (at most 16-fold
      per trial, as far as the per-sample part leaves room, the fixed part set apart once two
      sizes are measured: a step whose weights and gradients take most of the budget still
      grows fast); then
      it jumps to the largest size the fit says the budget holds, less 5%, verifies it with a
      trial and refits. The budget it plans against is what the device could give before the
      first trial: what a trial's allocator keeps after it (heap still mapped, a cache still
      reserved) is counted as used, yet the next trial reuses it. Once the next prediction
      gains under 3%, it tries the fit's own edge (no margin) before it answers. After an
      out-of-memory it tries 95% of the size that failed, 90% of the next that fails and so
      on (or the midpoint, if higher), and stops when the gap between the largest size that
      fitted and the smallest that failed is under 3%. From ``start=1``: 4 trials on a
      synthetic step, 5 to 11 on Lightning fits of a tiny GPT-2, where bisection takes 20
      to 23.

    A size that runs out of memory is tried once more before it counts as too big (an
    allocator that fails now and then, another process's spike). Memory is freed between
    trials as in :func:`oom_retry`. A boundary found once is not a size that holds in a
    fresh run (fragmentation, a peak that moves): the answer is the largest size that fitted
    less ``margin`` (5% by default, as Lightning's finder leaves). Measured on Lightning fits
    of a tiny GPT-2 under a 1 GiB host budget: the boundary moved by 6% between runs
    (167 and 177) and held in 1 of 2 fresh runs, while every size returned with the 5%
    margin held in 2 of 2. The margin covers that noise, not a trial that does less than
    the run: the trial must reach the run's peak (``steps`` or a step that includes the
    optimizer's state); one-step trials there found 201 where a three-step fit failed at
    170.

    Args:
        step: called with a batch size; runs what must fit (a training step, a forward).
        start: the first size tried. Default ``1``.
        max_batch_size: the largest size tried (``None``: no limit).
        mode: ``"binsearch"``, ``"power"`` or ``"predict"`` (above).
        steps: calls of ``step`` per trial (memory often peaks in the second step, once
            optimizer state exists). Default ``1``.
        margin: the fraction taken off the largest size that fitted. Default ``0.05``.
        max_attempts: the most trials; the search then stops at the largest size that fitted,
            with a warning. Default ``25``.
        on_retry: called with each failed trial's :class:`Attempt` after its cleanup.
            Default ``None``: nothing is called.
        sync: in a distributed job every rank tries the same sizes (a size that fails on any
            rank fails on all) and all return the same size. Default ``"auto"``.
        cache: ``True``: a later search with the same step and parameters in this process
            returns the size found without a trial; a file path: the same across processes
            and restarts (as ``oom_retry(cache=path)`` keeps its sizes); ``False``: search
            every time.
        restore: objects with ``state_dict``/``load_state_dict`` (model, optimizer...) put
            back to their state at the start before each trial and after the search, as
            Lightning's finder does: trials that train change the weights.
            Default ``None``: nothing is restored.

    Returns:
        The size (a :class:`BatchSize`, an ``int`` whose ``history`` holds every trial).

    Raises:
        OutOfMemoryError: when even ``start`` ran out of memory, twice.

    >>> import memguard
    >>> def step(batch_size):
    ...     if batch_size > 300:
    ...         raise MemoryError("too big")
    >>> size = memguard.find_batch_size(step, start=16, margin=0.0)
    >>> size, len(size.history)
    (300, 20)
    """
    who = "find_batch_size"
    start = positive_int(start, "start", who=who)  # as ints, whatever integral type came
    steps = positive_int(steps, "steps", who=who)
    if max_batch_size is not None:
        max_batch_size = positive_int(max_batch_size, "max_batch_size", who=who)
    if max_batch_size is not None and max_batch_size < start:
        raise ValueError(f"{who}: max_batch_size={max_batch_size} is smaller than "
                         f"start={start}")
    if mode not in _SEARCHES:
        raise ValueError(f"{who}: mode must be 'binsearch', 'power' or 'predict', got {mode!r}")
    margin = fraction(margin, "margin", include_zero=True, who=who)
    policy = Policy.checked(who, max_attempts=max_attempts, on_retry=on_retry, sync=sync)
    if not isinstance(cache, bool):
        cache = check_path(cache)
    objects = torch_state.check_restorable(restore)
    key = size_key(who, step, start, max_batch_size=max_batch_size, mode=mode, steps=steps,
                   max_attempts=max_attempts)
    file = SizeFile(cache) if isinstance(cache, str) else None
    stored = _FOUND.get(key) if cache is True else file.get(key) if file is not None else None
    if cache is not False and _every_rank_has(stored is not None and stored >= start, policy):
        assert stored is not None
        found = stored if max_batch_size is None else min(stored, max_batch_size)
        log.info("%s: %d from the size cache", who, found)
        return BatchSize(_finish(found, margin, policy), [])
    saved = (torch_state.copy_states(objects, budget_available("host"))
             if objects else None)
    try:
        search = _SEARCHES[mode](step, start, max_batch_size, steps, policy, saved)
        for attempt in search:
            with attempt:
                search.trial()
        if saved is not None:
            saved.load()
    finally:
        if saved is not None:
            saved.discard()
    if search.good is None:
        raise exhausted(who, search.attempts, f" from start={start}")
    if search.cut_short:
        log.warning("%s stopped after max_attempts=%d trials at %d, the largest size that "
                    "fitted; raise max_attempts or set max_batch_size to search on", who,
                    policy.max_attempts, search.good)
    if cache is True:
        _FOUND[key] = search.good
    elif file is not None:
        file.put(key, search.good)
    found = _finish(search.good, margin, policy)
    log.info("%s found %d after %d trials", who, found, len(search.attempts))
    return BatchSize(found, search.attempts)


def _every_rank_has(stored: bool, policy: Policy) -> bool:
    """Whether every rank has a stored size (``stored`` on this one): if one has none, all
    search, since a rank that went on alone would leave its peers' trials waiting on it
    (size files on each node's own disk, a rank whose key differs)."""
    from .distributed import Agreement

    return Agreement(policy.sync).all_max([0 if stored else 1]) == [0]


def _finish(good: int, margin: float, policy: Policy) -> int:
    """The size returned: ``good`` less ``margin``, the smallest over the ranks."""
    from .distributed import Agreement

    return Agreement(policy.sync).smallest(max(1, math.floor(good * (1 - margin))))


class _Probe:
    """Peak memory of one trial on each device that has a budget, above its level when the
    trial began: CUDA's ``max_memory_allocated`` after a reset, the host's high-water mark of
    the resident set (through the scopes' peak book, so open scopes keep their peaks)."""

    def __init__(self) -> None:
        watched = set(watched_devices())
        self.pairs = [(b, d) for b, d in resolve_devices(None) if d in watched]

    def available(self) -> dict[str, int]:
        found = {}
        for _, device in self.pairs:
            value = budget_available(device)
            if value is not None:
                found[device] = value
        return found

    def run(self, body: Callable[[], Any]) -> dict[str, int]:
        """Run ``body()`` (its exceptions propagate); the peak memory it took on each
        device."""
        levels = {d: b.level(b.read_fast(d)) for b, d in self.pairs}
        token = object()
        peak_book.enter(id(token), self.pairs)
        try:
            body()
        finally:
            peaks = peak_book.exit(id(token), self.pairs)
        memory = {}
        for device, level in levels.items():
            peak = peaks.get(device)
            if peak is not None and level is not None:
                memory[device] = max(0, peak - level)
        return memory


def _growth(fit: MemoryFit, room: int, good: int) -> int:
    """How far a size may grow while the fit is not reliable yet (its measured memory spans
    under :data:`_SIGNIFICANT` of the room).

    With one size measured, all of its memory is taken as per sample: the size whose memory
    would be a quarter of the room, or double if even then the room holds it (memory that
    grows with the size no faster than in proportion). With two sizes or more the fixed
    part (weights, gradients, optimizer state: what a trial takes whatever its size) is
    set apart, and the size grows until the per-sample part, at the most the readings allow
    (:meth:`~memguard.sizes.MemoryFit.cautious`), would take half of what the fixed part
    leaves: a step whose fixed part is most of the budget still grows fast.
    """
    top = max(s for s, _ in fit.points)
    measured = max(max(m for s, m in fit.points if s == top), _NOISE)
    size = max(good * 0.25 * room / measured,
               min(2.0 * good, good * (1 - AUTO_MARGIN) * room / measured))
    split = fit.cautious(_NOISE)
    if split is not None:
        fixed, per_sample = split
        size = max(size, 0.5 * (room - fixed) / per_sample)
    return math.floor(size)


def _predicted(fits: dict[str, MemoryFit], available: dict[str, int], good: int,
               bad: Optional[int], failures: int) -> int:
    """The next size ``mode="predict"`` tries (``<= good`` to stop).

    The fit's prediction (less :data:`AUTO_MARGIN`) while it gains; once it gains under
    ``_GAIN``, the fit's own edge (no margin) if no size has failed yet, so that the answer
    rests on a trial near the boundary rather than on the fit alone. After a size failed,
    95% of it; after more, a step further down each time (or the midpoint, if larger); the
    search stops when the gap between the largest size that fitted and the smallest that
    failed is under ``_GAIN`` of the former.
    """
    if bad is not None:
        if bad - good <= max(1, math.floor(good * _GAIN)):
            return good
        if failures >= 2:
            return max((good + bad) // 2, math.floor(bad * (1 - _BACKOFF * failures)))
    predictions, edges, bounds = [], [], []
    for device, fit in fits.items():
        room = available.get(device)
        if room is None or not fit.points:
            continue
        largest = fit.largest(room) if fit.spread() >= _SIGNIFICANT * room else None
        if largest is not None:
            predictions.append(largest)
            edges.append(fit.largest(room, margin=0.0) or 0)
        else:
            bounds.append(_growth(fit, room, good))
    if predictions:
        size = min(predictions + bounds)
        if size <= good * (1 + _GAIN):
            if bad is not None:
                return (good + bad) // 2  # the fit sees no room, the trials left a gap
            size = min(edges + bounds)
            if size <= good * (1 + _GAIN):
                return good
    else:
        size = min(bounds + [good * _GROWTH]) if bounds else good * 2
        size = max(size, good + 1)
    if bad is not None:
        size = min(size, math.floor(bad * (1 - _BACKOFF)))
        if size <= good:
            return (good + bad) // 2
    return size


class BatchResults(list[T], Generic[T]):
    """The list :func:`map_batches` returns (without ``collate``): one result per call of
    ``fn``, in order, and ``history``, the :class:`Attempt` records of its retries (one per
    out-of-memory, and one for the size that worked next).

    Args:
        items: the results, in order. Default ``()``: none.
        history: the retries' records, kept as ``history``. Default ``None``: none.

    Attributes:
        history: the :class:`Attempt` records of the retries.

    >>> results = BatchResults([1, 2])
    >>> results, results.history
    ([1, 2], [])
    """

    def __init__(self, items: Iterable[T] = (), history: Optional[list[Attempt]] = None
                 ) -> None:
        super().__init__(items)
        self.history: list[Attempt] = [] if history is None else history


class _Segment(Loop):
    """``map_batches`` over one input (a sequence, or one batch of an iterable): calls of
    ``fn`` on consecutive slices, the size shrinking on out-of-memory and staying shrunk for
    the rest; an attempt that fails is redone at the smaller size, finished slices never."""

    def __init__(self, fn: Callable[[Any], Any], cut: Callable[[int, int], Any], total: int,
                 size: int, policy: Policy, history: list[Attempt], where: Callable[[int], str],
                 whole: Any = None) -> None:
        super().__init__("map_batches", size, policy, history=history)
        self.fn, self.cut, self.total, self.where, self.whole = fn, cut, total, where, whole
        self.offset = 0
        self.results: list[Any] = []
        self.out: Any = None
        self.failed_here = False

    def call(self) -> None:
        """The body of one attempt: ``fn`` on the next slice."""
        stop = min(self.offset + self.size, self.total)
        whole = self.whole is not None and self.offset == 0 and stop == self.total
        chunk = self.whole if whole else self.cut(self.offset, stop)
        self.out = self.fn(chunk)

    def record_success(self, seconds: float) -> None:
        if self.attempts and not self.attempts[-1].ok:  # the size that worked after a failure
            super().record_success(seconds)

    def record(self, attempt: Attempt) -> None:
        self.failed_here = self.failed_here or not attempt.ok
        super().record(attempt)

    def after_ok(self) -> Optional[int]:
        self.results.append(self.out)
        self.out = None
        self.offset = min(self.offset + self.size, self.total)
        return self.size if self.offset < self.total else None

    def recover(self, retrying: bool) -> int:
        self.out = None
        return super().recover(retrying)

    def out_of_sizes(self) -> OutOfMemoryError:
        return OutOfMemoryError(
            f"map_batches: out of memory at batch_size={self.size}, the smallest allowed, at "
            f"{self.where(self.offset)}; the finished results are on the error's .partial",
            self.attempts)


class _Mapper:
    """One ``map_batches`` call: the size, the results, the history, over every segment."""

    def __init__(self, fn: Callable[[Any], Any], size: Optional[int], policy: Policy) -> None:
        self.fn = fn
        self.size = size  # None: an iterable's batches as they come, until one runs out
        self.policy = policy
        self.results: list[Any] = []
        self.history: list[Attempt] = []

    def run(self, cut: Callable[[int, int], Any], total: int, where: Callable[[int], str],
            whole: Any = None, join: bool = False) -> None:
        """Call ``fn`` on ``cut(start, stop)`` over ``0..total`` (``whole`` as it is when the
        size allows all of it at once); with ``join``, the slices' results joined into one.
        Nothing to cut (``total`` 0): no call, no result."""
        if total == 0:
            return
        size = total if self.size is None else min(self.size, total)
        segment = _Segment(self.fn, cut, total, max(size, 1), self.policy, self.history, where,
                           whole)
        try:
            for attempt in segment:
                with attempt:
                    segment.call()
        except OutOfMemoryError as exc:
            exc.partial = self.results + segment.results
            raise
        if segment.failed_here:
            self.size = segment.size
        if join and len(segment.results) > 1:
            from .backends.torch_data import concatenate

            self.results.append(concatenate(segment.results))
        else:
            self.results.extend(segment.results)


@overload
def map_batches(fn: Callable[[Any], T], data: Any, *, batch_size: Optional[int] = None,
                min_batch_size: int = 1, factor: Factor = 0.5,
                max_attempts: Optional[int] = None,
                on_retry: Optional[Callable[[Attempt], object]] = None, sync: Sync = False,
                collate: None = None) -> BatchResults[T]: ...
@overload
def map_batches(fn: Callable[[Any], T], data: Any, *, batch_size: Optional[int] = None,
                min_batch_size: int = 1, factor: Factor = 0.5,
                max_attempts: Optional[int] = None,
                on_retry: Optional[Callable[[Attempt], object]] = None, sync: Sync = False,
                collate: Callable[[list[T]], C]) -> C: ...


def map_batches(fn: Callable[[Any], T], data: Any, *, batch_size: Optional[int] = None,
                min_batch_size: int = 1, factor: Factor = 0.5,
                max_attempts: Optional[int] = None,
                on_retry: Optional[Callable[[Attempt], object]] = None, sync: Sync = False,
                collate: Optional[Callable[[list[T]], C]] = None
                ) -> Union[BatchResults[T], C]:
    """Apply ``fn`` to ``data`` in batches, shrinking the batch on out-of-memory.

    ``data`` is one of:

    - a sequence of items with ``len()`` and slicing (a list, a tensor, an array), cut into
      slices of ``batch_size``;
    - a tuple or dict (any ``Mapping``, nested) of per-sample parts, such as ``(x, y)`` or
      ``{"input_ids": ..., "attention_mask": ...}``: cut part by part, as
      :func:`auto_microbatch` cuts a batch, and ``fn`` receives the same structure;
    - a map-style ``torch.utils.data.Dataset``: ``batch_size`` samples at a time, collated
      with ``default_collate`` (a ``TensorDataset`` gives ``(x, y)`` of stacked tensors);
    - a ``DataLoader``, or any other iterable of batches (a generator): each batch goes to
      ``fn`` as it is (cut to ``batch_size`` when one is given and the batch is longer); the
      results of one batch's slices are joined into one result per input batch (tensors
      and arrays concatenated, lists end to end, tuples and dicts part by part; results of
      other kinds become the list of the slices' results).

    An empty input (a sequence, structure or dataset of no items, an iterable of no batches)
    calls ``fn`` never and returns an empty :class:`BatchResults` (or ``collate([])``): a
    result per slice, and there is no slice. An empty batch of an iterable is still a batch
    and goes to ``fn`` once, whole.

    On an out-of-memory only the failed batch (or slice) is retried, at a smaller size (half,
    by default), split along dim 0 (element-wise for tuples and dicts), and the rest goes on
    at that size: finished work is never recomputed. The policy arguments mean what they mean
    to :func:`oom_retry`.

    Args:
        fn: called with each batch; its result is kept.
        data: what to map (above).
        batch_size: the size of the slices (needed for everything but an iterable of
            batches). Default ``None``: an iterable's own batches.
        min_batch_size: the smallest size tried. Default ``1``.
        factor: the next size is ``floor(size * factor)``; ``"auto"`` measures it from what
            the failed call took and asked for (the budgets are read before every call of
            ``fn``, a fraction of a millisecond each time); a callable ``size -> next size``.
            Default ``0.5``.
        max_attempts: the most attempts at one batch.
            Default ``None``: until ``min_batch_size``.
        on_retry: called with each failed :class:`Attempt` after its cleanup.
            Default ``None``: nothing is called.
        sync: ``False`` by default, unlike the other entry points: ranks often map inputs of
            different lengths. With ``True`` (or ``"auto"`` in a job of several ranks) every
            rank must map data of the same length: a size that fails on any rank is redone
            on all, and all go on at the same size.
        collate: joins the list of results (``torch.cat``, say) before it is returned.
            Default ``None``: the list of results, a :class:`BatchResults`.

    Returns:
        The results, one per slice of a sequence and one per batch of an iterable (a
        :class:`BatchResults`, whose ``history`` holds the :class:`Attempt` records of the
        retries, each failure with its ``next_size``), or ``collate(results)``.

    Raises:
        OutOfMemoryError: when the slice at ``min_batch_size``, or ``collate``, runs out of
            memory; the finished results, in order, are on its ``.partial``.

    >>> import memguard
    >>> memguard.map_batches(sum, list(range(10)), batch_size=4)
    [6, 22, 17]
    >>> memguard.map_batches(lambda b: sum(b[1]), ([1, 2, 3], [4, 5, 6]), batch_size=2)
    [9, 6]
    >>> memguard.map_batches(len, iter([[1, 2, 3], [4, 5]]))
    [3, 2]
    """
    policy = Policy.checked("map_batches", min_batch_size=min_batch_size, factor=factor,
                            max_attempts=max_attempts, on_retry=on_retry, sync=sync)
    batch_size = policy.check_start(batch_size, "map_batches")
    from .backends.torch_data import collate as collate_samples, is_map_dataset

    mapper = _Mapper(fn, batch_size, policy)
    if isinstance(data, (tuple, Mapping)) or is_map_dataset(data) or (
            hasattr(data, "__len__") and hasattr(data, "__getitem__")):
        if batch_size is None:
            raise TypeError(f"map_batches: needs batch_size=... for a {type(data).__name__} "
                            f"(only an iterable of batches, such as a DataLoader, brings its "
                            f"own)")
        if isinstance(data, (tuple, Mapping)):
            plan = plan_batch(data)  # cut part by part
            cut: Callable[[int, int], Any] = lambda a, b: plan.cut(data, a, b)  # noqa: E731
            total = int(plan.length or 0)
        elif is_map_dataset(data):
            cut = lambda a, b: collate_samples([data[i] for i in range(a, b)])  # noqa: E731
            total = len(data)
        else:
            def cut(a: int, b: int) -> Any:
                chunk = data[a:b]
                _check_slice(data, chunk, a, b)
                return chunk

            total = len(data)
        mapper.run(cut, total, lambda done: f"item {done} of {total}")
    elif hasattr(data, "__iter__"):
        count = len(data) if hasattr(data, "__len__") else None
        of = f" of {count}" if count is not None else ""
        for index, batch in enumerate(data):
            _map_batch(mapper, batch, f"batch {index}{of}")
    else:
        raise TypeError(f"map_batches: needs data with len() and slicing, a tuple or dict of "
                        f"those, a torch Dataset, or an iterable of batches (a DataLoader), "
                        f"got {type(data).__name__}")
    results = mapper.results
    if collate is None:
        return BatchResults(results, mapper.history)
    try:
        return collate(results)
    except BaseException as exc:
        if oom_kind(exc) is None:
            raise
        raise OutOfMemoryError(f"map_batches: collate ran out of memory joining {len(results)} "
                               f"results; they are on the error's .partial", mapper.history,
                               results) from exc


def _map_batch(mapper: _Mapper, batch: Any, name: str) -> None:
    """One batch of an iterable: cut as :func:`plan_batch` says, or, with nothing per sample
    to cut, passed whole, once."""
    try:
        plan: Optional[Plan] = plan_batch(batch)
    except TypeError:
        plan = None
    if plan is None or not plan.length:
        mapper.run(lambda a, b: batch, 1, lambda done: name, whole=batch)
    else:
        mapper.run(lambda a, b: plan.cut(batch, a, b), plan.length,
                   lambda done: f"item {done} of {name}", whole=batch, join=True)


def _check_slice(data: Any, chunk: Any, start: int, stop: int) -> None:
    """A ``TypeError`` unless ``data[start:stop]`` gave ``stop - start`` items."""
    try:
        got: Any = len(chunk)
    except TypeError:
        got = f"a {type(chunk).__name__} without len()"
    if got != stop - start:
        raise TypeError(f"map_batches: data[{start}:{stop}] of a {type(data).__name__} gave "
                        f"{got} items, not {stop - start}; data must return its items when "
                        f"sliced (a list, a tensor, an array), or be a tuple or dict of such")
