"""Whole-model alignment over a ``SymmetrySpec``: Weight Matching plus attention matching.

The objective is the squared parameter distance ||theta_A - g . theta_B||^2
over every leaf, minimised by block coordinate descent (Ainsworth et al. 2023,
generalised):

* a permutation factor P (FFN hidden units, a LayerNorm residual stream): with
  every other factor fixed, <theta_A, g . theta_B> is linear in P, so the best
  P solves the linear assignment problem on M = sum_leaf A_(P) B_(P)^T over
  every leaf axis that P acts on (A_(P) the leaf with P's axis first,
  flattened to [n, -1]; B with all other factors and the attention elements
  applied);
* an orthogonal factor O (the residual stream of an RMSNorm model, norm scales
  folded) likewise maximises tr(O M) over O(n): the polar factor of M^T
  (orthogonal Procrustes). Folded norm scales (all ones) are left out, as
  ``group_action.apply_model`` leaves them unchanged;
* a mean-zero orthogonal factor O = U diag(1, R) U^T (a pre-LayerNorm stream with
  ``residual="orthogonal"``, both models in ``group_action.canonical_form``):
  tr(O M) = (U^T M U)_00 + tr(R K) with K the 1-perp block of U^T M U
  ([n - 1, n - 1]), so R = polar(K^T), Procrustes on the mean-zero subspace;
* attention sites: two-stage matching (``_attention``) of A's layer against
  B's layer with the current factors applied.

Steps group what is independent: factors of one kind and size that share no
leaf (the FFNs of all layers) form one step, solved one factor after another
(one n x n score matrix held at a time), and attention sites of one
configuration one step with ``vmap`` over layers.
A step is rerun only when a step sharing a leaf with it changed after it last
ran, and the loop ends when no step is pending (or after ``max_rounds``). In
the first round a factor reads only the leaves whose other factors and sites
are already solved (embeddings, norms and the head for the residual stream,
when nothing else is known), and runs again later with all of its leaves: a
wrong first guess from still unmatched weights would otherwise steer the
descent. A leaf on which a factor is the only name acting (an embedding, an
untied head) scores it the same in every round: its share of M is computed
once, before the loop (``_fixed_leaves``).

Acceptance. A factor step is an exact minimiser given everything else; it is
accepted only if it improves the objective by more than a relative tolerance
(so that rounding never moves a factor back and forth). An attention step is
not a minimiser: Stage 1 chooses the permutation by invariant circuit
distances, not by the parameter distance, and each method's Stage 2 is its
own solution. The first solve of every site (in round one) therefore applies
the method's solution unconditionally, as the paper defines the method: for
"perm" (Variant 1) the Stage 1 permutation even where it raises the distance,
for "ortho" and "full" their solution after that permutation even where it is
worse than identity (Stage 2 itself never is worse than the permutation
alone). When the factors around a site change in a later round, the site is
solved again and the new solution is accepted only if it lowers the objective
by more than the tolerance: from round two on the descent is monotone, and so
it ends. With a single site in scope (the first attention layer) the result is
exactly the method's solution.

Scope. The descent is compiled for the whole model; the scope is a traced
mask over its factors and sites (``active``), so that every scope of a model
shares one program. A factor or site out of scope stays identity: it is never
solved, never pending, and counts as solved for the first round's choice of
leaves. Its identity element acts exactly (a permutation by ``take``, an
identity matrix by a product whose every other term is an exact zero), so a
scope reaches the element that a descent over its own names alone reaches:
bit for bit for Weight Matching, "perm" and "ortho"; for "full" up to the
rounding of its refinement, which runs batched with the step's sites out of
scope (measured on ViT, GPT-2 and Llama: at most 8e-7 apart in float32).

Refinement of "full" (``refine``): "every_round" runs the whole "full" method
(Stage 1, Procrustes, refinement) at every attention step; "final" runs the descent
with "ortho" (Variant 2) to convergence and then refines every site's QK and
VO matrices once, from the descent's matrices with its permutations and
factors kept (never worse than the descent's element). Orthogonal factors
(an RMSNorm residual) thus keep the values fitted to the orthogonal attention
matrices: on a planted RMSNorm model "final" ends 1.5e-5 of the initial
distance away where "every_round" recovers it to rounding (permutation
factors are recovered exactly by both).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from attn_symmetry import group_action
from attn_symmetry import spec as spec_lib
from attn_symmetry.matching import _assignment
from attn_symmetry.matching import _attention
from attn_symmetry.matching import _features
from attn_symmetry.matching import _methods
from attn_symmetry.matching import _options
from attn_symmetry.matching import _stage2
from attn_symmetry.matching import _static

DEFAULT_MAX_ROUNDS = _options.DEFAULT_MAX_ROUNDS
REFINES = _options.REFINES  # when "full" refines the attention matrices (module docstring)
Params = dict[str, Any]


# ----------------------------------------------------------------------------- scope and plan


def _in_scope(path: str, prefixes: Sequence[str]) -> bool:
  return any(p == "" or path == p or path.startswith(p + "/") for p in prefixes)


def _site_leaves(spec: spec_lib.SymmetrySpec, site: str) -> list[str]:
  return [p for p in spec.axes if p.startswith(site + "/")]


def active_names(spec: spec_lib.SymmetrySpec, scope: str | Sequence[str] | None,
                 attention: bool = True) -> tuple[str, ...]:
  """Factors and (if ``attention``) sites all of whose leaves lie under a prefix of ``scope``.

  ``scope`` None or [""] means the whole model; a bare string is one prefix.
  A prefix that names no leaf is an error (ValueError naming it), so that a
  typo does not silently align nothing.
  """
  prefixes = [""] if scope is None else [scope] if isinstance(scope, str) else list(scope)
  for p in prefixes:
    if not isinstance(p, str):
      raise ValueError(f"scope entries must be path prefixes (str), got {p!r}")
    if not any(_in_scope(path, [p]) for path in spec.axes):
      raise ValueError(f"scope prefix {p!r} matches no parameter of the spec")
  names = []
  for f in spec.factors:
    leaves = [p for p, axes in spec.axes.items() if f in axes]
    if leaves and all(_in_scope(p, prefixes) for p in leaves):
      names.append(f)
  if attention:
    names += [s for s in spec.attention if all(_in_scope(p, prefixes) for p in _site_leaves(spec, s))]
  return tuple(names)


@dataclasses.dataclass(frozen=True)
class _Step:
  names: tuple[str, ...]  # factors of one kind and size, or attention sites of one configuration
  attention: bool
  leaves: frozenset[str]  # every leaf that the step's names act on


def _plan(spec: spec_lib.SymmetrySpec, flat: dict[str, Any]) -> list[_Step]:
  """The steps of one round, in order (module docstring); ``spec`` holds the active names only."""
  touched = {f: frozenset(p for p, axes in spec.axes.items() if f in axes) for f in spec.factors}
  size = lambda f: sum(math.prod(flat[p].shape) for p in touched[f])
  steps: list[_Step] = []
  kind = lambda f: (spec.factors[f].kind, spec.factors[f].size)
  for f in sorted(spec.factors, key=lambda f: -size(f)):  # the residual stream first
    for i, step in enumerate(steps):
      if kind(f) == kind(step.names[0]) and not step.leaves & touched[f]:
        steps[i] = _Step(step.names + (f,), False, step.leaves | touched[f])
        break
    else:
      steps.append(_Step((f,), False, touched[f]))
  groups: dict[Any, list[str]] = {}
  for s, site in spec.attention.items():
    leaves = _site_leaves(spec, s)
    key = (site, tuple((p[len(s):], flat[p].shape, flat[p].dtype) for p in leaves))
    groups.setdefault(key, []).append(s)
  for names in groups.values():
    leaves = frozenset(p for s in names for p in _site_leaves(spec, s))
    steps.append(_Step(tuple(names), True, leaves))
  return steps


def _site_of(spec: spec_lib.SymmetrySpec) -> dict[str, str]:
  return {p: s for s in spec.attention for p in _site_leaves(spec, s)}


def _active_names(spec: spec_lib.SymmetrySpec) -> tuple[str, ...]:
  """The order of the ``active`` mask: every factor, then every attention site."""
  return (*spec.factors, *spec.attention)


def _first_round_reads(spec: spec_lib.SymmetrySpec, plan: list[_Step], on: dict[str, jax.Array]
                       ) -> tuple[dict[str, dict[str, jax.Array]], list[jax.Array]]:
  """Which leaves each factor reads in round one, and which steps run again in round two.

  A leaf of factor f is read when every other factor and site acting on it is
  out of scope (``on`` False: identity) or belongs to an earlier step; if that
  leaves f without leaves, it reads all of them. A step whose factors in scope
  did not all read all of their leaves runs again in round two.

  Returns:
    (reads, again): reads[f][path] a traced bool for every leaf of every
    factor; again[i] a traced bool per step of ``plan`` (False for attention).
  """
  site_of = _site_of(spec)
  solved: set[str] = set()
  reads: dict[str, dict[str, jax.Array]] = {}
  again: list[jax.Array] = []
  for step in plan:
    rerun = jnp.bool_(False)
    for f in step.names if not step.attention else ():
      known = {}
      for p in (p for p in spec.axes if f in spec.axes[p]):
        pending = {g for g in (*spec.axes[p], site_of.get(p)) if g not in (None, f)} - solved
        known[p] = functools.reduce(jnp.logical_and, [~on[g] for g in sorted(pending)],
                                    jnp.bool_(True))
      flags = jnp.stack(list(known.values()))
      some, every = jnp.any(flags), jnp.all(flags)
      reads[f] = {p: k | ~some for p, k in known.items()}
      rerun = rerun | (on[f] & some & ~every)
    again.append(rerun)
    solved.update(step.names)
  return reads, again


def _neighbours(spec: spec_lib.SymmetrySpec, plan: list[_Step], active: jax.Array) -> jax.Array:
  """[S, S] bool: steps i != j whose names in scope share a leaf (a change in one makes the
  other pending)."""
  names = _active_names(spec)
  site_of = _site_of(spec)
  leaves = {n: {p for p, axes in spec.axes.items() if n in axes or site_of.get(p) == n}
            for n in names}
  overlap = np.array([[bool(leaves[a] & leaves[b]) for b in names] for a in names], np.float32)
  member = np.array([[n in step.names for n in names] for step in plan], np.float32)
  member = jnp.asarray(member) * active.astype(jnp.float32)  # [S, names], in scope only
  shared = member @ jnp.asarray(overlap).reshape(len(names), len(names)) @ member.T > 0
  return shared & ~jnp.eye(len(plan), dtype=bool)


# ----------------------------------------------------------------------------- steps


def _with_attention(spec: spec_lib.SymmetrySpec, plan: list[_Step], flat_b: dict[str, Any],
                    element: dict[str, Any], paths) -> dict[str, Any]:
  """B's leaves among ``paths``, with the attention elements of their sites applied
  (``group_action.apply``, vmapped over the sites of each attention step)."""
  out = {p: flat_b[p] for p in paths}
  for step in plan:
    sites = [s for s in step.names if step.attention and step.leaves & set(paths)]
    if not sites:
      continue
    layers = [spec_lib.unflatten({p[len(s) + 1:]: flat_b[p] for p in _site_leaves(spec, s)})
              for s in sites]
    moved = jax.vmap(group_action.apply)(_stack(layers), _stack([element[s] for s in sites]))
    for i, s in enumerate(sites):
      out.update({f"{s}/{p}": v[i] for p, v in spec_lib.flatten(moved).items()})
  return out


def _tolerance(dtype: Any) -> float:
  return 100 * float(jnp.finfo(dtype).eps)


Scores = tuple[jax.Array, jax.Array, jax.Array]  # (M [n, n], ||A||^2, ||B||^2)


def _scored_leaves(spec: spec_lib.SymmetrySpec, f: str) -> list[str]:
  """The leaves that factor ``f`` is scored on, in path order: every leaf it acts on but
  the norm scales of a matrix factor (folded, all ones: ``apply_leaf`` leaves them)."""
  orthogonal = spec.factors[f].is_matrix
  return sorted(p for p, axes in spec.axes.items()
                if f in axes and not (orthogonal and p in spec.norm_scales))


def _fixed_leaves(spec: spec_lib.SymmetrySpec, f: str, flat: dict[str, Any]) -> list[str]:
  """The leaves of ``f`` whose scores never change during the descent, worth computing once.

  A leaf on which ``f`` is the only name acting (one axis, no other factor, no
  attention site: embeddings, a head) contributes the same A_(f) B_(f)^T
  whatever the element. It is kept out of the loop when its [n, -1] view has
  at least n columns, so that its n x n contribution is no larger than the leaf
  (a LayerNorm's [n] scale or an FFN bias is cheaper to recompute than to hold).
  """
  n, site_of = spec.factors[f].size, _site_of(spec)
  return [p for p in _scored_leaves(spec, f)
          if [g for g in spec.axes[p] if g is not None] == [f] and p not in site_of
          and math.prod(flat[p].shape) >= n * n]


# The most bytes of one block of rows of M that _add_leaf_scores computes at a time.
SCORE_BLOCK_BYTES = 2 ** 27


def _score_blocks(n: int, itemsize: int) -> int:
  """How many row blocks _add_leaf_scores splits an n x n M into: the fewest that divide n
  with each block at most ``SCORE_BLOCK_BYTES`` (n blocks of one row at worst)."""
  least = -(-n * n * itemsize // SCORE_BLOCK_BYTES)
  return next(k for k in range(max(least, 1), n + 1) if n % k == 0)


def _add_leaf_scores(total: Scores, a: jax.Array, b: jax.Array, axis: int, n: int) -> Scores:
  """``total`` plus (A_(axis) B_(axis)^T [n, n], ||A||^2, ||B||^2) of one leaf pair, ``b``
  already mapped by every other name acting on it; M added in place one block of rows at a
  time (``_score_blocks``): total[0][rows] += A_(axis)[rows] B_(axis)^T, so that no second
  n x n buffer is held beside the running sum (an FFN's 14336^2 float32 M is 0.8 GB)."""
  # Norms of the leaves as laid out: XLA:CPU reduces a transposed view ~100x slower.
  norm_a, norm_b = jnp.sum(a * a), jnp.sum(b * b)
  a, b = (jnp.moveaxis(x, axis, 0).reshape(n, -1) for x in (a, b))
  m, blocks = total[0], _score_blocks(n, total[0].dtype.itemsize)
  rows = n // blocks

  def add(i, m):  # M: [new (A), old (B)]
    start = i * rows
    block = jnp.matmul(jax.lax.dynamic_slice_in_dim(a, start, rows), b.T,
                       precision=_features.HIGHEST)
    return jax.lax.dynamic_update_slice_in_dim(
        m, jax.lax.dynamic_slice_in_dim(m, start, rows) + block, start, 0)

  m = m + jnp.matmul(a, b.T, precision=_features.HIGHEST) if blocks == 1 else (
      jax.lax.fori_loop(0, blocks, add, m))
  return m, total[1] + norm_a, total[2] + norm_b


def _fixed_scores(spec: spec_lib.SymmetrySpec, flat_a, flat_b, on: dict[str, jax.Array]
                  ) -> dict[str, Scores]:
  """The summed scores of every factor's ``_fixed_leaves`` (zeros for a factor out of scope
  ``on``, which is never solved); computed once, before the descent."""
  dtype = next(iter(flat_a.values())).dtype
  out = {}
  for f, factor in spec.factors.items():
    n = factor.size
    zeros = (jnp.zeros((n, n), dtype), jnp.zeros((), dtype), jnp.zeros((), dtype))
    leaves = _fixed_leaves(spec, f, flat_a)

    def total(f=f, leaves=leaves, n=n, zeros=zeros):
      return functools.reduce(
          lambda t, p: _add_leaf_scores(t, flat_a[p], flat_b[p], spec.axes[p].index(f), n),
          leaves, zeros)

    out[f] = jax.lax.cond(on[f], total, lambda zeros=zeros: zeros) if leaves else zeros
  return out


def _factor_scores(spec: spec_lib.SymmetrySpec, plan: list[_Step], f: str, flat_a, flat_b,
                   element, read: dict[str, jax.Array], rounds: jax.Array, fixed: Scores
                   ) -> Scores:
  """(M, ||A||^2, ||B||^2) of factor ``f``: the scores M[j, i] = <A_j, B_i> [n, n] and the
  squared norms of the A and B parts, with everything else in ``element`` applied to B.

  ``fixed`` is the sum over ``_fixed_leaves`` (``_fixed_scores``); to it are
  added, in path order, the other leaves: in round one (``rounds`` 0) those
  ``read`` (a traced bool per leaf; the others are not computed), from round
  two on all of them.
  """
  skip = set(_fixed_leaves(spec, f, flat_a))
  own = [p for p in _scored_leaves(spec, f) if p not in skip]
  needed = {p: read[p] | (rounds > 0) for p in own}
  b_moved = {p: flat_b[p] for p in own}
  at_sites = [p for p in own if p in _site_of(spec)]  # in path order
  if at_sites:  # the attention elements, applied only when a leaf of theirs is read
    b_moved.update(jax.lax.cond(
        functools.reduce(jnp.logical_or, [needed[p] for p in at_sites]),
        lambda: {p: v for p, v in _with_attention(spec, plan, flat_b, element, at_sites).items()
                 if p in at_sites},
        lambda: {p: flat_b[p] for p in at_sites}))
  n = spec.factors[f].size

  def add(total, path, axis):
    b = group_action.apply_leaf(spec, path, b_moved[path], element, skip_axis=axis)
    return _add_leaf_scores(total, flat_a[path], b, axis, n)

  total = fixed
  for path in own:
    for axis in (i for i, g in enumerate(spec.axes[path]) if g == f):
      total = jax.lax.cond(needed[path], functools.partial(add, path=path, axis=axis),
                           lambda total: total, total)
  return total


def _factor_update(kind: str, scores: Scores, old: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The best value of a factor of ``kind`` given its ``_factor_scores``, accepted only if it
  gains more than the tolerance: (value, whether it changed)."""
  m, norm_a, norm_b = scores
  scale = jnp.sqrt(norm_a * norm_b)  # ||A|| ||B||
  if kind == "permutation":
    new = _assignment.linear_assignment(-m).astype(old.dtype)
    gain = _assignment.assignment_cost(m, new) - _assignment.assignment_cost(m, old)
    differs = jnp.any(new != old)
  else:  # orthogonal Procrustes, on 1-perp for a mean-zero orthogonal factor
    solve = _stage2.polar if kind == "orthogonal" else _stage2.mean_zero_polar
    new = solve(m.T)
    gain = jnp.sum((new - old) * m.T)
    differs = True
  accept = gain > _tolerance(m.dtype) * scale
  return jnp.where(accept, new, old), accept & differs


def _factor_step(spec: spec_lib.SymmetrySpec, plan: list[_Step], step: _Step, flat_a, flat_b,
                 element, reads: dict[str, dict[str, jax.Array]], rounds: jax.Array,
                 on: dict[str, jax.Array], fixed: dict[str, Scores]
                 ) -> tuple[dict[str, Any], jax.Array]:
  """Solves every factor of ``step`` in scope (``on``) given the rest of ``element``;
  (element, changed).

  In round one a factor reads the leaves of ``reads``, from round two on all of
  them (``_first_round_reads``). The factors are solved one after another (a
  loop over the step's factors), so that one factor's n x n scores are held at
  a time: a step holds the FFNs of every layer. Each factor has its own leaves,
  so its scores are a branch of their own (``lax.switch``); the factors share
  their kind and size, so one solver, compiled once, solves them all.
  """
  kind = spec.factors[step.names[0]].kind

  def scores(f):
    return _factor_scores(spec, plan, f, flat_a, flat_b, element, reads[f], rounds, fixed[f])

  branches = [functools.partial(scores, f) for f in step.names]
  in_scope = jnp.stack([on[f] for f in step.names])

  def solve(i, state):
    values, changed = state
    old = values[i]
    value, moved = jax.lax.cond(in_scope[i],
                                lambda: _factor_update(kind, jax.lax.switch(i, branches), old),
                                lambda: (old, jnp.bool_(False)))
    return values.at[i].set(value), changed | moved

  values = jnp.stack([element[f] for f in step.names])
  values, changed = jax.lax.fori_loop(0, len(step.names), solve, (values, jnp.bool_(False)))
  return dict(element, **{f: values[i] for i, f in enumerate(step.names)}), changed


def _stack(trees: list[Any]) -> Any:
  return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def _site_grams(spec: spec_lib.SymmetrySpec, step: _Step, flat_a, flat_b, element
                ) -> tuple[_features.Grams, jax.Array]:
  """Grams [S, ...] of the S sites of ``step``, B with the factors applied, and the
  squared norms [S] of both layers (the scale of the acceptance tolerance)."""
  layers_a, layers_b = [], []
  act = lambda p: group_action.apply_leaf(spec, p, flat_b[p], element)
  for s in step.names:
    leaves = _site_leaves(spec, s)
    layers_a.append(spec_lib.unflatten({p[len(s) + 1:]: flat_a[p] for p in leaves}))
    layers_b.append(spec_lib.unflatten({p[len(s) + 1:]: act(p) for p in leaves}))
  layer_a, layer_b = _stack(layers_a), _stack(layers_b)
  squares = lambda t: sum(jnp.sum(x * x, axis=tuple(range(1, x.ndim))) for x in jax.tree.leaves(t))
  return jax.vmap(_features.layer_grams)(layer_a, layer_b), squares(layer_a) + squares(layer_b)


def _set_sites(step: _Step, element, stacked) -> dict[str, Any]:
  return dict(element, **{s: jax.tree.map(lambda x, i=i: x[i], stacked)
                          for i, s in enumerate(step.names)})


def _attention_step(spec: spec_lib.SymmetrySpec, step: _Step, flat_a, flat_b, element, learning_rate,
                    first: jax.Array, stage: jax.Array, in_scope: jax.Array, distance: jax.Array,
                    *, steps: int | jax.Array, init: str | jax.Array, solver: str
                    ) -> tuple[dict[str, Any], jax.Array, jax.Array]:
  """Matches every site of ``step`` (vmap over sites) with the method of index ``stage``
  (``_attention.STAGES``) given the factors; (element, changed, the most refinement
  iterations of a site: 0 unless "full").

  The method's solution is taken unconditionally when ``first`` (the sites'
  first solve), else only where it lowers the objective (module docstring), and
  only for the sites ``in_scope`` ([S] bool).
  """
  grams, scale = _site_grams(spec, step, flat_a, flat_b, element)
  site = spec.attention[step.names[0]]
  solve = lambda g, current: _attention.solve_layer(g, site, stage, distance, steps=steps,
                                                    learning_rate=learning_rate, init=init,
                                                    solver=solver, current=current)
  old = _stack([element[s] for s in step.names])
  new, info = jax.vmap(solve)(grams, old)
  objective = info["objective"]
  old_value = objective["current"]
  new_value = jnp.stack([objective[m] for m in _attention.STAGES])[stage]
  tolerance = _tolerance(scale.dtype) * scale
  accept = in_scope & (first | (new_value < old_value - tolerance))
  moved = jnp.any(new.perm != old.perm, axis=-1) | (jnp.abs(new_value - old_value) > tolerance)
  taken = jnp.max(jnp.where(in_scope, info["refinement_steps"], 0))
  return (_set_sites(step, element, _pick(accept, new, old)), jnp.any(accept & moved),
          taken)


def _pick(where: jax.Array, new, old):
  """Per site ([S] bool), ``new`` where True, else ``old`` (trees of [S, ...] leaves)."""
  return jax.tree.map(lambda x, y: jnp.where(where.reshape(-1, *[1] * (x.ndim - 1)), x, y),
                      new, old)


def _refine_step(spec: spec_lib.SymmetrySpec, step: _Step, flat_a, flat_b, element, learning_rate,
                 in_scope: jax.Array, *, steps: int | jax.Array, init: str | jax.Array,
                 solver: str) -> tuple[dict[str, Any], jax.Array]:
  """The "full" refinement of the sites of ``step`` ``in_scope`` ([S] bool) from their
  current matrices, their permutations and the factors kept (``refine="final"``);
  (element, most iterations)."""
  grams, _ = _site_grams(spec, step, flat_a, flat_b, element)
  site = spec.attention[step.names[0]]

  def refine(g, current):
    problems = _stage2.pair_problems(g, current.perm)
    (qk, vo), taken = _attention.refine_matrices(problems, (current.qk, current.vo), site,
                                                 steps=steps, learning_rate=learning_rate,
                                                 init=init, solver=solver)
    return current._replace(qk=qk, vo=vo), jnp.max(taken)

  old = _stack([element[s] for s in step.names])
  refined, taken = jax.vmap(refine)(grams, old)
  return (_set_sites(step, element, _pick(in_scope, refined, old)),
          jnp.max(jnp.where(in_scope, taken, 0)))


# ----------------------------------------------------------------------------- the loop


def _distance(spec: spec_lib.SymmetrySpec, plan: list[_Step], flat_a, flat_b, element) -> jax.Array:
  """||theta_A - element . theta_B||^2 over every leaf."""
  moved = _with_attention(spec, plan, flat_b, element, list(flat_b))
  act = lambda p: group_action.apply_leaf(spec, p, moved[p], element)
  return sum(jnp.sum((a - act(p)) ** 2) for p, a in flat_a.items())


def _align_core(flat_a, flat_b, learning_rate, stage, active, distance, steps, max_rounds, init,
                *, spec, refine, solver):
  """The descent of ``align_model`` for the method of index ``stage`` into ``_attention.STAGES``
  over the names where ``active`` ([factors + sites] bool, ``_active_names``) is True, with the
  Stage 1 distance of index ``distance`` into ``_features.DISTANCES``, at most ``steps``
  refinement iterations, ``max_rounds`` rounds and the refinement's start of index ``init``
  into ``_attention.INITS``. All of these are traced: every method, scope, distance, step
  count, round count and start share one compiled program (``refine`` and ``solver`` change
  what it computes)."""
  spec = spec.spec
  full = stage == _attention.STAGES.index("full")
  final = refine == "final"  # for "full" only: the descent runs "ortho", then one refinement
  descent = jnp.where(full, _attention.STAGES.index("ortho"), stage) if final else stage
  dtype = next(iter(flat_a.values())).dtype
  plan = _plan(spec, flat_a)
  on = dict(zip(_active_names(spec), active))
  reads, again = _first_round_reads(spec, plan, on)
  neighbours = _neighbours(spec, plan, active)
  fixed = _fixed_scores(spec, flat_a, flat_b, on)
  sites_on = [jnp.stack([on[s] for s in step.names]) if step.attention else None for step in plan]

  def run(i, element, rounds):
    step = plan[i]
    if step.attention:
      return _attention_step(spec, step, flat_a, flat_b, element, learning_rate, rounds == 0,
                             descent, sites_on[i], distance, steps=steps, init=init,
                             solver=solver)
    return (*_factor_step(spec, plan, step, flat_a, flat_b, element, reads, rounds, on, fixed),
            jnp.int32(0))

  def body(state):
    element, dirty, rounds, taken = state
    for i in range(len(plan)):
      element, changed, t = jax.lax.cond(dirty[i], lambda e, i=i: run(i, e, rounds),
                                         lambda e: (e, jnp.bool_(False), jnp.int32(0)), element)
      dirty = dirty.at[i].set(again[i] & (rounds == 0)) | (changed & neighbours[i])
      taken = jnp.maximum(taken, t)
    return element, dirty, rounds + 1, taken

  element = group_action.identity_model(spec, dtype)
  pending = jnp.stack([functools.reduce(jnp.logical_or, [on[n] for n in step.names])
                       for step in plan]) if plan else jnp.zeros(0, bool)
  state = (element, pending, jnp.int32(0), jnp.int32(0))
  cond = lambda s: jnp.any(s[1]) & (s[2] < max_rounds)
  element, _, rounds, taken = jax.lax.while_loop(cond, body, state)
  distances = {"initial": sum(jnp.sum((flat_a[p] - flat_b[p]) ** 2) for p in flat_a)}
  if final:
    distances["before_refinement"] = _distance(spec, plan, flat_a, flat_b, element)

    def refine_sites(element, taken):
      for step, in_scope in zip(plan, sites_on):
        if step.attention:
          element, t = _refine_step(spec, step, flat_a, flat_b, element, learning_rate, in_scope,
                                    steps=steps, init=init, solver=solver)
          taken = jnp.maximum(taken, t)
      return element, taken

    element, taken = jax.lax.cond(full, refine_sites, lambda *state: state, element, taken)
  distances["final"] = _distance(spec, plan, flat_a, flat_b, element)
  return element, {"distance": distances, "rounds": rounds, "refinement_steps": taken}


_STATIC = ("spec", "refine", "solver")
_align_jit = jax.jit(_align_core, static_argnames=_STATIC)


# ----------------------------------------------------------------------------- public API


def _check_model_pair(spec: spec_lib.SymmetrySpec, params_a: Params, params_b: Params) -> None:
  for name, params in (("params_a", params_a), ("params_b", params_b)):
    try:
      spec.check(params)
    except ValueError as e:
      raise ValueError(f"{name}: {e}") from None
  flat_a, flat_b = spec_lib.flatten(params_a), spec_lib.flatten(params_b)
  _attention.check_same_leaves(flat_a, flat_b)
  for s, site in spec.attention.items():
    _attention.check_site_fits(site, spec_lib.subtree(params_a, s), prefix=s + "/")
  _attention.check_finite(flat_a, "params_a")
  _attention.check_finite(flat_b, "params_b")


def _needs_folding(spec: spec_lib.SymmetrySpec, names: Sequence[str]) -> bool:
  """Whether a matrix factor among ``names`` meets norm scales, which are then folded, with
  the rest of their gauge (``group_action.canonical_form``), before the descent."""
  return any(spec.factors[f].is_matrix for f in spec.factors
             if f in names and any(f in spec.axes[p] for p in spec.norm_scales))


def residual_spec(spec: spec_lib.SymmetrySpec, residual: str,
                  names: Sequence[str] | None = None) -> spec_lib.SymmetrySpec:
  """The spec whose group the descent's element belongs to under option ``residual``.

  "permutation": ``spec`` itself. "orthogonal": every permutation factor among ``names``
  (None: all) that ``spec.streams`` describes (a pre-LayerNorm stream read through LayerNorms
  only) becomes "mean_zero_orthogonal" (``SymmetrySpec.with_residual``); a matrix factor
  (an RMSNorm stream) stays as it is.

  Raises:
    ValueError: "orthogonal" where no factor among ``names`` is or can become a matrix one
      (a tied head, a post-LayerNorm stream), saying why; an unknown ``residual``.
  """
  if residual not in _options.RESIDUALS:
    raise ValueError(f"residual must be one of {_options.RESIDUALS}, got {residual!r}")
  names = list(spec.factors) if names is None else names
  if residual == "permutation":
    return spec
  streams = [f for f in spec.streams if f in names and spec.factors[f].kind == "permutation"]
  if not streams and not any(spec.factors[f].is_matrix for f in spec.factors if f in names):
    raise ValueError("residual='orthogonal' needs a residual stream read through LayerNorms "
                     "only (a pre-LayerNorm model with an untied head) or an RMSNorm one in "
                     "scope; this spec has none (a tied head must be untied first)")
  for f in streams:
    spec = spec.with_residual(f, "mean_zero_orthogonal")
  return spec


def _weight_matching(spec, params_a, params_b, *, names, method, distance, steps, learning_rate,
                     max_rounds, init=_attention.INITS[0], refine=REFINES[0],
                     solver=_attention.SOLVERS[0], residual=_options.RESIDUALS[0]):
  params_a, params_b = _attention.upcast(params_a), _attention.upcast(params_b)
  spec = residual_spec(spec, residual, names)
  needs_folding = _needs_folding(spec, names)
  if needs_folding:
    params_a = group_action.canonical_form(spec, params_a)
    params_b = group_action.canonical_form(spec, params_b)
  flat_a, flat_b = spec_lib.flatten(params_a), spec_lib.flatten(params_b)
  dtype = next(iter(flat_a.values())).dtype
  if not set(names) & set(spec.attention):  # one program whatever options change nothing
    refine, solver = REFINES[0], _attention.SOLVERS[0]
  active = jnp.asarray([n in names for n in _active_names(spec)], bool)
  index = lambda value, values: jnp.int32(values.index(value))
  element, info = _align_jit(flat_a, flat_b, jnp.asarray(learning_rate, dtype),
                             index(method, _attention.STAGES), active,
                             index(distance, _features.DISTANCES), jnp.int32(steps),
                             jnp.int32(max_rounds), index(init, _attention.INITS),
                             spec=_static.StaticSpec(spec), refine=refine, solver=solver)
  if method != "full":  # what only "full" does (refines) and reports
    del info["refinement_steps"]
    info["distance"].pop("before_refinement", None)
  info["folded_norm_scales"] = needs_folding
  return element, info


def _identity(spec: spec_lib.SymmetrySpec, params_a: Params, params_b: Params, *,
              scope: str | Sequence[str] | None) -> tuple[dict[str, Any], dict[str, Any]]:
  """Method "naive": the identity element, in the matching dtype."""
  del params_b, scope
  dtype = _attention.compute_dtype(next(iter(spec_lib.flatten(params_a).values())).dtype)
  return group_action.identity_model(spec, dtype), {"folded_norm_scales": False}


def _descent(spec: spec_lib.SymmetrySpec, params_a: Params, params_b: Params, *,
             scope: str | Sequence[str] | None, method: str, **options
             ) -> tuple[dict[str, Any], dict[str, Any]]:
  """Methods "perm", "ortho" and "full" (``method``): Weight Matching of the factors in
  ``scope`` with the method's attention matching, one compiled program for the three
  (``options``: ``_options.PROGRAM``)."""
  return _weight_matching(spec, params_a, params_b, names=active_names(spec, scope),
                          method=method, **options)


_STAGE_DOCS = {"perm": "Stage 1 head permutations and Weight Matching",
               "ortho": "perm, then orthogonal Procrustes within each head",
               "full": "ortho, then the refinement within each head (the default)"}
_methods.register_built_in("naive", _identity, doc="the identity: plain averaging",
                           streamed=_methods.WEIGHTS)
for _stage in _attention.STAGES:
  _methods.register_built_in(_stage, functools.partial(_descent, method=_stage),
                             doc=_STAGE_DOCS[_stage], streamed=_methods.WEIGHTS)


def align_model(spec: spec_lib.SymmetrySpec, params_a: Params, params_b: Params, *,
                scope: str | Sequence[str] | None = None, method: str = "full",
                **arguments) -> tuple[dict[str, Any], dict[str, Any]]:
  """Aligns model B to model A: every factor and attention site of ``spec`` in scope.

  Every method, built-in or registered, is a ``Method`` of ``matching.METHODS``: this
  checks the options, the arguments, the model pair and the scope, then calls the
  method's ``align`` with the options it takes and the arguments it reads.

  Args:
    spec: the models' symmetry spec.
    params_a, params_b: parameters that fit ``spec``, with equal shapes and
      dtypes; bfloat16 and float16 parameters are aligned in float32.
    scope: parameter path prefixes (``model.scope_paths(name)``), or one
      prefix as a string; a factor or site is aligned only if every leaf it
      acts on lies under one of them, the rest stays identity. None or [""]:
      the whole model.
    method: "naive" (identity everywhere), or the attention method ("perm",
      "ortho", "full"; ``match_attention``) used next to Weight Matching of
      the factors, or "learned": "full" (with the default ``steps`` and
      ``learning_rate``), then its attention matrices in scope trained on
      ``loss_fn`` of the interpolated model (``learn_alignment``, where
      ``steps`` and ``learning_rate`` are those of the training; ``factors``
      chooses what is trained), or "activation": every factor and site decided
      from the two models' ``activations`` on ``match_batches`` (``_activation``;
      ``steps``: the most Gauss-Newton iterations of its QK problems), or a
      method of ``register_method``: its ``align`` is called with ``scope``,
      the options it names (``matching.METHODS[method].options``) and the
      arguments it declares.
    **matching options: one keyword argument per field of ``MatchOptions``, which holds
      each one's default, doc and range (this signature is generated from it):
    distance, steps, learning_rate, init, solver: attention matching options
      (``match_attention``).
    max_rounds: most rounds of coordinate descent.
    residual: for every method but "naive": the residual factor of a stream read through
      LayerNorms only, "permutation" (default) or "orthogonal" (``residual_spec``; solved by
      Procrustes on 1-perp from the weights or, for "activation", from the stream's
      activations; "learned" trains it by a Cayley map on 1-perp).
    refine: when "full" refines the attention matrices: "every_round"
      (default: at every attention step of the descent) or "final" (the
      descent with "ortho", then one refinement; module docstring). Other
      methods ignore it.
    factors: for "learned" (or a registered method that reads it): which
      factors are trained, some of "attention" (the QK and VO matrices),
      "heads" (head permutations), "ffn" (FFN unit permutations), "residual"
      (the residual stream's factor); None (default) every one that the
      scope has. A factor the scope has no symmetry for is a ValueError.
    learn_init, learn_lam_band: for "learned": its start ("full" or "activation") and the
      half-width, in hundredths, of the band around ``lam`` that lambda is drawn from at
      every step (0: lambda fixed).
    **arguments: the arguments a method reads beyond the options (``Method.arguments``);
      one given (not None) to a method that does not read it is a ValueError. Those of the
      built-in methods:
    loss_fn, batches, holdout_batches, lam, key, eval_every, progress: for "learned"
      (``learn_alignment``).
    model, model_inputs, repair_no_bias: for "learned" with ``learn_repair`` (the input
      ``matching.REPAIR``): the ``models.Model`` of the parameters, what it reads of a
      training batch (None: the batch itself) and REPAIR's rule (None: "std").
    activations, match_batches: for "activation", and "learned" from it:
      ``activations(params, batch) -> {key: array}`` keyed by the spec's names
      (``matching.ACTIVATION_KEYS``; ``Model.activations``), pure and jittable, and the
      non-empty list of batches it reads (one at a time).

  Returns:
    (element, info): a model element for ``group_action.apply_model(spec,
    params, element)``, where params is ``params_b``, or, when an aligned
    orthogonal factor meets norm scales, ``group_action.canonical_form(spec,
    params_b)`` (the norm scales folded; info["folded_norm_scales"] says which). With
    ``residual="orthogonal"`` the spec is ``residual_spec(spec, "orthogonal", names)``
    (a pre-LayerNorm stream's factor is then a matrix with Q 1 = 1). Its matrices are
    float32 for bfloat16 and float16 parameters (``apply_model`` keeps the
    parameters' dtype), in the parameters' dtype otherwise.
    info["distance"] {"initial", "final"} the squared parameter distance to
    (folded) A before and after, computed in that dtype, and for
    ``refine="final"`` "before_refinement", the distance at the end of the
    descent; info["rounds"] the rounds run; for "full",
    info["refinement_steps"] the most iterations one refinement took; for
    "learned", info["learned"]
    (``learn_alignment``); for "activation", info["batches"], info["samples"] and
    info["refinement_steps"] (``_activation.align``).

  Raises:
    ValueError: before any computation, naming the leaf, option or argument, if the
      parameters do not fit the spec or each other, hold NaN or Inf, a scope prefix
      matches nothing, or an option or argument is unknown or not the method's
      (``_methods.check``); for "activation", naming the key, when the activations lack
      what a name in scope needs or are not finite.
  """
  options = _options.MatchOptions(**{k: arguments.pop(k) for k in _options.NAMES
                                      if k in arguments})
  chosen = _methods.check(method, options, arguments)
  _check_model_pair(spec, params_a, params_b)
  active_names(spec, scope)  # a scope prefix that names no leaf is an error
  return chosen.call(spec, params_a, params_b, scope=scope, options=options,
                     arguments=arguments)


align_model.__signature__ = _options.signature(align_model)


def match_ffn(spec: spec_lib.SymmetrySpec, params_a: Params, params_b: Params, *,
              scope: str | Sequence[str] | None = None,
              max_rounds: int = DEFAULT_MAX_ROUNDS) -> tuple[dict[str, Any], dict[str, Any]]:
  """Weight Matching (Ainsworth et al. 2023) of the permutation and orthogonal factors of ``spec``.

  Coordinate descent over the factors in scope (FFN hidden units, the residual
  stream), each step a linear assignment (or orthogonal Procrustes) on every
  weight the factor acts on; attention sites stay identity. Arguments and
  returns (half precision included) as ``align_model``.
  """
  _check_model_pair(spec, params_a, params_b)
  names = active_names(spec, scope, attention=False)
  return _weight_matching(spec, params_a, params_b, names=names, method="full",
                          distance="frobenius", steps=0, learning_rate=0.0, max_rounds=max_rounds)
