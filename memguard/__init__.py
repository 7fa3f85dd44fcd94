"""memguard: keep GPU and host memory under control in PyTorch and TensorFlow programs.

>>> import memguard
>>> with memguard.memory_scope() as scope:
...     pass
>>> print(scope)  # doctest: +SKIP
memory_scope: host peak 112.4 MiB, retained 0 B; freed 0 B in 0.000 s

What guards every block (scopes, cleanup, snapshots, errors) is imported with the package;
the rest (recovery from out-of-memory, the monitor, configuration) on first use of one of its
names, so that ``import memguard`` stays cheap (PEP 562).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._units import format_bytes, parse_size
from .backends import DeviceMemory, activate, list_devices
from .census import TensorInfo, live_tensors, memory_report
from .cleanup import free_memory
from .errors import MemguardError, MemoryLeakError, OutOfMemoryError, is_oom_error
from .frees import frees_memory
from .inference import InferenceMode, inference_mode
from .scope import MemoryScope, memory_scope
from .snapshot import MemorySnapshot, snapshot

if TYPE_CHECKING:
    from .backends.budget import Budget
    from .config import MemoryLimit, configure_allocator, memory_limit, tf_memory_growth
    from .history import RecordHistory, record_history
    from .loop import Attempt, AttemptLoop, attempts
    from .mapping import BatchResults, map_batches
    from .microbatch import MicrobatchedFunction, auto_microbatch
    from .monitor import MemoryMonitor
    from .retry import RetryingFunction, oom_retry
    from .search import BatchSize, find_batch_size

__version__ = "0.1.0"

# name -> the module that defines it, imported on first access
_LAZY = {
    "Budget": ".backends.budget",
    "Attempt": ".loop", "AttemptLoop": ".loop", "attempts": ".loop",
    "BatchResults": ".mapping", "map_batches": ".mapping",
    "BatchSize": ".search", "find_batch_size": ".search",
    "MemoryLimit": ".config", "configure_allocator": ".config", "memory_limit": ".config",
    "tf_memory_growth": ".config",
    "RecordHistory": ".history", "record_history": ".history",
    "MicrobatchedFunction": ".microbatch", "auto_microbatch": ".microbatch",
    "MemoryMonitor": ".monitor",
    "RetryingFunction": ".retry", "oom_retry": ".retry",
}


if not TYPE_CHECKING:  # type checkers see the imports above, and no other name
    def __getattr__(name: str) -> Any:
        module = _LAZY.get(name)
        if module is None:
            raise AttributeError(f"module 'memguard' has no attribute {name!r}")
        value = getattr(importlib.import_module(module, __name__), name)
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "Attempt", "AttemptLoop", "BatchResults", "BatchSize", "Budget", "DeviceMemory",
    "InferenceMode",
    "MemguardError", "MemoryLeakError", "MemoryLimit", "MemoryMonitor", "MemoryScope",
    "MemorySnapshot", "MicrobatchedFunction", "OutOfMemoryError", "RecordHistory",
    "RetryingFunction", "TensorInfo", "activate", "attempts", "auto_microbatch",
    "configure_allocator", "find_batch_size", "format_bytes", "free_memory", "frees_memory",
    "inference_mode", "is_oom_error", "list_devices", "live_tensors", "map_batches",
    "memory_limit", "memory_report", "memory_scope", "oom_retry", "parse_size", "record_history",
    "snapshot", "tf_memory_growth",
]
