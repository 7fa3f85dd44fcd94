"""Frameworks imported by the tests that use them, never at collection.

Importing TensorFlow, transformers or Lightning takes seconds and leaves hundreds of thousands
of objects that every later full collection of the run walks (memguard collects often): a
module that imports one at its top makes every test of the run slower, whether or not it is
selected. A test module says instead::

    from frameworks import lazy, requires

    transformers = lazy("transformers")  # imported on first attribute access
    MemguardCallback = deferred("memguard.integrations.transformers", "MemguardCallback")
    pytestmark = requires("transformers", "accelerate")  # skip where either is missing

and defines what subclasses a framework class inside the test or fixture that needs it.
"""

from __future__ import annotations

import importlib
import importlib.util
import types
from typing import Any

import pytest


def installed(name: str) -> bool:
    """Whether ``name`` can be imported, found without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package missing
        return False


def requires(*names: str) -> pytest.MarkDecorator:
    """A mark that skips where any of ``names`` is not installed (nothing is imported)."""
    missing = [name for name in names if not installed(name)]
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)}")


class lazy(types.ModuleType):
    """A module imported on first attribute access (through ``pytest.importorskip``, so a
    test that reaches a missing framework skips)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.__dict__["_module"] = None

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("_"):  # pytest's collection looks at every module global
            raise AttributeError(attribute)
        module = self.__dict__["_module"]
        if module is None:
            module = self.__dict__["_module"] = pytest.importorskip(self.__name__)
        return getattr(module, attribute)


def deferred(module: str, name: str) -> Any:
    """A stand-in for ``from module import name`` of a callable (a class to instantiate, a
    function): ``module`` is imported at the first call."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    return call
