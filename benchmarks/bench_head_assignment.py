"""Benchmark: compile time of ``align_model``'s program with the exhaustive head assignment
against the assignment solvers' (``matching._assignment.assign_heads``).

    .venv/bin/python benchmarks/bench_head_assignment.py                  # vit, llama; 3 repeats
    .venv/bin/python benchmarks/bench_head_assignment.py --families=gpt2 --repeats=5

For each tiny model (4 heads; ``models.build(family, "tiny")``) the program of method "full"
over the whole model is traced, lowered and compiled from scratch (``jax.clear_caches`` before
each, no persistent cache), alternating: solvers, exhaustive, solvers, exhaustive, ...
(``EXHAUSTIVE_MAX_PERMUTATIONS`` set to 0 for the solvers). The line prints the best seconds of
each, their ratio and the median of the per-repeat ratios, at whatever ``XLA_FLAGS`` the
process runs with. Then it checks that both programs return the same element on the pair.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from attn_symmetry import matching
from attn_symmetry import models
from attn_symmetry.matching import _assignment


def compile_seconds(spec, params_a, params_b, limit: int) -> tuple[float, object]:
  """(seconds to trace, lower and compile ``align_model``'s program, its element) with the
  exhaustive assignment for up to ``limit`` head permutations."""
  _assignment.EXHAUSTIVE_MAX_PERMUTATIONS = limit
  jax.clear_caches()
  start = time.perf_counter()
  element, _ = matching.align_model(spec, params_a, params_b, method="full", max_rounds=1,
                                    steps=1)  # a short run: compiling dominates
  jax.block_until_ready(element)
  return time.perf_counter() - start, element


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--families", default="vit,llama")
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()
  exhaustive = _assignment.EXHAUSTIVE_MAX_PERMUTATIONS
  for family in args.families.split(","):
    model = models.build(family, "tiny")
    params_a, params_b = model.init(jax.random.key(0)), model.init(jax.random.key(1))
    times = {"solvers": [], "exhaustive": []}
    elements = {}
    for _ in range(args.repeats):
      for name, limit in (("solvers", 0), ("exhaustive", exhaustive)):
        seconds, elements[name] = compile_seconds(model.spec, params_a, params_b, limit)
        times[name].append(seconds)
    ratios = [e / s for s, e in zip(times["solvers"], times["exhaustive"])]
    same = all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(elements["solvers"]),
                                                      jax.tree.leaves(elements["exhaustive"])))
    print(f"{family}: solvers {min(times['solvers']):.2f} s, exhaustive "
          f"{min(times['exhaustive']):.2f} s, ratio {min(times['exhaustive']) / min(times['solvers']):.2f} "
          f"(median per repeat {statistics.median(ratios):.2f}); same element: {same}")
  _assignment.EXHAUSTIVE_MAX_PERMUTATIONS = exhaustive


if __name__ == "__main__":
  main()
