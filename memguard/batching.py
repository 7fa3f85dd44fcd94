"""``find_batch_size`` and ``map_batches``: the largest batch that fits, and inference over a
large input that shrinks its batches on out-of-memory without redoing finished work."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Mapping
from typing import Any, Callable, Literal, Optional, TypeVar, Union

from ._checks import fraction, positive_int
from ._slices import Plan, plan_batch
from .backends import resolve_devices
from .backends.budget import available as budget_available, watched_devices
from .cleanup import drop_frames, free_memory
from .distributed import Agreement, Sync
from .errors import OutOfMemoryError, oom_kind
from .retry import Attempt, error_text, failure
from .scope import peak_book
from .sizes import (
    Factor,
    Gauge,
    MemoryFit,
    SizeFile,
    check_path,
    check_policy,
    check_start,
    next_size,
    size_key,
)

log = logging.getLogger("memguard")
T = TypeVar("T")


def _fits(step: Callable[[int], Any], size: int, steps: int) -> Optional[str]:
    """Run ``step(size)`` ``steps`` times: ``None`` if it fitted, else the out-of-memory's
    text, with the failed trial's memory already freed. Other errors propagate."""
    try:
        for _ in range(steps):
            step(size)
    except BaseException as exc:
        if oom_kind(exc) is None:
            raise
        text = error_text(exc)
        drop_frames(exc)
    else:
        return None
    free_memory()  # outside except: the exception is no longer referenced
    return text


def find_batch_size(step: Callable[[int], Any], *, start: int = 1,
                    max_batch_size: Optional[int] = None,
                    mode: Literal["binsearch", "power", "predict"] = "binsearch",
                    steps: int = 1, margin: float = 0.0, max_trials: int = 25,
                    sync: Sync = "auto",
                    cache: Union[str, "os.PathLike[str]", None] = None) -> int:
    """Probe ``step(batch_size)`` for the largest batch size that fits in memory.

    ``"power"`` doubles from ``start`` until the first out-of-memory (or ``max_batch_size``);
    ``"binsearch"`` then bisects between the last size that fitted and the first that failed
    until they are adjacent. ``"predict"`` measures instead of guessing: each trial's peak
    memory on every device with a budget (the backends' peak counters: CUDA's
    ``max_memory_allocated`` after a reset, the host's high-water mark), fitted as memory =
    fixed + per-sample x size; while the measured memory is under a tenth of what the
    budget that binds can give, the size grows (at most 16-fold, and so that even all of
    the measured memory per sample would fill at most a quarter of it); then it jumps to the
    largest size the fit says the budget holds, less 5%, verifies it with a trial, refits
    with what that trial measured and stops once the next prediction gains under 3%. After
    an out-of-memory it tries 95% of the size that failed, then bisects. It returns a size
    that was seen to fit, typically in 4 to 6 trials from ``start=1`` where bisection takes
    about 18.

    Each trial calls ``step`` ``steps`` times (memory often peaks in the second step, once
    optimizer state exists) and memory is freed between trials as in :func:`oom_retry`. A
    size that runs out of memory is tried once more before it counts as too big (an
    allocator that fails now and then, another process's spike); the search stops at
    ``max_batch_size`` or after ``max_trials`` sizes (the largest that fitted is returned,
    with a warning when the limit cut the search short). Returns the size found less the
    ``margin`` fraction (at least 1). In a distributed job each rank probes, then all adopt
    the smallest size. When even ``start`` fails twice: :class:`OutOfMemoryError`.

    ``cache``, a file path: the size found is kept there (as ``oom_retry(cache=path)``
    keeps its sizes: keyed by the step's code, ``start``, ``max_batch_size``, ``mode``,
    ``steps``, ``max_trials`` and the device) and a later search with the same key, in this
    process or a restarted one, returns it without a trial. A file that is not memguard's is
    never written (a warning says why).

    >>> import memguard
    >>> def step(batch_size):
    ...     if batch_size > 300:
    ...         raise MemoryError("too big")
    >>> memguard.find_batch_size(step, start=16)
    300
    """
    positive_int(start, "start")
    positive_int(steps, "steps")
    if max_batch_size is not None and positive_int(max_batch_size, "max_batch_size") < start:
        raise ValueError(f"max_batch_size={max_batch_size} is smaller than start={start}")
    if mode not in ("binsearch", "power", "predict"):
        raise ValueError(f"mode must be 'binsearch', 'power' or 'predict', got {mode!r}")
    fraction(margin, "margin", include_zero=True)
    positive_int(max_trials, "max_trials")
    sizes = None if cache is None else SizeFile(check_path(cache))
    agreement = Agreement(sync)
    # one per size (a confirmed failure once); only a failed start reaches the caller, on
    # the error, so no trial names a next_batch_size
    trials: list[Attempt] = []
    probe = _Probe() if mode == "predict" else None
    fits: dict[str, MemoryFit] = {}

    def finish(good: int) -> int:
        found = max(1, math.floor(good * (1 - margin)))
        found = agreement.smallest(found)
        log.info("find_batch_size found %d after %d trials", found, len(trials))
        return found

    key = None
    if sizes is not None:
        key = size_key("find_batch_size", step, start, max_batch_size=max_batch_size, mode=mode,
                       steps=steps, max_trials=max_trials)
        stored = sizes.get(key)
        if stored is not None and stored >= start:
            stored = stored if max_batch_size is None else min(stored, max_batch_size)
            log.info("find_batch_size: %d from the size cache %s", stored, sizes.path)
            return finish(stored)

    def trial(size: int) -> bool:
        started = time.perf_counter()
        if probe is not None:
            free_memory()  # every measured trial starts from the same, trimmed, state
            error, memory = probe.run(step, size, steps)
            if error is None:
                for device, used in memory.items():
                    fits.setdefault(device, MemoryFit()).add(size, used)
        else:
            error = _fits(step, size, steps)
        if error is not None:
            log.debug("find_batch_size: %d ran out of memory once; trying it again", size)
            error = _fits(step, size, steps)
        trials.append(Attempt(size, None, error is None, error, time.perf_counter() - started))
        log.debug("find_batch_size trial %d: %s", size, error or "fits")
        return error is None

    def room() -> bool:
        """Whether the search, not finished, may try another size."""
        if len(trials) < max_trials:
            return True
        log.warning("find_batch_size stopped after max_trials=%d trials at %d, the largest "
                    "size that fitted; raise max_trials or set max_batch_size to search on",
                    max_trials, good)
        return False

    if not trial(start):
        raise OutOfMemoryError(f"find_batch_size: even start={start} ran out of memory, "
                               f"twice ({trials[-1].error}); lower start or free memory held "
                               f"elsewhere", trials)
    good, bad = start, None
    if probe is not None:
        failures = 0
        while (max_batch_size is None or good < max_batch_size) and room():
            size = _predicted(fits, probe.available(), good, bad, failures)
            if max_batch_size is not None:
                size = min(size, max_batch_size)
            if size <= good:
                break
            if trial(size):
                good = size
            else:
                bad, failures = size, failures + 1
    else:
        while bad is None and (max_batch_size is None or good < max_batch_size) and room():
            size = good * 2 if max_batch_size is None else min(good * 2, max_batch_size)
            if trial(size):
                good = size
            else:
                bad = size
        if mode == "binsearch" and bad is not None:
            while bad - good > 1 and room():
                middle = (good + bad) // 2
                if trial(middle):
                    good = middle
                else:
                    bad = middle
    if sizes is not None and key is not None:
        sizes.put(key, good)
    return finish(good)


_SIGNIFICANT = 0.1  # a fit rests on measured memory of at least this share of the budget
_GROWTH = 16  # the most a size grows in one trial while no fit is reliable
_GAIN = 0.03  # a predicted size this little above the last one that fitted is not tried


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

    def run(self, step: Callable[[int], Any], size: int,
            steps: int) -> tuple[Optional[str], dict[str, int]]:
        levels = {d: b.level(b.read_fast(d)) for b, d in self.pairs}
        token = object()
        peak_book.enter(id(token), self.pairs)
        try:
            error = _fits(step, size, steps)
        finally:
            peaks = peak_book.exit(id(token), self.pairs)
        memory = {}
        for device, level in levels.items():
            peak = peaks.get(device)
            if peak is not None and level is not None:
                memory[device] = max(0, peak - level)
        return error, memory


def _predicted(fits: dict[str, MemoryFit], available: dict[str, int], good: int,
               bad: Optional[int], failures: int) -> int:
    """The next size ``mode="predict"`` tries (``<= good`` to stop)."""
    if bad is not None and failures >= 2:
        return (good + bad) // 2 if bad - good > 1 else good
    predictions, bounds = [], []
    for device, fit in fits.items():
        room = available.get(device)
        if room is None or not fit.points:
            continue
        largest = fit.largest(room) if fit.spread() >= _SIGNIFICANT * room else None
        if largest is not None:
            predictions.append(largest)
        else:  # all of the memory measured at ``good`` taken as per sample: a safe jump
            measured = max(m for s, m in fit.points if s == max(p[0] for p in fit.points))
            bounds.append(math.floor(good * 0.25 * room / max(measured, 1 << 20)))
    if predictions:
        size = min(predictions + bounds)
        if size <= good * (1 + _GAIN):
            return good
    else:
        size = min(bounds + [good * _GROWTH]) if bounds else good * 2
        size = max(size, good + 1)
    if bad is not None:
        size = min(size, math.floor(bad * 0.95))
        if size <= good:
            return (good + bad) // 2 if bad - good > 1 else good
    return size


class BatchResults(list):
    """The list :func:`map_batches` returns (without ``collate``): one result per call of
    ``fn``, in order, and ``history``, the :class:`Attempt` records of its retries (one per
    out-of-memory, and one for the size that worked next).

    >>> results = BatchResults([1, 2])
    >>> results, results.history
    ([1, 2], [])
    """

    def __init__(self, items: Any = (), history: Optional[list[Attempt]] = None) -> None:
        super().__init__(items)
        self.history: list[Attempt] = [] if history is None else history


class _Mapper:
    """One ``map_batches`` call: the current size, the results, the attempts."""

    def __init__(self, fn: Callable[[Any], Any], size: Optional[int], min_batch_size: int,
                 factor: Factor, on_retry: Optional[Callable[[Attempt], Any]]) -> None:
        self.fn = fn
        self.size = size  # None: an iterable's batches as they come, until one runs out
        self.min_batch_size = min_batch_size
        self.factor = factor
        self.gauge = Gauge("map_batches") if factor == "auto" else None
        self.on_retry = on_retry
        self.results: list[Any] = []
        self.history: list[Attempt] = []
        self.retried = False  # the next success is recorded: the size that worked

    def run(self, cut: Callable[[int, int], Any], total: int, where: Callable[[int], str],
            whole: Any = None) -> None:
        """Call ``fn`` on ``cut(start, stop)`` over ``0..total`` (``whole`` as it is when the
        size allows all of it at once), shrinking on out-of-memory."""
        done = 0
        while done < total:
            stop = total if self.size is None else min(done + self.size, total)
            chunk = whole if whole is not None and done == 0 and stop == total else \
                cut(done, stop)
            if self.gauge is not None:
                self.gauge.start()
            started = time.perf_counter()
            try:
                out = self.fn(chunk)
            except BaseException as exc:
                if oom_kind(exc) is None:
                    raise
                failed = self._failed(exc, stop - done, time.perf_counter() - started,
                                      where(done))
            else:
                self.results.append(out)
                if self.retried:
                    self.history.append(Attempt(stop - done, None, True, None,
                                                time.perf_counter() - started))
                    self.retried = False
                done = stop
                continue
            del chunk
            free_memory()  # outside except: the exception is no longer referenced
            self.size = failed.next_batch_size
            self.retried = True
            log.warning("map_batches ran out of memory at %s; going on at batch_size=%d",
                        where(done), self.size)
            if self.on_retry is not None:
                self.on_retry(failed)

    def _failed(self, exc: BaseException, size: int, seconds: float, where: str) -> Attempt:
        """Inside ``except``: the failed attempt at ``size``, recorded with the size to go on
        at; the :class:`OutOfMemoryError` when there is none smaller."""
        self.history.append(failure(exc, size, None, seconds))
        estimate = self.gauge.size_after(exc, size) if self.gauge is not None else None
        drop_frames(exc)  # before any raise: __cause__ must not keep the frames
        if size <= self.min_batch_size:  # nothing smaller to try
            raise OutOfMemoryError(
                f"map_batches: out of memory at batch_size={size}, the minimum, at {where}; "
                f"the finished results ({len(self.results)} calls) are on the error's "
                f".partial", self.history, self.results) from exc
        upcoming = next_size(self.factor, size, self.min_batch_size, estimate, "map_batches")
        self.history[-1] = dataclasses.replace(self.history[-1], next_batch_size=upcoming)
        return self.history[-1]


def map_batches(fn: Callable[[Any], T], data: Any, *, batch_size: Optional[int] = None,
                min_batch_size: int = 1, factor: Factor = 0.5,
                collate: Optional[Callable[[list[T]], Any]] = None,
                on_retry: Optional[Callable[[Attempt], Any]] = None) -> Any:
    """Apply ``fn`` to ``data`` in batches, shrinking the batch on out-of-memory.

    ``data`` is one of:

    - a sequence of items with ``len()`` and slicing (a list, a tensor, an array), cut into
      slices of ``batch_size``;
    - a tuple or dict (any ``Mapping``, nested) of per-sample parts, such as ``(x, y)`` or
      ``{"input_ids": ..., "attention_mask": ...}``: cut part by part, as
      :func:`auto_microbatch` cuts a batch, and ``fn`` receives the same structure;
    - a map-style ``torch.utils.data.Dataset``: ``batch_size`` samples at a time, collated
      with ``default_collate`` (a ``TensorDataset`` gives ``(x, y)`` of stacked tensors);
    - a ``DataLoader``, or any other iterable of batches: each batch goes to ``fn`` as it is
      (cut to ``batch_size`` when one is given and the batch is longer).

    On an out-of-memory only the failed batch (or slice) is retried, at
    ``max(min_batch_size, floor(size * factor))`` (half, by default), split along dim 0
    (element-wise for tuples and dicts), and the rest goes on at that size: finished work is
    never recomputed. ``factor`` means what it means to :func:`oom_retry`: a number between
    0 and 1; a callable ``size -> next size``, which must return a positive int below
    ``size`` (else ``ValueError``); or ``"auto"``, the next size measured from what the
    failed call took and asked for against what the budget that binds had left when it
    began (halving when the error states no size; the budgets are read before every call
    of ``fn``, a fraction of a millisecond each time). Returns a list of the results, one per
    call of ``fn`` (a :class:`BatchResults`, whose ``history`` holds the :class:`Attempt`
    records of the retries, each failure with its ``next_batch_size``), or
    ``collate(results)`` (``torch.cat``, say).
    ``on_retry(attempt)`` runs after each failed attempt's cleanup, before the retry. When
    the slice at ``min_batch_size``, or ``collate``, runs out of memory, the
    :class:`OutOfMemoryError` keeps the finished results, in order, on ``.partial``.

    >>> import memguard
    >>> memguard.map_batches(sum, list(range(10)), batch_size=4)
    [6, 22, 17]
    >>> memguard.map_batches(lambda b: sum(b[1]), ([1, 2, 3], [4, 5, 6]), batch_size=2)
    [9, 6]
    >>> memguard.map_batches(len, iter([[1, 2, 3], [4, 5]]))
    [3, 2]
    """
    check_start(batch_size, min_batch_size, "map_batches")
    factor = check_policy(factor)
    if on_retry is not None and not callable(on_retry):
        raise TypeError(f"map_batches: on_retry must be callable, got {on_retry!r}")
    from .backends.torch_data import collate as collate_samples, is_map_dataset

    mapper = _Mapper(fn, batch_size, min_batch_size, factor, on_retry)
    if isinstance(data, (tuple, Mapping)) or is_map_dataset(data) or (
            hasattr(data, "__len__") and hasattr(data, "__getitem__")):
        if batch_size is None:
            raise TypeError(f"map_batches needs batch_size=... for a {type(data).__name__} "
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
        raise TypeError(f"map_batches needs data with len() and slicing, a tuple or dict of "
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
                   lambda done: f"item {done} of {name}", whole=batch)


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
