"""The LMC study end to end on the quickstart at runlocal size, its caching and its errors."""

import glob
import json
import os

import numpy as np
import pytest

from experiments import study
from experiments import train
from experiments.configs import quickstart


def _config(**study_changes):
  config = quickstart.get_config("runlocal")
  config.reinit.scopes = ["first_attention"]
  # A little more training than runlocal, so that the models have a barrier to remove.
  config.train.num_steps = 150
  config.train.eval_every = 150
  config.train.checkpoint_every = 150
  config.train.learning_rate = 3e-3
  config.reinit.num_steps = 60
  config.reinit.seeds = [1, 2]
  for k, v in study_changes.items():
    config.study[k] = v
  return config


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("study"))
  config = _config()
  train.train_and_evaluate(config, workdir)
  paths = study.run_study(config, workdir)
  return config, workdir, paths


def _stage_files(workdir):
  return {p: os.stat(p).st_mtime_ns for p in glob.glob(f"{workdir}/study/*/pairs/*/*.json")}


def test_reports_are_written(finished):
  config, workdir, paths = finished
  assert set(paths) == {"first_attention/results.json", "first_attention/curves.png", "summary.md"}
  for p in paths.values():
    assert os.path.getsize(p) > 0
  res = json.load(open(paths["first_attention/results.json"]))
  assert len(res["lambdas"]) == config.study.num_lambdas and len(res["pairs"]) == 1
  for m in study.METHODS:
    row = res["methods"][m]
    for key in ("loss_barrier_mean", "accuracy_barrier_mean", "loss_barrier_ratio_pct",
                "loss_barrier_std", "accuracy_barrier_std"):
      assert key in row
    curve = res["pairs"][0]["methods"][m]["loss"]
    assert len(curve) == config.study.num_lambdas and np.isfinite(curve).all()
  assert res["methods"]["naive"]["loss_barrier_ratio_pct"] == pytest.approx(100.0)
  perm = res["ablation"]["permutations"]
  assert perm["num_permutations"] == 24 and 1 <= perm["summary"]["loss_rank_mean"] <= 24
  assert set(res["ablation"]["distances"]) == set(config.study.distances)
  assert res["robustness"]["noise_levels"] == list(config.study.noise_levels)
  summary = open(paths["summary.md"]).read()
  assert "| full (+ gradient refinement) |" in summary and "Rank (loss)" in summary


def test_full_method_beats_naive(finished):
  _, _, paths = finished
  methods = json.load(open(paths["first_attention/results.json"]))["methods"]
  assert methods["naive"]["loss_barrier_mean"] > 0.0
  assert methods["full"]["loss_barrier_mean"] < methods["naive"]["loss_barrier_mean"]


def test_checkpoint_with_itself_has_no_barrier(finished):
  config, workdir, _ = finished
  from experiments import inputs
  model = inputs.create_model(config)
  checkpoints = train.load_checkpoints(config, workdir)
  batches = list(inputs.eval_batches(config, config.dataset.name))
  evaluator = study.PathEvaluator(model, batches, chunk_size=25, bits_per_byte=False)
  s = study.ScopeStudy(config, model, "first_attention", checkpoints, evaluator,
                       os.path.join(workdir, "self"), "data")
  entry = s.pair(1, 1)
  for m, res in entry["methods"].items():
    assert res["loss_barrier"] <= 1e-5 and res["accuracy_barrier"] <= 1e-6, m


def test_rerun_skips_finished_stages_and_detects_changes(finished):
  config, workdir, _ = finished
  before = _stage_files(workdir)
  assert before
  study.run_study(config, workdir)
  assert _stage_files(workdir) == before  # nothing recomputed
  changed = _config(noise_levels=[0.0, 0.25])
  study.run_study(changed, workdir)
  after = _stage_files(workdir)
  redone = {os.path.basename(p) for p in before if after[p] != before[p]}
  assert redone == {"robustness.json"}


def test_bad_input_raises_before_work(finished, tmp_path):
  config, workdir, _ = finished
  other = _config()
  other.model.overrides.width = 48  # another architecture than the checkpoints
  with pytest.raises(ValueError, match="architecture|shape"):
    study.run_study(other, workdir)
  with pytest.raises(ValueError, match="config.study.methods"):
    study.run_study(_config(methods=["full"]), workdir)
  with pytest.raises(ValueError, match="checkpoint"):
    study.run_study(_config(), str(tmp_path))  # nothing trained there
  from attn_symmetry import models
  with pytest.MonkeyPatch.context() as mp:  # a scope holding only the classifier head
    mp.setattr(models.Model, "scope_paths", lambda self, scope: ["head"])
    with pytest.raises(ValueError, match="nothing to align"):
      study.run_study(config, workdir)
