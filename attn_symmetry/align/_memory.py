"""The memory policy: what an alignment holds, and whether it may.

Every method that ``matching.Method.streamed`` says can be streamed (``streamed_methods``),
without an evaluation or ``--repair``, streams (``streams``): both models are read a group of
tensors at a time (``_sources.Streamed``), and memory holds two groups of each model in float32,
as read and aligned; a method streamed by its activations (``matching.ACTIVATIONS``), which runs
both models a layer at a time on the match data, holds besides both models' hidden states on
every match batch and its sums (``activation_bytes``). Any other method, an evaluation and
``--repair`` hold both whole models twice in float32 (``_sources.Whole``). A', B' and the models they come from
are kept whole, for the function check and ``Alignment.params``, only where four float32 models fit
the budget (``keeps_models``). An alignment whose working set does not fit is refused before any
work (``check_memory``). The budget is ``--memory-budget``, else the machine's memory.
"""

from __future__ import annotations

import math

import jax
import numpy as np

from attn_symmetry import matching
from attn_symmetry import runtime
from attn_symmetry.align._records import InputError, Options, natural_order
from attn_symmetry.models import Model
from attn_symmetry.models import safetensors_io


def streamed_methods() -> list[str]:
  """The methods registered now that can read the models group by group
  (``matching.Method.streamed``)."""
  return [m.name for m in matching.METHODS.values() if m.streamed is not None]


def streams(options: Options) -> bool:
  """Whether the models are read group by group: a method of ``streamed_methods`` without an
  evaluation or ``repair``. Any other method, an evaluation and REPAIR hold both whole models
  (``whole_because``)."""
  return (options.method in streamed_methods() and not options.evaluated
          and not options.repair)


def whole_because(options: Options) -> str:
  """What holds both whole models where the alignment does not stream: the method (not
  streamed: it trains on the interpolated model, say), ``--repair`` (which runs the merged
  model) or the evaluation."""
  if options.method not in streamed_methods():
    return f"--method {options.method} (not streamed)"
  return "--repair" if options.repair else "the evaluation"


def budget(options: Options) -> float:
  """The memory budget in bytes: ``options.memory_budget``, else the machine's memory."""
  return options.memory_budget or runtime.physical_memory()


def gb(nbytes: float) -> str:
  """``nbytes`` in decimal gigabytes, as the messages and ``--memory-budget`` count them."""
  return f"{nbytes / 1e9:.2f} GB"


def whole_bytes(model: Model) -> int:
  """Bytes of one whole model in float32."""
  return 4 * sum(math.prod(s) for s in model.param_shapes.values())


def group_bytes(model: Model) -> tuple[int, tuple[str, ...]]:
  """(bytes in float32, paths) of the largest group that the streamed alignment reads at a
  time (``matching.stream_groups``), of one model."""
  size = lambda paths: 4 * sum(math.prod(model.param_shapes[p]) for p in paths)
  paths = max(matching.stream_groups(model.spec), key=size)
  return size(paths), paths


def activation_bytes(model: Model, options: Options) -> tuple[int, int]:
  """(bytes of both models' hidden states [B, T, D] on every match batch, bytes of the sums)
  that a method streamed by its activations holds besides two groups of each model, in float32:
  ``--match-batches`` batches of ``--batch-size`` examples of ``--seq-len`` tokens (at most the
  model's length; a ViT's patches), and ``matching.activation_statistics_bytes``."""
  config = model.config
  if model.input_key == "image":
    inputs = jax.ShapeDtypeStruct((options.batch_size, config.image_size, config.image_size,
                                   config.num_channels), np.float32)
  else:
    inputs = jax.ShapeDtypeStruct((options.batch_size, min(options.seq_len, config.max_len)),
                                  np.int32)
  hidden = 2 * options.match_batches * 4 * math.prod(model.hidden_shape({model.input_key:
                                                                          inputs}))
  return hidden, matching.activation_statistics_bytes(model.spec)


def keeps_models(model: Model, options: Options) -> bool:
  """Whether A, B and their aligned copies are held whole in float32, four models: always
  where the models are whole (``streams``); when streamed, only where they fit the budget, for the
  function check and ``Alignment.params``."""
  return not streams(options) or 4 * whole_bytes(model) <= budget(options)


def not_kept(model: Model, options: Options) -> str:
  """Why the function check is skipped where the models are not kept and nothing is written."""
  return (f"A, B and their aligned copies in float32 ({gb(4 * whole_bytes(model))}) do not fit "
          f"the memory budget {gb(budget(options))}, and without an output folder nothing is "
          "written to read back a layer at a time")


def check_memory(a: safetensors_io.Checkpoint, b: safetensors_io.Checkpoint, model: Model,
                 options: Options) -> None:
  """Refuses, before any work, an alignment that needs more than the budget: the streamed one
  holds two groups of leaves of each model in float32 (as read and aligned: ``group_bytes``),
  and for a method streamed by its activations the hidden states and sums
  (``activation_bytes``); the whole models
  (``whole_because``) are held twice in float32.

  Raises:
    InputError: naming the checkpoints' size, what the alignment needs, and the budget.
  """
  sizes = f"MODEL_A {gb(a.nbytes)}, MODEL_B {gb(b.nbytes)} as stored"
  most = budget(options)
  says = f"the memory budget {gb(most)} (--memory-budget)"
  if streams(options):
    group, paths = group_bytes(model)
    top = sorted({p.split("/")[0] for p in paths}, key=natural_order)
    largest = (f"the checkpoints ({sizes}) are read a group of tensors at a time, and the "
               f"largest ({', '.join(top)}: {gb(group)} per model in float32) needs "
               f"{gb(4 * group)} as read and aligned")
    if matching.METHODS[options.method].streamed == matching.ACTIVATIONS:
      hidden, sums = activation_bytes(model, options)
      if 4 * group + hidden + sums > most:
        raise InputError(f"{largest}; --method {options.method} adds both models' hidden states on "
                         f"{options.match_batches} match batches ({gb(hidden)}) and its sums "
                         f"({gb(sums)}): {gb(4 * group + hidden + sums)}, above {says}")
    elif 4 * group > most:
      raise InputError(f"{largest}, above {says}")
  elif 4 * whole_bytes(model) > most:
    raise InputError(f"{whole_because(options)} holds both whole models in float32, read and "
                     f"aligned: {gb(4 * whole_bytes(model))} for the checkpoints ({sizes}), "
                     f"above {says}; without an evaluation or --repair, methods "
                     f"{', '.join(streamed_methods())} read one layer at a time")
