r"""The 25-point interpolation path against 25 separate plain evaluations.

    python -m benchmarks.bench_interpolation [--preset=small] [--chunk=1] [--repeats=3]

Both sides evaluate the same ViT endpoints on the same digits test split in one
process: the path side with ``lmc.path_evaluator`` (one compilation, lambda an
argument vmapped over chunks of lambdas, every batch read once), the reference
with ``evaluation.evaluate`` called once per interpolated model (its step compiled
once and reused). Prints each side's best wall time over the repeats, after a
warm-up that compiles both, their ratio (goal: <= 1.1) and the number of
compilations of the path function.
"""

import argparse
import time

import jax
import numpy as np

from attn_symmetry import data
from attn_symmetry import lmc
from attn_symmetry import models

from experiments.train import evaluation
from experiments.train import inputs


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", default="small")
  parser.add_argument("--dataset", default="digits")
  parser.add_argument("--batch_size", type=int, default=256)
  parser.add_argument("--chunk", type=int, default=1)
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()

  info = data.dataset_info(args.dataset)
  model = models.build("vit", args.preset, **inputs.model_overrides(info))
  params_a, params_b = model.init(jax.random.key(0)), model.init(jax.random.key(1))
  batches = list(data.eval_iterator(args.dataset, batch_size=args.batch_size))
  lams = lmc.lambdas(25)
  mesh = inputs.create_mesh()

  traces = []
  def metric(p, b):
    traces.append(1)
    return evaluation.batch_metrics(model, p, b)
  evaluator = lmc.path_evaluator(metric)

  def path():
    sums = lmc.evaluate_path(evaluator, params_a, params_b, batches, lams, chunk_size=args.chunk,
                             put=lambda b: inputs.shard_batch(b, mesh))
    return sums["loss"] / sums["count"]

  def separate():
    return np.array([evaluation.evaluate(model, lmc.interpolate(params_a, params_b, lam), batches,
                                    mesh=mesh)["loss"] for lam in lams])

  loss_path, loss_sep = path(), separate()  # warm-up: compiles both
  np.testing.assert_allclose(loss_path, loss_sep, rtol=2e-4)
  times = {"path": [], "separate": []}
  for _ in range(args.repeats):
    for name, fn in (("path", path), ("separate", separate)):
      start = time.perf_counter()
      fn()
      times[name].append(time.perf_counter() - start)
  best = {k: min(v) for k, v in times.items()}
  n_examples = sum(int(b["valid"].sum()) for b in batches)
  print(f"ViT {args.preset} ({sum(x.size for x in jax.tree.leaves(params_a)):,} params), "
        f"{args.dataset} test split ({n_examples} examples), 25 lambdas, chunk {args.chunk}, "
        f"{jax.device_count()} {jax.default_backend()} device(s)")
  print(f"  25-point path (lmc.evaluate_path): {best['path']:.3f} s   compilations: {len(traces)}")
  print(f"  25 separate evaluations         : {best['separate']:.3f} s")
  print(f"  ratio path / separate           : {best['path'] / best['separate']:.3f}  (goal <= 1.1)")


if __name__ == "__main__":
  main()
