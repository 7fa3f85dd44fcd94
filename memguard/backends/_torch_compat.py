"""Every private torch API memguard uses, each with the torch version it was checked against.
Nothing here imports torch; the readers are C-built (``attrgetter``, ``methodcaller``), so
a per-step call adds no Python frame."""

from __future__ import annotations

import functools
import sys
from operator import attrgetter, methodcaller
from typing import Any, Callable, Optional

CHECKED_WITH = "2.13.0"
"""The torch version every entry below was checked against."""


# -- torch.inference_mode (checked with torch 2.13.0) -------------------------------------------
def inference_guard(torch: Any) -> Optional[type]:
    """``torch._C._InferenceMode`` (what ``torch.inference_mode()`` enters), or ``None``."""
    return getattr(torch._C, "_InferenceMode", None)  # noqa: SLF001 - what torch.inference_mode enters


# -- torch.distributed's default group (checked with torch 2.13.0) ------------------------------
def default_group_reader(dist: Any) -> Optional[Callable[[], Any]]:
    """A one-C-call reader of ``distributed_c10d._world._default_pg`` (the default group or
    ``None``); ``None`` where that record is not as expected (ask ``is_initialized()``)."""
    record = getattr(sys.modules.get("torch.distributed.distributed_c10d"), "_world", None)
    if record is not None and "_default_pg" in getattr(record, "__dict__", ()) \
            and (record._default_pg is not None) == dist.is_initialized():  # noqa: SLF001 - read, as is_initialized() does
        return functools.partial(attrgetter("_default_pg"), record)
    return None


# -- autograd (checked with torch 2.13.0) -------------------------------------------------------
def accumulate_grad_type(torch: Any) -> type:
    """The Python type of autograd's ``AccumulateGrad`` nodes (the graph's leaves)."""
    return torch._C._functions.AccumulateGrad  # noqa: SLF001 - no public name


SAVED_PREFIX = "_saved_"
"""A backward node's attributes that unpack its saved tensors begin with this (every torch 2.x
build generates them)."""

version_of: Callable[[Any], int] = attrgetter("_version")
"""A tensor's autograd version counter (bumped by every in-place write)."""

post_accumulate_grad_hooks: Callable[[Any], Any] = attrgetter("_post_accumulate_grad_hooks")
"""The hooks ``register_post_accumulate_grad_hook`` put on a parameter (``None`` or a dict)."""


# -- tensors (checked with torch 2.13.0) --------------------------------------------------------
is_view: Callable[[Any], bool] = methodcaller("_is_view")
"""Whether a tensor views another's storage (no public equivalent)."""

sparse_values: Callable[[Any], Any] = methodcaller("_values")
"""A sparse COO tensor's values, uncoalesced too, without a copy."""

sparse_indices: Callable[[Any], Any] = methodcaller("_indices")
"""A sparse COO tensor's indices, uncoalesced too, without a copy."""


# -- torch.nn.Module's own tables (checked with torch 2.13.0) -----------------------------------
children: Callable[[Any], Any] = attrgetter("_modules")
"""A module's children by name, as ``modules()`` reads them."""

parameters_of: Callable[[Any], Any] = attrgetter("_parameters")
"""A module's own parameters by name."""

buffers_of: Callable[[Any], Any] = attrgetter("_buffers")
"""A module's own buffers by name (written to put one back with its owner)."""

non_persistent_buffers: Callable[[Any], Any] = attrgetter("_non_persistent_buffers_set")
"""The names of a module's buffers that ``state_dict`` skips."""


# -- DistributedDataParallel and GradScaler (checked with torch 2.13.0) -------------------------
# Attributes a torch build or a model may lack: named here, read with getattr(obj, NAME, default).
DDP_ACCUMULATE_HOOKS = "_accum_grad_hooks"
"""DDP's own post-accumulate hooks' handles (compiled autograd's reduction)."""

DDP_COMM_HOOKS = "_comm_hooks"
"""``(hook, state)`` of the hooks registered with ``register_comm_hook``."""

DDP_LOGGING_DATA = "_get_ddp_logging_data"
"""DDP's logger's record, which names a built-in C++ comm hook."""

SCALER_OPTIMIZER_STATES = "_per_optimizer_states"
"""What a ``GradScaler`` recorded for each optimizer since its last ``update()``."""


# -- FSDP2, fully_shard (checked with torch 2.13.0) ---------------------------------------------
fsdp_state: Callable[[Any], Any] = methodcaller("_get_fsdp_state")
"""An FSDP2 module's state (one per ``fully_shard`` call)."""

fsdp_param_groups: Callable[[Any], Any] = attrgetter("_fsdp_param_groups")
"""The parameter groups of an FSDP2 state (their ``reduce_grads`` flags, ``fsdp_params``)."""

fsdp_is_root: Callable[[Any], bool] = attrgetter("_is_root")
"""Whether an FSDP2 state is a root (set by its lazy init)."""

fsdp_final_callback: Callable[[Any], None] = methodcaller("_root_post_backward_final_callback")
"""Run a root FSDP2 state's end-of-backward callback: each group's post-backward, which
reduce-scatters what the group accumulated."""

fsdp_reset_iter_state: Callable[[Any], None] = methodcaller("_reset_iter_state")
"""What ``FSDPModule.reset_iter_state`` calls: parameters resharded, trackers cleared."""


UNSHARDED_PARAM = "_unsharded_param"
"""An ``FSDPParam``'s unsharded parameter (absent before it was first unsharded)."""


# -- CUDA memory history (checked with torch 2.13.0; documented, underscored) -------------------
def record_memory_history(torch: Any) -> Callable[..., None]:
    """``torch.cuda.memory._record_memory_history``."""
    return torch.cuda.memory._record_memory_history  # noqa: SLF001 - torch's documented memory-history API


def dump_snapshot(torch: Any) -> Callable[[str], None]:
    """``torch.cuda.memory._dump_snapshot``."""
    return torch.cuda.memory._dump_snapshot  # noqa: SLF001 - torch's documented memory-history API


# -- state_dict (checked with torch 2.13.0) -----------------------------------------------------
STATE_DICT_METADATA = "_metadata"
"""Where a module's ``state_dict`` keeps its version metadata (``load_state_dict`` reads it)."""


# -- tensor classes by their module paths, private ones too (checked with torch 2.13.0) ------------
# torch's own tensor classes that never have an instance owning storage: wrappers whose data
# lives in plain tensors (which the census finds on their own), fake and lazy placeholders,
# and Buffer (its constructor returns a plain tensor). Leaving them out changes no census
# result and shortens the collector's pass, whose cost grows with the classes it looks for.
NO_STORAGE = frozenset({
    "torch.nn.parameter.Buffer",
    "torch._subclasses.fake_tensor.FakeTensor",
    "torch._subclasses.functional_tensor.FunctionalTensor",
    "torch.nn.parameter.UninitializedParameter",
    "torch.nn.parameter.UninitializedBuffer",
    "torch.masked.maskedtensor.core.MaskedTensor",
    "torch.nested._internal.nested_tensor.NestedTensor",
    "torch.sparse.semi_structured.SparseSemiStructuredTensor",
    "torch.sparse.semi_structured.SparseSemiStructuredTensorCUTLASS",
    "torch.sparse.semi_structured.SparseSemiStructuredTensorCUSPARSELT",
    "torch.testing._internal.logging_tensor.LoggingTensor",
    "torch.testing._internal.logging_tensor.LoggingTensorReentrant",
    "torch.distributed.tensor.DTensor",
    "torch.distributed.tensor._api.DTensor",
    "torch.distributed._functional_collectives.AsyncCollectiveTensor",
})
