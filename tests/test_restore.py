"""``oom_retry(restore=...)``: restoring that runs out of memory says so, the state kept in a
file instead of host memory, and Keras models restored like torch ones.

Out-of-memory errors are real: subprocesses with a soft RLIMIT_AS budget (see budget.py).
"""

from __future__ import annotations

import pytest

from budget import ENV, script

RESTORE_OOM = """
import torch, memguard
torch.set_num_threads(1)
model = torch.nn.Linear(2048, 2048)  # 16 MiB of weights, 16 of gradients
optimizer = torch.optim.Adam(model.parameters())
model(torch.ones(1, 2048)).sum().backward()
optimizer.step()  # 32 MiB of optimizer state, copied afresh at each restore
hold = []

@memguard.oom_retry(batch_size=8, restore=(model, optimizer))
def train(batch_size):
    if not hold:  # the first attempt leaves the budget nearly full, then runs out
        while True:
            try:
                hold.append(torch.empty(4 * 2**20, dtype=torch.uint8))
            except RuntimeError:
                break
        del hold[-2:]  # 8 MiB left: less than restoring the optimizer needs
        torch.empty(1 << 42)
    return batch_size

set_budget(200)
try:
    train()
    out = {"type": None}
except Exception as exc:
    out = {"type": type(exc).__name__, "message": str(exc), "oom": memguard.is_oom_error(exc),
           "attempts": [a.size for a in train.history]}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_restoring_that_runs_out_of_memory_says_so(python_in_subprocess):
    out = python_in_subprocess(script(RESTORE_OOM), env=ENV)
    assert out["type"] == "OutOfMemoryError" and out["oom"], out
    assert "restoring" in out["message"] and "Linear" in out["message"], out
    assert "MiB" in out["message"] and "restore_to='file'" in out["message"], out
    assert out["attempts"] == [8]


FILE_BUDGET = """
import torch, memguard
torch.set_num_threads(1)
model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(16)])  # 64 MiB
first = [p.detach().clone() for p in model.parameters()]
calls = []
set_budget(48)  # less than a copy of the weights

@memguard.oom_retry(batch_size=8, restore=model, restore_to=TO)
def train(batch_size):
    calls.append(batch_size)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    if batch_size > 2:
        torch.empty(1 << 42)
    return batch_size

try:
    size = train()
    out = {"size": size, "calls": calls,
           "restored": all(torch.equal(p, f + 1.0)
                           for p, f in zip(model.parameters(), first, strict=True))}
except Exception as exc:
    out = {"error": type(exc).__name__, "message": str(exc)[:400], "calls": calls,
           "cause": type(exc.__cause__).__name__, "oom": memguard.is_oom_error(exc)}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_restore_to_file_holds_no_copy_in_host_memory(python_in_subprocess):
    in_memory = python_in_subprocess(script(FILE_BUDGET.replace("TO", "'memory'")), env=ENV)
    # a copy in memory does not fit: memguard's error, naming the size and the way out, chained
    # to torch's, before any attempt ran
    assert in_memory["error"] == "OutOfMemoryError" and in_memory["oom"], in_memory
    assert in_memory["cause"] == "RuntimeError" and in_memory["calls"] == [], in_memory
    copying = "copying the state of Sequential (64.1 MiB of tensors) to host memory"
    assert copying in in_memory["message"], in_memory
    assert "restore_to='file'" in in_memory["message"], in_memory
    in_file = python_in_subprocess(script(FILE_BUDGET.replace("TO", "'file'")), env=ENV)
    assert in_file == {"size": 2, "calls": [8, 4, 2], "restored": True}, in_file


def test_restore_to_is_checked():
    import torch

    import memguard

    with pytest.raises(ValueError, match=r"restore_to must be 'auto', 'memory' or 'file', "
                                         r"got 'disk'"):
        memguard.oom_retry(restore=torch.nn.Linear(1, 1), restore_to="disk")


KERAS = """
import numpy as np, keras, memguard
keras.utils.set_random_seed(0)

def build():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.BatchNormalization(), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    return model

model, fresh, plain, filed = build(), build(), build(), build()
for other in (fresh, plain, filed):
    other.set_weights(model.get_weights())
x = np.random.default_rng(1).normal(size=(128, 8)).astype("float32")
y = np.random.default_rng(2).normal(size=(128, 1)).astype("float32")

def training(net):
    def train(batch_size):
        net.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
        if batch_size > 16:
            np.empty(1 << 50)  # a real out-of-memory, after the attempt trained a while
        return batch_size
    return train

retried = memguard.oom_retry(batch_size=64, factor=0.25, restore=model)(training(model))
size = retried()
in_file = memguard.oom_retry(batch_size=64, factor=0.25, restore=filed,
                             restore_to="file")(training(filed))
in_file()
training(fresh)(16)
memguard.oom_retry(batch_size=64, factor=0.25)(training(plain))()  # control: no restore
from memguard.backends.steps import torch_state
kept = torch_state.copy_states(torch_state.check_restorable(filed, "file"))
kept_in = kept.path  # what an error restoring it names
kept.discard()
same = lambda a, b: all(np.array_equal(u, v) for u, v in zip(a.get_weights(), b.get_weights()))
print(json.dumps({"size": size, "tried": [a.size for a in retried.history],
                  "equal": same(model, fresh), "control_equal": same(plain, fresh),
                  "file_equal": same(filed, fresh), "kept_in": kept_in,
                  "iterations": [int(m.optimizer.iterations.numpy()) for m in (model, fresh)]}))
"""


@pytest.mark.slow
def test_restore_takes_a_keras_model_and_its_optimizer(python_in_subprocess):
    out = python_in_subprocess(script(KERAS), env=ENV, timeout=240)
    assert out["size"] == 16 and out["tried"] == [64, 16], out
    assert out["equal"] and out["file_equal"] and not out["control_equal"], out
    assert out["iterations"] == [8, 8], out
    assert out["kept_in"] and out["kept_in"].endswith(".npy"), out  # not "host memory"


@pytest.mark.gpu
@pytest.mark.parametrize("to", ["memory", "file"])
def test_restore_puts_cuda_state_back_in_place(to):
    import torch

    from memguard.backends.steps import torch_state

    model = torch.nn.Linear(256, 256).cuda()
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 256, device="cuda")).sum().backward()
    optimizer.step()
    weights = [p.detach().clone() for p in model.parameters()]
    grads = [p.grad.clone() for p in model.parameters()]
    moments = [optimizer.state[p]["exp_avg"].clone() for p in model.parameters()]
    saved = torch_state.copy_states(torch_state.check_restorable((model, optimizer), to))
    assert (saved.path is not None) == (to == "file")
    optimizer.step()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
            p.grad.add_(1.0)
    saved.load()
    for p, w, g, m in zip(model.parameters(), weights, grads, moments, strict=True):
        assert p.is_cuda and torch.equal(p, w) and torch.equal(p.grad, g)
        assert optimizer.state[p]["exp_avg"].is_cuda and torch.equal(
            optimizer.state[p]["exp_avg"], m)
    saved.discard()
