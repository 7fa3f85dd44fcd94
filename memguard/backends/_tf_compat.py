"""Every private TensorFlow API memguard uses, in one place, each with the version it was
checked against: where a TensorFlow release moves one, this is the module to change.

Nothing here imports TensorFlow: its callers pass what they hold.
"""

from __future__ import annotations

from typing import Any

CHECKED_WITH = "2.21.0"
"""The TensorFlow version (``tensorflow-cpu``, Keras 3.15.1) every entry below was checked
against."""


# -- the eager runtime (checked with TensorFlow 2.21.0) -----------------------------------------
def runtime_initialized(context: Any) -> bool:
    """Whether TensorFlow's eager context has started its runtime (no public way to ask that
    does not start it): ``context`` is ``tensorflow.python.eager.context``. An
    ``AttributeError`` where a version lacks the flag."""
    return bool(context.context()._initialized)  # noqa: SLF001 - no public way to ask


# -- variables (checked with TensorFlow 2.21.0) -------------------------------------------------
VARIABLE_HANDLE = "_handle"
"""A resource variable's handle: variables that share one (the ``_UnreadVariable`` an
``assign`` returns) share its memory. Read with ``getattr(variable, VARIABLE_HANDLE, None)``."""
