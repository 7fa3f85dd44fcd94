"""memguard's exceptions."""

from __future__ import annotations

import re
from typing import Any, Mapping, Optional, Sequence


class MemguardError(Exception):
    """Base class of the errors memguard raises itself."""


class MemoryLeakError(MemguardError):
    """Memory still held after a guarded block and its cleanup exceeded ``max_leak``.

    ``retained`` maps each offending device to the bytes it kept; ``limit`` is the
    ``max_leak`` in bytes.

    >>> import memguard
    >>> try:
    ...     with memguard.memory_scope(max_leak="1MiB"):
    ...         pass
    ... except memguard.MemoryLeakError as err:
    ...     print(err.retained)
    """

    def __init__(self, message: str, retained: Mapping[str, int], limit: int) -> None:
        super().__init__(message)
        self.retained = dict(retained)
        self.limit = limit


class OutOfMemoryError(MemguardError, MemoryError):
    """Out of memory at every batch size memguard was allowed to try.

    ``attempts`` holds the :class:`memguard.Attempt` records, in order; ``__cause__`` is the
    last out-of-memory error. ``partial`` holds the work finished before the failure, where
    there is some to keep: for :func:`memguard.map_batches`, the list of results of the
    batches that completed, in order (``None`` otherwise). Being a ``MemoryError``, it is
    caught by ``except MemoryError`` and :func:`is_oom_error` accepts it.

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
# A RESOURCE_EXHAUSTED about these is not about memory.
NOT_MEMORY = ("No space left on device", "disk", "Disk", "quota", "Quota")
_MESSAGE_CLASSES = ("RuntimeError", "ResourceExhaustedError", "XlaRuntimeError")
# A DataLoader worker's error, re-raised in the main process as "Caught RuntimeError in
# DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n" + the worker's
# formatted traceback: only the worker's own error, after its last frame, is judged.
_WORKER = re.compile(r"\ACaught \w+ in DataLoader worker process \d+\.\n")
_FRAME = re.compile(r'^  File "[^\n]*\n(?:    [^\n]*\n)*', re.MULTILINE)


def oom_kind(exc: Any) -> str | None:
    """Which rule recognises ``exc`` (or an exception in its ``__cause__`` chain) as an
    out-of-memory, or ``None`` when none does (the rules are :func:`is_oom_error`'s).
    :func:`is_oom_error` is ``oom_kind(exc) is not None``.

    >>> oom_kind(RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB"))
    'CUDA caching allocator'
    """
    seen: set[int] = set()
    current = exc
    # Only Exceptions: KeyboardInterrupt, SystemExit, GeneratorExit, CancelledError (and
    # anything else outside Exception) are control flow, never an out-of-memory.
    while isinstance(current, Exception) and id(current) not in seen:
        seen.add(id(current))
        kind = _own_kind(current)
        if kind is not None:
            return kind
        current = current.__cause__
    return None


def _own_kind(exc: BaseException) -> str | None:
    if isinstance(exc, MemoryError):
        return "memguard" if isinstance(exc, OutOfMemoryError) else "MemoryError"
    if any(cls.__name__ == "OutOfMemoryError" and cls.__module__.startswith("torch")
           for cls in type(exc).__mro__):  # by name: this floor never touches torch
        return "torch.OutOfMemoryError"
    if not any(cls.__name__ in _MESSAGE_CLASSES for cls in type(exc).__mro__):
        return None
    text = str(exc)
    worker = _WORKER.match(text)
    if worker:
        text = _FRAME.split(text)[-1]
    if any(word in text for word in NOT_MEMORY):
        return None
    for kind, needle in OOM_MESSAGES:
        if needle in text:
            return f"DataLoader worker: {kind}" if worker else kind
    return None


def is_oom_error(exc: Any) -> bool:
    """Whether ``exc`` is an out-of-memory error, from any framework or device.

    True for ``torch.OutOfMemoryError``; RuntimeErrors that say CUDA/HIP/XPU/MPS/CPU
    allocation failed, including cuBLAS/cuDNN allocation failures, the cuDNN
    ``NOT_SUPPORTED`` error a full GPU produces and a torch memory mapping that failed with
    ``ENOMEM`` ("unable to mmap ... Cannot allocate memory (12)"); a DataLoader worker's
    error re-raised in the main process when the worker's own error is one of these;
    TensorFlow's ``ResourceExhaustedError`` about memory (not about disk space or a quota);
    ``MemoryError`` (so also numpy's and :class:`OutOfMemoryError`).

    Chains: an exception raised *from* one of these (``raise LoaderError(...) from oom``,
    its ``__cause__``: a wrapped out-of-memory) is one too. An exception raised while
    *handling* one, without ``from`` (only its ``__context__`` is the out-of-memory), is not:
    it is a new error, a bug in a handler say, and retrying would hide it. Exceptions outside
    ``Exception`` (``KeyboardInterrupt``, ``SystemExit``, ``GeneratorExit``,
    ``asyncio.CancelledError``) never are, whatever their chain, and neither is anything that
    is not an exception (``False``, never an error). oneDNN's ``could not create a primitive``
    is not recognised: its message does not say whether memory was the cause.

    >>> import memguard
    >>> memguard.is_oom_error(RuntimeError("DefaultCPUAllocator: can't allocate memory"))
    True
    >>> memguard.is_oom_error(ValueError("shape mismatch"))
    False
    >>> memguard.is_oom_error("out of memory")
    False
    """
    return oom_kind(exc) is not None
