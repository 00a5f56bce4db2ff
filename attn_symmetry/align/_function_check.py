"""The function check: aligned B (and aligned A, when A is re-parametrised) must compute B's (A's)
function on a few random inputs, to a tolerance, before anything is written."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from attn_symmetry import tasks
from attn_symmetry.align._records import FunctionCheckError, Options, Params
from attn_symmetry.models import Model
from attn_symmetry.models import convert
from attn_symmetry.models import safetensors_io


# The function check's random inputs: CHECK_BATCH examples (of CHECK_TOKENS tokens, or at most the
# model's max_len; or images of its size) drawn from jax.random.key(CHECK_SEED).
CHECK_SEED, CHECK_BATCH, CHECK_TOKENS = 0, 2, 16


def check_inputs(model: Model) -> jax.Array:
  """The function check's inputs, drawn from ``jax.random.key(CHECK_SEED)`` as the model reads
  them (``model.input_key``): CHECK_BATCH rows of min(CHECK_TOKENS, max_len) uniform token ids
  [B, T] (int32), or CHECK_BATCH standard normal images [B, S, S, C] (float32)."""
  key, config = jax.random.key(CHECK_SEED), model.config
  if model.input_key == "image":
    return jax.random.normal(key, (CHECK_BATCH, config.image_size, config.image_size,
                                   config.num_channels), jnp.float32)
  return jax.random.randint(key, (CHECK_BATCH, min(CHECK_TOKENS, config.max_len)), 0,
                            config.vocab_size, jnp.int32)


@functools.partial(jax.jit, static_argnums=0)
def logits(model: Model, params: Params, inputs: jax.Array) -> jax.Array:
  """``model``'s float32 logits on ``inputs``: [B, classes] or [B, T, V]."""
  return model.apply(params, inputs)[0].astype(jnp.float32)


def written_dtypes(ckpt: safetensors_io.Checkpoint, model: Model, dtype: str
                   ) -> dict[str, np.dtype]:
  """{parameter path: the dtype ``safetensors_io.save_params`` writes its tensor in}, laid out
  as ``ckpt``: the tensor's stored dtype (``dtype="keep"``) or float32."""
  table, _ = convert.param_table(model.config)
  if dtype == "float32":
    return {path: np.dtype(np.float32) for path in table}
  return {path: safetensors_io.DTYPES[ckpt.tensors[ckpt.names[src.key]].dtype]
          for path, src in table.items()}


def round_to(params: Params, dtypes: Mapping[str, np.dtype]) -> None:
  """Rounds, in place, every leaf of ``params`` whose written dtype (``dtypes``) is narrower
  than float32 (bfloat16, float16) to that dtype's values, kept in float32: the function check
  then evaluates what is written, and writing rounds nothing further. One leaf is replaced at a
  time, so the rounded model never coexists with a whole copy of itself."""
  for path, dtype in dtypes.items():
    if dtype.itemsize >= 4:
      continue
    *parents, name = path.split("/")
    node = params
    for parent in parents:
      node = node[parent]
    node[name] = rounded(node[name], dtype)


def rounded(leaf: jax.Array, dtype: np.dtype) -> jax.Array:
  """``leaf``'s values rounded to ``dtype`` where it is narrower than float32, in float32."""
  return leaf if dtype.itemsize >= 4 else leaf.astype(dtype).astype(jnp.float32)


def default_tolerance(dtypes: Iterable[np.dtype]) -> float:
  """The function check's default relative tolerance for a folder written in ``dtypes``: the
  square root of the machine epsilon of the least precise of them and float32 (the
  computation's): 3.5e-4 in float32, 3.1e-2 with float16 tensors, 8.8e-2 with bfloat16 ones."""
  return max(math.sqrt(float(jnp.finfo(d).eps)) for d in (*dtypes, np.dtype(np.float32)))


def function_difference(reference: jax.Array, logits: jax.Array, tolerance: float
                        ) -> dict[str, float]:
  """How far ``logits`` lie from the ``reference`` logits (both [B, ...]).

  Returns:
    {"max_abs": max |logits - reference|, "scale": max |reference| (the logits' scale),
    "relative": max_abs / scale, "tolerance": the most relative difference allowed}.
  """
  reference, logits = np.asarray(reference, np.float64), np.asarray(logits, np.float64)
  max_abs = float(np.max(np.abs(logits - reference)))
  scale = float(np.max(np.abs(reference)))
  relative = max_abs / scale if scale else (0.0 if max_abs == 0 else math.inf)
  return {"max_abs": max_abs, "scale": scale, "relative": relative, "tolerance": tolerance}


def outputs_name(model: Model) -> str:
  """What the check compares: the logits, or a bare encoder's last hidden states (a model
  without a task head outputs those)."""
  return "last hidden states" if model.task == tasks.FEATURES else "logits"


def function_check(model: Model, options: Options, inputs: jax.Array,
                   reference: Mapping[str, jax.Array],
                   written: Mapping[str, tuple[safetensors_io.Checkpoint, Params]]
                   ) -> dict[str, Any]:
  """Checks that each folder to be written computes its source's function.

  Args:
    model: the zoo model.
    options: the dtype to write (``written_dtypes``) and the tolerance (``function_tolerance``,
      else ``default_tolerance`` of the folder's dtypes).
    inputs: the check's inputs (``check_inputs``).
    reference: {"aligned_b": B's logits, "aligned_a": A's} on ``inputs``.
    written: {folder: (the checkpoint whose layout it takes, its float32 parameters)} for
      "aligned_b" (B') and, if folded, "aligned_a" (A'); each is rounded in place to the dtypes
      it is written in (``round_to``) and then evaluated.

  Returns:
    {"inputs": {"seed", "shape"}, "outputs": what is compared (``outputs_name``), folder:
    ``function_difference`` of its outputs from its reference, for each folder}.

  Raises:
    FunctionCheckError: a folder's relative difference is above its tolerance (or NaN).
  """
  out: dict[str, Any] = {"inputs": {"seed": CHECK_SEED, "shape": list(inputs.shape)},
                         "outputs": outputs_name(model)}
  for folder, (ckpt, params) in written.items():
    dtypes = written_dtypes(ckpt, model, options.dtype)
    round_to(params, dtypes)
    out[folder] = _judge(folder, reference[folder], logits(model, params, inputs), options,
                         dtypes.values(), out["outputs"])
  return out


def streamed_logits(model: Model, ckpt: safetensors_io.Checkpoint, inputs: jax.Array
                    ) -> jax.Array:
  """``model``'s float32 logits on ``inputs`` with ``ckpt``'s parameters read a layer at a
  time (``Model.apply_streamed``), computed in float32."""
  def read(paths):
    return {p: jnp.asarray(x, jnp.float32)
            for p, x in safetensors_io.read_leaves(ckpt, model, paths)}
  return model.apply_streamed(read, inputs).astype(jnp.float32)


def streamed_function_check(model: Model, options: Options, inputs: jax.Array,
                            written: Mapping[str, tuple[safetensors_io.Checkpoint,
                                                        safetensors_io.Checkpoint]]
                            ) -> dict[str, Any]:
  """``function_check`` of folders already written, read back a layer at a time with their
  sources (``streamed_logits``): memory holds one model's parameters outside the layers and one
  layer, never a whole model.

  Args:
    model, options, inputs: as for ``function_check``.
    written: {folder: (its source checkpoint, the written folder)}: "aligned_b" (B, B') and, if
      folded, "aligned_a" (A, A').

  Returns:
    ``function_check``'s dict, with "streamed": True.

  Raises:
    FunctionCheckError: as ``function_check``, or a written tensor holds NaN or Inf.
  """
  out: dict[str, Any] = {"inputs": {"seed": CHECK_SEED, "shape": list(inputs.shape)},
                         "outputs": outputs_name(model), "streamed": True}
  for folder, (source, folder_ckpt) in written.items():
    reference = streamed_logits(model, source, inputs)
    dtypes = written_dtypes(source, model, options.dtype).values()
    try:
      candidate = streamed_logits(model, folder_ckpt, inputs)
    except ValueError as e:  # read_leaves refuses a tensor that is not finite
      what = "aligned B" if folder == "aligned_b" else "aligned A"
      raise FunctionCheckError(f"{what} does not compute its source's function: {e}; nothing "
                               "is written") from None
    out[folder] = _judge(folder, reference, candidate, options, dtypes, out["outputs"])
  return out


def _judge(folder: str, reference: jax.Array, candidate: jax.Array, options: Options,
           dtypes: Iterable[np.dtype], outputs: str) -> dict[str, float]:
  """``function_difference`` of a folder's ``outputs`` (``candidate``) from its source's, against
  the tolerance (``options.function_tolerance``, else ``default_tolerance`` of the folder's
  ``dtypes``).

  Raises:
    FunctionCheckError: the relative difference is above the tolerance (or NaN), naming it.
  """
  tolerance = options.function_tolerance or default_tolerance(set(dtypes))
  d = function_difference(reference, candidate, tolerance)
  if not d["relative"] <= tolerance:
    source = {"aligned_b": "B", "aligned_a": "A"}[folder]
    what = "aligned B" if folder == "aligned_b" else "aligned A (A with its norm scales folded)"
    raise FunctionCheckError(
        f"{what} does not compute {source}'s function: on {reference.shape[0]} random inputs its "
        f"{outputs} differ from {source}'s by up to {d['max_abs']:.4g} ({d['relative']:.3g} of "
        f"their scale {d['scale']:.4g}), above --function-tolerance {tolerance:.3g}; nothing "
        "is written")
  return d
