"""``find_batch_size`` and ``map_batches``: the largest batch that fits, and inference over a
large input that shrinks its batches on out-of-memory without redoing finished work."""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable, Literal, Optional, Sequence, TypeVar

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
                    margin: float = 0.0, sync: Sync = "auto") -> int:
    """Probe ``step(batch_size)`` for the largest batch size that fits in memory.

    ``"power"`` doubles from ``start`` until the first out-of-memory (or ``max_batch_size``);
    ``"binsearch"`` then bisects between the last size that fitted and the first that failed
    until they are adjacent. Each trial calls ``step`` ``steps`` times (memory often peaks
    in the second step, once optimizer state exists) and memory is freed between trials as
    in :func:`oom_retry`. Returns the size found less the ``margin`` fraction (at least 1).
    In a distributed job each rank probes, then all adopt the smallest size. When even
    ``start`` fails: :class:`OutOfMemoryError`.

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
    agreement = Agreement(sync)
    trials: list[Attempt] = []

    def trial(size: int) -> bool:
        started = time.perf_counter()
        error = _fits(step, size, steps)
        trials.append(Attempt(size, None, error is None, error, time.perf_counter() - started))
        log.debug("memguard: find_batch_size trial %d: %s", size, error or "fits")
        return error is None

    if not trial(start):
        raise OutOfMemoryError(f"find_batch_size: even start={start} ran out of memory "
                               f"({trials[-1].error})", trials)
    good, bad = start, None
    while bad is None and (max_batch_size is None or good < max_batch_size):
        size = good * 2 if max_batch_size is None else min(good * 2, max_batch_size)
        if trial(size):
            good = size
        else:
            bad = size
    if mode == "binsearch" and bad is not None:
        while bad - good > 1:
            middle = (good + bad) // 2
            if trial(middle):
                good = middle
            else:
                bad = middle
    found = max(1, math.floor(good * (1 - margin)))
    found = agreement.smallest(found)
    log.info("memguard: find_batch_size found %d after %d trials", found, len(trials))
    return found


def map_batches(fn: Callable[[Any], T], data: Sequence[Any], *, batch_size: int,
                min_batch_size: int = 1, collate: Optional[Callable[[list[T]], Any]] = None
                ) -> Any:
    """Apply ``fn`` to ``data`` in batches, shrinking the batch on out-of-memory.

    ``data`` is anything with ``len()`` and slicing (a list, a tensor, an array). On an
    out-of-memory only the failed slice is retried, at half the size (never below
    ``min_batch_size``), and the rest goes on at that size: finished batches are never
    recomputed. Returns the list of results, or ``collate(results)`` (``torch.cat``, say).

    >>> import memguard
    >>> memguard.map_batches(sum, list(range(10)), batch_size=4)
    [6, 22, 17]
    """
    check_size(batch_size, "batch_size")
    check_size(min_batch_size, "min_batch_size")
    if min_batch_size > batch_size:
        raise ValueError(f"min_batch_size={min_batch_size} is larger than "
                         f"batch_size={batch_size}")
    if not hasattr(data, "__len__") or not hasattr(data, "__getitem__"):
        raise TypeError(f"map_batches needs data with len() and slicing, got "
                        f"{type(data).__name__}")
    results: list[T] = []
    failures: list[Attempt] = []
    total, done, size = len(data), 0, batch_size
    while done < total:
        chunk = data[done:done + size]
        try:
            out = fn(chunk)
        except BaseException as exc:
            if oom_kind(exc) is None:
                raise
            failures.append(Attempt(size, None, False, error_text(exc), 0.0))
            if size <= min_batch_size:
                raise OutOfMemoryError(
                    f"map_batches: out of memory at batch_size={size}, the minimum, at item "
                    f"{done} of {total}", failures) from exc
            drop_frames(exc)
        else:
            results.append(out)
            done += len(chunk)
            continue
        del chunk
        free_memory()
        size = max(min_batch_size, size // 2)
        log.warning("memguard: map_batches ran out of memory at item %d; going on at "
                    "batch_size=%d", done, size)
    return collate(results) if collate is not None else results
