"""Copies of training state (modules, optimizers, schedulers, a ``GradScaler``: anything with
``state_dict`` / ``load_state_dict``), taken before an attempt and loaded back before a retry.

The copy lives in host memory (each tensor cloned to the CPU), or in a file when the state is
larger than half the host's available memory. A module's parameter gradients are kept too, so
a retry starts with the gradients the first attempt started with. torch is imported only when
a state holds a tensor.
"""

from __future__ import annotations

import copy
import os
import sys
from typing import Any, Optional


def check_restorable(objects: Any) -> tuple[Any, ...]:
    """``objects`` (one object, or a tuple or list of them) as a tuple, each checked to have
    callable ``state_dict`` and ``load_state_dict``; else a ``TypeError`` naming the object.

    >>> check_restorable(())
    ()
    """
    if objects is None:
        return ()
    items = tuple(objects) if isinstance(objects, (tuple, list)) else (objects,)
    for i, obj in enumerate(items):
        for method in ("state_dict", "load_state_dict"):
            if not callable(getattr(obj, method, None)):
                raise TypeError(
                    f"oom_retry: restore[{i}] is a {type(obj).__name__} without a "
                    f"{method}() method; restore takes objects with state_dict() and "
                    f"load_state_dict(): modules, optimizers, LR schedulers, a GradScaler")
    return items


def _is_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _to_host(value: Any) -> Any:
    """A deep copy of a state structure with every tensor cloned to the CPU."""
    if _is_tensor(value):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        items = [(k, _to_host(v)) for k, v in value.items()]
        out = dict(items) if type(value) is dict else type(value)(items)
        metadata = getattr(value, "_metadata", None)  # a module's state_dict versions
        if metadata is not None:
            out._metadata = copy.deepcopy(metadata)  # type: ignore[attr-defined]  # noqa: SLF001 - a state_dict's version metadata
        return out
    if isinstance(value, list):
        return [_to_host(v) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_to_host(v) for v in value)
    return copy.deepcopy(value)


def _nbytes(value: Any) -> int:
    if _is_tensor(value):
        return int(value.numel() * value.element_size())
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


class SavedState:
    """What :func:`copy_states` took; :meth:`load` puts it back, :meth:`discard` frees it."""

    def __init__(self, objects: tuple[Any, ...], states: Optional[list[Any]],
                 path: Optional[str]) -> None:
        self.objects = objects
        self._states = states
        self.path = path

    def _read(self) -> list[Any]:
        if self._states is not None:
            return self._states
        import torch

        assert self.path is not None  # states are either held or written to a file
        return torch.load(self.path, map_location="cpu", weights_only=False)

    def load(self) -> None:
        """Load every copied state back into its object (a fresh copy each time, so an
        optimizer never shares tensors with the saved state)."""
        states = self._read()
        for obj, (state, grads) in zip(self.objects, states, strict=True):
            # load_state_dict may keep the tensors it is given (an optimizer on the CPU does)
            obj.load_state_dict(_to_host(state) if self.path is None else state)
            if grads is not None:
                for param, grad in zip(obj.parameters(), grads, strict=True):
                    param.grad = None if grad is None else grad.to(param.device, copy=True)

    def discard(self) -> None:
        """Drop the copy (and its file)."""
        self._states = None
        if self.path is not None:
            try:
                os.unlink(self.path)
            except OSError:
                pass
            self.path = None


def copy_states(objects: tuple[Any, ...], free_host: Optional[int] = None) -> SavedState:
    """Copy the state of each of ``objects`` (and a module's gradients) to host memory, or
    straight to a temporary file when it holds more than half of ``free_host`` bytes of
    tensors."""
    live = [(obj.state_dict(), _live_grads(obj)) for obj in objects]
    size = sum(_nbytes(s) + _nbytes(g or []) for s, g in live)
    if free_host is not None and size > free_host // 2 and size > 0:
        import tempfile

        import torch

        handle, path = tempfile.mkstemp(prefix="memguard-state-", suffix=".pt")
        os.close(handle)
        try:
            torch.save(live, path)  # written storage by storage, never all on the host at once
        except BaseException:
            os.unlink(path)
            raise
        return SavedState(objects, None, path)
    return SavedState(objects, [(_to_host(s), _to_host(g)) for s, g in live], None)


def _live_grads(obj: Any) -> Optional[list[Any]]:
    parameters = getattr(obj, "parameters", None)
    if not callable(parameters) or not callable(getattr(obj, "named_parameters", None)):
        return None
    return [p.grad for p in parameters()]
