"""Bad input is a clear error at the call, and small API traps are closed (issue "Reliability")."""

from __future__ import annotations

import logging
import types

import pytest
import torch

import memguard
from memguard.backends import Backend, check_device, check_devices, is_keras_model
from memguard.cleanup import empty_caches, read_all

MiB = 1 << 20


# -- devices ------------------------------------------------------------------------------------
def test_memory_scope_refuses_devices_that_are_not_names():
    with pytest.raises(TypeError, match=r"devices: expected None .*got 5 of type int"):
        with memguard.memory_scope(devices=5):
            pass
    with pytest.raises(TypeError, match=r"devices must be a string such as .*got 5 of type int"):
        memguard.snapshot(["host", 5])


@pytest.mark.parametrize("name", ["bogus", "cuda:x", "host:0", "cuda:0:1", ""])
def test_malformed_device_names_are_refused_whether_or_not_a_framework_is_imported(name):
    with pytest.raises(ValueError, match=f"unknown device {name!r}; use 'host', 'cuda'"):
        check_device(name)


def test_device_selection_is_checked_without_reading_devices():
    assert check_devices(None) is None
    assert check_devices("GPU:0") == ("GPU:0",)  # TensorFlow not imported: a name all the same
    assert check_devices(d for d in ["host", "cuda"]) == ("host", "cuda")


@pytest.mark.parametrize("call", [
    lambda: memguard.live_tensors("bogus"),
    lambda: memguard.live_tensors("cuda:x"),
    lambda: memguard.memory_report(device="bogus"),
])
def test_census_on_an_unknown_device_is_an_error_not_an_empty_answer(call):
    keep = torch.ones(MiB)  # a live tensor: an empty answer would be a lie
    with pytest.raises(ValueError, match=r"device: unknown device '(bogus|cuda:x)'"):
        call()
    del keep


def test_census_on_real_device_names_still_answers():
    keep = torch.ones(MiB // 4)
    assert id(keep) in {info.id for info in memguard.live_tensors("cpu")}
    assert id(keep) in {info.id for info in memguard.live_tensors("host")}
    assert memguard.live_tensors("cuda:0") == []  # no CUDA tensor on a CPU machine
    assert memguard.memory_report(device="cuda") == "no live tensors on cuda"


def test_live_tensors_min_bytes_takes_size_strings():
    big, small = torch.ones(2 * MiB // 4), torch.ones(MiB // 8)  # 2 MiB and 512 KiB
    found = {info.id for info in memguard.live_tensors(min_bytes="1MiB")}
    assert id(big) in found and id(small) not in found
    assert found == {info.id for info in memguard.live_tensors(min_bytes=MiB)}
    with pytest.raises(ValueError, match=r"live_tensors: min_bytes: cannot read 'lots'"):
        memguard.live_tensors(min_bytes="lots")


# -- free_memory --------------------------------------------------------------------------------
def test_free_memory_used_as_a_decorator_is_a_type_error_pointing_to_frees_memory():
    with pytest.raises(TypeError, match=r"free_memory\(\) takes 0 positional arguments"):
        @memguard.free_memory
        def train():
            return 1


def test_free_memory_keras_is_keyword_only_and_a_bool():
    with pytest.raises(TypeError, match=r"free_memory\(\) takes 0 positional arguments"):
        memguard.free_memory(True)
    with pytest.raises(TypeError, match=r"keras must be True or False, got 'yes'"):
        memguard.free_memory(keras="yes")
    assert memguard.free_memory(keras=False) >= 0


# -- Keras models -------------------------------------------------------------------------------
def test_is_keras_model_tells_keras_models_and_layers_from_anything_else(python_in_subprocess):
    result = python_in_subprocess("""
        import json, sys
        import keras
        import memguard
        from memguard.backends import is_keras_model
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        try:
            memguard.inference_mode(model)
            refused = None
        except TypeError as exc:
            refused = str(exc)
        print(json.dumps({"model": is_keras_model(model),
                          "layer": is_keras_model(keras.layers.Dense(2)),
                          "module": type(model).__module__, "refused": refused}))
    """, timeout=180)
    assert "training=False" in result.pop("refused")  # not "AttributeError: __enter__"
    assert result == {"model": True, "layer": True, "module": "keras.src.models.sequential"}
    assert not is_keras_model(torch.nn.Linear(2, 2))
    assert not is_keras_model(object) and not is_keras_model(None)
    # a look-alike outside Keras, and a package whose name only starts with "keras"
    for module in ("mylib.nets", "keras_contrib.models"):
        Model = types.new_class("Model")
        Model.__module__ = module
        assert not is_keras_model(Model())


# -- logging ------------------------------------------------------------------------------------
class _Broken(Backend):
    """A backend whose driver went away: every reading and every emptying fails."""

    name = "broken"

    def devices(self) -> list:
        return ["dev:0"]

    def owns(self, device: str) -> bool:
        return device.startswith("dev")

    def read(self, device: str):
        raise OSError("the driver went away")

    def reset_peak(self, device: str) -> bool:
        return False

    def empty_cache(self) -> None:
        raise OSError("no cache here")


def test_a_peak_counter_that_cannot_be_read_is_still_reset(caplog):
    """A scope's entry reads a device's peak counter, resets it and reads it again
    (``Backend.swap_peak``): a read that fails is logged, and the reset still runs, so the
    scope's peak is not the counter's from before it."""
    from memguard.scope import peak_book

    class Unreadable(_Broken):
        resets = 0

        def reset_peak(self, device: str) -> bool:
            self.resets += 1
            return True

    backend, counters = Unreadable(), {}
    with caplog.at_level(logging.WARNING, logger="memguard"):
        peak_book.enter(1, [(backend, "dev:0")], counters)
        peaks = peak_book.exit(1, [(backend, "dev:0")], counters)
    assert backend.resets == 1
    assert counters == {"dev:0": None} and peaks == {"dev:0": None}
    assert [r.getMessage() for r in caplog.records] == [
        "read_peak(dev:0) failed: the driver went away",
        "peak_after_reset(dev:0) failed: the driver went away",
        "read_peak(dev:0) failed: the driver went away"]


def test_log_messages_do_not_repeat_the_logger_name(caplog):
    with caplog.at_level(logging.WARNING, logger="memguard"):
        assert read_all([(_Broken(), "dev:0")]) == {"dev:0": (None, None)}
        empty_caches([_Broken()])
    assert [r.name for r in caplog.records] == ["memguard", "memguard"]
    assert [r.getMessage() for r in caplog.records] == [
        "cannot read dev:0: the driver went away",
        "emptying the broken cache failed: no cache here"]
