"""``record_history``: capture what filled the GPU as a PyTorch memory snapshot (around
``torch.cuda.memory._record_memory_history``), for https://pytorch.org/memory_viz."""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Optional, TypeVar

from ._checks import positive_int, warn_at_caller
from ._decorate import guard
from ._locks import ForkSafeLock
from .backends import torch as torch_backend
from .errors import is_oom_error

log = logging.getLogger("memguard")
F = TypeVar("F", bound=Callable[..., Any])

_lock = ForkSafeLock()
_depth = 0
_warned = False


def start_recording(max_entries: int) -> bool:
    """Start recording CUDA allocations (nested calls share one recording); False without
    CUDA, with a warning the first time."""
    global _depth, _warned
    if not torch_backend.history_supported():
        if not _warned:
            _warned = True
            warn_at_caller("memguard: recording memory history needs CUDA; without it "
                           "record_history and oom_retry(cuda_snapshot_dir=...) do nothing")
        return False
    with _lock:  # pragma: gpu
        if _depth == 0:
            torch_backend.start_history(max_entries)
        _depth += 1
    return True  # pragma: gpu


def stop_recording() -> None:  # pragma: gpu
    """End one :func:`start_recording`; the outermost turns recording off."""
    global _depth
    with _lock:
        _depth -= 1
        if _depth == 0:
            torch_backend.stop_history()


def dump(path: str) -> Optional[str]:  # pragma: gpu
    """Write the recorded snapshot to ``path`` (folders created); the path, or None if it
    could not be written (logged)."""
    try:
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        torch_backend.dump_history(path)
        log.warning("memory snapshot written to %s (open it at "
                    "https://pytorch.org/memory_viz)", path)
        return path
    except Exception as exc:  # noqa: BLE001 - never mask the error being diagnosed
        log.warning("could not write the memory snapshot %s: %s", path, exc)
        return None


class RecordHistory:
    """The object :func:`record_history` returns: a context manager and a decorator.

    Attributes:
        path: the file a snapshot is written to.
        dumped: the path the last block wrote, or ``None`` (no out-of-memory with
            ``on_oom_only``, or no CUDA).

    >>> import memguard
    >>> recorder = memguard.record_history("oom.pickle", max_entries=10_000)
    >>> with recorder:
    ...     pass
    >>> recorder.dumped is None
    True
    """

    def __init__(self, path: str = "memory_snapshot.pickle", *, max_entries: int = 100_000,
                 on_oom_only: bool = True) -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"record_history: path must be a string, got {path!r}")
        positive_int(max_entries, "max_entries", who="record_history")
        self.path = os.fspath(path)
        self.max_entries = max_entries
        self.on_oom_only = on_oom_only
        self.dumped: Optional[str] = None
        self._recording = False

    def __enter__(self) -> "RecordHistory":
        self.dumped = None
        self._recording = start_recording(self.max_entries)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if not self._recording:
            return
        self._recording = False  # pragma: gpu
        try:  # pragma: gpu
            if not self.on_oom_only or (exc is not None and is_oom_error(exc)):
                self.dumped = dump(self.path)
        finally:  # pragma: gpu
            stop_recording()

    def __call__(self, func: F) -> F:
        return guard(func, lambda: RecordHistory(self.path, max_entries=self.max_entries,
                                                 on_oom_only=self.on_oom_only),
                     "record_history", kinds=("sync", "async"))


def record_history(path: str = "memory_snapshot.pickle", *, max_entries: int = 100_000,
                   on_oom_only: bool = True) -> RecordHistory:
    """Record CUDA allocations inside a block and dump a snapshot when an out-of-memory passes
    through it; recording stops on exit. Without CUDA it warns once and does nothing.

    Args:
        path: the file the snapshot is written to (a pickle that memory_viz opens).
            Default ``"memory_snapshot.pickle"``.
        max_entries: how many allocation events PyTorch keeps (a positive int).
            Default ``100_000``.
        on_oom_only: dump only when an out-of-memory passes through; ``False`` dumps on every
            exit. Default ``True``.

    Returns:
        A :class:`RecordHistory`; its ``dumped`` is the path written, if any.

    Raises:
        ValueError: a ``max_entries`` that is not a positive int.

    >>> import memguard
    >>> with memguard.record_history("oom.pickle"):  # doctest: +SKIP
    ...     train()
    """
    return RecordHistory(path, max_entries=max_entries, on_oom_only=on_oom_only)
