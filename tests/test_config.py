from __future__ import annotations

import os
import resource

import pytest
import torch

import memguard
from memguard.config import ALLOC_VARIABLES

GiB = 1 << 30


@pytest.fixture
def clean_alloc_env(monkeypatch):
    for name in ALLOC_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def test_configure_allocator_writes_both_variables(clean_alloc_env):
    text = memguard.configure_allocator(max_split_size_mb=128, expandable_segments=True,
                                        garbage_collection_threshold=0.6,
                                        roundup_power2_divisions=4, backend="native")
    assert text == ("max_split_size_mb:128,expandable_segments:True,"
                    "garbage_collection_threshold:0.6,backend:native,roundup_power2_divisions:4")
    assert os.environ["PYTORCH_ALLOC_CONF"] == os.environ["PYTORCH_CUDA_ALLOC_CONF"] == text


def test_configure_allocator_merges_with_what_is_there(clean_alloc_env, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF",
                       "max_split_size_mb:64,roundup_power2_divisions:[256:1,512:2]")
    text = memguard.configure_allocator(max_split_size_mb=512)
    assert text == "max_split_size_mb:512,roundup_power2_divisions:[256:1,512:2]"
    assert os.environ["PYTORCH_ALLOC_CONF"] == text


@pytest.mark.parametrize("kwargs, error, match", [
    ({"max_split_size_mb": 20}, ValueError, r"max_split_size_mb must be an int >= 21, got 20"),
    ({"max_split_size_mb": "128"}, ValueError, "max_split_size_mb"),
    ({"expandable_segments": "yes"}, TypeError, "expandable_segments must be True or False"),
    ({"garbage_collection_threshold": 1.0}, ValueError,
     r"garbage_collection_threshold must be a number between 0 and 1 \(exclusive\)"),
    ({"backend": "cudaMalloc"}, ValueError, "backend must be 'native' or 'cudaMallocAsync'"),
    ({"roundup_power2_divisions": 3}, ValueError,
     "roundup_power2_divisions must be a power of two"),
])
def test_configure_allocator_validates(clean_alloc_env, kwargs, error, match):
    with pytest.raises(error, match=match):
        memguard.configure_allocator(**kwargs)
    assert "PYTORCH_ALLOC_CONF" not in os.environ


def test_memory_limit_gives_a_real_oom_and_restores(tmp_path):
    before = resource.getrlimit(resource.RLIMIT_AS)
    with memguard.memory_limit("256MiB", device="host") as limit:
        assert limit.limit == 256 << 20
        with pytest.raises(RuntimeError) as info:
            torch.ones(GiB // 4)
        assert memguard.is_oom_error(info.value)
    assert resource.getrlimit(resource.RLIMIT_AS) == before
    assert torch.ones(GiB // 4).numel() == GiB // 4


def test_memory_limit_after_a_freed_heap_gives_the_smaller_device(python_in_subprocess):
    # before: 1,784 MiB allocated under a 256 MiB limit, out of the 1.6 GiB freed just before
    out = python_in_subprocess("""
        import json, torch, memguard
        from memguard.backends.host import malloc_free
        keep = [torch.ones(2**14) for _ in range(12800)]  # 64 KiB each, 800 MiB in the heap
        del keep
        freed = malloc_free()
        from memguard.backends import host
        from memguard.backends.budget import budget
        outside = host.malloc_in_use()
        got = []
        with memguard.memory_limit("128MiB", device="host"):
            available, inside = budget("host").available, host.malloc_in_use()
            try:
                while True:
                    got.append(torch.ones(2**18))  # 1 MiB
            except RuntimeError:
                pass
        allocated = len(got)
        got.clear()
        again = [torch.ones(2**18) for _ in range(400)]  # what the block held back is back
        print(json.dumps({"freed": freed >> 20, "allocated": allocated, "after": len(again),
                          "available": available >> 20, "taken": (inside - outside) >> 20}))
    """)
    assert out["freed"] >= 700, out  # the heap held the freed tensors
    # what memguard's sizing reads: the smaller device, not the free pieces of the heap
    # before it (10 MiB of them where the modules were loaded from .pyc files)
    assert out["available"] <= 128, out
    assert abs(out["taken"]) <= 8, out  # the blocks kept out of reach are not the program's
    assert 16 <= out["allocated"] <= 128, out
    assert out["after"] == 400


def test_memory_limit_restores_when_the_body_raises():
    before = resource.getrlimit(resource.RLIMIT_AS)
    with pytest.raises(KeyError):
        with memguard.memory_limit("1GiB"):
            raise KeyError("x")
    assert resource.getrlimit(resource.RLIMIT_AS) == before


def test_memory_limit_refuses_what_it_cannot_do():
    with pytest.raises(RuntimeError, match="LogicalDeviceConfiguration"):
        memguard.memory_limit("1GiB", device="GPU:0")
    with pytest.raises(ValueError, match="device must be 'host', 'cuda' or 'cuda:N'"):
        memguard.memory_limit("1GiB", device="tpu")
    with pytest.raises(ValueError, match="'lots'"):
        memguard.memory_limit("lots")
    with pytest.raises(ValueError, match="limit must be positive"):
        memguard.memory_limit(0)


@pytest.mark.slow
def test_tf_memory_growth(python_in_subprocess):
    out = python_in_subprocess("""
        import json
        import tensorflow as tf
        import memguard
        count = memguard.tf_memory_growth()
        tf.constant(1.0)
        try:
            memguard.tf_memory_growth(False)
            late = "no error"
        except RuntimeError as exc:
            late = str(exc)
        print(json.dumps({"count": count, "gpus": len(tf.config.list_physical_devices("GPU")),
                          "late": late}))
    """)
    assert out["count"] == out["gpus"]
    if out["gpus"]:
        assert "call it before any TensorFlow op" in out["late"]
    else:
        assert out["late"] == "no error"  # nothing to set without GPUs


def test_tf_memory_growth_checks_its_argument():
    with pytest.raises(TypeError, match="enable must be True or False"):
        memguard.tf_memory_growth("yes")


@pytest.mark.gpu
def test_memory_limit_on_cuda():
    total = torch.cuda.get_device_properties(0).total_memory
    with memguard.memory_limit("512MiB", device="cuda:0"):
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    block = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    assert block.numel() == 1 << 30 and total > 1 << 30


@pytest.mark.gpu
def test_configure_allocator_warns_once_cuda_is_initialised(clean_alloc_env):
    torch.zeros(1, device="cuda")
    with pytest.warns(RuntimeWarning, match="cannot take effect"):
        memguard.configure_allocator(expandable_segments=True)


LIMITS_IN_THREADS_AND_TASKS = """
    import asyncio, json, resource, threading
    import memguard
    from memguard.backends.host import address_space_budget

    GiB = 1 << 30

    def soft():
        value = resource.getrlimit(resource.RLIMIT_AS)[0]
        return None if value == resource.RLIM_INFINITY else value

    def budget():
        found = address_space_budget()
        return None if found is None else [found[0], found[1]]

    def in_threads(first, second, exit_first):
        # Two threads each open a limit; the main thread reads the limit after each step.
        steps, sizes = [], {"a": first, "b": second}
        go = {name: (threading.Event(), threading.Event()) for name in sizes}
        done = {name: (threading.Event(), threading.Event()) for name in sizes}

        def worker(name):
            go[name][0].wait()
            with memguard.memory_limit(sizes[name], device="host"):
                done[name][0].set()
                go[name][1].wait()
            done[name][1].set()

        threads = [threading.Thread(target=worker, args=(name,)) for name in sizes]
        for thread in threads:
            thread.start()
        order = [("a", 0), ("b", 0), (exit_first, 1), ("b" if exit_first == "a" else "a", 1)]
        for name, stage in order:
            go[name][stage].set()
            done[name][stage].wait()
            steps.append([soft(), budget()])
        for thread in threads:
            thread.join()
        return steps

    def in_tasks(first, second, exit_first):
        async def main():
            steps, sizes = [], {"a": first, "b": second}
            go = {name: (asyncio.Event(), asyncio.Event()) for name in sizes}
            done = {name: (asyncio.Event(), asyncio.Event()) for name in sizes}

            async def worker(name):
                await go[name][0].wait()
                with memguard.memory_limit(sizes[name], device="host"):
                    done[name][0].set()
                    await go[name][1].wait()
                done[name][1].set()

            tasks = [asyncio.create_task(worker(name)) for name in sizes]
            order = [("a", 0), ("b", 0), (exit_first, 1),
                     ("b" if exit_first == "a" else "a", 1)]
            for name, stage in order:
                go[name][stage].set()
                await done[name][stage].wait()
                steps.append([soft(), budget()])
            await asyncio.gather(*tasks)
            return steps
        return asyncio.run(main())

    out = {"before": soft()}
    for how, run in (("threads", in_threads), ("tasks", in_tasks)):
        for exit_first in ("a", "b"):
            out[f"{how} wide first, {exit_first} exits first"] = run(2 * GiB, GiB, exit_first)
            out[f"{how} narrow first, {exit_first} exits first"] = run(GiB, 2 * GiB, exit_first)
    out["after"] = soft()
    print(json.dumps(out))
"""


@pytest.mark.slow
def test_limits_opened_in_threads_and_tasks_compose_whatever_the_exit_order(
        python_in_subprocess):
    out = python_in_subprocess(LIMITS_IN_THREADS_AND_TASKS)
    assert out["before"] is None and out["after"] is None  # unlimited before and after
    for how in ("threads", "tasks"):
        for exit_first, still_open in (("a", "b"), ("b", "a")):
            # a opens 2 GiB, then b opens 1 GiB: the tighter, b's, is in force.
            wide, both, one_left, none_left = out[f"{how} wide first, {exit_first} exits first"]
            assert wide[0] is not None and wide[1] == ["memory_limit", 2 * GiB]
            assert both[0] < wide[0] and both[1] == ["memory_limit", GiB]
            if still_open == "b":  # a closed first: b's limit stays in force
                assert one_left == both, (how, exit_first)
            else:  # b closed first: a's limit is back
                assert one_left == wide, (how, exit_first)
            assert none_left == [None, None], (how, exit_first)
            # a opens 1 GiB, then b opens 2 GiB: a's stays in force while both are open.
            narrow, both, one_left, none_left = out[f"{how} narrow first, "
                                                     f"{exit_first} exits first"]
            assert narrow[1] == ["memory_limit", GiB] and both == narrow
            if still_open == "b":  # a closed first: b's own, wider limit is in force
                assert one_left[1] == ["memory_limit", 2 * GiB], (how, exit_first)
                assert 0.9 * GiB < one_left[0] - narrow[0] < 1.1 * GiB
            else:
                assert one_left == narrow, (how, exit_first)
            assert none_left == [None, None], (how, exit_first)


@pytest.mark.gpu
def test_cuda_limits_opened_in_threads_compose_whatever_the_exit_order():
    import threading

    from memguard.backends import torch as torch_backend

    total = torch.cuda.get_device_properties(0).total_memory
    before = torch_backend.memory_fraction(0)
    for exit_first in ("wide", "narrow"):
        sizes, seen = {"wide": 2 * GiB, "narrow": GiB}, []
        opened = {name: threading.Event() for name in sizes}
        close = {name: threading.Event() for name in sizes}

        def worker(name, sizes=sizes, opened=opened, close=close):
            with memguard.memory_limit(sizes[name], device="cuda:0"):
                opened[name].set()
                close[name].wait()

        threads = {name: threading.Thread(target=worker, args=(name,)) for name in sizes}
        for name in ("wide", "narrow"):
            threads[name].start()
            opened[name].wait()
            seen.append(torch_backend.memory_fraction(0))
        for name in (exit_first, "narrow" if exit_first == "wide" else "wide"):
            close[name].set()
            threads[name].join()
            seen.append(torch_backend.memory_fraction(0))
        left = sizes["narrow" if exit_first == "wide" else "wide"]
        assert seen == pytest.approx([2 * GiB / total, GiB / total, left / total, before])
