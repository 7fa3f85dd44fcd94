"""How each kind of budget reads in snapshots and out-of-memory messages."""

from __future__ import annotations

import itertools
import re

import pytest

import memguard
from memguard.backends.budget import MEASURES, Budget, budget

MiB, GiB = 1 << 20, 1 << 30
# kind -> (limit, used, its short text, its line)
TEXTS = {
    "memory_limit": (60 * MiB, 42 * MiB, "42.0 MiB of the 60.0 MiB memory_limit (address space)",
                     ("host: memory_limit 60.0 MiB (address space), 42.0 MiB used, 18.0 MiB "
                     "available")),
    "RLIMIT_AS": (8 * GiB, 3 * GiB, "3.0 GiB of the 8.0 GiB RLIMIT_AS (address space)",
                  "host: RLIMIT_AS 8.0 GiB (address space), 3.0 GiB used, 5.0 GiB available"),
    "cgroup memory.max": (2 * GiB, GiB, "1.0 GiB of the 2.0 GiB cgroup memory.max",
                          "host: cgroup memory.max 2.0 GiB, 1.0 GiB used, 1.0 GiB available"),
    "physical memory": (int(23.5 * GiB), 995 * MiB, "995.0 MiB of 23.5 GiB physical memory",
                        "host: physical memory 23.5 GiB, 995.0 MiB used, 22.5 GiB available"),
    "CUDA memory fraction": (16 * GiB, 15 * GiB,
                             "15.0 GiB of the 16.0 GiB CUDA memory fraction (allocator memory)",
                             ("cuda:0: CUDA memory fraction 16.0 GiB (allocator memory), 15.0 GiB "
                             "used, 1.0 GiB available")),
    "CUDA device": (80 * GiB, 79 * GiB, "79.0 GiB of 80.0 GiB device memory",
                    ("cuda:0: CUDA device 80.0 GiB (device memory), 79.0 GiB used, 1.0 GiB "
                    "available")),
}


def repeated(text: str) -> list[str]:
    """The two-word phrases ``text`` says more than once (a budget that names itself twice)."""
    words = [w for w in re.findall(r"[A-Za-z_]+(?:\.[A-Za-z_]+)*", text)
             if w not in ("B", "KiB", "MiB", "GiB", "TiB")]
    pairs = [" ".join(pair) for pair in itertools.pairwise(words)]
    return sorted({p for p in pairs if pairs.count(p) > 1})


def test_every_kind_has_its_text():
    assert TEXTS.keys() == MEASURES.keys()


@pytest.mark.parametrize("kind", list(TEXTS))
def test_each_kind_reads_once_and_naturally(kind):
    limit, used, short, line = TEXTS[kind]
    found = Budget("cuda:0" if kind.startswith("CUDA") else "host", kind, limit, used)
    assert found.short() == short
    assert str(found) == line
    assert repeated(found.short()) == [] and repeated(str(found)) == []


def test_a_kind_memguard_does_not_know_reads_plainly():
    found = Budget("host", "slurm job limit", 4 * GiB, GiB)
    assert found.short() == "1.0 GiB of the 4.0 GiB slurm job limit"
    assert str(found) == "host: slurm job limit 4.0 GiB, 1.0 GiB used, 3.0 GiB available"


def test_an_out_of_memory_message_names_the_binding_budget_once():
    binding = budget("host")
    assert binding is not None

    @memguard.oom_retry(batch_size=2, cache=False)
    def attempt(batch_size):
        return bytearray(batch_size << 61)  # a real MemoryError: no allocator gives 4 EiB

    with pytest.raises(memguard.OutOfMemoryError) as caught:
        attempt()
    message = str(caught.value)
    limit_and_kind = binding.short().split(" of ", 1)[1]  # "23.5 GiB physical memory"
    assert re.search(r"host [\d.]+ [KMGT]?i?B of " + re.escape(limit_and_kind), message), message
    for part in message.split("; "):
        assert repeated(part) == [], part


def test_a_snapshot_lists_its_budgets_once_each():
    lines = [line for line in str(memguard.snapshot()).splitlines() if line.startswith("budget ")]
    assert lines, "the host always has a budget (physical memory at least)"
    for line in lines:
        assert repeated(line) == [], line


@pytest.mark.gpu
def test_a_cuda_budget_reads_once():
    import torch

    torch.ones(1, device="cuda")
    found = budget("cuda:0")
    assert found is not None and found.kind in ("CUDA device", "CUDA memory fraction")
    assert repeated(found.short()) == [] and repeated(str(found)) == []
    if found.kind == "CUDA device":
        assert found.short().endswith(" device memory"), found.short()
