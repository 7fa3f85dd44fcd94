"""Sizes measured instead of guessed: :func:`size_after_oom` (the next size after an
out-of-memory), :class:`Gauge` (what ``factor="auto"`` measures) and :class:`MemoryFit`
(memory = fixed + per-sample x size, for ``find_batch_size(mode="predict")``)."""

from __future__ import annotations

import logging
import math
from typing import Optional

from ._units import format_bytes
from .backends.budget import budget as binding_budget, watched_devices
from .errors import oom_device, requested_bytes

log = logging.getLogger("memguard")

AUTO_MARGIN = 0.05
"""The share of the available memory ``factor="auto"`` and ``mode="predict"`` leave unused."""
AUTO_MAX, AUTO_MIN = 0.9, 0.25
"""``factor="auto"`` moves to between ``size * AUTO_MIN`` and ``size * AUTO_MAX``."""
AUTO_AFTER_MISS = 0.5
"""``factor="auto"`` goes no higher than ``size * AUTO_AFTER_MISS`` when what it measured says
no more than the failure itself (see :class:`Gauge`): the fixed factor's step."""


def size_after_oom(size: int, need: Optional[int], available: Optional[int],
                   margin: float = AUTO_MARGIN) -> Optional[int]:
    """The next size after an out-of-memory at ``size``: at most ``available / need * size``
    (``need``: what the attempt held plus what it asked for), less ``margin``, between
    ``size * 0.25`` and ``size * 0.9``; ``None`` when a figure is unknown (the caller halves).

    >>> size_after_oom(512, need=1024 * 2**20, available=700 * 2**20)
    332
    """
    if need is None or available is None or need <= 0 or available <= 0:
        return None
    estimate = math.floor(size * available * (1 - margin) / need)
    return max(1, min(math.floor(size * AUTO_MAX), max(math.ceil(size * AUTO_MIN), estimate)))


class MemoryFit:
    """Measured memory of trials at several sizes on one device, fitted as
    ``memory = fixed + per_sample * size`` by least squares.

    >>> fit = MemoryFit()
    >>> for size in (1, 16, 200):
    ...     fit.add(size, 10 * 2**20 + size * 2**20)
    >>> fixed, per_sample = fit.line()
    >>> round(per_sample / 2**20, 3), fit.largest(500 * 2**20, margin=0.0)
    (1.0, 490)
    """

    def __init__(self) -> None:
        self.points: list[tuple[int, int]] = []

    def add(self, size: int, memory: int) -> None:
        """Record that a trial at ``size`` took ``memory`` bytes at its peak."""
        self.points.append((size, max(0, memory)))

    def line(self) -> Optional[tuple[float, float]]:
        """``(fixed, per_sample)``, or ``None`` with fewer than two sizes or no growth."""
        sizes = {s for s, _ in self.points}
        if len(sizes) < 2:
            return None
        n = len(self.points)
        mean_s = sum(s for s, _ in self.points) / n
        mean_m = sum(m for _, m in self.points) / n
        var = sum((s - mean_s) ** 2 for s, _ in self.points)
        slope = sum((s - mean_s) * (m - mean_m) for s, m in self.points) / var
        if slope <= 0:
            return None
        return mean_m - slope * mean_s, slope

    def cautious(self, noise: int) -> Optional[tuple[float, float]]:
        """``(fixed, per_sample)`` with ``per_sample`` the most the points allow when each reading
        may be ``noise`` bytes off, and ``fixed`` what the smallest size then leaves; ``None``
        with fewer than two sizes.

        >>> fit = MemoryFit()
        >>> fit.add(1, 101 * 2**20); fit.add(2, 102 * 2**20)
        >>> [round(v / 2**20) for v in fit.cautious(2**20)]
        [99, 2]
        """
        sizes = sorted({s for s, _ in self.points})
        if len(sizes) < 2:
            return None
        line = self.line()
        per_sample = (line[1] if line is not None else 0.0) + noise / (sizes[-1] - sizes[0])
        smallest = min(m for s, m in self.points if s == sizes[0])
        return max(0.0, smallest - per_sample * sizes[0]), per_sample

    def spread(self) -> int:
        """The largest measured memory less the smallest: how much the fit rests on."""
        memories = [m for _, m in self.points]
        return max(memories) - min(memories) if memories else 0

    def largest(self, available: int, margin: float = AUTO_MARGIN) -> Optional[int]:
        """The largest size whose fitted memory fits ``available`` less ``margin``."""
        line = self.line()
        if line is None:
            return None
        fixed, slope = line
        return max(0, math.floor((available * (1 - margin) - max(0.0, fixed)) / slope))


class Gauge:
    """What ``factor="auto"`` measures of one attempt (``who`` names it in the log): what each
    device could give when it began (:meth:`start`) and, inside ``except``, what it took and
    asked for (:meth:`size_after`). A lower bound, so the size halves instead where it says
    no more than the failure itself.

    >>> gauge = Gauge("train")
    >>> gauge.start()
    >>> gauge.size_after(MemoryError(), 64) is None  # no size stated: the caller halves
    True
    """

    def __init__(self, who: str) -> None:
        self.who = who
        self.before: dict[str, Optional[tuple[int, int]]] = {}
        self.guess: Optional[int] = None  # the last measured size, not tried yet
        self.trying: Optional[int] = None  # the measured size the running attempt tries

    def start(self) -> None:
        """Before an attempt."""
        self.trying, self.guess = self.guess, None
        self.before = {d: _safe_reading(d) for d in watched_devices()}

    def size_after(self, exc: BaseException, size: int) -> Optional[int]:
        """Inside ``except``: the size the failed attempt's memory says fits
        (:func:`~memguard.sizes.size_after_oom`), at most ``size * 0.5`` where the measurement says
        nothing more; ``None`` when unmeasured."""
        device = oom_device(exc)
        if device == "cuda":
            device = next((d for d in self.before if d.startswith("cuda:")), device)
        before = self.before.get(device)
        now = _safe_reading(device)
        asked = requested_bytes(exc)
        missed = self.trying is not None and size <= self.trying
        self.trying = None
        if before is None or now is None or asked is None:
            log.debug("%s: factor='auto' cannot measure this out-of-memory on %s (available "
                      "%s, asked %s); halving", self.who, device, before, asked)
            return None
        # what the attempt took: of all there was, or of new memory alone, whichever is more
        # (blocks it freed before the failure, inside a failed list comprehension or a
        # framework's op, are free in the allocator again but still mapped)
        need = max(0, before[0] - now[0], before[1] - now[1]) + asked
        estimate = size_after_oom(size, need, before[0])
        why = ""
        if estimate is not None and estimate >= math.floor(size * AUTO_MAX):
            why = "it needed hardly more than there was, which every failure shows"
        elif missed:
            why = "the measured guess failed"
        if why and estimate is not None:
            estimate = min(estimate, max(1, math.floor(size * AUTO_AFTER_MISS)))
            self.guess = None
        else:
            self.guess = estimate
        log.debug("%s: attempt at %d needed >= %s of %s available on %s; next %s%s", self.who,
                  size, format_bytes(need), format_bytes(before[0]), device, estimate,
                  f" ({why}: no gentler than halving)" if why else "")
        return estimate


def _safe_reading(device: str) -> Optional[tuple[int, int]]:
    """What ``device`` can still give under its budget, and how much of it is new memory."""
    try:
        found = binding_budget(device)
    except Exception:  # noqa: BLE001 - a reading must never mask the out-of-memory
        return None
    if found is None:
        return None
    return found.available, max(0, found.limit - found.used)
