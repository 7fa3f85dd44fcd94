"""What the three callbacks share (memguard.integrations._core), without a framework."""

from __future__ import annotations

import importlib

import pytest

import memguard.cleanup
from memguard.integrations._core import TRAIN, VAL, CallbackBase, Tracker, check_options
from memguard.loop import Attempt, error_text


@pytest.fixture
def settles(monkeypatch):
    """Every cleanup a memory_scope runs at its exit, recorded."""
    calls = []
    real = memguard.cleanup.Settler.settle

    def settle(self, pairs, entry, *args, **kwargs):
        calls.append(self)
        return real(self, pairs, entry, *args, **kwargs)

    monkeypatch.setattr(memguard.cleanup.Settler, "settle", settle)
    return calls


def test_a_failure_closes_the_open_scopes_measured_but_without_cleanup(settles):
    tracker = Tracker("demo", "1MiB", False, "always", None)
    tracker.begin(TRAIN)
    tracker.end(TRAIN)
    assert len(settles) == 1  # an epoch's normal end cleans up as its policy says
    tracker.begin(TRAIN)
    tracker.begin(VAL)
    scopes = list(tracker.open.values())
    block = bytearray(8 << 20)  # above max_leak: a failed run is not judged either
    try:
        raise RuntimeError("Graph execution error:\n\nOOM when allocating tensor with shape[9]")
    except RuntimeError as exc:  # as Lightning's on_exception: inside the trainer's except
        record = tracker.failed(exc)
        expected = error_text(exc)
    del block
    assert len(settles) == 1 and tracker.open == {}
    assert all(s.after is not None and s.freed == 0 and s.cleanup == "never" for s in scopes)
    assert record["error"] == expected and "OOM when allocating tensor" in expected
    assert tracker.failures == [record]


@pytest.mark.parametrize("cleanup", ["auto", "always", "never"])
def test_check_options_takes_every_policy_memory_scope_takes(cleanup):
    assert check_options(None, False, cleanup, None)[2] == cleanup


@pytest.mark.parametrize("cleanup", ["sometimes", 1, 0.0, None])
def test_check_options_refuses_what_memory_scope_refuses(cleanup):
    with pytest.raises(ValueError, match="MemguardCallback: cleanup must be ") as caught:
        check_options(None, False, cleanup, None)
    assert str(caught.value) == (f"MemguardCallback: cleanup must be 'auto', 'always' or "
                                 f"'never', got {cleanup!r}")


@pytest.mark.parametrize("module, framework_callback", [
    ("lightning", "pytorch_lightning:Callback"), ("transformers", "transformers:TrainerCallback"),
    ("keras", "keras:callbacks.Callback"),
])
def test_every_callback_shares_the_base_and_stays_its_frameworks_callback(module,
                                                                          framework_callback):
    package, path = framework_callback.split(":")
    base = pytest.importorskip(package)
    for part in path.split("."):
        base = getattr(base, part)
    cls = importlib.import_module(f"memguard.integrations.{module}").MemguardCallback
    assert issubclass(cls, CallbackBase) and issubclass(cls, base)  # its trainer takes it
    callback = cls(max_leak="64MiB", log_every_n_steps=5)
    assert callback.scopes == [] and callback.failures == []
    # every callback records an oom_retry failure alike: the size, the error, the memory
    memory = memguard.snapshot()
    callback.on_retry(Attempt(size=32, ok=False, error="out of memory (test)", memory=memory,
                              next_size=16))
    [failure] = callback.failures
    assert failure["batch_size"] == 32 and failure["error"] == "out of memory (test)"
    assert failure["memory"] == memory.to_dict()
    with pytest.raises(ValueError, match="MemguardCallback: max_leak"):
        cls(max_leak="lots")


def test_averaged_over_tells_tokens_samples_and_labelled_samples_apart():
    from memguard.integrations._core import SAMPLES_OR_LABELLED, averaged_over

    values = [2.0, 5.0, 3.0, 7.0, 1.0, 4.0]

    def reader(counts):
        def mean(kind):
            def loss(i, j):
                part = list(zip(values[i:j], counts[i:j], strict=True))
                labelled = [(v, c) for v, c in part if c > 0]
                if kind != "samples" and not labelled:
                    return float("nan")  # a mean over nothing
                if kind == "tokens":
                    return sum(v * c for v, c in labelled) / sum(c for _, c in labelled)
                if kind == "labelled":
                    return sum(v for v, _ in labelled) / len(labelled)
                return sum(v if c > 0 else 0.0 for v, c in part) / len(part)  # samples
            return loss
        return mean, (lambda i, j: sum(counts[i:j]))

    # the sample without labels is the fifth: the window read holds it
    mean, tokens = reader([3, 1, 4, 2, 0, 2])
    assert {kind: averaged_over(mean(kind), tokens, 6)
            for kind in ("tokens", "samples", "labelled")} == \
        {"tokens": "tokens", "samples": "samples", "labelled": "labelled"}
    # every sample labelled: all samples and labelled ones weight this batch alike
    mean, tokens = reader([3, 1, 4, 2, 5, 2])
    assert averaged_over(mean("labelled"), tokens, 6) == SAMPLES_OR_LABELLED
    assert averaged_over(mean("labelled"), tokens, 6, known=SAMPLES_OR_LABELLED) == \
        SAMPLES_OR_LABELLED
    # no four neighbours hold both a sample without labels and labels of different counts:
    # tokens and labelled samples match the samples read yet weight the batch differently
    mean, tokens = reader([0, 2, 2, 2, 2, 3])
    assert averaged_over(mean("labelled"), tokens, 6) is None
