from __future__ import annotations

import gc

import pytest
import torch

import memguard
from memguard.backends import host

MiB = 1 << 20


def mixed_model() -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5),
                                torch.nn.Sequential(torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2)))
    model.train()
    model[1].eval()       # a frozen dropout inside a training model
    model[2][0].eval()    # and a frozen batch norm
    return model


def flags(model: torch.nn.Module) -> list[bool]:
    return [m.training for m in model.modules()]


def test_runs_without_autograd_in_eval_mode_and_restores_every_flag():
    model = mixed_model()
    original = flags(model)
    with memguard.inference_mode(model):
        assert torch.is_inference_mode_enabled()
        assert not any(flags(model))
        out = model(torch.ones(3, 4))
    assert out.requires_grad is False and out.is_inference()
    assert flags(model) == original == [True, True, False, True, False, True]
    assert not torch.is_inference_mode_enabled()


def test_flags_are_restored_when_the_body_raises():
    model, other = mixed_model(), mixed_model()
    other.eval()
    with pytest.raises(ZeroDivisionError):
        with memguard.inference_mode(model, other):
            1 / 0  # noqa: B018 - the division is the error the block raises
    assert flags(model) == [True, True, False, True, False, True]
    assert not any(flags(other))
    assert not torch.is_inference_mode_enabled()


def test_non_models_are_refused_by_position():
    model = mixed_model()
    with pytest.raises(TypeError, match=r"argument 1 is a str, not a torch\.nn\.Module"):
        memguard.inference_mode(model, "weights.pt")
    with pytest.raises(ValueError, match="cleanup must be 'auto', 'always' or 'never', got 'yes'"):
        memguard.inference_mode(model, cleanup="yes")


def test_decorator_forms():
    model = mixed_model()

    @memguard.inference_mode
    def bare(x):
        """Predict."""
        return torch.is_inference_mode_enabled(), x * 2

    @memguard.inference_mode(model)
    def predict(x):
        return model.training, model(x)

    assert bare(1) == (True, 2) and bare.__doc__ == "Predict."
    training, out = predict(torch.ones(2, 4))
    assert training is False and not out.requires_grad
    assert model.training is True


def test_methods_can_be_decorated():
    class Server:
        def __init__(self):
            self.model = torch.nn.Linear(4, 2)

        @memguard.inference_mode()
        def answer(self, x):
            return self.model(x)

    assert Server().answer(torch.ones(1, 4)).requires_grad is False


def test_generators_and_coroutines_are_refused():
    def gen():
        yield 1

    async def coro():
        return 1

    for func in (gen, coro):
        with pytest.raises(TypeError, match="inference_mode cannot decorate"):
            memguard.inference_mode(func)


def test_cleans_up_what_inference_left_in_a_cycle():
    model = torch.nn.Linear(1024, 1024)
    memguard.free_memory()
    gc.disable()
    try:
        start = host.rss()
        with memguard.inference_mode(model):
            out = model(torch.ones(50_000, 1024))  # 200 MB of activations
            holder = [out]
            holder.append(holder)
            del out, holder
        assert host.rss() - start < 30 * MiB
    finally:
        gc.enable()


def test_on_a_fragmented_heap_the_check_reads_the_resident_set_and_still_cleans_up(
        python_in_subprocess):
    # mallinfo2 walks every free block: on a heap of 10,000 free blocks between live ones
    # it takes milliseconds, more than the forward it guards; the check then reads the
    # resident set, and what a block leaves in a cycle is still collected
    out = python_in_subprocess("""
        import gc, json, time
        import torch
        import memguard
        from memguard.backends import host
        from memguard.backends.host import HostBackend
        keep = [torch.ones(100 + i % 50) for i in range(20000)]
        del keep[::2]  # free blocks between live ones
        start = time.perf_counter()
        host.malloc_in_use()
        slow = time.perf_counter() - start
        model = torch.nn.Linear(1024, 1024)
        with memguard.inference_mode(model):
            model(torch.ones(8, 1024))
        kinds = [backend.read_quick(device)[0]
                 for backend, device in memguard.backends.resolve_devices(None)
                 if isinstance(backend, HostBackend)]
        gc.disable()
        rss = host.rss()
        with memguard.inference_mode(model):
            out = model(torch.ones(50_000, 1024))  # 200 MB of activations, in a cycle
            holder = [out]
            holder.append(holder)
            del out, holder
        print(json.dumps({"slow": slow, "kinds": kinds, "kept": host.rss() - rss}))
    """)
    assert out["slow"] > 200e-6, out  # precondition: mallinfo2 is slow on this heap
    assert out["kinds"] == ["resident"], out
    assert out["kept"] < 30 * MiB, out


def test_one_slow_mallinfo2_alone_keeps_the_cheaper_reading(python_in_subprocess):
    # a mallinfo2 slowed once (the process preempted on a loaded machine, about once in a
    # thousand readings) must not switch every check to the resident set for seconds: that
    # reading is a system call, dearer near a forward pass; a heap slow twice in a row does
    out = python_in_subprocess("""
        import json, time
        import torch
        from memguard.backends import host
        keep = [torch.ones(100 + i % 50) for i in range(20000)]
        del keep[::2]  # free blocks between live ones: mallinfo2 is slow
        start = time.perf_counter()
        host.read_quick()
        slow = time.perf_counter() - start
        del keep  # the heap is whole again: mallinfo2 is fast
        once = host.quick_kind()
        host.read_quick()
        keep = [torch.ones(100 + i % 50) for i in range(20000)]
        del keep[::2]
        host.read_quick()
        host.read_quick()
        print(json.dumps({"slow": slow, "once": once, "twice": host.quick_kind()}))
    """)
    assert out["slow"] > 200e-6, out  # precondition: mallinfo2 is slow on that heap
    assert out == dict(out, once="in use", twice="resident"), out


def test_a_reading_that_waited_for_the_thread_is_not_a_slow_heap(python_in_subprocess):
    # two readings made slow by waiting, not by the heap (a busy thread holding the
    # interpreter lock, the process preempted), switched the quick reading to the resident
    # set for 10 s, where each 8 MiB cycle then cost a full collection: 100 frees_memory
    # calls took 10 s instead of 15-30 ms
    out = python_in_subprocess("""
        import json, time
        from memguard.backends import host
        host.read_quick()  # glibc's functions looked up
        start = time.perf_counter()
        host.read_quick()
        quick = time.perf_counter() - start
        for _ in range(3):  # each begun a second ago, as one the thread waited through
            host._judge_mallinfo(time.perf_counter() - 1.0)
        print(json.dumps({"quick": quick, "kind": host.quick_kind()}))
    """)
    assert out["quick"] < 100e-6, out  # precondition: mallinfo2 is quick on this heap
    assert out["kind"] == "in use", out


def test_without_torch_it_only_cleans_up(python_in_subprocess):
    out = python_in_subprocess("""
        import gc, json, sys
        import memguard
        from memguard.backends import host
        gc.disable()
        start = host.rss()
        with memguard.inference_mode():
            block = [bytearray(200 * 2**20)]
            block.append(block)
            del block
        print(json.dumps({"torch": "torch" in sys.modules,
                          "left_mib": (host.rss() - start) / 2**20}))
    """)
    assert out["torch"] is False and out["left_mib"] < 30


def deep_model() -> torch.nn.Module:
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
                                 for _ in range(100)])


def test_switching_modes_costs_less_than_a_bare_eval_and_train():
    """Entering and leaving writes the flags directly: on a model of 301 plain modules it
    costs well under the ``eval()`` and ``train()`` it replaces (their walk through
    ``Module.__setattr__`` took longer than the rest of inference_mode together)."""
    import statistics
    import time

    model = deep_model()

    def bare():
        model.eval()
        model.train()

    def guarded():
        with memguard.inference_mode(model, cleanup="never"):
            pass

    times: dict = {bare: [], guarded: []}
    for _ in range(15):
        for fn in times:
            start = time.perf_counter()
            for _ in range(20):
                fn()
            times[fn].append(time.perf_counter() - start)
    ratio = statistics.median(times[guarded]) / statistics.median(times[bare])
    assert ratio < 0.6, f"inference_mode cost {ratio:.2f}x a bare eval() and train()"
    assert all(flags(model))


def test_a_module_that_overrides_train_gets_its_own_eval():
    calls = []

    class Frozen(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.BatchNorm1d(4)

        def train(self, mode=True):
            calls.append(mode)
            return super().train(mode)

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), Frozen())
    with memguard.inference_mode(model):
        assert not any(flags(model))
    assert calls == [False] and all(flags(model))


class Served(torch.nn.Module):
    """A model class that overrides ``train`` and ``__setattr__`` (Hugging Face's models
    override ``train``), counting what reaches them."""

    def __init__(self, calls: list) -> None:
        super().__init__()
        self.calls = calls
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))

    def train(self, mode=True):
        self.calls.append(("train", mode))
        return super().train(mode)

    def __setattr__(self, name, value):
        if name == "training" and "calls" in self.__dict__:
            self.calls.append(("set", value))
        super().__setattr__(name, value)

    def forward(self, x):
        return self.body(x)


def test_a_model_already_in_eval_mode_is_not_switched_again():
    # serving: a model put in eval once, then inference_mode per request; nothing needs
    # switching, and on a 164-module GPT-2 the switch (its own train() override) and the
    # flags' way back through __setattr__ cost ten times the rest of a block
    calls: list = []
    model = Served(calls).eval()
    calls.clear()
    for _ in range(3):
        with memguard.inference_mode(model):
            assert not any(flags(model))
    assert calls == [] and not any(flags(model))
    with memguard.inference_mode(model):
        model.train()  # the block's own code turns it on: it goes back as it was
        assert all(flags(model))
    assert not any(flags(model))
    model.train()
    calls.clear()
    with memguard.inference_mode(model):  # in training mode: switched, and back
        assert not any(flags(model))
    assert calls[0] == ("train", False) and all(flags(model))


def test_a_block_on_a_served_model_registers_nothing_and_writes_nothing():
    from memguard.backends import torch as torch_backend

    calls: list = []
    served = Served(calls).eval()
    training = torch.nn.Linear(2, 2)
    calls.clear()
    with memguard.inference_mode(served, cleanup="never"):  # quiet: no module registered
        assert torch_backend._INSIDE == {}
    with memguard.inference_mode(training, cleanup="never"):  # beside a switched model,
        with memguard.inference_mode(served, cleanup="never"):  # the served one registers
            assert id(served) in torch_backend._INSIDE
    assert calls == [] and not any(flags(served)) and training.training  # and is not written
    assert torch_backend._INSIDE == {}


def test_blocks_that_overlap_a_quiet_one_leave_the_model_as_before_the_first():
    # a quiet block (model in eval) registers nothing; a block entering beside it (another
    # thread) registers it too, with the flag it entered with, so neither order of leaving
    # restores the flag the quiet block's code set in between
    import threading

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5)).eval()
    seen: list = []

    def block(entered: threading.Event, leave: threading.Event, switch: bool) -> None:
        with memguard.inference_mode(model):
            if switch:
                model.train()  # the quiet block's own code
            entered.set()
            assert leave.wait(10)
        seen.append(flags(model))

    for quiet_leaves_first in (True, False):
        events = [threading.Event() for _ in range(4)]
        quiet = threading.Thread(target=block, args=(events[0], events[1], True))
        other = threading.Thread(target=block, args=(events[2], events[3], False))
        quiet.start()
        assert events[0].wait(10)
        other.start()
        assert events[2].wait(10)
        assert not any(flags(model))  # the other block switched it off again
        first, second = (quiet, other) if quiet_leaves_first else (other, quiet)
        events[1 if quiet_leaves_first else 3].set()
        first.join(10)
        assert not any(flags(model))  # one block is still inside
        events[3 if quiet_leaves_first else 1].set()
        second.join(10)
        assert not any(flags(model)), quiet_leaves_first
    assert seen and not any(any(f) for f in seen)


def test_the_last_quiet_block_to_leave_puts_a_switched_flag_back():
    # as for blocks that switched the model: a flag the inner block's code turned on stays
    # until the last block on that module leaves; a module no other block is on goes back
    model, alone = torch.nn.Linear(2, 2).eval(), torch.nn.Linear(2, 2).eval()
    with memguard.inference_mode(model, cleanup="never"):
        with memguard.inference_mode(model, alone, cleanup="never"):
            model.train()
            alone.train()
        assert model.training and not alone.training
    assert not model.training and not alone.training


def test_a_forked_child_ends_the_blocks_of_threads_it_does_not_have(python_in_subprocess):
    # a thread of the parent was inside a block at the fork: in the child that block never
    # leaves, and its registration kept the child's own blocks from putting the flag back
    out = python_in_subprocess("""
        import json, os, threading
        import torch, memguard
        model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5))  # training
        served = torch.nn.Linear(2, 2).eval()
        inside, leave = threading.Event(), threading.Event()

        def block():
            with memguard.inference_mode(model, served, cleanup="never"):
                inside.set()
                leave.wait(10)

        thread = threading.Thread(target=block)
        thread.start()
        assert inside.wait(10)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                seen = [model.training]
                with memguard.inference_mode(model, cleanup="never"):
                    seen.append(model.training)
                seen += [model.training, served.training]
                os.write(write, json.dumps(seen).encode())
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        child = json.loads(os.read(read, 1000))
        parent_inside = model.training
        leave.set()
        thread.join()
        print(json.dumps({"child": child, "parent": [parent_inside, model.training,
                                                    served.training]}))
    """)
    assert out == {"child": [True, False, True, False], "parent": [False, True, False]}, out


def test_a_module_shared_by_two_models_gets_its_own_flag_back():
    shared = torch.nn.Linear(2, 2)
    first, second = torch.nn.Sequential(shared), torch.nn.Sequential(shared, torch.nn.ReLU())
    with memguard.inference_mode(first, second):
        assert not any(flags(first) + flags(second))
    assert all(flags(first) + flags(second))


def full_collections_during(fn) -> int:
    """How many full (generation 2) collections ran while ``fn`` ran."""
    count = [0]

    def callback(phase: str, info: dict) -> None:
        if phase == "start" and info["generation"] == 2:
            count[0] += 1

    gc.callbacks.append(callback)
    try:
        fn()
    finally:
        gc.callbacks.remove(callback)
    return count[0]


def test_outputs_the_caller_keeps_do_not_cost_a_full_collection_every_call():
    # a language model's logits are often larger than the host's tolerance (4 MiB); a caller
    # that gathers each block's output (predictions over an evaluation set) left that much
    # more in use at every exit, and each exit ran a full collection (~100 ms with torch
    # imported): 20 of 20 blocks. Memory really in use is collected for with a back-off
    model = torch.nn.Linear(64, 16384)
    x = torch.ones(256, 64)
    memguard.free_memory()
    outputs = []

    def evaluate() -> None:
        for _ in range(20):
            with memguard.inference_mode(model):
                outputs.append(model(x))  # 16 MiB each, kept

    assert full_collections_during(evaluate) <= 5


def test_short_blocks_that_leave_cycles_are_still_collected(python_in_subprocess):
    # short blocks are checked every few blocks (memguard.inference.CHECK_SHARE, at most
    # MAX_GAP seconds of blocks apart); the check compares with the level the previous one
    # left, so what the unchecked blocks left in cycles is collected too
    out = python_in_subprocess("""
        import gc, json, time
        import torch
        import memguard
        from memguard.backends import host
        model = torch.nn.Linear(8, 8)
        gc.disable()
        start = host.malloc_in_use()
        for _ in range(100):
            with memguard.inference_mode(model):
                holder = [torch.ones(2**18), model(torch.ones(1, 8))]  # 1 MiB in a cycle
                holder.append(holder)
                del holder
                time.sleep(0.002)
        print(json.dumps({"left_mib": (host.malloc_in_use() - start) / 2**20}))
    """)
    assert out["left_mib"] < 40, out  # 100 MiB were left in cycles, one by each block


def test_blocks_in_several_threads_share_the_checks_without_waiting():
    # one check at a time: a thread that finds another checking goes on without waiting
    import threading

    models = [torch.nn.Linear(64, 64) for _ in range(4)]
    errors: list[BaseException] = []

    def work(model: torch.nn.Module) -> None:
        try:
            for _ in range(200):
                with memguard.inference_mode(model):
                    out = model(torch.ones(32, 64))
                    assert not out.requires_grad and not model.training
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(m,)) for m in models]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads)
    assert errors == [] and all(m.training for m in models)


def test_overlapping_blocks_on_one_model_from_two_threads_keep_it_in_eval_until_the_last_leaves():
    """Two threads serve one model with overlapping blocks: the first to leave does not put
    the model back in training (dropout on) under the second, and the last to leave restores
    the model as it was before the first entered."""
    import threading

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5))
    x = torch.ones(4, 8)
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen: dict = {}

    def first() -> None:
        with memguard.inference_mode(model, cleanup="never"):
            first_in.set()
            assert second_in.wait(30)
        first_out.set()

    def second() -> None:
        assert first_in.wait(30)
        with memguard.inference_mode(model, cleanup="never"):
            second_in.set()
            assert first_out.wait(30)
            seen["flags"] = flags(model)
            seen["same"] = torch.equal(model(x), model(x))  # dropout off: deterministic
        seen["after"] = flags(model)

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads)
    assert seen["flags"] == [False, False, False] and seen["same"]
    assert seen["after"] == [True, True, True] and all(flags(model))

    # a model in eval before the first block stays in eval after the last
    model.eval()
    first_in.clear(), second_in.clear(), first_out.clear()
    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(flags(model))
