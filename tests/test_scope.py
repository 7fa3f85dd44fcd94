"""memory_scope on real torch CPU tensors, measured through the host backend."""

from __future__ import annotations

import gc
import logging
import threading

import pytest
import torch

import memguard

MiB = 1 << 20


def cyclic(mib: int) -> None:
    """Leave ``mib`` MiB of tensor in a reference cycle that only the collector can free."""
    holder: list = [torch.ones(mib * MiB // 4)]
    holder.append(holder)


class FullCollections:
    """Counts full (generation 2) garbage collections while active."""

    def __enter__(self):
        self.count = 0
        gc.callbacks.append(self._seen)
        return self

    def _seen(self, phase, info):
        if phase == "start" and info["generation"] == 2:
            self.count += 1

    def __exit__(self, *exc):
        gc.callbacks.remove(self._seen)


@pytest.fixture(autouse=True)
def settled():
    memguard.free_memory()


@pytest.mark.parametrize("policy", ["auto", "always"])
def test_memory_in_a_reference_cycle_is_released_on_exit(policy):
    gc.disable()  # the collector must not beat the scope to it
    try:
        with memguard.memory_scope(cleanup=policy) as scope:
            cyclic(200)
    finally:
        gc.enable()
    assert scope.retained["host"] < 20 * MiB
    assert scope.freed > 180 * MiB
    assert scope.peak["host"] - scope.before["host"].reserved > 180 * MiB


def test_memory_still_referenced_is_reported_as_retained():
    with memguard.memory_scope() as scope:
        kept = torch.ones(200 * MiB // 4)
    assert 180 * MiB < scope.retained["host"] < 220 * MiB
    assert scope.freed < 20 * MiB
    del kept


def test_without_cleanup_the_cycle_stays():
    gc.disable()
    try:
        with memguard.memory_scope(cleanup="never") as scope:
            cyclic(200)
        assert scope.retained["host"] > 180 * MiB and scope.freed == 0
    finally:
        gc.enable()
        gc.collect()


def test_glibc_cache_left_by_small_tensors_is_trimmed(python_in_subprocess):
    # In a process of its own, with glibc's thresholds fixed (they move with what the
    # process freed before, and free() trims the top of the heap beyond the trim threshold):
    # 100 KB blocks come from the heap and stay resident after the del until a trim.
    out = python_in_subprocess("""
        import ctypes, json
        import psutil, torch
        import memguard
        libc = ctypes.CDLL(None)
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: free() never trims by itself
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: blocks under 1 MiB from the heap
        process = psutil.Process()
        with memguard.memory_scope() as scope:
            start = process.memory_info().rss
            tensors = [torch.ones(25_000) for _ in range(4000)]  # 400 MB in 100 KB blocks
            del tensors
            untrimmed = process.memory_info().rss - start  # what glibc keeps after the del
        print(json.dumps({"untrimmed": untrimmed, "freed": scope.freed,
                          "retained": scope.retained["host"]}))
    """)
    assert out["untrimmed"] > 300 * MiB, out  # precondition: the freed blocks stayed
    assert out["retained"] < 40 * MiB, out
    assert out["freed"] > 0.8 * out["untrimmed"], out


def test_auto_policy_does_not_collect_when_nothing_is_held():
    with FullCollections() as seen:
        for _ in range(20):
            with memguard.memory_scope():
                torch.ones(1000).sum()
    assert seen.count == 0
    with FullCollections() as seen:
        with memguard.memory_scope(cleanup="always"):
            pass
    assert seen.count == 1


def test_nested_scopes_keep_the_outer_peak(python_in_subprocess):
    # In a process of its own: memory another test's leftovers free meanwhile (a pool's
    # threads ending) lowers the resident set under the inner scope's entry reading
    out = python_in_subprocess("""
        import json, torch
        import memguard
        MiB = 1 << 20
        with memguard.memory_scope("outer") as outer:
            big = torch.ones(300 * MiB // 4)
            del big
            with memguard.memory_scope("inner") as inner:
                small = torch.ones(50 * MiB // 4)
                del small
        print(json.dumps({"outer": outer.peak["host"] - outer.before["host"].reserved,
                          "inner": inner.peak["host"] - inner.before["host"].reserved}))
    """)
    assert out["outer"] > 280 * MiB, out
    assert 40 * MiB < out["inner"] < 150 * MiB, out


def test_ctrl_c_at_an_inner_scopes_reset_keeps_the_outer_peak(python_in_subprocess):
    # the counter an inner scope's entry reads is folded into the scopes already open before
    # it resets the counter: a Ctrl-C landing between the reset and the fold lost the outer
    # scope's peak so far (here 64 MiB), 10 of 587 interrupted rounds under SIGALRM
    out = python_in_subprocess("""
        import json, os, sys, types
        import memguard
        host = sys.modules["memguard.backends.host"]
        armed = [False]
        def write(fd, data):  # the reset written, then Ctrl-C, as a signal landing there
            written = os.write(fd, data)
            if armed[0] and data == b"5":
                armed[0] = False
                raise KeyboardInterrupt
            return written
        host.os = types.SimpleNamespace(**{**vars(os), "write": write})
        for _ in range(3):
            with memguard.memory_scope():
                pass
        outer = memguard.memory_scope(cleanup="never")
        interrupted = False
        with outer:
            block = bytearray(64 << 20)
            block[::4096] = b"x" * len(block[::4096])
            del block
            armed[0] = True
            try:
                with memguard.memory_scope(cleanup="never"):
                    pass
            except KeyboardInterrupt:
                interrupted = True
        print(json.dumps({"interrupted": interrupted,
                          "rise": outer.peak["host"] - outer.before["host"].reserved}))
    """)
    assert out["interrupted"], out  # precondition: the inner entry was interrupted there
    assert out["rise"] >= 60 << 20, out


def test_ctrl_c_anywhere_in_a_scopes_entry_or_exit_leaves_no_lock_held(python_in_subprocess):
    # a KeyboardInterrupt raised as a lock's acquire returned, before the block that
    # releases it began, left it held: the next scope waited for ever (20 of 20 processes,
    # after 1 to 117 interrupted rounds of a program that catches Ctrl-C and goes on)
    out = python_in_subprocess("""
        import faulthandler, json, random, signal, sys
        import memguard
        faulthandler.dump_traceback_later(20, exit=True)  # a hang fails, with its stack
        random.seed(0)
        def interrupt(signum, frame):
            raise KeyboardInterrupt
        signal.signal(signal.SIGALRM, interrupt)
        interrupted = 0
        for _ in range(300):
            try:
                signal.setitimer(signal.ITIMER_REAL, random.uniform(0.0001, 0.001))
                while True:
                    with memguard.memory_scope(cleanup="never"):
                        pass
            except KeyboardInterrupt:
                interrupted += 1
        signal.setitimer(signal.ITIMER_REAL, 0)
        with memguard.memory_scope() as scope:
            block = bytearray(32 << 20)
            block[::4096] = b"x" * len(block[::4096])
        print(json.dumps({"interrupted": interrupted,
                          "rise": scope.peak["host"] - scope.before["host"].reserved}))
    """, timeout=120)
    assert out["interrupted"] == 300, out
    assert out["rise"] >= 30 << 20, out  # the scopes after them still measure


def test_peak_after_the_inner_scope_counts_for_the_outer_one():
    with memguard.memory_scope() as outer:
        with memguard.memory_scope():
            pass
        big = torch.ones(250 * MiB // 4)
        del big
    assert outer.peak["host"] - outer.before["host"].reserved > 230 * MiB


def test_scopes_in_threads_each_see_their_own_peak():
    """A scope opened in another thread after this one's peak resets the device's counter:
    the peak reached before that reset must still be this scope's."""
    barrier = threading.Barrier(2)
    results = {}

    def big():
        with memguard.memory_scope("big") as scope:
            block = torch.ones(300 * MiB // 4)
            del block
            barrier.wait()  # the peak is reached and gone: now the idle scope opens
            barrier.wait()  # ... and has reset the counter
        results["big"] = scope

    def idle():
        barrier.wait()
        with memguard.memory_scope("idle") as scope:
            barrier.wait()
        results["idle"] = scope

    threads = [threading.Thread(target=big), threading.Thread(target=idle)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    rise = results["big"].peak["host"] - results["big"].before["host"].reserved
    assert rise > 280 * MiB
    idle_rise = results["idle"].peak["host"] - results["idle"].before["host"].reserved
    assert idle_rise < 100 * MiB  # the idle scope opened after the peak: not its own


def test_body_exception_propagates_unchanged_and_cleanup_still_runs():
    gc.disable()
    error = ValueError("boom")
    try:
        with pytest.raises(ValueError, match="boom") as info:  # noqa: PT012 - must pass the scope
            with memguard.memory_scope(max_leak="1KiB") as scope:
                cyclic(200)
                raise error
    finally:
        gc.enable()
    assert info.value is error
    assert info.traceback[-1].name == (
        "test_body_exception_propagates_unchanged_and_cleanup_still_runs")
    assert scope.after is not None and scope.freed > 180 * MiB


def test_keyboard_interrupt_passes_through_after_cleanup():
    with pytest.raises(KeyboardInterrupt):
        with memguard.memory_scope() as scope:
            raise KeyboardInterrupt
    assert scope.after is not None and "host" in scope.retained


def test_max_leak_raises_with_what_was_kept():
    with pytest.raises(memguard.MemoryLeakError) as info:
        with memguard.memory_scope("load", max_leak="64MiB"):
            kept = torch.ones(200 * MiB // 4)
    err = info.value
    assert set(err.retained) == {"host"} and err.retained["host"] > 180 * MiB
    assert err.limit == 64 * MiB
    assert "memory_scope 'load' retained" in str(err) and "64.0 MiB" in str(err)
    del kept


def test_max_leak_is_quiet_when_nothing_leaks():
    with memguard.memory_scope(max_leak=64 * MiB) as scope:
        torch.ones(200 * MiB // 4).sum()
    assert scope.retained["host"] < 64 * MiB


def test_leak_is_logged_not_raised_when_the_body_raised(caplog):
    with caplog.at_level(logging.WARNING, logger="memguard"):
        with pytest.raises(RuntimeError, match="original"):  # noqa: PT012 - must pass the scope
            with memguard.memory_scope(max_leak="1MiB"):
                kept = torch.ones(50 * MiB // 4)  # noqa: F841
                raise RuntimeError("original")
    assert "not raised: the block raised RuntimeError" in caplog.text


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="'12 apples'"):
        memguard.memory_scope(max_leak="12 apples")
    with pytest.raises(ValueError, match="cleanup must be"):
        memguard.memory_scope(cleanup="sometimes")
    with pytest.raises(TypeError, match="name must be a string"):
        memguard.memory_scope(42)


def test_a_scope_object_cannot_be_entered_twice_at_once():
    scope = memguard.memory_scope()
    with scope:
        with pytest.raises(RuntimeError, match="already open"):
            with scope:
                pass


def test_str_summarises_and_debug_log_repeats_it(caplog):
    scope = memguard.memory_scope("step")
    assert str(scope) == "memory_scope 'step' (not entered)"
    with caplog.at_level(logging.DEBUG, logger="memguard"):
        with scope:
            pass
    text = str(scope)
    assert text.startswith("memory_scope 'step': host peak ") and "retained" in text
    assert "freed" in text and text in caplog.text
    data = scope.to_dict()
    assert data["name"] == "step" and set(data["retained"]) == {"host"}


def test_decorator_forms_measure_each_call():
    calls = []

    @memguard.memory_scope
    def bare(n):
        """Doc."""
        calls.append(n)
        return n * 2

    @memguard.memory_scope("named", max_leak="64MiB")
    def leaky():
        calls.append("leaky")
        return torch.ones(200 * MiB // 4)

    assert bare(3) == 6 and bare.__name__ == "bare" and bare.__doc__ == "Doc."
    for _ in range(2):  # a fresh scope per call, not "already open"
        with pytest.raises(memguard.MemoryLeakError, match="named") as info:
            leaky()
        del info  # its traceback holds the tensor the call returned
    assert calls == [3, "leaky", "leaky"]


def test_devices_argument_limits_what_is_watched():
    with memguard.memory_scope(devices="host") as scope:
        pass
    assert list(scope.peak) == ["host"] and list(scope.retained) == ["host"]
    with pytest.raises(ValueError, match="unknown device"):
        with memguard.memory_scope(devices=["nowhere"]):
            pass
    # Where the host is the only active device the first check holds whatever ``devices``
    # does; leaving out the host, which every scope watches by default, shows it is obeyed.
    started = torch.cuda.is_initialized()
    with memguard.memory_scope(devices="cuda:0") as gpu_only:
        pass
    assert list(gpu_only.peak) == list(gpu_only.retained) == list(gpu_only.before.devices) \
        == ["cuda:0"]
    if not started:  # on a GPU machine: watching a device never starts CUDA
        assert torch.cuda.is_initialized() is False


def test_a_bare_gpu_is_refused_when_the_scope_is_created_not_when_entered():
    """``"gpu"`` names no device any backend reads (TensorFlow's are ``GPU:0``...; a torch
    GPU is ``cuda``): refused at creation, with the names to use."""
    with pytest.raises(ValueError, match=r"unknown device 'gpu'.*\(a torch GPU is 'cuda'\)"):
        memguard.memory_scope(devices="gpu")
    with pytest.raises(ValueError, match="unknown device 'gpu:x'"):
        memguard.memory_scope(devices=["host", "gpu:x"])
    assert memguard.memory_scope(devices="GPU:1").devices == ("GPU:1",)


def test_a_scopes_snapshots_hold_what_it_measured_and_pickle():
    import pickle

    with memguard.memory_scope() as scope:
        block = torch.ones(4 * MiB // 4)
    entry, leaving = scope.before["host"], scope.after["host"]
    assert leaving.allocated - entry.allocated >= 4 * MiB - 64 * 1024
    assert leaving.peak >= leaving.reserved and entry.peak >= entry.reserved
    # the machine's figures are memguard.snapshot()'s: a scope does not pay for them
    assert (entry.free, entry.total, dict(scope.after.budgets)) == (None, None, {})
    copy = pickle.loads(pickle.dumps(scope))
    assert copy.before == scope.before and copy.after == scope.after
    del block


def test_a_scope_entered_again_shows_none_of_its_last_results_while_open():
    scope = memguard.memory_scope("epoch")
    with scope:
        block = torch.ones(8 * MiB // 4)
    assert scope.after is not None and scope.retained["host"] > 0
    with scope:
        assert "(open)" in str(scope)
        assert scope.after is None and scope.peak == {} and scope.retained == {}
        del block
    assert scope.after is not None and "host" in scope.peak


def test_a_cleanup_set_on_the_attribute_since_is_checked_as_the_constructor_checks_it():
    scope = memguard.memory_scope()
    scope.cleanup = "bogus"
    with pytest.raises(ValueError, match="memory_scope: cleanup must be 'auto', 'always' or"):
        with scope:
            pass
    scope = memguard.memory_scope("block")
    scope.cleanup = "never"  # a valid mode set since: it applies
    with scope:
        kept = bytearray(8 << 20)
    assert scope.freed == 0 and scope.retained["host"] >= 8 << 20
    del kept
