"""The pytest plugin, driven through pytest's own ``pytester`` in fresh processes."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

LEAKY = """
import pytest
import torch

CACHE = []


@pytest.mark.memguard(max_leak="16MiB")
def test_leaks():
    CACHE.append(torch.ones(64 * 2**20 // 4))


@pytest.mark.memguard(max_leak="16MiB")
def test_clean():
    torch.ones(64 * 2**20 // 4).sum()


@pytest.mark.memguard(max_leak="256MiB")
def test_within_its_limit():
    CACHE.append(torch.ones(32 * 2**20 // 4))


def test_unguarded_leak():
    CACHE.append(torch.ones(32 * 2**20 // 4))
"""


def test_marker_fails_a_leaking_test_with_a_short_message(pytester):
    pytester.makepyfile(test_leaky=LEAKY)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=3, failed=1)
    out = result.stdout.str()
    failure = out.split("test_leaks _")[1].split("short test summary")[0]
    lines = [line.strip("_= ") for line in failure.strip().splitlines()]
    assert lines[1].startswith("memguard: test_leaks retained ")
    assert lines[1].endswith(" MiB on host (max_leak 16.0 MiB)")
    assert lines[2] == ("float32[16777216] held by module test_leaky, global CACHE[0] "
                        "(64.0 MiB)")  # memory_scope's words
    assert len(lines) <= 4  # short: no traceback, no tensor dump


def test_command_line_limit_applies_to_every_test(pytester):
    pytester.makepyfile(test_leaky=LEAKY)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--memguard-max-leak=8MiB",
                                           "-k", "unguarded or clean")
    result.assert_outcomes(passed=1, failed=1)
    assert "memguard: test_unguarded_leak retained" in result.stdout.str()
    assert "(max_leak 8.0 MiB)" in result.stdout.str()


def test_plugin_can_be_turned_off(pytester):
    pytester.makepyfile(test_leaky=LEAKY)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:memguard")
    result.assert_outcomes(passed=4)


def test_max_peak_and_devices(pytester):
    pytester.makepyfile(test_peak="""
        import pytest
        import torch

        @pytest.mark.memguard(max_leak=None, max_peak="32MiB", devices="host")
        def test_spikes():
            torch.ones(128 * 2**20 // 4).sum()

        @pytest.mark.memguard(max_peak="256MiB")
        def test_modest():
            torch.ones(16 * 2**20 // 4).sum()
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    assert "memguard: test_spikes rose " in result.stdout.str()
    assert " above its start on host (max_peak 32.0 MiB)" in result.stdout.str()


def test_fixture_lets_a_test_assert_on_its_own_scope(pytester):
    pytester.makepyfile(test_fixture="""
        import torch

        KEEP = []

        def test_measures_itself(memguard_scope):
            assert memguard_scope.before is not None  # open while the test runs
            KEEP.append(torch.ones(48 * 2**20 // 4))
            memguard_scope.close()
            assert memguard_scope.retained["host"] > 40 * 2**20
            assert memguard_scope.leaks[0].holders == ["module test_fixture, global KEEP[0]"]
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_bad_option_and_marker_arguments_are_usage_errors(pytester):
    pytester.makepyfile(test_x="""
        import pytest

        @pytest.mark.memguard("1MiB")
        def test_positional():
            pass
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--memguard-max-leak=lots")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "'lots'" in result.stderr.str()
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    assert "memguard marker takes max_leak, max_peak and devices as keywords" in \
        result.stdout.str() + result.stderr.str()


BAD_MARKERS = """
import pytest

@pytest.mark.memguard(max_leak="bogus")
def test_bad_size():
    pass

@pytest.mark.memguard("1MiB")
def test_positional():
    pass

@pytest.mark.memguard(devices=5)
def test_bad_devices():
    pass

def test_fine():
    pass
"""


def test_bad_marker_arguments_fail_their_test_in_one_line_naming_it(pytester):
    pytester.makepyfile(test_bad=BAD_MARKERS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, errors=3)  # the others still run
    out = result.stdout.str()
    assert ("test_bad.py::test_bad_size: bad memguard marker: max_leak: cannot read 'bogus' as a "
            "size") in out
    assert ("test_bad.py::test_positional: the memguard marker takes max_leak, max_peak and "
            "devices as keywords, got '1MiB'") in out
    assert "test_bad.py::test_bad_devices: bad memguard marker: devices: expected None" in out
    assert "pytest_plugin.py" not in out and "Traceback" not in out  # no plugin traceback


def test_marker_without_max_leak_takes_the_command_line_limit(pytester):
    pytester.makepyfile(test_default="""
        import pytest
        import torch

        KEEP = []

        @pytest.mark.memguard(max_peak="1GiB")
        def test_leaks_4mib():
            KEEP.append(torch.ones(4 * 2**20 // 4))

        @pytest.mark.memguard(max_peak="1GiB")
        def test_leaks_96mib():
            KEEP.append(torch.ones(96 * 2**20 // 4))
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--memguard-max-leak=64MiB")
    result.assert_outcomes(passed=1, failed=1)
    assert "memguard: test_leaks_96mib retained" in result.stdout.str()
    assert "(max_leak 64.0 MiB)" in result.stdout.str()


FIRST_BACKWARD = """
import pytest
import torch

CACHE = []


def train_once():
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(),
                                torch.nn.Linear(2048, 512))
    optimizer = torch.optim.AdamW(model.parameters())
    loss = model(torch.randn(256, 512)).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def test_a_first_backward():
    train_once()


def test_leaks():
    train_once()
    CACHE.append(torch.ones(64 * 2**20 // 4))


def test_b_another_backward():
    train_once()
"""


def test_the_first_test_to_run_a_backward_is_not_charged_with_its_one_time_state(pytester):
    """Before: the first backward of the session failed at 16 MiB (20-24 MiB of one-time
    state); the leaking test must still fail."""
    pytester.makepyfile(test_first=FIRST_BACKWARD)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--memguard-max-leak=16MiB")
    result.assert_outcomes(passed=2, failed=1)
    out = result.stdout.str()
    assert "memguard: test_leaks retained 6" in out and "(max_leak 16.0 MiB)" in out
    assert "float32[16777216] held by module test_first, global CACHE[0] (64.0 MiB)" in out


def test_a_bare_marker_passes_a_trivial_first_test(pytester):
    """Before: a trivial first test failed the default 1 MiB limit (4.5 MiB of the resident set)."""
    pytester.makepyfile(test_trivial="""
        import pytest
        import torch

        @pytest.mark.memguard
        def test_trivial():
            assert torch.ones(3).sum().item() == 3

        @pytest.mark.memguard
        def test_second():
            assert torch.ones(3).sum().item() == 3
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)


def test_a_graph_leak_is_named_in_memory_scopes_words(pytester):
    pytester.makepyfile(test_graph="""
        import torch

        LOSSES = []
        MODEL = torch.nn.Sequential(torch.nn.Linear(256, 4096), torch.nn.Tanh(),
                                    torch.nn.Linear(4096, 1))

        def test_validation_keeps_its_losses():
            for _ in range(2):
                LOSSES.append(MODEL(torch.randn(1024, 256)).pow(2).mean())
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--memguard-max-leak=4MiB")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert ("float32[1024, 4096] and 3 more saved by the graph of float32[] held by module "
            "test_graph, global LOSSES[0] (17.0 MiB)") in out
    assert "global LOSSES[-1] (17.0 MiB)" in out
    assert "unknown holder" not in out


def test_a_test_that_imports_torch_first_is_not_judged_for_leaks(pytester):
    pytester.makepyfile(test_lazy="""
        CACHE = []

        def test_imports_torch():
            import torch
            torch.ones(3).sum()

        def test_leaks_later():
            import torch
            CACHE.append(torch.ones(64 * 2**20 // 4))
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--memguard-max-leak=8MiB",
                                           "-rA")
    result.assert_outcomes(passed=1, failed=1)
    out = result.stdout.str()
    assert "test_imports_torch imported torch for the first time in this process: not judged" \
        in out
    assert "memguard: test_leaks_later retained" in out
