"""``oom_retry(factor="auto")`` against real budgets: what the next attempt can really use,
memory that grows in the middle of a run, and a ladder no longer than halving's.

Every out-of-memory is real: torch CPU tensors in a subprocess under a soft RLIMIT_AS
(``set_budget``) or :func:`memguard.memory_limit`, with one malloc arena and one thread.
"""

from __future__ import annotations

import math

import pytest

from budget import ENV, script

MiB = 1 << 20

# Steps of a training-like loop whose sequences double at step 4: each step holds its
# activations (pieces of 16 KiB per sample, under malloc's mmap threshold once it has risen,
# so freed ones stay in the heap) and a 0.5 MiB-per-sample output.
GROWING = """
import math
import torch, memguard
torch.set_num_threads(1)
PIECE = 16 * 1024 // 4
UNIT = 2**20 // 4
calls = []

def train(batch_size):
    calls.append(batch_size)
    for step in range(6):
        pieces = 32 if step < 4 else 64
        activations = [torch.ones(batch_size * PIECE) for _ in range(pieces)]
        output = torch.ones(batch_size * UNIT // 2 * (pieces // 32))
        del activations, output
    return batch_size

def fits(size):
    memguard.free_memory()
    try:
        train(size)
        return True
    except RuntimeError:
        return False

train(1)
memguard.free_memory()
"""


@pytest.mark.slow
def test_auto_factor_reaches_most_of_the_largest_size_when_memory_grows_mid_run(
        python_in_subprocess):
    """The start fails in the first, short steps, the measured guess in the long ones; the
    size found is most of the largest, in no more attempts than halving from the start takes
    to get under the largest. (Where the heap is left mapped after a failure, the largest
    shrinks with it: the third attempt fits in most runs, the fourth in the others.)"""
    out = python_in_subprocess(script(GROWING, """
        set_budget(400)
        found = memguard.oom_retry(batch_size=640, factor="auto")(train)()
        attempts = list(calls[1:])
        above = math.floor(found / 0.85) + 1  # the size that must not fit
        found_fits = fits(found)  # first: a failure leaves the heap more fragmented
        print(json.dumps({"found": found, "attempts": attempts, "above": above,
                          "found_fits": found_fits, "above_fits": fits(above)}))
    """), env=ENV, timeout=300)
    assert out["found_fits"] and not out["above_fits"], out  # found >= 0.85 of the largest
    # the largest is under ``above``: halving from 640 gets under it at this attempt at best
    halving = math.floor(math.log2(640 / out["above"])) + 2
    assert len(out["attempts"]) <= halving, (halving, out)


@pytest.mark.slow
def test_available_memory_counts_what_malloc_holds_free_under_memory_limit(python_in_subprocess):
    """Blocks freed below live ones stay mapped (address space) but the next allocations
    reuse them: the budget's ``available`` gives them back."""
    out = python_in_subprocess(script("""
        import torch, memguard
        from memguard.backends.budget import budget
        torch.set_num_threads(1)
        with memguard.memory_limit("300MiB", device="host"):
            warm = [torch.ones(2 * 2**20 // 4) for _ in range(8)]  # raise the mmap threshold
            del warm
            memguard.free_memory()
            before = budget("host")
            blocks = [torch.ones(2 * 2**20 // 4) for _ in range(64)]  # 128 MiB on the heap
            held = budget("host")
            del blocks[:40]  # 80 MiB freed in one run below live blocks
            memguard.free_memory()
            after = budget("host")
            again = [torch.ones(2 * 2**20 // 4) for _ in range(32)]
            reused = budget("host")
        print(json.dumps({"before": before.available, "held": held.available,
                          "after": after.available, "after_used": after.used,
                          "held_used": held.used, "reused": reused.used,
                          "reusable": getattr(after, "reusable", 0), "text": str(after)}))
    """), env=ENV)
    assert out["before"] - out["held"] > 120 * MiB, out  # the blocks took it
    assert out["held_used"] - out["after_used"] < 16 * MiB, out  # the 80 MiB run stays mapped...
    assert out["after"] - out["held"] > 72 * MiB, out  # ...yet is available again
    assert out["reusable"] > 72 * MiB and "free in the allocator" in out["text"], out
    assert out["reused"] - out["after_used"] < 24 * MiB, out  # and mostly reused (of 64 MiB)


# An attempt that holds 12 pieces of 1 MiB per sample, allocated one by one: every failure
# names the same 1 MiB request, so the measured need is hardly more than what was available.
SAME_REQUEST = """
import torch, memguard
torch.set_num_threads(1)
calls = []

def attempt(batch_size):
    calls.append(batch_size)
    held = [torch.ones(2**20 // 4) for _ in range(12 * batch_size)]
    return batch_size

attempt(1)
memguard.free_memory()
set_budget(130)  # 8 x 12 MiB fits with room to spare, 16 x 12 MiB does not
"""


@pytest.mark.slow
def test_auto_factor_ladder_is_no_longer_than_halving_when_each_error_names_the_same_request(
        python_in_subprocess):
    out = python_in_subprocess(script(SAME_REQUEST, """
        ladders = {}
        for factor in (0.5, "auto"):
            calls.clear()
            memguard.free_memory()
            found = memguard.oom_retry(batch_size=64, factor=factor)(attempt)()
            ladders[str(factor)] = {"found": found, "calls": list(calls)}
        print(json.dumps(ladders))
    """), env=ENV, timeout=300)
    halving, auto = out["0.5"], out["auto"]
    assert len(halving["calls"]) == 4 and halving["found"] == 8, out  # 64, 32, 16, 8
    assert len(auto["calls"]) <= len(halving["calls"]), out
    assert auto["found"] >= halving["found"], out
