"""memguard's pytest plugin: fail tests that leak memory, and a fixture to measure a test.

Installed with memguard (entry point ``pytest11``); ``-p no:memguard`` turns it off.

- ``@pytest.mark.memguard(max_leak="1MiB", max_peak=None, devices=None)``: run the test in a
  :func:`memguard.memory_scope` that tracks tensors; fail it when a device retained more than
  ``max_leak`` after cleanup, or rose more than ``max_peak`` above its level at the start.
  Without ``max_leak`` the limit is the global one, else 1 MiB; ``max_leak=None`` checks no
  leak. A marker with bad arguments fails its test at setup, in one line.
- ``--memguard-max-leak=SIZE`` or ``memguard_max_leak = SIZE`` in the ini file (``pytest.ini``,
  ``setup.cfg``, ``tox.ini``, ``pyproject.toml``): the same check, with that limit, for every
  test. The command line overrides the ini file; ``none`` sets no global limit.
- the ``memguard_scope`` fixture: the test's own scope; ``memguard_scope.close()`` ends it
  early so that the test can assert on ``retained`` and ``peak`` itself. The plugin's verdict
  does not rest on it: it is taken when the test returns, once its locals are gone.

A failure is one line per device over its limit, with what keeps the memory in the report's
``memguard`` section, and a line at the end of the session lists the tests that exceeded their
limits.

Each test is judged on its own memory. Retention is judged on what the allocators hand out
(glibc's in-use bytes on the host, ``allocated`` on GPUs) and, for a growth under 64 KiB
(what those figures move by when nothing is kept), on the tensors the test created and left
alive: the verdict of :func:`memguard.memory_scope` with the same ``max_leak``, taken by one.
Before a guarded test's scope opens, what earlier tests left to be freed (the traceback of a
failed or skipped test, ``sys.last_value``, garbage in reference cycles) is freed, so that it
cannot cancel a leak out. State that only a process's first training step creates is never
charged to a test: before the first guarded test of a process the plugin runs a warm-up (one
tiny forward, backward and AdamW step with torch, when the program imported it, and one
throwaway scope), and a test during which torch or TensorFlow is imported for the first time
in the process is not judged for leaks (its peak still is). Library caches that live inside
the in-use bytes are turned off for the session where the plugin can: MKL's buffer cache
(``MKL_DISABLE_FAST_MM=1``, set before torch is imported unless the environment sets it),
which would otherwise charge the first linear algebra of a size with its buffers (4 to 18 MiB
measured for ``torch.linalg`` calls on matrices of 64 to 512 rows).
"""

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


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config, parser: pytest.Parser,
                                  args: list[str]) -> None:
    """Turn MKL's buffer cache off before the conftest files or the tests import torch: the
    cache holds buffers sized to the largest linear algebra call so far inside the in-use bytes
    (12 MiB for a first 64 x 64 solve), which the first test to call it would be charged
    with. A value already in the environment is left as it is."""
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
    """The limit for every test: the command line's, else the ini file's, else None. An
    unreadable size is a usage error that names where it came from."""
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
    """The item's :class:`Limits`, or None when it is not guarded.

    A marker without ``max_leak`` takes the global limit, else 1 MiB. A bad marker fails
    the test at setup with one line naming it (as pytest does for a bad ``skipif``).
    """
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
    """The memory scope of the running test: it opens when the test body starts and closes
    when the body returns, unless the test closes it earlier to assert on it.

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
    """The plugin's record of a session: what earlier tests may have left to be freed, and
    the tests that exceeded their limits (gathered from the reports, so on the controller too
    under pytest-xdist) for one line at the end of the session."""

    def __init__(self) -> None:
        self.exceeded: list[str] = []
        self.readings: Optional[Readings] = None  # after the last guarded test
        self.unsettled = True  # a test since then failed or was skipped in its body

    def settle(self, limit: Optional[int]) -> None:
        """Free what earlier tests left to be freed before a guarded test's scope opens, so
        that it cannot cancel a leak out: the last failure's ``sys.last_*`` (pytest drops
        them only inside the next test's call) and garbage in reference cycles, such as the
        traceback of a failed or skipped test and the frames it holds. The full collection
        (the dear part: tens to hundreds of ms) runs only when a test since the last guarded
        one did not pass, or when the in-use bytes grew since then by more than the test's
        ``limit`` or the backend's hold tolerance."""
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
    """The short failure text, a line per offending device (``""`` when within limits), and
    the report section's text: per device what was retained and how high it rose, then what
    keeps the leaked tensors, in :func:`memguard.memory_scope`'s words (three groups at
    most). ``over`` is the scope's own ``max_leak`` verdict: the devices it found over."""
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
