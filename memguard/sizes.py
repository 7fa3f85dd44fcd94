"""Sizes measured instead of guessed: what an attempt's memory says of the next size.

- :func:`size_after_oom`: the next size after an out-of-memory, from what the failed attempt
  used and asked for against what the budget could give (``factor="auto"``).
- :class:`Gauge`: what ``factor="auto"`` measures of an attempt.
- :class:`MemoryFit`: memory = fixed + per-sample x size, fitted to measured peaks, and the
  largest size a budget holds (``find_batch_size(mode="predict")``).
"""

from __future__ import annotations

import logging
import math
from typing import Optional

from ._units import format_bytes
from .backends.budget import available as budget_available, watched_devices
from .errors import oom_device, requested_bytes

log = logging.getLogger("memguard")

AUTO_MARGIN = 0.05
"""The share of the available memory ``factor="auto"`` and ``mode="predict"`` leave unused."""
AUTO_MAX, AUTO_MIN = 0.9, 0.25
"""``factor="auto"`` moves to between ``size * AUTO_MIN`` and ``size * AUTO_MAX``."""


def size_after_oom(size: int, need: Optional[int], available: Optional[int],
                   margin: float = AUTO_MARGIN) -> Optional[int]:
    """The next size after an out-of-memory at ``size``: the attempt needed at least ``need``
    bytes (what it had taken when it failed plus what the failed allocation asked for)
    where ``available`` bytes were free when it began, so at most ``available / need * size``
    samples fit; less ``margin``, and between ``size * 0.25`` and ``size * 0.9``. ``None``
    when either figure is unknown (the caller then halves).

    >>> size_after_oom(512, need=1024 * 2**20, available=700 * 2**20)
    332
    >>> size_after_oom(512, need=600 * 2**20, available=700 * 2**20)  # never above size * 0.9
    460
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
    >>> round(fit.per_sample() / 2**20, 3), fit.largest(500 * 2**20, margin=0.0)
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

    def per_sample(self) -> Optional[float]:
        """Bytes per sample, or ``None`` when not known yet."""
        line = self.line()
        return None if line is None else line[1]

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
    """What ``factor="auto"`` measures of one attempt: what each watched device could still
    give when it began (:meth:`start`) and, inside ``except`` while the failed attempt still
    holds its memory, what it took and asked for (:meth:`size_after`)."""

    def __init__(self, who: str) -> None:
        self.who = who
        self.before: dict[str, Optional[int]] = {}

    def start(self) -> None:
        """Before an attempt."""
        self.before = {d: _safe_available(d) for d in watched_devices()}

    def size_after(self, exc: BaseException, size: int) -> Optional[int]:
        """Inside ``except``: the size the failed attempt's measured memory says fits (see
        :func:`~memguard.sizes.size_after_oom`), ``None`` when it cannot be measured."""
        device = oom_device(exc)
        if device == "cuda":
            device = next((d for d in self.before if d.startswith("cuda:")), device)
        before = self.before.get(device)
        now = _safe_available(device)
        asked = requested_bytes(exc)
        if before is None or now is None or asked is None:
            log.debug("%s: factor='auto' cannot measure this out-of-memory on %s (available "
                      "%s, asked %s); halving", self.who, device, before, asked)
            return None
        need = max(0, before - now) + asked
        estimate = size_after_oom(size, need, before)
        log.debug("%s: attempt at %d needed >= %s of %s available on %s; next %s", self.who,
                  size, format_bytes(need), format_bytes(before), device, estimate)
        return estimate


def _safe_available(device: str) -> Optional[int]:
    """What ``device`` can still give under its binding budget; ``None`` if unknown."""
    try:
        return budget_available(device)
    except Exception:  # noqa: BLE001 - a reading must never mask the out-of-memory
        return None
