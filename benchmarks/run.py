"""Run every benchmark, print one table, write benchmarks/results.json.

``python -m benchmarks`` (or ``python benchmarks/run.py``); ``--quick`` for a short run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import (
    batching,
    census,
    guards,
    hf_trainer,
    integrations,
    lightning_microbatch,
    microbatch,
    mixed,
    oom,
    recompute,
    restore,
)
from benchmarks.common import ROOT, Result

ALL = (guards.BENCHMARKS + oom.BENCHMARKS + microbatch.BENCHMARKS + batching.BENCHMARKS
       + census.BENCHMARKS + integrations.BENCHMARKS + restore.BENCHMARKS
       + hf_trainer.BENCHMARKS + lightning_microbatch.BENCHMARKS + mixed.BENCHMARKS
       + recompute.BENCHMARKS)


def machine() -> dict:
    import psutil

    info = {"python": platform.python_version(), "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / 2**30, 1)}
    try:
        import torch

        info["torch"] = torch.__version__
    except ImportError:
        pass
    return info


def table(results: list[Result]) -> str:
    rows = [("benchmark", "memguard", "peer", "ratio", "unit", "target", "met")]
    for r in results:
        rows.append((r.name, f"{r.memguard:.3f}", "-" if r.peer is None else f"{r.peer:.3f}",
                     "-" if r.ratio is None else f"{r.ratio:.3f}", r.unit, r.target,
                     {True: "yes", False: "NO", None: "-"}[r.met]))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                     for row in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a reduced run (under 2 minutes)")
    parser.add_argument("--output", default=os.path.join(ROOT, "benchmarks", "results.json"))
    parser.add_argument("names", nargs="*",
                        help="run only the benchmarks whose function name contains one of these")
    args = parser.parse_args(argv)
    chosen = [b for b in ALL if not args.names or any(n in b.__name__ for n in args.names)]
    if not chosen:
        parser.error(f"no benchmark matches {args.names}; the names are "
                     f"{', '.join(b.__name__ for b in ALL)}")
    started = time.time()
    results: list[Result] = []
    for bench in chosen:
        results.extend(bench(args.quick))
    print(table(results))
    for r in results:
        if r.notes:
            print(f"  {r.name}: {r.notes}")
    with open(args.output, "w") as f:
        json.dump({"quick": args.quick, "seconds": round(time.time() - started, 1),
                   "machine": machine(), "results": [r.to_dict() for r in results]}, f, indent=2)
    print(f"written {args.output} in {time.time() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
