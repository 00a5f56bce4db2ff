"""``validate(config)``: the whole setting config checked before any work.

Every field has one rule, its entry's in ``experiments/setting/config_schema.py``
(``RULES``: type and range, or the options it is drawn from); then the rules
that relate fields (warmup shorter than training, a transfer data set of the
base set's kind, ...) run. The first field that cannot work raises ValueError
with one line naming it::

    config.train.learning_rate must be > 0, got -1.0

Each list of options is read from its owner when ``validate`` runs: methods
from ``attn_symmetry.matching.METHODS``, distances from
``attn_symmetry.matching.DISTANCES``, scopes from ``experiments.train.reinit.scopes()``,
model families and presets from ``attn_symmetry.models``, data sets and their
kinds from ``attn_symmetry.data``.

A config is validated once per run: ``validate`` remembers the last config it
passed, with its content, and ``validated`` tells a stage that it need not check
that config again (``main.py`` validates before the first stage; each stage
validates a config that it is given unchecked, or changed since).

``study.num_lambdas`` must be at least 3: the barrier of a path is its largest
gap to the chord joining its endpoints, so with the two endpoints alone every
barrier is 0 whatever the models.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import ml_collections

from attn_symmetry import data
from attn_symmetry import models
from experiments.setting import config_schema

# The last config that ``validate`` passed: (its id, its content then).
_last_valid: tuple[int, str] | None = None

# field path -> its check, from the schema. Ranges that depend on another field are in
# _check_relations.
RULES: dict[str, config_schema.Rule] = {f.path: f.rule for f in config_schema.FIELDS}
_fail = config_schema.fail


def field_paths(config: ml_collections.ConfigDict, prefix: str = "") -> Iterator[str]:
  """The dotted paths of ``config``'s fields, down to those that ``RULES`` checks whole."""
  for key, value in config.items():
    path = prefix + key
    if isinstance(value, ml_collections.ConfigDict) and path not in RULES:
      yield from field_paths(value, path + ".")
    else:
      yield path


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
  subset = tuple(config.study.permutation_ablation_seeds)
  if subset and (len(subset) < 2 or not set(subset) <= set(seeds)):
    _fail("study.permutation_ablation_seeds", f"must be at least 2 of reinit.seeds {seeds} "
          f"(the ablation's pairs), got {subset}")
  if "naive" not in config.study.methods:
    _fail("study.methods", "must include 'naive' (the baseline of every comparison), "
          f"got {tuple(config.study.methods)}")
  _check_heads_divide_width(config)
  _check_rule_can_stop(config)
  if config.study.circuit_path and _model_size(config, "pos_encoding") in ("rope", "rope2d"):
    _fail("study.circuit_path", "is not defined for a RoPE model (model pos_encoding "
          f"{_model_size(config, 'pos_encoding')!r}): the widened heads of the circuit path "
          "would rotate with the frequencies of a head twice as wide "
          "(attn_symmetry.circuit_path)")
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
  if config.study.learn_lam_band and config.study.learn_uniform_lambda:
    _fail("study.learn_lam_band", f"draws lambda from a band around 1/2, which "
          f"study.learn_uniform_lambda (lambda from U(0, 1)) replaces: set one, got "
          f"{config.study.learn_lam_band} and True")
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


def _model_size(config: ml_collections.ConfigDict, name: str) -> Any:
  """The model config's ``name`` ("width", "num_heads") as ``models.make_config`` sets it:
  the override, else the family's preset, else the preset, else the family's default."""
  if name in config.model.overrides:
    return config.model.overrides[name]
  family, preset = models.get_family(config.model.family), config.model.preset
  values = {**family.defaults, **models.PRESETS[preset], **family.presets.get(preset, {})}
  return values.get(name)


def _check_heads_divide_width(config: ml_collections.ConfigDict) -> None:
  """Each head reads width / num_heads of the residual stream, unless ``head_width`` sets its
  width: a width that the head count does not divide has no head dimension. Names the
  overridden field (the width when both are)."""
  width, heads = _model_size(config, "width"), _model_size(config, "num_heads")
  if _model_size(config, "head_width") is not None:
    return
  if isinstance(width, int) and isinstance(heads, int) and heads > 0 and width % heads:
    field = "width" if "width" in config.model.overrides else "num_heads"
    _fail(f"model.overrides.{field}", f"gives a width of {width}, which {heads} heads do not "
          "divide (each head reads width / num_heads dimensions)")


def _check_rule_can_stop(config: ml_collections.ConfigDict) -> None:
  """A stopping rule that can never stop a run before its budget is refused.

  The first validation, at ``validate_every`` steps, sets the best loss; the run stops at the
  ``patience``-th validation after it without improvement, so the earliest stop is at step
  (patience + 1) * validate_every. That has to fall within the budget of every run the rule
  governs: ``reinit.num_steps`` for a fine-tuned scope, ``train.num_steps`` for the "full"
  scope and for the base model under ``reinit.stop_base``."""
  r = config.reinit
  if not r.patience:
    return
  first_stop = (r.patience + 1) * r.validate_every
  budgets = {}
  if any(scope != "full" for scope in r.scopes):
    budgets["reinit.num_steps"] = r.num_steps
  if "full" in r.scopes or r.stop_base:
    budgets["train.num_steps"] = config.train.num_steps
  for field, budget in budgets.items():
    if first_stop > budget:
      _fail("reinit.patience", f"{r.patience} can never stop a run: its earliest stop, "
            f"(patience + 1) x reinit.validate_every = {first_stop} steps, is past the "
            f"{budget}-step budget {field}")


def validate(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the first field of ``config`` that cannot work; runs nothing.

  Args:
    config: a setting config, with the fields of ``experiments/setting/config_schema.py``.

  Raises:
    ValueError: one line, "config.<field> ...": a missing or unknown field, a
      value of the wrong type or out of range, an option that its owner does
      not list, an entry listed twice, or fields that contradict each other.
  """
  present = list(field_paths(config))
  for field in RULES:
    if field not in present:
      _fail(field, "is missing (every field of experiments/setting/config_schema.py is needed)")
  for field in present:
    if field not in RULES:
      _fail(field, "is not a field of the setting config (experiments/setting/config_schema.py); "
            "a typo?")
  for field, rule in RULES.items():
    rule(field, config_schema.value(config, field))
  _check_relations(config)
  global _last_valid
  _last_valid = (id(config), _content(config))


def validated(config: ml_collections.ConfigDict) -> bool:
  """Whether ``config`` is the last config that ``validate`` passed in this process, unchanged
  since: a stage given it (``main.py`` validates before the first) does not validate it again."""
  return _last_valid == (id(config), _content(config))


def _content(config: ml_collections.ConfigDict) -> str:
  """Every field's value, as JSON (a config that changed gives another string)."""
  return config.to_json_best_effort(sort_keys=True)
