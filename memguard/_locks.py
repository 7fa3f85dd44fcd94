"""Locks that a forked child gets back unlocked: ``os.fork()`` copies a lock held by another
thread as held, and the child's first memguard call would hang. Every memguard lock is a
:class:`ForkSafeLock`, re-created in the child (``os.register_at_fork``, and where a fork made
in C ran no handler, when a lock is found held in a process that did not make it)."""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any, Callable

_all: "weakref.WeakSet[ForkSafeLock]" = weakref.WeakSet()


class ForkSafeLock:
    """A ``threading.Lock`` (``threading.RLock`` with ``reentrant=True``) that a child
    process created by ``os.fork()`` finds unlocked.

    ``with lock:`` cannot leave it held on a Ctrl-C (a guard's every call, which a program
    may interrupt and go on from): ``__enter__`` hands ``with`` the ``threading`` lock's own
    acquire, which runs no Python code between taking the lock and the block that releases
    it. An ``__enter__`` written in Python could raise from a signal handler as its acquire
    returned, and leave the lock held for ever.

    >>> lock = ForkSafeLock()
    >>> with lock:
    ...     lock.acquire(blocking=False)
    False
    """

    __slots__ = ("inner", "_factory", "__weakref__")

    def __init__(self, reentrant: bool = False) -> None:
        self._factory = threading.RLock if reentrant else threading.Lock
        self.inner: Any = self._factory()  # a Lock, or an RLock (which has no locked())
        _all.add(self)

    @property
    def __enter__(self) -> Callable[[], bool]:
        """The acquire ``with`` calls: the ``threading`` lock's own, made anew first where it
        is found held in a child of a fork made in C (a re-entrant one is checked always:
        it cannot tell whether it is held)."""
        inner = self.inner
        if (self._factory is not threading.Lock or inner.locked()) \
                and _made_by[0] != os.getpid():
            _recreate_in_child()
            inner = self.inner
        return inner.__enter__

    @property
    def __exit__(self) -> Callable[..., Any]:
        """The release ``with`` calls: the ``threading`` lock's own."""
        return self.inner.__exit__

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        """As ``threading.Lock.acquire``."""
        return self.inner.acquire(False) or self._held(blocking, timeout)

    def _held(self, blocking: bool, timeout: float) -> bool:
        """Acquire a lock found held: a child of a fork made in C (ctypes, an extension) ran no
        handler, and finds held what another thread of its parent held (the process id tells)."""
        if _made_by[0] != os.getpid():
            _recreate_in_child()
            return self.inner.acquire(blocking, timeout)
        return blocking and self.inner.acquire(True, timeout)

    def release(self) -> None:
        """As ``threading.Lock.release``."""
        self.inner.release()


_made_by = [os.getpid()]  # the process the locks were made in


def _recreate_in_child() -> None:
    _made_by[0] = os.getpid()
    for lock in list(_all):
        lock.inner = lock._factory()  # noqa: SLF001 - the module's own locks, re-created in the child


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_recreate_in_child)
