"""Benchmark: what activation matching costs beside the forward passes it needs.

    .venv/bin/python benchmarks/bench_activation_matching.py           # the lm_* settings' size
    .venv/bin/python benchmarks/bench_activation_matching.py --quick   # a 2-layer smoke run

Activation matching (``matching.align_model(method="activation")``) runs both models on
every match batch and solves every factor and attention site from the sums it accumulates.
A forward pass per batch of each model is the least any method reading activations can
spend, so that is the yardstick: per family, this script times, in one process and one after
the other (each compiled first, then the median of ``--repeats`` runs):

* ``forward``: ``model.apply`` of A and of B on every batch (2 x batches passes, jitted);
* ``activation``: ``align_model(method="activation")`` on the same batches, the models'
  activations included;
* ``full``: weight matching (``align_model(method="full")``), which reads no data, for scale.

and prints activation / forward and what activation matching adds beyond the passes,
(activation - forward) / forward pass of one batch of one model. The pair is two independent
initialisations (``Model.init`` with keys 0 and 1) at the size of the ``lm_*_full`` settings
of experiments/configs/cpu_paper.py (6 layers, width 64, 4 heads; an FFN of 256 for GPT-2,
176 for Llama) on batches of 16 random windows of 64 tokens, 8 batches (the study's default
``study.activation_batches``). Timings are of this machine as it runs; the ratios are what
to compare.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from attn_symmetry import matching
from attn_symmetry import models

SIZES = {"gpt2": dict(preset="paper", width=64, depth=6, mlp_dim=256),
         "llama": dict(preset="paper", width=64, depth=6, mlp_dim=176)}
QUICK = {"gpt2": dict(preset="tiny"), "llama": dict(preset="tiny")}


def _timed(fn, repeats: int) -> float:
  """Median wall seconds of ``fn()`` (its result waited for) over ``repeats`` runs after one
  run that compiles."""
  jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def measure(family: str, sizes: dict, *, batches: int, batch_size: int, seq_len: int,
            repeats: int) -> dict[str, float]:
  """Seconds of the forward passes, activation matching and weight matching of one pair."""
  model = models.build(family, **sizes)
  a, b = (model.init(jax.random.key(seed)) for seed in (0, 1))
  rng = np.random.default_rng(0)
  seq_len = min(seq_len, model.config.max_len)
  data = [{model.input_key: rng.integers(0, model.config.vocab_size, (batch_size, seq_len),
                                         dtype=np.int32)} for _ in range(batches)]
  apply = jax.jit(lambda params, x: model.apply(params, x)[0])

  def forward():
    return [apply(params, batch[model.input_key]) for params in (a, b) for batch in data]

  def activation():
    return matching.align_model(model.spec, a, b, method="activation",
                                activations=model.batch_activations, match_batches=data)[0]

  def full():
    return matching.align_model(model.spec, a, b, method="full")[0]

  return {"forward": _timed(forward, repeats), "activation": _timed(activation, repeats),
          "full": _timed(full, repeats)}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="2-layer tiny models, 2 batches")
  parser.add_argument("--batches", type=int, default=8)
  parser.add_argument("--batch_size", type=int, default=16)
  parser.add_argument("--seq_len", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args()
  batches = 2 if args.quick else args.batches
  print(f"{jax.devices()[0].platform}: {batches} batches of {args.batch_size} x {args.seq_len} "
        f"tokens, median of {args.repeats}")
  print(f"{'family':<8} {'forward (2 models)':>19} {'activation':>11} {'full':>9} "
        f"{'activation / forward':>21} {'added, in passes':>17}")
  for family, sizes in (QUICK if args.quick else SIZES).items():
    t = measure(family, sizes, batches=batches, batch_size=args.batch_size,
                seq_len=args.seq_len, repeats=args.repeats)
    one_pass = t["forward"] / (2 * batches)
    print(f"{family:<8} {t['forward']:>18.3f}s {t['activation']:>10.3f}s {t['full']:>8.3f}s "
          f"{t['activation'] / t['forward']:>21.2f} "
          f"{(t['activation'] - t['forward']) / one_pass:>17.1f}")


if __name__ == "__main__":
  main()
