"""Size files: working sizes kept in a JSON file shared across processes, ranks and restarts
(``oom_retry(cache=path)``, ``find_batch_size(cache=path)``). :func:`size_key` makes the
key (code, start, search parameters, device); :class:`SizeFile` writes the file atomically
under an advisory lock on its folder, never touches a file that is not memguard's, and
never breaks a call (a warning says why)."""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Optional, Union

from ._checks import warn_at_caller
from .backends.budget import device_identity

log = logging.getLogger("memguard")
PathLike = Union[str, "os.PathLike[str]"]


def qualified_name(func: Any) -> str:
    """``module.QualName`` of a function (or of a callable object's class).

    >>> qualified_name(qualified_name)
    'memguard.sizefile.qualified_name'
    """
    target = getattr(func, "__func__", func)
    name = getattr(target, "__qualname__", None) or type(target).__qualname__
    module = getattr(target, "__module__", None) or type(target).__module__
    return f"{module}.{name}"


def size_key(kind: str, func: Any, start: int, device: Optional[str] = None,
             **search: Any) -> str:
    """The key a working size is kept under: who found it, for which code
    (:func:`code_identity`), from which start, with which search parameters, on which device.

    Args:
        kind: who found the size (``"oom_retry"``, ``"find_batch_size"``).
        func: the function (or callable) the size was found for.
        start: the size the search or the call started from.
        device: the device's identity; ``device_identity()`` when ``None``.
        **search: further parameters that change the size found, as ``name=value`` in order
            (a callable as its qualified name).

    Returns:
        A one-line, human-readable key.

    >>> key = size_key("find_batch_size", qualified_name, 64, "host x86_64 (1 bytes)",
    ...                max_batch_size=None, mode="binsearch")
    >>> key.split(" code=")[1][9:]
    'start=64 max_batch_size=None mode=binsearch on host x86_64 (1 bytes)'
    """
    params = "".join(f" {name}={qualified_name(value) if callable(value) else value}"
                     for name, value in search.items())
    return (f"{kind} {code_identity(func)} start={start}{params} on "
            f"{device or device_identity()}")


def code_identity(func: Any) -> str:
    """What identifies ``func``'s code across processes: its qualified name, file and first line,
    and a digest of its bytecode, constants, names, defaults and closure values (plain values
    by value, other objects by type): two closures holding different values differ, and so
    does an edited function.

    Args:
        func: a function, method, ``functools.partial``, decorated function (followed through
            ``__wrapped__``) or callable object.

    Returns:
        ``"module.QualName at /path/file.py:LINE code=1a2b3c4d"`` (no ``at`` part for a
        callable without Python code).

    >>> code_identity(code_identity).split(" at ")[0]
    'memguard.sizefile.code_identity'
    """
    import hashlib

    target = _innermost(func)
    code = getattr(target, "__code__", None)
    if code is None and not isinstance(target, type):
        code = getattr(_class_call(target), "__code__", None)
    where = ""
    if code is not None:
        file = code.co_filename  # "<string>" for python -c, "<stdin>": kept as they are
        file = file if file.startswith("<") else os.path.abspath(file)
        where = f" at {file}:{code.co_firstlineno}"
    digest = hashlib.sha256(_fingerprint(func, 0).encode("utf-8", "backslashreplace"))
    return f"{qualified_name(func)}{where} code={digest.hexdigest()[:8]}"


def _innermost(func: Any) -> Any:
    """``func`` less its ``partial``, bound-method and ``__wrapped__`` layers."""
    import functools

    for _ in range(100):  # a loop of wrappers ends here rather than hang
        if isinstance(func, functools.partial):
            func = func.func
        elif hasattr(func, "__func__"):
            func = func.__func__
        elif getattr(func, "__wrapped__", None) is not None:
            func = func.__wrapped__
        else:
            break
    return func


_PLAIN = (int, float, complex, str, bytes, bool, type(None), type(Ellipsis))
_MAX_DEPTH, _MAX_ITEMS = 6, 64


def _fingerprint(value: Any, depth: int) -> str:
    """A text, the same in every process, that changes with the behaviour ``value`` stands for:
    code by bytes and constants, plain values by ``repr``, other objects by type."""
    import functools
    import types

    if depth > _MAX_DEPTH:
        return "..."
    deeper = depth + 1
    if isinstance(value, _PLAIN):
        return repr(value)
    if isinstance(value, (tuple, frozenset)):
        if len(value) > _MAX_ITEMS:
            return f"{type(value).__name__}[{len(value)}]"
        parts = [_fingerprint(v, deeper) for v in value]
        if isinstance(value, frozenset):
            parts.sort()
        return f"{type(value).__name__}({','.join(parts)})"
    if isinstance(value, types.CodeType):
        return (f"code({value.co_code.hex()};{','.join(value.co_names)};"
                f"{_fingerprint(value.co_consts, deeper)})")
    if isinstance(value, types.FunctionType):
        cells = tuple(_cell(c, deeper) for c in value.__closure__ or ())
        return (f"function({_fingerprint(value.__code__, deeper)};"
                f"{_fingerprint(value.__defaults__, deeper)};"
                f"{_fingerprint(tuple(sorted((value.__kwdefaults__ or {}).items())), deeper)};"
                f"{';'.join(cells)})")
    if isinstance(value, functools.partial):
        return (f"partial({_fingerprint(value.func, deeper)};{_fingerprint(value.args, deeper)};"
                f"{_fingerprint(tuple(sorted(value.keywords.items())), deeper)})")
    if isinstance(value, types.MethodType):
        return (f"method({_fingerprint(value.__func__, deeper)};"
                f"{qualified_name(type(value.__self__))})")
    if getattr(value, "__wrapped__", None) is not None:
        return f"wrapped({_fingerprint(value.__wrapped__, deeper)})"
    if isinstance(value, types.ModuleType):
        return f"module({value.__name__})"
    if isinstance(value, type):
        return f"class({qualified_name(value)})"
    call = _class_call(value)
    if isinstance(call, types.FunctionType):  # a callable object: its class's code
        return f"object({qualified_name(value)};{_fingerprint(call, deeper)})"
    return f"object({qualified_name(value)})"


def _class_call(value: Any) -> Any:
    """The ``__call__`` a callable object's class defines (``None`` if none)."""
    return type(value).__call__ if callable(value) else None


def _cell(cell: Any, depth: int) -> str:
    try:
        return _fingerprint(cell.cell_contents, depth)
    except ValueError:  # an empty cell: a name bound later in the enclosing function
        return "<empty>"


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

    A missing or empty file becomes a size file (a symbolic link is kept); any other file is
    left as it is, with one warning, and a read-only size file is still read. Reading never
    raises into a call.

    Args:
        path: the file's path (``str`` or ``os.PathLike``).

    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "sizes.json")
    >>> sizes = SizeFile(path)
    >>> sizes.put("train start=256 on host", 48)
    >>> SizeFile(path).get("train start=256 on host")
    48
    """

    FORMAT = "memguard sizes"
    LARGEST = 16 << 20
    """A file larger than this is not read (a size file holds a few entries)."""

    def __init__(self, path: PathLike) -> None:
        self.path = check_path(path)
        self._warned: set[str] = set()

    def _warn(self, message: str) -> None:
        if message in self._warned:  # once per file and problem
            log.debug("%s", message)
            return
        self._warned.add(message)
        warn_at_caller(message)

    def _inspect(self) -> tuple[Optional[dict[str, int]], Optional[str]]:
        """``(sizes, problem)``: the entries (``None``: unusable), why not to write (or None)."""
        import stat

        try:
            info = os.stat(self.path)
        except FileNotFoundError:
            return {}, None
        except OSError as exc:
            return None, (f"memguard: cannot read the size file {self.path!r} ({exc}); sizes "
                          f"are not kept there. Pass another path as cache=")
        if not stat.S_ISREG(info.st_mode):
            return None, (f"memguard: cannot use {self.path!r} as a size file: it is not a "
                          f"regular file; it is left as it is and sizes are not kept. Pass a "
                          f"file path as cache=")
        read_only = (f"memguard: the size file {self.path!r} is read-only (mode "
                     f"{oct(stat.S_IMODE(info.st_mode))}); the sizes in it are used, new ones "
                     f"are not kept. Make it writable (chmod u+w) to keep them, or pass "
                     f"another path as cache=")
        writable = bool(info.st_mode & 0o222) and os.access(self.path, os.W_OK)
        if info.st_size > self.LARGEST:
            return None, self._foreign(f"{info.st_size} bytes, more than a size file holds")
        try:
            with open(self.path, "rb") as f:
                raw = f.read(self.LARGEST + 1)
        except OSError as exc:
            return None, (f"memguard: cannot read the size file {self.path!r} ({exc}); it is "
                          f"left as it is and sizes are not kept. Pass another path as "
                          f"cache=, or make the file readable")
        if not raw:
            return {}, None if writable else read_only
        sizes = self._parse(raw)
        if isinstance(sizes, str):
            return None, self._foreign(sizes)
        return sizes, None if writable else read_only

    def _foreign(self, why: str) -> str:
        return (f"memguard: {self.path!r} is not a memguard size file ({why}); it is left as "
                f"it is and sizes are not kept in it. Pass another path as cache= (a missing "
                f"file is created)")

    def _parse(self, raw: bytes) -> Union[dict[str, int], str]:
        """The entries of a size file's bytes, or why they are not a size file."""
        import json

        try:
            data = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
            return f"{type(exc).__name__}: {str(exc)[:200]}"
        sizes = data.get("sizes") if isinstance(data, dict) and self.FORMAT in data else None
        if not isinstance(sizes, dict):
            return f"no {self.FORMAT!r} and 'sizes' in it"
        return {k: v for k, v in sizes.items()
                if isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
                and v > 0}

    def get(self, key: str) -> Optional[int]:
        """The size kept under ``key`` (a :func:`size_key`), or ``None`` (also when unreadable)."""
        sizes, problem = self._inspect()
        if sizes is None and problem is not None:
            self._warn(problem)
        return (sizes or {}).get(key)

    def put(self, key: str, size: int) -> None:
        """Keep ``size`` under ``key``: read, merge and replace the file under the lock, keeping
        other processes' entries; a file that must not be written gets a warning."""
        sizes, problem = self._inspect()
        if sizes is not None and sizes.get(key) == size:
            return  # nothing to keep (a read-only size file that already holds it, say)
        if problem is not None:  # before the lock: no lock file beside a file not ours
            self._warn(problem)
            return
        real = os.path.realpath(self.path)  # a link is written through, and kept
        folder = os.path.dirname(real)
        try:
            with _FileLock(folder):
                sizes, problem = self._inspect()  # again: another process may have written
                if sizes is None or problem is not None:
                    self._warn(problem or self._foreign("changed while being written"))
                    return
                if sizes.get(key) == size:
                    return
                sizes[key] = size
                self._write(real, folder, sizes)
        except OSError as exc:
            self._warn(f"memguard: cannot write the size file {self.path!r} ({exc}); the size "
                       f"is not kept. Pass another path as cache=, or make its folder "
                       f"writable")

    def forget(self, keep: Callable[[str], bool]) -> int:
        """Drop every entry whose key ``keep(key)`` refuses, as :meth:`put` writes; how many were
        dropped."""
        sizes, problem = self._inspect()
        if not sizes or all(keep(key) for key in sizes):
            return 0  # nothing of ours (or no file): nothing to write
        if problem is not None:
            self._warn(problem)
            return 0
        real = os.path.realpath(self.path)
        try:
            with _FileLock(os.path.dirname(real)):
                sizes, problem = self._inspect()
                if sizes is None or problem is not None:
                    self._warn(problem or self._foreign("changed while being written"))
                    return 0
                kept = {key: size for key, size in sizes.items() if keep(key)}
                if len(kept) < len(sizes):
                    self._write(real, os.path.dirname(real), kept)
                return len(sizes) - len(kept)
        except OSError as exc:
            self._warn(f"memguard: cannot write the size file {self.path!r} ({exc}); the "
                       f"sizes in it are not forgotten. Make its folder writable, or delete "
                       f"the file")
            return 0

    def _write(self, real: str, folder: str, sizes: dict[str, int]) -> None:
        import json
        import tempfile

        mode = _mode_of(real)  # mkstemp's 0600 would lock other users out
        handle, temporary = tempfile.mkstemp(prefix=".memguard-sizes-", dir=folder)
        try:
            with os.fdopen(handle, "w", encoding="utf-8") as f:
                json.dump({self.FORMAT: 1, "sizes": sizes}, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(temporary, mode)
            os.replace(temporary, real)
        except BaseException:
            try:
                os.unlink(temporary)
            except OSError:
                pass
            raise
        _sync_folder(folder)


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
    """An exclusive ``flock`` on the size file's folder: the file is replaced by a rename, so its
    folder is what every writer can lock, and no lock file is left. Nothing without ``fcntl``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd: Optional[int] = None

    def __enter__(self) -> "_FileLock":
        try:
            import fcntl
        except ImportError:
            return self
        fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
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
