"""The microbatched step of the Hugging Face ``Trainer`` that
:func:`memguard.integrations.transformers.auto_microbatch` installs, and the slice size kept
with every checkpoint. Its public names are imported from
:mod:`memguard.integrations.transformers`."""

from __future__ import annotations

import copy
import itertools
import logging
import math
import weakref
from typing import Any, Callable, Optional

from ..loop import Attempt
from ..microbatch import ADDS_UP, auto_microbatch as _auto_microbatch
from ._core import (
    SAMPLES_OR_LABELLED,
    RungCounts,
    causal_lm,
    failure_text,
    labelled_samples,
    missing,
    probing,
    read_mean,
    samples_in,
    token_weight,
)
from ._transformers_compat import loss_shifts_labels, prepare_inputs

try:
    from transformers import TrainerCallback as _TrainerCallback
    from transformers.trainer_callback import ExportableState as _ExportableState
except ImportError:
    raise missing("transformers", "transformers", "Hugging Face transformers") from None

log = logging.getLogger("memguard")


class MicrobatchedTrainingStep:
    """What :func:`auto_microbatch` puts in place of a trainer's ``training_step``: the
    Trainer's own step, run on slices of the batch after an out-of-memory.

    Attributes:
        microbatch_size: the slice size of the last step (the whole batch's size when it
            fitted; ``None`` before the first step).
        history: the last step's :class:`memguard.Attempt` records (``unit="microbatch"``).
        original: the trainer's ``training_step`` that runs on each slice.

    >>> from memguard.integrations.transformers import MicrobatchedTrainingStep
    >>> MicrobatchedTrainingStep.__name__
    'MicrobatchedTrainingStep'
    """

    def __init__(self, trainer: Any, original: Callable[..., Any], options: dict[str, Any]
                 ) -> None:
        self._trainer = weakref.ref(trainer)
        self.original = original
        self._options = options
        self._steps: dict[str, tuple[Any, Any]] = {}  # reduction -> (model ref, step)
        self._last: Optional[Any] = None
        self._checked = False
        # what a model's loss is a mean over (with and without num_items_in_batch passed),
        # found out once per model
        self._units: "weakref.WeakKeyDictionary[Any, dict[bool, str]]" = \
            weakref.WeakKeyDictionary()
        self._context: Optional[tuple[Any, Any]] = None  # this call's model and count
        # the context and items of a step whose batch weights its slices alike by tokens and
        # by samples: what the loss is a mean over is read again at the next split
        self._undecided: Optional[tuple[Any, bool, str]] = None
        # models whose loss matched a mean over samples on batches whose every sample had
        # labels: read again at the first split of a batch with a sample without any
        self._provisional: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()
        # under DDP: the agreement on the reading's calls, the step and items it was made
        # for last, and whether every rank's reading is final (no agreement needed)
        self._agreement: Any = None
        self._calls = 0  # this step's
        # id of a model -> the most single-sample losses its reading takes, per sample read:
        # 3 with num_items_in_batch (twice each, then the mean), 1 without, 0 weight given
        self._probes: dict[int, int] = {}
        self._settled = False
        self._run: Any = None  # the TrainerState of the run seen last (a new one per train)
        self._seed: Optional[int] = None  # the size a resumed run starts from
        self._saved: Optional[int] = None  # the size last written into the TrainerState
        self.rungs = RungCounts()  # this train()'s batches that recomputed or offloaded

    def _agree_calls(self, model: Any, inputs: Any) -> int:
        """Under DDP, while some rank's loss reading is not final: the most gradient-free
        ``compute_loss`` calls a reading may make at this step, agreed over the ranks, so that a
        ``compute_loss`` with a collective of its own runs it as often. ``0`` otherwise."""
        if self._settled or not self._probes.get(id(model)):
            return 0
        if self._agreement is None:
            from ..distributed import Agreement

            self._agreement = Agreement(self._options.get("sync", "auto"))
        if not self._agreement.active:
            self._settled = True
            return 0
        length = min(len(inputs) if isinstance(inputs, list) else samples_in(inputs), 4)
        bound = 0 if self._units.get(model) else self._probes[id(model)] * length + 1
        most = self._agreement.all_max([bound])[0]
        if most == 0:  # every rank's reading is final
            self._settled = True
        return most

    # -- statistics ------------------------------------------------------------------------
    @property
    def history(self) -> list[Attempt]:
        """The last step's attempts (empty before the first step)."""
        return list(self._last.history) if self._last is not None else []

    @property
    def microbatch_size(self) -> Optional[int]:
        """The slice size the last step ran at (its batch's size when it fitted whole)."""
        attempts = self.history
        return attempts[-1].size if attempts else None

    def reset(self) -> None:
        """Forget the slice sizes that fitted: the next step starts with the whole batch."""
        self._seed = None
        for _, step in self._steps.values():
            step.reset()

    def _resume(self, trainer: Any) -> None:
        """At a ``train()``'s first step: start from the slice size a resumed checkpoint kept."""
        self._run = trainer.state
        self.rungs = RungCounts()
        saved = (getattr(trainer.state, "stateful_callbacks", None) or {}).get(STATE_KEY)
        size = saved.get("attributes", {}).get("microbatch_size") \
            if isinstance(saved, dict) else None
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            return
        if self._last is not None and self._last.microbatch_size is not None:
            return  # this trainer learned a size itself: it knows better
        self._seed = size
        for _, step in self._steps.values():
            step.reset(size)
        log.info("auto_microbatch(trainer): starting from microbatch_size=%d, kept in the "
                 "checkpoint resumed from", size)

    def _keep(self, trainer: Any) -> None:
        """Write the slice size learned into the trainer's state (:class:`MicrobatchState`)."""
        size = self._last.microbatch_size if self._last is not None else None
        if size is None or size == self._saved:
            return
        self._saved = size
        for callback in trainer.callback_handler.callbacks:
            if isinstance(callback, MicrobatchState):
                callback.microbatch_size = size
        callbacks = getattr(trainer.state, "stateful_callbacks", None)
        if isinstance(callbacks, dict):
            callbacks[STATE_KEY] = MicrobatchState.state_of(size)

    def figures(self) -> dict[str, float]:
        """``{"memory/microbatch_size": size}`` for the Trainer's log entries, with
        ``memory/recomputed_batches`` and ``memory/offloaded_batches`` from the first batch of
        this ``train()`` that needed the rung."""
        size = self.microbatch_size
        return {} if size is None else {"memory/microbatch_size": size, **self.rungs.figures()}

    # -- the step --------------------------------------------------------------------------
    def __call__(self, model: Any, inputs: Any, num_items_in_batch: Any = None,
                 *args: Any, **kwargs: Any) -> Any:
        trainer = self._trainer()
        if trainer is None:  # pragma: no cover - the trainer calls its own step
            return self.original(model, inputs, num_items_in_batch, *args, **kwargs)
        if not self._checked:
            _refuse_unsupported(trainer)
            self._checked = True
        if trainer.state is not self._run:  # a new train(), resumed from a checkpoint or not
            self._resume(trainer)
        scaled = trainer.loss_is_scaled_for_ga
        if scaled is None:  # as Trainer.training_step decides it
            scaled = ((trainer.model_accepts_loss_kwargs and num_items_in_batch is not None)
                      or trainer.compute_loss_func is not None)
        reduction = self._options.get("reduction") or ("sum" if scaled else "mean")
        step = self._step(trainer, model, reduction)
        self._last = step
        self._calls = self._agree_calls(model, inputs if _Packed.of(inputs) is None
                                        else _Packed.of(inputs))
        divisor = trainer.accelerator.gradient_accumulation_steps
        packed = _Packed.of(inputs)  # padding-free packing: cut between its sequences
        self._context = (model, num_items_in_batch)
        try:
            total = step(inputs if packed is None else packed, model, num_items_in_batch, args,
                         kwargs)
        finally:
            self._context = None
        self.rungs.add(step.history)
        self._keep(trainer)
        return total * divisor if divisor != 1 else total

    def _step(self, trainer: Any, model: Any, reduction: str) -> Any:
        """The microbatched slice function for ``model`` and ``reduction``, made once per model."""
        known = self._steps.get(reduction)
        if known is not None and known[0]() is model:
            return known[1]
        options = dict(self._options)
        options["reduction"] = reduction
        self._probes[id(model)] = 0
        if reduction == "mean" and options.get("weight") is None:
            options["weight"] = self._probed_weight(trainer, items=False)
            self._probes[id(model)] = 1
        elif reduction == "sum" and "reduction" not in self._options \
                and trainer.loss_is_scaled_for_ga is None:
            # the Trainer takes the loss to be divided by num_items_in_batch because the model
            # accepts **kwargs: whether it is, is found out at the first split; where it is
            # not, the slices are weighted by the weight= given (before, a weight= given made
            # the slices add up unweighted: the loss and gradients times the slices)
            options["reduction"] = "mean"
            options["weight"] = self._probed_weight(trainer, items=True,
                                                    given=options.get("weight"))
            self._probes[id(model)] = 3
        elif options.get("weight") is not None:
            counted = options["weight"]
            options["weight"] = lambda piece: counted(_Packed.rebuild(piece))
        if options.get("scaler") is None and getattr(trainer.accelerator, "scaler", None):
            options["scaler"] = trainer.accelerator.scaler
        original, accelerator = self.original, trainer.accelerator

        def training_step(piece: Any, model: Any, num_items_in_batch: Any, args: tuple,
                          kwargs: dict) -> Any:
            losses: list[Any] = []
            had = "backward" in accelerator.__dict__
            before = accelerator.__dict__.get("backward")

            def backward(loss: Any, **_: Any) -> None:
                losses.append(loss)  # memguard runs backward, weighted, per slice

            accelerator.backward = backward
            piece = _Packed.rebuild(piece)
            try:
                original(model, piece, num_items_in_batch, *args, **kwargs)
            finally:
                if had:
                    accelerator.backward = before
                else:
                    del accelerator.backward
            if len(losses) != 1:
                raise RuntimeError(
                    f"auto_microbatch(trainer): {type(trainer).__name__}.training_step called "
                    f"self.accelerator.backward {len(losses)} times for one batch; it must "
                    f"call it exactly once (memguard runs that backward itself, per slice)")
            loss = losses[0]
            divisor = accelerator.gradient_accumulation_steps
            return loss / divisor if divisor != 1 else loss

        training_step.__name__ = training_step.__qualname__ = (
            f"{type(trainer).__name__}.training_step")
        step = _auto_microbatch(model, **options)(training_step)
        if self._seed is not None:
            step.reset(self._seed)
        self._steps[reduction] = (weakref.ref(model), step)
        return step


    def _probed_weight(self, trainer: Any, items: bool,
                       given: Optional[Callable[[Any], Any]] = None) -> Callable[[Any], Any]:
        """A slice's weight where the Trainer does not say the loss's reduction, read once per model
        by :func:`_loss_unit`: 1 for a loss divided by ``num_items_in_batch``, else ``given``
        (the user's ``weight=``) or its tokens or samples."""
        by_tokens = _default_weight(trainer)
        labelled = labelled_samples(by_tokens)

        def weight(piece: Any) -> Any:
            context = self._context
            unit = "tokens"
            if context is not None:
                model, count = context
                found = self._units.setdefault(model, {})
                probe = items not in found and not (
                    self._undecided is not None and self._undecided[0] is context
                    and self._undecided[1] == items)
                calls, self._calls = self._calls, 0  # the first weight of the step
                if items in found:
                    unit = found[items]
                    if calls:  # another rank reads its loss: as many calls here
                        _loss_unit(trainer, model, _Packed.rebuild(piece), None, by_tokens,
                                   calls=calls, probe=False)
                elif not probe:
                    unit = self._undecided[2]  # type: ignore[index]  # this batch could not tell
                else:
                    unit = _loss_unit(trainer, model, _Packed.rebuild(piece),
                                      count if items else None, by_tokens,
                                      self._provisional.get(model), calls=calls)
                    if unit in ("either", SAMPLES_OR_LABELLED):  # read again next step
                        self._undecided = (context, items, unit)
                        if unit == SAMPLES_OR_LABELLED:
                            self._provisional[model] = unit
                    else:
                        found[items] = unit
            if unit == "items":
                return 1
            if given is not None:
                return given(_Packed.rebuild(piece))
            if unit in ("samples", SAMPLES_OR_LABELLED):
                return len(piece) if type(piece) is _Packed else samples_in(piece)
            if unit == "labelled":
                if isinstance(piece, list):  # a packed row's sequences
                    return sum(1 for span in piece
                               if float(by_tokens(_Packed.rebuild([span]))) > 0)
                return labelled(piece)
            return by_tokens(_Packed.rebuild(piece))

        # a loss divided by num_items_in_batch weighs 1 a slice: not a count that adds up
        setattr(weight, ADDS_UP, False)
        return weight


def _loss_unit(trainer: Any, model: Any, batch: Any, items: Any,
               by_tokens: Callable[[Any], Any], known: Optional[str] = None,
               calls: int = 0, probe: bool = True) -> str:
    """What ``trainer.compute_loss``'s loss is a mean over: ``"items"`` (divided by
    ``num_items_in_batch``), ``"tokens"`` or ``"samples"``, read gradient-free on the unwrapped
    model in eval mode (:func:`~memguard.integrations._core.averaged_over`). Undecided, the
    Trainer's assumption stands. Under DDP ``compute_loss`` is called ``calls`` times in all
    (``probe=False``: only those calls)."""
    from .._slices import plan_batch
    from ..backends.steps import torch_fsdp

    assumed = "items" if items is not None else "tokens"
    if torch_fsdp.units(model):
        return assumed
    unwrapped = trainer.accelerator.unwrap_model(model)
    packed = _Packed.of(batch)  # a packed row: its sequences, not the whole row
    source = batch if packed is None else packed
    plan = plan_batch(source)

    def piece(i: int, j: int) -> Any:
        return _Packed.rebuild(plan.cut(source, i, j))

    made: list[int] = []

    def loss(i: int, j: int, count: Any = items) -> float:
        made.append(1)
        inputs = prepare_inputs(trainer, piece(i, j))  # as training_step does
        with probing(unwrapped), trainer.compute_loss_context_manager():
            return float(trainer.compute_loss(unwrapped, dict(inputs),
                                              num_items_in_batch=count))

    try:
        if not probe:
            return assumed
        return _read_unit(loss, trainer, items, plan, piece, known, by_tokens)
    finally:
        while len(made) < calls:  # as many calls as the rank that reads most (DDP)
            loss(0, 1)


def _read_unit(loss: Callable[..., float], trainer: Any, items: Any, plan: Any,
               piece: Callable[[int, int], Any], known: Optional[str],
               by_tokens: Callable[[Any], Any]) -> str:
    """The body of :func:`_loss_unit`: the reading, logged."""
    name = type(trainer).__name__
    assumed = "items" if items is not None else "tokens"
    try:
        if items is not None:
            divided = _divided_by_items(loss, items, int(plan.length or 0),
                                        lambda i, j: float(by_tokens(piece(i, j))))
            if divided is not False:
                if divided is None:
                    log.warning(
                        "auto_microbatch(trainer): could not tell whether %s's loss is "
                        "divided by num_items_in_batch; a split step adds its slices' losses, "
                        "as the Trainer assumes. Set loss_is_scaled_for_ga on the Trainer "
                        "(False: a mean of its own) to say", name)
                return "items"
        unit = read_mean(loss, lambda i, j: float(by_tokens(piece(i, j))),
                         int(plan.length or 0), known)
    except Exception as error:  # noqa: BLE001 - the step itself runs next and raises its own
        # the probe failed (out of memory, a model that cannot run one sample in eval mode,
        # a BatchNorm without running statistics): the Trainer's assumption stands
        log.warning("auto_microbatch(trainer): reading what %s's loss is a mean over failed "
                    "(%s); a split step %s. Pass weight= or reduction= to say", name,
                    failure_text(error), "adds its slices' losses, as the Trainer assumes"
                    if items is not None else "weights its slices by their labels that are "
                    "not -100")
        return assumed
    ignores = " ignores num_items_in_batch and" if items is not None else ""
    if unit in ("either", SAMPLES_OR_LABELLED):  # this batch is weighted alike either way
        return unit
    if unit in ("tokens", "samples", "labelled"):
        log.info("auto_microbatch(trainer): %s's loss%s is a mean over %s: a split step "
                 "weights its slices by their %s", name, ignores,
                 "the samples with any label" if unit == "labelled" else unit,
                 {"tokens": "labels that are not -100", "samples": "samples",
                  "labelled": "samples with any label that is not -100"}[unit])
        return unit
    if unit is None:
        log.warning("auto_microbatch(trainer): could not tell whether %s's loss%s is a mean "
                    "over tokens, over all samples or over the samples with any label that is "
                    "not -100 (this batch weights its slices differently by each); a split "
                    "step weights its slices by their labels that are not -100. Pass weight= "
                    "(the count the loss averages over) to say", name, ignores)
    return "tokens"


def _divided_by_items(loss: Callable[..., float], items: Any, length: int,
                      tokens: Optional[Callable[[int, int], float]] = None) -> Optional[bool]:
    """Whether ``loss(i, j, count)`` is divided by ``count`` (one sample's loss with ``items``
    and ``2 * items``); ``None`` where the first four samples with a label that counts
    (``tokens(i, i + 1) > 0``; no forward) cannot tell. A sample without one has no mean of its
    own to read: a batch whose first half had none read as undecided, and the Trainer's
    assumption (the slices' losses added) stood for a loss that was a mean of its own."""
    candidates = list(range(length))
    if tokens is not None:
        candidates = [i for i in candidates if tokens(i, i + 1) > 0] or candidates
    for i in candidates[:4]:
        once, twice = loss(i, i + 1, items), loss(i, i + 1, items * 2)
        if not math.isfinite(once) or once == 0:
            continue
        if abs(once - twice) <= 1e-3 * abs(once):
            return False
        if abs(once - 2 * twice) <= 1e-3 * abs(once):
            return True
        return None
    return None


class _Span:
    """One sequence of a packed row: tokens ``start:stop`` of ``inputs``."""

    __slots__ = ("inputs", "start", "stop")

    def __init__(self, inputs: Any, start: int, stop: int) -> None:
        self.inputs, self.start, self.stop = inputs, start, stop


class _Packed(list):
    """A padding-free packed batch (``DataCollatorWithFlattening``) seen as its sequences, one
    :class:`_Span` each; :meth:`rebuild` packs a slice of them as the collator would have."""

    packed: Any

    @classmethod
    def of(cls, inputs: Any) -> "Optional[_Packed]":
        """``inputs`` seen as its sequences, or ``None`` if not a packed row of several."""
        if not hasattr(inputs, "keys") or "input_ids" not in inputs:
            return None
        ids = inputs["input_ids"]
        shape = tuple(getattr(ids, "shape", ()))
        if len(shape) != 2 or shape[0] != 1:
            return None
        if "cu_seq_lens_q" in inputs:
            bounds = [int(b) for b in inputs["cu_seq_lens_q"].reshape(-1).tolist()]
        elif "position_ids" in inputs and tuple(inputs["position_ids"].shape) == shape:
            positions = inputs["position_ids"][0]
            starts = (positions[1:] != positions[:-1] + 1).nonzero().reshape(-1) + 1
            if not bool((positions[starts] == positions[0]).all()):
                return None  # not sequences restarting at one position: padding, say
            bounds = [0, *starts.tolist(), shape[1]]
        else:
            return None
        if len(bounds) < 3 or bounds[0] != 0 or bounds[-1] != shape[1]:
            return None  # one sequence: nothing to cut between
        out = cls(_Span(inputs, a, b) for a, b in itertools.pairwise(bounds))
        out.packed = inputs
        return out

    @staticmethod
    def rebuild(piece: Any) -> Any:
        """The packed batch of ``piece`` (anything else returned as it is)."""
        if isinstance(piece, _Packed):
            return piece.packed
        if not (isinstance(piece, list) and piece and isinstance(piece[0], _Span)):
            return piece
        inputs, first, last = piece[0].inputs, piece[0].start, piece[-1].stop
        width = inputs["input_ids"].shape[1]
        out = copy.copy(inputs)  # its type (a dict, a BatchEncoding) and other entries
        for key, value in inputs.items():
            if tuple(getattr(value, "shape", ()))[-1:] == (width,) and value.dim() == 2:
                out[key] = value[:, first:last]
        if "seq_idx" in inputs:
            out["seq_idx"] = out["seq_idx"] - out["seq_idx"][:, :1]
        lengths = [span.stop - span.start for span in piece]
        for side in ("q", "k"):
            if f"cu_seq_lens_{side}" in inputs:
                old = inputs[f"cu_seq_lens_{side}"]
                bounds = [span.start - first for span in piece] + [last - first]
                out[f"cu_seq_lens_{side}"] = old.new_tensor(bounds)
            if f"max_length_{side}" in inputs:
                out[f"max_length_{side}"] = max(lengths)
        return out


STATE_KEY = "MicrobatchState"
"""Where a checkpoint's ``trainer_state.json`` keeps the slice size (``stateful_callbacks``)."""


class MicrobatchState(_TrainerCallback, _ExportableState):
    """The slice size :func:`auto_microbatch` learned, kept with every checkpoint in
    ``trainer_state.json``, so that ``train(resume_from_checkpoint=...)`` starts at it.

    Attributes:
        microbatch_size: the slice size learned (``None`` until a batch was split).

    >>> from memguard.integrations.transformers import MicrobatchState
    >>> MicrobatchState.state_of(4)
    {'args': {}, 'attributes': {'microbatch_size': 4}}
    """

    def __init__(self) -> None:
        self.microbatch_size: Optional[int] = None

    @staticmethod
    def state_of(size: Optional[int]) -> dict[str, Any]:
        """What ``trainer_state.json`` holds for ``size``.

        Args:
            size: the slice size learned, in samples, or ``None`` before a batch was split.
        """
        return {"args": {}, "attributes": {"microbatch_size": size}}

    def state(self) -> dict[str, Any]:
        """The Trainer's ``ExportableState``: saved with each checkpoint."""
        return self.state_of(self.microbatch_size)


def _refuse_unsupported(trainer: Any) -> None:
    """A clear error for the set-ups whose backward memguard cannot run slice by slice."""
    from accelerate.utils import DistributedType  # type: ignore[import-untyped]

    kind = trainer.accelerator.distributed_type
    if kind in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
        raise NotImplementedError(
            f"auto_microbatch(trainer) does not support {kind}: its engine runs backward "
            f"itself; use oom_retry around train() instead")
    if str(trainer.args.optim).lower().endswith(("lomo", "adalomo")):
        raise NotImplementedError(
            f"auto_microbatch(trainer) does not support optim={trainer.args.optim!s}: LOMO "
            f"steps the parameters inside backward")


def _default_weight(trainer: Any) -> Callable[[Any], Any]:
    """What a loss averages over without ``num_items_in_batch``: labels not -100 (shifted for a
    causal LM), or the samples of a batch without labels."""
    shifts = loss_shifts_labels(trainer) or _causal_loss(trainer)
    return token_weight(shifts)


def _causal_loss(trainer: Any) -> bool:
    """Whether the model's loss is a causal LM's (the Trainer's ``_loss_shifts_labels`` reads
    only ``config.loss_type``, often unset)."""
    try:
        return causal_lm(trainer.accelerator.unwrap_model(trainer.model))
    except Exception:  # noqa: BLE001 - an unknown model: its labels are not shifted
        return False
