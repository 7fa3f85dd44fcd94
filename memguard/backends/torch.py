"""PyTorch devices: CUDA (and ROCm, exposed as ``cuda``), MPS and XPU; CPU tensors belong to
the host backend. ``torch.accelerator``'s memory API (torch 2.9+) is preferred where it
serves the device. CUDA and XPU are read only once the process initialised them itself."""

from __future__ import annotations

import operator
import os
import sys
import weakref
from threading import get_ident
from typing import Any, Iterable, Optional

from .._locks import ForkSafeLock
from . import _torch_compat as compat
from ._torch_compat import children, is_view
from .base import UNKNOWN, Backend, DeviceMemory, Reading, TensorRow, subclasses


def _torch() -> Any:
    torch = sys.modules.get("torch")  # imported: no import statement's work at every read
    if torch is None:
        import torch
    return torch


def _split(device: str) -> tuple[str, int]:
    kind, _, index = device.partition(":")
    return kind, int(index) if index else 0


_MPS: list[Optional[bool]] = [None]  # whether torch's MPS is available, once asked


class TorchBackend(Backend):
    """Memory of torch's accelerators that this process has initialised (MPS once available)."""

    name = "torch"  # the tolerances are Backend's: 1 MiB held, 64 MiB of cache
    _known: Optional[tuple[int, tuple[str, ...]]] = None  # (pid, devices) once any is there

    # -- which devices ---------------------------------------------------------------------
    def _initialised_types(self, torch: Any = None) -> list[str]:
        torch = torch or _torch()
        kinds = []
        # is_initialized() only where the module's own flag, which torch sets once and never
        # clears, does not already say no: a call saved on each guard's call without a GPU
        if getattr(torch.cuda, "_initialized", True) and torch.cuda.is_initialized():
            kinds.append("cuda")  # pragma: gpu
        xpu = getattr(torch, "xpu", None)
        if xpu is not None and getattr(xpu, "_initialized", True) \
                and getattr(xpu, "is_initialized", lambda: False)():  # pragma: gpu
            kinds.append("xpu")
        if _MPS[0] is None:  # a machine's MPS is there or not for the whole run
            mps = getattr(getattr(torch, "backends", None), "mps", None)
            _MPS[0] = mps is not None and bool(mps.is_available())
        if _MPS[0]:  # pragma: gpu
            kinds.append("mps")
        return kinds

    def devices(self) -> list[str]:
        known = self._known
        if known is not None and known[0] == os.getpid():  # pragma: gpu
            return list(known[1])
        torch = sys.modules.get("torch") or _torch()  # imported: every guard's every call
        names = []
        for kind in self._initialised_types(torch):  # pragma: gpu
            if kind == "mps":
                names.append("mps")
            else:
                names.extend(f"{kind}:{i}" for i in range(getattr(torch, kind).device_count()))
        if names:  # an accelerator once initialised stays so, with its devices, in a process
            self._known = (os.getpid(), tuple(names))  # pragma: gpu
        return names

    def owns(self, device: str) -> bool:
        return device.partition(":")[0] in ("cuda", "xpu", "mps")

    def normalise(self, device: str) -> str:
        """``"cuda"`` -> ``"cuda:N"`` with N the current device once CUDA is initialised."""
        kind, _, index = device.partition(":")
        if kind == "mps" or index:
            return device
        module = getattr(_torch(), kind, None)
        if module is not None and getattr(module, "is_initialized", lambda: False)():
            return f"{kind}:{module.current_device()}"  # pragma: gpu
        return f"{kind}:0"

    def _accelerator(self, kind: str) -> Any:  # pragma: gpu
        """``torch.accelerator`` when it has the memory API and serves ``kind``."""
        acc = getattr(_torch(), "accelerator", None)
        if acc is None or not hasattr(acc, "memory_allocated"):
            return None
        try:
            current = acc.current_accelerator()
        except Exception:  # noqa: BLE001 - a build without the accelerator raises
            return None
        return acc if current is not None and current.type == kind else None

    def _ready(self, kind: str) -> bool:
        return kind in self._initialised_types()

    # -- reading -----------------------------------------------------------------------------
    def read_fast(self, device: str) -> Reading:  # pragma: gpu
        kind, index = _split(device)
        if not self._ready(kind):
            return UNKNOWN
        torch = _torch()
        if kind == "mps":
            return Reading(int(torch.mps.current_allocated_memory()),
                           int(torch.mps.driver_allocated_memory()))
        api = self._accelerator(kind) or getattr(torch, kind)
        return Reading(int(api.memory_allocated(index)), int(api.memory_reserved(index)))

    def read_peak(self, device: str) -> Optional[int]:  # pragma: gpu
        kind, index = _split(device)
        if kind == "mps" or not self._ready(kind):
            return None
        api = self._accelerator(kind) or getattr(_torch(), kind)
        return int(api.max_memory_allocated(index))

    def _free_total(self, kind: str, index: int) -> tuple[Optional[int], Optional[int]]:
        torch = _torch()  # pragma: gpu
        try:  # pragma: gpu
            acc = self._accelerator(kind)
            if acc is not None and hasattr(acc, "get_memory_info"):
                free, total = acc.get_memory_info(index)
            elif kind == "mps":
                total = getattr(torch.mps, "recommended_max_memory", lambda: None)()
                return None, (None if total is None else int(total))
            else:
                free, total = getattr(torch, kind).mem_get_info(index)
            return int(free), int(total)
        except (RuntimeError, AttributeError):  # pragma: gpu
            return None, None

    def read(self, device: str) -> DeviceMemory:  # pragma: gpu
        kind, index = _split(device)
        if not self._ready(kind):
            return DeviceMemory(device)
        allocated, reserved = self.read_fast(device)
        free, total = self._free_total(kind, index)
        return DeviceMemory(device, allocated=allocated, reserved=reserved,
                            peak=self.read_peak(device), free=free, total=total)

    def reset_peak(self, device: str) -> bool:  # pragma: gpu
        kind, index = _split(device)
        if kind == "mps" or not self._ready(kind):
            return False
        api = self._accelerator(kind) or getattr(_torch(), kind)
        api.reset_peak_memory_stats(index)
        return True

    def empty_cache(self) -> None:
        torch = _torch()
        for kind in self._initialised_types():  # pragma: gpu
            getattr(torch, kind).empty_cache()
            if kind == "cuda":
                torch.cuda.ipc_collect()


# -- inference --------------------------------------------------------------------------------
def is_module(obj: object) -> bool:
    """Whether ``obj`` is a ``torch.nn.Module`` (False when torch was never imported)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.nn.Module)


InferenceState = tuple[Any, list[Any]]
"""What :func:`enter_inference` changed, for :func:`exit_inference` to put back: the
inference-mode guard entered, and the block's token, a list whose ``id`` keys the block (its
thread and the modules of its tree) in :data:`_QUIET` or :data:`_BLOCKS`."""

_INSIDE: dict[int, list[Any]] = {}
"""Per module of a registered inference block inside now (by ``id``: each is kept alive by
the blocks' states): ``[blocks inside, training flag before the first]``. Blocks on one model
overlap (two threads serving one model): the first to enter saves the flag, the last to leave
puts it back, so no block runs with the flag another restored and the model ends as it was
before the first."""
_BLOCKS: dict[int, tuple[int, list[Any]]] = {}
"""The registered blocks inside now, by ``id`` of their token: ``(thread, modules)``; a child
made by ``os.fork()`` ends those of the threads it does not have (:func:`_after_fork`)."""
_QUIET: dict[int, tuple[int, list[Any]]] = {}
"""The quiet blocks inside now, by ``id`` of their token: ``(thread, modules)``. A block is
quiet when it enters with every module of its tree already in eval mode and no block
registered in :data:`_INSIDE` (a model put in eval once, then served): it switches nothing
and registers nothing per module (on a 164-module GPT-2, the switch through the model's own
``train`` and the flags' walk back through ``__setattr__`` cost more than 0.5 ms a block).
A block that must register turns every quiet block into a registered one first, with the
flag they all entered with: ``False``."""
_INSIDE_LOCK = ForkSafeLock(reentrant=True)  # reentrant: a module's own eval() may enter one

_CLASSES: list[Any] = []
"""``torch.nn.Module``, ``Module.train``, ``Module.__setattr__`` and the inference-mode guard
class, looked up once (this runs around every forward pass, where every lookup counts)."""


def _classes() -> list[Any]:
    if not _CLASSES:
        torch = _torch()
        module = torch.nn.Module
        # torch.inference_mode()'s own C++ guard where torch has it, else the public one
        guard = compat.inference_guard(torch)
        _CLASSES[:] = [module, module.train, module.__setattr__,
                       torch.inference_mode if guard is None else guard]
    return _CLASSES


def first_non_module(objects: tuple[Any, ...]) -> Optional[int]:
    """Position of the first of ``objects`` not a ``torch.nn.Module``; ``None`` if all are."""
    if not objects:
        return None
    if not _CLASSES and "torch" not in sys.modules:
        return 0
    module = (_CLASSES or _classes())[0]
    for position, obj in enumerate(objects):
        if not isinstance(obj, module):
            return position
    return None


_write = object.__setattr__
_flag = operator.attrgetter("training")


def module_tree(models: Iterable[Any]) -> list[Any]:
    """The models and their submodules, each once, breadth first (no dotted names built)."""
    out: list[Any] = []
    seen: set[int] = set()
    for model in models:
        if id(model) not in seen:
            seen.add(id(model))
            out.append(model)
    for module in out:  # grows while it is walked
        for child in children(module).values():
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                out.append(child)
    return out


def enter_inference(models: tuple[Any, ...]) -> Optional[InferenceState]:
    """Enter ``torch.inference_mode()`` and put every module in eval mode (flags written directly
    where no module overrides ``train``/``__setattr__``; a tree already in eval mode is left as
    it is); ``None`` without torch or models."""
    if not models and "torch" not in sys.modules:
        return None
    guard = (_CLASSES or _classes())[3]
    modules = module_tree(models)
    token: list[Any] = []
    state = (None, token)
    with _INSIDE_LOCK:
        training = any(map(_flag, modules))
        if not training and not _INSIDE:
            _QUIET[id(token)] = (get_ident(), modules)
        else:
            if _QUIET:
                _register_quiet()
            _register(modules, None)
            _BLOCKS[id(token)] = (get_ident(), modules)
            # eval mode: the flags written directly where no module overrides train or
            # __setattr__, else each model's own eval()
            if training:
                try:
                    _, train, setattr_, _ = _CLASSES
                    for module in modules:
                        cls = type(module)
                        if cls.train is not train or cls.__setattr__ is not setattr_:
                            for model in models:
                                model.eval()
                            break
                    else:
                        for module in modules:
                            _write(module, "training", False)
                except BaseException:
                    _restore(state)
                    raise
    context = guard(True)
    state = (context, token)
    try:
        context.__enter__()
    except BaseException:
        _restore(state)
        raise
    return state


def _register_quiet() -> None:
    """Turn the quiet blocks inside into registered ones, with the flag they entered with."""
    for _, quiet in _QUIET.values():
        _register(quiet, False)
    _BLOCKS.update(_QUIET)
    _QUIET.clear()


def _register(modules: list[Any], flag: Optional[bool]) -> None:
    """Count a block in on each of ``modules``; the first block on one saves its flag (``flag``,
    or the module's own where ``None``)."""
    inside = _INSIDE
    for module in modules:
        entry = inside.get(id(module))
        if entry is None:
            inside[id(module)] = [1, module.training if flag is None else flag]
        else:
            entry[0] += 1


def _restore(state: InferenceState) -> None:
    """Leave the block for each module; the last block to leave one restores its flag (a quiet
    block's modules were all in eval mode: one its code switched on goes back, unless another
    block on it is still inside)."""
    with _INSIDE_LOCK:
        _end(id(state[1]))


def _end(key: int) -> None:
    """End the block keyed ``key`` (its token's ``id``); nothing where it has ended already
    (in a forked child, :func:`_after_fork`)."""
    back: list[tuple[Any, Any]] = []  # (module, flag) to put back
    quiet, registered = _QUIET.pop(key, None), _BLOCKS.pop(key, None)
    if quiet is not None:
        modules = quiet[1]
        if any(map(_flag, modules)):
            _register_quiet()  # the others still inside: the last to leave puts it back
            back = [(module, False) for module in modules
                    if module.training and id(module) not in _INSIDE]
    elif registered is not None:
        inside = _INSIDE
        for module in registered[1]:  # counted out; the last block on a module puts its flag back
            entry = inside[id(module)]
            entry[0] -= 1
            if entry[0]:
                continue
            del inside[id(module)]
            if module.training != entry[1]:
                back.append((module, entry[1]))
    setattr_ = _CLASSES[2]
    for module, flag in back:  # directly, or through the __setattr__ a class overrides
        if type(module).__setattr__ is setattr_:
            _write(module, "training", flag)
        else:
            module.training = flag


def _after_fork() -> None:
    """In a child made by ``os.fork()``: the blocks of the parent's other threads never leave
    there, so they end now, as if they had left (a flag goes back where no block of this
    thread is on it)."""
    me = get_ident()
    for blocks in (_QUIET, _BLOCKS):
        for key in [key for key, (thread, _) in blocks.items() if thread != me]:
            _end(key)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def exit_inference(state: Optional[InferenceState]) -> None:
    """Leave inference mode and restore every submodule's ``training`` flag."""
    if state is None:
        return
    try:
        state[0].__exit__(None, None, None)
    finally:
        _restore(state)


# -- tensors ------------------------------------------------------------------------------------
def tensor_types() -> set[type]:
    """``torch.Tensor`` and every subclass defined now whose instances can own storage."""
    return subclasses(_torch().Tensor, excluding=compat.NO_STORAGE)




_names: dict[Any, str] = {}


def dtype_name(key: Any) -> str:
    """``float32`` for ``torch.float32``, ``cuda:0`` for ``device('cuda', 0)``; cached."""
    name = _names.get(key)
    if name is None:
        if isinstance(key, _torch().device):
            name = key.type if key.index is None else f"{key.type}:{key.index}"
        else:
            name = str(key).replace("torch.", "")
        _names[key] = name
    return name


def owned_storage(tensor: Any) -> tuple[Any, int]:
    """The tensor's untyped storage and data pointer (0 when it owns no memory)."""
    storage = tensor.untyped_storage()
    return storage, storage.data_ptr()


def census_rows(tensors: list[Any], names: dict[int, str]
                ) -> tuple[list[TensorRow], list[Any]]:
    """The census rows of the ``tensors`` that own memory (``nbytes``: the storage's, or the
    parts' for sparse and nested ones), and their storage keys; ``names``: ids to parameter
    names. Tensors of a subclass that fails when read are left out."""
    known = _names
    rows: list[TensorRow] = []
    keys: list[Any] = []
    composites: list[tuple[int, list[tuple[Any, int]]]] = []  # sparse and nested: row, parts
    add_row, add_key, ref = rows.append, keys.append, weakref.ref
    make = tuple.__new__  # TensorRow(...) without its argument handling
    for tensor in tensors:
        try:
            storage = tensor.untyped_storage()  # owned_storage(tensor), inlined: 100,000 calls
            pointer = storage.data_ptr()
            if not pointer:
                continue
            device, dtype = tensor.device, tensor.dtype
            device = known.get(device) or dtype_name(device)
            ident = id(tensor)
            add_row(make(TensorRow, ("torch", device, known.get(dtype) or dtype_name(dtype),
                                     tensor.shape, storage.nbytes(), is_view(tensor),
                                     names.get(ident), ident, ref(tensor))))
            add_key((device, pointer))
        except Exception:  # noqa: BLE001 - a program's subclass may raise anything from a read
            try:  # sparse and nested tensors refuse a plain read: their memory is in parts
                parts = _parts(tensor)
            except Exception:  # noqa: BLE001
                continue
            if not parts:
                continue
            device, dtype = tensor.device, tensor.dtype
            device = known.get(device) or dtype_name(device)
            ident = id(tensor)
            shape = (tensor.size(0),) if tensor.is_nested else tuple(tensor.shape)
            composites.append((len(rows), [((device, p), n) for p, n in parts]))
            add_row(make(TensorRow, ("torch", device, known.get(dtype) or dtype_name(dtype),
                                     shape, 0, False, names.get(ident), ident, ref(tensor))))
            add_key(("parts of", ident))
    if composites:
        _count_parts(rows, keys, composites)
    return rows, keys


def _parts(tensor: Any) -> list[tuple[int, int]]:
    """``(storage pointer, bytes)`` of each part of a sparse (COO, CSR, CSC, BSR, BSC) or strided
    nested tensor; empty for others."""
    torch = _torch()
    layout = tensor.layout
    tensors: tuple[Any, ...]
    if layout is torch.sparse_coo:
        tensors = (compat.sparse_values(tensor), compat.sparse_indices(tensor))
    elif layout in (torch.sparse_csr, torch.sparse_bsr):
        tensors = (tensor.values(), tensor.crow_indices(), tensor.col_indices())
    elif layout in (torch.sparse_csc, torch.sparse_bsc):
        tensors = (tensor.values(), tensor.ccol_indices(), tensor.row_indices())
    elif tensor.is_nested:
        tensors = (tensor,)
    else:
        return []
    storages = [part.untyped_storage() for part in tensors]
    return [(s.data_ptr(), s.nbytes()) for s in storages if s.data_ptr()]


def _count_parts(rows: list[TensorRow], keys: list[Any],
                 composites: list[tuple[int, list[tuple[Any, int]]]]) -> None:
    """Count each part's storage on the sparse or nested tensor owning it (the first where two
    share one), not on the plain tensors over those parts, so a leak is named by what the
    program holds."""
    owned: set[Any] = set()
    for index, parts in composites:
        total = 0
        for key, nbytes in parts:
            if key not in owned:
                owned.add(key)
                total += nbytes
        rows[index] = rows[index]._replace(nbytes=total)
    for index, key in enumerate(keys):
        if key in owned:
            rows[index] = rows[index]._replace(nbytes=0)
            keys[index] = ("part", rows[index].id)


def view_base(tensor: Any) -> Any:
    """The tensor a view keeps alive (in C++, where no referrer walk sees it); ``None`` for a
    tensor that views nothing."""
    return getattr(tensor, "_base", None)


def parameter_names(model: Any) -> dict[int, str]:
    """``id(tensor) -> qualified name`` for a module's parameters, their grads and buffers."""
    names: dict[int, str] = {}
    for name, param in model.named_parameters():
        names[id(param)] = name
        if param.grad is not None:
            names[id(param.grad)] = name + ".grad"
    for name, buffer in model.named_buffers():
        names[id(buffer)] = name
    return names


def history_supported() -> bool:
    """Whether CUDA memory history can be recorded here."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_available()


def start_history(max_entries: int) -> None:  # pragma: gpu
    """Start recording CUDA allocation history (stack traces included)."""
    compat.record_memory_history(_torch())(max_entries=max_entries)


def dump_history(path: str) -> None:  # pragma: gpu
    """Write the recorded history as a snapshot pickle (for PyTorch's memory_viz page)."""
    compat.dump_snapshot(_torch())(path)


def stop_history() -> None:  # pragma: gpu
    """Stop recording CUDA allocation history."""
    compat.record_memory_history(_torch())(enabled=None)


# -- limits -------------------------------------------------------------------------------------
def cuda_initialised() -> bool:
    """Whether this process has initialised CUDA (False when torch is not imported)."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_initialized()


def memory_fraction(index: int) -> float:  # pragma: gpu
    """The per-process memory fraction of a CUDA device (1.0 where torch cannot tell)."""
    getter = getattr(_torch().cuda, "get_per_process_memory_fraction", None)
    try:
        return float(getter(index)) if getter is not None else 1.0
    except RuntimeError:
        return 1.0


def set_memory_fraction(index: int, fraction: float) -> None:  # pragma: gpu
    """Cap the caching allocator of CUDA device ``index`` at ``fraction`` of its memory."""
    _torch().cuda.set_per_process_memory_fraction(fraction, index)


def cuda_total(index: int) -> int:  # pragma: gpu
    """Total memory of CUDA device ``index`` (initialises CUDA)."""
    return int(_torch().cuda.get_device_properties(index).total_memory)


def available_cuda_device() -> Optional[str]:
    """``"cuda:N"`` (the current device, else 0) when torch sees a GPU, else ``None``; never
    initialises CUDA.

    >>> available_cuda_device() is None or available_cuda_device().startswith("cuda:")
    True
    """
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    return TorchBackend().normalise("cuda")  # pragma: gpu


def cuda_device_count() -> int:
    """How many CUDA GPUs torch sees (0 without torch or CUDA); never initialises CUDA."""
    try:
        torch = _torch()
    except ImportError:
        return 0
    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def device_overview() -> list[dict[str, Any]]:
    """Each accelerator torch sees (initialising it): name, total, used and free bytes."""
    torch = _torch()
    out = []
    if torch.cuda.is_available():  # pragma: gpu
        for index in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(index)
            out.append({"device": f"cuda:{index}", "name": torch.cuda.get_device_name(index),
                        "total": int(total), "used": int(total - free), "free": int(free)})
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():  # pragma: gpu
        total = getattr(torch.mps, "recommended_max_memory", lambda: None)()
        used = int(torch.mps.driver_allocated_memory())
        out.append({"device": "mps", "name": "Apple MPS", "total": total, "used": used,
                    "free": None if total is None else int(total) - used})
    return out


def version() -> str:
    """The installed torch's version (imports it)."""
    return str(_torch().__version__)


# -- budgets --------------------------------------------------------------------------------------
def cuda_budget(index: int) -> Optional[tuple[str, int, int]]:  # pragma: gpu
    """``(kind, limit, used)`` in bytes: what CUDA device ``index`` can still give; ``None``
    when CUDA is not initialised or this process does not use that GPU (asking would create a
    context). Free memory is the driver's plus the allocator's reserved but unused bytes.
    ``kind`` is ``"CUDA memory fraction"`` under a per-process fraction (limit
    ``fraction * total``), else ``"CUDA device"``."""
    if not cuda_initialised():
        return None
    torch = _torch()
    try:
        allocated = int(torch.cuda.memory_allocated(index))
        reserved = int(torch.cuda.memory_reserved(index))
        if not reserved and index != torch.cuda.current_device():
            return None  # a GPU this process does not use: asking would create a context
        free, total = (int(v) for v in torch.cuda.mem_get_info(index))
    except (RuntimeError, AssertionError):
        return None
    available = free + max(0, reserved - allocated)
    fraction = memory_fraction(index)
    if fraction < 1.0:
        cap = int(fraction * total)
        if cap - allocated < available:
            return "CUDA memory fraction", cap, allocated
    return "CUDA device", total, total - available


def cuda_identity(index: int) -> Optional[str]:  # pragma: gpu
    """``"NVIDIA H100 80GB HBM3 (79.1 GiB)"``-like, or ``None`` when CUDA is not initialised."""
    if not cuda_initialised():
        return None
    torch = _torch()
    props = torch.cuda.get_device_properties(index)
    return f"{props.name} ({int(props.total_memory)} bytes)"
