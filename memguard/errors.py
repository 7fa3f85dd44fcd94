"""memguard's exceptions."""

from __future__ import annotations

import builtins
import re
from typing import Any, Iterator, Mapping, Optional, Sequence

from ._units import binary_unit


class MemguardError(Exception):
    """Base class of the errors memguard raises itself.

    Every one pickles with its message and fields, so one raised in a worker process reaches
    the parent as itself.

    Args:
        *args: the message (what was wrong, with the value, and what to do); subclasses add
            their own fields.

    >>> import pickle
    >>> err = pickle.loads(pickle.dumps(MemoryLeakError("kept 2 MiB", {"host": 2 << 20}, 1)))
    >>> type(err).__name__, err.retained, err.limit
    ('MemoryLeakError', {'host': 2097152}, 1)
    """

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt without calling __init__ (whose parameters are not ``args``): the message
        # as ``args``, then the attributes.
        return _rebuilt, (type(self), self.args), self.__dict__ or None


def _rebuilt(cls: type[MemguardError], args: tuple[Any, ...]) -> MemguardError:
    """An error of class ``cls`` with ``args``, made without its ``__init__`` (unpickling)."""
    try:  # BaseException's own __new__: MemoryError's refuses a class that also derives others
        return BaseException.__new__(cls, *args)
    except TypeError:  # a subclass that also derives from an exception of another layout
        return cls.__new__(cls, *args)  # (OSError, say) is made by that one's __new__


class MemoryLeakError(MemguardError):
    """Memory still held after a guarded block and its cleanup exceeded ``max_leak``.

    Args:
        message: what kept the memory and how much.

    Attributes:
        retained: device -> the bytes it kept over the reference level.
        limit: the ``max_leak`` in bytes.

    >>> import memguard
    >>> kept = []
    >>> try:
    ...     with memguard.memory_scope(max_leak="1MiB"):
    ...         kept.append(bytearray(16 * 2**20))
    ... except memguard.MemoryLeakError as err:
    ...     print(sorted(err.retained), err.limit)
    ['host'] 1048576
    """

    def __init__(self, message: str, retained: Mapping[str, int], limit: int) -> None:
        super().__init__(message)
        self.retained = dict(retained)
        self.limit = limit


class OutOfMemoryError(MemguardError, MemoryError):
    """Out of memory at every batch size memguard was allowed to try.

    A ``MemoryError``; ``__cause__`` is the last out-of-memory.

    Args:
        message: every size tried, with the memory at each failure.

    Attributes:
        attempts: the :class:`memguard.Attempt` records, in order.
        partial: the results finished before the failure (:func:`memguard.map_batches`), or
            ``None``.

    >>> import memguard
    >>> err = memguard.OutOfMemoryError("out of memory at batch sizes 8, 4", attempts=[])
    >>> memguard.is_oom_error(err)
    True
    """

    def __init__(self, message: str, attempts: Sequence[Any] = (),
                 partial: Optional[list[Any]] = None) -> None:
        super().__init__(message)
        self.attempts = list(attempts)
        self.partial = partial


# What an out-of-memory says, by who says it. Substrings, matched case-sensitively, as the
# frameworks print them; the CPU forms were produced on a CPU machine under a memory budget.
OOM_MESSAGES: tuple[tuple[str, str], ...] = (
    ("CUDA caching allocator", "CUDA out of memory"),
    ("ROCm caching allocator", "HIP out of memory"),
    ("XPU caching allocator", "XPU out of memory"),
    ("CUDA runtime", "CUDA error: out of memory"),
    ("MPS allocator", "MPS backend out of memory"),
    ("torch CPU allocator", "DefaultCPUAllocator: can't allocate memory"),
    ("cuBLAS", "CUBLAS_STATUS_ALLOC_FAILED"),
    ("cuDNN", "CUDNN_STATUS_ALLOC_FAILED"),
    ("cuDNN on a full GPU", "CUDNN_STATUS_NOT_SUPPORTED"),
    ("TensorFlow allocator", "OOM when allocating"),
    ("XLA allocator", "Out of memory while trying to allocate"),
    ("TensorFlow", "failed to allocate memory"),
    # "unable to mmap 67108864 bytes from file <...>: Cannot allocate memory (12)": torch's
    # file and shared-memory mappings (DataLoader workers' tensors, torch.from_file); ENOMEM.
    ("torch memory mapping", "Cannot allocate memory (12)"),
)
# Not here: oneDNN's "could not create a primitive" is thrown for any failed status (the
# out-of-memory status is dropped from the message), so memory cannot be told from it.
# A RESOURCE_EXHAUSTED about these is not about memory: the error's own words, whole
# (disk, disks, quota, quotas; any case), once the names in its text are set aside.
NOT_MEMORY = ("No space left on device", "disk", "quota")
_NOT_MEMORY = re.compile("|".join(rf"\b{re.escape(words)}s?\b" for words in NOT_MEMORY),
                         re.IGNORECASE)
# The names a message quotes, which are not its words: <...> (torch's file names), '...',
# "..." and `...` (an apostrophe inside a word, as in "can't", opens none), TensorFlow's
# {{node ...}}; then, word by word, paths (a slash or a backslash) and file names (name.ext).
# Negated classes only: linear in the length of the message, however it is made.
_QUOTED = re.compile(r"<[^<>\n]*>|\{\{[^{}\n]*\}\}|(?<!\w)'[^'\n]*'(?!\w)|\"[^\"\n]*\"|`[^`\n]*`")
_TOKEN = re.compile(r"\S+")
_DOTTED = re.compile(r"[\w-]+(?:\.[\w-]+)+")


def _is_name(token: str) -> bool:
    if "/" in token or "\\" in token:
        return True
    core = token.strip("()[]{}<>,;:!?'\"`")
    return _DOTTED.fullmatch(core) is not None and core.rpartition(".")[2][:1].isalpha()


def _own_words(text: str) -> str:
    """``text`` without the names it quotes (paths, file names, quoted and node names).

    >>> _own_words("unable to mmap 64 bytes from file </mnt/disk1/x.bin>: Cannot allocate")
    'unable to mmap 64 bytes from file : Cannot allocate'
    """
    text = _QUOTED.sub("", text)
    return _TOKEN.sub(lambda word: "" if _is_name(word.group()) else word.group(), text)


_MESSAGE_CLASSES = ("RuntimeError", "ResourceExhaustedError", "XlaRuntimeError")
# A DataLoader worker's error, re-raised in the main process as "Caught RuntimeError in
# DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n" + the worker's
# formatted traceback: only the worker's own error, after its last frame, is judged.
_WORKER = re.compile(r"\ACaught \w+ in DataLoader worker process \d+\.\n")
_FRAME = re.compile(r'^  File "[^\n]*\n(?:    [^\n]*\n)*', re.MULTILINE)


# Python 3.11's exception groups (``asyncio.TaskGroup``, ``except*``); absent on 3.10.
_GROUP: Optional[type] = getattr(builtins, "BaseExceptionGroup", None)


def text_of(exc: Any) -> str:
    """``str(exc)``, or ``""`` when its ``__str__`` raises (then judged by type alone).

    >>> class Unprintable(RuntimeError):
    ...     def __str__(self):
    ...         raise ValueError("no")
    >>> text_of(Unprintable()), text_of(KeyError("k"))
    ('', "'k'")
    """
    try:
        return str(exc)
    except Exception:  # noqa: BLE001 - a broken __str__ must not mask the exception itself
        return ""


def _leaves(group: Any) -> list[BaseException]:
    """The exceptions an exception group holds, groups inside it flattened."""
    found: list[BaseException] = []
    for inner in getattr(group, "exceptions", ()):
        if _GROUP is not None and isinstance(inner, _GROUP):
            found.extend(_leaves(inner))
        else:
            found.append(inner)
    return found


def chained(exc: Any, *, context: bool = False) -> Iterator[BaseException]:
    """``exc`` and its ``__cause__`` chain, each once, outermost first; with ``context=True``
    also every ``__context__`` and the members of exception groups. Empty for a non-exception."""
    seen: set[int] = set()
    stack: list[Any] = [exc]
    while stack:
        current = stack.pop()
        if not isinstance(current, BaseException) or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        if context:
            stack.extend(reversed(getattr(current, "exceptions", ())))
            stack.append(current.__context__)
        stack.append(current.__cause__)


def _recognised(exc: Any) -> Optional[tuple[BaseException, str]]:
    """The first exception along the ``__cause__`` chain a rule recognises, with the rule."""
    # Only Exceptions: KeyboardInterrupt, SystemExit, GeneratorExit, CancelledError (and
    # anything else outside Exception) are control flow, never an out-of-memory.
    for current in chained(exc):
        if not isinstance(current, Exception):
            return None
        if _GROUP is not None and isinstance(current, _GROUP):
            # A group is an out-of-memory when every exception in it is one (the first
            # stands for it); one other error in it and the group is that error's, to raise.
            found = [_recognised(leaf) for leaf in _leaves(current)]
            if found and all(found):
                return found[0]
            return None
        kind = _own_kind(current)
        if kind is not None:
            return current, kind
    return None


def oom_source(exc: Any) -> Optional[BaseException]:
    """The exception that makes ``exc`` an out-of-memory (itself, its cause, or a group's
    member), or ``None``.

    >>> oom = MemoryError("out of memory")
    >>> try:
    ...     raise ValueError("loading failed") from oom
    ... except ValueError as exc:
    ...     oom_source(exc) is oom
    True
    """
    found = _recognised(exc)
    return None if found is None else found[0]


def oom_kind(exc: Any) -> str | None:
    """The :func:`is_oom_error` rule that recognises ``exc``, or ``None``.

    >>> oom_kind(RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB"))
    'CUDA caching allocator'
    """
    found = _recognised(exc)
    return None if found is None else found[1]


def _own_kind(exc: BaseException) -> str | None:
    if isinstance(exc, MemoryError):
        return "memguard" if isinstance(exc, OutOfMemoryError) else "MemoryError"
    if any(cls.__name__ == "OutOfMemoryError" and cls.__module__.startswith("torch")
           for cls in type(exc).__mro__):  # by name: this floor never touches torch
        return "torch.OutOfMemoryError"
    if not any(cls.__name__ in _MESSAGE_CLASSES for cls in type(exc).__mro__):
        return None
    text = text_of(exc)
    worker = _WORKER.match(text)
    if worker:
        text = _FRAME.split(text)[-1]
    if _NOT_MEMORY.search(_own_words(text)):
        return None
    for kind, needle in OOM_MESSAGES:
        if needle in text:
            return f"DataLoader worker: {kind}" if worker else kind
    return None


def is_oom_error(exc: Any) -> bool:
    """Whether ``exc`` is an out-of-memory error, from any framework or device.

    Recognised: ``torch.OutOfMemoryError`` and ``MemoryError`` (numpy's, and
    :class:`OutOfMemoryError`); a ``RuntimeError`` saying a CUDA, HIP, XPU, MPS or CPU
    allocation failed (cuBLAS, cuDNN, a failed ``mmap`` with ``ENOMEM`` included); TensorFlow's
    ``ResourceExhaustedError`` about memory; a ``DataLoader`` worker's such error; an exception
    raised ``from`` one; an exception group all of whose members are. Not recognised: disk or
    quota errors; an exception raised while *handling* one without ``from`` (a new error);
    a group holding any other error; ``KeyboardInterrupt``, ``SystemExit``,
    ``asyncio.CancelledError``; oneDNN's ``could not create a primitive``. The message rules
    are one table, ``OOM_MESSAGES``.

    Args:
        exc: any object; only exceptions can be out-of-memory errors.

    Returns:
        ``True`` when ``exc`` (or the error it was raised ``from``) is an out-of-memory;
        never raises.

    >>> import memguard
    >>> memguard.is_oom_error(RuntimeError("DefaultCPUAllocator: can't allocate memory"))
    True
    >>> memguard.is_oom_error(ValueError("shape mismatch"))
    False
    """
    return oom_kind(exc) is not None


# What the failed allocation asked for, as the frameworks state it.
_REQUEST_PATTERNS = (
    re.compile(r"you tried to allocate (\d+) bytes"),                      # torch CPU
    re.compile(r"Tried to allocate (\d+(?:\.\d+)?) ?(B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)"),  # CUDA, MPS
    re.compile(r"Out of memory while trying to allocate (\d+) bytes"),     # XLA
    re.compile(r"Unable to allocate (\d+(?:\.\d+)?) (B|KiB|MiB|GiB|TiB|PiB) for an array"),  # numpy
    re.compile(r"unable to mmap (\d+) bytes"),                             # torch mappings
)
_TF_TENSOR = re.compile(r"OOM when allocating tensor with shape\s*\[([\d, ]*)\] and type (\w+)")
_TF_DTYPES = {"float": 4, "double": 8, "half": 2, "bfloat16": 2, "int32": 4, "int64": 8,
              "int8": 1, "uint8": 1, "int16": 2, "uint16": 2, "bool": 1, "complex64": 8,
              "complex128": 16, "uint32": 4, "uint64": 8}
_GPU_INDEX = re.compile(r"GPU (\d+) has a total capacity")


def requested_bytes(exc: Any) -> Optional[int]:
    """The bytes the failed allocation asked for, as the out-of-memory's message (along the
    ``__cause__`` chain) states them; ``None`` when none says.

    >>> requested_bytes(RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB"))
    20971520
    """
    for current in chained(exc):
        if _GROUP is not None and isinstance(current, _GROUP):
            asked = [requested_bytes(leaf) for leaf in _leaves(current)]
            return max((a for a in asked if a is not None), default=None)
        text = text_of(current)
        for pattern in _REQUEST_PATTERNS:
            match = pattern.search(text)
            if match:
                unit = match.group(2) if pattern.groups > 1 else "B"
                return int(float(match.group(1)) * binary_unit(unit))
        match = _TF_TENSOR.search(text)
        if match and match.group(2) in _TF_DTYPES:
            count = 1
            for dim in match.group(1).replace(" ", "").split(","):
                count *= int(dim) if dim else 1
            return count * _TF_DTYPES[match.group(2)]
    return None


def oom_device(exc: Any) -> str:
    """The device an out-of-memory ran out on: ``"cuda:N"`` (``"cuda"`` when unsaid) for CUDA,
    ``"host"`` for anything else.

    >>> oom_device(RuntimeError("CUDA out of memory. GPU 1 has a total capacity of 79 GiB"))
    'cuda:1'
    """
    found = _recognised(exc)
    source, kind = found if found is not None else (exc, "")
    text = text_of(source)
    match = _GPU_INDEX.search(text)
    if match:
        return f"cuda:{match.group(1)}"
    if any(word in kind for word in ("CUDA", "cuBLAS", "cuDNN", "ROCm")):
        return "cuda"
    if "device:GPU:" in text:
        return "GPU:" + text.split("device:GPU:")[1][:1]
    return "host"
