"""Linear assignment (scipy on the host for CPU, optax's Hungarian algorithm on accelerators)
and head-permutation enumeration."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from attn_symmetry import attention


# The smallest n solved on the host on a CPU backend (see linear_assignment).
HOST_MIN_SIZE = 512


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

  * CPU backend and n >= ``HOST_MIN_SIZE``: scipy's ``linear_sum_assignment``
    (a shortest-augmenting-path solver in C++) on the host, through
    ``jax.pure_callback``: the call stays jittable, vmappable and usable inside
    ``lax`` loops. scipy is imported only when this path runs. A program with a
    host callback is not stored in JAX's persistent compilation cache, hence
    the size threshold: below it the device solver costs under a millisecond
    more per problem, and the programs that only meet small problems (head
    assignments, narrow models) stay cacheable.
  * Otherwise ``optax.assignment.hungarian_algorithm`` on the device
    (O(n^3), a ``while_loop`` whose trip count depends on the costs): vmapped
    over a batch on accelerators, where every problem then runs as many
    iterations as the slowest one; one problem after another on CPU. On CPU
    it is about 5x slower than scipy on random 1024^2 costs, 1.5x on
    near-permutation ones (``benchmarks/bench_matching.py --lap_only``).

  All three return an optimal assignment; they can differ only where several
  assignments tie for the optimum.

  Args:
    cost: [..., n, n] finite costs.

  Returns:
    int32 [..., n] permutation: row i is assigned column perm[i].
  """
  cost = jnp.asarray(cost)
  solve = (_host_assignment if jax.default_backend() == "cpu" and cost.shape[-1] >= HOST_MIN_SIZE
           else _device_assignment)
  minima = jnp.argmin(cost, axis=-1).astype(jnp.int32)
  return jax.lax.cond(_is_permutation(minima), lambda _: minima, solve, cost)


def _is_permutation(perm: jax.Array) -> jax.Array:
  """Whether every [..., n] row of ``perm`` holds each of 0..n-1 once (all of them: one bool)."""
  return jnp.all(jnp.sort(perm, axis=-1) == jnp.arange(perm.shape[-1], dtype=perm.dtype))


def _device_assignment(cost: jax.Array) -> jax.Array:
  """optax's Hungarian algorithm over the leading axes of [..., n, n]: one problem after
  another on CPU (``lax.map``: each runs its own trip count, and vmap buys no parallelism
  there), side by side elsewhere (``vmap``)."""
  def one(c):
    rows, cols = optax.assignment.hungarian_algorithm(c)
    return jnp.zeros(c.shape[0], jnp.int32).at[rows].set(cols.astype(jnp.int32))

  if cost.ndim == 2:
    return one(cost)
  n = cost.shape[-1]
  flat = cost.reshape(-1, n, n)
  perms = jax.lax.map(one, flat) if jax.default_backend() == "cpu" else jax.vmap(one)(flat)
  return perms.reshape(cost.shape[:-1])


def _host_assignment(cost: jax.Array) -> jax.Array:
  """scipy's solver on the host, called from traced code; [..., n, n] -> int32 [..., n]."""
  out = jax.ShapeDtypeStruct(cost.shape[:-1], jnp.int32)
  # "expand_dims": under vmap the callback gets the batch as one more leading axis, which
  # _solve_on_host loops over like any other.
  return jax.pure_callback(_solve_on_host, out, cost, vmap_method="expand_dims")


def _solve_on_host(cost: np.ndarray) -> np.ndarray:
  from scipy.optimize import linear_sum_assignment  # pylint: disable=g-import-not-at-top

  cost = np.asarray(cost)
  if cost.dtype not in (np.float32, np.float64):  # bf16/f16: scipy reads float32 and float64
    cost = cost.astype(np.float32)
  n = cost.shape[-1]
  flat = cost.reshape(-1, n, n)
  perms = np.empty(flat.shape[:-1], np.int32)
  for i, c in enumerate(flat):
    perms[i] = linear_sum_assignment(c)[1]
  return perms.reshape(cost.shape[:-1])


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
  k = attention.kv_heads(num_heads, num_kv_heads)
  g = num_heads // k
  perms = []
  for sigma in itertools.permutations(range(k)):
    for inner in itertools.product(itertools.permutations(range(g)), repeat=k):
      perms.append([sigma[j] * g + inner[j][i] for j in range(k) for i in range(g)])
  return np.asarray(sorted(perms), np.int32)
