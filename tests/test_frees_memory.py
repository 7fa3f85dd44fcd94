"""@frees_memory on every kind of callable, with real torch CPU memory."""

from __future__ import annotations

import asyncio
import gc
import inspect
import time

import pytest
import torch
from test_scope import FullCollections, cyclic

import memguard
from memguard import frees
from memguard.backends import host
from memguard.cleanup import MAX_GAP, Settler

MiB = 1 << 20


@pytest.fixture(autouse=True)
def no_automatic_gc():
    """Only memguard may collect: the cycles below stay until it does."""
    memguard.free_memory()
    gc.disable()
    yield
    gc.enable()
    gc.collect()


def test_cleans_after_each_call_of_a_plain_function():
    @memguard.frees_memory
    def step(mib):
        cyclic(mib)
        return "done"

    start = host.rss()
    for _ in range(5):
        assert step(100) == "done"
    assert host.rss() - start < 30 * MiB


def test_without_it_the_cycles_pile_up():
    def step(mib):
        cyclic(mib)

    start = host.rss()
    for _ in range(3):
        step(100)
    assert host.rss() - start > 250 * MiB


def test_cleans_after_a_call_that_raised_and_keeps_the_exception():
    error = KeyError("x")

    @memguard.frees_memory
    def step():
        cyclic(150)
        raise error

    start = host.rss()
    with pytest.raises(KeyError) as info:
        step()
    assert info.value is error
    del info
    assert host.rss() - start < 30 * MiB


def test_auto_policy_collects_only_when_memory_is_held():
    @memguard.frees_memory
    def light():
        return torch.ones(100).sum()

    with FullCollections() as seen:
        for _ in range(50):
            light()
    assert seen.count == 0


def test_always_policy_collects_every_call():
    @memguard.frees_memory(cleanup="always")
    def light():
        return 1

    with FullCollections() as seen:
        for _ in range(3):
            light()
    assert seen.count == 3


def test_every_n_calls():
    @memguard.frees_memory(every=3, cleanup="always")
    def light():
        return 1

    with FullCollections() as seen:
        for _ in range(7):
            light()
    assert seen.count == 2


def test_auto_policy_backs_off_when_collections_free_nothing():
    kept = []

    @memguard.frees_memory
    def grows():
        kept.append(torch.ones(8 * MiB // 4))  # really in use: nothing to collect

    with FullCollections() as seen:
        for _ in range(40):
            grows()
    assert 1 <= seen.count <= 8
    kept.clear()


def test_max_leak_raises_after_cleanup():
    kept = []

    @memguard.frees_memory(max_leak="32MiB", warmup=0)
    def leaky():
        kept.append(torch.ones(100 * MiB // 4))

    with pytest.raises(memguard.MemoryLeakError, match=r"leaky.*retained"):
        leaky()
    kept.clear()

    @memguard.frees_memory(max_leak="32MiB")
    def cycles():
        cyclic(100)  # collectable: not a leak

    cycles()


def test_signature_name_doc_and_wrapped_are_kept():
    def original(a: int, b: str = "x", *, c: float = 1.0) -> str:
        """Original doc."""
        return f"{a}{b}{c}"

    wrapped = memguard.frees_memory(every=2)(original)
    assert inspect.signature(wrapped) == inspect.signature(original)
    assert wrapped.__name__ == "original" and wrapped.__doc__ == "Original doc."
    assert wrapped.__wrapped__ is original
    assert wrapped(1, c=2.0) == "1x2.0"


class Model:
    def __init__(self):
        self.calls = 0

    @memguard.frees_memory
    def method(self, mib):
        self.calls += 1
        cyclic(mib)
        return self.calls

    @classmethod
    @memguard.frees_memory
    def inner_classmethod(cls, mib):
        cyclic(mib)
        return cls.__name__

    @memguard.frees_memory
    @classmethod
    def outer_classmethod(cls, mib):
        cyclic(mib)
        return cls.__name__

    @memguard.frees_memory
    @staticmethod
    def outer_staticmethod(mib):
        cyclic(mib)
        return "static"


@pytest.mark.parametrize("call, expected", [
    (lambda m: m.method(100), 1),
    (lambda m: m.inner_classmethod(100), "Model"),
    (lambda m: Model.outer_classmethod(100), "Model"),
    (lambda m: m.outer_classmethod(100), "Model"),
    (lambda m: Model.outer_staticmethod(100), "static"),
])
def test_methods_classmethods_and_staticmethods(call, expected):
    model = Model()
    start = host.rss()
    assert call(model) == expected
    assert host.rss() - start < 30 * MiB


def test_async_function_is_cleaned_after_the_await():
    @memguard.frees_memory
    async def step(mib):
        await asyncio.sleep(0)
        cyclic(mib)
        return "async"

    assert inspect.iscoroutinefunction(step)
    start = host.rss()
    for _ in range(3):
        assert asyncio.run(step(100)) == "async"
    assert host.rss() - start < 30 * MiB


def test_generator_is_cleaned_when_it_finishes():
    @memguard.frees_memory
    def batches(n):
        for i in range(n):
            cyclic(60)
            yield i
        return "end"

    assert inspect.isgeneratorfunction(batches)
    start = host.rss()
    gen = batches(3)
    assert list(gen) == [0, 1, 2]
    assert host.rss() - start < 30 * MiB


def test_generator_is_cleaned_when_closed_early():
    @memguard.frees_memory
    def batches():
        while True:
            cyclic(100)
            yield

    start = host.rss()
    gen = batches()
    next(gen), next(gen)
    assert host.rss() - start > 150 * MiB  # still running: nothing is cleaned yet
    gen.close()
    assert host.rss() - start < 30 * MiB


def test_generator_send_and_return_value_pass_through():
    @memguard.frees_memory
    def echo():
        got = yield "ready"
        return got * 2

    gen = echo()
    assert next(gen) == "ready"
    with pytest.raises(StopIteration) as stop:
        gen.send(21)
    assert stop.value.value == 42


def test_recursive_calls_clean_once_at_the_outermost():
    @memguard.frees_memory(cleanup="always")
    def depth(n):
        return 0 if n == 0 else 1 + depth(n - 1)

    with FullCollections() as seen:
        assert depth(5) == 5
    assert seen.count == 1


@pytest.mark.parametrize("kwargs, match", [
    ({"every": 0}, "every must be a positive int"),
    ({"every": 1.5}, "every must be a positive int"),
    ({"cleanup": "sometimes"}, "cleanup must be 'auto', 'always' or 'never', got 'sometimes'"),
    ({"max_leak": "lots"}, "'lots'"),
])
def test_bad_options_are_refused_at_decoration(kwargs, match):
    with pytest.raises(ValueError, match=match):
        memguard.frees_memory(**kwargs)


def test_async_generators_are_refused_plainly():
    async def agen():
        yield 1

    with pytest.raises(TypeError, match="async generator"):
        memguard.frees_memory(agen)


def test_inputs_allocated_before_the_call_and_caught_in_its_cycle_are_freed():
    """The call's own entry level already holds its input: only the level the previous
    cleanup left shows that the inputs pile up."""

    @memguard.frees_memory
    def step(batch):
        record = {"inputs": batch}
        record["self"] = record

    step(torch.ones(40 * MiB // 4))
    start = host.malloc_in_use()
    for _ in range(10):
        step(torch.ones(40 * MiB // 4))
    assert host.malloc_in_use() - start < 90 * MiB  # bare: 400 MB


class Settles:
    """Counts the cleanups memguard's settlers run (each begins by reading memory)."""

    def __init__(self, monkeypatch):
        self.count = 0
        original = Settler.settle

        def counted(settler, *args, **kwargs):
            self.count += 1
            return original(settler, *args, **kwargs)

        monkeypatch.setattr(Settler, "settle", counted)


def light_function():
    @memguard.frees_memory
    def light():
        return 1

    return light


def test_auto_reads_back_to_back_short_calls_on_a_share_of_the_time(monkeypatch):
    light = light_function()
    settles = Settles(monkeypatch)
    for _ in range(3000):
        light()
    # each reading is due CHECK_SHARE^-1 times its own time after it: a few of 3,000 calls
    assert 1 <= settles.count <= 300, settles.count
    before = settles.count
    time.sleep(MAX_GAP)  # however slow the last reading, one is due after MAX_GAP seconds
    light()
    assert settles.count == before + 1


def test_a_full_collection_makes_the_next_call_read_on_entry(monkeypatch):
    monkeypatch.setattr(frees, "CHECK_SHARE", 1e-9)
    monkeypatch.setattr(frees, "MAX_GAP", 3600.0)  # the next reading due in an hour
    light = light_function()
    settles = Settles(monkeypatch)
    for _ in range(5):
        light()
    assert settles.count == 1  # the first call
    memguard.free_memory()  # a level read before it may be far above what is in use
    light()
    light()
    assert settles.count == 2


def test_a_verdict_reads_every_call(monkeypatch):
    @memguard.frees_memory(max_leak="1GiB")
    def judged():
        return 1

    settles = Settles(monkeypatch)
    for _ in range(50):
        judged()
    assert settles.count == 50


def test_short_calls_that_each_leave_a_cycle_are_freed_every_few_calls():
    """Back-to-back short calls are read every few: what they leave in cycles is freed at
    the next reading, a few milliseconds later, long before it piles up."""

    @memguard.frees_memory
    def step():
        record = {"inputs": torch.ones(MiB // 4)}  # 1 MiB in a cycle: ~0.1 ms a call
        record["self"] = record

    step()
    start = host.malloc_in_use()
    worst = 0
    for _ in range(400):
        step()
        worst = max(worst, host.malloc_in_use() - start)
    assert worst < 150 * MiB  # bare: 400 MiB


@pytest.mark.parametrize("options", [{}, {"max_leak": "1GiB"}], ids=["paced", "every call"])
def test_cycles_of_less_than_the_tolerance_a_call_do_not_pile_up(monkeypatch, options):
    """Each call leaves 1 MiB in a cycle, under the 4 MiB a single call may leave: the level
    the checks compare with must not creep up with it, or nothing is ever collected."""
    monkeypatch.setattr(frees, "MAX_GAP", 0.0)  # every call read, however short

    @memguard.frees_memory(**options)
    def step():
        record = {"inputs": torch.ones(MiB // 4)}
        record["self"] = record

    step()
    start = host.malloc_in_use()
    for _ in range(60):
        step()
    assert host.malloc_in_use() - start < 20 * MiB  # bare: 60 MiB


def read_only_by_their_run(monkeypatch):
    """A function whose calls leave ``mib`` MiB in a cycle, with no reading ever due by time:
    only a call that runs long enough is read (at its exit)."""
    monkeypatch.setattr(frees, "CHECK_SHARE", 1e-9)
    monkeypatch.setattr(frees, "MAX_GAP", 3600.0)

    @memguard.frees_memory
    def step(mib):
        if mib:
            record = {"inputs": torch.ones(mib * MiB // 4)}
            record["self"] = record

    return step


def test_what_the_last_of_a_burst_of_short_calls_leaves_is_freed_at_its_exit(monkeypatch):
    """The calls before it were too short to be read; this one ran long enough to allocate
    more than the tolerance, so it is read at its own exit: no later call is needed."""
    step = read_only_by_their_run(monkeypatch)

    for _ in range(3):
        step(0)
    start = host.malloc_in_use()
    for _ in range(20):
        step(0)
    step(16)
    assert host.malloc_in_use() - start < 8 * MiB


def test_a_call_read_at_its_exit_alone_compares_in_the_kind_of_its_reference(monkeypatch):
    """The quick reading switched to the resident set (a slow heap) since the last one: a call
    read at its exit alone still reads what malloc hands out, its reference's kind, and
    frees the 64 MiB it left in a cycle."""
    step = read_only_by_their_run(monkeypatch)

    monkeypatch.setattr(host, "_quick_rss_until", 0.0)  # mallinfo2 read: "in use"
    step(0)
    step(0)
    start = host.malloc_in_use()
    host._quick_rss_until = time.monotonic() + 3600  # the resident set from now on
    step(64)
    assert host.malloc_in_use() - start < 8 * MiB


def test_memory_kept_a_little_at_a_time_costs_no_full_collections():
    """Each call's result is kept (no garbage): growth of less than the tolerance a call,
    over several unread calls, is looked for in the young generations only."""
    kept = []

    @memguard.frees_memory
    def step():
        return torch.ones(MiB // 8)  # 512 KiB a call, kept by the caller

    step()
    with FullCollections() as seen:
        for _ in range(300):
            kept.append(step())
    assert seen.count == 0
    kept.clear()


def test_on_a_fragmented_heap_the_auto_check_reads_the_resident_set_and_verdicts_stay_exact(
        python_in_subprocess):
    # mallinfo2 walks every free block (milliseconds on 10,000 of them): without max_leak the
    # check after each call reads the resident set instead and still frees a cycle; with
    # max_leak the verdict still rests on what malloc hands out
    out = python_in_subprocess("""
        import gc, json
        import torch
        import memguard
        from memguard.backends import host
        keep = [torch.ones(100 + i % 50) for i in range(20000)]
        del keep[::2]  # free blocks between live ones
        host.read_fast_as("in use")  # two slow readings in a row: the cheap one stands in
        host.read_fast_as("in use")

        @memguard.frees_memory
        def step():
            out = torch.ones(50_000, 1024)  # 200 MB, left in a cycle
            holder = [out]
            holder.append(holder)

        import sys
        walks = []
        glibc = sys.modules["memguard.backends.host"]._libc()
        walk = glibc["mallinfo2"]
        glibc["mallinfo2"] = lambda: walks.append(1) or walk()  # count mallinfo2's walks
        gc.disable()
        rss = host.rss()
        step()
        kept = host.rss() - rss
        kind, step_walks = host.quick_kind(), len(walks)
        LEAKED = []

        @memguard.frees_memory(max_leak="16MiB", warmup=0)
        def leaky():
            LEAKED.append(torch.ones(16 * 2**20))  # 64 MiB kept

        try:
            leaky()  # the first call is judged too
            verdict = None
        except memguard.MemoryLeakError as err:
            verdict = str(err)
        print(json.dumps({"kept": kept, "kind": kind, "verdict": verdict,
                          "step_walks": step_walks, "leaky_walks": len(walks) - step_walks}))
    """)
    assert out["kind"] == "resident", out
    assert out["step_walks"] == 2, out  # the check reads the cheap reading; the collection
    # judges itself on what malloc hands out, before and after
    assert out["leaky_walks"] > 0, out  # a verdict: what malloc hands out
    assert out["kept"] < 30 * MiB, out
    assert out["verdict"] and "above max_leak=16.0 MiB" in out["verdict"], out


@pytest.mark.parametrize("guard", ["frees_memory", "inference_mode"])
def test_on_a_slow_heap_a_cycle_left_by_every_call_is_freed_by_every_call(
        guard, python_in_subprocess):
    # the resident set does not drop when a collection hands blocks back to malloc: judged on
    # it, each collection looked useless, was skipped for 1, 3, 7 ... calls, and the cycles of
    # the skipped calls stayed (24 MiB after 20 calls; 80 MiB on a loaded machine); untrimmed,
    # the freed blocks were reused by the next call, which then seemed to keep nothing
    out = python_in_subprocess(f"""
        import gc, json
        import torch
        import memguard
        from memguard.backends import host
        keep = [torch.ones(100 + i % 50) for i in range(20000)]
        del keep[::2]  # free blocks between live ones: mallinfo2 is slow
        gc.disable()

        def step():
            record = {{"inputs": torch.randn(2 * 2**20)}}  # 8 MiB in a cycle
            record["self"] = record

        guarded = {{"frees_memory": lambda: memguard.frees_memory(step)(),
                    "inference_mode": lambda: memguard.inference_mode()(step)()}}["{guard}"]
        guarded()
        host.read_fast_as("in use")  # two slow readings in a row: the cheap one stands in
        host.read_fast_as("in use")
        start, kinds, kept = host.malloc_in_use(), set(), 0
        for call in range(20):
            guarded()
            kinds.add(host.quick_kind())
            if call >= 10:  # inference_mode checks a run of short blocks every few blocks
                kept = max(kept, host.malloc_in_use() - start)
        print(json.dumps({{"kinds": sorted(kinds), "kept": kept}}))
    """)
    assert out["kinds"] == ["resident"], out
    assert out["kept"] < 8 * MiB, out


# -- Ctrl-C during the cleanup ---------------------------------------------------------------

class InterruptsWhenFreed:
    """64 MiB in a reference cycle whose finaliser delivers a real SIGINT (Ctrl-C while the
    cleanup's collection runs finalisers). Above glibc's largest mmap threshold (32 MiB), it
    is new pages whatever the heap holds: 8 MiB could come from free heap a test process's
    earlier tests left, and on a heap slow enough that the guards read the resident set the
    "auto" cleanup then saw no growth and rightly collected nothing."""

    def __init__(self) -> None:
        self.data = torch.ones(64 * MiB // 4)
        self.me = self

    def __del__(self) -> None:
        import signal

        signal.raise_signal(signal.SIGINT)


@pytest.mark.parametrize("guard", ["memory_scope", "frees_memory"])
@pytest.mark.parametrize("policy", ["auto", "always"])
def test_ctrl_c_while_the_cleanup_runs_finalisers_is_raised_after_it(guard, policy):
    """A KeyboardInterrupt raised inside a finaliser would be printed ("Exception ignored
    in ...") and lost: held while the cleanup runs, it is raised once the cleanup is over,
    as by free_memory(), with the memory freed and Python's handler back."""
    import signal
    import weakref

    kept: list = []

    def body() -> None:
        kept.append(weakref.ref(InterruptsWhenFreed().data))

    if guard == "memory_scope":
        def run() -> None:
            with memguard.memory_scope(cleanup=policy):
                body()
    else:
        run = memguard.frees_memory(cleanup=policy)(body)

    with pytest.raises(KeyboardInterrupt):
        run()
    assert kept[0]() is None  # the cleanup completed: the cycle was freed
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
