"""memguard: keep GPU and host memory under control in PyTorch and TensorFlow programs.

>>> import memguard
>>> with memguard.memory_scope() as scope:
...     pass
>>> print(scope)  # doctest: +SKIP
memory_scope: host peak 112.4 MiB, retained 0 B; freed 0 B in 0.000 s
"""

from ._units import format_bytes, parse_size
from .backends import DeviceMemory, activate, list_devices
from .cleanup import free_memory
from .errors import MemguardError, MemoryLeakError
from .inference import InferenceMode, inference_mode
from .scope import MemoryScope, frees_memory, memory_scope
from .snapshot import MemorySnapshot, snapshot

__version__ = "0.1.0"

__all__ = [
    "DeviceMemory", "InferenceMode", "MemguardError", "MemoryLeakError", "MemoryScope",
    "MemorySnapshot", "activate", "format_bytes", "free_memory", "frees_memory",
    "inference_mode", "list_devices", "memory_scope", "parse_size", "snapshot",
]
