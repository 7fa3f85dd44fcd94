"""memguard's exceptions."""

from __future__ import annotations

from typing import Any, Mapping, Sequence


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
    last out-of-memory error. Being a ``MemoryError``, it is caught by ``except MemoryError``
    and :func:`is_oom_error` accepts it.

    >>> import memguard
    >>> err = memguard.OutOfMemoryError("out of memory at batch sizes 8, 4", attempts=[])
    >>> memguard.is_oom_error(err)
    True
    """

    def __init__(self, message: str, attempts: Sequence[Any] = ()) -> None:
        super().__init__(message)
        self.attempts = list(attempts)


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
)
# A RESOURCE_EXHAUSTED about these is not about memory.
NOT_MEMORY = ("No space left on device", "disk", "Disk", "quota", "Quota")
_MESSAGE_CLASSES = ("RuntimeError", "ResourceExhaustedError", "XlaRuntimeError")


def oom_kind(exc: BaseException | None) -> str | None:
    """Which rule recognises ``exc`` (or an exception in its cause/context chain) as an
    out-of-memory, or ``None`` when none does. :func:`is_oom_error` is ``oom_kind(exc) is not
    None``.

    >>> oom_kind(RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB"))
    'CUDA caching allocator'
    """
    seen: set[int] = set()
    stack = [exc]
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        kind = _own_kind(current)
        if kind is not None:
            return kind
        stack += [current.__context__, current.__cause__]
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
    if any(word in text for word in NOT_MEMORY):
        return None
    for kind, needle in OOM_MESSAGES:
        if needle in text:
            return kind
    return None


def is_oom_error(exc: BaseException | None) -> bool:
    """Whether ``exc`` is an out-of-memory error, from any framework or device.

    True for ``torch.OutOfMemoryError``; RuntimeErrors that say CUDA/HIP/XPU/MPS/CPU
    allocation failed, including cuBLAS/cuDNN allocation failures and the cuDNN
    ``NOT_SUPPORTED`` error a full GPU produces; TensorFlow's ``ResourceExhaustedError`` about
    memory (not about disk space or a quota); ``MemoryError`` (so also numpy's and
    :class:`OutOfMemoryError`); and any exception whose ``__cause__`` / ``__context__`` chain
    holds one of these.

    >>> import memguard
    >>> memguard.is_oom_error(RuntimeError("DefaultCPUAllocator: can't allocate memory"))
    True
    >>> memguard.is_oom_error(ValueError("shape mismatch"))
    False
    """
    return oom_kind(exc) is not None
