"""One way to measure a batch and cut it into slices along its first dimension (the rules, as
users see them, are in the recovery internals guide).

Parts are **per-sample** (cut: an array-like with a ``shape``, or a list of plain items),
**containers** (rebuilt around their cut parts, type kept: Mappings, named tuples,
dataclasses, tuples and lists of batch parts) or **shared** (handed to every slice:
scalars, ``None``, other objects, record tuples such as ``torch.Size``, and a part of one
row beside longer ones, which torch broadcasts). Per-sample parts must agree in length. A
list of two or more tensors of one shape and dtype reads both as fields and as one tensor
per sample: the parts beside it decide, and where nothing does, cutting it is a
``ValueError`` rather than a guess. A ``PackedSequence`` cannot be cut.

No framework is imported: parts are recognised by their ``shape``."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, MutableMapping
from typing import Any, Optional, Union

SHARED, SAMPLES, ITEMS, MAPPING, SEQUENCE = "shared", "samples", "items", "mapping", "sequence"
RECORD, UNCUT = "record", "uncut"  # a dataclass instance; a part that cannot be cut


def _shape_length(value: Any) -> Optional[int]:
    """The first dimension of an array-like with at least one dimension, else ``None``."""
    shape = getattr(value, "shape", None)
    if shape is None or isinstance(value, type):
        return None
    try:
        dims = tuple(shape)
    except TypeError:
        return None
    if not dims or not hasattr(value, "__getitem__"):
        return None
    try:
        return int(dims[0])
    except (TypeError, ValueError):  # an unknown dimension (a symbolic TensorFlow shape)
        return None


class _Field(str):
    """A named tuple's field name in a :data:`Where`."""


Where = Union[str, tuple[Any, Any]]
"""Where a part sits in the batch, for messages: ``"batch"``, or ``(parent, key)`` (a key, an
index or a :class:`_Field`); the text is built only when a message needs it."""


def _where(where: Where) -> str:
    suffixes = []
    while isinstance(where, tuple):
        where, key = where
        suffixes.append(f".{key}" if isinstance(key, _Field) else f"[{key!r}]")
    return where + "".join(reversed(suffixes))


def _is_named_tuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(type(value), "_fields")


def _is_plain_sequence(value: Any) -> bool:
    """A list (or list subclass) or a plain tuple; tuple subclasses are records."""
    return isinstance(value, list) or type(value) is tuple


class Plan:
    """How one part of a batch is cut: its kind, its length and, for containers, its parts.

    >>> plan = Plan.of({"x": [[1, 2], [3, 4], [5, 6]], "name": ["a", "b", "c"], "lr": 0.1})
    >>> plan.length
    3
    >>> plan.cut({"x": [[1, 2], [3, 4], [5, 6]], "name": ["a", "b", "c"], "lr": 0.1}, 1, 3)
    {'x': [[3, 4], [5, 6]], 'name': ['b', 'c'], 'lr': 0.1}
    """

    __slots__ = ("kind", "length", "parts", "flat", "alt", "where")

    def __init__(self, kind: str, length: Optional[int], parts: Any = None) -> None:
        self.kind = kind
        self.length = length
        self.parts = parts
        # a tuple, list or mapping (its type) whose parts are all array-likes: see fits
        self.flat: Optional[type] = None
        # a list of tensors of one shape, read as fields (``length``) while it could be one
        # tensor per sample (``alt`` samples): nothing beside it told which; cut refuses
        self.alt: Optional[int] = None
        self.where: Where = "batch"  # for the messages of ``alt`` and ``UNCUT``

    def fits(self, value: Any) -> bool:
        """Whether this plan (of an array-like or a :attr:`flat` container) is also ``value``'s,
        checked without making objects; ``False`` is no verdict."""
        if self.kind == SAMPLES:
            return _shape_length(value) == self.length
        flat: Any = self.flat
        if flat is None or type(value) is not flat or len(value) != len(self.parts):
            return False
        length = self.length
        if self.kind == MAPPING:
            for key, part in zip(value, self.parts, strict=True):
                if key != part or _shape_length(value[key]) != length:
                    return False
            return True
        for item in value:
            if _shape_length(item) != length:
                return False
        return True

    @classmethod
    def of(cls, value: Any, where: Where = "batch") -> "Plan":
        """The plan of ``value``; ``ValueError`` when its per-sample parts disagree."""
        kind = type(value)
        if kind is tuple or kind is list:  # the common containers first: no shape to look up
            return cls._sequence(value, where)
        length = _shape_length(value)
        if length is not None:
            return _SAMPLES.get(length) or _samples(length)
        if isinstance(value, Mapping):
            parts = {key: cls.of(item, (where, key)) for key, item in value.items()}
            return _flat(cls(MAPPING, _common(parts, where), parts), value)
        if _is_named_tuple(value):
            if _is_packed_sequence(value):
                plan = cls(UNCUT, None)
                plan.where = where
                return plan
            parts = {i: cls.of(item, (where, _Field(name)))
                     for i, (name, item) in enumerate(zip(type(value)._fields, value, strict=True))}
            return cls(SEQUENCE, _common(parts, where), parts)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            parts = {f.name: cls.of(getattr(value, f.name), (where, _Field(f.name)))
                     for f in dataclasses.fields(value)}
            return cls(RECORD, _common(parts, where), parts)
        if _is_plain_sequence(value):
            return cls._sequence(value, where)
        return cls(SHARED, None)

    @classmethod
    def _sequence(cls, value: Any, where: Where) -> "Plan":
        parts: dict[Any, Plan] = {}
        kinds: set[str] = set()
        lengths: set[int] = set()
        for i, item in enumerate(value):  # one loop: this runs at every guarded step
            length = _shape_length(item)
            part = parts[i] = (cls.of(item, (where, i)) if length is None
                               else _SAMPLES.get(length) or _samples(length))
            kinds.add(part.kind)
            if part.length is not None:
                lengths.add(part.length)
        if kinds <= {SHARED}:
            return cls(ITEMS, len(value))  # strings, numbers: one item per sample
        if isinstance(value, list) and (kinds == {MAPPING} or kinds == {ITEMS}):
            return cls(ITEMS, len(value))  # one dict (or one token list) per sample
        if len(lengths) == 1:
            if (len(value) > 1 and kinds == {SAMPLES} and isinstance(value, list)
                    and _one_shape(value)):
                plan = cls(SEQUENCE, lengths.pop(), parts)  # fields, or one per sample
                plan.alt, plan.where = len(value), where
                return plan
            if SEQUENCE in kinds:  # a list of one-shaped tensors inside: settled here
                _common(parts, where)
            return _flat(cls(SEQUENCE, lengths.pop(), parts), value)
        if isinstance(value, list) and SHARED not in kinds:
            return cls(ITEMS, len(value))  # one tensor per sample (ragged sequences)
        return cls(SEQUENCE, _common(parts, where), parts)

    def cut(self, value: Any, start: int, stop: int) -> Any:
        """``value``'s samples ``start:stop``, shared parts as they are."""
        if self.kind == SHARED:
            return value
        if self.kind in (SAMPLES, ITEMS):
            return value[start:stop]
        if self.alt is not None:
            raise ValueError(_ambiguous(self, value))
        if self.kind == UNCUT:
            raise TypeError(f"memguard cannot cut {_where(self.where)}, a "
                            f"torch.nn.utils.rnn.PackedSequence, into samples: its data "
                            f"interleaves the sequences. Put the padded tensor and the lengths "
                            f"in the batch (torch.nn.utils.rnn.pad_packed_sequence, or "
                            f"pad_sequence of the sequences) and pack them inside the step "
                            f"function")
        if self.kind == MAPPING:
            return _rebuild_mapping(value, {key: plan.cut(value[key], start, stop)
                                            for key, plan in self.parts.items()})
        if self.kind == RECORD:
            return _rebuild_record(value, {name: plan.cut(getattr(value, name), start, stop)
                                           for name, plan in self.parts.items()
                                           if plan.kind != SHARED})
        items = [plan.cut(item, start, stop)
                 for plan, item in zip(self.parts.values(), value, strict=True)]
        if _is_named_tuple(value):
            return type(value)(*items)
        return type(value)(items)


def _flat(plan: Plan, value: Any) -> Plan:
    """``plan`` marked :attr:`~Plan.flat` where every part of ``value`` is an array-like."""
    if plan.length is not None and all(p.kind == SAMPLES for p in plan.parts.values()):
        plan.flat = type(value)
    return plan


_SAMPLES: dict[int, Plan] = {}  # plans of array-likes, by length: one object each
_BROADCAST = Plan(SHARED, None)  # a part of one row beside longer ones (see _common)


def _samples(length: int) -> Plan:
    """The plan of an array-like of ``length`` samples (plans are never changed: shared)."""
    plan = Plan(SAMPLES, length)
    if len(_SAMPLES) < 4096:
        _SAMPLES[length] = plan
    return plan


def _one_shape(items: list) -> bool:
    """Whether the array-likes ``items`` all have one shape and one dtype."""
    first = items[0]
    shape, dtype = tuple(first.shape), getattr(first, "dtype", None)
    return all(tuple(t.shape) == shape and getattr(t, "dtype", None) == dtype
               for t in items[1:])


def _is_packed_sequence(value: Any) -> bool:
    kind = type(value)
    return kind.__name__ == "PackedSequence" and kind.__module__.startswith("torch")


def _ambiguous(plan: Plan, value: Any) -> str:
    first = value[0]
    return (f"memguard cannot tell how to cut {_where(plan.where)}, a list of {plan.alt} "
            f"tensors of one shape {list(first.shape)}: it may be fields of {plan.length} "
            f"samples each (as DataLoader collation makes [inputs, targets]) or one tensor "
            f"per sample ({plan.alt} samples), and nothing beside it in the batch says "
            f"which. Make it plain: a tuple of fields (collate_fn=lambda b: "
            f"tuple(default_collate(b))), a dict, or one dict per sample "
            f"([{{'x': t}} for t in ...]), or put a per-sample tensor (the labels) beside it")


def _common(parts: dict[Any, Plan], where: Where) -> Optional[int]:
    if any(p.alt is not None for p in parts.values()):
        _settle(parts)
    lengths = {key: p.length for key, p in parts.items() if p.length is not None}
    found = set(lengths.values())
    if len(found) == 2 and 1 in found:
        # one row beside the samples' rows (position ids of shape [1, L]): what torch
        # broadcasts over the batch, so shared by every slice, as plain torch reads it
        for key, n in lengths.items():
            if n == 1:
                parts[key] = _BROADCAST
        found.discard(1)
        return found.pop()
    if len(found) > 1:
        listed = ", ".join(f"{key!r}: {n}" for key, n in lengths.items())
        raise ValueError(f"the per-sample parts of {_where(where)} disagree on the "
                         f"number of samples ({listed}); every tensor, array and per-sample "
                         f"list in a batch must have the same length along dim 0")
    return next(iter(lengths.values()), None)


def _settle(parts: dict[Any, Plan]) -> None:
    """Read each list of one-shaped tensors among ``parts`` (``alt``) as the plain parts agree:
    fields where their length is its items', one tensor per sample where it is its item count."""
    plain = {p.length for p in parts.values() if p.length is not None and p.alt is None}
    if len(plain) != 1:
        return
    length = plain.pop()
    for key, p in parts.items():
        if p.alt is None or p.length == p.alt:
            continue
        if p.length == length:
            p.alt = None  # fields
        elif p.alt == length:
            parts[key] = Plan(ITEMS, length)  # one tensor per sample


def _rebuild_record(original: Any, items: dict) -> Any:
    """A copy of the dataclass instance ``original`` holding ``items`` (by field name)."""
    init = {f.name for f in dataclasses.fields(original) if f.init}
    try:
        new = dataclasses.replace(original, **{k: v for k, v in items.items() if k in init})
        for key, item in items.items():
            if key not in init:
                object.__setattr__(new, key, item)
    except Exception as exc:
        raise TypeError(f"memguard cannot rebuild a {type(original).__name__} from its "
                        f"slices with dataclasses.replace ({exc}); pass the batch as a "
                        f"dict") from exc
    return new


def _rebuild_mapping(original: Mapping, items: dict) -> Mapping:
    """A mapping of ``original``'s type (and attributes) holding ``items``."""
    if isinstance(original, MutableMapping):
        try:
            new = copy.copy(original)
        except Exception:  # noqa: BLE001 - a type that does not copy: build it instead
            pass
        else:
            for key, item in items.items():
                new[key] = item
            return new
    try:
        return type(original)(items)  # type: ignore[call-arg]
    except Exception as exc:
        raise TypeError(f"memguard cannot rebuild a {type(original).__name__} from "
                        f"its slices ({exc}); pass the batch as a dict") from exc


def plan_batch(batch: Any, last: Optional[Plan] = None) -> Plan:
    """The plan of a whole batch: ``TypeError`` when nothing in it is per-sample; ``last``,
    the previous batch's plan, when it :meth:`~Plan.fits` this one.

    >>> plan_batch([1, 2, 3]).length
    3
    """
    if last is not None and last.fits(batch):
        return last
    plan = Plan.of(batch)
    if plan.length is None:
        if plan.kind == UNCUT:
            plan.cut(batch, 0, 0)  # its error
        raise TypeError(f"memguard cannot split a batch of type "
                        f"{type(batch).__module__}.{type(batch).__qualname__} ({_short(batch)}): "
                        f"it has no per-sample part. A batch is a tensor, an array, a "
                        f"list/tuple, a dict/Mapping or a dataclass of those (nested), or a "
                        f"list of per-sample items")
    return plan


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def batch_elements(batch: Any, depth: int = 0) -> int:
    """The elements of the batch's array-likes: roughly what it costs in memory (padding counts).

    >>> batch_elements({"x": [[1, 2], [3, 4]], "ids": ["a", "b"], "lr": 0.1})
    0
    """
    numel = getattr(batch, "numel", None)
    if callable(numel) and hasattr(batch, "shape"):  # a tensor
        return int(numel())
    if hasattr(batch, "shape") and isinstance(getattr(batch, "size", None), int):  # an array
        return int(batch.size)
    if depth > 8 or isinstance(batch, (str, bytes)):
        return 0
    if isinstance(batch, Mapping):
        return sum(batch_elements(value, depth + 1) for value in batch.values())
    if isinstance(batch, (list, tuple)):
        return sum(batch_elements(value, depth + 1) for value in batch)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return sum(batch_elements(getattr(batch, field.name), depth + 1)
                   for field in dataclasses.fields(batch))
    return 0
