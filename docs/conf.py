"""Sphinx configuration of memguard's documentation.

Build: ``python -m sphinx -W -b html docs <out>``; the examples: ``python -m sphinx -W -b
doctest docs <out>``.
"""

from __future__ import annotations

import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's start-up banner

import memguard  # noqa: E402  (the package is found from the repository root)

project = "memguard"
author = "the memguard authors"
copyright = "memguard authors"
release = version = memguard.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.doctest",
    "sphinx.ext.viewcode",
    "sphinx_copybutton",
]
# No network: no intersphinx. Under -n (nitpicky) every reference must resolve; the third-party
# types below cannot without intersphinx, so they stay plain text.
# Each autoclass directive says which members it shows (``:members:`` alone: all of them). No
# default "members" here: Sphinx 9 lets a boolean default override a directive's own list.
autodoc_default_options: dict[str, str] = {}
nitpick_ignore_regex = [
    # third-party and standard-library types (no intersphinx without a network)
    ("py:(class|obj|exc|data)", (r"(torch|tensorflow|keras|transformers|pytorch_lightning|"
                                 r"lightning|numpy|matplotlib|wrapt|psutil|pytest|_pytest|os)"
                                 r"(\..*)?")),
    # type variables of the generic signatures (F, R, T, P...): placeholders, not types
    ("py:class", r"~?(memguard\.[\w.]+\.)?(F|R|R_co|T|P|Q|S|W|C|TrainerT)"),
]

# The integrations import their trainer's framework: where one is not installed, autodoc
# documents its module against a stand-in, so the site builds with Sphinx and memguard alone.
FRAMEWORKS = ("transformers", "pytorch_lightning", "lightning", "keras", "tensorflow")


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


autodoc_mock_imports = [m for m in FRAMEWORKS if not installed(m)]

exclude_patterns = ["_build"]
templates_path: list[str] = []
html_static_path = ["_static"]
html_theme = "furo"
html_title = f"memguard {release}"
# The prompts and outputs of examples are not copied, only the code.
copybutton_prompt_text = r">>> |\.\.\. |\$ "
copybutton_prompt_is_regexp = True

# Signatures come from the code; the docstrings are napoleon style (Args:, Returns:, Raises:).
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
# Attributes: sections as fields of their class: the members themselves are documented once.
napoleon_use_ivar = True


# Doctests of docs/: every page's ``>>>`` examples and ``.. testcode::`` blocks run.
# The docstrings' own examples run under pytest (``--doctest-modules``), in their modules'
# namespaces; here only the pages' ``testcode``/``doctest`` directives run.
doctest_test_doctest_blocks = ""
doctest_global_setup = """
import memguard

try:  # the TensorFlow guide's examples run where TensorFlow is installed
    import tensorflow
    tensorflow_installed = not hasattr(tensorflow, "__sphinx_mock__")
except ImportError:
    tensorflow_installed = False
"""
