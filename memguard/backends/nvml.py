"""NVIDIA's management library (``nvidia-ml-py``): the driver's view of every GPU, other
processes included; empty without the package or a driver. Initialised once per process
(again after a fork), shut down at exit."""

from __future__ import annotations

import atexit
import logging
import os
from typing import Any, Optional

from .._locks import ForkSafeLock

log = logging.getLogger("memguard")
_state: dict[str, Any] = {}  # "pid": the process that initialised, "module": pynvml or None
_lock = ForkSafeLock()


def _nvml() -> Any:
    """``pynvml``, initialised in this process; None without the package or a driver."""
    if _state.get("pid") != os.getpid():
        with _lock:
            if _state.get("pid") != os.getpid():
                _state.update(module=_init(), pid=os.getpid())
    return _state["module"]


def _init() -> Any:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - no driver: NVMLError_LibraryNotFound and friends
        log.debug("NVML unavailable: %s", exc)
        return None
    return pynvml  # pragma: gpu


@atexit.register
def _shutdown() -> None:
    """Shut NVML down at exit if this process initialised it."""
    if _state.get("pid") == os.getpid() and _state.get("module") is not None:  # pragma: gpu
        module, _state["module"] = _state["module"], None
        try:
            module.nvmlShutdown()
        except Exception as exc:  # noqa: BLE001 - the driver went away: nothing to release
            log.debug("NVML shutdown: %s", exc)


def _text(value: Any) -> str:  # pragma: gpu
    return value.decode() if isinstance(value, bytes) else str(value)


def driver_version() -> Optional[str]:
    """The NVIDIA driver's version, or None.

    >>> driver_version() is None or driver_version()[0].isdigit()
    True
    """
    nvml = _nvml()
    if nvml is None:
        return None
    try:  # pragma: gpu
        return _text(nvml.nvmlSystemGetDriverVersion())
    except nvml.NVMLError as exc:  # pragma: gpu
        log.debug("NVML: %s", exc)
        return None


def gpus(pid: Optional[int] = None) -> list[dict[str, Any]]:
    """Each GPU: ``index``, ``name``, ``total``, ``used``, ``free`` and ``processes`` (pid ->
    bytes; only ``pid`` when given); empty without NVML.

    >>> all(gpu["total"] >= gpu["used"] for gpu in gpus())
    True
    """
    nvml = _nvml()
    if nvml is None:
        return []
    try:  # pragma: gpu
        return _gpus(nvml, pid)
    except nvml.NVMLError as exc:  # a GPU fell off the bus, the driver was reloaded  # pragma: gpu
        log.debug("NVML: %s", exc)
        return []


def _gpus(nvml: Any, pid: Optional[int]) -> list[dict[str, Any]]:  # pragma: gpu
    out = []
    for index in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        try:
            procs = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except nvml.NVMLError:  # not supported on this GPU or driver
            procs = []
        processes = {int(p.pid): int(p.usedGpuMemory or 0) for p in procs
                     if pid is None or int(p.pid) == pid}
        out.append({"index": index, "name": _text(nvml.nvmlDeviceGetName(handle)),
                    "total": int(memory.total), "used": int(memory.used),
                    "free": int(memory.free), "processes": processes})
    return out
