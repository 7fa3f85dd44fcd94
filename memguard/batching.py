"""``find_batch_size`` and ``map_batches``: the largest batch that fits, and inference over a
large input that shrinks its batches on out-of-memory without redoing finished work."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from typing import Any, Callable, Literal, Optional, TypeVar

from ._slices import ITEMS, Plan, plan_batch
from .cleanup import drop_frames, free_memory
from .distributed import Agreement, Sync
from .errors import OutOfMemoryError, oom_kind
from .retry import Attempt, check_size, error_text

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
                    mode: Literal["binsearch", "power"] = "binsearch", steps: int = 1,
                    margin: float = 0.0, max_trials: int = 25, sync: Sync = "auto") -> int:
    """Probe ``step(batch_size)`` for the largest batch size that fits in memory.

    ``"power"`` doubles from ``start`` until the first out-of-memory (or ``max_batch_size``);
    ``"binsearch"`` then bisects between the last size that fitted and the first that failed
    until they are adjacent. Each trial calls ``step`` ``steps`` times (memory often peaks
    in the second step, once optimizer state exists) and memory is freed between trials as
    in :func:`oom_retry`. A size that runs out of memory is tried once more before it counts
    as too big (an allocator that fails now and then, another process's spike); the search
    stops at ``max_batch_size`` or after ``max_trials`` sizes (the largest that fitted is
    returned, with a warning when the limit cut the search short). Returns the size found
    less the ``margin`` fraction (at least 1). In a distributed job each rank probes, then
    all adopt the smallest size. When even ``start`` fails twice: :class:`OutOfMemoryError`.

    >>> import memguard
    >>> def step(batch_size):
    ...     if batch_size > 300:
    ...         raise MemoryError("too big")
    >>> memguard.find_batch_size(step, start=16)
    300
    """
    check_size(start, "start")
    check_size(steps, "steps")
    if max_batch_size is not None and check_size(max_batch_size, "max_batch_size") < start:
        raise ValueError(f"max_batch_size={max_batch_size} is smaller than start={start}")
    if mode not in ("binsearch", "power"):
        raise ValueError(f"mode must be 'binsearch' or 'power', got {mode!r}")
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
        raise ValueError(f"margin must be a fraction in [0, 1), got {margin!r}")
    check_size(max_trials, "max_trials")
    agreement = Agreement(sync)
    trials: list[Attempt] = []  # one per size: a confirmed failure is recorded once

    def trial(size: int) -> bool:
        started = time.perf_counter()
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
    found = max(1, math.floor(good * (1 - margin)))
    found = agreement.smallest(found)
    log.info("find_batch_size found %d after %d trials", found, len(trials))
    return found


def map_batches(fn: Callable[[Any], T], data: Any, *, batch_size: int,
                min_batch_size: int = 1, collate: Optional[Callable[[list[T]], Any]] = None
                ) -> Any:
    """Apply ``fn`` to ``data`` in batches, shrinking the batch on out-of-memory.

    ``data`` is a sequence of items with ``len()`` and slicing (a list, a tensor, an array),
    or a tuple or dict (any ``Mapping``, nested) of per-sample parts, such as ``(x, y)`` or
    ``{"input_ids": ..., "attention_mask": ...}``: those are cut part by part, as
    :func:`auto_microbatch` cuts a batch, and ``fn`` receives the same structure. On an
    out-of-memory only the failed slice is retried, at half the size (never below
    ``min_batch_size``), and the rest goes on at that size: finished batches are never
    recomputed. Returns the list of results, or ``collate(results)`` (``torch.cat``, say).
    When the slice at ``min_batch_size``, or ``collate``, runs out of memory, the
    :class:`OutOfMemoryError` keeps the finished results, in order, on ``.partial``.

    >>> import memguard
    >>> memguard.map_batches(sum, list(range(10)), batch_size=4)
    [6, 22, 17]
    >>> memguard.map_batches(lambda b: sum(b[1]), ([1, 2, 3], [4, 5, 6]), batch_size=2)
    [9, 6]
    """
    check_size(batch_size, "batch_size")
    check_size(min_batch_size, "min_batch_size")
    if min_batch_size > batch_size:
        raise ValueError(f"min_batch_size={min_batch_size} is larger than "
                         f"batch_size={batch_size}")
    if isinstance(data, (tuple, Mapping)):
        plan = plan_batch(data)  # cut part by part
    elif hasattr(data, "__len__") and hasattr(data, "__getitem__"):
        plan = Plan(ITEMS, len(data))
    else:
        raise TypeError(f"map_batches needs data with len() and slicing, or a tuple or dict "
                        f"of those, got {type(data).__name__}")
    results: list[T] = []
    failures: list[Attempt] = []
    total, done, size = plan.length, 0, batch_size
    while done < total:
        stop = min(done + size, total)
        chunk = plan.cut(data, done, stop)
        if plan.kind == ITEMS:
            _check_slice(data, chunk, done, stop)
        try:
            out = fn(chunk)
        except BaseException as exc:
            if oom_kind(exc) is None:
                raise
            failures.append(Attempt(size, None, False, error_text(exc), 0.0))
            if size <= min_batch_size:
                raise OutOfMemoryError(
                    f"map_batches: out of memory at batch_size={size}, the minimum, at item "
                    f"{done} of {total}; the results of items 0 to {done - 1} are on the "
                    f"error's .partial", failures, results) from exc
            drop_frames(exc)
        else:
            results.append(out)
            done = stop
            continue
        del chunk
        free_memory()
        size = max(min_batch_size, size // 2)
        log.warning("map_batches ran out of memory at item %d; going on at batch_size=%d",
                    done, size)
    if collate is None:
        return results
    try:
        return collate(results)
    except BaseException as exc:
        if oom_kind(exc) is None:
            raise
        raise OutOfMemoryError(f"map_batches: collate ran out of memory joining {len(results)} "
                               f"results; they are on the error's .partial", failures,
                               results) from exc


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
