"""Benchmark 11 (Lightning): a tiny GPT-2 whose sequences grow mid-run under a real memory
budget, ``MemguardCallback(microbatch=True)`` against Lightning's ``BatchSizeFinder``.

``python -m benchmarks.lightning_microbatch`` runs it alone; ``python -m benchmarks`` runs it
with the others.
"""

from __future__ import annotations

from benchmarks.common import Result, failing_passes, run_python

WORKLOAD = """
import json, logging, os, resource, time, warnings
warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)
import torch, memguard
import pytorch_lightning as pl
from transformers import GPT2Config, GPT2LMHeadModel
from memguard.integrations.lightning import MemguardCallback
torch.set_num_threads(1)
MODE, STEPS, BATCH, BUDGET = "{mode}", {steps}, {batch}, {budget}
SHORT, LONG = 32, 256          # tokens: the first half of the run, then the second half

def vm_size():
    return int(open("/proc/self/statm").read().split()[0]) * 4096

g = torch.Generator().manual_seed(0)
samples = []
for step in range(STEPS):
    top = SHORT if step < STEPS // 2 else LONG
    for _ in range(BATCH):
        n = int(torch.randint(top // 2, top + 1, (1,), generator=g))
        samples.append(torch.randint(0, 1024, (n,), generator=g))

def collate(items):
    width = max(len(t) for t in items)
    ids = torch.zeros(len(items), width, dtype=torch.long)
    labels = torch.full((len(items), width), -100, dtype=torch.long)
    for i, t in enumerate(items):
        ids[i, :len(t)] = t
        labels[i, :len(t)] = t
    return {{"input_ids": ids, "labels": labels}}

forwards = []   # [optimizer step, samples] of every training_step call (trials included)

class LM(pl.LightningModule):
    def __init__(self):
        super().__init__()
        config = GPT2Config(vocab_size=1024, n_positions=LONG, n_embd=128, n_layer=2,
                            n_head=4, attn_implementation="eager", resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0)
        self.gpt = GPT2LMHeadModel(config)
        self.batch_size = BATCH

    def training_step(self, batch, index):
        forwards.append([self.trainer.global_step, len(batch["input_ids"])])
        return self.gpt(input_ids=batch["input_ids"], labels=batch["labels"]).loss

    def train_dataloader(self):
        return torch.utils.data.DataLoader(samples, batch_size=self.batch_size,
                                           collate_fn=collate)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

def trainer(callbacks, steps):
    return pl.Trainer(max_steps=steps, max_epochs=1, callbacks=callbacks, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, accelerator="cpu", devices=1)

torch.manual_seed(0)
model = LM()
start_state = {{k: v.clone() for k, v in model.state_dict().items()}}
# Warm-up, identical in every mode: one short step, then the start weights put back.
warm = LM()
warm.load_state_dict(start_state)
trainer([], 1).fit(warm)
del warm
memguard.free_memory()
forwards.clear()
if MODE != "reference":
    resource.setrlimit(resource.RLIMIT_AS, (vm_size() + BUDGET * 2**20, resource.RLIM_INFINITY))

weight = lambda b: (b["labels"][..., 1:] != -100).sum()
callbacks = []
callback = None
if MODE == "memguard":
    callback = MemguardCallback(microbatch=True, weight=weight)
    callbacks = [callback]
elif MODE == "finder":
    callbacks = [pl.callbacks.BatchSizeFinder(mode="power", init_val=BATCH)]
run = trainer(callbacks, STEPS)
error = None
start = time.perf_counter()
try:
    run.fit(model)
except Exception as exc:
    error = f"{{type(exc).__name__}}: {{str(exc)[:120]}}"
seconds = time.perf_counter() - start
resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
weights = torch.cat([p.detach().flatten() for p in model.parameters()])
torch.save(weights, os.environ["WEIGHTS"] + "." + MODE)
print(json.dumps({{"seconds": seconds, "forwards": forwards, "steps": run.global_step,
                  "error": error, "batch_size": model.batch_size,
                  "microbatch": callback.microbatch_size if callback else None}}))
"""

ENV = {"MALLOC_ARENA_MAX": "1", "OMP_NUM_THREADS": "1"}
BATCH = 16
BUDGET = 200  # MiB of address space above the warmed-up process


def lightning_microbatch(quick: bool) -> list[Result]:
    """Benchmark 11, Lightning: N optimizer steps (8; quick: 6) of a tiny GPT-2 (2 layers,
    n_embd 128, vocabulary 1024, made from a ``GPT2Config``: nothing downloaded) in a
    ``pytorch_lightning.Trainer`` (SGD, lr 0.05) on batches of 16 sequences padded to the
    batch's longest (labels -100 on padding, so the loss is a mean over tokens). Sequences
    of the first half of the run have 16-32 tokens, those of the second half 128-256: under
    a 200 MiB address-space budget set after a warm-up step (RLIMIT_AS) the short batches
    fit and the long ones do not. Three fresh processes: the reference (no budget),
    memguard (``MemguardCallback(microbatch=True, weight=<non--100 labels>)``) and the peer,
    Lightning's ``BatchSizeFinder(mode="power", init_val=16)``, the tool Lightning offers
    (it scales the batch size at the start of ``fit``, on the short sequences, and does
    nothing once training runs).

    Reported: optimizer steps completed; samples computed more than once (every
    ``training_step`` call's samples, failed ones and the finder's trials included, minus
    one clean pass; target: none outside the failing steps' own passes, every step that
    needed more than one pass: see ``failing_passes``); the largest
    absolute difference of any weight from the reference's (``inf`` when the run did not
    finish); wall time of ``fit``.
    """
    import os
    import tempfile

    import torch

    steps = 6 if quick else 8
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(ENV, WEIGHTS=os.path.join(tmp, "w"))
        runs = {mode: run_python(WORKLOAD.format(mode=mode, steps=steps, batch=BATCH,
                                                 budget=BUDGET), env=env)
                for mode in ("reference", "memguard", "finder")}
        weights = {mode: torch.load(os.path.join(tmp, "w." + mode)) for mode in runs}
    clean = steps * BATCH

    def redone(run: dict) -> int:
        return max(0, sum(n for _, n in run["forwards"]) - clean)

    def beyond_failed_step(run: dict) -> int:
        """Samples computed more than once outside the failing steps' own passes (those of
        every step that needed more than one pass: see ``failing_passes``)."""
        return redone(run) - failing_passes([(step, n) for step, n in run["forwards"]], BATCH)

    def drift(mode: str) -> float:
        run = runs[mode]
        if run["error"] is not None or run["steps"] != steps:
            return float("inf")
        return float((weights[mode] - weights["reference"]).abs().max())

    ref, mine, peer = runs["reference"], runs["memguard"], runs["finder"]
    sizes = [n for _, n in mine["forwards"]]
    scenario = (ref["error"] is None and ref["steps"] == steps
                and sizes[:steps // 2 + 1] == [BATCH] * (steps // 2 + 1)
                and len(sizes) > steps)  # the short half fitted, the first long batch did not
    shape = "" if scenario else "SCENARIO NOT REPRODUCED; "
    note = (f"{shape}memguard: {mine['steps']}/{steps} steps, microbatch size "
            f"{mine['microbatch']}, calls {sizes}, computed twice {redone(mine)}, of them "
            f"beyond the failing steps' passes {beyond_failed_step(mine)}, "
            f"error {mine['error']}; "
            f"BatchSizeFinder: {peer['steps']}/{steps} steps, batch size chosen "
            f"{peer['batch_size']}, calls {[n for _, n in peer['forwards']]}, "
            f"error {peer['error']}; "
            f"reference fit {ref['seconds']:.2f} s")
    return [
        Result(f"11 Lightning, growing sequences: steps completed (of {steps})",
               mine["steps"], peer["steps"], "steps", "BatchSizeFinder", f"{steps}",
               scenario and mine["steps"] == steps, note),
        Result("11 Lightning, growing sequences: samples computed twice", redone(mine),
               redone(peer), "samples", "BatchSizeFinder", "0 beyond the failing steps",
               scenario and mine["steps"] == steps and beyond_failed_step(mine) == 0),
        Result("11 Lightning, growing sequences: max |W - W_ref|", drift("memguard"),
               drift("finder"), "abs", "BatchSizeFinder", "<= 1e-5",
               scenario and drift("memguard") <= 1e-5,
               f"memguard {drift('memguard'):.2e}, BatchSizeFinder {drift('finder'):.2e}"),
        Result("11 Lightning, growing sequences: wall time of fit", mine["seconds"],
               peer["seconds"], "s", "BatchSizeFinder", "report", None),
    ]


BENCHMARKS = [lightning_microbatch]


if __name__ == "__main__":
    import sys

    from benchmarks.run import table

    results = lightning_microbatch("--quick" in sys.argv)
    print(table(results))
    for r in results:
        if r.notes:
            print(f"  {r.name}: {r.notes}")
