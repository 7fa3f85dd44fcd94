from __future__ import annotations

import json

import pytest
import torch

import memguard

MiB = 1 << 20


def test_snapshot_reads_every_active_device():
    snap = memguard.snapshot()
    assert next(iter(snap.devices)) == "host"
    host = snap["host"]
    assert host.device == "host" and host.reserved > 0 and host.total > host.free > 0
    assert snap.time > 0 and not snap.delta


def test_difference_of_two_snapshots_measures_an_allocation():
    memguard.free_memory()  # resident free heap would hide the growth of the resident set
    before = memguard.snapshot("host")
    block = torch.ones(64 * MiB // 4)
    after = memguard.snapshot(["host"])
    delta = after - before
    assert delta.delta and list(delta) == ["host"]
    assert 56 * MiB < delta["host"].reserved < 96 * MiB
    assert delta.time >= 0
    del block


def test_to_dict_is_json_ready_and_complete():
    data = json.loads(json.dumps(memguard.snapshot().to_dict()))
    assert set(data) == {"time", "delta", "devices", "budgets"}
    assert set(data["devices"]["host"]) == {"device", "allocated", "reserved", "peak", "free",
                                            "total"}
    assert set(data["budgets"]["host"]) == {"device", "kind", "limit", "used", "reusable",
                                            "available", "measure"}


def test_snapshot_names_the_budget_in_force_and_what_of_it_is_used(python_in_subprocess):
    """Under a 60 MiB memory_limit the host's budget is that limit, counted in address space,
    not the machine's physical memory. In a fresh process: late in a long session a 20 MiB
    block can come from heap that earlier tests freed, and take no new address space."""
    out = python_in_subprocess("""
        import json
        import torch, memguard
        MiB = 2**20
        free = memguard.snapshot()["host"]
        outside = memguard.snapshot().budgets["host"].kind
        with memguard.memory_limit("60MiB", device="host"):
            before = memguard.snapshot()
            block = torch.ones(20 * MiB // 4)
            after = memguard.snapshot()
            del block
        limit = after.budgets["host"]
        print(json.dumps({
            "outside": outside, "kind": limit.kind, "limit": limit.limit,
            "measure": limit.measure, "grew": limit.used - before.budgets["host"].used,
            "available": limit.available, "used": limit.used, "reusable": limit.reusable,
            "line": "budget host: memory_limit 60.0 MiB (address space" in str(after),
            "after_block": memguard.snapshot().budgets["host"].kind,
            "delta": dict((after - before).budgets), "total": free.total}))
    """)
    MiB = 2**20
    assert out["outside"] in ("physical memory", "RLIMIT_AS", "cgroup memory.max")
    assert out["kind"] == "memory_limit" and out["limit"] == 60 * MiB
    assert out["measure"] == "address space"
    assert 18 * MiB < out["grew"] < 32 * MiB, out  # the block, plus first-use mappings
    # what is left of the limit, and what malloc holds free in what is used
    assert out["available"] == out["limit"] - out["used"] + out["reusable"]
    assert out["limit"] - out["used"] < 42 * MiB
    assert out["line"] and out["after_block"] != "memory_limit"  # gone after the block
    assert out["delta"] == {} and out["total"] > 60 * MiB


def test_str_is_an_aligned_table_in_binary_units():
    before = memguard.snapshot("host")
    block = torch.ones(64 * MiB // 4)
    after = memguard.snapshot("host")
    del block
    lines = str(after).splitlines()
    assert lines[0].split() == ["device", "allocated", "reserved", "peak", "free", "total"]
    assert lines[1].startswith("host") and "iB" in lines[1]
    assert len(lines[0]) == len(lines[1])
    delta_row = str(after - before).splitlines()[1]
    assert delta_row.startswith("host") and "+64.0 MiB" in delta_row  # malloc's count grew


def test_missing_device_names_what_is_there():
    with pytest.raises(KeyError, match=r"'cuda:7'.*host"):
        memguard.snapshot()["cuda:7"]


def test_snapshot_is_immutable():
    snap = memguard.snapshot()
    with pytest.raises(TypeError):
        snap.devices["x"] = None  # type: ignore[index]
    with pytest.raises(AttributeError):
        snap.time = 0  # type: ignore[misc]
