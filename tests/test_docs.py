"""The documentation: a reference entry for every public name, the README a front page whose
test command is CI's, the Hugging Face recovery guide one click from the index, and a Sphinx
build that passes with warnings as errors."""

from __future__ import annotations

import ast
import html
import importlib
import inspect
import os
import re
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import warm

import memguard

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")


def read(*path: str) -> str:
    with open(os.path.join(ROOT, *path), encoding="utf-8") as f:
        return f.read()


def documented_in_api_rst() -> set[str]:
    """The names that the reference (docs/api.rst and its pages in docs/reference/) hands to
    autodoc under ``memguard.``."""
    pages = [read("docs", "api.rst")] + [read("docs", "reference", name) for name in
                                         sorted(os.listdir(os.path.join(DOCS, "reference")))]
    return set(re.findall(r"^\.\. auto(?:function|class|exception|data)::\s+memguard\.(\w+)"
                          r"(?:\(\))?\s*$", "\n".join(pages), re.MULTILINE))


def inventory(path: str) -> dict[str, str]:
    """``objects.inv`` of a built site: object name -> its ``domain:role``."""
    with open(path, "rb") as f:
        for _ in range(4):  # the header: version, project, version, "zlib" line
            f.readline()
        body = zlib.decompress(f.read()).decode()
    entries = {}
    for line in body.splitlines():
        m = re.match(r"(.+?)\s+(\S+:\S+)\s+-?\d+\s+\S+\s+.*$", line)
        if m:
            entries[m.group(1)] = m.group(2)
    return entries


def ci_steps() -> list[str]:
    """The commands of .ci/run, one per line, without comments, ``set`` and ``cd``."""
    steps = []
    for line in read(".ci", "run").splitlines():
        line = line.strip()
        if line and not line.startswith(("#", "set ", "cd ")):
            steps.append(line)
    return steps


def readme_test_command() -> str:
    """The command under README.rst's "Run what CI runs" heading."""
    readme = read("README.rst")
    section = readme.split("Run what CI runs", 1)[1]
    [command] = [line.strip() for line in section.splitlines()
                 if line.startswith("    ") and "pytest" in line][:1]
    return command


def test_every_public_name_has_an_autodoc_entry_under_memguard():
    missing = sorted(set(memguard.__all__) - documented_in_api_rst())
    assert not missing, f"docs/api.rst documents no memguard.{missing}"


@pytest.mark.parametrize("name", memguard.__all__)
def test_every_public_docstring_has_napoleon_sections_and_an_example(name):
    doc = inspect.getdoc(getattr(memguard, name)) or ""
    sections = [s for s in ("Args:", "Returns:", "Raises:", "Attributes:") if s in doc]
    assert sections, f"memguard.{name}: no Args:/Returns:/Raises:/Attributes: section"
    assert ">>>" in doc, f"memguard.{name}: no example"
    if callable(getattr(memguard, name)) and not inspect.isclass(getattr(memguard, name)):
        params = list(inspect.signature(getattr(memguard, name)).parameters)
        if params:
            assert "Args:" in doc, f"memguard.{name}: parameters {params} but no Args:"
            for param in params:
                assert re.search(rf"^\s+\*{{0,2}}{param}:", doc, re.MULTILINE), \
                    f"memguard.{name}: Args: does not describe {param}"


# -- every parameter described --------------------------------------------------------------

def described(doc: str | None, what: str) -> dict[str, tuple[str, str]]:
    """What napoleon makes of a docstring's ``Args:`` (``param``) and ``Attributes:``
    (``ivar``) sections: name -> (kind, description)."""
    from sphinx.ext.napoleon import Config, GoogleDocstring

    config = Config(napoleon_use_param=True, napoleon_use_ivar=True, napoleon_use_rtype=False)
    text = str(GoogleDocstring(doc or "", config, what=what))
    found: dict[str, tuple[str, str]] = {}
    for m in re.finditer(r"^:(param|ivar) (?:\\?\*){0,2}(\w+):(.*(?:\n[ \t]+\S.*)*)", text,
                         re.MULTILINE):
        found.setdefault(m.group(2), (m.group(1), " ".join(m.group(3).split())))
    return found


def resolve(path: str) -> object:
    """The object a dotted name in an autodoc directive names."""
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(path)


def documented_signatures() -> list[tuple[str, object, list, tuple[str, ...]]]:
    """Every parameter list the reference renders: each ``autofunction``, each ``autoclass``
    or ``autoexception`` whose constructor is shown (not written ``Name()``), and the methods
    its ``:members:`` option shows (all those the class defines when the option names none).
    Each as (name, object, docstrings to read, the sections that may describe a parameter):
    a constructor's parameters may be described as ``Attributes:`` (a result's fields)."""
    folder = os.path.join(DOCS, "reference")
    text = "\n".join(read("docs", "reference", name) for name in sorted(os.listdir(folder)))
    entries = []
    for kind, path, hidden, options in re.findall(
            r"^\.\. auto(function|class|exception)::\s+([\w.]+)(\(\))?[ \t]*\n"
            r"((?:   :[\w-]+:.*\n)*)", text, re.MULTILINE):
        obj = resolve(path)
        if kind == "function":
            entries.append((path, obj, [inspect.getdoc(obj)], ("param",)))
            continue
        assert isinstance(obj, type)
        if not hidden:
            init = obj.__init__ if "__init__" in vars(obj) else None
            entries.append((path, obj, [inspect.getdoc(obj), getattr(init, "__doc__", None)],
                            ("param", "ivar")))
        members = re.search(r"^   :members:(.*)$", options, re.MULTILINE)
        if members is None:
            continue
        names = [n.strip() for n in members.group(1).split(",") if n.strip()] or \
            [n for n in vars(obj) if not n.startswith("_")]
        for name in names:
            member = getattr(obj, name)
            if isinstance(inspect.getattr_static(obj, name), property) or \
                    isinstance(member, type) or not callable(member):
                continue
            entries.append((f"{path}.{name}", member, [inspect.getdoc(member)], ("param",)))
    return entries


def parameters(obj: object) -> list[inspect.Parameter]:
    try:
        signature = inspect.signature(obj)  # type: ignore[arg-type]
    except ValueError:  # an exception with Exception's own constructor: none shown either
        return []
    return [p for p in signature.parameters.values() if p.name not in ("self", "cls")]


def states_default(value: object, text: str) -> bool:
    """Whether a description says a parameter's default: the word, or the value itself."""
    if "default" in text.lower():
        return True
    forms = {repr(value), str(value)}
    if isinstance(value, int) and not isinstance(value, bool):
        forms.add(f"{value:_}")
    return any(form in text for form in forms)


def undescribed_parameters() -> list[str]:
    problems = []
    for name, obj, docs, kinds in documented_signatures():
        what = "class" if inspect.isclass(obj) else "function"
        found: dict[str, tuple[str, str]] = {}
        for doc in docs:
            found.update({k: v for k, v in described(doc, what).items() if v[0] in kinds})
        for param in parameters(obj):
            if param.name not in found or not found[param.name][1]:
                problems.append(f"{name}: {param.name} is not described")
            elif found[param.name][0] == "param" and param.default is not param.empty \
                    and not states_default(param.default, found[param.name][1]):
                problems.append(f"{name}: {param.name}'s default {param.default!r} is not said")
    return problems


def test_every_parameter_the_reference_shows_is_described_with_its_default():
    shown = {name for name, *_ in documented_signatures()}
    functions = [n for n in memguard.__all__ if inspect.isfunction(getattr(memguard, n))]
    assert functions and all(f"memguard.{n}" in shown for n in functions), functions
    assert "memguard.integrations.transformers.auto_microbatch" in shown
    assert "memguard.MemoryMonitor.to_csv" in shown  # methods too
    problems = undescribed_parameters()
    assert not problems, "\n".join(problems)


def test_readme_is_a_front_page_of_at_most_300_lines():
    lines = read("README.rst").splitlines()
    assert len(lines) <= 300, f"README.rst has {len(lines)} lines"
    readme = "\n".join(lines)
    for guide in ("out-of-memory", "trainers", "distributed", "leaks", "watching", "tensorflow",
                  "measuring"):
        assert f"docs/guides/{guide}.rst" in readme, f"README.rst links no {guide} guide"
        assert os.path.exists(os.path.join(DOCS, "guides", f"{guide}.rst"))


def test_the_readme_test_command_is_what_ci_runs():
    assert readme_test_command().split(" && ") == ci_steps()


def test_the_index_links_the_hugging_face_recovery_guide():
    index = read("docs", "index.rst")
    assert ":ref:`hf-recovery`" in index.split(".. toctree::")[0], \
        "the index's first lines link the Hugging Face recovery section"
    trainers = read("docs", "guides", "trainers.rst")
    heading = re.search(r"^\.\. _hf-recovery:\n\n(.+)\n~+$", trainers, re.MULTILINE)
    assert heading, "docs/guides/trainers.rst has no hf-recovery label over a heading"
    assert "Hugging Face" in heading.group(1) and "out-of-memory" in heading.group(1)
    section = trainers[heading.end():].split("\n~~~")[0]
    assert "auto_microbatch(trainer)" in section and "trainer.train()" in section


def test_nothing_in_the_documentation_speaks_of_one_machine():
    texts = {"README.rst": read("README.rst")}
    for folder, _, files in os.walk(DOCS):
        for name in files:
            if name.endswith(".rst"):
                path = os.path.join(folder, name)
                texts[os.path.relpath(path, ROOT)] = read(path)
    for path, text in texts.items():
        for phrase in ("this machine", "these machines", "on this 2-core"):
            assert phrase not in text.lower(), f"{path} speaks of {phrase!r}"


CI_SITE = os.path.join(ROOT, "build", "docs-html")  # where .ci/run builds it, with -W


def newest_source() -> float:
    """The latest modification time among the site's sources (docs/, memguard/, README)."""
    times = [os.path.getmtime(os.path.join(ROOT, "README.rst"))]
    for top in (DOCS, os.path.join(ROOT, "memguard")):
        for folder, _, files in os.walk(top):
            times += [os.path.getmtime(os.path.join(folder, name)) for name in files
                      if "__pycache__" not in folder]
    return max(times)


@pytest.mark.slow
def test_the_site_builds_with_warnings_as_errors_and_lists_every_public_name(tmp_path):
    # CI builds the site with -W just before the tests: a build newer than every source is
    # that build, and building it a second time would check nothing more
    built = os.path.join(CI_SITE, "objects.inv")
    if os.path.exists(built) and os.path.getmtime(built) > newest_source():
        out = Path(CI_SITE)
    else:
        out = tmp_path / "html"
        build = subprocess.run([sys.executable, "-m", "sphinx", "-W", "-q", "-b", "html", DOCS,
                                str(out)], capture_output=True, text=True, timeout=600,
                               cwd=ROOT, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
        assert build.returncode == 0, build.stderr[-3000:]
    entries = inventory(str(out / "objects.inv"))
    missing = sorted(n for n in memguard.__all__ if f"memguard.{n}" not in entries)
    assert not missing, f"no reference entry for memguard.{missing}"
    index = (out / "index.html").read_text()
    assert 'href="guides/trainers.html#hf-recovery"' in index
    stray = {page.name: line for page in sorted((out / "guides").glob("*.html"))
             for line in rendered_text(page.read_text()).splitlines() if "`" in line}
    assert not stray, f"markup rendered as text (a backtick on the page): {stray}"


def rendered_text(page: str) -> str:
    """The words of a built page's article, code blocks left out: where reST markup failed
    (a role inside a literal, emphasis around one), its backticks are left in these."""
    article = page.split("<article", 1)[-1]
    article = re.sub(r"<pre.*?</pre>", "", article, flags=re.DOTALL)
    return html.unescape(re.sub(r"<[^>]+>", "", article))


def guide_program(guide: str, first_line: str, after: str) -> str:
    """The code block of ``docs/guides/<guide>.rst`` that ends at the paragraph starting with
    ``after`` and starts at the last ``first_line`` before it, unindented."""
    text = read("docs", "guides", f"{guide}.rst")
    end = text.index(after)
    block = text[text.rindex(f"    {first_line}", 0, end):end]
    return "\n".join(line[4:] for line in block.splitlines())


def run_program(path: str | os.PathLike[str], cwd: str | os.PathLike[str]
                ) -> subprocess.CompletedProcess:
    """The program at ``path``, run to its end in ``cwd`` as ``python path`` would run it with
    memguard importable; one that imports torch before memguard starts forked with torch
    imported already (``warm``: 2-3 s less a program)."""
    return warm.run(Path(path).read_text(), dict(os.environ, TRANSFORMERS_VERBOSITY="error",
                                                 PYTHONPATH=ROOT), timeout=600, cwd=str(cwd))


@pytest.mark.slow
@pytest.mark.parametrize("first_line, after, start", [
    ("import tempfile", "The logits of 1024", 1024),                  # Hugging Face
    ("import pytorch_lightning as pl", "With the CPU build of PyTorch it printed ``2048", 16384),
], ids=["hugging-face", "lightning"])
def test_the_recovery_programs_of_the_trainers_guide_recover(tmp_path, first_line, after, start):
    """The trainers guide's programs, run as the page shows them: a trainer's run that runs
    out of memory under a host budget at ``start`` recovers at a smaller batch size."""
    program = tmp_path / "recover.py"
    program.write_text(guide_program("trainers", first_line, after))
    run = run_program(program, tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    last = run.stdout.strip().splitlines()[-1]  # the size that worked, then the sizes tried
    printed = re.match(r"(\d+) (\[[\d, ]*\])", last)
    assert printed, run.stdout[-2000:]
    final, tried = int(printed.group(1)), ast.literal_eval(printed.group(2))
    assert tried[0] == start and final == tried[-1] < start


@pytest.mark.slow
@pytest.mark.parametrize("first_line, after, batch", [
    ("import tempfile", "The logits of 512", 512),                    # Hugging Face
    ("import pytorch_lightning as pl", "The first step runs out of memory", 16384),
], ids=["hugging-face", "lightning"])
def test_the_step_level_programs_of_the_trainers_guide_train_every_step(tmp_path, first_line,
                                                                        after, batch):
    """The trainers guide's step-level programs, as the page shows them: under a host budget
    the batch does not fit, every one of the 4 steps trains, in slices smaller than it."""
    program = tmp_path / "steps.py"
    program.write_text(guide_program("trainers", first_line, after))
    run = run_program(program, tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    steps, sizes = run.stdout.strip().splitlines()[-1].split(" ", 1)
    sizes = ast.literal_eval(sizes)
    sizes = sizes if isinstance(sizes, list) else [sizes]
    assert int(steps) == 4 and sizes and all(0 < size < batch for size in sizes)


def test_the_benchmark_figure_draws_the_figures_the_guide_quotes(tmp_path):
    """benchmarks/plot.py draws benchmarks/figures.json; every non-integer figure in it is one
    the comparison table (the out-of-memory guide's explanation page) quotes, so the picture
    and the text say the same."""
    sys.path.insert(0, ROOT)
    try:
        from benchmarks import plot
    finally:
        sys.path.remove(ROOT)
    panels, source = plot.load(plot.FIGURES)
    guide = read("docs", "guides", "recovery-internals.rst")
    for panel in panels:
        for bar in panel["bars"]:
            value = bar["value"]
            if value != int(value):
                assert f"{value:g}" in guide or f"{value:.1e}" in guide, \
                    f"{bar['label']}: {value} is not in the guide's table"
    assert {bar["who"] for panel in panels for bar in panel["bars"]} == {"memguard", "peer"}
    out = plot.draw(panels, source, str(tmp_path / "benchmarks.png"))
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def quoted_output(page: str, script: str) -> str:
    """What ``docs/<page>`` says ``script`` prints: the first ``text`` block after the page's
    ``literalinclude`` of it, unindented."""
    text = read("docs", page)
    after = text.split(f".. literalinclude:: ../examples/{script}", 1)[1]
    block = after.split(".. code-block:: text\n\n", 1)[1]
    lines = []
    for line in block.splitlines():
        if line and not line.startswith("    "):
            break
        lines.append(line[4:])
    return "\n".join(lines).strip()


@pytest.mark.slow
@pytest.mark.parametrize("script", ["survive_hf.py", "survive_lightning.py", "survive_loop.py"])
def test_the_quickstart_scripts_print_what_the_page_quotes(script):
    """Each quickstart script, included in the page as it is, runs out of memory under its host
    budget, recovers, and prints exactly the output the page quotes; every script is a complete
    program of at most 30 lines."""
    path = os.path.join(ROOT, "examples", script)
    assert len(read("examples", script).splitlines()) <= 30
    run = run_program(path, ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "retrying at microbatch_size" in run.stderr, "the script never ran out of memory"
    assert run.stdout.strip() == quoted_output("quickstart.rst", script), run.stdout[-2000:]


@pytest.mark.slow
def test_the_quickstart_example_prints_a_leaky_step_with_and_without_frees_memory():
    """examples/quickstart.py runs the same leaky step 20 times plain, then 20 times under
    ``@frees_memory``, and prints both growths: the plain run keeps every step's cycle
    (8 MiB of input each), the guarded one does not."""
    run = run_program(os.path.join(ROOT, "examples", "quickstart.py"), ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    grew = dict(re.findall(r"(without|with) @frees_memory: +\+(\S+ \S+) in use", run.stdout))
    assert set(grew) == {"without", "with"}, run.stdout
    plain, guarded = (memguard.parse_size(grew[k].replace(" ", "")) for k in ("without", "with"))
    assert plain > 100 << 20 and guarded < plain / 4, (plain, guarded)
