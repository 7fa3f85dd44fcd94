"""What ``auto_microbatch`` needs from torch: a model's gradients set aside and merged back,
a weighted backward, and under DDP gradients kept local while slices run, averaged once.

Entry gradients are *moved* aside (``p.grad = None``), not copied: a failed pass's fresh
gradients are dropped whole, a good one's added to the entry ones (one buffer more at the
peak than plain accumulation where entry gradients exist)."""

from __future__ import annotations

import contextlib
import logging
import operator
import weakref
from contextvars import ContextVar
from typing import Any, Callable, ContextManager, Iterator, Optional

from ..._locks import ForkSafeLock
from ...errors import oom_kind
from .. import _torch_compat as compat
from .._torch_compat import (
    buffers_of,
    non_persistent_buffers,
    parameters_of,
    post_accumulate_grad_hooks,
    version_of,
)
from ..torch import module_tree

log = logging.getLogger("memguard")
SMALL_BUFFER = 4 << 20
"""Bytes up to which a persistent buffer is copied before a step whether or not it is known to
move (see :class:`Buffers`)."""
BUCKET_BYTES = 25 << 20  # DDP's default bucket size: the most the averaging concatenates


def parameters(model: Any) -> list[Any]:
    """The parameters of ``model`` that take gradients; ``TypeError`` for a non-module."""
    import torch

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"auto_microbatch needs the torch.nn.Module being trained, got "
                        f"{type(model).__name__}: {model!r:.80}")
    return [p for p in model.parameters() if p.requires_grad]


Slot = tuple[Any, str]
"""A persistent buffer by where its module holds it: ``(module, name)``."""


def trained(model: Any) -> tuple[list[Any], list[Slot]]:
    """In one walk over ``model``: the parameters that take gradients (same order on every rank)
    and where its persistent buffers are."""
    params: list[Any] = []
    slots: list[Slot] = []
    seen: set[int] = set()
    for module in module_tree((model,)):
        for p in parameters_of(module).values():  # one walk for both
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                if p.requires_grad:
                    params.append(p)
        buffers = buffers_of(module)  # with their owner and persistence
        if buffers:
            skip = non_persistent_buffers(module)  # what state_dict skips
            slots.extend((module, name) for name, b in buffers.items()
                         if b is not None and name not in skip)
    return params, slots


REWALK = 1.0
"""Seconds after which :class:`Walked` walks a model again even though torch's registration
hooks saw no change (a module or parameter written into a module's dictionaries directly)."""

_GENERATION = [0]  # bumped whenever any module registers a parameter, buffer or submodule
_HOOKED: list[Any] = []  # the registration hooks' handles, once registered


def _changed(*_: Any) -> None:
    _GENERATION[0] += 1


class Walked:
    """:func:`trained` for one model, kept between steps: walked again when torch's global
    registration hooks see a change, and at least every :data:`REWALK` seconds. ``known``:
    the parameters' ids; ``hooked``: their post-accumulate-grad hooks.

    What a kept walk misses is caught elsewhere: buffers are read at each step
    (:class:`Buffers`), a new parameter is found by the graph walk (:func:`outside`)."""

    __slots__ = ("model", "generation", "until", "params", "slots", "known", "hooked",
                 "movers")

    def __init__(self, model: Any) -> None:
        self.model = model
        self.generation = -1
        self.until = 0.0
        self.params: list[Any] = []
        self.slots: list[Slot] = []
        self.known: frozenset[int] = frozenset()
        self.hooked: list[tuple[int, Any]] = []  # fused_steps(params)
        # the buffers seen to move in a step (see Buffers), by id
        self.movers: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()

    def get(self, now: float) -> "Walked":
        """Itself, walked again after a change or :data:`REWALK` seconds since ``now``."""
        if self.generation != _GENERATION[0] or now >= self.until:
            self.refresh(now)
        return self

    def refresh(self, now: float) -> None:
        """Walk the model now."""
        if not _HOOKED:
            _hook()
        self.generation = _GENERATION[0]  # before the walk: a change during it walks again
        self.params, self.slots = trained(self.model)
        self.known = frozenset(id(p) for p in self.params)
        self.hooked = fused_steps(self.params)
        self.until = now + REWALK


def _hook() -> None:
    """Register the global hooks that count registrations (once per process)."""
    from torch.nn.modules import module

    with _HOOK_LOCK:
        if not _HOOKED:
            _HOOKED.extend(register(_changed) for register in (
                module.register_module_parameter_registration_hook,
                module.register_module_buffer_registration_hook,
                module.register_module_module_registration_hook))


grads = operator.attrgetter("grad")
"""A tensor's ``.grad``: ``list(map(grads, params))`` is the gradients, with no Python call
per parameter."""


def stash(params: list[Any]) -> list[Any]:
    """Move each parameter's gradient aside; the parameters are left with none."""
    saved = list(map(grads, params))
    if saved.count(None) != len(saved):
        for p in params:
            p.grad = None
    return saved


def drop(params: list[Any]) -> None:
    """Forget the gradients written since :func:`stash`."""
    for p in params:
        p.grad = None


def restore(params: list[Any], saved: list[Any]) -> None:
    """Put the stashed gradients back, dropping any written since."""
    for p, grad in zip(params, saved, strict=True):
        p.grad = grad


def merge(params: list[Any], saved: list[Any]) -> None:
    """Each parameter's gradient becomes stashed + new (in the stashed tensor)."""
    if saved.count(None) == len(saved):  # nothing stashed (zero_grad() before the step)
        return
    pairs = [(p, old) for p, old in zip(params, saved, strict=True) if old is not None]
    import torch

    with torch.no_grad():
        for p, old in pairs:
            if p.grad is not None:
                old.add_(p.grad)
            p.grad = old


def check_loss(loss: Any, who: str) -> None:
    """A clear error unless ``loss`` is a scalar tensor that backward can run from."""
    import torch

    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"{who} must return the loss as a torch.Tensor, got "
                        f"{type(loss).__name__}")
    if loss.numel() != 1:
        raise TypeError(f"{who} must return a scalar loss, got a tensor of shape "
                        f"{tuple(loss.shape)}; reduce it (loss.mean() or loss.sum())")
    if not loss.requires_grad:
        raise RuntimeError(f"{who} returned a loss that does not require grad: is the call "
                           f"inside torch.no_grad() or inference_mode, or is the loss "
                           f"detached?")


def outside(loss: Any, known: "set[int] | frozenset[int]") -> list[Any]:
    """The leaf tensors backward of ``loss`` writes into whose ``id`` is not in ``known`` (a head
    kept out of the model, an input that requires grad), each once."""
    root = loss.grad_fn
    if root is None:  # the loss is itself a leaf: backward writes into it
        return [] if id(loss) in known else [loss]
    found: list[Any] = []
    leaf: Any = _ACCUMULATE[0] if _ACCUMULATE else _accumulate_type()
    seen = {root}
    stack = [root]
    while stack:
        for node, _ in stack.pop().next_functions:
            if node is None or node in seen:
                continue
            seen.add(node)
            if type(node) is not leaf:
                stack.append(node)
            elif id(node.variable) not in known:  # the leaf an AccumulateGrad writes into
                found.append(node.variable)
    return found


_ACCUMULATE: list[type] = []


def _accumulate_type() -> type:
    """The Python type of autograd's ``AccumulateGrad`` nodes (the graph's leaves)."""
    import torch

    _ACCUMULATE[:] = [compat.accumulate_grad_type(torch)]
    return _ACCUMULATE[0]


def is_parameter(tensor: Any) -> bool:
    """Whether ``tensor`` is a ``torch.nn.Parameter``."""
    import torch

    return isinstance(tensor, torch.nn.Parameter)


def describe(tensor: Any) -> str:
    """``"float32[16, 1]"``."""
    return f"{str(tensor.dtype).replace('torch.', '')}{list(tensor.shape)}"


@contextlib.contextmanager
def hooks_held(params: list[Any]) -> Iterator[None]:
    """The parameters' own gradient hooks (``p.register_hook``) held back while memguard's
    passes run backward, for a caller that hands the whole step's gradient over through
    autograd afterwards (Lightning's carrier): there they run once, as in a plain step, not
    once more per pass. The hooks' dictionary is the one autograd reads, emptied and filled
    again in place."""
    held = []
    for p in params:
        hooks = p._backward_hooks  # noqa: SLF001 - a leaf's hooks, read by autograd
        if hooks:
            held.append((hooks, list(hooks.items())))
            hooks.clear()
    try:
        yield
    finally:
        for hooks, items in held:
            added = list(hooks.items())  # registered during the step: kept, after
            hooks.clear()
            hooks.update(items)
            hooks.update(added)


class Generators:
    """torch's random number generators as a step found them: the CPU's and, where their
    runtime has started, every CUDA (ROCm) and XPU device's, and MPS's. A failed pass drew
    from them (Dropout); put back before the batch is redone, the passes that run draw what
    they would have drawn had nothing failed, however many failed: a batch redone whole with
    its activations recomputed draws what plain torch's step draws. ~1 us a step."""

    __slots__ = ("cpu", "devices")

    def __init__(self) -> None:
        import torch

        self.cpu = torch.default_generator.get_state()
        self.devices: list[tuple[Any, Any]] = []
        for module in (torch.cuda, torch.xpu):
            if module.is_initialized():  # never starts a runtime to look  # pragma: gpu
                self.devices.append((module, module.get_rng_state_all()))
        if torch.backends.mps.is_available():  # pragma: gpu
            self.devices.append((torch.mps, torch.mps.get_rng_state()))

    def load(self) -> None:
        """Put the generators back as they were."""
        import torch

        torch.default_generator.set_state(self.cpu)
        for module, state in self.devices:  # pragma: gpu
            if module is torch.mps:
                module.set_rng_state(state)
            else:
                module.set_rng_state_all(state)


class Buffers:
    """What a failed pass must put back of a model's persistent buffers, and only that.

    Copied (one flat tensor per device and dtype): normalisation statistics, buffers of at
    most :data:`SMALL_BUFFER` bytes, and larger ones seen to move before (``movers``). Other
    large buffers are watched by version counter; a failed pass that moved one is warned
    about and it is copied from then on. Lazy buffers a failed pass initialised are reset. An
    out-of-memory while copying falls back to watching, with a warning."""

    def __init__(self, slots: list[Slot],
                 movers: "Optional[weakref.WeakValueDictionary[int, Any]]" = None,
                 who: str = "auto_microbatch") -> None:
        import torch
        from torch.nn.modules.batchnorm import _NormBase
        from torch.nn.parameter import is_lazy

        from ...errors import oom_kind

        self.who = who
        self.movers = movers
        self.slots: list[tuple[Any, str, Any]] = []  # copied: (module, name, entry buffer)
        self.watched: list[tuple[Any, str, Any, int]] = []  # (module, name, buffer, version)
        self.lazy: list[tuple[Any, str]] = []  # uninitialised on entry
        for module, name in slots:
            buffer = buffers_of(module).get(name)  # with its owner
            if buffer is None:
                continue
            if is_lazy(buffer):
                self.lazy.append((module, name))
            elif (buffer.numel() * buffer.element_size() <= SMALL_BUFFER
                  or (module.training and isinstance(module, _NormBase))
                  or (movers is not None and movers.get(id(buffer)) is buffer)):
                self.slots.append((module, name, buffer))
            else:
                self.watched.append((module, name, buffer, _version(buffer)))
        self.copies: dict[int, Any] = {}  # id of the entry buffer: its values on entry
        failed = 0
        try:
            self._copy(torch)
        except Exception as exc:
            if oom_kind(exc) is None:
                raise
            failed = sum(b.numel() * b.element_size() for _, _, b in self.slots)
        if failed:  # outside except: the failed copy's frames are gone
            self.copies = {}
            self.watched.extend((m, n, b, _version(b)) for m, n, b in self.slots)
            self.slots = []
            log.warning("%s: copying the model's %d MiB of moving buffers (running statistics) "
                        "ran out of memory before the step; the step runs without the copy "
                        "(memguard's own bookkeeping, not the batch, did not fit): a pass "
                        "that fails now cannot put those buffers back", who, failed >> 20)

    def _copy(self, torch: Any) -> None:
        groups: dict[tuple, list[Any]] = {}
        seen: set[int] = set()  # a buffer that two modules share is copied once
        for _, _, buffer in self.slots:
            if id(buffer) in seen:
                continue
            seen.add(id(buffer))
            plain = type(buffer) is torch.Tensor and buffer.layout == torch.strided
            key = (buffer.device, buffer.dtype) if plain else ("own", id(buffer))
            groups.setdefault(key, []).append(buffer)
        if not groups:
            return
        with torch.no_grad():
            for tensors in groups.values():  # a subclass (DTensor) or sparse one: a clone
                if len(tensors) == 1:
                    self.copies.update((id(t), t.clone()) for t in tensors)
                    continue
                flat = torch.cat([t.reshape(-1) for t in tensors])
                offset = 0
                for t in tensors:
                    self.copies[id(t)] = flat[offset:offset + t.numel()].view_as(t)
                    offset += t.numel()

    def _moved(self) -> list[tuple[Any, str, Any]]:
        """The watched buffers that moved since entry: ``(module, name, current tensor)``."""
        moved = []
        for module, name, buffer, version in self.watched:
            current = buffers_of(module).get(name)  # with its owner
            if current is not buffer or _version(buffer) != version:
                moved.append((module, name, current))
        return moved

    def learn(self) -> None:
        """After a good pass: the watched buffers it moved are copied from the next step on."""
        if self.movers is None or not self.watched:
            return
        for _, _, current in self._moved():
            if current is not None:
                self.movers[id(current)] = current

    def load(self) -> None:
        """Put the copied buffers back in place, reset lazy ones the pass initialised, warn of
        watched buffers that moved."""
        import torch
        from torch.nn.parameter import is_lazy

        with torch.no_grad():
            for module, name, buffer in self.slots:
                saved = self.copies[id(buffer)]
                current = buffers_of(module).get(name)  # with the owner
                if current is buffer:
                    buffer.copy_(saved)
                else:
                    buffers_of(module)[name] = saved.clone()  # with the owner
        stayed = []
        reset: set[int] = set()
        for module, name in self.lazy:
            current = buffers_of(module).get(name)  # with the owner
            if current is None or is_lazy(current) or id(module) in reset:
                continue
            if callable(getattr(module, "reset_running_stats", None)):
                reset.add(id(module))  # as initialised: zeros, ones, no batch counted
                module.reset_running_stats()
            else:
                stayed.append(f"{type(module).__name__}.{name}")
        for module, name, current in self._moved():
            stayed.append(f"{type(module).__name__}.{name}")
            if self.movers is not None and current is not None:
                self.movers[id(current)] = current
        if stayed:
            log.warning("%s: the failed pass moved %d buffer(s) memguard had not copied (%s): "
                        "their moves stay; memguard copies them from the next step on",
                        self.who, len(stayed), ", ".join(stayed[:4]))


def _version(tensor: Any) -> int:
    """``tensor``'s version counter; -1 for an inference tensor (which has none)."""
    try:
        return int(version_of(tensor))
    except RuntimeError:
        return -1


Held = Optional[list[Optional[tuple[Any, int]]]]
"""The gradients on entry, left on the parameters: a weak reference and the version counter of
each (``None`` for a parameter without one); ``None`` when no parameter holds one."""


def hold(params: list[Any]) -> Held:
    """The entry gradients, left in place and weakly referenced (a ``zero_grad()`` frees them as
    in plain torch), for :func:`settle` to tell what the first call did."""
    now = list(map(grads, params))
    if now.count(None) == len(now):
        return None
    return [None if g is None else (weakref.ref(g), version_of(g))
            for g in now]


def settle(params: list[Any], held: Held) -> tuple[list[Any], int, int]:
    """After the step function's first call: the gradients as it left them become the entry
    gradients, moved aside (``None`` after ``zero_grad()``, zeros after
    ``zero_grad(set_to_none=False)``). Returns them and two counts: gradients that appeared or
    were replaced (their entry put back), and gradients changed in place to other than zeros."""
    now = list(map(grads, params))
    if now.count(None) == len(now):  # none on entry and none now, or all cleared
        return now, 0, 0
    appeared = 0
    changed: list[Any] = []
    for i, g in enumerate(now):
        if g is None:
            continue
        mark = held[i] if held is not None and i < len(held) else None
        if mark is None or mark[0]() is not g:
            appeared += 1
            now[i] = None if mark is None else mark[0]()  # the entry, if it still exists
        elif version_of(g) != mark[1]:
            changed.append(g)
    for p in params:
        p.grad = None
    return now, appeared, _nonzero(changed) if changed else 0


def _nonzero(tensors: list[Any]) -> int:
    """How many of ``tensors`` hold anything but zeros (one synchronisation per device)."""
    import torch

    by_device: dict[Any, list[Any]] = {}
    for t in tensors:
        values = compat.sparse_values(t) if t.is_sparse else t
        by_device.setdefault(values.device, []).append(values.ne(0).any())
    with torch.no_grad():
        return sum(int(torch.stack(flags).sum().item()) for flags in by_device.values())


def present(params: list[Any]) -> int:
    """How many of ``params`` hold a gradient."""
    now = list(map(grads, params))
    return len(now) - now.count(None)


def fused_steps(params: list[Any], ddp: Any = None) -> list[tuple[int, Any]]:
    """The post-accumulate-grad hooks on ``params`` as ``(index, hook)``, DDP's own left out."""
    found: list[tuple[int, Any]] = []
    for i, p in enumerate(params):
        hooks = post_accumulate_grad_hooks(p)
        if hooks:
            found.extend((i, hook) for hook in hooks.values())
    if found and ddp is not None:
        own = {id(hook) for handle in getattr(ddp, compat.DDP_ACCUMULATE_HOOKS, ())
               for hook in _handle_hooks(handle)}
        found = [(i, hook) for i, hook in found if id(hook) not in own]
    return found


def _handle_hooks(handle: Any) -> list[Any]:
    """The hook a ``RemovableHandle`` stands for (none once removed)."""
    hooks = handle.hooks_dict_ref()
    return [hooks[handle.id]] if hooks is not None and handle.id in hooks else []


def hook_name(hook: Any) -> str:
    """A hook's readable name (a ``functools.partial``'s function's)."""
    func = getattr(hook, "func", hook)
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)


REFUSED: ContextVar[Optional[tuple["set[int] | frozenset[int]", str]]] = ContextVar(
    "memguard_refused_steps", default=None)
"""While set to ``(ids, message)`` (after :func:`refuse_steps`), in this thread or task, an
optimizer that holds one of the tensors whose ``id`` is in ``ids`` raises
``RuntimeError(message)`` before it steps; ``REFUSED.set`` and ``REFUSED.reset`` start and
end it."""
_HOOK_LOCK = ForkSafeLock()
_hooked = False


def _refuse_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    refused = REFUSED.get()
    if refused is None:
        return
    ids, message = refused
    if any(id(p) in ids for group in optimizer.param_groups for p in group["params"]):
        raise RuntimeError(message)


def refuse_steps() -> None:
    """Make :data:`REFUSED` work: one global optimizer pre-step hook, registered once."""
    global _hooked
    if not _hooked:
        with _HOOK_LOCK:
            if not _hooked:
                from torch.optim.optimizer import register_optimizer_step_pre_hook

                register_optimizer_step_pre_hook(_refuse_step)
                _hooked = True


def backward(loss: Any, weight: float, scaler: Any, total: Any) -> Any:
    """``(loss * weight).backward()`` (through ``scaler`` if given); ``total`` plus the weighted
    loss, detached."""
    if weight != 1.0:
        loss = loss * weight
    (scaler.scale(loss) if scaler is not None else loss).backward()
    value = loss.detach()
    if value.dim():  # a loss of shape [1]
        value = value.reshape(())
    return value if total is None else total + value


REPLICA_SAMPLES = 64  # parameters sampled, two values each (first and last element)


def replica_values(ddp: Any) -> tuple[list[str], list[float]]:
    """A sample of a DDP model's weights (first and last value of up to
    :data:`REPLICA_SAMPLES` parameters, with names), equal on every rank while they agree."""
    import torch

    named = [(name, p) for name, p in ddp.module.named_parameters() if p.numel()]
    if not named:
        return [], []
    chosen = named[::max(1, len(named) // REPLICA_SAMPLES)][:REPLICA_SAMPLES]
    with torch.no_grad():
        ends = [t for _, p in chosen for t in (p.detach().reshape(-1)[0],
                                               p.detach().reshape(-1)[-1])]
        values = torch.stack([t.to(ends[0].device) for t in ends]).double().cpu().tolist()
    return [name for name, _ in chosen for _ in (0, 1)], values


def reset_scaler(scaler: Any) -> None:
    """Forget what ``scaler`` recorded for the optimizers during a failed pass."""
    states = getattr(scaler, compat.SCALER_OPTIMIZER_STATES, None)
    if states:
        states.clear()


def ddp_of(model: Any) -> Optional[Any]:
    """``model`` when it is a ``DistributedDataParallel``, else ``None``."""
    import torch

    ddp = torch.nn.parallel.DistributedDataParallel
    return model if isinstance(model, ddp) else None


def comm_hooks(ddp: Any) -> list[str]:
    """The names of the communication hooks on a DDP model (empty for none or ``None``)."""
    hooks = getattr(ddp, compat.DDP_COMM_HOOKS, None) or []
    names = [getattr(hook, "__qualname__", None) or repr(hook) for hook, _ in hooks]
    if names or ddp is None:
        return names
    # a built-in C++ hook (``_register_builtin_comm_hook``) leaves no Python object: DDP's
    # logger records its name, as it does for every hook
    logged = getattr(ddp, compat.DDP_LOGGING_DATA, None)
    name = logged().get("comm_hook") if callable(logged) else None
    return [str(name)] if name else []


def static_graph(ddp: Any) -> bool:
    """Whether a DDP model was built with ``static_graph=True``."""
    return bool(getattr(ddp, "static_graph", False))


def group_size(ddp: Any) -> int:
    """The number of ranks of ``ddp``'s process group."""
    import torch.distributed as dist

    return dist.get_world_size(ddp.process_group)


def local_gradients(ddp: Optional[Any]) -> ContextManager[bool]:
    """Run the block with ``ddp`` neither reducing gradients nor broadcasting buffers (collectives
    a peer's out-of-memory would leave unmatched); buffers are broadcast from the first rank on
    entry instead.

    Yields whether DDP would have synchronised this step (``False`` inside ``no_sync()``)."""
    return contextlib.nullcontext(False) if ddp is None else _local_gradients(ddp)


@contextlib.contextmanager
def _local_gradients(ddp: Any) -> Iterator[bool]:
    import torch.distributed as dist

    syncs = bool(ddp.require_backward_grad_sync)
    forward_sync = ddp.require_forward_param_sync
    if syncs and forward_sync and getattr(ddp, "broadcast_buffers", False):
        source = dist.get_global_rank(ddp.process_group, 0)
        for buffer in ddp.module.buffers():
            dist.broadcast(buffer, src=source, group=ddp.process_group)
    ddp.require_backward_grad_sync = False
    ddp.require_forward_param_sync = False
    try:
        yield syncs
    finally:
        ddp.require_backward_grad_sync = syncs
        ddp.require_forward_param_sync = forward_sync


def presence(params: list[Any], saved: list[Any]) -> list[int]:
    """1 for each parameter that has a gradient (stashed or new), else 0."""
    return [int(p.grad is not None or old is not None)
            for p, old in zip(params, saved, strict=True)]


def average(params: list[Any], present: list[int], group: Any,
            agree: Optional[Callable[[list[int]], list[int]]] = None) -> bool:
    """Average the gradients over ``group`` as DDP would (a parameter with a gradient on some rank
    gets one on all), in buckets of at most ``BUCKET_BYTES`` by device and dtype.

    With ``agree``, the ranks first agree that every rank could allocate the buckets; where one
    could not, all reduce each gradient in place instead, so no rank is left in an unmatched
    collective. Returns whether the buckets served."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size(group)
    grads = []
    with torch.no_grad():
        for p, anywhere in zip(params, present, strict=True):
            if not anywhere:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if p.grad.is_sparse:
                raise NotImplementedError("auto_microbatch cannot average sparse gradients "
                                          "over DDP ranks; use dense embeddings")
            grads.append(p.grad)
        buckets: dict[tuple, list[list[Any]]] = {}
        filled: dict[tuple, int] = {}
        for grad in grads:
            key, size = (grad.device, grad.dtype), grad.numel() * grad.element_size()
            chain = buckets.setdefault(key, [[]])
            if chain[-1] and filled[key] + size > BUCKET_BYTES:
                chain.append([])
                filled[key] = 0
            chain[-1].append(grad)
            filled[key] = filled.get(key, 0) + size
        bucketed = [bucket for chain in buckets.values() for bucket in chain]
        flats: list[Any] = []
        failed = False
        try:
            flats.extend(torch.cat([g.reshape(-1) for g in bucket]) for bucket in bucketed)
        except Exception as exc:
            if agree is None or oom_kind(exc) is None:
                raise
            failed = True  # decided inside except; the buckets are dropped outside it
        if failed:
            flats.clear()
        if agree is not None and agree([int(failed)])[0]:
            flats.clear()
            for grad in grads:  # in place: nothing allocated
                grad.div_(world)
                dist.all_reduce(grad, group=group)
            return False
        for bucket, flat in zip(bucketed, flats, strict=True):
            flat.div_(world)
            dist.all_reduce(flat, group=group)
            offset = 0
            for g in bucket:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        return True
