"""Allocator settings, TensorFlow memory growth, and a smaller device to rehearse on."""

from __future__ import annotations

import itertools
import logging
import os
import sys
import warnings
from typing import Any, Optional

from ._checks import flag, fraction, positive_int
from ._locks import ForkSafeLock
from ._units import Size, format_bytes, parse_size
from .backends import check_device, tensorflow as tf_backend, torch as torch_backend
from .backends.host import limit_address_space, restore_address_space

log = logging.getLogger("memguard")
ALLOC_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
_BACKENDS = ("native", "cudaMallocAsync")


def _split_settings(text: str) -> list[tuple[str, str]]:
    """``"a:1,b:[2,3]"`` -> ``[("a", "1"), ("b", "[2,3]")]`` (commas inside brackets kept)."""
    items, depth, current = [], 0, ""
    for char in text:
        depth += char == "["
        depth -= char == "]"
        if char == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    items.append(current)
    pairs = []
    for item in items:
        key, sep, value = item.strip().partition(":")
        if key and sep:
            pairs.append((key.strip(), value.strip()))
    return pairs


def _validated(max_split_size_mb: Any, expandable_segments: Any,
               garbage_collection_threshold: Any, backend: Any,
               roundup_power2_divisions: Any) -> dict[str, str]:
    settings: dict[str, str] = {}
    who = "configure_allocator"
    if max_split_size_mb is not None:
        settings["max_split_size_mb"] = str(positive_int(
            max_split_size_mb, "max_split_size_mb", minimum=21, who=who, hint=" (MiB)"))
    if expandable_segments is not None:
        settings["expandable_segments"] = str(flag(expandable_segments, "expandable_segments",
                                                   who=who))
    if garbage_collection_threshold is not None:
        settings["garbage_collection_threshold"] = repr(fraction(
            garbage_collection_threshold, "garbage_collection_threshold", who=who))
    if backend is not None:
        if backend not in _BACKENDS:
            raise ValueError(f"configure_allocator: backend must be 'native' or "
                             f"'cudaMallocAsync', got {backend!r}")
        settings["backend"] = backend
    if roundup_power2_divisions is not None:
        value = roundup_power2_divisions
        if isinstance(value, bool) or not isinstance(value, int) or value not in (1, 2, 4, 8, 16):
            raise ValueError(f"configure_allocator: roundup_power2_divisions must be a power of "
                             f"two from 1 to 16, got {value!r}")
        settings["roundup_power2_divisions"] = str(value)
    return settings


def configure_allocator(*, max_split_size_mb: Optional[int] = None,
                        expandable_segments: Optional[bool] = None,
                        garbage_collection_threshold: Optional[float] = None,
                        backend: Optional[str] = None,
                        roundup_power2_divisions: Optional[int] = None) -> str:
    """Set PyTorch's caching-allocator options for this process and return the result.

    Merges with what ``PYTORCH_ALLOC_CONF`` / ``PYTORCH_CUDA_ALLOC_CONF`` hold (the new values
    win) and writes both. The allocator reads them when CUDA initialises: called later, it
    warns that they cannot take effect.

    Args:
        max_split_size_mb: blocks larger than this (MiB, an int above 20) are never split.
            Default ``None``: left as it is.
        expandable_segments: let the allocator grow segments instead of allocating new ones.
            Default ``None``: left as it is.
        garbage_collection_threshold: reclaim cached blocks once this fraction (between 0 and
            1) of the memory is in use. Default ``None``: left as it is.
        backend: ``"native"`` or ``"cudaMallocAsync"``. Default ``None``: left as it is.
        roundup_power2_divisions: round allocations up to this many divisions of a power of
            two (a power of two up to 16). Default ``None``: left as it is.

    Returns:
        The merged configuration, as written to both variables.

    Raises:
        ValueError: a value outside its range, naming the option and the range.

    >>> import memguard
    >>> memguard.configure_allocator(expandable_segments=True)  # doctest: +SKIP
    'expandable_segments:True'
    """
    settings = _validated(max_split_size_mb, expandable_segments, garbage_collection_threshold,
                          backend, roundup_power2_divisions)
    current = os.environ.get(ALLOC_VARIABLES[0]) or os.environ.get(ALLOC_VARIABLES[1]) or ""
    merged = dict(_split_settings(current))
    merged.update(settings)
    text = ",".join(f"{key}:{value}" for key, value in merged.items())
    for name in ALLOC_VARIABLES:
        os.environ[name] = text
    if torch_backend.cuda_initialised():  # pragma: gpu
        message = (f"configure_allocator: CUDA is already initialised in this process, so "
                   f"{text!r} cannot take effect here; call it before the first CUDA "
                   f"operation, or set PYTORCH_ALLOC_CONF before starting Python")
        warnings.warn(message, RuntimeWarning, stacklevel=2)
    log.debug("allocator settings %s", text)
    return text


def tf_memory_growth(enable: bool = True) -> int:
    """Set memory growth on every visible TensorFlow GPU, so TensorFlow claims GPU memory as it
    needs it instead of nearly all of it at start.

    Args:
        enable: turn memory growth on (``True``, the default) or off.

    Returns:
        The number of GPUs set (0 without GPUs or without TensorFlow).

    Raises:
        RuntimeError: TensorFlow has already initialised its GPUs; call it before any
            TensorFlow op.

    >>> import memguard
    >>> memguard.tf_memory_growth()  # doctest: +SKIP
    0
    """
    flag(enable, "enable", who="tf_memory_growth")
    try:
        return tf_backend.set_memory_growth(enable)
    except ImportError:
        return 0


class MemoryLimit:
    """The context manager :func:`memory_limit` returns (one block at a time).

    Attributes:
        limit: the bytes the block may use.
        device: the device it binds, ``"host"`` or ``"cuda:N"``.

    >>> import memguard
    >>> limit = memguard.memory_limit("8GiB", "host")
    >>> limit.limit, limit.device
    (8589934592, 'host')
    >>> with limit:
    ...     pass
    """

    def __init__(self, limit: Size, device: Optional[str] = None) -> None:
        self.limit = parse_size(limit, "memory_limit: limit")
        if self.limit <= 0:
            raise ValueError(f"memory_limit: limit must be positive, got {limit!r}")
        self.device = _checked_device(device)
        self._restore: Any = None

    def __enter__(self) -> "MemoryLimit":
        if self._restore is not None:
            raise RuntimeError("this memory_limit is already active; use a new "
                               "memory_limit(...) for each block open at the same time")
        if self.device == "host":
            _import_what_guards_import()
            self._restore = ("host", limit_address_space(self.limit))
        else:  # pragma: gpu
            index = int(self.device.partition(":")[2])
            total = torch_backend.cuda_total(index)
            if self.limit > total:
                raise ValueError(f"memory_limit: {format_bytes(self.limit)} is more than "
                                 f"{self.device} has ({format_bytes(total)})")
            self._restore = ("cuda", index, _open_cuda_limit(index, self.limit / total))
        log.debug("memory limited to %s on %s", format_bytes(self.limit), self.device)
        return self

    def __repr__(self) -> str:
        state = "active" if self._restore is not None else "not active"
        return f"<MemoryLimit {format_bytes(self.limit)} on {self.device}, {state}>"

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        restore, self._restore = self._restore, None
        if restore is None:
            return
        if restore[0] == "host":
            restore_address_space(restore[1])
        else:  # pragma: gpu
            _close_cuda_limit(restore[1], restore[2])


# CUDA limits open per device: index -> {token: fraction}, and the fraction found when the
# first opened. As on the host, the tightest open one is in force, whichever thread or task
# opened it and whatever order they close in; the one found comes back when the last closes.
_CUDA_OPEN: dict[int, dict[int, float]] = {}
_CUDA_ORIGINAL: dict[int, float] = {}
_CUDA_TOKENS = itertools.count(1)
_CUDA_LOCK = ForkSafeLock()


def _open_cuda_limit(index: int, fraction: float) -> int:  # pragma: gpu
    with _CUDA_LOCK:
        opened = _CUDA_OPEN.setdefault(index, {})
        if not opened:
            _CUDA_ORIGINAL[index] = torch_backend.memory_fraction(index)
        token = next(_CUDA_TOKENS)
        opened[token] = fraction
        torch_backend.set_memory_fraction(index, min(_CUDA_ORIGINAL[index], *opened.values()))
    return token


def _close_cuda_limit(index: int, token: int) -> None:  # pragma: gpu
    with _CUDA_LOCK:
        opened = _CUDA_OPEN.get(index, {})
        if opened.pop(token, None) is None:
            return
        original = _CUDA_ORIGINAL[index]
        torch_backend.set_memory_fraction(index, min(original, *opened.values()))
        if not opened:
            del _CUDA_OPEN[index], _CUDA_ORIGINAL[index]


_DEVICES = "'host', 'cuda' or 'cuda:N'"


def _checked_device(device: Any) -> str:
    """``device`` as ``"host"`` or ``"cuda:N"`` (default: the current CUDA device, else the
    host), or an error saying what is wrong."""
    if device is None:
        return torch_backend.available_cuda_device() or "host"
    if not isinstance(device, str):
        check_device(device, "memory_limit: device")  # the one message for a wrong type
    if device.upper().startswith("GPU"):
        raise RuntimeError(
            f"memory_limit: TensorFlow GPUs ({device}) can only be limited before "
            f"TensorFlow initialises them, and not undone: at the start of the program, "
            f"tf.config.set_logical_device_configuration(tf.config.list_physical_devices("
            f"'GPU')[0], [tf.config.LogicalDeviceConfiguration(memory_limit=MiB)])")
    kind, colon, index = device.partition(":")
    if device == "host":
        return device
    if kind != "cuda" or (colon and not index.isdigit()):
        raise ValueError(f"memory_limit: device must be {_DEVICES}, got {device!r}")
    count = torch_backend.cuda_device_count()
    if not colon:
        index = (torch_backend.available_cuda_device() or "cuda:0").partition(":")[2]
    if int(index) >= count:
        seen = "no CUDA GPU" if not count else f"{count} (cuda:0 to cuda:{count - 1})"
        raise ValueError(f"memory_limit: device {device!r} needs a CUDA GPU, and torch sees "
                         f"{seen}; use device='host' to rehearse on host memory instead")
    return f"cuda:{int(index)}"  # pragma: gpu


# What memguard's guards import on first use. Under a tight address-space limit an import
# can fail in ways that hide the out-of-memory (a shared object that cannot be mapped is an
# ImportError; the compiler short of memory raised "field 'target' is required for
# AnnAssign"), so a host limit imports them before it opens.
_GUARDS = ("memguard.cleanup", "memguard.errors", "memguard.loop", "memguard.scope",
           "memguard.frees", "memguard.snapshot", "memguard.census", "memguard.holders",
           "memguard.backends.budget")
_FRAMEWORK_PARTS = {"torch": ("memguard.backends.torch", "memguard.backends.torch_autograd"),
                    "tensorflow": ("memguard.backends.tensorflow",)}


def _import_what_guards_import() -> None:
    import importlib

    names = list(_GUARDS)
    for framework, parts in _FRAMEWORK_PARTS.items():
        if framework in sys.modules:
            names += parts
    for name in names:
        if name not in sys.modules:
            importlib.import_module(name)


def memory_limit(limit: Size, device: Optional[str] = None) -> MemoryLimit:
    """Rehearse a smaller device: inside the block, ``device`` has only ``limit`` bytes.

    On CUDA the caching allocator is capped with ``set_per_process_memory_fraction``. On the
    host a soft ``RLIMIT_AS`` is set at the current virtual size plus ``limit`` (Linux; it
    counts address space for the whole process, and the heap is trimmed on entry so freed
    memory is not reused beyond the limit). Open limits compose: the tightest is in force,
    and the previous one is back when the last closes. TensorFlow GPUs can only be limited
    before TensorFlow initialises them (``tf.config.set_logical_device_configuration``).

    Args:
        limit: the bytes the block may use, an int or a size such as ``"256MiB"``.
        device: ``"host"``, ``"cuda"`` or ``"cuda:N"``. Default ``None``: the current CUDA
            device when torch sees one, else the host.

    Returns:
        a :class:`MemoryLimit`, to use with ``with``.

    Raises:
        TypeError: a ``device`` that is not a string.
        ValueError: another device, a CUDA device torch does not see, or an unreadable
            ``limit``.
        RuntimeError: a TensorFlow GPU.

    >>> import torch, memguard
    >>> with memguard.memory_limit("256MiB", device="host"):  # doctest: +SKIP
    ...     torch.ones(2**28)  # 1 GiB
    RuntimeError: ... DefaultCPUAllocator: can't allocate memory ...
    """
    return MemoryLimit(limit, device)
