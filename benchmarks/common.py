"""Small pieces shared by the benchmarks: a timed loop, a fresh interpreter, a result row."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import textwrap
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Result:
    """One line of the table: memguard's figure, the peer's, their ratio, the target."""

    name: str
    memguard: float
    peer: Optional[float]
    unit: str
    peer_name: str
    target: str
    met: Optional[bool]
    notes: str = ""

    @property
    def ratio(self) -> Optional[float]:
        if self.peer in (None, 0):
            return None
        return self.memguard / self.peer

    def to_dict(self) -> dict:
        return dict(asdict(self), ratio=self.ratio)


def interleaved(variants: dict[str, Callable[[], None]], rounds: int, per_round: int) -> dict:
    """Median seconds per call of each variant, measured in alternating rounds.

    Alternating spreads the machine's noise (other load, frequency changes) evenly over the
    variants, so their ratios from one run hold even when absolute times drift.
    """
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            start = time.perf_counter()
            for _ in range(per_round):
                fn()
            times[name].append((time.perf_counter() - start) / per_round)
    return {name: statistics.median(values) for name, values in times.items()}


def run_python(code: str, env: Optional[dict] = None, timeout: float = 600) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON object as its last line."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", **(env or {})))
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark subprocess failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def failing_passes(calls: list[tuple[int, int]], batch: int) -> int:
    """The samples of failing steps' extra passes: ``calls`` are ``(step, samples)`` of every
    forward of a training step, in order; consecutive calls at one step are that step's,
    and those beyond its ``batch`` samples are the passes that ran out of memory (a step
    that starts over later, after a restart, is a new run of calls). Under a real budget a
    later step may fail too: the address space in use creeps from step to step, so in some
    runs a size that fitted stops fitting a few steps after the first failure."""
    extra, index = 0, 0
    while index < len(calls):
        step, samples = calls[index][0], 0
        while index < len(calls) and calls[index][0] == step:
            samples += calls[index][1]
            index += 1
        extra += max(0, samples - batch)
    return extra


TRAIN_UNDER_BUDGET = """
if MODE != "reference":
    resource.setrlimit(resource.RLIMIT_AS, (vm_size() + BUDGET * 2**20, resource.RLIM_INFINITY))
history, failed = [], None
start = time.perf_counter()
try:
    for batch in batches:
        if step is not None:
            step(batch)
            history.append([[a.size, a.ok, a.steps, a.recompute] for a in step.history])
        else:
            loss_of(batch).backward()
        opt.step()
        opt.zero_grad()
except RuntimeError as exc:
    failed = str(exc)[:200]
seconds = time.perf_counter() - start
resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
weights = torch.cat([p.detach().flatten() for p in model.parameters()])
"""
"""The timed part of a training run under a budget (benchmarks 12 and 13): ``MODE``,
``BUDGET`` (MiB), ``vm_size``, ``batches``, ``step`` (the guarded step, or ``None`` for a
plain backward of ``loss_of``), ``opt`` and ``model`` come before it; it leaves ``history``
([size, ok, slices, recompute] per attempt, per batch), ``failed``, ``seconds`` and
``weights``."""
