r"""Input pipeline throughput next to what a jitted training step consumes, in one run.

    python benchmarks/bench_input.py [--preset=small] [--cases=vit:fashion_mnist_deb,gpt2:wiki_bytes]

For each case (model family on a data set) it measures, in the same process:

* pipeline: examples/s that ``data.train_iterator`` delivers (steady state,
  after the first batches), as numpy batches on the host;
* train step: examples/s that one jitted training step (forward, backward,
  AdamW update) consumes on a batch already on the device;
* fed: examples/s of the training step fed by the pipeline (device_put
  included), which falls below "train step" when data stalls training.

The goal is pipeline / train step >= 10, so that data never stalls training.
Image cases read with ``augment=True`` (crop, plus flip where it keeps the
label): the most expensive path.
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from attn_symmetry import data
from attn_symmetry import models
from attn_symmetry import tasks

DEFAULT_CASES = "vit:digits,vit:fashion_mnist_deb,gpt2:wiki_bytes,bert:newsgroups_mini"


def model_for(family: str, preset: str, info: data.DatasetInfo) -> models.Model:
  """The model sized for the data set's inputs and outputs."""
  overrides = {}
  if info.image_shape is not None:
    overrides.update(image_size=info.image_shape[0], num_channels=info.image_shape[2])
  else:
    overrides.update(vocab_size=info.vocab_size, max_len=info.seq_len)
  if info.task == tasks.CLASSIFICATION:
    overrides["num_classes"] = info.num_classes
  return models.build(family, preset, **overrides)


def make_step(model: models.Model, optimizer: optax.GradientTransformation):
  """Jitted (params, opt_state, batch) -> (params, opt_state, loss)."""

  def loss_fn(params, batch):
    if model.task == tasks.LM:
      logits, _ = model.apply(params, batch["tokens"][:, :-1])
      labels = batch["tokens"][:, 1:]
    else:
      logits, _ = model.apply(params, batch[model.input_key], mask=batch.get("mask"))
      labels = batch["label"]
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), labels).mean()

  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return jax.jit(step, donate_argnums=(0, 1))


def pipeline_rate(it, batch_size: int, num_batches: int) -> float:
  for _ in range(3):  # Warm-up: threads start, files open, caches fill.
    next(it)
  start = time.perf_counter()
  for _ in range(num_batches):
    next(it)
  return num_batches * batch_size / (time.perf_counter() - start)


def step_rates(model, it, batch_size: int, num_steps: int) -> tuple[float, float]:
  """(examples/s on a resident batch, examples/s fed by the iterator)."""
  optimizer = optax.adamw(1e-4)
  params = model.init(jax.random.key(0))
  opt_state = optimizer.init(params)
  step = make_step(model, optimizer)
  batch = jax.device_put(next(it))
  params, opt_state, loss = step(params, opt_state, batch)  # Compiles.
  loss.block_until_ready()
  start = time.perf_counter()
  for _ in range(num_steps):
    params, opt_state, loss = step(params, opt_state, batch)
  loss.block_until_ready()
  resident = num_steps * batch_size / (time.perf_counter() - start)
  start = time.perf_counter()
  for _ in range(num_steps):
    params, opt_state, loss = step(params, opt_state, jax.device_put(next(it)))
  loss.block_until_ready()
  fed = num_steps * batch_size / (time.perf_counter() - start)
  return resident, fed


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", default="small")
  parser.add_argument("--cases", default=DEFAULT_CASES,
                      help="comma-separated family:dataset pairs")
  parser.add_argument("--image_batch", type=int, default=256)
  parser.add_argument("--text_batch", type=int, default=32)
  parser.add_argument("--seq_len", type=int, default=256)
  parser.add_argument("--batches", type=int, default=100, help="pipeline batches timed")
  parser.add_argument("--steps", type=int, default=10, help="training steps timed")
  parser.add_argument("--data_dir", default=None)
  args = parser.parse_args()

  print(f"devices: {jax.devices()}  preset: {args.preset}")
  print(f"{'case':28s} {'batch':>6s} {'pipeline ex/s':>14s} {'train ex/s':>11s} "
        f"{'fed ex/s':>9s} {'ratio':>7s}")
  for case in args.cases.split(","):
    family, name = case.split(":")
    info = data.dataset_info(name, data_dir=args.data_dir)
    image = info.image_shape is not None
    if not image:
      info = data.dataset_info(name, data_dir=args.data_dir, seq_len=args.seq_len)
    batch_size = args.image_batch if image else args.text_batch
    options = dict(batch_size=batch_size, seed=0, data_dir=args.data_dir,
                   **({"augment": True} if image else {"seq_len": args.seq_len}))
    model = model_for(family, args.preset, info)
    pipeline = pipeline_rate(data.train_iterator(name, **options), batch_size, args.batches)
    resident, fed = step_rates(model, data.train_iterator(name, **options), batch_size,
                               args.steps)
    print(f"{case:28s} {batch_size:6d} {pipeline:14.0f} {resident:11.0f} {fed:9.0f} "
          f"{pipeline / resident:7.1f}", flush=True)



if __name__ == "__main__":
  main()
