"""The memguard command, run as a user runs it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")


def memguard(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "memguard", *args], capture_output=True,
                          text=True, timeout=timeout, env=ENV)


@pytest.mark.slow
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


@pytest.mark.slow
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
    ("demo", "--budget", "0"), ("demo", "--plot", "/no/such/folder/demo.png"),
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
    assert re.search(r"^  epoch 1: 32768(, \d+)* out of memory; \d+ fits$", out, re.M), out
    assert "everything held" in out
    assert "Traceback" not in result.stderr
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000


def test_the_demo_summary_names_every_attempt_of_every_epoch():
    # An out-of-memory in a later epoch was summed up as "64, 64 (fits)": sizes that ran out
    # of memory, wherever they were, beside the size oom_retry ended with.
    from memguard.demo import tried_lines

    tries = [[1, 128, "out of memory"], [1, 64, "fits"], [2, 64, "out of memory"],
             [2, 32, "fits"], [3, 32, "fits"], [4, 32, "fits"], [5, 32, "failed"]]
    assert tried_lines(tries) == ["  epoch 1: 128 out of memory; 64 fits",
                                  "  epoch 2: 64 out of memory; 32 fits",
                                  "  epochs 3-4: 32 fits", "  epoch 5: 32 failed"]


def test_demo_at_its_smallest_budget_ends_in_its_own_words(tmp_path):
    # Under a tight address-space limit nothing new can be mapped: a library or a module of
    # memguard's first imported inside the limit failed to load and ended the demo in a
    # traceback (an ImportError; "field 'target' is required for AnnAssign" from the
    # compiler). A batch that fits in the heap is a pass too; either way no traceback.
    result = memguard("demo", "--budget", "4MiB", "--epochs", "1",
                      "--plot", str(tmp_path / "small.png"), timeout=300)
    assert "Traceback" not in result.stderr, result.stderr
    if result.returncode == 1:
        assert "a 4.0 MiB budget is too small for this demo; try --budget 256MiB" in result.stdout
        assert re.search(r"^  epoch 1: 32768, .* out of memory$", result.stdout, re.M)
    else:
        assert result.returncode == 0 and "everything held" in result.stdout, result.stdout


def test_demo_refuses_a_budget_below_what_its_kernels_need():
    # 1 KiB ended at times in a segfault inside torch, not in an out-of-memory
    result = memguard("demo", "--budget", "1KiB")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "1.0 KiB is too small for this demo: under 4.0 MiB" in result.stderr


@pytest.mark.slow
def test_demo_with_tensorflow(tmp_path):
    # two epochs, the fewest that judge creep after the first (the torch demo above runs the
    # default three): a TensorFlow epoch takes 3-4 s
    result = memguard("demo", "--framework", "tensorflow", "--plot", str(tmp_path / "tf.png"),
                      "--epochs", "2", timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "tensorflow on cpu" in result.stdout and "everything held" in result.stdout
    assert "epoch 2/2 [########################]" in result.stdout  # both epochs trained


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


def test_demo_checks_the_plot_path_before_training(tmp_path):
    missing = tmp_path / "no-such-folder" / "demo.png"
    result = memguard("demo", "--plot", str(missing), timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stdout == ""  # refused before the demo started: nothing trained
    assert (f"memguard demo: error: argument --plot: cannot write the timeline to "
            f"'{missing}': the folder '{missing.parent}' does not exist; create it first or "
            f"choose another --plot PATH") in result.stderr
    folder = memguard("demo", "--plot", str(tmp_path), timeout=60)
    assert folder.returncode == 2 and "it is a folder" in folder.stderr


DEMO_TIMELINE = """
    import json
    from memguard import demo

    said = []
    result = demo.train(768 << 20, "torch", epochs=2,
                        say=lambda text="", **_: said.append(text))
    figure = demo.timeline(result)
    panels = {ax.get_ylabel(): {line.get_label(): [float(y) for y in line.get_ydata()]
                                for line in ax.get_lines()} for ax in figure.axes}
    numbers = [t for t in figure.axes[0].texts if t.get_text().isdigit()]
    renderer = figure.canvas.get_renderer()
    boxes = [t.get_window_extent(renderer) for t in numbers]
    overlaps = sum(bool(a.overlaps(b)) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    listing = figure.texts[-1].get_text().splitlines()[1:]
    print(json.dumps({"ok": result.ok, "title": figure.get_suptitle(), "panels": panels,
                      "numbers": len(numbers), "overlaps": overlaps, "listing": listing,
                      "marks": [label for _, label in result.monitor.marks],
                      "oom_labels": [t.get_text() for t in figure.axes[0].texts
                                     if t.get_color() == "tab:red"],
                      "oom_lines": [len(c.get_segments()) for ax in figure.axes
                                    for c in ax.collections if c.get_label() == "out of memory"],
                      "said": said}))
"""


@pytest.mark.slow
def test_the_demo_timeline_draws_the_budget_it_sets_and_marks_in_true_order(
        python_in_subprocess):
    out = python_in_subprocess(DEMO_TIMELINE, timeout=300)
    assert out["ok"]
    assert out["title"] == "memguard demo: torch on cpu, memory_limit 768.0 MiB"
    # The out-of-memory stands out from the other marks: a red line in every panel and a red
    # label; and the demo says what its budget counts.
    ooms = sum(label.startswith("out of memory") for label in out["marks"])
    assert ooms >= 1 and out["oom_labels"] == ["\u25bc out of memory"] * ooms
    assert out["oom_lines"] == [ooms] * len(out["panels"])
    assert "counts address space" in out["said"][1] and "can exceed" in out["said"][1]
    # The budget limits address space: drawn against the virtual size, not the resident set.
    assert set(out["panels"]) == {"host (MiB)", "host address space (MiB)"}
    assert set(out["panels"]["host (MiB)"]) == {"allocated", "reserved"}
    space = out["panels"]["host address space (MiB)"]
    assert set(space) == {"virtual size", "soft RLIMIT_AS (set by memory_limit)"}
    (limit,) = set(space["soft RLIMIT_AS (set by memory_limit)"])  # one limit, the budget's
    virtual = space["virtual size"]
    assert max(virtual) < limit and limit - max(virtual) < 768  # approaches, never crosses
    # Every mark once, in the order things happened: the out-of-memory inside its epoch.
    labels = [re.sub(r"^ *(\d+|-) +[\d.]+ s  ", "", row) for row in out["listing"]]
    assert labels[0] == "enter memory_scope 'epoch 1, batch 32768'"
    assert labels[1].startswith("out of memory: batch 32768 asked ")
    assert labels[2:] == ["exit memory_scope 'epoch 1, batch 32768'",
                          "enter memory_scope 'epoch 1, batch 16384'",
                          "exit memory_scope 'epoch 1, batch 16384'",
                          "enter memory_scope 'epoch 2, batch 16384'",
                          "exit memory_scope 'epoch 2, batch 16384'"]
    assert "OOM at batch_size=32768" in out["marks"]  # oom_retry's own, for the summary
    assert out["numbers"] >= 3 and out["overlaps"] == 0
