"""TensorFlow GPUs, through ``tf.config.experimental.get_memory_info``. TensorFlow never hands
GPU memory back inside a process (no cache to empty); devices are listed only once its
runtime started (listing would start it). CPU tensors belong to the host backend."""

from __future__ import annotations

import logging
import os
import re
import sys
import weakref
from typing import Any, Optional

from . import _tf_compat as compat
from ._tf_compat import VARIABLE_HANDLE, runtime_initialized
from .base import UNKNOWN, Backend, DeviceMemory, Reading, TensorRow, subclasses

log = logging.getLogger("memguard")

NO_RELEASE = ("TensorFlow keeps the GPU memory it reserved until the process ends; "
              "freed tensors go back to its own pool, not to the driver")


def _tf() -> Any:
    import tensorflow as tf

    return tf


def _runtime_started() -> bool:
    # Where TensorFlow cannot be asked (not importable, or a version without this private
    # flag) the answer is "not started": looking must never start the runtime and claim GPUs.
    if "tensorflow" not in sys.modules:
        return False  # never imported: nothing started (and nothing imported to look)
    try:
        from tensorflow.python.eager import context

        return runtime_initialized(context)
    except (ImportError, AttributeError):
        return False


_GPU_NAME = re.compile(r"(?i:gpu):\d+")


class TensorFlowBackend(Backend):
    """Memory of TensorFlow's GPUs (``GPU:0``, ...)."""

    name = "tensorflow"  # the tolerances are Backend's

    def devices(self) -> list[str]:
        if not _runtime_started():
            return []
        return [d.name.replace("/device:", "") for d in _tf().config.list_logical_devices("GPU")]

    def owns(self, device: str) -> bool:
        # with its index, as TensorFlow lists it: a bare "gpu" is more likely a torch
        # program's "cuda", refused when the guard is created rather than when entered
        return _GPU_NAME.fullmatch(device) is not None

    def read_fast(self, device: str) -> Reading:  # pragma: gpu
        info = self._info(device)
        return UNKNOWN if info is None else Reading(int(info["current"]), None)

    def _info(self, device: str) -> Optional[dict[str, int]]:  # pragma: gpu
        try:
            return _tf().config.experimental.get_memory_info(device)
        except (ValueError, RuntimeError):
            return None

    def read_peak(self, device: str) -> Optional[int]:  # pragma: gpu
        info = self._info(device)
        return None if info is None else int(info["peak"])

    def read(self, device: str) -> DeviceMemory:  # pragma: gpu
        info = self._info(device)
        if info is None:
            return DeviceMemory(device)
        return DeviceMemory(device, allocated=int(info["current"]), peak=int(info["peak"]))

    def reset_peak(self, device: str) -> bool:  # pragma: gpu
        try:
            _tf().config.experimental.reset_memory_stats(device)
            return True
        except (ValueError, RuntimeError):
            return False

    def empty_cache(self) -> None:
        if self.devices():  # pragma: gpu
            log.debug("free_memory: %s", NO_RELEASE)


def cpu_pool_free() -> int:
    """Bytes TensorFlow's CPU pool holds free (high-water mark less in use; 0 when unknown):
    taken under an address-space budget, yet free for its next tensors. An underestimate
    after ``reset_memory_stats``.

    >>> cpu_pool_free() >= 0
    True
    """
    if not _runtime_started():
        return 0
    try:
        info = _tf().config.experimental.get_memory_info("CPU:0")
        return max(0, int(info["peak"]) - int(info["current"]))
    except (ValueError, RuntimeError, KeyError, TypeError):
        return 0


# Whether this process's TensorFlow CPU allocator keeps statistics: None until asked once the
# runtime started, then fixed (the allocator is chosen when the runtime starts).
_CPU_STATS: dict[str, bool] = {}


def cpu_pool_in_use() -> int:
    """Bytes TensorFlow's CPU pool has handed out (``get_memory_info("CPU:0")["current"]``); 0
    before its runtime started or without statistics (``TF_ENABLE_ONEDNN_OPTS=0``). With
    oneDNN these tensors move neither the resident set nor ``mallinfo2`` (see the development
    page's measured facts).

    >>> cpu_pool_in_use() >= 0
    True
    """
    if "tensorflow" not in sys.modules or _CPU_STATS.get("known") is False:
        return 0
    if not _CPU_STATS.get("started"):
        if not _runtime_started():
            return 0
        _CPU_STATS["started"] = True  # a runtime once started stays started
    try:
        current = int(_tf().config.experimental.get_memory_info("CPU:0")["current"])
    except (ValueError, RuntimeError, KeyError, TypeError):
        _CPU_STATS["known"] = False  # no statistics: malloc is the allocator, mallinfo2 sees all
        return 0
    _CPU_STATS["known"] = True
    return current


def clear_keras_session() -> bool:
    """``keras.backend.clear_session()`` for whichever Keras is imported; False if none."""
    keras = sys.modules.get("keras")
    if keras is None and "tensorflow" in sys.modules:
        keras = _tf().keras
    if keras is None:
        return False
    keras.backend.clear_session()
    return True


# -- tensors ------------------------------------------------------------------------------------
def tensor_types() -> set[type]:
    """TensorFlow's eager tensor and variable classes (graph tensors own no memory)."""
    tf = _tf()
    from tensorflow.python.framework import ops

    return subclasses(ops.EagerTensor, tf.Variable, excluding=compat.NO_STORAGE)


def _device(name: str) -> str:
    """``/job:localhost/replica:0/task:0/device:CPU:0`` -> ``cpu``; ``...GPU:1`` -> ``GPU:1``."""
    short = name.rsplit("device:", 1)[-1] if name else "CPU:0"
    return "cpu" if short.upper().startswith("CPU") else short


def tensor_facts(tensor: Any) -> Optional[tuple]:
    """(device, dtype, shape, storage key, bytes, is_view) of an eager tensor or variable."""
    try:
        shape = tuple(tensor.shape.as_list())
        count = tensor.shape.num_elements()
        dtype = tensor.dtype
        nbytes = None if count is None else count * dtype.size
        # A variable's memory is its resource handle's: variables that share one (such as the
        # _UnreadVariable an assign returns) count it once.
        # The handle itself (dtype resource) holds no data and is keyed apart: seen before its
        # variable it would otherwise take the variable's bytes as its own zero.
        handle = getattr(tensor, VARIABLE_HANDLE, None)
        if dtype.name == "resource":
            key = ("tf-handle", id(tensor))
        else:
            key = ("tf", id(tensor if handle is None else handle))
        return (_device(tensor.device), dtype.name, shape, key, nbytes or 0, False)
    except (ValueError, AttributeError, RuntimeError, TypeError):
        return None


def census_rows(tensors: list[Any], names: dict[int, str]
                ) -> tuple[list[TensorRow], list[Any]]:
    """The census rows of ``tensors`` and their storage keys (see the torch backend's)."""
    rows: list[TensorRow] = []
    keys: list[Any] = []
    for tensor in tensors:
        facts = tensor_facts(tensor)
        if facts is not None:
            device, dtype, shape, key, nbytes, is_view = facts
            try:
                ref = weakref.ref(tensor)
            except TypeError:
                ref = None
            rows.append(TensorRow("tensorflow", device, dtype, shape, nbytes, is_view,
                                  names.get(id(tensor)), id(tensor), ref))
            keys.append(key)
    return rows, keys


def write_scalars(writer: Any, rows: list[tuple[str, int, float]]) -> None:
    """Write ``(tag, step, value)`` rows through ``tf.summary`` with ``writer``."""
    tf = _tf()
    with writer.as_default():
        for tag, step, value in rows:
            tf.summary.scalar(tag, value, step=step)
    writer.flush()


def set_memory_growth(enable: bool) -> int:
    """Set memory growth on every visible GPU; their number (``RuntimeError`` once started)."""
    tf = _tf()
    gpus = tf.config.list_physical_devices("GPU")
    for gpu in gpus:  # pragma: gpu
        try:
            tf.config.experimental.set_memory_growth(gpu, enable)
        except RuntimeError as exc:
            raise RuntimeError(
                "tf_memory_growth: TensorFlow has already initialised its GPUs; call it before "
                "any TensorFlow op (right after importing TensorFlow), or set "
                "TF_FORCE_GPU_ALLOW_GROWTH=true in the environment") from exc
    return len(gpus)


def device_overview() -> list[dict[str, Any]]:
    """TensorFlow's GPUs as it sees them (without starting its runtime)."""
    tf = _tf()
    return [{"device": d.name.replace("/physical_device:", ""), "name": d.device_type}
            for d in tf.config.list_physical_devices("GPU")]


def version() -> str:
    """The installed tensorflow's version (imports it)."""
    return str(_tf().__version__)


DISTRIBUTIONS = ("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tensorflow-rocm",
                 "tensorflow-macos", "tf-nightly", "tf-nightly-cpu")


def installed_version() -> Optional[str]:
    """TensorFlow's version from package metadata, without importing it (``None``: none)."""
    from importlib import metadata

    for name in DISTRIBUTIONS:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def gpus_possible() -> bool:
    """Whether TensorFlow could see a GPU here (an NVIDIA driver, ROCm, macOS); if not, its GPU
    list is empty without an import.

    >>> isinstance(gpus_possible(), bool)
    True
    """
    return (os.path.exists("/proc/driver/nvidia") or os.path.exists("/dev/kfd")
            or sys.platform == "darwin")


def import_quietly() -> Any:
    """Import TensorFlow once without its start-up banner: ``TF_CPP_MIN_LOG_LEVEL=2`` unless set,
    and file descriptor 2 pointed at ``/dev/null`` while its libraries load (their oneDNN
    banner is printed before its logging exists)."""
    if "tensorflow" in sys.modules:
        return sys.modules["tensorflow"]
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        import tensorflow as tf
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
    return tf
