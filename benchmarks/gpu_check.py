"""The GPU verification run: everything memguard claims on CUDA, in one script, < 5 minutes.

On a CUDA machine, from the repository root, with the machine's own torch installed::

    pip install -e ".[test]" accelerate && python benchmarks/gpu_check.py

It runs the test suite's ``gpu``-marked tests; recovers from a real CUDA out-of-memory with
``oom_retry`` (reserved memory back after cleanup, ``num_ooms`` counted) and with
``auto_microbatch``, down to its offload rung (one sample whose recomputed pass still does not
fit runs with its saved tensors in pinned host memory); rehearses a
smaller GPU with ``memory_limit``; dumps a snapshot with ``record_history``; and measures
benchmark 1 (guard overhead on a training step) and benchmark 3 (recovery against
Accelerate) on the GPU. It prints a summary, writes ``benchmarks/gpu_results.json``, and
exits 0 when every check passed, 1 when one failed, 2 without CUDA.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import memguard  # noqa: E402

MiB = 1 << 20
results: dict[str, Any] = {}


def check(name: str, fn: Callable[[], dict]) -> None:
    start = time.perf_counter()
    try:
        outcome = fn()
        outcome.setdefault("ok", True)
    except Exception as exc:  # noqa: BLE001 - a failed check is reported, not fatal
        outcome = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    outcome["seconds"] = round(time.perf_counter() - start, 2)
    results[name] = outcome
    print(f"{'PASS' if outcome['ok'] else 'FAIL'}  {name}: "
          f"{ {k: v for k, v in outcome.items() if k not in ('ok', 'output')} }", flush=True)


def gpu_tests() -> dict:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p",
                           "no:cacheprovider", "tests"], cwd=ROOT, capture_output=True,
                          text=True, timeout=240)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    return {"ok": proc.returncode == 0, "summary": summary, "output": proc.stdout[-4000:]}


def real_oom() -> dict:
    total = torch.cuda.mem_get_info()[1]
    per_sample = total // 16
    ooms = torch.cuda.memory_stats().get("num_ooms", 0)

    @memguard.oom_retry(batch_size=32)
    def step(batch_size: int) -> int:
        torch.empty(batch_size * per_sample, dtype=torch.uint8, device="cuda").fill_(1)
        return batch_size

    found = step()
    memguard.free_memory()
    reserved = torch.cuda.memory_reserved()
    counted = torch.cuda.memory_stats().get("num_ooms", 0) - ooms
    return {"ok": found <= 8 and counted >= 1 and reserved < total // 8, "found": found,
            "sizes": [a.size for a in step.history], "num_ooms": counted,
            "reserved_after_cleanup_mib": reserved // MiB}


def microbatch() -> dict:
    """auto_microbatch through a real CUDA out-of-memory: a step whose forward needs a sixth
    of the GPU per 16 samples, at batch 64, then two more steps at the size that fitted."""
    total = torch.cuda.mem_get_info()[1]
    per_sample = total // 96
    model = torch.nn.Linear(8, 1).cuda()

    @memguard.auto_microbatch(model)
    def loss_of(batch: torch.Tensor) -> torch.Tensor:
        torch.empty(len(batch) * per_sample, dtype=torch.uint8, device="cuda").fill_(1)
        return model(batch).pow(2).mean()

    batch = torch.randn(64, 8, device="cuda")
    sizes = []
    for _ in range(3):
        loss_of(batch)
        sizes.append([a.size for a in loss_of.history])
        model.zero_grad()
    return {"ok": sizes[0][0] == 64 and len(sizes[0]) > 1
            and all(len(s) == 1 for s in sizes[1:]), "sizes": sizes,
            "microbatch_size": loss_of.microbatch_size}


def offload() -> dict:
    """auto_microbatch's last rungs on a real CUDA out-of-memory: one sample of 16,384
    positions through a 32-block residual stack (width 256), about 1.6 GiB saved for
    backward plain and 530 MiB with every block recomputed, under a cap of 340 MiB over the
    model and its data (``set_per_process_memory_fraction``): the plain pass and the
    recomputed one run out, the one with saved tensors in pinned host memory (recompute on)
    fits, with the uncapped step's gradients (1e-5 relative)."""
    torch.manual_seed(0)

    def block() -> torch.nn.Module:
        class Block(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.up = torch.nn.Linear(256, 256)
                self.down = torch.nn.Linear(256, 256)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return x + self.down(torch.nn.functional.gelu(self.up(x)))

        return Block()

    model = torch.nn.Sequential(*[block() for _ in range(32)], torch.nn.Linear(256, 1)).cuda()
    g = torch.Generator(device="cuda").manual_seed(1)
    batch = (torch.randn(1, 16384, 256, device="cuda", generator=g),
             torch.randn(1, 16384, 1, device="cuda", generator=g))

    def loss_of(b: tuple) -> torch.Tensor:
        return torch.nn.functional.mse_loss(model(b[0]), b[1])

    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss_of(batch).backward()
    plain_peak = torch.cuda.max_memory_allocated() - start
    reference = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    memguard.free_memory()
    base = torch.cuda.memory_reserved()
    torch.cuda.set_per_process_memory_fraction(
        (base + 340 * MiB) / torch.cuda.get_device_properties(0).total_memory)
    try:
        step = memguard.auto_microbatch(model)(loss_of)
        torch.cuda.reset_peak_memory_stats()
        began = time.perf_counter()
        step(batch)
        seconds = time.perf_counter() - began
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    rows = [[a.size, a.ok, a.recompute, a.offload] for a in step.history]
    worst = max(((p.grad - r).norm() / r.norm()).item()
                for p, r in zip(model.parameters(), reference, strict=True))
    return {"ok": rows == [[1, False, False, False], [1, False, True, False],
                           [1, True, True, True]] and worst < 1e-5,
            "history": rows, "relative_grad_diff": worst,
            "plain_peak_mib": plain_peak // MiB, "cap_mib": 340,
            "seconds_all_passes": round(seconds, 3)}


def limit() -> dict:
    with memguard.memory_limit("1GiB", device="cuda"):
        try:
            torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
            inside = "no error"
        except torch.OutOfMemoryError as exc:
            inside = "oom" if memguard.is_oom_error(exc) else "other"
    after = torch.empty(2 << 30, dtype=torch.uint8, device="cuda").numel()
    return {"ok": inside == "oom" and after == 2 << 30, "inside": inside}


def history() -> dict:
    path = os.path.join(tempfile.mkdtemp(), "oom.pickle")
    try:
        with memguard.record_history(path):
            torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError:
        pass
    size = os.path.getsize(path) if os.path.exists(path) else 0
    return {"ok": size > 0, "snapshot_bytes": size}


def overhead() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(),
                                torch.nn.Linear(4096, 1024)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(512, 1024, device="cuda")

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()

    def naive() -> None:
        step()
        gc.collect()
        torch.cuda.empty_cache()

    auto = memguard.frees_memory(step)
    variants = {"bare": step, "auto": auto, "naive": naive}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for fn in variants.values():
        fn()
    for _ in range(10):
        for name, fn in variants.items():
            start = time.perf_counter()
            for _ in range(20):
                fn()
            times[name].append((time.perf_counter() - start) / 20)
    medians = {name: statistics.median(v) * 1000 for name, v in times.items()}
    ratio = medians["auto"] / medians["bare"]
    return {"ok": ratio <= 1.05, "ms": {k: round(v, 3) for k, v in medians.items()},
            "auto_ratio": round(ratio, 3),
            "naive_ratio": round(medians["naive"] / medians["bare"], 2)}


def recovery() -> dict:
    total = torch.cuda.mem_get_info()[1]
    unit = (2 << 30) // 100  # 100 samples need 2 x 2 GiB under a 3 GiB limit

    def attempt(batch_size: int) -> int:
        first = torch.empty(batch_size * unit, dtype=torch.uint8, device="cuda").fill_(1)
        second = torch.empty(batch_size * unit, dtype=torch.uint8, device="cuda").fill_(1)
        del first, second
        return batch_size

    out: dict[str, Any] = {}
    runners: dict[str, Callable[[], Callable[[], int]]] = {
        "memguard": lambda: memguard.oom_retry(batch_size=100)(attempt)}
    try:
        from accelerate.utils import find_executable_batch_size

        runners["accelerate"] = lambda: find_executable_batch_size(
            lambda batch_size: attempt(batch_size), starting_batch_size=100)
    except ImportError:
        out["accelerate"] = "not installed"
    for name, make in runners.items():
        memguard.free_memory()
        with memguard.memory_limit(min(3 << 30, total // 2), device="cuda"):
            ooms = torch.cuda.memory_stats().get("num_ooms", 0)
            start = time.perf_counter()
            found = make()()
            out[name] = {"found": found, "seconds": round(time.perf_counter() - start, 3),
                         "attempts": torch.cuda.memory_stats().get("num_ooms", 0) - ooms + 1}
    mine = out["memguard"]["attempts"]
    peer = out.get("accelerate")
    out["ok"] = not isinstance(peer, dict) or mine <= peer["attempts"]
    return out


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to check")
        return 2
    name = torch.cuda.get_device_name(0)
    print(f"gpu_check on {name}, torch {torch.__version__}, memguard {memguard.__version__}")
    torch.zeros(1, device="cuda")
    for label, fn in [("gpu tests", gpu_tests), ("real CUDA OOM through oom_retry", real_oom),
                      ("real CUDA OOM through auto_microbatch", microbatch),
                      ("auto_microbatch's offload rung after recompute", offload),
                      ("memory_limit on CUDA", limit), ("record_history on OOM", history),
                      ("benchmark 1 on the GPU", overhead), ("benchmark 3 on the GPU", recovery)]:
        check(label, fn)
        gc.collect()
        torch.cuda.empty_cache()
    report = {"date": time.strftime("%Y-%m-%d"), "gpu": name, "torch": torch.__version__,
              "python": platform.python_version(), "results": results}
    path = os.path.join(ROOT, "benchmarks", "gpu_results.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    passed = sum(r["ok"] for r in results.values())
    print(f"{passed}/{len(results)} checks passed; results in {path}")
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
