"""Copies of training state (anything with ``state_dict`` / ``load_state_dict``; Keras through
:mod:`~memguard.backends.steps.keras_state`), taken before an attempt and loaded back before
a retry: in host memory, or with ``restore_to="file"`` (``"auto"``: state over half the
available host memory) in a temporary file written and read back one tensor at a time, so
no second copy is held. A module's gradients are kept too."""

from __future__ import annotations

import copy
import os
import sys
from typing import Any, BinaryIO, Optional

from ..._units import format_bytes
from ...errors import OutOfMemoryError, oom_kind
from .._torch_compat import STATE_DICT_METADATA
from ..base import is_keras_model
from . import keras_state

RESTORE_TO = ("auto", "memory", "file")


class Restorables(tuple):
    """The objects ``restore=`` names, and where their copy goes (``to``)."""

    to: str = "auto"


def check_restorable(objects: Any, to: str = "auto") -> Restorables:
    """``objects`` (one, or a tuple or list) as a :class:`Restorables`, each checked to have
    ``state_dict`` and ``load_state_dict`` or to be Keras; else a ``TypeError`` naming it.

    Args:
        objects: what ``oom_retry(restore=...)`` was given (``None``: nothing).
        to: ``oom_retry(restore_to=...)``: ``"memory"``, ``"file"`` or ``"auto"``.

    >>> check_restorable(()), check_restorable((), "file").to
    ((), 'file')
    """
    if to not in RESTORE_TO:
        raise ValueError(f"oom_retry: restore_to must be 'auto', 'memory' or 'file', got "
                         f"{to!r}")
    if objects is None:
        objects = ()
    items = tuple(objects) if isinstance(objects, (tuple, list)) else (objects,)
    for i, obj in enumerate(items):
        if keras_state.is_keras_state(obj) or is_keras_model(obj):
            continue
        for method in ("state_dict", "load_state_dict"):
            if not callable(getattr(obj, method, None)):
                raise TypeError(
                    f"oom_retry: restore[{i}] is a {type(obj).__name__} without a "
                    f"{method}() method; restore takes objects with state_dict() and "
                    f"load_state_dict(): modules, optimizers, LR schedulers, a GradScaler, "
                    f"or Keras models and optimizers")
    out = Restorables(items)
    out.to = to
    return out


def _is_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _is_module(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.nn.Module)


def _to_host(value: Any) -> Any:
    """A deep copy of a state structure with every tensor cloned to the CPU."""
    return _map(value, lambda t: t.detach().to("cpu", copy=True))


def _map(value: Any, tensor: Any) -> Any:
    """``value`` with each tensor replaced by ``tensor(t)``, everything else deep-copied."""
    if _is_tensor(value) or isinstance(value, _Stored):
        return tensor(value)
    if isinstance(value, dict):
        items = [(k, _map(v, tensor)) for k, v in value.items()]
        out = dict(items) if type(value) is dict else type(value)(items)
        metadata = getattr(value, STATE_DICT_METADATA, None)  # a module's state_dict versions
        if metadata is not None:
            setattr(out, STATE_DICT_METADATA, copy.deepcopy(metadata))
        return out
    if isinstance(value, list):
        return [_map(v, tensor) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_map(v, tensor) for v in value)
    return copy.deepcopy(value)


def _nbytes(value: Any) -> int:
    if _is_tensor(value):
        return int(value.numel() * value.element_size())
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


class _Stored:
    """A tensor whose bytes are in the state file at ``offset``."""

    __slots__ = ("dtype", "nbytes", "offset", "shape")

    def __init__(self, offset: int, shape: tuple[int, ...], dtype: Any, nbytes: int) -> None:
        self.offset, self.shape, self.dtype, self.nbytes = offset, shape, dtype, nbytes


def _bytes_of(t: Any) -> Any:
    """A CPU tensor's bytes as a writable buffer (no copy for a contiguous CPU tensor)."""
    import torch

    return t.reshape(-1).view(torch.uint8).numpy()


def _plain(t: Any) -> bool:
    """A dense tensor whose bytes can be read and written as they are."""
    import torch

    return (t.layout == torch.strided and not t.is_quantized and not t.is_conj()
            and not t.is_neg() and t.dtype != torch.complex32)


class _StateFile:
    """Tensors' bytes appended one at a time to a temporary file; read back in place."""

    def __init__(self) -> None:
        import tempfile

        handle, self.path = tempfile.mkstemp(prefix="memguard-state-", suffix=".bin")
        self.file: BinaryIO = os.fdopen(handle, "w+b")

    def put(self, t: Any) -> Any:
        """Write ``t``'s bytes; a :class:`_Stored` in its place (an odd tensor: a copy)."""
        t = t.detach()
        if not _plain(t):
            return t.to("cpu", copy=True)
        offset = self.file.tell()
        host = t.to("cpu").contiguous()  # one tensor at a time on the host, if any
        self.file.write(_bytes_of(host))
        return _Stored(offset, tuple(t.shape), t.dtype, host.numel() * host.element_size())

    def read_into(self, stored: _Stored, target: Any) -> None:
        """Fill ``target`` with the stored bytes (in place for a contiguous CPU tensor)."""
        import torch

        if target.device.type == "cpu" and target.is_contiguous() and _plain(target):
            with torch.no_grad():
                self._fill(stored, _bytes_of(target))
            return
        with torch.no_grad():
            target.copy_(self.read(stored))

    def read(self, stored: _Stored) -> Any:
        """A new CPU tensor with the stored bytes."""
        import torch

        out = torch.empty(stored.shape, dtype=stored.dtype)
        self._fill(stored, _bytes_of(out))
        return out

    def _fill(self, stored: _Stored, buffer: Any) -> None:
        self.file.seek(stored.offset)
        view = memoryview(buffer).cast("B")
        done = 0
        while done < stored.nbytes:
            got = self.file.readinto(view[done:])  # type: ignore[attr-defined]
            if not got:
                raise OSError(f"memguard: the state file {self.path} ends early")
            done += got

    def close(self) -> None:
        self.file.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass


class SavedState:
    """What :func:`copy_states` took; :meth:`load` puts it back, :meth:`discard` frees it."""

    def __init__(self, objects: tuple[Any, ...], states: Optional[list[Any]],
                 file: Optional[_StateFile], others: Optional[list[Any]] = None) -> None:
        self.objects = objects
        self._states = states
        self._file = file
        self._others = others or []  # Keras copies
        self.nbytes = 0

    @property
    def path(self) -> Optional[str]:
        """The file the state is kept in (``None``: host memory)."""
        if self._file is not None:
            return self._file.path
        return next((other.path for other in self._others
                     if getattr(other, "path", None)), None)

    def load(self) -> None:
        """Load every copy back (module tensors overwritten in place, a fresh copy for objects that
        keep what they are given); an out-of-memory raises :class:`~memguard.OutOfMemoryError`."""
        try:
            self._load()
            for other in self._others:
                other.load()
        except BaseException as exc:
            if oom_kind(exc) is None:
                raise
            names = ", ".join(type(o).__name__ for o in self.objects)
            where = f"the file {self.path}" if self.path else "host memory"
            way = ("restore less (the model alone)" if self.path else "pass "
                   "restore_to='file' (a module's tensors are then read straight into place)")
            raise OutOfMemoryError(
                f"oom_retry: restoring the state of {names} (saved before the first attempt, "
                f"{format_bytes(self.nbytes)} of tensors kept in {where}) ran out of memory: "
                f"loading it back needs up to that much again while the objects hold their "
                f"own; they are left partly restored. Free memory held outside the call, or "
                f"{way}") from exc

    def _load(self) -> None:
        states = self._states or []
        torch_objects = [o for o in self.objects if not _keras(o)]
        for obj, (state, grads) in zip(torch_objects, states, strict=True):
            if self._file is not None:
                self._load_from_file(obj, state, grads)
                continue
            # load_state_dict may keep the tensors it is given (an optimizer on the CPU does);
            # a module copies them into its own
            obj.load_state_dict(state if _is_module(obj) else _to_host(state))
            if grads is not None:
                for param, grad in zip(obj.parameters(), grads, strict=True):
                    param.grad = None if grad is None else grad.to(param.device, copy=True)

    def _load_from_file(self, obj: Any, state: Any, grads: Optional[list[Any]]) -> None:
        file = self._file
        assert file is not None
        live = obj.state_dict() if _is_module(obj) else None
        if live is not None and _same_layout(live, state):
            for key, stored in state.items():
                if isinstance(stored, _Stored):
                    file.read_into(stored, live[key])
                else:
                    live[key].copy_(stored)
        else:
            obj.load_state_dict(_map(state, lambda s: s if _is_tensor(s) else file.read(s)))
        if grads is not None:
            for param, stored in zip(obj.parameters(), grads, strict=True):
                if stored is None:
                    param.grad = None
                elif (param.grad is not None and isinstance(stored, _Stored)
                      and tuple(param.grad.shape) == stored.shape
                      and param.grad.dtype == stored.dtype):
                    file.read_into(stored, param.grad)
                else:
                    grad = stored if _is_tensor(stored) else file.read(stored)
                    param.grad = grad.to(param.device, copy=True)

    def discard(self) -> None:
        """Drop the copy (and its file)."""
        self._states = None
        for other in self._others:
            other.discard()
        self._others = []
        if self._file is not None:
            self._file.close()
            self._file = None


def _same_layout(live: dict[str, Any], state: dict[str, Any]) -> bool:
    """Whether ``state`` (of stored tensors) fits ``live`` key by key, shape by shape."""
    if set(live) != set(state):
        return False
    for key, stored in state.items():
        target = live[key]
        if not _is_tensor(target):
            return False
        shape = stored.shape if isinstance(stored, _Stored) else tuple(stored.shape)
        if tuple(target.shape) != tuple(shape) or target.dtype != stored.dtype:
            return False
    return True


def _keras(obj: Any) -> bool:
    return keras_state.is_keras_state(obj) or is_keras_model(obj)


def copy_states(objects: tuple[Any, ...], free_host: Optional[int] = None) -> SavedState:
    """Copy the state of each of ``objects`` (and a module's gradients) to host memory or a
    temporary file (a :class:`Restorables`' ``to``; ``free_host``: the available host bytes for
    ``"auto"``), for :meth:`SavedState.load` and :meth:`SavedState.discard`."""
    to = getattr(objects, "to", "auto")
    torch_objects = [o for o in objects if not _keras(o)]
    keras_objects = [o for o in objects if _keras(o)]
    live = [(obj.state_dict(), _live_grads(obj)) for obj in torch_objects]
    size = sum(_nbytes(s) + _nbytes(g or []) for s, g in live)
    size += sum(keras_state.nbytes(o) for o in keras_objects)
    in_file = to == "file" or (to == "auto" and free_host is not None
                               and size > free_host // 2 and size > 0)
    try:
        others = [keras_state.copy_state(o, in_file) for o in keras_objects]
        if in_file and live:
            file = _StateFile()
            try:
                states = [(_map(s, file.put), None if g is None else
                           [None if t is None else file.put(t) for t in g]) for s, g in live]
                file.file.flush()
            except BaseException:
                file.close()
                raise
            saved = SavedState(objects, states, file, others)
        else:
            saved = SavedState(objects, [(_to_host(s), _to_host(g)) for s, g in live], None,
                               others)
    except BaseException as exc:
        if oom_kind(exc) is None:
            raise
        raise _copy_failed(objects, size, in_file) from exc
    saved.nbytes = size
    return saved


def _copy_failed(objects: tuple[Any, ...], size: int, in_file: bool) -> OutOfMemoryError:
    """The error for a copy of the state that ran out of memory before the first attempt."""
    names = ", ".join(type(o).__name__ for o in objects)
    if in_file:
        hint = ("the tensors are written to a temporary file one at a time, so the memory "
                "ran out beside them: free memory held outside the call, or restore less "
                "(the model alone)")
    else:
        hint = ("pass restore_to='file' (the copy is written to a temporary file one tensor "
                "at a time and read straight back into place), or free memory held outside "
                "the call")
    return OutOfMemoryError(
        f"oom_retry: copying the state of {names} ({format_bytes(size)} of tensors) to "
        f"{'a file' if in_file else 'host memory'} before the first attempt ran out of "
        f"memory; no attempt ran. {hint[0].upper()}{hint[1:]}")


def _live_grads(obj: Any) -> Optional[list[Any]]:
    parameters = getattr(obj, "parameters", None)
    if not callable(parameters) or not callable(getattr(obj, "named_parameters", None)):
        return None
    return [p.grad for p in parameters()]
