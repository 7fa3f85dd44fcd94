"""The live-tensor census, holder paths and the memory report, on real torch tensors."""

from __future__ import annotations

import copy
import itertools
import pickle
import warnings
import weakref

import pytest
import torch

import memguard
from memguard.census import memory_report
from memguard.holders import find_holders

MiB = 1 << 20
CACHE: list = []


class Trainer:
    def __init__(self):
        self.history = []

    def step(self):
        self.history.append(torch.ones(256, 1024))


def ids(infos):
    return {info.id for info in infos}


def test_census_finds_tensors_parameters_and_grads_with_their_names():
    model = torch.nn.Linear(64, 32)
    model(torch.ones(2, 64)).sum().backward()
    plain = torch.ones(100, 100)
    infos = memguard.live_tensors(model=model)
    by_id = {info.id: info for info in infos}
    assert id(plain) in by_id and id(model.weight) in by_id and id(model.weight.grad) in by_id
    assert by_id[id(model.weight)].name == "weight"
    assert by_id[id(model.weight.grad)].name == "weight.grad"
    assert by_id[id(model.bias)].name == "bias"
    info = by_id[id(plain)]
    assert (info.framework, info.device, info.dtype, info.shape) == ("torch", "cpu", "float32",
                                                                      (100, 100))
    assert info.nbytes == 40_000 and not info.is_view and info.name is None
    assert [i.nbytes for i in infos] == sorted((i.nbytes for i in infos), reverse=True)


def test_views_share_their_storage_bytes_once():
    base = torch.ones(1000, 1000)
    view, other_view = base[10:], base.view(-1)
    by_id = {info.id: info for info in memguard.live_tensors()}
    assert by_id[id(base)].nbytes == 4_000_000 and not by_id[id(base)].is_view
    assert by_id[id(view)].nbytes == 0 and by_id[id(view)].is_view
    assert by_id[id(other_view)].nbytes == 0


def test_a_view_of_a_temporary_counts_its_storage_once():
    view = torch.ones(1000, 1000)[500:]  # torch keeps the base's object alive for the view
    sharing = [i for i in memguard.live_tensors() if i.shape in ((1000, 1000), (500, 1000))]
    assert sum(i.nbytes for i in sharing) == 4_000_000
    assert [i.is_view for i in sharing if i.nbytes] == [False]
    assert [(i.is_view, i.nbytes) for i in sharing if i.id == id(view)] == [(True, 0)]
    # the base that counts the bytes is named through the view that keeps it
    base = next(i for i in sharing if i.nbytes)
    assert base.held_by == ("held by frame test_a_view_of_a_temporary_counts_its_storage_once() "
                            "local 'view' (a view of it)")


def test_tensors_that_own_no_memory_are_left_out_without_error():
    """Meta, fake, lazy (uninitialised) and wrapper tensors hold no storage of their own; a
    wrapper's data is the plain tensor inside it, which the census counts once."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.masked import masked_tensor

    lazy = torch.nn.LazyLinear(8)  # its parameters are UninitializedParameter
    meta = torch.ones(1000, 1000, device="meta")
    with FakeTensorMode():
        fake = torch.ones(1000, 1000)
    data = torch.ones(300, 300)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "prototype stage"
        masked = masked_tensor(data, torch.ones(300, 300, dtype=torch.bool))
    buffer = torch.nn.Buffer(torch.ones(200, 200))  # a plain tensor, marked as a buffer
    by_id = {info.id: info for info in memguard.live_tensors()}
    for holds_nothing in (lazy.weight, meta, fake, masked):
        assert id(holds_nothing) not in by_id
    assert by_id[id(buffer)].nbytes == 160_000
    counted = [i for i in by_id.values() if i.shape == (300, 300) and i.dtype == "float32"]
    assert sum(i.nbytes for i in counted) == 720_000  # data, and the copy the mask wraps
    assert id(data) in by_id


def test_tensor_info_is_an_immutable_value():
    plain = torch.ones(10, 10)
    info = next(i for i in memguard.live_tensors() if i.id == id(plain))
    again = next(i for i in memguard.live_tensors() if i.id == id(plain))
    assert info == again and hash(info) == hash(again) and info is not again
    with pytest.raises(AttributeError):
        info.nbytes = 0  # type: ignore[misc]
    assert info.to_dict() == {"framework": "torch", "device": "cpu", "dtype": "float32",
                              "shape": [10, 10], "nbytes": 400, "is_view": False,
                              "name": None, "id": id(plain)}
    assert "nbytes=400" in repr(info) and str(info) == "float32[10, 10] 400 B on cpu"
    made = memguard.TensorInfo("torch", "cpu", "float32", (10, 10), 400, id=id(plain))
    assert made == info and not made.alive
    assert copy.deepcopy(info) is info and info.alive
    restored = pickle.loads(pickle.dumps(info))
    assert restored == info and not restored.alive  # the weak reference stays behind


def test_device_and_size_filters():
    big = torch.ones(2 * MiB // 4)
    on_cpu = memguard.live_tensors("cpu", min_bytes=MiB)
    assert id(big) in ids(on_cpu) and all(i.nbytes >= MiB for i in on_cpu)
    assert ids(memguard.live_tensors("host", min_bytes=MiB)) == ids(on_cpu)
    on_gpu = memguard.live_tensors("cuda:0")
    assert id(big) not in ids(on_gpu) and all(i.device == "cuda:0" for i in on_gpu)
    if not torch.cuda.is_available():
        assert on_gpu == []


def test_the_census_keeps_no_tensor_alive():
    tensor = torch.ones(10)
    ref, ident = weakref.ref(tensor), id(tensor)
    infos = memguard.live_tensors()
    del tensor
    assert ref() is None
    info = next(i for i in infos if i.id == ident)
    assert not info.alive and info.holders == []


def test_the_census_survives_weak_proxies_and_odd_objects():
    class NoStorage(torch.Tensor):
        """A program's own wrapper subclass: the census looks at it (it is a tensor class
        memguard does not know), and reading its storage raises RuntimeError."""

        @staticmethod
        def __new__(cls, shape):
            return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.float32)

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            raise NotImplementedError(func)

    tensor = torch.ones(5)
    proxy = weakref.proxy(tensor)  # isinstance(proxy, torch.Tensor) is True: not a tensor
    odd = NoStorage((1000, 1000))
    with pytest.raises(RuntimeError):
        odd.untyped_storage().data_ptr()  # what the census has to survive
    found = ids(memguard.live_tensors())
    assert id(tensor) in found and id(proxy) not in found and id(odd) not in found


def test_holder_of_a_module_global_list_element():
    CACHE.append(torch.ones(321, 7))
    try:
        info = next(i for i in memguard.live_tensors() if i.shape == (321, 7))
        assert f"module {__name__}, global CACHE[0]" in info.holders
    finally:
        CACHE.clear()


def test_holder_of_a_frame_local():
    outputs = torch.ones(123, 4)
    holders = find_holders(outputs, seconds=10)
    assert "frame test_holder_of_a_frame_local() local 'outputs'" in holders


# The holder walks below get 10 s instead of the default 0.5 s a tensor: late in a long session
# the heap holds every framework the suite imported, and a walk's time grows with it.
def test_holder_of_an_instance_attribute_and_of_a_module_parameter():
    trainer = Trainer()
    trainer.step()
    trainer.step()
    holders = find_holders(trainer.history[-1], seconds=10)
    frame = "frame test_holder_of_an_instance_attribute_and_of_a_module_parameter()"
    assert f"{frame} local 'trainer'.history[-1]" in holders
    model = torch.nn.Linear(3, 2)
    assert f"{frame} local 'model'.weight" in find_holders(model.weight, seconds=10)


def test_holder_through_a_dict_and_a_closure():
    registry = {"logits": torch.ones(9)}

    def make():
        kept = torch.ones(11)
        return lambda: kept

    fn = make()
    assert "frame test_holder_through_a_dict_and_a_closure() local 'registry'['logits']" in \
        find_holders(registry["logits"], seconds=10)
    # past the function to the name that holds it
    assert ("frame test_holder_through_a_dict_and_a_closure() local 'fn', function "
            "test_holder_through_a_dict_and_a_closure.<locals>.make.<locals>.<lambda>() "
            "closure 'kept'") in find_holders(fn.__closure__[0].cell_contents, seconds=10)
    # a function held where the walk names nothing (an iterator's state): its own form
    hidden = itertools.repeat(make())
    target = next(hidden).__closure__[0].cell_contents
    holders = find_holders(target, seconds=10)
    function = "test_holder_through_a_dict_and_a_closure.<locals>.make.<locals>.<lambda>()"
    assert sorted(holders) == [
        "frame test_holder_through_a_dict_and_a_closure() local 'target'",
        f"function {function} closure 'kept'"]


def test_scope_names_leaked_tensors_and_their_holders():
    trainer = Trainer()
    with memguard.memory_scope("epoch", track_tensors=True) as scope:
        CACHE.append(torch.ones(40 * MiB // 4096, 1024))
        trainer.step()
        temporary = torch.ones(1000)
        del temporary
    try:
        leaks = scope.leaks
        assert [leak.shape for leak in leaks[:2]] == [(10240, 1024), (256, 1024)]
        assert leaks[0].holders[0] == f"module {__name__}, global CACHE[0]"
        assert ("frame test_scope_names_leaked_tensors_and_their_holders() local "
                "'trainer'.history[0]") in leaks[1].holders
        text = str(scope)
        assert (f"retained {memguard.format_bytes(scope.retained['host'])} on host: "
                f"float32[10240, 1024] held by module {__name__}, global CACHE[0]") in text
    finally:
        CACHE.clear()


def test_max_leak_error_names_the_holder():
    with pytest.raises(memguard.MemoryLeakError) as info:
        with memguard.memory_scope(max_leak="8MiB", track_tensors=True):
            CACHE.append(torch.ones(64 * MiB // 4))
    CACHE.clear()
    assert f"float32[16777216] held by module {__name__}, global CACHE[0]" in str(info.value)


def test_untracked_scope_has_no_leaks_and_tensors_made_before_are_not_leaks():
    before = torch.ones(50)
    with memguard.memory_scope(track_tensors=True) as scope:
        before.add_(1)
    with memguard.memory_scope() as untracked:
        kept = torch.ones(10)
    assert scope.leaks == [] and untracked.leaks == []
    del kept  # alive through the untracked scope's exit: a tracking scope would list it


def test_memory_report_groups_and_totals():
    blocks = [torch.ones(333, 777) for _ in range(3)]
    report = memory_report(top=5, device="cpu")
    lines = report.splitlines()
    assert lines[0].split() == ["device", "dtype", "shape", "count", "bytes"]
    assert any("[333, 777]" in line and line.split()[-3] == "3" for line in lines)
    assert lines[-1].startswith("cpu: ") and "in live tensors" in lines[-1]
    on_gpu = memory_report(device="cuda:3")
    if memguard.live_tensors("cuda:3"):  # a fourth GPU holding tensors: none of the CPU's
        assert not any(line.startswith("cpu") for line in on_gpu.splitlines())
    else:
        assert on_gpu == "no live tensors on cuda:3"
    with pytest.raises(ValueError, match="top must be a positive int"):
        memory_report(top=0)
    del blocks


def test_census_and_holders_are_empty_when_nothing_is_imported(python_in_subprocess):
    out = python_in_subprocess("""
        import json, sys
        import memguard
        print(json.dumps({"census": memguard.live_tensors(),
                          "torch": "torch" in sys.modules}))
    """)
    assert out == {"census": [], "torch": False}


@pytest.mark.slow
def test_tensorflow_tensors_and_variables_are_counted(python_in_subprocess):
    out = python_in_subprocess("""
        import json
        import tensorflow as tf
        import torch
        import memguard
        KEEP = [tf.ones((100, 50)), tf.Variable(tf.zeros((20, 10))), torch.ones(30, 7)]
        ALIAS = KEEP[1].assign(tf.ones((20, 10)))  # an _UnreadVariable over the same handle
        from memguard.backends import tensorflow as backend
        # the handle (dtype resource) must not share its variable's storage key: whichever the
        # census met first would count the storage, and the handle's bytes are zero
        keys = [backend.tensor_facts(x)[3] for x in (KEEP[1].handle, KEEP[1], ALIAS)]
        census = memguard.live_tensors("cpu")
        infos = {tuple(i.shape): i for i in census if i.nbytes}
        a, v, t = infos[(100, 50)], infos[(20, 10)], infos[(30, 7)]
        print(json.dumps({"a": [a.framework, a.dtype, a.nbytes, a.holders],
                          "v": [v.framework, v.nbytes], "t": [t.framework, t.nbytes],
                          "variables": sum(i.nbytes for i in census if i.shape == (20, 10)),
                          "alias_seen": any(i.id == id(ALIAS) for i in census),
                          "handle_apart": keys[0] != keys[1] == keys[2]}))
    """)
    assert out["a"][:3] == ["tensorflow", "float32", 20_000]
    assert "module __main__, global KEEP[0]" in out["a"][3]
    assert out["v"] == ["tensorflow", 800]
    assert out["t"] == ["torch", 840]  # one census over both frameworks
    assert out["variables"] == 800 and out["alias_seen"]  # the alias is listed, counted once
    assert out["handle_apart"]


def test_sparse_and_nested_tensors_are_counted_by_their_parts():
    """Sparse (COO: indices and values; CSR: compressed and plain indices and values) and
    nested tensors refuse a plain read of their storage or shape: the census counts their
    parts, so that a scope that keeps them finds them."""
    n = 1 << 17
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sparse CSR and nested tensors are "beta"
        coo = torch.sparse_coo_tensor(torch.stack([torch.arange(n), torch.arange(n)]),
                                      torch.ones(n), (n, n))
        csr = torch.sparse_csr_tensor(torch.arange(n + 1), torch.arange(n), torch.ones(n),
                                      (n, n))
        nested = torch.nested.nested_tensor([torch.ones(n), torch.ones(2 * n)])
    by_id = {info.id: info for info in memguard.live_tensors()}
    assert by_id[id(coo)].nbytes == 2 * n * 8 + n * 4
    assert by_id[id(coo)].shape == (n, n) and by_id[id(coo)].dtype == "float32"
    assert by_id[id(csr)].nbytes == (n + 1) * 8 + n * 8 + n * 4
    assert by_id[id(nested)].nbytes == 3 * n * 4 and by_id[id(nested)].shape == (2,)

    def keep() -> None:
        with memguard.memory_scope(max_leak=0, track_tensors=True):
            CACHE.extend([coo.coalesce(), csr.clone(), nested.clone()])

    with pytest.raises(memguard.MemoryLeakError) as info:
        keep()
    try:
        leaked = {leak.nbytes for leak in info.value.leaks}  # type: ignore[attr-defined]
        assert leaked == {2 * n * 8 + n * 4, (n + 1) * 8 + n * 8 + n * 4, 3 * n * 4}, leaked
        assert f"held by module {__name__}, global CACHE[0]" in str(info.value)
    finally:
        CACHE.clear()
