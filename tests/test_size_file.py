"""Size files (``cache=path`` of oom_retry and find_batch_size): a file that is not memguard's
is never written, a size file never breaks a call, and different code never shares a size.

Out-of-memory errors are real: ``torch.empty`` of more than the machine has fails in the CPU
allocator at once.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import warnings

import pytest
import torch

import memguard
from memguard.sizefile import SizeFile, size_key

HUGE = 1 << 42


def real_oom() -> None:
    torch.empty(HUGE)


def _guarded(path, limit=20):
    calls = []

    @memguard.oom_retry(batch_size=64, cache=path)
    def train(batch_size):
        calls.append(batch_size)
        if batch_size > limit:
            real_oom()
        return batch_size

    return train, calls


# -- A file that is not memguard's is never written -------------------------------------------

NOT_SIZE_FILES = {
    "a user's config": b'{"lr": 0.001}',
    "corrupt": b"{not json",
    "not UTF-8": b'{"memguard sizes": 1, "sizes": {"\xff\xfe": 3}}',
    "deeply nested": b"[" * 200_000 + b"]" * 200_000,
    "a JSON list": b"[1, 2, 3]",
    "whitespace": b"  \n",
}


@pytest.mark.parametrize("content", NOT_SIZE_FILES.values(), ids=NOT_SIZE_FILES.keys())
def test_a_file_that_is_not_a_size_file_is_left_as_it_is_and_the_call_succeeds(tmp_path,
                                                                                 content):
    path = tmp_path / "config.json"
    path.write_bytes(content)
    train, calls = _guarded(path)
    with pytest.warns(RuntimeWarning, match=r"config\.json.* not a memguard size file") as seen:
        assert train() == 16
    assert calls == [64, 32, 16]
    assert path.read_bytes() == content
    assert {str(w.message) for w in seen}, "warned"
    assert [w.filename for w in seen] == [__file__] * len(seen)  # the caller's line
    assert not [f for f in os.listdir(tmp_path) if f != "config.json"]  # no lock, no temp


def test_find_batch_size_leaves_a_user_file_as_it_is(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"lr": 0.001}')
    with pytest.warns(RuntimeWarning, match="not a memguard size file") as seen:
        assert memguard.find_batch_size(lambda b: b > 300 and real_oom(), margin=0.0, start=16,
                                        cache=path) == 300
    assert path.read_text() == '{"lr": 0.001}'
    assert len(seen) == 1 and seen[0].filename == __file__


@pytest.mark.parametrize("mode", [0o444, 0o000])
def test_a_read_only_size_file_is_read_but_never_written(tmp_path, mode):
    path = tmp_path / "sizes.json"
    train, _ = _guarded(path, limit=40)
    assert train() == 32
    before = path.read_bytes()
    os.chmod(path, mode)
    train, calls = _guarded(path, limit=40)
    assert train() == 32 and calls == [32]  # still read
    train, calls = _guarded(path, limit=20)
    with pytest.warns(RuntimeWarning, match=r"sizes\.json.* read-only"):
        assert train() == 16
    assert path.read_bytes() == before and os.stat(path).st_mode & 0o777 == mode


def test_an_unreadable_path_is_never_replaced(tmp_path):
    path = tmp_path / "sizes.json"
    path.mkdir()  # readable by no one, root included
    train, _ = _guarded(path)
    with pytest.warns(RuntimeWarning, match=r"sizes\.json.* not a regular file"):
        assert train() == 16
    assert path.is_dir() and not list(path.iterdir())


def test_an_empty_file_becomes_a_size_file(tmp_path):
    path = tmp_path / "sizes.json"
    path.touch()
    train, _ = _guarded(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert train() == 16
    assert list(json.loads(path.read_text())["sizes"].values()) == [16]


def test_a_symlink_to_a_size_file_is_written_through_and_stays_a_link(tmp_path):
    target = tmp_path / "real" / "sizes.json"
    target.parent.mkdir()
    link = tmp_path / "sizes.json"
    link.symlink_to(target)  # dangling until the first size is kept
    train, _ = _guarded(link)
    assert train() == 16
    assert link.is_symlink() and list(json.loads(target.read_text())["sizes"].values()) == [16]
    train, _ = _guarded(link, limit=40)  # another function: a second entry
    assert train() == 32
    assert link.is_symlink() and sorted(json.loads(target.read_text())["sizes"].values()) == [
        16, 32]


def test_a_size_file_never_breaks_a_call_under_warnings_as_errors(tmp_path, caplog):
    path = tmp_path / "config.json"
    path.write_text('{"lr": 0.001}')
    train, _ = _guarded(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with caplog.at_level(logging.WARNING, logger="memguard"):
            assert train() == 16  # the result is never lost
    assert any("not a memguard size file" in r.getMessage() for r in caplog.records)
    assert path.read_text() == '{"lr": 0.001}'


def test_a_call_that_cannot_keep_its_size_returns_its_result_under_warnings_as_errors(
        tmp_path, caplog):
    path = tmp_path / "sizes.json"
    SizeFile(path).put("another entry", 3)  # a size file when the call begins

    @memguard.oom_retry(batch_size=64, cache=path)
    def train(batch_size):
        if batch_size > 20:
            real_oom()
        path.write_text('{"lr": 0.001}')  # meanwhile the path became someone else's file
        return batch_size

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with caplog.at_level(logging.WARNING, logger="memguard"):
            assert train() == 16
    assert path.read_text() == '{"lr": 0.001}'
    assert any("not a memguard size file" in r.getMessage() for r in caplog.records)


def test_the_warning_is_shown_once_and_not_also_logged(tmp_path, caplog):
    path = tmp_path / "config.json"
    path.write_text("{not json")
    train, _ = _guarded(path)
    with caplog.at_level(logging.WARNING, logger="memguard"):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            train()
    assert len([w for w in seen if "size file" in str(w.message)]) == 1
    assert not [r for r in caplog.records
                if r.levelno >= logging.WARNING and "size file" in r.getMessage()]


def test_a_size_file_with_bad_entries_keeps_its_good_ones(tmp_path):
    path = tmp_path / "sizes.json"
    path.write_text(json.dumps({"memguard sizes": 1, "sizes": {"a": 4, "b": "x", "c": -1}}))
    sizes = SizeFile(path)
    assert sizes.get("a") == 4 and sizes.get("b") is None
    sizes.put("d", 8)
    assert json.loads(path.read_text())["sizes"] == {"a": 4, "d": 8}


# -- Different code never shares a size --------------------------------------------------------

def _fits(limit, trials=None):
    def check(batch_size):
        if trials is not None:
            trials.append(batch_size)
        if batch_size > limit:
            real_oom()
    return check


@pytest.mark.slow
def test_two_lambdas_of_one_module_keep_their_own_sizes(tmp_path):
    path = tmp_path / "sizes.json"
    fits_40, fits_10 = _fits(40), _fits(10)
    assert memguard.find_batch_size(lambda b: fits_40(b), margin=0.0, start=8, cache=path) == 40
    trials = []
    assert memguard.find_batch_size(lambda b: trials.append(b) or fits_10(b), margin=0.0, start=8,
                                    cache=path) == 10
    assert trials  # searched, not read from the entry of the other lambda


@pytest.mark.slow
def test_closures_from_one_factory_keep_their_own_sizes(tmp_path):
    path = tmp_path / "sizes.json"
    assert memguard.find_batch_size(_fits(40), margin=0.0, start=8, cache=path) == 40
    assert memguard.find_batch_size(_fits(10), margin=0.0, start=8, cache=path) == 10
    assert memguard.find_batch_size(_fits(40), margin=0.0, start=8, cache=path) == 40
    assert len(json.loads(path.read_text())["sizes"]) == 2


@pytest.mark.slow
@pytest.mark.parametrize("first, second", [
    ({"max_batch_size": 8}, {}),
    ({"mode": "power"}, {"mode": "binsearch"}),
    ({"max_attempts": 2}, {}),
])
def test_find_batch_size_keeps_a_size_per_search(tmp_path, first, second):
    path = tmp_path / "sizes.json"
    trials: list[int] = []
    step = _fits(300, trials)  # the same step (its list of trials is not part of the key)
    capped = memguard.find_batch_size(step, margin=0.0, start=4, cache=path, **first)
    assert capped < 300
    trials.clear()
    assert memguard.find_batch_size(step, margin=0.0, start=4, cache=path, **second) == 300
    assert trials  # searched
    trials.clear()
    assert memguard.find_batch_size(step, margin=0.0, start=4, cache=path, **first) == capped
    assert trials == []  # each search's own entry


def test_steps_per_trial_is_part_of_the_key(tmp_path):
    assert (size_key("find_batch_size", _fits, 4, "host", steps_per_trial=1)
            != size_key("find_batch_size", _fits, 4, "host", steps_per_trial=2))


def test_the_key_names_the_code_readably():
    key = size_key("oom_retry", _fits, 64, "host x86_64 (1 bytes)")
    assert key.startswith("oom_retry test_size_file._fits at ")
    assert f"{os.path.abspath(__file__)}:" in key and key.endswith(
        "start=64 on host x86_64 (1 bytes)")


SCRIPT = """
import json, sys, torch, memguard

def train(batch_size):
    if batch_size > LIMIT:
        torch.empty(1 << 42)
    return batch_size

print(json.dumps(memguard.find_batch_size(train, margin=0.0, start=8, cache=sys.argv[1])))
"""


@pytest.mark.slow
def test_two_scripts_main_train_keep_their_own_sizes(tmp_path):
    path = str(tmp_path / "sizes.json")
    found = []
    for name, limit in (("first.py", 40), ("second.py", 10)):
        script = tmp_path / name
        script.write_text(SCRIPT.replace("LIMIT", str(limit)))
        proc = subprocess.run([sys.executable, str(script), path], capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        found.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert found == [40, 10]


def test_reset_forgets_the_functions_sizes_in_the_file_and_keeps_the_others(tmp_path):
    path = str(tmp_path / "sizes.json")
    train, calls = _guarded(path, limit=20)
    assert train() == 16 and calls == [64, 32, 16]
    assert train(batch_size=40) == 20

    @memguard.oom_retry(batch_size=64, cache=path)
    def other(batch_size):
        if batch_size > 8:
            real_oom()
        return batch_size

    assert other() == 8
    assert len(json.loads(open(path).read())["sizes"]) == 3
    train.reset()
    calls.clear()
    assert train() == 16 and calls == [64, 32, 16]  # afresh, not from the file
    # a later process (a new decoration of the same code) starts afresh too, after a reset
    train.reset()
    again, again_calls = _guarded(path, limit=20)
    assert again() == 16 and again_calls == [64, 32, 16]
    sizes = json.loads(open(path).read())["sizes"]
    assert sorted(sizes.values()) == [8, 16], sizes  # other's size is still kept


def test_concurrent_writers_keep_every_entry_and_leave_nothing_beside_the_file(tmp_path):
    """Four processes writing 15 entries each at once: the lock keeps every entry (a
    read-merge-replace without it loses some), and no lock file is left beside the size file."""
    import multiprocessing

    path = tmp_path / "sizes.json"
    context = multiprocessing.get_context("fork")
    start = context.Event()

    def write(worker: int) -> None:
        start.wait(30)
        sizes = SizeFile(str(path))
        for i in range(15):
            sizes.put(f"worker {worker} key {i}", 1 + i)

    workers = [context.Process(target=write, args=(w,)) for w in range(4)]
    for worker in workers:
        worker.start()
    start.set()
    for worker in workers:
        worker.join(60)
    assert [w.exitcode for w in workers] == [0, 0, 0, 0]
    sizes = SizeFile(str(path))
    missing = [(w, i) for w in range(4) for i in range(15)
               if sizes.get(f"worker {w} key {i}") != 1 + i]
    assert not missing
    assert os.listdir(tmp_path) == ["sizes.json"]
