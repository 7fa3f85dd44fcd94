"""Real out-of-memory on a CPU: a subprocess with a soft RLIMIT_AS budget.

The budget is a fixed amount of address space above what the process has mapped once warmed
up (one thread, one malloc arena, so that later thread stacks and arenas do not eat it).
"""

from __future__ import annotations

import textwrap

PRELUDE = """
import json, os, resource, sys, gc
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"

def vm_size():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024

def set_budget(mib):
    resource.setrlimit(resource.RLIMIT_AS, (vm_size() + mib * 2**20, resource.RLIM_INFINITY))

def lift_budget():
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
"""

ENV = {"MALLOC_ARENA_MAX": "1", "OMP_NUM_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1",
       "TF_NUM_INTRAOP_THREADS": "1"}


def script(*parts: str) -> str:
    """The prelude followed by ``parts``, each dedented on its own."""
    return PRELUDE + "".join(textwrap.dedent(part) for part in parts)
