"""Interpolation path and barriers."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn_symmetry import lmc


def test_barrier_of_known_curves():
  lams = lmc.lambdas(25)
  assert lams[0] == 0 and lams[-1] == 1 and len(lams) == 25
  assert lmc.barrier(lams, 2 + 3 * lams) == pytest.approx(0.0, abs=1e-12)  # on the chord
  bump = 1.0 + lams + 4 * lams * (1 - lams)  # peak gap 1 at lambda = 1/2
  assert lmc.barrier(lams, bump) == pytest.approx(1.0)
  assert lmc.barrier(lams, 0.9 - 0.2 * lams * (1 - lams), higher_is_better=True) == pytest.approx(0.05)
  assert lmc.barrier(lams, 1.0 - lams * (1 - lams)) == 0.0  # a valley is no barrier
  with pytest.raises(ValueError, match="lambdas from 0 to 1"):
    lmc.barrier(lams[1:], bump[1:])
  with pytest.raises(ValueError, match="at least 2"):
    lmc.lambdas(1)


def _metric(params, batch):
  pred = batch["x"] @ params["w"] + params["b"]
  return {"loss": jnp.sum((pred - batch["y"]) ** 2), "count": jnp.asarray(batch["x"].shape[0], float)}


@pytest.mark.parametrize("chunk_size", [None, 4, 25])
def test_evaluate_path_matches_pointwise_evaluation(chunk_size):
  rng = np.random.default_rng(0)
  a = {"w": rng.normal(size=(3,)).astype(np.float32), "b": np.float32(0.5)}
  b = {"w": rng.normal(size=(3,)).astype(np.float32), "b": np.float32(-1.0)}
  batches = [{"x": rng.normal(size=(8, 3)).astype(np.float32), "y": rng.normal(size=8).astype(np.float32)}
             for _ in range(3)]
  lams = lmc.lambdas(25)
  traced = chex.assert_max_traces(n=1)(_metric)
  sums = lmc.evaluate_path(lmc.path_evaluator(traced), a, b, batches, lams, chunk_size=chunk_size)
  for i, lam in enumerate(lams):  # reference: the path and the loss written out in numpy
    w = (1 - lam) * a["w"].astype(np.float64) + lam * b["w"].astype(np.float64)
    bias = (1 - lam) * np.float64(a["b"]) + lam * np.float64(b["b"])
    want = sum(np.sum((batch["x"].astype(np.float64) @ w + bias - batch["y"]) ** 2)
               for batch in batches)
    assert sums["loss"][i] == pytest.approx(want, rel=1e-5)
  np.testing.assert_array_equal(sums["count"], 24.0)
  chex.clear_trace_counter()


def test_interpolate_keeps_dtypes_and_endpoints():
  a = {"w": jnp.ones(3, jnp.bfloat16), "i": jnp.zeros(2)}
  b = {"w": jnp.zeros(3, jnp.bfloat16), "i": jnp.ones(2)}
  assert lmc.interpolate(a, b, 0.25)["w"].dtype == jnp.bfloat16
  chex.assert_trees_all_close(lmc.interpolate(a, b, 0.0), a)
  chex.assert_trees_all_close(lmc.interpolate(a, b, 1.0), b)


@pytest.mark.parametrize("lam", [0.25, 0.5, 0.7])
def test_interpolate_interior_is_the_straight_line(x64, lam):
  rng = np.random.default_rng(1)
  a = {"w": rng.normal(size=(4, 3)), "b": {"c": rng.normal(size=5)}}
  b = {"w": rng.normal(size=(4, 3)), "b": {"c": rng.normal(size=5)}}
  got = lmc.interpolate(jax.tree.map(jnp.asarray, a), jax.tree.map(jnp.asarray, b), lam)
  np.testing.assert_allclose(got["w"], (1 - lam) * a["w"] + lam * b["w"], rtol=1e-14, atol=1e-14)
  np.testing.assert_allclose(got["b"]["c"], (1 - lam) * a["b"]["c"] + lam * b["b"]["c"],
                             rtol=1e-14, atol=1e-14)
