"""Hugging Face's Trainer: step-level recovery with ``auto_microbatch(trainer)`` against the
Trainer's own ``auto_find_batch_size=True``, and what being ready costs a step that fits."""

from __future__ import annotations

from benchmarks.common import Result, failing_passes, run_python

SETUP = """
import json, os, resource, tempfile, time, warnings
os.environ["TRANSFORMERS_VERBOSITY"] = "error"
warnings.filterwarnings("ignore")
import torch, transformers
import memguard
from memguard.integrations.transformers import auto_microbatch
torch.set_num_threads(1)

def vm_size():
    return int(open("/proc/self/statm").read().split()[0]) * 4096

class Growing(torch.utils.data.Dataset):
    # STEPS batches of BATCH sequences, in order: the first half SHORT tokens long, the rest
    # LONG; labels -100 on each sequence's padding
    def __len__(self):
        return STEPS * BATCH
    def __getitem__(self, i):
        length = SHORT if i < STEPS // 2 * BATCH else LONG
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, VOCAB, (length,), generator=g)
        used = length // 2 + (i * 7) % (length // 2)
        labels = ids.clone()
        labels[used:] = -100
        mask = (torch.arange(length) < used).long()
        return {{"input_ids": ids, "attention_mask": mask, "labels": labels}}

def model():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=LONG, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))

def pad(features):
    # pads to the batch's longest sequence: a batch size that does not divide the short
    # phase (auto_find_batch_size shrinks by 0.9) mixes lengths
    length = max(len(f["input_ids"]) for f in features)
    def padded(key, value):
        return torch.stack([torch.nn.functional.pad(f[key], (0, length - len(f[key])),
                                                    value=value) for f in features])
    return {{"input_ids": padded("input_ids", 0), "attention_mask": padded("attention_mask", 0),
             "labels": padded("labels", -100)}}

def trainer(net, **options):
    args = transformers.TrainingArguments(
        tempfile.mkdtemp(), num_train_epochs=1, per_device_train_batch_size=BATCH,
        learning_rate=0.1, optim="sgd", lr_scheduler_type="constant", report_to=[],
        save_strategy="no", logging_strategy="no", disable_tqdm=True, use_cpu=True, seed=0,
        data_seed=0, train_sampling_strategy="sequential", **options)
    return transformers.Trainer(model=net, args=args, train_dataset=Growing(),
                                data_collator=pad)
"""

WORKLOAD = SETUP + """
STEPS, BATCH, SHORT, LONG, VOCAB, BUDGET = {steps}, 64, 32, 128, 2000, {budget}
MODE = "{mode}"
forwards = []  # [samples, global step] of every forward, failed ones included
net = model()
trainer(model(), max_steps=1).train()  # warm-up of the Trainer's machinery, another model
t = trainer(net, auto_find_batch_size=(MODE == "hf"))
net.transformer.wte.register_forward_pre_hook(
    lambda module, args: forwards.append([args[0].shape[0], t.state.global_step]))
if MODE == "memguard":
    t = auto_microbatch(t)
memguard.free_memory()
if MODE != "reference":
    resource.setrlimit(resource.RLIMIT_AS, (vm_size() + BUDGET * 2**20, resource.RLIM_INFINITY))
start = time.perf_counter()
t.train()
seconds = time.perf_counter() - start
resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
weights = torch.cat([p.detach().flatten() for p in net.parameters()]).tolist()
print(json.dumps({{"seconds": seconds, "forwards": forwards, "steps": t.state.global_step,
                  "batch": t._train_batch_size, "weights": weights,
                  "size": t.training_step.microbatch_size if MODE == "memguard" else None}}))
"""

ENV = {"MALLOC_ARENA_MAX": "1", "OMP_NUM_THREADS": "1"}
BUDGET = 200  # MiB of address space: 64 short sequences fit, 64 long ones do not


def hf_trainer(quick: bool) -> list[Result]:
    """Benchmark 11 (Hugging Face half): one epoch of a tiny GPT-2 (1 layer, 32 wide, a
    vocabulary of 2,000) in HF's ``Trainer`` (SGD at lr 0.1, constant schedule, sequential
    sampling) over N batches of 64 sequences (12; quick: 8) whose length grows mid-run: the
    first half are 32 tokens long, the rest 128 (labels -100 on each sequence's padding, so
    the loss is a mean over tokens and the Trainer passes ``num_items_in_batch``). Under a
    200 MiB address-space budget set after a warm-up (RLIMIT_AS: torch's allocator raises
    "can't allocate memory", which both tools recognise), 64 short sequences fit and 64 long
    ones do not. Three fresh processes: the reference (no budget), memguard
    (``auto_microbatch(trainer)``, its defaults) and HF's ``auto_find_batch_size=True``
    (Accelerate's ``find_executable_batch_size`` around the training loop: it halves the
    batch size and starts the loop over).

    Samples redone: the samples of every forward call (failed ones included) minus one clean
    pass over the data, minus the forwards of each step beyond its batch (the passes that ran
    out of memory, which either tool needs to find out; a restart's steps are not the failed
    step's). Also reported: optimizer steps
    completed, wall time of ``train()`` and the largest weight difference from the
    reference.
    """
    steps = 8 if quick else 12
    runs = {mode: run_python(WORKLOAD.format(steps=steps, budget=BUDGET, mode=mode),
                             env=ENV, timeout=900)
            for mode in ("reference", "memguard", "hf")}
    reference, mine, peer = runs["reference"], runs["memguard"], runs["hf"]
    clean = steps * 64

    def redone(run: dict) -> tuple[int, int]:
        """Samples redone beyond the failing steps' passes; those passes' samples."""
        forwards = run["forwards"]
        extra = failing_passes([(step, n) for n, step in forwards], 64)
        return sum(n for n, _ in forwards) - clean - extra, extra

    def drift(run: dict) -> float:
        return max(abs(a - b) for a, b in zip(run["weights"], reference["weights"], strict=True))

    lost_mine, passes_mine = redone(mine)
    lost_peer, _ = redone(peer)
    scenario = (reference["steps"] == steps and sum(n for n, _ in reference["forwards"]) == clean
                and mine["size"] is not None and mine["size"] < 64)
    shape = "" if scenario else "SCENARIO NOT REPRODUCED (budget); "
    note = (f"{shape}memguard: {mine['steps']} steps, slices of {mine['size']}, the failing "
            f"steps' passes {passes_mine} samples; auto_find_batch_size: {peer['steps']} "
            f"steps of the restarted loop at batch {peer['batch']}; reference "
            f"{reference['seconds']:.2f} s, {clean} samples per pass")
    return [
        Result(f"11 HF Trainer through an oom: samples redone ({steps} steps)", lost_mine,
               lost_peer, "samples", "auto_find_batch_size=True",
               "0 beyond the failing steps' passes", scenario and lost_mine == 0, note),
        Result("11 HF Trainer through an oom: optimizer steps", mine["steps"], peer["steps"],
               "steps", "auto_find_batch_size=True", f"{steps}",
               scenario and mine["steps"] == steps),
        Result("11 HF Trainer through an oom: wall time", mine["seconds"], peer["seconds"],
               "s", "auto_find_batch_size=True", "report", None),
        Result("11 HF Trainer through an oom: max |W - W_ref|", drift(mine), drift(peer),
               "abs", "auto_find_batch_size=True", "<= 1e-5",
               scenario and drift(mine) <= 1e-5,
               f"memguard {drift(mine):.2e}, auto_find_batch_size {drift(peer):.2e}"),
    ]


COST = SETUP + """
STEPS, BATCH, SHORT, LONG, VOCAB = {steps}, 16, 32, 32, 2000
ROUNDS = {rounds}
times = {{"plain": [], "memguard": []}}
for round in range(ROUNDS):
    for mode in ("plain", "memguard")[::1 if round % 2 == 0 else -1]:  # each goes first
        t = trainer(model())
        if mode == "memguard":
            t = auto_microbatch(t)
        start = time.perf_counter()
        t.train()
        times[mode].append((time.perf_counter() - start) / STEPS)
print(json.dumps(times))
"""


def hf_trainer_cost(quick: bool) -> list[Result]:
    """The cost of being ready: a tiny GPT-2 (vocabulary 2,000, batches of 16 sequences of 32
    tokens: steps of about 10 ms on one thread) trained for one epoch of N steps (200;
    quick: 80) by HF's ``train()`` plain and with ``auto_microbatch(trainer)``, alternating
    (each first in every other round),
    fresh model and Trainer each round (7 rounds; quick: 3); the median time per step of
    each, the whole ``train()`` call included; met is judged on the median of the rounds'
    ratios. Target: <= 1.03x plain."""
    steps, rounds = (80, 3) if quick else (200, 7)
    out = run_python(COST.format(steps=steps, rounds=rounds), env=ENV, timeout=900)
    median = {mode: sorted(values)[len(values) // 2] for mode, values in out.items()}
    ms = 1000.0
    # the median of the rounds' ratios: each round's two runs share the machine's load
    ratios = sorted(m / p for m, p in zip(out["memguard"], out["plain"], strict=True))
    ratio = ratios[len(ratios) // 2]
    return [Result("11 HF Trainer step with auto_microbatch(trainer) (fits)",
                   median["memguard"] * ms, median["plain"] * ms, "ms", "plain train()",
                   "<= 1.03x", ratio <= 1.03,
                   f"median of the rounds' ratios {ratio:.3f}; per-round ms: memguard "
                   f"{[round(v * ms, 2) for v in out['memguard']]}, "
                   f"plain {[round(v * ms, 2) for v in out['plain']]}")]


BENCHMARKS = [hf_trainer, hf_trainer_cost]
