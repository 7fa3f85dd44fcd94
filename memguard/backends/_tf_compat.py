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


# -- tensor classes by their module paths, private ones too (checked with TensorFlow 2.21.0) -------
# TensorFlow's variable classes that never own memory themselves: abstract bases (the
# metaclass hands out ResourceVariables), graph-only variables, and wrappers over component
# variables that the census finds on their own (distributed, TPU, autocast). Leaving them out
# shortens the collector's pass, whose cost grows with the classes it looks for, and keeps a
# wrapper from counting its components' memory a second time.
NO_STORAGE = frozenset({
    "tensorflow.python.ops.variables.Variable",
    "tensorflow.python.ops.variable_v1.VariableV1",
    "tensorflow.python.ops.ref_variable.RefVariable",
    "tensorflow.python.distribute.values.DistributedVariable",
    "tensorflow.python.distribute.values.MirroredVariable",
    "tensorflow.python.distribute.values.SyncOnReadVariable",
    "tensorflow.python.distribute.tpu_values.TPUDistributedVariable",
    "tensorflow.python.distribute.tpu_values.TPULazyDistributedVariable",
    "tensorflow.python.distribute.tpu_values.TPUMirroredVariable",
    "tensorflow.python.distribute.tpu_values.TPUSyncOnReadVariable",
    "tensorflow.python.distribute.tpu_replicated_variable.TPUReplicatedVariable",
    "tensorflow.python.distribute.packed_distributed_variable.PackedDistributedVariable",
    "tensorflow.python.distribute.ps_values.AggregatingVariable",
    "tensorflow.python.distribute.ps_values.CachingVariable",
    "tensorflow.python.distribute.ps_values.PerWorkerVariable",
    "tensorflow.python.keras.mixed_precision.autocast_variable.AutoCastVariable",
    "tensorflow.python.tpu.tpu_embedding_v3.TPUEmbeddingShardedVariable",
})
