"""``auto_microbatch``: a training step that survives out-of-memory by redoing the same batch in
slices, with gradients accumulated exactly and, under DDP or FSDP2, no rank left waiting in a
collective.

One call: the entry gradients stay in place for the step function's first call (a
``zero_grad()`` there clears them), then are moved aside; movable persistent buffers are copied.
A pass runs forward and backward on each slice (the whole batch first), each slice's loss
weighted by its share, without DDP's reduction or buffer broadcast. An out-of-memory is
recognised inside ``except``; outside it the pass's gradients are dropped, the buffers and
torch's random number generators put back, memory freed, and the pass redone in smaller
slices. Ranks agree after every pass on memguard's gloo group; at the end the new gradients are
added to the entry ones and averaged once where DDP would have. Under FSDP2 reduction is held
back and ranks exchange a flag before each unit's all-gathers (``backends/steps/torch_fsdp.py``).
Calls on one model are serialised."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import math
import time
import weakref
from typing import (
    Any,
    Callable,
    Concatenate,
    ContextManager,
    Iterator,
    Literal,
    Optional,
    ParamSpec,
    Protocol,
    TypeVar,
    overload,
)

from ._checks import flag, optional_positive_int
from ._decorate import function_kind, name_of, with_statistics
from ._locks import ForkSafeLock
from ._slices import Plan, batch_elements, plan_batch
from .backends import torch_distributed
from .backends.steps import (
    torch_fsdp,
    torch_offload,
    torch_recompute,
    torch_training as training,
)
from .cleanup import free_memory
from .distributed import OK, Agreement, Sync
from .errors import MemguardError, OutOfMemoryError, oom_kind
from .loop import (
    NO_OPINION,
    Attempt,
    Factor,
    GuardState,
    Loop,
    Policy,
    Unit,
    enter_attempt,
    exhausted,
    leave_attempt,
    running,
)
from .sizes import Gauge

log = logging.getLogger("memguard")
P = ParamSpec("P")
R_co = TypeVar("R_co", covariant=True)
Q = ParamSpec("Q")
R = TypeVar("R")
S = TypeVar("S")
W = TypeVar("W")
Reduction = Literal["mean", "sum"]


class MicrobatchedFunction(Protocol[P, R_co]):
    """What ``@auto_microbatch(model)`` returns: the step, called as before, with its statistics.

    Attributes:
        microbatch_size: the slice size that fitted (``None`` until a batch was split).
        history: the last call's :class:`Attempt` records (``unit="microbatch"``).

    >>> import torch, memguard
    >>> model = torch.nn.Linear(4, 1)
    >>> @memguard.auto_microbatch(model)
    ... def loss_of(batch):
    ...     return model(batch).pow(2).mean()
    >>> loss = loss_of(torch.ones(8, 4))
    >>> loss_of.microbatch_size is None, loss.requires_grad, model.weight.grad is not None
    (True, False, True)
    """

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R_co: ...

    # a decorated method, read from an instance, is bound as the function would be
    @overload
    def __get__(self: W, instance: None, owner: Any, /) -> W: ...
    @overload
    def __get__(self: MicrobatchedFunction[Concatenate[S, Q], R], instance: S, owner: Any, /
                ) -> MicrobatchedFunction[Q, R]: ...

    @property
    def microbatch_size(self) -> Optional[int]: ...

    @property
    def history(self) -> list[Attempt]: ...

    def reset(self, microbatch_size: Optional[int] = None) -> None:
        """Forget the microbatch size and the last call's attempts.

        Args:
            microbatch_size: the slice size to start from instead, in samples (one learned
                before, kept with a checkpoint). Default ``None``: the whole batch first.
        """


class _Config:
    def __init__(self, func: Callable[..., Any], model: Any, policy: Policy, reduction: str,
                 grow_every: Optional[int], scaler: Any, sharded: bool,
                 weight: Optional[Callable[[Any], Any]] = None,
                 recompute: bool = True,
                 cost: Optional[Callable[[Any], Any]] = None, offload: bool = True) -> None:
        self.name = name_of(func)
        self.called = f"{self.name}()"
        target = getattr(func, "__func__", func)
        self.names = list(inspect.signature(target).parameters)
        if not self.names:
            raise TypeError(f"auto_microbatch: {self.name}() takes no argument; its first "
                            f"parameter receives the batch")
        self.model = model
        self.policy = policy
        self.reduction = reduction
        self.weight = weight
        # a weight's slices must add up to its batch, but for the trainers' own, which weighs
        # a loss already divided by the whole batch's count at 1 a slice (ADDS_UP)
        self.weight_adds_up = getattr(weight, ADDS_UP, True)
        self.cost = cost
        self.recompute = recompute
        if recompute:
            torch_recompute.prepare(model)  # while memory is plentiful, not in the rung
        self.offload = offload
        self.grow_every = grow_every
        self.scaler = scaler
        # FSDP's forward gathers parameters into tensors of its own: they are the graph's
        # leaves, not strangers to the model
        self.sharded = sharded
        self.ddp = training.ddp_of(model)
        self.walked = training.Walked(model)  # the model's parameters, kept between calls
        training.refuse_steps()
        # no DDP or FSDP model, and no agreement asked for: a call may take _Step.whole
        self.alone = self.ddp is None and not sharded and policy.sync is not True
        self.refusal = (f"{self.name}() called optimizer.step() on the parameters "
                        f"auto_microbatch accumulates gradients for: auto_microbatch runs "
                        f"backward itself, in slices when the batch does not fit, so inside "
                        f"the step function the gradients are absent or partial; call "
                        f"optimizer.step() after the decorated function returns")

    def split_arguments(self, instance: Any, args: tuple, kwargs: dict) -> tuple[Any, tuple,
                                                                                dict]:
        """The batch, and the other arguments to pass to every slice's call."""
        if args:
            return args[0], args[1:], kwargs
        name = self.names[1 if instance is not None and len(self.names) > 1 else 0]
        if name in kwargs:
            rest = dict(kwargs)
            return rest.pop(name), (), rest
        raise TypeError(f"{self.name}() needs the batch as its first argument")


class _State(GuardState):
    """What a step remembers between calls: the slice size and cost that fitted, the clean
    steps since an out-of-memory, the last call's attempts, the tensors warned about."""

    def __init__(self) -> None:
        # the last call's attempts; (size, seconds) for a call that ran the whole batch in
        # one pass (its record made when asked for), written under the model's lock
        self.last: "list[Attempt] | tuple[int, float]" = []
        super().__init__()
        # the parameters outside the model warned about, by id
        self.warned: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
        self.warned_other = False  # a tensor outside that is not a parameter (an input)
        self.plan: Optional[Plan] = None  # the last batch's
        self.calls = 0  # under DDP: the calls made, for the weights' comparison

    @property
    def history(self) -> list[Attempt]:
        last = self.last
        if isinstance(last, tuple):  # its record, made when asked for
            size, seconds = last
            return [Attempt(size=size, ok=True, unit="microbatch", steps=1, seconds=seconds)]
        return last

    @history.setter
    def history(self, attempts: list[Attempt]) -> None:
        self.last = attempts

    def forget(self) -> None:
        self.microbatch_size: Optional[int] = None
        # what a slice of microbatch_size cost (see _cost) where it fitted: the unit a later
        # batch is cut in, whatever its samples cost
        self.slice_cost: Optional[float] = None
        self.clean_steps = 0

    def reset(self, microbatch_size: Optional[int] = None) -> None:
        """Forget the size that fitted and the last attempts; start from ``microbatch_size``."""
        if microbatch_size is not None:
            optional_positive_int(microbatch_size, "microbatch_size", who="reset")
        super().reset()
        with self.lock:
            self.microbatch_size = microbatch_size
            self.slice_cost = None


_MODELS_LOCK = ForkSafeLock()
# by the model's id (a module need not be hashable); an entry lives while a step function
# decorated for the model does
_MODEL_LOCKS: "weakref.WeakValueDictionary[int, ForkSafeLock]" = weakref.WeakValueDictionary()


def _model_lock(model: Any) -> ForkSafeLock:
    """The re-entrant lock serialising steps on ``model``, shared with the module a DDP wraps and
    with any model sharing a parameter (so gradients add up one step at a time)."""
    ddp = training.ddp_of(model)
    key = ddp.module if ddp is not None else model
    params = training.parameters(key)
    with _MODELS_LOCK:
        lock = _MODEL_LOCKS.get(id(key))
        if lock is None:
            lock = next((found for p in params
                         if (found := _MODEL_LOCKS.get(-id(p))) is not None), None)
        if lock is None:
            lock = ForkSafeLock(reentrant=True)
        _MODEL_LOCKS[id(key)] = lock
        for p in params:  # by the parameter's id, negated: apart from the models' ids
            _MODEL_LOCKS.setdefault(-id(p), lock)
        return lock


class _Step(Loop):
    """One call: its passes over the batch (the loop's attempts)."""

    unit: Unit = "microbatch"
    peers: Literal["redo", "wait"] = "wait"
    per_sample: Any  # the batch's cost per sample (see _per_sample), or _UNREAD

    def __init__(self, cfg: _Config, state: _State, batch: Any, plan: Plan,
                 planned: tuple[Optional[int], Any]) -> None:
        """``planned``: what :func:`_planned` said of this batch."""
        self._prepare(cfg, state, batch, plan)
        n = self.samples
        remembered, self.per_sample = planned
        with state.lock:
            grow = (cfg.grow_every is not None and remembered is not None and remembered < n
                    and state.clean_steps >= cfg.grow_every)
        size = remembered if remembered is not None and remembered < n else n
        self.fallback: Optional[int] = None
        if grow:
            factor = cfg.policy.factor
            larger = math.ceil(size / factor) if isinstance(factor, float) else size * 2
            self.fallback, size = size, min(n, larger)
            log.info("%s: %d clean steps at microbatch_size=%d; trying %d", cfg.name,
                     state.clean_steps, self.fallback, size)
        self._start(size)

    def _prepare(self, cfg: _Config, state: _State, batch: Any, plan: Plan,
                 found: Optional[tuple[list[Any], list[training.Slot], set[int], int]] = None
                 ) -> None:
        """What a pass needs; ``found``: the parameters, buffers, ids and count (:meth:`whole`)."""
        self.cfg, self.state, self.batch, self.plan = cfg, state, batch, plan
        self.who = cfg.name
        self.samples = self.size = int(plan.length or 0)
        self.per_sample = _UNREAD
        self.fallback = None
        self.recomputing = False  # this batch's passes recompute activations (torch_recompute)
        # this batch's passes keep saved tensors in pinned host memory of this accelerator
        # (torch_offload), None when they do not
        self.offloading: Optional[str] = None
        self.host_oom = False  # the last failure was the host's memory running out
        if found is None:
            params, slots = training.trained(cfg.model)
            hooked = training.fused_steps(params, cfg.ddp)
            if hooked:
                raise _fused_step_error(cfg, params, hooked)
            found = params, slots, {id(p) for p in params}, len(params)
        # the model's own parameters (what DDP averages) and those found outside it, by id
        self.params, self.slots, self.known, self.shared = found
        self.buffers: Optional[training.Buffers] = None
        self.generators: Optional[training.Generators] = None
        # the gradients on entry: left on the parameters (held) until the step function's
        # first call returns, then moved aside (entry) as that call left them
        self.held: training.Held = None
        self.entry: list[Any] = []
        self.settled = False
        self.syncs = False  # a DDP model's reduction is held back: agree on its flags too

    def _start(self, size: int) -> None:
        """The loop over the passes, from ``size``; the model's wrappers checked."""
        cfg, state = self.cfg, self.state
        super().__init__(cfg.name, size, cfg.policy, owner=state)
        with state.lock:
            state.history = self.attempts
        self.ddp = cfg.ddp
        hooks = training.comm_hooks(self.ddp)
        if hooks:
            raise NotImplementedError(
                f"auto_microbatch: {cfg.name}'s DDP model has a communication hook registered "
                f"({', '.join(hooks)}); auto_microbatch keeps gradients local while its slices "
                f"run and averages them itself once per step, which would skip the hook "
                f"silently. Register no hook on a model auto_microbatch steps, or step it "
                f"without auto_microbatch")
        if self.ddp is not None and training.static_graph(self.ddp):
            raise NotImplementedError(
                f"auto_microbatch: {cfg.name}'s DDP model was built with static_graph=True; "
                f"DDP's static graph expects its gradient reduction in every backward, and "
                f"auto_microbatch holds it back while its slices run (torch aborts the "
                f"process at the first out-of-memory). Build the model with "
                f"DistributedDataParallel(..., static_graph=False) (the default)")
        world = torch_distributed.world() if self.ddp is not None else None
        if self.ddp is not None and self.agreement.active and world is not None \
                and training.group_size(self.ddp) != world[1]:
            raise NotImplementedError(
                f"auto_microbatch: {cfg.name}'s DDP model runs on a process group of "
                f"{training.group_size(self.ddp)} ranks while the job has {world[1]}; ranks "
                f"agree over the whole job, so the DDP group must span it")
        # FSDP2: every rank runs every all-gather, so all redo a failed pass, at one size
        self.fsdp = torch_fsdp.Sharding(cfg.model) if cfg.sharded else None
        self.watching = self.fsdp is not None and self.agreement.active
        self.told: Optional[tuple[int, int]] = None  # an agreement already made at a check
        self.most = self.samples  # the longest batch over the ranks (FSDP2: the same passes)
        self.culprit: Optional[int] = None  # the lowest rank that failed, where known
        self.stopped = False  # this rank's pass ended at a check point: a peer's failure
        self.world = world[1] if world is not None else 1
        if self.watching:
            self.peers = "redo"
            self._share_lengths()

    def _share_lengths(self) -> None:
        """FSDP2 with several ranks: every rank runs as many passes (the longest batch and the
        smallest remembered size decide; see :meth:`_bounds`)."""
        world = torch_distributed.world()
        self.world = world[1] if world is not None else 1
        n = self.samples
        size = self.size if self.size < n else NO_OPINION
        most, negative = self.agreement.all_max([n, -size])
        self.most = most
        self.size = min(-negative, most)

    @classmethod
    def whole(cls, cfg: _Config, state: _State, batch: Any, plan: Plan,
              wrapped: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """The common case (:func:`_whole_fits`): one pass over the whole batch with no loop objects
        made; on out-of-memory the loop resumes as if this were its first attempt."""
        started = time.perf_counter()
        walked = cfg.walked.get(started)
        params = walked.params
        shared = len(params)  # the model's own
        known: "set[int] | frozenset[int]" = walked.known
        gauge = Gauge(cfg.name) if cfg.policy.factor == "auto" else None
        if gauge is not None:
            gauge.start()
        gave_up: dict[Any, int] = {}  # what loops nested in the pass give up at
        if walked.hooked:  # read at the walk: walked again, in case they were removed since
            walked.refresh(started)
            params = walked.params
            if walked.hooked:
                raise _fused_step_error(cfg, params, walked.hooked)
        held = training.hold(params)  # left in place: a zero_grad() in the call clears them
        entry: Optional[list[Any]] = None  # once the call returned
        buffers = None
        generators = training.Generators()  # before any draw: a redo draws the same
        try:
            if walked.slots:
                buffers = training.Buffers(walked.slots, walked.movers, cfg.name)
                started = time.perf_counter()
            token = enter_attempt(state, gave_up)
            try:
                refused = training.REFUSED.set((known, cfg.refusal))
                try:
                    loss = wrapped(batch, *args, **kwargs)
                finally:
                    training.REFUSED.reset(refused)
                entry, appeared, changed = training.settle(params, held)
                if appeared or changed:
                    raise _changed_error(cfg, len(params), appeared, changed)
                training.check_loss(loss, cfg.called)
                found = training.outside(loss, known)
                if found:
                    params, entry, known = _adopt(cfg, state, found, params, entry, known)
                total = training.backward(loss, 1.0, cfg.scaler, None)
            finally:
                leave_attempt(token)
        except BaseException as exc:
            if entry is None:  # the call raised: what it did to the gradients stands
                entry = training.settle(params, held)[0]
            if not (isinstance(exc, Exception) and oom_kind(exc) is not None):
                training.restore(params, entry)
                state.history = []
                raise
            own: Optional[BaseException] = None  # memguard's own error while recovering
            try:
                step = cls.__new__(cls)
                step._prepare(cfg, state, batch, plan,  # noqa: SLF001 - its own class's
                              (list(params), walked.slots, set(known), shared))
                step.entry, step.buffers, step.settled = entry, buffers, True
                step.generators = generators
                step._start(step.samples)  # noqa: SLF001 - its own class's
                step.gauge, step.gave_up, step.started = gauge, gave_up, started
                # recorded, frames dropped, the next size proposed (a factor that returns
                # an invalid size raises here)
                resumes = step._exit(exc)  # noqa: SLF001 - its own class's
            except BaseException as error:  # noqa: BLE001 - raised below, after the restore
                resumes, own = False, error
            if not resumes:  # the entry gradients, buffers and generators as they were
                training.restore(params, entry)
                if buffers is not None:
                    buffers.load()
                generators.load()
                state.history = []
                if own is not None:
                    raise own from exc
                raise
        else:
            seconds = time.perf_counter() - started
            if entry.count(None) != len(entry):  # gradients held on entry: add them
                training.merge(params, entry)
            if buffers is not None and buffers.watched:
                buffers.learn()
            state.last = (plan.length or 0, seconds)  # the history, made when asked for
            state.clean_steps += 1
            return total
        return step.run(wrapped, args, kwargs, resumed=True)

    def slices(self) -> int:
        return math.ceil(self.most / self.size)

    def _bounds(self) -> list[tuple[int, int, bool]]:
        """Each slice as ``(start, stop, stand_in)``; where another rank's batch is longer (FSDP2),
        missing slices are stand-ins (the first sample at weight 0) so every rank joins the same
        collectives."""
        n, size, count = self.samples, self.size, self.slices()
        if count * size - size < n:  # the usual cut gives as many slices
            return [(start, min(n, start + size), False) for start in range(0, n, size)]
        bounds = [(i * n // count, (i + 1) * n // count, False) for i in range(count)]
        return [(a, b, False) if b > a else (0, 1, True) for a, b, _ in bounds]

    # -- FSDP2 -----------------------------------------------------------------------------
    def _sharding(self) -> ContextManager[None]:
        """FSDP2: gradient reduction held back and, with several ranks, a check before each
        unit's all-gathers."""
        return contextlib.nullcontext() if self.fsdp is None else self._sharded()

    @contextlib.contextmanager
    def _sharded(self) -> Iterator[None]:
        fsdp = self.fsdp
        assert fsdp is not None
        fsdp.hold()
        if self.watching:
            fsdp.watch(self._check)
        try:
            yield
        finally:
            fsdp.unwatch()
            fsdp.release()

    def _check(self) -> None:
        """Before an FSDP unit's all-gather: the end-of-pass exchange, so a peer's failure is met
        here, not in a collective it never joins; the outcome serves this pass's agreement."""
        if self.told is None:
            values = self.agreement.all_max([OK, -NO_OPINION, *self._flags(False)])
            if values[0] == OK:
                return
            self.flags = values[2:-1]
            self.culprit = self.world - values[-1] if values[-1] else None
            self.told = (values[0], -values[1])
        who = "another rank" if self.culprit is None else f"rank {self.culprit}"
        self.stopped = True
        raise OutOfMemoryError(f"{self.cfg.name}: {who} ran out of memory (or failed) in "
                               f"this pass; every rank redoes it")

    def _agree(self, status: int, proposal: int) -> tuple[int, int]:
        told, self.told = self.told, None
        if told is not None:  # exchanged at a check point during the pass
            return told
        agreed = super()._agree(status, proposal)
        if self.watching:  # the failing rank's mark, last
            mark = self.flags.pop() if self.agreement.active else 0
            self.culprit = self.world - mark if mark else None
        return agreed

    # -- the call --------------------------------------------------------------------------
    def run(self, wrapped: Callable[..., Any], args: tuple, kwargs: dict, *,
            resumed: bool = False) -> Any:
        """The passes and what follows; ``resumed``: after :meth:`whole`'s failed pass."""
        if not resumed:
            self.held = training.hold(self.params)
        fsdp = self.fsdp
        unsharded = fsdp.stash() if fsdp is not None else []
        total = None
        try:
            with training.local_gradients(self.ddp) as syncs, self._sharding():
                self.syncs = syncs
                if not resumed:
                    # after DDP's broadcast
                    self.buffers = training.Buffers(self.slots, self.cfg.walked.movers,
                                                    self.cfg.name)
                    self.generators = training.Generators()
                for attempt in self:
                    with attempt:
                        total = self._pass(wrapped, args, kwargs)
            if fsdp is not None:
                fsdp.merge(unsharded)
                if fsdp.syncs:  # held back during the passes: once, now, on every rank
                    fsdp.reduce()
            training.merge(self.params, self.entry)
            if self.buffers is not None:
                self.buffers.learn()
        except BaseException:
            if fsdp is not None:
                fsdp.reset()
                fsdp.restore(unsharded)
            if not self.settled:  # before the step function ever ran
                self._settle_entry(strict=False)
            training.restore(self.params, self.entry)
            raise
        if syncs and self.ddp is not None:  # a DDP model's reduction was held back
            agree = self.agreement.all_max if self.agreement.active else None
            if not training.average(self.params[:self.shared], self.flags,
                                    self.ddp.process_group, agree):
                log.warning("%s: out of memory allocating the buckets that average the "
                            "gradients on some rank; averaged each gradient in place instead",
                            self.cfg.name)
        self._remember()
        return total

    def _pass(self, wrapped: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Forward and backward of every slice; the summed weighted loss, detached."""
        if not self.recomputing and self.offloading is None:
            return self._slices(wrapped, args, kwargs)
        with contextlib.ExitStack() as rungs:
            if self.offloading is not None:  # outermost: checkpoint's own hooks nest inside
                rungs.enter_context(torch_offload.offloading(self.offloading))
            if self.recomputing:
                rungs.enter_context(torch_recompute.recomputing(self.cfg.model))
            return self._slices(wrapped, args, kwargs)

    def _slices(self, wrapped: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        cfg, n = self.cfg, self.samples
        self.stopped = False
        if self.slices() == 1:
            return self._backward(self._call(wrapped, self.batch, args, kwargs), 1.0, None)
        total = None
        bounds = self._bounds()
        where: Optional[tuple[int, int]] = None  # the slice running
        try:
            counts = None  # what ``weight`` says each slice's loss averages over
            if cfg.weight is not None and cfg.reduction != "sum":
                counts = self._counts(bounds, cfg.weight_adds_up)
            for index, (start, stop, stand_in) in enumerate(bounds):
                where = None
                piece = self.plan.cut(self.batch, start, stop)
                where = (start, stop)
                if stand_in:
                    weight = 0.0
                elif cfg.reduction == "sum":
                    weight = 1.0
                elif counts is not None:
                    weight = counts[index]
                else:
                    weight = (stop - start) / n
                loss = self._call(wrapped, piece, args, kwargs)
                if weight == 0:
                    # nothing in this slice that the loss averages over (every label -100): it
                    # adds nothing, and its loss, a mean over nothing, is NaN, as backward of it
                    # may be. FSDP runs that backward anyway (every rank must join its
                    # collectives), and both drop what it adds
                    if cfg.sharded:
                        self._backward(loss, weight, None)
                    else:
                        training.check_loss(loss, cfg.called)
                    continue
                total = self._backward(loss, weight, total)
            return total
        except Exception as exc:
            if oom_kind(exc) is None:  # an error only a slice meets: say it was one
                self._tell_cut(exc, where)
            raise

    def _tell_cut(self, exc: BaseException, where: Optional[tuple[int, int]]) -> None:
        """Add to an error raised while the batch ran in slices (the step function on a slice,
        a refusal to cut the batch) a note of the cut and why it was made: a function that
        counts on the whole batch (a shape written out) fails only on a slice."""
        if not hasattr(exc, "add_note"):  # Python 3.10: the log has it
            return
        failed = [a.size for a in self.attempts if not a.ok]
        why = (f"after an out-of-memory at microbatch_size={failed[-1]}" if failed else
               "as the slices that fitted before say this batch needs")
        if where is None:
            exc.add_note(f"memguard: raised while cutting a batch of {self.samples} into "
                         f"slices of {self.size} for {self.cfg.name}, {why}")
        else:
            exc.add_note(f"memguard: raised on samples {where[0]}:{where[1]} of a batch of "
                         f"{self.samples} that {self.cfg.name} ran in slices of {self.size}, "
                         f"{why} (its history lists the passes)")

    def _counts(self, bounds: list[tuple[int, int, bool]], adds_up: bool) -> list[float]:
        """Each slice's share of what ``weight`` says the batch's loss averages over, read
        before any slice runs: the slices' counts must add up to the batch's, or no weighting
        of the slices' losses gives the batch's (a weight that returns a constant or a mean)."""
        whole = self._weight_of(self.batch)
        parts = [0.0 if stand_in else self._weight_of(self.plan.cut(self.batch, start, stop))
                 for start, stop, stand_in in bounds]
        added = math.fsum(parts)
        if adds_up and not math.isclose(added, whole, rel_tol=1e-6, abs_tol=1e-9):
            raise ValueError(f"auto_microbatch: weight must count what {self.cfg.name}'s loss "
                             f"averages over (tokens, samples), so that the slices' counts "
                             f"add up to the batch's: the batch's is {whole:g}, its "
                             f"{len(parts)} slices' add up to {added:g}")
        return [part / whole for part in parts]

    def _weight_of(self, part: Any) -> float:
        """What ``weight`` says the loss of ``part`` averages over, as a float."""
        assert self.cfg.weight is not None
        value = self.cfg.weight(part)
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise TypeError(f"auto_microbatch: weight({self.cfg.name}'s batch) must return a "
                            f"number (the count the loss averages over), got "
                            f"{type(value).__name__}") from None
        if not number >= 0 or number == float("inf"):
            raise ValueError(f"auto_microbatch: weight returned {number!r}; it must be a "
                             f"finite count >= 0")
        if part is self.batch and number == 0:
            raise ValueError(f"auto_microbatch: weight of the whole batch is 0: the loss "
                             f"averages over nothing ({self.cfg.name})")
        return number

    def _call(self, wrapped: Callable[..., Any], piece: Any, args: tuple, kwargs: dict) -> Any:
        """The step function on one slice, its optimizers' steps refused.

        The first call sees the entry gradients (its ``zero_grad()`` stands); later calls run with
        the accumulated gradients moved aside, and a gradient written there is an error."""
        first = not self.settled
        aside = None if first else training.stash(self.params)
        token = training.REFUSED.set((self.known, self.cfg.refusal))
        try:
            loss = wrapped(piece, *args, **kwargs)
        except BaseException:
            if first:
                self._settle_entry(strict=False)
            elif aside is not None:
                training.restore(self.params, aside)
            raise
        finally:
            training.REFUSED.reset(token)
        if first:
            self._settle_entry(strict=True)
        elif aside is not None:
            appeared = training.present(self.params)
            training.restore(self.params, aside)
            if appeared:
                raise _changed_error(self.cfg, len(self.params), appeared, 0)
        return loss

    def _settle_entry(self, strict: bool) -> None:
        """Move the entry gradients aside as the first call left them; ``strict``: a change other
        than zeroing is an error."""
        self.entry, appeared, changed = training.settle(self.params, self.held)
        self.held, self.settled = None, True
        if strict and (appeared or changed):
            raise _changed_error(self.cfg, len(self.params), appeared, changed)

    def _backward(self, loss: Any, weight: float, total: Any) -> Any:
        training.check_loss(loss, self.cfg.called)
        if not self.cfg.sharded:
            found = training.outside(loss, self.known)
            if found:
                self.params, self.entry, self.known = _adopt(
                    self.cfg, self.state, found, self.params, self.entry, self.known)
        return training.backward(loss, weight, self.cfg.scaler, total)

    # -- the loop's hooks ------------------------------------------------------------------
    def steps(self) -> int:
        return self.slices()

    def local_flags(self) -> list[int]:
        return self._flags(self.status != OK)

    def _flags(self, failed: bool) -> list[int]:
        """The gradients' presence under DDP; under FSDP2, last, ``world - rank`` when ``failed``
        (the maximum names the lowest failing rank)."""
        flags: list[int] = []
        if self.syncs:
            shared = self.params[:self.shared]
            entry = self.entry[:self.shared] if self.settled else [None] * len(shared)
            flags = training.presence(shared, entry)
        if self.watching:
            flags.append(self.world - self.agreement.rank if failed else 0)
        return flags

    def propose(self, estimate: Optional[int]) -> Optional[int]:
        if self.fallback is not None:  # a larger size tried after clean steps: step back
            size, self.fallback = self.fallback, None
            return size
        upcoming = super().propose(estimate)
        cfg, policy = self.cfg, self.cfg.policy
        if upcoming is not None or cfg.sharded or self.offloading is not None \
                or self.size > policy.min_batch_size \
                or (policy.max_attempts is not None and self.tries >= policy.max_attempts):
            return upcoming
        # the rungs below the smallest slice: the same slices, with fewer activations kept
        recompute = cfg.recompute and torch_recompute.available(cfg.model)
        if recompute and not self.recomputing:
            # their activations recomputed in backward
            self.recomputing = True
            log.warning("%s: out of memory at microbatch_size=%d, the smallest; redoing "
                        "this batch with its activations recomputed (gradient "
                        "checkpointing of the model's blocks)", cfg.name, self.size)
            return self.size
        # then, on an accelerator, the tensors backward needs kept in pinned host memory
        # (with recompute, where it ran: checkpoints' inputs go to the host too); not after
        # the host's own memory ran out
        kind = torch_offload.device_type(cfg.model) if cfg.offload and not self.host_oom \
            else None
        if kind is None:
            return None
        self.offloading = kind
        log.warning("%s: out of memory at microbatch_size=%d%s; redoing this batch with the "
                    "tensors saved for backward in pinned host memory (offloaded from %s)",
                    cfg.name, self.size,
                    " with activations recomputed" if self.recomputing else ", the smallest",
                    kind)
        return self.size

    def record(self, attempt: Attempt) -> None:
        if self.recomputing or self.offloading is not None:
            attempt = dataclasses.replace(attempt, recompute=self.recomputing,
                                          offload=self.offloading is not None)
        super().record(attempt)

    def _exit(self, exc: Optional[BaseException]) -> bool:
        # which memory ran out decides whether offloading to the host can help
        self.host_oom = isinstance(exc, Exception) and oom_kind(exc) in _HOST_KINDS
        return super()._exit(exc)

    def after_oom(self, agreed: int) -> Optional[int]:
        if self.watching:  # every rank runs the same slices: FSDP's collectives pair up
            return agreed
        return self.proposal  # each rank cuts its own batch: its own size

    def recover(self, retrying: bool) -> int:
        """Drop the failed pass's gradients, put the buffers and the random number
        generators back, free its memory."""
        if not self.settled:  # the pass failed before the step function's first call
            self._settle_entry(strict=False)
        training.drop(self.params)
        if self.fsdp is not None:  # FSDP's iteration state, left mid-pass by the error
            self.fsdp.reset()
            self.fsdp.drop()
        if self.buffers is not None:
            self.buffers.load()
        if self.generators is not None:
            self.generators.load()
        if self.cfg.scaler is not None:
            training.reset_scaler(self.cfg.scaler)
        freed = free_memory()
        if self.offloading is not None:  # the failed pass's pinned blocks, now unused
            torch_offload.release()
        return freed

    def peer_gave_up(self) -> OutOfMemoryError:
        if self.culprit is not None:
            return self._peer_error()
        return super().peer_gave_up()

    def out_of_sizes(self) -> OutOfMemoryError:
        if self.stopped and self.culprit is not None:
            return self._peer_error()
        return exhausted(self.cfg.name, self.attempts, f" for a batch of {self.samples}")

    def _peer_error(self) -> OutOfMemoryError:
        """A peer ran out at its smallest size, this rank did not."""
        return OutOfMemoryError(
            f"{self.cfg.name}: rank {self.culprit} ran out of memory at "
            f"microbatch_size={self.size}, the smallest allowed; this rank (rank "
            f"{self.agreement.rank}) did not run out itself: it stopped or ended its pass "
            f"before FSDP's next collective, as every rank does. See rank {self.culprit}'s log "
            f"for its memory; lower min_batch_size or free memory there", self.attempts)

    def _remember(self) -> None:
        failed = any(not a.ok for a in self.attempts)
        grew = len(self.attempts) == 1 and self.fallback is not None
        with self.state.lock:
            if grew or (failed and self.size < self.samples):
                self.state.microbatch_size = self.size
                if self.per_sample is _UNREAD:
                    try:
                        self.per_sample = _per_sample(self.cfg, self.batch, self.samples)
                    except Exception as exc:  # noqa: BLE001 - the step is done: not lost
                        text = (str(exc) if str(exc).startswith("auto_microbatch: cost(")
                                else f"auto_microbatch: cost({self.cfg.name}'s batch) raised "
                                     f"{type(exc).__name__}: {exc}")
                        log.warning("%s; later batches are cut in samples", text)
                        self.per_sample = None
                self.state.slice_cost = (None if self.per_sample is None
                                         else self.size * self.per_sample)
            self.state.clean_steps = 0 if failed or grew else self.state.clean_steps + 1


def _changed_error(cfg: _Config, total: int, appeared: int, changed: int) -> RuntimeError:
    """The error for gradients that the step function wrote or changed itself."""
    if appeared:
        what = ("gradients were written before memguard's backward: a backward() of its own "
                "or an assignment to .grad, or, where a module is shared with another model, "
                "that model's step running meanwhile in another thread (decorate the step of a "
                "module holding both, torch.nn.ModuleList([model_a, model_b]), or share the "
                "module before decorating: steps of models that share parameters then take "
                "turns)")
    else:
        what = ("they changed in place to values other than zeros: a backward() of its own "
                "or clipping")
    return RuntimeError(
        f"{cfg.called} changed the gradients of {appeared + changed} of the {total} tensors "
        f"auto_microbatch accumulates gradients for ({what}). auto_microbatch runs backward "
        f"itself, once per slice, and the step function must only return the loss (a "
        f"zero_grad() before the forward is fine: the step then starts from zero "
        f"gradients); clip and call optimizer.step() after the decorated function returns")


def _fused_step_error(cfg: _Config, params: list[Any],
                      hooked: list[tuple[int, Any]]) -> NotImplementedError:
    """The refusal of post-accumulate-grad hooks (an optimizer step fused into backward)."""
    index, hook = hooked[0]
    names = {id(p): name for name, p in cfg.model.named_parameters()}
    where = names.get(id(params[index]), training.describe(params[index]))
    count = len({i for i, _ in hooked})
    return NotImplementedError(
        f"auto_microbatch: {count} parameter(s) of {cfg.name}'s model have a hook registered "
        f"with register_post_accumulate_grad_hook ({training.hook_name(hook)} on {where!r}): "
        f"auto_microbatch runs backward once per slice and drops a failed pass's gradients, "
        f"so such a hook (an optimizer step fused into backward) would run on partial "
        f"gradients and on gradients that are then dropped. Remove the hook and call "
        f"optimizer.step() after the decorated function returns, or train this model without "
        f"auto_microbatch")


def _adopt(cfg: _Config, state: _State, found: list[Any], params: list[Any],
           entry: list[Any], known: "set[int] | frozenset[int]"
           ) -> tuple[list[Any], list[Any], set[int]]:
    """Set aside tensors backward is about to write into that were not set aside on entry (found
    by walking the loss's graph before each backward), so a failed pass's share is dropped too.
    Returns the parameters, entry gradients and known ids with them added; warns once per tensor
    outside the model."""
    with state.lock:
        new = [t for t in found if training.is_parameter(t) and id(t) not in state.warned]
    if new:  # the model's own, or strangers: the model walked now tells (once for each)
        cfg.walked.refresh(time.perf_counter())
        new = [t for t in new if id(t) not in cfg.walked.known]
    with state.lock:
        state.warned.update((id(t), t) for t in new)
        other = [t for t in found if not training.is_parameter(t)]
        if other and not state.warned_other:
            state.warned_other = True
            new += other
    if new:
        log.warning("%s: backward writes gradients into %d tensor(s) outside the model given "
                    "to auto_microbatch (%s): memguard handles them too, but pass a module "
                    "that holds every trained parameter (torch.nn.ModuleList([model, head]))",
                    cfg.name, len(new), ", ".join(training.describe(t) for t in new[:4]))
    return (params + found, entry + training.stash(found),
            set(known).union(id(t) for t in found))


REPLICA_EVERY = 32
"""Calls between two comparisons of a DDP model's weights across the ranks."""


def _check_replicas(cfg: _Config, state: _State) -> None:
    """Every :data:`REPLICA_EVERY` calls under DDP: compare a sample of the weights across ranks
    and raise where they drifted (an optimizer step that ran on some ranks only). A collective."""
    state.calls += 1
    if state.calls % REPLICA_EVERY:
        return
    agreement = Agreement(cfg.policy.sync)
    if not agreement.active:
        return
    names, values = training.replica_values(cfg.ddp)
    spread = agreement.spread(values)
    for name, value, apart in zip(names, values, spread, strict=True):
        if apart > 1e-6 * max(abs(value), 1e-3):
            raise MemguardError(
                f"{cfg.name}: the DDP model's weights differ between the ranks (parameter "
                f"{name!r} by {apart:.3g}, at call {state.calls}): an optimizer step, or "
                f"another change of the weights, ran on some ranks only - an out-of-memory "
                f"in optimizer.step() caught and carried on, say. DDP averages gradients, "
                f"not weights, so the replicas stay apart. memguard guards forward and "
                f"backward only: let an error outside them end the job, and restart from a "
                f"checkpoint")


def _whole_fits(cfg: _Config, plan: Plan, planned: Optional[int]) -> bool:
    """Whether a call takes :meth:`_Step.whole`: no DDP/FSDP, no agreement, no enclosing
    attempt, and the batch ``planned`` whole."""
    if not cfg.alone or running():  # nested in another guard's attempt
        return False
    if cfg.policy.sync is not False:
        world = torch_distributed.world()
        if world is not None and world[1] > 1:
            return False
    return planned is None or planned >= (plan.length or 0)


ADDS_UP = "memguard_adds_up"
"""An attribute a ``weight`` function may set to ``False``: its slices' values need not add up
to its batch's (the trainers' own weight, 1 a slice for a loss divided by
``num_items_in_batch``)."""
_UNREAD: Any = object()  # a batch's cost per sample not read yet (None: nothing to count)
# out-of-memory kinds (errors.oom_kind) that say the host ran out: offloading cannot help
_HOST_KINDS = frozenset({"torch CPU allocator", "MemoryError", "torch memory mapping"})


def _per_sample(cfg: _Config, batch: Any, n: int) -> Optional[float]:
    """``cost(batch)`` (default: its tensors' elements) over ``n``; ``None``: nothing to count."""
    if cfg.cost is None:
        total = float(batch_elements(batch))
    else:
        value = cfg.cost(batch)
        try:
            total = float(value)
        except (TypeError, ValueError):
            raise TypeError(f"auto_microbatch: cost({cfg.name}'s batch) must return a number, "
                            f"got {value!r:.80}") from None
        if not math.isfinite(total) or total < 0:
            raise ValueError(f"auto_microbatch: cost({cfg.name}'s batch) must return a "
                             f"finite number >= 0, got {value!r:.80}")
    return total / n if total > 0 and n > 0 else None


def _planned(cfg: _Config, state: _State, batch: Any, n: int) -> tuple[Optional[int], Any]:
    """The slice size to start a batch of ``n`` at: as many samples as the slice cost that
    fitted holds at this batch's cost per sample (the remembered size where there is no cost;
    ``None`` where nothing is remembered), and the cost per sample read (or ``_UNREAD``)."""
    with state.lock:
        remembered, slice_cost = state.microbatch_size, state.slice_cost
    if remembered is None or slice_cost is None:
        return remembered, _UNREAD
    per_sample = _per_sample(cfg, batch, n)
    if per_sample is None:
        return remembered, None
    # a cost is a rough measure (a batch's labels count beside its tokens): 15.99 samples'
    # worth is 16, not a pass of 15 and another of 1; 1,024's is 1,024, not 1,025
    fits = slice_cost / per_sample
    nearest = round(fits)
    size = max(1, min(n, nearest if abs(fits - nearest) <= 0.001 * fits + 0.02 else int(fits)))
    if size != remembered:
        log.debug("%s: %d samples at %.4g each: slices of %d (%d fitted at %.4g each)",
                  cfg.name, n, per_sample, size, remembered, slice_cost / remembered)
    return size, per_sample


def auto_microbatch(model: Any, *, min_batch_size: int = 1, factor: Factor = 0.5,
                    max_attempts: Optional[int] = None,
                    on_retry: Optional[Callable[[Attempt], object]] = None, sync: Sync = "auto",
                    reduction: Reduction = "mean",
                    weight: Optional[Callable[[Any], Any]] = None,
                    grow_every: Optional[int] = None, scaler: Any = None,
                    recompute: bool = True, cost: Optional[Callable[[Any], Any]] = None,
                    offload: bool = True
                    ) -> Callable[[Callable[P, R_co]], MicrobatchedFunction[P, R_co]]:
    """Run a training step's forward and backward, redoing the batch in slices on
    out-of-memory, with the same gradients as one backward of the whole batch.

    The decorated function takes the batch first (other arguments go to every call) and
    returns its scalar loss; memguard runs backward and returns the whole batch's loss,
    detached. On an out-of-memory (:func:`is_oom_error`) the pass is undone, memory freed,
    and the batch redone in slices along dim 0 (a tensor, array, list, Mapping or
    dataclass, nested); later batches start from the cost that fitted. torch's random number
    generators are put back before a failed pass is redone. Gradients held on entry are
    kept, also when another exception propagates; an error that only a slice met (a shape
    written for the whole batch) carries a note of the cut. The function must only compute
    the loss: a ``zero_grad()`` at its top is fine, an ``optimizer.step()`` or a
    ``backward()`` of its own is an error, and a learning-rate scheduler's ``step()`` would
    run once per slice (call both after the step returns). Under DDP or FSDP2 every rank
    calls the step and no rank is left waiting in a collective (see the distributed guide).

    Args:
        model: the module whose parameters the step trains (a ``torch.nn.Module``, DDP
            wrapped, sharded with FSDP2's ``fully_shard``, or neither).
        min_batch_size: the smallest slice size tried. Default ``1``.
        factor: the next slice size is ``floor(size * factor)``; ``"auto"`` measures it; a
            callable ``size -> next size`` decides. Default ``0.5``.
        max_attempts: the most passes over one batch (``None``: until ``min_batch_size``).
        on_retry: called with the failed :class:`Attempt` after the cleanup, before the
            batch is redone. Default ``None``: nothing is called.
        sync: agree with the other ranks of a distributed job after each pass.
            Default ``"auto"``.
        reduction: ``"mean"`` (slices weighted by their share of samples) or ``"sum"``
            (added as they are): what the loss is over its samples. Default ``"mean"``.
        weight: for a loss averaged over something other than samples: a callable
            ``slice -> count`` (tokens); each slice's loss is weighted by
            ``weight(slice) / weight(batch)``, so the slices' counts must add up to the
            batch's (a constant or a mean is refused with ``ValueError`` before any slice
            runs). For a causal LM with labels ``-100`` on padding:
            ``weight=lambda b: (b["labels"][..., 1:] != -100).sum()``. ``None``: samples.
        grow_every: after this many steps without an out-of-memory, try the next larger
            slice size, stepping back at once if it fails; ``None``: never.
        scaler: a ``torch.amp.GradScaler`` that scales each backward.
            Default ``None``: no scaling.
        cost: a callable ``batch -> number >= 0`` that grows with its memory (tokens:
            ``lambda b: b["attention_mask"].sum()``); slices are planned in it. ``None``: the
            elements of the batch's tensors and arrays. Read once a split batch has run: a
            cost that fails then is logged and later batches are cut in samples.
        recompute: when a slice of ``min_batch_size`` still runs out of memory, redo that
            batch once with activations recomputed in backward (``torch.utils.checkpoint``
            on the model's ``ModuleList``/``Sequential`` children, or a Hugging Face model's
            ``gradient_checkpointing_enable()``); its attempts have ``recompute=True``.
            Dropout draws what the plain step draws. A block that draws from a
            ``torch.Generator`` of its own would not (checkpointing restores only torch's
            global generators): a model whose modules keep one is not recomputed; pass
            ``False`` where the generator lives elsewhere. Default ``True``.
        offload: on a CUDA, ROCm or XPU device, when that still runs out of memory, redo it
            once more with the tensors saved for backward in pinned host memory
            (``save_on_cpu(pin_memory=True)``); its attempt has ``offload=True``. Never on
            the CPU nor after the host's own memory ran out. Default ``True``.

    Returns:
        A decorator; the decorated step (a :class:`MicrobatchedFunction`) returns the whole
        batch's loss, detached, and exposes ``microbatch_size``, ``history`` (``steps``: the
        number of slices) and ``reset()``.

    Raises:
        OutOfMemoryError: when the slice at ``min_batch_size`` (or the ``max_attempts``-th
            pass) runs out of memory too, after the recompute and offload rungs.
        TypeError: at decoration, for a model holding FSDP1's ``FullyShardedDataParallel``.
        NotImplementedError: at a call, for parameters with a post-accumulate-grad hook.
        ValueError: at a split call, for a ``weight`` whose slices do not add up to the
            batch.

    >>> import torch, memguard
    >>> model = torch.nn.Linear(4, 1)
    >>> @memguard.auto_microbatch(model)
    ... def loss_of(batch):
    ...     return torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
    >>> loss = loss_of({"x": torch.ones(8, 4), "y": torch.zeros(8, 1)})
    >>> loss.requires_grad, model.weight.grad is not None, loss_of.microbatch_size
    (False, True, None)
    """
    if callable(model) and not hasattr(model, "parameters"):
        raise TypeError(f"auto_microbatch takes the model first: "
                        f"@auto_microbatch(model), not @auto_microbatch (got {model!r:.80})")
    policy = Policy.checked("auto_microbatch", min_batch_size=min_batch_size, factor=factor,
                            max_attempts=max_attempts, on_retry=on_retry, sync=sync)
    if weight is not None and not callable(weight):
        raise TypeError(f"auto_microbatch: weight must be a callable slice -> count, got "
                        f"{weight!r}")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"auto_microbatch: reduction must be 'mean' or 'sum', got "
                         f"{reduction!r}")
    optional_positive_int(grow_every, "grow_every", who="auto_microbatch")
    flag(recompute, "recompute", who="auto_microbatch")
    flag(offload, "offload", who="auto_microbatch")
    if cost is not None and not callable(cost):
        raise TypeError(f"auto_microbatch: cost must be a callable batch -> number, got "
                        f"{cost!r:.80}")
    if scaler is not None and not callable(getattr(scaler, "scale", None)):
        raise TypeError(f"auto_microbatch: scaler must be a torch.amp.GradScaler (or have "
                        f"its scale()), got {type(scaler).__name__}")
    training.parameters(model)
    old = torch_fsdp.fsdp1(model)
    if old is not None:
        raise TypeError(f"auto_microbatch does not support FSDP1's FullyShardedDataParallel "
                        f"wrapper ({type(old).__name__} in {type(model).__name__}): its "
                        f"collectives run inside forward and backward, where one rank's "
                        f"out-of-memory would leave its peers waiting. Shard the model with "
                        f"FSDP2's torch.distributed.fsdp.fully_shard (per layer and at the "
                        f"root) instead")
    sharded = bool(torch_fsdp.units(model))

    def decorate(func: Callable[P, R_co]) -> MicrobatchedFunction[P, R_co]:
        kind = function_kind(func)
        if kind != "sync":
            raise TypeError(f"auto_microbatch cannot decorate {kind} function "
                            f"{name_of(func)}: backward runs synchronously")
        cfg = _Config(func, model, policy, reduction, grow_every, scaler, sharded, weight,
                      recompute, cost, offload)
        state = _State()
        lock = _model_lock(model)

        def wrapper(wrapped, instance, args, kwargs):  # type: ignore[no-untyped-def]
            if args:  # the batch first, as in split_arguments
                batch, rest, kw = args[0], args[1:], kwargs
            else:
                batch, rest, kw = cfg.split_arguments(instance, args, kwargs)
            plan = state.plan = plan_batch(batch, state.plan)  # the last one, if it fits
            if not plan.length:
                raise ValueError(f"{cfg.name}() got an empty batch (0 samples)")
            with lock:  # one step at a time on a model: threads' gradients add up exactly
                if cfg.ddp is not None:
                    _check_replicas(cfg, state)
                planned = _planned(cfg, state, batch, plan.length or 0)
                if _whole_fits(cfg, plan, planned[0]):
                    return _Step.whole(cfg, state, batch, plan, wrapped, rest, kw)
                return _Step(cfg, state, batch, plan, planned).run(wrapped, rest, kw)

        return with_statistics(
            func, wrapper,
            {"microbatch_size": (lambda: state.microbatch_size,
                                 "The slice size that fitted (None until a batch was split)."),
             "history": (lambda: state.history, "The last call's attempts.")},
            state.reset)

    return decorate
