"""One way to turn a context-manager factory into a decorator, for every kind of function.

Built on ``wrapt``: the decorated function keeps its signature, name, docstring and
``__wrapped__``, and binds like the original on classes (methods, classmethods, staticmethods).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, ContextManager, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


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
    """Wrap ``func`` so that each call runs inside a fresh ``context()``.

    Coroutines run inside it from their first step to their end; generators from their first
    ``next()`` until they finish or are closed.
    """
    if not callable(func) and not hasattr(func, "__func__"):
        raise TypeError(f"{who} decorates functions, got {func!r}")
    kind = function_kind(func)
    if kind not in kinds:
        raise TypeError(f"{who} cannot decorate {kind} function {name_of(func)}; "
                        f"it supports {', '.join(k + ' functions' for k in kinds)}")
    import wrapt

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
    return wrapt.FunctionWrapper(func, wrapper)  # type: ignore[return-value]


def name_of(func: Any) -> str:
    """The qualified name of a function, classmethod or staticmethod."""
    target = getattr(func, "__func__", func)
    return getattr(target, "__qualname__", repr(target))



def with_statistics(func: Any, wrapper: Callable[..., Any],
                    attributes: dict[str, tuple[Callable[[], Any], str]],
                    reset: Callable[[], None]) -> Any:
    """``wrapt.FunctionWrapper(func, wrapper)`` whose instances, bound to an object or not,
    expose each of ``attributes`` (``name: (getter, doc)``) as a read-only property and
    ``reset()``, as tenacity's retrying functions expose their statistics."""
    import wrapt

    def reset_method(self: Any) -> None:
        reset()

    reset_method.__doc__ = reset.__doc__
    members: dict[str, Any] = {name: property(lambda self, get=get: get(), doc=doc)
                               for name, (get, doc) in attributes.items()}
    members["reset"] = reset_method
    bound = type("BoundWithStatistics", (wrapt.BoundFunctionWrapper,), dict(members))
    members["__bound_function_wrapper__"] = bound
    unbound = type("FunctionWithStatistics", (wrapt.FunctionWrapper,), members)
    return unbound(func, wrapper)
