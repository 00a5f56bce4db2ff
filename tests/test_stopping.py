"""The stopping rule of re-initialised runs: a validation plateau or the step budget,
whichever comes first; the held-out validation split; completeness, resume and reruns.

Every workdir is the quickstart at runlocal size (ViT on digits, training on
"train[:90%]", validating on "train[90%:]") with the rule tuned so that the
outcome is known: a learning rate of 1e-12 leaves the parameters, and so the
validation loss, unchanged (a plateau after exactly ``patience`` evaluations);
``min_delta`` 0.5 asks for a halving of the loss, which a few steps of real
training do not reach (a plateau with moving parameters); ``min_delta`` 0
with a loss that falls at every evaluation runs the whole budget.
"""

import collections
import json
import logging
import os
import shutil

import jax
import numpy as np
import pytest

from attn_symmetry import data
from attn_symmetry import spec as spec_lib
from experiments.configs import quickstart
from experiments.train import checkpoints
from experiments.train import evaluation
from experiments.train import inputs
from experiments.train import metric_writers
from experiments.train import reinit
from experiments.train import runs
from experiments.train import saved_runs
from experiments.train import schedules
from experiments.train import trainer
from tests.test_train import _bits_equal
from tests.test_train import _Crash
from tests.test_train import _tree_digest

SEEDS = (1, 2)


def make_config(scopes=("first_attention",), **reinit):
  """The runlocal quickstart with one fine-tuned scope and ``reinit`` fields changed."""
  config = quickstart.get_config("runlocal")
  assert (config.dataset.train_split, config.dataset.validation_split) == (
      "train[:90%]", "train[90%:]")
  config.reinit.scopes, config.reinit.seeds = scopes, SEEDS
  config.train.checkpoint_every = 2
  config.reinit.update(reinit)
  return config


FROZEN = dict(learning_rate=1e-12, num_steps=20, validate_every=2, patience=2)
HALVING = dict(min_delta=0.5, num_steps=12, validate_every=1, patience=3)
IMPROVING = dict(min_delta=0.0, num_steps=30, validate_every=10, patience=2, learning_rate=1e-2)


def _trained(trained_workdir, tmp_path_factory, name, config):
  """(config, a copy of its finished workdir, the training's final metrics)."""
  return (config, *trained_workdir(config, tmp_path_factory.mktemp(name) / "w"))


@pytest.fixture(scope="module")
def frozen(trained_workdir, tmp_path_factory):
  """(config, workdir, results): the fine-tuned scope cannot move; the "full" scope, which
  trains from scratch on the base schedule, follows the rule too."""
  return _trained(trained_workdir, tmp_path_factory, "frozen",
                  make_config(scopes=("first_attention", "full"), **FROZEN))


@pytest.fixture(scope="module")
def halving(trained_workdir, tmp_path_factory):
  return _trained(trained_workdir, tmp_path_factory, "halving", make_config(**HALVING))


def _validation_losses(workdir, name):
  log = metric_writers.read_jsonl(os.path.join(workdir, name, "metrics.jsonl"))
  return {e["step"]: e["validation/loss"] for e in log if "validation/loss" in e}


def _expected_end(losses, rule, budget):
  """The rule, written out again: (last step, how it ended) for validation ``losses`` by step."""
  best, since = None, 0
  for step in sorted(losses):
    if best is None or losses[step] < best * (1 - rule.min_delta):
      best, since = losses[step], 0
    else:
      since += 1
    if since >= rule.patience:
      return step, "plateau"
  return budget, "budget"


def _params(config, workdir, name):
  return jax.tree.map(np.asarray, saved_runs.load_checkpoints(config, workdir)[name])


def _assert_same_params(a, b):
  a, b = spec_lib.flatten(a), spec_lib.flatten(b)
  assert a.keys() == b.keys()
  for path in a:
    assert _bits_equal(a[path], b[path]), path


@pytest.mark.slow
def test_plateau_stops_after_patience_evaluations(frozen):
  config, workdir, results = frozen
  stop = FROZEN["validate_every"] * (1 + FROZEN["patience"])  # the first evaluation is the best
  for seed in SEEDS:
    name = f"reinit/first_attention/seed_{seed}"
    losses = _validation_losses(workdir, name)
    assert sorted(losses) == list(range(2, stop + 1, 2))
    assert len(set(losses.values())) == 1  # nothing moved
    m = results[name]
    assert (m["steps"], m["stopped"]) == (stop, "plateau")
    assert m["validation_loss"] == m["best_validation_loss"] == losses[2] and m["best_step"] == 2
    ckpts = checkpoints.RunCheckpoints(os.path.join(workdir, name), read_only=True)
    assert ckpts.latest_step() == stop
    ckpts.close()
    log = metric_writers.read_jsonl(os.path.join(workdir, name, "metrics.jsonl"))
    assert max(e["step"] for e in log) == stop
    assert [e for e in log if "eval/loss" in e][-1]["step"] == stop  # reported at the stop
  assert results["base"]["steps"] == config.train.num_steps
  assert results["base"]["stopped"] == "budget" and "validation_loss" not in results["base"]
  assert not _validation_losses(workdir, "base")  # the base model trains its whole schedule


@pytest.mark.slow
def test_base_model_follows_the_rule_with_stop_base(trained_workdir, tmp_path_factory):
  """With reinit.stop_base the base model stops at its plateau too (frozen by a learning rate
  of 1e-12: after patience evaluations), on its own budget train.num_steps; the scope
  fine-tuned from it starts from the parameters at that stop."""
  config = make_config(**FROZEN)
  config.reinit.stop_base = True
  config.train.learning_rate = 1e-12
  config, workdir, results = _trained(trained_workdir, tmp_path_factory, "stop_base", config)
  stop = FROZEN["validate_every"] * (1 + FROZEN["patience"])
  assert stop < config.train.num_steps
  losses = _validation_losses(workdir, "base")
  assert sorted(losses) == list(range(2, stop + 1, 2)) and len(set(losses.values())) == 1
  base = results["base"]
  assert (base["steps"], base["stopped"], base["best_step"]) == (stop, "plateau", 2)
  assert saved_runs.steps_taken(config, workdir)["base"]["num_steps"] == config.train.num_steps
  fields = json.load(open(os.path.join(workdir, "base", "fingerprint.json")))["fields"]
  assert fields.get("reinit.stop_base") is True and fields["reinit.patience"] == FROZEN["patience"]
  assert results["reinit/first_attention/seed_1"]["stopped"] == "plateau"


@pytest.mark.slow
def test_full_scope_follows_the_rule_on_the_base_schedule(frozen):
  config, workdir, results = frozen
  rule = runs.stopping(config, runs.runs(config)[-1])
  for seed in SEEDS:
    name = f"reinit/full/seed_{seed}"
    losses = _validation_losses(workdir, name)
    assert min(losses) == 2 and max(losses) == results[name]["steps"]
    expected = _expected_end(losses, rule, config.train.num_steps)
    assert (results[name]["steps"], results[name]["stopped"]) == expected


@pytest.mark.slow
def test_steps_taken_reads_how_each_run_ended(frozen):
  config, workdir, results = frozen
  taken = saved_runs.steps_taken(config, workdir)
  assert list(taken) == [run.name for run in runs.runs(config)]
  for name, end in taken.items():
    fields = ("steps", "stopped", "validation_loss", "best_validation_loss", "best_step")
    assert {k: end[k] for k in fields if k in end} == {
        k: results[name][k] for k in fields if k in results[name]}
  assert taken["base"]["num_steps"] == config.train.num_steps
  assert taken["reinit/first_attention/seed_1"]["num_steps"] == FROZEN["num_steps"]


@pytest.mark.slow
def test_budget_when_the_loss_keeps_improving(tmp_path):
  config = make_config(**IMPROVING)
  config.train.batch_size = 32  # the barely trained base model learns in 30 steps, not in 4
  config, workdir, results = _trained_here(tmp_path, config)
  rule = runs.stopping(config, runs.runs(config)[1])
  for seed in SEEDS:
    name = f"reinit/first_attention/seed_{seed}"
    losses = _validation_losses(workdir, name)
    steps = sorted(losses)
    assert steps == [10, 20, 30]
    assert all(losses[a] > losses[b] for a, b in zip(steps, steps[1:]))  # always improving
    assert (results[name]["steps"], results[name]["stopped"]) == (30, "budget")
    assert _expected_end(losses, rule, 30) == (30, "budget")


def _trained_here(tmp_path, config):
  workdir = str(tmp_path / "w")
  return config, workdir, trainer.train_and_evaluate(config, workdir)


@pytest.mark.slow
def test_plateau_with_moving_parameters(halving):
  """Real training that stops at a plateau, because no evaluation halves the first loss."""
  config, workdir, results = halving
  rule = runs.stopping(config, runs.runs(config)[1])
  base = spec_lib.flatten(_params(config, workdir, "base"))
  for seed in SEEDS:
    name = f"reinit/first_attention/seed_{seed}"
    losses = _validation_losses(workdir, name)
    assert len(set(losses.values())) == len(losses)  # the loss moves
    assert (results[name]["steps"], results[name]["stopped"]) == (4, "plateau")
    assert _expected_end(losses, rule, HALVING["num_steps"]) == (4, "plateau")
    tuned = spec_lib.flatten(_params(config, workdir, name))
    assert not _bits_equal(tuned["layers_0/attention/query/kernel"],
                           base["layers_0/attention/query/kernel"])


@pytest.mark.slow
def test_stopped_run_is_complete(frozen, caplog):
  """A run stopped at a plateau is skipped on rerun (nothing written) and accepted as
  complete by the study's loader, though its step is short of the budget."""
  config, workdir, results = frozen
  before = _tree_digest(workdir)
  with caplog.at_level(logging.INFO):
    assert trainer.train_and_evaluate(config, workdir) == results
  assert _tree_digest(workdir) == before
  messages = [r.getMessage() for r in caplog.records]
  for seed in SEEDS:
    assert (f"reinit/first_attention/seed_{seed}: complete (step 6, stopped at a validation "
            "plateau), skipped") in messages
  loaded = saved_runs.load_checkpoints(config, workdir, require_complete=True)
  assert set(loaded) == set(results)


@pytest.mark.slow
def test_unfinished_run_is_refused_by_the_study_loader(frozen, tmp_path):
  """The stop recorded in the checkpoint, not its step, makes a run complete: without it
  (the last checkpoint gone, as after a crash), the run is unfinished."""
  config, workdir, _ = frozen
  copy = str(tmp_path / "w")
  shutil.copytree(workdir, copy)
  name = "reinit/first_attention/seed_2"
  shutil.rmtree(os.path.join(copy, name, "checkpoints", "6"))
  with pytest.raises(ValueError, match=f"run '{name}' stopped at step 4 of 20"):
    saved_runs.load_checkpoints(config, copy, require_complete=True)
  assert saved_runs.steps_taken(config, copy)[name]["stopped"] is None


@pytest.mark.slow
def test_changed_patience_retrains_the_runs_under_the_rule(frozen, tmp_path, caplog):
  _, workdir, _ = frozen
  copy = str(tmp_path / "w")
  shutil.copytree(workdir, copy)
  config = make_config(scopes=("first_attention", "full"), **{**FROZEN, "patience": 3})
  with caplog.at_level(logging.INFO):
    results = trainer.train_and_evaluate(config, copy)
  messages = " ".join(r.getMessage() for r in caplog.records)
  for scope in ("first_attention", "full"):
    for seed in SEEDS:
      assert (f"reinit/{scope}/seed_{seed}: config changed (reinit.patience 2 -> 3); "
              "retraining") in messages
  assert "base: complete (step 8, at the end of its budget), skipped" in messages
  assert results["reinit/first_attention/seed_1"]["steps"] == 2 * (1 + 3)


@pytest.mark.slow
def test_the_rule_can_validate_on_the_first_examples_of_the_split(halving, tmp_path, caplog):
  """dataset.validation_examples: the rule's loss is that of the split's first examples; 0, the
  whole split, keys nothing; another value retrains."""
  config, reference, results = halving
  assert "dataset.validation_examples" not in json.dumps(runs.run_fields(
      config, runs.runs(config)[1], base_params="x"))
  copy = str(tmp_path / "w")
  shutil.copytree(reference, copy)
  subset = make_config(**HALVING)
  subset.dataset.validation_examples = 20
  with caplog.at_level(logging.INFO):
    got = trainer.train_and_evaluate(subset, copy)
  messages = " ".join(r.getMessage() for r in caplog.records)
  model = inputs.create_model(subset)
  split = data.eval_iterator("digits", batch_size=subset.train.eval_batch_size,
                             split="train[90%:]")
  first_20 = list(inputs.first_examples(split, 20))
  assert sum(int(b["valid"].sum()) for b in first_20) == 20
  for seed in SEEDS:
    name = f"reinit/first_attention/seed_{seed}"
    assert f"{name}: config changed (dataset.validation_examples (none) -> 20); retraining" \
        in messages
    on_first_20 = evaluation.evaluate(model, _params(subset, copy, name), first_20)["loss"]
    assert got[name]["validation_loss"] == pytest.approx(on_first_20, rel=1e-6)
    assert got[name]["validation_loss"] != results[name]["validation_loss"]


@pytest.mark.slow
def test_turning_the_rule_on_retrains(frozen, tmp_path, caplog):
  """With the rule off its fields are not keyed; turning it on adds them, so the runs retrain."""
  config = make_config(patience=0, learning_rate=1e-12, num_steps=4)
  workdir = str(tmp_path / "w")
  results = trainer.train_and_evaluate(config, workdir)
  assert results["reinit/first_attention/seed_1"]["steps"] == 4
  assert "validation_loss" not in results["reinit/first_attention/seed_1"]
  assert not _validation_losses(workdir, "reinit/first_attention/seed_1")
  on = make_config(patience=1, learning_rate=1e-12, num_steps=4, validate_every=1)
  with caplog.at_level(logging.INFO):
    results = trainer.train_and_evaluate(on, workdir)
  assert "reinit/first_attention/seed_1: config changed (dataset.validation_split (none) -> " \
         "train[90%:]" in " ".join(r.getMessage() for r in caplog.records)
  assert (results["reinit/first_attention/seed_1"]["steps"],
          results["reinit/first_attention/seed_1"]["stopped"]) == (2, "plateau")


@pytest.mark.slow
def test_resume_after_a_crash_is_bit_identical(halving, tmp_path, monkeypatch, caplog):
  """Seed 1 dies before its batch 4, after the checkpoint at step 2 (one evaluation without
  improvement since the best): the rerun resumes there, restores the plateau state and
  stops at step 4 exactly as the uninterrupted run did, with the same parameters."""
  config, reference, results = halving
  workdir = str(tmp_path / "w")
  real = inputs.train_batches

  class Dying:
    def __init__(self, it):
      self.it, self.n = it, 0

    def __next__(self):
      self.n += 1
      if self.n == 4:
        raise _Crash("killed before batch 4")
      return next(self.it)

    def get_state(self):
      return self.it.get_state()

    def set_state(self, state):
      self.it.set_state(state)

  with monkeypatch.context() as m:
    m.setattr(inputs, "train_batches", lambda config, dataset, *, seed: (
        Dying(real(config, dataset, seed=seed)) if seed == 1 else real(config, dataset,
                                                                        seed=seed)))
    with pytest.raises(_Crash):
      trainer.train_and_evaluate(config, workdir)
  name = "reinit/first_attention/seed_1"
  ckpts = checkpoints.RunCheckpoints(os.path.join(workdir, name), read_only=True)
  assert ckpts.all_steps() == [2]
  assert ckpts.restore_meta(2)["stopping"]["since_best"] == 1
  ckpts.close()
  with caplog.at_level(logging.INFO):
    resumed = trainer.train_and_evaluate(config, workdir)
  assert f"{name}: resuming from step 2" in " ".join(r.getMessage() for r in caplog.records)
  assert resumed == results
  for run in runs.runs(config):
    _assert_same_params(_params(config, workdir, run.name), _params(config, reference, run.name))
    assert _validation_losses(workdir, run.name) == _validation_losses(reference, run.name)


@pytest.mark.slow
def test_no_decision_reads_the_test_split(halving, tmp_path, monkeypatch):
  """Training reads "train[:90%]" and the rule "train[90%:]"; the test split only feeds
  the reported evaluations: with its labels scrambled, every run stops where it did, with
  the same parameters, and only the reported test metrics change."""
  config, reference, results = halving
  reads = collections.Counter()
  for reader in ("train_iterator", "eval_iterator"):
    real = getattr(data, reader)

    def recording(name, *, real=real, reader=reader, **kwargs):
      reads[reader, name, kwargs.get("split", "test")] += 1
      return real(name, **kwargs)
    monkeypatch.setattr(data, reader, recording)
  real_eval = inputs.eval_batches

  def scrambled(config, dataset):
    for batch in real_eval(config, dataset):
      yield {**batch, "label": (batch["label"] + 1) % 10}
  monkeypatch.setattr(inputs, "eval_batches", scrambled)
  workdir = str(tmp_path / "w")
  got = trainer.train_and_evaluate(config, workdir)
  assert set(reads) == {("train_iterator", "digits", "train[:90%]"),
                        ("eval_iterator", "digits", "train[90%:]"),
                        ("eval_iterator", "digits", "test")}
  for run in runs.runs(config):
    kept = ("steps", "stopped", "validation_loss", "best_validation_loss", "best_step")
    assert {k: got[run.name].get(k) for k in kept} == {
        k: results[run.name].get(k) for k in kept}
    assert got[run.name]["loss"] != results[run.name]["loss"]
    _assert_same_params(_params(config, workdir, run.name), _params(config, reference, run.name))


@pytest.mark.slow
@pytest.mark.parametrize("changes, message", [
    ({"dataset.validation_split": "train[85%:]"},
     r"config.dataset.validation_split 'train\[85%:\]' shares records \[1222, 1294\) of split "
     r"'train' of 'digits' with config.dataset.train_split 'train\[:90%\]'"),
    ({"dataset.validation_split": "validation"},
     r"config.dataset.validation_split 'validation' does not fit: Dataset 'digits' has no "
     r"split 'validation'"),
    ({"dataset.train_split": "train[:90%]x"}, r"config.dataset.train_split"),
    ({"dataset.train_split": "train[:5]"}, r"larger than the train split 'train\[:5\]'"),
])
def test_bad_splits_fail_before_training(changes, message, tmp_path):
  config = make_config(**HALVING)
  for field, value in changes.items():
    section, key = field.split(".")
    config[section][key] = value
  workdir = str(tmp_path / "w")
  with pytest.raises(ValueError, match=message):
    trainer.train_and_evaluate(config, workdir)
  assert not os.path.exists(workdir)


def test_plateau_counts_relative_improvements():
  rule = schedules.Stopping(patience=2, min_delta=0.01, validate_every=1)
  plateau = schedules.Plateau(rule)
  # 1.0 best; 0.995 is not 1 % better; 0.98 is; then 0.975 and 0.99 are not: stop.
  stops = [plateau.observe(step, loss) for step, loss in enumerate([1.0, 0.995, 0.98, 0.975,
                                                                   0.99], start=1)]
  assert stops == [False, False, False, False, True]
  assert (plateau.best_loss, plateau.best_step, plateau.since_best) == (0.98, 3, 2)
  restored = schedules.Plateau.from_meta(rule, plateau.to_meta())
  assert restored == plateau
  assert schedules.Plateau.from_meta(rule, None) == schedules.Plateau(rule)


@pytest.mark.slow
def test_spawned_children_start_from_the_base_model_and_differ_only_in_data_order(
    trained_workdir, tmp_path_factory):
  """The positive control's scope: nothing is re-initialised and every parameter trains. With a
  learning rate of 1e-12 the children stay the base model to float32 rounding; with a real
  one, each seed's data order moves them apart."""
  frozen = make_config(scopes=(reinit.SPAWN,), **{**FROZEN, "learning_rate": 1e-12})
  config, workdir, _ = _trained(trained_workdir, tmp_path_factory, "spawn_frozen", frozen)
  base = spec_lib.flatten(_params(config, workdir, "base"))
  for seed in SEEDS:
    child = spec_lib.flatten(_params(config, workdir, f"reinit/spawn/seed_{seed}"))
    assert child.keys() == base.keys()
    for path in base:
      np.testing.assert_allclose(child[path], base[path], atol=1e-6, err_msg=path)
  moving = make_config(scopes=(reinit.SPAWN,), **IMPROVING)
  config, workdir, _ = _trained(trained_workdir, tmp_path_factory, "spawn_moving", moving)
  one, two = (spec_lib.flatten(_params(config, workdir, f"reinit/spawn/seed_{s}")) for s in SEEDS)
  assert any(not np.array_equal(one[p], two[p]) for p in one)
