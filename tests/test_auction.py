"""The auction solver of the linear assignment (attn_symmetry.matching._auction): optimal costs
against scipy's, its certificate, batching, jit, and refused inputs."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.optimize

from attn_symmetry.matching import _auction


def _random(n, seed=0):
  return np.random.default_rng(seed).normal(size=(n, n))


def _near_permutation(n, seed=0, noise=0.3):
  """-(P + noise N(0, 1)) and P's permutation: at noise 0.3 some row minima share a column."""
  rng = np.random.default_rng(seed)
  perm = rng.permutation(n)
  return -(np.eye(n)[perm] + noise * rng.normal(size=(n, n))), perm


def _assert_optimal(cost, perm, rtol):
  """perm is a permutation whose cost equals scipy's optimum within rtol (summed in float64)."""
  cost = np.asarray(cost, np.float64)
  perm = np.asarray(perm)
  n = cost.shape[-1]
  assert sorted(perm) == list(range(n))
  rows, cols = scipy.optimize.linear_sum_assignment(cost)
  np.testing.assert_allclose(cost[np.arange(n), perm].sum(), cost[rows, cols].sum(), rtol=rtol)


@pytest.mark.parametrize("n", [2, 17, 64, 512])
@pytest.mark.parametrize("kind", ["random", "near_permutation"])
def test_optimal_in_float64_with_a_zero_gap(x64, n, kind):
  cost = _random(n, n) if kind == "random" else _near_permutation(n, n)[0]
  solution = jax.jit(_auction.solve)(cost)
  _assert_optimal(cost, solution.perm, rtol=1e-12)
  assert solution.prices.dtype == jnp.float64
  assert abs(float(solution.gap)) <= 1e-12 * n


@pytest.mark.parametrize("kind", ["random",
                                  pytest.param("near_permutation", marks=pytest.mark.slow)])
def test_optimal_in_float32_within_1e6(kind):
  """512 rows in float32, and 1024 (where the candidates come from block minima)."""
  for n in (512, 1024):
    cost = (_random(n, 1) if kind == "random" else _near_permutation(n, 1)[0]).astype(np.float32)
    solution = jax.jit(_auction.solve)(cost)
    _assert_optimal(cost, solution.perm, rtol=1e-6)
    assert solution.repaired > 0  # the auction alone is not exact: the repair ran


def test_the_planted_permutation_is_recovered():
  cost, perm = _near_permutation(256, seed=3, noise=0.05)
  np.testing.assert_array_equal(jax.jit(_auction.solve)(cost.astype(np.float32)).perm, perm)


def test_the_gap_bounds_a_worse_permutation(x64):
  """The certificate: 0 for the optimum, and at least the excess cost for a worse permutation."""
  cost = _random(64, 5)
  solution = jax.jit(_auction.solve)(cost)
  reduced = _auction.reduce_costs(jnp.asarray(cost))
  worse = np.asarray(solution.perm).copy()
  worse[[0, 1]] = worse[[1, 0]]
  rows = np.arange(64)
  excess = cost[rows, worse].sum() - cost[rows, np.asarray(solution.perm)].sum()
  assert excess > 0
  assert float(_auction.certificate_gap(reduced, jnp.asarray(worse), solution.prices)) >= (
      excess - 1e-12)
  assert abs(float(_auction.certificate_gap(reduced, solution.perm, solution.prices))) <= 1e-12


def test_the_repair_alone_is_exact(x64, monkeypatch):
  """A phase out of bids stops the auction (as when the candidates admit no perfect matching);
  the shortest augmenting paths then assign every row, still optimally."""
  monkeypatch.setattr(_auction, "_MAX_BIDS_PER_ROW", 0)
  cost = _random(128, 9)
  # The constant is read when tracing, and jit keeps traces by function and shapes: a new
  # function is traced with it.
  solution = jax.jit(functools.partial(_auction.solve))(cost)
  assert int(solution.repaired) == 128
  _assert_optimal(cost, solution.perm, rtol=1e-12)


@pytest.mark.parametrize("cost", [np.zeros((40, 40)), np.ones((40, 40)),
                                  np.add.outer(np.arange(40.0), np.arange(40.0)),
                                  np.random.default_rng(2).integers(0, 3, (40, 40)),
                                  np.random.default_rng(4).normal(size=(40, 40)) * 1e6 + 1e9],
                         ids=["zeros", "ones", "sum", "ties", "offset"])
def test_degenerate_costs(cost):
  """Every permutation optimal, many ties, integer costs, a large offset (float32)."""
  _assert_optimal(cost.astype(np.float32), jax.jit(_auction.solve)(cost).perm, rtol=1e-6)


def test_a_batch_under_vmap(x64):
  """Under vmap a finished problem keeps running its loops' bodies: they must change nothing and
  end. (Leading axes, which CPU backends solve one after another, are in test_matching.py.)"""
  cost = np.stack([_random(48, s) for s in range(4)]).reshape(2, 2, 48, 48)
  solution = jax.jit(jax.vmap(jax.vmap(_auction.solve)))(cost)
  assert solution.perm.shape == (2, 2, 48) and solution.gap.shape == (2, 2)
  for c, p in zip(cost.reshape(4, 48, 48), np.asarray(solution.perm).reshape(4, 48)):
    _assert_optimal(c, p, rtol=1e-12)


@pytest.mark.slow  # 9 s: a program of its own for the accelerators' bidding block
def test_an_accelerator_block_on_cpu(x64):
  """The block of rows bidding at once (ACCELERATOR_BLOCK off CPU) changes nothing but speed."""
  cost = _random(200, 8)
  for block in (1, 1024):
    _assert_optimal(cost, jax.jit(lambda c, b=block: _auction.solve(c, block=b))(cost).perm,
                    rtol=1e-12)


def test_size_one():
  np.testing.assert_array_equal(_auction.solve(np.ones((3, 1, 1))).perm, np.zeros((3, 1)))


@pytest.mark.parametrize("shape", [(3, 4), (5,), (0, 0), (2, 3, 2)])
def test_ill_shaped_costs_are_refused(shape):
  with pytest.raises(ValueError, match=r"\[\.\.\., n, n\] costs"):
    _auction.solve(np.zeros(shape))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_costs_are_refused(bad):
  cost = _random(8)
  cost[2, 3] = bad
  with pytest.raises(ValueError, match="NaN or Inf"):
    _auction.solve(cost)
