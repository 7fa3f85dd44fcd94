"""Census cost: live_tensors() and holder paths, as ratios to one bare gc.get_objects()."""

from __future__ import annotations

from benchmarks.common import Result, run_python

CENSUS = """
import gc, json, statistics, time, weakref
import torch, memguard
from memguard.census import live_tensors

OBJECTS = [[i] for i in range({objects})]          # tracked Python objects
TENSORS = [torch.ones(4) for _ in range({tensors})]
VIEWS = [TENSORS[i][:2] for i in range({views})]   # views: storages counted once
LEAKED = {{"step%d" % i: [torch.ones(1000 + i)] for i in range(10)}}   # ten held tensors
MODEL = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
LOSSES = [MODEL(torch.randn(32, 64)).mean() for _ in range({graphs})]  # losses kept with graphs

def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start

from memguard.census import _live_objects
from memguard.backends.torch import tensor_types

def reads():  # what a census cannot do without: each tensor's fields, read, nothing kept
    ref, classes = weakref.ref, tensor_types()
    collecting = gc.isenabled()
    gc.disable()  # as the census
    try:
        for t in _live_objects(classes):
            s = t.untyped_storage()
            s.data_ptr(), s.nbytes(), t.device, t.dtype, t.shape, t._is_view(), ref(t)
    finally:
        if collecting:
            gc.enable()

bare, census, floor = [], [], []
for _ in range(7):  # alternating, so that a slow spell of the machine hits both
    bare.append(timed(gc.get_objects))
    census.append(timed(live_tensors))
    floor.append(timed(reads))
bare, census, floor = (statistics.median(bare), statistics.median(census),
                       statistics.median(floor))
top = live_tensors(min_bytes=4000)[:10]
start = time.perf_counter()
words = [info.held_by for info in top]
holders = time.perf_counter() - start
infos = live_tensors()
print(json.dumps({{"bare": bare, "census": census, "floor": floor, "holders": holders,
                  "found": sum(1 for w in words if w != "holder not found"),
                  "graph": sum(1 for w in words if w.startswith("saved by the graph")),
                  "saved": sum(1 for i in infos if i.saved_by), "tensors": len(infos)}}))
"""


def census(quick: bool) -> list[Result]:
    """Benchmark 6: ``live_tensors()``, autograd graph tracing included, in a process holding
    1,000,000 tracked Python objects, 10,000 tensors and 20 losses kept with their graphs (the
    loss-in-a-list leak: 100 saved activations no Python object refers to), against one bare
    ``gc.get_objects()`` pass over the same process (medians of 7 alternating rounds); and the
    time to say what keeps each of the 10 largest tensors (``held_by``: holder paths, and for
    saved activations the graph's root and its holder), all in one walk.

    Fair: the bare pass is the floor any census that scans the collector pays; both run in
    the same process, one after the other.
    """
    objects, tensors, graphs = (300_000, 3_000, 20) if quick else (1_000_000, 10_000, 20)
    out = run_python(CENSUS.format(objects=objects, tensors=tensors, graphs=graphs, views=0))
    ms = 1000
    return [
        Result(f"6a census ({objects:,} objects, {tensors:,} tensors)", out["census"] * ms,
               out["bare"] * ms, "ms", "bare gc.get_objects()", "<= 2x",
               out["census"] <= 2 * out["bare"],
               f"{out['tensors']} tensors found, {out['saved']} saved by {graphs} graphs"),
        Result("6b holders of the top 10 tensors", out["holders"], None, "s", "-", "< 1 s",
               out["holders"] < 1 and out["found"] == 10,
               f"{out['found']} of 10 holders found, {out['graph']} through a graph"),
    ]


HOLDERS = """
import collections, gc, json, time
import torch, memguard
from memguard.census import live_tensors
from memguard.holders import find_holders

TENSORS = [torch.ones(4) for _ in range({tensors})]   # the many small ones
BIG = [torch.ones(1000 + i) for i in range(10)]                    # module global list
class Trainer:
    def __init__(self):
        self.state = {{"step%d" % i: torch.ones(2000 + i) for i in range(10)}}
TRAINER = Trainer()                                                 # instance, dict inside
MODEL = torch.nn.Sequential(*[torch.nn.Linear(1000 + i, 1000) for i in range(5)])  # 10 params
QUEUE = collections.deque(torch.ones(5000 + i) for i in range(10))  # a deque
def batches():
    kept = [torch.ones(6000 + i) for i in range(10)]
    yield 1
    yield 2
SUSPENDED = batches()
next(SUSPENDED)                                                     # a suspended generator

infos = live_tensors()
top = infos[:50]
start = time.perf_counter()
words = [info.held_by for info in top]                              # memguard: shared walks
memguard_s = time.perf_counter() - start
tensors = [info._ref() for info in top]
start = time.perf_counter()
for tensor in tensors:
    find_holders(tensor)                                            # one walk per tensor
per_tensor_s = time.perf_counter() - start
print(json.dumps({{"memguard": memguard_s, "per_tensor": per_tensor_s, "tensors": len(infos),
                  "found": sum(1 for w in words if w != "holder not found")}}))
"""


def holders(quick: bool) -> list[Result]:
    """Benchmark 6c: what keeps each of the 50 largest of 100,000 tensors (``held_by``, one
    after the other, as a report asks), the 50 held in five ways (a module's list, a dict in
    an instance, a model's parameters, a deque, a suspended generator's local), against one
    walk per tensor (``find_holders`` for each, the way of a walk per ``gc.get_referrers``
    question), in the same process, after it.

    Fair: both walk the same heap for the same 50 tensors with the same depth, path and time
    bounds; the second runs after the first, so any cache warmed helps the peer.
    """
    tensors = 30_000 if quick else 100_000
    out = run_python(HOLDERS.format(tensors=tensors))
    return [Result(f"6c holders of the 50 largest of {tensors:,} tensors", out["memguard"],
                   out["per_tensor"], "s", "one walk per tensor", "<= 0.25x",
                   out["memguard"] <= 0.25 * out["per_tensor"]
                   and out["found"] == 50,
                   f"{out['found']} of 50 holders found")]


def census_views(quick: bool) -> list[Result]:
    """Benchmark 6d: benchmark 6a's census with ten times the tensors, a third of them views
    of the others (100,000 tensors and 50,000 views; the quick run a third of each), in a
    process holding as many tracked objects as 6a's, against one bare ``gc.get_objects()``
    pass there (medians of 7 alternating rounds). The census's cost grows with the tensors
    (each is read: its storage, shape, device), the bare pass's with every tracked object.
    """
    objects, tensors, views = (300_000, 33_000, 17_000) if quick else (1_000_000, 100_000,
                                                                       50_000)
    out = run_python(CENSUS.format(objects=objects, tensors=tensors, graphs=20, views=views))
    ms = 1000
    return [Result(f"6d census ({objects:,} objects, {tensors:,} tensors, {views:,} views)",
                   out["census"] * ms, out["bare"] * ms, "ms", "bare gc.get_objects()",
                   "<= 3x", out["census"] <= 3 * out["bare"],
                   f"{out['tensors']} tensors found, {out['saved']} saved by 20 graphs"),
            Result("6d the fields a census reads, alone", out["floor"] * ms, out["bare"] * ms,
                   "ms", "bare gc.get_objects()", "-", None,
                   "the floor of 6d: each tensor's storage pointer and bytes, device, dtype, "
                   "shape, view flag and a weak reference, read and dropped (collector off, "
                   "as in the census)")]


BENCHMARKS = [census, census_views, holders]
