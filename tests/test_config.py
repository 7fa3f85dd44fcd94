from __future__ import annotations

import os
import resource

import pytest
import torch

import memguard
from memguard.config import ALLOC_VARIABLES

GiB = 1 << 30


@pytest.fixture
def clean_alloc_env(monkeypatch):
    for name in ALLOC_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def test_configure_allocator_writes_both_variables(clean_alloc_env):
    text = memguard.configure_allocator(max_split_size_mb=128, expandable_segments=True,
                                        garbage_collection_threshold=0.6,
                                        roundup_power2_divisions=4, backend="native")
    assert text == ("max_split_size_mb:128,expandable_segments:True,"
                    "garbage_collection_threshold:0.6,backend:native,roundup_power2_divisions:4")
    assert os.environ["PYTORCH_ALLOC_CONF"] == os.environ["PYTORCH_CUDA_ALLOC_CONF"] == text


def test_configure_allocator_merges_with_what_is_there(clean_alloc_env, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF",
                       "max_split_size_mb:64,roundup_power2_divisions:[256:1,512:2]")
    text = memguard.configure_allocator(max_split_size_mb=512)
    assert text == "max_split_size_mb:512,roundup_power2_divisions:[256:1,512:2]"
    assert os.environ["PYTORCH_ALLOC_CONF"] == text


@pytest.mark.parametrize("kwargs, error, match", [
    ({"max_split_size_mb": 20}, ValueError, r"max_split_size_mb must be an int >= 21, got 20"),
    ({"max_split_size_mb": "128"}, ValueError, "max_split_size_mb"),
    ({"expandable_segments": "yes"}, TypeError, "expandable_segments must be True or False"),
    ({"garbage_collection_threshold": 1.0}, ValueError,
     r"garbage_collection_threshold must be a number between 0 and 1 \(exclusive\)"),
    ({"backend": "cudaMalloc"}, ValueError, "backend must be 'native' or 'cudaMallocAsync'"),
    ({"roundup_power2_divisions": 3}, ValueError,
     "roundup_power2_divisions must be a power of two"),
])
def test_configure_allocator_validates(clean_alloc_env, kwargs, error, match):
    with pytest.raises(error, match=match):
        memguard.configure_allocator(**kwargs)
    assert "PYTORCH_ALLOC_CONF" not in os.environ


def test_memory_limit_gives_a_real_oom_and_restores(tmp_path):
    before = resource.getrlimit(resource.RLIMIT_AS)
    with memguard.memory_limit("256MiB", device="host") as limit:
        assert limit.limit == 256 << 20
        with pytest.raises(RuntimeError) as info:
            torch.ones(GiB // 4)
        assert memguard.is_oom_error(info.value)
    assert resource.getrlimit(resource.RLIMIT_AS) == before
    assert torch.ones(GiB // 4).numel() == GiB // 4


def test_memory_limit_restores_when_the_body_raises():
    before = resource.getrlimit(resource.RLIMIT_AS)
    with pytest.raises(KeyError):
        with memguard.memory_limit("1GiB"):
            raise KeyError("x")
    assert resource.getrlimit(resource.RLIMIT_AS) == before


def test_memory_limit_refuses_what_it_cannot_do():
    with pytest.raises(RuntimeError, match="LogicalDeviceConfiguration"):
        memguard.memory_limit("1GiB", device="GPU:0")
    with pytest.raises(ValueError, match="device must be 'host', 'cuda' or 'cuda:N'"):
        memguard.memory_limit("1GiB", device="tpu")
    with pytest.raises(ValueError, match="'lots'"):
        memguard.memory_limit("lots")
    with pytest.raises(ValueError, match="limit must be positive"):
        memguard.memory_limit(0)


@pytest.mark.slow
def test_tf_memory_growth(python_in_subprocess):
    out = python_in_subprocess("""
        import json
        import tensorflow as tf
        import memguard
        count = memguard.tf_memory_growth()
        tf.constant(1.0)
        try:
            memguard.tf_memory_growth(False)
            late = "no error"
        except RuntimeError as exc:
            late = str(exc)
        print(json.dumps({"count": count, "gpus": len(tf.config.list_physical_devices("GPU")),
                          "late": late}))
    """)
    assert out["count"] == out["gpus"]
    if out["gpus"]:
        assert "call it before any TensorFlow op" in out["late"]
    else:
        assert out["late"] == "no error"  # nothing to set without GPUs


def test_tf_memory_growth_checks_its_argument():
    with pytest.raises(TypeError, match="enable must be True or False"):
        memguard.tf_memory_growth("yes")


@pytest.mark.gpu
def test_memory_limit_on_cuda():
    total = torch.cuda.get_device_properties(0).total_memory
    with memguard.memory_limit("512MiB", device="cuda:0"):
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    block = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    assert block.numel() == 1 << 30 and total > 1 << 30


@pytest.mark.gpu
def test_configure_allocator_warns_once_cuda_is_initialised(clean_alloc_env):
    torch.zeros(1, device="cuda")
    with pytest.warns(RuntimeWarning, match="cannot take effect"):
        memguard.configure_allocator(expandable_segments=True)
