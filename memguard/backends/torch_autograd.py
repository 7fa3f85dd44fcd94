"""What autograd keeps: the tensors live graphs saved for backward (a ``loss`` kept in a list
keeps them, with no Python referrer), read through each node's ``_saved_*`` attributes and
``saved_tensors``; and a warm-up step. Only keys and indices are returned, never tensors."""

from __future__ import annotations

import itertools
import operator
import sys
import weakref
from typing import Any, NamedTuple, Optional

from ._torch_compat import SAVED_PREFIX
from .torch import dtype_name as _name, owned_storage

_SAVED_NAMES: dict[type, tuple[str, ...]] = {}


def _saved_names(node_type: type) -> tuple[str, ...]:
    """The attributes of a node class that unpack its saved tensors; cached per class."""
    names = _SAVED_NAMES.get(node_type)
    if names is None:
        names = tuple(name for name in dir(node_type)
                      if name.startswith(SAVED_PREFIX) or name == "saved_tensors")
        _SAVED_NAMES[node_type] = names
    return names


def _saved_of(node: Any, tensor_type: type) -> list[Any]:
    """The tensors ``node`` saved for backward (empty once its graph ran backward)."""
    out = []
    for name in _saved_names(type(node)):
        try:
            value = getattr(node, name)
        except (RuntimeError, AttributeError, TypeError):
            continue  # freed by a backward pass, or not a tensor slot
        if isinstance(value, tensor_type):
            out.append(value)
        elif isinstance(value, (tuple, list)):
            out.extend(v for v in value if isinstance(v, tensor_type))
    return out


class Saving(NamedTuple):
    """A storage a graph saved: its key (device, data pointer), then what the census reports."""

    key: tuple[str, int]
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


Root = tuple[str, Any]
"""A tensor whose graph saved something: ``(its description, a weak reference to it)``."""


def graph_savings(tensors: list[Any], known: set[tuple[str, int]]
                  ) -> tuple[dict[tuple[str, int], int], dict[int, Root], list[tuple[Saving, int]]]:
    """Which graph keeps each saved storage, for a census's live ``tensors``: ``({key: root id},
    {root id: (description, weak reference)}, [(row, root id)])``, a root being a tensor whose
    ``grad_fn`` no other live graph reaches, the last list the storages no census tensor owns
    (not in ``known``)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return {}, {}, []
    tensor_type = torch.Tensor
    candidates = _with_graphs(tensors)
    if not candidates:
        return {}, {}, []
    nodes: dict[int, Any] = {}  # every node reached (kept alive only for this walk)
    inner: set[int] = set()  # nodes some other node leads to
    stack = [node for _, node in candidates]
    try:
        while stack:
            node = stack.pop()
            if id(node) in nodes:
                continue
            nodes[id(node)] = node
            for child, _ in _next(node):
                if child is not None:
                    inner.add(id(child))
                    if id(child) not in nodes:
                        stack.append(child)
        owner: dict[tuple[str, int], int] = {}
        roots: dict[int, Root] = {}
        extra: list[tuple[Saving, int]] = []
        done: set[int] = set()
        for index, root in candidates:
            if id(root) in inner or id(root) in done:
                continue
            tensor = tensors[index]
            ident, found = id(tensor), len(owner)
            stack = [root]
            while stack:
                node = stack.pop()
                if id(node) in done:
                    continue
                done.add(id(node))
                for saved in _saved_of(node, tensor_type):
                    row = _row(saved)
                    if row is not None and row.key not in owner:
                        owner[row.key] = ident
                        if row.key not in known:
                            extra.append((row, ident))
                    del saved
                stack.extend(child for child, _ in _next(node)
                             if child is not None and id(child) not in done)
            if len(owner) > found:
                roots[ident] = (_describe(tensor), weakref.ref(tensor))
            del tensor
        return owner, roots, extra
    finally:
        nodes.clear()
        del stack, candidates


def _with_graphs(tensors: list[Any]) -> list[tuple[int, Any]]:
    """``(index, grad_fn)`` of the ``tensors`` that have one; read in C loops (a census reads
    100,000 tensors), one by one only where a program's subclass raises from the read."""
    try:
        nodes = list(map(_grad_fn, tensors))
    except Exception:  # noqa: BLE001 - a program's subclass may raise anything from a read
        nodes = []
        for tensor in tensors:
            try:
                nodes.append(tensor.grad_fn)
            except Exception:  # noqa: BLE001
                nodes.append(None)
    present = list(map(operator.is_not, nodes, itertools.repeat(None)))
    return list(zip(itertools.compress(range(len(nodes)), present),
                    itertools.compress(nodes, present), strict=True))


_grad_fn = operator.attrgetter("grad_fn")


def _describe(tensor: Any) -> str:
    return f"{_name(tensor.dtype)}[{', '.join(map(str, tensor.shape))}]"


def _next(node: Any) -> tuple:
    try:
        return node.next_functions
    except (RuntimeError, AttributeError):
        return ()


def _row(tensor: Any) -> Optional[Saving]:
    try:
        storage, pointer = owned_storage(tensor)
        if not pointer:
            return None
        device = _name(tensor.device)
        return Saving((device, pointer), _name(tensor.dtype), tuple(tensor.shape),
                      storage.nbytes())
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return None


def warm_up() -> None:
    """Run one tiny training step (forward, backward, AdamW) on the CPU and on an initialised
    CUDA device, so one-time state exists before a measured block; never initialises CUDA and
    leaves the random number generators as they were."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    devices = ["cpu"]
    if torch.cuda.is_initialized():  # pragma: gpu
        devices.append(f"cuda:{torch.cuda.current_device()}")
    with torch.random.fork_rng(devices=[d for d in devices if d != "cpu"]):
        for device in devices:
            _one_step(torch, device)


def _one_step(torch: Any, device: str) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 8)).to(device)
    optimizer = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        inputs = torch.randn(16, 64, device=device)
        loss = torch.nn.functional.cross_entropy(
            model(inputs), torch.zeros(16, dtype=torch.long, device=device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
