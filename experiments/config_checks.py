"""``validate(config)``: the whole setting config checked before any work.

Every field of ``experiments/configs/default.py`` has one rule in ``RULES``
(type and range, or the options it is drawn from); then the rules that relate
fields (warmup shorter than training, a transfer data set of the base set's
kind, ...) run. The first field that cannot work raises ValueError with one line
naming it::

    config.train.learning_rate must be > 0, got -1.0

Each list of options is read from its owner when ``validate`` runs: methods
from ``attn_symmetry.matching.METHODS``, distances from
``attn_symmetry.matching.DISTANCES``, scopes from ``attn_symmetry.models.SCOPES``,
model families and presets from ``attn_symmetry.models``, data sets and their
kinds from ``attn_symmetry.data``.

``study.num_lambdas`` must be at least 3: the barrier of a path is its largest
gap to the chord joining its endpoints, so with the two endpoints alone every
barrier is 0 whatever the models.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NoReturn

import jax
import ml_collections

from attn_symmetry import data
from attn_symmetry import matching
from attn_symmetry import models

Rule = Callable[[str, Any], None]  # (field path, value); raises ValueError if the value is bad


def _fail(field: str, problem: str) -> NoReturn:
  raise ValueError(f"config.{field} {problem}")


def _integer(minimum: int) -> Rule:
  """An int >= ``minimum``."""
  def check(field, value):
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
      _fail(field, f"must be an integer, got {value!r}")
    if value < minimum:
      _fail(field, f"must be >= {minimum}, got {value!r}")
  return check


def _real(requirement: str, holds: Callable[[float], bool]) -> Rule:
  """A finite number for which ``holds`` is true (``requirement`` says so in words)."""
  def check(field, value):
    if (not isinstance(value, numbers.Real) or isinstance(value, bool)
        or not math.isfinite(value)):
      _fail(field, f"must be a finite number, got {value!r}")
    if not holds(value):
      _fail(field, f"must be {requirement}, got {value!r}")
  return check


def _boolean(field: str, value: Any) -> None:
  if not isinstance(value, bool):
    _fail(field, f"must be True or False, got {value!r}")


def _one_of(noun: str, options: Callable[[], Iterable[str]]) -> Rule:
  """One of ``options()``, read from the list's owner when the check runs."""
  def check(field, value):
    allowed = tuple(options())
    if value not in allowed:
      _fail(field, f"is an unknown {noun} {value!r}; choose from {allowed}")
  return check


def _distinct(element: Rule) -> Rule:
  """A tuple (or list) of distinct entries, each passing ``element``."""
  def check(field, values):
    if not isinstance(values, (tuple, list)):
      _fail(field, f"must be a tuple, got {values!r}")
    for i, value in enumerate(values):
      try:
        element(f"{field}[{i}]", value)
      except ValueError as e:
        if isinstance(value, str) and "," in value:  # `--config.f=a,b` gives ("a,b",)
          raise ValueError(f"{e}; on the command line write a tuple as "
                           f"--config.{field}=\"('a', 'b')\"") from None
        raise
      if value in values[:i]:
        _fail(field, f"lists {value!r} twice; its entries must be distinct, got {tuple(values)}")
  return check


def _data_dir(field: str, value: Any) -> None:
  if not isinstance(value, str):
    _fail(field, f"must be a path (a string), got {value!r}")
  if value and not os.path.isdir(value):
    _fail(field, f"{value!r} is not a directory (\"\" takes the default data dir)")


def _model_overrides(field: str, value: Any) -> None:
  """A mapping from fields of ``attn_symmetry.models.Config`` to values.

  Their values are checked with the data set's input and output sizes when
  the model is built (``attn_symmetry.models.make_config``).
  """
  if not isinstance(value, (ml_collections.ConfigDict, Mapping)):
    _fail(field, f"must be a mapping of model config fields, got {value!r}")
  known = sorted(f.name for f in dataclasses.fields(models.Config) if f.name != "family")
  for key in value:
    if key not in known:
      _fail(f"{field}.{key}", "is not a field of attn_symmetry.models.Config that a setting "
            f"overrides; choose from {known}")


def _split(optional: bool = False, evaluation: bool = False) -> Rule:
  """A split of the data set ("train") or one slice of it ("train[:90%]"); "" too if
  ``optional``. Not the test split (kept for the reported evaluations, so that no training
  decision reads it), unless ``evaluation``: a split that is only evaluated
  (``study.eval_split``) may be any. Whether the data set has it is checked when it is
  opened (``train.check_data``)."""
  def check(field, value):
    if not isinstance(value, str):
      _fail(field, f"must be a split name (a string), got {value!r}")
    if optional and not value:
      return
    if not re.fullmatch(r"[A-Za-z][\w-]*(\[[^\[\]]*\])?", value):
      _fail(field, "must be a split such as 'train' or one slice of it such as 'train[:90%]', "
            f"got {value!r}")
    if not evaluation and value.split("[", 1)[0] == "test":
      _fail(field, f"reads the test split ({value!r}), which is kept for the reported "
            "evaluations: no training decision may read it; hold out a slice of the training "
            "split instead, such as 'train[90%:]'")
  return check


_AT_LEAST_0 = _integer(0)
_AT_LEAST_1 = _integer(1)
_POSITIVE = _real("> 0", lambda v: v > 0)
_NON_NEGATIVE = _real(">= 0", lambda v: v >= 0)
_BETA = _real("in [0, 1)", lambda v: 0 <= v < 1)

# One rule per field of experiments/configs/default.py (tests/test_config_checks.py holds
# the two in step). Ranges that depend on another field are in _check_relations.
RULES: dict[str, Rule] = {
    "seed": _AT_LEAST_0,
    "model.family": _one_of("model family", lambda: models.FAMILIES),
    "model.preset": _one_of("model preset", lambda: models.PRESETS),
    "model.overrides": _model_overrides,
    "dataset.name": _one_of("data set", lambda: data.DATASETS),
    "dataset.data_dir": _data_dir,
    "dataset.seq_len": _AT_LEAST_0,  # 0: the reader's default
    "dataset.image_size": _AT_LEAST_0,  # 0: the reader's default
    "dataset.augment": _boolean,
    "dataset.num_workers": _AT_LEAST_0,
    "dataset.train_split": _split(),
    "dataset.validation_split": _split(optional=True),  # "": none
    "dataset.validation_examples": _AT_LEAST_0,  # 0: the whole of dataset.validation_split
    "train.num_steps": _AT_LEAST_1,
    "train.batch_size": _AT_LEAST_1,
    "train.eval_batch_size": _AT_LEAST_1,
    "train.learning_rate": _POSITIVE,
    "train.warmup_steps": _AT_LEAST_0,
    "train.final_lr_fraction": _real("in [0, 1]", lambda v: 0 <= v <= 1),
    "train.weight_decay": _NON_NEGATIVE,
    "train.b1": _BETA,
    "train.b2": _BETA,
    "train.grad_clip_norm": _POSITIVE,
    "train.log_every": _AT_LEAST_1,
    "train.eval_every": _AT_LEAST_1,
    "train.checkpoint_every": _AT_LEAST_1,
    "train.keep_checkpoints": _AT_LEAST_1,
    "reinit.scopes": _distinct(_one_of("scope", lambda: models.SCOPES)),
    "reinit.seeds": _distinct(_AT_LEAST_0),
    "reinit.num_steps": _AT_LEAST_1,
    "reinit.learning_rate": _POSITIVE,
    "reinit.warmup_steps": _AT_LEAST_0,
    "reinit.dataset": _one_of("data set", lambda: ("", *data.DATASETS)),
    "reinit.patience": _AT_LEAST_0,  # 0: no stopping rule
    "reinit.min_delta": _real("in [0, 1)", lambda v: 0 <= v < 1),
    "reinit.validate_every": _AT_LEAST_1,
    "study.methods": _distinct(_one_of("method", lambda: matching.METHODS)),
    "study.num_lambdas": _integer(3),  # the endpoints and at least one point between them
    "study.lambda_chunk": _AT_LEAST_1,
    "study.match_steps": _AT_LEAST_0,  # 0: Stage 1 only
    "study.match_learning_rate": _POSITIVE,
    "study.match_init": _one_of("Stage 2 start", lambda: matching.INITS),
    "study.match_refine": _one_of("refinement schedule", lambda: matching.REFINES),
    "study.match_solver": _one_of("refinement solver", lambda: matching.SOLVERS),
    "study.learn_steps": _AT_LEAST_0,
    "study.learn_learning_rate": _POSITIVE,
    "study.learn_uniform_lambda": _boolean,
    "study.learn_holdout_batches": _AT_LEAST_1,
    "study.eval_examples": _AT_LEAST_0,  # 0: the whole of study.eval_split
    "study.eval_split": _split(evaluation=True),
    "study.distance": _one_of("distance", lambda: matching.DISTANCES),
    "study.distances": _distinct(_one_of("distance", lambda: matching.DISTANCES)),
    "study.permutation_ablation": _boolean,
    "study.max_exhaustive_heads": _AT_LEAST_1,
    "study.noise_levels": _distinct(_NON_NEGATIVE),  # at most 1 on text: _check_relations
}


def field_paths(config: ml_collections.ConfigDict, prefix: str = "") -> Iterator[str]:
  """The dotted paths of ``config``'s fields, down to those that ``RULES`` checks whole."""
  for key, value in config.items():
    path = prefix + key
    if isinstance(value, ml_collections.ConfigDict) and path not in RULES:
      yield from field_paths(value, path + ".")
    else:
      yield path


def _value(config: ml_collections.ConfigDict, path: str) -> Any:
  for key in path.split("."):
    config = config[key]
  return config


def _check_relations(config: ml_collections.ConfigDict) -> None:
  """The rules that relate fields; each field alone is already valid."""
  for stage in ("train", "reinit"):
    c = config[stage]
    if c.warmup_steps >= c.num_steps:
      _fail(f"{stage}.warmup_steps", f"must be < {stage}.num_steps = {c.num_steps}, "
            f"got {c.warmup_steps}")
  devices = jax.device_count()
  for field in ("batch_size", "eval_batch_size"):
    if config.train[field] % devices:
      _fail(f"train.{field}", f"must be a multiple of the {devices} devices, "
            f"got {config.train[field]}")
  seeds = tuple(config.reinit.seeds)
  if config.reinit.scopes and len(seeds) < 2:
    _fail("reinit.seeds", "needs at least 2 seeds when reinit.scopes is set (the study "
          f"compares pairs of seeds), got {seeds}")
  if "naive" not in config.study.methods:
    _fail("study.methods", "must include 'naive' (the baseline of every comparison), "
          f"got {tuple(config.study.methods)}")
  d = config.dataset
  if config.reinit.patience and not d.validation_split:
    _fail("dataset.validation_split", "must name a held-out split when reinit.patience > 0 "
          f"(the stopping rule reads its loss), such as 'train[90%:]', got {d.validation_split!r}")
  if d.validation_split == d.train_split:
    _fail("dataset.validation_split", f"must differ from dataset.train_split, got "
          f"{d.validation_split!r} for both")
  if "learned" in config.study.methods and not d.validation_split:
    _fail("study.methods", "includes 'learned', which chooses its best iterate on held-out "
          "training data: set dataset.validation_split (e.g. 'train[90%:]')")
  kind = data.dataset_kind(d.name)
  if kind == "image" and d.seq_len:
    _fail("dataset.seq_len", f"applies to text data sets; {d.name!r} holds images, "
          f"got {d.seq_len}")
  if kind != "image" and (d.image_size or d.augment):
    _fail("dataset.image_size" if d.image_size else "dataset.augment",
          f"applies to image data sets; {d.name!r} holds text")
  transfer = config.reinit.dataset
  if transfer and data.dataset_kind(transfer) != kind:
    _fail("reinit.dataset", f"{transfer!r} does not fit the model of {d.name!r}: it holds "
          f"{data.dataset_kind(transfer)!r} data, the base data set {kind!r} data")
  if kind != "image":  # noise on text replaces this fraction of the tokens
    for i, level in enumerate(config.study.noise_levels):
      if level > 1:
        _fail(f"study.noise_levels[{i}]", "is a token replacement rate on text and must be in "
              f"[0, 1], got {level!r}")


def validate(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the first field of ``config`` that cannot work; runs nothing.

  Args:
    config: a setting config, with the fields of ``experiments/configs/default.py``.

  Raises:
    ValueError: one line, "config.<field> ...": a missing or unknown field, a
      value of the wrong type or out of range, an option that its owner does
      not list, an entry listed twice, or fields that contradict each other.
  """
  present = list(field_paths(config))
  for field in RULES:
    if field not in present:
      _fail(field, "is missing (every field of experiments/configs/default.py is needed)")
  for field in present:
    if field not in RULES:
      _fail(field, "is not a field of the setting config (experiments/configs/default.py); "
            "a typo?")
  for field, rule in RULES.items():
    rule(field, _value(config, field))
  _check_relations(config)
