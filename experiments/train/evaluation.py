"""Loss and accuracy of a model on batches: the training objective and the evaluation.

``batch_metrics`` is pure and jittable (the training step differentiates it;
the study evaluates it along interpolation paths); ``evaluate`` sums it over
one pass of evaluation batches on the device mesh.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from attn_symmetry import models
from attn_symmetry import tasks
from experiments.train import inputs

Params = dict[str, Any]
_MASK_KEY = 0  # the seed of every example's hidden positions (``masked_positions``)


def masked_positions(tokens: jax.Array, fraction: float = tasks.MLM_MASK_FRACTION) -> jax.Array:
  """[B, T] bool: the positions that a masked-LM example hides, from int tokens [B, T].

  Each position is hidden with probability ``fraction``, drawn from a key that
  folds a hash of the example's tokens into one fixed seed: an example hides the
  same positions whenever it is met (in training, at every point of an
  interpolation path, in every run), and different examples hide independent
  ones. Pure and jittable.
  """
  t = tokens.shape[-1]
  # h = sum_t tokens[t] * w_t mod 2^32, w_t odd and distinct (Knuth's multiplicative constant).
  weights = jnp.arange(t, dtype=jnp.uint32) * jnp.uint32(2654435761) + jnp.uint32(1)
  hashes = jnp.sum(tokens.astype(jnp.uint32) * weights, axis=-1, dtype=jnp.uint32)
  keys = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.key(_MASK_KEY), hashes.reshape(-1))
  draws = jax.vmap(lambda k: jax.random.uniform(k, (t,)))(keys)
  return draws.reshape(tokens.shape) < fraction


def mask_token(model: models.Model) -> int:
  """The id that replaces a hidden byte of a masked-LM model: its vocabulary's last, one past
  the data set's (``inputs.model_overrides``)."""
  return model.config.vocab_size - 1


def _read(model: models.Model, batch: Mapping[str, Any]):
  """(inputs, targets, weights, mask) of a batch as ``batch_metrics`` reads it: the inputs
  ``batch[model.input_key]`` as ``tasks.model_batch`` reads them, and the text's key mask
  (None but for classified text)."""
  raw, mask = batch[model.input_key], None
  if model.task == tasks.MLM:
    tokens = raw[:, :-1]  # a window of T + 1 tokens, as language models read, holds T
    inputs, labels, counted = tasks.model_batch(model.task, tokens, hidden=masked_positions(tokens),
                                                mask_id=mask_token(model))
  elif model.task == tasks.LM:
    inputs, labels, counted = tasks.model_batch(model.task, raw)
  else:
    inputs, labels, counted = tasks.model_batch(model.task, raw, labels=batch["label"])
    mask = batch.get("mask")  # which tokens of a text are real (padding follows)
  return inputs, labels, counted, mask


def model_inputs(model: models.Model, batch: Mapping[str, Any]) -> dict[str, Any]:
  """{``model.input_key``: what the model reads from ``batch`` [B, T] or [B, S, S, C], and
  "mask" [B, T] where the text has one}: a batch of the data pipeline as ``Model.apply``
  takes it, for the passes that measure activations (REPAIR, activation matching)."""
  inputs, _, _, mask = _read(model, batch)
  return {model.input_key: inputs} | ({} if mask is None else {"mask": mask})


def batch_metrics(model: models.Model, params: Params, batch: Mapping[str, jax.Array]
                  ) -> dict[str, jax.Array]:
  """Summed cross-entropy, correct predictions and the number of predictions.

  The inputs are ``batch[model.input_key]``, read as ``tasks.model_batch``
  says. Classification: one prediction per example. Language modelling: one
  per token, inputs ``tokens[:, :-1]`` and targets ``tokens[:, 1:]``. Masked
  language modelling (BERT's MLM head, on the same windows of T + 1 tokens):
  the first T tokens with the positions of ``masked_positions`` replaced by
  ``mask_token``, one prediction per hidden position (its original token).
  Examples with ``valid`` False (padding of the last evaluation batch) count
  zero. Pure and jittable.

  Returns:
    {"loss": sum of cross-entropies, "correct": number of correct argmax
    predictions, "count": number of predictions}, float32 scalars.
  """
  inputs, labels, counted, mask = _read(model, batch)
  logits, _ = model.apply(params, inputs, mask=mask)
  valid = batch.get("valid", jnp.ones(labels.shape[:1], bool))
  weights = (counted & valid.reshape(valid.shape + (1,) * (labels.ndim - 1))).astype(jnp.float32)
  logits = logits.astype(jnp.float32)
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  correct = (jnp.argmax(logits, -1) == labels).astype(jnp.float32)
  return {"loss": jnp.sum(losses * weights), "correct": jnp.sum(correct * weights),
          "count": jnp.sum(weights)}


def _means(sums: Mapping[str, Any]) -> dict[str, float]:
  count = float(sums["count"])
  return {"loss": float(sums["loss"]) / count, "accuracy": float(sums["correct"]) / count}


_EVAL_STEPS: dict[Any, Any] = {}


def evaluate(model: models.Model, params: Params, batches: Iterable[inputs.Batch], *,
             mesh: jax.sharding.Mesh | None = None) -> dict[str, float]:
  """Mean loss and accuracy of ``params`` over ``batches`` (e.g. ``eval_batches``).

  One jitted step per model config (compiled once per batch shape) adds each
  batch's sums to the running ones, which stay on the devices until the end.

  Returns:
    {"loss": mean cross-entropy per prediction, "accuracy": fraction correct}.
  """
  mesh = inputs.create_mesh() if mesh is None else mesh
  step = _EVAL_STEPS.get(model.config)
  if step is None:
    def step(params, batch, total):
      return jax.tree.map(jnp.add, total, batch_metrics(model, params, batch))
    step = _EVAL_STEPS[model.config] = jax.jit(step)
  params = inputs.on_mesh(params, mesh)  # split parameters (train.param_sharding) stay split
  total = inputs.replicate(dict.fromkeys(("loss", "correct", "count"), np.float32(0)), mesh)
  empty = True
  for batch in batches:
    total, empty = step(params, inputs.shard_batch(batch, mesh), total), False
  if empty:
    raise ValueError("evaluate got no batches")
  return _means(inputs.to_host(total))
