"""The host process: resident memory, its peak, and glibc's free-list trimming.

- ``reserved`` is the process's resident set size (RSS);
- ``allocated`` is what glibc's malloc has handed out and not yet freed (``mallinfo2``), which
  is where torch and TensorFlow CPU tensors live; without glibc it equals the RSS. TensorFlow
  with oneDNN (its default on x86) cuts CPU tensors from blocks its own pool took from malloc
  and keeps: the bytes that pool hands out are added (:func:`.tensorflow.cpu_pool_in_use`), so
  a tensor kept in the pool counts once in what a block retained, which ``mallinfo2`` alone
  does not see (the pool's blocks count in ``mallinfo2`` too: the level is that much above
  what the process really uses, and a block during which the pool took a new block of its own
  retains that block as well);
- ``peak`` is the kernel's high-water mark of the RSS (``VmHWM``), reset by writing ``5`` to
  ``/proc/self/clear_refs``; where that is not allowed, the highest RSS memguard has read
  since the last reset;
- emptying the cache is glibc's ``malloc_trim(0)``: after ``del`` of many torch CPU tensors the
  RSS stays up until it runs.
"""

from __future__ import annotations

import itertools
import os
import re
import sys
import threading
import time
from threading import get_ident
from typing import Any, Callable, Iterable, Optional

from .._locks import ForkSafeLock

try:
    import resource
except ImportError:  # Windows: used only where /proc/self/clear_refs is (Linux)
    resource = None  # type: ignore[assignment]
from .base import Backend, DeviceMemory, Reading
from .tensorflow import cpu_pool_in_use

HOST = "host"
SLOW_MALLINFO = 100e-6  # seconds: a mallinfo2 slower than this is not read on every call
MALLINFO_PAUSE = 10.0  # seconds the resident set stands in after a slow mallinfo2
SLOW_IN_A_ROW = 2  # mallinfo2 slow this many times running: the heap is slow, not the machine
# the kernel sums a resident set's per-CPU parts approximately (here readings a reset and a
# read apart differed by up to 256 kB either way): getrusage read at a reset may exceed the
# resident set read next by that much and still be the process's own mark
USAGE_SLACK = 1 << 20


_glibc: dict[str, Any] = {}


def _libc() -> dict[str, Any]:
    """glibc's functions memguard calls, loaded once; empty without glibc.

    ``pread`` and ``mallinfo2`` take microseconds and are called *without* releasing the
    interpreter lock (``ctypes.PyDLL``). Released, each would send a sampling thread back to
    the end of the queue for the lock, a switch interval behind a busy thread: a monitor
    would fall behind its interval under a CPU-bound loop. ``malloc_trim`` can take
    milliseconds: it lets the lock go (``ctypes.CDLL``).
    """
    if "loaded" not in _glibc:
        _glibc["loaded"] = True
        try:
            import ctypes

            held, released = ctypes.PyDLL(None), ctypes.CDLL(None)
            trim = released.malloc_trim
            trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
            pread = held.pread
            pread.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_long]
            pread.restype = ctypes.c_ssize_t
            _glibc.update(malloc_trim=trim, pread=pread, buffer=ctypes.create_string_buffer)
            malloc, free = held.malloc, held.free
            malloc.argtypes, malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
            free.argtypes, free.restype = [ctypes.c_void_p], None
            _glibc.update(malloc=malloc, free=free)
            fields = ("arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks "
                      "keepcost").split()

            class MallInfo2(ctypes.Structure):
                _fields_ = [(f, ctypes.c_size_t) for f in fields]

            mallinfo2 = held.mallinfo2  # glibc >= 2.33
            mallinfo2.restype = MallInfo2
            _glibc["mallinfo2"] = mallinfo2
        except (OSError, AttributeError):
            pass
    return _glibc


class _KeptFile:
    """A descriptor kept open, made sure of before each use: the same file, opened by this
    process. A program may close it (a daemon's ``os.closerange``) and open a file of its own
    under the number, which memguard must never write or close (a kept
    ``/proc/self/clear_refs`` descriptor wrote "5" into a program's log), nor take a reading
    from (:class:`_ProcFile` checks what it read instead). After ``fork`` it is opened again
    (an inherited one reads the parent; a fork C code makes runs no ``os.register_at_fork``
    handler)."""

    __slots__ = ("path", "flags", "fd", "pid", "identity")

    def __init__(self, path: str, flags: int = os.O_RDONLY) -> None:
        self.path = path
        self.flags = flags | getattr(os, "O_CLOEXEC", 0)
        self.fd: Optional[int] = None
        self.pid = -1  # the process that opened it
        self.identity: Optional[tuple[int, int]] = None  # its device and inode

    def get(self) -> int:
        """The descriptor, opened again where it is no longer this process's file."""
        if self._ours():
            return self.fd  # type: ignore[return-value]
        fd = os.open(self.path, self.flags)
        info = os.fstat(fd)
        self.fd, self.pid, self.identity = fd, os.getpid(), (info.st_dev, info.st_ino)
        return fd

    def _ours(self) -> bool:
        if self.fd is None or self.pid != os.getpid():
            return False
        try:
            info = os.fstat(self.fd)
        except OSError:
            return False
        return (info.st_dev, info.st_ino) == self.identity

    def close(self) -> None:
        """Close the descriptor where it is still this file (the next use opens it again)."""
        if self._ours():
            os.close(self.fd)  # type: ignore[arg-type]
        self.fd = None


class _ProcFile:
    """A ``/proc`` file kept open (:class:`_KeptFile`) and read with ``pread``: no open and
    close a read (an open costs more than the read; the kernel writes the file afresh at every
    read). Read through glibc's ``pread`` with the interpreter lock held where glibc is there.

    ``looks_right`` (where given) tells this file's text from any other's: a descriptor this
    process opened is then read without asking the kernel first whether it is still the file
    (an ``fstat``, 3-5 us next to a step, a third of such a read), and what it read is
    checked instead; ``pread`` moves no offset, and a text that is not this file's is
    dropped, the file made sure of (opened again where it is not) and read again.
    """

    SIZE = 4096

    def __init__(self, name: str, looks_right: Optional[Callable[[bytes], bool]] = None
                 ) -> None:
        self.file = _KeptFile(name if name.startswith("/") else "/proc/self/" + name)
        self._lock = ForkSafeLock()  # guards the buffer
        self._buffer: Any = None
        self._looks_right = looks_right

    def read(self) -> bytes:
        file, looks_right = self.file, self._looks_right
        fd = file.fd
        if looks_right is not None and fd is not None and file.pid == os.getpid():
            try:
                # the main thread reads through os.pread, which lets the interpreter lock go
                # for the call but costs half of glibc's through ctypes next to a step; a
                # sampling thread keeps the lock (see _libc)
                text = os.pread(fd, self.SIZE, 0) if get_ident() == _MAIN[0] \
                    else self._read(fd)
            except OSError:
                pass  # closed, or a descriptor pread cannot read: made sure of below
            else:
                if looks_right(text):
                    return text
        return self._read(file.get())

    def _read(self, fd: int) -> bytes:
        pread = _libc().get("pread")
        if pread is not None:
            with self._lock:
                if self._buffer is None:
                    self._buffer = _glibc["buffer"](self.SIZE)
                size = pread(fd, self._buffer, self.SIZE, 0)
                if size >= 0:
                    return self._buffer[:size]  # one copy (.raw copies the whole buffer)
        return os.pread(fd, self.SIZE, 0)

    def close(self) -> None:
        """Close the descriptor (the next read opens it again)."""
        self.file.close()


_reading = tuple.__new__  # Reading(...) without the named tuple's argument handling
_MAIN = [threading.main_thread().ident]  # the main thread's, the forking thread's in a child


def _is_statm(text: bytes) -> bool:
    r"""Whether ``text`` reads as ``/proc/<pid>/statm``: seven numbers on one line, the
    resident set within the size, the fifth and seventh 0 (the kernel has not filled them
    since 2.6).

    >>> _is_statm(b"1000 200 100 4 0 500 0\n"), _is_statm(b"1000 2000 300 4 0 500 0\n")
    (True, False)
    """
    found = _statm_fields(text)
    return found is not None and int(found[2]) <= int(found[1])


# statm's size and resident set, where the text has its form (see _is_statm): one C call
_statm_fields = re.compile(rb"(\d+) (\d+) \d+ \d+ 0 \d+ 0\n").fullmatch


def _is_status(text: bytes) -> bool:
    """Whether ``text`` reads as ``/proc/<pid>/status``."""
    return text.startswith(b"Name:") and b"\nTgid:" in text and b"\nVmRSS:" in text


def _is_meminfo(text: bytes) -> bool:
    """Whether ``text`` reads as ``/proc/meminfo``."""
    return text.startswith(b"MemTotal:")


# the fields of /proc/meminfo psutil.virtual_memory() reads besides its total and available
_MEMINFO_FIELDS = (b"\nBuffers:", b"\nCached:", b"\nShmem:", b"\nActive:", b"\nInactive:")


def _field(text: bytes, name: bytes) -> Optional[int]:
    """The figure after ``name`` in a ``/proc`` file of ``Name:  1234 kB`` lines, in bytes
    (kB times 1024); ``None`` where ``name`` is missing."""
    start = text.find(name)
    if start < 0:
        return None
    end = text.find(b"\n", start + len(name))
    words = text[start + len(name):end if end >= 0 else len(text)].split()
    try:
        return int(words[0]) * 1024
    except (IndexError, ValueError):
        return None


class HostBackend(Backend):
    """Memory of this process on the host (always active)."""

    name = "host"
    hold_tolerance = 4 << 20
    reserve_tolerance = 16 << 20
    level_field = "reserved"

    def __init__(self) -> None:
        self._lock = ForkSafeLock()
        self._linux = sys.platform.startswith("linux") and os.path.exists("/proc/self/statm")
        self._statm = _ProcFile("statm", _is_statm)
        self._status = _ProcFile("status", _is_status)
        self._meminfo = _ProcFile("/proc/meminfo", _is_meminfo)
        self._clear_refs = _KeptFile("/proc/self/clear_refs", os.O_WRONLY)
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        self._clear_refs_ok: Optional[bool] = None
        self._sampled_peak = 0
        # getrusage's ru_maxrss is the high-water mark VmHWM gives, unless the image the
        # process replaced at exec had a higher one (the kernel keeps that too): exact from a
        # reset after which it was no higher than a resident set read (reset_peak, rss), in
        # that process
        self._usage_exact = False
        self._usage_pid = -1
        self._resets = 0  # resets begun
        self._written = 0  # resets written
        self._unchecked: Optional[tuple[int, int, int]] = None  # see _check_usage
        self._psutil_proc: Any = None
        self._quick_rss_until = 0.0  # read_quick: the resident set until then
        self._slow_mallinfo = 0  # mallinfo2 readings in a row slower than SLOW_MALLINFO

    # -- small readers -------------------------------------------------------------------
    def _process(self) -> Any:
        if self._psutil_proc is None:
            import psutil

            self._psutil_proc = psutil.Process()
        return self._psutil_proc

    def rss(self) -> int:
        """The resident set size of this process, in bytes."""
        if self._linux:
            written = self._written
            file, found = self._statm.file, None
            if file.fd is not None and file.pid == os.getpid() and get_ident() == _MAIN[0]:
                try:  # _ProcFile.read's first try, inline: every guard's every reading
                    found = _statm_fields(os.pread(file.fd, _ProcFile.SIZE, 0))
                except OSError:
                    pass
            if found is not None and int(found[2]) <= int(found[1]):
                rss = int(found[2]) * self._page
            else:
                rss = int(self._statm.read().split()[1]) * self._page
            if self._unchecked is not None:
                self._check_usage(written, rss)
        else:
            rss = int(self._process().memory_info().rss)
        if rss > self._sampled_peak:
            self._sampled_peak = rss
        return rss

    def malloc_in_use(self) -> Optional[int]:
        """Bytes malloc has handed out (glibc's ``mallinfo2``), or ``None`` without glibc."""
        mallinfo2 = _glibc.get("mallinfo2") if "loaded" in _glibc else _libc().get("mallinfo2")
        if mallinfo2 is None:
            return None
        info = mallinfo2()
        return info.uordblks + info.hblkhd - _TAKEN[0]  # c_size_t fields read as ints

    def _rss_and_hwm(self) -> tuple[int, Optional[int]]:
        """The resident set and its high-water mark (``VmHWM``, ``None`` where unknown), in
        bytes, from one read of ``/proc/self/status`` (its ``VmRSS`` is the resident set
        ``statm`` gives, in kB: one read serves both)."""
        if self._linux:
            text = self._status.read()
            rss, hwm = _field(text, b"\nVmRSS:"), _field(text, b"\nVmHWM:")
            if rss is not None:
                if rss > self._sampled_peak:
                    self._sampled_peak = rss
                return rss, hwm
            return self.rss(), hwm
        return self.rss(), None

    def physical(self) -> tuple[int, int]:
        """The machine's physical memory, ``(total, available)`` in bytes, as
        ``psutil.virtual_memory()`` gives them, read from ``/proc/meminfo`` kept open (psutil
        opens and parses the whole file: ~25 us against ~6 us); psutil itself where the file
        lacks a field its figures rest on, or off Linux."""
        if self._linux:
            text = self._meminfo.read()
            total, free = _field(text, b"MemTotal:"), _field(text, b"\nMemFree:")
            available = _field(text, b"\nMemAvailable:")
            # psutil estimates where MemAvailable is missing or 0, and warns where a field
            # it reports is missing: those cases stay psutil's
            if total is not None and free is not None and available \
                    and all(name in text for name in _MEMINFO_FIELDS):
                return total, free if available > total else available
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.total), int(vm.available)

    # -- Backend -------------------------------------------------------------------------
    def devices(self) -> list[str]:
        return [HOST]

    def owns(self, device: str) -> bool:
        return device == HOST

    def handed_out(self) -> Optional[int]:
        """Bytes handed out: malloc's (``mallinfo2``) and TensorFlow's CPU pool's, or ``None``
        without glibc."""
        used = self.malloc_in_use()
        return None if used is None else used + cpu_pool_in_use()

    def read_fast(self, device: str = HOST) -> Reading:
        """``(handed_out(), rss())``: :meth:`read_fast_as` ``"in use"``."""
        return self.read_fast_as("in use")

    def read_in_use(self, device: str = HOST) -> Optional[int]:
        used = self.handed_out()
        return self.rss() if used is None else used

    def quick_kind(self, device: Optional[str] = None) -> str:
        """The reading a check on every call takes now: ``"in use"`` (``mallinfo2``), or
        ``"resident"`` (the resident set) for :data:`MALLINFO_PAUSE` seconds after
        :data:`SLOW_IN_A_ROW` ``mallinfo2`` readings in a row slower than
        :data:`SLOW_MALLINFO` (one slow reading alone is the process being preempted: a
        fragmented heap is slow every time).

        ``mallinfo2`` walks every free block of the heap: microseconds on a fresh heap,
        milliseconds on one holding many free blocks between live ones (a long-running
        server's), which a check on every call cannot afford. The resident set takes a few
        microseconds to read; it grows when a block keeps new memory, and also when the heap
        merely grew, which then costs one needless cleanup. Each reading is also a system
        call, which near a forward pass over large weights costs more than the call itself:
        where ``mallinfo2`` is fast it is the cheaper reading."""
        return "resident" if time.monotonic() < self._quick_rss_until else "in use"

    def _judge_mallinfo(self, start: float) -> None:
        """Count a ``mallinfo2`` reading begun at ``start`` (``perf_counter``) towards
        :meth:`quick_kind`'s pause. The slow reading that would begin the pause is timed
        again at once: where that second reading is quick, the slow ones waited (the thread
        preempted, or another holding the interpreter lock), and the heap is not slow (one
        walk more a pause on a heap that is)."""
        if time.perf_counter() - start <= SLOW_MALLINFO:
            self._slow_mallinfo = 0
            return
        mallinfo2 = _libc().get("mallinfo2")
        if mallinfo2 is not None and self._slow_mallinfo + 1 >= SLOW_IN_A_ROW \
                and time.monotonic() >= self._quick_rss_until:
            again = time.perf_counter()
            mallinfo2()
            if time.perf_counter() - again <= SLOW_MALLINFO:
                self._slow_mallinfo = 0
                return
        self._slow_mallinfo += 1
        if self._slow_mallinfo >= SLOW_IN_A_ROW:
            self._slow_mallinfo = 0
            self._quick_rss_until = time.monotonic() + MALLINFO_PAUSE

    def read_fast_as(self, kind: str, device: str = HOST) -> Reading:
        rss = self.rss()
        if kind == "resident":
            return _reading(Reading, (rss, rss))
        # handed_out() and the timing's verdict inline: every guard's reading, next to a step
        mallinfo2 = _glibc.get("mallinfo2") if "loaded" in _glibc else _libc().get("mallinfo2")
        if mallinfo2 is None:
            return _reading(Reading, (rss, rss))
        start = time.perf_counter()
        info = mallinfo2()
        if time.perf_counter() - start > SLOW_MALLINFO:
            self._judge_mallinfo(start)
        else:
            self._slow_mallinfo = 0
        used = info.uordblks + info.hblkhd - _TAKEN[0]
        if "tensorflow" in sys.modules:
            used += cpu_pool_in_use()
        return _reading(Reading, (used, rss))

    def read_quick(self, device: str = HOST,
                   kind: Optional[str] = None) -> tuple[str, Optional[int]]:
        """What malloc hands out (``mallinfo2`` alone: no system call), or the resident set
        while ``mallinfo2`` is slow (:meth:`quick_kind`); ``kind`` asks for that kind
        whatever the speed."""
        kind = kind or self.quick_kind()
        if kind == "resident":
            return kind, self.rss()
        start = time.perf_counter()
        used = self.handed_out()
        self._judge_mallinfo(start)
        return kind, self.rss() if used is None else used

    def _check_usage(self, written: int, rss: int) -> None:
        """Whether getrusage gives this process's own mark until the next reset, from a
        resident set ``rss`` read after the reset that was ``written`` (the scope's reading on
        entry: no read of its own). getrusage read after the reset was the higher of the mark
        before exec and the resident set then; at most ``rss`` (give or take the kernel's
        approximation, USAGE_SLACK), the first is at most the mark until the next reset."""
        unchecked = self._unchecked
        if unchecked is None:
            return
        usage, done, pid = unchecked
        if done != written or pid != os.getpid():
            return  # read before that reset was written, or in another process
        if self._lock.inner.locked():
            return  # a reset is under way (or this thread's, under a handler): a later read
            # checks its own (a with, unlike a try-acquire, that no Ctrl-C leaves held)
        with self._lock:
            if self._unchecked is unchecked:  # decided for the reset it was read after
                self._unchecked = None
                self._usage_exact, self._usage_pid = usage <= rss + USAGE_SLACK, pid

    def _usage_peak(self) -> Optional[int]:
        """The kernel's high-water mark from ``getrusage`` (~1 us; reading
        ``/proc/self/status`` takes 7-40 us next to a step), or ``None`` where that is not known
        to be this process's own mark since the last reset. Its resident set is summed over
        the CPUs approximately (here up to 256 kB short; VmHWM's stored mark is too, its
        current part exact): a scope takes the higher of it and the levels it read."""
        resets = self._resets
        if not self._usage_exact or self._usage_pid != os.getpid():
            return None
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return peak if resets == self._resets else None  # no reset began meanwhile

    def read_peak(self, device: str = HOST) -> Optional[int]:
        if self._clear_refs_ok is False:
            rss = self.rss()
            return max(self._sampled_peak, rss)
        peak = self._usage_peak()
        if peak is not None:
            return peak
        rss, hwm = self._rss_and_hwm()
        return max(self._sampled_peak, rss) if hwm is None else max(hwm, rss)

    def read(self, device: str = HOST) -> DeviceMemory:
        used = self.handed_out()
        if self._clear_refs_ok is False:
            rss = self.rss()
            peak = max(self._sampled_peak, rss)
        else:
            usage = self._usage_peak()
            if usage is not None:
                rss = self.rss()
                peak = max(usage, rss)
            else:
                rss, hwm = self._rss_and_hwm()  # one read for the resident set and the peak
                peak = max(self._sampled_peak, rss) if hwm is None else max(hwm, rss)
        total, available = self.physical()
        return DeviceMemory(HOST, allocated=rss if used is None else used, reserved=rss,
                            peak=peak, free=available, total=total)

    def reset_peak(self, device: str = HOST) -> bool:
        with self._lock:
            if self._clear_refs_ok is not False and self._linux:
                self._resets += 1
                self._usage_exact, self._unchecked = False, None
                try:
                    os.write(self._clear_refs.get(), b"5")  # the kernel resets VmHWM
                    self._clear_refs_ok = True
                except OSError:
                    self._clear_refs_ok = False
                else:
                    self._written += 1
                    # checked against the next resident set read (_check_usage)
                    self._unchecked = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                                       * 1024, self._written, os.getpid())
            # where the kernel keeps the mark, the highest resident set read since the reset
            # stands in only if /proc/self/status lacks VmHWM
            self._sampled_peak = 0 if self._clear_refs_ok else self.rss()
        return bool(self._clear_refs_ok)

    def swap_peak(self, device: str = HOST) -> tuple[Optional[int], Optional[int]]:
        """:meth:`read_peak`, :meth:`reset_peak` and :meth:`peak_after_reset` under one hold
        of the lock, where getrusage is known to give this process's own mark (every scope's
        entry after the first: two getrusage and a write, next to the step); the three calls
        otherwise."""
        pid = os.getpid()
        with self._lock:
            fast = self._clear_refs_ok is True and self._usage_exact and self._usage_pid == pid
            if fast:
                before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
                self._resets += 1
                self._usage_exact, self._unchecked = False, None
                try:
                    os.write(self._clear_refs.get(), b"5")
                except OSError:
                    self._clear_refs_ok = False
                    self._sampled_peak = self.rss()
                    return before, self._sampled_peak
                self._written += 1
                self._unchecked = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                                   self._written, pid)
                self._sampled_peak = 0
        return (before, None) if fast else super().swap_peak(device)

    def peak_after_reset(self, device: str = HOST) -> Optional[int]:
        """Where the kernel keeps the high-water mark, ``None``: it starts from the resident
        set at the reset, and a scope's peak is the counter at its exit or a higher one
        folded in before a later reset. Else the resident set read at the reset."""
        return None if self._clear_refs_ok else self._sampled_peak

    def empty_cache(self) -> None:
        trim = _libc().get("malloc_trim")
        if trim is not None:
            trim(0)


def _vm_size() -> int:
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def limit_address_space(limit: int) -> int:
    """Open a soft ``RLIMIT_AS`` at the current virtual size + ``limit`` and return a token
    for :func:`restore_address_space`.

    What malloc holds free is mapped already, so the block could take it without new address
    space: a block opened after 1.6 GiB of small tensors were freed allocated 1.8 GiB under a
    256 MiB limit. The heap is trimmed first, and what this thread's malloc still holds free
    is taken out of its reach until the block closes (allocated, never touched: no new
    address space, hardly any resident memory).

    Open limits compose, whichever thread or task opened them and whatever order they close
    in: the tightest one open is in force (never wider than the limits found when the first
    opened), and once the last closes the limits found then are back.
    """
    import resource

    # The host backend imports psutil on first use; under a tight limit its shared object
    # could not be mapped then (an ImportError, not an out-of-memory), so import it first.
    import psutil  # noqa: F401

    trim = _libc().get("malloc_trim")
    if trim is not None:
        trim(0)
    ballast = _take_free(malloc_free() or 0)
    with _LIMITS_LOCK:
        if not _OPEN_LIMITS:
            _ORIGINAL[:] = [resource.getrlimit(resource.RLIMIT_AS)]
        base = _vm_size()
        soft = base + limit
        for bound in _ORIGINAL[0]:
            if bound != resource.RLIM_INFINITY:
                soft = min(soft, bound)
        token = next(_TOKENS)
        _OPEN_LIMITS[token] = (soft, base)
        _BALLAST[token] = ballast
        _TAKEN[0] += ballast[1]
        _apply_limits()
    return token


def restore_address_space(token: int) -> None:
    """Close the limit :func:`limit_address_space` opened as ``token``: the tightest of those
    still open is in force, or, once none is, the limits found when the first opened."""
    with _LIMITS_LOCK:
        if _OPEN_LIMITS.pop(token, None) is not None:
            _apply_limits()
        ballast = _BALLAST.pop(token, ([], 0))
        _TAKEN[0] -= ballast[1]
    _give_back(ballast[0])


BALLAST_LARGEST = 1 << 30
BALLAST_SMALLEST = 1 << 12
BALLAST_SECONDS = 0.25


def _take_free(wanted: int) -> tuple[list[int], int]:
    """Blocks of what malloc holds free, up to ``wanted`` bytes, allocated without new
    address space (one that needed some is freed again, and smaller blocks are tried):
    their pointers, for :func:`_give_back`, and their bytes."""
    if wanted < BALLAST_SMALLEST or "malloc" not in _libc():
        return [], 0
    malloc, free = _glibc["malloc"], _glibc["free"]
    taken: list[int] = []
    # the largest first (a free run of the heap is one block, taken in one call), halving
    size = min(BALLAST_LARGEST, 1 << (wanted.bit_length() - 1))
    got, space = 0, _vm_size()
    # a heap freed in small pieces is taken for a bounded time: what is left stays reusable
    deadline = time.perf_counter() + BALLAST_SECONDS
    while got < wanted and size >= BALLAST_SMALLEST and time.perf_counter() < deadline:
        pointer = malloc(size)
        if not pointer:
            size //= 2
            continue
        if _vm_size() > space:  # not a free block: new address space
            free(pointer)
            space = _vm_size()
            size //= 2
            continue
        taken.append(pointer)
        got += size
    return taken, got


def _give_back(pointers: list[int]) -> None:
    free = _glibc.get("free")
    if free is not None:
        for pointer in pointers:
            free(pointer)


def _apply_limits() -> None:
    """Set the kernel's limit from the open ones (the caller holds ``_LIMITS_LOCK``)."""
    import resource

    if not _OPEN_LIMITS:
        resource.setrlimit(resource.RLIMIT_AS, _ORIGINAL[0])
        return
    soft = min(soft for soft, _ in _OPEN_LIMITS.values())
    resource.setrlimit(resource.RLIMIT_AS, (soft, _ORIGINAL[0][1]))


# -- budgets: what the process may still allocate on the host -----------------------------------
# The limits memguard.memory_limit opened and has not closed: token -> (soft RLIMIT_AS, the
# virtual size when it was set). RLIMIT_AS is one per process, while blocks open and close in
# any order across threads and tasks: the kernel holds the tightest open one, and the limits
# found when the first opened (_ORIGINAL) come back when the last closes. The lock keeps the
# table and the kernel's limit in step.
_OPEN_LIMITS: dict[int, tuple[int, int]] = {}
_ORIGINAL: list[tuple[int, int]] = []
# token -> the free blocks taken while it is open (pointers, bytes); their bytes in all, which
# malloc counts as handed out and the readings of what the program holds leave out
_BALLAST: dict[int, tuple[list[int], int]] = {}
_TAKEN = [0]
_TOKENS = itertools.count(1)
_LIMITS_LOCK = ForkSafeLock()


def malloc_free() -> Optional[int]:
    """Bytes glibc's malloc holds free inside memory it has already mapped (``mallinfo2``'s
    ``fordblks``, every arena): freed blocks, kept for the next ``malloc``. ``None`` without
    glibc.

    They still count as address space, trimmed or not (``malloc_trim`` gives the pages back,
    not the mapping), yet the next allocations that fit in them take no new address space:
    after a failed attempt has been freed they are most of what the next one can use.

    >>> malloc_free() is None or malloc_free() >= 0
    True
    """
    mallinfo2 = _libc().get("mallinfo2")
    if mallinfo2 is None:
        return None
    return int(mallinfo2().fordblks)


def address_space_budget() -> Optional[tuple[str, int, int]]:
    """The soft ``RLIMIT_AS`` in force as ``(kind, limit, used)`` in bytes of address space,
    or ``None`` when there is none (or off Linux). ``kind`` is ``"memory_limit"`` when
    :func:`memguard.memory_limit` set it (``limit`` is then the size it was given and
    ``used`` the address space mapped since), else ``"RLIMIT_AS"`` (``limit`` the soft limit,
    ``used`` the whole virtual size). Under such a limit the virtual size, not the resident
    set, is what runs out; what of it malloc holds free is :func:`malloc_free`.

    >>> address_space_budget() is None or address_space_budget()[1] > 0
    True
    """
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        if soft == resource.RLIM_INFINITY:
            return None
        vm = _vm_size()
    except (ImportError, OSError, ValueError):
        return None
    base = _opened_base(soft)
    if base is not None:
        return "memory_limit", soft - base, max(0, vm - base)  # unmapped since: none used
    return "RLIMIT_AS", soft, vm


def address_space() -> Optional[tuple[int, int, str]]:
    """The process's virtual size and the soft ``RLIMIT_AS`` in force, in bytes, and who set
    that limit (``"memory_limit"`` or ``"RLIMIT_AS"``), or ``None`` when there is none (or
    off Linux): the two figures to draw side by side, as the limit counts address space.

    >>> address_space() is None or address_space()[0] > 0
    True
    """
    try:
        import resource

        with _LIMITS_LOCK:  # the limit and who set it, read in step with memory_limit
            soft = resource.getrlimit(resource.RLIMIT_AS)[0]
            ours = _opened_base(soft) is not None
        if soft == resource.RLIM_INFINITY:
            return None
        vm = _vm_size()
    except (ImportError, OSError, ValueError):
        return None
    return vm, soft, "memory_limit" if ours else "RLIMIT_AS"


def _opened_base(soft: int) -> Optional[int]:
    """The virtual size at which :func:`memguard.memory_limit` opened the limit ``soft``
    in force; ``None`` when the limit is not one it set: none is open, or the one open was
    capped by the limit the process had before (``ulimit -v``), which stays the process's own.
    """
    import resource

    original = _ORIGINAL[0][0] if _ORIGINAL else resource.RLIM_INFINITY
    for limit, base in list(_OPEN_LIMITS.values()):
        if limit == soft and (original == resource.RLIM_INFINITY or limit < original):
            return base
    return None


_CGROUP_ROOT = "/sys/fs/cgroup"


def _cgroup_levels(text: str, root: str) -> list[str]:
    """The folders of the cgroup v2 named in ``/proc/self/cgroup``'s ``text`` and of each
    cgroup above it, deepest first; none without a v2 line."""
    path = next((line[3:] for line in text.splitlines() if line.startswith("0::")), None)
    if path is None:
        return []
    parts = [p for p in path.strip("/").split("/") if p]
    return [os.path.join(root, *parts[:depth]) for depth in range(len(parts), -1, -1)]


def _tightest(pairs: Iterable[tuple[str, str]]) -> Optional[tuple[int, int]]:
    """Of ``(memory.max, memory.current)`` texts, the ``(limit, used)`` with the least left;
    ``None`` when none has a limit."""
    best: Optional[tuple[int, int]] = None
    for text, current in pairs:
        text = text.strip()
        if text == "max":
            continue
        try:
            limit, used = int(text), int(current.strip())
        except ValueError:
            continue
        if best is None or limit - used < best[0] - best[1]:
            best = (limit, used)
    return best


def cgroup_memory_budget(root: str = _CGROUP_ROOT,
                         membership: str = "/proc/self/cgroup") -> Optional[tuple[int, int]]:
    """The cgroup v2 ``memory.max`` of this process's cgroup (the tightest one up the tree)
    and its ``memory.current``, as ``(limit, used)`` in bytes; ``None`` without cgroup v2 or
    without a limit (``max``). ``root`` and ``membership`` name where the files are.

    Args:
        root: the folder cgroup v2 is mounted at. Default ``/sys/fs/cgroup``.
        membership: the file naming this process's cgroups. Default ``/proc/self/cgroup``.

    Returns:
        ``(limit, used)`` in bytes, or ``None``.

    >>> cgroup_memory_budget(root="/nonexistent") is None
    True
    """
    if root == _CGROUP_ROOT and membership == "/proc/self/cgroup":
        return _CGROUP.read()
    reader = _CgroupReader(root, membership)
    try:
        return reader.read()
    finally:
        reader.close()


class _CgroupReader:
    """:func:`cgroup_memory_budget` with its files kept open, for the budgets every snapshot
    reads (opening the membership file and each level's two files cost ~25 us a snapshot).

    What is read stays exact at every call: the membership file, and each level's
    ``memory.max`` and ``memory.current``, are read again (``pread``). Only which files exist
    is kept: the levels' descriptors, found again when the membership changes, after
    ``fork``, when a read fails, and at least every :data:`RECHECK` seconds (a ``memory.max``
    appears when a parent enables the memory controller for its children).
    """

    RECHECK = 1.0

    def __init__(self, root: str, membership: str) -> None:
        self.root = root
        self.membership = _ProcFile(membership)
        self._lock = ForkSafeLock()
        self._key: Optional[tuple[bytes, int]] = None  # the membership text and pid found
        self._found = 0.0  # monotonic time the levels' files were found
        self._files: list[tuple[_KeptFile, _KeptFile]] = []  # each level's max and current

    def read(self) -> Optional[tuple[int, int]]:
        try:
            text = self.membership.read()
        except OSError:
            return None
        with self._lock:
            key = (text, os.getpid())
            if key != self._key or time.monotonic() - self._found > self.RECHECK:
                self._find(text.decode(errors="replace"))
                self._key = key
            try:
                return _tightest((os.pread(limit.get(), 64, 0).decode(),
                                  os.pread(current.get(), 64, 0).decode())
                                 for limit, current in self._files)
            except (OSError, UnicodeDecodeError):
                self._key = None  # found again at the next call
                return None

    def _find(self, text: str) -> None:
        self._close()
        self._found = time.monotonic()
        for folder in _cgroup_levels(text, self.root):
            limit = _KeptFile(os.path.join(folder, "memory.max"))
            current = _KeptFile(os.path.join(folder, "memory.current"))
            try:
                limit.get()
                current.get()
            except OSError:
                limit.close()
                continue
            self._files.append((limit, current))

    def close(self) -> None:
        """Close every file kept open."""
        self._close()
        self.membership.close()

    def _close(self) -> None:
        for pair in self._files:
            for kept in pair:
                try:
                    kept.close()
                except OSError:
                    pass
        self._files = []


_CGROUP = _CgroupReader(_CGROUP_ROOT, "/proc/self/cgroup")


def _import_psutil_before_fork() -> None:
    """Fork only once psutil is imported: a child forked while another thread is importing it
    (the host backend imports it on first use) would wait for ever on the import's lock."""
    import psutil  # noqa: F401


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_import_psutil_before_fork,
                        after_in_child=lambda: _MAIN.__setitem__(0, get_ident()))
