"""record_history where there is no CUDA: it warns once and does nothing (the GPU side is in
test_gpu.py)."""

from __future__ import annotations

import warnings

import pytest
import torch

import memguard
from memguard import history


@pytest.fixture
def fresh_warning(monkeypatch):
    monkeypatch.setattr(history, "_warned", False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")
def test_without_cuda_it_warns_once_and_does_nothing(tmp_path, fresh_warning):
    path = tmp_path / "snap.pickle"
    with pytest.warns(RuntimeWarning, match="needs CUDA"):
        with memguard.record_history(str(path), on_oom_only=False) as recorder:
            torch.ones(10)
    assert recorder.dumped is None and not path.exists()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with memguard.record_history(str(path)):
            pass


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")
def test_oom_retry_snapshot_dir_without_cuda(tmp_path, fresh_warning):
    @memguard.oom_retry(batch_size=4, cuda_snapshot_dir=str(tmp_path))
    def step(batch_size):
        torch.empty(batch_size * (1 << 42) if batch_size > 1 else 1)
        return batch_size

    with pytest.warns(RuntimeWarning, match="needs CUDA"):
        assert step() == 1
    assert all(a.snapshot_path is None for a in step.history)
    assert list(tmp_path.iterdir()) == []


def test_record_history_checks_its_arguments_and_decorates(fresh_warning):
    with pytest.raises(ValueError, match="max_entries"):
        memguard.record_history(max_entries=0)
    with pytest.raises(TypeError, match="path must be a string"):
        memguard.record_history(3)

    @memguard.record_history("unused.pickle")
    def work(x):
        """Doc."""
        return x + 1

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert work(1) == 2 and work.__doc__ == "Doc."
