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
from experiments import inputs

Params = dict[str, Any]


def batch_metrics(model: models.Model, params: Params, batch: Mapping[str, jax.Array]
                  ) -> dict[str, jax.Array]:
  """Summed cross-entropy, correct predictions and the number of predictions.

  The inputs are ``batch[model.input_key]``. Classification: one prediction
  per example. Language modelling: one per token, inputs ``tokens[:, :-1]``
  and targets ``tokens[:, 1:]``. Examples
  with ``valid`` False (padding of the last evaluation batch) count zero.
  Pure and jittable.

  Returns:
    {"loss": sum of cross-entropies, "correct": number of correct argmax
    predictions, "count": number of predictions}, float32 scalars.
  """
  if model.task == tasks.LM:
    tokens = batch[model.input_key]
    logits, _ = model.apply(params, tokens[:, :-1])
    labels = tokens[:, 1:]
  else:
    logits, _ = model.apply(params, batch[model.input_key], mask=batch.get("mask"))
    labels = batch["label"]
  valid = batch.get("valid", jnp.ones(labels.shape[:1], bool))
  weights = jnp.broadcast_to(valid.reshape(valid.shape + (1,) * (labels.ndim - 1)),
                             labels.shape).astype(jnp.float32)
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
  params, total = jax.device_put(
      (params, dict.fromkeys(("loss", "correct", "count"), np.float32(0))), inputs.replicated(mesh))
  empty = True
  for batch in batches:
    total, empty = step(params, inputs.shard_batch(batch, mesh), total), False
  if empty:
    raise ValueError("evaluate got no batches")
  return _means(inputs.to_host(total))
