"""Census cost: live_tensors() and holder paths, as ratios to one bare gc.get_objects()."""

from __future__ import annotations

from benchmarks.common import Result, run_python

CENSUS = """
import gc, json, statistics, time
import torch, memguard
from memguard.tensors import live_tensors

OBJECTS = [[i] for i in range({objects})]          # tracked Python objects
TENSORS = [torch.ones(4) for _ in range({tensors})]
LEAKED = {{"step%d" % i: [torch.ones(1000 + i)] for i in range(10)}}   # ten held tensors

def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start

bare, census = [], []
for _ in range(7):  # alternating, so that a slow spell of the machine hits both
    bare.append(timed(gc.get_objects))
    census.append(timed(live_tensors))
bare, census = statistics.median(bare), statistics.median(census)
top = live_tensors(min_bytes=4000)[:10]
start = time.perf_counter()
paths = [info.holders for info in top]
holders = time.perf_counter() - start
print(json.dumps({{"bare": bare, "census": census, "holders": holders,
                  "found": sum(1 for p in paths if p), "tensors": len(live_tensors())}}))
"""


def census(quick: bool) -> list[Result]:
    """Benchmark 6: ``live_tensors()`` in a process holding 1,000,000 tracked Python objects
    and 10,000 tensors, against one bare ``gc.get_objects()`` pass over the same process
    (medians of 7 alternating rounds), and the time to find holder paths for the 10 largest
    tensors.

    Fair: the bare pass is the floor any census that scans the collector pays; both run in
    the same process, one after the other.
    """
    objects, tensors = (300_000, 3_000) if quick else (1_000_000, 10_000)
    out = run_python(CENSUS.format(objects=objects, tensors=tensors))
    ms = 1000
    return [
        Result(f"6a census ({objects:,} objects, {tensors:,} tensors)", out["census"] * ms,
               out["bare"] * ms, "ms", "bare gc.get_objects()", "<= 2x",
               out["census"] <= 2 * out["bare"], f"{out['tensors']} tensors found"),
        Result("6b holders of the top 10 tensors", out["holders"], None, "s", "-", "< 1 s",
               out["holders"] < 1 and out["found"] == 10,
               f"{out['found']} of 10 holders found"),
    ]


BENCHMARKS = [census]
