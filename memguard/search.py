"""``find_batch_size``, a driver over :class:`memguard.loop.Loop`: the largest batch that
fits, one search class per mode (doubling, binary search, a prediction from measured memory)."""

from __future__ import annotations

import logging
import math
import os
from typing import Any, Callable, Literal, Optional, Union

from ._checks import fraction, positive_int
from .backends import resolve_devices
from .backends.budget import available as budget_available, watched_devices
from .backends.steps import torch_state
from .cleanup import free_memory
from .distributed import Sync
from .errors import OutOfMemoryError
from .loop import Attempt, Loop, Policy, exhausted
from .scope import peak_book
from .sizefile import SizeFile, check_path, size_key
from .sizes import AUTO_MARGIN, MemoryFit

log = logging.getLogger("memguard")
Mode = Literal["binsearch", "power", "predict"]

# sizes found with cache=True, for the life of the process
_FOUND: dict[str, int] = {}


class BatchSize(int):
    """The size :func:`find_batch_size` found: an ``int``, with ``history``.

    Args:
        value: the size found, in samples.
        history: the trials' records.

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
    """A search for the largest size that fits: each out-of-memory tried once more before it
    counts, the next size chosen after the ranks agree. ``good``: the largest size that fitted;
    ``bad``: the smallest that failed twice."""

    retry_level = logging.INFO  # a search meets out-of-memory by design

    def __init__(self, step: Callable[[int], Any], start: int, max_batch_size: Optional[int],
                 steps_per_trial: int, policy: Policy, saved: Any) -> None:
        super().__init__("find_batch_size", start, policy)
        self.step, self.start, self.cap = step, start, max_batch_size
        self.repeat = steps_per_trial
        self.saved = saved
        self.good: Optional[int] = None
        self.bad: Optional[int] = None
        self.cut_short = False

    def trial(self) -> None:
        """The body of one attempt: ``step(size)``, ``steps_per_trial`` times."""
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
    """``mode="binsearch"``: doubling, then bisecting between ``good`` and ``bad``."""


_SIGNIFICANT = 0.1  # a fit rests on measured memory of at least this share of the budget
_GROWTH = 16  # the most a size grows in one trial while no fit is reliable
_GAIN = 0.03  # a predicted size this little above the last one that fitted is not tried
_BACKOFF = 0.05  # after each size that failed, the next is this much further below it
_NOISE = 1 << 20  # how far one trial's measured peak may be off


class _Predict(_Search):
    """``mode="predict"``: peaks fitted as fixed + per-sample x size; next, the largest size the
    fit says the budget holds."""

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
                    steps_per_trial: int = 1, margin: float = 0.05,
                    max_attempts: Optional[int] = 25,
                    on_retry: Optional[Callable[[Attempt], object]] = None, sync: Sync = "auto",
                    cache: Union[bool, str, "os.PathLike[str]"] = False,
                    restore: Any = None) -> BatchSize:
    """Probe ``step(batch_size)`` for the largest batch size that fits in memory.

    Modes: ``"power"`` doubles from ``start`` until the first out-of-memory (or
    ``max_batch_size``); ``"binsearch"`` then bisects until the last size that fitted and the
    first that failed are adjacent; ``"predict"`` measures each trial's peak on every device
    with a budget, fits memory = fixed + per-sample x size, and jumps to the largest size the
    fit says the budget holds, refining until the gap is under 3% (far fewer trials than
    bisection; see the recovery internals guide).

    A size that runs out of memory is tried once more before it counts as too big; memory is
    freed between trials as in :func:`oom_retry`. The answer is the largest size that fitted
    less ``margin``, since a boundary found once moves between runs. Each trial must reach the
    run's peak (``steps_per_trial``, or a step that includes the optimizer's state).

    Args:
        step: called with a batch size; runs what must fit (a training step, a forward).
        start: the first size tried, and the smallest: the search grows from it.
            Default ``1``.
        max_batch_size: the largest size tried (``None``: no limit).
        mode: ``"binsearch"`` (the default), ``"power"`` or ``"predict"``.
        steps_per_trial: calls of ``step`` per trial (memory often peaks in the second
            step, once optimizer state exists). Default ``1``.
        margin: the fraction taken off the largest size that fitted. Default ``0.05``.
        max_attempts: the most trials; the search then stops at the largest size that
            fitted, with a warning. Default ``25`` (a step that never runs out of memory
            would grow for ever).
        on_retry: called with each failed trial's :class:`Attempt` after its cleanup.
            Default ``None``: nothing is called.
        sync: in a distributed job every rank tries the same sizes and all return the same
            size. Default ``"auto"``.
        cache: ``True``: a later search with the same step and parameters in this process
            returns the size found without a trial; a file path: the same across processes
            and restarts; ``False``: search every time. Default ``False`` (a kept size is
            never checked against changes the key cannot see, such as longer inputs).
        restore: objects with ``state_dict``/``load_state_dict`` (model, optimizer...) put
            back to their starting state before each trial and after the search.
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
    steps_per_trial = positive_int(steps_per_trial, "steps_per_trial", who=who)
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
    key = size_key(who, step, start, max_batch_size=max_batch_size, mode=mode,
                   steps_per_trial=steps_per_trial,
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
        search = _SEARCHES[mode](step, start, max_batch_size, steps_per_trial, policy, saved)
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
    """Whether every rank has a stored size: if one has none, all search (a rank going on alone
    would leave its peers' trials waiting)."""
    from .distributed import Agreement

    return Agreement(policy.sync).all_max([0 if stored else 1]) == [0]


def _finish(good: int, margin: float, policy: Policy) -> int:
    """The size returned: ``good`` less ``margin``, the smallest over the ranks."""
    from .distributed import Agreement

    return Agreement(policy.sync).smallest(max(1, math.floor(good * (1 - margin))))


class _Probe:
    """Peak memory of one trial above its start on each device with a budget (CUDA's
    ``max_memory_allocated``, the host's resident high-water mark through the scopes' peak book)."""

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
        """Run ``body()``; the peak memory it took on each device."""
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
    """How far a size may grow while the fit is unreliable (its memory spans under
    :data:`_SIGNIFICANT` of the room): with one size, until a quarter of the room (all memory
    taken as per sample); with more, the fixed part set apart, until the cautious per-sample
    part would take half of what remains."""
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
    """The next size ``mode="predict"`` tries (``<= good`` to stop): the fit's prediction less
    :data:`AUTO_MARGIN` while it gains ``_GAIN``, then the fit's own edge; after failures, 95%
    of the failed size and further down each time (or the midpoint), until the gap is under
    ``_GAIN``."""
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
