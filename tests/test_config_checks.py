"""config_checks.validate: each bad field named in one line; list fields set by flags."""

import ast
import glob
import os
import re
import sys

import ml_collections
import pytest
from absl.testing import flagsaver

from attn_symmetry import data
from attn_symmetry import matching
from attn_symmetry import models
from experiments import main
from experiments.configs import default
from experiments.configs import gpt2_wiki_bytes
from experiments.configs import quickstart
from experiments.setting import config_checks
from experiments.setting import config_schema
from experiments.study import path_evaluation
from experiments.train import data_checks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMAGES = "quickstart"  # digits, every scope re-initialised with seeds (1, 2)
TEXT = "gpt2_wiki_bytes"  # a byte stream
SETTINGS = {IMAGES: quickstart, TEXT: gpt2_wiki_bytes}


def _config(setting=IMAGES, **changes):
  """The runlocal setting with ``changes`` ({"train.num_steps": 3}), set on a plain dict so
  that values of the wrong type get through to ``validate`` too; None deletes a field."""
  tree = SETTINGS[setting].get_config("runlocal").to_dict()
  for field, value in changes.items():
    *parents, last = field.split(".")
    node = tree
    for key in parents:
      node = node[key]
    if value is None:
      del node[last]
    else:
      node[last] = value
  return ml_collections.ConfigDict(tree)


# (setting, field, bad value, where the message points, what it says)
BAD = [
    (IMAGES, "seed", -1, "seed", "must be >= 0, got -1"),
    (IMAGES, "seed", True, "seed", "must be an integer"),
    (IMAGES, "model.family", "resnet", "model.family", "unknown model family 'resnet'"),
    (IMAGES, "model.preset", "huge", "model.preset", "unknown model preset 'huge'"),
    (IMAGES, "model.overrides", {"widht": 64}, "model.overrides.widht", "not a field of"),
    (IMAGES, "model.overrides", {"family": "bert"}, "model.overrides.family",
     "that a setting overrides"),
    (IMAGES, "model.overrides", ("width", 64), "model.overrides", "must be a mapping"),
    (IMAGES, "dataset.name", "no_such_data", "dataset.name", "unknown data set"),
    (IMAGES, "dataset.data_dir", "/no/such/dir", "dataset.data_dir", "not a directory"),
    (IMAGES, "dataset.seq_len", -1, "dataset.seq_len", "must be >= 0"),
    (IMAGES, "dataset.seq_len", 32, "dataset.seq_len", "applies to text data sets"),
    (IMAGES, "dataset.image_size", -8, "dataset.image_size", "must be >= 0"),
    (TEXT, "dataset.image_size", 32, "dataset.image_size", "applies to image data sets"),
    (IMAGES, "dataset.augment", "yes", "dataset.augment", "True or False"),
    (TEXT, "dataset.augment", True, "dataset.augment", "applies to image data sets"),
    (IMAGES, "dataset.num_workers", -1, "dataset.num_workers", "must be >= 0"),
    (IMAGES, "dataset.train_split", "", "dataset.train_split", "must be a split such as"),
    (IMAGES, "dataset.train_split", 90, "dataset.train_split", "must be a split name"),
    (IMAGES, "dataset.train_split", "train[:90%", "dataset.train_split",
     "one slice of it such as 'train[:90%]'"),
    (IMAGES, "dataset.train_split", "test[:50%]", "dataset.train_split", "reads the test split"),
    (IMAGES, "dataset.validation_split", "test", "dataset.validation_split",
     "reads the test split ('test'), which is kept for the reported evaluations"),
    (IMAGES, "dataset.validation_split", "train[:90%]", "dataset.validation_split",
     "must differ from dataset.train_split, got 'train[:90%]' for both"),
    (IMAGES, "dataset.validation_split", None, "dataset.validation_split", "is missing"),
    (IMAGES, "dataset.validation_split", "", "dataset.validation_split",
     "must name a held-out split when reinit.patience > 0"),
    (IMAGES, "train.num_steps", 0, "train.num_steps", "must be >= 1, got 0"),
    (IMAGES, "train.num_steps", 2.5, "train.num_steps", "must be an integer"),
    (IMAGES, "train.batch_size", 0, "train.batch_size", "must be >= 1"),
    (IMAGES, "train.eval_batch_size", -8, "train.eval_batch_size", "must be >= 1"),
    (IMAGES, "train.learning_rate", -1.0, "train.learning_rate", "must be > 0, got -1.0"),
    (IMAGES, "train.learning_rate", 0.0, "train.learning_rate", "must be > 0, got 0.0"),
    (IMAGES, "train.learning_rate", float("nan"), "train.learning_rate", "finite number"),
    (IMAGES, "train.learning_rate", "1e-3", "train.learning_rate", "finite number"),
    (IMAGES, "train.warmup_steps", -1, "train.warmup_steps", "must be >= 0"),
    (IMAGES, "train.warmup_steps", 8, "train.warmup_steps", "must be < train.num_steps = 8"),
    (IMAGES, "train.final_lr_fraction", 1.5, "train.final_lr_fraction", "in [0, 1]"),
    (IMAGES, "train.weight_decay", -0.1, "train.weight_decay", "must be >= 0"),
    (IMAGES, "train.b1", 1.0, "train.b1", "in [0, 1)"),
    (IMAGES, "train.b2", -0.5, "train.b2", "in [0, 1)"),
    (IMAGES, "train.grad_clip_norm", 0.0, "train.grad_clip_norm", "must be > 0"),
    (IMAGES, "train.log_every", 0, "train.log_every", "must be >= 1"),
    (IMAGES, "train.eval_every", 0, "train.eval_every", "must be >= 1"),
    (IMAGES, "train.checkpoint_every", -4, "train.checkpoint_every", "must be >= 1"),
    (IMAGES, "train.keep_checkpoints", 0, "train.keep_checkpoints", "must be >= 1"),
    (IMAGES, "reinit.scopes", ("first_attention", "second_layer"), "reinit.scopes[1]",
     "unknown scope 'second_layer'"),
    (IMAGES, "reinit.scopes", ("full", "full"), "reinit.scopes", "lists 'full' twice"),
    (IMAGES, "reinit.scopes", "full", "reinit.scopes", "must be a tuple"),
    (IMAGES, "reinit.seeds", (1, 1), "reinit.seeds", "must be distinct"),
    (IMAGES, "reinit.seeds", (1,), "reinit.seeds", "needs at least 2 seeds"),
    (IMAGES, "reinit.seeds", (1, -2), "reinit.seeds[1]", "must be >= 0"),
    (IMAGES, "reinit.seeds", ("1", "2"), "reinit.seeds[0]", "must be an integer"),
    (IMAGES, "reinit.num_steps", 0, "reinit.num_steps", "must be >= 1"),
    (IMAGES, "reinit.learning_rate", -1e-3, "reinit.learning_rate", "must be > 0"),
    (IMAGES, "reinit.warmup_steps", 8, "reinit.warmup_steps", "must be < reinit.num_steps = 8"),
    (IMAGES, "reinit.dataset", "no_such_data", "reinit.dataset", "unknown data set"),
    (IMAGES, "reinit.dataset", "wiki_bytes", "reinit.dataset", "does not fit the model"),
    (IMAGES, "reinit.patience", -1, "reinit.patience", "must be >= 0"),
    (IMAGES, "reinit.patience", 1.5, "reinit.patience", "must be an integer"),
    (IMAGES, "reinit.min_delta", 1.0, "reinit.min_delta", "must be in [0, 1), got 1.0"),
    (IMAGES, "reinit.min_delta", -0.01, "reinit.min_delta", "in [0, 1)"),
    (IMAGES, "reinit.validate_every", 0, "reinit.validate_every", "must be >= 1, got 0"),
    # runlocal: patience 1, validations 4 steps apart, budgets of 8 steps
    (IMAGES, "reinit.patience", 2, "reinit.patience", "2 can never stop a run: its earliest "
     "stop, (patience + 1) x reinit.validate_every = 12 steps, is past the 8-step budget "
     "reinit.num_steps"),
    (IMAGES, "reinit.validate_every", 5, "reinit.patience", "past the 8-step budget "
     "reinit.num_steps"),
    (IMAGES, "reinit.stop_base", "yes", "reinit.stop_base", "True or False"),
    (IMAGES, "model.overrides", {"width": 30}, "model.overrides.width",
     "gives a width of 30, which 4 heads do not divide"),
    (IMAGES, "model.overrides", {"num_heads": 3}, "model.overrides.num_heads",
     "gives a width of 32, which 3 heads do not divide"),
    (IMAGES, "study.methods", ("naive", "bogus"), "study.methods[1]", "unknown method 'bogus'"),
    (IMAGES, "study.methods", ("perm", "full"), "study.methods", "must include 'naive'"),
    (IMAGES, "study.methods", ("naive", "naive"), "study.methods", "lists 'naive' twice"),
    (IMAGES, "study.methods", ("naive,full",), "study.methods[0]",
     "on the command line write a tuple as --config.study.methods=\"('a', 'b')\""),
    (IMAGES, "study.num_lambdas", 2, "study.num_lambdas", "must be >= 3, got 2"),
    (IMAGES, "study.num_lambdas", 1, "study.num_lambdas", "must be >= 3, got 1"),
    (IMAGES, "study.lambda_chunk", 0, "study.lambda_chunk", "must be >= 1"),
    (IMAGES, "study.match_steps", -1, "study.match_steps", "must be >= 0"),
    (IMAGES, "study.match_learning_rate", 0.0, "study.match_learning_rate", "must be > 0"),
    (IMAGES, "study.match_init", "lstsq", "study.match_init", "unknown Stage 2 start 'lstsq'"),
    (IMAGES, "study.match_refine", "never", "study.match_refine",
     "unknown refinement schedule 'never'"),
    (IMAGES, "study.match_solver", "lbfgs", "study.match_solver",
     "unknown refinement solver 'lbfgs'"),
    (IMAGES, "study.learn_steps", -1, "study.learn_steps", "must be"),
    (IMAGES, "study.learn_learning_rate", -0.1, "study.learn_learning_rate", "must be > 0"),
    (IMAGES, "study.learn_uniform_lambda", 1, "study.learn_uniform_lambda", "True or False"),
    (IMAGES, "study.learn_holdout_batches", 0, "study.learn_holdout_batches", "must be"),
    (IMAGES, "study.eval_examples", -5, "study.eval_examples", "must be"),
    (IMAGES, "dataset.validation_examples", -1, "dataset.validation_examples", "must be"),
    (IMAGES, "study.eval_split", "train+test", "study.eval_split",
     "must be a split such as 'train' or one slice of it such as 'train[:90%]'"),
    (IMAGES, "study.eval_split", 0.9, "study.eval_split", "must be a split name"),
    (IMAGES, "study.distance", "manhattan", "study.distance", "unknown distance 'manhattan'"),
    (IMAGES, "study.distances", ("frobenius", "l1"), "study.distances[1]", "unknown distance"),
    (IMAGES, "study.permutation_ablation", 1, "study.permutation_ablation", "True or False"),
    (IMAGES, "study.permutation_ablation_seeds", (1, 9), "study.permutation_ablation_seeds",
     "must be at least 2 of reinit.seeds"),
    (IMAGES, "study.permutation_ablation_seeds", (1,), "study.permutation_ablation_seeds",
     "must be at least 2 of reinit.seeds"),
    (IMAGES, "study.max_exhaustive_heads", 0, "study.max_exhaustive_heads", "must be >= 1"),
    (IMAGES, "study.noise_levels", (0.0, -0.5), "study.noise_levels[1]", "must be >= 0"),
    (IMAGES, "study.noise_levels", (float("inf"),), "study.noise_levels[0]", "finite number"),
    (TEXT, "study.noise_levels", (0.0, 1.5), "study.noise_levels[1]",
     "token replacement rate on text and must be in [0, 1], got 1.5"),
    (IMAGES, "study.num_lambdas", None, "study.num_lambdas", "is missing"),
    (IMAGES, "dataset.train_split", "train[:125%]", "dataset.train_split",
     "reads a data fraction outside (0, 1]: its percent bound 125% is outside [-100, 100], "
     "got 'train[:125%]'"),
    (IMAGES, "dataset.train_split", "train[:0%]", "dataset.train_split",
     "reads a data fraction of 0 of its split; it must be in (0, 1]"),
    (IMAGES, "dataset.validation_split", "train[95%:90%]", "dataset.validation_split",
     "a data fraction of -0.05 of its split"),
    (IMAGES, "study.eval_split", "test[-150%:]", "study.eval_split",
     "its percent bound -150% is outside [-100, 100], got 'test[-150%:]'"),
    (IMAGES, "train.lerning_rate", 1e-3, "train.lerning_rate", "is not a field"),
]


@pytest.mark.parametrize("setting, field, value, where, says", BAD,
                         ids=[f"{c[1]}={c[2]!r}" for c in BAD])
def test_bad_field_is_named_in_one_line(setting, field, value, where, says):
  config = _config(setting, **{field: value})
  with pytest.raises(ValueError) as raised:
    config_checks.validate(config)
  message = str(raised.value)
  assert message.startswith(f"config.{where} "), message
  assert says in message and "\n" not in message, message


def test_rules_are_the_schemas():
  """RULES holds each schema entry's rule, and the default config has exactly those fields."""
  assert config_checks.RULES == {f.path: f.rule for f in config_schema.FIELDS}
  assert sorted(config_checks.field_paths(default.get_config())) == sorted(config_checks.RULES)


@pytest.mark.parametrize("field", config_schema.FIELDS, ids=lambda f: f.path)
def test_every_field_rejects_its_rules_bad_value(field):
  """Every schema entry's rule rejects a value, and validate names the field (or its entry)."""
  with pytest.raises(ValueError, match=rf"^config\.{re.escape(field.path)}"):
    field.rule(field.path, field.rule.bad)
  with pytest.raises(ValueError) as raised:
    config_checks.validate(_config(**{field.path: field.rule.bad}))
  message = str(raised.value)
  assert re.match(rf"config\.{re.escape(field.path)}(\[0\]|\.\w+)? ", message), message
  assert "\n" not in message


@pytest.mark.parametrize("setting, field, value", [
    (IMAGES, "study.num_lambdas", 3),  # the endpoints and one point between them
    (IMAGES, "study.noise_levels", (0.0, 1.5, 3.0)),  # a Gaussian std on images may exceed 1
    (IMAGES, "study.noise_levels", ()),  # no robustness check
    (IMAGES, "study.distances", ()),  # no distance ablation
    (IMAGES, "study.match_steps", 0),  # Stage 1 only
    (IMAGES, "reinit.scopes", ()),  # base model only: one seed is enough
    (IMAGES, "reinit.seeds", ()),
    (IMAGES, "dataset.data_dir", REPO),
    (TEXT, "study.noise_levels", (0.0, 1.0)),
    (TEXT, "reinit.dataset", "wiki_bytes"),
    (IMAGES, "reinit.patience", 0),  # the rule off: no validation split needed
    (IMAGES, "reinit.min_delta", 0.0),  # any decrease is an improvement
    (TEXT, "dataset.validation_split", "validation"),
    (IMAGES, "dataset.train_split", "train"),
    (IMAGES, "study.eval_split", "test[:50%]"),  # only evaluated: the test split is allowed
    (IMAGES, "study.eval_split", "train[:90%]"),
    (IMAGES, "study.eval_split", "test[-100%:]"),  # all of the test split
    (IMAGES, "study.eval_split", "test[:300]"),  # a slice in records: the data source checks it
])
def test_edge_values_are_accepted(setting, field, value):
  changes = {field: value}
  if field == "reinit.seeds":
    changes["reinit.scopes"] = ()
  no_holdout = {"dataset.validation_split": "", "study.methods": ("naive", "perm", "ortho", "full")}
  if field == "reinit.patience":  # no rule and no learned method: no held-out slice needed
    changes.update(no_holdout)
  if field == "dataset.train_split":  # every run trains on the whole split; no rule
    changes.update({**no_holdout, "reinit.patience": 0})
  config_checks.validate(_config(setting, **changes))


@pytest.mark.parametrize("scopes, stop_base, budget", [
    (("full",), False, "train.num_steps"),  # trained from scratch on the base schedule
    ((), True, "train.num_steps"),  # the base model alone, under the rule
    (("first_attention",), False, "reinit.num_steps"),
])
def test_a_rule_is_checked_against_the_budget_of_each_run_it_governs(scopes, stop_base, budget):
  """The earliest stop, (patience + 1) x validate_every, may fall on the budget's last step
  and not past it; the budget is the one of the runs the rule governs."""
  steps = {"train.num_steps": 8, "reinit.num_steps": 8}[budget]
  fits = {"reinit.scopes": scopes, "reinit.stop_base": stop_base, "reinit.patience": 3,
          "reinit.validate_every": steps // 4}
  config_checks.validate(_config(**fits))  # stops at step 4 x validate_every = the budget
  with pytest.raises(ValueError, match=rf"^config\.reinit\.patience 4 can never stop a run: .* "
                     rf"= {5 * (steps // 4)} steps, is past the {steps}-step budget {budget}$"):
    config_checks.validate(_config(**{**fits, "reinit.patience": 4}))


def test_a_base_model_outside_the_rule_has_no_budget_to_fit():
  """Without stop_base the base model trains its whole schedule: a rule too long for
  train.num_steps is fine when no run trained on that schedule follows it."""
  config_checks.validate(_config(**{"reinit.scopes": ("first_attention",), "reinit.patience": 1,
                                    "train.num_steps": 3, "train.warmup_steps": 1}))


def _module_level_lists(path):
  """{name: tuple of strings} of the module-level assignments of string tuples or lists."""
  out = {}
  for node in ast.parse(open(path, encoding="utf-8").read()).body:
    if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value,
                                                                     (ast.Tuple, ast.List)):
      items = node.value.elts
      if items and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in items):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for t in targets:
          if isinstance(t, ast.Name):
            out[t.id] = tuple(e.value for e in items)
  return out


def test_no_module_copies_an_option_list():
  """No experiments module or setting holds its own copy of a list that a library module
  owns (methods, distances, scopes, families, data sets): each imports the owner's."""
  owned = {"matching.METHODS": matching.METHODS, "matching.DISTANCES": matching.DISTANCES,
           "models.SCOPES": models.SCOPES, "models.FAMILIES": models.FAMILIES,
           "data.DATASETS": data.DATASETS}
  paths = glob.glob(os.path.join(REPO, "experiments", "*.py"))
  paths += glob.glob(os.path.join(REPO, "experiments", "configs", "*.py"))
  assert len(paths) > 20
  copies = [f"{os.path.relpath(p, REPO)}: {name} copies {owner}"
            for p in paths for name, values in _module_level_lists(p).items()
            for owner, listed in owned.items() if set(values) == set(listed)]
  assert not copies
  assert not hasattr(default, "SCOPES")  # the settings read models.SCOPES itself


def test_options_come_from_their_owners(monkeypatch):
  """A method or scope that its owner adds is accepted: no copy of the lists to update."""
  configs = {"method": _config(**{"study.methods": ("naive", "new_one")}),
             "scope": _config(**{"reinit.scopes": ("new_one",)})}
  for noun, config in configs.items():
    with pytest.raises(ValueError, match=f"unknown {noun} 'new_one'"):
      config_checks.validate(config)
  monkeypatch.setattr(matching, "METHODS", (*matching.METHODS, "new_one"))
  monkeypatch.setattr(models, "SCOPES", (*models.SCOPES, "new_one"))
  for config in configs.values():
    config_checks.validate(config)


# Each list-valued field of the settings, set on the command line: (flags, field, parsed value).
OVERRIDES = [
    (["--config.study.methods=('naive', 'full')"], "study.methods", ("naive", "full")),
    (["--config.study.methods=naive", "--config.study.methods=ortho"], "study.methods",
     ("naive", "ortho")),
    (["--config.study.distances=('cosine',)"], "study.distances", ("cosine",)),
    (["--config.study.distances=()"], "study.distances", ()),
    (["--config.study.noise_levels=(0.0, 0.25, 2)"], "study.noise_levels", (0.0, 0.25, 2)),
    (["--config.reinit.scopes=('first_layer', 'full')"], "reinit.scopes", ("first_layer", "full")),
    (["--config.reinit.scopes=full"], "reinit.scopes", ("full",)),
    (["--config.reinit.seeds=(4, 5, 6)"], "reinit.seeds", (4, 5, 6)),
    (["--config.model.overrides.patch_size=4"], "model.overrides",
     {"patch_size": 4, "pos_encoding": "rope2d"}),
    (["--config.model.overrides={'num_kv_heads': 2, 'pos_encoding': 'rope2d'}"],
     "model.overrides", {"num_kv_heads": 2, "pos_encoding": "rope2d"}),
]


def _main_flags(monkeypatch, overrides, workdir):
  """main.py's flag parsing of ``overrides`` on quickstart:rope,runlocal (the config flag
  reads its --config.* overrides from sys.argv)."""
  argv = ["main.py", f"--config={REPO}/experiments/configs/quickstart.py:rope,runlocal",
          f"--workdir={workdir}", "--compilation_cache=", *overrides]
  monkeypatch.setattr(sys, "argv", argv)
  return main.parse_flags(argv)


@pytest.mark.parametrize("overrides, field, expected", OVERRIDES,
                         ids=[" ".join(o[0]) for o in OVERRIDES])
def test_list_field_set_on_the_command_line(overrides, field, expected, monkeypatch, tmp_path):
  with flagsaver.flagsaver():
    _main_flags(monkeypatch, overrides, tmp_path)
    config = main.FLAGS.config
    value = config
    for key in field.split("."):
      value = value[key]
    if isinstance(value, ml_collections.ConfigDict):
      value = value.to_dict()
    assert value == expected and type(value) is type(expected)
    config_checks.validate(config)


def test_main_stops_at_a_bad_value_before_any_stage(monkeypatch, tmp_path):
  ran = []
  monkeypatch.setattr(main, "STAGES", (lambda config, workdir: ran.append(workdir) or {},))
  workdir = tmp_path / "w"
  with flagsaver.flagsaver():
    argv = _main_flags(monkeypatch, ["--config.study.methods=('naive', 'fulll')"], workdir)
    with pytest.raises(SystemExit, match=re.escape(
        "FATAL config.study.methods[1] is an unknown method 'fulll'; choose from")):
      main.main(argv)
  assert not ran and not workdir.exists()


def test_learned_needs_a_validation_split():
  config = _config(**{"dataset.validation_split": "", "reinit.patience": 0})
  with pytest.raises(ValueError, match=r"^config.study.methods includes 'learned', which "
                     r"chooses its best iterate on held-out training data"):
    config_checks.validate(config)


def test_a_band_of_lambda_and_a_uniform_lambda_are_refused_together():
  config = _config(**{"study.learn_lam_band": 10, "study.learn_uniform_lambda": True})
  with pytest.raises(ValueError, match=r"^config.study.learn_lam_band draws lambda from a band"):
    config_checks.validate(config)
  config_checks.validate(_config(**{"study.learn_lam_band": 10}))


def test_the_circuit_path_is_refused_for_a_rope_model_before_any_work():
  config = _config(**{"study.circuit_path": True, "model.overrides.pos_encoding": "rope2d"})
  with pytest.raises(ValueError, match=r"^config.study.circuit_path is not defined for a RoPE "
                     r"model \(model pos_encoding 'rope2d'\)"):
    config_checks.validate(config)
  config_checks.validate(_config(**{"study.circuit_path": True}))  # the quickstart's ViT: APE
  config_checks.validate(_config(**{"model.overrides.head_width": 12,
                                    "model.overrides.num_heads": 5}))  # 5 heads of width 12


def test_eval_split_must_be_a_split_of_the_studied_data_set():
  """Checked with the other splits before training (data_checks.check_data) and before the study
  reads it (path_evaluation.evaluation_examples)."""
  config = _config(**{"study.eval_split": "validation"})
  says = "config.study.eval_split 'validation' does not fit: Dataset 'digits' has no split"
  with pytest.raises(ValueError, match=re.escape(says)):
    data_checks.check_data(config)
  with pytest.raises(ValueError, match=re.escape(says)):
    path_evaluation.evaluation_examples(config, "digits")


@pytest.mark.parametrize("part, fraction", [
    ("train", 1.0), ("train[:25%]", 0.25), ("train[90%:]", 0.1), ("train[-10%:]", 0.1),
    ("train[10%:-10%]", 0.8), ("test[:100%]", 1.0), ("train[:5000]", None),
    ("train[10%:5000]", None)])
def test_split_fraction_reads_percent_slices(part, fraction):
  got = config_schema.split_fraction(part)
  assert got == (None if fraction is None else pytest.approx(fraction))
