"""A method that needs data, registered in this file alone, reaches it through the align command
and through the study: it declares its inputs (``matching.INPUTS``) and each caller's provider
supplies them (``matching.provided_arguments``), with nothing of the library edited."""

import json

import numpy as np
import pytest

from attn_symmetry import align
from attn_symmetry import matching
from attn_symmetry import registry
from experiments.configs import quickstart
from experiments.study import study
from tests import test_align_checkpoints as checkpoints_tests

NAME = "probe_data"


def _register(seen: dict) -> None:
  """Registers ``NAME``: it reads the activations of A on the first match batch and the loss of
  A on the first training and held-out batches (recorded in ``seen``), then returns the "full"
  method's element, so that the caller's own checks of a symmetry still hold."""

  def align_probe(spec, params_a, params_b, *, scope, activations, match_batches, loss_fn,
                  batches, holdout_batches, key, progress, **options):
    taps = activations(params_a, match_batches[0])
    train, held = next(iter(batches)), next(iter(holdout_batches))
    seen.update(taps=len(taps), match_batches=len(match_batches),
                train_loss=float(loss_fn(params_a, train)),
                holdout_loss=float(loss_fn(params_a, held)), key=key is not None,
                progress=callable(progress))
    return matching.align_model(spec, params_a, params_b, scope=scope, method="full", **options)

  matching.register_method(NAME, align_probe, options=matching.METHODS["full"].options,
                           inputs=(matching.ACTIVATIONS, matching.LOSS),
                           doc="full, having read activations and a loss")


def _assert_fed(seen: dict) -> None:
  assert seen["taps"] > 0 and seen["match_batches"] >= 1
  assert np.isfinite(seen["train_loss"]) and np.isfinite(seen["holdout_loss"])
  assert seen["key"] and seen["progress"]


def test_needs_follow_the_declaration():
  seen = {}
  with registry.scoped():
    _register(seen)
    method = matching.METHODS[NAME]
    assert method.needs({}) == (matching.ACTIVATIONS, matching.LOSS)
    given = matching.provided_arguments(NAME, {}, lambda needed: {
        a: needed for a in matching.INPUTS[needed]})
    assert given == {"activations": "activations", "match_batches": "activations",
                     **{a: "loss" for a in matching.INPUTS[matching.LOSS]}}
    with pytest.raises(ValueError, match="the provider of input 'activations' gave"):
      matching.provided_arguments(NAME, {}, lambda needed: {"activations": None})
  assert NAME not in matching.METHODS


@pytest.mark.slow
def test_the_align_command_supplies_what_a_registered_method_needs(tmp_path):
  a = checkpoints_tests._save_model("vit", str(tmp_path / "a"))  # pylint: disable=protected-access
  b = checkpoints_tests._plant("vit", a, str(tmp_path / "b"), seed=3)  # pylint: disable=protected-access
  images = checkpoints_tests._images(tmp_path / "images")  # pylint: disable=protected-access
  seen = {}
  with registry.scoped():
    _register(seen)
    result = align.align_checkpoints(a, b, method=NAME, eval_images=images, match_data=images,
                                     batch_size=2, num_lambdas=3, out=str(tmp_path / "out"))
  _assert_fed(seen)
  assert result.report["method"] == NAME
  # it trains on the match data (3 batches of 2 images: 2 to train on, the last held out)
  assert [result.report["eval"][k] for k in ("training_batches", "holdout_batches")] == [2, 1]
  assert result.report["eval"]["training_data"] == str(images)
  with pytest.raises(align.InputError, match=f"--method {NAME} trains on the task loss"):
    with registry.scoped():
      _register({})
      align.align_checkpoints(a, b, method=NAME, match_data=images, out=str(tmp_path / "o2"))


@pytest.mark.slow
def test_the_study_supplies_what_a_registered_method_needs(trained_workdir, tmp_path):
  seen = {}
  with registry.scoped():
    _register(seen)
    config = quickstart.get_config("runlocal")
    config.reinit.scopes, config.reinit.seeds = ("first_attention",), (1, 2)
    config.study.methods = ("naive", NAME)
    config.study.permutation_ablation, config.study.distances = False, ()
    config.study.noise_levels = ()
    workdir, _ = trained_workdir(config, tmp_path / "w")
    paths = study.run_study(config, workdir)
  _assert_fed(seen)
  with open(paths["first_attention/results.json"]) as f:
    result = json.load(f)
  assert set(result["methods"]) == {"naive", NAME}
  assert np.isfinite(result["methods"][NAME]["loss_barrier_mean"])
