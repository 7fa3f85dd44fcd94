"""Copies of Keras state for ``oom_retry(restore=...)``: a model's weights and its optimizer's
variables, or an optimizer's alone, copied to numpy arrays or a temporary file and assigned
back before a retry. Classes are told by name; no framework is imported."""

from __future__ import annotations

import os
from typing import Any, Optional

from ..base import _KERAS_MODULES, is_keras_model


def is_keras_state(obj: Any) -> bool:
    """Whether ``obj`` is a Keras optimizer (a model is :func:`is_keras_model`).

    >>> is_keras_state(object())
    False
    """
    for cls in type(obj).__mro__:
        module = getattr(cls, "__module__", None) or ""
        if cls.__name__ in ("Optimizer", "BaseOptimizer") and (
                module.split(".")[0] in _KERAS_MODULES):
            return True
    return False


def _variables(obj: Any) -> list[Any]:
    """A model's weights and its compiled optimizer's variables (the optimizer built first)."""
    if is_keras_model(obj):
        weights = list(obj.weights)
        if not weights:
            raise TypeError(f"oom_retry: restore got the Keras model {obj.name!r} before it has "
                            f"weights; build it (call it once on a batch, or model.build("
                            f"input_shape)) before the decorated call")
        optimizer = getattr(obj, "optimizer", None)
        if optimizer is not None and is_keras_state(optimizer):
            return weights + _optimizer_variables(optimizer, obj.trainable_variables)
        return weights
    return _optimizer_variables(obj, None)


def _optimizer_variables(optimizer: Any, trainable: Optional[list[Any]]) -> list[Any]:
    if not getattr(optimizer, "built", True) and trainable:
        optimizer.build(trainable)  # what the first training step does: now, to be saved
    return list(optimizer.variables)


def nbytes(obj: Any) -> int:
    """The bytes :func:`copy_state` would copy of ``obj`` (4 an element for unknown dtypes)."""
    import math

    import numpy as np

    total = 0
    for v in _variables(obj):
        try:
            size = np.dtype(str(v.dtype)).itemsize
        except TypeError:
            size = 4
        total += math.prod(int(d) for d in v.shape) * size
    return total


class KerasCopy:
    """The values of one Keras object's variables, in memory or in a file."""

    def __init__(self, obj: Any, in_file: bool) -> None:
        import numpy as np

        self.obj = obj
        self.variables = _variables(obj)
        self.values: Optional[list[Any]] = None
        self.path: Optional[str] = None
        self.nbytes = 0
        if in_file:
            import tempfile

            handle, self.path = tempfile.mkstemp(prefix="memguard-keras-", suffix=".npy")
            with os.fdopen(handle, "wb") as f:
                for v in self.variables:
                    value = np.asarray(v.numpy())
                    self.nbytes += value.nbytes
                    np.save(f, value, allow_pickle=False)
        else:
            self.values = [np.array(v.numpy(), copy=True) for v in self.variables]
            self.nbytes = sum(value.nbytes for value in self.values)

    def load(self) -> None:
        """Assign every saved value back to its variable."""
        import numpy as np

        now = _variables(self.obj)
        if len(now) != len(self.variables) or any(
                a is not b for a, b in zip(now, self.variables, strict=True)):
            raise RuntimeError(f"oom_retry: the variables of {type(self.obj).__name__} changed "
                               f"during the attempt ({len(self.variables)} saved, {len(now)} "
                               f"now); build the model and its optimizer before the call")
        if self.path is not None:
            with open(self.path, "rb") as f:
                for v in self.variables:
                    v.assign(np.load(f, allow_pickle=False))
            return
        for v, value in zip(self.variables, self.values or [], strict=True):
            v.assign(value)

    def discard(self) -> None:
        """Drop the copy (and its file)."""
        self.values = None
        if self.path is not None:
            try:
                os.unlink(self.path)
            except OSError:
                pass
            self.path = None


def copy_state(obj: Any, in_file: bool) -> KerasCopy:
    """Copy the variables of the Keras model (weights and compiled optimizer's variables) or
    optimizer ``obj``, to a temporary file with ``in_file``; ``load()`` assigns the copy back,
    ``discard()`` frees it."""
    return KerasCopy(obj, in_file)
