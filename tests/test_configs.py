"""Every setting in experiments/configs: its command, its variants, a valid model and data set;
the schema its fields come from (experiments/setting/config_schema.py) and what derives from it."""

import dataclasses
import glob
import importlib
import os

import ml_collections
import pytest
from absl import flags
from ml_collections import config_flags

from attn_symmetry import data
from attn_symmetry import models
from experiments.setting import config_checks
from experiments.setting import config_schema
from experiments.setting import fingerprints
from experiments.train import data_checks
from experiments.train import inputs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# cpu_paper names its settings by variant (table1_vit_mnist_ape, ...) rather than ape/rope;
# tests/test_reproduce.py checks each of them.
SETTINGS = sorted(os.path.basename(p)[:-3]
                  for p in glob.glob(os.path.join(REPO, "experiments", "configs", "*.py"))
                  if not p.endswith(("__init__.py", "cpu_paper.py")))
# The paper's settings (and their A->B variants) that the issue asks for, each with APE and RoPE.
PAPER = ["vit_mnist", "vit_cifar", "vit_cifar100", "vit_imagenet", "gpt2_enwik8",
         "gpt2_wikitext103", "llama_lm1b", "bert_imdb", "bert_agnews", "bert_dbpedia"]
OFFLINE = ["quickstart", "vit_mnist_to_fashion", "gpt2_wiki_bytes", "llama_wiki_bytes",
           "bert_offline", "bert_mlm_wiki_bytes"]
# Input and output sizes of the paper's data sets, which are not prepared on this machine.
PAPER_DATA = {
    "mnist": dict(image_size=28, num_channels=1, num_classes=10),
    "cifar10": dict(image_size=32, num_channels=3, num_classes=10),
    "cifar100": dict(image_size=32, num_channels=3, num_classes=100),
    "imagenet2012": dict(num_channels=3, num_classes=1000),
    "imdb_reviews": dict(num_classes=2),
    "ag_news_subset": dict(num_classes=4),
    "dbpedia": dict(num_classes=14),
}
# Every variant name a setting may accept besides "runlocal".
VARIANTS = ("ape", "rope", "to_fashion", "to_enwik8", "to_wikitext103")


def _module(name):
  return importlib.import_module(f"experiments.configs.{name}")


def _variants(name):
  return [None, "runlocal"] if name == "default" else [None, "ape", "rope", "rope,runlocal"]


def _model_config(config):
  """The model config of a setting, with the data set's sizes (real for offline data)."""
  name = config.dataset.name
  if name in PAPER_DATA:
    sizes = dict(PAPER_DATA[name])
    if config.dataset.image_size:
      sizes["image_size"] = config.dataset.image_size
    if config.model.family != "vit":
      sizes.update(vocab_size=data.VOCAB_SIZE, max_len=config.dataset.seq_len)
  elif name in ("enwik8", "wikitext103", "lm1b"):
    sizes = dict(vocab_size=data.VOCAB_SIZE, max_len=config.dataset.seq_len)
  else:
    sizes = inputs.model_overrides(inputs.dataset_info(config, name),
                                   mask_token=config.model.overrides.get("head") == "mlm")
  return models.make_config(config.model.family, config.model.preset,
                            **{**sizes, **config.model.overrides.to_dict()})


def test_every_required_setting_exists():
  assert set(PAPER + OFFLINE + ["default"]) <= set(SETTINGS)


@pytest.mark.parametrize("name", SETTINGS)
def test_docstring_holds_the_command(name):
  doc = _module(name).__doc__
  assert f"python experiments/main.py --config=experiments/configs/{name}.py" in doc


@pytest.mark.parametrize("name", SETTINGS)
def test_variants_are_valid(name):
  for arg in _variants(name):
    config = _module(name).get_config(arg)
    config_checks.validate(config)
    assert config.dataset.name in data.DATASETS
    assert config.reinit.dataset in ("", *data.DATASETS)
    model = _model_config(config)
    if arg and "rope" in arg:
      assert model.rotary
    elif arg == "ape":
      assert model.pos_encoding == "learned"
    if arg and "runlocal" in arg:
      assert model.width <= 64 and model.depth <= 2
      assert config.train.num_steps <= 10 and config.reinit.num_steps <= 10
  with pytest.raises(ValueError, match="unknown config variant"):
    _module(name).get_config("no_such_variant")


def _accepts(name, variant):
  try:
    _module(name).get_config(variant)
  except ValueError as e:
    assert "unknown config variant" in str(e)
    return False
  return True


@pytest.mark.parametrize("name", SETTINGS)
def test_every_variant_validates(name):
  """Each variant the setting accepts, alone and with runlocal, passes config_checks."""
  accepted = [v for v in VARIANTS if _accepts(name, v)]
  assert name == "default" or {"ape", "rope"} <= set(accepted)
  for variant in [None, *accepted]:
    for arg in (variant, ",".join(filter(None, (variant, "runlocal")))):
      config_checks.validate(_module(name).get_config(arg))


@pytest.mark.parametrize("name", PAPER + OFFLINE)
def test_settings_reinitialise_every_scope(name):
  config = _module(name).get_config()
  assert tuple(config.reinit.scopes) == models.SCOPES
  assert len(config.reinit.seeds) >= 3


@pytest.mark.parametrize("name, arg, dataset", [
    ("vit_mnist", "to_fashion", "fashion_mnist_deb"),
    ("gpt2_enwik8", "rope,to_wikitext103", "wikitext103"),
    ("gpt2_wikitext103", "to_enwik8", "enwik8"),
    ("llama_lm1b", "to_wikitext103", "wikitext103"),
    ("vit_mnist_to_fashion", None, "fashion_mnist_deb"),
])
def test_transfer_variants(name, arg, dataset):
  config = _module(name).get_config(arg)
  assert config.reinit.dataset == dataset != config.dataset.name


@pytest.mark.parametrize("name", OFFLINE)
def test_offline_settings_read_real_data(name):
  config = _module(name).get_config("runlocal")
  config_checks.validate(config)
  data_checks.check_data(config)
  model = inputs.create_model(config)
  assert model.config == _model_config(config)
  assert model.input_key == inputs.dataset_info(config, config.dataset.name).input_key


def test_model_that_reads_other_inputs_than_the_data_is_rejected():
  config = _module("quickstart").get_config("runlocal")
  config.dataset.name = "wiki_bytes"
  with pytest.raises(ValueError, match="config.model.family 'vit' reads 'image' inputs; data set "
                     "'wiki_bytes' holds 'tokens'"):
    inputs.create_model(config)


def _parse(argv):
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "setting", flag_values=values,
                                  lock_config=True, sys_argv=argv)
  values(argv)
  return values.config


def test_command_line_overrides():
  setting = "--config=experiments/configs/quickstart.py:rope,runlocal"
  config = _parse(["main.py", setting, "--config.train.num_steps=3",
                   "--config.reinit.scopes=('first_layer',)", "--config.reinit.seeds=(7, 8)"])
  assert config.train.num_steps == 3
  assert tuple(config.reinit.scopes) == ("first_layer",)
  assert tuple(config.reinit.seeds) == (7, 8)
  assert config.model.overrides.pos_encoding == "rope2d"
  # The config is locked: a field that does not exist cannot be created by an override.
  with pytest.raises((AttributeError, KeyError, flags.Error), match="num_stepz"):
    _parse(["main.py", setting, "--config.train.num_stepz=3"])


# The schema (experiments/setting/config_schema.py): every field defined there once, the rest
# derived.


def _setting_args(name):
  """Every variant string of a setting: alone and with its shrinking variant."""
  module = _module(name)
  if name == "cpu_paper":
    return [s + v for s in sorted(module.SETTINGS) for v in ("", ",reduced")]
  accepted = [v for v in VARIANTS if _accepts(name, v)]
  return [a for v in [None, *accepted] for a in (v, ",".join(filter(None, (v, "runlocal"))))]


def _not_in_schema(config):
  """(fields of ``config`` outside the schema, schema fields missing from ``config``)."""
  present = list(config_checks.field_paths(config))
  return ([f for f in present if f not in config_schema.BY_PATH],
          [f for f in config_schema.BY_PATH if f not in present])


@pytest.mark.parametrize("name", SETTINGS + ["cpu_paper"])
def test_every_setting_has_exactly_the_schemas_fields(name):
  """A setting file changes values of the schema's fields; a field it creates fails here."""
  for arg in _setting_args(name):
    assert _not_in_schema(_module(name).get_config(arg)) == ([], []), (name, arg)


def test_a_field_created_outside_the_schema_is_found():
  config = _module("quickstart").get_config("runlocal")
  config.train.new_option = 1
  del config.study.eval_split
  assert _not_in_schema(config) == (["train.new_option"], ["study.eval_split"])


def test_default_config_is_the_schemas_defaults():
  """default.py writes no default of its own: get_config() is the table's defaults."""
  expected = {}
  for field in config_schema.FIELDS:
    *sections, name = field.path.split(".")
    node = expected
    for section in sections:
      node = node.setdefault(section, {})
    node[name] = field.default
  config = _module("default").get_config()
  assert config.to_dict() == expected
  assert sorted(config_checks.field_paths(config)) == sorted(config_schema.BY_PATH)
  for field in config_schema.FIELDS:  # types too: 1e-3 stays a float, () a tuple
    value = config
    for key in field.path.split("."):
      value = value[key]
    assert type(value) is (ml_collections.ConfigDict if isinstance(field.default, dict)
                           else type(field.default)), field.path


def test_every_entry_has_a_rule_a_role_and_a_doc():
  paths = [f.path for f in config_schema.FIELDS]
  assert len(paths) == len(set(paths)) == len(config_schema.BY_PATH)
  for field in config_schema.FIELDS:
    assert isinstance(field.rule, config_schema.Rule) and field.rule.says, field.path
    assert isinstance(field.keys, config_schema.Role), field.path
    assert field.doc and "\n" not in field.doc, field.path
    field.rule(field.path, field.default)  # the default passes its own check
    if field.unkeyed_default is not config_schema.ALWAYS:
      assert field.keys is not config_schema.Role.NOT_KEYED, field.path
      field.rule(field.path, field.unkeyed_default)
    if "." in field.path:
      assert field.path.split(".")[0] in config_schema.SECTIONS, field.path
  reference = config_schema.reference()
  assert all(f"  {path} = " in reference for path in paths)


GROUPS = ("TRAINING", "TRAIN_SCHEDULE", "REINIT_SCHEDULE", "STOPPING", "STUDY", "PER_RUN",
          "NOT_KEYED")


def test_fingerprint_groups_derive_from_the_schema():
  """A few fields where the fingerprints expect them, and every field in exactly one group."""
  expected = {"TRAINING": ["model", "dataset.train_split", "train.batch_size", "train.b2"],
              "TRAIN_SCHEDULE": ["train.num_steps", "train.learning_rate", "train.warmup_steps"],
              "REINIT_SCHEDULE": ["reinit.num_steps", "reinit.learning_rate",
                                  "reinit.warmup_steps"],
              "STOPPING": ["reinit.patience", "dataset.validation_split"],
              "STUDY": ["study.num_lambdas", "study.match_solver", "study.eval_split"],
              "PER_RUN": ["seed", "dataset.name", "reinit.dataset"],
              "NOT_KEYED": ["train.log_every", "study.lambda_chunk", "reinit.scopes"]}
  for group, names in expected.items():
    assert set(names) <= set(getattr(fingerprints, group)), group
  assert fingerprints.TRAIN_SCHEDULE == tuple(expected["TRAIN_SCHEDULE"])
  assert fingerprints.PER_RUN == tuple(expected["PER_RUN"])
  assert not any(n.startswith("model.") for g in GROUPS for n in getattr(fingerprints, g))
  assert fingerprints.UNKEYED_DEFAULTS == {"dataset.validation_examples": 0,
                                           "reinit.stop_base": False,
                                           "study.eval_split": "test",
                                           "study.learn_factors": ("attention",),
                                           "study.learn_init": "full",
                                           "study.learn_lam_band": 0,
                                           "study.match_residual": "permutation",
                                           "study.learn_schedule": "constant",
                                           "study.learn_patience": 0,
                                           "study.learn_repair": False,
                                           "study.activation_batches": 8,
                                           "study.repair_no_bias": "std"}
  for field in config_schema.FIELDS:
    holders = [g for g in GROUPS for n in getattr(fingerprints, g)
               if field.path == n or field.path.startswith(n + ".")]
    assert holders == [field.keys.name], (field.path, holders)


def test_a_section_is_keyed_whole_only_when_all_its_fields_key_the_group(monkeypatch):
  fields = [dataclasses.replace(f, keys=config_schema.Role.NOT_KEYED)
            if f.path == "model.preset" else f for f in config_schema.FIELDS]
  monkeypatch.setattr(config_schema, "FIELDS", tuple(fields))
  training = config_schema.keyed_by(config_schema.Role.TRAINING)
  assert training[:2] == ("model.family", "model.overrides") and "model" not in training
  assert "model.preset" in config_schema.keyed_by(config_schema.Role.NOT_KEYED)
