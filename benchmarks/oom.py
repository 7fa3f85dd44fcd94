"""OOM recovery: memguard's oom_retry against Accelerate's find_executable_batch_size."""

from __future__ import annotations

import importlib.util
import os
import tempfile

from benchmarks.common import Result, run_python

WORKLOAD = """
import gc, json, resource, time
import torch, memguard
from memguard.backends import host
torch.set_num_threads(1)
UNIT = 2**20 // 4              # 1 MiB per sample, allocated twice per attempt: 2 MiB
PIECE = 16 * 1024 // 4         # growing: activations in pieces of 16 KiB per sample
START = {start}
CYCLE = {cycle}

def vm_size():
    return int(open("/proc/self/statm").read().split()[0]) * 4096

entries = []
kept = []

def plain(batch_size):
    first = torch.ones(batch_size * UNIT)
    if CYCLE:
        holder = [first]
        holder.append(holder)
        del first
    second = torch.ones(batch_size * UNIT)

def growing(batch_size):
    for step in range(6):
        pieces = 32 if step < 4 else 64  # sequences double at step 4: 1, then 2 MiB a sample
        activations = [torch.ones(batch_size * PIECE) for _ in range(pieces)]
        output = torch.ones(batch_size * UNIT // 2 * (pieces // 32))
        kept.append(torch.ones(16384))  # a step's logged figures, above its activations
        del activations, output

def attempt(batch_size):
    entries.append((batch_size, host.rss()))
    {body}(batch_size)
    return batch_size

def fits(size):
    try:
        attempt(size)
        return True
    except RuntimeError:
        return False

attempt(1)
memguard.free_memory()
baseline = host.rss()
resource.setrlimit(resource.RLIMIT_AS, (vm_size() + 700 * 2**20, resource.RLIM_INFINITY))
{runner}
start = time.perf_counter()
found = run()
seconds = time.perf_counter() - start
attempts = len(entries) - 1
held = max(rss - baseline for _, rss in entries[1:])
entries.clear()
gc.collect()  # the cycle variant's successful attempt left garbage: not the cache's business
run()
second_attempts = len(entries)
entries.clear()
memguard.free_memory()
memguard.free_memory()
low, high = found, START  # found fits, the start did not: bisect for the largest that fits
while high - low > 1:
    middle = (low + high) // 2
    if fits(middle):
        low = middle
    else:
        high = middle
    memguard.free_memory()
largest = low
print(json.dumps({{"found": found, "seconds": seconds, "attempts": attempts, "held": held,
                  "second": second_attempts, "largest": largest}}))
"""

MEMGUARD = """
run = memguard.oom_retry(batch_size=START, factor={factor!r})(attempt)
"""

ACCELERATE = """
from accelerate.utils import find_executable_batch_size

@find_executable_batch_size(starting_batch_size=START)
def run(batch_size):
    return attempt(batch_size)
"""

RESTARTED = """
import os
run = memguard.oom_retry(batch_size=START, factor="auto",
                         cache=os.environ["MEMGUARD_BENCH_SIZES"])(attempt)
"""

ENV = {"MALLOC_ARENA_MAX": "1", "OMP_NUM_THREADS": "1"}
VARIANTS = (("plain", False, "plain", 512), ("cycle", True, "plain", 512),
            ("growing", False, "growing", 1024))
"""Benchmark 3's scenarios: label, the first tensor in a cycle, the attempt's body, start."""


def _runner(runner: str, cycle: bool, sizes: str = "", body: str = "plain",
            start: int = 512) -> dict:
    return run_python(WORKLOAD.format(cycle=cycle, runner=runner, body=body, start=start),
                      env=dict(ENV, MEMGUARD_BENCH_SIZES=sizes))


def recovery(quick: bool) -> list[Result]:
    """Benchmark 3: the same memory-budgeted workload (2 MiB per sample, 1 MiB allocated
    twice, a 700 MiB address-space budget, start at 512: the issue's plain scenario) under
    ``oom_retry`` halving (``factor=0.5``), ``oom_retry(factor="auto")`` (the next size from
    what the failed attempt measured) and Accelerate's ``find_executable_batch_size`` (its
    default: x0.9), each in a fresh process.

    Reported per policy: attempts until success, seconds until success, size found / largest
    feasible size (bisected afterwards between the size found and the start), the most
    memory still held when a retry started, and the attempts of a second call (after a
    ``gc.collect()``, since the cycle variant's successful attempt leaves its own garbage
    behind). Run three times: plain; with the attempt's first tensor in a reference cycle,
    which only a collection outside ``except`` frees in time; and growing, memory that grows
    in the middle of a run (six steps whose sequences double at step 4: 1, then 2 MiB a
    sample, in activations of 16 KiB-per-sample pieces that malloc keeps in its heap, below a
    small tensor each step keeps; start at 1024, so the start fails in a short step and the
    measured guess in a long one, after the short steps left their freed activations mapped).
    Last, a restarted process:
    ``factor="auto", cache=path`` run in one process, then in a second one with the same
    file, whose first call must take one attempt.
    Fair to the peer: the same process set-up and budget; each tool at its own defaults.
    """
    have_peer = importlib.util.find_spec("accelerate") is not None
    rows = []
    mib = 2**20
    for label, cycle, body, start in VARIANTS:
        halving = _runner(MEMGUARD.format(factor=0.5), cycle, body=body, start=start)
        auto = _runner(MEMGUARD.format(factor="auto"), cycle, body=body, start=start)
        peer = _runner(ACCELERATE, cycle, body=body, start=start) if have_peer else None
        runs = [("halving", halving), ("auto", auto)] + ([("accelerate x0.9", peer)]
                                                        if peer else [])
        note = "; ".join(f"{name} {r['found']}/{r['largest']} in {r['attempts']} "
                         f"attempts, {r['seconds']:.2f} s, held {r['held'] / mib:.0f} MiB at "
                         f"a retry, second call {r['second']} attempt(s)" for name, r in runs)
        rows.append(Result(f"3 oom recovery ({label}): halving attempts",
                           halving["attempts"],
                           peer["attempts"] if peer else None, "attempts",
                           "accelerate" if peer else "accelerate (not installed)",
                           "<= peer; nothing held; 2nd call 1 attempt",
                           (peer is None or halving["attempts"] <= peer["attempts"])
                           and halving["held"] < 20 * mib and halving["second"] == 1, note))
        for name, r in runs:
            rows.append(Result(f"3 oom recovery ({label}): {name} size / largest",
                               r["found"] / r["largest"],
                               peer["found"] / peer["largest"] if peer else None, "fraction",
                               "accelerate", ">= 0.85 in <= 3 attempts" if name == "auto"
                               else "report",
                               (r["found"] >= 0.85 * r["largest"] and r["attempts"] <= 3
                                and r["held"] < 20 * mib and r["second"] == 1)
                               if name == "auto" else None,
                               f"{r['attempts']} attempts, {r['seconds']:.3f} s"))
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "sizes.json")
        first = _runner(RESTARTED, False, path)
        restarted = _runner(RESTARTED, False, path)
    rows.append(Result("3 oom recovery: restarted process, cache=path", restarted["attempts"],
                       first["attempts"], "attempts", "the first process",
                       "1 attempt", restarted["attempts"] == 1
                       and restarted["found"] == first["found"],
                       f"first process {first['found']} in {first['attempts']} attempts, "
                       f"restarted {restarted['found']} in {restarted['attempts']}"))
    return rows


BENCHMARKS = [recovery]
