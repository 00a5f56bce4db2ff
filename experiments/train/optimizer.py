"""The optimiser and the training step of a run.

``create_optimizer``: AdamW with warmup and cosine decay over the run's
schedule, on the trainable leaves only. ``make_train_step``: one jitted step
over a batch split along the mesh's "data" axis, the state placed as
``config.train.param_sharding`` says (``inputs.placement``). ``optimizer_and_step``
gives both, compiled once per process for the runs that share them.
"""

from __future__ import annotations

from typing import Any

import jax
import ml_collections
import optax

from attn_symmetry import models
from attn_symmetry import spec as spec_lib
from experiments.train import evaluation
from experiments.train import inputs
from experiments.train import schedules

Params = dict[str, Any]


def create_optimizer(config: ml_collections.ConfigDict, sched: schedules.Schedule, trainable: Params
                     ) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """AdamW with warmup and cosine decay on the trainable leaves; zero updates elsewhere.

  Weight decay applies to matrices (kernels, embeddings), not to biases and
  norm scales. Frozen leaves (``trainable`` False) get ``optax.set_to_zero``
  through ``optax.multi_transform`` and keep no optimiser state.

  Returns:
    (optimizer, learning-rate schedule).
  """
  t = config.train
  lr = optax.warmup_cosine_decay_schedule(
      0.0, sched.learning_rate, sched.warmup_steps, sched.num_steps,
      end_value=sched.learning_rate * t.final_lr_fraction)
  decay_mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)
  adamw = optax.chain(optax.clip_by_global_norm(t.grad_clip_norm),
                      optax.adamw(lr, b1=t.b1, b2=t.b2, weight_decay=t.weight_decay,
                                  mask=decay_mask))
  labels = jax.tree.map(lambda m: "train" if m else "freeze", trainable)
  return optax.multi_transform({"train": adamw, "freeze": optax.set_to_zero()}, labels), lr


def make_train_step(model: models.Model, optimizer: optax.GradientTransformation,
                    trainable: Params, mesh: jax.sharding.Mesh, param_sharding: str = "replicated"):
  """Jitted ``step(state, batch) -> (state, {"loss", "accuracy"})``.

  ``state`` is {"params", "opt_state"}, placed by ``inputs.placement(mesh,
  param_sharding)`` and donated; the step returns it placed the same way and the
  metrics replicated. Frozen leaves are passed through as they are (not even
  ``p + 0``), so they stay bit-identical.
  """

  def loss_fn(params, batch):
    sums = evaluation.batch_metrics(model, params, batch)
    return sums["loss"] / sums["count"], sums

  def step(state, batch):
    (loss, sums), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"], batch)
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    params = jax.tree.map(lambda p, u, m: optax.apply_updates(p, u) if m else p,
                          state["params"], updates, trainable)
    return ({"params": params, "opt_state": opt_state},
            {"loss": loss, "accuracy": sums["correct"] / sums["count"]})

  replicated = inputs.replicated(mesh)
  shapes = jax.eval_shape(model.init, jax.random.key(0))
  state = jax.eval_shape(lambda p: {"params": p, "opt_state": optimizer.init(p)}, shapes)
  placed = inputs.shardings(state, inputs.placement(mesh, param_sharding))
  return jax.jit(step, donate_argnums=0, out_shardings=(placed, replicated))


_TRAIN_STEPS: dict[Any, tuple] = {}


def optimizer_and_step(config, model, sched, trainable, mesh):
  """(optimizer, jitted learning-rate schedule, jitted step), cached in this process.

  Runs with the same model, schedule, optimiser settings and trainable set
  (the seeds of a scope; the base model and the "full" scope) share one
  compilation.
  """
  t = config.train
  key = (model.config, sched, tuple(sorted(spec_lib.flatten(trainable).items())), mesh,
         t.param_sharding, t.final_lr_fraction, t.grad_clip_norm, t.b1, t.b2, t.weight_decay)
  if key not in _TRAIN_STEPS:
    optimizer, lr = create_optimizer(config, sched, trainable)
    _TRAIN_STEPS[key] = (optimizer, jax.jit(lr),
                         make_train_step(model, optimizer, trainable, mesh, t.param_sharding))
  return _TRAIN_STEPS[key]
