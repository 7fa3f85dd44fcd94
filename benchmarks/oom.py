"""OOM recovery: memguard's oom_retry against Accelerate's find_executable_batch_size."""

from __future__ import annotations

import importlib.util

from benchmarks.common import Result, run_python

WORKLOAD = """
import gc, json, resource, time
import torch, memguard
from memguard.backends import host
torch.set_num_threads(1)
UNIT = 5 * 2**20 // 4          # 5 MiB per sample, allocated twice per attempt
CYCLE = {cycle}

def vm_size():
    return int(open("/proc/self/statm").read().split()[0]) * 4096

entries = []

def attempt(batch_size):
    entries.append((batch_size, host.rss()))
    first = torch.ones(batch_size * UNIT)
    if CYCLE:
        holder = [first]
        holder.append(holder)
        del first
    second = torch.ones(batch_size * UNIT)
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
resource.setrlimit(resource.RLIMIT_AS, (vm_size() + 650 * 2**20, resource.RLIM_INFINITY))
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
low, high = found, 100  # found fits, the start did not: bisect for the largest that fits
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
run = memguard.oom_retry(batch_size=100)(attempt)
"""

ACCELERATE = """
from accelerate.utils import find_executable_batch_size

@find_executable_batch_size(starting_batch_size=100)
def run(batch_size):
    return attempt(batch_size)
"""

ENV = {"MALLOC_ARENA_MAX": "1", "OMP_NUM_THREADS": "1"}


def recovery(quick: bool) -> list[Result]:
    """Benchmark 3: the same memory-budgeted workload (5 MiB per sample allocated twice, a
    650 MiB address-space budget, start at 100) under ``oom_retry`` (halving) and under
    Accelerate's ``find_executable_batch_size`` (its default: x0.9), in fresh processes.

    Reported: attempts until success, seconds until success, size found / largest feasible
    size (bisected afterwards between the size found and the start), the most memory still
    held when a retry started, and the attempts of a second call (after a ``gc.collect()``,
    since the cycle variant's successful attempt leaves its own garbage behind). Run twice:
    plain, and with the attempt's first tensor in a reference cycle, which only a
    collection outside ``except`` frees in time.
    Fair to the peer: the same process set-up and budget; each tool at its own defaults.
    """
    have_peer = importlib.util.find_spec("accelerate") is not None
    rows = []
    mib = 2**20
    for cycle in (False, True):
        label = "cycle" if cycle else "plain"
        mine = run_python(WORKLOAD.format(cycle=cycle, runner=MEMGUARD), env=ENV)
        peer = (run_python(WORKLOAD.format(cycle=cycle, runner=ACCELERATE), env=ENV)
                if have_peer else None)
        note = (f"memguard {mine['found']}/{mine['largest']} in {mine['seconds']:.2f} s, "
                f"held {mine['held'] / mib:.0f} MiB at a retry, second call "
                f"{mine['second']} attempt(s)")
        if peer:
            note += (f"; accelerate {peer['found']}/{peer['largest']} in "
                     f"{peer['seconds']:.2f} s, held {peer['held'] / mib:.0f} MiB, second "
                     f"call {peer['second']}")
        rows.append(Result(f"3 oom recovery ({label}): attempts", mine["attempts"],
                           peer["attempts"] if peer else None, "attempts",
                           "accelerate" if peer else "accelerate (not installed)",
                           "<= peer; nothing held; 2nd call 1 attempt",
                           (peer is None or mine["attempts"] <= peer["attempts"])
                           and mine["held"] < 20 * mib and mine["second"] == 1, note))
        rows.append(Result(f"3 oom recovery ({label}): size found / largest",
                           mine["found"] / mine["largest"],
                           peer["found"] / peer["largest"] if peer else None, "fraction",
                           "accelerate", "report", None))
    return rows


BENCHMARKS = [recovery]
