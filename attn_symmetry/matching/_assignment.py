"""Linear assignment (jitted Hungarian algorithm) and head-permutation enumeration."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax


def linear_assignment(cost: jax.Array) -> jax.Array:
  """The permutation that minimises sum_i cost[i, perm[i]], batched over leading axes.

  Uses ``optax.assignment.hungarian_algorithm`` (jittable, O(n^3)). The
  algorithm is a while loop whose trip count depends on the costs; under
  ``vmap`` every problem of a batch runs as many iterations as the slowest
  one. On CPU, where a batch gains no parallelism from vmap, the problems of a
  batch run one after another (``lax.map``), each for its own trip count; on
  accelerators they run side by side.

  Args:
    cost: [..., n, n] finite costs.

  Returns:
    int32 [..., n] permutation: row i is assigned column perm[i].
  """
  def one(c):
    rows, cols = optax.assignment.hungarian_algorithm(c)
    return jnp.zeros(c.shape[0], jnp.int32).at[rows].set(cols.astype(jnp.int32))

  if cost.ndim == 2:
    return one(cost)
  batch, n = cost.shape[:-2], cost.shape[-1]
  flat = cost.reshape(-1, n, n)
  perms = jax.lax.map(one, flat) if jax.default_backend() == "cpu" else jax.vmap(one)(flat)
  return perms.reshape(*batch, n)


def assignment_cost(cost: jax.Array, perm: jax.Array) -> jax.Array:
  """sum_i cost[..., i, perm[..., i]]; [...]."""
  return jnp.take_along_axis(cost, perm[..., None], axis=-1).sum((-2, -1))


def assign_heads(cost: jax.Array, num_kv_heads: int) -> jax.Array:
  """Assigns the query heads of B to those of A, moving kv groups as wholes.

  With G = N / K query heads per kv head, kv groups are assigned first: the
  cost of pairing group k of A with group l of B is the optimal cost of
  assigning their G query heads to each other (a G x G assignment for every
  (k, l)); a K x K assignment on these costs then pairs the groups.

  Args:
    cost: [N, N]; cost[n, m] of matching head n of A with head m of B.
    num_kv_heads: K.

  Returns:
    int32 [N] permutation perm (head n of A is matched with head perm[n] of B)
    that maps kv groups onto kv groups.
  """
  n = cost.shape[-1]
  g = n // num_kv_heads
  if g == 1:
    return linear_assignment(cost)
  blocks = cost.reshape(num_kv_heads, g, num_kv_heads, g).transpose(0, 2, 1, 3)  # [K, K, G, G]
  inner = linear_assignment(blocks)  # [K, K, G]
  sigma = linear_assignment(assignment_cost(blocks, inner))  # [K]
  chosen = inner[jnp.arange(num_kv_heads), sigma]  # [K, G]
  return (sigma[:, None] * g + chosen).reshape(n).astype(jnp.int32)


def head_permutations(num_heads: int, num_kv_heads: int | None = None) -> np.ndarray:
  """Every head permutation that maps kv groups onto kv groups.

  Returns:
    int32 [P, N] with P = K! (G!)^K (N! for plain multi-head attention), in
    lexicographic order; row 0 is the identity.
  """
  k = num_heads if num_kv_heads is None else num_kv_heads
  g = num_heads // k
  perms = []
  for sigma in itertools.permutations(range(k)):
    for inner in itertools.product(itertools.permutations(range(g)), repeat=k):
      perms.append([sigma[j] * g + inner[j][i] for j in range(k) for i in range(g)])
  return np.asarray(sorted(perms), np.int32)
