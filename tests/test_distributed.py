"""Ranks agree: three gloo processes on this machine, one with a smaller memory budget.

A hang is the failure this guards against, so every run has a deadline.
"""

from __future__ import annotations

import pytest

from budget import free_port, run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ranks")]  # ranks run alone (-n 2)

WORKER = """
import torch, torch.distributed as dist
import memguard
torch.set_num_threads(1)
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", rank=rank, world_size=world)
UNIT = 50 * 2**20 // 4

def attempt(batch_size):
    first = torch.ones(batch_size * UNIT)
    second = torch.ones(batch_size * UNIT)
    return batch_size

memguard.oom_retry(batch_size=1)(attempt)()  # warm up: torch, gloo's buffers and threads
memguard.free_memory()
set_budget(300 if rank == 1 else 1500)  # rank 1 fits 2 x 50 MiB x 2 only

train = memguard.oom_retry(batch_size=8)(attempt)
result = train()
sizes = [a.size for a in train.history]
again = train()
found = memguard.find_batch_size(attempt, margin=0.0, start=1, max_batch_size=16)

@memguard.oom_retry(batch_size=4)
def broken(batch_size):
    if rank == 2:
        raise ValueError("rank 2 has bad data")
    return attempt(batch_size)

try:
    broken()
    broken_outcome = "returned"
except ValueError as exc:
    broken_outcome = "ValueError: " + str(exc)
except memguard.MemguardError as exc:
    broken_outcome = "MemguardError: " + str(exc)
dist.destroy_process_group()
finish({"rank": rank, "result": result, "sizes": sizes,
       "again": len(train.history), "found": found, "broken": broken_outcome})
"""


def test_three_ranks_retry_together_and_finish_alike():
    outputs = run_ranks(WORKER)
    for out in outputs:
        assert out["result"] == 2 and out["sizes"] == [8, 4, 2], outputs
        assert out["again"] == 1  # the cached size, on every rank
        assert out["found"] == outputs[1]["found"]  # everyone adopts the smallest rank's size
    assert 1 <= outputs[1]["found"] < 4
    assert outputs[2]["broken"] == "ValueError: rank 2 has bad data"
    for rank in (0, 1):
        assert outputs[rank]["broken"].startswith("MemguardError: broken: another rank failed")


def test_process_group_is_not_kept_alive_after_destroy(python_in_subprocess):
    """memguard must not hold the process group once the user destroyed it: its C++
    destructor (gloo's threads) would then run at interpreter shutdown, where it can abort
    the process ("terminate called without an active exception") after a clean run."""
    out = python_in_subprocess(f"""
        import gc, json, os, weakref
        import torch.distributed as dist
        import memguard
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{free_port()}")
        dist.init_process_group("gloo", rank=0, world_size=1)

        @memguard.oom_retry(batch_size=4, sync=True)  # one all-reduce at the attempt's end
        def step(batch_size):
            return batch_size

        result = step()
        world = weakref.ref(dist.group.WORLD)
        dist.destroy_process_group()
        gc.collect()
        print(json.dumps({{"result": result, "alive": world() is not None}}))
    """)
    assert out == {"result": 4, "alive": False}


def test_world_follows_the_default_group_being_made_and_destroyed(python_in_subprocess):
    """``world()`` runs on every guarded call and reads torch's record of the default group
    directly: it must still see the group come and go."""
    out = python_in_subprocess(f"""
        import json, os
        import torch.distributed as dist
        from memguard.backends.torch_distributed import world
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{free_port()}")
        before = world()
        dist.init_process_group("gloo", rank=0, world_size=1)
        during = world()
        dist.destroy_process_group()
        print(json.dumps({{"before": before, "during": during, "after": world()}}))
    """)
    assert out == {"before": None, "during": [0, 1], "after": None}


ONE_RANK_ONLY = """
import time
import torch.distributed as dist
import memguard
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", rank=rank, world_size=world)
dist.barrier()

@memguard.oom_retry(batch_size=4)  # sync="auto": takes part in the agreement
def evaluate(batch_size):
    return batch_size

outcome, waited = "not called", 0.0
if rank == 0:  # the peer never makes the guarded call
    start = time.monotonic()
    try:
        outcome = "returned %r" % evaluate()
    except memguard.MemguardError as exc:
        outcome = "MemguardError: " + str(exc)
    waited = time.monotonic() - start
else:
    time.sleep(8)  # busy elsewhere, past rank 0's short timeout
finish({"rank": rank, "outcome": outcome, "waited": waited})
"""


def test_a_guarded_call_on_one_rank_only_raises_after_the_timeout(monkeypatch):
    """``if rank == 0: evaluate()`` with a guarded ``evaluate`` used to wait for rank 1
    forever; with a short MEMGUARD_SYNC_TIMEOUT rank 0 raises an error naming the fix."""
    monkeypatch.setenv("MEMGUARD_SYNC_TIMEOUT", "2")
    outputs = run_ranks(ONE_RANK_ONLY, world=2, timeout=60)
    first = outputs[0]
    assert first["outcome"].startswith("MemguardError: rank 0: the other ranks did not reach"), \
        outputs
    assert "sync=False" in first["outcome"] and "collective of your own" in first["outcome"]
    assert 2 <= first["waited"] < 7, outputs  # the timeout, not the peer's return, ended it
    assert outputs[1]["outcome"] == "not called"


OWN_COLLECTIVE = """
import datetime, time
import torch, torch.distributed as dist
import memguard
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
# the program's own group ends a collective whose peer is gone after 15 s, not 30 minutes
dist.init_process_group("gloo", rank=rank, world_size=world,
                        timeout=datetime.timedelta(seconds=15))
torch.manual_seed(0)
model = torch.nn.Linear(3, 1)

@memguard.auto_microbatch(model)
def step(batch):
    if rank == 1 and len(batch) > 4:  # rank 1 alone runs out of memory, before the count
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    count = torch.tensor([float(len(batch))])
    dist.all_reduce(count)  # a collective of the program's own (a token count, a metric)
    return model(batch).pow(2).sum() / count

dist.barrier()
start = time.monotonic()
try:
    step(torch.ones(8, 3))
    outcome = "returned"
except Exception as exc:
    outcome = type(exc).__name__ + ": " + str(exc)
finish({"rank": rank, "outcome": outcome, "waited": time.monotonic() - start})
"""


def test_a_collective_of_the_programs_own_in_the_step_ends_with_an_error(monkeypatch):
    """An all_reduce inside an auto_microbatch step, one rank out of memory before it: that
    rank waits in memguard's agreement while its peer waits in the program's all_reduce.
    Once used to hang; now the rank that ran out raises a MemguardError naming the cause
    after MEMGUARD_SYNC_TIMEOUT, and its peer's collective ends with an error too."""
    monkeypatch.setenv("MEMGUARD_SYNC_TIMEOUT", "2")
    outputs = run_ranks(OWN_COLLECTIVE, world=2, timeout=90)
    failed, peer = outputs[1], outputs[0]
    assert failed["outcome"].startswith("MemguardError: rank 1"), outputs
    assert "collective of your own" in failed["outcome"], outputs
    assert 2 <= failed["waited"] < 10, outputs
    assert peer["outcome"] != "returned" and peer["waited"] < 60, outputs


DRIFT = """
import torch, torch.distributed as dist
import memguard
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", rank=rank, world_size=world)
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 2))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

@memguard.auto_microbatch(model)
def step(batch):
    return model(batch).pow(2).mean()

outcome, steps = "trained", 0
try:
    for i in range(40):
        optimizer.zero_grad()
        step(torch.randn(4, 3))
        if not (SKIP and rank == 1 and i == 5):  # an out-of-memory in the step, caught
            optimizer.step()
        steps += 1
except memguard.MemguardError as exc:
    outcome = str(exc)
dist.destroy_process_group()
finish({"rank": rank, "outcome": outcome, "steps": steps})
"""


@pytest.mark.parametrize("skip", [True, False])
def test_weights_that_drift_apart_across_ranks_are_named(skip):
    """An optimizer step skipped on one rank (its out-of-memory caught) leaves the DDP
    replicas apart for good; memguard compares a sample of the weights every 32 calls."""
    outputs = run_ranks(f"SKIP = {skip}\n" + DRIFT, world=2, timeout=90)
    for out in outputs:
        if skip:
            assert out["steps"] == 31, outputs  # the 32nd call compared and raised
            assert "weights differ between the ranks" in out["outcome"], outputs
            assert "optimizer.step()" in out["outcome"]
        else:
            assert out == {"rank": out["rank"], "outcome": "trained", "steps": 40}, outputs
