"""``align_model``'s matching options in one table: ``MatchOptions``.

Each field of ``MatchOptions`` is one option: its default, and in its metadata
(``option``) a one-line doc, its range and who reads it. Everything else that
names the options derives from this table:

* ``matching.ALIGN_OPTIONS`` (what a method's registration may name:
  ``METHOD_OPTIONS``), the built-in methods' ``Method.options``
  (``built_in_options``) and what a method reads given the others (``reads``);
* ``align_model``'s keyword arguments and their defaults (``signature``);
* the align command's ``MATCHING_OPTIONS``, its flags (help and type) and its
  checks (the range; an option the method does not read);
* the study's ``study.match_*`` config fields (default, doc, rule:
  ``experiments/setting/config_schema.py``).

A new option is one field here plus the code that reads it (the ``align`` of a
method that reads it: ``_model``'s descent for "perm", "ortho" and "full").
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from attn_symmetry.matching import _attention
from attn_symmetry.matching import _correction
from attn_symmetry.matching import _features

DEFAULT_MAX_ROUNDS = 10
REFINES = ("every_round", "final")  # when "full" refines the attention matrices (``_model``)
# The residual factor of a stream read through LayerNorms only (``_model.residual_spec``).
RESIDUALS = ("permutation", "orthogonal")


# ----------------------------------------------------------------------------- ranges


def _is_int(value: Any) -> bool:
  return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class AtLeast:
  """An integer >= ``minimum``."""
  minimum: int
  parse = int  # the command line's parser of a value
  metavar = None  # and its placeholder, where not the option's name

  def __contains__(self, value: Any) -> bool:
    return _is_int(value) and value >= self.minimum

  @property
  def says(self) -> str:
    """What a value must do, in words after "must"."""
    named = {0: "a non-negative integer", 1: "a positive integer"}
    return "be " + named.get(self.minimum, f"an integer >= {self.minimum}")


@dataclasses.dataclass(frozen=True)
class Positive:
  """A finite real number > 0."""
  parse = float
  metavar = None

  def __contains__(self, value: Any) -> bool:
    return (isinstance(value, (int, float, np.integer, np.floating))
            and not isinstance(value, bool) and math.isfinite(value) and value > 0)

  @property
  def says(self) -> str:
    return "be a positive number"


@dataclasses.dataclass(frozen=True)
class OneOf:
  """One of ``values``, the tuple that ``owner`` (a dotted name) holds; ``noun`` names one."""
  noun: str
  owner: str
  values: tuple[str, ...]
  parse = str
  metavar = None

  def __contains__(self, value: Any) -> bool:
    return isinstance(value, str) and value in self.values

  @property
  def says(self) -> str:
    return f"be one of {', '.join(self.values)}"


@dataclasses.dataclass(frozen=True)
class SomeOf:
  """A non-empty list (or tuple) of entries of ``values`` (as ``OneOf``); on the command
  line, comma-separated."""
  noun: str
  owner: str
  values: tuple[str, ...]
  metavar = "A,B,..."

  @staticmethod
  def parse(text: str) -> tuple[str, ...]:
    return tuple(entry for entry in text.split(",") if entry)

  def __contains__(self, value: Any) -> bool:
    return (isinstance(value, (list, tuple)) and bool(value)
            and all(isinstance(v, str) and v in self.values for v in value))

  @property
  def says(self) -> str:
    return f"list some of {', '.join(self.values)}"


@dataclasses.dataclass(frozen=True)
class Flag:
  """True or False; on the command line, "true" or "false"."""
  metavar = "true|false"

  @staticmethod
  def parse(text: str) -> bool:
    words = {"true": True, "false": False}
    if text.lower() not in words:
      raise ValueError(f"not true or false: {text!r}")
    return words[text.lower()]

  def __contains__(self, value: Any) -> bool:
    return isinstance(value, (bool, np.bool_))

  @property
  def says(self) -> str:
    return "be true or false"


Range = AtLeast | Positive | OneOf | SomeOf | Flag


@dataclasses.dataclass(frozen=True)
class Requires:
  """For ``method``, the option is read only when option ``option`` is ``value``; ``what``
  says what it is then ("the Adam solver's step size")."""
  method: str
  option: str
  value: Any
  what: str


# ----------------------------------------------------------------------------- the table


def option(default: Any, doc: str, range_: Range, *, methods: tuple[str, ...] = (),
           descent: bool = False, requires: Requires | None = None) -> Any:
  """One field of ``MatchOptions``.

  Args:
    default: ``align_model``'s default.
    doc: what it does, one line (the command's help, the study field's doc).
    range_: the values it accepts (``AtLeast``, ``Positive``, ``OneOf``, ``SomeOf``).
    methods: the built-in methods that read it and whose results it keys
      (their ``Method.options``); a registered method names its own.
    descent: read by every built-in coordinate descent (``Method.descent``) and by no
      method's ``options``: a registered method cannot name it.
    requires: a condition on another option under which one method reads it.
  """
  return dataclasses.field(default=default, metadata=dict(
      doc=doc, range=range_, methods=methods, descent=descent, requires=requires))


DESCENTS = ("perm", "ortho", "full", "learned")  # the built-in methods that run the descent
_REFINING = ("full", "learned")  # and those that refine (Stage 2 after Procrustes)
_LEARNED = ("learned",)  # the options of "learned" alone
LEARN_INITS = ("full", "activation")  # the starts of "learned": the methods it starts from
# The learning-rate schedules of "learned" (``_learned.learning_rates``).
LEARN_SCHEDULES = ("constant", "warmup_cosine")


@dataclasses.dataclass(frozen=True)
class MatchOptions:
  """``align_model``'s matching options, one field each (module docstring)."""
  distance: str = option(
      "frobenius", "Stage 1 head distance",
      OneOf("distance", "attn_symmetry.matching.DISTANCES", _features.DISTANCES),
      methods=DESCENTS)
  steps: int = option(
      _attention.DEFAULT_STEPS,
      "most iterations of the Stage 2 refinement (0: none)", AtLeast(0),
      methods=(*_REFINING, "activation"))
  learning_rate: float = option(
      _attention.DEFAULT_LEARNING_RATE,
      "step size of the 'adam' refinement solver",
      Positive(), methods=_REFINING,
      requires=Requires("full", "solver", "adam", "the Adam solver's step size"))
  max_rounds: int = option(DEFAULT_MAX_ROUNDS, "most rounds of coordinate descent", AtLeast(1),
                           descent=True)
  init: str = option(
      _attention.INITS[0],
      "start of the Stage 2 refinement: 'procrustes' or the 'best' of it and others",
      OneOf("Stage 2 start", "attn_symmetry.matching.INITS", _attention.INITS),
      methods=_REFINING)
  refine: str = option(
      REFINES[0], "when 'full' refines: at every round of the descent or once at the end",
      OneOf("refinement schedule", "attn_symmetry.matching.REFINES", REFINES),
      methods=_REFINING)
  solver: str = option(
      _attention.SOLVERS[0],
      "the Stage 2 refinement: 'gauss_newton' (stops on a tolerance within steps iterations) "
      "or 'adam' (that many Adam steps at the learning rate)",
      OneOf("refinement solver", "attn_symmetry.matching.SOLVERS", _attention.SOLVERS),
      methods=_REFINING)
  residual: str = option(
      RESIDUALS[0],
      "the residual factor of a pre-LayerNorm stream read through LayerNorms only (GPT-2 "
      "untied, ViT, GPT-NeoX): 'permutation' or 'orthogonal' (O(d - 1) on the mean-zero "
      "subspace, both models brought to one gauge first); other streams keep their own",
      OneOf("residual factor", "attn_symmetry.matching.RESIDUALS", RESIDUALS),
      methods=(*DESCENTS, "activation"))
  learn_init: str = option(
      LEARN_INITS[0],
      "the start of 'learned': the weight method 'full' or the activation method "
      "'activation' (which reads the models' activations on data)",
      OneOf("learned start", "attn_symmetry.matching.LEARN_INITS", LEARN_INITS),
      methods=_LEARNED)
  learn_lam_band: int = option(
      0,
      "'learned' draws lambda at every step from U(lam - w, lam + w), w this many hundredths "
      "(0: lambda fixed; 10: U(0.4, 0.6) around 1/2, Theus et al.); below 50, drawn with a "
      "random key",
      AtLeast(0), methods=_LEARNED)
  learn_schedule: str = option(
      LEARN_SCHEDULES[0],
      "the learning rate of 'learned' over its steps: 'constant', or 'warmup_cosine' (linear "
      "warm-up over the first tenth of learn_steps, then cosine decay towards 0)",
      OneOf("learning-rate schedule", "attn_symmetry.matching.LEARN_SCHEDULES", LEARN_SCHEDULES),
      methods=_LEARNED)
  learn_patience: int = option(
      0, "'learned' stops after this many held-out evaluations without a lower barrier "
      "(learn_steps the ceiling; 0: it runs every step)", AtLeast(0), methods=_LEARNED)
  factors: tuple[str, ...] | None = option(
      None,
      "the factors that 'learned' trains, those of them the scope has (by default all of "
      "them)",
      SomeOf("learned factor", "attn_symmetry.matching.LEARNED_FACTORS", _correction.FACTORS),
      methods=_LEARNED)
  learn_steps: int = option(
      300, "training steps of 'learned' (its start runs with steps and learning_rate)",
      AtLeast(0), methods=_LEARNED)
  learn_learning_rate: float = option(
      1e-2, "step size of the training of 'learned'", Positive(), methods=_LEARNED)
  learn_uniform_lambda: bool = option(
      False, "'learned' draws lambda from U(0, 1) at every step instead of 1/2 (with a random "
      "key)",
      Flag(), methods=_LEARNED)
  learn_holdout_batches: int = option(
      4, "held-out batches on which 'learned' picks its best iterate (the first that many)",
      AtLeast(1), methods=_LEARNED)
  learn_repair: bool = option(
      False, "'learned' fits its element on the REPAIRed path: the loss of every step, and the "
      "held-out barrier that picks the iterate, are those of the interpolated model REPAIRed "
      "on that batch (with the caller's REPAIR rule)", Flag(), methods=_LEARNED)


@dataclasses.dataclass(frozen=True)
class Option:
  """One row of the table: a field of ``MatchOptions`` with its metadata (``option``)."""
  name: str
  default: Any
  annotation: str
  doc: str
  range: Range
  methods: tuple[str, ...]
  descent: bool
  requires: Requires | None


def options() -> tuple[Option, ...]:
  """The rows of ``MatchOptions``, in its order."""
  return tuple(Option(f.name, f.default, f.type, **f.metadata)
               for f in dataclasses.fields(MatchOptions))


OPTIONS = options()
NAMES = tuple(o.name for o in OPTIONS)
# What a method's registration may name: every option but the built-in descent's own.
METHOD_OPTIONS = tuple(o.name for o in OPTIONS if not o.descent)
DEFAULTS: dict[str, Any] = {o.name: o.default for o in OPTIONS}
# The options of the built-in descent's one compiled program, which "perm", "ortho" and "full"
# share (``Method.takes``): those that "full" reads and the descent's own.
PROGRAM = tuple(o.name for o in OPTIONS if "full" in o.methods or o.descent)
# The options that one built-in method alone reads ("learned"'s own), each to that method: a
# method that does not read one refuses a value other than its default (``_methods.check``).
OWN = {o.name: o.methods[0] for o in OPTIONS if len(o.methods) == 1}


def built_in_options(method: str) -> tuple[str, ...]:
  """The ``Method.options`` of built-in ``method``: the options whose ``methods`` name it."""
  return tuple(o.name for o in OPTIONS if method in o.methods)


def reads(named: tuple[str, ...], method: str, descent: bool,
          given: Mapping[str, Any]) -> tuple[str, ...]:
  """The options that ``method`` reads, in table order, given the options ``given``: those it
  names (``named``, its ``Method.options``), the descent's own if it runs the built-in descent
  (``descent``), less those whose ``requires`` (for this method) ``given`` does not meet."""
  out = []
  for o in OPTIONS:
    if not (o.name in named or (descent and o.descent)):
      continue
    need = o.requires
    if need and need.method == method and given.get(need.option, DEFAULTS[need.option]) != (
        need.value):
      continue
    out.append(o.name)
  return tuple(out)


def signature(function: Callable[..., Any]) -> inspect.Signature:
  """``function``'s signature with every option of the table as a keyword argument at its
  default, before its ``**`` parameter (through which ``function`` receives them)."""
  params = list(inspect.signature(function).parameters.values())
  rest = [p for p in params if p.kind is inspect.Parameter.VAR_KEYWORD]
  table = [inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, default=o.default,
                             annotation=o.annotation) for o in OPTIONS]
  return inspect.Signature([p for p in params if p not in rest] + table + rest)
