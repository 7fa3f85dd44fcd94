"""oom_retry's size policy, cache and statistics, on real torch allocation failures.

``torch.empty`` of more bytes than the machine has fails at once with the CPU allocator's real
out-of-memory error, so these tests need no memory budget; test_oom_recovery.py runs the
budgeted ones.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math

import pytest
import torch

import memguard


def workload(limit: int, calls: list | None = None):
    """A step that really runs out of memory above ``limit`` samples."""

    def step(batch_size: int, accumulation_steps: int = 1) -> int:
        if calls is not None:
            calls.append((batch_size, accumulation_steps))
        torch.empty(batch_size * (1 << 42) if batch_size > limit else batch_size)
        return batch_size

    return step


def test_halves_until_it_fits_and_records_every_attempt():
    calls = []
    train = memguard.oom_retry(batch_size=256)(workload(50, calls))
    assert train() == 32
    assert [b for b, _ in calls] == [256, 128, 64, 32]
    history = train.history
    assert [(a.size, a.ok) for a in history] == [(256, False), (128, False), (64, False),
                                                      (32, True)]
    assert "DefaultCPUAllocator" in history[0].error and history[0].memory is not None
    assert history[0].memory["host"].reserved > 0 and history[-1].memory is None
    assert all(a.seconds >= 0 for a in history)
    assert train.batch_size == 32


def test_second_call_starts_at_the_cached_size_and_reset_forgets_it():
    calls = []
    train = memguard.oom_retry(batch_size=256)(workload(50, calls))
    train()
    calls.clear()
    assert train() == 32 and calls == [(32, 1)] and len(train.history) == 1
    train.reset()
    assert train.batch_size is None and train.history == []
    calls.clear()
    train()
    assert len(calls) == 4


def test_cache_is_per_requested_start():
    calls = []
    train = memguard.oom_retry(batch_size=256)(workload(50, calls))
    train()
    calls.clear()
    assert train(batch_size=40) == 40 and calls == [(40, 1)]
    calls.clear()
    assert train(batch_size=100) == 50 and [b for b, _ in calls] == [100, 50]
    calls.clear()
    assert train(batch_size=100) == 50 and calls == [(50, 1)]


def test_without_cache_every_call_starts_over():
    calls = []
    train = memguard.oom_retry(batch_size=64, cache=False)(workload(20, calls))
    train(), train()
    assert [b for b, _ in calls] == [64, 32, 16, 64, 32, 16]


def test_bare_decorator_starts_at_the_callers_argument_or_the_default():
    calls = []

    @memguard.oom_retry
    def train(batch_size=64):
        return workload(10, calls)(batch_size)

    assert train() == 8 and [b for b, _ in calls] == [64, 32, 16, 8]
    calls.clear()
    assert train(batch_size=5) == 5 and calls == [(5, 1)]
    calls.clear()
    assert train(20) == 10 and [b for b, _ in calls] == [20, 10]


def test_every_argument_reaches_the_function_as_called_whatever_its_signature():
    """A call's arguments reach the function as a plain call would pass them, with only
    the size replaced: positional, by name or left to defaults, on a function of plain
    parameters and on one with keyword-only ones; and after the function's code is
    swapped for one with its parameters in another order."""
    seen = []

    def plain(a, batch_size=8, c=3):
        seen.append((a, batch_size, c))
        torch.empty(batch_size * (1 << 42) if batch_size > 4 else batch_size)
        return a

    def keywords(a, batch_size=8, *, c=3):
        seen.append((a, batch_size, c))
        torch.empty(batch_size * (1 << 42) if batch_size > 4 else batch_size)
        return a

    for func in (plain, keywords):
        guarded = memguard.oom_retry(cache=False)(func)
        seen.clear()
        assert guarded(1) == 1 and seen == [(1, 8, 3), (1, 4, 3)]
        seen.clear()
        guarded(1, c=7, batch_size=2)
        guarded(a=5, batch_size=3)
        assert seen == [(1, 2, 7), (5, 3, 3)]
        assert [(a.size, a.ok) for a in guarded.history] == [(3, True)]
        if func is plain:
            seen.clear()
            guarded(1, 2, 9)
            assert seen == [(1, 2, 9)]

    def swapped(batch_size=8, a=0, c=3):
        seen.append((a, batch_size, c))
        return a

    guarded = memguard.oom_retry(cache=False)(plain)
    guarded(1, 2)
    plain.__code__, plain.__defaults__ = swapped.__code__, swapped.__defaults__
    seen.clear()
    guarded(2, 6)  # now the size comes first
    assert seen == [(6, 2, 3)] and guarded.batch_size == 2


def test_a_call_that_does_not_bind_is_refused_as_such_whatever_its_size():
    calls = []

    @memguard.oom_retry
    def train(x, batch_size=64, y=2):
        calls.append(batch_size)
        return batch_size

    train(1, 8)
    for args, kwargs in (((1, -3), {"zz": 1}), ((1, -3), {"batch_size": 8}),
                         ((1, 64), {"batch_size": 32}), ((1,), {"zz": 1})):
        with pytest.raises(TypeError, match=r"^(unexpected keyword|multiple values|got an)"):
            train(*args, **kwargs)
    with pytest.raises(ValueError, match="got -3"):
        train(1, -3)
    # refused before any attempt: the function never ran, the last call's record stands
    assert calls == [8] and [(a.size, a.ok) for a in train.history] == [(8, True)]


def test_a_late_reader_of_history_never_puts_back_an_older_calls_record(monkeypatch):
    """A call that fits has its record made when ``history`` is read: a reader that read
    the older call's figures before a newer call ended must not replace the newer call's
    attempts with the older call's record."""
    from memguard import retry

    @memguard.oom_retry
    def train(batch_size=64):
        if batch_size > 16:
            raise MemoryError("out of memory")
        return batch_size

    train(8)
    made = retry.succeeded
    newer = []

    def meanwhile(*args, **kwargs):  # another thread's call, between the read and the record
        if not newer:
            newer.append(train(64))
        return made(*args, **kwargs)

    monkeypatch.setattr(retry, "succeeded", meanwhile)
    late = train.history  # the reader, late: the older call's record
    monkeypatch.setattr(retry, "succeeded", made)
    assert newer == [16] and [(a.size, a.ok) for a in late] == [(8, True)]
    assert [(a.size, a.ok) for a in train.history] == [(64, False), (32, False), (16, True)]
    assert train.batch_size == 16


def test_factor_min_batch_size_and_max_attempts():
    calls = []
    train = memguard.oom_retry(batch_size=100, factor=0.75)(workload(40, calls))
    assert train() == 31 and [b for b, _ in calls] == [100, 75, 56, 42, 31]
    calls.clear()
    train = memguard.oom_retry(batch_size=100, min_batch_size=30)(workload(20, calls))
    with pytest.raises(memguard.OutOfMemoryError):
        train()
    assert [b for b, _ in calls] == [100, 50, 30]
    calls.clear()
    train = memguard.oom_retry(batch_size=100, max_attempts=2)(workload(1, calls))
    with pytest.raises(memguard.OutOfMemoryError):
        train()
    assert [b for b, _ in calls] == [100, 50]


def test_giving_up_lists_every_size_with_its_memory_and_chains_the_last_error():
    train = memguard.oom_retry(batch_size=8)(workload(0, None))
    with pytest.raises(memguard.OutOfMemoryError) as info:
        train()
    err = info.value
    assert [a.size for a in err.attempts] == [8, 4, 2, 1]
    text = str(err)
    assert "out of memory at every batch_size tried: 8 (host " in text
    assert "; 4 (host" in text and "; 1 (host" in text
    assert isinstance(err.__cause__, RuntimeError)
    assert "DefaultCPUAllocator" in str(err.__cause__)
    assert memguard.is_oom_error(err) and isinstance(err, MemoryError)


def test_other_exceptions_propagate_untouched_with_their_traceback():
    calls = []
    error = ValueError("bad labels")

    @memguard.oom_retry(batch_size=16)
    def train(batch_size):
        calls.append(batch_size)
        raise error

    with pytest.raises(ValueError, match="bad labels") as info:
        train()
    assert info.value is error and calls == [16]
    assert info.traceback[-1].name == "train"
    assert info.value.__cause__ is None and info.value.__context__ is None


def test_keep_effective_batch_passes_accumulation_steps():
    calls = []
    train = memguard.oom_retry(batch_size=100, keep_effective_batch=True)(workload(30, calls))
    assert train() == 25
    assert calls == [(100, 1), (50, 2), (25, 4)]
    for size, steps in calls:
        assert size * steps >= 100 and steps == math.ceil(100 / size)
    assert train.history[-1].steps == 4


def test_keep_effective_batch_with_a_named_accumulation_parameter():
    seen = []

    @memguard.oom_retry(batch_size=10, keep_effective_batch=True, accumulation_arg="accum")
    def train(batch_size, accum=1):
        seen.append((batch_size, accum))
        workload(3)(batch_size)

    train()
    assert seen == [(10, 1), (5, 2), (2, 5)]


def test_on_retry_runs_after_cleanup_before_the_next_attempt(caplog):
    events = []

    def on_retry(attempt):
        events.append(("retry", attempt.size, attempt.ok))

    @memguard.oom_retry(batch_size=40, on_retry=on_retry)
    def train(batch_size):
        events.append(("attempt", batch_size))
        return workload(10)(batch_size)

    with caplog.at_level(logging.WARNING, logger="memguard"):
        train()
    assert events == [("attempt", 40), ("retry", 40, False), ("attempt", 20),
                      ("retry", 20, False), ("attempt", 10)]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert "train: out of memory (torch CPU allocator)" in warnings[0].getMessage()
    assert "at batch_size=40; host " in warnings[0].getMessage()
    assert "retrying at batch_size=20" in warnings[0].getMessage()


def test_methods_and_async_functions():
    class Trainer:
        def __init__(self):
            self.sizes = []

        @memguard.oom_retry(batch_size=32)
        def fit(self, batch_size):
            self.sizes.append(batch_size)
            return workload(8)(batch_size)

        @memguard.oom_retry(batch_size=32)
        async def afit(self, batch_size):
            await asyncio.sleep(0)
            self.sizes.append(batch_size)
            return workload(4)(batch_size)

    trainer = Trainer()
    assert trainer.fit() == 8 and trainer.sizes == [32, 16, 8]
    assert trainer.fit.batch_size == 8 and Trainer.fit.batch_size == 8
    assert [a.size for a in trainer.fit.history] == [32, 16, 8]
    assert trainer.fit() == 8 and [a.size for a in Trainer.fit.history] == [8]
    assert inspect.iscoroutinefunction(Trainer.afit)
    assert asyncio.run(trainer.afit()) == 4
    assert [a.ok for a in trainer.afit.history] == [False, False, False, True]


def test_signature_and_metadata_are_kept():
    def train(batch_size: int = 8, *, lr: float = 0.1) -> float:
        """Train."""
        return lr

    wrapped = memguard.oom_retry(train)
    assert inspect.signature(wrapped) == inspect.signature(train)
    assert wrapped.__name__ == "train" and wrapped.__doc__ == "Train." and wrapped() == 0.1


@pytest.mark.parametrize("kwargs, error, match", [
    ({"batch_size": 0}, ValueError, "batch_size must be a positive int, got 0"),
    ({"batch_size": 2.5}, ValueError, "batch_size must be a positive int"),
    ({"batch_size": 8, "min_batch_size": 16}, ValueError, "min_batch_size=16 is larger"),
    ({"factor": 1.0}, ValueError, "factor must be a number between 0 and 1"),
    ({"factor": 0}, ValueError, "factor"),
    ({"max_attempts": 0}, ValueError, "max_attempts"),
    ({"sync": "sometimes"}, ValueError, "sync must be"),
])
def test_bad_options_are_refused_at_decoration(kwargs, error, match):
    with pytest.raises(error, match=match):
        memguard.oom_retry(**kwargs)(lambda batch_size: None)


def test_a_function_without_the_parameter_is_refused_at_decoration():
    with pytest.raises(TypeError, match=r"train\(\) has no parameter 'batch_size'"):
        @memguard.oom_retry
        def train(n):
            pass
    with pytest.raises(TypeError, match="keep_effective_batch needs a parameter"):
        @memguard.oom_retry(keep_effective_batch=True)
        def fit(batch_size):
            pass
    with pytest.raises(TypeError, match="generator"):
        @memguard.oom_retry
        def gen(batch_size):
            yield batch_size


def test_bad_sizes_at_call_time():
    @memguard.oom_retry(min_batch_size=4)
    def train(batch_size):
        return batch_size

    with pytest.raises(TypeError, match="got no batch_size"):
        train()
    with pytest.raises(ValueError, match="batch_size must be a positive int, got -3"):
        train(-3)
    with pytest.raises(ValueError, match="min_batch_size=4 is larger than the starting"):
        train(2)


def test_the_final_error_does_not_keep_the_last_attempts_tensors():
    """The OutOfMemoryError outlives the call (in a notebook, until the next error): its
    ``__cause__`` must not hold the failed attempt's frames and what they allocated."""
    import weakref

    refs = []

    @memguard.oom_retry(batch_size=2)
    def step(batch_size):
        activations = torch.ones(1000)
        refs.append(weakref.ref(activations))
        torch.empty(1 << 60)

    def data(batch):
        activations = torch.ones(1000)
        refs.append(weakref.ref(activations))
        torch.empty(1 << 60)

    for call in (step, lambda: memguard.map_batches(data, list(range(4)), batch_size=1)):
        refs.clear()
        with pytest.raises(memguard.OutOfMemoryError) as info:
            call()
        assert refs and all(r() is None for r in refs), info.value


def test_each_failed_attempt_names_the_size_the_next_one_runs_at():
    calls = []
    train = memguard.oom_retry(batch_size=64, factor=0.25, min_batch_size=2)(workload(3, calls))
    assert train() == 2 and [b for b, _ in calls] == [64, 16, 4, 2]
    history = train.history
    assert [(a.size, a.next_size) for a in history] == [(64, 16), (16, 4), (4, 2),
                                                                   (2, None)]
    assert str(history[0]).endswith("; next batch_size=16") and "next" not in str(history[-1])
    assert history[0].to_dict()["next_size"] == 16
    seen = []
    train = memguard.oom_retry(batch_size=8, factor=lambda size: max(1, size - 3),
                               on_retry=seen.append)(workload(0, None))
    with pytest.raises(memguard.OutOfMemoryError) as info:
        train()
    assert [(a.size, a.next_size) for a in seen] == [(8, 5), (5, 2), (2, 1)]
    assert [(a.size, a.next_size) for a in info.value.attempts][-1] == (1, None)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_recovery_runs_once_the_failed_attempt_and_its_exception_are_gone(kind):
    """The decision is taken inside the exception handling, the cleanup outside it: when
    on_retry runs, no exception is being handled and the failed attempt's tensors are freed."""
    import sys
    import weakref

    refs, seen = [], []

    def body(batch_size):
        held = torch.ones(1000)
        refs.append(weakref.ref(held))
        torch.empty(batch_size * (1 << 42) if batch_size > 2 else batch_size)
        return batch_size

    def on_retry(attempt):
        seen.append((sys.exc_info()[1], [r() is None for r in refs]))

    async def async_body(batch_size):
        return body(batch_size)

    if kind == "sync":
        assert memguard.oom_retry(batch_size=8, on_retry=on_retry)(body)() == 2
    else:
        step = memguard.oom_retry(batch_size=8, on_retry=on_retry)(async_body)
        assert asyncio.run(step()) == 2
    assert seen == [(None, [True]), (None, [True, True])]


def test_other_exceptions_leave_an_async_function_untouched_with_their_traceback():
    error = ValueError("bad labels")

    @memguard.oom_retry(batch_size=16)
    async def train(batch_size):
        raise error

    with pytest.raises(ValueError, match="bad labels") as info:
        asyncio.run(train())
    assert info.value is error and info.traceback[-1].name == "train"
    assert info.value.__cause__ is None and info.value.__context__ is None
    assert [a.ok for a in train.history] == []


def test_a_function_whose_code_changes_is_bound_by_its_new_signature():
    # the signature is computed once per function and kept while its code and defaults are
    # the same: a changed function must not be bound by the old one
    def train(batch_size):
        return ("old", batch_size)

    guarded = memguard.oom_retry(batch_size=4)(train)
    assert guarded() == ("old", 4)

    def replacement(prefix, batch_size=4):
        return (prefix, batch_size)

    train.__code__ = replacement.__code__
    train.__defaults__ = replacement.__defaults__
    assert guarded("new") == ("new", 4)
    assert guarded("new", batch_size=2) == ("new", 2)


def test_a_method_is_bound_as_a_method_after_the_function_was_called_plainly():
    class Trainer:
        @memguard.oom_retry(batch_size=8)
        def fit(self, batch_size):
            return (self, batch_size)

    trainer = Trainer()
    assert Trainer.fit(trainer) == (trainer, 8)  # unbound: self is an argument
    assert trainer.fit() == (trainer, 8)  # bound: self is not
    assert trainer.fit(batch_size=4) == (trainer, 4)
    assert Trainer.fit(trainer, 2) == (trainer, 2)


def test_every_way_of_calling_binds_as_inspect_binds():
    # plain parameters are bound without inspect's walk: the same arguments, positional and
    # by keyword, as Signature.bind_partial; a call that does not bind fails as before
    from memguard.loop import Policy
    from memguard.retry import _Config, _PlainBinding

    def step(data, batch_size, scale=1.0, label="x"):
        return data, batch_size, scale, label

    cfg = _Config(step, 8, "batch_size", Policy(), False, "accumulation_steps", False, None, ())
    signature = inspect.signature(step)
    calls = [((), {}), ((1,), {}), ((1, 2),), ((1, 2, 3.0, "y"), {}), ((1,), {"scale": 2.0}),
             ((), {"label": "z", "data": 5}), ((1, 2), {"label": "z"})]
    for args, *rest in calls:
        kwargs = rest[0] if rest else {}
        ours, theirs = cfg.bind(step, args, kwargs), signature.bind_partial(*args, **kwargs)
        assert isinstance(ours, _PlainBinding)
        assert ours.arguments == dict(theirs.arguments)
        assert list(ours.arguments) == list(theirs.arguments)
        for size in (4, None):
            if size is not None:
                ours.arguments["batch_size"] = theirs.arguments["batch_size"] = size
            assert ours.split() == (theirs.args, theirs.kwargs)
    for args, kwargs in (((1, 2, 3, 4, 5), {}), ((1,), {"data": 2}), ((), {"other": 1})):
        with pytest.raises(TypeError):
            cfg.bind(step, args, kwargs)
    guarded = memguard.oom_retry(batch_size=8)(step)
    assert guarded(1) == (1, 8, 1.0, "x")
    assert guarded(1, label="z") == (1, 8, 1.0, "z")
    assert guarded(data=1, scale=2.0) == (1, 8, 2.0, "x")
    with pytest.raises(TypeError, match="multiple values"):
        guarded(1, data=2)
