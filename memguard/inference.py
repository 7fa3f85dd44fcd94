"""``inference_mode``: no autograd state, models in eval mode, memory cleaned afterwards."""

from __future__ import annotations

import gc
import logging
import time
from typing import Any, Callable, Optional, TypeVar

from ._decorate import guard
from .backends import is_keras_model, resolve_devices
from .backends.torch import InferenceState, enter_inference, exit_inference, is_module
from .cleanup import Cleanup, Pairs, Settler, cleanup_mode, empty_caches

F = TypeVar("F", bound=Callable[..., Any])
log = logging.getLogger("memguard")
InUse = list[tuple[str, Optional[int]]]


_DEVICES: tuple[float, Pairs] = (-1.0, [])
DEVICES_TTL = 1.0
"""Seconds the devices an ``"auto"`` cleanup watches are reused for before they are listed
again (listing them costs more than the two readings it serves: asking each framework which
devices it has started)."""


def _devices() -> Pairs:
    """Every active ``(backend, device)`` pair, listed again at most every
    :data:`DEVICES_TTL` seconds (a device started since is watched from the next listing)."""
    global _DEVICES
    now = time.monotonic()
    listed, pairs = _DEVICES
    if now - listed > DEVICES_TTL:
        pairs = resolve_devices(None)
        _DEVICES = (now, pairs)
    return pairs


def _in_use(pairs: Pairs, like: Optional[InUse] = None) -> InUse:
    """Each device's quick reading, ``(kind, bytes)``: what its allocator has handed out, or
    on a slow host heap the resident set (bytes ``None`` where unknown); with ``like``, of
    the kinds those readings had, so that they compare (``mallinfo2`` found slow inside the
    block must not leave the exit's reading of another kind than the entry's)."""
    out: InUse = []
    for index, (backend, device) in enumerate(pairs):
        try:
            kind = like[index][0] or None if like is not None else None
            out.append(backend.read_quick(device, kind))
        except Exception as exc:  # noqa: BLE001 - never let a reading break the program
            log.warning("cannot read %s: %s", device, exc)
            out.append(("", None))
    return out


def _held(pairs: Pairs, entry: InUse, now: InUse) -> Pairs:
    """The devices whose allocator hands out more than its tolerance above ``entry``."""
    return [(backend, device) for (backend, device), before, after in zip(pairs, entry, now,
                                                                          strict=True)
            if before[1] is not None and after[1] is not None and before[0] == after[0]
            and after[1] - before[1] > backend.hold_tolerance]


def _settle_kept(pairs: Pairs, entry: InUse) -> None:
    """The ``"auto"`` cleanup after an inference block: one cheap reading per device (what
    the allocators hand out; microseconds); only where the block left more than the device's
    tolerance in use, collect the young generations, then in full if that did not free it,
    and empty the caches of the devices that had held it. A cache that merely grew (the
    forward's activations freed into it) is left to the next forward, which reuses it."""
    held = _held(pairs, entry, _in_use(pairs, entry))
    if not held:
        return
    gc.collect(1)
    held_entry = [entry[pairs.index(p)] for p in held]
    still = _held(held, held_entry, _in_use(held, held_entry))
    if still:
        gc.collect()
    empty_caches(backend for backend, _ in held)
    log.debug("inference_mode collected garbage; memory was held on %s",
              ", ".join(device for _, device in held))


class InferenceMode:
    """The object :func:`inference_mode` returns: a context manager and a decorator.

    Attributes:
        models: the modules switched to ``eval()`` inside the block.
        cleanup: the exit policy, ``"auto"``, ``"always"`` or ``"never"``.

    >>> import torch, memguard
    >>> model = torch.nn.Linear(4, 2)
    >>> mode = memguard.inference_mode(model, cleanup="never")
    >>> with mode:
    ...     model.training
    False
    """

    def __init__(self, *models: Any, cleanup: Cleanup = "auto") -> None:
        for position, model in enumerate(models):
            if not is_module(model):
                raise TypeError(
                    f"inference_mode: argument {position} is a {type(model).__name__}, not a "
                    f"torch.nn.Module; pass the models to switch to eval mode (Keras models "
                    f"take training=False when called instead)")
        self.models = models
        self.cleanup: Cleanup = cleanup_mode(cleanup, "inference_mode")
        self._state: Optional[InferenceState] = None
        self._pairs: Pairs = []
        self._entry: InUse = []
        self._active = False

    def __enter__(self) -> "InferenceMode":
        if self._active:
            raise RuntimeError("this inference_mode is already active; use a new one per block")
        if self.cleanup == "auto":
            self._pairs = _devices()
            self._entry = _in_use(self._pairs)
        self._state = enter_inference(self.models)
        self._active = True
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._active = False
        state, self._state = self._state, None
        try:
            exit_inference(state)
        finally:
            try:
                if self.cleanup == "auto":
                    _settle_kept(self._pairs, self._entry)
                elif self.cleanup == "always":
                    Settler("always").settle(resolve_devices(None), {})
            except Exception:
                if exc_type is None:
                    raise

    def __call__(self, func: F) -> F:
        return guard(func, lambda: InferenceMode(*self.models, cleanup=self.cleanup),
                     "inference_mode", kinds=("sync",))


def inference_mode(*models: Any, cleanup: Cleanup = "auto") -> Any:
    """Run inference with no autograd state and every given model in eval mode.

    With torch: enters ``torch.inference_mode()``, switches each ``torch.nn.Module`` to
    ``eval()``, and on exit (also on an exception) restores every submodule's own ``training``
    flag; then cleans up. ``cleanup="auto"`` (the default) reads what each device's allocator
    hands out on entry and on exit (microseconds) and only where the block left more than the
    device's tolerance in use (a reference cycle holding outputs, say) collects garbage and
    empties that device's cache; a cache that merely grew (activations freed into it) is left
    to the next forward, which reuses it (the devices watched are listed again at most once
    a second, :data:`DEVICES_TTL`). On the host that reading is glibc's ``mallinfo2``, which
    walks every free block of the heap: where it takes more than 0.1 ms (a fragmented heap
    of a long-running server), the resident set stands in for the next 10 s. ``"always"``
    collects in full and empties every cache; ``"never"`` does neither.
    Without torch (a TensorFlow program) it only cleans up. Usable as ``with``, as
    ``@inference_mode`` and as ``@inference_mode(model)``; as a decorator it takes plain
    functions and methods (torch's inference mode belongs to a thread, so it cannot follow a
    coroutine or a generator between steps).

    Args:
        *models: the ``torch.nn.Module`` objects to switch to ``eval()`` inside the block. Given
            a function (bare ``@inference_mode``), it decorates it.
        cleanup: ``"auto"``, ``"always"`` or ``"never"`` (see above).

    Returns:
        An :class:`InferenceMode`: a context manager and a decorator.

    Raises:
        TypeError: an argument that is not a ``torch.nn.Module`` (named by its position; a
            Keras model takes ``training=False`` instead), or a coroutine or generator function
            given to the decorator.
        ValueError: a bad ``cleanup``.

    >>> import torch, memguard
    >>> model = torch.nn.Linear(4, 2)
    >>> with memguard.inference_mode(model):
    ...     y = model(torch.ones(1, 4))
    >>> y.requires_grad, model.training
    (False, True)
    """
    if len(models) == 1 and callable(models[0]) and not is_module(models[0]) \
            and not is_keras_model(models[0]):
        return InferenceMode(cleanup=cleanup)(models[0])
    return InferenceMode(*models, cleanup=cleanup)
