"""One way to say each thing: ``cleanup=`` means the same everywhere, devices come first,
argument checks speak with one voice."""

import re
import warnings

import pytest
import torch

import memguard
from memguard.integrations._core import check_options

MiB = 1 << 20

# Every guard that cleans up, built with a given cleanup value.
GUARDS = {
    "memory_scope": lambda cleanup: memguard.memory_scope(cleanup=cleanup),
    "frees_memory": lambda cleanup: memguard.frees_memory(cleanup=cleanup)(lambda: None),
    "inference_mode": lambda cleanup: memguard.inference_mode(cleanup=cleanup),
    "MemguardCallback": lambda cleanup: check_options(None, False, cleanup, None),
}


@pytest.mark.parametrize("guard", sorted(GUARDS))
@pytest.mark.parametrize("value", ["auto", "always", "never"])
def test_every_guard_takes_the_same_three_cleanup_values(guard, value):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the current spelling never warns
        GUARDS[guard](value)


@pytest.mark.parametrize("guard", sorted(GUARDS))
@pytest.mark.parametrize("value", ["sometimes", None, 1, "Auto"])
def test_every_guard_refuses_the_same_wrong_cleanup_values(guard, value):
    with pytest.raises(ValueError, match=r"cleanup must be 'auto', 'always' or 'never', got "):
        GUARDS[guard](value)


@pytest.mark.parametrize("guard", sorted(GUARDS))
@pytest.mark.parametrize("old, new", [(True, "auto"), (False, "never")])
def test_the_older_boolean_spelling_is_refused_naming_the_word_to_write(guard, old, new):
    with pytest.raises(ValueError, match=f"got {old} \\(write cleanup='{new}'\\)"):
        GUARDS[guard](old)


def test_cleanup_never_measures_without_cleaning_in_every_guard():
    kept = []
    with memguard.memory_scope(cleanup="never") as scope:
        kept.append(bytearray(32 * MiB))
    assert scope.freed == 0 and scope.retained["host"] >= 32 * MiB

    @memguard.frees_memory(cleanup="never", max_leak="8MiB", warmup=0)
    def step():
        kept.append(bytearray(32 * MiB))

    with pytest.raises(memguard.MemoryLeakError):  # still judged: measuring is not cleaning
        step()

    model = torch.nn.Linear(4, 4)
    with memguard.inference_mode(model, cleanup="never"):
        assert not model.training
    assert model.training


def test_cleanup_always_collects_a_cycle_that_auto_may_leave():
    class Node:
        def __init__(self):
            self.payload = bytearray(48 * MiB)
            self.me = self

    with memguard.memory_scope(cleanup="always") as scope:
        Node()
    assert scope.retained["host"] < 8 * MiB


def test_scope_close_takes_the_same_values():
    scope = memguard.memory_scope("early")
    scope.__enter__()
    with pytest.raises(ValueError, match=r"MemoryScope\.close: cleanup must be"):
        scope.close(cleanup="later")
    scope.close(cleanup="never", judge=False)
    assert scope.freed == 0 and scope.after is not None


def test_memory_report_takes_the_device_first_and_top_by_keyword():
    keep = torch.ones(MiB // 4)
    report = memguard.memory_report("cpu", top=1)
    assert report.splitlines()[1].split()[0] == "cpu"
    with pytest.raises(TypeError, match=r"write memory_report\(top=5\)"):
        memguard.memory_report(5)
    with pytest.raises(TypeError):
        memguard.memory_report("cpu", 5)  # top is keyword-only
    del keep


@pytest.mark.parametrize("call, message", [
    (lambda: memguard.frees_memory(every=0), "frees_memory: every must be a positive int, got 0"),
    (lambda: memguard.record_history(max_entries=0),
     "record_history: max_entries must be a positive int, got 0"),
    (lambda: memguard.MemoryMonitor(max_samples=1),
     "MemoryMonitor: max_samples must be an int >= 2, got 1"),
    (lambda: memguard.memory_report(top=True),
     "memory_report: top must be a positive int, got True"),
    (lambda: check_options(None, False, "auto", 0),
     "MemguardCallback: log_every_n_steps must be a positive int, got 0"),
])
def test_counts_are_checked_by_one_rule_with_one_message(call, message):
    with pytest.raises(ValueError, match=re.escape(message)) as caught:
        call()
    assert str(caught.value).startswith(message)


def test_level_field_names_the_figure_budgets_count():
    from memguard.backends import Reading, host, level_field

    assert level_field("host") == "reserved" and level_field("cuda:1") == "allocated"
    reading = host.read_fast()
    assert isinstance(reading, Reading)
    assert host.level(reading) == reading.reserved


def test_a_backend_must_implement_the_abstract_methods():
    from memguard.backends import Backend

    class Half(Backend):
        def devices(self):
            return []

    with pytest.raises(TypeError, match="abstract"):
        Half()
