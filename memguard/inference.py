"""``inference_mode``: no autograd state, models in eval mode, memory cleaned afterwards."""

from __future__ import annotations

import logging
import os
import threading
import time
from time import perf_counter
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, TypeVar, Union, overload

from . import cleanup as cleanup_state
from ._decorate import guard
from .backends import is_keras_model, resolve_devices
from .backends.torch import InferenceState, enter_inference, exit_inference, first_non_module
from .cleanup import (
    MAX_GAP,
    Backoff,
    Cleanup,
    Pairs,
    Settler,
    cleanup_mode,
    collect_held,
    empty_caches,
    interrupts_after,
)

if TYPE_CHECKING:  # for type checkers only: memguard imports torch in its backends, lazily
    import torch

F = TypeVar("F", bound=Callable[..., Any])
log = logging.getLogger("memguard")


_DEVICES: tuple[float, Pairs] = (-1.0, [])
DEVICES_TTL = 1.0
"""Seconds the devices an ``"auto"`` cleanup watches are reused for before they are listed
again (listing them costs more than the readings it serves: asking each framework which
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


Level = tuple[str, Optional[int]]
"""A device's quick reading, ``(kind, bytes)`` (bytes ``None`` where unknown); readings of
different kinds do not compare."""
Levels = dict[str, Level]

CHECK_SHARE = 0.001
"""The most of the blocks' time the ``"auto"`` checks may take: the devices are read once the
blocks since the previous check have run ``1 / CHECK_SHARE`` times as long as that check
took (each check times itself). A block that long is checked at its exit; a run of shorter
ones every few blocks."""


def _levels(pairs: Pairs, like: Optional[Mapping[str, Optional[Level]]] = None) -> Levels:
    """Each device's quick reading: what its allocator has handed out, or on a slow host heap
    the resident set; with ``like``, of the kind each device's reading there has (so that
    the two compare)."""
    out: Levels = {}
    for backend, device in pairs:
        kind = (like.get(device) or ("", None))[0] or None if like else None
        try:
            out[device] = backend.read_quick(device, kind)
        except Exception as exc:  # noqa: BLE001 - never let a reading break the program
            log.warning("cannot read %s: %s", device, exc)
            out[device] = ("", None)
    return out


def _above(now: Level, reference: Optional[Level]) -> int:
    """Bytes ``now`` is above ``reference``; 0 where they do not compare."""
    if reference is None or now[1] is None or reference[1] is None or now[0] != reference[0]:
        return 0
    return now[1] - reference[1]


def _lower(older: Optional[Level], newer: Optional[Level]) -> Optional[Level]:
    """The lower of two levels of one kind; of two kinds (or one unknown), the newer known."""
    if newer is None or newer[1] is None:
        return older
    if older is None or older[1] is None or older[0] != newer[0]:
        return newer
    return older if older[1] <= newer[1] else newer


class _Watch:
    """What :func:`inference_mode`'s ``"auto"`` cleanup keeps across blocks, one per process:
    each device's level as the previous check left it, the block time run since that check,
    what the check took, and a back-off for collections that freed nothing.

    A check compares each device's reading at a block's exit with a reference: the lower of
    the level the previous check left and, where the block was read on entry too (the check
    was due then), its entry reading; so a block that leaves memory in use is seen whether
    memory was freed or allocated between blocks, and so is memory left by unchecked blocks
    before it. Where a device is more than its tolerance above the reference: collect the
    young generations, then in full if that did not free it, and empty that device's cache.
    A collection that freed nothing (memory really in use: outputs the caller keeps) backs
    off, skipping the next 1, 3, 7 ... 63 collections a check would run, and the level
    becomes what is in use then, so that it is not collected for again until more is held.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.level: Levels = {}
        self.owed = 0.0  # seconds of blocks run since the last check
        self.due = 0.0  # ... at which the next check is due: 0 before the first
        self.backoff = Backoff()

    def stale(self) -> None:
        """Make the next block's check due on its entry (after a full collection, a level
        read before it may be far above what is in use)."""
        self.due = 0.0

    def entry(self) -> Optional[Levels]:
        """The entry readings of a block whose check is due."""
        return _levels(_devices(), self.level)

    def check(self, entry: Optional[Levels]) -> None:
        """Check after a block (entered with ``entry`` readings or none); see the class."""
        if self.lock.locked():
            return  # another thread's block is being checked
        with self.lock:  # a with, unlike a try-acquire, that no Ctrl-C leaves held
            start = time.perf_counter()
            pairs = _devices()
            now = _levels(pairs, self.level)
            reference = {device: _lower(self.level.get(device), (entry or {}).get(device))
                         for device in now}
            held = [(backend, device) for backend, device in pairs
                    if _above(now[device], reference[device]) > backend.hold_tolerance]
            self.due = min((time.perf_counter() - start) / CHECK_SHARE, MAX_GAP)
            self.owed = 0.0
            if held and self.backoff.ready():
                now = self._collect(pairs, held, reference)
            self.level = {}
            for backend, device in pairs:  # memory still held is taken as in use from now on
                reading, was = now[device], reference[device]
                self.level[device] = reading if _above(reading, was) > backend.hold_tolerance \
                    else _lower(was, reading) or reading
            moved = [(b, d) for b, d in pairs if b.quick_kind(d) != self.level[d][0]]
            self.level.update(_levels(moved))  # the quick reading changed kind: a new level

    def _collect(self, pairs: Pairs, held: Pairs, reference: dict[str, Optional[Level]]
                 ) -> Levels:
        """Collect for the ``held`` devices; the readings afterwards."""
        def still(now: Levels) -> Pairs:
            return [(b, d) for b, d in held if _above(now[d], reference[d]) > b.hold_tolerance]

        def freed(start: Levels, now: Levels) -> bool:
            return any(_above(start[d], now[d]) > b.hold_tolerance for b, d in held)

        with interrupts_after():  # finalisers run: Ctrl-C in one is raised afterwards
            in_use = {device: ("in use", None) for _, device in held}
            now = collect_held(lambda: _levels(pairs, reference), lambda now: bool(still(now)),
                               freed, self.backoff, lambda: _levels(held, in_use))
            empty_caches(backend for backend, _ in held)
        log.debug("inference_mode collected garbage; memory was held on %s",
                  ", ".join(device for _, device in held))
        return now


_WATCH = _Watch()
os.register_at_fork(after_in_child=lambda: setattr(_WATCH, "lock", threading.Lock()))
cleanup_state.on_full_collection.append(_WATCH.stale)


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

    __slots__ = ("_active", "_entry", "_start", "_state", "cleanup", "models")

    def __init__(self, *models: Any, cleanup: Cleanup = "auto") -> None:
        position = first_non_module(models)
        if position is not None:
            raise TypeError(
                f"inference_mode: argument {position} is a {type(models[position]).__name__}, "
                f"not a torch.nn.Module; pass the models to switch to eval mode (Keras models "
                f"take training=False when called instead)")
        self.models = models
        self.cleanup: Cleanup = cleanup if cleanup == "auto" else cleanup_mode(
            cleanup, "inference_mode")
        self._state: Optional[InferenceState] = None
        self._entry: Optional[Levels] = None
        self._start = 0.0
        self._active = False

    def __enter__(self) -> "InferenceMode":
        if self._active:
            raise RuntimeError("this inference_mode is already active; use a new one per block")
        if self.cleanup == "auto":
            watch = _WATCH
            if watch.owed >= watch.due:
                self._entry = watch.entry()
            self._start = perf_counter()
        self._state = enter_inference(self.models)
        self._active = True
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._active = False
        state, self._state = self._state, None
        try:
            exit_inference(state)
        finally:
            if self.cleanup == "auto":
                watch = _WATCH
                watch.owed += perf_counter() - self._start
                if self._entry is not None or watch.owed >= watch.due:
                    self._check(exc_type)
            elif self.cleanup == "always":
                self._check(exc_type)

    def _check(self, exc_type: Any) -> None:
        """The cleanup after the block, raising only where the block did not."""
        try:
            if self.cleanup == "auto":
                entry, self._entry = self._entry, None
                _WATCH.check(entry)
            else:
                Settler("always").settle(resolve_devices(None), {})
        except Exception:
            if exc_type is None:
                raise

    def __repr__(self) -> str:
        models = ", ".join(type(model).__name__ for model in self.models) or "no model"
        state = ", active" if self._active else ""
        return f"<InferenceMode of {models}, cleanup={self.cleanup!r}{state}>"

    def __call__(self, func: F) -> F:
        return guard(func, lambda: InferenceMode(*self.models, cleanup=self.cleanup),
                     "inference_mode", kinds=("sync",))


@overload
def inference_mode(*models: torch.nn.Module, cleanup: Cleanup = "auto") -> InferenceMode: ...
@overload
def inference_mode(func: F, /) -> F: ...


def inference_mode(*models: Any, cleanup: Cleanup = "auto") -> Union[InferenceMode, F]:
    """Run inference with no autograd state and every given model in eval mode.

    With torch: enters ``torch.inference_mode()``, switches each ``torch.nn.Module`` to
    ``eval()``, and on exit (also on an exception) restores every submodule's own ``training``
    flag; then cleans up. A model whose every submodule is already in eval mode (put there once
    to serve) is not switched again: its ``train`` is not called, and on exit only a flag the
    block's own code turned on is set back (by the last block on that model to leave).

    ``cleanup="auto"`` (the default) watches what each device's allocator
    hands out, at a cost kept to about 0.1% of the time spent in blocks: a check (microseconds)
    runs at the exit of a block once the blocks since the previous check have run 1,000 times as
    long as that check took (``CHECK_SHARE``: so every block that long, every few shorter
    ones, and always within ``MAX_GAP`` seconds of blocks), and on the first block
    and the first after a full collection memguard ran (:func:`memguard.free_memory`, a scope's
    cleanup), against its own entry too. It compares with the lower of the level the previous
    check left and, where the check was due on entry, the block's entry; where a device is more
    than its tolerance above that (a reference cycle holding outputs, from this block or the
    unchecked ones before it), it collects the young generations, then in full if that did not
    free it, and empties that device's cache. What a collection could not free (outputs the
    caller keeps) is the level from then on, and collections that keep freeing nothing back off
    (skipping 1, 3, 7 ... 63 of them). A cache that merely grew (activations freed into it) is
    left to the next forward, which reuses it. On the host the reading is glibc's ``mallinfo2``,
    which walks every free block of the heap: where it takes more than 0.1 ms twice running (a
    fragmented heap of a long-running server) the resident set stands in for the next 10 s.
    ``"always"`` collects in full and empties every cache; ``"never"`` does neither.
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
    if len(models) == 1 and first_non_module(models) == 0 and callable(models[0]) \
            and not is_keras_model(models[0]):
        return InferenceMode(cleanup=cleanup)(models[0])
    return InferenceMode(*models, cleanup=cleanup)
