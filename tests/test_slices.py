"""Measuring and cutting batches as users build them."""

from __future__ import annotations

import collections
from typing import NamedTuple

import numpy as np
import pytest
import torch

from memguard._slices import plan_batch


def cut(batch, start, stop):
    return plan_batch(batch).cut(batch, start, stop)


def test_tensor_and_array_are_cut_along_dim_0():
    t, a = torch.arange(20).reshape(10, 2), np.arange(30).reshape(10, 3)
    assert plan_batch(t).length == 10 and plan_batch(a).length == 10
    assert torch.equal(cut(t, 2, 5), t[2:5])
    assert np.array_equal(cut(a, 8, 10), a[8:])


def test_tuple_of_fields_keeps_scalars_and_none_for_every_slice():
    x, y = torch.randn(6, 3), torch.arange(6)
    piece = cut((x, y, 0.5, None), 4, 6)
    assert type(piece) is tuple and piece[2:] == (0.5, None)
    assert torch.equal(piece[0], x[4:]) and torch.equal(piece[1], y[4:])


def test_list_of_strings_is_per_sample():
    names = [f"doc{i}" for i in range(5)]
    assert plan_batch(names).length == 5
    assert cut(names, 1, 3) == ["doc1", "doc2"]


def test_hugging_face_style_dict_with_a_per_sample_text_field():
    batch = {"input_ids": torch.arange(12).reshape(4, 3), "attention_mask": torch.ones(4, 3),
             "text": ["a", "b", "c", "d"], "labels": torch.tensor([0, 1, 0, 1]),
             "scale": torch.tensor(2.0), "task": "sst2"}
    piece = cut(batch, 1, 3)
    assert list(piece) == list(batch)
    assert piece["text"] == ["b", "c"] and piece["task"] == "sst2"
    assert torch.equal(piece["input_ids"], batch["input_ids"][1:3])
    assert piece["scale"] is batch["scale"]  # 0-dim: shared


def test_nested_containers_and_named_tuples_keep_their_types():
    class Pair(NamedTuple):
        inputs: dict
        target: torch.Tensor

    class Encoding(collections.UserDict):
        pass

    batch = Pair(Encoding({"ids": torch.arange(8), "pos": [torch.arange(8), torch.arange(8)]}),
                 torch.arange(8) * 10)
    # "pos" is a list of two tensors of the common length: fields, each cut
    piece = cut(batch, 2, 4)
    assert isinstance(piece, Pair) and isinstance(piece.inputs, Encoding)
    assert torch.equal(piece.inputs["ids"], torch.tensor([2, 3]))
    assert [p.tolist() for p in piece.inputs["pos"]] == [[2, 3], [2, 3]]
    assert torch.equal(piece.target, torch.tensor([20, 30]))


def test_defaultdict_and_ordered_dict_keep_type_and_factory():
    d = collections.defaultdict(list, x=torch.arange(4))
    piece = cut(d, 0, 2)
    assert isinstance(piece, collections.defaultdict) and piece.default_factory is list
    o = collections.OrderedDict(b=torch.arange(4), a=torch.arange(4))
    assert list(cut(o, 0, 1)) == ["b", "a"]


def test_ragged_list_of_tensors_is_one_item_per_sample():
    seqs = [torch.ones(5), torch.ones(7), torch.ones(3)]
    assert plan_batch(seqs).length == 3
    assert [len(s) for s in cut(seqs, 1, 3)] == [7, 3]


def test_list_of_per_sample_dicts_or_token_lists_is_one_item_per_sample():
    samples = [{"x": torch.zeros(3), "label": i} for i in range(4)]  # collate_fn=lambda x: x
    assert plan_batch(samples).length == 4
    assert [s["label"] for s in cut(samples, 1, 3)] == [1, 2]
    tokens = {"ids": [[1, 2], [3, 4], [5, 6]], "y": torch.arange(3)}  # padded, as lists
    assert plan_batch(tokens).length == 3
    assert cut(tokens, 2, 3)["ids"] == [[5, 6]]


def test_a_tuple_of_fields_must_agree_even_without_shared_parts():
    with pytest.raises(ValueError, match=r"0: 4, 1: 3"):
        plan_batch((torch.ones(4), torch.ones(3)))


def test_a_torch_size_is_a_record_not_samples():
    batch = {"x": torch.ones(4, 2), "shape": torch.Size([2, 2])}
    assert plan_batch(batch).length == 4
    assert cut(batch, 0, 1)["shape"] == torch.Size([2, 2])


def test_hugging_face_batch_encoding_keeps_its_type():
    transformers = pytest.importorskip("transformers")
    enc = transformers.BatchEncoding({"input_ids": torch.arange(6).reshape(3, 2),
                                      "attention_mask": torch.ones(3, 2)})
    piece = cut(enc, 1, 3)
    assert isinstance(piece, transformers.BatchEncoding)
    assert torch.equal(piece["input_ids"], enc["input_ids"][1:])


@pytest.mark.parametrize("batch", [3.5, "text", None, object(), torch.tensor(1.0),
                                   {"lr": 0.1, "opt": None}])
def test_a_batch_with_nothing_per_sample_is_a_type_error_naming_it(batch):
    with pytest.raises(TypeError, match="cannot split a batch of type"):
        plan_batch(batch)


def test_disagreeing_lengths_are_a_value_error_naming_the_parts():
    with pytest.raises(ValueError, match=r"'x': 4, 'y': 3"):
        plan_batch({"x": torch.ones(4), "y": torch.ones(3)})
    with pytest.raises(ValueError, match=r"'x': 4, 'y': 3, 'z': 1"):  # one row among them
        plan_batch({"x": torch.ones(4), "y": torch.ones(3), "z": torch.ones(1)})


def test_one_row_beside_the_samples_rows_goes_to_every_slice_as_torch_broadcasts_it():
    # position ids of shape [1, L] beside a batch of 4: before, refused at every call,
    # also where the batch fitted whole
    batch = {"ids": torch.arange(12).reshape(4, 3), "positions": torch.arange(3)[None],
             "pair": (torch.ones(4, 2), torch.zeros(1, 2))}
    plan = plan_batch(batch)
    assert plan.length == 4
    piece = cut(batch, 1, 3)
    assert torch.equal(piece["ids"], batch["ids"][1:3])
    assert piece["positions"] is batch["positions"]
    assert piece["pair"][0].shape == (2, 2) and piece["pair"][1] is batch["pair"][1]
    # the slices' sum is the whole batch's, as torch broadcasts the row over either
    whole = (batch["ids"] + batch["positions"]).sum()
    parts = sum((p["ids"] + p["positions"]).sum() for p in (cut(batch, 0, 1), cut(batch, 1, 4)))
    assert int(parts) == int(whole)


def test_empty_and_huge_batches():
    assert plan_batch(torch.ones(0, 3)).length == 0
    huge = torch.empty(10**9, dtype=torch.uint8)  # 1 GB, untouched
    assert plan_batch({"x": huge}).length == 10**9
    assert cut({"x": huge}, 10**9 - 2, 10**9)["x"].shape == (2,)


def test_a_list_of_one_shaped_tensors_reads_as_what_is_beside_it_says():
    seqs = [torch.full((10,), i) for i in range(6)]  # six sequences of one length
    beside = (seqs, torch.arange(6))  # six labels: one sequence per sample
    assert plan_batch(beside).length == 6
    assert [int(s[0]) for s in cut(beside, 2, 4)[0]] == [2, 3]
    fields = (seqs, torch.arange(10))  # ten labels: six fields of ten samples
    assert plan_batch(fields).length == 10
    assert [len(s) for s in cut(fields, 2, 4)[0]] == [2] * 6
    ragged = [torch.ones(5), torch.ones(7), torch.ones(3)]  # lengths say it: per sample
    assert plan_batch(ragged).length == 3


def test_a_list_of_one_shaped_tensors_alone_is_refused_when_cut_whatever_it_holds():
    for batch in ([torch.ones(10) for _ in range(6)], [torch.ones(8, 3), torch.ones(8, 3)]):
        plan = plan_batch(batch)  # measured: a batch that fits runs whole
        with pytest.raises(ValueError, match=r"cannot tell how to cut batch, a list of"):
            plan.cut(batch, 0, 1)
    assert plan_batch((torch.ones(8, 3), torch.ones(8, 3))).length == 8  # a tuple: fields
    assert plan_batch([torch.ones(8, 3), torch.ones(8)]).length == 8  # two shapes: fields


def test_a_dataclass_is_rebuilt_around_its_cut_fields():
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Batch:
        x: torch.Tensor
        names: list
        lr: float = 0.1
        total: torch.Tensor = dataclasses.field(init=False, default=None)

    batch = Batch(torch.arange(6), ["a", "b", "c", "d", "e", "f"])
    object.__setattr__(batch, "total", torch.arange(6) * 2)  # set after __init__
    piece = cut(batch, 1, 3)
    assert type(piece) is Batch and piece.names == ["b", "c"] and piece.lr == 0.1
    assert piece.x.tolist() == [1, 2] and piece.total.tolist() == [2, 4]
    assert batch.x.tolist() == list(range(6))  # the original untouched


def test_a_packed_sequence_is_refused_by_name():
    packed = torch.nn.utils.rnn.pack_sequence([torch.ones(3), torch.ones(2)])
    with pytest.raises(TypeError, match=r"batch\[0\], a torch.nn.utils.rnn.PackedSequence"):
        plan_batch((packed, torch.arange(2))).cut((packed, torch.arange(2)), 0, 1)
