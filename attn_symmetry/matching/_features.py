"""Stage 1 of attention matching: invariant head features compared through H x H Grams.

For one layer pair (A, B) every quantity that matching needs is a trace of
products of H x H Gram matrices of the (bias-augmented) per-head weights
W~^Q_n = [W^Q_n; b^Q_n] ([D+1, H], likewise K, V) and W^O_n ([H, D]):

    cross Grams   Q~_{A,n}^T Q~_{B,m},  K~_{A,k}^T K~_{B,l},  V~_{A,k}^T V~_{B,l},  O_{A,n} O_{B,m}^T
    self Grams    the same with A = B and n = m.

The invariant circuits (docs/matching.md, 'Stage 1'), M^QK_n = Q~_n K~_{k(n)}^T and
M^VO_n = V~_{k(n)} O_n ((D+1) x (D+1) and (D+1) x D), are never formed:

    <Q~ K~^T, Q~' K~'^T>_F = sum_{ij} (Q~^T Q~')_{ij} (K~^T K~')_{ij}
    <V~ O,    V~' O'>_F    = sum_{ij} (V~^T V~')_{ij} (O O'^T)_{ij}

so ||M_A - M_B||_F^2 = <M_A, M_A> - 2 <M_A, M_B> + <M_B, M_B> costs O(H^2) per
head pair once the Grams are known. With RoPE the QK circuit is split into one
circuit per frequency pair j, Q~_{[j]} K~_{[j]}^T (two columns each, plus one
for the unrotated dims of a partial rotary), which H(H) leaves unchanged; the
split only restricts the sum above to the diagonal blocks of a mask.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from attn_symmetry import attention
from attn_symmetry import spec as spec_lib

DISTANCES = ("frobenius", "squared", "normalised", "cosine")
HIGHEST = jax.lax.Precision.HIGHEST


class Grams(NamedTuple):
  """H x H Gram matrices of one layer pair (A, B) (module docstring).

  Attributes:
    q, o: [N, N, H, H]; q[n, m] = Q~_{A,n}^T Q~_{B,m}, o[n, m] = O_{A,n} O_{B,m}^T.
    k, v: [K, K, H, H]; k[k, l] = K~_{A,k}^T K~_{B,l}, likewise v.
    qa, qb, oa, ob: [N, H, H] self Grams of A and B (oa[n] = O_{A,n} O_{A,n}^T).
    ka, kb, va, vb: [K, H, H] self Grams.
  """
  q: jax.Array
  k: jax.Array
  v: jax.Array
  o: jax.Array
  qa: jax.Array
  qb: jax.Array
  ka: jax.Array
  kb: jax.Array
  va: jax.Array
  vb: jax.Array
  oa: jax.Array
  ob: jax.Array


def augmented(layer: dict[str, Any], name: str) -> jax.Array:
  """[W; b] of the query, key or value projection: [..., D + 1, N|K, H] (b = 0 if absent)."""
  bias = attention.bias_or_zeros(layer, name)
  return jnp.concatenate([layer[name]["kernel"], bias[..., None, :, :]], axis=-3)


def layer_grams(params_a: dict[str, Any], params_b: dict[str, Any]) -> Grams:
  """The Grams of one canonical attention layer pair (no leading axes)."""
  cross = lambda x, y: jnp.einsum("dnh,dmi->nmhi", x, y, precision=HIGHEST)
  auto = lambda x: jnp.einsum("dnh,dni->nhi", x, x, precision=HIGHEST)
  q, k, v = ((augmented(params_a, s), augmented(params_b, s)) for s in ("query", "key", "value"))
  oa, ob = params_a["out"]["kernel"], params_b["out"]["kernel"]
  o_cross = jnp.einsum("nhd,mid->nmhi", oa, ob, precision=HIGHEST)
  o_auto = lambda x: jnp.einsum("nhd,nid->nhi", x, x, precision=HIGHEST)
  return Grams(cross(*q), cross(*k), cross(*v), o_cross, auto(q[0]), auto(q[1]), auto(k[0]),
               auto(k[1]), auto(v[0]), auto(v[1]), o_auto(oa), o_auto(ob))


def qk_block_mask(site: spec_lib.AttentionSite) -> np.ndarray:
  """[H, H] float mask of the QK circuit's blocks: all ones for GL; with RoPE,
  ones where both coordinates lie in the same frequency pair (or both in the
  unrotated part)."""
  h = site.head_dim
  if site.group != "rope":
    return np.ones((h, h))
  pairs = site.rope_pairs()
  block = np.full(h, len(pairs))
  block[pairs[:, 0]] = block[pairs[:, 1]] = np.arange(len(pairs))
  return (block[:, None] == block[None, :]).astype(np.float64)


def _distance(sq_a: jax.Array, sq_b: jax.Array, cross: jax.Array,
              distance: str | jax.Array) -> jax.Array:
  """Pairwise distance [N, M] of features with squared norms [N], [M] and inner products [N, M].

  ``distance`` is a name of ``DISTANCES`` or a traced index into it (all four
  computed, one selected: a program that serves every distance).
  """
  if not isinstance(distance, str):
    return jnp.stack([_distance(sq_a, sq_b, cross, d) for d in DISTANCES])[distance]
  squared = sq_a[:, None] + sq_b[None, :] - 2 * cross
  if distance == "squared":
    return squared
  if distance == "frobenius":
    return jnp.sqrt(jnp.maximum(squared, 0))
  tiny = jnp.finfo(cross.dtype).tiny
  cosine = cross / jnp.sqrt(jnp.maximum(sq_a[:, None] * sq_b[None, :], tiny))
  if distance == "cosine":
    return 1 - cosine
  return jnp.sqrt(jnp.maximum(2 - 2 * cosine, 0))  # normalised: || M_A/|M_A| - M_B/|M_B| ||_F


def head_cost(g: Grams, site: spec_lib.AttentionSite, distance: str | jax.Array) -> jax.Array:
  """Stage 1 cost [N, N]: d(M^QK_{A,n}, M^QK_{B,m}) + d(M^VO_{A,n}, M^VO_{B,m}), with d named
  by ``distance`` or a traced index into ``DISTANCES``.

  Query head n reads kv head n // G, so under GQA the kv Grams are expanded to
  query heads before the traces.
  """
  n, k = g.q.shape[0], g.k.shape[0]
  rep = n // k
  to_heads = lambda x: jnp.repeat(x, rep, axis=0)
  to_pairs = lambda x: jnp.repeat(to_heads(x), rep, axis=1)
  mask = jnp.asarray(qk_block_mask(site), g.q.dtype)
  qk_cross = jnp.einsum("nmhi,nmhi,hi->nm", g.q, to_pairs(g.k), mask)
  qk_a = jnp.einsum("nhi,nhi,hi->n", g.qa, to_heads(g.ka), mask)
  qk_b = jnp.einsum("nhi,nhi,hi->n", g.qb, to_heads(g.kb), mask)
  vo_cross = jnp.einsum("nmhi,nmhi->nm", to_pairs(g.v), g.o)
  vo_a = jnp.einsum("nhi,nhi->n", to_heads(g.va), g.oa)
  vo_b = jnp.einsum("nhi,nhi->n", to_heads(g.vb), g.ob)
  return _distance(qk_a, qk_b, qk_cross, distance) + _distance(vo_a, vo_b, vo_cross, distance)


def head_distances(params_a: dict[str, Any], params_b: dict[str, Any],
                   site: spec_lib.AttentionSite, *, distance: str = "frobenius") -> jax.Array:
  """Stage 1 costs [..., N, N] between the heads of two canonical layers (stacks).

  cost[..., n, m] = d(M^QK_{A,n}, M^QK_{B,m}) + d(M^VO_{A,n}, M^VO_{B,m}) for
  the chosen distance, per-frequency-pair QK circuits when ``site.group`` is
  "rope". Jittable.
  """
  spec_lib.check_site(site)
  if distance not in DISTANCES:
    raise ValueError(f"distance must be one of {DISTANCES}, got {distance!r}")
  lead = params_a["query"]["kernel"].shape[:-3]
  flat = lambda p: jax.tree.map(lambda x: x.reshape(-1, *x.shape[len(lead):]), p)
  grams = jax.vmap(layer_grams)(flat(params_a), flat(params_b))
  cost = jax.vmap(lambda g: head_cost(g, site, distance))(grams)
  return cost.reshape(*lead, *cost.shape[1:])
