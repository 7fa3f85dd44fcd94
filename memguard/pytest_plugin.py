"""memguard's pytest plugin: fail tests that leak memory, and a fixture to measure a test.

Installed with memguard (entry point ``pytest11``); ``-p no:memguard`` turns it off. A
guarded test (the ``memguard`` marker, or a global ``--memguard-max-leak``) runs in a
:func:`memguard.memory_scope` that tracks tensors and fails when a device retained more
than ``max_leak`` after cleanup, or rose more than ``max_peak``; the failure is one line
per device, with what keeps the memory in the report's ``memguard`` section. Each test is
judged on its own memory: what earlier tests left is freed first, one-time state is
created by a warm-up, and MKL's buffer cache is turned off (see the leaks guide)."""

from __future__ import annotations

import gc
import os
import sys
from typing import Any, Generator, Iterator, NamedTuple, Optional

import pytest

from ._units import format_bytes, parse_optional_size, parse_size
from .backends import check_devices, level_field, resolve_devices
from .cleanup import Readings, read_all
from .errors import MemoryLeakError
from .holders import describe_leaks
from .scope import MemoryScope


class Limits(NamedTuple):
    """A guarded test's limits, in bytes (``None``: not checked), and its devices."""

    max_leak: Optional[int]
    max_peak: Optional[int]
    devices: Optional[tuple[str, ...]]


_SCOPE = pytest.StashKey[MemoryScope]()
_LIMITS = pytest.StashKey[Optional[Limits]]()
_SECTIONS = pytest.StashKey[list[str]]()
_MAX_LEAK = pytest.StashKey[Optional[int]]()
_SESSION = pytest.StashKey["_Session"]()
DEFAULT_MAX_LEAK = "1MiB"
FRAMEWORKS = ("torch", "tensorflow")
SECTION = "memguard"
#: The environment variable that turns MKL's buffer cache off (any value does), and why the
#: plugin left the cache on (torch imported before the plugin could set it), if it did.
MKL_CACHE = "MKL_DISABLE_FAST_MM"
_cache_left_on: list[str] = []
_warmed: set[str] = set()


def _warm_up() -> None:
    """Create, once per process, what a first step creates (a tiny torch training step, a scope)."""
    if "scope" not in _warmed:
        _warmed.add("scope")
        with MemoryScope("memguard warm-up", track_tensors=True) as scope:
            pass
        scope.biggest_leak()
    if "torch" in sys.modules and "torch" not in _warmed:
        _warmed.add("torch")
        from .backends import torch_autograd

        torch_autograd.warm_up()


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config, parser: pytest.Parser,
                                  args: list[str]) -> None:
    """Turn MKL's buffer cache off before anything imports torch (it keeps buffers inside the
    in-use bytes, charged to the first test to call linear algebra); an existing value stays."""
    if MKL_CACHE in os.environ:
        return
    if "torch" in sys.modules:
        _cache_left_on.append(f"torch was imported before the plugin could set {MKL_CACHE}")
        return
    os.environ[MKL_CACHE] = "1"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("memguard", "memory limits for tests")
    group.addoption("--memguard-max-leak", metavar="SIZE", default=None,
                    help="fail every test that leaves more than SIZE (e.g. 1MiB) on a device; "
                         "overrides the memguard_max_leak ini value ('none': no global limit)")
    parser.addini("memguard_max_leak", "fail every test that leaves more than this size "
                  "(e.g. 1MiB) on a device; --memguard-max-leak overrides it", default="")


def _global_max_leak(config: pytest.Config) -> Optional[int]:
    """The limit for every test: the command line's, else the ini file's, else ``None``."""
    value = config.getoption("--memguard-max-leak")
    where = "--memguard-max-leak"
    if value is None:
        value = str(config.getini("memguard_max_leak")).strip()
        where = f"memguard_max_leak in {config.inipath}"
        if not value:
            return None
    if value.strip().lower() == "none":
        return None
    try:
        return parse_size(value, where)
    except (TypeError, ValueError) as exc:
        raise pytest.UsageError(f"{exc}; write a size such as 32MiB, or none") from None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "memguard(max_leak='1MiB', max_peak=None, devices=None): fail the test when it leaves "
        "more than max_leak allocated on a device, or rises more than max_peak above its "
        "starting level")
    config.stash[_MAX_LEAK] = _global_max_leak(config)
    config.stash[_SESSION] = _Session()
    config.pluginmanager.register(config.stash[_SESSION], "memguard-session")


def pytest_report_header(config: pytest.Config) -> list[str]:
    if not _cache_left_on:
        return []
    line = (f"memguard: MKL's buffer cache is on ({_cache_left_on[0]}): the first test to "
            f"run linear algebra of a new size may be charged with it; set {MKL_CACHE}=1 in "
            f"the environment to turn it off")
    return [line]


def _limits(item: pytest.Item) -> Optional[Limits]:
    """The item's :class:`Limits`, or ``None`` when it is not guarded; a bad marker fails the
    test at setup with one line."""
    if _LIMITS in item.stash:
        return item.stash[_LIMITS]
    marker = item.get_closest_marker("memguard")
    option = item.config.stash.get(_MAX_LEAK, None)
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
    """The memory scope of the running test: open while the body runs, unless the test closes
    it earlier to assert on it.

    Args:
        request: pytest's request for the running test.

    Returns:
        The test's :class:`memguard.MemoryScope` (``track_tensors=True``).

    Example::

        def test_epoch(memguard_scope):
            run_epoch()
            memguard_scope.close()
            assert memguard_scope.retained["host"] < 2**20
    """
    return _scope_for(request.node)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[Any]:
    limits = _limits(item)
    fixture = item.stash.get(_SCOPE, None)
    if limits is None and fixture is None:
        return (yield)
    session = item.config.stash[_SESSION]
    session.settle(None if limits is None else limits.max_leak)
    _warm_up()
    # The verdict rests on a scope of its own that closes after the body returned, whenever
    # the test closes the fixture's scope: what the test's locals held is gone by then.
    # It judges as memory_scope(max_leak=...) does, on the same path: below the allocators'
    # resolution the census of the tensors the test created decides.
    judge = (None if limits is None else
             MemoryScope(item.name, devices=limits.devices, max_leak=limits.max_leak,
                         track_tensors=True))
    scopes = [scope for scope in (judge, fixture) if scope is not None]
    imported = {name for name in FRAMEWORKS if name in sys.modules}
    sections = item.stash[_SECTIONS] = []
    try:
        for scope in scopes:
            scope.__enter__()
        result = yield
    except BaseException:
        for scope in reversed(scopes):  # a failed test is not judged; its traceback holds
            scope.close(cleanup="never", judge=False)  # what a cleanup would have to free
        session.done()
        raise
    first = sorted(name for name in FRAMEWORKS if name in sys.modules and name not in imported)
    over: dict[str, int] = {}
    for scope in reversed(scopes):
        if scope is not judge:
            scope.close()
            continue
        try:
            scope.close(judge=not first)  # a first import and first step are no leak of it
        except MemoryLeakError as leak:
            over = leak.retained
    session.done()
    if judge is None or limits is None:
        return result
    if first:
        sections.append(
            f"{item.name} imported {' and '.join(first)} for the first time in this process: "
            f"not judged for leaks (import it at the top of the test module to judge it)")
        limits = limits._replace(max_leak=None)
    verdict, details = _failure(item, judge, limits, over)
    if verdict:
        sections.append(details)
        pytest.fail(verdict, pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if call.when == "call":
        for text in item.stash.get(_SECTIONS, []):
            report.sections.append((SECTION, text))
    return report


class _Session:
    """The plugin's record of a session: what earlier tests may have left to be freed, and the
    tests over their limits (from the reports, so under xdist too) for the session's last line."""

    def __init__(self) -> None:
        self.exceeded: list[str] = []
        self.readings: Optional[Readings] = None  # after the last guarded test
        self.unsettled = True  # a test since then failed or was skipped in its body

    def settle(self, limit: Optional[int]) -> None:
        """Free what earlier tests left (``sys.last_*``, garbage in cycles) before a guarded test's
        scope opens, so it cannot cancel a leak out. The full collection runs only after a test
        that did not pass, or when the in-use bytes grew by more than the tolerance."""
        for name in ("last_type", "last_value", "last_traceback", "last_exc"):
            if hasattr(sys, name):
                delattr(sys, name)
                self.unsettled = True
        if self.unsettled or self.readings is None or self._grown(limit):
            gc.collect()
        self.unsettled = False

    def _grown(self, limit: Optional[int]) -> bool:
        assert self.readings is not None
        pairs = resolve_devices(None)
        now = read_all(pairs)
        for backend, device in pairs:
            before = self.readings.get(device)
            start = None if before is None else backend.in_use(before)
            end = backend.in_use(now[device])
            tolerance = backend.hold_tolerance if limit is None else min(
                limit, backend.hold_tolerance)
            if start is not None and end is not None and end - start > tolerance:
                return True
        return False

    def done(self) -> None:
        """Record the in-use bytes after a guarded test, which the next one settles against."""
        self.readings = read_all(resolve_devices(None))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed or (report.skipped and report.when == "call"):
            self.unsettled = True  # its traceback may hold what it allocated
        if report.when == "call" and report.failed and any(
                title == SECTION for title, _ in report.sections):
            self.exceeded.append(report.nodeid)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        count = len(self.exceeded)
        if count:
            terminalreporter.write_line(
                f"memguard: {count} test{'s' if count > 1 else ''} exceeded "
                f"{'their' if count > 1 else 'its'} memory limits: {', '.join(self.exceeded)}")


def _failure(item: pytest.Item, scope: MemoryScope, limits: Limits, over: dict[str, int]
             ) -> tuple[str, str]:
    """The short failure text (a line per device over its limit; ``""`` within limits) and the
    report section's text; ``over``: the devices the scope's own verdict found over."""
    max_leak, max_peak = limits.max_leak, limits.max_peak
    lines, measured = [], []
    leaked = False
    for device, retained in scope.retained.items():
        start = (None if scope.before is None else
                 getattr(scope.before[device], level_field(device)))
        peak = scope.peak.get(device)
        rise = None if peak is None or start is None else peak - start
        measured.append(f"{device}: retained {format_bytes(retained)}, peak "
                        f"{format_bytes(peak)} ({format_bytes(rise)} above its start)")
        if max_leak is not None and device in over:
            leaked = True
            lines.append(f"memguard: {item.name} retained {format_bytes(retained)} on {device} "
                         f"(max_leak {format_bytes(max_leak)})")
        if max_peak is not None and rise is not None and rise > max_peak:
            lines.append(f"memguard: {item.name} rose {format_bytes(rise)} above its start on "
                         f"{device} (max_peak {format_bytes(max_peak)})")
    if not lines:
        return "", ""
    if scope.leaks:
        measured += [f"  {line}" for line in describe_leaks(scope.leaks)]
    elif leaked:
        measured.append(f"  no tensor that {item.name} created is still alive: the memory is "
                        f"held outside tensors (Python objects, a library's buffers)")
    return "\n".join(lines), "\n".join(measured)
