"""map_batches over what people hold: a torch Dataset, a DataLoader, any iterable of batches;
its retries visible on the result's .history and through on_retry."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

import memguard
from memguard.mapping import BatchResults

HUGE = 1 << 42  # float32 elements: 16 TiB, a real DefaultCPUAllocator failure


def oom_above(limit: int, length: int) -> None:
    if length > limit:
        torch.empty(HUGE)


def test_a_tensor_dataset_is_collated_into_tuples_of_stacked_tensors():
    x, y = torch.arange(10.0).unsqueeze(1).repeat(1, 3), torch.arange(10)
    seen = []

    def fn(batch):
        xs, ys = batch
        seen.append((type(batch).__name__, tuple(xs.shape), tuple(ys.shape)))
        return xs.sum(dim=1) + ys

    out = memguard.map_batches(fn, TensorDataset(x, y), batch_size=4, collate=torch.cat)
    assert seen[0][0] in ("tuple", "list") and [s[1:] for s in seen] == [
        ((4, 3), (4,)), ((4, 3), (4,)), ((2, 3), (2,))]
    assert torch.equal(out, x.sum(dim=1) + y)


def test_a_dataset_of_dicts_shrinks_on_a_real_oom_and_records_it():
    class Tokens(Dataset):
        def __len__(self):
            return 12

        def __getitem__(self, i):
            return {"ids": torch.full((5,), i), "label": i}

    retries = []

    def fn(batch):
        oom_above(3, len(batch["ids"]))
        return batch["label"].tolist()

    out = memguard.map_batches(fn, Tokens(), batch_size=8, on_retry=retries.append)
    assert [label for part in out for label in part] == list(range(12))
    assert [len(r) for r in out] == [2, 2, 2, 2, 2, 2]  # 8 fails, 4 fails, then 2 from there
    assert isinstance(out, BatchResults)
    assert [(a.size, a.ok) for a in out.history] == [(8, False), (4, False), (2, True)]
    assert "DefaultCPUAllocator" in out.history[0].error and out.history[0].memory is not None
    assert [a.size for a in retries] == [8, 4]


def test_a_dataloader_batch_is_passed_as_is_and_split_element_wise_on_oom():
    data = TensorDataset(torch.arange(20.0), torch.arange(20) * 2)
    loader = DataLoader(data, batch_size=8)
    seen = []

    def fn(batch):
        xs, ys = batch
        seen.append(len(xs))
        assert len(ys) == len(xs)
        oom_above(4, len(xs))
        return xs + ys

    out = memguard.map_batches(fn, loader, collate=torch.cat)
    assert torch.equal(out, torch.arange(20.0) * 3)
    # batch 0: 8 fails, 4 + 4; batch 1 goes on at 4; the last batch (4 items) as it is
    assert seen == [8, 4, 4, 4, 4, 4]


def test_any_iterable_of_batches_keeps_finished_results_on_partial():
    def batches():
        yield torch.arange(4)
        yield torch.arange(4, 8)
        yield {"x": torch.arange(8, 12)}

    def fn(batch):
        if isinstance(batch, dict):
            torch.empty(HUGE)  # fails at every size
        return batch.tolist()

    with pytest.raises(memguard.OutOfMemoryError, match="item 0 of batch 2") as info:
        memguard.map_batches(fn, batches(), min_batch_size=2)
    assert info.value.partial == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [a.size for a in info.value.attempts] == [4, 2]


def test_an_iterable_batch_is_cut_to_batch_size_and_a_sequence_needs_one():
    out = memguard.map_batches(len, iter([list(range(10))]), batch_size=4)
    assert out == [[4, 4, 2]] and out.history == []  # one result per input batch
    joined = memguard.map_batches(lambda b: [2 * x for x in b], iter([[1, 2, 3], [4]]),
                                  batch_size=2)
    assert joined == [[2, 4, 6], [8]]
    with pytest.raises(TypeError, match=r"needs batch_size=\.\.\. for a TensorDataset"):
        memguard.map_batches(len, TensorDataset(torch.arange(3)))
    with pytest.raises(TypeError, match="on_retry must be callable, got 3"):
        memguard.map_batches(len, [1], batch_size=1, on_retry=3)
    with pytest.raises(TypeError, match=r"iterable of batches .* got int"):
        memguard.map_batches(len, 5, batch_size=1)


def test_factor_chooses_the_sizes_tried_and_each_failure_names_the_next():
    seen, retries = [], []

    def fn(batch):
        seen.append(len(batch))
        oom_above(5, len(batch))
        return len(batch)

    out = memguard.map_batches(fn, list(range(64)), batch_size=64, factor=0.25,
                               on_retry=retries.append)
    assert seen[:3] == [64, 16, 4] and sum(out) == 64 and set(out) == {4}
    assert [(a.size, a.ok, a.next_size) for a in out.history] == [
        (64, False, 16), (16, False, 4), (4, True, None)]
    assert [a.next_size for a in retries] == [16, 4]
    seen.clear()
    out = memguard.map_batches(fn, torch.arange(10), batch_size=10,
                               factor=lambda size: size - 3)
    assert seen == [10, 7, 4, 4, 2] and out == [4, 4, 2]  # 10 -> 7 -> 4, then 4 on from there
    assert [a.next_size for a in out.history] == [7, 4, None]


def test_auto_factor_measures_what_the_failed_call_asked_for():
    from memguard.backends.budget import available

    seen = []
    asked = 2 * available("host")  # twice what the host can give: about half of it fits

    def fn(batch):
        seen.append(len(batch))
        if len(batch) > 20:
            raise RuntimeError(f"DefaultCPUAllocator: can't allocate memory: you tried to "
                               f"allocate {asked} bytes. Error code 12 (Cannot allocate memory)")
        return len(batch)

    out = memguard.map_batches(fn, list(range(64)), batch_size=64, factor="auto")
    # 64 * 0.95 / 2 = 30: measured, neither halving's 32 nor the 0.25 floor's 16
    assert 27 <= seen[1] <= 30, seen
    assert out.history[0].next_size == seen[1] and sum(out) == 64

    def huge(batch):
        seen.append(len(batch))
        oom_above(10, len(batch))  # asks for 16 TiB: far more than any budget here
        return len(batch)

    seen.clear()
    out = memguard.map_batches(huge, list(range(64)), batch_size=64, factor="auto")
    assert seen[:3] == [64, 16, 4]  # the measured size is kept to a quarter at the least

    def unsized(batch):
        seen.append(len(batch))
        if len(batch) > 10:
            raise MemoryError()  # no size stated: nothing to measure, so it halves
        return len(batch)

    seen.clear()
    assert memguard.map_batches(unsized, list(range(16)), batch_size=16,
                                factor="auto") == [8, 8]
    assert seen == [16, 8, 8]


@pytest.mark.parametrize("factor, match", [
    (1.0, "factor must be a number between 0 and 1"),
    (0, "factor must be a number between 0 and 1"),
    (True, "factor must be a number between 0 and 1"),
    ("fast", "'auto' or a callable size -> next size, got 'fast'"),
])
def test_bad_factors_are_refused(factor, match):
    with pytest.raises(ValueError, match=match):
        memguard.map_batches(len, [1, 2], batch_size=2, factor=factor)


def test_a_callable_factor_that_does_not_shrink_is_refused_when_used():
    def stubborn(size):
        return size

    with pytest.raises(ValueError, match=r"map_batches: factor .*stubborn\(8\) returned 8; it "
                                         r"must return a positive int smaller than 8"):
        memguard.map_batches(lambda b: oom_above(1, len(b)), list(range(8)), batch_size=8,
                             factor=stubborn)
    with pytest.raises(ValueError, match="map_batches: min_batch_size=4 is larger than the "
                                         "starting batch_size=2"):
        memguard.map_batches(len, [1, 2], batch_size=2, min_batch_size=4)


def test_a_generator_of_batches_gives_one_result_per_input_batch_even_when_split():
    def batches():
        for start in range(0, 32, 8):
            yield torch.arange(start, start + 8, dtype=torch.float32)

    def double(batch):
        oom_above(3, len(batch))  # every batch of 8 is split into slices of 2
        return batch * 2

    out = memguard.map_batches(double, batches())
    assert len(out) == 4  # not one per slice
    assert torch.equal(torch.cat(out), torch.arange(32, dtype=torch.float32) * 2)
    assert [a.size for a in out.history if not a.ok] == [8, 4]  # the size stays shrunk


def test_max_attempts_counts_the_attempts_at_one_batch():
    sizes = []

    def fn(batch):
        sizes.append(len(batch))
        oom_above(4 if batch[0] < 8 else 2, len(batch))  # later items need smaller batches
        return len(batch)

    # two attempts at each of two batches: 8 fails, 4 fits; later 4 fails, 2 fits
    out = memguard.map_batches(fn, list(range(16)), batch_size=8, max_attempts=2)
    assert sum(out) == 16 and sizes[:4] == [8, 4, 4, 4] and sizes[4:6] == [2, 2]
    with pytest.raises(memguard.OutOfMemoryError):
        memguard.map_batches(fn, list(range(16)), batch_size=8, max_attempts=1)


def test_an_empty_input_calls_fn_never_and_gives_what_a_plain_loop_gives():
    calls = []

    def fn(batch):
        calls.append(batch)
        return len(batch)

    empties = [[], torch.empty(0, 3), (torch.empty(0), torch.empty(0, 2)),
               {"x": torch.empty(0, 5)}, TensorDataset(torch.empty(0, 2))]
    for data in empties:
        # what a plain loop over the slices gives: no slice, no call
        plain = [fn(data[i:i + 4]) for i in range(0, len(data), 4)] if isinstance(
            data, (list, torch.Tensor)) else []
        results = memguard.map_batches(fn, data, batch_size=4)
        assert isinstance(results, BatchResults)
        assert results == plain == [] and results.history == [], type(data)
    assert memguard.map_batches(fn, [], batch_size=4, collate=list) == []
    assert memguard.map_batches(fn, iter([]), collate=list) == []
    assert calls == []
    # an empty batch of an iterable is still a batch
    assert memguard.map_batches(fn, iter([[]])) == [0] and len(calls) == 1
