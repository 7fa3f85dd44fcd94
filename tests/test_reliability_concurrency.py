"""Reliability under concurrency: overlapping calls of @frees_memory (asyncio tasks,
interleaved generators, threads), fork while another thread holds memguard's locks, and
decorated functions that pickle and copy as plain functions do."""

from __future__ import annotations

import asyncio
import copy
import multiprocessing
import pickle
import threading

import pytest
import torch
from test_scope import FullCollections

import memguard

import decorated_functions as df
from conftest import run_python

MiB = 1 << 20


@pytest.fixture(autouse=True)
def settled():
    memguard.free_memory()


# -- @frees_memory: each call keeps its own entry readings -------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("every, expected", [(1, 10), (5, 2)])
def test_overlapping_asyncio_calls_each_clean_up(every, expected):
    @memguard.frees_memory(every=every, cleanup="always")
    async def step(i):
        await asyncio.sleep(0)  # every task is inside the call before any leaves it
        return i

    async def main():
        return await asyncio.gather(*(step(i) for i in range(10)))

    with FullCollections() as seen:
        assert asyncio.run(main()) == list(range(10))
    assert seen.count == expected


def test_async_recursion_still_cleans_once_at_the_outermost():
    @memguard.frees_memory(cleanup="always")
    async def depth(n):
        await asyncio.sleep(0)
        return 0 if n == 0 else 1 + await depth(n - 1)

    with FullCollections() as seen:
        assert asyncio.run(depth(5)) == 5
    assert seen.count == 1


def test_interleaved_generators_each_clean_up():
    @memguard.frees_memory(cleanup="always")
    def numbers(n):
        yield from range(n)

    with FullCollections() as seen:
        first, second = numbers(3), numbers(3)
        pairs = list(zip(first, second, strict=False))  # leaves `second` open: finished below
        assert pairs == [(0, 0), (1, 1), (2, 2)]
        assert next(first, None) is None and next(second, None) is None
    assert seen.count == 2


def test_a_generator_left_open_does_not_stop_later_cleanups():
    @memguard.frees_memory(cleanup="always")
    def numbers(n):
        yield from range(n)

    left_open = numbers(5)
    next(left_open)
    with FullCollections() as seen:
        for _ in range(3):
            assert list(numbers(2)) == [0, 1]
    assert seen.count == 3
    left_open.close()


def test_a_generator_closed_on_another_thread_does_not_stop_later_cleanups():
    @memguard.frees_memory(cleanup="always")
    def numbers(n):
        yield from range(n)

    started_here = numbers(5)
    next(started_here)
    with FullCollections() as seen:
        closer = threading.Thread(target=started_here.close)
        closer.start()
        closer.join()
        assert seen.count == 1  # its cleanup ran on the thread that closed it
        for _ in range(3):
            assert list(numbers(2)) == [0, 1]
    assert seen.count == 4


def test_a_leaking_thread_is_blamed_and_clean_threads_are_not():
    """One thread keeps 96 MiB per call while three clean threads' calls overlap its calls
    (they enter after its allocation; in the second round one leaves after the next leak,
    with its own level unchanged). Only the leaking thread's calls may raise."""
    kept: list = []
    errors: dict[str, list[str]] = {"leaky": [], "clean": []}
    allocated, clean_entered = threading.Event(), threading.Barrier(4)
    leaky_left = threading.Event()

    @memguard.frees_memory(max_leak="32MiB", warmup=0)  # every call judged, the first too
    def step(role):
        if role == "leaky":
            kept.append(torch.ones(96 * MiB // 4))
            allocated.set()
        clean_entered.wait(timeout=30)  # all four are inside their calls
        if role == "clean":
            leaky_left.wait(timeout=30)

    def run(role):
        if role == "clean":
            allocated.wait(timeout=30)
        try:
            step(role)
        except memguard.MemoryLeakError as exc:
            errors[role].append(str(exc))
        if role == "leaky":
            leaky_left.set()

    for _ in range(3):
        allocated.clear(), leaky_left.clear(), clean_entered.reset()
        threads = [threading.Thread(target=run, args=(role,))
                   for role in ("leaky", "clean", "clean", "clean")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads)
    kept.clear()
    assert len(errors["leaky"]) == 3, errors
    assert all("step retained" in e for e in errors["leaky"])
    assert errors["clean"] == []


def test_a_clean_call_spanning_a_freed_and_reallocated_leak_is_not_blamed():
    """A clean call enters with 96 MiB held by another thread's earlier call; that memory is
    freed and a new leak of the same size made before the clean call leaves: the clean call's
    level did not change, the second leaking call's did."""
    kept: list = []
    errors: list[str] = []
    clean_in, done = threading.Event(), threading.Event()

    @memguard.frees_memory(max_leak="32MiB")
    def step(role):
        if role == "clean":
            clean_in.set()
            done.wait(timeout=30)
        else:
            kept.append(torch.ones(96 * MiB // 4))

    try:
        step("leaky")
    except memguard.MemoryLeakError:
        pass
    def clean_call():
        try:
            step("clean")
        except memguard.MemoryLeakError as exc:
            errors.append(str(exc))

    clean = threading.Thread(target=clean_call)
    clean.start()
    assert clean_in.wait(timeout=30)
    kept.clear()
    with pytest.raises(memguard.MemoryLeakError, match="step retained"):
        step("leaky")
    done.set()
    clean.join(timeout=60)
    assert not clean.is_alive()
    kept.clear()
    assert errors == []


# -- fork ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_fork_while_another_thread_is_inside_memguard_never_hangs_the_child():
    result = run_python("""
        import json, os, signal, threading, time
        import memguard

        stop = threading.Event()

        @memguard.frees_memory(cleanup="always")
        def step():
            junk = [bytearray(1 << 16) for _ in range(50)]
            junk.append(junk)

        def busy():
            while not stop.is_set():
                with memguard.memory_scope():
                    bytearray(1 << 20)
                step()

        # Warm up first: a child forked while another thread is importing a module (the
        # host backend's first psutil import) waits for ever on Python's own module lock.
        with memguard.memory_scope():
            step()
        thread = threading.Thread(target=busy, daemon=True)
        thread.start()
        hangs = 0
        for i in range(40):
            time.sleep(0.005 * (i % 7))
            pid = os.fork()
            if pid == 0:
                with memguard.memory_scope():
                    bytearray(1 << 20)
                step()
                os._exit(0)
            deadline = time.monotonic() + 10
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    assert os.waitstatus_to_exitcode(status) == 0, status
                    break
                if time.monotonic() > deadline:
                    hangs += 1
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    break
                time.sleep(0.01)
        stop.set()
        thread.join()
        print(json.dumps({"hangs": hangs}))
    """, timeout=500)
    assert result["hangs"] == 0


def test_a_child_forked_while_a_collection_starts_does_not_wait_for_it():
    # CPython counts a collection as running from before its first gc callback to after its
    # last, and a forked child never ends it. A program's callback ahead of memguard's that
    # lets the GIL go is the widest such moment: a child forked there waited 10 s in each
    # collection memguard needed (1 child in 200 of the test above, at random moments).
    result = run_python("""
        import gc, json, logging, os, threading, time
        import memguard

        warned = []
        handler = logging.Handler()
        handler.emit = lambda record: warned.append(record.getMessage())
        logging.getLogger("memguard").addHandler(handler)

        inside, forked = threading.Event(), threading.Event()

        def statistics(phase, info):
            if phase == "start" and threading.current_thread().name == "collector":
                inside.set()
                forked.wait(10)  # a blocking write

        gc.callbacks.insert(0, statistics)
        memguard.free_memory()
        collector = threading.Thread(target=gc.collect, name="collector")
        collector.start()
        assert inside.wait(10)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                began = time.monotonic()
                memguard.free_memory()
                with memguard.memory_scope(max_leak="1MiB"):
                    junk = [bytearray(1 << 24)]
                    junk.append(junk)  # garbage no collection here can free
                    del junk
                said = any("no full collection could run" in m for m in warned)
                code = 0 if time.monotonic() - began < 3 and said else 2
            finally:
                os._exit(code)
        forked.set()
        collector.join()
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"child": os.waitstatus_to_exitcode(status)}))
    """)
    assert result["child"] == 0


@pytest.mark.parametrize("takeover", ["clear at start", "clear at stop", "pop the last"])
def test_a_program_that_takes_over_gc_callbacks_leaves_verdicts_whole(takeover):
    # A profiler that keeps only its own callback, at either phase, or pops the last one: the
    # verdicts waited 10 s for a collection that had ended, or were skipped after it ran; a
    # child forked after one such collection took itself for one forked during it
    result = run_python(f"""
        import gc, json, os, time
        import memguard

        TAKEOVER = {takeover!r}

        def profiler(phase, info):
            if TAKEOVER == "clear at " + phase:
                gc.callbacks[:] = [profiler]
            if TAKEOVER == "pop the last" and gc.callbacks[-1] is not profiler:
                gc.callbacks.pop()

        gc.callbacks.append(profiler)
        gc.collect()
        KEEP = []

        def judged():
            began = time.monotonic()
            try:
                with memguard.memory_scope(cleanup="never", max_leak="1MiB"):
                    KEEP.append(bytearray(16 << 20))  # kept (no torch: a forked child's
                    # first parallel fill waits for ever on the parent's OpenMP threads)
            except memguard.MemoryLeakError:
                return time.monotonic() - began < 3
            return False

        parent = judged()
        gc.callbacks[:] = [profiler]  # its last take-over, the collection before the fork
        gc.collect()
        pid = os.fork()
        if pid == 0:
            os._exit(0 if judged() else 1)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({{"parent": parent, "child": os.waitstatus_to_exitcode(status)}}))
    """)
    assert result == {"parent": True, "child": 0}


# -- Ctrl-C ------------------------------------------------------------------------------------
def test_ctrl_c_during_a_programs_collection_reaches_the_program():
    # A Python callback in gc.callbacks takes a Ctrl-C that arrives during a collection (its
    # handler runs at the callback's first line) and CPython drops it ("Exception ignored"):
    # with memguard merely imported, 18 of 20 were lost. memguard's callbacks are C-level.
    result = run_python("""
        import gc, json, os, signal, threading, time, types
        import torch
        import memguard

        with memguard.memory_scope(max_leak="1GiB"):  # every callback memguard installs
            memguard.free_memory()
        python_callbacks = [type(c).__name__ for c in gc.callbacks
                            if isinstance(c, (types.FunctionType, types.MethodType))]
        heap = [[i] for i in range(1_500_000)]  # a full collection of some 100 ms
        reached = 0
        for trial in range(5):
            timer = threading.Timer(0.02 + 0.013 * trial, os.kill, (os.getpid(), signal.SIGINT))
            timer.start()
            try:
                deadline = time.monotonic() + 3
                while time.monotonic() < deadline:
                    gc.collect()
            except KeyboardInterrupt:
                reached += 1
            timer.join()
        print(json.dumps({"reached": reached, "python_callbacks": python_callbacks}))
    """)
    assert result == {"reached": 5, "python_callbacks": []}


# -- pickling and copying -------------------------------------------------------------------
DECORATED = [df.shrinking_step, df.frees, df.frees_with_options, df.frees_async,
             df.frees_generator, df.scoped, df.scoped_named, df.inferred,
             df.inferred_with_model, df.microbatched, df.recorded]


@pytest.mark.parametrize("func", DECORATED, ids=lambda f: f.__name__)
def test_decorated_functions_pickle_by_reference(func):
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        data = pickle.dumps(func, protocol)
        assert b"decorated_functions" in data and len(data) < 200
        assert pickle.loads(data) is func


@pytest.mark.parametrize("func", DECORATED, ids=lambda f: f.__name__)
def test_copy_and_deepcopy_return_the_decorated_function_itself(func):
    assert copy.copy(func) is func
    assert copy.deepcopy(func) is func
    assert copy.deepcopy({"step": [func]})["step"][0] is func


def test_the_unpickled_function_is_the_working_decorated_one():
    step = pickle.loads(pickle.dumps(df.shrinking_step))
    assert step() == 64
    assert [a.size for a in step.history] == [1024, 512, 256, 128, 64]
    scoped = pickle.loads(pickle.dumps(df.frees_with_options))
    assert scoped(1) == 3


def test_decorated_methods_pickle_like_bound_methods():
    trainer = df.Trainer()
    step = pickle.loads(pickle.dumps(trainer.step))
    assert step(1) == 11
    assert pickle.loads(pickle.dumps(df.Trainer.step))(trainer, 2) == 12
    assert pickle.loads(pickle.dumps(trainer.fit))() == 8


def test_local_and_lambda_decorated_functions_fail_to_pickle_as_plain_ones_do():
    @memguard.frees_memory
    def local(x):
        return x

    with pytest.raises((pickle.PicklingError, AttributeError), match="local object"):
        pickle.dumps(local)
    with pytest.raises(pickle.PicklingError, match="lambda"):
        pickle.dumps(df.frees_lambda)
    assert copy.copy(local) is local  # copying needs no name


@pytest.mark.slow
def test_an_oom_retry_function_runs_in_a_spawn_pool_and_retries_there():
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        sizes = pool.map_async(df.shrinking_step, [1024, 512]).get(timeout=240)
    assert sizes == [64, 64]


def test_a_finaliser_calling_the_function_during_its_cleanup_does_not_deadlock(
        python_in_subprocess):
    """The cleanup's collection runs finalisers; one that calls the same @frees_memory
    function re-enters its bookkeeping on the same thread."""
    out = python_in_subprocess("""
        import gc, json
        import memguard

        calls = []

        class Cycle:
            def __init__(self):
                self.me = self

            def __del__(self):
                step(leave_cycle=False)

        @memguard.frees_memory(cleanup="always")
        def step(leave_cycle=True):
            calls.append(leave_cycle)
            if leave_cycle:
                Cycle()

        gc.disable()  # only the cleanup's own collection finds the cycle
        step()
        print(json.dumps({"calls": calls}))
    """, timeout=60)
    assert out["calls"] == [True, False]


def test_a_finaliser_that_opens_a_scope_never_waits_on_memguard_itself():
    # a collection started inside the peak book's locked section ran a finaliser whose
    # scope waited for ever on that lock
    result = run_python("""
        import json, memguard

        class Resource:
            def __init__(self):
                self.me = self  # freed by a collection

            def __del__(self):
                with memguard.memory_scope():
                    pass

        for i in range(5000):
            Resource()
            with memguard.memory_scope():
                junk = [{} for _ in range(20)]
        print(json.dumps({"done": i + 1}))
    """, timeout=60)
    assert result["done"] == 5000
