"""Linear mode connectivity: the interpolation path and its barriers (docs/lmc.md, 'Barriers').

theta(lambda) = (1 - lambda) theta_A + lambda theta_B for lambda in [0, 1]
(theta_B already aligned to theta_A, e.g. ``group_action.apply_model(spec,
theta_B, g)``). With L(lambda) the loss along the path,

    loss barrier     = max_lambda  L(lambda) - ((1 - lambda) L(0) + lambda L(1))
    accuracy barrier = max_lambda  ((1 - lambda) a(0) + lambda a(1)) - a(lambda)

and the barrier ratio of a method is barrier(method) / barrier(naive) * 100 %.

``path_evaluator`` compiles one function for all lambdas: lambda is an
argument, vmapped over a chunk of lambdas per batch, so every batch is read
once for the whole path.

This module imports jax and numpy only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Params = Any
MetricFn = Callable[[Params, Mapping[str, jax.Array]], Mapping[str, jax.Array]]


def lambdas(num: int = 25) -> np.ndarray:
  """``num`` evenly spaced interpolation weights in [0, 1], endpoints included."""
  if num < 2:
    raise ValueError(f"an interpolation path needs at least 2 points, got {num}")
  return np.linspace(0.0, 1.0, num)


def interpolate(params_a: Params, params_b: Params, lam: jax.Array | float) -> Params:
  """(1 - lam) params_a + lam params_b, leaf by leaf, in each leaf's dtype."""
  return jax.tree.map(lambda a, b: ((1 - lam) * a + lam * b).astype(a.dtype), params_a, params_b)


def barrier(lams: np.ndarray, values: np.ndarray, *, higher_is_better: bool = False) -> float:
  """Largest gap between the path and the straight line joining its endpoints.

  Args:
    lams: [P] increasing weights with lams[0] = 0 and lams[-1] = 1.
    values: [P] metric along the path (loss, or accuracy with
      ``higher_is_better``).

  Returns:
    max over the path of values - line (loss) or line - values (accuracy);
    zero for a path that lies on its chord, and never negative, as the
    endpoints themselves lie on it.
  """
  lams, values = np.asarray(lams, np.float64), np.asarray(values, np.float64)
  if lams.shape != values.shape or lams[0] != 0.0 or lams[-1] != 1.0:
    raise ValueError(f"barrier needs values at lambdas from 0 to 1, got lambdas {lams} for "
                     f"{values.shape[0] if values.ndim else 0} values")
  line = (1 - lams) * values[0] + lams * values[-1]
  gap = line - values if higher_is_better else values - line
  return float(max(gap.max(), 0.0))


def path_evaluator(metric_fn: MetricFn, *,
                   interpolation: Callable[[Params, Params, jax.Array], Params] = interpolate
                   ) -> Callable[..., Mapping[str, jax.Array]]:
  """One jitted function that evaluates a chunk of interpolation points on one batch.

  Args:
    metric_fn: pure ``(params, batch) -> {name: scalar sum}``, e.g. summed
      loss, correct predictions and their count.
    interpolation: ``(params_a, params_b, lam) -> the path's point at lam``, traceable in
      lam: ``interpolate`` (the straight line, the default), or another path, such as the
      circuit path (``circuit_path.path_evaluator``), whose points ``metric_fn`` reads.

  Returns:
    jitted ``(params_a, params_b, lams [C], batch) -> {name: [C] sums}``.
  """
  def one(params_a, params_b, lam, batch):
    return metric_fn(interpolation(params_a, params_b, lam), batch)
  return jax.jit(jax.vmap(one, in_axes=(None, None, 0, None)))


def evaluate_path(evaluator: Callable[..., Mapping[str, jax.Array]], params_a: Params,
                  params_b: Params, batches: Iterable[Mapping[str, Any]], lams: np.ndarray, *,
                  chunk_size: int | None = None, put: Callable[[Any], Any] = lambda b: b
                  ) -> dict[str, np.ndarray]:
  """Summed metrics at every lambda, over one pass of ``batches``.

  Args:
    evaluator: from ``path_evaluator``.
    params_a, params_b: endpoints (B already aligned).
    batches: the evaluation data; iterated once.
    lams: [P] interpolation weights.
    chunk_size: lambdas evaluated together per call (default all P); the
      last chunk is padded by repeating its last lambda so every call has the
      same shape and the function compiles once.
    put: maps a host batch to device arrays (e.g. sharding over a mesh).

  Returns:
    {name: [P] float64 sums over all batches}.
  """
  lams = np.asarray(lams)
  size = len(lams) if chunk_size is None else min(chunk_size, len(lams))
  pad = -len(lams) % size
  chunks = np.concatenate([lams, np.full(pad, lams[-1])]).reshape(-1, size)
  total = None
  for batch in batches:
    batch = put(batch)
    sums = [evaluator(params_a, params_b, jnp.asarray(c, jnp.result_type(float)), batch)
            for c in chunks]
    sums = {k: jnp.concatenate([s[k] for s in sums]) for k in sums[0]}
    total = sums if total is None else jax.tree.map(jnp.add, total, sums)
  if total is None:
    raise ValueError("evaluate_path got no batches")
  return {k: np.asarray(v, np.float64)[: len(lams)] for k, v in total.items()}
