"""The whole-model matching methods by name: one registration per method, built-in or not.

``METHODS`` maps each method's name to its ``Method``: the function that computes
its element, the options of ``align_model`` it reads (callers key saved results by
them, so that a result is recomputed when one of them changes and only then; for a
built-in method, the table ``MatchOptions`` says which) and the inputs beyond the
weights that it needs (``INPUTS``: the models' activations on match batches, a loss
with training and held-out batches), which a caller supplies through one provider
(``provided_arguments``) without asking which method it holds. ``align_model`` checks
the options, the arguments, the model pair and the scope once (``check``), then calls
the method (``Method.call``).

The built-in methods register themselves beside their code (``register_built_in``):
"naive", "perm", "ortho" and "full" in ``_model``, "learned" in ``_learned``,
"activation" in ``_activation``; ``register_method`` adds one from outside the
package (docs/extending.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from attn_symmetry import registry
from attn_symmetry.matching import _options

# The options of ``align_model`` that a method may name (``MatchOptions``' fields but those of
# the built-in descent alone: ``max_rounds``).
ALIGN_OPTIONS = _options.METHOD_OPTIONS
Align = Callable[..., tuple[dict[str, Any], dict[str, Any]]]

# What a method may need beyond the two models' weights: each input is a set of
# ``align_model``'s arguments that one provider supplies together.
#   ACTIVATIONS: ``activations(params, batch)`` -> {name: array} (``ACTIVATION_KEYS``'s
#     contract) and ``match_batches``, the batches it is run on;
#   LOSS: ``loss_fn(params, batch)`` -> a scalar, ``batches`` (an iterable of training
#     batches), ``holdout_batches`` (an iterable of held-out batches), ``key`` (a
#     ``jax.random`` key, for what the method draws at random) and ``progress`` (called
#     with a dict of figures at each evaluation; may be None);
#   REPAIR: what REPAIRs a model of the path on a batch of the loss's (``repair.BatchRepair``):
#     ``model`` (the ``models.Model`` that the parameters belong to), ``model_inputs`` (batch
#     -> what the model reads of it, traceable; None: the batch itself) and
#     ``repair_no_bias`` (REPAIR's rule, one of ``repair.NO_BIAS_RULES``; None: its default).
ACTIVATIONS = "activations"
LOSS = "loss"
REPAIR = "repair"
INPUTS = {ACTIVATIONS: ("activations", "match_batches"),
          LOSS: ("loss_fn", "batches", "holdout_batches", "key", "progress"),
          REPAIR: ("model", "model_inputs", "repair_no_bias")}
# How the align command can read a method's models a group of leaves at a time
# (``Method.streamed``): WEIGHTS by ``align_model_streamed``, ACTIVATIONS by
# ``align_activations_streamed`` (both models run a group of leaves at a time).
WEIGHTS = "weights"
Provide = Callable[[str], Mapping[str, Any]]  # an input of ``INPUTS`` -> its arguments


@dataclasses.dataclass(frozen=True)
class When:
  """``inputs`` (of ``INPUTS``) that a method needs only when option ``option`` is ``value``."""
  option: str
  value: Any
  inputs: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Method:
  """One whole-model matching method.

  Attributes:
    name: the method's name (``align_model(method=...)``, ``study.methods``).
    align: ``align(spec, params_a, params_b, *, scope, **options, **arguments)``
      -> (element, info): a group element of ``spec`` (as
      ``group_action.identity_model``'s) that brings B close to A, acting only
      inside ``scope`` (parameter path prefixes, checked), and a dict of
      JSON-convertible diagnostics. ``info["folded_norm_scales"]`` True says
      the element needs both endpoints' norm scales folded
      (``group_action.fold_norm_scales``), as an orthogonal residual does. It
      receives the options of ``takes`` and the arguments of ``reads_arguments``
      that the caller gave.
    options: the entries of ``ALIGN_OPTIONS`` it reads.
    descent: whether it runs ``align_model``'s coordinate descent, and so reads the
      descent's own options too (``max_rounds``): the built-in methods but "naive"
      and "activation" (``_options.DESCENTS``).
    arguments: the arguments of ``align_model`` beyond the options and its inputs'
      that it reads.
    inputs: what it needs beyond the weights (``INPUTS``), whatever its options.
    when: inputs it needs under a condition on the options ("learned" needs
      ``ACTIVATIONS`` with ``learn_init="activation"``).
    streamed: how the align command may read its models a group of leaves at a time
      (``WEIGHTS``, ``ACTIVATIONS``), or None: it reads both whole models.
    doc: what it does, a few words (the align command's help).
  """
  name: str
  options: tuple[str, ...]
  align: Align
  descent: bool = False
  arguments: tuple[str, ...] = ()
  inputs: tuple[str, ...] = ()
  when: tuple[When, ...] = ()
  streamed: str | None = None
  doc: str = ""

  def reads(self, given: Mapping[str, Any]) -> tuple[str, ...]:
    """The matching options it reads, in ``MatchOptions``' order, when called with the
    options ``given``: its ``options``, the descent's own if ``descent``, but an option
    whose ``requires`` ``given`` does not meet ("full" reads ``learning_rate`` only with the
    "adam" solver)."""
    return _options.reads(self.options, self.name, self.descent, given)

  @property
  def takes(self) -> tuple[str, ...]:
    """The options its ``align`` receives, in table order: its ``options`` and, for a
    descent, every option of the descent's one compiled program (``_options.PROGRAM``), so
    that "perm", "ortho" and "full" called with equal options share that program."""
    return tuple(n for n in _options.NAMES
                 if n in self.options or (self.descent and n in _options.PROGRAM))

  @property
  def every_input(self) -> tuple[str, ...]:
    """Every input it may need: ``inputs`` and those of ``when``."""
    return tuple(dict.fromkeys((*self.inputs, *(i for w in self.when for i in w.inputs))))

  @property
  def every_argument(self) -> tuple[str, ...]:
    """Every argument it may read: ``arguments`` and those of every input it may need."""
    return self.arguments + tuple(a for i in self.every_input for a in INPUTS[i])

  def needs(self, options: _options.MatchOptions | Mapping[str, Any]) -> tuple[str, ...]:
    """The inputs (``INPUTS``) it needs given ``options`` (a ``MatchOptions``, or a mapping
    of the options given, the others at their defaults): ``inputs``, and those of ``when``
    met."""
    value = ((lambda n: getattr(options, n)) if isinstance(options, _options.MatchOptions)
             else (lambda n: options.get(n, _options.DEFAULTS[n])))
    met = (i for w in self.when if value(w.option) == w.value for i in w.inputs)
    return tuple(dict.fromkeys((*self.inputs, *met)))

  def reads_arguments(self, options: _options.MatchOptions) -> tuple[str, ...]:
    """The arguments it reads given ``options``: ``arguments``, and those of its ``needs``."""
    return self.arguments + tuple(a for i in self.needs(options) for a in INPUTS[i])

  def call(self, spec: Any, params_a: Any, params_b: Any, *, scope: Any,
           options: _options.MatchOptions, arguments: Mapping[str, Any]
           ) -> tuple[dict[str, Any], dict[str, Any]]:
    """``align`` on the pair, with the options it takes and the ``arguments`` it reads."""
    read = self.reads_arguments(options)
    return self.align(spec, params_a, params_b, scope=scope,
                      **{k: getattr(options, k) for k in self.takes},
                      **{k: v for k, v in arguments.items() if k in read})


METHODS: registry.Registry = registry.Registry()


def provided_arguments(name: str, options: _options.MatchOptions | Mapping[str, Any],
                       provide: Provide) -> dict[str, Any]:
  """``align_model``'s arguments for the inputs that method ``name`` needs with ``options``
  (``Method.needs``): ``provide(input)`` for each, which gives that input's arguments
  (``INPUTS``). A caller that can supply every input passes one ``provide`` for every method.

  Raises:
    ValueError: ``provide`` gives other arguments than an input's.
  """
  out: dict[str, Any] = {}
  for needed in METHODS[name].needs(options):
    given = dict(provide(needed))
    if set(given) != set(INPUTS[needed]):
      raise ValueError(f"the provider of input {needed!r} gave {sorted(given)}, not "
                       f"{list(INPUTS[needed])}")
    out |= given
  return out


def _register(method: Method) -> Method:
  if method.name in METHODS:
    raise ValueError(f"matching method {method.name!r} is already registered")
  if not callable(method.align):
    raise ValueError(f"matching method {method.name!r}: align must be callable, got "
                     f"{method.align!r}")
  unknown = sorted(set(method.inputs) - set(INPUTS))
  if unknown or method.streamed not in (None, WEIGHTS, ACTIVATIONS):
    raise ValueError(f"matching method {method.name!r}: inputs must be some of {list(INPUTS)} "
                     f"and streamed one of {WEIGHTS!r}, {ACTIVATIONS!r} or None, got inputs "
                     f"{list(method.inputs)}, streamed {method.streamed!r}")
  taken = sorted(set(_options.NAMES) & set(method.every_argument))
  if taken:
    raise ValueError(f"matching method {method.name!r}: arguments {taken} are matching options; "
                     "name them in options")
  METHODS[method.name] = method
  return method


def register_built_in(name: str, align: Align, *, doc: str, arguments: Sequence[str] = (),
                      inputs: Sequence[str] = (), when: Sequence[When] = (),
                      streamed: str | None = None) -> Method:
  """Adds the package's method ``name``: its options are those the table ``MatchOptions``
  names for it, and it runs the descent if it is one of ``_options.DESCENTS``."""
  return _register(Method(name, _options.built_in_options(name), align,
                          descent=name in _options.DESCENTS, arguments=tuple(arguments),
                          inputs=tuple(inputs), when=tuple(when), streamed=streamed, doc=doc))


def register_method(name: str, align: Align, *, options: Sequence[str] = (),
                    arguments: Sequence[str] = (), inputs: Sequence[str] = (),
                    doc: str = "") -> Method:
  """Adds a whole-model matching method (``Method``); returns it. ``inputs`` (some of
  ``INPUTS``) are what it needs beyond the weights: the align command and the study supply
  them (``provided_arguments``).

  Raises:
    ValueError: the name is taken, ``align`` is not callable, ``options`` names
      something other than ``ALIGN_OPTIONS``, ``inputs`` something other than ``INPUTS``,
      or ``arguments`` names an option.
  """
  unknown = sorted(set(options) - set(ALIGN_OPTIONS))
  if unknown:
    raise ValueError(f"matching method {name!r}: unknown options {unknown}; a method reads "
                     f"some of {ALIGN_OPTIONS}")
  return _register(Method(name, tuple(options), align, arguments=tuple(arguments),
                          inputs=tuple(inputs), doc=doc))


# ----------------------------------------------------------------------------- the checks


def _words(names: Sequence[str]) -> str:
  return " and ".join(names) if len(names) < 3 else f"{', '.join(names[:-1])} and {names[-1]}"


def _readers(argument: str) -> list[str]:
  """Who reads ``argument``: "method 'activation'", "'learned' with learn_init='activation'"."""
  reads = lambda inputs: any(argument in INPUTS[i] for i in inputs)
  return ([f"method {m.name!r}" for m in METHODS.values()
           if argument in m.arguments or reads(m.inputs)]
          + [f"{m.name!r} with {w.option}={w.value!r}" for m in METHODS.values()
             for w in m.when if reads(w.inputs)])


def _check_arguments(method: Method, options: _options.MatchOptions,
                     arguments: Mapping[str, Any]) -> None:
  """ValueError naming an argument that no method reads, or one given (not None) to a
  method that does not read it with these options."""
  known = {a for m in METHODS.values() for a in m.every_argument}
  unknown = sorted(set(arguments) - known)
  read = method.reads_arguments(options)
  if unknown:
    hints = "".join(f"; {u} is the matching option {o}" for u in unknown
                    for o in _options.NAMES if o.endswith("_" + u))
    raise ValueError(f"unknown options {unknown} of method {method.name!r}; it takes the "
                     f"matching options (MatchOptions) and {list(read)}{hints}")
  unread = sorted(a for a, v in arguments.items() if v is not None and a not in read)
  if unread:
    readers = _readers(unread[0])
    group = [a for a in unread if _readers(a) == readers]
    condition = "".join(f" with {w.option}={getattr(options, w.option)!r}" for w in method.when
                        if set(group) & {a for i in w.inputs for a in INPUTS[i]})
    raise ValueError(f"{_words(group)} are read by {readers[0]}"
                     + "".join(f" (and {r})" for r in readers[1:])
                     + f" only, not by {method.name!r}{condition}")


def check(name: str, options: _options.MatchOptions, arguments: Mapping[str, Any]) -> Method:
  """``METHODS[name]``, once ``options`` and ``arguments`` are seen to fit it.

  Raises:
    ValueError: naming the option or argument: the method is unknown, an option lies
      outside its range (``OneOf``, ``AtLeast``, ``Positive``, ``Flag``; the method that
      reads factors checks those), an option that one built-in method alone reads (``learned``'s
      own) is given another value than its default to a method that does not read it, or
      an argument is unknown or given to a method that does not read it.
  """
  if name not in METHODS:
    raise ValueError(f"method must be one of {tuple(METHODS)}, got {name!r}")
  for option in _options.OPTIONS:  # factors: the method that reads it
    value = getattr(options, option.name)
    if (isinstance(option.range, (_options.OneOf, _options.AtLeast, _options.Positive,
                                  _options.Flag)) and value not in option.range):
      raise ValueError(f"{option.name} must {option.range.says}, got {value!r}")
  method = METHODS[name]
  foreign = [n for n in _options.OWN
             if getattr(options, n) != _options.DEFAULTS[n] and n not in method.options]
  if foreign:
    raise ValueError(f"{foreign} are options of method {_options.OWN[foreign[0]]!r} only, not "
                     f"of {name!r}")
  _check_arguments(method, options, arguments)
  return method
