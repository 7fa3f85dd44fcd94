"""The memguard command, run as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")


def memguard(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "memguard", *args], capture_output=True,
                          text=True, timeout=timeout, env=ENV)


def test_info_human_and_json():
    human = memguard("info", "--no-tensorflow")
    assert human.returncode == 0, human.stderr
    lines = human.stdout.splitlines()
    assert lines[0].startswith("memguard 0.1.0, Python 3.")
    assert any(line.startswith("torch 2.") for line in lines)
    assert "tensorflow: skipped (--no-tensorflow)" in lines
    assert any(line.split()[:1] == ["host"] and "GiB" in line for line in lines)
    machine = memguard("info", "--json", "--no-tensorflow")
    data = json.loads(machine.stdout)
    assert data["devices"][0]["device"] == "host" and data["devices"][0]["total"] > 0
    assert "torch" in data["frameworks"] and "tensorflow" not in data["frameworks"]


def test_info_shows_allocator_settings_from_the_environment():
    result = subprocess.run([sys.executable, "-m", "memguard", "info", "--no-tensorflow"],
                            capture_output=True, text=True, timeout=120,
                            env=dict(ENV, PYTORCH_ALLOC_CONF="expandable_segments:True"))
    assert "  PYTORCH_ALLOC_CONF=expandable_segments:True" in result.stdout


@pytest.mark.slow
def test_info_with_tensorflow():
    data = json.loads(memguard("info", "--json").stdout)
    assert data["frameworks"]["tensorflow"].startswith("2.")
    assert isinstance(data["tensorflow_gpus"], list)


def test_watch_prints_count_lines():
    result = memguard("watch", "--count", "3", "--interval", "0.05")
    assert result.returncode == 0
    lines = result.stdout.splitlines()
    assert len(lines) == 3 and all(" host used " in line and " free " in line for line in lines)
    mine = memguard("watch", "--count", "1", "--pid", str(os.getpid()))
    assert f"pid {os.getpid()} rss " in mine.stdout


def test_watch_of_a_missing_process():
    result = memguard("watch", "--count", "1", "--pid", "999999999")
    assert result.returncode == 1 and "no process 999999999" in result.stderr


@pytest.mark.parametrize("args", [
    ("watch", "--interval", "0"), ("watch", "--count", "x"), ("demo", "--budget", "lots"),
    ("demo", "--framework", "jax"), ("frobnicate",), (),
    ("watch", "--interval", "nan", "--count", "2"), ("watch", "--interval", "inf", "--count", "2"),
    ("demo", "--budget", "0"),
])
def test_bad_arguments_exit_2_without_a_traceback(args):
    result = memguard(*args)
    assert result.returncode == 2
    assert "usage: memguard" in result.stderr and "Traceback" not in result.stderr
    assert len([line for line in result.stderr.splitlines() if "error:" in line]) == 1


@pytest.mark.parametrize("command", ["info", "watch", "demo"])
def test_every_subcommand_has_help(command):
    result = memguard(command, "--help")
    assert result.returncode == 0 and f"usage: memguard {command}" in result.stdout


@pytest.mark.slow
def test_demo_recovers_trains_and_writes_the_timeline(tmp_path):
    plot = tmp_path / "demo.png"
    result = memguard("demo", "--plot", str(plot), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "out of memory at batch_size=32768" in out  # the whole data set: too big
    assert "retrying at batch_size=16384" in out  # the size oom_retry runs next
    assert "epoch 3/3 [########################]" in out
    assert "(fits)" in out and "everything held" in out
    assert "Traceback" not in result.stderr
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000


@pytest.mark.slow
def test_demo_with_tensorflow(tmp_path):
    result = memguard("demo", "--framework", "tensorflow", "--plot", str(tmp_path / "tf.png"),
                      timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "tensorflow on cpu" in result.stdout and "everything held" in result.stdout


def test_the_demo_prints_the_size_oom_retry_runs_next_whatever_the_factor():
    import memguard
    from memguard.demo import retry_line

    lines = []

    @memguard.oom_retry(batch_size=64, factor=0.25, on_retry=lambda a: lines.append(retry_line(a)))
    def step(batch_size):
        if batch_size > 4:
            raise MemoryError(f"{batch_size} samples do not fit")
        return batch_size

    assert step() == 4
    assert [line.split("; ")[-1] for line in lines] == ["memory freed, retrying at batch_size=16",
                                                        "memory freed, retrying at batch_size=4"]
    assert lines[0].startswith("  out of memory at batch_size=64 after ")
