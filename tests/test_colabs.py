"""Every notebook in colabs/ runs top to bottom on a CPU (each in a fresh process)."""

import glob
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "colabs", "*.ipynb")))


def test_there_are_notebooks():
  assert NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path, tmp_path):
  with open(path) as f:
    cells = json.load(f)["cells"]
  code = "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
  assert "!pip" not in code  # install instructions live in markdown cells
  script = tmp_path / "notebook.py"
  script.write_text(code)
  proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                        timeout=900, env=dict(os.environ, MPLBACKEND="Agg"))
  assert proc.returncode == 0, proc.stderr[-3000:]
