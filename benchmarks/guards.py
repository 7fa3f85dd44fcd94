"""Guard overhead, reclaim, and import time: the cost of memguard when nothing is wrong."""

from __future__ import annotations

import statistics

from benchmarks.common import Result, run_python

STEP = """
import gc, torch
torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                            torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(256, 256), torch.randint(0, 10, (256,))

def step():
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
"""


def overhead(quick: bool) -> list[Result]:
    """Benchmark 1: a small MLP training step (about 5-20 ms on a CPU core) run bare, under
    ``@frees_memory`` (auto), under ``memory_scope()``, under the naive recipe
    (``gc.collect()`` and emptying the allocator caches after every step); with its loss
    under ``auto_microbatch`` (the whole batch fits: what the readiness costs) in a process of
    its own, in paired rounds (:func:`_microbatch`, benchmark 1e). The forward pass under
    ``inference_mode()`` is benchmark 1d (:func:`inference`), in a process of its own.

    Fair to the peers: the same step, same thread count, the variants measured in alternating
    rounds within one process, medians compared. The naive recipe is what it is: we report it,
    we do not tune it.
    """
    rounds, per_round = (5, 10) if quick else (15, 20)
    out = run_python(STEP + f"""
import json, ctypes
import memguard
from benchmarks.common import interleaved
libc = ctypes.CDLL(None)

auto = memguard.frees_memory(step)

def scoped():
    with memguard.memory_scope():
        step()

def naive():
    step()
    gc.collect()
    libc.malloc_trim(0)  # the host's empty_cache

for f in (step, auto, scoped, naive):
    f()
times = interleaved({{"bare": step, "auto": auto, "scope": scoped, "naive": naive}},
                    {rounds}, {per_round})
print(json.dumps(times))
""")
    bare = out["bare"]
    ms = 1000
    return [
        Result("1a frees_memory(auto) step", out["auto"] * ms, bare * ms, "ms", "bare step",
               "<= 1.05x", out["auto"] / bare <= 1.05),
        Result("1b memory_scope() step", out["scope"] * ms, bare * ms, "ms", "bare step",
               "report", None),
        Result("1c naive gc+trim step", out["naive"] * ms, bare * ms, "ms", "bare step",
               "report", None, "what the common recipe costs"),
        _microbatch(quick),
        _first_attempt(quick),
        _fragmented(rounds, per_round),
    ]


def _microbatch(quick: bool) -> Result:
    """Benchmark 1e: the step with its loss under ``auto_microbatch`` (the whole batch fits:
    what being ready for an out-of-memory costs) against the bare step, measured as 1d is:
    short rounds (5 steps) in adjacent pairs, which goes first alternating, the median of the
    pairs' ratios per process and the median of several processes. Not among 1a-1c's rounds:
    a variant that ran after the naive recipe's ``malloc_trim`` paid the page faults of the
    memory it had given back."""
    runs, pairs = (1, 60) if quick else (3, 150)
    ratios, peer_ms = _paired(STEP + """
import memguard

loss_of = memguard.auto_microbatch(model)(
    lambda batch: torch.nn.functional.cross_entropy(model(batch[0]), batch[1]))

def microbatched():
    loss_of((x, y))
    opt.step()
    opt.zero_grad()
""", "microbatched", "step", runs, pairs)
    ratio = statistics.median(ratios)
    return Result("1e auto_microbatch step (fits)", ratio * peer_ms, peer_ms, "ms",
                  "bare step", "<= 1.02x", ratio <= 1.02,
                  "whole batch, no out-of-memory: the cost of being ready for one; median of "
                  f"{runs} processes' medians of {pairs} paired ratios ("
                  + ", ".join(f"{r:.3f}" for r in ratios) + ")")


def _first_attempt(quick: bool) -> Result:
    """Benchmark 1e': what the whole-batch pass (``microbatch._Step.whole``, the call when
    the batch is planned whole and nothing is to be agreed) saves over the sizing loop's own
    first attempt, which every other call takes: the same step under two ``auto_microbatch``
    wrappers, one of them sent through the loop, paired as 1e is (loop against whole)."""
    runs, pairs = (1, 60) if quick else (5, 150)
    ratios, peer_ms = _paired(STEP + """
import memguard
from memguard import microbatch

whole_fits = microbatch._whole_fits


def never(*args):
    return False


def loss(batch):
    return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])


by_whole = memguard.auto_microbatch(model)(loss)
by_loop = memguard.auto_microbatch(model)(loss)


def whole_pass():
    microbatch._whole_fits = whole_fits
    by_whole((x, y))
    opt.step()
    opt.zero_grad()


def loop_attempt():
    microbatch._whole_fits = never
    by_loop((x, y))
    opt.step()
    opt.zero_grad()
""", "loop_attempt", "whole_pass", runs, pairs)
    ratio = statistics.median(ratios)
    return Result("1e' the loop's first attempt instead of the whole pass", ratio * peer_ms,
                  peer_ms, "ms", "1e's whole pass", "report", None,
                  f"median of {runs} processes' medians of {pairs} paired ratios ("
                  + ", ".join(f"{r:.3f}" for r in ratios) + ")")


PAIRED = """
import json, statistics, time

def timed(fn):
    start = time.perf_counter()
    for _ in range(5):
        fn()
    return time.perf_counter() - start

for f in ({bare}, {guarded}):
    f()
ratios, peer = [], []
for index in range({pairs}):
    if index % 2:
        bare = timed({bare})
        guarded = timed({guarded})
    else:
        guarded = timed({guarded})
        bare = timed({bare})
    ratios.append(guarded / bare)
    peer.append(bare / 5)
print(json.dumps({{"ratio": statistics.median(ratios), "peer": statistics.median(peer)}}))
"""


def _paired(setup: str, guarded: str, bare: str, runs: int, pairs: int
            ) -> tuple[list[float], float]:
    """``runs`` processes each timing ``pairs`` adjacent pairs of 5-call rounds of the
    functions ``setup`` names ``guarded`` and ``bare``, which goes first alternating: each
    process's median ratio (sorted), and the median of the bare call's time in ms."""
    code = setup + PAIRED.format(guarded=guarded, bare=bare, pairs=pairs)
    outs = [run_python(code) for _ in range(runs)]
    ratios = sorted(out["ratio"] for out in outs)
    return ratios, statistics.median(out["peer"] for out in outs) * 1000


FRAGMENT = "keep = [torch.ones(100 + i % 50) for i in range(20000)]\ndel keep[::2]\n"
"""10,000 free blocks between live ones: a long-running process's heap, on which glibc's
``mallinfo2`` (what malloc hands out) takes milliseconds."""


def _fragmented(rounds: int, per_round: int) -> Result:
    """Benchmark 1a on a fragmented heap (:data:`FRAGMENT`)."""
    out = run_python(STEP + FRAGMENT + f"""
import json
import memguard
from benchmarks.common import interleaved

auto = memguard.frees_memory(step)
for f in (step, auto):
    f()
print(json.dumps(interleaved({{"bare": step, "auto": auto}}, {rounds}, {per_round})))
""")
    return Result("1a frees_memory(auto) step (fragmented heap)", out["auto"] * 1000,
                  out["bare"] * 1000, "ms", "bare step", "<= 1.05x",
                  out["auto"] / out["bare"] <= 1.05,
                  "10,000 free blocks between live ones: mallinfo2 takes ~2 ms there")


def inference(quick: bool) -> list[Result]:
    """Benchmark 1d: a forward pass of benchmark 1's MLP (about 1-3 ms on a CPU core) under
    ``inference_mode(model)`` (cleanup ``"auto"``) against the same forward under
    ``torch.no_grad()``; the same on a fragmented heap, and on a served GPT-2 of 164 modules
    (:func:`_served`).

    Fair to the peer: one thread, short rounds (5 forwards) in adjacent pairs, which of the
    two goes first alternating; each process's figure is the median of its pairs' ratios, so
    that the machine's slow spells, longer than a pair, cancel out, and the figure is the
    median of several processes' (the notes give each). The peer does less (no eval mode, no
    cleanup); the figure is what a user sees replacing one line with the other.
    """
    rows = []
    for fragmented in (False, True):
        rows.append(_inference(quick, fragmented))
    rows.append(_served(quick))
    return rows


def _served(quick: bool) -> Result:
    """Benchmark 1d on a served model: a GPT-2 of 12 layers (164 modules; Hugging Face's model
    class overrides ``train``) put in eval mode once, a forward of one 32-token sequence under
    ``inference_mode(model)`` against the same under ``torch.no_grad()``, paired as 1d is.
    What a block costs grows with the modules it walks; this row is the many-module case
    that 1d's five-module MLP does not show."""
    runs, pairs = (1, 40) if quick else (3, 150)
    return _forwards("""
import torch, transformers
torch.manual_seed(0)
torch.set_num_threads(1)
transformers.logging.set_verbosity_error()
model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
    n_layer=12, n_embd=128, n_head=4, vocab_size=1000, bos_token_id=0, eos_token_id=0)).eval()
x = torch.randint(0, 1000, (1, 32))
""", "1d inference_mode forward, served GPT-2 (164 modules)", runs, pairs, "model in eval mode; ")


def _inference(quick: bool, fragmented: bool) -> Result:
    """One row of benchmark 1d; ``fragmented``: on a heap holding 10,000 free blocks between
    live ones (a long-running server's), where glibc's ``mallinfo2`` takes milliseconds."""
    runs, pairs = (1, 60) if quick else (3, 200)
    return _forwards(STEP + (FRAGMENT if fragmented else ""),
                     "1d inference_mode forward" + (" (fragmented heap)" if fragmented else ""),
                     runs, pairs)


def _forwards(setup: str, label: str, runs: int, pairs: int, note: str = "") -> Result:
    """A row of benchmark 1d: ``model(x)``, which ``setup`` defines, under
    ``inference_mode(model)`` against ``torch.no_grad()``, paired (:func:`_paired`)."""
    ratios, peer_ms = _paired(setup + """
import memguard

def forward_no_grad():
    with torch.no_grad():
        model(x)

def forward_memguard():
    with memguard.inference_mode(model):
        model(x)
""", "forward_memguard", "forward_no_grad", runs, pairs)
    ratio = statistics.median(ratios)
    return Result(label, ratio * peer_ms, peer_ms, "ms", "torch.no_grad forward", "<= 1.02x",
                  ratio <= 1.02, f"{note}median of {runs} processes' medians of {pairs} "
                  "paired ratios (" + ", ".join(f"{r:.3f}" for r in ratios) + ")")


SMALL_STEP = """
import statistics, time
import torch
torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(4096, 128), torch.randint(0, 10, (4096,))
wide = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                           torch.nn.ReLU(), torch.nn.Linear(256, 10))
pool = torch.randn(4096, 256)

def train(batch_size=64):
    loss = torch.nn.functional.cross_entropy(model(x[:batch_size]), y[:batch_size])
    loss.backward()
    opt.step()
    opt.zero_grad()

def rows_for(call, seconds=5e-4):  # the rows that make call(rows) take about `seconds`
    rows = 64
    for _ in range(3):
        for _ in range(20):
            call(rows)
        times = []
        for _ in range(9):
            start = time.perf_counter()
            for _ in range(10):
                call(rows)
            times.append((time.perf_counter() - start) / 10)
        rows = min(4096, max(8, round(rows * seconds / statistics.median(times))))
    return rows

BATCH = rows_for(train)
inputs = pool[:rows_for(lambda rows: wide(pool[:rows]))].clone()

def step():
    train(BATCH)

def forward_no_grad():
    with torch.no_grad():
        wide(inputs)

import memguard

decorated = memguard.memory_scope(train)

def scope_decorator():
    decorated(BATCH)

def scope_block():
    with memguard.memory_scope():
        train(BATCH)

freed = memguard.frees_memory(train)

def frees():
    freed(BATCH)

retried = memguard.oom_retry(train)

def retry():
    retried(BATCH)

def forward_memguard():
    with memguard.inference_mode(wide):
        wide(inputs)

import os, ctypes, resource
_statm = os.open("/proc/self/statm", os.O_RDONLY)
_clear_refs = os.open("/proc/self/clear_refs", os.O_WRONLY)
class _MallInfo2(ctypes.Structure):
    _fields_ = [(f"field{i}", ctypes.c_size_t) for i in range(10)]

_mallinfo2 = ctypes.PyDLL(None).mallinfo2
_mallinfo2.restype = _MallInfo2

def reads_alone():  # what a scope must read, as bare system calls: its floor
    resource.getrusage(resource.RUSAGE_SELF)
    os.write(_clear_refs, b"5")
    resource.getrusage(resource.RUSAGE_SELF)
    os.pread(_statm, 128, 0)  # the entry reading, which also checks the reset's getrusage
    _mallinfo2()
    train(BATCH)
    resource.getrusage(resource.RUSAGE_SELF)
    os.pread(_statm, 128, 0)
    _mallinfo2()

def frees_reads_alone():  # reading both ends of every call, as bare calls
    os.pread(_statm, 128, 0)
    _mallinfo2()
    train(BATCH)
    os.pread(_statm, 128, 0)
    _mallinfo2()
"""
"""Benchmark 1f's steps: a training step of a tiny MLP bare and under each guard, and a
forward pass of a wider one under ``torch.no_grad()`` and under ``inference_mode``, each on
as many rows as make it take 0.5 ms on one CPU thread of the machine it runs on
(``rows_for``: the machines here took 0.26-0.4 ms on the fixed 64 rows of before)."""

SCOPE_LEFT = ("left: the reads a scope cannot do without (row 'its reads alone') and its "
              "Python around them")
SMALL_ROWS = (
    ("1f memory_scope() decorator, 0.5 ms step", "scope_decorator", "step", "bare step",
     SCOPE_LEFT),
    ("1f memory_scope() with-block, 0.5 ms step", "scope_block", "step", "bare step",
     SCOPE_LEFT),
    ("1f frees_memory (auto), 0.5 ms step", "frees", "step", "bare step",
     ("left: a call's own work (its recursion guard, the time since the last reading) and "
      "its readings, due every few calls (CHECK_SHARE)")),
    ("1f oom_retry (nothing fails), 0.5 ms step", "retry", "step", "bare step",
     ("left: a call's own work (its size found, the attempt marked in the context, the size "
      "kept: 15-20 us next to a step there, with no loop made)")),
    ("1f inference_mode, 0.5 ms forward", "forward_memguard", "forward_no_grad",
     "torch.no_grad forward", ("left: what each block does besides no_grad's work: "
     "torch.inference_mode, and each module switched to eval and back (kept per module for "
     "overlapping blocks); its memory check runs on 0.1% of the blocks' time")),
)


def small_steps(quick: bool) -> list[Result]:
    """Benchmark 1f: what each guard costs a small step, where its fixed cost per call
    weighs most: a training step of 0.5 ms on one CPU thread (its rows calibrated to that
    on the machine), bare and under ``memory_scope()`` (as a decorator and as a ``with``
    block), ``frees_memory`` (cleanup ``"auto"``) and ``oom_retry`` (nothing runs out of
    memory); a forward of 0.5 ms under ``inference_mode`` against ``torch.no_grad()``; the
    reads a scope cannot do without, as bare calls around the same step (the floor of its
    cost); and ``frees_memory``'s readings taken at both ends of every call, as bare calls
    (what reading on a share of the time saves).

    Measured as 1d is (:func:`_paired`): each guard against the bare step in a process of
    its own, short rounds (5 calls) in adjacent pairs, which goes first alternating; the
    median of each process's median pair ratio over several processes. Fair to the bare
    step: the same function is called, with the same arguments; the guard's work is all
    that differs.
    """
    runs, pairs = (1, 60) if quick else (3, 200)
    rows = []
    for label, guarded, bare, peer, left in SMALL_ROWS:
        ratios, peer_ms = _paired(SMALL_STEP, guarded, bare, runs, pairs)
        ratio = statistics.median(ratios)
        met = ratio <= 1.05
        rows.append(Result(label, ratio * peer_ms, peer_ms, "ms", peer, "<= 1.05x", met,
                           f"median of {runs} processes' medians of {pairs} paired ratios ("
                           + ", ".join(f"{r:.3f}" for r in ratios) + ")"
                           + ("" if met else f"; {left}")))
    ratios, peer_ms = _paired(SMALL_STEP, "reads_alone", "step", runs, pairs)
    rows.append(Result("1f memory_scope()'s reads alone, 0.5 ms step",
                       statistics.median(ratios) * peer_ms, peer_ms, "ms", "bare step", "-",
                       None, "the floor of a scope's cost: the peak counter (getrusage's "
                       "ru_maxrss) before and after, its reset (a write to "
                       "/proc/self/clear_refs, and getrusage after it), "
                       "the resident set (/proc/self/statm) and mallinfo2 at both ends, as "
                       "bare system calls around the step; median of "
                       f"{runs} processes' medians of {pairs} paired ratios ("
                       + ", ".join(f"{r:.3f}" for r in ratios) + ")"))
    ratios, peer_ms = _paired(SMALL_STEP, "frees_reads_alone", "step", runs, pairs)
    rows.append(Result("1f both ends of every call read, 0.5 ms step",
                       statistics.median(ratios) * peer_ms, peer_ms, "ms", "bare step", "-",
                       None, "what frees_memory's readings would cost read at both ends of "
                       "every call (it reads on a share of the time instead): the resident "
                       "set (/proc/self/statm) and mallinfo2 before and after, as bare calls "
                       f"around the step; median of {runs} processes' medians of {pairs} "
                       "paired ratios (" + ", ".join(f"{r:.3f}" for r in ratios) + ")"))
    return rows


LEAK = STEP + """
import json, sys
import memguard
from memguard.backends import host

def leaky_step():
    step()
    record = {"x": torch.randn(1024, 1024)}  # 4 MiB caught in a cycle each step
    record["self"] = record

variant = sys.argv[1] if len(sys.argv) > 1 else "{variant}"
fn = {"bare": leaky_step, "auto": memguard.frees_memory(leaky_step),
      "naive": memguard.frees_memory(cleanup="always")(leaky_step)}[variant]
fn()
start = host.rss()
growth = []
for i in range({steps}):
    fn()
    growth.append(host.rss() - start)
print(json.dumps({"final": growth[-1], "max": max(growth)}))
"""


def reclaim(quick: bool) -> list[Result]:
    """Benchmark 2: the same step leaking 4 MiB into a reference cycle each call, with
    Python's collector left on as in a real program; resident memory growth after the steps.

    Fair to bare: the collector does run on its own schedule; the figure is what that schedule
    lets pile up. The naive variant is ``@frees_memory(cleanup="always")``.
    """
    steps = 30 if quick else 100
    grown = {v: run_python(LEAK.replace("{variant}", v).replace("{steps}", str(steps)))
             for v in ("bare", "auto", "naive")}
    mib = 2**20
    return [Result(f"2 reclaim after {steps} leaky steps", grown["auto"]["max"] / mib,
                   grown["bare"]["max"] / mib, "MiB peak growth", "bare",
                   "flat like naive; bare grows",
                   grown["auto"]["max"] <= grown["naive"]["max"] + 16 * mib
                   and grown["bare"]["max"] > 4 * grown["auto"]["max"],
                   f"naive {grown['naive']['max'] / mib:.1f} MiB")]


def import_time(quick: bool) -> list[Result]:
    """Benchmark 8: ``import memguard`` in a fresh interpreter, minus the interpreter's own
    start, median of several runs; and that it imports neither torch nor TensorFlow.

    Measured as installed code runs: with its bytecode cached (pip compiles it at install;
    ``PYTHONDONTWRITEBYTECODE`` is lifted for these runs and one warm-up run writes it).
    """
    runs = 7 if quick else 21
    code = """
import json, os, subprocess, sys, time
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
subprocess.run([sys.executable, "-c", "import memguard"], check=True)
def timed(arg):
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", arg], check=True)
    return time.perf_counter() - start
bare = [timed("pass") for _ in range({runs})]
full = [timed("import memguard") for _ in range({runs})]
heavy = subprocess.run([sys.executable, "-c", "import memguard, sys; print([m for m in "
                        "('torch', 'tensorflow') if m in sys.modules])"],
                       capture_output=True, text=True).stdout.strip()
print(json.dumps({{"bare": bare, "full": full, "heavy": heavy}}))
""".format(runs=runs)
    out = run_python(code)
    bare, full = statistics.median(out["bare"]), statistics.median(out["full"])
    cost = (full - bare) * 1000
    return [Result("8 import memguard", cost, None, "ms over the interpreter", "-",
                   "< 50 ms, no framework", cost < 50 and out["heavy"] == "[]",
                   f"frameworks imported: {out['heavy']}")]


BENCHMARKS = [overhead, inference, small_steps, reclaim, import_time]


MONITOR = """
import json, time, statistics
import memguard

def work():
    total = 0
    for i in range(200_000):
        total += i * i
    return total

def timed(n):
    start = time.perf_counter()
    for _ in range(n):
        work()
    return time.perf_counter() - start

def watched(n):
    with memguard.MemoryMonitor(interval=0.01) as mon:
        return timed(n), len(mon.samples)

work()
ratios = []
for index in range({pairs}):
    if index % 2:  # alternate which one runs first
        bare = timed({per_round})
        seconds_watched, count = watched({per_round})
    else:
        seconds_watched, count = watched({per_round})
        bare = timed({per_round})
    ratios.append(seconds_watched / bare)
long_round, count = watched(60)  # the sampling rate the loop leaves the monitor
print(json.dumps({{"ratio": statistics.median(ratios), "bare": bare,
                  "watched": seconds_watched, "rate": (count - 2) / long_round}}))
"""


def monitor(quick: bool) -> list[Result]:
    """Benchmark 7: a CPU-bound pure-Python loop (it needs the GIL all the time, the worst
    case for a sampling thread) with and without a MemoryMonitor sampling every 10 ms.

    Short rounds (about 40 ms) in adjacent pairs, which of the two goes first alternating;
    each process's figure is the median of its pairs' ratios, so that the machine's slow
    spells, which last longer than a pair, cancel out. A whole process can still sit a few
    percent off (0.98x to 1.03x here, in either direction), so several processes run and the
    figure is the median of theirs; the notes give each.
    """
    runs, pairs = (3, 30) if quick else (5, 80)
    outs = [run_python(MONITOR.format(pairs=pairs, per_round=3)) for _ in range(runs)]
    ratios = sorted(out["ratio"] for out in outs)
    ratio = statistics.median(ratios)
    rate = statistics.median(out["rate"] for out in outs)
    return [Result("7 MemoryMonitor at 10 ms", ratio, 1.0, "x the loop's time",
                   "no monitor", "< 1.02x", ratio < 1.02,
                   f"median of {runs} processes' medians of {pairs} paired ratios ("
                   + ", ".join(f"{r:.3f}" for r in ratios) + f"); {rate:.0f} samples a "
                   f"second over a 1 s round")]


BENCHMARKS.append(monitor)


if __name__ == "__main__":
    import argparse

    from benchmarks.run import table

    parser = argparse.ArgumentParser(description="Run some of the guard benchmarks: "
                                     "python -m benchmarks.guards inference")
    parser.add_argument("names", nargs="*", help="overhead, inference, small_steps, reclaim, "
                        "import_time, monitor (default: every one)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    chosen = [b for b in BENCHMARKS if not args.names or b.__name__ in args.names]
    results = [r for bench in chosen for r in bench(args.quick)]
    print(table(results))
    for r in results:
        if r.notes:
            print(f"  {r.name}: {r.notes}")
