"""Working sizes: remembered in a file shared across processes and restarts, and predicted from
what memory an attempt measured instead of guessed from a fixed factor.

- :class:`SizeFile`: a JSON file of working sizes, keyed by the function's qualified name, the
  start size and the device (name and total memory). Written atomically (a temporary file
  renamed over it) under an advisory lock, so ranks and processes sharing it merge their
  entries; a corrupt or unreadable file is a warning, never a crash.
- :func:`size_after_oom`: the next size after an out-of-memory, from what the failed attempt
  used and asked for against what the budget could give (``oom_retry(factor="auto")``).
- :class:`MemoryFit`: memory = fixed + per-sample x size, fitted to measured peaks, and the
  largest size a budget holds (``find_batch_size(mode="predict")``).
- the size policy ``oom_retry`` and ``map_batches`` share: ``factor`` checked
  (:func:`check_policy`), the next size (:func:`next_size`), what ``factor="auto"`` measures
  of an attempt (:class:`Gauge`), a start size checked against ``min_batch_size``.
"""

from __future__ import annotations

import logging
import math
import os
import warnings
from typing import Any, Callable, Literal, Optional, Union

from ._checks import fraction, positive_int
from ._decorate import name_of
from ._units import format_bytes
from .backends.budget import budget as binding_budget, device_identity, watched_devices
from .errors import oom_device, requested_bytes

log = logging.getLogger("memguard")
PathLike = Union[str, "os.PathLike[str]"]
Factor = Union[float, Literal["auto"], Callable[[int], int]]
"""How the size shrinks after an out-of-memory: a fraction, ``"auto"`` or ``size -> size``."""

AUTO_MARGIN = 0.05
"""The share of the available memory ``factor="auto"`` and ``mode="predict"`` leave unused."""
AUTO_MAX, AUTO_MIN = 0.9, 0.25
"""``factor="auto"`` moves to between ``size * AUTO_MIN`` and ``size * AUTO_MAX``."""
AUTO_AFTER_MISS = 0.5
"""``factor="auto"`` goes no higher than ``size * AUTO_AFTER_MISS`` when what it measured says
no more than the failure itself (see :class:`Gauge`): the fixed factor's step."""


def qualified_name(func: Any) -> str:
    """``module.QualName`` of a function (or of a callable object's class).

    >>> qualified_name(qualified_name)
    'memguard.sizes.qualified_name'
    """
    target = getattr(func, "__func__", func)
    name = getattr(target, "__qualname__", None) or type(target).__qualname__
    module = getattr(target, "__module__", None) or type(target).__module__
    return f"{module}.{name}"


def size_key(kind: str, func: Any, start: int, device: Optional[str] = None) -> str:
    """The key a working size is kept under: who found it, for which function, from which
    start, on which device (``device_identity()`` unless given).

    >>> size_key("oom_retry", qualified_name, 64, "host x86_64 (1 bytes)")
    'oom_retry memguard.sizes.qualified_name start=64 on host x86_64 (1 bytes)'
    """
    return f"{kind} {qualified_name(func)} start={start} on {device or device_identity()}"


def check_path(value: Any, name: str = "cache") -> str:
    """``value`` as a path string, or a ``TypeError`` that says what ``name`` takes."""
    try:
        path = os.fspath(value)
    except TypeError:
        raise TypeError(f"{name} must be True, False or a file path (str or os.PathLike), got "
                        f"{value!r} of type {type(value).__name__}") from None
    if not isinstance(path, str) or not path:
        raise TypeError(f"{name} must be a non-empty file path, got {value!r}")
    return path


class SizeFile:
    """Working sizes kept in a JSON file: ``{"memguard sizes": 1, "sizes": {key: size}}``.

    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "sizes.json")
    >>> sizes = SizeFile(path)
    >>> sizes.put("train start=256 on host", 48)
    >>> SizeFile(path).get("train start=256 on host")
    48
    """

    FORMAT = "memguard sizes"

    def __init__(self, path: PathLike) -> None:
        self.path = check_path(path)

    def _warn(self, what: str, exc: BaseException) -> None:
        message = (f"memguard: cannot {what} the size cache {self.path!r} ({exc}); going on "
                   f"without it. Delete or fix the file, or pass another path")
        warnings.warn(message, RuntimeWarning, stacklevel=4)
        log.warning("%s", message)

    def _read(self) -> dict[str, int]:
        try:
            with open(self.path, encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError:
            return {}
        except OSError as exc:
            self._warn("read", exc)
            return {}
        import json

        try:
            data = json.loads(text)
            sizes = data["sizes"] if isinstance(data, dict) and self.FORMAT in data else None
            if not isinstance(sizes, dict):
                raise ValueError("not a memguard size file")
            return {str(k): int(v) for k, v in sizes.items()
                    if isinstance(v, int) and not isinstance(v, bool) and v > 0}
        except (ValueError, KeyError, TypeError) as exc:
            self._warn("read", exc)
            return {}

    def get(self, key: str) -> Optional[int]:
        """The size kept under ``key``, or ``None``."""
        return self._read().get(key)

    def put(self, key: str, size: int) -> None:
        """Keep ``size`` under ``key``: read, merge and replace the file under a lock, so
        entries other processes wrote meanwhile are kept."""
        folder = os.path.dirname(os.path.abspath(self.path))
        try:
            with _FileLock(self.path + ".lock"):
                sizes = self._read()
                if sizes.get(key) == size:
                    return
                sizes[key] = size
                import json
                import tempfile

                mode = _mode_of(self.path)  # mkstemp's 0600 would lock other users out
                handle, temporary = tempfile.mkstemp(prefix=".memguard-sizes-", dir=folder)
                try:
                    with os.fdopen(handle, "w", encoding="utf-8") as f:
                        json.dump({self.FORMAT: 1, "sizes": sizes}, f, indent=1,
                                  sort_keys=True)
                        f.flush()
                        os.fsync(f.fileno())
                    os.chmod(temporary, mode)
                    os.replace(temporary, self.path)
                except BaseException:
                    try:
                        os.unlink(temporary)
                    except OSError:
                        pass
                    raise
                _sync_folder(folder)
        except OSError as exc:
            self._warn("write", exc)


def _mode_of(path: str) -> int:
    """The permission bits of the file at ``path``; ``0o644`` where there is none."""
    import stat

    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return 0o644


def _sync_folder(folder: str) -> None:
    """Make a rename in ``folder`` durable where the OS lets a folder be synced."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # Windows cannot open a folder: the rename is all there is
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class _FileLock:
    """An exclusive ``flock`` on ``path`` (created if missing); nothing where ``fcntl`` is
    missing (the rename alone keeps the file whole there)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd: Optional[int] = None

    def __enter__(self) -> "_FileLock":
        try:
            import fcntl
        except ImportError:
            return self
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        locked = False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            locked = True
        finally:
            if not locked:  # flock raised (an interrupt, a file system without locks)
                os.close(fd)
        self.fd = fd
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.fd is not None:
            import fcntl

            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


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


def check_start(size: Any, min_batch_size: Any, who: str, name: str = "batch_size") -> None:
    """The starting size ``size`` (``None``: not known yet) and ``min_batch_size`` as positive
    ints, ``min_batch_size`` no larger than ``size``; else a ``ValueError`` naming them."""
    if size is not None:
        positive_int(size, name)
    positive_int(min_batch_size, "min_batch_size")
    if size is not None and min_batch_size > size:
        raise ValueError(f"{who}: min_batch_size={min_batch_size} is larger than the starting "
                         f"{name}={size}; lower min_batch_size or start larger")


def check_policy(factor: Any) -> Factor:
    """``factor`` as ``oom_retry`` and ``map_batches`` take it: a fraction, ``"auto"`` or a
    callable."""
    if factor == "auto" and isinstance(factor, str):
        return "auto"
    if callable(factor):
        return factor
    if isinstance(factor, str):
        raise ValueError(f"factor must be a number between 0 and 1 (exclusive), 'auto' or a "
                         f"callable size -> next size, got {factor!r}")
    return fraction(factor, "factor")


def next_size(factor: Factor, size: int, minimum: int, estimate: Optional[int] = None,
              who: str = "oom_retry") -> int:
    """The size after an out-of-memory at ``size`` (above ``minimum``): ``floor(size *
    factor)``, what a callable ``factor`` returns (checked: a positive int below ``size``), or
    for ``"auto"`` the measured ``estimate`` (half when nothing was measured); never below
    ``minimum``.

    >>> next_size(0.25, 64, 1), next_size("auto", 64, 1), next_size(lambda s: s - 30, 64, 40)
    (16, 32, 40)
    """
    if factor == "auto":
        upcoming = estimate if estimate is not None else size // 2
    elif callable(factor):
        upcoming = factor(size)
        if isinstance(upcoming, bool) or not isinstance(upcoming, int) or not 0 < upcoming < size:
            raise ValueError(f"{who}: factor {name_of(factor)}({size}) returned {upcoming!r}; "
                             f"it must return a positive int smaller than {size}")
    else:
        upcoming = math.floor(size * factor)
    return max(minimum, upcoming)


class Gauge:
    """What ``factor="auto"`` measures of one attempt: what each watched device could still
    give when it began (:meth:`start`) and, inside ``except`` while the failed attempt still
    holds its memory, what it took and asked for (:meth:`size_after`).

    A measurement is a lower bound: the attempt needed at least what it held plus what it
    asked for, maybe much more (the allocations it never reached). Two cases say no more
    than the failure itself, and then the size halves as the fixed factor 0.5 would:

    - the attempt measured as needing hardly more than there was (the estimate would be
      ``size * AUTO_MAX`` or more): any failure shows that much;
    - the attempt was the measured guess of the one before it and failed too: the guess
      was too large, the next step is no gentler than halving.

    Args:
        who: the name the log lines give.

    Example:
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
        """Inside ``except``: the size the failed attempt's measured memory says fits (see
        :func:`~memguard.sizes.size_after_oom`), no more than ``size * 0.5`` when the
        measurement says no more than the failure does (see the class); ``None`` when it
        cannot be measured (the caller then halves).

        Args:
            exc: the out-of-memory error of the attempt.
            size: the size the attempt ran at.

        Returns:
            The next size, or ``None``.
        """
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
    """What ``device`` can still give under its binding budget, and what of it is new memory
    (not what the allocator holds free); ``None`` if unknown."""
    try:
        found = binding_budget(device)
    except Exception:  # noqa: BLE001 - a reading must never mask the out-of-memory
        return None
    if found is None:
        return None
    return found.available, max(0, found.limit - found.used)
