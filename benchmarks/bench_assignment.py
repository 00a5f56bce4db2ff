"""Benchmark: the auction solver (``matching._auction.solve``) against scipy's linear_sum_assignment.

    .venv/bin/python benchmarks/bench_assignment.py                       # 1024 ... 8192
    .venv/bin/python benchmarks/bench_assignment.py --sizes=512 --repeats=2

For every size n and two kinds of n x n float32 costs,

* random: N(0, 1) entries;
* near-permutation: -(P + 0.3 N(0, 1)) for a random permutation matrix P, the kind Weight
  Matching meets between a model and a fine-tuned copy, with noise large enough that some row
  minima share a column (so that ``linear_assignment``'s row-minima certificate does not answer
  it and a solver runs; the line says whether they do),

the solvers run side by side in one process, alternating (scipy, auction, scipy, auction, ...
``--repeats`` times, each after one untimed call that compiles), and the line prints the best
time of each and their ratio, with the median of the per-repeat ratios. scipy gets the costs as
a float32 numpy array (it solves in float64); the auction gets them as a float32 jax array on
the default device. Exactness: the relative difference of the two assignments' costs (summed in
float64 over the same float32 costs), and the auction's certified gap (0 proves optimality, up
to the rounding of the float32 sums; see ``matching._auction``), its repaired rows and
Dijkstra steps.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import scipy.optimize

from attn_symmetry.matching import _assignment
from attn_symmetry.matching import _auction

NEAR_NOISE = 0.3


def costs(n: int, seed: int = 0) -> dict[str, np.ndarray]:
  """float32 [n, n] costs of each kind (module docstring)."""
  rng = np.random.default_rng(seed)
  planted = np.zeros((n, n))
  planted[np.arange(n), rng.permutation(n)] = 1.0
  return {"random": rng.normal(size=(n, n)).astype(np.float32),
          "near-permutation": (-(planted + NEAR_NOISE * rng.normal(size=(n, n)))).astype(
              np.float32)}


def timed(fn) -> tuple[object, float]:
  """(fn(), its seconds), the result waited for."""
  start = time.perf_counter()
  out = jax.block_until_ready(fn())
  return out, time.perf_counter() - start


def compare(n: int, kind: str, cost: np.ndarray, repeats: int) -> None:
  """One line: best times, ratio, exactness (module docstring)."""
  device_cost = jnp.asarray(cost)
  solve = jax.jit(_auction.solve)
  jax.block_until_ready(solve(device_cost))  # compiled before timing
  ours, theirs, ratios = [], [], []
  for _ in range(repeats):
    (_, cols), t_scipy = timed(lambda: scipy.optimize.linear_sum_assignment(cost))
    solution, t_ours = timed(lambda: solve(device_cost))
    theirs.append(t_scipy)
    ours.append(t_ours)
    ratios.append(t_ours / t_scipy)
  exact = cost.astype(np.float64)
  rows = np.arange(n)
  optimum = exact[rows, cols].sum()
  relative = (exact[rows, np.asarray(solution.perm)].sum() - optimum) / abs(optimum)
  distinct = bool(_assignment._is_permutation(jnp.argmin(device_cost, axis=-1)))  # pylint: disable=protected-access
  print(f"  n={n:5d} {kind:>16}: scipy {min(theirs):7.3f} s | auction {min(ours):7.3f} s | "
        f"ratio {min(ours) / min(theirs):.2f} (median {statistics.median(ratios):.2f}) | "
        f"cost - scipy's: {relative:.1e} relative, certified gap {float(solution.gap):.1e}, "
        f"repaired {int(solution.repaired)} rows in {int(solution.path_steps)} steps | "
        f"row minima distinct: {distinct}", flush=True)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--sizes", default="1024,2048,4096,8192")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--kinds", default="random,near-permutation")
  args = parser.parse_args()
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}; best of {args.repeats} "
        f"alternating calls each; ratio = auction / scipy")
  for n in (int(s) for s in args.sizes.split(",")):
    for kind, cost in costs(n).items():
      if kind in args.kinds.split(","):
        compare(n, kind, cost, args.repeats)


if __name__ == "__main__":
  main()
