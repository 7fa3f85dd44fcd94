"""Backends against real memory: the host process, torch and TensorFlow as installed here."""

from __future__ import annotations

import os

import pytest
import torch

import memguard
from memguard.backends import activate, active_backends, host, list_devices, resolve_devices

MiB = 1 << 20


def test_host_reads_follow_a_real_allocation():
    # pages an earlier test freed, still resident, would take the block without the resident
    # set moving: trimmed first, they are given back and must be touched again
    host.empty_cache()
    before = host.read()
    block = torch.ones(50 * MiB // 4)  # 50 MiB, touched
    during = host.read()
    # seen once in CI: the resident set unchanged to the byte; say what each reader saw then
    with open("/proc/self/status") as f:
        again = (host.rss(), [line for line in f if line.startswith(("VmRSS", "VmHWM"))])
    del block
    assert during.reserved - before.reserved > 45 * MiB, (before, during, again)
    assert during.allocated - before.allocated > 45 * MiB  # malloc's own count sees it too
    assert during.peak >= during.reserved
    assert 0 < during.free <= during.total

def test_a_forked_child_reads_its_own_memory_not_its_parents(python_in_subprocess):
    """The /proc descriptor is kept open between reads; a child must not read through the
    parent's."""
    out = python_in_subprocess("""
        import json, os
        from memguard.backends import host
        parent_before = host.rss()
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            block = bytearray(300 * 2**20)  # zero pages: touch them
            block[::4096] = b"x" * len(block[::4096])
            os.write(write, str(host.rss()).encode())
            os._exit(0)
        os.waitpid(pid, 0)
        child = int(os.read(read, 64))
        print(json.dumps({"child_gain": child - parent_before,
                          "parent_gain": host.rss() - parent_before}))
    """)
    assert out["child_gain"] > 250 * 2**20
    assert out["parent_gain"] < 50 * 2**20

def test_host_peak_resets_to_the_current_level():
    # Trimmed before and after: a block glibc serves from free heap space left by earlier
    # tests either raises no peak (pages still resident) or stays resident after del.
    memguard.free_memory()
    block = torch.ones(100 * MiB // 4)
    del block
    memguard.free_memory()
    high = host.read_peak()
    assert host.reset_peak() is True  # /proc/self/clear_refs is writable on this machine
    low = host.read_peak()
    assert high - low > 80 * MiB
    assert abs(low - host.rss()) < 8 * MiB



def test_peak_reset_in_a_forked_child_resets_the_childs_peak_not_the_parents(
        python_in_subprocess):
    # clear_refs is written through a descriptor kept open: one inherited over fork would
    # write /proc/<parent>/clear_refs
    out = python_in_subprocess("""
        import json, os
        from memguard.backends import host
        host.reset_peak()  # the parent's descriptor is open from here
        block = bytearray(300 * 2**20)
        del block
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            host.reset_peak()
            os.write(write, str(host.read_peak()).encode())
            os._exit(0)
        os.waitpid(pid, 0)
        print(json.dumps({"child": int(os.read(read, 64)), "parent": host.read_peak(),
                          "rss": host.rss()}))
    """)
    assert out["parent"] - out["rss"] > 250 * MiB  # the parent keeps its own peak
    assert out["child"] - out["rss"] < 100 * MiB


def test_a_scope_in_a_process_started_by_a_big_one_reads_its_own_peak():
    # getrusage, which the peak is read through, reports the peak of the memory map exec
    # replaced when that is higher: a Python started (vfork and exec) by a process holding
    # 600 MiB would read a 600 MiB peak however little it uses
    import json
    import subprocess
    import sys

    ballast = bytearray(600 * MiB)
    ballast[::4096] = b"x" * len(ballast[::4096])
    code = """if True:
        import json, memguard
        for _ in range(3):
            with memguard.memory_scope() as scope:
                block = bytearray(20 * 2**20)
                block[::4096] = b"x" * len(block[::4096])
                del block
        print(json.dumps({"rise": scope.peak["host"] - scope.before["host"].reserved,
                          "peak": scope.peak["host"]}))
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    del ballast
    found = json.loads(out.stdout)
    assert 15 * MiB < found["rise"] < 60 * MiB, found
    assert found["peak"] < 400 * MiB, found


def test_descriptors_a_program_closed_are_never_used_for_its_own_files(python_in_subprocess):
    # a daemon closes every descriptor it did not open (os.closerange) and opens its own files:
    # memguard's kept /proc/self/clear_refs descriptor wrote "5" into the program's log, its
    # readers read the program's files or failed (retained 0 for a 50 MiB leak, EBADF)
    out = python_in_subprocess("""
        import json, os, tempfile
        import memguard
        with memguard.memory_scope():  # memguard's descriptors opened
            memguard.snapshot()
        os.closerange(3, 1 << 12)
        folder = tempfile.mkdtemp()
        logs = []
        for i in range(12):
            fd = os.open(os.path.join(folder, str(i)), os.O_RDWR | os.O_CREAT | os.O_APPEND)
            os.write(fd, b"line")
            logs.append(fd)
        kept, leak = [], None
        for _ in range(3):
            try:
                with memguard.memory_scope(cleanup="never", max_leak="1MiB") as scope:
                    kept.append(bytearray(50 << 20))
            except memguard.MemoryLeakError as error:
                leak = error.retained["host"]
        snapshot = memguard.snapshot()["host"]
        contents = [os.pread(fd, 64, 0).decode() for fd in logs]
        print(json.dumps({"logs": sorted(set(contents)), "leak": leak,
                          "peak": scope.peak["host"], "total": snapshot.total}))
    """)
    assert out["logs"] == ["line"]
    assert out["leak"] >= 50 * MiB
    assert out["peak"] >= 100 * MiB and out["total"] > out["peak"]


def test_a_kept_proc_file_whose_number_now_holds_a_programs_file_is_read_again(tmp_path):
    # a read of a /proc file this process opened skips the identity check and judges the text
    # instead: a program's file under the number, even one of numbers, is never taken for it
    from memguard.backends.host import _is_statm, _is_status, _ProcFile

    for name, check, fake in (("statm", _is_statm, b"1000 2000 300 4 0 500 0\n"),
                              ("status", _is_status, b"Name:\tlog\nState:\tR\n")):
        kept = _ProcFile(name, check)
        assert check(kept.read())
        path = tmp_path / name
        path.write_bytes(fake)
        number = kept.file.fd
        theirs = os.open(path, os.O_RDONLY)
        os.dup2(theirs, number)  # as a program that closed it and opened its own file
        os.close(theirs)
        try:
            text = kept.read()
            assert check(text) and text != fake and kept.file.fd != number
            assert os.pread(number, 100, 0) == fake  # theirs: neither moved nor closed
        finally:
            os.close(number)
            kept.close()


def test_a_fork_made_in_c_finds_memguards_locks_unlocked(python_in_subprocess):
    # no os.register_at_fork handler runs in the child of a fork made in C: a lock another
    # thread held there was copied held, and the child's first scope waited for ever
    out = python_in_subprocess("""
        import ctypes, json, os, signal, threading
        import memguard
        from memguard.scope import peak_book

        held, release = threading.Event(), threading.Event()

        def holder():
            with peak_book._lock:
                held.set()
                release.wait()

        thread = threading.Thread(target=holder)
        thread.start()
        held.wait()
        pid = ctypes.PyDLL(None).fork()  # with the interpreter lock held, as an extension's
        if pid == 0:
            signal.alarm(10)  # its default ends the child
            with memguard.memory_scope():
                pass
            os._exit(0)
        release.set()
        thread.join()
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"child": os.waitstatus_to_exitcode(status)}))
    """)
    assert out == {"child": 0}


def test_a_fork_made_in_c_reads_and_resets_the_childs_own_memory(python_in_subprocess):
    # a fork C code makes (ctypes, an extension) runs no os.register_at_fork handler: the
    # descriptors kept open are checked against the process id, not a fork count
    out = python_in_subprocess("""
        import ctypes, json, os
        import memguard
        from memguard.backends import host
        libc = ctypes.CDLL(None)
        with memguard.memory_scope() as scope:
            block = bytearray(400 * 2**20)
            block[::4096] = b"x" * len(block[::4096])
            del block
            host.empty_cache()
            read, write = os.pipe()
            pid = libc.fork()
            if pid == 0:
                with memguard.memory_scope():
                    pass
                os.write(write, str(host.rss()).encode())
                os._exit(0)
            os.waitpid(pid, 0)
        child = int(os.read(read, 64))
        print(json.dumps({"rise": scope.peak["host"] - scope.before["host"].reserved,
                          "child": child, "parent": host.rss()}))
    """)
    assert out["rise"] > 380 * MiB, out  # the child's reset did not clear the parent's peak
    assert out["child"] < out["parent"] + 64 * MiB, out


def test_physical_memory_reads_as_psutil_does():
    import psutil

    total, available = host.physical()
    vm = psutil.virtual_memory()
    assert total == vm.total
    assert abs(available - vm.available) < 64 * MiB  # read a moment apart
    assert memguard.snapshot()["host"].total == vm.total


def test_cgroup_files_kept_open_read_every_change(tmp_path):
    from memguard.backends.host import _CgroupReader

    membership = tmp_path / "cgroup"
    membership.write_text("0::/job/worker\n")
    for folder, limit, current in (("job", "1073741824", "900000000"),
                                   ("job/worker", "max", "800000000"),
                                   ("other", "3221225472", "100")):
        (tmp_path / folder).mkdir(parents=True, exist_ok=True)
        (tmp_path / folder / "memory.max").write_text(limit + "\n")
        (tmp_path / folder / "memory.current").write_text(current + "\n")
    reader = _CgroupReader(str(tmp_path), str(membership))
    try:
        assert reader.read() == (1 << 30, 900000000)
        (tmp_path / "job" / "memory.current").write_text("950000000\n")  # used moves
        assert reader.read() == (1 << 30, 950000000)
        (tmp_path / "job" / "memory.max").write_text("2147483648\n")  # the limit is raised
        assert reader.read() == (2 << 30, 950000000)
        (tmp_path / "job" / "worker" / "memory.max").write_text("1073741824\n")
        assert reader.read() == (1 << 30, 800000000)  # the tighter one binds
        membership.write_text("0::/other\n")  # the process moved to another cgroup
        assert reader.read() == (3 << 30, 100)
        membership.write_text("0::/job/fresh\n")  # a level without its files yet
        assert reader.read() == (2 << 30, 950000000)
        (tmp_path / "job" / "fresh").mkdir()
        (tmp_path / "job" / "fresh" / "memory.max").write_text("1000\n")
        (tmp_path / "job" / "fresh" / "memory.current").write_text("10\n")
        reader.RECHECK = 0.0  # the files that exist are looked for again once it is past
        assert reader.read() == (1000, 10)
    finally:
        reader.close()

@pytest.mark.slow
def test_free_memory_trims_what_glibc_keeps_after_del(python_in_subprocess):
    """The measured fact behind the host backend: RSS stays up after ``del`` until a trim.

    In a process of its own, with glibc's thresholds fixed: they move with what the process
    freed before (and free() trims the top of the heap beyond the trim threshold), so in the
    test process the outcome would depend on the tests that ran before."""
    out = python_in_subprocess("""
        import ctypes, json
        import torch
        import memguard
        from memguard.backends import host
        libc = ctypes.CDLL(None)
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: free() never trims by itself
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: blocks under 1 MiB from the heap
        memguard.free_memory()
        start = host.rss()
        tensors = [torch.ones(25_000) for _ in range(4000)]  # 400 MB in 100 KB blocks
        del tensors
        kept = host.rss() - start
        released = memguard.free_memory()
        print(json.dumps({"kept": kept, "released": released, "end": host.rss() - start}))
    """)
    assert out["kept"] > 300 * MiB, f"glibc kept the freed blocks resident: {out}"
    assert out["end"] < 40 * MiB, out
    assert out["released"] > 300 * MiB, out


@pytest.mark.slow
def test_torch_backend_lists_reads_and_initialises_nothing_before_cuda_is_used(
        python_in_subprocess):
    """Looking never starts CUDA. In a fresh interpreter CUDA is not initialised, on a CPU
    build and on a GPU machine alike, so every answer below holds on both; on a GPU machine
    the last one says that none of these looks initialised CUDA (where the GPU is used, see
    test_gpu.py)."""
    out = python_in_subprocess("""
        import json
        import torch
        import memguard
        from memguard.backends import resolve_devices
        from memguard.backends.torch import TorchBackend
        backend = TorchBackend()
        seen = {"devices": backend.devices(),
                "read": backend.read("cuda:0") == memguard.DeviceMemory("cuda:0"),
                "read_fast": list(backend.read_fast("cuda:0")),
                "peak": backend.read_peak("cuda:0"),
                "reset": backend.reset_peak("cuda:0"),
                "resolved": [name for _, name in resolve_devices("cuda")],
                "watched": list(memguard.snapshot().devices)}
        seen["initialised"] = torch.cuda.is_initialized()
        print(json.dumps(seen))
    """)
    assert out == {"devices": [], "read": True, "read_fast": [None, None], "peak": None,
                   "reset": False, "resolved": ["cuda:0"], "watched": ["host"],
                   "initialised": False}


def test_active_backends_include_torch_once_imported():
    assert [b.name for b in active_backends()][:2] == ["host", "torch"]
    assert list_devices()[0] == "host"


def test_activate_rejects_unknown_frameworks():
    with pytest.raises(ValueError, match=r"'jax'.*tensorflow, torch"):
        activate("jax")


def test_unknown_device_names_are_refused_with_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown device 'tpu:3'.*host"):
        resolve_devices("tpu:3")
    with pytest.raises(TypeError,
                       match="devices must be a string such as 'host' or 'cuda:0', got 0 "):
        resolve_devices([0])


def test_torch_device_names_resolve_without_initialising_cuda():
    started = torch.cuda.is_initialized()  # an earlier test on a GPU machine may start it
    (backend, name), = resolve_devices("cuda")
    assert backend.name == "torch"
    if started:  # "cuda" is the current device
        assert name == f"cuda:{torch.cuda.current_device()}"
    else:  # where CUDA will start, and resolving did not start it (see the fresh-process test)
        assert name == "cuda:0" and torch.cuda.is_initialized() is False


def test_device_memory_is_frozen_and_serialisable():
    mem = memguard.DeviceMemory("host", allocated=1, reserved=2 * MiB)
    with pytest.raises(AttributeError):
        mem.allocated = 5  # type: ignore[misc]
    assert mem.to_dict() == {"device": "host", "allocated": 1, "reserved": 2 * MiB, "peak": None,
                             "free": None, "total": None}
    assert str(mem) == "host: allocated 1 B, reserved 2.0 MiB"


PEAK_IN_A_CHILD = r"""
import json, resource
import memguard
from memguard.backends import host

with memguard.memory_scope(devices=["host"]) as scope:
    block = bytearray(96 * 2**20)
    block[::4096] = b"x" * len(block[::4096])  # touched: resident
    during = host.rss()
    del block
with open("/proc/self/status") as f:
    hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
below = 0  # scopes whose peak is under a resident set they read themselves
for i in range(20):
    with memguard.memory_scope(devices=["host"]) as small:
        kept = [bytearray(100_000 + i) for _ in range(100)]
        for block in kept:
            block[::4096] = b"x" * len(block[::4096])
        if i % 2:
            del kept
    levels = (small.before.devices["host"].reserved, small.after.devices["host"].reserved)
    below += small.peak["host"] < max(levels)
print(json.dumps({"peak": scope.peak["host"], "during": during, "hwm": hwm, "below": below,
                  "fast": host._usage_exact,
                  "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def test_a_scopes_peak_is_its_own_process_s_whatever_the_image_it_replaced_at_exec():
    """The peak is read through getrusage (~1 us) where that is exact and /proc/self/status
    (7-40 us) otherwise: getrusage's mark is the higher of the process's own and the one the
    image it replaced at exec reached. Started by a large process (this one, 512 MiB more),
    a child's getrusage reads the parent's mark; started through a small one, its own."""
    import json
    import subprocess
    import sys

    ballast = bytearray(512 * MiB)
    ballast[::4096] = b"x" * len(ballast[::4096])
    direct = [sys.executable, "-c", PEAK_IN_A_CHILD]
    through = [sys.executable, "-c",
               f"import subprocess, sys; sys.exit(subprocess.call({direct!r}))"]
    outs = [json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True,
                                      timeout=120).stdout) for cmd in (direct, through)]
    del ballast
    inherited, own = outs
    assert inherited["maxrss"] > inherited["hwm"] + 256 * MiB  # getrusage reads the parent's
    for out in outs:
        # the kernel's counters, read two ways, differ by a few pages
        assert out["during"] - MiB <= out["peak"] <= out["hwm"] + MiB, out
        assert out["hwm"] - out["peak"] < 4 * MiB, out
        # the kernel sums the per-CPU parts of the resident set approximately for its mark
        # (up to 256 kB short here): a peak never reads under the scope's own readings
        assert out["below"] == 0, out
    assert not inherited["fast"]
    assert own["fast"], outs  # through a small parent: getrusage is the process's own mark


STALE_CHECK = r"""
import inspect, json, sys, threading
import memguard
from memguard.backends import host

def touch(size):
    block = bytearray(size)
    block[::4096] = b"x" * len(block[::4096])
    return block

def vm_hwm():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))

# a thread's check of one reset's getrusage reading, held just before it decides, while
# another thread resets: the decision must not land on that later reset
source, first = inspect.getsourcelines(type(host)._check_usage)
line = first + next(i for i, text in enumerate(source) if "inner.locked()" in text)
held, go, done = threading.Event(), threading.Event(), threading.Event()

def hold(frame, event, arg):
    if frame.f_code.co_name != "_check_usage":
        return None
    def local(frame, event, arg):
        if event == "line" and frame.f_lineno == line:
            held.set()
            go.wait(30)
        return local
    return local

keep = touch(400 * 2**20)  # above the mark inherited at exec: that reset's reading is exact

def other():
    sys.settrace(hold)
    with memguard.memory_scope(cleanup="never"):  # its entry checks its own reset's reading
        sys.settrace(None)
        done.wait(30)

thread = threading.Thread(target=other)
thread.start()
assert held.wait(30)
del keep  # back under the inherited mark: the next reset's reading is not exact
with memguard.memory_scope(cleanup="never") as scope:
    go.set()
    thread.join(0.2)  # the held check goes on
    block = touch(20 * 2**20)
    del block
done.set()
thread.join()
print(json.dumps({"peak": scope.peak["host"], "hwm": vm_hwm(), "line": line}))
"""


def test_a_check_held_past_a_reset_does_not_decide_for_it():
    """The check that getrusage is this process's own mark runs on the next resident set
    read, in whatever thread reads it. A thread held just before deciding for one reset
    while another thread reset again made the later reset read getrusage, so the scope's
    peak was the mark of the image before exec (212 MiB), not its own (37 MiB)."""
    import json
    import subprocess
    import sys

    child = [sys.executable, "-c", STALE_CHECK]
    # started by a process holding 200 MiB: the child inherits that mark at exec
    parent = ("import subprocess, sys\nblock = bytearray(200 * 2**20)\n"
              "block[::4096] = b'x' * len(block[::4096])\n"
              f"sys.exit(subprocess.call({child!r}))")
    run = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout)
    assert out["peak"] <= out["hwm"] + MiB, out
