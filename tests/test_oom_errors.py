"""is_oom_error against every message form, the CPU ones produced for real here."""

from __future__ import annotations

import builtins
import time

import pytest
import torch

import memguard
from memguard.errors import oom_kind

from budget import ENV, script

# Recorded from torch 2.13.0 and TensorFlow 2.21 on this machine under an address-space budget
# (test_real_cpu_messages_are_recognised reproduces them live); the GPU forms are the
# frameworks' own wording.
TORCH_CPU = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
             "memory: you tried to allocate 8589934592 bytes. Error code 12 (Cannot allocate "
             "memory)")
TF_CPU = ("{{function_node __wrapped__Fill_device_/job:localhost/replica:0/task:0/device:CPU:0}} "
          "OOM when allocating tensor with shape[2147483648] and type float on "
          "/job:localhost/replica:0/task:0/device:CPU:0 by allocator mklcpu [Op:Fill] name: ")

RUNTIME_OOMS = [
    ("torch CPU allocator", TORCH_CPU),
    ("CUDA caching allocator", ("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a "
                                "total capacity of 79.15 GiB of which 3.12 MiB is free.")),
    ("ROCm caching allocator", ("HIP out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
                                "total capacity of 63.98 GiB of which 1.00 GiB is free.")),
    ("XPU caching allocator", ("XPU out of memory. Tried to allocate 1.00 GiB (GPU 0; 15.11 GiB "
                               "total capacity)")),
    ("CUDA runtime", ("CUDA error: out of memory\nCUDA kernel errors might be asynchronously "
                      "reported at some other API call")),
    ("MPS allocator", ("MPS backend out of memory (MPS allocated: 17.00 GB, other allocations: "
                       "1.00 GB, max allowed: 18.13 GB). Tried to allocate 256.00 MB on private "
                       "pool.")),
    ("cuBLAS", "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    ("cuDNN", "cuDNN error: CUDNN_STATUS_ALLOC_FAILED"),
    ("cuDNN on a full GPU", ("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if "
                             "you passed in a non-contiguous input.")),
    ("XLA allocator", ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 17179869184 "
                       "bytes.")),
    ("torch memory mapping", ("unable to mmap 67108864 bytes from file </torch_1234_5678_0>: "
                              "Cannot allocate memory (12)")),
]


@pytest.mark.parametrize("kind, message", RUNTIME_OOMS, ids=[k for k, _ in RUNTIME_OOMS])
def test_runtime_error_messages(kind, message):
    assert memguard.is_oom_error(RuntimeError(message))
    assert oom_kind(RuntimeError(message)) == kind


@pytest.mark.parametrize("exc", [
    torch.OutOfMemoryError("anything"),
    MemoryError(),
    memguard.OutOfMemoryError("gave up", []),
], ids=["torch.OutOfMemoryError", "MemoryError", "memguard.OutOfMemoryError"])
def test_out_of_memory_classes(exc):
    assert memguard.is_oom_error(exc)


@pytest.mark.parametrize("exc", [
    ValueError("CUDA out of memory"),  # the words alone, in an error that is not a runtime one
    RuntimeError("shape mismatch: 3 vs 4"),
    RuntimeError("CUDA error: device-side assert triggered"),
    OSError(28, "No space left on device"),
    KeyboardInterrupt(),
    None,
], ids=["value-error", "shape", "device-assert", "disk", "interrupt", "none"])
def test_everything_else_is_not(exc):
    assert not memguard.is_oom_error(exc)


def test_out_of_memory_wrapped_in_another_exception_is_found():
    def wrapped():
        try:
            raise RuntimeError(TORCH_CPU)
        except RuntimeError as inner:
            raise ValueError("data loader worker failed") from inner

    with pytest.raises(ValueError, match="data loader worker failed") as caught:
        wrapped()
    assert memguard.is_oom_error(caught.value)

    def raised_while_handling():
        try:
            raise MemoryError
        except MemoryError:
            raise KeyError("while handling")  # noqa: B904 - the implicit __context__ is the case

    with pytest.raises(KeyError, match="while handling") as caught:
        raised_while_handling()
    assert isinstance(caught.value.__context__, MemoryError)  # implicit __context__: a new error
    assert not memguard.is_oom_error(caught.value)


def test_chains_with_cycles_terminate():
    a, b = RuntimeError("a"), RuntimeError("b")
    a.__context__, b.__context__ = b, a
    assert not memguard.is_oom_error(a)
    a.__cause__, b.__cause__ = b, a
    assert not memguard.is_oom_error(a)


CPU_MESSAGES = """
    import numpy, torch
    import tensorflow as tf
    import memguard

    @tf.function
    def fill(n):
        return tf.fill([n], 1.0) * 2

    torch.ones(10), fill(tf.constant(10))
    found = {}
    set_budget(512)
    for name, make in [("torch", lambda: torch.ones(2 << 30)),
                       ("tensorflow", lambda: tf.ones((2 << 30,))),
                       ("tf.function", lambda: fill(tf.constant(2 << 30))),
                       ("numpy", lambda: numpy.ones(2 << 30))]:
        if name not in CASES:
            continue
        try:
            make()
            found[name] = None
        except Exception as exc:
            found[name] = [type(exc).__name__, memguard.is_oom_error(exc), str(exc)[:300]]
    print(json.dumps(found))
"""


@pytest.mark.slow
def test_real_cpu_messages_are_recognised(python_in_subprocess):
    # TensorFlow's default CPU allocator (oneDNN's, "mklcpu") waits 10 s before it reports an
    # out-of-memory: the eager case runs out of it (the one real out-of-memory of TensorFlow's
    # default allocator in the tests), the tf.function case out of the plain allocator
    # (TF_ENABLE_ONEDNN_OPTS=0, which fails at once), in a second process that runs while the
    # first waits.
    from concurrent.futures import ThreadPoolExecutor

    runs = [(("torch", "tensorflow", "numpy"), ENV),
            (("tf.function",), dict(ENV, TF_ENABLE_ONEDNN_OPTS="0"))]
    with ThreadPoolExecutor(len(runs)) as pool:
        outs = list(pool.map(lambda run: python_in_subprocess(
            script(f"CASES = {run[0]!r}\n", CPU_MESSAGES), env=run[1], timeout=300), runs))
    out = {**outs[0], **outs[1]}
    assert set(out) == {"torch", "tensorflow", "tf.function", "numpy"}, out
    assert out["torch"][:2] == ["RuntimeError", True]
    assert "DefaultCPUAllocator: can't allocate memory" in out["torch"][2]
    assert out["tensorflow"][:2] == ["ResourceExhaustedError", True]
    assert "OOM when allocating" in out["tensorflow"][2]
    assert "by allocator mklcpu" in out["tensorflow"][2]  # the default allocator's own
    assert out["tf.function"][:2] == ["ResourceExhaustedError", True]
    assert out["numpy"][1] is True


@pytest.mark.slow
def test_tensorflow_resource_exhausted_about_disk_is_not_memory(python_in_subprocess):
    out = python_in_subprocess("""
        import json
        import tensorflow as tf
        import memguard
        E = tf.errors.ResourceExhaustedError
        print(json.dumps([memguard.is_oom_error(E(None, None, text)) for text in (
            "OOM when allocating tensor with shape[1024,1024] on GPU:0 by allocator GPU_0_bfc",
            "Out of memory while trying to allocate 4096 bytes.",
            "failed to allocate memory [Op:AddV2]",
            "/tmp/ckpt; No space left on device",
            "Disk quota exceeded writing summary",
            "Quota exceeded for requests",
        )]))
    """)
    assert out == [True, True, True, False, False, False]


# Out-of-memory errors whose text names a path or a quoted name holding "disk" or "quota":
# the words of a name are not the error's kind.
NAMED_OOMS = [
    ("torch memory mapping", ("unable to mmap 67108864 bytes from file "
                             "</mnt/disk1/cache/shard.bin>: Cannot allocate memory (12)")),
    ("torch memory mapping", ("unable to mmap 67108864 bytes from file "
                             "</data/disk/quota/shard.bin>: Cannot allocate memory (12)")),
    ("torch CPU allocator", TORCH_CPU + " while reading 'Disk cache.pt'"),
    ("torch CPU allocator", TORCH_CPU + ' (loading "quota table")'),
    ("torch CPU allocator", TORCH_CPU + " at C:\\Disk\\data\\x.bin"),
    ("torch CPU allocator", TORCH_CPU + " reading disk.bin"),
    ("TensorFlow allocator", ("OOM when allocating tensor with shape[1024,1024] on GPU:0 by "
                              "allocator GPU_0_bfc [[{{node disk_reader/MatMul}}]]")),
    ("TensorFlow allocator", ("OOM when allocating tensor with shape[4096] [[{{node "
                              "quota}}]] [Op:MatMul]")),
]
# What is about disk space or a quota stays refused, in the error's own words, names or not.
NOT_MEMORY_TEXTS = [
    "/tmp/ckpt; No space left on device",
    "Disk quota exceeded writing summary",
    "Quota exceeded for requests",
    "failed to allocate memory: disk full on </mnt/scratch>",
    "OOM when allocating the quota of '/mnt/disk1'",
    "DefaultCPUAllocator: can't allocate memory: Disk quota exceeded (file 'x')",
    "failed to allocate memory: the disks are full",
]


@pytest.mark.parametrize("kind, message", NAMED_OOMS,
                         ids=[f"{k}-{i}" for i, (k, _) in enumerate(NAMED_OOMS)])
def test_disk_or_quota_in_a_name_does_not_hide_an_out_of_memory(kind, message):
    assert memguard.is_oom_error(RuntimeError(message)), message
    assert oom_kind(RuntimeError(message)) == kind


@pytest.mark.parametrize("message", NOT_MEMORY_TEXTS)
def test_disk_and_quota_in_the_errors_own_words_are_not_memory(message):
    assert not memguard.is_oom_error(RuntimeError(message)), message


@pytest.mark.slow
def test_a_real_mapping_failure_under_a_disk_path_is_recognised(python_in_subprocess, tmp_path):
    folder = tmp_path / "mnt" / "disk1" / "quota"
    folder.mkdir(parents=True)
    out = python_in_subprocess(script(f"""
        import torch, memguard
        path = {str(folder / "shard.bin")!r}
        open(path, "wb").truncate(256 * 2**20)
        set_budget(64)
        try:
            torch.from_file(path, shared=True, size=64 * 2**20)
            found = None
        except RuntimeError as exc:
            found = [str(exc), memguard.is_oom_error(exc), memguard.errors.oom_kind(exc)]
        print(json.dumps(found))
    """), env=ENV, timeout=120)
    assert out is not None, "the mapping fitted: the budget was not in force"
    message, recognised, kind = out
    assert "unable to mmap 268435456 bytes" in message and "/disk1/quota/" in message, message
    assert recognised and kind == "torch memory mapping", message


@pytest.mark.parametrize("text", ["a" * 20000, "<" * 20000, "1." * 10000 + "!",
                                  "a-" * 10000, " 'a" * 7000, ' "x' * 7000],
                         ids=["letters", "brackets", "dots", "dashes", "quotes", "double-quotes"])
def test_a_long_message_is_judged_in_linear_time(text):
    message = "DefaultCPUAllocator: can't allocate memory " + text
    started = time.perf_counter()
    assert memguard.is_oom_error(RuntimeError(message))
    assert time.perf_counter() - started < 0.5  # about 5 ms; quadratic rules take seconds


def _real_oom() -> RuntimeError:
    """torch's real CPU out-of-memory (more bytes than the machine has)."""
    try:
        torch.empty(1 << 60, dtype=torch.uint8)
    except RuntimeError as exc:
        return exc
    raise AssertionError("the allocation succeeded")


# Python 3.11's groups (asyncio.TaskGroup raises them); the tests below need them.
ExceptionGroup = getattr(builtins, "ExceptionGroup", None)
BaseExceptionGroup = getattr(builtins, "BaseExceptionGroup", None)
needs_groups = pytest.mark.skipif(ExceptionGroup is None, reason="exception groups: Python 3.11+")


@needs_groups
def test_an_exception_group_of_out_of_memory_errors_is_one_and_a_mixed_one_is_not():
    oom = _real_oom()
    group = ExceptionGroup("unhandled errors in a TaskGroup", [oom, MemoryError()])
    assert memguard.is_oom_error(group) and oom_kind(group) == "torch CPU allocator"
    nested = ExceptionGroup("outer", [ExceptionGroup("inner", [oom])])
    assert memguard.is_oom_error(nested)
    mixed = ExceptionGroup("unhandled errors in a TaskGroup", [oom, ValueError("a bug")])
    assert not memguard.is_oom_error(mixed)
    assert not memguard.is_oom_error(BaseExceptionGroup("stop", [oom, KeyboardInterrupt()]))
    assert memguard.errors.requested_bytes(group) == 1 << 60


@needs_groups
def test_an_async_retry_recovers_an_out_of_memory_inside_a_task_group():
    import asyncio

    @memguard.oom_retry(batch_size=64)
    async def step(batch_size):
        async def child():
            torch.empty(batch_size << 42 if batch_size > 8 else batch_size)

        async with asyncio.TaskGroup() as group:
            group.create_task(child())
            group.create_task(asyncio.sleep(0))
        return batch_size

    assert asyncio.run(step()) == 8
    assert [a.size for a in step.history] == [64, 32, 16, 8]
    assert "DefaultCPUAllocator" in step.history[0].error

    @memguard.oom_retry(batch_size=64)
    async def mixed(batch_size):
        async def bug():
            raise ValueError("a bug")

        async def child():
            torch.empty(batch_size << 42)

        async with asyncio.TaskGroup() as group:
            group.create_task(child())
            group.create_task(bug())

    with pytest.raises(ExceptionGroup) as raised:
        asyncio.run(mixed())
    assert mixed.history == []  # not retried: the bug reaches the program at once
    assert any(isinstance(e, ValueError) for e in raised.value.exceptions)


class _Unprintable(RuntimeError):
    def __str__(self) -> str:
        raise ValueError("__str__ is broken")


class _UnprintableMemory(MemoryError):
    def __str__(self) -> str:
        raise ValueError("__str__ is broken")


def test_an_exception_that_cannot_be_printed_is_judged_by_its_type_and_never_masked():
    assert memguard.is_oom_error(_Unprintable()) is False
    assert memguard.is_oom_error(_UnprintableMemory()) is True

    @memguard.oom_retry(batch_size=8)
    def broken(batch_size):
        raise _Unprintable()

    with pytest.raises(_Unprintable):  # the program's own exception, not a ValueError
        broken()

    @memguard.oom_retry(batch_size=8)
    def shrinks(batch_size):
        if batch_size > 2:
            raise _UnprintableMemory()
        return batch_size

    assert shrinks() == 2
    assert [a.size for a in shrinks.history] == [8, 4, 2]


def test_an_oom_of_tensorflows_onednn_allocator_tells_once_of_its_wait(caplog, monkeypatch):
    """oneDNN's CPU allocator waits up to 10 s before each out-of-memory it reports: the
    first attempt that runs out of it says so, and what turns it off; no other does."""
    from memguard import loop

    monkeypatch.setattr(loop, "_told_of_wait", [])
    caplog.set_level("WARNING", logger="memguard")

    @memguard.oom_retry(batch_size=16)
    def torch_step(batch_size):
        if batch_size > 8:
            raise RuntimeError(TORCH_CPU)
        return batch_size

    @memguard.oom_retry(batch_size=16)
    def tensorflow_step(batch_size):
        if batch_size > 4:
            raise RuntimeError(TF_CPU)
        return batch_size

    def told():
        return [r.getMessage() for r in caplog.records if "TF_ENABLE_ONEDNN_OPTS=0" in
                r.getMessage()]

    assert torch_step() == 8 and told() == []
    assert tensorflow_step() == 4 and tensorflow_step.history[0].ok is False
    assert len(told()) == 1 and "waits up to 10 s" in told()[0]  # two failures, told once
    tensorflow_step.reset()
    assert tensorflow_step() == 4 and len(told()) == 1
    # the error wrapped in another (raise ... from) or in a group (asyncio.TaskGroup): told too
    for wrap in (lambda e: RuntimeError("the step failed"), lambda e: ExceptionGroup("g", [e])):
        monkeypatch.setattr(loop, "_told_of_wait", [])
        caplog.clear()

        @memguard.oom_retry(batch_size=16, cache=False)
        def wrapped(batch_size, wrap=wrap):
            if batch_size > 4:
                inner = RuntimeError(TF_CPU)
                raise wrap(inner) from inner
            return batch_size

        assert wrapped() == 4 and len(told()) == 1, wrapped.history
