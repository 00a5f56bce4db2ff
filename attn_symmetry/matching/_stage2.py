"""Stage 2 of attention matching: the best QK and VO matrices of one matched head pair.

Both halves of a matched pair are the same problem,

    min_M  q(M; S1, C1, n1) + q(M^{-T}; S2, C2, n2),
    q(X; S, C, n) = tr(X^T S X) - 2 tr(X^T C) + n = ||X_B X - Y_A||_F^2,

with S = X_B^T X_B, C = X_B^T Y_A and n = ||Y_A||_F^2:

* QK: M = A, (X_B, Y_A) = (Q~_B, Q~_A) and (K~_B, K~_A), since W^K <- W^K A^{-T};
  A in GL(H), or in H(H) with RoPE;
* VO: M = B, (X_B, Y_A) = (V~_B, V~_A) and (O_B^T, O_A^T), since
  ||B^{-1} O_B - O_A||^2 = ||O_B^T B^{-T} - O_A^T||^2; B in GL(H).

Under GQA, S1, C1 (QK) and S2, C2 (VO) sum over the G query heads of the kv
group. Everything is H x H, so an evaluation costs O(H^3) whatever D is.

Solutions, from cheap to exact (docs/matching.md, 'Stage 2'):

* Procrustes: for orthogonal M, M^{-T} = M and q(M) = const - 2 tr(M^T (C1 + C2)),
  maximised over O(H) by the polar factor U V^T of C1 + C2 = U S V^T; over the
  orthogonal part of H(H) (one unit complex number per frequency pair) by
  normalising each pair's coefficients <E_p, C1 + C2> (a polar factor on the
  unrotated block of a partial rotary).
* Least squares from one side: M = S1^{-1} C1 ignores the second term,
  M^{-T} = S2^{-1} C2 the first; exact on noise-free planted problems.
  Projected onto H(H) with RoPE.
* Refinement (``SOLVERS``), from the Procrustes solution (the paper's start)
  or from the best of the three (``best_start``). Iterates whose objective is
  not finite or whose condition bound ||M||_F ||M^{-1}||_F exceeds
  ``max_condition`` are rejected.

  - "gauss_newton" (the default): with X = M^{-T}, both terms are sums of
    squares, ||X1 M - Y1||^2 and ||X2 X - Y2||^2 with dX = -X dM^T X, and
    their Gauss-Newton model has the curvature operator
    A(D) = S1 D + P D Q, P = X X^T, Q = X^T S2 X. The step solves
    A(D) = -grad / 2, a generalised Sylvester equation: with W^T S1 W = I,
    W^T P W = Lambda (one eigendecomposition of the S1-whitened P; S1's
    whitening is computed once) and Q = U Sigma U^T,
    D = W [(W^T R U)_ij / (1 + lambda_i sigma_j)] U^T, O(H^3). In H(H) the
    model is minimised over the group's span by conjugate gradients
    preconditioned with that solve (projected onto the span). A backtracking
    line search keeps the objective decreasing, up to its rounding: q sums
    ||Y_A||^2 and terms of that size, so it cancels to ~eps ||Y_A||^2 near a
    noise-free solution while the gradient does not, and a step that changes
    q by less than ``tolerance`` ||Y_A||^2 is accepted (this is what takes
    float32 to ~1e-7 in M rather than ~sqrt(eps)). The iteration stops when
    the model predicts a relative decrease below ``tolerance``, after a step
    shorter than sqrt(eps) ||M||, when no step is accepted, or after
    ``steps`` iterations: a few steps (quadratic convergence on noise-free
    problems, fast linear convergence otherwise). It returns the last
    iterate and the iterations taken.
  - "adam": the paper's plain gradient refinement, ``steps`` Adam (optax)
    steps with the gradient in closed form. For H(H) the gradient is
    projected onto its span; Adam then acts on the matrix exactly as it
    would on the (a_p, b_p) coordinates (the entries of a coordinate receive
    equal or opposite gradients, hence equal or opposite updates), so the
    iterates stay in H(H). A rejected iterate returns to the best one so far
    and the step size halves. The best iterate is returned.

QK and VO problems of a layer run as one batch, and the linear solves of a
stage form one chain: independent batched LAPACK calls that XLA's CPU runtime
runs concurrently can deadlock in jaxlib 0.10 (triangular solves), so none are
issued side by side.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from attn_symmetry import group_action
from attn_symmetry import spec as spec_lib
from attn_symmetry.matching._features import HIGHEST, Grams


SOLVERS = ("gauss_newton", "adam")  # the refinement's solvers (module docstring)
MAX_HALVINGS = 12  # backtracking line search: step sizes 1, 1/2, ..., 2^-12


class Problem(NamedTuple):
  """min_M q(M; s1, c1, n1) + q(M^{-T}; s2, c2, n2) (module docstring); s, c [H, H], n []."""
  s1: jax.Array
  c1: jax.Array
  n1: jax.Array
  s2: jax.Array
  c2: jax.Array
  n2: jax.Array


def pair_problems(g: Grams, perm: jax.Array) -> tuple[Problem, Problem]:
  """The QK and VO problems [K] of every kv group once B's heads are permuted by ``perm`` [N]."""
  n, k = g.q.shape[0], g.k.shape[0]
  rep = n // k
  sigma = perm[::rep] // rep
  heads, groups = jnp.arange(n), jnp.arange(k)
  per_group = lambda x: x.reshape(k, rep, *x.shape[1:]).sum(1)
  t = lambda x: jnp.swapaxes(x, -1, -2)
  tr = lambda x: jnp.trace(x, axis1=-2, axis2=-1)
  qk = Problem(per_group(g.qb[perm]), per_group(t(g.q[heads, perm])), per_group(tr(g.qa)),
               g.kb[sigma], t(g.k[groups, sigma]), tr(g.ka))
  vo = Problem(g.vb[sigma], t(g.v[groups, sigma]), tr(g.va),
               per_group(g.ob[perm]), per_group(t(g.o[heads, perm])), per_group(tr(g.oa)))
  return qk, vo


def max_condition(dtype: Any) -> float:
  """Largest accepted condition bound: group_action's limit, or less in low precision."""
  return min(group_action.MAX_CONDITION, 0.01 / float(jnp.finfo(dtype).eps))


def _matmul(x, y):
  return jnp.matmul(x, y, precision=HIGHEST)


def _terms(m: jax.Array, p: Problem) -> tuple[jax.Array, ...]:
  """M^{-T} (an LU solve), S1 M and S2 M^{-T}, shared by the value and the gradient."""
  m_inv_t = jnp.linalg.inv(m).T
  return m_inv_t, _matmul(p.s1, m), _matmul(p.s2, m_inv_t)


def objective(m: jax.Array, p: Problem) -> tuple[jax.Array, jax.Array]:
  """(q(M) + q(M^{-T}), ||M||_F ||M^{-T}||_F) for one matrix M [H, H]."""
  m_inv_t, s1m, s2x = _terms(m, p)
  value = (jnp.sum(m * s1m) - 2 * jnp.sum(m * p.c1) + p.n1
           + jnp.sum(m_inv_t * s2x) - 2 * jnp.sum(m_inv_t * p.c2) + p.n2)
  return value, jnp.linalg.norm(m) * jnp.linalg.norm(m_inv_t)


def objective_and_gradient(m: jax.Array, p: Problem
                           ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """``objective``, its gradient in M and M^{-T}, in closed form with the same single solve.

  With X = M^{-T}, dX = -X dM^T X, so d q(X)/dM = -X G^T X for G = dq/dX = 2 (S2 X - C2).

  Returns:
    (value, condition bound, gradient [H, H], M^{-T} [H, H]).
  """
  m_inv_t, s1m, s2x = _terms(m, p)
  value = (jnp.sum(m * s1m) - 2 * jnp.sum(m * p.c1) + p.n1
           + jnp.sum(m_inv_t * s2x) - 2 * jnp.sum(m_inv_t * p.c2) + p.n2)
  g_x = 2 * (s2x - p.c2)
  grad = 2 * (s1m - p.c1) - _matmul(_matmul(m_inv_t, g_x.T), m_inv_t)
  return value, jnp.linalg.norm(m) * jnp.linalg.norm(m_inv_t), grad, m_inv_t


# ----------------------------------------------------------------------------- group parameters
# ``rope`` is the attention site when the matrix lies in H(H), None for GL(H).


def to_matrix(params: Any, rope: spec_lib.AttentionSite | None) -> jax.Array:
  """The [H, H] matrix of group parameters (the matrix itself for GL(H))."""
  if rope is None:
    return params
  return group_action.rope_commutant(params["ab"], params.get("rest"), rope)


def project(m: jax.Array, rope: spec_lib.AttentionSite | None) -> Any:
  """Group parameters of the Frobenius-nearest matrix to ``m`` [..., H, H] in the group's span.

  H(H) is spanned by an orthogonal basis E_i (the two matrices of every pair,
  one per entry of the unrotated block), so the projection has coefficients
  <E_i, m> / <E_i, E_i>: on pair (i, j), a = (m_ii + m_jj) / 2 and
  b = (m_ij - m_ji) / 2; the unrotated block is ``m``'s own.
  """
  if rope is None:
    return m
  pairs = rope.rope_pairs().astype(np.int32)  # int32 indices: a gather whatever x64 says
  i, j = pairs[:, 0], pairs[:, 1]
  params = {"ab": jnp.stack([(m[..., i, i] + m[..., j, j]) / 2,
                             (m[..., i, j] - m[..., j, i]) / 2], axis=-1)}
  rest = rope.unrotated_dims()
  if len(rest):
    params["rest"] = m[..., rest[:, None], rest[None, :]]
  return params


def polar(c: jax.Array) -> jax.Array:
  """The orthogonal polar factor U V^T of c = U S V^T, batched ([..., n, n])."""
  u, _, vt = jnp.linalg.svd(c)
  return u @ vt


def mean_zero_polar(c: jax.Array) -> jax.Array:
  """The O = U diag(1, R) U^T with R in O(n - 1) (``group_action.mean_zero_orthogonal``: the
  orthogonal maps with O 1 = 1) that maximises tr(O^T c), c [n, n]: tr(O^T c) = (U^T c U)_00
  + tr(R^T K) with K = (U^T c U)[1:, 1:] the 1-perp block, so R = polar(K) (Procrustes on the
  mean-zero subspace; c's component along 1 does not enter)."""
  u = group_action.mean_zero_basis(c.shape[-1], c.dtype)
  return group_action.mean_zero_orthogonal(polar(_matmul(_matmul(u.T, c), u)[1:, 1:]))


def sequenced(x: Any, after: Any) -> Any:
  """``x``, made to depend on ``after`` (adds 0 times a finite scalar of it).

  jaxlib 0.10's CPU LAPACK kernels block an XLA worker thread while they wait
  for work they scheduled on the same pool, so two batched LAPACK calls that
  XLA runs side by side can deadlock a machine with few cores. Every LAPACK
  call here therefore lies on one chain of data dependencies.
  """
  scalar = jax.tree.leaves(after)[0].reshape(-1)[0]
  zero = 0 * jnp.where(jnp.isfinite(scalar), scalar, 0)
  return jax.tree.map(lambda y: y + zero.astype(y.dtype), x)


def procrustes(c_qk: jax.Array, c_vo: jax.Array,
               rope: spec_lib.AttentionSite | None) -> tuple[jax.Array, jax.Array]:
  """Orthogonal QK and VO matrices [K, H, H] maximising tr(M^T c) (module docstring).

  One batched SVD for both halves: under RoPE, the unrotated block of the QK
  side (partial rotary) is embedded in an identity matrix next to the VO side.
  """
  k, h = c_qk.shape[0], c_qk.shape[-1]
  if rope is None:
    both = polar(jnp.concatenate([c_qk, c_vo]))
    return both[:k], both[k:]
  params = jax.vmap(lambda c: project(c, rope))(c_qk)
  ab = params["ab"]
  radius = jnp.linalg.norm(ab, axis=-1, keepdims=True)
  params["ab"] = jnp.where(radius > 0, ab / jnp.where(radius > 0, radius, 1),
                           jnp.array([1, 0], ab.dtype))
  if "rest" not in params:
    return jax.vmap(lambda p: to_matrix(p, rope))(params), polar(c_vo)
  rest = rope.unrotated_dims()
  embedded = jnp.broadcast_to(jnp.eye(h, dtype=c_qk.dtype), c_qk.shape)
  embedded = embedded.at[:, rest[:, None], rest[None, :]].set(params["rest"])
  both = polar(jnp.concatenate([embedded, c_vo]))
  params["rest"] = both[:k][:, rest[:, None], rest[None, :]]
  return jax.vmap(lambda p: to_matrix(p, rope))(params), both[k:]


def project_matrix(m: jax.Array, rope: spec_lib.AttentionSite | None) -> jax.Array:
  """The Frobenius projection [H, H] of ``m`` onto the group's span (``m`` itself for GL(H))."""
  return m if rope is None else to_matrix(project(m, rope), rope)


def _constrain(m: jax.Array, constrained: jax.Array,
               rope: spec_lib.AttentionSite | None) -> jax.Array:
  """``m`` projected onto H(H) where ``constrained`` (a QK problem under RoPE), else ``m``."""
  return m if rope is None else jnp.where(constrained, project_matrix(m, rope), m)


def _evaluate(m: jax.Array, p: Problem) -> jax.Array:
  """Objective, +inf where it is not finite or M is near-singular."""
  value, cond = objective(m, p)
  return jnp.where(jnp.isfinite(value) & (cond <= max_condition(value.dtype)), value, jnp.inf)


def best_start(p: Problem, orthogonal: jax.Array, constrained: jax.Array,
               rope: spec_lib.AttentionSite | None) -> jax.Array:
  """The best of the Procrustes start ``orthogonal`` [H, H] and the two one-sided
  least-squares starts (projected onto H(H) where ``constrained``)."""
  eye = jnp.eye(p.s1.shape[-1], dtype=p.s1.dtype)
  ridge = lambda s: s + _ridge(s) * eye
  first, second_inv_t = jnp.linalg.solve(jnp.stack([ridge(p.s1), ridge(p.s2)]),
                                         jnp.stack([p.c1, p.c2]))
  second = jnp.linalg.inv(second_inv_t).T
  candidates = jnp.stack([orthogonal, _constrain(first, constrained, rope),
                          _constrain(second, constrained, rope)])
  values = jax.vmap(_evaluate, in_axes=(0, None))(candidates, p)
  return candidates[jnp.argmin(values)]


def adam(start: jax.Array, p: Problem, constrained: jax.Array,
         rope: spec_lib.AttentionSite | None, *, steps: int, learning_rate: jax.Array) -> jax.Array:
  """Guarded Adam steps on the exact objective from ``start`` [H, H] (module docstring).

  Returns the best of ``start`` and the ``steps`` iterates.
  """
  opt = optax.adam(learning_rate)
  limit = max_condition(p.s1.dtype)

  def body(_, state):
    m, opt_state, best, best_value, scale = state
    value, cond, grad, _ = objective_and_gradient(m, p)
    ok = jnp.isfinite(value) & (cond <= limit) & jnp.isfinite(grad).all()
    better = ok & (value < best_value)
    best, best_value = jnp.where(better, m, best), jnp.where(better, value, best_value)
    updates, opt_state = opt.update(jnp.where(ok, _constrain(grad, constrained, rope), 0),
                                    opt_state, m)
    return (jnp.where(ok, m + scale * updates, best), opt_state, best, best_value,
            jnp.where(ok, scale, scale / 2))

  inf = jnp.full((), jnp.inf, p.s1.dtype)
  state = (start, opt.init(start), start, inf, jnp.ones((), p.s1.dtype))
  # Iteration i evaluates iterate i; the update of the last one is not used.
  return jax.lax.fori_loop(0, steps + 1, body, state)[2]


def tolerance(dtype: Any) -> float:
  """Gauss-Newton stops once its model predicts a relative decrease below this (100 eps)."""
  return 100 * float(jnp.finfo(dtype).eps)


def _ridge(s: jax.Array) -> jax.Array:
  """eps (tr(S) / H + tiny): added to a Gram's diagonal, it keeps its inverse finite."""
  return jnp.finfo(s.dtype).eps * (jnp.trace(s) / s.shape[-1] + jnp.finfo(s.dtype).tiny)


def _whitening(s1: jax.Array) -> jax.Array:
  """W1 [H, H] with W1^T (S1 + ridge) W1 = I (``_ridge``)."""
  ridge = _ridge(s1)
  d, u = jnp.linalg.eigh(s1 + ridge * jnp.eye(s1.shape[-1], dtype=s1.dtype))
  return u / jnp.sqrt(jnp.maximum(d, ridge))


def _gauss_newton_step(grad: jax.Array, m_inv_t: jax.Array, w1: jax.Array, p: Problem,
                       constrained: jax.Array, rope: spec_lib.AttentionSite | None) -> jax.Array:
  """The Gauss-Newton step D [H, H]: A(D) = -grad / 2 (module docstring), in H(H)'s span
  where ``constrained`` (preconditioned conjugate gradients, H(H)'s dimension at most)."""
  big_p = _matmul(m_inv_t, m_inv_t.T)
  q = _matmul(_matmul(m_inv_t.T, p.s2), m_inv_t)
  lam_sig, vecs = jnp.linalg.eigh(jnp.stack([_matmul(_matmul(w1.T, big_p), w1), q]))
  w, u = _matmul(w1, vecs[0]), vecs[1]
  scale = 1 + jnp.maximum(lam_sig[0], 0)[:, None] * jnp.maximum(lam_sig[1], 0)[None, :]

  def solve(r):  # A^{-1} r
    return _matmul(_matmul(w, _matmul(_matmul(w.T, r), u) / scale), u.T)

  if rope is None:
    return solve(-grad / 2)
  proj = lambda x: _constrain(x, constrained, rope)
  apply_a = lambda d: proj(_matmul(p.s1, d) + _matmul(_matmul(big_p, d), q))
  precondition = lambda r: proj(solve(r))
  safe = lambda num, den: jnp.where(den > 0, num / jnp.where(den > 0, den, 1), 0)

  def body(_, state):
    d, r, z, direction, rz = state
    a_dir = apply_a(direction)
    alpha = safe(rz, jnp.sum(direction * a_dir))
    d, r = d + alpha * direction, r - alpha * a_dir
    z = precondition(r)
    rz_new = jnp.sum(r * z)
    return d, r, z, z + safe(rz_new, rz) * direction, rz_new

  r = proj(-grad / 2)
  z = precondition(r)
  dim = rope.rotary_dims() + (rope.head_dim - rope.rotary_dims()) ** 2
  state = (jnp.zeros_like(r), r, z, z, jnp.sum(r * z))
  return jax.lax.fori_loop(0, min(dim, 2 * rope.head_dim), body, state)[0]


def gauss_newton(start: jax.Array, p: Problem, constrained: jax.Array,
                 rope: spec_lib.AttentionSite | None, *, steps: int
                 ) -> tuple[jax.Array, jax.Array]:
  """Gauss-Newton iterations with a backtracking line search from ``start`` [H, H]
  (module docstring); at most ``steps``.

  Every LAPACK call (S1's eigendecomposition, each inverse and each step's
  eigendecompositions) lies on one chain (``sequenced``).

  Returns:
    (M [H, H], iterations taken []): no worse than ``start`` beyond the objective's
    rounding (the line search's slack).
  """
  limit, tol = max_condition(p.s1.dtype), tolerance(p.s1.dtype)
  eps = jnp.finfo(p.s1.dtype).eps
  # The objective's rounding: q = ||Y||^2 + (terms of its size) cancels to ~eps ||Y||^2, so a
  # step that changes it by less is accepted (its gradients, free of that cancellation, still
  # steer the iterate; a noise-free problem is thus solved to rounding in M, not in q).
  slack = tol * (jnp.abs(p.n1) + jnp.abs(p.n2))
  w1 = _whitening(sequenced(p.s1, start))  # after the LAPACK calls that made ``start``
  start = sequenced(start, w1)
  value, _, grad, m_inv_t = objective_and_gradient(start, p)
  grad = _constrain(grad, constrained, rope)

  def line_search(m, value, delta):
    def try_step(state):
      t, _, _ = state
      candidate = m + t * delta
      new = objective_and_gradient(candidate, p)
      ok = jnp.isfinite(new[0]) & (new[1] <= limit) & jnp.isfinite(new[2]).all()
      return t / 2, ok & (new[0] < value + slack), (candidate, *new)
    state = try_step((jnp.ones((), m.dtype), False, None))
    state = jax.lax.while_loop(lambda s: ~s[1] & (s[0] >= 2.0 ** -MAX_HALVINGS), try_step, state)
    return state[1], state[2]

  def body(state):
    m, value, grad, m_inv_t, taken, _ = state
    delta = _gauss_newton_step(grad, m_inv_t, w1, p, constrained, rope)
    predicted = -jnp.sum(grad * delta) / 2  # the model's decrease
    found, (candidate, new_value, _, new_grad, new_inv) = line_search(m, value, delta)
    move = found & (predicted > tol * jnp.abs(value))
    pick = lambda new, old: jnp.where(move, new, old)
    new_grad = _constrain(new_grad, constrained, rope)
    small = jnp.linalg.norm(delta) <= jnp.sqrt(eps) * jnp.linalg.norm(m)  # the last step
    return (pick(candidate, m), pick(new_value, value), pick(new_grad, grad),
            pick(new_inv, m_inv_t), taken + move, ~move | small)

  state = (start, value, grad, m_inv_t, jnp.zeros((), jnp.int32), jnp.bool_(False))
  cond_fn = lambda s: ~s[5] & (s[4] < steps)
  m, *_, taken, _ = jax.lax.while_loop(cond_fn, body, state)
  return m, taken
