from __future__ import annotations

import csv
import json
import threading
import time

import pytest
import torch

import memguard

MiB = 1 << 20


def test_samples_follow_memory_and_peak_is_kept():
    with memguard.MemoryMonitor(interval=0.01) as mon:
        time.sleep(0.05)
        block = torch.ones(200 * MiB // 4)
        time.sleep(0.08)
        del block
        time.sleep(0.05)
    assert len(mon.samples) >= 10
    times = [t for t, _ in mon.samples]
    assert times == sorted(times)
    levels = [mem["host"].reserved for _, mem in mon.samples]
    assert max(levels) - levels[0] > 150 * MiB and levels[-1] - levels[0] < 60 * MiB
    assert mon.peak["host"] >= max(levels)
    assert all(mem["host"].allocated is not None for _, mem in mon.samples)


def test_marks_from_the_user_from_scopes_and_from_oom_retry():
    @memguard.oom_retry(batch_size=4)
    def step(batch_size):
        torch.empty(batch_size * (1 << 42) if batch_size > 2 else batch_size)

    with memguard.MemoryMonitor(interval=0.05) as mon:
        mon.mark("epoch 1")
        with memguard.memory_scope("load"):
            pass
        step()
    labels = [label for _, label in mon.marks]
    assert labels == ["epoch 1", "enter memory_scope 'load'", "exit memory_scope 'load'",
                      "OOM at batch_size=4"]
    with memguard.memory_scope("after"):
        pass
    assert len(mon.marks) == 4  # a stopped monitor hears nothing


def test_stops_within_an_interval_even_when_the_body_raises():
    mon = memguard.MemoryMonitor(interval=0.2)
    with pytest.raises(ValueError, match="body"):
        with mon:
            raise ValueError("body")
    started = time.perf_counter()
    mon2 = memguard.MemoryMonitor(interval=0.5).start()
    time.sleep(0.05)
    mon2.stop()
    assert time.perf_counter() - started < 0.5
    assert not any(t.name == "memguard-monitor" for t in threading.enumerate())


def test_start_twice_and_bad_interval():
    mon = memguard.MemoryMonitor(interval=0.05).start()
    try:
        with pytest.raises(RuntimeError, match="already running"):
            mon.start()
    finally:
        mon.stop()
    for bad in (0, -1, "1", True):
        with pytest.raises(ValueError, match="interval must be a positive, finite number"):
            memguard.MemoryMonitor(interval=bad)


def test_csv_and_dict_exports(tmp_path):
    with memguard.MemoryMonitor(interval=0.01) as mon:
        mon.mark("half")
        time.sleep(0.03)
    path = tmp_path / "timeline.csv"
    mon.to_csv(str(path))
    rows = list(csv.DictReader(path.open()))
    assert set(rows[0]) == {"time", "device", "allocated", "reserved", "mark"}
    assert any(row["mark"] == "half" for row in rows)
    samples = [row for row in rows if row["device"] == "host"]
    assert len(samples) == len(mon.samples) and int(samples[0]["reserved"]) > 0
    data = json.loads(json.dumps(mon.to_dict()))
    assert data["marks"][0]["label"] == "half" and data["peak"]["host"] > 0
    assert len(data["samples"]) == len(mon.samples)


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    with memguard.MemoryMonitor(interval=0.01) as mon:
        mon.mark("spike")
        block = torch.ones(50 * MiB // 4)
        time.sleep(0.03)
        del block
    path = tmp_path / "timeline.png"
    assert mon.plot(str(path)) == str(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


def test_plot_without_matplotlib_names_the_extra(python_in_subprocess):
    out = python_in_subprocess("""
        import json, sys
        sys.modules["matplotlib"] = None  # as if it were not installed
        import memguard
        mon = memguard.MemoryMonitor(interval=0.01).start()
        mon.stop()
        try:
            mon.plot("x.png")
            print(json.dumps(None))
        except ImportError as exc:
            print(json.dumps(str(exc)))
    """)
    assert out == 'MemoryMonitor.plot needs matplotlib: pip install "memguard[plot]"'


def test_tensorboard_through_torch_summary_writer(tmp_path):
    tensorboard = pytest.importorskip("torch.utils.tensorboard")
    with memguard.MemoryMonitor(interval=0.01) as mon:
        time.sleep(0.03)
    writer = tensorboard.SummaryWriter(str(tmp_path))
    written = mon.to_tensorboard(writer)
    writer.close()
    assert written == 2 * len(mon.samples)
    assert any(p.name.startswith("events.out.tfevents") for p in tmp_path.iterdir())
    with pytest.raises(TypeError, match="SummaryWriter"):
        mon.to_tensorboard(object())


@pytest.mark.slow
def test_tensorboard_through_tf_summary(python_in_subprocess, tmp_path):
    out = python_in_subprocess(f"""
        import json, os, time
        import tensorflow as tf
        import memguard
        with memguard.MemoryMonitor(interval=0.01) as mon:
            time.sleep(0.03)
        writer = tf.summary.create_file_writer({str(tmp_path)!r})
        written = mon.to_tensorboard(writer)
        print(json.dumps({{"written": written, "samples": len(mon.samples),
                          "files": os.listdir({str(tmp_path)!r})}}))
    """)
    assert out["written"] == 2 * out["samples"]
    assert any(name.startswith("events.out.tfevents") for name in out["files"])
