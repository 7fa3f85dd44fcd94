"""The census: which tensors are alive and how much memory they own, each storage counted once.

The census asks the collector for the referrers of the tensor classes: one pass over the
tracked objects, about the cost of ``gc.get_objects()`` itself. It keeps no strong
reference once it returns: each :class:`TensorInfo` holds a weak reference, and holder paths
(:mod:`memguard.holders`) are computed only on request.
"""

from __future__ import annotations

import collections
import gc
import itertools
import operator
import sys
import weakref
from typing import Any, Callable, Iterable, Optional

from ._checks import positive_int
from ._units import Size, format_bytes, format_table, parse_size
from .backends import check_device, resolve_devices
from .backends.base import TensorRow
from .cleanup import no_collection
from .holders import HOLDER_DEPTH, HOLDER_PATHS, HOLDER_SECONDS, walk_holders

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

    Attributes:
        framework: ``"torch"`` or ``"tensorflow"``.
        device: where the tensor lives (``"cpu"``, ``"cuda:0"``, ``"GPU:0"``).
        dtype: its element type, as a string (``"float32"``).
        shape: its shape (a ``torch.Size`` or a tuple of ints).
        nbytes: the bytes it is counted for (0 when another tensor counts its storage).
        is_view: whether it views another tensor's storage.
        name: the parameter's qualified name when the census was given the model, else ``None``.
        id: ``id()`` of the tensor.
        alive: whether the tensor still exists (the census keeps only a weak reference).
        saved_by: the live autograd graph that saved it, if any.
        holders: short paths from a root to the tensor (computed on first access).
        held_by: the holders in words.

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
        return self._row[:_REF] == other._row[:_REF]

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
        """Walk once for this tensor and the ones its census ranked after it (the first
        ``HOLDER_BATCH`` for any of them, then four times as many at each further walk), and the
        roots of the graphs that saved them."""
        wanted = self._batch(known)
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
            seconds = HOLDER_SECONDS * min(max(1.0, len(targets) / HOLDER_BATCH), 20.0)
            found, in_time = walk_holders(list(targets.values()), HOLDER_DEPTH, HOLDER_PATHS,
                                          seconds)
            for ident, paths in zip(targets, found, strict=True):
                if in_time or paths or ident == self.id:  # the rest: asked again, walked again
                    known[ident] = paths
            self._through_views({i: t for i, t in targets.items() if known.get(i) == []},
                                known)
        targets.clear()

    def _through_views(self, bases: dict[int, Any], known: dict[int, list[str]]) -> None:
        """The holders of a tensor nothing in Python refers to but a live view of it: torch
        keeps a view's base alive in C++, where no referrer walk sees it (a 16 MiB base read
        "holder not found" while ``KEPT['x'] = t[1:2]`` held it)."""
        if not bases:
            return
        from .backends import torch as torch_backend  # only torch has views

        idents: list[int] = []
        views: list[Any] = []  # the walk's targets: it never walks through this list
        for row in self._cache.get("rows", ()):
            if row.is_view and row.ref is not None:
                base = torch_backend.view_base(row.ref())
                if base is not None and bases.get(id(base)) is base:
                    idents.append(id(base))
                    views.append(row.ref())
                base = None
        if views:
            found, _ = walk_holders(views, HOLDER_DEPTH, HOLDER_PATHS, HOLDER_SECONDS)
            views.clear()
            for ident, paths in zip(idents, found, strict=True):
                known[ident].extend(f"{path} (a view of it)" for path in paths
                                    if len(known[ident]) < HOLDER_PATHS)

    def _batch(self, known: dict[int, list[str]]) -> list[tuple[int, Any]]:
        """``(id, weak reference)`` of the tensors to walk for: this one and the next ones of
        its census not walked yet, ``HOLDER_BATCH`` at the first walk, four times as many at each
        next one (at most ``HOLDER_BATCH_MAX``)."""
        cache = self._cache
        rows: list[TensorRow] = cache.get("rows", [])
        rank = cache.get("rank")
        if rank is None and rows:
            rank = cache["rank"] = {row.id: position for position, row in enumerate(rows)}
        start = None if rank is None else rank.get(self.id)
        if start is None:
            return [(self.id, self._ref)]
        walks = cache.get("walks", 0)
        cache["walks"] = walks + 1
        size = min(HOLDER_BATCH << (2 * walks), HOLDER_BATCH_MAX)
        first = 0 if start < HOLDER_BATCH else start
        wanted = [(self.id, self._ref)]
        for row in itertools.islice(rows, first, None):
            if len(wanted) >= size:
                break
            if row.id not in known and row.id != self.id:
                wanted.append((row.id, row.ref))
        return wanted

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
        """The tensor's holder, said in words (``held by module __main__, global CACHE[0]``,
        ``saved by the graph of float32[] held by module __main__, global losses[2]``, or
        ``holder not found``)."""
        holders = self.holders
        if holders:
            return f"held by {holders[0]}"
        graph = self.saved_by
        return f"saved by {graph}" if graph else "holder not found"

    def describe(self) -> str:
        """``float32[10000, 1024]``."""
        return f"{self.dtype}[{', '.join(map(str, self.shape))}]"

    def to_dict(self, holders: bool = False) -> dict[str, Any]:
        """A JSON-ready dict.

        Args:
            holders: also compute and include ``holders`` and ``saved_by`` (a walk of the
                referrers, milliseconds per tensor). Default ``False``.
        """
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

    Args:
        device: only the tensors on this device (``"cuda:0"``, ``"cpu"`` or ``"host"``,
            ``"GPU:0"``); ``None`` for every device.
        min_bytes: leave out tensors smaller than this, in bytes or a size such as ``"1MiB"``.
            Default ``0``.
        model: a ``torch.nn.Module`` whose parameters, grads and buffers are named
            (``"0.weight"``, ``"0.weight.grad"``). Default ``None``: parameters are not named.

    Returns:
        A list of :class:`TensorInfo`, largest first; each storage's bytes are counted once.

    Raises:
        ValueError: an unknown device, or a negative or unreadable ``min_bytes``.

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
    with no_collection():  # the census allocates a few objects per tensor
        graphs: dict[str, Any] = {}
        rows = _census_rows(frameworks, names, graphs)
        if device is not None or min_bytes:
            rows = [row for row in rows
                    if row.nbytes >= min_bytes and _device_matches(device, row.device)]
        rows.sort(key=_nbytes_of, reverse=True)  # the rows, not the infos: no Python call
        # one info per row, built by C loops (map over the slots' setters): a census makes
        # 100,000 of them, and a Python loop costs more than the rows' own reads
        infos: list[TensorInfo] = list(map(object.__new__, itertools.repeat(TensorInfo,
                                                                            len(rows))))
        _drain(map(_ROW_SLOT.__set__, infos, rows))
        _attach(infos, _shared_cache(rows, graphs))
    return infos


def _attach(infos: list[TensorInfo], cache: dict[str, Any]) -> None:
    """Give every one of ``infos`` the holder ``cache`` (by a C loop: a census has 100,000)."""
    _drain(map(_CACHE_SLOT.__set__, infos, itertools.repeat(cache)))


_drain: Callable[[Iterable[Any]], None] = collections.deque(maxlen=0).extend
"""Runs an iterator to its end, keeping nothing."""


_nbytes_of = operator.itemgetter(TensorRow._fields.index("nbytes"))
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
    # storage -> index of the row that counts it: the first tensor that is not a view, else
    # the first view (fed last to first, so that the first wins; in C, not row by row)
    views = list(map(_is_view_of, rows))
    plain = list(map(operator.not_, views))
    backwards = range(len(rows) - 1, -1, -1)
    owners = dict(zip(itertools.compress(reversed(keys), reversed(views)),
                      itertools.compress(backwards, reversed(views)), strict=True))
    owners.update(zip(itertools.compress(reversed(keys), reversed(plain)),
                      itertools.compress(backwards, reversed(plain)), strict=True))
    make, at = tuple.__new__, _NBYTES
    for index in set(range(len(rows))).difference(owners.values()):
        row = rows[index]  # another tensor counts this storage (_replace, unchecked)
        rows[index] = make(TensorRow, (*row[:at], 0, *row[at + 1:]))
    return rows


_NBYTES = TensorRow._fields.index("nbytes")
_is_view_of = operator.itemgetter(TensorRow._fields.index("is_view"))


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
    found = list(map(owner.get, keys))  # in C: most of 100,000 rows have no graph
    for row, root in zip(itertools.compress(rows, found), filter(None, found),  # ids: not 0
                         strict=True):
        if root != row.id:
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


HOLDER_BATCH = 10
HOLDER_BATCH_MAX = 5120


def _shared_cache(rows: list[TensorRow], graphs: dict[str, Any]) -> dict[str, Any]:
    """The holder cache the infos of ``rows`` (largest first) share (:func:`_share_holders`)."""
    return {"batch": [(row.id, row.ref) for row in rows[:HOLDER_BATCH]], "rows": rows,
            "holders": {}, "saved": graphs.get("saved", {}), "roots": graphs.get("roots", {})}


def _share_holders(infos: list[TensorInfo],
                   graphs: Optional[dict[str, Any]] = None) -> list[TensorInfo]:
    """Let ``infos`` (largest first) share one cache, so that asking any of the first
    ``HOLDER_BATCH`` for its holders finds the holders of all of them (and of the roots of
    the graphs that saved them) in one walk, and asking one further down finds those of the
    next ones as well, four times as many each time (40, 160, ...). ``graphs`` is what the census
    traced; without it, what the infos' own census traced is kept."""
    if graphs is None:
        graphs, caches = {}, {id(info._cache): info._cache for info in infos}  # noqa: SLF001 - this module's TensorInfo
        for cache in caches.values():
            for part in ("saved", "roots"):
                graphs.setdefault(part, {}).update(cache.get(part, {}))
    _attach(infos, _shared_cache([info._row for info in infos], graphs))  # noqa: SLF001 - this module's TensorInfo
    return infos


def memory_report(device: Optional[str] = None, *, top: int = 20) -> str:
    """A table of the ``top`` largest storages, grouped by device, dtype and shape, with
    totals; on ``device`` only when given (as in :func:`live_tensors`, whose order of
    parameters it follows: the device first, the rest by keyword).

    Per device it also gives, where the backend knows it, the gap between the census total
    and the allocator's ``allocated`` figure: buffers that autograd keeps in C++ (saved
    activations) and allocator rounding are invisible to any census.

    Args:
        device: only the storages on this device; ``None`` for every device.
        top: how many groups of storages to list (a positive int). Default ``20``.

    Returns:
        The report, a text table.

    Raises:
        ValueError: an unknown device, or a ``top`` that is not a positive int.

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
