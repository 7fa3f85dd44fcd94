"""The one sizing loop: the block form, one vocabulary across the four entry points, nesting
shared by every loop, and decorated functions typed for users' type checkers."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

import memguard
from memguard.loop import Attempt, Policy

CUDA_OOM = "CUDA out of memory. Tried to allocate 2.00 MiB"


def oom_above(limit: int, size: int) -> None:
    if size > limit:
        raise RuntimeError(CUDA_OOM)


# -- the block form -------------------------------------------------------------------------

def test_the_block_form_shrinks_until_the_block_fits_and_records_every_attempt():
    sizes, retried = [], []
    loop = memguard.attempts(batch_size=256, factor=0.5, on_retry=retried.append)
    for attempt in loop:
        with attempt:
            sizes.append(attempt.batch_size)
            oom_above(40, attempt.batch_size)
    assert sizes == [256, 128, 64, 32]
    assert loop.batch_size == 32
    assert [(a.size, a.ok, a.next_size) for a in loop.history] == [
        (256, False, 128), (128, False, 64), (64, False, 32), (32, True, None)]
    assert [a.size for a in retried] == [256, 128, 64]  # after each failure's cleanup


def test_the_block_form_lets_other_errors_through_untouched():
    loop = memguard.attempts(batch_size=8)
    with pytest.raises(KeyError, match="not memory"):  # noqa: PT012 - the loop raises from its own step
        for attempt in loop:
            with attempt:
                raise KeyError("not memory")
    assert loop.history == []  # nothing recorded as an out-of-memory


def test_giving_up_at_one_sample_does_not_advise_lowering_the_floor():
    with pytest.raises(memguard.OutOfMemoryError) as at_one:  # noqa: PT012 - the loop raises from its own step
        for attempt in memguard.attempts(batch_size=2):
            with attempt:
                raise MemoryError("out of memory")
    assert "Not even one sample fits" in str(at_one.value)
    assert "min_batch_size" not in str(at_one.value)
    with pytest.raises(memguard.OutOfMemoryError) as at_floor:  # noqa: PT012 - the loop raises from its own step
        for attempt in memguard.attempts(batch_size=8, min_batch_size=4):
            with attempt:
                raise MemoryError("out of memory")
    assert "Lower min_batch_size" in str(at_floor.value)


def test_the_block_form_gives_up_at_min_batch_size_or_max_attempts():
    exhausted = "out of memory at every batch_size"
    with pytest.raises(memguard.OutOfMemoryError, match=exhausted) as caught:  # noqa: PT012 - the loop raises from its own step
        for attempt in memguard.attempts(batch_size=8, min_batch_size=2):
            with attempt:
                raise MemoryError("out of memory")
    assert [a.size for a in caught.value.attempts] == [8, 4, 2]
    with pytest.raises(memguard.OutOfMemoryError) as caught:  # noqa: PT012 - the loop raises from its own step
        for attempt in memguard.attempts(batch_size=64, max_attempts=2):
            with attempt:
                raise MemoryError("out of memory")
    assert [a.size for a in caught.value.attempts] == [64, 32]
    assert isinstance(caught.value.__cause__, MemoryError)


def test_the_block_form_works_in_async_code():
    async def main() -> int:
        loop = memguard.attempts(batch_size=16)
        for attempt in loop:
            with attempt:
                await asyncio.sleep(0)
                oom_above(4, attempt.batch_size)
        return loop.batch_size

    assert asyncio.run(main()) == 4


# -- one vocabulary -------------------------------------------------------------------------

POLICY = {"min_batch_size": 2, "factor": 0.25, "max_attempts": 3, "on_retry": print,
          "sync": False}


def test_every_sizing_entry_point_takes_the_same_policy_words():
    model = torch.nn.Linear(2, 1)
    memguard.oom_retry(batch_size=8, **POLICY)
    memguard.map_batches(len, [1, 2, 3, 4], batch_size=2, **POLICY)
    memguard.auto_microbatch(model, **POLICY)
    memguard.attempts(batch_size=8, **POLICY)
    find = {k: v for k, v in POLICY.items() if k in ("max_attempts", "on_retry", "sync")}
    assert memguard.find_batch_size(lambda b: None, max_batch_size=4, **find) >= 1


@pytest.mark.parametrize("name, value, message", [
    ("min_batch_size", 0, "min_batch_size must be a positive int, got 0"),
    ("factor", 1.5, "factor must be a number between 0 and 1"),
    ("factor", "half", "factor must be a number between 0 and 1"),
    ("max_attempts", 0, "max_attempts must be a positive int, got 0"),
    ("sync", "yes", "sync must be True, False or 'auto', got 'yes'"),
])
def test_every_entry_point_refuses_a_bad_policy_value_naming_itself(name, value, message):
    model = torch.nn.Linear(2, 1)
    calls = {
        "oom_retry": lambda **kw: memguard.oom_retry(batch_size=8, **kw),
        "map_batches": lambda **kw: memguard.map_batches(len, [1, 2], batch_size=2, **kw),
        "auto_microbatch": lambda **kw: memguard.auto_microbatch(model, **kw),
        "attempts": lambda **kw: memguard.attempts(batch_size=8, **kw),
    }
    for who, call in calls.items():
        with pytest.raises(ValueError, match=f"^{who}: {message}"):
            call(**{name: value})


def test_on_retry_must_be_callable_everywhere():
    for call in (lambda: memguard.oom_retry(on_retry=3),
                 lambda: memguard.attempts(batch_size=2, on_retry=3),
                 lambda: memguard.find_batch_size(len, on_retry=3),
                 lambda: memguard.auto_microbatch(torch.nn.Linear(1, 1), on_retry=3)):
        with pytest.raises(TypeError, match="on_retry must be callable, got 3"):
            call()


def test_auto_and_callable_factors_work_for_auto_microbatch_too():
    model = torch.nn.Linear(3, 1)
    for factor, expected in (("auto", 8), (lambda size: size - 6, 10)):
        model.zero_grad()

        @memguard.auto_microbatch(model, factor=factor)
        def step(batch: torch.Tensor) -> torch.Tensor:
            oom_above(10, len(batch))
            return model(batch).mean()

        step(torch.ones(16, 3))
        assert step.microbatch_size == expected, factor


def test_a_factor_callable_may_return_any_integral_number():
    sizes = []
    loop = memguard.attempts(batch_size=64, factor=lambda size: np.int64(size // 4))
    for attempt in loop:
        with attempt:
            sizes.append(attempt.batch_size)
            oom_above(4, attempt.batch_size)
    assert sizes == [64, 16, 4]
    with pytest.raises(ValueError, match=r"returned 2.5; it must return a positive int"):  # noqa: PT012 - the loop raises from its own step
        for attempt in memguard.attempts(batch_size=8, factor=lambda size: size / 3.2):
            with attempt:
                raise MemoryError("out of memory")


@pytest.mark.slow
def test_cache_true_means_this_process_for_find_batch_size_as_for_oom_retry():
    trials = []

    def step(batch_size: int) -> None:
        trials.append(batch_size)
        oom_above(40, batch_size)

    first = memguard.find_batch_size(step, start=8, cache=True, margin=0.0)
    count = len(trials)
    again = memguard.find_batch_size(step, start=8, cache=True, margin=0.0)
    assert first == again == 40 and len(trials) == count  # no trial the second time
    memguard.find_batch_size(step, start=8, cache=False, margin=0.0)
    assert len(trials) > count


def test_find_batch_size_keeps_every_trial_and_calls_on_retry():
    retried = []
    found = memguard.find_batch_size(lambda b: oom_above(20, b), start=4, margin=0.0,
                                     on_retry=retried.append)
    assert found == 20
    assert isinstance(found, memguard.BatchSize) and isinstance(found, int)
    assert [a.size for a in found.history][:4] == [4, 8, 16, 32]
    assert all(not a.ok for a in retried) and {a.size for a in retried} >= {32}


def test_find_batch_size_restores_the_state_before_each_trial_and_after():
    model = torch.nn.Linear(4, 1)
    start = model.weight.detach().clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    seen = []

    def step(batch_size: int) -> None:
        seen.append(model.weight.detach().clone())
        loss = model(torch.ones(batch_size, 4)).sum()
        loss.backward()
        optimizer.step()  # a trial that trains changes the weights
        optimizer.zero_grad()
        oom_above(12, batch_size)

    memguard.find_batch_size(step, start=2, restore=(model, optimizer))
    assert all(torch.equal(weights, start) for weights in seen)
    assert torch.equal(model.weight, start)


def test_find_batch_size_default_margin_leaves_five_percent():
    assert memguard.find_batch_size(lambda b: oom_above(100, b), start=4) == 95


# -- nesting --------------------------------------------------------------------------------

def test_auto_microbatch_inside_oom_retry_walks_each_ladder_once():
    model = torch.nn.Linear(2, 1)
    passes = []

    @memguard.auto_microbatch(model)
    def step(batch: torch.Tensor) -> torch.Tensor:
        passes.append(len(batch))
        raise RuntimeError(CUDA_OOM)

    @memguard.oom_retry(batch_size=8)
    def train(batch_size: int) -> None:
        step(torch.ones(batch_size, 2))

    with pytest.raises(memguard.OutOfMemoryError):
        train()
    # the inner ladder 8, 4, 2, 1 once; then one pass per outer size 4, 2, 1
    assert len(passes) == 4 + 4 - 1, passes


def test_nested_block_forms_walk_each_ladder_once():
    inner_calls = []
    with pytest.raises(memguard.OutOfMemoryError):  # noqa: PT012 - the loop raises from its own step
        for outer in memguard.attempts(batch_size=8, name="outer"):
            with outer:
                inner = memguard.attempts(batch_size=outer.batch_size, name="inner")
                for attempt in inner:
                    with attempt:
                        inner_calls.append(attempt.batch_size)
                        raise MemoryError("out of memory")
    # the guard is the line that makes the loop: it walks its sizes once, then one attempt
    # at the size it gave up at per outer size (4, 2, 1)
    assert inner_calls == [8, 4, 2, 1] + [1] * 3


def test_a_block_form_inside_a_function_guard_follows_the_rule_of_two_function_guards():
    def never_fits():
        raise MemoryError("out of memory")

    block_calls, function_calls = [], []

    @memguard.oom_retry(batch_size=8)
    def outer_block(batch_size):
        for attempt in memguard.attempts(batch_size=16):
            with attempt:
                block_calls.append(attempt.batch_size)
                never_fits()

    @memguard.oom_retry(batch_size=16)
    def inner(batch_size):
        function_calls.append(batch_size)
        never_fits()

    @memguard.oom_retry(batch_size=8)
    def outer_function(batch_size):
        inner()

    for outer in (outer_block, outer_function):
        with pytest.raises(memguard.OutOfMemoryError):
            outer()
    assert block_calls == function_calls == [16, 8, 4, 2, 1] + [1] * 3  # 5 + 4 - 1, not 20


def test_a_finished_attempt_entered_again_is_an_error_not_a_swallowed_oom():
    loop = memguard.attempts(batch_size=8)
    for attempt in loop:
        with attempt:
            pass
    with pytest.raises(RuntimeError, match=r"attempt 1 of attempts at batch_size=8> has "
                                           r"already run; each attempt runs once"):
        with attempt:
            raise MemoryError("out of memory")  # never reached, never swallowed
    assert loop.batch_size == 8 and [a.size for a in loop.history] == [8]


def test_a_generator_suspended_inside_an_attempt_does_not_nest_its_consumer():
    def batches():
        for attempt in memguard.attempts(batch_size=8):
            with attempt:
                yield attempt.batch_size

    @memguard.oom_retry(batch_size=64)
    def train(batch_size):
        if batch_size > 32:
            torch.empty(batch_size << 42)  # a real out-of-memory above 32
        return batch_size

    feed = batches()
    assert next(feed) == 8  # suspended inside its `with attempt:`
    assert not memguard.loop.running()
    assert train() == 32 and train.batch_size == 32
    assert [a.size for a in train.history] == [64, 32]
    assert train() == 32  # the cache holds what fitted, not 1
    with pytest.raises(StopIteration):
        next(feed)  # the generator's own attempt ends as it would alone


def test_a_recursive_function_reports_the_size_its_inner_call_really_ran_at():
    calls = []

    @memguard.oom_retry(batch_size=16)
    def rec(batch_size, depth=1):
        calls.append((depth, batch_size))
        if depth:
            return rec(batch_size=batch_size, depth=depth - 1)
        if batch_size > 2:
            torch.empty(batch_size << 42)
        return batch_size

    assert rec() == 2
    assert calls == [(1, 16), (0, 16), (0, 8), (0, 4), (0, 2)]
    assert rec.batch_size == 2
    assert [(a.size, a.ok) for a in rec.history] == [(16, False), (8, False), (4, False),
                                                      (2, True)]
    calls.clear()
    assert rec() == 2 and calls == [(1, 2), (0, 2)]  # the next call starts at what worked


# -- records and messages -------------------------------------------------------------------

def test_an_attempt_is_built_by_keyword_and_says_what_its_size_counts():
    with pytest.raises(TypeError):
        Attempt(8, True)  # type: ignore[misc]
    batch = Attempt(size=8, ok=True, seconds=0.1)
    micro = Attempt(size=8, unit="microbatch", steps=4, ok=False, error="oom", next_size=4)
    assert str(batch).startswith("batch_size=8: ok")
    assert str(micro).startswith("microbatch_size=8 (4 slices): oom")


def test_policy_next_size_never_goes_below_the_floor():
    assert Policy(min_batch_size=5, factor=0.1).next_size(64, None, "f") == 6
    assert Policy(min_batch_size=10, factor=0.1).next_size(64, None, "f") == 10


# -- interrupts -----------------------------------------------------------------------------

def test_ctrl_c_during_the_cleanup_between_attempts_stops_the_program(python_in_subprocess):
    out = python_in_subprocess("""
        import json, os, signal
        import memguard

        calls = []

        class Interrupts:
            def __del__(self):
                os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while finalisers run

        @memguard.oom_retry(batch_size=8)
        def train(batch_size):
            calls.append(batch_size)
            cycle = [Interrupts()]
            cycle.append(cycle)  # freed by the collection between attempts
            raise MemoryError("out of memory")

        try:
            train()
            outcome = "went on"
        except KeyboardInterrupt:
            outcome = "interrupted"
        after = signal.getsignal(signal.SIGINT) is signal.default_int_handler
        print(json.dumps({"outcome": outcome, "calls": calls, "handler restored": after}))
    """)
    assert out == {"outcome": "interrupted", "calls": [8], "handler restored": True}


def test_an_attempt_not_run_in_a_with_block_is_an_error_not_a_loop_for_ever():
    loop = memguard.attempts(batch_size=8)
    with pytest.raises(RuntimeError, match=r"was never run; run each attempt's work inside"):
        for _attempt in loop:
            pass
