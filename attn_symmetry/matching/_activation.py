"""Activation matching: every factor of a ``SymmetrySpec`` decided from the two models'
activations on a few batches (docs/matching.md, 'Activation matching').

The weight method ("full") matches parameters; this one matches what the
parameters compute. ``activations(params, batch)`` returns a dict of arrays
keyed by the spec's names (``ACTIVATION_KEYS``; ``Model.activations`` is one
for every built-in family). From both models' activations on every batch, sums
of products are accumulated (one batch at a time, never holding two batches),
and each name in scope is then solved from its own statistics:

* every entry of a factor (one point of the stream, say) is, per batch, centred and scaled
  to unit root mean square (``_standardised``), so that no point outweighs another by its
  size or offset (the stream grows along the layers); the rows of all entries are pooled;
* a permutation factor P (FFN hidden units, a LayerNorm residual stream, a
  head's units): with c[i, j] the correlation of A's unit i and B's unit j over the
  pooled rows, P maximises sum_i c[i, P(i)]: the exact linear assignment on -c;
* an orthogonal factor O (an RMSNorm residual stream): min_O sum ||X_B O - X_A||^2 over
  the pooled rows, O = polar(sum X_B^T X_A) (orthogonal Procrustes). The norm
  scales do not enter the stream, so the element acts on both models with their scales
  folded (``group_action.fold_norm_scales``, info["folded_norm_scales"]), as the weight
  method's does;
* a mean-zero orthogonal factor O = U diag(1, R) U^T (a pre-LayerNorm stream with
  ``residual="orthogonal"``, ``_model.residual_spec``): every row of an entry is first
  projected onto 1-perp (x -> x - mean(x) 1: the stream's mean is a gauge, which LayerNorm
  drops and ``group_action.canonical_form`` removes), then standardised as above; R =
  polar(K), K the 1-perp block of U^T (sum X_B^T X_A) U (``_stage2.mean_zero_polar``). The
  element acts on both models in canonical form (writers projected onto 1-perp, LayerNorm
  gains folded into their readers), as the weight method's does;
* an attention site, after the factors (its Stage 1 reads the residual's element):

  - Stage 1: the cost of pairing A's head n with B's head m is
    d(L_{A,n}, L_{B,m}) + d(o_{A,n}, o_{B,m}), d the Frobenius distance summed over the
    batches, L_n = Q_n K_{k(n)}^T the head's logits over every query/key pair of a sequence
    and o_n = Z_n W^O_n the head's output in the stream (Z_n the head's output before the
    projection; B's W^O mapped by the residual's element). Both are invariant under the
    head's QK and VO matrices, so they compare heads before Stage 2 is known. Under GQA the
    heads are assigned within kv groups and the groups as wholes, as Stage 1 of the weight
    method does (``_assignment.assign_heads``);
  - Stage 2, per kv group, least squares on the activations that the matrices act on:
    QK, A in GL(H) (in H(H) under RoPE) minimising
    ||Q_B A - Q_A||^2 + ||K_B A^{-T} - K_A||^2 over the G query heads of the group and
    their kv head (queries and keys after RoPE, which the logits read; for A in H(H), which
    commutes with every rotation, the objective is the same before or after RoPE). This is
    ``_stage2``'s problem, solved as the weight method's "full" with init "best": the best
    of the Procrustes solution and both one-sided least-squares solutions, refined by
    Gauss-Newton with its guards (iterates that are not finite, or whose condition bound
    exceeds ``_stage2.max_condition``, are rejected). VO, B in GL(H) minimising
    ||V_B B - V_A||^2 + ||Z_B B - Z_A||^2 (values and the heads' outputs both move by B)
    among the maps that carry B's Gram S_B of these rows onto A's S_A (B^T S_B B = S_A):
    B = S_B^{-1/2} polar(S_B^{-1/2} C S_A^{1/2}) S_A^{1/2}, C = X_B^T X_A. On a planted pair
    this is the exact least-squares solution; on others the unconstrained least squares
    S_B^{-1} C shrinks B where the two models' values correlate weakly, and B^{-1} then
    inflates B's W^O. If B is not finite or its condition bound exceeds ``max_condition``,
    the orthogonal Procrustes solution polar(C) is taken.

The element is assembled as the weight method's (``group_action.identity_model`` with
the names in scope replaced): always an exact group element; what it brings B to is B's
function. On a planted pair (B = g . A) every factor and site is recovered exactly, the
permutations by correlations of 1 and the matrices by the exact least squares.

The sums are fed an entry at a time (``Statistics``), so that ``align_streamed`` can run the
models a layer at a time: it holds the models' hidden states, the residual's sums and one layer's
FFN and site sums, and solves each name once its sums are complete (its docstring).

Activations that are not finite are refused, naming the key (the layer and tap) and the
model and batch. This module imports jax, numpy and optax only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from attn_symmetry import attention
from attn_symmetry import group_action
from attn_symmetry import spec as spec_lib
from attn_symmetry.matching import _assignment
from attn_symmetry.matching import _attention
from attn_symmetry.matching import _features
from attn_symmetry.matching import _methods
from attn_symmetry.matching import _model
from attn_symmetry.matching import _options
from attn_symmetry.matching import _stage2
from attn_symmetry.matching import _streamed

ACTIVATION_KEYS = """\
activations(params, batch) -> {key: array}, keyed by the spec's names:
  factor f: every key f or f + ':' + tag (tags free: 'residual:layers_0'), each [..., size]
    with the factor's axis last; all of them pooled (every leading index a sample);
  attention site s: s + ':q' [..., T, N, H] and s + ':k' [..., T, K, H] (after RoPE),
    s + ':v' [..., T, K, H], s + ':heads' [..., T, N, H] (each head's softmax-weighted values,
    before the output projection); [...] indexes sequences, T their tokens."""

Activations = Callable[[Any, Any], Mapping[str, jax.Array]]


# ----------------------------------------------------------------------------- the contract


def factor_keys(keys: Sequence[str], factor: str) -> list[str]:
  """The keys that hold factor ``factor``'s units (``ACTIVATION_KEYS``), in sorted order."""
  return sorted(k for k in keys if spec_lib.is_key_of(k, factor))


def _site_keys(site: str) -> list[str]:
  """The keys of attention site ``site``'s taps, in the order of ``spec.SITE_TAPS``."""
  return [spec_lib.tap(site, t) for t in spec_lib.SITE_TAPS]


def check_shapes(spec: spec_lib.SymmetrySpec, names: Sequence[str],
                 shapes: Mapping[str, Any]) -> None:
  """ValueError naming the name or key when ``shapes`` (of one model's activations,
  ``jax.eval_shape``'s) does not hold what ``names`` need (``ACTIVATION_KEYS``)."""
  for name in names:
    if name in spec.factors:
      keys = factor_keys(list(shapes), name)
      if not keys:
        raise ValueError(f"activations: no entry for factor {name!r} (a key {name!r} or "
                         f"{spec_lib.tap(name, '...')!r}); got keys {sorted(shapes)}")
      for k in keys:
        shape = tuple(shapes[k].shape)
        if not shape or shape[-1] != spec.factors[name].size:
          raise ValueError(f"activations[{k!r}] has shape {shape}; factor {name!r} needs its "
                           f"last axis of size {spec.factors[name].size}")
      continue
    site = spec.attention[name]
    n, k, h = site.num_heads, site.kv_heads, site.head_dim
    keys = _site_keys(name)
    tails = attention.HeadActivations(q=(n, h), k=(k, h), v=(k, h), heads=(n, h))
    lead = None
    for key, tail in zip(keys, tails):
      if key not in shapes:
        raise ValueError(f"activations: no entry {key!r} for attention site {name!r} (it needs "
                         f"{keys})")
      shape = tuple(shapes[key].shape)
      if len(shape) < 3 or shape[-2:] != tail or (lead is not None and shape[:-2] != lead):
        raise ValueError(f"activations[{key!r}] has shape {shape}, expected [..., T, "
                         f"{tail[0]}, {tail[1]}] with the leading axes of {keys[0]!r}")
      lead = shape[:-2]


# ----------------------------------------------------------------------------- statistics


class PermutationStats(NamedTuple):
  """Sums over the samples of a permutation factor's units a (A) and b (B): count [],
  a, b, a^2, b^2 [n], a b^T [n, n]."""
  count: jax.Array
  a: jax.Array
  b: jax.Array
  aa: jax.Array
  bb: jax.Array
  ab: jax.Array


class SiteStats(NamedTuple):
  """Sums over a site's tokens: ``grams`` (``_features.Grams``, of activations: q[n, m] =
  Q_{A,n}^T Q_{B,m} [N, N, H, H], k and v over kv heads, o[n, m] = Z_{A,n}^T Z_{B,m} of the
  heads' outputs, and the self Grams of A and B), and the logits' inner products: logits
  [N, N] (<L_{A,n}, L_{B,m}>), logits_a, logits_b [N]."""
  grams: _features.Grams
  logits: jax.Array
  logits_a: jax.Array
  logits_b: jax.Array


def _rows(x: jax.Array) -> jax.Array:
  return x.reshape(-1, x.shape[-1])


def _dot(x, y, spec):
  return jnp.einsum(spec, x, y, precision=_features.HIGHEST)


def _standardised(x: jax.Array) -> jax.Array:
  """One entry's rows [R, n], centred (each unit's mean over the rows) and scaled to unit
  root mean square over all of them (1 where that is 0): no point of the stream outweighs
  another by its size or its offset. Both commute with a permutation or an orthogonal map of
  the units."""
  x = _rows(x)
  x = x - jnp.mean(x, axis=0)
  rms = jnp.sqrt(jnp.mean(x * x))
  return x / jnp.where(rms > 0, rms, 1)


def _factor_stats(kind: str, a: jax.Array, b: jax.Array):
  """One entry's statistics of one factor of ``kind`` on one batch (each side
  ``_standardised``, its rows projected onto 1-perp first for a mean-zero orthogonal factor);
  a factor's statistics are the sums over its entries and the batches."""
  if kind == "mean_zero_orthogonal":
    a, b = (x - jnp.mean(x, axis=-1, keepdims=True) for x in (a, b))
  a, b = _standardised(a), _standardised(b)
  if kind != "permutation":
    return _dot(b, a, "ti,tj->ij")  # X_B^T X_A
  return PermutationStats(jnp.asarray(a.shape[0], a.dtype), a.sum(0), b.sum(0), (a * a).sum(0),
                          (b * b).sum(0), _dot(a, b, "ti,tj->ij"))


def _site_stats(taps_a: Sequence[jax.Array], taps_b: Sequence[jax.Array]) -> SiteStats:
  """One batch's statistics of one site from its taps [..., T, N|K, H], in the order of
  ``spec.SITE_TAPS`` (``_site_keys``)."""
  seq = lambda x: x.reshape(-1, *x.shape[-3:])  # [S, T, N|K, H]
  qa, ka, va, za = map(seq, taps_a)
  qb, kb, vb, zb = map(seq, taps_b)
  cross = lambda x, y: _dot(x, y, "stnh,stmi->nmhi")
  auto = lambda x: _dot(x, x, "stnh,stni->nhi")
  g = qa.shape[-2] // ka.shape[-2]
  logits = lambda q, k: _dot(q, jnp.repeat(k, g, axis=-2), "stnh,sunh->sntu")
  la, lb = logits(qa, ka), logits(qb, kb)
  grams = _features.Grams(cross(qa, qb), cross(ka, kb), cross(va, vb), cross(za, zb), auto(qa),
                          auto(qb), auto(ka), auto(kb), auto(va), auto(vb), auto(za), auto(zb))
  return SiteStats(grams, _dot(la, lb, "sntu,smtu->nm"), jnp.sum(la * la, (0, 2, 3)),
                   jnp.sum(lb * lb, (0, 2, 3)))


@functools.partial(jax.jit, static_argnames=("kind",))
def _add_factor(total, a, b, *, kind):
  new = _factor_stats(kind, a, b)
  return new if total is None else jax.tree.map(jnp.add, total, new)


@jax.jit
def _add_site(total, taps_a, taps_b):
  new = _site_stats(taps_a, taps_b)
  return new if total is None else jax.tree.map(jnp.add, total, new)


class Statistics:
  """The sums of products of the names in scope, fed the two models' activations an entry at a
  time: ``add`` takes any subset of the keys (every key of a batch, or one layer's), so that
  neither the batches nor the layers need to be held together.

  Held per name fed (float ``dtype``): a permutation factor of n units ``PermutationStats``
  ([], [n] x 4, [n, n]); an orthogonal or mean-zero orthogonal one X_B^T X_A [n, n]; a site (N heads, K kv heads, head
  dim H) ``SiteStats``: Grams [N, N, H, H] (q, o) and [K, K, H, H] (k, v), self Grams
  [N|K, H, H], logits [N, N] and [N] x 2. ``pop`` hands a name's sums over and forgets them.

  Attributes:
    spec: the models' spec; names: the names whose entries are summed; dtype: the sums'.
    sums: name -> its sums so far.
  """

  def __init__(self, spec: spec_lib.SymmetrySpec, names: Sequence[str], dtype: Any):
    self.spec, self.names, self.dtype = spec, tuple(names), dtype
    self.sums: dict[str, Any] = {}

  def add(self, acts_a: Mapping[str, jax.Array], acts_b: Mapping[str, jax.Array], batch: int
          ) -> set[str]:
    """Adds the entries of ``acts_a`` and ``acts_b`` (A's and B's activations of the same keys
    on match batch ``batch``) to the sums of the names they belong to; returns those names.

    Raises:
      ValueError: naming the model, batch and key, if an entry that is read is not finite.
    """
    fed = set()
    for name in self.names:
      if name in self.spec.factors:
        keys = factor_keys(list(acts_a), name)
      else:  # a site's four taps come together
        taps = _site_keys(name)
        keys = taps if taps[0] in acts_a else []
      if not keys:
        continue
      for which, acts in (("A", acts_a), ("B", acts_b)):
        bad = next((k for k in keys if not bool(jnp.all(jnp.isfinite(acts[k])))), None)
        if bad is not None:
          raise ValueError(f"activations of model {which} on match batch {batch}: {bad!r} has "
                           "NaN or Inf entries")
      cast = lambda acts: [acts[k].astype(self.dtype) for k in keys]
      total = self.sums.get(name)
      if name in self.spec.factors:
        kind = self.spec.factors[name].kind
        for xa, xb in zip(cast(acts_a), cast(acts_b)):
          total = _add_factor(total, xa, xb, kind=kind)
      else:
        total = _add_site(total, cast(acts_a), cast(acts_b))
      self.sums[name] = jax.block_until_ready(total)
      fed.add(name)
    return fed

  def pop(self, name: str) -> Any:
    """The sums of ``name``, forgotten here.

    Raises:
      ValueError: naming it, if none of its entries were fed.
    """
    if name not in self.sums:
      raise ValueError(f"activations: no entry of {name!r} was computed")
    return self.sums.pop(name)


# ----------------------------------------------------------------------------- solving


def _permutation(stats: PermutationStats) -> jax.Array:
  """The assignment maximising the summed correlations of A's unit i and B's unit P(i)."""
  count = jnp.maximum(stats.count, 1)
  mean_a, mean_b = stats.a / count, stats.b / count
  cov = stats.ab / count - mean_a[:, None] * mean_b[None, :]
  tiny = jnp.finfo(cov.dtype).tiny
  std = lambda sq, mean: jnp.sqrt(jnp.maximum(sq / count - mean * mean, tiny))
  corr = cov / (std(stats.aa, mean_a)[:, None] * std(stats.bb, mean_b)[None, :])
  return _assignment.linear_assignment(-corr).astype(jnp.int32)


def _head_cost(stats: SiteStats, out_a: jax.Array, out_b: jax.Array) -> jax.Array:
  """Stage 1 cost [N, N]: Frobenius distances of the logits and of the heads' outputs in
  the stream (module docstring)."""
  g = stats.grams
  vo_cross = jnp.einsum("nmhi,nmhi->nm", g.o, _dot(out_a, out_b, "nhd,mid->nmhi"))
  vo_a = jnp.einsum("nhi,nhi->n", g.oa, _dot(out_a, out_a, "nhd,nid->nhi"))
  vo_b = jnp.einsum("nhi,nhi->n", g.ob, _dot(out_b, out_b, "nhd,nid->nhi"))
  return (_features._distance(stats.logits_a, stats.logits_b, stats.logits, "frobenius")
          + _features._distance(vo_a, vo_b, vo_cross, "frobenius"))


def _value_matrices(s_b: jax.Array, s_a: jax.Array, c: jax.Array, fallback: jax.Array
                    ) -> jax.Array:
  """B [K, H, H] minimising ||X_B B - X_A||^2 among the maps that carry B's Gram S_B = X_B^T
  X_B onto A's S_A (B^T S_B B = S_A): B = S_B^{-1/2} polar(S_B^{-1/2} C S_A^{1/2}) S_A^{1/2},
  C = X_B^T X_A (module docstring); ``fallback`` where B is not finite or its condition bound
  ||B|| ||B^{-1}|| exceeds ``_stage2.max_condition``."""
  ridge = lambda x: x + jax.vmap(_stage2._ridge)(x)[:, None, None] * jnp.eye(x.shape[-1],
                                                                                dtype=x.dtype)
  d, u = jnp.linalg.eigh(_stage2.sequenced(jnp.stack([ridge(s_b), ridge(s_a)]), fallback))
  root = jnp.sqrt(jnp.maximum(d, jnp.finfo(d.dtype).tiny))[..., None, :]
  t = lambda x: jnp.swapaxes(x, -1, -2)
  power = lambda sign: jnp.matmul(u * root ** sign, t(u), precision=_features.HIGHEST)
  half, inverse_half = power(1), power(-1)  # [2, K, H, H]: B's, then A's
  mm = lambda *xs: functools.reduce(lambda x, y: jnp.matmul(x, y, precision=_features.HIGHEST),
                                    xs)
  q = _stage2.polar(mm(inverse_half[0], c, half[1]))
  solved, its_inverse = mm(inverse_half[0], q, half[1]), mm(inverse_half[1], t(q), half[0])
  bound = jnp.linalg.norm(solved, axis=(-2, -1)) * jnp.linalg.norm(its_inverse, axis=(-2, -1))
  ok = jnp.all(jnp.isfinite(solved), axis=(-2, -1)) & (bound <= _stage2.max_condition(c.dtype))
  return jnp.where(ok[:, None, None], solved, fallback)


def _solve_site(stats: SiteStats, out_a, out_b, site: spec_lib.AttentionSite, *, steps: int
                ) -> tuple[group_action.AttentionElement, jax.Array]:
  """Stage 1 and Stage 2 of one site (module docstring); (element, the most Gauss-Newton
  iterations of its QK problems)."""
  perm = _assignment.assign_heads(_head_cost(stats, out_a, out_b), site.kv_heads)
  # Stage 2's problems of the weight method, with activation Grams: QK's as they are; VO's two
  # terms both move by B here (values and heads' outputs), so they are one least squares.
  g = stats.grams
  qk, vo = _stage2.pair_problems(g, perm)
  s_vo, c_vo = vo.s1 + vo.s2, vo.c1 + vo.c2
  k = site.kv_heads
  s_a = g.va + g.oa.reshape(k, -1, *g.oa.shape[1:]).sum(1)  # A's Gram of the same rows
  rope = site if site.group == "rope" else None
  qk_start, vo_start = _stage2.procrustes(qk.c1 + qk.c2, c_vo, rope)
  constrained = jnp.ones((), bool)
  qk = _stage2.sequenced(qk, (qk_start, vo_start))

  def refine(p, start):
    m = _stage2.best_start(p, start, constrained, rope)
    return _stage2.gauss_newton(m, p, constrained, rope, steps=steps)

  qk_m, taken = jax.vmap(refine)(qk, qk_start)
  vo_m = _value_matrices(s_vo, s_a, c_vo, _stage2.sequenced(vo_start, qk_m))
  return group_action.AttentionElement(perm.astype(jnp.int32), qk_m, vo_m), jnp.max(taken)


@functools.partial(jax.jit, static_argnames=("kind",))
def _solve_factor(stats, *, kind: str) -> jax.Array:
  """A factor's element from its sums: polar(X_B^T X_A) (orthogonal), the same on 1-perp
  (mean-zero orthogonal, ``_stage2.mean_zero_polar``) or the assignment on the correlations
  (permutation)."""
  solve = {"orthogonal": _stage2.polar, "mean_zero_orthogonal": _stage2.mean_zero_polar,
           "permutation": _permutation}[kind]
  return solve(stats)


@functools.partial(jax.jit, static_argnames=("site", "steps"))
def _solve_sites(stats, out_a, out_b, *, site, steps):
  """The elements of S sites of one configuration ``site``, vmapped: stats stacked [S, ...],
  W^O of A and B [S, N, H, D] (B's mapped by the residual's element); (elements, the most
  Gauss-Newton iterations)."""
  values, taken = jax.vmap(lambda st, oa, ob: _solve_site(st, oa, ob, site, steps=steps))(
      stats, out_a, out_b)
  return values, jnp.max(taken)


def _out_kernels(spec: spec_lib.SymmetrySpec, sites: Sequence[str], flat_a, flat_b, element
                 ) -> tuple[jax.Array, jax.Array]:
  """W^O of ``sites`` in A and B [S, N, H, D] from (folded, upcast) leaves, B's mapped by the
  factors of ``element`` (its sites at identity: Stage 1 compares the heads' outputs in A's
  stream)."""
  path = lambda s: f"{s}/out/kernel"
  out_a = jnp.stack([flat_a[path(s)] for s in sites])
  out_b = jnp.stack([group_action.apply_leaf(spec, path(s), flat_b[path(s)], element)
                     for s in sites])
  return out_a, out_b


def _out_leaves(spec: spec_lib.SymmetrySpec, sites: Sequence[str], leaves: Sequence[Flat],
                fold: bool) -> tuple[Flat, Flat]:
  """(A's, B's) W^O of ``sites`` {path: array} from a step's leaves (one {path: array} per
  model), upcast, and where ``fold`` in canonical form (``group_action.canonical_form`` on that
  part of the spec: the norm scales among the leaves that read into them folded, and W^O
  projected onto 1-perp where it writes a mean-zero orthogonal stream): all that
  ``_solve_into`` reads, so the step's other leaves are neither copied nor folded."""
  outs = [f"{s}/out/kernel" for s in sites]
  scales = [p for p, readers in spec.norm_scales.items()
            if p in leaves[0] and any(r in outs for r in readers)]
  picked = [_attention.upcast({p: x[p] for p in outs + scales}) for x in leaves]
  if not fold:
    return picked[0], picked[1]
  part = spec.part(outs + scales)
  flat_a, flat_b = (spec_lib.flatten(group_action.canonical_form(part, spec_lib.unflatten(x)))
                    for x in picked)
  return flat_a, flat_b


def _site_groups(spec: spec_lib.SymmetrySpec, sites: Sequence[str]) -> list[list[str]]:
  """``sites`` grouped by configuration (one program, vmapped, for each group)."""
  out: dict[Any, list[str]] = {}
  for s in sites:
    out.setdefault(spec.attention[s], []).append(s)
  return list(out.values())


def _solve_into(element, spec: spec_lib.SymmetrySpec, stats: Statistics, sites: Sequence[str],
                flat_a, flat_b, steps: int) -> int:
  """Solves ``sites`` (of one configuration) from their sums in ``stats`` (popped) and the
  leaves holding their W^O (folded where the element folds, upcast), into ``element``; returns
  the most Gauss-Newton iterations. Each program is waited for: every LAPACK call on one
  chain (``_stage2.sequenced``)."""
  sums = jax.tree.map(lambda *x: jnp.stack(x), *[stats.pop(s) for s in sites])
  out_a, out_b = _out_kernels(spec, sites, flat_a, flat_b, element)
  values, taken = jax.block_until_ready(
      _solve_sites(sums, out_a, out_b, site=spec.attention[sites[0]], steps=int(steps)))
  element.update({s: jax.tree.map(lambda x, j=j: x[j], values) for j, s in enumerate(sites)})
  return int(taken)


def _solve_factors_into(element, spec: spec_lib.SymmetrySpec, stats: Statistics,
                        factors: Sequence[str], samples: dict[str, float]) -> None:
  """Solves ``factors`` from their sums (popped) into ``element``, one program each (waited
  for); records the pooled rows of each permutation factor in ``samples``."""
  for f in factors:
    sums = stats.pop(f)
    if isinstance(sums, PermutationStats):
      samples[f] = float(sums.count)
    kind = spec.factors[f].kind
    element[f] = jax.block_until_ready(_solve_factor(sums, kind=kind)).astype(
        jnp.int32 if kind == "permutation" else stats.dtype)


# ----------------------------------------------------------------------------- the method

_JITTED: dict[Any, Any] = {}  # activations functions, jitted once each (keyed by the function)


def _jitted(activations: Activations):
  if activations not in _JITTED:
    _JITTED[activations] = jax.jit(lambda params, batch: dict(activations(params, batch)))
  return _JITTED[activations]


def check_inputs(activations: Any, batches: Any) -> None:
  """ValueError naming the argument when the activation method cannot run on them."""
  if not callable(activations):
    raise ValueError("method 'activation' needs activations(params, batch) -> {key: array} "
                     f"(e.g. model.activations); got {activations!r}")
  if isinstance(batches, (str, bytes)) or not isinstance(batches, Sequence) or not batches:
    raise ValueError("method 'activation' needs match_batches, a non-empty list of batches "
                     f"(e.g. from the training split); got {batches!r}")


def _split(spec: spec_lib.SymmetrySpec, names: Sequence[str]) -> tuple[list[str], list[str]]:
  """(the factors, the sites) among ``names``."""
  return [n for n in names if n in spec.factors], [n for n in names if n in spec.attention]


def align(spec: spec_lib.SymmetrySpec, params_a, params_b, *,
          scope: str | Sequence[str] | None, steps: int, residual: str,
          activations: Activations | None = None, match_batches: Sequence[Any] | None = None
          ) -> tuple[dict[str, Any], dict[str, Any]]:
  """Method "activation" (``align_model(method="activation")``) on checked models (module
  docstring).

  Args:
    spec: the models' spec.
    params_a, params_b: the two models (any float dtype; the statistics and the element are
      in the matching dtype, float32 for half precision).
    scope: parameter path prefixes; the names in scope are ``_model.active_names``'.
    steps: the most Gauss-Newton iterations of each QK problem.
    residual: the residual factor of a stream read through LayerNorms only, "permutation" or
      "orthogonal" (``_model.residual_spec``: the element then belongs to that spec's group).
    activations: ``activations(params, batch) -> {key: array}`` (``ACTIVATION_KEYS``), pure
      and jittable; called on A's and B's parameters as given (unfolded).
    match_batches: the batches it is evaluated on, one at a time.

  Returns:
    (element, info): info {"folded_norm_scales" (whether the element acts on parameters in
    ``group_action.canonical_form``: a matrix factor in scope meets norm scales), "batches"
    (read),
    "samples" (per permutation factor in scope: the pooled rows of its statistics),
    "refinement_steps", "distance" {"initial", "final"} the squared parameter distance to
    (folded) A before and after}.

  Raises:
    ValueError: before any computation, naming the argument or key, if ``activations`` or
      ``match_batches`` cannot serve (``check_inputs``) or the activations lack what a name
      in scope needs; after a batch, naming the model, batch and key, if an activation is
      not finite.
  """
  batches = match_batches
  check_inputs(activations, batches)
  names = _model.active_names(spec, scope)
  spec = _model.residual_spec(spec, residual, names)
  needs_folding = _model._needs_folding(spec, names)
  dtype = _attention.compute_dtype(next(iter(spec_lib.flatten(params_a).values())).dtype)
  for which, params in (("A", params_a), ("B", params_b)):
    try:
      shapes = jax.eval_shape(activations, params, batches[0])
    except Exception as e:  # pylint: disable=broad-except
      raise ValueError(f"activations(params_{which.lower()}, match_batches[0]) fails: "
                       f"{type(e).__name__}: {e}") from None
    check_shapes(spec, names, shapes)
  run, stats = _jitted(activations), Statistics(spec, names, dtype)
  for i, batch in enumerate(batches):
    stats.add(run(params_a, batch), run(params_b, batch), i)
  if needs_folding:
    params_a, params_b = (group_action.canonical_form(spec, p) for p in (params_a, params_b))
  flat_a = _attention.upcast(spec_lib.flatten(params_a))
  flat_b = _attention.upcast(spec_lib.flatten(params_b))
  factors, sites = _split(spec, names)
  element, samples = group_action.identity_model(spec, dtype), {}
  _solve_factors_into(element, spec, stats, factors, samples)
  taken = max([_solve_into(element, spec, stats, group, flat_a, flat_b, steps)
               for group in _site_groups(spec, sites)], default=0)
  moved = spec_lib.flatten(group_action.apply_model(spec, spec_lib.unflatten(flat_b), element,
                                                    check_element=False))
  distance = {"initial": sum(jnp.sum((flat_a[p] - flat_b[p]) ** 2) for p in flat_a),
              "final": sum(jnp.sum((flat_a[p] - moved[p]) ** 2) for p in flat_a)}
  return element, {"folded_norm_scales": needs_folding, "batches": len(batches),
                   "samples": samples, "refinement_steps": jnp.int32(taken),
                   "distance": distance}


Flat = dict[str, Any]
Forward = Callable[[], Iterable[tuple[Sequence[Flat], Iterable[Sequence[Mapping[str, Any]]]]]]


def align_streamed(spec: spec_lib.SymmetrySpec, forward: Forward, shapes: Mapping[str, Any], *,
                   scope: str | Sequence[str] | None, steps: int, batches: int,
                   residual: str = _options.RESIDUALS[0]) -> tuple[dict[str, Any], dict[str, Any]]:
  """Method "activation" with both models run a group of leaves at a time: the element of
  ``align`` (the same sums, added in another order: identical permutations, matrices to
  rounding), without holding either model or all layers' activations.

  ``forward()`` runs both models over the match batches once, a group of leaves at a time
  (``Model.activations_streamed``): it yields, per step (the embeddings, each layer, the
  head), ((A's leaves, B's leaves) read for it {path: array}, an iterable over the batches of
  (A's, B's) activations {key: array} of the keys that step computes (``ACTIVATION_KEYS``)).
  Each step's sums are added batch by batch (``Statistics``), and a name is solved as soon as
  its sums are complete: a factor whose leaves lie in one group of ``stream_groups`` (an FFN)
  at the end of its step, a factor spanning groups (the residual stream) at the end of the
  pass, a site at the end of its step, reading its W^O from the step's leaves. A site's Stage
  1 compares its heads' outputs in A's stream, through the residual's element: where that
  element is in scope (it is only known after the whole pass), the sites are solved in a
  second pass, which runs the models again and holds one site's sums at a time. So memory
  holds, besides the step's leaves and the models' hidden states on the match batches: the
  sums of each spanning factor ([n, n]), and of one layer's FFN factor ([F, F]) and site
  (``Statistics``: [N, N, H, H] x 2, [K, K, H, H] x 2) while that layer runs.

  Args:
    spec: the models' spec.
    forward: the pass, as above (called once or twice); the leaves and activations upcast
      from half precision already (any float dtype; the sums are in the activations' dtype).
    shapes: one model's activations on one batch, as ``jax.eval_shape`` gives them (the keys'
      shapes and dtype), checked against the names in scope before any pass
      (``check_shapes``).
    scope, steps, residual: as ``align`` (with "orthogonal", the W^O that a site's Stage 1
      reads are brought to canonical form from the step's leaves: projected onto 1-perp).
    batches: how many match batches ``forward`` runs (info["batches"]).

  Returns:
    (element, info) as ``align``'s, without "distance" (the parameters are not held).

  Raises:
    ValueError: as ``align``.
  """
  names = _model.active_names(spec, scope)
  spec = _model.residual_spec(spec, residual, names)
  check_shapes(spec, names, shapes)
  needs_folding = _model._needs_folding(spec, names)
  dtype = _attention.compute_dtype(next(iter(shapes.values())).dtype)
  factors, sites = _split(spec, names)
  groups = _streamed.stream_groups(spec)
  leaves_of = lambda f: {p for p, axes in spec.axes.items() if f in axes}
  local = {f for f in factors if any(leaves_of(f) <= set(g) for g in groups)}
  spanning = [f for f in factors if f not in local]
  waits = any(f in spanning for s in sites for f in spec.axes[f"{s}/out/kernel"])
  element, samples, taken = group_action.identity_model(spec, dtype), {}, 0

  def run(names: Sequence[str]) -> None:
    nonlocal taken
    stats, solved = Statistics(spec, names, dtype), set()
    for leaves, entries in forward():
      fed = set()
      for i, (acts_a, acts_b) in enumerate(entries):
        fed |= stats.add(acts_a, acts_b, i)
      if fed & solved:
        raise ValueError(f"activations: entries of {sorted(fed & solved)} in two steps of the "
                         "pass; a layer's factor or site must be computed in one")
      done = sorted(n for n in fed if n in local)
      _solve_factors_into(element, spec, stats, done, samples)
      here = [s for s in sites if s in fed]
      if here:
        taken = max(taken, _solve_into(element, spec, stats, here,
                                       *_out_leaves(spec, here, leaves, needs_folding), steps))
      solved |= set(done) | set(here)
      del leaves, entries  # not held while the next step reads its leaves
    _solve_factors_into(element, spec, stats, [f for f in spanning if f in names], samples)

  if waits:
    run(factors)
    run(sites)
  else:
    run(names)
  return element, {"folded_norm_scales": needs_folding, "batches": batches, "passes": 1 + waits,
                   "samples": samples, "refinement_steps": jnp.int32(taken)}


def statistics_bytes(spec: spec_lib.SymmetrySpec) -> int:
  """The most bytes of float32 sums that ``align_streamed`` holds at once on the whole spec:
  every factor spanning groups (``PermutationStats`` or [n, n]), plus the largest factor of
  one group and the largest site (``Statistics``)."""
  groups = _streamed.stream_groups(spec)
  leaves_of = lambda f: {p for p, axes in spec.axes.items() if f in axes}
  factor = lambda f: spec.factors[f].size ** 2 + 4 * spec.factors[f].size + 1
  spanning = [f for f in spec.factors if not any(leaves_of(f) <= set(g) for g in groups)]
  local = [factor(f) for f in spec.factors if f not in spanning]

  def site(s):
    n, k, h = s.num_heads, s.kv_heads, s.head_dim
    return 2 * (n * n + k * k) * h * h + 2 * (n + k) * h * h * 2 + n * n + 2 * n

  return 4 * (sum(factor(f) for f in spanning) + max(local, default=0) +
              max((site(s) for s in spec.attention.values()), default=0))


_methods.register_built_in(
    "activation", align, inputs=(_methods.ACTIVATIONS,), streamed=_methods.ACTIVATIONS,
    doc="every factor from the models' activations on match data")
