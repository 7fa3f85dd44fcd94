"""Holder paths wherever Python keeps a tensor, and holder paths, censuses and reports that
never raise because of the program's own objects (a key whose ``repr`` raises, say)."""

from __future__ import annotations

import collections
import dataclasses
import functools
import gc
import itertools
import logging
import re

import pytest
import torch

import memguard
from memguard.holders import find_holders

MiB = 1 << 20
REGISTRY: dict = {}
SAVED = None  # an error kept, as a program keeps the last one
QUEUE: collections.deque = collections.deque()
BY_KEY: dict = {}
GENERATORS: list = []


@pytest.fixture(autouse=True)
def emptied():
    yield
    REGISTRY.clear()
    QUEUE.clear()
    BY_KEY.clear()
    GENERATORS.clear()


class Detached:
    """An object whose ``repr`` fails, as an ORM row's does once its session closed."""

    def __repr__(self) -> str:
        raise RuntimeError("Instance <Detached> is not bound to a Session")


class BadRepr:
    """An object whose ``repr`` is not a string."""

    def __repr__(self):
        return 42


UNPRINTABLE = re.escape(f"module {__name__}, global REGISTRY[<Detached object at 0x") + \
    r"[0-9a-f]+>\]"


def holders(target) -> list[str]:
    """Every path (the test's own frames name the target too), with time to spare late in a
    long session."""
    return find_holders(target, seconds=10, max_paths=20)


# -- user objects never make a path, a census or a report raise ----------------------------------
def test_a_key_whose_repr_raises_is_named_by_its_type_and_address():
    REGISTRY[Detached()] = torch.ones(7, 3)
    REGISTRY[BadRepr()] = torch.ones(7, 4)
    REGISTRY["x" * 500] = torch.ones(7, 5)
    infos = {i.shape[1]: i for i in memguard.live_tensors()  # no raise
             if len(i.shape) == 2 and i.shape[0] == 7}
    assert re.fullmatch(UNPRINTABLE, infos[3].holders[0])
    assert re.fullmatch(re.escape(f"module {__name__}, global REGISTRY[<BadRepr object at 0x")
                        + r"[0-9a-f]+>\]", infos[4].holders[0])
    long_key = infos[5].holders[0]
    assert long_key.startswith(f"module {__name__}, global REGISTRY['xxx")
    assert long_key.endswith("...]") and len(long_key) < 200
    assert infos[3].held_by == f"held by {infos[3].holders[0]}"


def test_memory_scope_hands_back_the_blocks_error_not_the_reprs(caplog):
    caplog.set_level(logging.WARNING, logger="memguard")
    with pytest.raises(ValueError, match="bad batch"):  # noqa: PT012 - the error must cross the scope's exit
        with memguard.memory_scope("step", max_leak="8MiB", track_tensors=True):
            REGISTRY[Detached()] = torch.ones(64 * MiB // 4)
            raise ValueError("bad batch")
    warned = [r.getMessage() for r in caplog.records if "not raised: the block raised" in
              r.getMessage()]
    assert warned and re.search(UNPRINTABLE, warned[0])


def test_str_of_a_scope_with_a_leak_under_an_unprintable_key():
    with memguard.memory_scope("step", track_tensors=True) as scope:
        REGISTRY[Detached()] = torch.ones(10 * MiB // 4)
    assert scope.leaks
    assert re.search(r"float32\[2621440\] held by " + UNPRINTABLE, str(scope))
    assert re.search(UNPRINTABLE, repr(scope))


def test_frees_memory_under_an_unprintable_key(caplog):
    @memguard.frees_memory(track_tensors=True, warmup=0)
    def keep() -> None:
        REGISTRY[Detached()] = torch.ones(1000, 9)

    @memguard.frees_memory(max_leak="8MiB", track_tensors=True, warmup=0)
    def fail() -> None:
        REGISTRY[Detached()] = torch.ones(64 * MiB // 4)
        raise ValueError("bad batch")

    caplog.set_level(logging.DEBUG, logger="memguard")
    keep()  # its leak is logged at DEBUG, with the holder
    assert any(re.search(UNPRINTABLE, r.getMessage()) for r in caplog.records
               if " kept " in r.getMessage())
    with pytest.raises(ValueError, match="bad batch"):
        fail()


def test_a_referrer_whose_class_attribute_raises_is_passed_over():
    class Proxy:
        """A lazy proxy whose ``__class__`` (read by ``isinstance``) raises."""

        def __init__(self, target):
            self.target = target

        @property
        def __class__(self):
            raise LookupError("no object bound to this proxy")

    proxy = Proxy(torch.ones(7, 6))
    found = holders(proxy.target)  # before: LookupError from isinstance
    del proxy  # pytest would read its __class__ to show it
    assert any(path.endswith("local 'proxy'.target") for path in found), found


def test_a_census_leaves_out_a_tensor_subclass_that_raises_on_every_read():
    class Unmaterialized(torch.Tensor):
        """A program's subclass whose every read fails (a parameter not loaded yet)."""

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            raise KeyError("parameter not materialized")

    odd = torch.ones(5).as_subclass(Unmaterialized)
    plain = torch.ones(7, 11)
    found = {info.id for info in memguard.live_tensors()}  # before: KeyError
    assert id(plain) in found and id(odd) not in found
    assert "[7, 11]" in memguard.memory_report(top=1000)
    with memguard.memory_scope(track_tensors=True) as scope:
        REGISTRY["made"] = torch.ones(7, 12)
    assert [leak.shape for leak in scope.leaks] == [(7, 12)]


# -- holders wherever Python keeps a tensor ------------------------------------------------------
class Config:
    EMBEDDINGS = torch.ones(13, 2)


class Slotted:
    __slots__ = ("weights", "__private")

    def __init__(self, weights):
        self.weights = weights
        self.__private = weights.clone()


@dataclasses.dataclass(frozen=True, slots=True)
class StepKey:
    step: int
    mask: torch.Tensor = dataclasses.field(compare=False)


def test_holder_is_a_class_attribute():
    assert f"class {Config.__qualname__} .EMBEDDINGS" in holders(Config.EMBEDDINGS)


def test_holder_is_a_slotted_instance():
    kept = Slotted(torch.ones(13, 3))
    name = "frame test_holder_is_a_slotted_instance() local 'kept'"
    assert f"{name}.weights" in holders(kept.weights)
    assert f"{name}._Slotted__private" in holders(kept._Slotted__private)


def test_holder_is_a_deque():
    QUEUE.extend([torch.ones(13, 4), torch.ones(13, 5), torch.ones(13, 6)])
    assert f"module {__name__}, global QUEUE[0]" in holders(QUEUE[0])
    assert f"module {__name__}, global QUEUE[-1]" in holders(QUEUE[-1])


def test_holder_is_a_dict_key():
    BY_KEY[(torch.ones(13, 7), "step 3")] = "seen"
    BY_KEY[StepKey(4, torch.ones(13, 8))] = "seen"
    by_tuple, by_object = list(BY_KEY)
    assert f"module {__name__}, global BY_KEY.keys()[0][0]" in holders(by_tuple[0])
    assert f"module {__name__}, global BY_KEY.keys()[1].mask" in holders(by_object.mask)


def numbers():
    activations = torch.ones(13, 9)
    yield activations.sum()
    yield 2


def delegating():
    yield 0
    yield from numbers()


def test_holder_is_a_suspended_generators_local():
    GENERATORS.append(numbers())
    next(GENERATORS[0])
    tensor = GENERATORS[0].gi_frame.f_locals["activations"]
    # past the generator to the name that holds it
    assert (f"module {__name__}, global GENERATORS[0], generator numbers() local "
            "'activations'") in holders(tensor)


def test_holder_is_a_local_of_a_generator_suspended_inside_another():
    GENERATORS.append(delegating())
    next(GENERATORS[0])
    next(GENERATORS[0])  # now suspended in numbers(), through yield from
    tensor = GENERATORS[0].gi_yieldfrom.gi_frame.f_locals["activations"]
    assert (f"module {__name__}, global GENERATORS[0], generator delegating() yield from "
            "numbers() local 'activations'") in holders(tensor)


def test_a_generator_held_where_the_walk_names_nothing_is_named_by_itself():
    hidden = itertools.repeat(numbers())  # an iterator's state: no path goes through it
    next(next(hidden))
    tensor = next(hidden).gi_frame.f_locals["activations"]
    assert "generator numbers() local 'activations'" in holders(tensor)


# -- many holders, few walks ---------------------------------------------------------------------
MANY: list = []


def test_holders_down_a_census_come_in_few_walks_and_name_each_tensor():
    MANY.extend(torch.ones(3000 + i) for i in range(60))  # the 60 largest, smallest last
    try:
        infos = memguard.live_tensors(min_bytes=12_000)[:60]
        words = [info.held_by for info in infos]
        expected = [f"held by module {__name__}, global MANY[{i}]" for i in range(58, -1, -1)]
        assert words == [f"held by module {__name__}, global MANY[-1]", *expected]
        assert infos[0]._cache["walks"] == 3  # the point: 10, then 40, then the last 10
    finally:
        MANY.clear()


def test_a_pass_over_every_object_finds_what_the_collectors_referrers_find(monkeypatch):
    from memguard import holders

    MANY.extend(torch.ones(5) for _ in range(100))  # longer than LARGE_CONTAINER: indexed
    REGISTRY[Detached()] = torch.ones(7, 3)
    QUEUE.append(torch.ones(7, 4))
    targets = [MANY[0], MANY[-1], REGISTRY[next(iter(REGISTRY))], QUEUE[0]]
    try:
        by_referrers = holders.find_holders_of(targets, seconds=20, max_paths=20)
        monkeypatch.setattr(holders, "REFERRER_PASS", 0)  # every level: one pass over all
        by_pass = holders.find_holders_of(targets, seconds=20, max_paths=20)
    finally:
        MANY.clear()
    assert by_pass == by_referrers
    assert f"module {__name__}, global MANY[-1]" in by_pass[1]
    assert f"module {__name__}, global QUEUE[0]" in by_pass[3]


def test_the_nearest_holders_are_found_whatever_the_time_allowed():
    # a pass of the collector over a large heap on a loaded machine can outlast the whole
    # time budget: the first levels (a module global, an instance attribute) still complete
    NEAREST.append(torch.ones(13, 10))
    kept = Slotted(torch.ones(13, 11))
    assert f"module {__name__}, global NEAREST[0]" in find_holders(NEAREST[0], seconds=0)
    name = "frame test_the_nearest_holders_are_found_whatever_the_time_allowed() local 'kept'"
    assert f"{name}.weights" in find_holders(kept.weights, seconds=0)
    NEAREST.clear()


NEAREST: list = []


class Holder:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.t = tensor


MODEL = torch.nn.Sequential(torch.nn.Linear(3, 2))


def test_an_instance_is_named_by_the_global_that_roots_it():
    # before: "Holder object .t", a path that names nothing the program can delete
    REGISTRY["run1"] = Holder(torch.ones(13, 12))
    found = holders(REGISTRY["run1"].t)
    REGISTRY.clear()
    assert f"module {__name__}, global REGISTRY['run1'].t" in found, found


def test_a_module_in_a_model_is_named_by_the_global_that_roots_it():
    # before: "Linear object .weight"
    found = holders(MODEL[0].weight)
    assert f"module {__name__}, global MODEL.0.weight" in found, found


def test_an_instance_rooted_nowhere_keeps_its_own_form():
    # an instance kept only by a cycle through itself: no name above it, so its own form
    gc.disable()  # keep the cycle until the walk has read it
    try:
        cycle = Holder(torch.ones(13, 13))
        cycle.me = cycle
        tensor = cycle.t
        del cycle
        found = holders(tensor)
    finally:
        gc.enable()
    assert "Holder object .t" in found, found


def _fails():
    outputs = torch.ones(13, 14)  # noqa: F841 - kept by the frame the traceback keeps
    raise ValueError("a step that failed")


@functools.lru_cache(maxsize=4)
def cached(n):
    return torch.ones(n, 15)


@functools.lru_cache(maxsize=None)
def cached_forever(n):
    return torch.ones(n, 16)


def test_a_frame_kept_by_a_saved_traceback_is_named_by_the_error_that_keeps_it():
    # before: "frame _fails() local 'outputs'", as if _fails were still running
    global SAVED
    try:
        _fails()
    except ValueError as error:
        SAVED = error
    try:
        found = holders(SAVED.__traceback__.tb_next.tb_frame.f_locals["outputs"])
    finally:
        SAVED = None
    assert f"module {__name__}, global SAVED.__traceback__, frame _fails() local 'outputs'" \
        in found, found


@pytest.mark.parametrize("cache, key", [(cached, ""), (cached_forever, "[2]")])
def test_a_result_kept_by_lru_cache_is_named_by_the_cached_function(cache, key):
    # before: nothing (the cache is no container the walk knew)
    found = holders(cache(2))
    cache.cache_clear()
    said = f"(its lru_cache{key}; .cache_clear() frees it)"
    assert f"module {__name__}, global {cache.__name__} {said}" in found, found
