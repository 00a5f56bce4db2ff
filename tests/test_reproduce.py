"""results/ is what the committed code computes: the smallest setting's reduced form is rerun
and its numbers compared with the committed ones; every setting's config is valid."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from experiments import config_checks
from experiments import reproduce
from experiments.configs import cpu_paper

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALLEST = "table1_vit_mnist_ape"
COMMITTED = os.path.join(REPO, "results", SMALLEST, "reduced")
RTOL = 1e-4  # float32 rounding of one run: between runs and between CPUs' kernels


@pytest.mark.parametrize("setting", sorted(cpu_paper.SETTINGS))
@pytest.mark.parametrize("variant", ["", ",reduced"])
def test_every_setting_is_a_valid_config(setting, variant):
  config_checks.validate(cpu_paper.get_config(setting + variant))


def test_a_setting_must_be_named():
  with pytest.raises(ValueError, match="name one setting"):
    cpu_paper.get_config("reduced")
  with pytest.raises(ValueError, match="unknown setting"):
    reproduce.run_setting("table9", reduced=True, workdir="/nonexistent", results_dir="/nonexistent")


def _load(directory):
  with open(os.path.join(directory, "first_attention", "results.json")) as f:
    return json.load(f)


def test_reduced_rerun_gives_the_committed_numbers(tmp_path):
  """The committed reduced run, recomputed by the committed command in a process of its own:
  the same barriers, curves, ranks and chosen permutations (to float32 rounding across runs).

  Its own process, as a user runs it."""
  results = tmp_path / "results"
  subprocess.run([sys.executable, "experiments/reproduce.py", f"--setting={SMALLEST}",
                  "--reduced", f"--workdir_root={tmp_path / 'work'}", f"--results={results}",
                  "--compilation_cache="], cwd=REPO, check=True,
                 env=dict(os.environ, PYTHONPATH=REPO))
  rerun = results / SMALLEST / "reduced"
  with open(rerun / "run.json") as f:
    record = json.load(f)
  assert record["command"] == f"python experiments/reproduce.py --setting={SMALLEST} --reduced"
  with open(os.path.join(COMMITTED, "run.json")) as f:
    assert json.load(f)["command"] == record["command"]
  new, old = _load(rerun), _load(COMMITTED)
  assert [(p["a"], p["b"]) for p in new["pairs"]] == [(p["a"], p["b"]) for p in old["pairs"]]
  assert list(new["methods"]) == list(old["methods"])
  # A barrier is a difference of points of a loss (accuracy) curve: it carries their
  # rounding, RTOL of the largest, which differs between CPUs' kernels.
  tolerance = lambda values, key: dict(
      rtol=RTOL, atol=RTOL * max(np.max(np.abs(v[key])) for v in values))
  ablations = [r["ablation"]["permutations"]["per_pair"] for r in (new, old)]
  assert len(ablations[0]) == len(ablations[1]) == len(old["pairs"])
  for p_new, p_old, abl_new, abl_old in zip(new["pairs"], old["pairs"], *ablations):
    values = list(p_old["methods"].values())
    for method in old["methods"]:
      for key, scale in (("loss", "loss"), ("accuracy", "accuracy"),
                         ("loss_barrier", "loss"), ("accuracy_barrier", "accuracy")):
        np.testing.assert_allclose(p_new["methods"][method][key], p_old["methods"][method][key],
                                   **tolerance(values, scale), err_msg=f"{method} {key}")
    assert abl_new["chosen"] == abl_old["chosen"]
    assert abl_new["loss_rank"] == abl_old["loss_rank"]
    np.testing.assert_allclose(abl_new["loss_barriers"], abl_old["loss_barriers"],
                               **tolerance(values, "loss"))
  with open(os.path.join(COMMITTED, "summary.md")) as f:
    committed_summary = f.read()
  assert "## Re-initialisation scope: first_attention" in committed_summary


def test_commit_column_marks_edited_code_but_not_reports_of_other_settings():
  sha = "0123456789abcdef"
  assert reproduce._commit({"commit": sha, "uncommitted": []}) == "0123456"
  assert reproduce._commit({"commit": sha, "uncommitted": ["results/other/run.json"]}) == "0123456"
  assert reproduce._commit({"commit": sha, "uncommitted": ["results/other/run.json",
                                                           "experiments/train.py"]}
                           ) == "0123456 (with edits)"
  assert reproduce._commit({"commit": sha + "+dirty"}) == "0123456 (with edits)"


def test_readme_table_is_generated_from_the_committed_runs():
  """results/README.md's table is exactly what --table makes of results/*/run.json and the
  results beside them, one row per setting and scope, with the commit each run started from."""
  root = os.path.join(REPO, "results")
  with open(os.path.join(root, "README.md")) as f:
    text = f.read()
  table = text.split(reproduce._MARK_BEGIN, 1)[1].split(reproduce._MARK_END, 1)[0].strip()
  assert table == reproduce.results_table(root)
  runs = [d for d in os.listdir(root) if os.path.exists(os.path.join(root, d, "run.json"))]
  for setting in runs:
    with open(os.path.join(root, setting, "run.json")) as f:
      commit = json.load(f)["commit"][:7]
    assert f"| {setting} |" in table and f"| {commit}" in table


def _leaves(tree, prefix=""):
  if isinstance(tree, dict):
    for k, v in tree.items():
      yield from _leaves(v, f"{prefix}.{k}")
  else:
    yield prefix, tree


@pytest.mark.parametrize("setting", sorted(
    d for d in os.listdir(os.path.join(REPO, "results"))
    if os.path.exists(os.path.join(REPO, "results", d, "run.json"))))
def test_committed_runs_are_the_settings_of_the_committed_config(setting):
  """Each committed run is a setting of cpu_paper, and every config field it recorded has
  the value the setting has now (fields added to the config since are not in its record), so
  that a setting's definition cannot change under its committed numbers."""
  assert setting in cpu_paper.SETTINGS, f"results/{setting} is no setting of cpu_paper"
  with open(os.path.join(REPO, "results", setting, "config.json")) as f:
    recorded = dict(_leaves(json.load(f)))
  now = dict(_leaves(json.loads(cpu_paper.get_config(setting).to_json())))
  changed = {k: (v, now.get(k)) for k, v in recorded.items() if now.get(k) != v}
  assert not changed, f"{setting}: fields changed since its run (recorded, now): {changed}"


def test_table_says_when_a_ratio_leaves_out_pairs(tmp_path):
  """A pair whose naive barrier is zero has no ratio to naive; the row says over how many
  pairs its ratios are taken."""
  setting = SMALLEST
  shutil.copytree(os.path.join(REPO, "results", setting), tmp_path / setting,
                  ignore=shutil.ignore_patterns("reduced", "*.png"))
  path = tmp_path / setting / "first_attention" / "results.json"
  res = json.loads(path.read_text())
  assert f"| {setting} | first_attention | 10 |" in reproduce.results_table(str(tmp_path))
  for pair in res["pairs"][:3]:
    pair["methods"]["naive"]["loss_barrier"] = 0.0
  path.write_text(json.dumps(res))
  assert (f"| {setting} | first_attention | 10 (ratios over 7) |"
          in reproduce.results_table(str(tmp_path)))
