"""``inference_mode``: no autograd state, models in eval mode, memory cleaned afterwards."""

from __future__ import annotations

from typing import Any, Callable, Optional, TypeVar

from ._decorate import guard
from .backends import is_keras_model, resolve_devices
from .backends.torch import InferenceState, enter_inference, exit_inference, is_module
from .cleanup import Cleanup, Pairs, Readings, cleanup_mode, read_all, settler_for

F = TypeVar("F", bound=Callable[..., Any])


class InferenceMode:
    """The object :func:`inference_mode` returns: a context manager and a decorator.

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
        self._entry: Readings = {}
        self._active = False

    def __enter__(self) -> "InferenceMode":
        if self._active:
            raise RuntimeError("this inference_mode is already active; use a new one per block")
        if self.cleanup != "never":
            self._pairs = resolve_devices(None)
            self._entry = read_all(self._pairs)
        self._state = enter_inference(self.models)
        self._active = True
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._active = False
        state, self._state = self._state, None
        try:
            exit_inference(state)
        finally:
            settler = settler_for(self.cleanup)
            if settler is not None:
                try:
                    settler.settle(self._pairs, self._entry)
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
    flag; then cleans up as ``memory_scope`` does (``cleanup="auto"``, the default,
    ``"always"`` or ``"never"``).
    Without torch (a TensorFlow program) it only cleans up. Usable as ``with``, as
    ``@inference_mode`` and as ``@inference_mode(model)``; as a decorator it takes plain
    functions and methods (torch's inference mode belongs to a thread, so it cannot follow a
    coroutine or a generator between steps).

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
