"""memguard: keep GPU and host memory under control in PyTorch and TensorFlow programs.

>>> import memguard
>>> with memguard.memory_scope() as scope:
...     pass
>>> print(scope)  # doctest: +SKIP
memory_scope: host peak 112.4 MiB, retained 0 B; freed 0 B in 0.000 s
"""

from ._units import format_bytes, parse_size
from .backends import DeviceMemory, activate, list_devices
from .batching import find_batch_size, map_batches
from .cleanup import free_memory
from .config import MemoryLimit, configure_allocator, memory_limit, tf_memory_growth
from .errors import MemguardError, MemoryLeakError, OutOfMemoryError, is_oom_error
from .history import RecordHistory, record_history
from .inference import InferenceMode, inference_mode
from .microbatch import auto_microbatch
from .monitor import MemoryMonitor
from .retry import Attempt, oom_retry
from .scope import MemoryScope, frees_memory, memory_scope
from .snapshot import MemorySnapshot, snapshot
from .tensors import TensorInfo, live_tensors, memory_report

__version__ = "0.1.0"

__all__ = [
    "Attempt", "DeviceMemory", "InferenceMode", "MemguardError", "MemoryLeakError",
    "MemoryLimit", "MemoryMonitor", "MemoryScope", "MemorySnapshot", "OutOfMemoryError",
    "activate", "auto_microbatch", "configure_allocator", "find_batch_size", "memory_limit", "tf_memory_growth",
    "format_bytes", "free_memory", "frees_memory", "inference_mode", "is_oom_error",
    "list_devices", "live_tensors", "map_batches", "memory_report", "memory_scope",
    "oom_retry", "parse_size", "record_history", "RecordHistory", "snapshot", "TensorInfo",
]
