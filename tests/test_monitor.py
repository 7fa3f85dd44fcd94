from __future__ import annotations

import csv
import json
import logging
import threading
import time

import pytest
import torch

import memguard
from memguard import backends

from frameworks import requires

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


def _numbers(ax):
    """The mark numbers drawn on ``ax``, as ``{number: x}``."""
    return {int(t.get_text()): t.get_position()[0] for t in ax.texts if t.get_text().isdigit()}


def _mark_lines(ax):
    """The x of every vertical mark line drawn on ``ax`` (marks are line collections)."""
    from matplotlib.collections import LineCollection

    return sorted(segment[0][0] for c in ax.collections if isinstance(c, LineCollection)
                  for segment in c.get_segments())


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
    figure = mon.figure(title="one spike")
    ax = figure.axes[0]
    assert ax.get_ylabel() == "host (MiB)" and figure.get_suptitle() == "one spike"
    drawn = {line.get_label(): line for line in ax.get_lines()}
    series = mon.series()["host"]
    for field in ("allocated", "reserved"):
        assert list(drawn[field].get_xdata()) == pytest.approx([t for t, _ in series[field]])
        assert list(drawn[field].get_ydata()) == pytest.approx(
            [v / MiB for _, v in series[field]])
    assert max(drawn["allocated"].get_ydata()) - min(drawn["allocated"].get_ydata()) > 40
    spike = mon.marks[0][0] - mon.started
    assert _mark_lines(ax) == pytest.approx([spike])
    assert _numbers(ax) == pytest.approx({1: spike})
    listing = "\n".join(text.get_text() for text in figure.texts)
    assert "1" in listing and "spike" in listing


def test_plot_of_a_monitor_that_never_ran(tmp_path):
    pytest.importorskip("matplotlib")
    mon = memguard.MemoryMonitor()
    mon.mark("before any sample")  # seconds count from the first mark, not from 1970
    assert mon.plot(str(tmp_path / "idle.png")).endswith("idle.png")
    figure = mon.figure()
    assert _mark_lines(figure.axes[0]) == [0.0] and _numbers(figure.axes[0]) == {1: 0.0}


def test_a_failing_reading_is_logged_once_then_counted(monkeypatch, caplog):
    def unreadable(device="host"):
        raise OSError(5, "Input/output error", "/proc/self/statm")

    monkeypatch.setattr(backends.host, "read_fast", unreadable)
    with caplog.at_level(logging.WARNING, logger="memguard"):
        with memguard.MemoryMonitor(interval=0.01, devices="host") as mon:
            time.sleep(0.3)
    messages = [r.getMessage() for r in caplog.records if r.name == "memguard"]
    assert len(mon.samples) >= 10
    assert all(mem["host"].reserved is None for _, mem in mon.samples)
    assert len(messages) == 2, f"{len(messages)} warnings: {messages[:3]}..."
    failed = mon.failed_readings["host"]
    assert failed >= len(mon.samples)
    assert messages[0].startswith("MemoryMonitor: cannot read host: [Errno 5] Input/output "
                                  "error: '/proc/self/statm'")
    assert messages[1] == f"MemoryMonitor: reading host failed {failed} times of {failed}"


def test_marks_are_bounded_keeping_the_first_and_the_latest():
    with memguard.MemoryMonitor(interval=0.05, max_marks=100) as mon:
        for i in range(1000):
            with memguard.memory_scope(f"s{i}"):
                pass
    labels = [label for _, label in mon.marks]
    assert len(labels) == 100 and mon.marks_dropped == 1900
    assert labels[:2] == ["enter memory_scope 's0'", "exit memory_scope 's0'"]
    assert labels[49] == "exit memory_scope 's24'"
    assert labels[50] == "enter memory_scope 's975'"  # the latest 50 of 2000
    assert labels[-1] == "exit memory_scope 's999'"
    times = [t for t, _ in mon.marks]
    assert times == sorted(times)
    assert mon.to_dict()["marks_dropped"] == 1900
    with pytest.raises(ValueError, match="max_marks must be an int >= 2, got 1"):
        memguard.MemoryMonitor(max_marks=1)


@pytest.mark.slow
def test_plot_of_ten_thousand_marks_is_fast_and_legible(tmp_path):
    pytest.importorskip("matplotlib")
    with memguard.MemoryMonitor(interval=0.01) as mon:
        for i in range(10_000):
            mon.mark(f"enter memory_scope 'step {i}'")
            if i % 50 == 0:
                time.sleep(0.002)
    assert len(mon.marks) == 10_000
    started = time.perf_counter()
    path = mon.plot(str(tmp_path / "many.png"))
    seconds = time.perf_counter() - started
    assert seconds < 8, f"plot of 10,000 marks took {seconds:.1f} s"  # 21 s when drawn one by one
    assert (tmp_path / "many.png").stat().st_size > 5000 and path.endswith("many.png")
    figure = mon.figure()
    ax = figure.axes[0]
    assert len(_mark_lines(ax)) == 10_000  # every mark is a line, in a few collections
    assert len(ax.collections) <= 2
    numbers = _numbers(ax)
    assert 5 <= len(numbers) <= memguard.monitor.MAX_LISTED_MARKS
    assert sorted(numbers) == list(range(1, len(numbers) + 1))
    xs = [numbers[n] for n in sorted(numbers)]
    assert xs == sorted(xs)  # numbered in time order
    renderer = figure.canvas.get_renderer()
    boxes = [t.get_window_extent(renderer) for t in ax.texts if t.get_text().isdigit()]
    overlapping = [(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:] if a.overlaps(b)]
    assert not overlapping
    listing = "\n".join(text.get_text() for text in figure.texts)
    assert f"{10_000 - len(numbers)} more marks" in listing


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
    assert out == 'MemoryMonitor.plot needs matplotlib: pip install "memguard-ml[plot]"'


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
@requires("tensorflow", "tensorboard")  # tf.summary writes through tensorboard
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


def test_a_restarted_monitor_continues_its_timeline_with_times_that_only_grow():
    """Before: a second start moved the time origin, so the first run's samples read as
    negative times."""
    mon = memguard.MemoryMonitor(interval=0.005, devices="host")
    for _ in range(2):
        with mon:
            mon.mark("run")
            time.sleep(0.03)
    times = [t for t, _ in mon.series()["host"]["reserved"]]
    assert len(times) >= 4 and times[0] >= 0
    assert times == sorted(times)
    assert len(mon.marks) == 2 and all(t >= mon.started for t, _ in mon.marks)


def test_guards_have_readable_reprs():
    model = torch.nn.Linear(2, 2)
    assert repr(memguard.inference_mode(model)) == "<InferenceMode of Linear, cleanup='auto'>"
    limit = memguard.memory_limit("256MiB", "host")
    assert repr(limit) == "<MemoryLimit 256.0 MiB on host, not active>"
    mon = memguard.MemoryMonitor(interval=0.5, devices="host")
    assert repr(mon) == "<MemoryMonitor every 0.5 s on host, stopped, 0 samples, 0 marks>"
    loop = memguard.attempts(batch_size=8)
    assert repr(loop) == "<AttemptLoop 'attempts': batch_size=8, 0 attempts, not done>"
    for attempt in loop:
        with attempt:
            pass
    assert repr(loop) == "<AttemptLoop 'attempts': batch_size=8, 1 attempt, done>"


def test_a_limit_the_process_had_before_is_not_labelled_memory_limit(python_in_subprocess):
    """A ``ulimit -v`` in force before memory_limit opened a wider one stays the process's own
    limit (RLIMIT_AS) in the budget and the monitor, not "memory_limit"."""
    out = python_in_subprocess("""
        import json, resource, time
        import memguard
        from memguard.backends import budget

        def vm():
            with open("/proc/self/status") as f:
                return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))

        resource.setrlimit(resource.RLIMIT_AS, (vm() + 500 * 2**20, resource.RLIM_INFINITY))
        kinds = {"before": budget.budget("host").kind}
        with memguard.MemoryMonitor(interval=0.01, devices="host") as mon:
            with memguard.memory_limit("4GiB", "host"):  # wider: the 500 MiB stays in force
                kinds["wider"] = budget.budget("host").kind
                time.sleep(0.03)
            with memguard.memory_limit("100MiB", "host"):  # tighter: memguard's own
                kinds["tighter"] = budget.budget("host").kind
                time.sleep(0.03)
        kinds["monitor"] = sorted({kind for *_, kind in mon.address_space()})
        print(json.dumps(kinds))
    """)
    assert out == {"before": "RLIMIT_AS", "wider": "RLIMIT_AS", "tighter": "memory_limit",
                   "monitor": ["RLIMIT_AS", "memory_limit"]}, out
