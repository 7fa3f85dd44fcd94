"""Which memory backends are active.

The host backend always is. A framework's backend becomes active once the program has imported
the framework (memguard never imports it first), or after :func:`activate`.
"""

from __future__ import annotations

import importlib
import logging
import sys
from typing import Iterable, Optional, Union

from .base import Backend, DeviceMemory, Reading
from .host import HOST, HostBackend
from .tensorflow import TensorFlowBackend
from .torch import TorchBackend

__all__ = ["Backend", "DeviceMemory", "Reading", "HOST", "activate", "active_backends",
           "host", "resolve_devices", "list_devices"]

log = logging.getLogger("memguard")

host = HostBackend()
_FRAMEWORKS: dict[str, Backend] = {"torch": TorchBackend(), "tensorflow": TensorFlowBackend()}
_requested: set[str] = set()

Devices = Optional[Union[str, Iterable[str]]]


def activate(framework: str) -> Backend:
    """Import ``framework`` ("torch" or "tensorflow") and make its backend active.

    >>> from memguard import backends
    >>> backends.activate("torch").name
    'torch'
    """
    if framework not in _FRAMEWORKS:
        raise ValueError(f"unknown framework {framework!r}; memguard knows "
                         f"{', '.join(sorted(_FRAMEWORKS))}")
    importlib.import_module(framework)
    _requested.add(framework)
    return _FRAMEWORKS[framework]


def active_backends() -> list[Backend]:
    """The host backend, then each framework backend whose framework is imported."""
    return [host] + [b for name, b in _FRAMEWORKS.items()
                     if name in sys.modules or name in _requested]


def _devices_of(backend: Backend) -> list[str]:
    try:
        return backend.devices()
    except Exception as exc:  # noqa: BLE001 - a broken driver must not break the program
        log.warning("memguard: cannot list %s devices: %s", backend.name, exc)
        return []


def list_devices() -> list[str]:
    """Names of every device the active backends can read now (``host`` first)."""
    return [d for b in active_backends() for d in _devices_of(b)]


def resolve_devices(devices: Devices = None) -> list[tuple[Backend, str]]:
    """``(backend, device)`` pairs for a device name, a list of names, or all (``None``).

    Unknown names get a ``ValueError`` listing the devices that can be read.
    """
    if devices is None:
        return [(b, d) for b in active_backends() for d in _devices_of(b)]
    names = [devices] if isinstance(devices, str) else list(devices)
    pairs = []
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"devices: expected device names such as 'host' or 'cuda:0', "
                            f"got {name!r}")
        backend = _owner(name)
        if backend is None:
            raise ValueError(f"devices: unknown device {name!r}; this process can read "
                             f"{', '.join(list_devices())}")
        if isinstance(backend, TorchBackend):
            name = backend.normalise(name)
        pairs.append((backend, name))
    return pairs


def _owner(name: str) -> Optional[Backend]:
    if host.owns(name):
        return host
    for framework, backend in _FRAMEWORKS.items():
        if backend.owns(name):
            if framework not in sys.modules and framework not in _requested:
                return None
            return backend
    return None
