import pytest

import memguard
from memguard._units import format_bytes, parse_optional_size, parse_size


@pytest.mark.parametrize("text, expected", [
    ("512MiB", 512 * 2**20), ("1.5GB", 1_500_000_000), ("1.5GiB", 3 * 2**29), ("64KiB", 65536),
    ("64kb", 64000), ("10", 10), ("10B", 10), (" 2 gib ", 2 * 2**30), ("3M", 3 * 2**20),
    ("1TiB", 2**40), (".5KiB", 512), (4096, 4096), (0, 0),
])
def test_parse_size_accepts_ints_and_unit_strings(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "MiB", "12 parsecs", "1.2.3GB", "-5MiB", "5 MiB extra"])
def test_bad_size_strings_are_quoted_in_the_error(text):
    with pytest.raises(ValueError, match=r"max_leak: cannot read .* as a size") as info:
        parse_size(text, "max_leak")
    assert repr(text) in str(info.value) and "max_leak" in str(info.value)


@pytest.mark.parametrize("value", [1.5, None, True, [1]])
def test_size_of_the_wrong_type_is_a_type_error(value):
    with pytest.raises(TypeError, match=r"int \(bytes\) or a string"):
        parse_size(value)


@pytest.mark.parametrize("value", ["9" * 400, 2**63, "9000000TiB"])
def test_sizes_larger_than_any_memory_are_a_value_error_naming_them(value):
    with pytest.raises(ValueError, match=r"max_leak: .*9.* is more bytes than any memory holds"):
        parse_size(value, "max_leak")


def test_long_size_strings_are_read_exactly():
    assert parse_size("9" * 18) == 10**18 - 1  # a float would round it
    assert parse_size("1.000000000000000001KiB") == 1024


def test_negative_int_is_refused():
    with pytest.raises(ValueError, match="-1"):
        parse_size(-1)


def test_optional_size_passes_none_through():
    assert parse_optional_size(None, "x") is None
    assert parse_optional_size("1KiB", "x") == 1024


@pytest.mark.parametrize("n, text", [
    (0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (40 * 2**20, "40.0 MiB"),
    (int(1.5 * 2**30), "1.5 GiB"), (-2048, "-2.0 KiB"), (None, "-"), (3 * 2**50, "3.0 PiB"),
])
def test_format_bytes_uses_binary_units(n, text):
    assert format_bytes(n) == text


def test_signed_format_marks_growth():
    assert format_bytes(2048, signed=True) == "+2.0 KiB"
    assert format_bytes(0, signed=True) == "0 B"


def test_public_size_helpers_are_exported():
    assert memguard.parse_size("1KiB") == 1024
    assert memguard.format_bytes(1024) == "1.0 KiB"


def test_numpy_numbers_are_sizes_counts_and_factors_as_python_numbers_are():
    import numpy as np
    import torch

    assert parse_size(np.int64(4096)) == 4096 and type(parse_size(np.int64(1))) is int
    assert parse_size(np.uint32(64)) == 64
    for refused in (np.bool_(True), np.float64(64.0), True):
        with pytest.raises(TypeError):
            parse_size(refused)
    calls = []

    @memguard.oom_retry(batch_size=np.int64(64), factor=np.float32(0.5),
                        min_batch_size=np.int32(2), max_attempts=np.int64(9))
    def step(batch_size):
        calls.append(batch_size)
        torch.empty(batch_size << 42 if batch_size > 8 else 1)
        return batch_size

    assert step() == 8 and calls == [64, 32, 16, 8]
    assert all(type(size) is int for size in calls)
    found = memguard.find_batch_size(lambda b: None, start=np.int64(4),
                                     max_batch_size=np.int64(16), margin=np.float64(0.0))
    assert found == 16
    assert memguard.map_batches(len, list(range(10)), batch_size=np.int16(4)) == [4, 4, 2]
    with memguard.memory_limit(np.int64(2**40)):
        pass
    for bad in (np.float64("nan"), np.float32(1.5), np.bool_(True), float("inf")):
        with pytest.raises(ValueError, match="factor must be a number"):
            memguard.oom_retry(factor=bad)
    for bad in (np.bool_(True), np.float64(4.0), np.int64(0)):
        with pytest.raises(ValueError, match="batch_size must be a positive int"):
            memguard.oom_retry(batch_size=bad)
