"""Who holds an object: short paths from a root (a module global, a frame, a class, an
instance) to it, found by walking the collector's referrers (bounded in depth and time,
memguard's own objects ignored, never raising because of the program's objects)."""

from __future__ import annotations

import collections
import functools
import gc
import logging
import math
import os
import sys
import time
import types
from typing import TYPE_CHECKING, Any, Optional

from ._units import format_bytes

if TYPE_CHECKING:  # the census's rows, described here by their holders
    from .census import TensorInfo

log = logging.getLogger("memguard")
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
HOLDER_DEPTH = 8
HOLDER_SECONDS = 0.5
HOLDER_PATHS = 3


def _is_own_frame(frame: types.FrameType) -> bool:
    return os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == _PACKAGE_DIR


REPR_LIMIT = 80
LARGE_CONTAINER = 64  # longer ones are indexed once per walk: 1,000 targets in a list of 100,000
_SEQUENCES: tuple[type, ...] = (list, tuple, collections.deque)
_SETS: tuple[type, ...] = (set, frozenset)
_CONTAINERS = (dict, *_SEQUENCES, *_SETS)
# suspended frames: the kind's word, its frame, what it delegates to, how it delegates
_SUSPENDED = {types.GeneratorType: ("generator", "gi_frame", "gi_yieldfrom", "yield from"),
              types.CoroutineType: ("coroutine", "cr_frame", "cr_await", "await"),
              types.AsyncGeneratorType: ("async generator", "ag_frame", "ag_await", "await")}
# functions whose frames outlive a return by design: generators and coroutines
_SUSPENDABLE = 0x20 | 0x80 | 0x200  # CO_GENERATOR, CO_COROUTINE, CO_ASYNC_GENERATOR
_TRACEBACK: Any = BaseException.__dict__["__traceback__"]
_LRU_WRAPPER: Any = type(functools.lru_cache(maxsize=None)(len))
_CLASS_DICT: Any = type.__dict__["__dict__"]  # a class's namespace, whatever its metaclass says
_QUALNAME: Any = type.__dict__["__qualname__"]
_MODULE: Any = type.__dict__["__module__"]
_MODULE_SLOTS = ("_parameters", "_buffers", "_modules")


def _type_name(kind: type) -> str:
    """``kind``'s qualified name, read past any metaclass."""
    return str(_QUALNAME.__get__(kind))


def _safe_repr(value: Any) -> str:
    """``repr(value)`` cut to ``REPR_LIMIT``; ``<Session object at 0x7f...>`` when it raises or
    returns a non-string."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - the program's own __repr__ may raise anything; a path is still due
        text = None
    if not isinstance(text, str):
        return f"<{_type_name(type(value))} object at {id(value):#x}>"
    return text if len(text) <= REPR_LIMIT else text[:REPR_LIMIT - 3] + "..."


def _base(kind: type, bases: tuple[type, ...]) -> Optional[type]:
    return next((base for base in bases if issubclass(kind, base)), None)


def _positions(container: Any) -> tuple[dict[int, int], Optional[list], int]:
    """``id(member) -> position`` over a container (dict values map to their key's ``p``, keys to
    ``-p - 1``), and its length; read through the base type (no subclass code runs)."""
    index: dict[int, int] = {}
    kind = type(container)
    if issubclass(kind, dict):
        keys = list(dict.keys(container))
        for position, key in enumerate(keys):
            index.setdefault(id(key), -position - 1)
        for position, value in enumerate(dict.values(container)):
            if index.get(id(value), -1) < 0:  # a value's path reads better than a key's
                index[id(value)] = position
        return index, keys, len(keys)
    base: Any = _base(kind, _SEQUENCES + _SETS)
    size = 0
    for size, value in enumerate(base.__iter__(container), 1):
        index.setdefault(id(value), size - 1)
    return index, None, size


class _Walk:
    """What one walk keeps (module namespaces, running frames' locals, large containers'
    positions) and the ids of its own objects, never walked through."""

    def __init__(self) -> None:
        self.modules: dict[int, str] = {}
        for name, module in sorted(sys.modules.copy().items(),  # copied at once: imports in threads
                                   key=lambda item: item[0] != "__main__"):
            try:
                namespace = object.__getattribute__(module, "__dict__")
            except (AttributeError, TypeError):
                continue
            if type(namespace) is dict:
                self.modules.setdefault(id(namespace), name)
        self.stacks = _running_frames()  # running frames are not referrers the collector reports
        self.locals: dict[int, list[str]] = {}
        for frame, local_vars in self.stacks:
            for name, value in local_vars.items():
                self.locals.setdefault(id(value), []).append(
                    f"frame {frame.f_code.co_name}() local '{name}'")
        self.indexed: dict[int, tuple[dict[int, int], Optional[list], int]] = {}
        self.delegations: dict[int, tuple[str, Any]] = {}
        self.slots: dict[int, list[tuple[str, Any]]] = {}
        self.late = False  # a pass cut short by the deadline
        self.kept: list[Any] = []  # what the ids above name: alive while the walk runs
        self.own = {id(self), id(self.modules), id(self.stacks), id(self.locals),
                    id(self.indexed), id(self.kept), id(self.delegations), id(self.slots)}
        self.own.update(id(local_vars) for _, local_vars in self.stacks)

    def step(self, container: Any, obj: Any) -> Optional[tuple[str, Optional[str]]]:
        """How ``container`` refers to ``obj`` (``[3]``, ``['key']``, ``.keys()[0]``, ``{...}``)
        and a dict's string key; ``None`` when it does not."""
        if _base(type(container), _CONTAINERS) is None:
            return None
        found = self.indexed.get(id(container))
        if found is None:
            found = _positions(container)
            if found[2] > LARGE_CONTAINER:
                self.indexed[id(container)] = found
                self.kept.append(container)
                if found[1] is not None:
                    self.own.add(id(found[1]))
        index, keys, size = found
        position = index.get(id(obj))
        if position is None:
            return None
        if keys is not None:
            if position < 0:
                return f".keys()[{-position - 1}]", None
            key = keys[position]
            return f"[{_safe_repr(key)}]", key if isinstance(key, str) else None
        if _base(type(container), _SETS) is not None:
            return "{...}", None
        last = position == size - 1 and position > 0
        return ("[-1]" if last else f"[{position}]"), None

    def members(self, kind: type) -> list[tuple[str, Any]]:
        """The slots' descriptors of a class and its bases, cached per walk."""
        found = self.slots.get(id(kind))
        if found is None:
            found = self.slots[id(kind)] = [
                (str(name), member) for klass in kind.__mro__
                for name, member in _CLASS_DICT.__get__(klass).items()
                if type(member) is types.MemberDescriptorType]
            self.kept.append(kind)
        return found

    def delegation(self, suspended: Any) -> tuple[str, Any]:
        """What delegates to a suspended generator or coroutine (``yield from``, ``await``),
        outermost first, as ``generator epoch() yield from ``, and the outermost one."""
        known = self.delegations.get(id(suspended))
        if known is not None:
            return known
        words, inner = [], suspended
        for _ in range(HOLDER_DEPTH):
            outer = next((r for r in gc.get_referrers(inner) if type(r) in _SUSPENDED
                          and getattr(r, _SUSPENDED[type(r)][2]) is inner), None)
            if outer is None:
                break
            words.append(f"{outer.__qualname__}() {_SUSPENDED[type(outer)][3]} ")
            inner = outer
        kind = _SUSPENDED[type(inner)][0]
        found = self.delegations[id(suspended)] = (
            f"{kind} " + "".join(reversed(words)), inner)
        self.kept.append(suspended)
        return found

    def referrers(self, wanted: dict[int, Any], deadline: float) -> list[tuple[Any, Any]]:
        """``(referrer, object)`` for every referrer of the objects in ``wanted`` (by id): one
        ``gc.get_referrers`` pass, or for many objects one pass over every tracked object."""
        objects = tuple(wanted.values())
        self.own.add(id(objects))
        if len(objects) <= REFERRER_PASS:
            candidates = gc.get_referrers(*objects)
        else:
            candidates = gc.get_objects()
        del objects
        self.own.add(id(candidates))
        pairs: list[tuple[Any, Any]] = []
        self.own.add(id(pairs))
        own, referents, clock = self.own, gc.get_referents, time.perf_counter
        for count, ref in enumerate(candidates):
            if id(ref) in own:
                continue
            if not count & 4095 and clock() > deadline:
                self.late = True
                break
            for child in referents(ref):
                if id(child) in wanted:
                    pairs.append((ref, child))
        candidates.clear()
        return pairs


SURE_LEVELS = 3  # levels of a holder walk that complete whatever its deadline
REFERRER_PASS = 256  # objects per gc.get_referrers pass; beyond, one pass over every object


def find_holders(target: Any, *, max_depth: int = HOLDER_DEPTH, max_paths: int = HOLDER_PATHS,
                 seconds: float = HOLDER_SECONDS) -> list[str]:
    """Short paths from a root to ``target``, found breadth-first over ``gc.get_referrers``.

    Roots are module globals (``module __main__, global CACHE[3]``), frames (``frame
    train() local 'outputs'``), suspended generators (``generator batches() local 'x'``),
    instances nothing roots (``Trainer object .history[-1]``), classes (``class Config
    .TABLE``) and closures; a frame kept by a saved traceback and an ``lru_cache`` entry are
    named through what keeps them. The walk goes through dicts, lists, tuples, deques and
    sets.

    Args:
        target: the object (a tensor, usually) whose holders to find.
        max_depth: the most steps from a root to ``target``.
        max_paths: the most paths returned, shortest first.
        seconds: the time the walk may take beyond its first three levels, which always
            complete.

    Returns:
        The paths, shortest first; empty when none was found.

    >>> import sys, types
    >>> app = sys.modules["app"] = types.ModuleType("app")
    >>> app.CACHE = {"logits": [0.5]}
    >>> find_holders(app.CACHE["logits"])
    ["module app, global CACHE['logits']"]
    >>> del sys.modules["app"]
    """
    return find_holders_of([target], max_depth=max_depth, max_paths=max_paths,
                           seconds=seconds)[0]


def find_holders_of(targets: list[Any], *, max_depth: int = HOLDER_DEPTH,
                    max_paths: int = HOLDER_PATHS, seconds: float = HOLDER_SECONDS
                    ) -> list[list[str]]:
    """:func:`find_holders` for several ``targets`` in one walk (one pass over the tracked objects
    per level, whatever their number): one list of paths per target, in order; ``seconds``
    bounds the whole walk."""
    return walk_holders(targets, max_depth, max_paths, seconds)[0]


def walk_holders(targets: list[Any], max_depth: int, max_paths: int, seconds: float
          ) -> tuple[list[list[str]], bool]:
    """The paths of each target, and whether the walk ended before its deadline."""
    deadline = time.perf_counter() + seconds
    walk = _Walk()
    paths: list[list[str]] = [[] for _ in targets]
    instances: list[list[_Instance]] = [[] for _ in targets]  # used where no root is found above
    seen = [{id(target)} for target in targets]
    # each entry: (target index, object, path from it to the target, path if it is an
    # instance's __dict__)
    frontier: list[tuple[int, Any, str, Optional[str]]] = [
        (index, target, "", None) for index, target in enumerate(targets)]
    walk.own.update((id(paths), id(seen), id(frontier), id(targets), id(instances)))
    in_time = True

    def add(index: int, path: str) -> None:
        if path and path not in paths[index]:
            paths[index].append(path)

    for level in range(max_depth):
        frontier = [entry for entry in frontier if len(paths[entry[0]]) < max_paths]
        if not frontier:
            break
        # the first levels always complete: a pass over a large heap under load can take
        # longer than the whole budget, and the nearest holders are the ones that matter
        sure = level < SURE_LEVELS
        if not sure and time.perf_counter() > deadline:
            in_time = False
            break
        by_id: dict[int, list[tuple[int, Any, str, Optional[str]]]] = {}
        wanted: dict[int, Any] = {}
        for entry in frontier:
            index, obj, suffix, _ = entry
            by_id.setdefault(id(obj), []).append(entry)
            wanted[id(obj)] = obj
            for prefix in walk.locals.get(id(obj), ()):
                add(index, prefix + suffix)
        upcoming: list[tuple[int, Any, str, Optional[str]]] = []
        # the walk's own entries refer to its targets: never walk up through them (20 graph
        # roots made 847 of them at the fourth level, and a 1.3 s pass of the collector)
        walk.own.update((id(upcoming), id(by_id), id(wanted), id(frontier)))
        walk.own.update(id(entry) for entry in frontier)
        pairs = walk.referrers(wanted, math.inf if sure else deadline)
        wanted.clear()
        for ref, child in pairs:
            if not sure and time.perf_counter() > deadline:
                in_time = False
                break
            for index, obj, suffix, as_attribute in by_id[id(child)]:
                if id(ref) in seen[index]:
                    continue
                seen[index].add(id(ref))
                try:
                    root = _root(ref, obj, suffix, as_attribute, walk)
                    if type(root) is _Instance:  # go on to the name that roots the instance
                        instances[index].append(root)
                        above = ref if root.origin is None else root.origin
                        seen[index].add(id(above))
                        upcoming.append((index, above, root.attribute, None))
                        continue
                    if root is not None:
                        add(index, root)
                        continue
                    step = ("", None) if type(ref) is types.CellType else walk.step(ref, obj)
                except Exception:  # a program's object that fails when looked at
                    log.debug("holder walk: passed over a %s that failed when read",
                              type(ref).__name__, exc_info=True)
                    continue
                if step is not None:
                    key = step[1]
                    attribute = None if key is None else f".{key}{suffix}"
                    upcoming.append((index, ref, step[0] + suffix, attribute))
        pairs.clear()
        del pairs
        frontier = upcoming
    best = []
    for found, fallback in zip(paths, instances, strict=True):
        # an instance whose attribute path is in no rooted path was rooted nowhere the walk
        # reached (in, not at the end: an lru_cache's words close a path): its own form is
        # the best name there is, after every rooted path, however short
        unrooted = sorted((path for path in dict.fromkeys(fallback) if path
                           and not any(path.attribute in other for other in found)), key=len)
        best.append([str(path) for path in (sorted(found, key=len) + unrooted)[:max_paths]])
    return best, in_time and not walk.late


def _running_frames() -> list[tuple[types.FrameType, dict]]:
    """Every thread's running frames (memguard's left out), with their locals. The walk's own
    locals are dropped first: a local naming this frame would keep the caller's frames alive."""
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
          walk: _Walk) -> Optional[str]:
    """The path if ``ref`` is a root holding ``obj``; ``""`` to skip it; ``None`` to walk on.
    Types read with ``type()``: a proxy's ``__class__`` may lie or raise."""
    kind = type(ref)
    if kind is types.FrameType:
        # the collector reports no running frame (those are read from the stacks): this one
        # has returned and is kept, by a traceback most often, which the walk goes on to
        if _is_own_frame(ref):
            return ""
        for name, value in ref.f_locals.items():
            if value is obj:
                text = f"frame {ref.f_code.co_name}() local '{name}'{suffix}"
                if ref.f_code.co_flags & _SUSPENDABLE:
                    return text
                return _Instance(f"{text} (returned; its frame kept)", f", {text}")
        return ""
    if kind is types.TracebackType:
        if ref.tb_frame is obj or ref.tb_next is obj:
            return _Instance("", suffix)
        return ""
    if issubclass(kind, BaseException) and _TRACEBACK.__get__(ref) is obj:
        return _Instance(f"{_type_name(kind)} object .__traceback__{suffix}",
                         f".__traceback__{suffix}")
    if kind is _LRU_WRAPPER and obj is not _instance_dict(ref):
        return _Instance(f"{ref.__qualname__}() lru_cache{suffix}",
                         f" (its lru_cache{suffix}; .cache_clear() frees it)")
    if kind is dict and id(ref) in walk.modules:
        for name, value in dict.items(ref):
            if value is obj:
                return f"module {walk.modules[id(ref)]}, global {name}{suffix}"
        return ""
    if kind is types.FunctionType:
        cells = ref.__closure__ or ()
        if cells is obj and suffix.startswith("["):  # function -> closure tuple -> cell
            index, _, rest = suffix[1:].partition("]")
            position = int(index) if index.lstrip("-").isdigit() else None
            if position is not None and -len(cells) <= position < len(cells):
                name = ref.__code__.co_freevars[position]
                text = f"function {ref.__qualname__}() closure '{name}'{rest}"
                return _Instance(text, f", {text}")  # go on to what holds the function
        return ""
    if kind is types.CellType:
        return None if ref.cell_contents is obj else ""
    if kind in _SUSPENDED:
        return _suspended_root(ref, obj, suffix, walk)
    if _base(kind, _CONTAINERS) is not None:
        return None
    if issubclass(kind, type):
        return _class_root(ref, obj, suffix, as_attribute)
    module = _MODULE.__get__(kind)
    if isinstance(module, str) and module.startswith("memguard"):
        return ""
    attribute: Optional[str] = None
    attributes = _instance_dict(ref)
    if as_attribute is not None and attributes is obj:
        attribute = as_attribute
    elif type(attributes) is dict:  # attributes stored inline in the instance (Python 3.11+)
        key = next((k for k, v in dict.items(attributes) if v is obj), None)
        attribute = None if key is None else f".{key}{suffix}"
    if attribute is None:
        slot = _slot_holding(ref, obj, walk)
        attribute = None if slot is None else f".{slot}{suffix}"
    if attribute is None:
        return ""
    for slot in _MODULE_SLOTS:  # torch modules: .weight rather than ._parameters['weight']
        if attribute.startswith(f".{slot}["):
            attribute = "." + attribute[len(slot) + 3:].replace("']", "", 1)
    return _Instance(f"{_type_name(kind)} object {attribute}", attribute)


class _Instance(str):
    """An instance's attribute path (``Holder object .t``), kept only when no root is found past
    the instance; the walk goes on from ``origin`` (where given: the outermost of generators
    that delegate) or the instance, with ``attribute`` as the rest of the path."""

    attribute: str
    origin: Any

    def __new__(cls, text: str, attribute: str, origin: Any = None) -> "_Instance":
        made = super().__new__(cls, text)
        made.attribute = attribute
        made.origin = origin
        return made


def _instance_dict(owner: Any) -> Optional[dict]:
    try:
        return object.__getattribute__(owner, "__dict__")
    except (AttributeError, TypeError):
        return None


def _slot_holding(owner: Any, obj: Any, walk: _Walk) -> Optional[str]:
    """The ``__slots__`` entry of ``owner`` holding ``obj`` (mangled name for a private one)."""
    kind = type(owner)
    for name, member in walk.members(kind):
        try:
            value = member.__get__(owner, kind)
        except AttributeError:  # an empty slot
            continue
        if value is obj:
            return name
    return None


def _class_root(cls: type, obj: Any, suffix: str, as_attribute: Optional[str]) -> str:
    """``class Config .TABLE``: a class attribute, from the value or the class's namespace."""
    namespace = _CLASS_DICT.__get__(cls)  # a read-only view over that dict
    if as_attribute is not None and any(inner is obj for inner in gc.get_referents(namespace)):
        return f"class {_type_name(cls)} {as_attribute}"
    for name, value in namespace.items():
        if value is obj:
            return f"class {_type_name(cls)} .{name}{suffix}"
    return ""


def _suspended_root(ref: Any, obj: Any, suffix: str, walk: _Walk) -> str:
    """``generator batches() local 'x'``: a suspended generator's or coroutine's local, named
    through those that delegate to it."""
    frame = getattr(ref, _SUSPENDED[type(ref)][1])
    if frame is None or _is_own_frame(frame):
        return ""
    name = next((key for key, value in frame.f_locals.items() if value is obj), None)
    if name is None:
        return ""
    words, outermost = walk.delegation(ref)
    text = f"{words}{ref.__qualname__}() local '{name}'{suffix}"
    return _Instance(text, f", {text}", outermost)  # go on to what holds the generator


def _nbytes(info: TensorInfo) -> int:
    return info.nbytes


def describe_leaks(leaks: list[TensorInfo], groups: int = 3) -> list[str]:
    """The leaked tensors ``leaks`` grouped by what keeps them, largest first, at most ``groups``
    lines and one for the rest: ``float32[10240, 1024] held by module __main__, global
    CACHE[0] (40.0 MiB)``; a graph once, with all it keeps (``... and 4 more saved by the graph
    of float32[] held by ...``).

    >>> describe_leaks([])
    []
    """
    if not leaks:
        return []
    cache = leaks[0]._cache  # noqa: SLF001 - the census's cache: the graphs it traced, the first walk
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
        members.sort(key=_nbytes, reverse=True)
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
