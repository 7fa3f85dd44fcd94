"""Reliability: bounded monitor memory, bad inputs refused up front, nested limits, a user's
matplotlib backend, NVML once per process, looking never starting a runtime, a quiet pipe."""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys
import time

import pytest
import torch

import memguard
from memguard.backends import DeviceMemory, nvml, torch as torch_backend

MiB = 1 << 20
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")


# -- MemoryMonitor: bounded samples ---------------------------------------------------------------
def test_monitor_stays_within_max_samples_covers_the_run_and_keeps_a_spike():
    mon = memguard.MemoryMonitor(interval=1.0, max_samples=64)
    start, week, n = 1_000_000.0, 7 * 24 * 3600.0, 20_000
    spike_at = 12_345
    mon.started = start
    for i in range(n):
        level = 5 << 30 if i == spike_at else (1 << 30) + i
        mon._record(start + i * week / (n - 1),
                    {"host": DeviceMemory("host", allocated=level - 100, reserved=level)})
        assert len(mon.samples) <= 64
    times = [t for t, _ in mon.samples]
    assert times == sorted(times) and len(mon.samples) >= 32
    assert times[-1] == start + week  # the latest reading is always there
    assert times[0] - start <= week / 32  # the start is covered too, at the coarser step
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert max(gaps) <= week / 32  # a step of at most twice the finest that fits
    assert max(gaps[:-1]) - min(gaps[:-1]) < 1e-3  # one resolution across the whole run
    series = mon.series()["host"]
    assert max(v for _, v in series["reserved"]) == 5 << 30  # the spike survives the merges
    assert max(v for _, v in series["allocated"]) == (5 << 30) - 100
    spike_time = start + spike_at * week / (n - 1)
    assert any(abs(t + start - spike_time) <= max(gaps) and v == 5 << 30
               for t, v in series["reserved"])


def test_a_real_fast_monitor_stays_bounded_and_keeps_every_mark():
    with memguard.MemoryMonitor(interval=0.001, max_samples=16) as mon:
        for i in range(30):
            mon.mark(f"m{i}")
            time.sleep(0.01)
    assert 8 <= len(mon.samples) <= 16
    assert [label for _, label in mon.marks] == [f"m{i}" for i in range(30)]
    assert mon.samples[0][0] - mon.started < 0.25 and mon.samples[-1][0] >= mon.marks[-1][0]
    assert mon.to_dict()["max_samples"] == 16


@pytest.mark.parametrize("value", [0, 1, 2.5, True, "100"])
def test_max_samples_is_checked(value):
    with pytest.raises(ValueError,
                       match=f"max_samples must be an int >= 2, got {value!r}"):
        memguard.MemoryMonitor(max_samples=value)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 0, -1, "1"])
def test_interval_must_be_a_positive_finite_number(value):
    with pytest.raises(ValueError, match=f"positive, finite number of seconds, got {value!r}"):
        memguard.MemoryMonitor(interval=value)


# -- the command line ---------------------------------------------------------------------------
@pytest.mark.slow
def test_watch_into_a_pipe_closed_early_exits_quietly():
    watch = subprocess.Popen([sys.executable, "-m", "memguard", "watch", "--interval", "0.05"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)
    head = subprocess.Popen(["head", "-n", "1"], stdin=watch.stdout, stdout=subprocess.PIPE)
    watch.stdout.close()  # head owns the pipe now: when head exits, watch's writes fail
    first = head.communicate(timeout=60)[0].decode()
    errors = watch.stderr.read().decode()
    assert watch.wait(timeout=60) == 1
    assert " host used " in first and first.count("\n") == 1
    assert errors == ""


# -- memory_limit -------------------------------------------------------------------------------
@pytest.mark.parametrize("device, error, match", [
    ("cuda:x", ValueError, "device must be 'host', 'cuda' or 'cuda:N', got 'cuda:x'"),
    ("cuda:-1", ValueError, "device must be 'host', 'cuda' or 'cuda:N', got 'cuda:-1'"),
    ("host:0", ValueError, "device must be 'host', 'cuda' or 'cuda:N', got 'host:0'"),
    (5, TypeError, "device must be a string such as 'host' or 'cuda:0', got 5 of type int"),
])
def test_memory_limit_refuses_bad_devices_when_called(device, error, match):
    with pytest.raises(error, match=match):
        memguard.memory_limit("1GiB", device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:3"])
def test_memory_limit_on_cuda_without_cuda_says_so(device):
    with pytest.raises(ValueError, match=f"memory_limit: device {device!r} needs a CUDA GPU.*"
                                         f"device='host'"):
        memguard.memory_limit("1GiB", device)
    assert not torch.cuda.is_initialized()


@pytest.mark.slow
def test_nested_memory_limit_only_narrows(python_in_subprocess):
    """In a fresh process: in a long test session other threads' mappings come and go, and
    an address-space budget counts them too."""
    out = python_in_subprocess("""
        import json, resource
        import torch, memguard
        MiB = 2**20
        checks = {}

        def fails(size):
            try:
                torch.empty(size, dtype=torch.uint8)
            except RuntimeError as exc:
                return memguard.is_oom_error(exc)
            return False

        before = resource.getrlimit(resource.RLIMIT_AS)
        with memguard.memory_limit("300MiB", "host"):
            outer = resource.getrlimit(resource.RLIMIT_AS)
            with memguard.memory_limit("1GiB", "host"):
                checks["wider inner keeps the outer"] = resource.getrlimit(
                    resource.RLIMIT_AS) == outer
                checks["500 MiB refused inside"] = fails(500 * MiB)
            checks["outer back"] = resource.getrlimit(resource.RLIMIT_AS) == outer
            with memguard.memory_limit("50MiB", "host"):
                checks["narrower inner applies"] = resource.getrlimit(
                    resource.RLIMIT_AS)[0] < outer[0]
                checks["150 MiB refused in the narrower"] = fails(150 * MiB)
            checks["outer back again"] = resource.getrlimit(resource.RLIMIT_AS) == outer
            checks["150 MiB fits the outer"] = not fails(150 * MiB)
        checks["all lifted"] = resource.getrlimit(resource.RLIMIT_AS) == before
        print(json.dumps(checks))
    """)
    assert all(out.values()), out


# -- plot ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_plot_leaves_the_users_matplotlib_backend_alone(python_in_subprocess, tmp_path):
    pytest.importorskip("matplotlib")
    out = python_in_subprocess(f"""
        import json
        import matplotlib
        matplotlib.use("svg")
        import memguard
        with memguard.MemoryMonitor(interval=0.01) as mon:
            mon.mark("x")
        mon.plot({str(tmp_path / "t.png")!r})
        print(json.dumps({{"backend": matplotlib.get_backend()}}))
    """)
    assert out["backend"] == "svg"
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- NVML ---------------------------------------------------------------------------------------
def test_nvml_is_initialised_once_per_process_and_again_after_fork(monkeypatch):
    pynvml = pytest.importorskip("pynvml")
    calls = []
    real = pynvml.nvmlInit
    monkeypatch.setattr(pynvml, "nvmlInit", lambda *a: (calls.append(os.getpid()), real(*a)))
    monkeypatch.setattr(nvml, "_state", {})
    first = nvml.driver_version(), nvml.gpus()
    for _ in range(5):
        assert (nvml.driver_version(), len(nvml.gpus())) == (first[0], len(first[1]))
    assert calls == [os.getpid()]  # once, whether or not a driver answered
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: NVML handles are not inherited, it initialises its own
        nvml.gpus()
        os.write(write, str(len(calls)).encode())
        os._exit(0)
    os.close(write)
    assert os.read(read, 16) == b"2"
    os.waitpid(pid, 0)
    os.close(read)


# -- looking never starts a runtime -------------------------------------------------------------
def test_available_cuda_device_does_not_initialise_cuda():
    device = torch_backend.available_cuda_device()
    assert device == (None if not torch.cuda.is_available() else device)
    assert not torch.cuda.is_initialized()


def test_tensorflow_that_cannot_be_asked_counts_as_not_started(python_in_subprocess):
    out = python_in_subprocess("""
        import json, sys
        sys.modules["tensorflow"] = None  # TensorFlow that cannot be imported or asked
        from memguard.backends import tensorflow as tf_backend
        print(json.dumps({"started": tf_backend._runtime_started(),
                          "devices": tf_backend.TensorFlowBackend().devices()}))
    """)
    assert out == {"started": False, "devices": []}


# -- the demo -----------------------------------------------------------------------------------
def test_demo_explains_a_kernel_that_could_not_get_memory():
    from memguard.demo import explain_failure

    text = explain_failure(RuntimeError("could not create a primitive"), 32 * MiB, 2048)
    assert text is not None
    assert "batch_size=2048" in text and "32.0 MiB" in text and "--budget" in text
    assert explain_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"),
                           32 * MiB, 2048) is None


@pytest.mark.slow
def test_demo_under_a_tiny_budget_ends_with_a_message_not_a_traceback(tmp_path):
    result = subprocess.run([sys.executable, "-m", "memguard", "demo", "--budget", "32MiB",
                             "--epochs", "1", "--plot", ""], capture_output=True, text=True,
                            timeout=300, env=ENV)
    assert "Traceback" not in result.stderr, result.stderr
    if result.returncode:
        assert "try --budget" in result.stdout or "gave up" in result.stdout, result.stdout
    else:
        assert "everything held" in result.stdout
