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

Activations that are not finite are refused, naming the key (the layer and tap) and the
model and batch. This module imports jax, numpy and optax only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from attn_symmetry import group_action
from attn_symmetry import spec as spec_lib
from attn_symmetry.matching import _assignment
from attn_symmetry.matching import _attention
from attn_symmetry.matching import _features
from attn_symmetry.matching import _methods
from attn_symmetry.matching import _model
from attn_symmetry.matching import _stage2
from attn_symmetry.matching import _static

SEPARATOR = ":"
SITE_TAPS = ("q", "k", "v", "heads")  # an attention site's keys: f"{site}:{tap}"
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
  return sorted(k for k in keys if k == factor or k.startswith(factor + SEPARATOR))


def check_shapes(spec: spec_lib.SymmetrySpec, names: Sequence[str],
                 shapes: Mapping[str, Any]) -> None:
  """ValueError naming the name or key when ``shapes`` (of one model's activations,
  ``jax.eval_shape``'s) does not hold what ``names`` need (``ACTIVATION_KEYS``)."""
  for name in names:
    if name in spec.factors:
      keys = factor_keys(list(shapes), name)
      if not keys:
        raise ValueError(f"activations: no entry for factor {name!r} (a key {name!r} or "
                         f"'{name}{SEPARATOR}...'); got keys {sorted(shapes)}")
      for k in keys:
        shape = tuple(shapes[k].shape)
        if not shape or shape[-1] != spec.factors[name].size:
          raise ValueError(f"activations[{k!r}] has shape {shape}; factor {name!r} needs its "
                           f"last axis of size {spec.factors[name].size}")
      continue
    site = spec.attention[name]
    n, k, h = site.num_heads, site.kv_heads, site.head_dim
    want = {"q": (n, h), "k": (k, h), "v": (k, h), "heads": (n, h)}
    lead = None
    for tap, tail in want.items():
      key = f"{name}{SEPARATOR}{tap}"
      if key not in shapes:
        raise ValueError(f"activations: no entry {key!r} for attention site {name!r} (it needs "
                         f"{[f'{name}{SEPARATOR}{t}' for t in SITE_TAPS]})")
      shape = tuple(shapes[key].shape)
      if len(shape) < 3 or shape[-2:] != tail or (lead is not None and shape[:-2] != lead):
        raise ValueError(f"activations[{key!r}] has shape {shape}, expected [..., T, "
                         f"{tail[0]}, {tail[1]}] with the leading axes of '{name}{SEPARATOR}q'")
      lead = shape[:-2]


def _needed(spec: spec_lib.SymmetrySpec, names: Sequence[str], keys: Sequence[str]) -> list[str]:
  out = []
  for name in names:
    out += (factor_keys(keys, name) if name in spec.factors
            else [f"{name}{SEPARATOR}{t}" for t in SITE_TAPS])
  return out


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


def _factor_stats(kind: str, units_a: list[jax.Array], units_b: list[jax.Array]):
  """One batch's statistics of one factor, from its entries (each ``_standardised``, then
  pooled)."""
  a = jnp.concatenate([_standardised(x) for x in units_a])
  b = jnp.concatenate([_standardised(x) for x in units_b])
  if kind == "orthogonal":
    return _dot(b, a, "ti,tj->ij")  # X_B^T X_A
  return PermutationStats(jnp.asarray(a.shape[0], a.dtype), a.sum(0), b.sum(0), (a * a).sum(0),
                          (b * b).sum(0), _dot(a, b, "ti,tj->ij"))


def _site_stats(taps_a: dict[str, jax.Array], taps_b: dict[str, jax.Array]) -> SiteStats:
  """One batch's statistics of one site from its taps [..., T, N|K, H]."""
  seq = lambda x: x.reshape(-1, *x.shape[-3:])  # [S, T, N|K, H]
  qa, ka, va, za = (seq(taps_a[t]) for t in SITE_TAPS)
  qb, kb, vb, zb = (seq(taps_b[t]) for t in SITE_TAPS)
  cross = lambda x, y: _dot(x, y, "stnh,stmi->nmhi")
  auto = lambda x: _dot(x, x, "stnh,stni->nhi")
  g = qa.shape[-2] // ka.shape[-2]
  logits = lambda q, k: _dot(q, jnp.repeat(k, g, axis=-2), "stnh,sunh->sntu")
  la, lb = logits(qa, ka), logits(qb, kb)
  grams = _features.Grams(cross(qa, qb), cross(ka, kb), cross(va, vb), cross(za, zb), auto(qa),
                          auto(qb), auto(ka), auto(kb), auto(va), auto(vb), auto(za), auto(zb))
  return SiteStats(grams, _dot(la, lb, "sntu,smtu->nm"), jnp.sum(la * la, (0, 2, 3)),
                   jnp.sum(lb * lb, (0, 2, 3)))


def groups(spec: spec_lib.SymmetrySpec, names: Sequence[str], shapes: Mapping[str, Any]
           ) -> tuple[tuple[str, ...], ...]:
  """``names`` grouped where one program serves them all (vmapped over the group): factors
  of one kind and size whose entries have equal shapes (the FFNs of all layers), sites of
  one configuration and tap shapes (every attention layer)."""
  out: dict[Any, list[str]] = {}
  for name in names:
    if name in spec.factors:
      keys = factor_keys(list(shapes), name)
      key = (spec.factors[name], tuple(tuple(shapes[k].shape) for k in keys))
    else:
      key = (spec.attention[name],
             tuple(tuple(shapes[f"{name}{SEPARATOR}{t}"].shape) for t in SITE_TAPS))
    out.setdefault(key, []).append(name)
  return tuple(tuple(g) for g in out.values())


def _entries(spec: spec_lib.SymmetrySpec, acts: Mapping[str, jax.Array], name: str
             ) -> list[jax.Array]:
  if name in spec.factors:
    return [acts[k] for k in factor_keys(list(acts), name)]
  return [acts[f"{name}{SEPARATOR}{t}"] for t in SITE_TAPS]


def _batch_stats(acts_a, acts_b, *, spec, groups):
  """One batch's statistics of every group of names, stacked over the group's names."""
  spec = spec.spec
  out = []
  for names in groups:
    stack = lambda acts: [jnp.stack(x) for x in zip(*(_entries(spec, acts, n) for n in names))]
    if names[0] in spec.factors:
      kind = spec.factors[names[0]].kind
      stats = jax.vmap(lambda a, b: _factor_stats(kind, a, b))(stack(acts_a), stack(acts_b))
    else:
      taps = lambda xs: dict(zip(SITE_TAPS, xs))
      stats = jax.vmap(lambda a, b: _site_stats(taps(a), taps(b)))(stack(acts_a), stack(acts_b))
    out.append(stats)
  return out


def _accumulate(total, acts_a, acts_b, *, spec, groups):
  new = _batch_stats(acts_a, acts_b, spec=spec, groups=groups)
  return jax.tree.map(jnp.add, total, new)


_accumulate_jit = jax.jit(_accumulate, static_argnames=("spec", "groups"))


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


def _solve(stats, outs, *, spec, groups, steps):
  """The element of the names of ``groups`` from their statistics (``outs``: per site group,
  W^O of A and B [S, N, H, D]), each group vmapped; every LAPACK call on one chain
  (``_stage2.sequenced``)."""
  spec = spec.spec
  dtype = next(iter(jax.tree.leaves(stats))).dtype
  element = group_action.identity_model(spec, dtype)
  taken = jnp.int32(0)
  last: Any = jnp.zeros((), dtype)
  order = sorted(range(len(groups)), key=lambda i: groups[i][0] in spec.attention)
  for i in order:  # the factors first: a site's Stage 1 reads the residual's element
    names, s = groups[i], _stage2.sequenced(stats[i], last)
    if names[0] in spec.factors:
      orthogonal = spec.factors[names[0]].kind == "orthogonal"
      values = _stage2.polar(s) if orthogonal else jax.vmap(_permutation)(s)
      last = values.astype(dtype)
    else:
      out_a, out_b = outs[i]
      out_b = jnp.stack([group_action.apply_leaf(spec, f"{n}/out/kernel", out_b[j], element)
                         for j, n in enumerate(names)])
      site = spec.attention[names[0]]
      values, t = jax.vmap(lambda st, oa, ob: _solve_site(st, oa, ob, site, steps=steps))(
          s, out_a, out_b)
      taken, last = jnp.maximum(taken, jnp.max(t)), values.vo
    element.update({n: jax.tree.map(lambda x, j=j: x[j], values) for j, n in enumerate(names)})
  return element, taken


_solve_jit = jax.jit(_solve, static_argnames=("spec", "groups", "steps"))


# ----------------------------------------------------------------------------- the method

_JITTED: dict[Any, Any] = {}  # activations functions, jitted once each (keyed by the function)


def _jitted(activations: Activations):
  if activations not in _JITTED:
    def run(params, batch):
      acts = dict(activations(params, batch))
      return acts, {k: jnp.all(jnp.isfinite(v)) for k, v in acts.items()}
    _JITTED[activations] = jax.jit(run)
  return _JITTED[activations]


def check_inputs(activations: Any, batches: Any) -> None:
  """ValueError naming the argument when the activation method cannot run on them."""
  if not callable(activations):
    raise ValueError("method 'activation' needs activations(params, batch) -> {key: array} "
                     f"(e.g. model.activations); got {activations!r}")
  if isinstance(batches, (str, bytes)) or not isinstance(batches, Sequence) or not batches:
    raise ValueError("method 'activation' needs match_batches, a non-empty list of batches "
                     f"(e.g. from the training split); got {batches!r}")


def align(spec: spec_lib.SymmetrySpec, params_a, params_b, *,
          scope: str | Sequence[str] | None, steps: int, activations: Activations | None = None,
          match_batches: Sequence[Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
  """Method "activation" (``align_model(method="activation")``) on checked models (module
  docstring).

  Args:
    spec: the models' spec.
    params_a, params_b: the two models (any float dtype; the statistics and the element are
      in the matching dtype, float32 for half precision).
    scope: parameter path prefixes; the names in scope are ``_model.active_names``'.
    steps: the most Gauss-Newton iterations of each QK problem.
    activations: ``activations(params, batch) -> {key: array}`` (``ACTIVATION_KEYS``), pure
      and jittable; called on A's and B's parameters as given (unfolded).
    match_batches: the batches it is evaluated on, one at a time.

  Returns:
    (element, info): info {"folded_norm_scales" (whether the element acts on folded
    parameters: an orthogonal factor in scope meets norm scales), "batches" (read),
    "samples" (per factor in scope: the pooled rows of its statistics),
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
  needs_folding = _model._needs_folding(spec, names)
  dtype = _attention.compute_dtype(next(iter(spec_lib.flatten(params_a).values())).dtype)
  for which, params in (("A", params_a), ("B", params_b)):
    try:
      shapes = jax.eval_shape(activations, params, batches[0])
    except Exception as e:  # pylint: disable=broad-except
      raise ValueError(f"activations(params_{which.lower()}, match_batches[0]) fails: "
                       f"{type(e).__name__}: {e}") from None
    check_shapes(spec, names, shapes)
  static, run = _static.StaticSpec(spec), _jitted(activations)
  grouped = groups(spec, names, shapes)
  total = None  # zeros of the statistics' shapes, then the sums over the batches
  for i, batch in enumerate(batches):
    acts = {}
    for which, params in (("A", params_a), ("B", params_b)):
      values, finite = run(params, batch)
      needed = _needed(spec, names, list(values))
      bad = next((k for k in needed if not bool(finite[k])), None)
      if bad is not None:
        raise ValueError(f"activations of model {which} on match batch {i}: {bad!r} has NaN "
                         "or Inf entries")
      acts[which] = {k: values[k].astype(dtype) for k in needed}
    if total is None:
      total = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(
          functools.partial(_batch_stats, spec=static, groups=grouped), acts["A"], acts["B"]))
    total = _accumulate_jit(total, acts["A"], acts["B"], spec=static, groups=grouped)
    del acts
  if needs_folding:
    params_a, params_b = (group_action.fold_norm_scales(spec, p) for p in (params_a, params_b))
  flat_a = _attention.upcast(spec_lib.flatten(params_a))
  flat_b = _attention.upcast(spec_lib.flatten(params_b))
  outs = [tuple(jnp.stack([flat[f"{s}/out/kernel"] for s in g]) for flat in (flat_a, flat_b))
          if g[0] in spec.attention else None for g in grouped]
  element, taken = _solve_jit(total, outs, spec=static, groups=grouped, steps=int(steps))
  moved = spec_lib.flatten(group_action.apply_model(spec, spec_lib.unflatten(flat_b), element,
                                                    check_element=False))
  distance = {"initial": sum(jnp.sum((flat_a[p] - flat_b[p]) ** 2) for p in flat_a),
              "final": sum(jnp.sum((flat_a[p] - moved[p]) ** 2) for p in flat_a)}
  samples = {n: float(stats.count[j]) for g, stats in zip(grouped, total)
             if isinstance(stats, PermutationStats) for j, n in enumerate(g)}
  return element, {"folded_norm_scales": needs_folding, "batches": len(batches),
                   "samples": samples, "refinement_steps": taken, "distance": distance}


_methods.register_built_in("activation", align, arguments=("activations", "match_batches"))
