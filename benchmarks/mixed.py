"""Mixed lengths: slices planned by each batch's cost against slices counted in samples."""

from __future__ import annotations

import json
import os
import time

from benchmarks.common import ROOT, TRAIN_UNDER_BUDGET, Result, run_python

WORKLOAD = """
import json, math, random, resource, time
import torch, memguard
from transformers import GPT2Config, GPT2LMHeadModel
torch.set_num_threads(1)
MODE, BUDGET, STEPS = "{mode}", {budget}, {steps}

def vm_size():
    return int(open("/proc/self/statm").read().split()[0]) * 4096

torch.manual_seed(0)
config = GPT2Config(n_layer=2, n_embd=128, n_head=2, vocab_size=1000, n_positions=512,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # no dropout: comparable
model = GPT2LMHeadModel(config)
if MODE == "checkpointing":
    model.gradient_checkpointing_enable()
model.train()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
rng = random.Random(1)
lengths = [rng.choice((32, 64, 512)) for _ in range(STEPS)]
g = torch.Generator().manual_seed(2)
batches = [torch.randint(0, 1000, (16, n), generator=g) for n in lengths]

def loss_of(ids):
    return model(input_ids=ids, labels=ids).loss

loss_of(batches[0][:2, :32]).backward()  # warm-up, the same in every mode
opt.zero_grad()
memguard.free_memory()
probe = {{}}
if MODE == "probe":  # the largest slice of each length that fits, tried from 16 down
    resource.setrlimit(resource.RLIMIT_AS, (vm_size() + BUDGET * 2**20, resource.RLIM_INFINITY))
    for n in sorted(set(lengths)):
        ids = torch.randint(0, 1000, (16, n), generator=g)
        for size in (16, 8, 4, 2, 1):
            try:
                for part in ids.split(size):
                    loss_of(part).backward()
                probe[n] = size
                break
            except RuntimeError:
                pass
            finally:
                opt.zero_grad()
                memguard.free_memory()
    print(json.dumps({{"probe": {{str(k): v for k, v in probe.items()}}, "lengths": lengths}}))
    raise SystemExit
cost = (lambda ids: len(ids)) if MODE == "samples" else None  # one per sample: counted in samples
step = (memguard.auto_microbatch(model, cost=cost)(loss_of)
        if MODE in ("samples", "cost") else None)
""" + TRAIN_UNDER_BUDGET + """
print(json.dumps({{"seconds": seconds, "failed": failed, "history": history,
                  "weights": weights[::97].tolist(), "lengths": lengths}}))
"""

ENV = {"MALLOC_ARENA_MAX": "1", "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
BUDGET = 250  # MiB over the warmed-up process: 16 x 512 tokens does not fit, 8 x 512 does
BATCHES = os.path.join(ROOT, "benchmarks", "mixed_lengths.json")
"""Where a full run keeps its per-batch record (``python benchmarks/plot.py --mixed`` draws it
into the out-of-memory guide's figure)."""


def keep_batches(runs: dict, steps: int, path: str = BATCHES) -> str:
    """Write the per-batch record of a run, one batch a line: its length, tokens and the
    per-batch best slice count (from the probe), and the attempts (``[size, ok, slices,
    recompute]``) of the cost-planned run (``cost``) and of the sample-counted one
    (``samples``)."""
    probe, lengths = runs["probe"]["probe"], runs["probe"]["lengths"]
    head = {"benchmark": "12 mixed lengths", "date": time.strftime("%Y-%m-%d", time.gmtime()),
            "batch": 16, "budget_mib": BUDGET, "steps": steps, "probe": probe,
            "seconds": {mode: round(runs[mode]["seconds"], 2)
                        for mode in ("cost", "samples", "checkpointing")}}
    batches = [{"length": n, "tokens": 16 * n, "best": -(-16 // probe[str(n)]),
                "cost": cost, "samples": samples}
               for n, cost, samples in zip(lengths, runs["cost"]["history"],
                                           runs["samples"]["history"], strict=True)]
    text = json.dumps(head, indent=1)[:-2]
    text += ',\n "batches": [\n  ' + ",\n  ".join(json.dumps(b) for b in batches) + "\n ]\n}\n"
    with open(path, "w") as f:
        f.write(text)
    return path


def mixed(quick: bool) -> list[Result]:
    """Benchmark 12: mixed lengths. A tiny GPT-2 (2 layers, n_embd 128, random weights, no
    download) trains on N batches of 16 sequences (24; quick: 12) whose lengths are drawn from
    {32, 64, 512}, SGD, under a 250 MiB address-space budget set after a warm-up. Fresh
    processes: the reference (no budget), ``auto_microbatch(model)`` planning slices by each
    batch's cost (its elements), the same with ``cost=len`` (one per sample: slices counted
    in samples, as before the planner), Hugging Face's static gradient checkpointing (every
    step recomputes, no memguard), and a probe of the largest slice of each length that fits
    under the budget (the best static split per batch). Reported: slices run over the run
    against the per-batch best, failed passes, wall time against the sample-counted run and
    against gradient checkpointing, and the largest relative weight difference from the
    reference (a sample of every 97th weight). A full run keeps each batch's record in
    ``benchmarks/mixed_lengths.json`` (:func:`keep_batches`).
    """
    steps = 12 if quick else 24
    runs = {mode: run_python(WORKLOAD.format(mode=mode, budget=BUDGET, steps=steps), env=ENV)
            for mode in ("reference", "probe", "cost", "samples", "checkpointing")}
    if not quick:
        keep_batches(runs, steps)
    probe, lengths = runs["probe"]["probe"], runs["probe"]["lengths"]
    best = sum(-(-16 // probe[str(n)]) for n in lengths)
    reference = runs["reference"]["weights"]
    norm = max(abs(w) for w in reference)

    def slices(run: dict) -> int:
        return sum(a[2] for h in run["history"] for a in h if a[1])

    def failures(run: dict) -> int:
        return sum(1 for h in run["history"] for a in h if not a[1])

    def drift(run: dict) -> float:
        return max(abs(a - b) for a, b in zip(run["weights"], reference, strict=True)) / norm

    mine, counted, static = runs["cost"], runs["samples"], runs["checkpointing"]
    ok = mine["failed"] is None and counted["failed"] is None
    note = (f"lengths {lengths}; largest slice that fits per length {probe}; by samples "
            f"{slices(counted)} slices, {failures(counted)} failed passes")
    return [
        Result(f"12 mixed lengths: slices run ({steps} batches)", slices(mine), best, "slices",
               "per-batch best", "<= 1.25x", ok and slices(mine) <= 1.25 * best, note),
        Result("12 mixed lengths: failed passes", failures(mine), failures(counted), "passes",
               "counted in samples", "<= 3", ok and failures(mine) <= 3),
        Result("12 mixed lengths: wall time", mine["seconds"], counted["seconds"], "s",
               "counted in samples", "report", None,
               f"gradient checkpointing {static['seconds']:.2f} s"
               f"{'' if static['failed'] is None else ' (ran out of memory)'}"),
        Result("12 mixed lengths: max |W - W_ref| / max |W_ref|", drift(mine), drift(counted),
               "rel", "counted in samples", "<= 1e-5", ok and drift(mine) <= 1e-5),
    ]


BENCHMARKS = [mixed]
