"""The load and align stages of a whole-model alignment ("learned", or any method with an
evaluation): both models in float32, g, B' = g . B a group at a time, and the function check."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from attn_symmetry import _eval_files
from attn_symmetry import group_action
from attn_symmetry import matching
from attn_symmetry import runtime
from attn_symmetry import spec as spec_lib
from attn_symmetry.align import _distances, _function_check
from attn_symmetry.align._clock import Stage
from attn_symmetry.align._records import Aligned, InputError, Inputs, Loaded, Options, Params
from attn_symmetry.models import Model
from attn_symmetry.models import safetensors_io


def load(inputs: Inputs) -> Loaded:
  """The load stage: both models' float32 parameters, one stored tensor at a time.

  Raises:
    InputError: a tensor holds NaN or Inf (``safetensors_io.load_params``).
  """
  try:
    return Loaded(safetensors_io.load_params(inputs.a, inputs.model),
                  safetensors_io.load_params(inputs.b, inputs.model))
  except ValueError as e:
    raise InputError(str(e)) from None


def _learned_options(model: Model, inputs: Inputs, say: Callable[[str], None]) -> dict[str, Any]:
  """``align_model``'s loss, batches and progress for method "learned": the mean loss of the
  evaluation file's first half, the iterate chosen on the next quarter
  (``_check.split_for_learning``)."""
  metrics = _eval_files.metric_fn(model)

  def loss_fn(params, batch):
    sums = metrics(params, batch)
    return sums["loss"] / sums["count"]

  def progress(line):
    say(f"learned: step {line['step']}/{line['steps']}, held-out barrier "
        f"{line['holdout_barrier']:.4g} (best {line['best_holdout_barrier']:.4g})")

  return dict(loss_fn=loss_fn, batches=inputs.train, holdout_batches=inputs.holdout,
              progress=progress)


def _match(inputs: Inputs, options: Options, loaded: Loaded, say: Callable[[str], None]
           ) -> tuple[dict[str, Any], dict[str, Any]]:
  """(g, info) of ``matching.align_model`` of B to A on the scope, with the C heap's free pages
  released between compiling a program and running it."""
  extra = _learned_options(inputs.model, inputs, say) if options.method == "learned" else {}
  with runtime.release_memory_after_compiles():
    element, info = matching.align_model(inputs.model.spec, loaded.a, loaded.b,
                                         scope=inputs.scope, method=options.method,
                                         **options.matching, **extra)
    jax.block_until_ready(element)
  return element, info


def align(inputs: Inputs, options: Options, loaded: Loaded, stage: Stage) -> Aligned:
  """The align stage: g (``_match``, timed as the stage's part "align_model"), A and B folded
  where g needs it, B' = g . B, the distances before and after, and the function check
  (``_function_check.function_check``, the part "function_check"): B's logits (and A's, if
  folded) on a few random inputs, taken before B (and A) are released and compared with those
  of B' (and A') as they are written.

  Without an evaluation, A and B are taken out of ``loaded`` and each of B's groups is released
  as soon as its part of B' is computed; with one, they stay there for the "before" path.

  Raises:
    FunctionCheckError: B' (or A') does not compute B's (or A's) function to the tolerance.
  """
  with stage.part("align_model", "matching"):
    element, info = _match(inputs, options, loaded, stage.say)
  model, keep = inputs.model, inputs.batches is not None
  params_a, params_b = (loaded.a, loaded.b) if keep else loaded.take()
  folded = bool(info.get("folded_norm_scales"))
  check_inputs = _function_check.check_inputs(model)
  with stage.part("function_check", "function check"):
    reference = {"aligned_b": _function_check.logits(model, params_b, check_inputs)}
    if folded:
      reference["aligned_a"] = _function_check.logits(model, params_a, check_inputs)
  if folded:
    params_a = group_action.fold_norm_scales(model.spec, params_a)
    params_b = group_action.fold_norm_scales(model.spec, params_b)
  before = _distances.distances(params_a, params_b)
  aligned = _apply_by_group(model.spec, params_b, element, consume=not keep or folded)
  del params_b
  after = _distances.distances(params_a, aligned)
  written = {"aligned_b": (inputs.b, aligned)} | ({"aligned_a": (inputs.a, params_a)} if folded
                                                  else {})
  with stage.part("function_check", "function check"):
    function = _function_check.function_check(model, options, check_inputs, reference, written)
  return Aligned(element, info, folded, params_a, aligned, {"before": before, "after": after},
                 function)


def _apply_by_group(spec: spec_lib.SymmetrySpec, params: Params, element: dict[str, Any], *,
                    consume: bool) -> Params:
  """g . params (``group_action.apply_model``), one top-level group of leaves (``layers_i``,
  ``embed``, ...) at a time, op by op: under one jit, jaxlib 0.10's CPU LAPACK kernels (the
  sites' inverses) could deadlock when two ran side by side. With ``consume``, each group is
  removed from ``params`` once transformed, so that one model and one group are held, not two
  models (every attention site lies inside one group). The element is checked once, not once
  per group."""
  group_action.check_model_element(spec, element)
  out: Params = {}
  for group in list(params):
    part = spec.part(spec_lib.flatten({group: params[group]}))
    names = set(part.factors) | set(part.attention)
    out[group] = group_action.apply_model(part, {group: params[group]},
                                          {k: v for k, v in element.items() if k in names},
                                          check_element=False)[group]
    jax.block_until_ready(out[group])
    if consume:
      del params[group]
  return out
