"""``map_batches``, a driver over :class:`memguard.loop.Loop`: a function mapped over a large
input in batches that shrink on out-of-memory, finished work never redone."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Generic, Iterable, Optional, TypeVar, Union, overload

from ._slices import Plan, plan_batch
from .distributed import Sync
from .errors import OutOfMemoryError, oom_kind
from .loop import Attempt, Factor, Loop, Policy

T = TypeVar("T")
C = TypeVar("C")


class BatchResults(list[T], Generic[T]):
    """The list :func:`map_batches` returns (without ``collate``): one result per call of
    ``fn``, in order, with ``history``.

    Args:
        items: the results, in order. Default ``()``: none.
        history: the retries' records. Default ``None``: none.

    Attributes:
        history: the :class:`Attempt` records of the retries.

    >>> results = BatchResults([1, 2])
    >>> results, results.history
    ([1, 2], [])
    """

    def __init__(self, items: Iterable[T] = (), history: Optional[list[Attempt]] = None
                 ) -> None:
        super().__init__(items)
        self.history: list[Attempt] = [] if history is None else history


class _Segment(Loop):
    """``map_batches`` over one input: ``fn`` on consecutive slices, the size shrinking on
    out-of-memory and staying shrunk; finished slices never redone."""

    def __init__(self, fn: Callable[[Any], Any], cut: Callable[[int, int], Any], total: int,
                 size: int, policy: Policy, history: list[Attempt], where: Callable[[int], str],
                 whole: Any = None) -> None:
        super().__init__("map_batches", size, policy, history=history)
        self.fn, self.cut, self.total, self.where, self.whole = fn, cut, total, where, whole
        self.offset = 0
        self.results: list[Any] = []
        self.out: Any = None
        self.failed_here = False

    def call(self) -> None:
        """The body of one attempt: ``fn`` on the next slice."""
        stop = min(self.offset + self.size, self.total)
        whole = self.whole is not None and self.offset == 0 and stop == self.total
        chunk = self.whole if whole else self.cut(self.offset, stop)
        self.out = self.fn(chunk)

    def record_success(self, seconds: float) -> None:
        if self.attempts and not self.attempts[-1].ok:  # the size that worked after a failure
            super().record_success(seconds)

    def record(self, attempt: Attempt) -> None:
        self.failed_here = self.failed_here or not attempt.ok
        super().record(attempt)

    def after_ok(self) -> Optional[int]:
        self.results.append(self.out)
        self.out = None
        self.offset = min(self.offset + self.size, self.total)
        return self.size if self.offset < self.total else None

    def recover(self, retrying: bool) -> int:
        self.out = None
        return super().recover(retrying)

    def out_of_sizes(self) -> OutOfMemoryError:
        return OutOfMemoryError(
            f"map_batches: out of memory at batch_size={self.size}, the smallest allowed, at "
            f"{self.where(self.offset)}; the finished results are on the error's .partial",
            self.attempts)


class _Mapper:
    """One ``map_batches`` call: the size, the results, the history, over every segment."""

    def __init__(self, fn: Callable[[Any], Any], size: Optional[int], policy: Policy) -> None:
        self.fn = fn
        self.size = size  # None: an iterable's batches as they come, until one runs out
        self.policy = policy
        self.results: list[Any] = []
        self.history: list[Attempt] = []

    def run(self, cut: Callable[[int, int], Any], total: int, where: Callable[[int], str],
            whole: Any = None, join: bool = False) -> None:
        """Call ``fn`` on ``cut(start, stop)`` over ``0..total`` (``whole`` when it fits at once);
        with ``join``, the slices' results joined. ``total`` 0: no call."""
        if total == 0:
            return
        size = total if self.size is None else min(self.size, total)
        segment = _Segment(self.fn, cut, total, max(size, 1), self.policy, self.history, where,
                           whole)
        try:
            for attempt in segment:
                with attempt:
                    segment.call()
        except OutOfMemoryError as exc:
            exc.partial = self.results + segment.results
            raise
        if segment.failed_here:
            self.size = segment.size
        if join and len(segment.results) > 1:
            from .backends.steps.torch_data import concatenate

            self.results.append(concatenate(segment.results))
        else:
            self.results.extend(segment.results)


@overload
def map_batches(fn: Callable[[Any], T], data: Any, *, batch_size: Optional[int] = None,
                min_batch_size: int = 1, factor: Factor = 0.5,
                max_attempts: Optional[int] = None,
                on_retry: Optional[Callable[[Attempt], object]] = None, sync: Sync = False,
                collate: None = None) -> BatchResults[T]: ...
@overload
def map_batches(fn: Callable[[Any], T], data: Any, *, batch_size: Optional[int] = None,
                min_batch_size: int = 1, factor: Factor = 0.5,
                max_attempts: Optional[int] = None,
                on_retry: Optional[Callable[[Attempt], object]] = None, sync: Sync = False,
                collate: Callable[[list[T]], C]) -> C: ...


def map_batches(fn: Callable[[Any], T], data: Any, *, batch_size: Optional[int] = None,
                min_batch_size: int = 1, factor: Factor = 0.5,
                max_attempts: Optional[int] = None,
                on_retry: Optional[Callable[[Attempt], object]] = None, sync: Sync = False,
                collate: Optional[Callable[[list[T]], C]] = None
                ) -> Union[BatchResults[T], C]:
    """Apply ``fn`` to ``data`` in batches, shrinking the batch on out-of-memory.

    ``data`` is a sequence (list, tensor, array) cut into slices of ``batch_size``; a tuple or
    Mapping of per-sample parts, cut part by part as :func:`auto_microbatch` cuts a batch; a
    map-style ``torch.utils.data.Dataset``, collated with ``default_collate``; or an iterable
    of batches (a ``DataLoader``), each passed as it is (cut to ``batch_size`` when longer,
    its slices' results joined). An empty input calls ``fn`` never.

    On an out-of-memory only the failed slice is retried, smaller, and the rest goes on at
    that size: finished work is never recomputed. The policy arguments mean what they mean to
    :func:`oom_retry`.

    Args:
        fn: called with each batch; its result is kept.
        data: what to map (above).
        batch_size: the size of the slices (needed for everything but an iterable of
            batches). Default ``None``: an iterable's own batches.
        min_batch_size: the smallest size tried. Default ``1``.
        factor: the next size is ``floor(size * factor)``; ``"auto"`` measures it; a
            callable ``size -> next size``. Default ``0.5``.
        max_attempts: the most attempts at one batch.
            Default ``None``: until ``min_batch_size``.
        on_retry: called with each failed :class:`Attempt` after its cleanup.
            Default ``None``: nothing is called.
        sync: ``False`` by default (ranks often map inputs of different lengths); with
            ``True`` (or ``"auto"`` with several ranks) every rank must map data of the same
            length and all go on at the same size.
        collate: joins the list of results (``torch.cat``, say) before it is returned.
            Default ``None``: the list of results, a :class:`BatchResults`.

    Returns:
        The results, one per slice of a sequence and one per batch of an iterable (a
        :class:`BatchResults`), or ``collate(results)``.

    Raises:
        OutOfMemoryError: when the slice at ``min_batch_size``, or ``collate``, runs out of
            memory; the finished results are on its ``.partial``.

    >>> import memguard
    >>> memguard.map_batches(sum, list(range(10)), batch_size=4)
    [6, 22, 17]
    >>> memguard.map_batches(lambda b: sum(b[1]), ([1, 2, 3], [4, 5, 6]), batch_size=2)
    [9, 6]
    >>> memguard.map_batches(len, iter([[1, 2, 3], [4, 5]]))
    [3, 2]
    """
    policy = Policy.checked("map_batches", min_batch_size=min_batch_size, factor=factor,
                            max_attempts=max_attempts, on_retry=on_retry, sync=sync)
    batch_size = policy.check_start(batch_size, "map_batches")
    from .backends.steps.torch_data import collate as collate_samples, is_map_dataset

    mapper = _Mapper(fn, batch_size, policy)
    if isinstance(data, (tuple, Mapping)) or is_map_dataset(data) or (
            hasattr(data, "__len__") and hasattr(data, "__getitem__")):
        if batch_size is None:
            raise TypeError(f"map_batches: needs batch_size=... for a {type(data).__name__} "
                            f"(only an iterable of batches, such as a DataLoader, brings its "
                            f"own)")
        if isinstance(data, (tuple, Mapping)):
            plan = plan_batch(data)  # cut part by part
            cut: Callable[[int, int], Any] = lambda a, b: plan.cut(data, a, b)  # noqa: E731
            total = int(plan.length or 0)
        elif is_map_dataset(data):
            cut = lambda a, b: collate_samples([data[i] for i in range(a, b)])  # noqa: E731
            total = len(data)
        else:
            def cut(a: int, b: int) -> Any:
                chunk = data[a:b]
                _check_slice(data, chunk, a, b)
                return chunk

            total = len(data)
        mapper.run(cut, total, lambda done: f"item {done} of {total}")
    elif hasattr(data, "__iter__"):
        count = len(data) if hasattr(data, "__len__") else None
        of = f" of {count}" if count is not None else ""
        for index, batch in enumerate(data):
            _map_batch(mapper, batch, f"batch {index}{of}")
    else:
        raise TypeError(f"map_batches: needs data with len() and slicing, a tuple or dict of "
                        f"those, a torch Dataset, or an iterable of batches (a DataLoader), "
                        f"got {type(data).__name__}")
    results = mapper.results
    if collate is None:
        return BatchResults(results, mapper.history)
    try:
        return collate(results)
    except BaseException as exc:
        if oom_kind(exc) is None:
            raise
        raise OutOfMemoryError(f"map_batches: collate ran out of memory joining {len(results)} "
                               f"results; they are on the error's .partial", mapper.history,
                               results) from exc


def _map_batch(mapper: _Mapper, batch: Any, name: str) -> None:
    """One batch of an iterable: cut as :func:`plan_batch` says, or passed whole."""
    try:
        plan: Optional[Plan] = plan_batch(batch)
    except TypeError:
        plan = None
    if plan is None or not plan.length:
        mapper.run(lambda a, b: batch, 1, lambda done: name, whole=batch)
    else:
        mapper.run(lambda a, b: plan.cut(batch, a, b), plan.length,
                   lambda done: f"item {done} of {name}", whole=batch, join=True)


def _check_slice(data: Any, chunk: Any, start: int, stop: int) -> None:
    """A ``TypeError`` unless ``data[start:stop]`` gave ``stop - start`` items."""
    try:
        got: Any = len(chunk)
    except TypeError:
        got = f"a {type(chunk).__name__} without len()"
    if got != stop - start:
        raise TypeError(f"map_batches: data[{start}:{stop}] of a {type(data).__name__} gave "
                        f"{got} items, not {stop - start}; data must return its items when "
                        f"sliced (a list, a tensor, an array), or be a tuple or dict of such")
