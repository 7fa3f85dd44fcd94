"""CUDA (and ROCm) through torch: run wherever a GPU is present, skipped elsewhere."""

from __future__ import annotations

import gc
import os

import pytest
import torch

import memguard

MiB = 1 << 20
pytestmark = pytest.mark.gpu


def cuda_cycle(mib: int) -> None:
    holder: list = [torch.ones(mib * MiB // 4, device="cuda")]
    holder.append(holder)


def test_cuda_is_listed_only_once_the_program_used_it(python_in_subprocess):
    out = python_in_subprocess("""
        import json
        import torch
        import memguard
        before = memguard.list_devices()
        initialised = torch.cuda.is_initialized()
        torch.zeros(1, device="cuda")
        print(json.dumps({"before": before, "initialised": initialised,
                          "after": memguard.list_devices()}))
    """)
    assert out["before"] == ["host"] and out["initialised"] is False
    assert out["after"][:2] == ["host", "cuda:0"]


def test_device_memory_reads_the_caching_allocator():
    block = torch.ones(64 * MiB // 4, device="cuda")
    mem = memguard.snapshot("cuda:0")["cuda:0"]
    assert mem.allocated >= 64 * MiB and mem.reserved >= mem.allocated
    assert mem.peak >= mem.allocated and 0 < mem.free < mem.total
    del block


def test_scope_frees_a_cuda_cycle_and_empties_the_grown_cache():
    torch.cuda.empty_cache()
    gc.disable()
    try:
        with memguard.memory_scope(devices="cuda") as scope:
            cuda_cycle(256)
    finally:
        gc.enable()
    assert scope.retained["cuda:0"] < 2 * MiB
    assert scope.peak["cuda:0"] - scope.before["cuda:0"].allocated >= 256 * MiB
    assert scope.freed >= 200 * MiB  # the cache the cycle grew went back to the driver
    assert torch.cuda.memory_reserved() - scope.before["cuda:0"].reserved < 64 * MiB


def test_scope_reports_a_kept_cuda_tensor_and_max_leak():
    with pytest.raises(memguard.MemoryLeakError, match="cuda:0"):
        with memguard.memory_scope(devices=["cuda:0"], max_leak="16MiB") as scope:
            kept = torch.ones(128 * MiB // 4, device="cuda")
    assert 127 * MiB <= scope.retained["cuda:0"] <= 130 * MiB
    del kept


def test_nested_cuda_peaks():
    with memguard.memory_scope(devices="cuda:0") as outer:
        big = torch.ones(512 * MiB // 4, device="cuda")
        del big
        with memguard.memory_scope(devices="cuda:0") as inner:
            small = torch.ones(64 * MiB // 4, device="cuda")
            del small
    assert outer.peak["cuda:0"] - outer.before["cuda:0"].allocated >= 512 * MiB
    assert inner.peak["cuda:0"] - inner.before["cuda:0"].allocated < 128 * MiB


def test_free_memory_returns_the_cache_to_the_driver():
    block = torch.ones(256 * MiB // 4, device="cuda")
    del block
    assert torch.cuda.memory_reserved() >= 256 * MiB
    assert memguard.free_memory() >= 256 * MiB
    assert torch.cuda.memory_reserved() < 256 * MiB


def test_inference_mode_on_a_cuda_model():
    model = torch.nn.Linear(256, 256).cuda().train()
    with memguard.inference_mode(model):
        out = model(torch.ones(8, 256, device="cuda"))
    assert not out.requires_grad and model.training


def test_frees_memory_keeps_a_cuda_training_step_flat():
    model = torch.nn.Linear(1024, 1024).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @memguard.frees_memory
    def step():
        loss = model(torch.randn(512, 1024, device="cuda")).square().mean()
        holder = [loss]
        holder.append(holder)  # the classic leak: a graph kept alive by a cycle
        loss.backward()
        opt.step()
        opt.zero_grad()

    gc.disable()
    try:
        step()
        start = torch.cuda.memory_allocated()
        for _ in range(20):
            step()
    finally:
        gc.enable()
    assert torch.cuda.memory_allocated() - start < 8 * MiB


def test_oom_retry_recovers_from_a_real_cuda_oom():
    total = torch.cuda.mem_get_info()[1]
    per_sample = total // 16  # 16 samples fill the GPU: 32 cannot fit, 4 can
    ooms_before = torch.cuda.memory_stats().get("num_ooms", 0)

    @memguard.oom_retry(batch_size=32)
    def step(batch_size):
        block = torch.empty(batch_size * per_sample, dtype=torch.uint8, device="cuda")
        block.fill_(1)
        return batch_size

    found = step()
    assert found <= 8 and step.history[0].ok is False
    assert "CUDA caching allocator" in step.history[0].error or "torch.OutOfMemoryError" in \
        step.history[0].error
    assert torch.cuda.memory_stats()["num_ooms"] > ooms_before
    memguard.free_memory()
    assert torch.cuda.memory_reserved() < total // 8


def test_is_oom_error_on_a_real_cuda_oom():
    with pytest.raises(torch.OutOfMemoryError) as excinfo:
        torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
    assert memguard.is_oom_error(excinfo.value)


def test_record_history_dumps_a_snapshot_when_an_oom_passes(tmp_path):
    path = tmp_path / "oom.pickle"
    with pytest.raises(torch.OutOfMemoryError):  # noqa: PT012 - the OOM must leave the block
        with memguard.record_history(str(path)) as recorder:
            keep = torch.ones(1024, device="cuda")  # noqa: F841
            torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
    assert recorder.dumped == str(path) and path.stat().st_size > 0
    quiet = tmp_path / "quiet.pickle"
    with memguard.record_history(str(quiet)):
        torch.ones(10, device="cuda")
    assert not quiet.exists()
    always = tmp_path / "always.pickle"
    with memguard.record_history(str(always), on_oom_only=False):
        torch.ones(10, device="cuda")
    assert always.stat().st_size > 0


def test_oom_retry_writes_one_snapshot_per_failed_attempt(tmp_path):
    total = torch.cuda.mem_get_info()[1]

    @memguard.oom_retry(batch_size=64, cuda_snapshot_dir=str(tmp_path))
    def step(batch_size):
        torch.empty(batch_size * (total // 16), dtype=torch.uint8, device="cuda").fill_(1)
        return batch_size

    step()
    failed = [a for a in step.history if not a.ok]
    assert failed and all(a.snapshot_path and os.path.getsize(a.snapshot_path) > 0
                          for a in failed)
    assert len(list(tmp_path.iterdir())) == len(failed)


def test_auto_microbatch_recovers_a_real_cuda_oom_with_exact_gradients():
    """A layer whose forward needs a sixth of the GPU per 16 samples: 64 samples cannot fit,
    16 can. The split step's gradients equal a whole-batch backward computed on the CPU."""
    import copy

    total = torch.cuda.mem_get_info()[1]
    per_sample = total // 96

    class Wide(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.last = torch.nn.Linear(8, 16), torch.nn.Linear(16, 1)
            self.per_sample = per_sample

        def forward(self, x):
            scratch = torch.empty(x.shape[0] * self.per_sample, dtype=torch.uint8,
                                  device=x.device)
            scratch.fill_(1)
            return self.last(torch.relu(self.first(x)))

    torch.manual_seed(0)
    model = Wide().cuda()
    reference = copy.deepcopy(model).cpu()
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    loss_of = memguard.auto_microbatch(model)(
        lambda b: torch.nn.functional.mse_loss(model(b[0]), b[1]))
    loss = loss_of((x.cuda(), y.cuda()))
    assert loss_of.microbatch_size is not None and loss_of.microbatch_size < 64
    assert not loss_of.history[0].ok and loss_of.history[-1].ok
    reference.per_sample = 1  # the whole-batch reference runs on the host, without scratch
    expected = torch.nn.functional.mse_loss(reference(x), y)
    expected.backward()
    assert abs(loss.item() - expected.item()) < 1e-5
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert (p.grad.cpu() - q.grad).abs().max().item() < 1e-5
