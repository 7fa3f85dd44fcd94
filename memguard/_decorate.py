"""One way to turn a context-manager factory into a decorator for every kind of function,
built on ``wrapt``: the result keeps the signature, name, docstring and ``__wrapped__``,
binds like the original, and pickles by reference like a plain function."""

from __future__ import annotations

import functools
import inspect
import types
from typing import Any, Callable, ContextManager, Optional, SupportsIndex, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


@functools.lru_cache(maxsize=None)
def _wrapper_classes() -> tuple[type, type]:
    """``wrapt``'s function wrappers, made to pickle and copy as functions do, and their bound
    form (``wrapt`` imported on first use)."""
    import wrapt

    def copy(self: Any, memo: Any = None) -> Any:
        return self  # functions are immutable for copy purposes

    class Bound(wrapt.BoundFunctionWrapper):
        def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
            # as a bound method pickles: getattr(obj, name)
            owner = self._self_owner if self._self_instance is None else self._self_instance
            return getattr, (owner, self.__name__)

        __copy__ = __deepcopy__ = copy

    class Wrapper(wrapt.FunctionWrapper):
        __bound_function_wrapper__ = Bound

        def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
            # as a function pickles: by its global name, which pickle looks up
            return self.__qualname__

        __copy__ = __deepcopy__ = copy

    return Wrapper, Bound


def _wrap(func: Any, wrapper: Callable[..., Any], name: str,
          members: Optional[dict[str, Any]] = None) -> Any:
    """``func`` wrapped in a wrapper class of its own (``name``) holding ``members``; a plain
    function is called straight through (wrapt's ``__self__`` lookup raises at every call)."""
    members = dict(members or {})
    if isinstance(func, types.FunctionType):
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            return wrapper(func, None, args, kwargs)

        members["__call__"] = call
    return type(name, (_wrapper_classes()[0],), members)(func, wrapper)


def function_kind(func: Any) -> str:
    """``"sync"``, ``"async"``, ``"generator"`` or ``"async generator"``."""
    target = getattr(func, "__func__", func)  # classmethod / staticmethod objects
    if inspect.isasyncgenfunction(target):
        return "async generator"
    if inspect.iscoroutinefunction(target):
        return "async"
    if inspect.isgeneratorfunction(target):
        return "generator"
    return "sync"


def guard(func: F, context: Callable[[], ContextManager[Any]], who: str,
          kinds: tuple[str, ...] = ("sync", "async", "generator")) -> F:
    """Wrap ``func`` so that each call (a coroutine's whole run, a generator's from its first
    ``next()`` to its end) runs inside a fresh ``context()``.

    >>> import contextlib
    >>> def double(x):
    ...     return 2 * x
    >>> guarded = guard(double, contextlib.nullcontext, "example")
    >>> guarded(21), guarded.__name__
    (42, 'double')
    """
    if not callable(func) and not hasattr(func, "__func__"):
        raise TypeError(f"{who} decorates functions, got {func!r}")
    kind = function_kind(func)
    if kind not in kinds:
        raise TypeError(f"{who} cannot decorate {kind} function {name_of(func)}; "
                        f"it supports {', '.join(k + ' functions' for k in kinds)}")

    wrapper: Callable[..., Any]
    if kind == "async":
        async def wrapper(wrapped, instance, args, kwargs):  # type: ignore[no-untyped-def]
            with context():
                return await wrapped(*args, **kwargs)
    elif kind == "generator":
        def wrapper(wrapped, instance, args, kwargs):  # type: ignore[no-untyped-def]
            def run():  # type: ignore[no-untyped-def]
                with context():
                    return (yield from wrapped(*args, **kwargs))
            return run()
    else:
        def wrapper(wrapped, instance, args, kwargs):  # type: ignore[no-untyped-def]
            with context():
                return wrapped(*args, **kwargs)
    return _wrap(func, wrapper, "Guarded")


def name_of(func: Any) -> str:
    """The qualified name of a function, classmethod or staticmethod."""
    target = getattr(func, "__func__", func)
    return getattr(target, "__qualname__", repr(target))


def _statistic(get: Callable[[], Any], doc: str) -> property:
    """A read-only attribute of a decorated function (``history``, ``batch_size``...)."""
    return property(lambda self: get(), doc=doc)


def with_statistics(func: Any, wrapper: Callable[..., Any],
                    attributes: dict[str, tuple[Callable[[], Any], str]],
                    reset: Callable[[], None]) -> Any:
    """``wrapt.FunctionWrapper(func, wrapper)`` exposing each of ``attributes``
    (``name: (getter, doc)``) as a read-only property, and ``reset()``, bound or not.

    >>> calls = []
    >>> def count(wrapped, instance, args, kwargs):
    ...     calls.append(1)
    ...     return wrapped(*args, **kwargs)
    >>> f = with_statistics(abs, count, {"calls": (lambda: len(calls), "Calls.")}, calls.clear)
    >>> f(-3), f.calls
    (3, 1)
    """
    bound_base = _wrapper_classes()[1]

    def reset_method(self: Any, *args: Any, **kwargs: Any) -> None:
        reset(*args, **kwargs)

    reset_method.__doc__ = reset.__doc__
    members: dict[str, Any] = {name: _statistic(get, doc)
                               for name, (get, doc) in attributes.items()}
    members["reset"] = reset_method
    bound = type("BoundWithStatistics", (bound_base,), dict(members))
    members["__bound_function_wrapper__"] = bound
    return _wrap(func, wrapper, "FunctionWithStatistics", members)
