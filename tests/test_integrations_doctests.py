"""The docstring examples of the integrations that import a framework when imported, run in
one process of their own (the project's conftest.py keeps them out of the test process)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from frameworks import installed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULES = {"memguard/integrations/keras.py": "keras",
           "memguard/integrations/lightning.py": "pytorch_lightning",
           "memguard/integrations/_lightning_step.py": "pytorch_lightning",
           "memguard/integrations/transformers.py": "transformers",
           "memguard/integrations/_transformers_step.py": "transformers"}


@pytest.mark.slow
def test_the_docstring_examples_of_the_framework_integrations_run(lean_pytest):
    paths = [path for path, package in MODULES.items() if installed(package)]
    if not paths:
        pytest.skip(f"needs one of {sorted(MODULES.values())}")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "--noconftest", "-p", "no:cacheprovider", "-q",
         "-o", "addopts=", "--doctest-modules", *paths],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", TRANSFORMERS_VERBOSITY="error"))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    passed = re.search(r"(\d+) passed", run.stdout)
    assert passed and int(passed.group(1)) >= len(paths), run.stdout[-3000:]
