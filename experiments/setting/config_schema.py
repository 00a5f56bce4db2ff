"""The setting config's schema: each field defined once, in ``FIELDS``.

An entry holds the field's dotted path, its ``default``, its ``rule`` (type and
range, or the options it is drawn from), what it ``keys`` (``Role``: which
stage fingerprints it enters), a one-line ``doc`` and, for the study, which of
its stages read it (``study``, from ``STUDY_READERS``) or the ``align_model``
argument it sets (``option``). The rest derives from it:

* ``experiments/configs/default.py``'s ``get_config()`` is ``default_config()``;
  a setting file changes values of these fields and creates none
  (``tests/test_configs.py`` checks every setting and variant);
* ``experiments/setting/config_checks.py``'s ``RULES`` (the checks that relate fields,
  such as warmup shorter than training, are ``config_checks._check_relations``);
* ``experiments/setting/fingerprints.py``'s field groups ``TRAINING``, ``TRAIN_SCHEDULE``,
  ``REINIT_SCHEDULE``, ``STOPPING``, ``STUDY``, ``PER_RUN``, ``NOT_KEYED`` and
  ``UNKEYED_DEFAULTS`` (``keyed_by`` and ``unkeyed_defaults``);
* ``experiments/study/scope_study.py``'s stage keys (``study_keyed``) and its
  ``matching_kwargs``, the config fields of ``align_model``'s options
  (``option_fields``).

The fields of the matching options (``study.match_*``, ``study.distance``,
``study.learn_factors``) are in turn generated from ``attn_symmetry.matching.MatchOptions``
(``match_fields``): a new matching option that a method names gets its study field there.

Adding a field is one entry here and the code that reads it. Every field, its
default, its check and what it keys::

    python -m experiments.setting.config_schema

Lists of options are read from their owners when a check runs (methods from
``attn_symmetry.matching.METHODS``, scopes from ``experiments.train.reinit.scopes()``,
data sets from ``attn_symmetry.data.DATASETS``, ...), so this module imports
no model or data code (only the pure core's ``matching``, for its table of options) and a
method or scope that its owner adds is accepted.
It lives beside ``config_checks`` rather than in ``experiments/configs/``, whose
every module is a setting (``--config=FILE``, and the tests run each one).
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import math
import numbers
import os
import re
import textwrap
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

import ml_collections

from attn_symmetry import matching


def fail(field: str, problem: str) -> NoReturn:
  """Raises ValueError("config.<field> <problem>")."""
  raise ValueError(f"config.{field} {problem}")


@dataclasses.dataclass(frozen=True)
class Rule:
  """The check of one field: ``rule(field, value)`` raises ValueError naming ``config.<field>``.

  Attributes:
    says: what it accepts, in words ("an integer >= 1").
    check: (field path, value) -> None; raises ValueError (``fail``) if the value is bad.
    bad: a value it rejects (the tests set it on every field of the table).
  """
  says: str
  check: Callable[[str, Any], None]
  bad: Any

  def __call__(self, field: str, value: Any) -> None:
    self.check(field, value)


def _integer(minimum: int) -> Rule:
  def check(field, value):
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
      fail(field, f"must be an integer, got {value!r}")
    if value < minimum:
      fail(field, f"must be >= {minimum}, got {value!r}")
  return Rule(f"an integer >= {minimum}", check, bad=minimum - 1)


def _real(requirement: str, holds: Callable[[float], bool]) -> Rule:
  """A finite number for which ``holds`` is true (``requirement`` says so in words)."""
  def check(field, value):
    if (not isinstance(value, numbers.Real) or isinstance(value, bool)
        or not math.isfinite(value)):
      fail(field, f"must be a finite number, got {value!r}")
    if not holds(value):
      fail(field, f"must be {requirement}, got {value!r}")
  return Rule(f"a finite number {requirement}", check, bad=float("nan"))


def _check_boolean(field: str, value: Any) -> None:
  if not isinstance(value, bool):
    fail(field, f"must be True or False, got {value!r}")


def _owned(owner: str) -> tuple[str, ...]:
  """The option list ``owner`` ("attn_symmetry.matching.METHODS"), read now from its module
  (called first if it is a function, such as "experiments.train.reinit.scopes")."""
  module, name = owner.rsplit(".", 1)
  options = getattr(importlib.import_module(module), name)
  return tuple(options() if callable(options) else options)


def _one_of(noun: str, owner: str, *, or_empty: bool = False) -> Rule:
  """One of the options that ``owner`` lists ("" too if ``or_empty``), read when the check runs."""
  def check(field, value):
    allowed = ("",) * or_empty + _owned(owner)
    if value not in allowed:
      fail(field, f"is an unknown {noun} {value!r}; choose from {allowed}")
  says = f"a {noun}: " + ('"" or ' if or_empty else "") + f"one of {owner}"
  return Rule(says, check, bad=f"no such {noun}")


def _distinct(element: Rule) -> Rule:
  """A tuple (or list) of distinct entries, each passing ``element``."""
  def check(field, values):
    if not isinstance(values, (tuple, list)):
      fail(field, f"must be a tuple, got {values!r}")
    for i, value in enumerate(values):
      try:
        element(f"{field}[{i}]", value)
      except ValueError as e:
        if isinstance(value, str) and "," in value:  # `--config.f=a,b` gives ("a,b",)
          raise ValueError(f"{e}; on the command line write a tuple as "
                           f"--config.{field}=\"('a', 'b')\"") from None
        raise
      if value in values[:i]:
        fail(field, f"lists {value!r} twice; its entries must be distinct, got {tuple(values)}")
  return Rule(f"a tuple of distinct entries, each {element.says}", check, bad=(element.bad,))


def _check_data_dir(field: str, value: Any) -> None:
  if not isinstance(value, str):
    fail(field, f"must be a path (a string), got {value!r}")
  if value and not os.path.isdir(value):
    fail(field, f"{value!r} is not a directory (\"\" takes the default data dir)")


def _check_model_overrides(field: str, value: Any) -> None:
  """A mapping from fields of ``attn_symmetry.models.Config`` to values; their values are
  checked with the data set's input and output sizes when the model is built
  (``attn_symmetry.models.make_config``)."""
  if not isinstance(value, (ml_collections.ConfigDict, Mapping)):
    fail(field, f"must be a mapping of model config fields, got {value!r}")
  model_config = importlib.import_module("attn_symmetry.models").Config
  known = sorted(f.name for f in dataclasses.fields(model_config) if f.name != "family")
  for key in value:
    if key not in known:
      fail(f"{field}.{key}", "is not a field of attn_symmetry.models.Config that a setting "
           f"overrides; choose from {known}")


_SLICE = re.compile(r"\[(?P<start>-?\d*)(?P<start_pct>%?):(?P<stop>-?\d*)(?P<stop_pct>%?)\]")


def split_fraction(split: str) -> float | None:
  """The fraction of its split that ``split`` reads: "train" 1.0, "train[:25%]" 0.25,
  "train[90%:]" and "train[-10%:]" 0.1; None for a slice in records ("train[:5000]"), whose
  fraction depends on the split's size, or a slice of another form. ValueError for a percent
  bound outside [-100, 100]."""
  if "[" not in split:
    return 1.0
  m = _SLICE.fullmatch(split[split.index("["):])
  if not m or (m["start"] and not m["start_pct"]) or (m["stop"] and not m["stop_pct"]):
    return None
  for text in (m["start"], m["stop"]):
    if text and not -100 <= int(text) <= 100:
      raise ValueError(f"its percent bound {text}% is outside [-100, 100]")
  bound = lambda text, default: (default if not text else
                                 int(text) + 100 if int(text) < 0 else int(text))
  return (bound(m["stop"], 100) - bound(m["start"], 0)) / 100


def _split(optional: bool = False, evaluation: bool = False) -> Rule:
  """A split of the data set ("train") or one slice of it ("train[:90%]") that reads a
  fraction of it in (0, 1] (``split_fraction``); "" too if
  ``optional``. Not the test split (kept for the reported evaluations, so that no training
  decision reads it), unless ``evaluation``: a split that is only evaluated
  (``study.eval_split``) may be any. Whether the data set has it is checked when it is
  opened (``data_checks.check_data``)."""
  def check(field, value):
    if not isinstance(value, str):
      fail(field, f"must be a split name (a string), got {value!r}")
    if optional and not value:
      return
    if not re.fullmatch(r"[A-Za-z][\w-]*(\[[^\[\]]*\])?", value):
      fail(field, "must be a split such as 'train' or one slice of it such as 'train[:90%]', "
           f"got {value!r}")
    try:
      fraction = split_fraction(value)
    except ValueError as e:
      fail(field, f"reads a data fraction outside (0, 1]: {e}, got {value!r}")
    if fraction is not None and not 0 < fraction <= 1:
      fail(field, f"reads a data fraction of {fraction:g} of its split; it must be in (0, 1] "
           f"(percent bounds with start before stop), got {value!r}")
    if not evaluation and value.split("[", 1)[0] == "test":
      fail(field, f"reads the test split ({value!r}), which is kept for the reported "
           "evaluations: no training decision may read it; hold out a slice of the training "
           "split instead, such as 'train[90%:]'")
  says = "a split or one slice of it ('train[:90%]')"
  says += ", the test split included" if evaluation else ", not the test split"
  return Rule(says + (', or ""' if optional else ""), check, bad="train[:90%")


_AT_LEAST_0 = _integer(0)
_AT_LEAST_1 = _integer(1)
_POSITIVE = _real("> 0", lambda v: v > 0)
_NON_NEGATIVE = _real(">= 0", lambda v: v >= 0)
_FRACTION = _real("in [0, 1)", lambda v: 0 <= v < 1)
_BOOLEAN = Rule("True or False", _check_boolean, bad="yes")
_DATA_DIR = Rule('a directory ("" for the default)', _check_data_dir, bad="/no/such/dir")
_MODEL_OVERRIDES = Rule("a mapping of attn_symmetry.models.Config fields to values",
                        _check_model_overrides, bad={"no_such_field": 1})
_DATASET = _one_of("data set", "attn_symmetry.data.DATASETS")


def option_rule(range_: matching.AtLeast | matching.Positive | matching.OneOf | matching.SomeOf
                | matching.Flag) -> Rule:
  """The rule of a matching option's range (``matching.OPTIONS``)."""
  if isinstance(range_, matching.AtLeast):
    return _integer(range_.minimum)
  if isinstance(range_, matching.Positive):
    return _POSITIVE
  if isinstance(range_, matching.OneOf):
    return _one_of(range_.noun, range_.owner)
  if isinstance(range_, matching.SomeOf):
    return _distinct(_one_of(range_.noun, range_.owner))
  if isinstance(range_, matching.Flag):
    return _BOOLEAN
  raise TypeError(f"no rule for the range {range_!r}")


_OPTIONS = {o.name: o for o in matching.OPTIONS}
_DISTANCE = option_rule(_OPTIONS["distance"].range)


class Role(enum.Enum):
  """Which stage fingerprints a field enters (``experiments/setting/fingerprints.py``: how, why).

  A field of any role but ``NOT_KEYED`` may key study stages too: those that its ``study``
  or ``option`` names."""
  TRAINING = "every training run"
  TRAIN_SCHEDULE = "the base run and the 'full' scope's runs"
  REINIT_SCHEDULE = "the fine-tuned scopes' runs"
  STOPPING = "the runs under the stopping rule: the re-initialised runs, and the base run " \
             "with reinit.stop_base"
  STUDY = "the study stages that read it"
  PER_RUN = "each run or stage, by the value it uses"
  NOT_KEYED = "no stage"


# What a field's ``study`` may name: the study stages (``experiments/study/scope_study.py``) that
# read it, each of which keys it by its value; or ``DATA``, read through the data readers. The
# inputs of ``matching.INPUTS`` stand for the stages of every method that needs that input
# (``matching.Method.needs``): the study's provider reads these fields to supply it.
EVERY_STAGE = "every stage"
LOSS = matching.LOSS
ROBUSTNESS = "robustness"
REPAIR = matching.REPAIR
ACTIVATIONS = matching.ACTIVATIONS
DATA = "data"
STUDY_READERS = {
    EVERY_STAGE: "every study stage",
    LOSS: "the study stages of the methods that train on a loss (their paths and the "
          "robustness check)",
    ROBUSTNESS: "the study's robustness check",
    REPAIR: "the study stages of each method's path with REPAIR (study.repair), and those of "
            "the methods that REPAIR inside their objective ('learned' with learn_repair)",
    ACTIVATIONS: "the study stages of the methods that read activations",
    DATA: "the study through its data readers (keyed by the examples' content, not by value)",
}


class _Always:
  def __repr__(self):
    return "always"


ALWAYS = _Always()  # ``Field.unkeyed_default`` of a field that keys at every value


@dataclasses.dataclass(frozen=True)
class Field:
  """One field of the setting config.

  Attributes:
    path: dotted path, "train.learning_rate".
    default: its value in ``default_config()`` (a dict becomes a ConfigDict).
    rule: its check (``Rule``).
    keys: the stage fingerprints it enters (``Role``).
    doc: what it does, one line.
    unkeyed_default: a value at which it keys nothing (a field added after results were
      stored, at the value it stands for there: those results stay valid), or ``ALWAYS``.
    study: the study stages that read it (``STUDY_READERS``); each keys it by its value,
      except ``DATA``.
    option: the argument of ``attn_symmetry.matching.align_model`` that it sets: every stage
      of a method that reads that option (``matching.METHODS[method].options``) keys it.
  """
  path: str
  default: Any
  rule: Rule
  keys: Role
  doc: str
  unkeyed_default: Any = ALWAYS
  study: tuple[str, ...] = ()
  option: str | None = None

  def __post_init__(self):
    """Raises ValueError for a ``study`` entry outside ``STUDY_READERS``."""
    unknown = [s for s in self.study if s not in STUDY_READERS]
    if unknown:
      raise ValueError(f"{self.path}: study names {unknown}; choose from {list(STUDY_READERS)}")

  @property
  def keys_study(self) -> bool:
    """Whether some study stage keys it by value: a stage that its ``study`` names (but
    ``DATA``), or a method stage that reads its ``option``."""
    return bool(self.option) or any(reader != DATA for reader in self.study)


# What each section of the config holds, beyond its fields' own lines.
SECTIONS = {
    "model": "the model, built by attn_symmetry.models.build(family, preset, **overrides); "
             "the data set fixes its input and output sizes.",
    "dataset": "the data set A and its reader. Every run trains on train_split; the stopping "
               "rule and the 'learned' method read validation_split, which shares no record "
               "with it. Neither may be the test split: it is kept for the reported "
               "evaluations and the study.",
    "train": "optimisation of the base model (AdamW with linear warmup and cosine decay), "
             "evaluation, logging and checkpointing intervals.",
    "reinit": "the re-initialisation protocol (docs/lmc.md, 'Re-initialisation'): each scope is "
              "re-initialised once per seed and only it is trained (the 'full' scope trains "
              "the whole model from scratch with the base schedule train.*). The stopping rule "
              "(patience > 0): a run stops after patience validations, one every "
              "validate_every steps, without improving its validation loss by more than "
              "min_delta relative, or at its budget, whichever comes first "
              "(experiments/train/trainer.py); the base model too when stop_base is set.",
    "study": "the LMC study after training (experiments/study/study.py): the matching methods "
             "compared on the paths between each pair of seeds, the Stage 1 distance "
             "ablation, the ablation over every head order and the input-noise robustness "
             "check.",
}

# The study's field of a matching option where it is not ``study_path``'s at the option's
# default (``match_fields``).
_STUDY_OPTIONS = {
    "distance": dict(path="study.distance"),
    "factors": dict(path="study.learn_factors", default=("attention",),
                    unkeyed_default=("attention",)),
    # added after results were stored, at the values those results ran with
    "learn_init": dict(unkeyed_default="full"),
    "learn_lam_band": dict(unkeyed_default=0),
    "residual": dict(unkeyed_default="permutation"),
    "learn_schedule": dict(unkeyed_default="constant"),
    "learn_patience": dict(unkeyed_default=0),
    "learn_repair": dict(unkeyed_default=False),
}


def study_path(option: str) -> str:
  """The study's field of matching option ``option``: ``study.<option>`` for the options of
  "learned" alone (``learn_*``), ``study.match_<option>`` for the others, but where
  ``_STUDY_OPTIONS`` names another."""
  if "path" in _STUDY_OPTIONS.get(option, {}):
    return _STUDY_OPTIONS[option]["path"]
  return f"study.{option}" if option.startswith("learn_") else f"study.match_{option}"


def match_fields() -> tuple[Field, ...]:
  """One ``Role.STUDY`` field per matching option that a method may name
  (``matching.ALIGN_OPTIONS``), generated from ``matching.MatchOptions``: its path
  (``study_path``), its doc, its rule (``option_rule``) and, but where ``_STUDY_OPTIONS``
  says otherwise, its default; ``option`` names it. The descent's own options
  (``max_rounds``) stay at their default in the study."""
  fields = []
  for option in matching.OPTIONS:
    if option.name not in matching.ALIGN_OPTIONS:
      continue
    study = _STUDY_OPTIONS.get(option.name, {})
    fields.append(Field(study_path(option.name), study.get("default", option.default),
                        option_rule(option.range), Role.STUDY, option.doc,
                        unkeyed_default=study.get("unkeyed_default", ALWAYS),
                        option=option.name))
  return tuple(fields)


FIELDS: tuple[Field, ...] = (
    Field("seed", 0, _AT_LEAST_0, Role.PER_RUN,
          "seed of the base model (initialisation and data order)", study=(ROBUSTNESS,)),

    Field("model.family", "vit", _one_of("model family", "attn_symmetry.models.FAMILIES"),
          Role.TRAINING, "the model family", study=(EVERY_STAGE,)),
    Field("model.preset", "tiny", _one_of("model preset", "attn_symmetry.models.PRESETS"),
          Role.TRAINING, "the family's size preset", study=(EVERY_STAGE,)),
    Field("model.overrides", {}, _MODEL_OVERRIDES, Role.TRAINING,
          "keyword arguments passed on to the model config (pos_encoding, width, ...)",
          study=(EVERY_STAGE,)),

    Field("dataset.name", "digits", _DATASET, Role.PER_RUN,
          "the data set A that the base model trains on", study=(DATA,)),
    Field("dataset.data_dir", "", _DATA_DIR, Role.TRAINING,
          'where prepared data sets live ("" for the default)', study=(DATA,)),
    Field("dataset.seq_len", 0, _AT_LEAST_0, Role.TRAINING,
          "tokens per text example (0: the reader's default)", study=(DATA,)),
    Field("dataset.image_size", 0, _AT_LEAST_0, Role.TRAINING,
          "crop side of variable-size images (0: the reader's default)", study=(DATA,)),
    Field("dataset.augment", False, _BOOLEAN, Role.TRAINING,
          "random crop and flip of the training images", study=(LOSS,)),
    Field("dataset.num_workers", 0, _AT_LEAST_0, Role.NOT_KEYED,
          "reader processes on top of threads (0 reads in-process); batch k holds the "
          "same examples", study=(DATA,)),
    Field("dataset.train_split", "train", _split(), Role.TRAINING,
          "the split, or one slice of it ('train[:90%]'), that every run trains on",
          study=(LOSS, REPAIR, ACTIVATIONS)),
    Field("dataset.validation_split", "", _split(optional=True), Role.STOPPING,
          "the held-out split or slice ('train[90%:]', or a real 'validation' split) of the "
          "stopping rule and the 'learned' method; \"\" for none", study=(LOSS,)),
    Field("dataset.validation_examples", 0, _AT_LEAST_0, Role.STOPPING,
          "the first that many examples of validation_split are read (0: all of them)",
          unkeyed_default=0, study=(LOSS,)),

    Field("train.num_steps", 1000, _AT_LEAST_1, Role.TRAIN_SCHEDULE,
          "steps of the base run (and of the 'full' scope)"),
    Field("train.batch_size", 128, _AT_LEAST_1, Role.TRAINING,
          "training batch size of every run, a multiple of the devices",
          study=(LOSS, REPAIR, ACTIVATIONS)),
    Field("train.eval_batch_size", 256, _AT_LEAST_1, Role.STUDY,
          "evaluation batch size, a multiple of the devices (splits the same sums otherwise; "
          "'learned' picks its iterate on study.learn_holdout_batches batches of it)",
          study=(LOSS,)),
    Field("train.param_sharding", "replicated",
          _one_of("parameter sharding", "experiments.train.inputs.PARAM_SHARDINGS"), Role.NOT_KEYED,
          "'replicated' (a copy of the parameters and optimiser state on every device) or "
          "'fsdp' (each leaf split over the devices: about 1/N of the model on each; the "
          "same steps up to float32 rounding)"),
    Field("train.learning_rate", 1e-3, _POSITIVE, Role.TRAIN_SCHEDULE,
          "peak learning rate of the base schedule"),
    Field("train.warmup_steps", 100, _AT_LEAST_0, Role.TRAIN_SCHEDULE,
          "linear warmup steps of the base schedule, fewer than num_steps"),
    Field("train.final_lr_fraction", 0.01, _real("in [0, 1]", lambda v: 0 <= v <= 1),
          Role.TRAINING, "every run's cosine decay ends at this fraction of its peak rate"),
    Field("train.weight_decay", 0.05, _NON_NEGATIVE, Role.TRAINING, "AdamW's weight decay"),
    Field("train.b1", 0.9, _FRACTION, Role.TRAINING, "AdamW's beta_1"),
    Field("train.b2", 0.999, _FRACTION, Role.TRAINING, "AdamW's beta_2"),
    Field("train.grad_clip_norm", 1.0, _POSITIVE, Role.TRAINING,
          "gradients are clipped to this global norm"),
    Field("train.log_every", 50, _AT_LEAST_1, Role.NOT_KEYED,
          "steps between logged training losses (metrics.jsonl only)"),
    Field("train.eval_every", 500, _AT_LEAST_1, Role.NOT_KEYED,
          "steps between evaluations on the way (the last step is always evaluated)"),
    Field("train.checkpoint_every", 500, _AT_LEAST_1, Role.NOT_KEYED,
          "steps between checkpoints (a resumed run is bit-identical)"),
    Field("train.keep_checkpoints", 2, _AT_LEAST_1, Role.NOT_KEYED,
          "checkpoints kept per run, the newest"),

    Field("reinit.scopes", (), _distinct(_one_of("scope", "experiments.train.reinit.scopes")),
          Role.NOT_KEYED, "the scopes re-initialised in turn (() trains the base model only)"),
    Field("reinit.seeds", (1, 2, 3), _distinct(_AT_LEAST_0), Role.NOT_KEYED,
          "each scope is re-initialised once per seed; the study compares every pair"),
    Field("reinit.num_steps", 500, _AT_LEAST_1, Role.REINIT_SCHEDULE,
          "step budget of a fine-tuned scope"),
    Field("reinit.learning_rate", 1e-3, _POSITIVE, Role.REINIT_SCHEDULE,
          "peak learning rate of a fine-tuned scope"),
    Field("reinit.warmup_steps", 50, _AT_LEAST_0, Role.REINIT_SCHEDULE,
          "warmup steps of a fine-tuned scope, fewer than num_steps"),
    Field("reinit.dataset", "", _one_of("data set", "attn_symmetry.data.DATASETS",
                                        or_empty=True), Role.PER_RUN,
          'the data set B of an A->B transfer ("": the base data set)', study=(DATA,)),
    Field("reinit.patience", 0, _AT_LEAST_0, Role.STOPPING,
          "validations without improvement after which a run stops (0: no stopping rule, "
          "every run trains its whole budget)"),
    Field("reinit.min_delta", 0.0, _FRACTION, Role.STOPPING,
          "the relative decrease of the validation loss that counts as an improvement"),
    Field("reinit.validate_every", 100, _AT_LEAST_1, Role.STOPPING,
          "steps between the stopping rule's validations"),
    Field("reinit.stop_base", False, _BOOLEAN, Role.STOPPING,
          "the base model follows the stopping rule too, with train.num_steps as its budget "
          "(False: it trains its whole schedule)", unkeyed_default=False),

    Field("study.methods", ("naive", "perm", "ortho", "full"),
          _distinct(_one_of("method", "attn_symmetry.matching.METHODS")), Role.STUDY,
          "the matching methods compared; 'naive' must be one (each method's stages are keyed "
          "by their method; the robustness check measures them all)", study=(ROBUSTNESS,)),
    Field("study.num_lambdas", 25, _integer(3), Role.STUDY,
          "interpolation points of a path, endpoints included (with 2 every barrier is 0)",
          study=(EVERY_STAGE,)),
    Field("study.lambda_chunk", 1, _AT_LEAST_1, Role.NOT_KEYED,
          "interpolation points evaluated in one call (benchmarks/bench_interpolation.py: "
          "1 beats 5 and 25 on CPU)"),
    *match_fields(),
    Field("study.repair", False, _BOOLEAN, Role.NOT_KEYED,
          "also measure each method's path with REPAIR at every interior point "
          "(attn_symmetry.repair; reported as the method '<method>+repair')"),
    Field("study.repair_no_bias", "std", _one_of("REPAIR rule", "attn_symmetry.repair.NO_BIAS_RULES"),
          Role.STUDY,
          "what REPAIR's scale matches at a point with no bias to take the shift (Llama): "
          "'std' (REPAIR's rule) or 'second_moment' (the uncentred E[x^2]); "
          "attn_symmetry.repair.repair's no_bias; also the rule of 'learned' with "
          "study.learn_repair", study=(REPAIR,), unkeyed_default="std"),
    Field("study.circuit_path", False, _BOOLEAN, Role.NOT_KEYED,
          "also measure each method's aligned pair on the circuit path, a comparison measure "
          "(attn_symmetry.circuit_path: each head's circuits W_Q W_K^T and W_V W_O "
          "interpolated, as Theus et al.; its interior points are models of twice the head "
          "width, not of the original architecture), recorded beside the ordinary barrier as "
          "the method's 'circuit' entry and 'circuit_*' summaries (docs/lmc.md, 'The circuit "
          "path'); refused for RoPE models"),
    Field("study.activation_batches", 8, _AT_LEAST_1, Role.STUDY,
          "training batches (dataset.train_split, not augmented) on which the methods that "
          "read activations measure them: REPAIR's statistics and activation matching "
          "(the 'activation' method, and 'learned' from it)",
          study=(REPAIR, ACTIVATIONS), unkeyed_default=8),
    Field("study.eval_examples", 0, _AT_LEAST_0, Role.STUDY,
          "the first that many examples of eval_split evaluate every path (0: all of them)",
          study=(EVERY_STAGE,)),
    Field("study.eval_split", "test", _split(evaluation=True), Role.STUDY,
          "the split or slice that evaluates every path: the test split, or e.g. "
          "'train[:90%]' for the barrier of the fitted objective ('learned' trains there, "
          "so summary.md says its barrier is not held out)", unkeyed_default="test",
          study=(EVERY_STAGE,)),
    Field("study.distances", ("frobenius", "squared", "normalised", "cosine"),
          _distinct(_DISTANCE), Role.NOT_KEYED, "the Stage 1 distances of the ablation"),
    Field("study.permutation_ablation", True, _BOOLEAN, Role.NOT_KEYED,
          "the first attention scope's ablation over every head order"),
    Field("study.permutation_ablation_seeds", (), _distinct(_AT_LEAST_0), Role.NOT_KEYED,
          "the head-order ablation runs on the pairs of these re-initialisation seeds only "
          "(a fixed subset of reinit.seeds, at least 2; empty: every pair)"),
    Field("study.max_exhaustive_heads", 6, _AT_LEAST_1, Role.NOT_KEYED,
          "the head-order ablation runs on layers of at most this many heads"),
    Field("study.noise_levels", (0.0, 0.5, 1.0), _distinct(_NON_NEGATIVE), Role.STUDY,
          "input noise of the robustness check: Gaussian std on normalised images, token "
          "replacement rate (at most 1) on text", study=(ROBUSTNESS,)),
)

BY_PATH: dict[str, Field] = {f.path: f for f in FIELDS}


def check_roles(fields: tuple[Field, ...]) -> None:
  """Raises ValueError naming the fields whose ``Role`` contradicts what the study keys them
  by: a ``Role.STUDY`` field that no study stage keys, or a ``Role.NOT_KEYED`` one that some
  stage keys (``Field.keys_study``)."""
  wrong = [f.path for f in fields if (f.keys is Role.STUDY and not f.keys_study)
           or (f.keys is Role.NOT_KEYED and f.keys_study)]
  if wrong:
    raise ValueError(f"{wrong}: a Role.STUDY field names the study stages that key it "
                     "(study=, option=), a Role.NOT_KEYED one names none")


check_roles(FIELDS)


def default_config() -> ml_collections.ConfigDict:
  """A ConfigDict of every field at its default."""
  config = ml_collections.ConfigDict()
  for field in FIELDS:
    *sections, name = field.path.split(".")
    node = config
    for section in sections:
      if section not in node:
        node[section] = ml_collections.ConfigDict()
      node = node[section]
    default = field.default
    if isinstance(default, Mapping):  # a fresh copy for every config
      default = ml_collections.ConfigDict(dict(default))
    node[name] = default
  return config


def value(config: ml_collections.ConfigDict, path: str) -> Any:
  """The value of the field at dotted ``path`` ("study.match_steps") in ``config``."""
  for key in path.split("."):
    config = config[key]
  return config


def _names(selected: Callable[[Field], bool]) -> tuple[str, ...]:
  """The names of the ``selected`` fields, in table order, for ``fingerprints.config_fields``:
  a section all of whose fields are selected is named whole ("model"), so that every leaf
  under it is keyed (``model.overrides.width``, ...)."""
  names = []
  for field in FIELDS:
    if not selected(field):
      continue
    section = field.path.split(".", 1)[0]
    whole = section != field.path and all(
        selected(f) for f in FIELDS if f.path.startswith(section + "."))
    name = section if whole else field.path
    if name not in names:
      names.append(name)
  return tuple(names)


def keyed_by(role: Role) -> tuple[str, ...]:
  """The names of the fields that key ``role``'s stages (``_names``)."""
  return _names(lambda field: field.keys is role)


def study_keyed(reader: str) -> tuple[str, ...]:
  """The names of the fields whose ``study`` names ``reader`` (a key of ``STUDY_READERS``;
  ``_names``): the fields that its stages key by value, but for ``DATA``."""
  if reader not in STUDY_READERS:
    raise ValueError(f"no study reader {reader!r}; choose from {list(STUDY_READERS)}")
  return _names(lambda field: reader in field.study)


def option_fields() -> dict[str, str]:
  """{align_model option: the path of the field that sets it} (``Field.option``)."""
  return {f.option: f.path for f in FIELDS if f.option}


def unkeyed_defaults() -> dict[str, Any]:
  """{path: value} of the fields that key nothing at that value (``Field.unkeyed_default``)."""
  return {f.path: f.unkeyed_default for f in FIELDS if f.unkeyed_default is not ALWAYS}


def reference() -> str:
  """Every field of ``FIELDS``, section by section: its default, what it does, its check and
  the stages it keys."""
  def wrap(text, indent):
    return textwrap.fill(text, 96, initial_indent=indent, subsequent_indent=indent,
                         break_on_hyphens=False)
  lines, section = [], None
  for field in FIELDS:
    head = field.path.split(".", 1)[0] if "." in field.path else None
    if head is not None and head != section:
      lines += ["", wrap(f"{head}: {SECTIONS[head]}", "")]
    section = head
    keys = field.keys.value
    keys += "".join(f"; {STUDY_READERS[reader]}" for reader in field.study)
    if field.option:
      keys += f"; the study stages of the methods that read align_model's {field.option!r}"
    if field.unkeyed_default is not ALWAYS:
      keys += f" (none at {field.unkeyed_default!r})"
    lines += [f"  {field.path} = {field.default!r}", wrap(field.doc, "      "),
              wrap(f"check: {field.rule.says}; keys: {keys}", "      ")]
  return "\n".join(lines)


if __name__ == "__main__":
  print(reference())
