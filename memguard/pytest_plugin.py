"""memguard's pytest plugin: fail tests that leak memory, and a fixture to measure a test.

Installed with memguard (entry point ``pytest11``); ``-p no:memguard`` turns it off.

- ``@pytest.mark.memguard(max_leak="1MiB", max_peak=None, devices=None)``: run the test in a
  :func:`memguard.memory_scope` that tracks tensors; fail it when a device retained more than
  ``max_leak`` after cleanup, or rose more than ``max_peak`` above its level at the start.
  Without ``max_leak`` the limit is ``--memguard-max-leak``, else 1 MiB; ``max_leak=None``
  checks no leak. A marker with bad arguments fails its test at setup, in one line.
- ``--memguard-max-leak=SIZE``: the same check, with that limit, for every test.
- the ``memguard_scope`` fixture: the scope of the running test; ``memguard_scope.close()``
  ends it early so that the test can assert on ``retained`` and ``peak`` itself.

Retention is judged on what the allocators hand out (glibc's in-use bytes on the host,
``allocated`` on GPUs), as in :func:`memguard.memory_scope`. State that only a process's first
training step creates is never charged to a test: before the first guarded test of a process
the plugin runs a warm-up (one tiny forward, backward and AdamW step with torch, when the
program imported it, and one throwaway scope), and a test during which torch or TensorFlow is
imported for the first time in the process is not judged for leaks (its peak still is).
"""

from __future__ import annotations

import sys
from typing import Any, Iterator, NamedTuple, Optional

import pytest

from ._units import format_bytes, parse_optional_size, parse_size
from .backends import check_devices, level_field
from .scope import MemoryScope
from .tensors import describe_leaks


class Limits(NamedTuple):
    """A guarded test's limits, in bytes (``None``: not checked), and its devices."""

    max_leak: Optional[int]
    max_peak: Optional[int]
    devices: Optional[tuple[str, ...]]


_SCOPE = pytest.StashKey[MemoryScope]()
_LIMITS = pytest.StashKey[Optional[Limits]]()
DEFAULT_MAX_LEAK = "1MiB"
FRAMEWORKS = ("torch", "tensorflow")
_warmed: set[str] = set()


def _warm_up() -> None:
    """Create, once per process, what a first step creates: torch's one tiny training step
    (when torch is imported) and memguard's own first scope."""
    if "scope" not in _warmed:
        _warmed.add("scope")
        with MemoryScope("memguard warm-up", track_tensors=True) as scope:
            pass
        scope.biggest_leak()
    if "torch" in sys.modules and "torch" not in _warmed:
        _warmed.add("torch")
        from .backends import torch_autograd

        torch_autograd.warm_up()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("memguard", "memory limits for tests")
    group.addoption("--memguard-max-leak", metavar="SIZE", default=None,
                    help="fail every test that leaves more than SIZE (e.g. 1MiB) on a device")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "memguard(max_leak='1MiB', max_peak=None, devices=None): fail the test when it leaves "
        "more than max_leak allocated on a device, or rises more than max_peak above its "
        "starting level")
    option = config.getoption("--memguard-max-leak")
    if option is not None:
        try:
            parse_size(option, "--memguard-max-leak")
        except (TypeError, ValueError) as exc:
            raise pytest.UsageError(str(exc)) from None


def _limits(item: pytest.Item) -> Optional[Limits]:
    """The item's :class:`Limits`, or None when it is not guarded.

    A marker without ``max_leak`` takes ``--memguard-max-leak``, else 1 MiB. A bad marker fails
    the test at setup with one line naming it (as pytest does for a bad ``skipif``).
    """
    if _LIMITS in item.stash:
        return item.stash[_LIMITS]
    marker = item.get_closest_marker("memguard")
    option = item.config.getoption("--memguard-max-leak")
    limits: Optional[Limits] = None
    if marker is not None or option is not None:
        kwargs = dict(marker.kwargs) if marker is not None else {}
        unknown = sorted(set(kwargs) - {"max_leak", "max_peak", "devices"})
        if unknown or (marker is not None and marker.args):
            args = marker.args if marker is not None else ()
            got = [repr(arg) for arg in args] + [f"{key}=" for key in unknown]
            pytest.fail(f"{item.nodeid}: the memguard marker takes max_leak, max_peak and "
                        f"devices as keywords, got {', '.join(got)}", pytrace=False)
        max_leak = kwargs.get("max_leak", DEFAULT_MAX_LEAK if option is None else option)
        try:
            limits = Limits(parse_optional_size(max_leak, "max_leak"),
                            parse_optional_size(kwargs.get("max_peak"), "max_peak"),
                            check_devices(kwargs.get("devices")))
        except (TypeError, ValueError) as exc:
            pytest.fail(f"{item.nodeid}: bad memguard marker: {exc}", pytrace=False)
    item.stash[_LIMITS] = limits
    return limits


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _limits(item)  # a bad marker fails here, before the test's fixtures run


def _scope_for(item: pytest.Item) -> MemoryScope:
    if _SCOPE not in item.stash:
        limits = _limits(item)
        devices = limits.devices if limits else None
        item.stash[_SCOPE] = MemoryScope(item.name, devices=devices, track_tensors=True)
    return item.stash[_SCOPE]


@pytest.fixture
def memguard_scope(request: pytest.FixtureRequest) -> MemoryScope:
    """The memory scope of the running test (it opens when the test body starts)."""
    return _scope_for(request.node)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[Any]:
    limits = _limits(item)
    if limits is None and _SCOPE not in item.stash:
        return (yield)
    _warm_up()
    scope = _scope_for(item)
    imported = {name for name in FRAMEWORKS if name in sys.modules}
    scope.__enter__()
    try:
        result = yield
    except BaseException:
        scope.close()
        raise
    scope.close()
    first = sorted(name for name in FRAMEWORKS if name in sys.modules and name not in imported)
    if first and limits is not None:  # its import and first step are no leak of the test
        item.add_report_section("call", "memguard", (
            f"{item.name} imported {' and '.join(first)} for the first time in this process: "
            f"not judged for leaks (import it at the top of the test module to judge it)"))
        limits = limits._replace(max_leak=None)
    if limits is not None:
        failure = _failure(item, scope, limits)
        if failure:
            pytest.fail(failure, pytrace=False)
    return result


def _failure(item: pytest.Item, scope: MemoryScope, limits: Limits) -> str:
    """The short failure text: a line per offending device, then what keeps the leaked
    tensors, in :func:`memguard.memory_scope`'s words (three groups at most)."""
    max_leak, max_peak = limits.max_leak, limits.max_peak
    lines = []
    for device, retained in scope.retained.items():
        if max_leak is not None and retained > max_leak:
            lines.append(f"memguard: {item.name} retained {format_bytes(retained)} on {device} "
                         f"(max_leak {format_bytes(max_leak)})")
    if max_peak is not None and scope.before is not None:
        for device, peak in scope.peak.items():
            start = getattr(scope.before[device], level_field(device))
            if peak is not None and start is not None and peak - start > max_peak:
                lines.append(f"memguard: {item.name} rose {format_bytes(peak - start)} above its "
                             f"start on {device} (max_peak {format_bytes(max_peak)})")
    if lines and scope.leaks:
        lines += [f"  {line}" for line in describe_leaks(scope.leaks)]
    return "\n".join(lines)
