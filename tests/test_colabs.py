"""Every notebook in colabs/ runs top to bottom in a fresh Jupyter kernel on a CPU.

A notebook's checks are its own ``assert`` statements: an error in any cell
fails the test. Notebooks in ``STRUCTURED`` are also checked for what a Colab
user expects: an "Open in Colab" badge at the top that links the notebook
itself on GitHub, a first code cell that installs the package only inside
Colab, and the outputs of one top-to-bottom run saved in the file (figures
included, kept small).
"""

import ast
import base64
import glob
import os
import re

import nbclient  # in the [test] extra: a missing runner fails the run, it does not skip
import nbformat
import pytest

from tests import conftest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "colabs", "*.ipynb")))
# Notebooks held to the structure below: every notebook of colabs/ (a test checks that).
STRUCTURED = ("01_attention_symmetries.ipynb", "02_matching_and_lmc.ipynb",
              "03_head_permutation_ablation.ipynb", "04_align_two_checkpoints.ipynb")
# The badge and the install cell name one GitHub repository (owner/name); every structured
# notebook must name the same one.
BADGE = re.compile(r"\[!\[Open In Colab\]\(https://colab\.research\.google\.com/assets/colab-badge\.svg\)\]"
                   r"\(https://colab\.research\.google\.com/github/([\w.-]+/[\w.-]+)/blob/main/colabs/"
                   r"([\w.-]+\.ipynb)\)")
# The install cell installs the package (pip) from a clone or a git URL of one repository.
INSTALL = re.compile(r"https://github\.com/([\w.-]+/[\w.-]+?)(?:\.git)?[\"'@\s]")
COLAB_TEST = '"google.colab" in sys.modules'
# Notebooks of small programs (float64 checks of the group actions), which spend their time
# compiling: they keep the test run's compile options rather than a workload's (one core:
# colabs/01 23 s with them, 30 s at -O1).
COMPILE_BOUND = frozenset({"01_attention_symmetries.ipynb"})
CELL_TIMEOUT_S = 600
MAX_IMAGE_BYTES = 120_000  # each saved figure (PNG)


def _read(path):
  return nbformat.read(path, as_version=4)


def _code_cells(nb):
  return [c for c in nb.cells if c.cell_type == "code"]


def test_there_are_notebooks():
  assert NOTEBOOKS
  names = {os.path.basename(p) for p in NOTEBOOKS}
  assert set(STRUCTURED) == names, sorted(set(STRUCTURED) ^ names)


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path, tmp_path, monkeypatch):
  """Executes every cell in a fresh kernel, in an empty folder, with matplotlib's Agg backend
  and the compile options of a workload (tests/conftest.py; but for ``COMPILE_BOUND``); any
  exception (a failed assert included) fails the test with the cell's traceback."""
  nb = _read(path)
  assert not any("!pip" in c.source for c in _code_cells(nb))  # the install cell is Python
  monkeypatch.setenv("MPLBACKEND", "Agg")
  if os.path.basename(path) not in COMPILE_BOUND:
    monkeypatch.setenv("XLA_FLAGS", conftest.workload_env(os.environ)["XLA_FLAGS"])
  # experiments/ is not installed: a notebook imports it from the checkout, as in Colab.
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
  client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                   resources={"metadata": {"path": str(tmp_path)}})
  client.execute()  # raises CellExecutionError on the first failing cell


def _is_colab_only_install(source):
  """True if the cell is imports plus ``if "google.colab" in sys.modules:`` blocks, and the
  word pip occurs only inside those blocks."""
  tree = ast.parse(source)
  for node in tree.body:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      continue
    if not (isinstance(node, ast.If) and ast.unparse(node.test) == COLAB_TEST.replace('"', "'")
            and not node.orelse):
      return False
  outside = [ast.unparse(n) for n in tree.body if not isinstance(n, ast.If)]
  return "pip" in source and not any("pip" in s for s in outside)


@pytest.mark.parametrize("name", STRUCTURED)
def test_notebook_structure(name):
  nb = _read(os.path.join(ROOT, "colabs", name))
  first = nb.cells[0]
  assert first.cell_type == "markdown", "the first cell is the title with the Colab badge"
  badge = BADGE.search(first.source)
  assert badge, "no 'Open In Colab' badge in the first cell"
  repo, linked = badge.groups()
  assert linked == name, f"the badge opens {linked}, not this notebook"

  code = _code_cells(nb)
  install = code[0].source
  assert COLAB_TEST in install and _is_colab_only_install(install), (
      "the first code cell must install the package inside `if \"google.colab\" in "
      "sys.modules:` and do nothing else elsewhere")
  match = INSTALL.search(install)
  assert match and match.group(1) == repo, "the install cell and the badge name one repository"
  others = {BADGE.search(_read(os.path.join(ROOT, "colabs", n)).cells[0].source).group(1)
            for n in STRUCTURED}
  assert others == {repo}, f"structured notebooks name different repositories: {others}"


@pytest.mark.parametrize("name", STRUCTURED)
def test_notebook_is_saved_with_outputs(name):
  """One top-to-bottom run is saved: execution counts 1, 2, ..., no errors, text outputs, a
  PNG figure where the notebook plots, each figure under MAX_IMAGE_BYTES."""
  nb = _read(os.path.join(ROOT, "colabs", name))
  code = _code_cells(nb)
  counts = [c.execution_count for c in code]
  assert counts == list(range(1, len(code) + 1)), f"not saved from one run in order: {counts}"
  outputs = [o for c in code for o in c.outputs]
  assert not [o for o in outputs if o.output_type == "error"]
  assert any(o.output_type == "stream" for o in outputs)
  images = [base64.b64decode(o.data["image/png"]) for o in outputs if "image/png" in o.get("data", {})]
  if any("plt." in c.source for c in code):
    assert images, "the notebook plots but no figure is saved"
  assert all(len(png) <= MAX_IMAGE_BYTES for png in images), [len(png) for png in images]
