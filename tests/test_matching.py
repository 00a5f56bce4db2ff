"""Attention matching: LAP, Stage 1 features, planted recovery, noise, exhaustive mode, jit, bad input."""

import functools
import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.optimize

from attn_symmetry import attention
from attn_symmetry import group_action as ga
from attn_symmetry import matching
from attn_symmetry import spec as spec_lib
from attn_symmetry.matching import _assignment
from attn_symmetry.matching import _attention
from attn_symmetry.matching import _stage2

D, N, H, L = 12, 4, 4, 2

# name -> (group, num_kv_heads, biases, rope_pairing, rotary_fraction)
CASES = {
    "gl": ("gl", None, True, "half", 1.0),
    "gl_no_bias": ("gl", None, False, "half", 1.0),
    "gl_gqa": ("gl", 2, True, "half", 1.0),
    "rope_half_gqa": ("rope", 2, False, "half", 1.0),
    "rope_interleaved_partial": ("rope", None, True, "interleaved", 0.5),
}


def _stack(seed, *, kv=None, bias=True, layers=L, width=D):
  """``layers`` random canonical attention layers stacked, [L, ...] float64 leaves.

  Test data comes from numpy: every distinct eager JAX op would cost a compile.
  """
  rng = np.random.default_rng(seed)
  k = kv or N
  shapes = {"query": ((width, N, H), (N, H)), "key": ((width, k, H), (k, H)),
            "value": ((width, k, H), (k, H)), "out": ((N, H, width), (width,))}
  params = {}
  for name, (kernel, bias_shape) in shapes.items():
    params[name] = {"kernel": rng.normal(size=(layers, *kernel)) / np.sqrt(kernel[0])}
    if bias:
      params[name]["bias"] = 0.1 * rng.normal(size=(layers, *bias_shape))
  return params


_act = jax.jit(ga.apply)
_random_element = jax.jit(ga.random_element, static_argnames=("site", "group", "batch_shape",
                                                               "dtype"))


def _site(case):
  group, kv, _, pairing, fraction = CASES[case]
  return spec_lib.AttentionSite(N, H, num_kv_heads=kv, group=group, rope_pairing=pairing,
                                rotary_fraction=fraction)


def _planted(case, seed=0, noise=0.0, element_group=None):
  """(A, B = g A (+ noise), g, the layers' AttentionSite) for one of CASES."""
  _, kv, bias, _, _ = CASES[case]
  site = _site(case)
  a = _stack(seed, kv=kv, bias=bias)
  g = _random_element(jax.random.key(seed), site, group=element_group, batch_shape=(L,),
                      dtype=jnp.float64)
  g = g._replace(perm=np.asarray(g.perm, np.int32))  # as matching returns it: one trace of _act
  b = jax.tree.map(np.asarray, _act(a, g))
  if noise:
    rng = np.random.default_rng(seed + 1)
    b = jax.tree.map(lambda x: x + noise * np.std(x) * rng.normal(size=x.shape), b)
  return a, b, g, site


def _inverse_perm(g):
  return np.argsort(np.asarray(g.perm), axis=-1)


def _squared_distance(a, b, element=None):
  """sum over the head-symmetric leaves of ||a - element . b||^2, computed directly."""
  moved = spec_lib.flatten(b if element is None else _act(b, element))
  return sum(np.sum((leaf - moved[p]) ** 2) for p, leaf in spec_lib.flatten(a).items()
             if p != "out/bias")


@functools.partial(jax.jit, static_argnames=("pairing", "fraction"))
def _rotations(offsets, *, pairing, fraction):
  """R_k [len(offsets), H, H] as matrices, from apply_rope on the basis rows."""
  eye = jnp.broadcast_to(jnp.eye(H, dtype=jnp.float64)[None, :, None, :], (len(offsets), H, 1, H))
  positions = jnp.broadcast_to(offsets[:, None], (len(offsets), H))
  return attention.apply_rope(eye, positions, pairing=pairing, rotary_fraction=fraction)[:, :, 0]


# ----------------------------------------------------------------------------- the LAP


def _assert_optimal(cost, perm):
  n = cost.shape[-1]
  for c, p in zip(cost.reshape(-1, n, n), np.asarray(perm).reshape(-1, n)):
    assert sorted(p) == list(range(n))
    rows, cols = scipy.optimize.linear_sum_assignment(c)
    np.testing.assert_allclose(c[np.arange(n), p].sum(), c[rows, cols].sum(), rtol=1e-12)


def _fresh_solvers(monkeypatch):
  """Puts new function objects in place of linear_assignment's two solvers, and returns a new
  jitted linear_assignment: the path is chosen when a call is traced, and JAX keys the traces
  it keeps (jit's, lax.cond's branches) by function and shapes, so a trace made under another
  path is otherwise reused. New functions trace anew, and the rest of the run keeps its
  compiled programs (``jax.clear_caches`` would drop every one)."""
  for name in ("_hungarian", "_device_assignment"):
    monkeypatch.setattr(_assignment, name, functools.partial(getattr(_assignment, name)))
  return jax.jit(functools.partial(matching.linear_assignment))


def _use_solver(monkeypatch, solver):
  """Forces one of linear_assignment's paths for every size: "auction" (on CPU, problems of a
  batch one after another), "hungarian" (optax's, CPU) or "device" (the auction, vmapped);
  returns a jitted linear_assignment traced on that path (``_fresh_solvers``)."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu" if solver == "device" else "cpu")
  monkeypatch.setattr(_assignment, "AUCTION_MIN_SIZE", 10**9 if solver == "hungarian" else 0)
  return _fresh_solvers(monkeypatch)


@pytest.mark.parametrize("shape", [(1, 1), (5, 5), (3, 9, 9), (2, 3, 9, 9), (17, 17)])
@pytest.mark.parametrize("solver", ["auction", "hungarian", "device"])
def test_linear_assignment_is_optimal(x64, monkeypatch, shape, solver):
  """Both solvers, on this machine: the auction (one problem after another or vmapped) and
  optax's Hungarian algorithm."""
  solve = _use_solver(monkeypatch, solver)
  cost = np.random.default_rng(sum(shape)).normal(size=shape)
  _assert_optimal(cost, solve(cost))


@pytest.mark.parametrize("solver", ["auction", "hungarian"])
def test_linear_assignment_certifies_distinct_row_minima_without_a_solver(x64, monkeypatch,
                                                                         solver):
  """Costs whose row minima lie in distinct columns are answered by the minima (optimal) and
  reach no solver; costs where two rows share their minimum's column reach it."""
  solve = _use_solver(monkeypatch, solver)
  calls = []

  def counted(real):  # counts the calls that run, not the traces (lax.cond traces both)
    def solve(cost):
      jax.debug.callback(lambda: calls.append(1))
      return real(cost)
    return solve

  for name in ("_hungarian", "_device_assignment"):
    monkeypatch.setattr(_assignment, name, counted(getattr(_assignment, name)))
  rng = np.random.default_rng(7)
  perm = rng.permutation(9)
  near = -np.eye(9)[perm] + 0.1 * rng.normal(size=(9, 9))  # row i's minimum at perm[i]
  clash = near.copy()
  clash[0] = clash[1]  # rows 0 and 1 share their minimum's column
  for cost, solved in ((near, False), (clash, True)):
    calls.clear()
    _assert_optimal(cost, solve(cost))
    assert bool(calls) == solved
  np.testing.assert_array_equal(solve(near), perm)


def test_linear_assignment_keeps_every_problem_on_the_device(monkeypatch):
  """No host callback enters the program at any size (it stays persistently cacheable), and the
  size decides the CPU solver: the Hungarian algorithm below AUCTION_MIN_SIZE, the auction from
  it."""
  monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
  solve = _fresh_solvers(monkeypatch)
  traced = []
  monkeypatch.setattr(_assignment, "_device_assignment",
                      lambda c, real=_assignment._device_assignment: traced.append(1) or real(c))
  small = solve.lower(jnp.zeros((8, 8))).as_text()
  assert not traced
  large = solve.lower(jnp.zeros((_assignment.AUCTION_MIN_SIZE,) * 2)).as_text()
  assert traced
  assert "callback" not in small and "callback" not in large


@pytest.mark.parametrize("solver", ["auction", "hungarian", "device"])
def test_linear_assignment_under_vmap_and_in_a_loop(x64, monkeypatch, solver):
  """Every solver batches under vmap and runs inside lax loops."""
  _use_solver(monkeypatch, solver)  # vmap and the loop's body below are new functions too
  cost = np.random.default_rng(3).normal(size=(4, 2, 6, 6))
  _assert_optimal(cost, jax.jit(jax.vmap(matching.linear_assignment))(cost))

  def body(i, perms):
    return perms.at[i].set(matching.linear_assignment(jnp.asarray(cost[0])[i]))

  perms = jax.jit(lambda: jax.lax.fori_loop(0, 2, body, jnp.zeros((2, 6), jnp.int32)))()
  _assert_optimal(cost[0], perms)


@pytest.mark.parametrize("heads,kv,exhaustive", [(4, 4, True), (4, 2, True), (6, 6, True),
                                                 (8, 2, True), (8, 4, True), (8, 8, False),
                                                 (8, 1, False), (9, 3, False)])
def test_head_assignment_is_the_cheapest_kv_preserving_permutation(x64, monkeypatch, heads, kv,
                                                                   exhaustive):
  """``assign_heads`` returns a permutation of least total cost among those that move kv groups
  as wholes: by trying each where they number at most EXHAUSTIVE_MAX_PERMUTATIONS (no solver
  is traced), by the assignment solvers above that; jitted and under vmap alike."""
  solvers = []
  monkeypatch.setattr(_assignment, "linear_assignment",
                      lambda c, real=_assignment.linear_assignment: solvers.append(1) or real(c))
  costs = np.random.default_rng(heads + kv).normal(size=(3, heads, heads))
  assign = jax.jit(jax.vmap(functools.partial(_assignment.assign_heads, num_kv_heads=kv)))
  perms = np.asarray(assign(costs))
  assert bool(solvers) != exhaustive
  allowed = matching.head_permutations(heads, kv)
  for cost, perm in zip(costs, perms):
    assert perm.dtype == np.int32 and any((perm == p).all() for p in allowed)
    best = cost[np.arange(heads), allowed].sum(-1).min()
    np.testing.assert_allclose(cost[np.arange(heads), perm].sum(), best, rtol=1e-12)


@pytest.mark.parametrize("kv", [None, 2, 1])
def test_head_permutations_enumerate_the_kv_preserving_ones(kv):
  perms = matching.head_permutations(N, kv)
  g = N // (kv or N)
  expected = {p for p in itertools.permutations(range(N))
              if all(p[i] // g == p[i - i % g] // g for i in range(N))}
  assert {tuple(p) for p in perms} == expected and len(perms) == len(expected)
  assert list(perms[0]) == list(range(N))


# ----------------------------------------------------------------------------- Stage 1 features


def _circuits(layer, n, site):
  """Brute force: the D+1-sized QK circuits (per frequency pair with RoPE) and VO circuit of head n."""
  k = n // (N // layer["key"]["kernel"].shape[-2])
  aug = lambda name, i: np.concatenate([layer[name]["kernel"][:, i], layer[name]["bias"][None, i]])
  q, key, v = aug("query", n), aug("key", k), aug("value", k)
  if site.group == "rope":
    pairs = site.rope_pairs()
    blocks = [list(p) for p in pairs] + [sorted(set(range(H)) - set(pairs.reshape(-1)))]
    qk = [q[:, b] @ key[:, b].T for b in blocks if b]
  else:
    qk = [q @ key.T]
  return np.stack(qk), v @ np.asarray(layer["out"]["kernel"][n])


def _brute_force_distance(x, y, distance):
  if distance == "squared":
    return np.sum((x - y) ** 2)
  if distance == "frobenius":
    return np.linalg.norm(x - y)
  cosine = np.sum(x * y) / (np.linalg.norm(x) * np.linalg.norm(y))
  return 1 - cosine if distance == "cosine" else np.sqrt(2 - 2 * cosine)


@pytest.mark.parametrize("pairing,fraction,rope_axes",
                         [("half", 1.0, 1), ("interleaved", 0.5, 1), ("half", 1.0, 2)])
def test_rope_group_parameters_are_the_matrix_entries_and_project_is_orthogonal(
    x64, pairing, fraction, rope_axes):
  """H(H) from its parameters holds a_p on (i, i) and (j, j), b_p on (i, j), -b_p on (j, i), the
  free block on the unrotated dims and zeros elsewhere; ``project`` returns the parameters of
  such a matrix exactly, and of any matrix m those of its Frobenius projection: m minus it is
  orthogonal to every element of H(H) (float64)."""
  site = spec_lib.AttentionSite(4, 8, group="rope", rope_pairing=pairing,
                                rotary_fraction=fraction, rope_axes=rope_axes)
  pairs, rng = site.rope_pairs(), np.random.default_rng(0)
  unrotated = np.setdiff1d(np.arange(8), pairs.reshape(-1))
  params = {"ab": rng.normal(size=(len(pairs), 2))}
  if len(unrotated):
    params["rest"] = rng.normal(size=(len(unrotated), len(unrotated)))
  want = np.zeros((8, 8))
  for (i, j), (a, b) in zip(pairs, params["ab"]):
    want[i, i], want[j, j], want[i, j], want[j, i] = a, a, b, -b
  if len(unrotated):
    want[np.ix_(unrotated, unrotated)] = params["rest"]
  np.testing.assert_array_equal(_stage2.to_matrix(params, site), want)
  chex.assert_trees_all_equal(_stage2.project(jnp.asarray(want), site), params)
  m = rng.normal(size=(8, 8))
  residual = m - np.asarray(_stage2.project_matrix(jnp.asarray(m), site))
  for _ in range(3):
    other = {k: rng.normal(size=v.shape) for k, v in params.items()}
    assert abs(np.sum(residual * np.asarray(_stage2.to_matrix(other, site)))) < 1e-12


@pytest.mark.parametrize("case", ["gl_gqa", "rope_interleaved_partial"])
def test_head_distances_equal_brute_force_circuits(x64, case):
  """The Gram/trace expansions equal distances of the explicitly formed D x D circuits."""
  site = _site(case)
  a, b = (jax.tree.map(lambda x: np.asarray(x[0]), _stack(s, kv=site.num_kv_heads, layers=1))
          for s in (0, 1))
  costs = jax.jit(lambda a, b: [matching.head_distances(a, b, site, distance=d)
                                for d in matching.DISTANCES])(a, b)
  for distance, cost in zip(matching.DISTANCES, costs):
    for n, m in itertools.product(range(N), range(N)):
      (qk_a, vo_a), (qk_b, vo_b) = _circuits(a, n, site), _circuits(b, m, site)
      want = _brute_force_distance(qk_a, qk_b, distance) + _brute_force_distance(vo_a, vo_b, distance)
      np.testing.assert_allclose(cost[n, m], want, rtol=1e-9, atol=1e-9, err_msg=distance)


# ----------------------------------------------------------------------------- planted recovery


# One case of each group in the fast tier; the other cases (each compiles a matcher of its
# own, 12-26 s) in the whole suite.
_SLOW = pytest.mark.slow


@pytest.mark.parametrize("case", ["gl", pytest.param("gl_no_bias", marks=_SLOW),
                                  pytest.param("gl_gqa", marks=_SLOW), "rope_half_gqa",
                                  pytest.param("rope_interleaved_partial", marks=_SLOW)])
def test_planted_recovery(x64, case):
  """init="best" (least-squares starts, exact on planted problems) recovers g to rounding."""
  a, b, g, site = _planted(case)
  element, info = matching.match_attention(a, b, site, init="best")
  np.testing.assert_array_equal(element.perm, _inverse_perm(g))
  moved = spec_lib.flatten(_act(b, element))
  for path, leaf in spec_lib.flatten(a).items():
    assert np.linalg.norm(moved[path] - leaf) / np.linalg.norm(leaf) <= 1e-5, path
  # The Gram-based objectives are the squared parameter distances.
  np.testing.assert_allclose(info["objective"]["naive"].sum(), _squared_distance(a, b), rtol=1e-9)
  assert float(info["objective"]["full"].sum()) <= 1e-10 * float(info["objective"]["naive"].sum())
  if site.group == "rope":
    qk = np.asarray(element.qk)
    for r in np.asarray(_rotations(jnp.array([1.0, 2.0, 7.0]), pairing=site.rope_pairing,
                                   fraction=site.rotary_fraction)):
      np.testing.assert_allclose(r @ qk, qk @ r, atol=1e-10)


@pytest.mark.slow
def test_init_chooses_the_start(x64):
  """With no refinement steps "full" is its start: the Procrustes solution for
  init="procrustes" (equal to "ortho"), the exact least-squares solution of a planted problem
  for "best". With the default solver from Procrustes the planted element is recovered."""
  a, b, g, site = _planted("gl")
  ortho, _ = matching.match_attention(a, b, site, method="ortho")
  start, info = matching.match_attention(a, b, site, steps=0)
  np.testing.assert_array_equal(start.qk, ortho.qk)
  np.testing.assert_array_equal(start.vo, ortho.vo)
  _, info = matching.match_attention(a, b, site, steps=0, init="best")
  assert float(info["objective"]["full"].sum()) <= 1e-10 * float(info["objective"]["ortho"].sum())
  element, info = matching.match_attention(a, b, site)
  objective = {k: float(v.sum()) for k, v in info["objective"].items()}
  np.testing.assert_array_equal(element.perm, _inverse_perm(g))
  assert objective["full"] <= 1e-4 * objective["naive"] < 1e-2 * objective["ortho"]


@pytest.mark.parametrize("case", ["gl", pytest.param("rope_half_gqa", marks=_SLOW)])
def test_noise_orders_the_methods(x64, case):
  """B = g A + noise: perm >= ortho >= full, and full well below naive."""
  a, b, _, site = _planted(case, seed=3, noise=0.2)
  element, info = matching.match_attention(a, b, site)
  objective = {k: float(v.sum()) for k, v in info["objective"].items()}
  assert objective["perm"] >= objective["ortho"] >= objective["full"]
  assert objective["full"] <= 0.1 * objective["naive"]
  np.testing.assert_allclose(objective["full"], _squared_distance(a, b, element), rtol=1e-9)
  if case == "gl":  # the Variant 2 element itself gives the reported distance
    variant, _ = matching.match_attention(a, b, site, method="ortho")
    np.testing.assert_allclose(_squared_distance(a, b, variant), objective["ortho"], rtol=1e-9)
    assert objective["ortho"] > 1.5 * objective["full"]  # refinement matters for GL(H)


@pytest.mark.parametrize("solver", matching.SOLVERS)
def test_refinement_guard_keeps_matrices_well_conditioned(x64, solver):
  """A rank-deficient key head (and for Adam a huge learning rate): the result stays finite,
  invertible and never worse than the best start."""
  a, b, _, site = _planted("gl", seed=5, noise=0.3)
  b["key"]["kernel"] = np.asarray(b["key"]["kernel"]).copy()
  b["key"]["kernel"][:, :, 1, 1:] = 0.0
  b["key"]["bias"] = np.asarray(b["key"]["bias"]).copy()
  b["key"]["bias"][:, 1, 1:] = 0.0
  element, info = matching.match_attention(a, b, site, learning_rate=10.0, solver=solver)
  ga.check_element(element)  # finite, condition number <= ga.MAX_CONDITION
  assert np.isfinite(np.asarray(element.qk)).all()
  assert float(info["objective"]["full"].sum()) <= float(info["objective"]["ortho"].sum())

  @jax.jit
  def start_and_refine(problem):
    start = _stage2.best_start(problem, jnp.eye(H), False, None)
    if solver == "adam":
      best = _stage2.adam(start, problem, False, None, steps=50, learning_rate=jnp.float64(100.0))
    else:
      best, _ = _stage2.gauss_newton(start, problem, False, None, steps=50)
    return _stage2.objective(start, problem)[0], _stage2.objective(best, problem)

  problem = _stage2.Problem(jnp.diag(jnp.array([1.0, 1e-12, 1.0, 1.0])), jnp.eye(H), 4.0,
                            jnp.eye(H), jnp.eye(H), 4.0)
  start_value, (value, cond) = start_and_refine(problem)
  assert value <= start_value and cond <= _stage2.max_condition(jnp.float64)


# The float32 planted cases: every group, both pairings, partial rotary, GQA.
FLOAT32_CASES = {**CASES, "rope_interleaved": ("rope", None, True, "interleaved", 1.0),
                 "rope_half_partial_gqa": ("rope", 2, True, "half", 0.5)}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(FLOAT32_CASES))
@pytest.mark.parametrize("init", matching.INITS)
def test_float32_planted_recovery(x64, monkeypatch, case, init):
  """In float32, Gauss-Newton recovers the planted element to <= 1e-5 relative error in
  every leaf (measured 1.6e-7 to 7.0e-7) in a few iterations (measured 1 to 5), from
  either start; Adam's 200 steps ended at 5.6e-5 to 1.9e-4 from "best" and up to 1.3e-2
  from Procrustes."""
  monkeypatch.setitem(CASES, case, FLOAT32_CASES[case])
  a, b, g, site = _planted(case)
  f32 = lambda t: jax.tree.map(lambda x: np.asarray(x, np.float32), t)
  element, info = matching.match_attention(f32(a), f32(b), site, init=init)
  assert element.qk.dtype == jnp.float32
  np.testing.assert_array_equal(element.perm, _inverse_perm(g))
  assert int(np.max(info["refinement_steps"])) <= 10
  element = jax.tree.map(lambda x: np.asarray(x, np.float64) if x.dtype == np.float32 else x,
                         element)
  moved = spec_lib.flatten(_act(b, element))
  for path, leaf in spec_lib.flatten(a).items():
    assert np.linalg.norm(moved[path] - leaf) / np.linalg.norm(leaf) <= 1e-5, path


@pytest.mark.slow
@pytest.mark.parametrize("case", ["gl", "rope_half_gqa"])
def test_gauss_newton_matches_adam_in_fewer_steps(x64, case):
  """On a noisy problem (no exact solution) Gauss-Newton ends at an objective no higher than
  200 Adam steps' (it converges: 200 more iterations change nothing), in a few iterations."""
  a, b, _, site = _planted(case, seed=3, noise=0.2)
  full = lambda **kw: float(matching.match_attention(a, b, site, **kw)[1]["objective"]["full"].sum())
  _, info = matching.match_attention(a, b, site)
  taken = np.asarray(info["refinement_steps"])
  assert 1 <= taken.max() <= 20
  gauss_newton = float(info["objective"]["full"].sum())
  assert gauss_newton <= full(solver="adam") * (1 + 1e-12)
  assert gauss_newton == pytest.approx(full(steps=int(taken.max()) + 200), rel=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision(x64, dtype):
  """Half-precision layers are matched in float32 (x64 on: float32 whatever JAX's default):
  the planted permutation exactly, the distance down to the rounding of the parameters."""
  a, b, g, site = _planted("rope_half_gqa")
  half = lambda t: jax.tree.map(lambda x: np.asarray(x).astype(dtype), t)
  element, info = matching.match_attention(half(a), half(b), site)
  assert element.qk.dtype == element.vo.dtype == info["objective"]["full"].dtype == jnp.float32
  np.testing.assert_array_equal(element.perm, _inverse_perm(g))
  objective = {k: float(v.sum()) for k, v in info["objective"].items()}
  assert objective["full"] <= (2e-5 if dtype == jnp.bfloat16 else 1e-6) * objective["naive"]
  elements, info = matching.match_attention_exhaustive(half(a), half(b), site, method="ortho")
  assert elements.qk.dtype == jnp.float32
  perms = np.asarray(info["perms"])
  np.testing.assert_array_equal(perms[np.asarray(info["stage1_index"])], _inverse_perm(g))


# ----------------------------------------------------------------------------- exhaustive mode


@pytest.mark.slow
@pytest.mark.parametrize("case,method,element_group", [("gl", "full", None),
                                                       ("gl_gqa", "ortho", "orthogonal")])
def test_exhaustive_best_permutation_is_stage1s(x64, case, method, element_group):
  a, b, g, site = _planted(case, seed=7, element_group=element_group)
  elements, info = matching.match_attention_exhaustive(a, b, site, method=method, init="best")
  perms = np.asarray(info["perms"])
  assert len(perms) == (24 if g.num_kv_heads == N else 8)
  assert elements.perm.shape == (len(perms), L, N) and info["objective"].shape == (len(perms), L)
  best = np.argmin(np.asarray(info["objective"]), axis=0)
  np.testing.assert_array_equal(best, info["stage1_index"])
  np.testing.assert_array_equal(perms[best], _inverse_perm(g))
  for layer in range(L):
    chosen = jax.tree.map(lambda x: np.asarray(x)[best[layer], layer:layer + 1], elements)
    one = lambda p: jax.tree.map(lambda x: x[layer:layer + 1], p)
    assert _squared_distance(one(a), one(b), chosen) <= 1e-10 * float(info["objective"][:, layer].max())


# ----------------------------------------------------------------------------- jit and bad input


def test_one_trace_per_shape(x64, monkeypatch):
  counted = jax.jit(chex.assert_max_traces(_attention._match_core, n=1),
                    static_argnames=_attention._STATIC)  # pylint: disable=protected-access
  monkeypatch.setattr(_attention, "_match_jit", counted)
  for seed, bias, lr in ((0, True, 1e-2), (1, False, 3e-3), (2, True, 0.5)):
    a, b = (_stack(seed + s, bias=bias) for s in (0, 10))
    matching.match_attention(a, b, _site("gl"), method="perm", learning_rate=lr)
  with pytest.raises(AssertionError, match="traced > 1"):  # a new shape traces again
    matching.match_attention(*(_stack(s, layers=3) for s in (0, 1)), _site("gl"), method="perm")


def _bad_input(case):
  a = _stack(0)
  if case == "extra leaf":
    return dict(a, extra={"kernel": a["out"]["kernel"]}), a, "extra/kernel"
  if case == "missing bias":
    return a, dict(a, query={"kernel": a["query"]["kernel"]}), "query/bias"
  if case == "different width":
    return a, _stack(1, width=D + 1), "query/kernel: params_a has float64\\[2, 12, 4, 4\\]"
  if case == "kv heads do not divide":
    return (dict(a, key=jax.tree.map(lambda x: x[..., :3, :], a["key"])), a,
            "key/kernel has shape .* must divide the 4 query heads")
  if case == "inconsistent head dim":
    return dict(a, out=dict(a["out"], kernel=a["out"]["kernel"][:, :, :3])), a, "out/kernel has shape"
  if case == "nan":
    bias = a["value"]["bias"].copy()
    bias[0, 1, 2] = np.nan
    return a, dict(a, value=dict(a["value"], bias=bias)), "params_b: value/bias has NaN or Inf"
  if case == "inf":
    kernel = a["query"]["kernel"].copy()
    kernel[0] = np.inf
    return dict(a, query=dict(a["query"], kernel=kernel)), a, "params_a: query/kernel has NaN or Inf"
  return a, jax.tree.map(lambda x: x.astype(np.float32), a), "params_b has float32"


@pytest.mark.parametrize("case", ["extra leaf", "missing bias", "different width",
                                  "kv heads do not divide", "inconsistent head dim", "nan", "inf",
                                  "float32 against float64"])
def test_bad_input_names_the_leaf(x64, case):
  a, b, message = _bad_input(case)
  with pytest.raises(ValueError, match=message):
    matching.match_attention(a, b, _site("gl"))


@pytest.mark.parametrize("kwargs,message", [
    (dict(method="greedy"), "method must be one of"),
    (dict(distance="l1"), "distance must be one of"),
    (dict(steps=-1), "steps must be"),
    (dict(group="rope", rotary_fraction=0.25), "rotated dims"),
    (dict(group="so"), "group must be one of"),
    (dict(num_heads=2), "have N=4, K=4, H=4, but the site has N=2, K=2, H=4"),
])
def test_bad_options(x64, kwargs, message):
  a = _stack(0)
  site_fields = {k: kwargs.pop(k) for k in list(kwargs) if k not in ("method", "distance", "steps")}
  with pytest.raises(ValueError, match=message):
    site = spec_lib.AttentionSite(**{"num_heads": N, "head_dim": H, **site_fields})
    matching.match_attention(a, a, site, **kwargs)


def test_site_must_be_an_attention_site(x64):
  a = _stack(0)
  for call in (matching.match_attention, matching.match_attention_exhaustive):
    with pytest.raises(TypeError, match="site must be a spec.AttentionSite.*got dict"):
      call(a, a, {"group": "gl"})
  with pytest.raises(TypeError, match="got str"):
    ga.random_element(jax.random.key(0), "rope")


@pytest.mark.slow
def test_exhaustive_refuses_many_heads(x64):
  a = jax.tree.map(lambda x: x[0], _stack(0))
  big = {name: {"kernel": np.ones((D, 9, 2))} for name in ("query", "key", "value")}
  big["out"] = {"kernel": np.ones((9, 2, D))}
  with pytest.raises(ValueError, match="N = 9"):
    matching.match_attention_exhaustive(big, big, spec_lib.AttentionSite(9, 2))
  with pytest.raises(ValueError, match="Stage 2 method"):
    matching.match_attention_exhaustive(a, a, _site("gl"), method="naive")
