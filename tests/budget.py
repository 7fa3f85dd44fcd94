"""Real out-of-memory on a CPU: a subprocess with a soft RLIMIT_AS budget.

The budget is a fixed amount of address space above what the process has mapped once warmed
up (one thread, one malloc arena, so that later thread stacks and arenas do not eat it).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import textwrap

import warm

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

def finish(result):
    # print the result and leave at once: at interpreter exit, the C++ destructors of
    # torch.distributed's threads abort now and then ("terminate called without an active
    # exception", about one run in six of three gloo ranks), after the result is out
    print(json.dumps(result), flush=True)
    sys.stderr.flush()
    os._exit(0)
"""

ENV = {"MALLOC_ARENA_MAX": "1", "OMP_NUM_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1",
       "TF_NUM_INTRAOP_THREADS": "1"}


def script(*parts: str) -> str:
    """The prelude followed by ``parts``, each dedented on its own."""
    return PRELUDE + "".join(textwrap.dedent(part) for part in parts)


def free_port() -> int:
    """A TCP port on the loopback nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(code: str, world: int = 3, timeout: float = 240) -> list[dict]:
    """Run ``code`` (prelude included) as ``world`` gloo ranks on this machine; each prints
    one JSON object as its last line. A hang fails the caller instead of the suite: every
    rank has a deadline and is killed past it."""
    env = dict(os.environ, **ENV, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE=str(world), TF_CPP_MIN_LOG_LEVEL="3")
    procs = [warm.popen(script(code), dict(env, RANK=str(rank))) for rank in range(world)]
    outputs = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, stderr[-3000:]
            outputs.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return outputs


def ranks_left_waiting(code: str, world: int = 2, ready: str = "ready", grace: float = 10,
                       timeout: float = 240) -> list[int]:
    """Run ``code`` as ``world`` gloo ranks; each prints the line ``ready`` just before the
    work under test. Once every rank has printed it, wait ``grace`` seconds (the good path
    ends long before) and return the ranks still running: a hang is measured from the moment
    the ranks meet, not from their start, so a slow start neither fakes nor hides it."""
    import threading
    import time

    env = dict(os.environ, **ENV, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE=str(world), TF_CPP_MIN_LOG_LEVEL="3")
    procs = [warm.popen(script(code), dict(env, RANK=str(rank)), stderr=False)
             for rank in range(world)]
    arrived = [threading.Event() for _ in procs]

    def watch(proc: warm.Process | subprocess.Popen, event: threading.Event) -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            if line.strip() == ready:
                event.set()
        event.set()  # ended (or never got there): nothing more to wait for

    for proc, event in zip(procs, arrived, strict=True):
        threading.Thread(target=watch, args=(proc, event), daemon=True).start()
    try:
        deadline = time.monotonic() + timeout
        for rank, event in enumerate(arrived):
            assert event.wait(max(0.0, deadline - time.monotonic())), \
                f"rank {rank} printed no {ready!r} line within {timeout} s"
        deadline = time.monotonic() + grace
        for proc in procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return [rank for rank, proc in enumerate(procs) if proc.poll() is None]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
