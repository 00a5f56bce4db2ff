"""An exact linear assignment in JAX: an epsilon-scaling auction on each row's cheapest columns,
then shortest augmenting paths that make it optimal, with a dual certificate.

The problem: for costs C [n, n], the permutation pi minimising sum_i C[i, pi(i)]. Its
linear-programming dual: row potentials u and column prices p with

    u_i <= C[i, j] + p_j  for all i, j,        maximise  sum_i u_i - sum_j p_j,

(the column dual is -p). With u_i = min_j (C[i, j] + p_j), a permutation pi and prices p give

    cost(pi) - optimum <= gap(pi, p) = sum_i (C[i, pi(i)] + p_pi(i) - u_i)        (weak duality:
    any sigma costs sum_i C[i, sigma(i)] >= sum_i u_i - sum_j p_j = cost(pi) - gap),

so gap = 0, i.e. every row's assigned column attains its row's minimum of C + p (complementary
slackness), certifies that pi is optimal. ``solve`` returns pi, p and gap; pi is optimal
(gap = 0 up to the rounding of the sums C[i, j] + p_j) whatever the costs.

Four steps, each in ``jax.lax`` loops (jittable, vmappable):

1. Reduction: C' = C - min over each row, then minus min over each column (the same optimal
   assignments; every row and column of C' has a zero, and near-optimal entries are small, which
   keeps their rounding small).
2. Candidates: each row's k cheapest columns of C' (``lax.top_k``), [n, k].
3. Auction (Bertsekas 1988, with epsilon-scaling; in min form): a free row i bids for its
   cheapest candidate j1 under C' + p, raising p_j1 to w2 - C'[i, j1] + eps, where w2 is its
   second cheapest value C'[i, j] + p_j among its candidates; the previous owner of j1 becomes
   free. Free rows are kept in a queue and bid ``block`` at a time (Jacobi bidding within a
   block: for each column the highest bid wins, ties to the earlier row). A phase ends when
   every row has a column, with eps-complementary slackness on the candidates:
   C'[i, pi(i)] + p_pi(i) <= min_{j candidate} (C'[i, j] + p_j) + eps. eps starts at a quarter
   of the largest k-th candidate cost and shrinks by ``theta`` per phase, rows are freed at each
   phase's start and prices kept, down to eps of about 1e-6 of that scale (never below a few ulps
   of the largest price, so that every bid raises a price). The auction's assignment is then
   within n * eps of the optimum of the candidate problem, but not, in general, optimal.
4. Exactness. First ``tighten``: four Bellman-Ford rounds that lower each non-tight row's column
   price by its violation (below), which leaves fewer rows non-tight. Then shortest augmenting
   paths (Jonker-Volgenant style, on the dense C'): with
   u_i = min_j (C'[i, j] + p_j) over all columns, a row whose auctioned column attains u_i
   ("tight") keeps it; the others are freed. For each free row i0, Dijkstra over the columns with
   the reduced costs r[i, j] = C'[i, j] + p_j - u_i >= 0 (assigned rows are tight, so the edge to
   their own column has r = 0) finds the shortest path to an unassigned column, at distance
   delta; the prices of the columns it settled (distance d_j <= delta) rise by delta - d_j, which
   keeps every assigned row tight and makes the path's edges tight, and the path is flipped (one
   more row assigned). This is the Hungarian method's invariant (dual feasibility and
   complementary slackness of the assigned rows), so when no row is free the assignment is
   optimal: gap = 0. The auction's prices are nearly optimal duals, so the paths are short, and
   only the rows left non-tight are repaired (on random float32 costs at n = 4096, about a
   quarter of the rows, about 8 Dijkstra steps each), not n as in the Hungarian method.

Which of several optimal assignments is returned depends on the steps above (ties are not
broken as scipy breaks them). Rounding: C' + p is evaluated in the costs' dtype; in float32,
the certified gap is exact for those rounded sums, and the cost is within a few ulps of the
near-optimal entries per row of the optimum (tests/test_auction.py compares with scipy in
float64 and float32).

Work: O(n^2) for the reduction, candidates and the dense tightness check; the auction's bids
cost O(k) each (about 2-3 bids per row per phase on random costs); the repair's Dijkstra steps
cost O(n) each. Every loop is bounded: a phase stops after ``_MAX_BIDS_PER_ROW`` * n bids (then
the auction ends and the repair, which is exact whatever the auction left, finishes alone, in the
Hungarian method's O(n^3) at worst), so the solver ends on any finite costs.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

# Candidate columns per row (step 2). With 8, random costs already need columns outside the
# candidates (more repair); 16 leaves them to a few rows.
CANDIDATES = 16
# eps shrinks by this factor per phase (step 3).
THETA = 4.0
# The last phase's eps, relative to the largest k-th candidate cost.
FINAL_EPS = 1e-6
# Rows bidding at once (step 3): on CPU small blocks keep every bid's work O(k); on accelerators
# a block of many rows is one parallel step.
CPU_BLOCK = 16
ACCELERATOR_BLOCK = 1024
# A phase with more bids than this times n stops the auction (e.g. when the candidates admit no
# perfect matching); the repair then finishes alone.
_MAX_BIDS_PER_ROW = 32


class Solution(NamedTuple):
  """``solve``'s answer for [..., n, n] costs.

  Attributes:
    perm: int32 [..., n]; row i is assigned column perm[i].
    prices: [..., n] column prices p of the reduced costs C' (C' = C minus row and column
      minima): u_i = min_j (C'[i, j] + p_j) and p are an optimal dual.
    gap: [...] sum_i (C'[i, perm[i]] + p[perm[i]] - u_i) >= cost(perm) - optimum; 0 certifies
      that perm is optimal (see the module docstring).
    repaired: int32 [...] rows that the repair (step 4) assigned.
    path_steps: int32 [...] the Dijkstra steps (columns settled) of the repair's paths.
  """
  perm: jax.Array
  prices: jax.Array
  gap: jax.Array
  repaired: jax.Array
  path_steps: jax.Array


def solve(cost: jax.Array, *, block: int | None = None) -> Solution:
  """An optimal assignment of [..., n, n] finite costs, with its certificate (module docstring).

  Args:
    cost: [..., n, n] finite floating-point costs (integers are read as float32). Leading axes
      are a batch: on a CPU backend its problems run one after another (``lax.map``: each runs
      its own number of loop steps), elsewhere side by side (``vmap``).
    block: rows bidding at once in the auction; by default ``CPU_BLOCK`` on a CPU backend and
      ``ACCELERATOR_BLOCK`` (at most n) elsewhere.

  Returns:
    ``Solution``: perm, prices, gap (0 for an optimal perm), repaired.

  Raises:
    ValueError: costs that are not [..., n, n] with n >= 1, or concrete costs with NaN or Inf
      entries. (Traced costs cannot be checked: a NaN or Inf entry then gives an unspecified
      permutation whose gap is NaN or Inf.)
  """
  cost = _checked(cost)
  n = cost.shape[-1]
  cpu = jax.default_backend() == "cpu"
  if block is None:
    block = CPU_BLOCK if cpu else ACCELERATOR_BLOCK
  one = functools.partial(_solve_one, block=max(1, min(block, n)))
  if cost.ndim == 2:
    return one(cost)
  flat = cost.reshape(-1, n, n)
  out = jax.lax.map(one, flat) if cpu else jax.vmap(one)(flat)
  return jax.tree.map(lambda x: x.reshape(cost.shape[:-2] + x.shape[1:]), out)


def _checked(cost) -> jax.Array:
  """cost as a floating-point array, or ValueError for a shape that is not [..., n, n] with
  n >= 1, or (concrete costs only) for NaN or Inf entries."""
  if not isinstance(cost, jax.core.Tracer):
    cost = jnp.asarray(cost)
  if cost.ndim < 2 or cost.shape[-1] != cost.shape[-2] or cost.shape[-1] == 0:
    raise ValueError(f"linear assignment needs [..., n, n] costs with n >= 1, got shape "
                     f"{tuple(cost.shape)}")
  if not jnp.issubdtype(cost.dtype, jnp.floating):
    cost = cost.astype(jnp.float32)
  elif jnp.finfo(cost.dtype).bits < 32:  # bf16/f16: prices need float32's resolution
    cost = cost.astype(jnp.float32)
  if not isinstance(cost, jax.core.Tracer) and not bool(jnp.all(jnp.isfinite(cost))):
    raise ValueError("linear assignment needs finite costs; these have NaN or Inf entries")
  return cost


def _solve_one(cost: jax.Array, *, block: int) -> Solution:
  """Steps 1-4 of the module docstring for one [n, n] problem."""
  n = cost.shape[0]
  if n == 1:
    zero = jnp.zeros((), cost.dtype)
    return Solution(jnp.zeros(1, jnp.int32), jnp.zeros(1, cost.dtype), zero, jnp.int32(0),
                    jnp.int32(0))
  c = reduce_costs(cost)
  values, columns = candidates(c, min(CANDIDATES, n))
  prices, assigned = auction(values, columns, block=block)
  prices = tighten(c, prices, assigned)
  perm, prices, repaired, steps = repair(c, prices, assigned)
  return Solution(perm, prices, certificate_gap(c, perm, prices), repaired, steps)


class Reduced(NamedTuple):
  """C' = (C - r) - s (step 1), never formed as a whole: n x n arrays cost page faults on every
  call, and every use of C' is a reduction over it or a few of its rows.

  Attributes:
    cost: [n, n] C.
    row: [n] r_i = min_j C[i, j].
    column: [n] s_j = min_i (C[i, j] - r_i).
  """
  cost: jax.Array
  row: jax.Array
  column: jax.Array

  def rows(self, i: jax.Array) -> jax.Array:
    """C'[i] for a row index i ([n]) or indices i [m] ([m, n])."""
    return (self.cost[i] - self.row[i][..., None]) - self.column

  def entries(self, i: jax.Array, j: jax.Array) -> jax.Array:
    """C'[i, j], elementwise over broadcast i and j."""
    return (self.cost[i, j] - self.row[i]) - self.column[j]

  def whole(self) -> jax.Array:
    """C' [n, n], for XLA to fuse into a reduction."""
    return (self.cost - self.row[:, None]) - self.column


def reduce_costs(cost: jax.Array) -> Reduced:
  """Step 1: C' = C - row minima - column minima (of C - row minima); the same optimal
  assignments as C, and C' >= 0 with a zero in every row and column."""
  row = jnp.min(cost, axis=1)
  return Reduced(cost, row, jnp.min(cost - row[:, None], axis=0))


# Candidates come from the minima of blocks of this many columns when n is a multiple of it and
# at least 64 blocks: lax.top_k over all n columns costs about ten passes over C on CPU, over
# the n / 16 block minima much less. A row's k cheapest columns are then approximately its
# candidates (two of them in one block count once); any candidates give an exact result.
_CANDIDATE_BLOCK = 16


def candidates(c: Reduced, k: int) -> tuple[jax.Array, jax.Array]:
  """Step 2: about each row's k cheapest columns of C': values [n, k] (ascending) and int32
  column indices [n, k]."""
  n = c.cost.shape[0]
  b = _CANDIDATE_BLOCK
  if n % b or n < 64 * b:
    negated, columns = jax.lax.top_k(-c.whole(), k)
    return -negated, columns.astype(jnp.int32)
  blocks = c.whole().reshape(n, n // b, b)
  _, chosen = jax.lax.top_k(-jnp.min(blocks, axis=2), k)                  # [n, k] blocks
  within = jnp.take_along_axis(jnp.argmin(blocks, axis=2), chosen, axis=1)
  columns = (chosen * b + within).astype(jnp.int32)
  values = c.entries(jnp.arange(n)[:, None], columns)
  order = jnp.argsort(values, axis=1)
  return jnp.take_along_axis(values, order, 1), jnp.take_along_axis(columns, order, 1)


class _Auction(NamedTuple):
  """The auction's loop state (step 3)."""
  prices: jax.Array     # [n] p_j
  owner: jax.Array      # int32 [n]: the row holding column j, or -1
  assigned: jax.Array   # int32 [n]: the column of row i, or -1
  queue: jax.Array      # int32 [n]: a ring of the free rows, from head, count of them
  head: jax.Array
  count: jax.Array
  bids: jax.Array       # bids in this phase
  eps: jax.Array        # this phase's eps on the schedule (scale / 4, / theta per phase, ...)
  step: jax.Array       # the eps that bids add: eps, or a few ulps of the largest price if more
  stalled: jax.Array    # a phase ran out of bids: the auction stops, the repair finishes


def auction(values: jax.Array, columns: jax.Array, *, block: int,
            theta: float = THETA, final_eps: float = FINAL_EPS) -> tuple[jax.Array, jax.Array]:
  """Epsilon-scaling auction (step 3) on candidate costs values [n, k] at columns [n, k].

  Returns:
    prices [n], and assigned int32 [n] (row i's column, or -1 for rows left free when the
    auction stopped early).
  """
  n, _ = values.shape
  scale = jnp.max(values[:, -1])
  eps_floor = jnp.maximum(scale * final_eps, jnp.finfo(values.dtype).tiny)
  state = _Auction(prices=jnp.zeros(n, values.dtype), owner=jnp.full(n, -1, jnp.int32),
                   assigned=jnp.full(n, -1, jnp.int32), queue=jnp.arange(n, dtype=jnp.int32),
                   head=jnp.int32(0), count=jnp.int32(n), bids=jnp.int32(0),
                   eps=(scale / 4).astype(values.dtype), step=jnp.zeros((), values.dtype),
                   stalled=scale <= 0)

  def more(s: _Auction) -> jax.Array:
    return ~s.stalled & (s.eps * theta > eps_floor)

  def phase(s: _Auction) -> _Auction:
    # Under vmap a finished problem's phases still run (their results are discarded): with no
    # free rows they are empty.
    prices = s.prices - jnp.min(s.prices)  # a common shift changes no bid; keeps prices small
    # A few ulps of the largest price at least, so that every bid raises a price.
    step = jnp.maximum(s.eps, 8 * jnp.finfo(values.dtype).eps * jnp.max(prices))
    s = s._replace(prices=prices, owner=jnp.full(n, -1, jnp.int32),
                   assigned=jnp.full(n, -1, jnp.int32), queue=jnp.arange(n, dtype=jnp.int32),
                   head=jnp.int32(0), count=jnp.where(more(s), n, 0).astype(jnp.int32),
                   bids=jnp.int32(0), step=step)
    s = jax.lax.while_loop(
        lambda s: (s.count > 0) & (s.bids < _MAX_BIDS_PER_ROW * n),
        functools.partial(_bid, values, columns, block), s)
    return s._replace(eps=s.eps / theta, stalled=s.count > 0)

  state = jax.lax.while_loop(more, phase, state)
  return state.prices, state.assigned


def _bid(values: jax.Array, columns: jax.Array, block: int, s: _Auction) -> _Auction:
  """One round: the next ``block`` free rows of the queue bid; losers and the rows whose columns
  were taken go back to the queue's end."""
  n, k = values.shape
  lane = jnp.arange(block, dtype=jnp.int32)
  size = jnp.minimum(block, s.count)
  bidding = lane < size
  rows = s.queue[(s.head + lane) % n]                            # [B]
  row_values, row_columns = values[rows], columns[rows]          # [B, k]
  total = row_values + s.prices[row_columns]
  best = jnp.argmin(total, axis=1)
  w1 = jnp.take_along_axis(total, best[:, None], 1)[:, 0]
  w2 = jnp.min(jnp.where(jnp.arange(k) == best[:, None], jnp.inf, total), axis=1)
  target = jnp.take_along_axis(row_columns, best[:, None], 1)[:, 0]
  bid = jnp.where(bidding, w2 - (w1 - s.prices[target]) + s.step, -jnp.inf)
  wins = bidding & _first_highest(target, bid, block)
  won = jnp.where(wins, target, n)                               # n: dropped by the scatters
  previous = jnp.where(wins, s.owner[jnp.where(wins, target, 0)], -1)
  assigned = s.assigned.at[jnp.where(previous >= 0, previous, n)].set(-1, mode="drop")
  assigned = assigned.at[jnp.where(wins, rows, n)].set(target, mode="drop")
  requeue = jnp.where(wins, previous, jnp.where(bidding, rows, -1))
  back = requeue >= 0
  slot = (s.head + s.count + jnp.cumsum(back) - 1) % n
  queue = s.queue.at[jnp.where(back, slot, n)].set(requeue, mode="drop")
  return s._replace(prices=s.prices.at[won].set(bid, mode="drop"),
                    owner=s.owner.at[won].set(rows, mode="drop"), assigned=assigned, queue=queue,
                    head=(s.head + size) % n, count=s.count - size + back.sum(dtype=jnp.int32),
                    bids=s.bids + size)


def _first_highest(target: jax.Array, bid: jax.Array, block: int) -> jax.Array:
  """[B] bool: whether bid b is the highest for its target column, ties to the lowest b."""
  lane = jnp.arange(block)
  same = target[:, None] == target[None, :]
  beaten = same & ((bid[None, :] > bid[:, None])
                   | ((bid[None, :] == bid[:, None]) & (lane[None, :] < lane[:, None])))
  return ~jnp.any(beaten, axis=1)


def _row_minima(c: Reduced, prices: jax.Array) -> jax.Array:
  """u_i = min_j (C'[i, j] + p_j); [n]."""
  return jnp.min(c.whole() + prices[None, :], axis=1)


def _tight(c: Reduced, prices: jax.Array, perm: jax.Array) -> jax.Array:
  """[n] bool: row i has a column perm[i] >= 0 that attains u_i."""
  col = jnp.maximum(perm, 0)
  mine = c.entries(jnp.arange(perm.shape[0]), col) + prices[col]
  return (perm >= 0) & (mine <= _row_minima(c, prices))


# Rounds of ``tighten``.
TIGHTEN_ROUNDS = 4


def tighten(c: Reduced, prices: jax.Array, assigned: jax.Array,
            rounds: int = TIGHTEN_ROUNDS) -> jax.Array:
  """Lowers the price of every non-tight row's column by the row's violation
  C'[i, pi(i)] + p_pi(i) - u_i, making the row tight (and maybe others not), ``rounds`` times:
  Bellman-Ford on the assignment's residual graph, which converges when the assignment is
  optimal; the auction's rarely is, but four rounds leave about a fifth as many rows for the
  repair on random costs. Prices only; the repair keeps exactness whatever they are."""
  n = assigned.shape[0]
  col = jnp.maximum(assigned, 0)

  def lower(_, prices):
    violation = c.entries(jnp.arange(n), col) + prices[col] - _row_minima(c, prices)
    return prices.at[col].add(-jnp.where(assigned >= 0, violation, 0))

  return jax.lax.fori_loop(0, rounds, lower, prices)


class _Path(NamedTuple):
  """Dijkstra's state for one augmenting path (step 4)."""
  dist: jax.Array     # [n] d_j, from the free row
  pred: jax.Array     # int32 [n]: the row before column j on its shortest path
  settled: jax.Array  # bool [n]
  end: jax.Array      # the unassigned column reached (valid once found)
  found: jax.Array
  steps: jax.Array    # Dijkstra steps of every path so far


def repair(c: Reduced, prices: jax.Array, assigned: jax.Array):
  """Step 4: frees the non-tight rows and assigns each by a shortest augmenting path.

  Returns:
    (perm int32 [n], prices [n], number of rows repaired, Dijkstra steps in all).
  """
  n = c.cost.shape[0]
  tight = _tight(c, prices, assigned)
  assigned = jnp.where(tight, assigned, -1)
  owner = jnp.full(n, -1, jnp.int32).at[jnp.where(tight, assigned, n)].set(
      jnp.arange(n, dtype=jnp.int32), mode="drop")
  free = jnp.nonzero(~tight, size=n, fill_value=0)[0].astype(jnp.int32)
  count = jnp.sum(~tight, dtype=jnp.int32)

  def augment(i, state):
    assigned, owner, prices, steps = state
    # Under vmap a problem with all rows assigned still runs the loop's body: inactive, it must
    # change nothing and end (no unassigned column is left to end a path).
    return _augment(c, free[i], i < count, assigned, owner, prices, steps)

  assigned, _, prices, steps = jax.lax.fori_loop(0, count, augment,
                                                 (assigned, owner, prices, jnp.int32(0)))
  return assigned, prices, count, steps


def _augment(c, start, active, assigned, owner, prices, steps):
  """One shortest augmenting path from the free row ``start`` (step 4); nothing if not
  ``active``."""
  n = c.cost.shape[0]
  first = c.rows(start) + prices
  path = _Path(dist=first - jnp.min(first), pred=jnp.full(n, start, jnp.int32),
               settled=jnp.zeros(n, bool), end=jnp.int32(0), found=~active,
               steps=steps)

  def step(s: _Path) -> _Path:
    d = jnp.where(s.settled, jnp.inf, s.dist)
    nearest = jnp.min(d)
    at_min = d == nearest
    unowned = at_min & (owner < 0)  # among the nearest, an unassigned column ends the path
    j = jnp.where(jnp.any(unowned), jnp.argmax(unowned), jnp.argmax(at_min)).astype(jnp.int32)
    found = owner[j] < 0
    i = jnp.maximum(owner[j], 0)
    settled = s.settled.at[j].set(~found)
    through = nearest + (c.rows(i) + prices) - (c.entries(i, j) + prices[j])
    shorter = ~settled & (through < s.dist) & ~found
    return _Path(dist=jnp.where(shorter, through, s.dist), pred=jnp.where(shorter, i, s.pred),
                 settled=settled, end=j, found=found, steps=s.steps + 1)

  path = jax.lax.while_loop(lambda s: ~s.found, step, path)
  delta = path.dist[path.end]
  prices = prices + jnp.where(path.settled, delta - path.dist, 0)

  def flip(state):
    column, assigned, owner, _ = state
    row = path.pred[column]
    after = assigned[row]
    return after, assigned.at[row].set(column), owner.at[column].set(row), row == start

  _, assigned, owner, _ = jax.lax.while_loop(lambda s: ~s[3], flip,
                                             (path.end, assigned, owner, ~active))
  return assigned, owner, prices, path.steps


def certificate_gap(c: Reduced, perm: jax.Array, prices: jax.Array) -> jax.Array:
  """sum_i (C'[i, perm[i]] + p_perm[i] - min_j (C'[i, j] + p_j)) >= cost(perm) - optimum (the
  module docstring); 0 certifies perm optimal. perm int32 [n], prices [n] of C'."""
  mine = c.entries(jnp.arange(perm.shape[0]), perm) + prices[perm]
  return jnp.sum(mine - _row_minima(c, prices))
