"""``oom_retry(restore=...)``: what copying the state aside costs, against a plain torch copy
of the same bytes, in host memory and in a file.

``python -m benchmarks.restore`` runs it alone (``--quick`` for 64 MiB instead of 256 MiB).
"""

from __future__ import annotations

import sys

from benchmarks.common import Result, run_python

CODE = """
import json, statistics, time, torch
from memguard.backends.steps import torch_state
torch.set_num_threads(1)
MIB = {mib}
model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(MIB // 4)])
params = list(model.parameters())  # MIB MiB of float32 weights, no gradients

def plain():
    return [p.detach().clone() for p in params]

def saved(to):
    return torch_state.copy_states(torch_state.check_restorable(model, to))

times = {{"plain": [], "memory": [], "file": [], "load memory": [], "load file": []}}
for _ in range({rounds}):
    for name in ("plain", "memory", "file"):
        start = time.perf_counter()
        copy = plain() if name == "plain" else saved(name)
        times[name].append(time.perf_counter() - start)
        if name != "plain":
            start = time.perf_counter()
            copy.load()
            times["load " + name].append(time.perf_counter() - start)
            copy.discard()
        del copy
print(json.dumps({{k: statistics.median(v) for k, v in times.items()}}))
"""


def restore_copy(quick: bool) -> list[Result]:
    """Benchmark 11: copying a model's state aside for ``restore=`` (``restore_to="memory"``
    and ``"file"``) and loading it back, against cloning the same tensors with torch; median
    seconds of alternating rounds in one process."""
    mib, rounds = (64, 3) if quick else (256, 5)
    out = run_python(CODE.format(mib=mib, rounds=rounds))
    plain = out["plain"]
    return [
        Result(f"11 restore copy {mib} MiB: memory", out["memory"], plain, "s", "tensor clone",
               "<= 1.5x", out["memory"] <= 1.5 * plain),
        Result(f"11 restore copy {mib} MiB: file", out["file"], plain, "s", "tensor clone",
               "-", None, f"load back: memory {out['load memory']:.3f} s, file "
               f"{out['load file']:.3f} s"),
    ]


BENCHMARKS = [restore_copy]

if __name__ == "__main__":
    from benchmarks.run import table

    results = restore_copy("--quick" in sys.argv)
    print(table(results))
    for r in results:
        if r.notes:
            print(f"  {r.name}: {r.notes}")
