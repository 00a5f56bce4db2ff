"""The circuit path: every attention head's circuits interpolated, a comparison measure.

docs/lmc.md, 'The circuit path'. A head's function depends on its weights only through
its two circuits (docs/symmetries.md, 'Why the output does not change'): with the
bias-augmented weights W~ = [W; b] (the bias appended as a last row, zeros where a
layer has none) and x~ = [x, 1],

    M^QK_n = W~^Q_n W~^K_{k(n)}^T   [D+1, D+1],      M^VO_n = W~^V_{k(n)} W^O_n   [D+1, D].

Theus et al. (NeurIPS 2025) interpolate these instead of the weights. The point at
lambda of the circuit path from theta_A to theta_B (B already aligned) is the model
whose every leaf outside the attention heads is (1 - lambda) theta_A + lambda theta_B
(``lmc.interpolate``: embeddings, norms, FFN, output head, and each attention layer's
output bias b^O), and whose head n has the circuits

    M^QK_n(lambda) = (1 - lambda) M^QK_{A,n} + lambda M^QK_{B,n},
    M^VO_n(lambda) = (1 - lambda) M^VO_{A,n} + lambda M^VO_{B,n}.

These have rank up to 2H, which no head of width H carries: the path's interior points
are no model of the original architecture. They are a standard model with heads of width
2H (``head_width``; ``models.circuit_model`` builds it), whose head n concatenates A's and
B's along the head dimension (``interpolate_site``), with c = sqrt(2):

    W~^Q'_n = [c sqrt(1 - lambda) W~^Q_{A,n},   c sqrt(lambda) W~^Q_{B,n}]      [D+1, 2H]
    W~^K'_k = [sqrt(1 - lambda) W~^K_{A,k},     sqrt(lambda) W~^K_{B,k}]        [D+1, 2H]
    W~^V'_k = [(1 - lambda) W~^V_{A,k},         lambda W~^V_{B,k}]              [D+1, 2H]
    W^O'_n  = [W^O_{A,n}; W^O_{B,n}]                                            [2H, D]

so that W~^Q'_n W~^K'_k^T / sqrt(2H) = M^QK_n(lambda) / sqrt(H): the scores of the
widened head are the interpolated scores at the original softmax scale 1 / sqrt(H) (c
makes up for the widened head's 1 / sqrt(2H)), and W~^V'_k W^O'_n = M^VO_n(lambda).
Query head n reads kv head k(n) = n // (N / K) in A, in B and in the widened model, so
grouped-query attention (K < N) is exact too. At lambda = 0 (1) B's (A's) half is zero and
the point computes A's (B's) function.

RoPE is refused: the widened model rotates its queries and keys with the frequencies of a
head of width 2H, not each half with those of a head of width H, so its scores would not be
the interpolated ones.

A group element g = (tau, (A_k, B_k)) of a site gives head n of g . theta the circuits of
head tau(n) of theta (the GL(H) matrices cancel), so the circuit path of
(theta_A, g . theta_B) is that of (theta_A, tau . theta_B): circuit space quotients out the
GL(H) factors of the attention group, not the order of the heads, nor any factor outside
the heads.

This module imports jax and numpy only.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from attn_symmetry import attention
from attn_symmetry import lmc
from attn_symmetry import spec as spec_lib

Params = Any
WIDENING = 2  # the circuit path's heads are this many times as wide as the original ones


def head_width(spec: spec_lib.SymmetrySpec) -> int:
  """The head width 2H of the model that evaluates the circuit path of a model of ``spec``.

  Raises:
    ValueError: the spec has no attention site, a site rotates its queries and keys
      (RoPE, group "rope"), or the sites' head dims differ; each named.
  """
  if not spec.attention:
    raise ValueError("the circuit path interpolates attention heads, and the spec has no "
                     "attention site")
  rotary = [name for name, site in spec.attention.items() if site.group == "rope"]
  if rotary:
    raise ValueError(
        f"the circuit path is not defined for RoPE (attention sites {rotary}): the widened "
        "heads would rotate with the frequencies of a head of width 2H, not each half with "
        "those of the original head, so their scores would not interpolate the QK circuits")
  dims = {name: site.head_dim for name, site in spec.attention.items()}
  if len(set(dims.values())) > 1:
    raise ValueError(f"the circuit path widens every head alike; the sites' head dims differ: "
                     f"{dims}")
  return WIDENING * next(iter(dims.values()))


def _check_pair(params_a: Params, params_b: Params, where: str) -> None:
  """ValueError naming the first leaf whose path or shape differs between A and B."""
  flat_a, flat_b = spec_lib.flatten(params_a), spec_lib.flatten(params_b)
  if set(flat_a) != set(flat_b):
    raise ValueError(f"{where}A and B hold different leaves: only in A "
                     f"{sorted(set(flat_a) - set(flat_b))}, only in B "
                     f"{sorted(set(flat_b) - set(flat_a))}")
  for path, leaf in flat_a.items():
    if np.shape(leaf) != np.shape(flat_b[path]):
      raise ValueError(f"{where}{path} has shape {np.shape(leaf)} in A and "
                       f"{np.shape(flat_b[path])} in B")


def _halves(a: jax.Array, b: jax.Array, wa: jax.Array, wb: jax.Array, axis: int) -> jax.Array:
  """[wa a, wb b] concatenated along ``axis``, in a's dtype."""
  return jnp.concatenate([wa * a, wb * b], axis=axis).astype(a.dtype)


def interpolate_site(params_a: Params, params_b: Params, lam: jax.Array | float) -> Params:
  """The widened attention layer whose heads carry the interpolated circuits (module
  docstring).

  Args:
    params_a, params_b: canonical attention layers (``attention.LEAVES``) of the same shapes
      and leaves: query/kernel [..., D, N, H], key and value kernels [..., D, K, H],
      out/kernel [..., N, H, D], and the optional biases [..., N|K, H], out/bias [..., D].
    lam: the interpolation weight in [0, 1]; may be traced.

  Returns:
    The layer of head width 2H, in the same nested layout and dtypes: query/kernel
    [..., D, N, 2H], key and value kernels [..., D, K, 2H], out/kernel [..., N, 2H, D],
    the q, k, v biases [..., N|K, 2H] where the layers have them, out/bias (1 - lam) b_A +
    lam b_B [..., D].

  Raises:
    ValueError: a layer that is not canonical (``attention.layer_shapes``), or A and B of
      different leaves or shapes, naming the leaf.
  """
  attention.layer_shapes(params_a, "A: ")
  attention.layer_shapes(params_b, "B: ")
  _check_pair(params_a, params_b, "attention layer: ")
  lam = jnp.asarray(lam)
  root = math.sqrt(WIDENING)  # 1 / sqrt(2H) * root = 1 / sqrt(H)
  weights = {"query": (root * jnp.sqrt(1 - lam), root * jnp.sqrt(lam)),
             "key": (jnp.sqrt(1 - lam), jnp.sqrt(lam)), "value": (1 - lam, lam)}
  out = {}
  for name, node in params_a.items():
    if name in weights:
      out[name] = {leaf: _halves(x, params_b[name][leaf], *weights[name], axis=-1)
                   for leaf, x in node.items()}
    else:  # "out": W^O stacked on its input (head-dim) axis; b^O on the straight line
      out[name] = {"kernel": _halves(node["kernel"], params_b[name]["kernel"], 1, 1, axis=-2)}
      if "bias" in node:
        out[name]["bias"] = lmc.interpolate(node["bias"], params_b[name]["bias"], lam)
  return out


def interpolate(spec: spec_lib.SymmetrySpec, params_a: Params, params_b: Params,
                lam: jax.Array | float) -> Params:
  """The circuit path's point at ``lam``: the parameters of the model with heads of width
  ``head_width(spec)`` (``models.circuit_model``) whose heads carry the interpolated
  circuits (``interpolate_site`` at every attention site of ``spec``) and whose every other
  leaf is on the straight line (``lmc.interpolate``).

  Args:
    spec: the symmetry spec of both endpoints' model; its ``attention`` names the sites.
    params_a, params_b: the endpoints, of the same leaves and shapes (B already aligned).
    lam: the interpolation weight in [0, 1]; may be traced (``path_evaluator``).

  Raises:
    ValueError: before any work, a spec that the circuit path does not apply to
      (``head_width``), or endpoints that do not fit it or each other, naming the leaf.
  """
  head_width(spec)
  spec.check(params_a)
  _check_pair(params_a, params_b, "")
  out = lmc.interpolate(params_a, params_b, lam)
  for site in spec.attention:
    *parents, last = site.split("/")
    node = out
    for p in parents:
      node = node[p]
    node[last] = interpolate_site(spec_lib.subtree(params_a, site),
                                  spec_lib.subtree(params_b, site), lam)
  return out


def path_evaluator(spec: spec_lib.SymmetrySpec, metric_fn: lmc.MetricFn
                   ) -> Callable[..., Mapping[str, jax.Array]]:
  """``lmc.path_evaluator`` of the circuit path: one jitted function that evaluates a chunk
  of its points on one batch, for ``lmc.evaluate_path``.

  Args:
    spec: the endpoints' symmetry spec (``interpolate``).
    metric_fn: ``(params, batch) -> {name: scalar sum}`` of the widened model
      (``models.circuit_model``), which reads ``interpolate``'s points.

  Returns:
    jitted ``(params_a, params_b, lams [C], batch) -> {name: [C] sums}``.

  Raises:
    ValueError: a spec that the circuit path does not apply to (``head_width``), at once.
  """
  head_width(spec)
  return lmc.path_evaluator(metric_fn, interpolation=functools.partial(interpolate, spec))
