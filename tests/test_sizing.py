"""Sizes that are measured instead of guessed, attempts that start from the same state, and
sizes remembered across restarts (oom_retry(factor=..., restore=..., cache=path),
find_batch_size(mode="predict", cache=path)), and the budgets they measure against.

Out-of-memory errors are real: ``torch.empty`` of more than the machine has fails in the CPU
allocator at once, and the budgeted ones run in subprocesses with a soft RLIMIT_AS.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import memguard
from memguard.backends.host import cgroup_memory_budget
from memguard.backends.steps import torch_state
from memguard.errors import requested_bytes
from memguard.sizefile import SizeFile
from memguard.sizes import size_after_oom

from budget import ENV, script

HUGE = 1 << 42
MiB = 1 << 20


def real_oom() -> None:
    torch.empty(HUGE)


# -- predictive search under a real budget -----------------------------------------------------

SEARCH = """
import torch, memguard
torch.set_num_threads(1)
UNIT = 200 * 1024 // 4  # 200 KiB, allocated twice per sample
calls = []

def step(batch_size):
    calls.append(batch_size)
    first = torch.ones(batch_size * UNIT)
    second = torch.ones(batch_size * UNIT)

step(1)
memguard.free_memory()
set_budget(300)
"""


@pytest.mark.slow
def test_predict_finds_nine_tenths_of_binsearch_in_at_most_eight_trials(python_in_subprocess):
    out = python_in_subprocess(script(SEARCH, """
        results = {}
        for mode in ("binsearch", "predict"):
            calls.clear()
            memguard.free_memory()
            found = memguard.find_batch_size(step, start=1, mode=mode, margin=0.0)
            results[mode] = {"found": found, "calls": list(calls)}
        print(json.dumps(results))
    """), env=ENV, timeout=300)
    binsearch, predict = out["binsearch"], out["predict"]
    trials = sorted(set(predict["calls"]), key=predict["calls"].index)
    assert len(binsearch["calls"]) >= 15, binsearch  # bisection's cost from start=1
    assert len(trials) <= 8, predict
    assert predict["found"] >= 0.9 * binsearch["found"], out
    assert predict["found"] <= binsearch["found"] + 2  # it returns a size seen to fit
    assert predict["found"] in predict["calls"]


FIXED_PART = """
import torch, memguard
torch.set_num_threads(1)
MiB = 2**20 // 4  # float32 elements
calls = []

def step(batch_size):  # 100 MiB whatever the size (weights, gradients) + 1 MiB a sample
    calls.append(batch_size)
    fixed = torch.ones(100 * MiB)
    per_sample = torch.ones(batch_size * MiB)

step(1)
memguard.free_memory()
set_budget(400)
"""


@pytest.mark.slow
def test_predict_sets_a_large_fixed_part_apart_and_does_not_crawl(python_in_subprocess):
    out = python_in_subprocess(script(FIXED_PART, """
        results = {}
        for mode in ("binsearch", "predict"):
            calls.clear()
            memguard.free_memory()
            found = memguard.find_batch_size(step, start=1, mode=mode, margin=0.0)
            results[mode] = {"found": found, "calls": list(calls)}
        print(json.dumps(results))
    """), env=ENV, timeout=300)
    binsearch, predict = out["binsearch"], out["predict"]
    trials = sorted(set(predict["calls"]), key=predict["calls"].index)
    assert binsearch["found"] > 200, binsearch  # ~300 MiB of the budget are per sample
    assert predict["found"] >= 0.9 * binsearch["found"], out
    assert len(trials) <= 10, predict
    assert predict["found"] in predict["calls"]


@pytest.mark.slow
def test_predict_returns_a_size_that_was_seen_to_fit_and_respects_max_batch_size():
    sizes = []

    def step(batch_size):
        sizes.append(batch_size)
        block = torch.ones(batch_size * 64 * 1024)  # 256 KiB per sample
        if batch_size > limit[0]:
            real_oom()
        del block

    limit = [5000]
    found = memguard.find_batch_size(step, margin=0.0, start=4, mode="predict", max_batch_size=900)
    assert found == 900 and found in sizes and len(set(sizes)) <= 5
    sizes.clear()
    limit[0] = 700  # now the cap does not fit: the answer is a size seen to fit below it
    found = memguard.find_batch_size(step, margin=0.0, start=4, mode="predict", max_batch_size=900)
    failed = [a.size for a in found.history if not a.ok]
    assert failed and min(failed) > 700, found.history
    assert found <= 700 and found in sizes and found == max(a.size for a in found.history if a.ok)
    with pytest.raises(ValueError, match="'binsearch', 'power' or 'predict', got 'guess'"):
        memguard.find_batch_size(step, margin=0.0, mode="guess")


# -- factor="auto" and a callable factor --------------------------------------------------------

PLAIN = """
import torch, memguard
torch.set_num_threads(1)
UNIT = 2**20 // 4  # 1 MiB, allocated twice: 2 MiB per sample
calls = []

def attempt(batch_size):
    calls.append(batch_size)
    first = torch.ones(batch_size * UNIT)
    second = torch.ones(batch_size * UNIT)
    return batch_size

attempt(1)
memguard.free_memory()
set_budget(700)
"""


@pytest.mark.slow
def test_auto_factor_reaches_most_of_the_largest_size_in_three_attempts(python_in_subprocess):
    out = python_in_subprocess(script(PLAIN, """
        results = {}
        for factor in (0.5, "auto"):
            calls.clear()
            fn = memguard.oom_retry(batch_size=512, factor=factor)(attempt)
            results[str(factor)] = {"found": fn(), "attempts": len(fn.history)}
        low, high = results["auto"]["found"], 512
        while high - low > 1:
            middle = (low + high) // 2
            memguard.free_memory()
            try:
                attempt(middle)
                low = middle
            except RuntimeError:
                high = middle
        results["largest"] = low
        print(json.dumps(results))
    """), env=ENV, timeout=300)
    largest = out["largest"]
    assert out["auto"]["attempts"] <= 3
    assert out["auto"]["found"] >= 0.85 * largest, out
    assert out["0.5"]["found"] <= 0.8 * largest  # halving's 256: what auto improves on


def test_auto_factor_halves_when_the_error_states_no_size():
    calls = []

    @memguard.oom_retry(batch_size=64, factor="auto")
    def step(batch_size):
        calls.append(batch_size)
        if batch_size > 10:
            raise MemoryError()  # no size stated: nothing to measure
        return batch_size

    assert step() == 8 and calls == [64, 32, 16, 8]


def test_auto_factor_stays_between_a_quarter_and_nine_tenths():
    assert size_after_oom(512, need=1024 * MiB, available=700 * MiB) == 332
    assert size_after_oom(100, need=1 * MiB, available=700 * MiB) == 90
    assert size_after_oom(100, need=10_000 * MiB, available=700 * MiB) == 25
    assert size_after_oom(100, need=None, available=700 * MiB) is None


def test_a_callable_factor_chooses_the_next_size_and_is_checked():
    calls = []

    @memguard.oom_retry(batch_size=100, factor=lambda size: size - 30)
    def step(batch_size):
        calls.append(batch_size)
        if batch_size > 50:
            real_oom()
        return batch_size

    assert step() == 40 and calls == [100, 70, 40]

    def stubborn(size):
        return size

    @memguard.oom_retry(batch_size=64, factor=stubborn)
    def never(batch_size):
        real_oom()

    with pytest.raises(ValueError, match=r"factor .*stubborn\(64\) returned 64; it must return "
                                         r"a positive int smaller than 64"):
        never()
    with pytest.raises(ValueError, match="'auto' or a callable"):
        memguard.oom_retry(factor="fast")


def test_requested_bytes_are_read_from_real_messages():
    with pytest.raises(RuntimeError) as torch_oom:
        real_oom()
    assert requested_bytes(torch_oom.value) == HUGE * 4
    with pytest.raises(MemoryError) as numpy_oom:
        np.empty(1 << 50)
    assert requested_bytes(numpy_oom.value) == 8 << 50
    text = "OOM when allocating tensor with shape[1024,256] and type float on /job:localhost"
    assert requested_bytes(RuntimeError(text)) == 1024 * 256 * 4
    assert requested_bytes(RuntimeError("CUDA out of memory. Tried to allocate 2.50 GiB")) \
        == int(2.5 * (1 << 30))
    assert requested_bytes(ValueError("nothing")) is None


# -- the budget in force, in snapshots and messages ---------------------------------------------

@pytest.mark.slow
def test_oom_message_names_the_memory_limit_and_what_of_it_was_used(python_in_subprocess):
    out = python_in_subprocess(script("""
        import torch, memguard
        UNIT = 80 * 2**20 // 4
        @memguard.oom_retry(batch_size=4)
        def attempt(batch_size):
            return torch.ones(batch_size * UNIT).sum()
        torch.ones(8).sum()
        with memguard.memory_limit("60MiB", device="host"):
            try:
                attempt()
            except memguard.OutOfMemoryError as err:
                message = str(err)
        print(json.dumps({"message": message}))
    """), env=ENV, timeout=120)
    message = out["message"]
    assert "of the 60.0 MiB memory_limit (address space" in message, message
    assert "host -" not in message, message  # what a limit has used is never negative
    assert "23.5 GiB" not in message and "GiB" not in message.split("tried:")[1]


def test_cgroup_v2_memory_max_is_read_up_the_tree(tmp_path):
    (tmp_path / "cgroup").write_text("0::/job/worker\n")
    for folder, limit, current in (("job", "1073741824", "900000000"),
                                   ("job/worker", "max", "800000000")):
        os.makedirs(tmp_path / folder, exist_ok=True)
        (tmp_path / folder / "memory.max").write_text(limit + "\n")
        (tmp_path / folder / "memory.current").write_text(current + "\n")
    assert cgroup_memory_budget(str(tmp_path), str(tmp_path / "cgroup")) == (1 << 30, 900000000)
    (tmp_path / "cgroup").write_text("4:memory:/job\n")  # cgroup v1 only
    assert cgroup_memory_budget(str(tmp_path), str(tmp_path / "cgroup")) is None


# -- restore: every attempt starts from the same state ------------------------------------------

def _training(restore: bool):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    generator = torch.Generator().manual_seed(1)
    data = torch.randn(128, 8, generator=generator)
    target = torch.randn(128, 1, generator=generator)

    def train(batch_size):
        for start in range(0, 128, batch_size):
            loss = torch.nn.functional.mse_loss(model(data[start:start + batch_size]),
                                                target[start:start + batch_size])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if start >= batch_size and batch_size > 16:
                real_oom()  # two optimizer steps in, as a long attempt would be
        scheduler.step()
        return batch_size

    return model, optimizer, scheduler, train


def test_restore_makes_a_retried_call_equal_one_that_fitted_at_once():
    model, optimizer, scheduler, train = _training(True)
    retried = memguard.oom_retry(batch_size=64, factor=0.25,
                                 restore=(model, optimizer, scheduler))(train)
    assert retried() == 16 and [a.size for a in retried.history] == [64, 16]

    fresh, fresh_optimizer, fresh_scheduler, fresh_train = _training(True)
    fresh_train(16)
    for mine, theirs in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(mine, theirs)
    assert optimizer.state_dict()["state"][0]["step"] == fresh_optimizer.state_dict()[
        "state"][0]["step"]
    assert scheduler.get_last_lr() == fresh_scheduler.get_last_lr()

    plain, _, _, plain_train = _training(False)  # control: without restore they differ
    memguard.oom_retry(batch_size=64, factor=0.25)(plain_train)()
    assert not all(torch.equal(a, b)
                   for a, b in zip(plain.parameters(), fresh.parameters(), strict=True))


def test_restore_keeps_gradients_and_spills_large_state_to_a_file():
    model = torch.nn.Linear(256, 256)
    model(torch.ones(2, 256)).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    weights = [p.detach().clone() for p in model.parameters()]
    saved = torch_state.copy_states((model,), free_host=1024)  # "no room": a file
    assert saved.path is not None and os.path.getsize(saved.path) > 256 * 256 * 4
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
            p.grad = None
    saved.load()
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    path = saved.path
    saved.discard()
    assert not os.path.exists(path)


def test_restore_refuses_an_object_without_state_dict():
    with pytest.raises(TypeError, match=r"restore\[1\] is a list without a state_dict\(\)"):
        memguard.oom_retry(restore=(torch.nn.Linear(1, 1), [1, 2]))


# -- sizes that survive a restart -----------------------------------------------------------------

RESTART = """
import json, sys, torch, memguard

@memguard.oom_retry(batch_size=256, cache=sys.argv[1])
def train(batch_size):
    if batch_size > 40:
        torch.empty(1 << 42)
    return batch_size

print(json.dumps({"size": train(), "attempts": [a.size for a in train.history]}))
"""


def _run(code: str, *args: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_restarted_process_starts_at_the_size_that_worked(tmp_path):
    path = str(tmp_path / "sizes.json")
    first = _run(RESTART, path)
    second = _run(RESTART, path)
    assert first == {"size": 32, "attempts": [256, 128, 64, 32]}
    assert second == {"size": 32, "attempts": [32]}  # one attempt
    with open(path) as f:
        (key, size), = json.load(f)["sizes"].items()
    assert size == 32 and key.startswith("oom_retry __main__.train at <string>:4 code=")
    assert "start=256 factor=0.5 on host" in key


def test_several_processes_share_one_size_file(tmp_path):
    path = str(tmp_path / "shared.json")
    code = textwrap.dedent("""
        import sys
        from memguard.sizefile import SizeFile
        sizes = SizeFile(sys.argv[1])
        for i in range(25):
            sizes.put(f"rank{sys.argv[2]} key{i}", i + 1)
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code, path, str(rank)])
             for rank in range(4)]
    assert all(p.wait(timeout=120) == 0 for p in procs)
    with open(path) as f:
        sizes = json.load(f)["sizes"]
    assert len(sizes) == 100 and sizes["rank3 key24"] == 25
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".memguard-sizes-")]


def test_a_corrupt_size_file_is_a_warning_and_is_left_as_it_is(tmp_path):
    path = tmp_path / "sizes.json"
    path.write_text("{not json")
    calls = []

    @memguard.oom_retry(batch_size=64, cache=path)
    def train(batch_size):
        calls.append(batch_size)
        if batch_size > 20:
            real_oom()
        return batch_size

    with pytest.warns(RuntimeWarning, match=r"sizes\.json' is not a memguard size file"):
        assert train() == 16
    assert path.read_text() == "{not json"
    with pytest.raises(TypeError, match="cache must be True, False or a file path"):
        memguard.oom_retry(cache=3)


def test_a_rewritten_size_file_keeps_its_mode_and_a_new_one_is_readable_by_all(tmp_path):
    shared = tmp_path / "shared.json"
    SizeFile(shared).put("a", 1)
    os.chmod(shared, 0o644)
    SizeFile(shared).put("b", 2)  # replaced by a temporary file: mkstemp makes those 0600
    assert os.stat(shared).st_mode & 0o777 == 0o644
    os.chmod(shared, 0o664)
    SizeFile(shared).put("c", 3)
    assert os.stat(shared).st_mode & 0o777 == 0o664
    fresh = tmp_path / "fresh.json"
    SizeFile(fresh).put("a", 1)
    assert os.stat(fresh).st_mode & 0o777 == 0o644
    assert SizeFile(shared).get("b") == 2 and not list(tmp_path.glob(".memguard-sizes-*"))


def test_the_size_file_lock_closes_its_descriptor_when_flock_fails(tmp_path, monkeypatch):
    fcntl = pytest.importorskip("fcntl")
    from memguard import sizefile as sizes

    opened = []
    real_open = os.open

    def recording_open(*args, **kwargs):
        opened.append(real_open(*args, **kwargs))
        return opened[-1]

    def failing_flock(fd, operation):
        raise OSError(37, "No locks available")

    monkeypatch.setattr(os, "open", recording_open)
    monkeypatch.setattr(fcntl, "flock", failing_flock)
    with pytest.raises(OSError, match="No locks available"):
        with sizes._FileLock(str(tmp_path)):
            pass
    assert len(opened) == 1
    with pytest.raises(OSError, match="Bad file descriptor"):
        os.fstat(opened[0])  # closed


def test_find_batch_size_remembers_its_size_in_a_file(tmp_path):
    path = tmp_path / "found.json"
    trials = []

    def step(batch_size):
        trials.append(batch_size)
        if batch_size > 300:
            real_oom()

    assert memguard.find_batch_size(step, margin=0.0, start=16, cache=path) == 300
    searched = len(trials)
    trials.clear()
    assert memguard.find_batch_size(step, start=16, cache=path, margin=0.1) == 270
    assert searched > 5 and trials == []  # no trial at all


def test_find_batch_size_calls_the_step_steps_per_trial_times_at_each_size():
    calls = []

    def step(batch_size):
        calls.append(batch_size)
        if batch_size > 8 and calls.count(batch_size) > 1:  # the peak comes at the 2nd step
            raise MemoryError("out of memory in the second step")

    found = memguard.find_batch_size(step, margin=0.0, start=2, steps_per_trial=2, mode="power")
    assert found == 8 and calls[:6] == [2, 2, 4, 4, 8, 8]
    assert all(attempt.steps is None for attempt in found.history)  # Attempt.steps: slices
    with pytest.raises(TypeError, match="steps"):
        memguard.find_batch_size(step, steps=2)  # one name: steps_per_trial


# -- CUDA ----------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_cuda_budget_counts_reserved_but_unused_memory_and_predict_finds_a_size():
    from memguard.backends.budget import budget

    torch.cuda.init()
    block = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    free_before = budget("cuda:0").available
    del block  # back to the caching allocator: reserved, not in use
    after = budget("cuda:0")
    assert after.kind == "CUDA device" and abs(after.available - free_before - 256 * MiB) < 8 * MiB
    with memguard.memory_limit("2GiB", device="cuda:0"):
        assert budget("cuda:0").kind == "CUDA memory fraction"

        def step(batch_size):
            torch.empty(batch_size * 4 * MiB, dtype=torch.uint8, device="cuda").sum()

        predicted = memguard.find_batch_size(step, margin=0.0, start=1, mode="predict")
        searched = memguard.find_batch_size(step, margin=0.0, start=1)
    assert predicted >= 0.9 * searched
