r"""Throughput of a jitted AdamW training step, against the machine's fp32 matmul rate.

    python benchmarks/bench_train_step.py [--models=vit,gpt2] [--steps=5] [--repeats=3]

Models (the zoo's "small" preset: D = 256, 6 layers, 4 heads, F = 1024):
  vit   batch 128 of 32 x 32 x 3 images, patch 4 -> 65 tokens, 10 classes;
  gpt2  batch ``--gpt2_batch`` of T = 256 tokens, vocabulary 256 (bytes).

For each model: compile once, then time ``--steps`` consecutive steps
(parameters and optimiser state donated), ``--repeats`` times; step time and
tokens/s are the best window. The FLOP count of a step is the matmul FLOPs of forward and backward,
3 x forward, counted from the config (projections, attention scores and
mixing, FFN, embedding and head matmuls); XLA's own count of the compiled
step is printed next to it. Right after each step window, fp32 [M, M] x
[M, M] matmuls (``--matmul_size``) run back to back for as long; the ratio is
the step's matmul FLOP/s over that window's matmul FLOP/s, median over the
windows, so on a shared machine both sides see about the same load. The
"matmul" column is the best window's rate.

Memory: the compiled ViT step needs 1.8 GB of temporaries per execution,
which XLA allocates on a worker thread; glibc serves an allocation that large
in a thread arena with a fresh mmap and unmaps it on free, so every step
faulted in 430,000 new pages (printed as "faults/step"). ``--keep_memory``
(default on) calls ``mallopt`` before JAX allocates anything: one arena, an
mmap threshold of 2 GiB and no trimming, so the freed temporaries stay in the
heap and are reused (0 faults per step once the warm-up window has grown the
heap). Starting Python with MALLOC_ARENA_MAX=1 MALLOC_MMAP_THRESHOLD_=2147483647
MALLOC_TRIM_THRESHOLD_=-1 set should do the same.
"""

import argparse
import ctypes
import ctypes.util
import functools
import os
import resource
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from attn_symmetry import models


def keep_freed_memory() -> bool:
  """Stops glibc from returning freed large buffers to the kernel; False if not glibc."""
  name = ctypes.util.find_library("c")
  try:
    libc = ctypes.CDLL(name)
    m_trim_threshold, m_mmap_threshold, m_arena_max = -1, -3, -8
    never_trim, largest_int = -1, 2 ** 31 - 1
    return bool(libc.mallopt(m_arena_max, 1) and libc.mallopt(m_trim_threshold, never_trim)
                and libc.mallopt(m_mmap_threshold, largest_int))
  except (OSError, AttributeError):
    return False


class MatmulRate:
  """FLOP/s of a jitted [M, M] x [M, M] matmul in ``dtype`` (fp32 by default), measured over
  a time window."""

  def __init__(self, size: int, dtype=jnp.float32):
    self.size = size
    self.a = jax.random.normal(jax.random.key(0), (size, size), dtype)
    self.b = jax.random.normal(jax.random.key(1), (size, size), dtype)
    self.matmul = jax.jit(jnp.matmul)
    self.matmul(self.a, self.b).block_until_ready()

  def measure(self, seconds: float) -> float:
    """Runs matmuls back to back for about ``seconds``; returns the mean FLOP/s."""
    count, start = 0, time.perf_counter()
    while count == 0 or time.perf_counter() - start < seconds:
      self.matmul(self.a, self.b).block_until_ready()
      count += 1
    return count * 2 * self.size ** 3 / (time.perf_counter() - start)


def forward_matmul_flops(cfg: models.Config, batch: int, tokens: int) -> int:
  """Matmul FLOPs of one forward pass (2 per multiply-add)."""
  d, n, k, h, f = cfg.width, cfg.num_heads, cfg.kv_heads, cfg.head_dim, cfg.mlp_dim
  per_token_layer = 2 * d * (n + 2 * k) * h + 2 * n * h * d + 2 * d * f * (3 if cfg.gated_mlp else 2)
  per_token_layer += 2 * 2 * tokens * n * h  # scores q k^T and mixing a v, over all T keys
  flops = per_token_layer * cfg.depth * tokens
  if cfg.family == "vit":
    flops += 2 * cfg.num_patches * cfg.patch_size ** 2 * cfg.num_channels * d + 2 * d * cfg.num_classes
  else:
    flops += 2 * tokens * d * cfg.vocab_size
  return flops * batch


def make_step(model: models.Model, optimizer: optax.GradientTransformation, compute_dtype=None):
  """A jitted AdamW step on cross-entropy; params and optimiser state are donated. With a
  ``compute_dtype`` (``jnp.bfloat16``) the forward and backward passes run on a copy of the
  parameters in it (the model computes in its parameters' dtype), the loss and the update
  in the parameters' own dtype: mixed precision."""
  def loss_fn(params, inputs, targets):
    if compute_dtype is not None:
      params = jax.tree.map(lambda x: x.astype(compute_dtype), params)
    logits, _ = model.apply(params, inputs)
    logits = logits.astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt_state, inputs, targets):
    loss, grads = jax.value_and_grad(loss_fn)(params, inputs, targets)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss
  return step


def bench(name: str, model: models.Model, inputs, targets, tokens: int, matmul: MatmulRate,
          args) -> dict:
  """Times the step in ``args.repeats`` windows, each paired with a matmul window as long."""
  cfg = model.config
  optimizer = optax.adamw(1e-3, weight_decay=0.01)
  params = model.init(jax.random.key(0))
  opt_state = optimizer.init(params)
  step = make_step(model, optimizer)
  compiled = step.lower(params, opt_state, inputs, targets).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  xla_flops = float(cost.get("flops", float("nan"))) if cost else float("nan")
  for _ in range(args.steps):  # warm-up: the heap grows to its steady size
    params, opt_state, loss = step(params, opt_state, inputs, targets)
  loss.block_until_ready()
  flops = 3 * forward_matmul_flops(cfg, inputs.shape[0], tokens)
  times, ratios, peaks, faults = [], [], [], 0
  for _ in range(args.repeats):
    faults -= resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    for _ in range(args.steps):
      params, opt_state, loss = step(params, opt_state, inputs, targets)
    loss.block_until_ready()
    times.append((time.perf_counter() - start) / args.steps)
    faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    peaks.append(matmul.measure(times[-1] * args.steps))
    ratios.append(flops / times[-1] / peaks[-1])
  best = min(times)
  return {"model": name, "step_s": best, "tokens_per_s": inputs.shape[0] * tokens / best,
          "flops": flops, "xla_flops": xla_flops, "flops_per_s": flops / best,
          "peak": max(peaks), "ratio": float(np.median(ratios)), "ratios": ratios,
          "faults_per_step": faults / (args.repeats * args.steps)}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", default="vit,gpt2")
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--vit_batch", type=int, default=128)
  parser.add_argument("--gpt2_batch", type=int, default=16)
  parser.add_argument("--gpt2_len", type=int, default=256)
  parser.add_argument("--matmul_size", type=int, default=2048)
  parser.add_argument("--keep_memory", action=argparse.BooleanOptionalAction, default=True)
  args = parser.parse_args()
  kept = args.keep_memory and keep_freed_memory()

  rng = np.random.default_rng(0)
  matmul = MatmulRate(args.matmul_size)
  runs = []
  for name in args.models.split(","):
    if name == "vit":
      model = models.build("vit", "small")
      cfg = model.config
      images = rng.normal(size=(args.vit_batch, 32, 32, 3)).astype(np.float32)
      labels = rng.integers(0, cfg.num_classes, args.vit_batch).astype(np.int32)
      tokens = cfg.num_patches + 1
      runs.append(bench(name, model, jnp.asarray(images), jnp.asarray(labels), tokens, matmul, args))
    elif name == "gpt2":
      model = models.build("gpt2", "small", max_len=args.gpt2_len)
      seq = rng.integers(0, model.config.vocab_size, (args.gpt2_batch, args.gpt2_len + 1))
      seq = jnp.asarray(seq, jnp.int32)
      runs.append(bench(name, model, seq[:, :-1], seq[:, 1:], args.gpt2_len, matmul, args))
    else:
      raise ValueError(f"unknown model {name!r}; choose from vit, gpt2")

  print(f"devices: {jax.devices()}; freed memory kept (mallopt): {kept}; "
        f"load average (1, 5, 15 min): {os.getloadavg()} on {os.cpu_count()} CPUs")
  print(f"{'model':6s} {'step s':>8s} {'tokens/s':>10s} {'GFLOP/step':>11s} {'XLA GFLOP':>10s} "
        f"{'GFLOP/s':>8s} {'matmul':>8s} {'faults/step':>11s} {'ratio':>6s}  ratio per window")
  for r in runs:
    print(f"{r['model']:6s} {r['step_s']:8.3f} {r['tokens_per_s']:10.0f} {r['flops'] / 1e9:11.2f} "
          f"{r['xla_flops'] / 1e9:10.2f} {r['flops_per_s'] / 1e9:8.1f} {r['peak'] / 1e9:8.1f} "
          f"{r['faults_per_step']:11.0f} {r['ratio']:6.2f}  {' '.join(f'{x:.2f}' for x in r['ratios'])}")

if __name__ == "__main__":
  main()
