"""The check stage (``check``): every problem with the options, the folders, the memory budget
(``_memory.check_memory``), the evaluation file or the match data is refused with a one-line
``InputError`` before anything is written; the options first, from the options alone
(``check_options``), then the files (``_inspect``)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from attn_symmetry.align import _eval_files, _memory
from attn_symmetry import matching
from attn_symmetry import repair as repair_lib
from attn_symmetry import tasks
from attn_symmetry.align._records import (DTYPES, MATCHING_OPTIONS, AlignWarning, InputError,
                                          Inputs, Options)
from attn_symmetry.models import SCOPES, Model
from attn_symmetry.models import convert
from attn_symmetry.models import safetensors_io


def check_options(options: Options) -> None:
  """Refuses bad options from the options alone: no file is read and nothing is imported (the
  methods are those ``matching.METHODS`` holds now).

  Raises:
    InputError: the first bad option, naming its command-line flag.
  """
  if options.method not in matching.METHODS:
    raise InputError(f"--method must be one of {', '.join(matching.METHODS)}, got "
                     f"{options.method!r}")
  if matching.LOSS in options.needs and not options.evaluated:
    raise InputError(f"--method {options.method} trains on the task loss of a checkpoint with a "
                     "task head, and is judged on an evaluation file: give --eval-text or "
                     "--eval-images")
  unknown = sorted(set(options.matching) - set(MATCHING_OPTIONS))
  if unknown:
    raise InputError(f"unknown matching options {unknown}; known: {', '.join(MATCHING_OPTIONS)}")
  _check_matching_values(options.matching)
  _check_factors(options)
  _check_options_read(options)
  _check_scope(options.scope)
  if options.merge is not None and not 0.0 <= options.merge <= 1.0:
    raise InputError(f"--merge must lie in [0, 1], got {options.merge}")
  _check_match_data(options)
  if options.dtype not in DTYPES:
    raise InputError(f"--dtype must be one of {', '.join(DTYPES)}, got {options.dtype!r}")
  tolerance = options.function_tolerance
  if tolerance is not None and (isinstance(tolerance, bool) or
                                not isinstance(tolerance, (int, float)) or not tolerance > 0):
    raise InputError(f"--function-tolerance must be a positive number, got {tolerance!r}")
  budget = options.memory_budget
  if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float))
                             or not budget > 0):
    raise InputError(f"--memory-budget must be a positive number of GB, got {budget!r}")
  if options.eval_text is not None and options.eval_images is not None:
    raise InputError("give --eval-text or --eval-images, not both")
  for name, least in (("num_lambdas", 3), ("batch_size", 1), ("seq_len", 1),
                      ("eval_batches", 1), ("match_batches", 1), ("seed", 0)):
    value = getattr(options, name)
    if int(value) != value or value < least:
      raise InputError(f"{Options.flag(name)} must be an integer >= {least}, got {value}")


_DATA = (matching.ACTIVATIONS, matching.LOSS)  # the inputs that --match-data supplies


def orthogonal_residual(options: Options) -> bool:
  """Whether the options ask for the O(d - 1) residual of a pre-LayerNorm stream
  (``--residual orthogonal``)."""
  return options.matching.get("residual", matching.MatchOptions().residual) == "orthogonal"


def _match_data_readers() -> list[str]:
  """Who reads ``--match-data``: "--method activation", "--method learned" (the methods that
  need ``matching.ACTIVATIONS`` or ``matching.LOSS``), then the option values under which
  another method does."""
  readers = [m for m in matching.METHODS.values() if set(_DATA) & set(m.inputs)]
  return ([f"--method {m.name}" for m in readers]
          + [f"{flag(w.option)} {w.value}" for m in matching.METHODS.values() for w in m.when
             if m not in readers and set(_DATA) & set(w.inputs)])


def _check_match_data(options: Options) -> None:
  """``--match-data`` is given exactly where something reads it: a method that needs the
  models' activations with its options (``Options.needs``), one that trains on a loss (which
  trains on it where it is given), ``--repair`` (which needs ``--merge`` too)."""
  reads = bool(set(_DATA) & set(options.needs))
  if matching.ACTIVATIONS in options.needs and options.match_data is None:
    method = matching.METHODS[options.method]
    why = "".join(f" with {flag(w.option)} {w.value}" for w in method.when
                  if matching.ACTIVATIONS in w.inputs and matching.ACTIVATIONS not in method.inputs)
    raise InputError(f"--method {options.method}{why} reads the models' activations on data: "
                     "give --match-data FILE")
  if options.repair:
    if options.merge is None:
      raise InputError("--repair repairs the merged model: give --merge LAMBDA")
    if options.match_data is None:
      raise InputError("--repair resets the merged model's channel statistics measured on "
                       "data: give --match-data FILE")
  elif options.match_data is not None and not reads:
    raise InputError(f"--match-data is read by {', '.join(_match_data_readers())} and --repair "
                     f"only; --method is {options.method!r} without --repair")


def flag(option: str) -> str:
  """The command-line flag of a matching option: ``learning_rate`` -> ``--learning-rate``."""
  return "--" + option.replace("_", "-")


def _check_matching_values(given: dict[str, Any]) -> None:
  """Refuses a matching option outside its range (``matching.OPTIONS``)."""
  for option in matching.OPTIONS:
    if option.name in given and given[option.name] not in option.range:
      raise InputError(f"{flag(option.name)} must {option.range.says}, got "
                       f"{given[option.name]!r}")


def options_used(method: str, given: dict[str, Any]) -> dict[str, Any]:
  """{option: value} of every matching option ``method`` reads (``matching.Method.reads``):
  the value given, else its default in ``matching.MatchOptions`` (what ``align_model`` passes
  on)."""
  defaults = matching.MatchOptions()
  return {o: given[o] if o in given else getattr(defaults, o)
          for o in matching.METHODS[method].reads(given)}


def _check_options_read(options: Options) -> None:
  """Refuses a matching option that the method (and the options it is given) would ignore."""
  method = matching.METHODS[options.method]
  read = method.reads(options.matching)
  for option in matching.OPTIONS:
    if option.name not in options.matching or option.name in read:
      continue
    if option.name in method.options:  # named, but its condition (``requires``) is not met
      need = option.requires
      value = options.matching.get(need.option, getattr(matching.MatchOptions(), need.option))
      raise InputError(f"{flag(option.name)} is {need.what}; {flag(need.option)} is {value!r} "
                       f"(give {flag(need.option)} {need.value}, or no {flag(option.name)})")
    reads = ", ".join(flag(o) for o in read) or "no matching option"
    raise InputError(f"{flag(option.name)} is not read by --method {options.method} (it reads "
                     f"{reads})")


def _check_factors(options: Options) -> None:
  """``--factors``: for ``--method learned`` (or a registered method that reads it) only (its
  range is ``_check_matching_values``'s check, which of them the model has in the scope
  ``_inspect``'s)."""
  if "factors" not in options.matching:
    return
  if "factors" not in matching.METHODS[options.method].options:
    readers = " or ".join(f"--method {m.name}" for m in matching.METHODS.values()
                          if "factors" in m.options)
    raise InputError(f"--factors chooses what {readers} trains; --method is {options.method!r}")


def _scope_prefixes(scope: str | Sequence[str]) -> list[str] | None:
  """The parameter path prefixes that ``scope`` lists, or None for a name of ``models.SCOPES``
  (whose prefixes depend on the model: ``Model.scope_paths``)."""
  if isinstance(scope, str):
    return None if scope in SCOPES else [s for s in scope.split(",") if s]
  return list(scope)


def _check_scope(scope: str | Sequence[str]) -> None:
  """Refuses a scope that lists no prefix, or one that is not a string (whether each prefix
  names parameters of the model is ``_scope``'s check)."""
  prefixes = _scope_prefixes(scope)
  if prefixes is None:
    return
  for p in prefixes:
    if not isinstance(p, str):
      raise InputError(f"--scope: scope entries must be path prefixes (str), got {p!r} "
                       f"(scopes: {', '.join(SCOPES)}, or path prefixes)")
  if not prefixes:
    raise InputError(f"--scope {','.join(prefixes)} holds no whole attention site or factor to "
                     "align")


def check_extras(options: Options) -> None:
  """Refuses an evaluation whose packages (the ``align`` extra) are not installed: the
  tokenizer for text, PIL for images, matplotlib for the plot of the curves."""
  needed = {"tokenizers": options.eval_text is not None, "PIL": options.eval_images is not None,
            "matplotlib": options.evaluated and options.out is not None}
  missing = [m for m, need in needed.items() if need and importlib.util.find_spec(m) is None]
  if missing:
    raise InputError(f"the evaluation needs {', '.join(missing)}, which is not installed: "
                     f"pip install 'attn_symmetry[align]'")


def _architecture_difference(a: safetensors_io.Checkpoint, b: safetensors_io.Checkpoint
                             ) -> str | None:
  """None if A and B have one architecture, else what differs first: a config.json key whose
  value in B changes A's architecture (``model_type`` before the others, so that two families
  are named as such), or else the field of the derived config."""
  if a.config == b.config:
    return None
  head = a.config.head
  for key in sorted(set(a.hf_config) | set(b.hf_config), key=lambda k: (k != "model_type", k)):
    va, vb = a.hf_config.get(key), b.hf_config.get(key)
    if va == vb:
      continue
    swapped = {k: v for k, v in a.hf_config.items() if k != key}
    if key in b.hf_config:
      swapped[key] = vb
    try:
      changes = convert.config_from_hf(swapped, head) != a.config
    except ValueError:
      changes = True
    if changes:
      return f"config.json's {key} is {va!r} in {a.name} but {vb!r} in {b.name}"
  field = next(f.name for f in dataclasses.fields(a.config)
               if getattr(a.config, f.name) != getattr(b.config, f.name))
  return (f"{field} is {getattr(a.config, field)!r} in {a.name} but {getattr(b.config, field)!r} "
          f"in {b.name}")


def _inside(path: str, folder: str) -> bool:
  """Whether real path ``path`` is ``folder`` or lies inside it."""
  return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _check_out(out: str, overwrite: bool, inputs: Sequence[safetensors_io.Checkpoint]) -> None:
  """Refuses an output folder that overlaps an input folder, or holds a file that is read (a
  weight file may be a link to a file elsewhere), or is not a writable, empty folder (unless
  ``overwrite``)."""
  real = os.path.realpath(out)
  for ckpt in inputs:
    model = os.path.realpath(ckpt.path)
    if _inside(real, model) or _inside(model, real):
      raise InputError(f"--out {out} overlaps {ckpt.name}: nothing is written in or around an "
                       "input folder")
    for file in ckpt.files_read:
      if _inside(file, real):
        raise InputError(f"--out {out} holds {file}, which {ckpt.name} reads: nothing is written "
                         "where an input file lies")
  if os.path.exists(out) and not os.path.isdir(out):
    raise InputError(f"--out {out} is a file")
  if os.path.isdir(out) and os.listdir(out) and not overwrite:
    raise InputError(f"--out {out} already holds {len(os.listdir(out))} entries; pass --overwrite "
                     "to replace this tool's outputs there")
  parent = real
  while not os.path.exists(parent):
    parent = os.path.dirname(parent)
  if not os.access(parent, os.W_OK | os.X_OK):
    raise InputError(f"--out {out}: {parent} is not writable")


def _scope(model: Model, scope: str | Sequence[str]) -> list[str]:
  """Parameter path prefixes of a scope name (``models.SCOPES``) or of prefixes."""
  prefixes = _scope_prefixes(scope)
  if prefixes is None:
    prefixes = model.scope_paths(scope)
  try:
    names = matching.active_names(model.spec, prefixes)
  except ValueError as e:
    raise InputError(f"--scope: {e} (scopes: {', '.join(SCOPES)}, or path prefixes)") from None
  if not names:
    raise InputError(f"--scope {','.join(prefixes)} holds no whole attention site or factor to "
                     "align")
  return prefixes


def factors_in_scope(model: Model, prefixes: list[str], factors: Sequence[str]) -> None:
  """Refuses a factor of ``--factors`` that ``model`` has no symmetry for in the scope."""
  try:
    matching.learned_factors(model.spec, matching.active_names(model.spec, prefixes), factors)
  except ValueError as e:
    message = str(e).removeprefix("factors: ")
    raise InputError(f"--factors: {message} ({model.config.family} model, scope "
                     f"{','.join(prefixes) or 'full'})") from None


# The parts of a tokenizer.json that decide what it does, each by its keys there: two files
# that agree on every part tokenize alike, however their bytes differ (indentation, key order,
# merges written as "a b" or as ["a", "b"]; padding and truncation are settings of a call).
TOKENIZER_PARTS = {"vocabulary": ("model", "vocab"), "merges": ("model", "merges"),
                   "model type": ("model", "type"), "unknown token": ("model", "unk_token"),
                   "special tokens": ("added_tokens",), "normalisation": ("normalizer",),
                   "pre-tokenisation": ("pre_tokenizer",), "post-processing": ("post_processor",),
                   "decoding": ("decoder",)}


def _tokenizer_part(tokenizer: dict[str, Any], keys: tuple[str, ...]) -> Any:
  """The part of a parsed tokenizer.json at ``keys`` (None where absent), in one form: merges
  as pairs, added tokens in id order."""
  node: Any = tokenizer
  for key in keys:
    node = node.get(key) if isinstance(node, dict) else None
  if keys == ("model", "merges") and node is not None:
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in node]
  if keys == ("added_tokens",) and node is not None:
    return sorted(node, key=lambda token: token.get("id", -1))
  return node


def _same_tokenizer(a: safetensors_io.Checkpoint, b: safetensors_io.Checkpoint) -> None:
  """Refuses two folders whose tokenizer.json files tokenize differently, naming the part
  (``TOKENIZER_PARTS``) in which they differ; their bytes are not compared."""
  files = [os.path.join(c.path, "tokenizer.json") for c in (a, b)]
  if not all(os.path.isfile(f) for f in files):
    return
  parsed = []
  for checkpoint, file in zip((a, b), files):
    try:
      with open(file, encoding="utf-8") as f:
        parsed.append(json.load(f))
    except (OSError, ValueError) as e:
      raise InputError(f"{checkpoint.name}: tokenizer.json does not parse ({e})") from None
  differ = [name for name, keys in TOKENIZER_PARTS.items()
            if _tokenizer_part(parsed[0], keys) != _tokenizer_part(parsed[1], keys)]
  if differ:
    raise InputError(f"{a.name} and {b.name} have tokenizers that differ in their "
                     f"{', '.join(differ)} (tokenizer.json)")


def _read_pair(path_a: str | os.PathLike, path_b: str | os.PathLike, *, untie: bool = False
               ) -> tuple[safetensors_io.Checkpoint, safetensors_io.Checkpoint, Model, bool]:
  """Both folders' configs and tensor tables, checked to be of one architecture whose zoo model
  their tensors fit (ValueError naming the folder otherwise), and whether a head was untied.

  With ``untie`` (``--residual orthogonal``, whose stream must be read through LayerNorms only,
  and whose ``canonical_form`` projects the embedding that a tied head reads), a tied head of
  a pre-LayerNorm model is untied first (``safetensors_io.untie_head``), so that a tied A and
  a B untied by an earlier alignment are one architecture; a post-LayerNorm model stays as it
  is (``_check_residual`` refuses it)."""
  a = safetensors_io.Checkpoint(path_a, "MODEL_A " + os.fspath(path_a))
  b = safetensors_io.Checkpoint(path_b, "MODEL_B " + os.fspath(path_b))
  tied = a.config.tied_embeddings or b.config.tied_embeddings
  if untie and not a.config.post_norm:
    a, b = safetensors_io.untie_head(a), safetensors_io.untie_head(b)
  difference = _architecture_difference(a, b)
  if difference:
    raise InputError(f"MODEL_A and MODEL_B have different architectures: {difference}")
  model = Model(a.config)
  safetensors_io.check_layout(a, model)
  safetensors_io.check_layout(b, model)
  return a, b, model, tied and not model.config.tied_embeddings


def _check_residual(model: Model, prefixes: list[str]) -> None:
  """Refuses ``--residual orthogonal`` for a model whose stream in the scope cannot take the
  O(d - 1) factor (``matching.residual_spec``), in one line naming why."""
  cfg = model.config
  if cfg.post_norm:
    raise InputError(f"--residual orthogonal: {cfg.family} is post-LayerNorm (a LayerNorm sits "
                     "on the residual stream itself, which only permutations commute with); "
                     "give --residual permutation")
  try:
    matching.residual_spec(model.spec, "orthogonal", matching.active_names(model.spec, prefixes))
  except ValueError as e:
    raise InputError(f"--residual orthogonal: {e}; give --residual permutation") from None


def _evaluation_batches(options: Options, a: safetensors_io.Checkpoint,
                        b: safetensors_io.Checkpoint, model: Model
                        ) -> list[dict[str, np.ndarray]] | None:
  """The evaluation file's batches (``_task_batches``), or None without one."""
  if options.eval_text is not None:
    _same_tokenizer(a, b)
    return _task_batches(options.eval_text, "--eval-text", options, a, model,
                         max_batches=options.eval_batches, images=False)
  if options.eval_images is not None:
    return _task_batches(options.eval_images, "--eval-images", options, a, model,
                         max_batches=options.eval_batches, images=True)
  return None


def _task_batches(path: str, flag: str, options: Options, a: safetensors_io.Checkpoint,
                  model: Model, *, max_batches: int, images: bool) -> list[dict[str, np.ndarray]]:
  """The batches of ``path`` (named ``flag`` in the errors) as an evaluation file is read,
  labels and all (``_eval_files``, with A's tokenizer or image processor config): an image
  folder with ``images``, else a text file."""
  if images:
    return _eval_files.image_batches(path, a.path, model, a.hf_config,
                                     batch_size=options.batch_size, max_batches=max_batches,
                                     flag=flag)
  return _eval_files.text_batches(path, a.path, model, a.hf_config,
                                  batch_size=options.batch_size, seq_len=options.seq_len,
                                  max_batches=max_batches, flag=flag)


def _match_batches(options: Options, a: safetensors_io.Checkpoint,
                   b: safetensors_io.Checkpoint, model: Model
                   ) -> list[dict[str, np.ndarray]] | None:
  """The match data's batches (``_eval_files.match_batches``, with A's tokenizer or image
  processor config), or None without ``--match-data``."""
  if options.match_data is None:
    return None
  _same_tokenizer(a, b)
  return _eval_files.match_batches(options.match_data, a.path, model, a.hf_config,
                                   batch_size=options.batch_size, seq_len=options.seq_len,
                                   max_batches=options.match_batches)


def _check_task_loss(model: Model, method: str) -> None:
  """Refuses a method that trains on a loss for a checkpoint that has none: a bare encoder,
  whose output is its last hidden states."""
  if model.task == tasks.FEATURES:
    cfg = model.config
    without = ", ".join(m.name for m in matching.METHODS.values()
                        if matching.LOSS not in m.every_input)
    raise InputError(f"--method {method} trains on a task loss, which this checkpoint "
                     f"({cfg.family} without a task head, {cfg.head!r}) does not have: align "
                     f"a checkpoint with a task head, or use a method that needs none ({without})")


def _training_batches(options: Options, a: safetensors_io.Checkpoint, model: Model
                      ) -> tuple[list[Any], list[Any]]:
  """(training, held-out) batches of ``--match-data`` for a method that trains on a loss, read
  as an evaluation file is (labels and all) with ``--match-batches`` at most: the last quarter
  (at least one batch) held out to choose the iterate, the rest to train on.

  Raises:
    InputError: fewer than 2 batches.
  """
  batches = _task_batches(options.match_data, "--match-data", options, a, model,
                          max_batches=options.match_batches, images=model.input_key == "image")
  if len(batches) < 2:
    raise InputError(f"--method {options.method} needs at least 2 batches of --match-data "
                     f"(training, held out); {options.match_data} gives {len(batches)}")
  held = max(1, len(batches) // 4)
  return batches[:-held], batches[-held:]


def _check_repair(model: Model) -> None:
  """Refuses ``--repair``, and ``--learn-repair true`` (REPAIR inside the learned objective),
  for a family with nothing to fold REPAIR's correction into (one line naming the family:
  ``repair.repair``'s own check, run before any work)."""
  repair_lib.check_model(model)


def split_for_learning(batches: list[Any], method: str
                       ) -> tuple[list[Any], list[Any], list[Any]]:
  """The split of the evaluation batches for ``method``, which needs a loss: (curve, training,
  held out), the first half for training, the next quarter held out to choose the iterate,
  the rest for the curve.

  Raises:
    InputError: fewer than 3 batches.
  """
  if len(batches) < 3:
    raise InputError(f"--method {method} needs at least 3 evaluation batches (training, held "
                     f"out, curve); the data gives {len(batches)}")
  train, holdout = len(batches) // 2, (len(batches) - len(batches) // 2) // 2
  return batches[train + holdout:], batches[:train], batches[train:train + holdout]


def _inspect(path_a: str | os.PathLike, path_b: str | os.PathLike, options: Options) -> Inputs:
  """The checks that read files: both folders (``_read_pair``), the output folder, the scope on
  the model, the evaluation file and its batches. Nothing is written.

  Raises:
    InputError: the first problem (every ValueError of the readers becomes one).
  """
  try:
    a, b, model, untied = _read_pair(path_a, path_b, untie=orthogonal_residual(options))
    real = os.path.realpath(a.path)
    if real == os.path.realpath(b.path):
      warnings.warn(f"MODEL_A and MODEL_B are the same folder ({real}): B is aligned to itself",
                    AlignWarning, stacklevel=2)
    _memory.check_memory(a, b, model, options)
    if options.out is not None:
      _check_out(options.out, options.overwrite, (a, b))
    prefixes = _scope(model, options.scope)
    if orthogonal_residual(options):
      _check_residual(model, prefixes)
    if "factors" in options.matching:
      factors_in_scope(model, prefixes, options.matching["factors"])
    if options.repair or matching.REPAIR in options.needs:
      _check_repair(model)
    if matching.LOSS in options.needs:
      _check_task_loss(model, options.method)
    batches = _evaluation_batches(options, a, b, model)
    match = _match_batches(options, a, b, model)
    if matching.LOSS not in options.needs:
      return Inputs(a, b, model, prefixes, batches, match=match, untied_head=untied)
    if options.match_data is None:
      return Inputs(a, b, model, prefixes, *split_for_learning(batches, options.method),
                    match=match, untied_head=untied)
    return Inputs(a, b, model, prefixes, batches, *_training_batches(options, a, model),
                  match=match, untied_head=untied)
  except InputError:
    raise
  except ValueError as e:
    raise InputError(str(e)) from None


def check(path_a: str | os.PathLike, path_b: str | os.PathLike, options: Options) -> Inputs:
  """The check stage: the options (``check_options``), the evaluation's packages
  (``check_extras``), then the files (``_inspect``)."""
  check_options(options)
  check_extras(options)
  return _inspect(path_a, path_b, options)


def summary(inputs: Inputs) -> str:
  """The check stage's line: the family, the task, the parameters, both checkpoints' dtypes
  and sizes; and, where ``--residual orthogonal`` untied the head, that it did."""
  a, b = inputs.a, inputs.b
  return (f"{a.config.family} ({inputs.model.task}), {inputs.parameters / 1e6:.2f}M parameters; "
          f"A {'+'.join(a.dtypes)} {a.nbytes / 1e6:.1f} MB, B {'+'.join(b.dtypes)} "
          f"{b.nbytes / 1e6:.1f} MB" +
          ("; head untied for --residual orthogonal (lm_head.weight a copy of the embedding, "
           "tie_word_embeddings false in every folder written)" if inputs.untied_head else ""))
