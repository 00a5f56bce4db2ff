"""Linear assignment (an auction in JAX, or optax's Hungarian algorithm for small problems on
CPU) and head-permutation enumeration."""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

from attn_symmetry import attention
from attn_symmetry.matching import _auction


# On a CPU backend, the smallest n solved by the auction (see linear_assignment).
AUCTION_MIN_SIZE = 512
# ``assign_heads`` tries every head permutation that maps kv groups onto kv groups when there
# are at most this many (multi-head attention up to 6 heads; 8 heads in 2 or 4 kv groups).
EXHAUSTIVE_MAX_PERMUTATIONS = 1152


def linear_assignment(cost: jax.Array) -> jax.Array:
  """The permutation that minimises sum_i cost[i, perm[i]], batched over leading axes.

  First a certificate: when the columns of the rows' smallest costs are all
  different, taking every row's minimum is optimal (no assignment costs less
  than the sum of the row minima), and no solver runs (a ``lax.cond``; under
  ``vmap`` both branches run and the certified rows are selected). Costs close
  to a permutation pass it, as Weight Matching meets them between a model and
  a fine-tuned, partly re-initialised or planted copy of it (every assignment
  of the GPT-2-small pair of ``benchmarks/bench_matching.py`` passes); those
  between independently trained models mostly do not. Checking costs one
  pass over the costs and a sort of n indices. Otherwise one of two exact
  solvers, chosen when the call is traced:

  * ``matching._auction.solve`` (an epsilon-scaling auction on each row's
    cheapest columns, made exact by shortest augmenting paths from its prices,
    with a dual certificate; see that module): on accelerators at every n, and
    on a CPU backend from n = ``AUCTION_MIN_SIZE``. Problems of a batch run side
    by side (``vmap``) on accelerators, one after another on CPU. On CPU it
    takes 0.3 to 0.5x scipy's ``linear_sum_assignment`` time on random costs
    from n = 1024 (``benchmarks/bench_assignment.py``; docs/matching.md).
  * Below ``AUCTION_MIN_SIZE`` on CPU, ``optax.assignment.hungarian_algorithm``
    (O(n^3), a ``while_loop`` whose trip count depends on the costs), one
    problem after another: at such sizes it runs in about a millisecond like
    the auction, and its program compiles several times faster.

  Neither needs a host callback, so every program stays jittable, vmappable,
  usable in ``lax`` loops and storable in JAX's persistent compilation cache.
  Both return an optimal assignment; they can differ only where several
  assignments tie for the optimum.

  Args:
    cost: [..., n, n] finite costs.

  Returns:
    int32 [..., n] permutation: row i is assigned column perm[i].
  """
  cost = jnp.asarray(cost)
  solve = (_hungarian if jax.default_backend() == "cpu" and cost.shape[-1] < AUCTION_MIN_SIZE
           else _device_assignment)
  minima = jnp.argmin(cost, axis=-1).astype(jnp.int32)
  return jax.lax.cond(_is_permutation(minima), lambda _: minima, solve, cost)


def _is_permutation(perm: jax.Array) -> jax.Array:
  """Whether every [..., n] row of ``perm`` holds each of 0..n-1 once (all of them: one bool)."""
  return jnp.all(jnp.sort(perm, axis=-1) == jnp.arange(perm.shape[-1], dtype=perm.dtype))


def _device_assignment(cost: jax.Array) -> jax.Array:
  """The auction (``_auction.solve``) over the leading axes of [..., n, n]; int32 [..., n]."""
  return _auction.solve(cost).perm


def _hungarian(cost: jax.Array) -> jax.Array:
  """optax's Hungarian algorithm over the leading axes of [..., n, n], one problem after another
  (``lax.map``: each runs its own trip count; it serves CPU backends only)."""
  def one(c):
    rows, cols = optax.assignment.hungarian_algorithm(c)
    return jnp.zeros(c.shape[0], jnp.int32).at[rows].set(cols.astype(jnp.int32))

  n = cost.shape[-1]
  return jax.lax.map(one, cost.reshape(-1, n, n)).reshape(cost.shape[:-1])


def assignment_cost(cost: jax.Array, perm: jax.Array) -> jax.Array:
  """sum_i cost[..., i, perm[..., i]]; [...]."""
  return jnp.take_along_axis(cost, perm[..., None], axis=-1).sum((-2, -1))


def assign_heads(cost: jax.Array, num_kv_heads: int) -> jax.Array:
  """Assigns the query heads of B to those of A, moving kv groups as wholes.

  With G = N / K query heads per kv head, kv groups are assigned first: the
  cost of pairing group k of A with group l of B is the optimal cost of
  assigning their G query heads to each other (a G x G assignment for every
  (k, l)); a K x K assignment on these costs then pairs the groups.

  Where the permutations that move kv groups as wholes number at most
  ``EXHAUSTIVE_MAX_PERMUTATIONS`` (K! (G!)^K; N! for multi-head attention), every one
  is costed and the cheapest taken instead (the first in ``head_permutations``' order on a
  tie): the same optimum, found by a gather and an argmin over a constant table, whose
  program is smaller than the assignment solvers' loops (``align_model``'s first call at 4
  heads takes 0.83 to 0.92 of the time; ``benchmarks/bench_head_assignment.py``).

  Args:
    cost: [N, N]; cost[n, m] of matching head n of A with head m of B.
    num_kv_heads: K.

  Returns:
    int32 [N] permutation perm (head n of A is matched with head perm[n] of B)
    that maps kv groups onto kv groups.
  """
  n = cost.shape[-1]
  g = n // num_kv_heads
  if _count_head_permutations(n, num_kv_heads) <= EXHAUSTIVE_MAX_PERMUTATIONS:
    perms = head_permutations(n, num_kv_heads)  # [P, N]
    totals = cost[np.arange(n), perms].sum(-1)  # [P]
    return jnp.asarray(perms)[jnp.argmin(totals)]
  if g == 1:
    return linear_assignment(cost)
  blocks = cost.reshape(num_kv_heads, g, num_kv_heads, g).transpose(0, 2, 1, 3)  # [K, K, G, G]
  inner = linear_assignment(blocks)  # [K, K, G]
  sigma = linear_assignment(assignment_cost(blocks, inner))  # [K]
  chosen = inner[jnp.arange(num_kv_heads), sigma]  # [K, G]
  return (sigma[:, None] * g + chosen).reshape(n).astype(jnp.int32)


def _count_head_permutations(num_heads: int, num_kv_heads: int) -> int:
  """K! (G!)^K: how many rows ``head_permutations(num_heads, num_kv_heads)`` has."""
  g = num_heads // num_kv_heads
  return math.factorial(num_kv_heads) * math.factorial(g) ** num_kv_heads


def head_permutations(num_heads: int, num_kv_heads: int | None = None) -> np.ndarray:
  """Every head permutation that maps kv groups onto kv groups.

  Returns:
    int32 [P, N] with P = K! (G!)^K (N! for plain multi-head attention), in
    lexicographic order; row 0 is the identity.
  """
  k = attention.kv_heads(num_heads, num_kv_heads)
  g = num_heads // k
  perms = []
  for sigma in itertools.permutations(range(k)):
    for inner in itertools.product(itertools.permutations(range(g)), repeat=k):
      perms.append([sigma[j] * g + inner[j][i] for j in range(k) for i in range(g)])
  return np.asarray(sorted(perms), np.int32)
