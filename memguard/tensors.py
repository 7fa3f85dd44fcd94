"""Which tensors are alive, how much memory they own, and who holds them.

The census asks the collector for the referrers of the tensor classes: one pass over the
tracked objects, about the cost of ``gc.get_objects()`` itself. It keeps no strong
reference once it returns: each :class:`TensorInfo` holds a weak reference, and holder paths
are computed only on request.
"""

from __future__ import annotations

import gc
import os
import sys
import time
import types
import weakref
from typing import Any, Callable, Optional

from ._checks import positive_int
from ._units import Size, format_bytes, format_table, parse_size
from .backends import check_device, resolve_devices
from .backends.base import TensorRow

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
HOLDER_DEPTH = 8
HOLDER_SECONDS = 0.5
HOLDER_PATHS = 3


Rows = Callable[[list[Any], dict[int, str]], tuple[list[TensorRow], list[Any]]]


def _frameworks() -> dict[str, tuple[set[type], Rows]]:
    """``framework -> (tensor classes, census_rows)`` for the frameworks imported now."""
    found: dict[str, tuple[set[type], Rows]] = {}
    if "torch" in sys.modules:
        from .backends import torch as torch_backend

        found["torch"] = (torch_backend.tensor_types(), torch_backend.census_rows)
    if "tensorflow" in sys.modules:
        from .backends import tensorflow as tf_backend

        try:
            found["tensorflow"] = (tf_backend.tensor_types(), tf_backend.census_rows)
        except (ImportError, AttributeError):
            pass
    return found


def _live_objects(classes: set[type]) -> list[Any]:
    """Every live object whose exact class is in ``classes``.

    Instances of classes defined in Python (every torch and TensorFlow tensor class) report
    their class to the collector, so one ``gc.get_referrers`` pass over the classes finds
    them without building the list of all objects and filtering it in Python.
    """
    if not classes:
        return []
    found = gc.get_referrers(*classes)
    try:
        return [obj for obj in found if type(obj) in classes]
    finally:
        del found


def _device_matches(wanted: Optional[str], device: str) -> bool:
    if wanted is None:
        return True
    if wanted in ("host", "cpu"):
        return device == "cpu"
    if wanted == device:
        return True
    return ":" not in wanted and device.split(":")[0] == wanted and device.endswith(":0")


def _field(name: str, doc: str) -> Any:
    index = TensorRow._fields.index(name)  # read by position: a census makes thousands
    return property(lambda info: info._row[index], doc=doc)  # noqa: SLF001 - this module's TensorInfo


_REF = TensorRow._fields.index("ref")
_FIELDS = TensorRow._fields[:_REF]  # what a TensorInfo is: every field but the weak reference


class TensorInfo:
    """One live tensor, as the census saw it (immutable).

    ``nbytes`` counts each storage once: on the tensor that owns it, or on one of its views
    when only views are alive; every other tensor sharing that storage reports 0. ``name``
    is a parameter's qualified name when the census was given the model. ``holders`` (computed
    on first access, then kept) are short paths from a root to the tensor, such as
    ``module __main__, global CACHE[3]`` or ``frame train() local 'outputs'``.

    >>> import torch, memguard
    >>> CACHE = [torch.ones(1000, 1000)]
    >>> info = memguard.live_tensors(min_bytes=4_000_000)[0]
    >>> str(info)  # doctest: +SKIP
    'float32[1000, 1000] 3.8 MiB on cpu'
    """

    # One census row (a TensorRow: the fields, then the weak reference) and the holder cache
    # the census shares between its rows: a census builds 10,000 of these in a few ms.
    __slots__ = ("_row", "_cache")
    _row: TensorRow
    _cache: dict[str, Any]

    framework: str = _field("framework", "``torch`` or ``tensorflow``.")
    device: str = _field("device", "``cpu``, ``cuda:0``, ``GPU:0``...")
    dtype: str = _field("dtype", "``float32``...")
    shape: tuple[int, ...] = _field("shape", "The tensor's shape.")
    nbytes: int = _field("nbytes", "Bytes of storage counted here.")
    is_view: bool = _field("is_view", "Whether it views another's storage.")
    name: Optional[str] = _field("name", "The parameter's name, if known.")
    id: int = _field("id", "``id()`` of the tensor.")

    def __init__(self, framework: str, device: str, dtype: str, shape: tuple[int, ...],
                 nbytes: int, is_view: bool = False, name: Optional[str] = None,
                 id: int = 0, ref: Any = None) -> None:
        _ROW_SLOT.__set__(self, TensorRow(framework, device, dtype, tuple(shape), nbytes,
                                          is_view, name, id, ref))
        _CACHE_SLOT.__set__(self, {})

    @property
    def _ref(self) -> Any:
        return self._row.ref

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"TensorInfo is immutable: cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"TensorInfo is immutable: cannot delete {name!r}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorInfo):
            return NotImplemented
        return self._row[:_REF] == other._row[:8]

    def __hash__(self) -> int:
        return hash(self._row[:_REF])

    def __copy__(self) -> "TensorInfo":
        return self  # immutable

    def __deepcopy__(self, memo: dict) -> "TensorInfo":
        return self

    def __reduce__(self) -> tuple:
        return TensorInfo, self._row[:_REF]  # pickled: the fields, not the weak reference

    def __repr__(self) -> str:
        fields = ", ".join(f"{key}={value!r}"
                           for key, value in zip(_FIELDS, self._row, strict=False))
        return f"TensorInfo({fields})"

    @property
    def alive(self) -> bool:
        """Whether the tensor still exists."""
        return self._ref is not None and self._ref() is not None

    @property
    def holders(self) -> list[str]:
        """Paths from a root (module global, frame, class instance) to the tensor; empty when
        nothing in Python refers to it (see :attr:`saved_by` for a tensor an autograd graph
        keeps)."""
        known = self._cache.setdefault("holders", {})
        if self.id not in known:
            self._find_holders(known)
        return list(known[self.id])

    def _find_holders(self, known: dict[int, list[str]]) -> None:
        """Walk once for this tensor, or for its whole batch, and the roots of the graphs
        that saved them."""
        batch = self._cache.get("batch", [])
        if any(ident == self.id for ident, _ in batch):
            wanted = [(ident, ref) for ident, ref in batch if ident not in known]
        else:
            wanted = [(self.id, self._ref)]
        saved, roots = self._cache.get("saved", {}), self._cache.get("roots", {})
        for ident, _ in list(wanted):
            root = saved.get(ident)
            if root is not None and root not in known and root in roots:
                wanted.append((root, roots[root][1]))
        targets: dict[int, Any] = {}
        for ident, ref in wanted:
            target = None if ident < 0 or ref is None else ref()  # < 0: no tensor object
            if target is None:
                known[ident] = []
            else:
                targets[ident] = target
        del wanted
        if targets:
            found = find_holders_of(list(targets.values()))
            known.update(zip(targets, found, strict=True))
        targets.clear()

    @property
    def saved_by(self) -> Optional[str]:
        """``the graph of float32[] held by module __main__, global losses[2]``: the live
        autograd graph that saved this tensor for backward, named by the tensor that owns the
        graph (the ``loss``) and that tensor's first holder; ``None`` when no graph saved it."""
        root = self._cache.get("saved", {}).get(self.id)
        if root is None:
            return None
        description, ref = self._cache["roots"][root]
        if ref() is None:
            return None
        known = self._cache.setdefault("holders", {})
        if root not in known:
            self._find_holders(known)
        paths = known.get(root) or []
        return f"the graph of {description} " + (f"held by {paths[0]}" if paths
                                                  else "(its holder not found)")

    @property
    def held_by(self) -> str:
        """How the tensor is kept, in words: ``held by module __main__, global CACHE[0]``,
        ``saved by the graph of float32[] held by module __main__, global losses[2]``, or
        ``holder not found``."""
        holders = self.holders
        if holders:
            return f"held by {holders[0]}"
        graph = self.saved_by
        return f"saved by {graph}" if graph else "holder not found"

    def describe(self) -> str:
        """``float32[10000, 1024]``."""
        return f"{self.dtype}[{', '.join(map(str, self.shape))}]"

    def to_dict(self, holders: bool = False) -> dict[str, Any]:
        """A JSON-ready dict; ``holders=True`` computes and includes the holder paths."""
        data = dict(zip(_FIELDS, self._row, strict=False))
        data["shape"] = list(self.shape)
        if holders:
            data["holders"] = self.holders
            data["saved_by"] = self.saved_by
        return data

    def __str__(self) -> str:
        name = f" ({self.name})" if self.name else ""
        view = ", a view" if self.is_view else ""
        return f"{self.describe()} {format_bytes(self.nbytes)} on {self.device}{name}{view}"


def _check_tensor_device(device: Optional[str], name: str) -> None:
    """Refuse a ``device`` no census row can be on (``"cpu"`` is a tensor device, not a
    backend's)."""
    if device is not None and device != "cpu":
        check_device(device, name)


def live_tensors(device: Optional[str] = None, *, min_bytes: Size = 0,
                 model: Any = None) -> list[TensorInfo]:
    """Every live torch tensor (parameters and grads included) and TensorFlow eager tensor or
    variable, largest first; on ``device`` only when given (``"cuda:0"``, ``"cpu"`` or
    ``"host"``, ``"GPU:0"``; a name that is not a device is a ``ValueError``). ``min_bytes``
    (bytes or a size such as ``"1MiB"``) drops smaller ones; ``model`` (a ``torch.nn.Module``)
    names its parameters, their grads and its buffers.

    >>> import memguard
    >>> [t for t in memguard.live_tensors(min_bytes="1TiB")]
    []
    """
    _check_tensor_device(device, "live_tensors: device")
    min_bytes = parse_size(min_bytes, "live_tensors: min_bytes")
    frameworks = _frameworks()
    if not frameworks:
        return []
    names: dict[int, str] = {}
    if model is not None:
        from .backends import torch as torch_backend

        if not torch_backend.is_module(model):
            raise TypeError(f"live_tensors: model must be a torch.nn.Module, got "
                            f"{type(model).__name__}")
        names = torch_backend.parameter_names(model)
    collecting = gc.isenabled()
    gc.disable()  # the census allocates a few objects per tensor: no collection in between
    try:
        new, set_row = object.__new__, _ROW_SLOT.__set__
        infos = []
        graphs: dict[str, Any] = {}
        for row in _census_rows(frameworks, names, graphs):
            if row.nbytes < min_bytes or not _device_matches(device, row.device):
                continue
            info = new(TensorInfo)
            set_row(info, row)
            infos.append(info)
    finally:
        if collecting:
            gc.enable()
    infos.sort(key=_size_of, reverse=True)
    return _share_holders(infos, graphs)


_size_of = TensorInfo.nbytes.fget  # type: ignore[attr-defined]
# The slots' descriptors: a census fills 10,000 rows without calling __init__.
_ROW_SLOT: Any = TensorInfo.__dict__["_row"]
_CACHE_SLOT: Any = TensorInfo.__dict__["_cache"]


def _census_rows(frameworks: dict[str, tuple[set[type], Rows]],
                 names: dict[int, str], graphs: Optional[dict[str, Any]] = None
                 ) -> list[TensorRow]:
    """One row per tensor that owns memory: the fields of :class:`TensorInfo` and a weak
    reference, ``nbytes`` on the one row that counts each storage (the first tensor over it,
    a tensor that is not a view before views). With ``graphs`` (a dict), torch's autograd
    graphs are traced too (:func:`_trace_graphs`) and what they save is recorded there."""
    rows: list[TensorRow] = []
    keys: list[Any] = []
    objects = _live_objects({cls for classes, _ in frameworks.values() for cls in classes})
    try:
        for framework, (classes, census_rows) in frameworks.items():
            mine = objects if len(frameworks) == 1 else [o for o in objects if type(o) in classes]
            more_rows, more_keys = census_rows(mine, names)
            if framework == "torch" and graphs is not None:
                _trace_graphs(mine, more_rows, more_keys, graphs)
            del mine
            rows += more_rows
            keys += more_keys
    finally:
        del objects
    if len(set(keys)) == len(keys):
        return rows  # no storage is shared
    owners: dict[Any, int] = {}  # storage -> index of the row that counts it
    for index, key in enumerate(keys):
        previous = owners.get(key)
        if previous is None or (rows[previous].is_view and not rows[index].is_view):
            owners[key] = index
    counted = set(owners.values())
    for index, row in enumerate(rows):
        if index not in counted:  # another tensor counts this storage
            rows[index] = row._replace(nbytes=0)
    return rows


def _trace_graphs(tensors: list[Any], rows: list[TensorRow], keys: list[Any],
                  graphs: dict[str, Any]) -> None:
    """Record in ``graphs`` which live autograd graph saved each storage: ``"saved"`` maps a
    row's tensor id to its root's id, ``"roots"`` a root's id to ``(description, weak
    reference)``. Storages only a graph keeps (no live tensor object over them) get rows of
    their own, ``id`` the negated data pointer and the root's weak reference."""
    from .backends import torch_autograd

    owner, roots, extra = torch_autograd.graph_savings(tensors, set(keys))
    if not owner:
        return
    saved = graphs.setdefault("saved", {})
    graphs.setdefault("roots", {}).update(roots)
    for row, key in zip(rows, keys, strict=True):
        root = owner.get(key)
        if root is not None and root != row.id:
            saved[row.id] = root
    for saving, root in extra:
        device, pointer = saving.key
        ident = -pointer  # a storage without a tensor object: named by its data pointer
        rows.append(TensorRow("torch", device, saving.dtype, saving.shape, saving.nbytes,
                              False, None, ident, roots[root][1]))
        keys.append(saving.key)
        saved[ident] = root


def tensor_ids() -> dict[int, Any]:
    """``id -> weak reference`` (or ``None``) of every live tensor: what a scope records on
    entry to tell the tensors it created from those that were already there."""
    frameworks = _frameworks()
    classes = {cls for classes, _ in frameworks.values() for cls in classes}
    out: dict[int, Any] = {}
    objects = _live_objects(classes) if classes else []
    for obj in objects:
        try:
            out[id(obj)] = weakref.ref(obj)
        except TypeError:
            out[id(obj)] = None
    if "torch" in frameworks:  # storages only a graph keeps: by their (negated) pointer
        from .backends import torch_autograd

        owner = torch_autograd.graph_savings(objects, set())[0]
        out.update((-key[1], None) for key in owner)
    del objects
    return out


def created_since(before: dict[int, Any], infos: list[TensorInfo]) -> list[TensorInfo]:
    """The tensors among ``infos`` that were not alive when ``before`` was recorded."""
    new = []
    for info in infos:
        old = before.get(info.id, False)
        if old is False:
            new.append(info)
        elif old is not None and info._ref is not None and old() is not info._ref():  # noqa: SLF001 - this module's TensorInfo
            new.append(info)  # the id was reused by a new tensor
    return _share_holders(new)


# -- holders ------------------------------------------------------------------------------------
def _is_own_frame(frame: types.FrameType) -> bool:
    return os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == _PACKAGE_DIR


def _key_in(container: Any, obj: Any) -> Optional[str]:
    """How ``container`` refers to ``obj``: ``[3]``, ``[-1]``, ``['key']``, or None."""
    if isinstance(container, dict):
        for key, value in container.items():
            if value is obj:
                return f"[{key!r}]"
        return None
    if isinstance(container, (list, tuple)):
        for index, value in enumerate(container):
            if value is obj:
                last = index == len(container) - 1 and index > 0
                return "[-1]" if last else f"[{index}]"
        return None
    if isinstance(container, (set, frozenset)) and obj in container:
        return "{...}"
    return None


_MODULE_SLOTS = ("_parameters", "_buffers", "_modules")


def _instance_dict(owner: Any) -> Optional[dict]:
    try:
        return object.__getattribute__(owner, "__dict__")
    except (AttributeError, TypeError):
        return None


def find_holders(target: Any, *, max_depth: int = HOLDER_DEPTH, max_paths: int = HOLDER_PATHS,
                 seconds: float = HOLDER_SECONDS) -> list[str]:
    """Short paths from a root to ``target``, found breadth-first over ``gc.get_referrers``.

    Roots are module globals (``module __main__, global CACHE[3]``), frames (``frame
    train() local 'outputs'``), class instances (``Trainer object .history[-1]``), classes
    and closures. The walk is bounded in depth and time and ignores memguard's own objects.
    """
    return find_holders_of([target], max_depth=max_depth, max_paths=max_paths,
                           seconds=seconds)[0]


def find_holders_of(targets: list[Any], *, max_depth: int = HOLDER_DEPTH,
                    max_paths: int = HOLDER_PATHS, seconds: float = HOLDER_SECONDS
                    ) -> list[list[str]]:
    """:func:`find_holders` for several targets at once: each level of the walk costs one
    pass of the collector over every tracked object, whatever the number of targets."""
    modules: dict[int, str] = {}
    for name, module in sorted(sys.modules.items(), key=lambda item: item[0] != "__main__"):
        if module is not None and hasattr(module, "__dict__"):
            modules.setdefault(id(vars(module)), name)
    deadline = time.perf_counter() + seconds
    paths: list[list[str]] = [[] for _ in targets]
    seen = [{id(target)} for target in targets]
    # each entry: (target index, object, path from it to the target, path if it is an
    # instance's __dict__)
    frontier: list[tuple[int, Any, str, Optional[str]]] = [
        (index, target, "", None) for index, target in enumerate(targets)]
    stacks = _running_frames()  # running frames are not referrers the collector reports
    own = {id(paths), id(seen), id(frontier), id(modules), id(stacks), id(targets)}
    own.update(id(local_vars) for _, local_vars in stacks)

    def add(index: int, path: str) -> None:
        if path and path not in paths[index]:
            paths[index].append(path)

    for _ in range(max_depth):
        frontier = [entry for entry in frontier if len(paths[entry[0]]) < max_paths]
        if not frontier or time.perf_counter() > deadline:
            break
        by_id: dict[int, list[tuple[int, Any, str, Optional[str]]]] = {}
        for entry in frontier:
            index, obj, suffix, _ = entry
            by_id.setdefault(id(obj), []).append(entry)
            for frame, local_vars in stacks:
                for name, value in local_vars.items():
                    if value is obj:
                        add(index, f"frame {frame.f_code.co_name}() local '{name}'{suffix}")
        upcoming: list[tuple[int, Any, str, Optional[str]]] = []
        own.update((id(upcoming), id(by_id)))
        # the walk's own entries refer to its targets: never walk up through them (20 graph
        # roots made 847 of them at the fourth level, and a 1.3 s pass of the collector)
        own.update(id(entry) for entry in frontier)
        objects = tuple({id(e[1]): e[1] for e in frontier}.values())
        own.add(id(objects))
        referrers = gc.get_referrers(*objects)
        del objects
        own.add(id(referrers))
        for ref in referrers:
            if id(ref) in own or time.perf_counter() > deadline:
                continue
            for child in gc.get_referents(ref):
                for index, obj, suffix, as_attribute in by_id.get(id(child), ()):
                    if id(ref) in seen[index]:
                        continue
                    seen[index].add(id(ref))
                    root = _root(ref, obj, suffix, as_attribute, modules)
                    if root is not None:
                        add(index, root)
                        continue
                    step = "" if isinstance(ref, types.CellType) else _key_in(ref, obj)
                    if step is None:
                        continue
                    attribute = None
                    if isinstance(ref, dict):
                        key = next(k for k, v in ref.items() if v is obj)
                        if isinstance(key, str):
                            attribute = f".{key}{suffix}"
                    upcoming.append((index, ref, step + suffix, attribute))
        del referrers
        frontier = upcoming
    return [sorted(found, key=len)[:max_paths] for found in paths]


HOLDER_BATCH = 10


def _share_holders(infos: list[TensorInfo],
                   graphs: Optional[dict[str, Any]] = None) -> list[TensorInfo]:
    """Let ``infos`` (largest first) share one cache, so that asking any of the first
    ``HOLDER_BATCH`` for its holders finds the holders of all of them (and of the roots of
    the graphs that saved them) in one walk. ``graphs`` is what the census traced; without
    it, what the infos' own census traced is kept."""
    if graphs is None:
        graphs, caches = {}, {id(info._cache): info._cache for info in infos}  # noqa: SLF001 - this module's TensorInfo
        for cache in caches.values():
            for part in ("saved", "roots"):
                graphs.setdefault(part, {}).update(cache.get(part, {}))
    shared: dict[str, Any] = {"batch": [(i.id, i._ref) for i in infos[:HOLDER_BATCH]],  # noqa: SLF001 - this module's TensorInfo
                              "holders": {}, "saved": graphs.get("saved", {}),
                              "roots": graphs.get("roots", {})}
    set_cache = _CACHE_SLOT.__set__
    for info in infos:
        set_cache(info, shared)
    return infos


def describe_leaks(leaks: list[TensorInfo], groups: int = 3) -> list[str]:
    """The leaked tensors ``leaks`` (largest first) grouped by what keeps them, largest group
    first, at most ``groups`` lines and a last one for the rest: a tensor alone reads
    ``float32[10240, 1024] held by module __main__, global CACHE[0] (40.0 MiB)``; a graph once,
    with all it keeps, ``float32[1024, 4096] and 4 more saved by the graph of float32[] held by
    module __main__, global losses[2] (21.0 MiB)`` (the tensor owning the graph counts in its
    group). Holder paths are looked for only for the tensors shown.

    >>> describe_leaks([])
    []
    """
    if not leaks:
        return []
    cache = leaks[0]._cache  # noqa: SLF001 - this module's TensorInfo
    saved, roots = cache.get("saved", {}), cache.get("roots", {})
    batch = {ident for ident, _ in cache.get("batch", [])}
    order: dict[Any, list[TensorInfo]] = {}
    for leak in leaks:
        root = saved.get(leak.id)
        if root is None and leak.id in roots:
            root = leak.id  # the tensor owning a graph: with what its graph saved
        elif root is not None and leak.id in batch and leak.holders:
            root = None  # held directly as well: its own holder says more
        order.setdefault(("graph", root) if root is not None else ("tensor", leak.id),
                         []).append(leak)
    ranked = sorted(order.items(), key=lambda item: -sum(i.nbytes for i in item[1]))
    lines = []
    for (kind, key), members in ranked[:groups]:
        members.sort(key=_size_of, reverse=True)
        total = format_bytes(sum(i.nbytes for i in members))
        head = members[0]
        saver = next((m for m in members if m.id != key), None) if kind == "graph" else None
        graph = saver.saved_by if saver is not None else None
        held = f"saved by {graph}" if graph else head.held_by
        more = f" and {len(members) - 1} more" if len(members) > 1 else ""
        lines.append(f"{head.describe()}{more} {held} ({total})")
    rest = ranked[groups:]
    if rest:
        count = sum(len(members) for _, members in rest)
        size = sum(i.nbytes for _, members in rest for i in members)
        lines.append(f"{count} more tensor{'s' if count > 1 else ''} ({format_bytes(size)})")
    return lines


def _running_frames() -> list[tuple[types.FrameType, dict]]:
    """Every thread's running frames (memguard's own left out), with their locals.

    The walk's own locals are dropped before returning: this frame is among the running
    ones, and a local naming it would make a cycle keeping the caller's frames (and the
    tensors they hold) alive until the next full collection."""
    found = []
    tops = list(sys._current_frames().values())  # noqa: SLF001 - every thread's frames: no public way
    for top in tops:
        frame: Optional[types.FrameType] = top
        while frame is not None:
            if not _is_own_frame(frame) and frame.f_locals is not frame.f_globals:
                found.append((frame, dict(frame.f_locals)))  # module frames: see globals
            frame = frame.f_back
    tops.clear()
    del top, frame  # break the cycle through this frame
    return found


def _root(ref: Any, obj: Any, suffix: str, as_attribute: Optional[str],
          modules: dict[int, str]) -> Optional[str]:
    """The path if ``ref`` is a root holding ``obj``; ``""`` for a referrer to skip; ``None``
    to keep walking through it."""
    if isinstance(ref, types.FrameType):
        if _is_own_frame(ref):
            return ""
        for name, value in ref.f_locals.items():
            if value is obj:
                return f"frame {ref.f_code.co_name}() local '{name}'{suffix}"
        return ""
    if isinstance(ref, dict) and id(ref) in modules:
        for name, value in ref.items():
            if value is obj:
                return f"module {modules[id(ref)]}, global {name}{suffix}"
        return ""
    if isinstance(ref, types.FunctionType):
        cells = ref.__closure__ or ()
        if cells is obj and suffix.startswith("["):  # function -> closure tuple -> cell
            index, _, rest = suffix[1:].partition("]")
            position = int(index) if index.lstrip("-").isdigit() else None
            if position is not None and -len(cells) <= position < len(cells):
                name = ref.__code__.co_freevars[position]
                return f"function {ref.__qualname__}() closure '{name}'{rest}"
        return ""
    if isinstance(ref, types.CellType):
        return None if ref.cell_contents is obj else ""
    if isinstance(ref, (dict, list, tuple, set, frozenset)):
        return None
    if isinstance(ref, type):
        for name, value in vars(ref).items():
            if value is obj:
                return f"class {ref.__qualname__} .{name}{suffix}"
        return ""
    if type(ref).__module__.startswith("memguard"):
        return ""
    attribute: Optional[str] = None
    attributes = _instance_dict(ref)
    if as_attribute is not None and attributes is obj:
        attribute = as_attribute
    elif attributes is not None:  # attributes stored inline in the instance (Python 3.11+)
        key = next((k for k, v in attributes.items() if v is obj), None)
        attribute = None if key is None else f".{key}{suffix}"
    if attribute is None:
        return ""
    for slot in _MODULE_SLOTS:  # torch modules: .weight rather than ._parameters['weight']
        if attribute.startswith(f".{slot}["):
            attribute = "." + attribute[len(slot) + 3:].replace("']", "", 1)
    return f"{type(ref).__qualname__} object {attribute}"


def memory_report(device: Optional[str] = None, *, top: int = 20) -> str:
    """A table of the ``top`` largest storages, grouped by device, dtype and shape, with
    totals; on ``device`` only when given (as in :func:`live_tensors`, whose order of
    parameters it follows: the device first, the rest by keyword).

    Per device it also gives, where the backend knows it, the gap between the census total
    and the allocator's ``allocated`` figure: buffers that autograd keeps in C++ (saved
    activations) and allocator rounding are invisible to any census.

    >>> import memguard
    >>> print(memguard.memory_report(top=5))  # doctest: +SKIP
    device  dtype    shape          count       bytes
    cpu     float32  [10000, 1024]      1    39.1 MiB
    ...
    """
    if isinstance(device, int) and not isinstance(device, bool):
        raise TypeError(f"memory_report: the first parameter is the device, got {device!r}; "
                        f"write memory_report(top={device}) for the {device} largest groups")
    positive_int(top, "top", who="memory_report")
    _check_tensor_device(device, "memory_report: device")
    groups: dict[tuple[str, str, tuple[int, ...]], list[int]] = {}
    totals: dict[str, int] = {}
    for info in live_tensors(device):
        entry = groups.setdefault((info.device, info.dtype, info.shape), [0, 0])
        entry[0] += 1
        entry[1] += info.nbytes
        totals[info.device] = totals.get(info.device, 0) + info.nbytes
    if not groups:
        return "no live tensors" + (f" on {device}" if device else "")
    ranked = sorted(groups.items(), key=lambda item: item[1][1], reverse=True)
    rows = [("device", "dtype", "shape", "count", "bytes")]
    rows += [(dev, dtype, f"[{', '.join(map(str, shape))}]", str(count), format_bytes(size))
             for (dev, dtype, shape), (count, size) in ranked[:top]]
    if len(ranked) > top:
        rest = sum(size for _, (_, size) in ranked[top:])
        rows.append(("...", "", f"{len(ranked) - top} more groups", "", format_bytes(rest)))
    lines = [format_table(rows, left=3)]
    lines.append("")
    for dev, total in sorted(totals.items()):
        line = f"{dev}: {format_bytes(total)} in live tensors"
        allocated = _allocated(dev)
        if allocated is not None:
            line += (f"; the allocator reports {format_bytes(allocated)} allocated, "
                     f"{format_bytes(allocated - total)} not in any tensor the census can see "
                     f"(autograd's saved buffers, workspaces, rounding)")
        lines.append(line)
    return "\n".join(lines)


def _allocated(device: str) -> Optional[int]:
    """The allocator's ``allocated`` figure for a tensor device, where a backend reads it."""
    if device == "cpu":
        return None
    try:
        pairs = resolve_devices(device)
    except ValueError:
        return None
    backend, name = pairs[0]
    return backend.read_fast(name)[0]
