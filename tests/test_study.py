"""The LMC study end to end on the quickstart at runlocal size, its caching and its errors.

Three seeds give three pairs, so that spreads over pairs are not zero. The
reports are checked on their values: barriers recomputed from the curves in
results.json, summaries recomputed from the barriers, summary.md against
results.json, and the path ends against the seeds' own evaluations.
"""

import glob
import json
import os
import shutil

import jax
import numpy as np
import pytest

from attn_symmetry import data
from attn_symmetry import matching
from attn_symmetry import models
from experiments.configs import quickstart
from experiments.report import report
from experiments.setting import fingerprints
from experiments.study import input_noise
from experiments.study import path_evaluation
from experiments.study import scope_study
from experiments.study import study
from experiments.train import evaluation
from experiments.train import inputs
from experiments.train import saved_runs


def _config(**study_changes):
  config = quickstart.get_config("runlocal")
  config.reinit.scopes = ["first_attention"]
  # A little more training than runlocal, so that the models have a barrier to remove.
  config.train.num_steps = 150
  config.train.eval_every = 150
  config.train.checkpoint_every = 150
  config.train.learning_rate = 3e-3
  config.reinit.num_steps = 60
  config.reinit.patience, config.reinit.validate_every = 4, 2  # quickstart's patience
  config.reinit.seeds = [1, 2, 3]
  # The whole test split, as the trainer's final evaluation reads it: a path's ends are the
  # seeds' own evaluations (runlocal's study reads the first 64 examples).
  config.study.eval_examples = 0
  for k, v in study_changes.items():
    config.study[k] = v
  return config


@pytest.fixture(scope="module")
def finished(trained_workdir, tmp_path_factory):
  """(config, a copy of its finished workdir, the report paths, the final metrics)."""
  config = _config()
  workdir, trained = trained_workdir(config, tmp_path_factory.mktemp("study") / "w", study=True)
  return config, workdir, study.run_study(config, workdir), trained


def _stage_files(workdir):
  return {p: os.stat(p).st_mtime_ns for p in glob.glob(f"{workdir}/study/*/pairs/*/*.json")}


@pytest.mark.slow
def test_reports_are_written(finished):
  config, _, paths, _ = finished
  assert set(paths) == {"first_attention/results.json", "first_attention/curves.png",
                        "first_attention/ablation_permutations.png", "summary.md"}
  for p in paths.values():
    assert os.path.getsize(p) > 0
  res = json.load(open(paths["first_attention/results.json"]))
  assert len(res["lambdas"]) == config.study.num_lambdas and len(res["pairs"]) == 3
  for m in config.study.methods:
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


def _results(finished):
  return json.load(open(finished[2]["first_attention/results.json"]))


def _barrier(lams, values, higher_is_better=False):
  """Largest gap between a path and its chord (never negative), written out here."""
  lams, values = np.asarray(lams), np.asarray(values)
  gap = values - ((1 - lams) * values[0] + lams * values[-1])
  return max(0.0, float((-gap if higher_is_better else gap).max()))


@pytest.mark.slow
def test_barriers_and_their_summary_are_recomputed_from_the_curves(finished):
  config, res = finished[0], _results(finished)
  lams = np.asarray(res["lambdas"])
  np.testing.assert_allclose(lams, np.linspace(0, 1, len(lams)))
  assert [(p["a"], p["b"]) for p in res["pairs"]] == [
      ("seed_1", "seed_2"), ("seed_1", "seed_3"), ("seed_2", "seed_3")]
  for metric, higher in (("loss", False), ("accuracy", True)):
    naive = [p["methods"]["naive"][f"{metric}_barrier"] for p in res["pairs"]]
    for m in config.study.methods:
      barriers = []
      for p in res["pairs"]:
        curve = p["methods"][m]
        assert curve[f"{metric}_barrier"] == pytest.approx(
            _barrier(lams, curve[metric], higher), abs=1e-12), (m, p["a"], p["b"])
        barriers.append(curve[f"{metric}_barrier"])
      row = res["methods"][m]
      assert row["num_pairs"] == 3 and row[f"{metric}_barrier_num_finite"] == 3
      assert row[f"{metric}_barrier_mean"] == pytest.approx(np.mean(barriers), abs=1e-12)
      assert row[f"{metric}_barrier_std"] == pytest.approx(np.std(barriers), abs=1e-12)
      ratios = [100 * b / n for b, n in zip(barriers, naive) if n > 1e-12]
      assert row[f"{metric}_barrier_ratio_pct"] == pytest.approx(np.mean(ratios))
      assert row[f"{metric}_barrier_ratio_pct_std"] == pytest.approx(np.std(ratios), abs=1e-9)
  naive_row = res["methods"]["naive"]
  assert naive_row["loss_barrier_ratio_pct"] == pytest.approx(100.0)
  assert naive_row["loss_barrier_ratio_pct_std"] == pytest.approx(0.0, abs=1e-9)
  assert naive_row["loss_barrier_std"] > 0  # three different pairs


@pytest.mark.slow
def test_path_ends_are_the_seeds_own_evaluations(finished):
  config, _, _, trained = finished
  res = _results(finished)
  ends = res["endpoints"]
  for seed in config.reinit.seeds:  # as train_and_evaluate evaluated the fine-tuned seed
    final = trained[f"reinit/first_attention/seed_{seed}"]
    assert ends[f"seed_{seed}"]["loss"] == pytest.approx(final["loss"], rel=1e-6)
    assert ends[f"seed_{seed}"]["accuracy"] == pytest.approx(final["accuracy"], abs=1e-9)
  for p in res["pairs"]:
    a, b = ends[p["a"]], ends[p["b"]]
    for m, curve in p["methods"].items():  # each seed evaluated once (ScopeStudy._path)
      assert curve["loss"][0] == pytest.approx(a["loss"], rel=1e-6), m
      assert curve["accuracy"][0] == pytest.approx(a["accuracy"], abs=1e-9), m
      assert curve["loss"][-1] == pytest.approx(b["loss"], rel=1e-6), m
      assert curve["accuracy"][-1] == pytest.approx(b["accuracy"], abs=1e-9), m


@pytest.mark.slow
def test_each_path_is_its_aligned_models_path_evaluated_at_every_lambda(finished):
  """The study evaluates a pair's endpoints once and each path's interior points: the same
  curve as evaluating theta_A -> g.theta_B at every lambda, since the (norm-folded) theta_A
  and g.theta_B compute the seeds' own functions (up to float32 rounding). One pair: every
  pair's paths come from the same code, and realigning the three took a minute."""
  config, workdir, _, _ = finished
  res = _results(finished)
  model = inputs.create_model(config)
  evaluator = path_evaluation.PathEvaluator(
      model, path_evaluation.evaluation_examples(config, config.dataset.name),
      chunk_size=config.study.lambda_chunk, bits_per_byte=False)
  checkpoints = saved_runs.load_checkpoints(config, workdir, require_complete=True)
  scope = scope_study.ScopeStudy(config, model, "first_attention", checkpoints, evaluator,
                                 workdir=str(workdir), data_fingerprint="")
  one_example = 1.0 / 300  # the digits test split has more examples than that
  for p in res["pairs"][:1]:
    a, b = (int(p[k].removeprefix("seed_")) for k in ("a", "b"))
    for m, curve in p["methods"].items():
      theta_a, aligned_b, _ = scope.align(a, b, m)
      every = evaluator(theta_a, aligned_b, np.asarray(res["lambdas"]))
      np.testing.assert_allclose(curve["loss"], every["loss"], rtol=1e-4, err_msg=m)
      np.testing.assert_allclose(curve["accuracy"], every["accuracy"], atol=one_example,
                                 err_msg=m)
      np.testing.assert_array_equal(curve["loss"][1:-1], every["loss"][1:-1], err_msg=m)


@pytest.mark.slow
def test_ablations_and_robustness_are_recomputed(finished):
  config, _, _, _ = finished
  res = _results(finished)
  perm = res["ablation"]["permutations"]
  assert len(perm["per_pair"]) == 3
  for p, abl in zip(res["pairs"], perm["per_pair"]):
    for metric in ("loss", "accuracy"):
      barriers = np.asarray(abl[f"{metric}_barriers"])
      chosen, best = barriers[abl["chosen"]], barriers.min()
      assert len(barriers) == 24
      # Every permutation's path is stored, and its barrier is that path's.
      curves = abl[f"{metric}_curves"]
      assert len(curves) == 24 and all(len(c) == len(res["lambdas"]) for c in curves)
      np.testing.assert_allclose(
          [_barrier(res["lambdas"], c, metric == "accuracy") for c in curves], barriers)
      assert abl[f"{metric}_rank"] == 1 + np.sum(barriers < chosen - 1e-12)
      naive = p["methods"]["naive"][f"{metric}_barrier"]
      lhat = 100 * (chosen - best) / (naive - best) if naive - best > 1e-12 else None
      assert abl[f"{metric}_lhat"] == (None if lhat is None else pytest.approx(lhat))
  ranks = [abl["loss_rank"] for abl in perm["per_pair"]]
  assert perm["summary"]["loss_rank_mean"] == pytest.approx(np.mean(ranks))
  assert perm["summary"]["loss_rank_std"] == pytest.approx(np.std(ranks))
  # The study's own distance is the full method's: the same barriers.
  same = res["ablation"]["distances"][config.study.distance]
  assert same["loss_barrier_mean"] == pytest.approx(res["methods"]["full"]["loss_barrier_mean"])
  assert same["loss_barrier_std"] == pytest.approx(res["methods"]["full"]["loss_barrier_std"])
  # Without noise, the accuracies are the path's: A at 0, B at 1, a midpoint at 1/2.
  rob, mid = res["robustness"], res["lambdas"].index(0.5)
  assert rob["noise_levels"][0] == 0.0
  def mean_at(method, i):
    return np.mean([p["methods"][method]["accuracy"][i] for p in res["pairs"]])
  assert rob["accuracy"]["A"][0] == pytest.approx(mean_at("naive", 0))
  assert rob["accuracy"]["B"][0] == pytest.approx(mean_at("naive", -1))
  for m in config.study.methods:
    assert rob["accuracy"][f"midpoint ({m})"][0] == pytest.approx(mean_at(m, mid)), m


def _fmt(mean, std, digits):
  return "n/a" if mean is None else f"{mean:.{digits}f} ± {std:.{digits}f}"


@pytest.mark.slow
def test_summary_md_holds_the_numbers_of_results_json(finished):
  res = _results(finished)
  lines = open(finished[2]["summary.md"]).read().splitlines()
  assert any(line.startswith("3 checkpoint pair(s), 5 interpolation points") for line in lines)
  # Under the floor on the mean naive loss barrier no loss ratio is printed (nor L-hat).
  floor = res["methods"]["naive"]["loss_barrier_mean"] < report.RATIO_FLOOR
  interval = lambda ci: "n/a" if ci is None else f"[{ci[0]:.1f}, {ci[1]:.1f}]"
  value = lambda v: "n/a" if v is None else f"{v:.1f}"
  for m, row in res["methods"].items():
    kinds = ("loss_barrier", "accuracy_barrier")
    cells = [_fmt(row[f"{k}_mean"], row[f"{k}_std"], 4) for k in kinds]
    cells += (["no ratio", "", "", ""] if floor else
              [_fmt(row["loss_barrier_ratio_pct"], row["loss_barrier_ratio_pct_std"], 1),
               interval(row["loss_barrier_ratio_pct_seed_ci"]),
               value(row["loss_barrier_ratio_pct_median"]),
               value(row["loss_barrier_ratio_of_means_pct"])])
    cells += [_fmt(row["accuracy_barrier_ratio_pct"], row["accuracy_barrier_ratio_pct_std"], 1),
              interval(row["accuracy_barrier_ratio_pct_seed_ci"])]
    assert f"| {report.METHOD_LABELS[m]} | " + " | ".join(cells) + " |" in lines, m
  s = res["ablation"]["permutations"]["summary"]
  lhat = "no ratio" if floor else _fmt(s["loss_lhat_mean"], s["loss_lhat_std"], 1)
  assert (f"| Stage 1 | {_fmt(s['loss_rank_mean'], s['loss_rank_std'], 2)} | {lhat} | "
          f"{_fmt(s['accuracy_rank_mean'], s['accuracy_rank_std'], 2)} | "
          f"{_fmt(s['accuracy_lhat_mean'], s['accuracy_lhat_std'], 1)} |") in lines
  for d, row in res["ablation"]["distances"].items():
    barrier = _fmt(row["loss_barrier_mean"], row["loss_barrier_std"], 4)
    ratio = ("no ratio" if floor else
             _fmt(row["loss_barrier_ratio_pct"], row["loss_barrier_ratio_pct_std"], 1))
    assert f"| {d} | {barrier} | {ratio} |" in lines
  rob = res["robustness"]
  for i, sigma in enumerate(rob["noise_levels"]):
    assert (f"| {sigma:g} | " + " | ".join(f"{rob['accuracy'][m][i]:.4f}" for m in rob["models"])
            + " |") in lines


@pytest.mark.slow
def test_full_method_beats_naive(finished):
  _, _, paths, _ = finished
  methods = json.load(open(paths["first_attention/results.json"]))["methods"]
  assert methods["naive"]["loss_barrier_mean"] > 0.0
  assert methods["full"]["loss_barrier_mean"] < methods["naive"]["loss_barrier_mean"]


@pytest.mark.slow
def test_checkpoint_with_itself_has_no_barrier(finished):
  config, workdir, _, _ = finished
  from experiments.train import inputs
  model = inputs.create_model(config)
  checkpoints = saved_runs.load_checkpoints(config, workdir)
  batches = list(inputs.eval_batches(config, config.dataset.name))
  evaluator = path_evaluation.PathEvaluator(model, batches, chunk_size=25, bits_per_byte=False)
  s = scope_study.ScopeStudy(config, model, "first_attention", checkpoints, evaluator,
                       os.path.join(workdir, "self"), "data")
  entry = s.pair(1, 1)
  for m, res in entry["methods"].items():
    assert res["loss_barrier"] <= 1e-5 and res["accuracy_barrier"] <= 1e-6, m


@pytest.mark.slow
def test_rerun_skips_finished_stages_and_detects_changes(finished):
  config, workdir, _, _ = finished
  before = _stage_files(workdir)
  assert before
  study.run_study(config, workdir)
  assert _stage_files(workdir) == before  # nothing recomputed
  changed = _config(noise_levels=[0.0, 0.25])
  study.run_study(changed, workdir)
  after = _stage_files(workdir)
  redone = {os.path.basename(p) for p in before if after[p] != before[p]}
  assert redone == {"robustness.json"}


@pytest.mark.slow
def test_bad_input_raises_before_work(finished, tmp_path):
  config, workdir, _, _ = finished
  other = _config()
  other.model.overrides.width = 48  # another architecture than the checkpoints
  with pytest.raises(ValueError, match="architecture|shape"):
    study.run_study(other, workdir)
  with pytest.raises(ValueError, match="config.study.methods"):
    study.run_study(_config(methods=["full"]), workdir)
  with pytest.raises(ValueError, match="checkpoint"):
    study.run_study(_config(), str(tmp_path))  # nothing trained there
  with pytest.MonkeyPatch.context() as mp:  # a scope holding only the classifier head
    mp.setattr(models.Model, "scope_paths", lambda self, scope: ["head"])
    with pytest.raises(ValueError, match="nothing to align"):
      study.run_study(config, workdir)


def test_first_examples_keeps_a_fixed_prefix_of_the_valid_examples():
  batches = [{"label": np.arange(4) + 4 * i, "valid": np.array([True, True, True, i < 2])}
             for i in range(3)]  # 11 valid examples: 0..10 (11 is padding)
  kept = list(inputs.first_examples(batches, 6))
  assert len(kept) == 2
  labels = np.concatenate([b["label"][b["valid"]] for b in kept])
  np.testing.assert_array_equal(labels, np.arange(6))
  everything = list(inputs.first_examples(batches, 0))
  assert len(everything) == 3 and sum(int(b["valid"].sum()) for b in everything) == 11
  assert sum(int(b["valid"].sum()) for b in inputs.first_examples(batches, 50)) == 11

  def reads(limit):  # the batches read: none past the subset
    read = []
    def source():
      for b in batches:
        read.append(b)
        yield b
    list(inputs.first_examples(source(), limit))
    return len(read)
  assert (reads(6), reads(8), reads(9), reads(0)) == (2, 2, 3, 3)


def test_evaluation_examples_are_a_prefix_of_the_named_split():
  config = _config(eval_examples=16)
  digests = {}
  for split in ("test", "train[:50%]", "train[10:]"):
    config.study.eval_split = split
    batches = path_evaluation.evaluation_examples(config, "digits")
    assert sum(int(b["valid"].sum()) for b in batches) == 16
    digests[split] = path_evaluation.examples_digest(batches)
  assert len(set(digests.values())) == 3
  whole = data.eval_iterator("digits", batch_size=config.train.eval_batch_size, split="train")
  assert digests["train[:50%]"] == path_evaluation.examples_digest(
      inputs.first_examples(whole, 16))


def test_learned_overlap_names_the_slices_learned_reads_from_the_evaluation_split():
  for split, expected in (("test", {}), ("train[:50%]", {"dataset.train_split": "train[:90%]"}),
                          ("train[95%:]", {"dataset.validation_split": "train[90%:]"}),
                          ("train", {"dataset.train_split": "train[:90%]",
                                     "dataset.validation_split": "train[90%:]"})):
    assert scope_study.learned_overlap(_config(eval_split=split), "digits") == expected, split
  assert scope_study.learned_overlap(_config(eval_split="train", methods=("naive", "full")),
                                     "digits") == {}


@pytest.mark.slow
def test_study_evaluates_the_paths_on_study_eval_split(finished, tmp_path):
  """On a copy of the trained workdir: the paths on the first 40 examples of "train[:50%]"
  (their ends: the seeds' training-data metrics, not their test ones); the split keyed in
  every stage file and named in summary.md."""
  config, workdir, _, _ = finished
  copy = str(tmp_path / "w")
  shutil.copytree(workdir, copy, ignore=shutil.ignore_patterns("study"))
  changed = _config(eval_split="train[:50%]", eval_examples=40, methods=("naive", "perm"),
                    distances=(), permutation_ablation=False, noise_levels=())
  paths = study.run_study(changed, copy)
  res = json.load(open(paths["first_attention/results.json"]))
  assert (res["eval_split"], res["eval_examples"], res["learned_overlap"]) == (
      "train[:50%]", 40, {})
  for stage in ("naive", "perm"):
    stored = json.load(open(os.path.join(copy, "study", "first_attention", "pairs",
                                         "seed_1-seed_2", stage + ".json")))
    assert stored["fields"]["study.eval_split"] == "train[:50%]"
  test_ends = _results(finished)["endpoints"]
  assert all(res["endpoints"][s]["loss"] != test_ends[s]["loss"] for s in test_ends)
  model, params = inputs.create_model(changed), saved_runs.load_checkpoints(changed, copy)
  first_40 = list(inputs.first_examples(
      data.eval_iterator("digits", batch_size=changed.train.eval_batch_size, split="train"), 40))
  for seed in changed.reinit.seeds:
    on_train = evaluation.evaluate(model, params[f"reinit/first_attention/seed_{seed}"], first_40)
    assert res["endpoints"][f"seed_{seed}"]["loss"] == pytest.approx(on_train["loss"], rel=1e-5)
  summary = open(paths["summary.md"]).read()
  assert "5 interpolation points on 40 examples of the train[:50%] split." in summary
  assert _results(finished)["eval_split"] == "test"
  default = json.load(open(os.path.join(workdir, "study", "first_attention", "pairs",
                                        "seed_1-seed_2", "naive.json")))
  assert "study.eval_split" not in default["fields"]  # the default keys nothing


@pytest.mark.slow
def test_the_head_order_ablation_can_run_on_the_pairs_of_some_seeds(finished, tmp_path):
  """``study.permutation_ablation_seeds=(1, 3)``: the ablation of pair 1-3 alone, named in its
  entry, reused from the full run's stage file; every pair's paths are still compared."""
  _, workdir, _, _ = finished
  copy = str(tmp_path / "w")
  shutil.copytree(workdir, copy)
  paths = study.run_study(_config(permutation_ablation_seeds=(1, 3)), copy)
  res = json.load(open(paths["first_attention/results.json"]))
  (entry,) = res["ablation"]["permutations"]["per_pair"]
  assert (entry["a"], entry["b"]) == ("seed_1", "seed_3") and len(res["pairs"]) == 3
  every = {(e["a"], e["b"]): e for e in _results(finished)["ablation"]["permutations"]["per_pair"]}
  assert entry == every["seed_1", "seed_3"]
  assert res["ablation"]["permutations"]["summary"]["loss_rank_mean"] == entry["loss_rank"]


@pytest.mark.slow
def test_learned_is_compared_and_lowers_the_full_methods_barrier(finished):
  res = _results(finished)
  assert "learned" in res["methods"]
  for p in res["pairs"]:
    info = p["methods"]["learned"]["matching"]["learned"]
    assert info["sites"] == ["layers_0/attention"] and info["steps"] > 0
  # Learned starts from the full element and keeps an iterate only if its held-out barrier
  # is lower, so on these barely trained runlocal models it may keep the start itself.
  learned, full = (res["methods"][m]["loss_barrier_mean"] for m in ("learned", "full"))
  assert learned <= full, (learned, full)


@pytest.mark.slow
def test_learned_reads_training_and_validation_slices_only(finished, monkeypatch):
  """The learned stage reads the training slice and the validation slice, never the test
  split (every data set read it makes is recorded)."""
  config, workdir, _, _ = finished
  checkpoints = saved_runs.load_checkpoints(config, workdir, require_complete=True)
  model = inputs.create_model(config)
  scope = scope_study.ScopeStudy(config, model, "first_attention", checkpoints,
                           evaluator=None, workdir=str(workdir), data_fingerprint="")
  reads = []
  for name in ("train_iterator", "eval_iterator"):
    original = getattr(data, name)
    def record(*args, original=original, name=name, **kwargs):
      reads.append((name, kwargs.get("split")))
      return original(*args, **kwargs)
    monkeypatch.setattr(data, name, record)
  element, info = scope._element(1, 2, "learned", scope_study.matching_kwargs(config, "learned"))
  assert info["learned"]["steps"] == config.study.learn_steps
  assert sorted(reads) == [("eval_iterator", config.dataset.validation_split),
                           ("train_iterator", config.dataset.train_split)]
  assert "test" not in {split for _, split in reads}


def test_input_noise_perturbs_only_the_inputs_it_is_told_of():
  key = jax.random.key(0)
  images = [{"image": np.zeros((4, 3, 3, 1), np.float32), "label": np.arange(4)}]
  (noisy,) = input_noise.noisy(images, 0.5, key=key, input_key="image", vocab_size=None)
  assert noisy["image"].dtype == np.float32 and 0.2 < noisy["image"].std() < 0.8
  np.testing.assert_array_equal(noisy["label"], np.arange(4))
  (again,) = input_noise.noisy(images, 0.5, key=key, input_key="image", vocab_size=None)
  np.testing.assert_array_equal(again["image"], noisy["image"])  # same key, same noise
  tokens = [{"tokens": np.full((8, 256), 7, np.int32), "mask": np.ones((8, 256), bool)}]
  (noisy,) = input_noise.noisy(tokens, 0.25, key=key, input_key="tokens", vocab_size=5)
  replaced = noisy["tokens"] != 7
  assert noisy["tokens"].dtype == np.int32 and 0.2 < replaced.mean() < 0.3
  assert noisy["tokens"][replaced].max() < 5 and noisy["mask"].all()
  (clean,) = input_noise.noisy(tokens, 0.0, key=key, input_key="tokens", vocab_size=5)
  np.testing.assert_array_equal(clean["tokens"], tokens[0]["tokens"])


def test_learned_factors_reach_the_method_and_key_its_stages_off_their_default():
  """study.learn_factors is the learned method's ``factors``; at its default (the attention
  matrices, as before the field existed) it keys nothing, so stored results stay valid."""
  config = _config()
  assert scope_study.matching_kwargs(config, "learned")["factors"] == ("attention",)
  assert "study.learn_factors" not in fingerprints.config_fields(
      config, scope_study.method_keys("learned"))
  config.study.learn_factors = ("attention", "ffn")
  assert scope_study.matching_kwargs(config, "learned")["factors"] == ("attention", "ffn")
  assert fingerprints.config_fields(config, scope_study.method_keys("learned"))[
      "study.learn_factors"] == ["attention", "ffn"]


@pytest.mark.parametrize("scope, expected", [
    ("first_attention", ("attention", "heads")),
    ("first_layer", ("attention", "heads", "ffn")),
    ("full", ("attention", "heads", "ffn", "residual")),
])
def test_each_scope_learns_the_factors_it_has(scope, expected):
  """One study.learn_factors serves every scope: each trains those of them it has."""
  model = models.build("vit", "tiny")
  names = matching.active_names(model.spec, model.scope_paths(scope))
  wanted = ("residual", "ffn", "heads", "attention")
  assert scope_study.factors_in_scope(model.spec, names, wanted) == tuple(
      f for f in wanted if f in expected)
  assert scope_study.factors_in_scope(model.spec, names, ("attention",)) == ("attention",)
