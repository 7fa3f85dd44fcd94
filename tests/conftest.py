"""Shared helpers: markers, and running a snippet in a fresh interpreter."""

from __future__ import annotations

import functools
import gc
import importlib
import inspect
import json
import os
import re
import sys
import tempfile
import textwrap
import time

import pytest
import warm

MiB = 1 << 20


def _freeze_what_torch_imported() -> None:
    """Move the objects of torch's import (about 170,000), and of the trainers' (Lightning,
    transformers: 440,000 in all), to the collector's permanent generation before any test
    module is imported: each full collection (memguard makes one at every scope, retry and
    cleanup) walked them all, 0.2-0.5 s on a 2-core machine; two files of scope and retry
    tests took 46 s with them and 19 s without. What the tests create is collected, listed
    and walked as before; a frozen object is one no test made. TensorFlow is not imported
    here: once it is, memguard reads its CPU pool in every host reading."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return
    for imports in (("lightning.pytorch",), ("pytorch_lightning",),
                    ("transformers", "Trainer", "TrainingArguments", "GPT2LMHeadModel")):
        try:
            module = importlib.import_module(imports[0])
            for name in imports[1:]:
                getattr(module, name)  # transformers imports its parts when first named
        except ImportError:
            pass
    gc.collect()
    gc.freeze()


_freeze_what_torch_imported()

# programs that torchrun starts, not tests: --doctest-modules would import them (and the
# frameworks they import) at collection
collect_ignore = ["torchrun_scripts", "typed_usage.py"]


def _has_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


FRAMEWORKS = re.compile(r"\b(tensorflow|keras|transformers|lightning|accelerate)\b")
TESTS = os.path.dirname(os.path.abspath(__file__))


@functools.cache
def _names_a_framework(path: str) -> bool:
    """Whether the test module at ``path`` names a framework: it may import it in the test
    process."""
    with open(path, encoding="utf-8") as f:
        return FRAMEWORKS.search(f.read()) is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if any(item.get_closest_marker("gpu") for item in items) and not _has_gpu():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(skip)
    # Once a test imports TensorFlow, transformers or Lightning, the rest of its process pays
    # for their objects at every full collection (memguard collects at every retry): 4 files
    # of guard tests took 37 s alone and 89 s after those imports. So the tests that may
    # import one run last, in each xdist worker too (workers take tests in this order).
    items.sort(key=_framework_rank)


def _framework_rank(item: pytest.Item) -> int:
    """0: a test whose module names no framework; 1: one whose module does; 2: one whose own
    code does."""
    path = str(item.path)
    if not path.startswith(TESTS) or not _names_a_framework(path):
        return 0
    function = getattr(item, "function", None)
    try:
        source = inspect.getsource(function) if function is not None else ""
    except (OSError, TypeError):
        source = ""
    return 2 if FRAMEWORKS.search(source) else 1


def run_python(code: str, timeout: float = 120, env: dict[str, str] | None = None) -> dict:
    """Run ``code`` in a fresh interpreter (see ``warm``); it prints one JSON object as its
    last line."""
    full_env = dict(os.environ, **(env or {}))
    full_env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    proc = warm.run(textwrap.dedent(code), full_env, timeout)
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def python_in_subprocess():
    return run_python


# Plugins installed beside pytest that a session started by a test never uses: hypothesis's
# imports hypothesis (about 1.5 s of every start), the others their own machinery.
UNUSED_PLUGINS = " ".join(f"-p no:{name}" for name in (
    "hypothesispytest", "anyio", "xdist", "xdist.looponfail", "pytest_cov"))


@pytest.fixture
def lean_pytest(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sessions of pytest that the test starts (pytester's, ``python -m pytest``) load no
    plugin they do not use: a trivial session takes 0.6 s instead of 2.5 s. Pytester's
    sessions fork from a server that has imported torch (:func:`warm_pytest`)."""
    if "pytester" in request.fixturenames:
        pytester = request.getfixturevalue("pytester")  # it clears PYTEST_ADDOPTS at start
        monkeypatch.setattr(pytester, "runpytest_subprocess",
                            functools.partial(warm_pytest, pytester))
    monkeypatch.setenv("PYTEST_ADDOPTS", UNUSED_PLUGINS)


def fresh_pytest(pytester: pytest.Pytester, *args: str | os.PathLike[str],
                 timeout: float | None = None) -> pytest.RunResult:
    """``pytester.runpytest_subprocess`` in a new interpreter, for a test whose session can
    tell a forked one apart: torch not yet imported, or the host heap of a new process."""
    return pytest.Pytester.runpytest_subprocess(pytester, *args, timeout=timeout)


def warm_pytest(pytester: pytest.Pytester, *args: str | os.PathLike[str],
                timeout: float | None = None) -> pytest.RunResult:
    """``pytester.runpytest_subprocess(*args)``, forked from a server that has imported torch
    (``warm``: 0.1 s a start where a new interpreter takes 2-3 s). Only where the session
    would not tell: the plugin sets ``MKL_DISABLE_FAST_MM`` before torch is imported unless
    the environment has it, so without it in the environment a new interpreter runs."""
    if "MKL_DISABLE_FAST_MM" not in os.environ:
        return fresh_pytest(pytester, *args, timeout=timeout)
    basetemp = tempfile.mkdtemp(prefix="runpytest-", dir=pytester.path)
    argv = [f"--basetemp={basetemp}", *(os.fspath(arg) for arg in args)]
    code = f"import torch\nimport sys\nimport pytest\nsys.exit(int(pytest.main({argv!r})))\n"
    start = time.perf_counter()
    proc = warm.run(code, dict(os.environ), timeout or 600)
    outlines, errlines = proc.stdout.splitlines(), proc.stderr.splitlines()
    print(proc.stdout)
    print(proc.stderr, file=sys.stderr)
    try:
        ret: int | pytest.ExitCode = pytest.ExitCode(proc.returncode)
    except ValueError:
        ret = proc.returncode
    return pytest.RunResult(ret, outlines, errlines, time.perf_counter() - start)
