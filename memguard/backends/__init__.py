"""Which memory backends are active.

The host backend always is. A framework's backend becomes active once the program has imported
the framework (memguard never imports it first), or after :func:`activate`.
"""

from __future__ import annotations

import importlib
import logging
import re
import sys
from typing import Iterable, Optional, Union

from .base import UNKNOWN, Backend, DeviceMemory, LevelField, Reading, is_keras_model
from .host import HOST, HostBackend
from .tensorflow import TensorFlowBackend
from .torch import TorchBackend

__all__ = ["Backend", "DeviceMemory", "LevelField", "Reading", "UNKNOWN", "HOST", "activate",
           "active_backends", "check_device", "check_devices", "host", "is_keras_model",
           "level_field", "resolve_devices", "list_devices"]

log = logging.getLogger("memguard")

host = HostBackend()
_FRAMEWORKS: dict[str, Backend] = {"torch": TorchBackend(), "tensorflow": TensorFlowBackend()}
_requested: set[str] = set()

Devices = Optional[Union[str, Iterable[str]]]


def activate(framework: str) -> Backend:
    """Import ``framework`` ("torch" or "tensorflow") and make its backend active.

    Args:
        framework: ``"torch"`` or ``"tensorflow"``.

    Returns:
        The framework's backend, now active: its devices are read by :func:`snapshot` and
        cleaned by :func:`free_memory`.

    Raises:
        ValueError: a framework memguard does not know.
        ImportError: the framework is not installed.

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
        log.warning("cannot list %s devices: %s", backend.name, exc)
        return []


def list_devices() -> list[str]:
    """Names of every device the active backends can read now (``host`` first).

    Returns:
        The device names, ``"host"`` first, then those of torch (``"cuda:0"``, ``"mps"``,
        ``"xpu:0"``) and TensorFlow (``"GPU:0"``) once the program has initialised them.

    >>> import memguard
    >>> memguard.list_devices()[0]
    'host'

    """
    return [d for b in active_backends() for d in _devices_of(b)]


_NAME_RE = re.compile(r"[A-Za-z]+(:\d+)?")
EXAMPLES = "'host', 'cuda', 'cuda:0', 'xpu:0', 'mps' or 'GPU:0'"


def check_device(device: object, name: str = "device") -> str:
    """``device`` if it is a device name some backend answers for, whether or not its framework
    is imported yet; else a ``TypeError`` or ``ValueError`` naming ``name`` and the value.

    >>> check_device("cuda:0")
    'cuda:0'
    >>> check_device("cuda:x")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: device: unknown device 'cuda:x'; use 'host', 'cuda', 'cuda:0', ... or 'GPU:0'
    """
    if not isinstance(device, str):
        raise TypeError(f"{name} must be a string such as 'host' or 'cuda:0', got "
                        f"{device!r} of type {type(device).__name__}")
    if not _NAME_RE.fullmatch(device) or _owner(device, imported_only=False) is None:
        hint = " (a torch GPU is 'cuda')" if device.lower() == "gpu" else ""
        raise ValueError(f"{name}: unknown device {device!r}; use {EXAMPLES}{hint}")
    return device


def check_devices(devices: Devices, name: str = "devices") -> Optional[tuple[str, ...]]:
    """The form of a device selection checked without reading any device: ``None`` (every
    device), one name, or an iterable of names (see :func:`check_device`); the names as a tuple.
    What an object taking ``devices`` calls when it is created.

    >>> check_devices(["host", "cuda:1"])
    ('host', 'cuda:1')
    >>> check_devices(5)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    TypeError: devices: expected None (every device), a device name ..., got 5 of type int
    """
    if devices is None:
        return None
    if isinstance(devices, str):
        return (check_device(devices, name),)
    try:
        names = tuple(devices)
    except TypeError:
        raise TypeError(f"{name}: expected None (every device), a device name such as 'host' or "
                        f"'cuda:0', or a list of names, got {devices!r} of type "
                        f"{type(devices).__name__}") from None
    return tuple(check_device(device, name) for device in names)


def resolve_devices(devices: Devices = None) -> list[tuple[Backend, str]]:
    """``(backend, device)`` pairs for a device name, a list of names, or all (``None``).

    A malformed selection gets the errors of :func:`check_devices`; a device whose framework
    this process has not imported, or that it cannot read, a ``ValueError`` listing the devices
    that can be read.
    """
    if devices is None:  # every guard's case, at every call: in a loop, few calls
        pairs: list[tuple[Backend, str]] = [(host, HOST)]
        for framework, backend in _FRAMEWORKS.items():
            if framework in sys.modules or framework in _requested:
                for device in _devices_of(backend):
                    pairs.append((backend, device))
        return pairs
    names = check_devices(devices)
    assert names is not None
    pairs = []
    for name in names:
        owner = _owner(name)
        if owner is None:
            raise ValueError(f"devices: unknown device {name!r}; this process can read "
                             f"{', '.join(list_devices())}")
        if isinstance(owner, TorchBackend):
            name = owner.normalise(name)
        pairs.append((owner, name))
    return pairs


def level_field(device: str) -> LevelField:
    """The figure of ``device``'s memory that its peak follows and its budgets count
    (:attr:`Backend.level_field`): ``"reserved"`` (the resident set) on the host,
    ``"allocated"`` on every other device, whether or not its framework is imported.

    >>> level_field("host"), level_field("cuda:0")
    ('reserved', 'allocated')
    """
    backend = _owner(device, imported_only=False)
    return backend.level_field if backend is not None else "allocated"


def _owner(name: str, imported_only: bool = True) -> Optional[Backend]:
    """The backend that answers for ``name``; ``None`` if none does, or (``imported_only``)
    if its framework is not imported."""
    if host.owns(name):
        return host
    for framework, backend in _FRAMEWORKS.items():
        if backend.owns(name):
            if imported_only and framework not in sys.modules and framework not in _requested:
                return None
            return backend
    return None
