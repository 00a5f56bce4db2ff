"""Every setting in experiments/configs: its command, its variants, a valid model and data set."""

import glob
import importlib
import os

import pytest
from absl import flags
from ml_collections import config_flags

from attn_symmetry import data
from attn_symmetry import models
from experiments import config_checks
from experiments import inputs
from experiments import train

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
  train.check_data(config)
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
