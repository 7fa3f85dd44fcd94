"""NVIDIA's management library (``nvidia-ml-py``): the driver's view of every GPU, including
other processes' use. Optional: without the package or a driver, everything here is empty."""

from __future__ import annotations

from typing import Any, Optional


def _nvml() -> Any:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver: NVMLError_LibraryNotFound and friends
        return None
    return pynvml


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def driver_version() -> Optional[str]:
    """The NVIDIA driver's version, or None."""
    nvml = _nvml()
    return None if nvml is None else _text(nvml.nvmlSystemGetDriverVersion())


def gpus(pid: Optional[int] = None) -> list[dict[str, Any]]:
    """Each GPU: ``index``, ``name``, ``total``, ``used``, ``free`` and ``processes`` (pid ->
    bytes; only ``pid`` when given)."""
    nvml = _nvml()
    if nvml is None:
        return []
    out = []
    for index in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        try:
            procs = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except Exception:  # noqa: BLE001
            procs = []
        processes = {int(p.pid): int(p.usedGpuMemory or 0) for p in procs
                     if pid is None or int(p.pid) == pid}
        out.append({"index": index, "name": _text(nvml.nvmlDeviceGetName(handle)),
                    "total": int(memory.total), "used": int(memory.used),
                    "free": int(memory.free), "processes": processes})
    return out
