"""Polish found while building the integrations: `memguard info` and TensorFlow, the demo's
start and its timeline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

import memguard
from memguard import demo
from memguard.backends import tensorflow as tf_backend


def test_the_demo_starts_at_a_batch_no_larger_than_its_data():
    assert demo.START_BATCH <= demo.SAMPLES


def test_the_timeline_draws_horizontal_lines_and_numbered_marks(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.collections import LineCollection
    from matplotlib.image import imread

    with memguard.MemoryMonitor(interval=0.01) as monitor:
        for i in range(30):  # crowded marks: listed beside the plot, not stacked on it
            monitor.mark(f"mark {i}")
            time.sleep(0.004 if i % 10 == 9 else 0)
        block = bytearray(20 << 20)
        del block
    budget = {"host": [(1 << 30, "budget")]}
    figure = monitor.figure(lines=budget)
    ax = figure.axes[0]
    (line,) = [line for line in ax.get_lines() if line.get_label() == "budget"]
    assert list(line.get_ydata()) == [1024, 1024] and ax.get_ylim()[1] >= 1024
    marks = sorted(segment[0][0] for c in ax.collections if isinstance(c, LineCollection)
                   for segment in c.get_segments())
    assert marks == pytest.approx(sorted(t - monitor.started for t, _ in monitor.marks))
    numbers = [t for t in ax.texts if t.get_text().isdigit()]
    assert 3 <= len(numbers) < 30  # three bursts of ten: a number each at least, never 30
    assert [int(t.get_text()) for t in numbers] == list(range(1, len(numbers) + 1))
    renderer = figure.canvas.get_renderer()
    boxes = [t.get_window_extent(renderer) for t in numbers]
    assert not [(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:] if a.overlaps(b)]
    listing = figure.texts[-1].get_text().splitlines()
    assert listing[0] == "marks" and len(listing) == 31  # every mark, in time order
    assert [row.split()[-2:] for row in listing[1:]] == [["mark", str(i)] for i in range(30)]
    path = monitor.plot(str(tmp_path / "t.png"), lines=budget)
    image = imread(path)
    assert image.shape[1] == 1200  # 12 in at 100 dpi: room for the list of marks
    red = (abs(image[..., 0] - 0.84) < 0.08) & (image[..., 1] < 0.3) & (image[..., 2] < 0.3)
    assert red.sum() > 200  # the budget line is in the picture


@pytest.mark.slow
def test_info_knows_tensorflow_without_importing_it_where_no_gpu_driver_is():
    if tf_backend.installed_version() is None:
        pytest.skip("TensorFlow is not installed")
    code = ("import json, sys\nfrom memguard.cli import collect_info\n"
            "data = collect_info()\n"
            "print(json.dumps([data['frameworks'].get('tensorflow'), "
            "'tensorflow' in sys.modules, tf_possible()]))\n").replace(
        "tf_possible()", "__import__('memguard.backends.tensorflow', fromlist=['x'])"
                         ".gpus_possible()")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0"))
    version, imported, possible = json.loads(out.stdout.splitlines()[-1])
    assert version.startswith("2.")
    assert imported == possible  # imported only where a GPU could be listed
    assert "oneDNN" not in out.stderr


@pytest.mark.slow
def test_tensorflow_is_imported_once_without_its_banner():
    code = ("from memguard.backends.tensorflow import import_quietly\n"
            "tf = import_quietly()\nassert import_quietly() is tf\n"
            "import sys; print(tf.__version__, file=sys.stderr)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=180, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0"))
    assert out.returncode == 0, out.stderr
    assert "oneDNN" not in out.stderr and out.stderr.strip().startswith("2.")
