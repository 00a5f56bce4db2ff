"""The study's cache keys derive from the schema, and key every config field a stage reads.

Each field of ``experiments/setting/config_schema.py`` names the study stages that read it
(``Field.study``) or the ``align_model`` option it sets (``Field.option``);
``scope_study`` keys every stage from that alone. Here the study of one scope runs on a
config that records every field read (``RecordingConfig``), each stage computed afresh,
and a field that a stage reads but does not key fails the test: the stage's stored result
would be reused when that field changes.

The models are random initialisations (no training): the keys do not depend on the
parameters' values, and every stage reads the same fields of any parameters. What the study
reads when it is set up (which seeds, the data set, the model, the evaluation examples, the
options of the compiled program that "perm", "ortho" and "full" share) is outside the stages;
it reaches them through the fields every stage keys and the content hashes of the endpoints
and of the evaluation examples. That study takes about 25 s on one core (the "learned"
stage compiles its REPAIRed objective too: study.learn_repair), so the tests that read it are
in the slow tier (tests/conftest.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import jax
import ml_collections
import pytest

from attn_symmetry import matching
from attn_symmetry import runtime
from experiments.configs import quickstart
from experiments.setting import config_schema
from experiments.setting import fingerprints
from experiments.study import path_evaluation
from experiments.study import result_cache
from experiments.study import scope_study
from experiments.train import inputs

SCOPE = "first_attention"  # the scope of every kind of stage: methods, both ablations, noise
METHODS = ("naive", "perm", "ortho", "full", "learned")


class RecordingConfig(Mapping):
  """A read-only view of a ConfigDict that adds the dotted path of every field read to
  ``reads`` while that is a set (``recording``); a sub-config read whole (``to_dict()``)
  counts as a read of its path."""

  def __init__(self, node: ml_collections.ConfigDict, path: str = "", reads: list | None = None):
    self._node, self._path = node, path
    # [the set being filled, or None], one list shared with the views of the sub-configs.
    self._reads = reads if reads is not None else [None]

  def _child(self, key: str) -> str:
    return f"{self._path}.{key}" if self._path else key

  def _record(self, path: str) -> None:
    if self._reads[0] is not None:
      self._reads[0].add(path)

  def __getitem__(self, key: str) -> Any:
    value = self._node[key]
    if isinstance(value, ml_collections.ConfigDict):
      return RecordingConfig(value, self._child(key), self._reads)
    self._record(self._child(key))
    return value

  def __getattr__(self, name: str) -> Any:
    if name.startswith("_"):
      raise AttributeError(name)
    if name in self._node:
      return self[name]
    self._record(self._path)  # a method of the sub-config (to_dict, ...): read whole
    return getattr(self._node, name)

  def __iter__(self) -> Iterator[str]:
    return iter(self._node.keys())

  def __len__(self) -> int:
    return len(self._node)

  @contextlib.contextmanager
  def recording(self) -> Iterator[set[str]]:
    """The set of the paths read inside the block."""
    self._reads[0] = reads = set()
    try:
      yield reads
    finally:
      self._reads[0] = None


def study_config() -> ml_collections.ConfigDict:
  """The quickstart at runlocal size with every built-in method, both ablations and the
  robustness check, small, and every field of ``fingerprints.UNKEYED_DEFAULTS`` off the value
  at which it keys nothing (so that a stage's fields show every field it keys)."""
  config = quickstart.get_config("runlocal")
  config.reinit.scopes = (SCOPE,)
  config.reinit.seeds = (1, 2)
  config.train.eval_batch_size = 16
  config.dataset.validation_examples = 16
  config.study.methods = METHODS
  config.study.num_lambdas = 3
  config.study.eval_examples = 16
  config.study.eval_split = "train[:10%]"
  config.study.match_steps = 2
  config.study.learn_steps = 2
  config.study.learn_factors = ("attention", "heads")
  config.study.learn_init = "activation"  # "learned" from the activation method's element
  config.study.learn_lam_band = 10
  config.study.learn_schedule = "warmup_cosine"
  config.study.learn_patience = 1
  config.study.learn_repair = True  # its objective REPAIRed, with repair_no_bias's rule
  config.study.repair_no_bias = "second_moment"
  config.study.activation_batches = 2
  config.study.noise_levels = (0.5,)
  config.reinit.stop_base = True  # the base model under the rule too (no study stage reads it)
  config.study.match_residual = "orthogonal"  # no LayerNorm stream in the scope: permutation
  for path, value in fingerprints.UNKEYED_DEFAULTS.items():
    section, name = path.split(".")
    assert config[section][name] != value, path
  return config


class Stage(NamedTuple):
  reads: frozenset[str]  # the config fields that computing the stage read
  fields: dict[str, Any]  # the fields it is keyed by (result_cache.cached's)
  result: dict[str, Any]


def run_scope(config, model, evaluator, checkpoints, workdir, monkeypatch,
              stored: Mapping[str, Stage] | None = None) -> dict[str, Stage]:
  """Every stage of the scope's study of ``config``, by name ("full", "robustness", ...).

  Each stage is computed with nothing kept from an earlier one (its alignments, path
  ends), so that its reads are its own; with ``stored``, it is not computed: its stored
  result stands in, and only its fields are new.
  """
  study = scope_study.ScopeStudy(config, model, SCOPE, checkpoints, evaluator, workdir,
                                 data_fingerprint="the evaluation data")
  stages = {}

  def cached(path, fields, compute):
    name = os.path.basename(path).removesuffix(".json")
    if stored is not None:
      result, reads = stored[name].result, stored[name].reads
    else:
      for kept in (study._alignments, study._elements, study._ends, study._activation_data):
        kept.clear()
      with config.recording() as reads:
        result = compute()
    stages[name] = Stage(frozenset(reads), dict(fields), result)
    return result, "new"

  monkeypatch.setattr(result_cache, "cached", cached)
  with runtime.single_threaded_blas():
    study.run()
  return stages


def unkeyed_reads(stages: Mapping[str, Stage]) -> dict[str, list[str]]:
  """{stage: the config fields it read that its fields do not key}. A field is keyed when
  the stage's fields hold it (or its leaves, for a section), when it reaches the stage
  through the data readers only (``config_schema.DATA``), whose examples' content hash the
  stage keys."""
  out = {}
  for name, stage in stages.items():
    missing = sorted(
        path for path in stage.reads
        if path not in stage.fields and not any(k.startswith(path + ".") for k in stage.fields)
        and config_schema.DATA not in config_schema.BY_PATH[path].study)
    if missing:
      out[name] = missing
  return out


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
  """(stages, run_keys): every stage of the study computed with its reads recorded, and
  ``run_keys(monkeypatch)``, the same stages keyed again (from the current schema) without
  computing them."""
  config = RecordingConfig(study_config())
  model = inputs.create_model(config)
  checkpoints = {f"reinit/{SCOPE}/seed_{s}": model.init(jax.random.key(s))
                 for s in config.reinit.seeds}
  batches = path_evaluation.evaluation_examples(config, config.dataset.name)
  evaluator = path_evaluation.PathEvaluator(model, batches, chunk_size=1, bits_per_byte=False)
  workdir = str(tmp_path_factory.mktemp("study_keys"))
  run = lambda monkeypatch, stored=None: run_scope(config, model, evaluator, checkpoints,
                                                   workdir, monkeypatch, stored)
  with pytest.MonkeyPatch.context() as monkeypatch:
    stages = run(monkeypatch)
  return stages, lambda monkeypatch: run(monkeypatch, stages)


@pytest.mark.slow
def test_every_field_a_stage_reads_is_keyed(recorded):
  stages, _ = recorded
  assert set(stages) == {*METHODS, "ablation_permutations", "ablation_distance_frobenius",
                         "ablation_distance_cosine", "robustness"}
  # The recording sees what each stage reads (through the readers of inputs.py too).
  assert {"study.learn_steps", "dataset.train_split", "train.batch_size",
          "train.eval_batch_size", "study.learn_factors"} <= stages["learned"].reads
  assert {"seed", "study.noise_levels", "study.methods"} <= stages["robustness"].reads
  assert stages["perm"].reads == {"study.distance", "study.num_lambdas", "study.match_residual"}
  # study.learn_repair: the learned objective REPAIRs with study.repair_no_bias's rule
  assert "study.repair_no_bias" in stages["learned"].reads
  assert stages["learned"].result["matching"]["learned"]["repair"]["no_bias"] == "second_moment"
  assert unkeyed_reads(stages) == {}


EVERY_PATH_STAGE = {*METHODS, "ablation_permutations", "ablation_distance_frobenius",
                    "ablation_distance_cosine"}  # the robustness check evaluates no path


@pytest.mark.slow
@pytest.mark.parametrize("path, reader, stages_that_miss_it", [
    ("dataset.validation_split", config_schema.LOSS, {"learned", "robustness"}),
    ("study.noise_levels", config_schema.ROBUSTNESS, {"robustness"}),
    ("study.num_lambdas", config_schema.EVERY_STAGE, EVERY_PATH_STAGE),
])
def test_a_field_read_but_not_keyed_fails(recorded, monkeypatch, path, reader,
                                          stages_that_miss_it):
  """A schema whose field forgets a stage that reads it: the stages are keyed without it, and
  the check names the field in each of them."""
  _, run_keys = recorded
  forgotten = tuple(
      dataclasses.replace(f, study=tuple(r for r in f.study if r != reader))
      if f.path == path else f for f in config_schema.FIELDS)
  monkeypatch.setattr(config_schema, "FIELDS", forgotten)
  assert unkeyed_reads(run_keys(monkeypatch)) == {stage: [path] for stage in stages_that_miss_it}


def test_each_role_agrees_with_the_study_stages():
  """The schema checks itself when imported; a study field that names no stage, or a field
  that keys nothing but names one, is refused."""
  config_schema.check_roles(config_schema.FIELDS)
  broken = (dataclasses.replace(config_schema.BY_PATH["study.noise_levels"], study=()),
            dataclasses.replace(config_schema.BY_PATH["study.lambda_chunk"],
                                study=(config_schema.ROBUSTNESS,)))
  with pytest.raises(ValueError, match=r"\['study.noise_levels', 'study.lambda_chunk'\]"):
    config_schema.check_roles(broken)


def test_each_matching_option_has_one_field_named_by_its_align_model_argument():
  """``matching_kwargs`` and the method stages' keys read the fields that ``option`` names:
  one for each option a method may read, each an argument of ``align_model``."""
  fields = config_schema.option_fields()
  assert sorted(fields) == sorted(matching.ALIGN_OPTIONS)
  assert len(set(fields.values())) == len(fields)
  assert set(fields) <= set(inspect.signature(matching.align_model).parameters)
  config = study_config()
  for method in METHODS:
    kwargs = scope_study.matching_kwargs(config, method)
    assert set(kwargs) == set(matching.METHODS[method].options)
    assert scope_study.method_keys(method)[:len(kwargs)] == tuple(fields[o] for o in kwargs)
  assert scope_study.matching_kwargs(config, "learned")["factors"] == ("attention", "heads")
  assert scope_study.matching_kwargs(config, "full", distance="cosine")["distance"] == "cosine"


def test_a_field_names_known_study_stages_only():
  with pytest.raises(ValueError, match="study names"):
    dataclasses.replace(config_schema.BY_PATH["study.num_lambdas"], study=("no such stage",))
  with pytest.raises(ValueError, match="no study reader"):
    config_schema.study_keyed("no such stage")



def _small_study(tmp_path, monkeypatch, **study_fields) -> dict:
  """The stages ``run_scope`` records for ``study_config`` with ``study_fields`` set, without the
  ablation, the Stage 1 distances and the noise check, on untrained endpoints."""
  config = study_config()
  config.study.permutation_ablation = False
  config.study.distances = ()
  config.study.noise_levels = ()
  for name, value in study_fields.items():
    config.study[name] = value
  config = RecordingConfig(config)
  model = inputs.create_model(config)
  checkpoints = {f"reinit/{SCOPE}/seed_{s}": model.init(jax.random.key(s))
                 for s in config.reinit.seeds}
  batches = path_evaluation.evaluation_examples(config, config.dataset.name)
  evaluator = path_evaluation.PathEvaluator(model, batches, chunk_size=1, bits_per_byte=False)
  return run_scope(config, model, evaluator, checkpoints, str(tmp_path), monkeypatch)

def test_the_activation_and_repair_stages_key_every_field_they_read(tmp_path, monkeypatch):
  """The "activation" method reads training batches; with ``study.repair`` each method has a
  second stage, its REPAIRed path, which reads them too besides the method's own fields; each
  is keyed."""
  stages = _small_study(tmp_path, monkeypatch, methods=("naive", "full", "activation"),
                        repair=True, activation_batches=2)
  assert set(stages) == {"naive", "full", "activation", "naive+repair", "full+repair",
                         "activation+repair"}
  assert {"study.activation_batches", "dataset.train_split", "train.batch_size"} <= (
      stages["activation"].reads)
  assert {"study.activation_batches", "dataset.train_split", "train.batch_size"} <= (
      stages["full+repair"].reads)
  assert "dataset.augment" not in stages["full+repair"].reads  # REPAIR reads no augmentation
  assert unkeyed_reads(stages) == {}
  repaired, plain = stages["full+repair"].result, stages["full"].result
  # the endpoints are the seeds' own models; the interior point is the repaired one
  assert repaired["loss"][0] == plain["loss"][0] and repaired["loss"][-1] == plain["loss"][-1]
  assert repaired["loss"][1] != plain["loss"][1]
  assert set(repaired["repair"]["points"]) <= {f"layers_{i}/{p}" for i in range(8)
                                                for p in ("attention", "mlp")}
  (counts,) = repaired["repair"]["per_lambda"]
  assert counts["corrected"] + counts["degenerate"] == counts["channels"] > 0
  assert repaired["repair"]["no_bias"] == "second_moment"
  assert set(counts["gaps"]) == set(repaired["repair"]["points"])
  assert all(set(g) == {"mean_gap", "scale_gap"} for g in counts["gaps"].values())


def test_the_circuit_path_stages_key_the_methods_fields(tmp_path, monkeypatch):
  """With ``study.circuit_path`` each method has a second stage, its aligned pair on the circuit
  path, keyed by the method's fields and reading no other; its ends are the method's, and
  "perm" and "ortho", whose elements differ in the GL(H) matrices alone on the first
  attention layer, give the same circuit path (circuit space quotients them out)."""
  stages = _small_study(tmp_path, monkeypatch, methods=("naive", "perm", "ortho"),
                        circuit_path=True)
  assert set(stages) == {"naive", "perm", "ortho", "naive+circuit", "perm+circuit",
                         "ortho+circuit"}
  assert stages["perm+circuit"].reads == stages["perm"].reads
  assert unkeyed_reads(stages) == {}
  circuit, plain = stages["ortho+circuit"].result, stages["ortho"].result
  assert circuit["loss"][0] == plain["loss"][0] and circuit["loss"][-1] == plain["loss"][-1]
  assert circuit["loss"][1] != plain["loss"][1]
  assert circuit["loss"][1] == pytest.approx(stages["perm+circuit"].result["loss"][1], rel=1e-5)
  assert plain["loss"][1] != pytest.approx(stages["perm"].result["loss"][1], rel=1e-3)
