"""Shared helpers: markers, and running a snippet in a fresh interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

MiB = 1 << 20

# programs that torchrun starts, not tests: --doctest-modules would import them (and the
# frameworks they import) at collection
collect_ignore = ["torchrun_scripts"]


def _has_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if any(item.get_closest_marker("gpu") for item in items) and not _has_gpu():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(skip)


def run_python(code: str, timeout: float = 120, env: dict[str, str] | None = None) -> dict:
    """Run ``code`` in a new interpreter; it prints one JSON object as its last line."""
    full_env = dict(os.environ, **(env or {}))
    full_env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout, env=full_env)
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def python_in_subprocess():
    return run_python
