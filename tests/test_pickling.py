"""Every result and error memguard hands out pickles and deep-copies: they cross processes."""

from __future__ import annotations

import copy
import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch

import memguard
from memguard.backends.budget import Budget, budgets
from memguard.loop import Attempt
from memguard.mapping import BatchResults

LEAKS: list = []


def round_trips(obj):
    """``obj`` through pickle (every protocol) and through ``copy.deepcopy``."""
    copies = [pickle.loads(pickle.dumps(obj, protocol)) for protocol in
              range(pickle.HIGHEST_PROTOCOL + 1)]
    return [*copies, copy.deepcopy(obj), copy.copy(obj)]


def same_error(a: BaseException, b: BaseException) -> None:
    assert type(b) is type(a)
    assert b.args == a.args and str(b) == str(a)
    assert vars(b).keys() == vars(a).keys()


def test_snapshots_deltas_and_budgets_pickle_equal():
    before = memguard.snapshot()
    block = bytearray(8 << 20)
    after = memguard.snapshot()
    assert after.budgets and block  # a host budget is always known (physical memory at least)
    delta = after - before
    for original in (after, delta, after["host"], budgets("host")[0],
                     Budget("host", "memory_limit", 60 << 20, 42 << 20)):
        for twin in round_trips(original):
            assert twin == original and str(twin) == str(original)
    for twin in round_trips(after):
        assert twin.to_dict() == after.to_dict()
        assert twin["host"] == after["host"]  # still a read-only mapping
        with pytest.raises(TypeError, match="does not support item assignment"):
            twin.devices["host"] = None  # type: ignore[index]


def test_attempts_and_batch_results_carry_their_snapshots():
    failed = Attempt(size=8, ok=False, error="out of memory (MemoryError)", seconds=0.25,
                     memory=memguard.snapshot(), next_size=4)
    for original in (failed, Attempt(size=4, steps=2, ok=True, seconds=0.5)):
        for twin in round_trips(original):
            assert twin == original and twin.to_dict() == original.to_dict()
    results = BatchResults([1, 2, 3], history=[failed])
    for twin in round_trips(results):
        assert twin == results and twin.history == [failed]


def test_a_closed_scope_with_its_leaks_pickles_and_an_open_one_says_to_close_it():
    LEAKS.clear()
    with memguard.memory_scope("epoch", track_tensors=True) as scope:
        LEAKS.append(torch.ones(1 << 20))
    assert scope.leaks
    for twin in round_trips(scope):
        assert twin.to_dict() == scope.to_dict()
        assert twin.leaks == scope.leaks  # the tensors' fields (their holders stay here)
        assert str(twin).split("; retained")[0] == str(scope).split("; retained")[0]
    with memguard.memory_scope("clean") as clean:
        pass
    for twin in round_trips(clean):
        assert str(twin) == str(clean) and twin.to_dict() == clean.to_dict()
    fresh = memguard.memory_scope("unused", max_leak="1MiB")
    for twin in round_trips(fresh):
        assert str(twin) == str(fresh) and twin.max_leak == fresh.max_leak
        with twin:  # a copy of an unused scope is a scope of its own
            pass
        assert twin.retained.keys() == {"host"}
    with memguard.memory_scope("open") as open_scope:
        with pytest.raises(TypeError, match=r"memory_scope 'open' is open.*close it first"):
            pickle.dumps(open_scope)
        with pytest.raises(TypeError, match=r"memory_scope 'open' is open"):
            copy.deepcopy(open_scope)
    LEAKS.clear()


def test_a_copy_of_a_closed_scope_entered_again_measures_its_own_block(python_in_subprocess):
    # a copy keeps the snapshots and figures of the block it measured: entered again, it
    # reported that block's entry snapshot and the 16 MiB its cleanup had freed (in a process
    # of its own: the cycle mapped, freed and unmapped as on a fresh heap)
    out = python_in_subprocess("""
        import copy, gc, json, pickle
        import memguard

        class Cycle:
            def __init__(self):
                self.block, self.me = bytearray(16 << 20), self

        gc.disable()  # the cycle is the scope's cleanup's to free
        scope = memguard.memory_scope()
        with scope:
            Cycle()
        twins = []
        for twin in (copy.deepcopy(scope), pickle.loads(pickle.dumps(scope))):
            grown = bytearray(64 << 20)
            grown[::4096] = b"x" * len(grown[::4096])  # resident before the copy's entry
            with twin:
                pass
            twins.append({"freed": twin.freed, "entry": twin.before["host"].reserved})
            del grown
        print(json.dumps({"freed": scope.freed, "entry": scope.before["host"].reserved,
                          "twins": twins}))
    """)
    assert out["freed"] >= 8 << 20, out  # precondition: its cleanup freed the cycle
    for twin in out["twins"]:
        assert twin["freed"] == 0, out
        assert twin["entry"] >= out["entry"] + (48 << 20), out


def test_monitor_samples_and_tensor_infos_pickle():
    with memguard.MemoryMonitor(interval=0.01) as monitor:
        monitor.mark("start")
    held = torch.ones(1 << 18)
    info = next(i for i in memguard.live_tensors() if i.shape == (1 << 18,))
    for original in (monitor.samples, monitor.marks, dict(monitor.peak), info):
        for twin in round_trips(original):
            assert twin == original
    assert held.numel() == 1 << 18


def test_every_error_pickles_with_its_fields():
    LEAKS.clear()
    with pytest.raises(memguard.MemoryLeakError) as caught:
        with memguard.memory_scope("step", max_leak="1MiB", track_tensors=True):
            LEAKS.append(torch.ones(4 << 20))
    leak = caught.value
    assert leak.leaks and leak.retained["host"] > 1 << 20  # type: ignore[attr-defined]
    oom = memguard.OutOfMemoryError(
        "out of memory at batch sizes 8, 4",
        attempts=[Attempt(size=8, ok=False, error="out of memory", seconds=0.1,
                          memory=memguard.snapshot())],
        partial=[1, 2])
    oom.add_note("while training")
    errors = [memguard.MemguardError("bad value"), leak, oom,
              memguard.MemoryLeakError("kept 2 MiB", {"host": 2 << 20}, 1 << 20)]
    for original in errors:
        for twin in round_trips(original):
            same_error(original, twin)
            assert {k: v for k, v in vars(twin).items() if k != "leaks"} == \
                {k: v for k, v in vars(original).items() if k != "leaks"}
    for twin in round_trips(leak):
        assert twin.retained == leak.retained and twin.limit == leak.limit
        assert twin.leaks == leak.leaks  # type: ignore[attr-defined]
    for twin in round_trips(oom):
        assert twin.attempts == oom.attempts and twin.partial == [1, 2]
        assert twin.__notes__ == ["while training"]
        assert memguard.is_oom_error(twin) and isinstance(twin, MemoryError)
    LEAKS.clear()


def test_a_subclass_with_its_own_signature_still_pickles():
    class Tagged(memguard.MemoryLeakError):
        def __init__(self, tag: str) -> None:
            super().__init__(f"leak in {tag}", {"host": 5}, 1)
            self.tag = tag

    class FileGone(memguard.MemguardError, OSError):  # another exception layout
        pass

    for cls in (Tagged, FileGone):
        globals()[cls.__name__] = cls
        cls.__qualname__ = cls.__name__
    try:
        original = Tagged("epoch 3")
        for twin in round_trips(original):
            same_error(original, twin)
            assert twin.tag == "epoch 3" and twin.retained == {"host": 5}
        gone = FileGone(2, "no such file")
        for twin in round_trips(gone):
            same_error(gone, twin)
            assert twin.errno == 2 and twin.strerror == "no such file"
    finally:
        del globals()["Tagged"], globals()["FileGone"]


@pytest.mark.slow
def test_lightning_callback_after_a_fit_pickles_and_copies():
    pl = pytest.importorskip("pytorch_lightning")
    from memguard.integrations.lightning import MemguardCallback

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch, index):
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)),
                                       batch_size=4)
    callback = MemguardCallback(max_leak="1GiB", log_every_n_steps=1)
    pl.Trainer(max_epochs=2, callbacks=[callback], logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False).fit(Tiny(), data)
    assert len(callback.scopes) == 2
    for twin in round_trips(callback):
        assert [s.to_dict() for s in twin.scopes] == [s.to_dict() for s in callback.scopes]
        assert twin.failures == callback.failures
    twin = pickle.loads(pickle.dumps(callback))  # and the copy measures a fit of its own
    pl.Trainer(max_epochs=1, callbacks=[twin], logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False).fit(Tiny(), data)
    assert [s.name for s in twin.scopes] == ["lightning epoch 1", "lightning epoch 2",
                                             "lightning epoch 1"]
    assert len(callback.scopes) == 2


@pytest.mark.slow
def test_transformers_callback_after_training_pickles_and_copies(tmp_path):
    transformers = pytest.importorskip("transformers")
    from memguard.integrations.transformers import MemguardCallback

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            ids = torch.arange(i, i + 8) % 50
            return {"input_ids": ids, "labels": ids}

    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50,
                                     n_positions=16)
    callback = MemguardCallback(log_every_n_steps=1)
    args = transformers.TrainingArguments(
        str(tmp_path), num_train_epochs=1, per_device_train_batch_size=4, report_to=[],
        save_strategy="no", logging_strategy="no", disable_tqdm=True, use_cpu=True)
    trainer = transformers.Trainer(model=transformers.GPT2LMHeadModel(config), args=args,
                                   train_dataset=Tokens(), callbacks=[callback])
    trainer.train()
    assert [s.name for s in callback.scopes] == ["transformers epoch 1"]
    for twin in round_trips(callback):
        assert [s.to_dict() for s in twin.scopes] == [s.to_dict() for s in callback.scopes]
        assert twin._trainer is None  # found again at its next train
    assert callback._trainer() is trainer


@pytest.mark.slow
def test_keras_callback_after_a_fit_pickles_and_copies():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    keras = pytest.importorskip("keras")
    import numpy as np

    from memguard.integrations.keras import MemguardCallback

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    callback = MemguardCallback(log_every_n_steps=1)
    x = np.ones((8, 4), dtype="float32")
    model.fit(x, x[:, :1], batch_size=4, epochs=2, verbose=0, callbacks=[callback])
    assert [s.name for s in callback.scopes] == ["keras epoch 1", "keras epoch 2"]
    for twin in round_trips(callback):
        assert [s.to_dict() for s in twin.scopes] == [s.to_dict() for s in callback.scopes]
        assert twin.model is None and callback.model is model  # Keras sets it at fit


POOL = """
import multiprocessing, pickle, sys
import memguard

def oom(n):
    # A real out-of-memory: a bytearray under a 64 MiB address-space budget, at every size.
    @memguard.oom_retry(batch_size=4, min_batch_size=2, cache=False)
    def step(batch_size):
        return len(bytearray(batch_size * 512 * 2**20))

    with memguard.memory_limit("64MiB", device="host"):
        return step()

KEPT = []

def leak(n):
    with memguard.memory_scope("worker step", max_leak="1MiB"):
        KEPT.append(bytearray(8 * 2**20))

if __name__ == "__main__":
    context = multiprocessing.get_context("spawn")
    seen = {}
    with context.Pool(1) as pool:
        for name, fn in (("oom", oom), ("leak", leak)):
            try:
                pool.map_async(fn, [0]).get(timeout=60)
                seen[name] = "no error"
            except multiprocessing.TimeoutError:
                seen[name] = "hung"
            except Exception as exc:
                seen[name] = type(exc).__name__
                if isinstance(exc, memguard.OutOfMemoryError):
                    assert [a.size for a in exc.attempts] == [4, 2], exc.attempts
                    assert exc.attempts[0].memory["host"].reserved > 0
                    assert "out of memory" in str(exc)
                if isinstance(exc, memguard.MemoryLeakError):
                    assert exc.retained["host"] >= 8 * 2**20 and exc.limit == 2**20
                    assert "worker step" in str(exc)
        pool.terminate()
    print(seen)
"""


@pytest.mark.slow
def test_errors_raised_in_a_spawn_pool_reach_the_parent_as_themselves(tmp_path):
    path = tmp_path / "pool_errors.py"
    path.write_text(textwrap.dedent(POOL))
    env = dict(os.environ, MALLOC_ARENA_MAX="1")
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                          timeout=120, env=env, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == \
        "{'oom': 'OutOfMemoryError', 'leak': 'MemoryLeakError'}", proc.stdout + proc.stderr
