"""docs/extending.md works as written: its code blocks run in order, and what they register
(a model family, a matching method, a data set) trains and is studied through its setting.

A block whose first line is "# file: NAME.py" is written to a file and imported as that
module (a setting); every other Python block runs in one shared namespace.
"""

import importlib.util
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from attn_symmetry import data
from attn_symmetry import matching
from attn_symmetry import models
from attn_symmetry import registry
from experiments.setting import config_checks
from experiments.study import scope_study
from experiments.study import study
from experiments.train import inputs
from experiments.train import saved_runs
from experiments.train import trainer

PAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                    "extending.md")
BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
FILE = re.compile(r"# file: (\w+)\.py\n")


def _blocks():
  return BLOCK.findall(open(PAGE, encoding="utf-8").read())


@pytest.fixture(scope="module")
def extended(tmp_path_factory):
  """The page's blocks run (registrations included) with a fresh data dir, in a
  ``registry.scoped()`` block: other tests see the package as it ships."""
  tmp = tmp_path_factory.mktemp("extending")
  data_dir = tmp / "data"
  data_dir.mkdir()
  with pytest.MonkeyPatch.context() as mp, registry.scoped():
    mp.setenv(data.DATA_DIR_ENV, str(data_dir))
    namespace, settings = {}, {}
    for block in _blocks():
      name = FILE.match(block)
      if name:
        path = tmp / f"{name.group(1)}.py"
        path.write_text(block)
        spec = importlib.util.spec_from_file_location(name.group(1), path)
        settings[name.group(1)] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
      else:
        exec(compile(block, PAGE, "exec"), namespace)  # pylint: disable=exec-used
    yield namespace, settings, tmp
  assert "meanpool" not in models.FAMILIES and "majority" not in data.DATASETS
  assert "full_attention_only" not in matching.METHODS


def test_the_page_has_one_example_of_each_extension():
  blocks = _blocks()
  assert len(blocks) == 4
  for call in ("models.register_family(", "matching.register_method(",
               "data.register_dataset(", "def get_config("):
    assert sum(call in b for b in blocks) == 1, call


@pytest.mark.slow
def test_registrations_are_listed_where_configs_look(extended):
  namespace, settings, _ = extended
  assert "meanpool" in models.FAMILIES and models.build("meanpool").input_key == "tokens"
  assert "full_attention_only" in matching.METHODS and "majority" in data.DATASETS
  config_checks.validate(settings["majority_meanpool"].get_config())
  with pytest.raises(ValueError, match="already registered"):
    models.register_family(models.get_family("meanpool"))
  with pytest.raises(ValueError, match="already registered"):
    matching.register_method("full_attention_only", namespace["align_attention_only"])
  with pytest.raises(ValueError, match="already registered"):
    data.register_dataset("majority", data.Entry("text", namespace["Majority"]))


@pytest.mark.slow
def test_registration_rejects_what_the_package_does_not_know(extended):
  namespace, _, _ = extended
  family = models.get_family("meanpool")
  for changes, match in [(dict(input_key="audio"), "input_key must be one of"),
                         (dict(heads={"classifier": "regression"}), "task 'regression'"),
                         (dict(presets={"huge": {}}), "unknown presets \\['huge'\\]"),
                         (dict(defaults={"num_layers": 3}), "unknown config fields")]:
    with pytest.raises(ValueError, match=match):
      models.register_family(models.Family(**{**family.__dict__, "name": "other", **changes}))
  with pytest.raises(ValueError, match="unknown options \\['seed'\\]"):
    matching.register_method("other", namespace["align_attention_only"], options=("seed",))
  with pytest.raises(ValueError, match="kind must be one of"):
    data.Entry("audio", namespace["Majority"])


@pytest.mark.slow
def test_the_setting_trains_and_is_studied_with_the_new_method(extended):
  """The new family on the new data set, re-initialised and studied with the new method."""
  _, settings, tmp = extended
  config = settings["majority_meanpool"].get_config("runlocal")
  config.reinit.scopes = ("first_layer",)
  config.study.permutation_ablation = False
  config.study.distances = ()
  config.study.noise_levels = ()
  config.study.num_lambdas = 3
  config.study.methods = ("naive", "full_attention_only")  # "full" is tested elsewhere
  workdir = str(tmp / "workdir")
  trainer.train_and_evaluate(config, workdir)
  paths = study.run_study(config, workdir)
  result = json.load(open(paths["first_layer/results.json"]))
  methods = result["methods"]
  assert set(methods) == {"naive", "full_attention_only"}
  assert all(np.isfinite(m["loss_barrier_mean"]) for m in methods.values())
  # The new method moved the heads of B and nothing else: its element is what study applied.
  model = inputs.create_model(config)
  checkpoints = saved_runs.load_checkpoints(config, workdir)
  a, b = (checkpoints[f"reinit/first_layer/seed_{s}"] for s in (1, 2))
  element, _ = matching.align_model(
      model.spec, a, b, scope=model.scope_paths("first_layer"), method="full_attention_only",
      **scope_study.matching_kwargs(config, "full_attention_only"))
  np.testing.assert_array_equal(element["layers_0/mlp"], np.arange(model.config.mlp_dim))
  heads = element["layers_0/attention"]
  assert not (np.array_equal(heads.perm, np.arange(model.config.num_heads))
              and np.allclose(heads.qk, np.eye(model.config.head_dim)))
  # A symmetry keeps B's function: the path's endpoints are the naive path's.
  (pair,) = result["pairs"]
  naive, own = (pair["methods"][m]["loss"] for m in ("naive", "full_attention_only"))
  np.testing.assert_allclose([own[0], own[-1]], [naive[0], naive[-1]], rtol=1e-4)


def _registries():
  return list(models.FAMILIES), dict(matching.METHODS), dict(data.DATASETS.mapping)


def test_a_scoped_block_leaves_every_registry_as_it_was():
  """What a block registers, replaces or removes is undone when it ends, also by an error,
  in place: the name views (models.FAMILIES, data.DATASETS) stay live. Blocks nest."""
  before = _registries()
  with pytest.raises(RuntimeError, match="inside"):
    with registry.scoped():
      models.register_family(models.Family(**{**models.get_family("gpt2").__dict__,
                                              "name": "gpt2_copy"}))
      with registry.scoped():
        matching.register_method("inner", lambda *a, **k: ({}, {}))
        assert "inner" in matching.METHODS
      assert "inner" not in matching.METHODS and "gpt2_copy" in models.FAMILIES
      assert models.build("gpt2_copy", "tiny").config.family == "gpt2_copy"
      data.register_dataset("digits_copy", data.Entry("image", "mnist"))
      del matching.METHODS["perm"]
      raise RuntimeError("an error inside the block")
  assert _registries() == before
  assert "gpt2_copy" not in models.FAMILIES and "digits_copy" not in data.DATASETS
  with pytest.raises(ValueError, match="unknown model family 'gpt2_copy'"):
    models.get_family("gpt2_copy")


@pytest.mark.slow
def test_a_registry_first_imported_inside_the_block_keeps_its_built_in_entries():
  code = """
from attn_symmetry import registry
with registry.scoped():
  from attn_symmetry import matching, models
  built_in = list(models.FAMILIES), list(matching.METHODS)
  models.register_family(models.Family(**{**models.get_family("vit").__dict__, "name": "v2"}))
  matching.register_method("m2", lambda *a, **k: ({}, {}))
assert (list(models.FAMILIES), list(matching.METHODS)) == built_in, built_in
assert {"vit", "bert", "gpt2", "llama"} <= set(built_in[0]) and "full" in built_in[1]
"""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                          timeout=300, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
