"""Dependencies: the core and the align command import without the extras' packages.

Each check runs in a fresh interpreter in which the blocked top-level modules are set to None in
``sys.modules``: importing one (or a submodule) raises ModuleNotFoundError and
``importlib.util.find_spec`` reports it missing, as on a machine without it.
"""

import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Import name -> distribution, of what only the experiments (and attn_symmetry.data) need.
EXPERIMENTS = {"sklearn": "scikit-learn", "mlxtend": "mlxtend", "gensim": "gensim",
               "matplotlib": "matplotlib", "tensorflow_datasets": "tensorflow-datasets",
               "grain": "grain", "tensorboardX": "tensorboardX", "tqdm": "tqdm",
               "ml_collections": "ml-collections", "orbax": "orbax-checkpoint"}
# What the align command's evaluation alone needs (the [align] extra).
ALIGN = {"tokenizers": "tokenizers", "PIL": "pillow", "matplotlib": "matplotlib"}
# Neither the core nor the align command may import these.
NEVER = ("torch", "transformers", "tensorflow", "chex")


def _run(blocked, code: str) -> str:
  prelude = f"import sys\nfor name in {sorted(blocked)!r}:\n  sys.modules[name] = None\n"
  result = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  return result.stdout


@pytest.mark.slow
def test_core_imports_and_matches_without_extras():
  """group_action, spec, attention, matching and lmc import (and match a layer pair) with
  jax, numpy and optax: neither the experiments' packages nor Flax."""
  out = _run({*EXPERIMENTS, *ALIGN, *NEVER, "flax", "safetensors"}, """
      import numpy as np
      import attn_symmetry
      from attn_symmetry import attention, group_action, lmc, matching, spec
      rng = np.random.default_rng(0)
      layer = lambda: {name: {"kernel": rng.normal(size=shape)} for name, shape in
                       (("query", (6, 2, 4)), ("key", (6, 2, 4)), ("value", (6, 2, 4)),
                        ("out", (2, 4, 6)))}
      element, info = matching.match_attention(layer(), layer(), spec.AttentionSite(2, 4),
                                               method="ortho")
      group_action.check_element(element)
      print(sorted(m for m in sys.modules if m.partition(".")[0] == "attn_symmetry"))
      """)
  assert "attn_symmetry.matching" in out and "attn_symmetry.models" not in out


@pytest.mark.slow
def test_align_command_needs_no_experiment_extra(tmp_path):
  """The align command imports with the core dependencies; its evaluation names the [align]
  extra, before reading anything, when a package of it is missing; attn_symmetry.data names
  the [experiments] extra."""
  _run({*EXPERIMENTS, *ALIGN, *NEVER}, f"""
      from attn_symmetry import align, models
      assert models.build("gpt2").spec is not None
      for kind in ("eval_text", "eval_images"):
        try:
          align.align_checkpoints("missing_a", "missing_b", out={str(tmp_path)!r},
                                  **{{kind: "missing"}})
        except align.InputError as e:
          assert "pip install 'attn_symmetry[align]'" in str(e), e
        else:
          raise AssertionError("no InputError")
      try:
        import attn_symmetry.data
      except ImportError as e:
        assert "pip install 'attn_symmetry[experiments]'" in str(e), e
      else:
        raise AssertionError("attn_symmetry.data imported without its extra")
      """)


def _name(requirement: str) -> str:
  for stop in "<>=[; ":
    requirement = requirement.split(stop)[0]
  return requirement.lower()


def test_pyproject_puts_experiment_packages_in_extras():
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  core = {_name(r) for r in project["dependencies"]}
  extras = {k: {_name(r) for r in v} for k, v in project["optional-dependencies"].items()}
  assert not core & {d.lower() for d in (*EXPERIMENTS.values(), *ALIGN.values(), *NEVER)}
  assert {d.lower() for d in EXPERIMENTS.values()} <= extras["experiments"]
  assert {d.lower() for d in ALIGN.values()} <= extras["align"]
  assert {"pytest", "chex"} <= extras["test"]


def test_ci_installs_every_extra_the_tests_import():
  install = (ROOT / ".ci/run").read_text().split("pip install", 1)[1].split("\n", 1)[0]
  for extra in ("experiments", "align", "test", "hf"):
    assert extra in install, extra


@pytest.mark.slow
def test_experiments_is_not_installed_and_its_scripts_run_by_path(tmp_path):
  """Only the library installs (pyproject's package list): outside the checkout no module
  named ``experiments`` can be imported, and the scripts still run by path from anywhere,
  loading their own package from their own folder (``experiments/main.py``'s first lines)."""
  include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
      "packages"]["find"]["include"]
  assert all(pattern.startswith("attn_symmetry") for pattern in include), include
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  found = subprocess.run([sys.executable, "-c", "import importlib.util as u; "
                          "print(u.find_spec('experiments'))"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120, check=True)
  assert found.stdout.strip() == "None", found.stdout
  for script, flag in (("experiments/main.py", "--config"),
                       ("experiments/reproduce.py", "--setting")):
    run = subprocess.run([sys.executable, str(ROOT / script), "--helpfull"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=300, check=False)
    assert flag in run.stdout + run.stderr, (script, run.returncode, run.stderr[-2000:])
    assert "ModuleNotFoundError" not in run.stderr, run.stderr[-2000:]
