"""The correction g_c that learned alignment trains, and how it acts on g0 . theta_B.

Learned alignment (``_learned``) returns g = g_c o g0: g0 is its start (the
full method's element), applied to theta_B once, and g_c a correction that
starts at the identity. Its factors (``FACTORS``, the ``factors`` option):

* "attention": for every kv group k of a trained site, A^c_k = I + D^QK_k and
  B^c_k = I + D^VO_k, D from zero (D^QK in the span of H(H) under RoPE, where
  ``group_action.rope_commutant`` of trained (a_p, b_p) keeps I + D^QK in
  H(H) exactly).
* "residual" on an orthogonal stream (RMSNorm, norm scales folded): the Cayley
  map O^c = cayley(S) = (I - S)(I + S)^{-1} of S = (W - W^T) / 2, W from zero.
  For S skew-symmetric I + S is invertible (eigenvalues 1 + i t), I - S and
  (I + S)^{-1} commute, and

      cayley(S)^T cayley(S) = (I + S)^{-T} (I - S)^T (I - S) (I + S)^{-1}
                            = (I - S)^{-1} (I + S) (I - S) (I + S)^{-1} = I,

  so O^c is orthogonal up to rounding whatever W is (one LU solve,
  ``jnp.linalg.solve(I + S, I - S)``), and cayley(0) = I exactly.
* "residual" on a mean-zero orthogonal stream (a pre-LayerNorm one with
  ``residual="orthogonal"``, both models in ``group_action.canonical_form``): the
  same map restricted to 1-perp, O^c = U diag(1, cayley(S)) U^T with S [n - 1, n - 1]
  (``group_action.mean_zero_orthogonal``, U's first column 1 / sqrt(n)): orthogonal,
  O^c 1 = 1 up to rounding, and the identity at W = 0.
* permutations: "heads" (each site's head permutation, mapping kv groups onto
  kv groups under GQA), "ffn" (every FFN's hidden units) and "residual" on a
  permutation stream (LayerNorm). Each is a straight-through estimator on a
  score matrix M [n, n] (below).

Straight-through permutations. The forward pass uses the hard permutation

    pi(M) = argmax_pi sum_j M[j, pi(j)]          (``linear_assignment(-M)``;
                                                   ``assign_heads`` under GQA)

as the matrix P(pi)[j, i] = [i = pi(j)], which maps an axis by
new_j = sum_i P[j, i] old_i = old_{pi(j)} (``take(old, pi)``). It enters the
loss as P~ = P(pi) + (M - stop_gradient(M)): the value is P(pi) exactly
(x - x = 0 for finite x, and a product with a one-hot matrix at full precision
is exact), so the loss is that of the hard permutation, and the gradient that
reaches M is dL/dP~ = G, the loss's gradient with respect to a dense matrix at
the permutation: the relaxation is M itself. G[j, i] pairs the gradient at
slot j with unit i of B (times lambda), and L(P') ~ L(P) + <G, P' - P> is the
first-order model of the loss over permutations. Under GQA the kv heads move
by Sigma~[k, l] = (1/G) sum_{i, j} P~[kG + i, lG + j], the block means, which
equal P(sigma) exactly for a permutation that keeps kv groups whole.

M starts at ``SCORE_MARGIN`` I (the correction's identity, i.e. g0's
permutation is the argmax) and follows momentum on max-normalised gradients:

    m_t = beta m_{t-1} + G_t / sqrt(v_t),    v_t = mean_s max_ji G_s[j, i]^2,
    M_t = M_{t-1} - eta m_t,

beta = ``SCORE_MOMENTUM``, eta the learning rate (the max is Adam's bias-corrected running
mean of max |G|^2, one per matrix, so that steps shrink as the gradients do). Then pi(M_t) minimises the
accumulated linear model sum_s <m_s, P> against the prior SCORE_MARGIN <I, P>
/ eta: follow-the-regularised-leader over permutations, a transposition
taking about SCORE_MARGIN / eta steps of a consistent gradient on its strongest
entries. Two alternatives were rejected: Adam normalises every entry alone, so
early on every score moves by +-eta whatever the size of its gradient and the
assignment would follow G's sign pattern, not the linear model; a Sinkhorn
relaxation P(M / tau) saturates at the one-hot start for small tau (its
Jacobian ~ P (1 - P) / tau vanishes off the current assignment, which is where
a better permutation needs score) and for large tau is far from the hard
forward pass.

None of this reaches the result: ``compose`` builds the returned element from
the hard permutations, the Cayley matrix and I + D only, composed with g0 as
``group_action.compose`` does (a o b: perm = b.perm[a.perm], A_k =
A^b_{sigma_a(k)} A^a_k; factors b[a] and O_b O_a).

This module imports jax, numpy and optax only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from attn_symmetry import group_action
from attn_symmetry import spec as spec_lib
from attn_symmetry.matching import _assignment
from attn_symmetry.matching import _features
from attn_symmetry.matching import _stage2

FACTORS = ("attention", "heads", "ffn", "residual")
RESIDUAL = "residual"  # the residual stream's factor name (models.core, tiny_transformer)
SCORE_MARGIN = 1.0  # M starts at SCORE_MARGIN * I
SCORE_MOMENTUM = 0.9
# The axis of the heads of every canonical attention leaf and whether it counts query heads
# or kv heads (the layout of ``attention.leaf_shapes``); out/bias has none.
_HEAD_AXES = {"query/kernel": (1, "query"), "query/bias": (0, "query"),
              "key/kernel": (1, "kv"), "key/bias": (0, "kv"),
              "value/kernel": (1, "kv"), "value/bias": (0, "kv"), "out/kernel": (0, "query")}
Params = dict[str, Any]


# ----------------------------------------------------------------------------- which factors


def available(spec: spec_lib.SymmetrySpec, names: Sequence[str]) -> dict[str, tuple[str, ...]]:
  """The spec's names in ``names`` (a scope's, ``active_names``) that each of ``FACTORS`` trains.

  "attention" and "heads": the attention sites ("heads" those with more than
  one head); "residual": the factor named ``RESIDUAL``; "ffn": every other
  factor (the FFN hidden units of the model zoo, "layers_i/mlp").
  """
  sites = tuple(n for n in names if n in spec.attention)
  factors = [n for n in names if n in spec.factors]
  return {"attention": sites,
          "heads": tuple(s for s in sites if spec.attention[s].num_heads > 1),
          "ffn": tuple(f for f in factors if f != RESIDUAL),
          "residual": tuple(f for f in factors if f == RESIDUAL)}


def _describe(spec: spec_lib.SymmetrySpec, found: Mapping[str, tuple[str, ...]]) -> str:
  kinds = [k if k != "residual" else f"residual ({spec.factors[RESIDUAL].kind})"
           for k in FACTORS if found[k]]
  return ", ".join(kinds) or "none"


def resolve(spec: spec_lib.SymmetrySpec, names: Sequence[str],
            factors: str | Sequence[str] | None) -> tuple[str, ...]:
  """The ``factors`` option checked against what ``names`` hold; None: all that they hold.

  Raises:
    ValueError: a factor that is not one of ``FACTORS``, or one that the
      model has no symmetry for in this scope (naming it and what it has).
  """
  found = available(spec, names)
  if factors is None:
    return tuple(k for k in FACTORS if found[k])
  given = (factors,) if isinstance(factors, str) else factors
  if (not isinstance(given, Sequence) or not given
      or not all(isinstance(f, str) for f in given)):
    raise ValueError(f"factors must be a non-empty list of {FACTORS} or None (all in scope), "
                     f"got {factors!r}")
  unknown = [f for f in given if f not in FACTORS]
  if unknown:
    raise ValueError(f"factors {unknown} unknown: method 'learned' trains some of {FACTORS}")
  for f in given:
    if not found[f]:
      raise ValueError(f"factors: the model has no {f!r} symmetry in this scope; it has "
                       f"{_describe(spec, found)}")
  return tuple(k for k in FACTORS if k in given)


# ----------------------------------------------------------------------------- the plan


@dataclasses.dataclass(frozen=True)
class SiteGroup:
  """Trained attention sites of one configuration, stacked along a leading axis [S]."""
  names: tuple[str, ...]
  site: spec_lib.AttentionSite
  matrices: bool  # "attention": I + D^QK, I + D^VO trained
  heads: bool  # "heads": head scores trained

  @property
  def rope(self) -> spec_lib.AttentionSite | None:
    return self.site if self.site.group == "rope" else None


@dataclasses.dataclass(frozen=True)
class FactorGroup:
  """Trained factors of one kind and size, stacked along a leading axis [C]."""
  names: tuple[str, ...]
  kind: str  # "permutation", "orthogonal" or "mean_zero_orthogonal" (``spec.FACTOR_KINDS``)
  size: int

  @property
  def skew_size(self) -> int:
    """The side of W for a matrix kind: n, or n - 1 on 1-perp for a mean-zero one."""
    return self.size - (self.kind == "mean_zero_orthogonal")


@dataclasses.dataclass(frozen=True)
class Plan:
  """What is trained (a static, hashable argument of the compiled step).

  Attributes:
    sites, factors: the groups.
    leaves: (path, ((axis, factor group, index in it), ...)) for every leaf
      that a trained factor maps (a matrix one leaves folded norm scales
      alone, as ``group_action.apply_leaf`` does).
  """
  sites: tuple[SiteGroup, ...]
  factors: tuple[FactorGroup, ...]
  leaves: tuple[tuple[str, tuple[tuple[int, int, int], ...]], ...]

  @property
  def site_names(self) -> tuple[str, ...]:
    return tuple(s for g in self.sites for s in g.names)


def plan(spec: spec_lib.SymmetrySpec, names: Sequence[str], factors: Sequence[str],
         flat: Params) -> Plan:
  """The groups of ``names`` (in scope) that ``factors`` (``resolve``d) train; ``flat`` the
  flattened parameters (site groups share leaf shapes)."""
  found = available(spec, names)
  trained = {n for f in factors for n in found[f] if f not in ("attention", "heads")}
  by_kind: dict[Any, list[str]] = {}
  for f in spec.factors:
    if f in trained:
      by_kind.setdefault((spec.factors[f].kind, spec.factors[f].size), []).append(f)
  factor_groups = tuple(FactorGroup(tuple(n), *key) for key, n in by_kind.items())
  where = {n: (i, j) for i, g in enumerate(factor_groups) for j, n in enumerate(g.names)}
  leaves = []
  for path, axes in spec.axes.items():
    maps = tuple((axis, *where[f]) for axis, f in enumerate(axes) if f in where
                 and not (spec.factors[f].is_matrix and path in spec.norm_scales))
    if maps:
      leaves.append((path, maps))
  matrices, heads = "attention" in factors, set(found["heads"]) if "heads" in factors else set()
  by_site: dict[Any, list[str]] = {}
  for s in found["attention"] if matrices else sorted(heads, key=list(spec.attention).index):
    shapes = tuple((p[len(s):], flat[p].shape) for p in flat if p.startswith(s + "/"))
    by_site.setdefault((spec.attention[s], shapes, s in heads), []).append(s)
  site_groups = tuple(SiteGroup(tuple(n), key[0], matrices, key[2])
                      for key, n in by_site.items())
  return Plan(site_groups, factor_groups, tuple(leaves))


# ----------------------------------------------------------------------------- parameters


def init(p: Plan, dtype: Any) -> Params:
  """The correction's identity: D = 0, W = 0 and scores SCORE_MARGIN I.

  Returns:
    {"sites": per site group {"qk": D^QK group parameters [S, K, ...], "vo": [S, K, H, H]}
    (if matrices) and {"heads": [S, N, N]} (if heads); "factors": per factor group
    {"scores": [C, n, n]} or {"skew": W [C, m, m]} (m = ``FactorGroup.skew_size``)}.
  """
  sites = []
  for g in p.sites:
    s, k, h, n = len(g.names), g.site.kv_heads, g.site.head_dim, g.site.num_heads
    entry = {}
    if g.matrices:
      zeros = jnp.zeros((s, k, h, h), dtype)
      entry["qk"] = jax.vmap(jax.vmap(lambda m, g=g: _stage2.project(m, g.rope)))(zeros)
      entry["vo"] = zeros
    if g.heads:
      entry["heads"] = _margin(s, n, dtype)
    sites.append(entry)
  factors = [{"scores": _margin(len(g.names), g.size, dtype)} if g.kind == "permutation"
             else {"skew": jnp.zeros((len(g.names), g.skew_size, g.skew_size), dtype)}
             for g in p.factors]
  return {"sites": tuple(sites), "factors": tuple(factors)}


def _margin(count: int, n: int, dtype: Any) -> jax.Array:
  return jnp.broadcast_to(SCORE_MARGIN * jnp.eye(n, dtype=dtype), (count, n, n))


class _LargestState(NamedTuple):
  count: jax.Array
  second: Any  # per matrix, the running mean of max |G|^2 [..., 1, 1]


def _scale_by_largest(decay: float = 0.999) -> optax.GradientTransformation:
  """Divides every [n, n] matrix of the updates by the root of a running mean (bias
  corrected, as Adam's) of its largest squared entry: one scale per matrix, so the entries keep
  their relative sizes, and steps shrink when the gradients do."""
  def init(params):
    return _LargestState(jnp.zeros((), jnp.int32), jax.tree.map(
        lambda x: jnp.zeros((*x.shape[:-2], 1, 1), x.dtype), params))

  def update(updates, state, params=None):
    del params
    count = state.count + 1
    second = jax.tree.map(
        lambda v, g: decay * v + (1 - decay) * jnp.max(g * g, axis=(-2, -1), keepdims=True),
        state.second, updates)
    def scale(g, v):
      root = jnp.sqrt(v / (1 - decay ** count.astype(v.dtype)))
      return g / jnp.maximum(root, jnp.finfo(g.dtype).tiny)
    return jax.tree.map(scale, updates, second), _LargestState(count, second)

  return optax.GradientTransformation(init, update)


def _labels(params: Params) -> Params:
  is_score = lambda path: getattr(path[-1], "key", None) in ("scores", "heads")
  return jax.tree_util.tree_map_with_path(
      lambda path, _: "scores" if is_score(path) else "adam", params)


def optimizer(learning_rate: jax.Array) -> optax.GradientTransformation:
  """Adam for D and W; momentum on max-normalised gradients for scores (module docstring)."""
  scores = optax.chain(_scale_by_largest(), optax.trace(decay=SCORE_MOMENTUM),
                       optax.scale(-learning_rate))
  return optax.multi_transform({"adam": optax.adam(learning_rate), "scores": scores}, _labels)


# ----------------------------------------------------------------------------- hard values


def cayley(w: jax.Array) -> jax.Array:
  """cayley((W - W^T) / 2) [..., n, n], orthogonal (module docstring)."""
  s = (w - jnp.swapaxes(w, -1, -2)) / 2
  eye = jnp.eye(w.shape[-1], dtype=w.dtype)
  return jnp.linalg.solve(eye + s, jnp.broadcast_to(eye, s.shape) - s)


def orthogonal(w: jax.Array, kind: str) -> jax.Array:
  """The trained matrix factor of ``kind`` from W: cayley(W) [..., n, n] ("orthogonal"), or
  U diag(1, cayley(W)) U^T [..., n, n] from W [..., n - 1, n - 1] ("mean_zero_orthogonal",
  ``group_action.mean_zero_orthogonal``)."""
  o = cayley(w)
  return group_action.mean_zero_orthogonal(o) if kind == "mean_zero_orthogonal" else o


def _head_permutations(scores: jax.Array, site: spec_lib.AttentionSite) -> jax.Array:
  """pi(M) [S, N] over the permutations that keep kv groups whole."""
  cost = -jax.lax.stop_gradient(scores)
  return jax.vmap(lambda c: _assignment.assign_heads(c, site.kv_heads))(cost)


def _permutations(scores: jax.Array) -> jax.Array:
  """pi(M) [..., n]."""
  return _assignment.linear_assignment(-jax.lax.stop_gradient(scores))


def corrections(params: Params, g: SiteGroup) -> tuple[jax.Array, jax.Array]:
  """I + D^QK and I + D^VO [S, K, H, H] of a site group with trained matrices."""
  d_qk = jax.vmap(jax.vmap(lambda q: _stage2.to_matrix(q, g.rope)))(params["qk"])
  eye = jnp.eye(g.site.head_dim, dtype=d_qk.dtype)
  return eye + d_qk, eye + params["vo"]


# ----------------------------------------------------------------------------- forward pass


def _straight_through(perm: jax.Array, scores: jax.Array) -> jax.Array:
  """P~ = P(pi) + (M - stop_gradient(M)) [..., n, n]: P(pi)'s value, M's gradient."""
  hard = jax.nn.one_hot(perm, scores.shape[-1], dtype=scores.dtype)
  return hard + (scores - jax.lax.stop_gradient(scores))


def _map_axis(leaf: jax.Array, axis: int, matrix: jax.Array) -> jax.Array:
  """new[..., j, ...] = sum_i leaf[..., i, ...] matrix[i, j] on ``axis``."""
  out = jnp.tensordot(leaf, matrix, axes=(axis, 0), precision=_features.HIGHEST)
  return jnp.moveaxis(out, -1, axis)


def _permute_heads(layer: Params, heads: jax.Array, kv: jax.Array) -> Params:
  """One site's (flat) leaves with heads mapped by P~ [N, N] and kv heads by Sigma~ [K, K]."""
  out = dict(layer)
  for path, (axis, which) in _HEAD_AXES.items():
    if path in layer:
      out[path] = _map_axis(layer[path], axis, (heads if which == "query" else kv).T)
  return out


def act(flat: Params, params: Params, p: Plan) -> Params:
  """g_c . ``flat`` (flat g0 . theta_B), straight through (module docstring); flat.

  Every LAPACK call (the Cayley solve, the inverses of ``group_action.apply``)
  lies on one chain of data dependencies (``_stage2.sequenced``).
  """
  out = dict(flat)
  matrices, after = [], None
  for g, q in zip(p.factors, params["factors"]):
    if g.kind != "permutation":
      skew = q["skew"] if after is None else _stage2.sequenced(q["skew"], after)
      after = o = orthogonal(skew, g.kind)
      matrices.append(o)
    else:
      matrices.append(jnp.swapaxes(_straight_through(_permutations(q["scores"]), q["scores"]),
                                   -1, -2))
  for path, maps in p.leaves:
    leaf = out[path]
    for axis, i, j in maps:
      leaf = _map_axis(leaf, axis, matrices[i][j])
    out[path] = leaf
  for g, q in zip(p.sites, params["sites"]):
    prefix = g.names[0] + "/"
    paths = [path[len(prefix):] for path in out if path.startswith(prefix)]
    stacked = {path: jnp.stack([out[f"{s}/{path}"] for s in g.names]) for path in paths}
    if g.heads:
      heads = _straight_through(_head_permutations(q["heads"], g.site), q["heads"])
      k = g.site.kv_heads
      group = g.site.num_heads // k
      kv = heads.reshape(len(g.names), k, group, k, group).sum(axis=(2, 4)) / group
      stacked = jax.vmap(_permute_heads)(stacked, heads, kv)
    if g.matrices:
      qk, vo = corrections(q, g)
      if after is not None:
        qk, vo = _stage2.sequenced((qk, vo), after)
      identity = np.broadcast_to(np.arange(g.site.num_heads, dtype=np.int32),
                                 (len(g.names), g.site.num_heads))
      nested = group_action.apply(spec_lib.unflatten(stacked),
                                  group_action.AttentionElement(identity, qk, vo))
      stacked = after = spec_lib.flatten(nested)
    for path, v in stacked.items():
      out.update({f"{s}/{path}": v[i] for i, s in enumerate(g.names)})
  return out


def condition(params: Params, start: Sequence[tuple[jax.Array, jax.Array]], p: Plan) -> jax.Array:
  """Largest bound ||M||_F ||M^{-1}||_F of the trained matrices M = M0 (I + D) (``start``:
  (A0, B0) [S, K, H, H] per site group); 0 when none is trained, NaN if not finite."""
  worst = jnp.zeros((), jnp.result_type(*jax.tree.leaves(params)))
  for g, q, (a0, b0) in zip(p.sites, params["sites"], start):
    if not g.matrices:
      continue
    qk, vo = corrections(q, g)
    matmul = lambda x, y: jnp.matmul(x, y, precision=_features.HIGHEST)
    m = _stage2.sequenced(jnp.stack([matmul(a0, qk), matmul(b0, vo)]), worst)
    bound = jnp.linalg.norm(m, axis=(-2, -1)) * jnp.linalg.norm(jnp.linalg.inv(m), axis=(-2, -1))
    worst = jnp.maximum(worst, jnp.max(bound))
  return worst


# ----------------------------------------------------------------------------- the result


def compose(params: Params, p: Plan, start: Mapping[str, Any]) -> dict[str, Any]:
  """g_c o g0 from the hard values of ``params`` only (module docstring): an exact group
  element; names the correction does not train keep g0's values bit for bit."""
  matmul = lambda x, y: jnp.matmul(x, y, precision=_features.HIGHEST)
  element = dict(start)
  for g, q in zip(p.factors, params["factors"]):
    if g.kind != "permutation":
      values = orthogonal(q["skew"], g.kind)
      element.update({n: matmul(start[n], values[i]) for i, n in enumerate(g.names)})
    else:
      values = _permutations(q["scores"])
      element.update({n: start[n][values[i]] for i, n in enumerate(g.names)})
  for g, q in zip(p.sites, params["sites"]):
    perms = _head_permutations(q["heads"], g.site) if g.heads else None
    qk, vo = corrections(q, g) if g.matrices else (None, None)
    for i, s in enumerate(g.names):
      g0 = start[s]
      if perms is not None:
        sigma = group_action.kv_permutation(perms[i], g.site.kv_heads)
        g0 = group_action.AttentionElement(g0.perm[perms[i]], g0.qk[sigma], g0.vo[sigma])
      if qk is not None:
        g0 = g0._replace(qk=matmul(g0.qk, qk[i]), vo=matmul(g0.vo, vo[i]))
      element[s] = g0
  return element
