"""Two-stage weight matching of attention layers (docs/matching.md).

Given two canonical attention layers (``attention.LEAVES``; docs/symmetries.md,
'The canonical attention layer'), or layer stacks with a leading [L] axis, and
their ``spec.AttentionSite``, find g = (perm, A_k, B_k) with g . theta_B close
to theta_A:

1. Stage 1 assigns B's heads to A's by a linear assignment problem on the
   invariant-feature distances of ``_features`` (under GQA, kv groups first,
   then heads within groups);
2. Stage 2 solves, for every matched kv group, the QK matrix in GL(H) (H(H)
   with RoPE) and the VO matrix in GL(H) (``_stage2``).

Methods (the paper's Table 1): "naive" (identity), "perm" (Variant 1: Stage 1
only), "ortho" (Variant 2: Stage 1 and the orthogonal Procrustes solution),
"full" (Stage 1, then a refinement by ``solver`` from a start chosen by
``init``: the Procrustes solution, as the paper does, for "procrustes" (the
default); the best of it and the two one-sided least-squares solutions for
"best", which is exact on noise-free planted problems). The refinement is
Gauss-Newton (the default, "gauss_newton": a handful of iterations, stopped
on a tolerance) or the paper's plain gradient descent ("adam": ``steps``
Adam steps at ``learning_rate``); ``_stage2`` has both. The objective reported for every stage
is the squared parameter distance over the query, key, value and output
weights and biases, sum_leaf ||theta_A - g . theta_B||^2 (the output bias is
left out: no head symmetry moves it), computed from the H x H Grams.

Half precision: bfloat16 and float16 parameters are cast to float32 before
any computation (``compute_dtype``), so the returned elements and objectives
are float32 for them; float32 and float64 parameters are matched in their own
dtype.

Everything after input validation runs in one ``jax.jit`` per shape, dtype and
option set: Grams by einsum, ``vmap`` over layers, heads and permutations,
``jax.lax`` loops.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from attn_symmetry import attention
from attn_symmetry import group_action
from attn_symmetry import spec as spec_lib
from attn_symmetry.matching import _assignment
from attn_symmetry.matching import _features
from attn_symmetry.matching import _stage2

# "learned" (``_learned``) fits "full"'s element to a task loss and "activation"
# (``_activation``) matches the models' activations: ``align_model`` only.
# The whole-model methods are ``_methods.METHODS``, each registered beside its code.
METHODS = ("naive", "perm", "ortho", "full", "learned", "activation")
# The methods that are stages of one computation (each starts from the one before it):
# ``stage2`` and ``solve_layer`` take one of them by name, or by a traced index into this.
STAGES = ("perm", "ortho", "full")
INITS = ("procrustes", "best")  # starts of the "full" refinement (module docstring)
SOLVERS = _stage2.SOLVERS  # its solvers: Gauss-Newton (the default) or Adam
DEFAULT_STEPS = 200
DEFAULT_LEARNING_RATE = 1e-2
MAX_EXHAUSTIVE_HEADS = 8

Params = dict[str, Any]


# ----------------------------------------------------------------------------- validation


def check_options(method: str, distance: str, steps: int, init: str = INITS[0],
                  methods=METHODS, solver: str = SOLVERS[0]) -> None:
  """ValueError naming the option that is not one of its values (``methods``: the known names)."""
  if method not in methods:
    raise ValueError(f"method must be one of {tuple(methods)}, got {method!r}")
  if init not in INITS:
    raise ValueError(f"init must be one of {INITS}, got {init!r}")
  if solver not in SOLVERS:
    raise ValueError(f"solver must be one of {SOLVERS}, got {solver!r}")
  if distance not in _features.DISTANCES:
    raise ValueError(f"distance must be one of {_features.DISTANCES}, got {distance!r}")
  if not isinstance(steps, (int, np.integer)) or steps < 0:
    raise ValueError(f"steps must be a non-negative integer, got {steps!r}")


def check_finite(flat: dict[str, Any], name: str) -> None:
  """ValueError naming the first leaf with NaN or Inf entries (concrete leaves only)."""
  for path, leaf in flat.items():
    if not isinstance(leaf, jax.core.Tracer) and not np.isfinite(np.asarray(leaf)).all():
      raise ValueError(f"{name}: {path} has NaN or Inf entries")


def check_same_leaves(flat_a: dict[str, Any], flat_b: dict[str, Any]) -> None:
  """ValueError naming the leaf when two flattened trees differ in paths, shapes or dtypes."""
  only_a, only_b = sorted(set(flat_a) - set(flat_b)), sorted(set(flat_b) - set(flat_a))
  if only_a or only_b:
    raise ValueError(f"params_a and params_b differ: leaves only in params_a {only_a}, "
                     f"only in params_b {only_b}")
  for path, a in flat_a.items():
    b = flat_b[path]
    if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
      raise ValueError(f"{path}: params_a has {a.dtype}{list(a.shape)} but params_b has "
                       f"{b.dtype}{list(b.shape)}")
    if not jnp.issubdtype(a.dtype, jnp.floating):
      raise ValueError(f"{path}: parameters must be floating point, got {a.dtype}")


def compute_dtype(dtype: Any) -> np.dtype:
  """The dtype matching computes in: float32 for bfloat16 and float16, else ``dtype``."""
  return jnp.promote_types(dtype, jnp.float32)


def upcast(tree: Any) -> Any:
  """Floating leaves cast to their ``compute_dtype`` (a no-op for float32 and float64)."""
  def cast(x):
    dtype = compute_dtype(x.dtype)
    return x if x.dtype == dtype else x.astype(dtype)
  return jax.tree.map(cast, tree)


def check_site_fits(site: spec_lib.AttentionSite, params: Params, prefix: str = "") -> None:
  """ValueError naming the leaves when a canonical layer (stack) is not shaped as ``site`` says."""
  _, _, n, k, h = attention.layer_shapes(params, prefix)
  if (n, k, h) != (site.num_heads, site.kv_heads, site.head_dim):
    raise ValueError(f"{prefix}query/kernel and {prefix}key/kernel have N={n}, K={k}, H={h}, but "
                     f"the site has N={site.num_heads}, K={site.kv_heads}, H={site.head_dim}")


def _check_pair(params_a: Params, params_b: Params, site: spec_lib.AttentionSite) -> None:
  check_site_fits(site, params_a)
  flat_a, flat_b = spec_lib.flatten(params_a), spec_lib.flatten(params_b)
  check_same_leaves(flat_a, flat_b)
  check_finite(flat_a, "params_a")
  check_finite(flat_b, "params_b")


# ----------------------------------------------------------------------------- the solver


def _values(matrices: list[tuple[jax.Array, jax.Array]],
            problems: list[tuple[_stage2.Problem, _stage2.Problem]]) -> jax.Array:
  """Objective [S] of S (qk, vo) matrix pairs [K, H, H] on their problems, summed over kv groups.

  One batched evaluation for all of them (a single copy of the objective in
  the compiled program).
  """
  qk, vo = (jnp.stack([m[i] for m in matrices]) for i in (0, 1))
  qk_p, vo_p = (jax.tree.map(lambda *x: jnp.stack(x), *[p[i] for p in problems]) for i in (0, 1))
  value = jax.vmap(jax.vmap(lambda m, p: _stage2.objective(m, p)[0]))
  concat = lambda x, y: jnp.concatenate([x, y])
  both = value(concat(qk, vo), jax.tree.map(concat, qk_p, vo_p))
  return (both[: len(matrices)] + both[len(matrices):]).sum(-1)


def element_objective(g: _features.Grams, element: group_action.AttentionElement) -> jax.Array:
  """sum_leaf ||theta_A - element . theta_B||^2 of one layer from its Grams (no leading axes)."""
  return _values([(element.qk, element.vo)], [_stage2.pair_problems(g, element.perm)])[0]


def solve_layer(g: _features.Grams, site: spec_lib.AttentionSite, method: str | jax.Array,
                distance: str | jax.Array, *, steps: int, learning_rate: jax.Array, init: str = INITS[0],
                solver: str = SOLVERS[0], current: group_action.AttentionElement | None = None
                ) -> tuple[group_action.AttentionElement, dict[str, Any]]:
  """Both stages for one layer from its Grams (no leading axes).

  ``method`` is a name of ``METHODS`` but "learned", or a traced index into
  ``STAGES`` (``stage2``); ``distance`` a name of ``_features.DISTANCES`` or a
  traced index into it.

  Returns:
    (element, info) with info["objective"][stage] for "naive" and every stage
    up to ``method`` (every stage of ``STAGES`` for an index; "full" is then
    "ortho" unless the index selects it), info["assignment_cost"] (not for
    "naive"), info["refinement_steps"] (for "full" or an index: the most
    iterations any of the layer's problems took, 0 unless refined), and
    info["objective"]["current"] for the element ``current`` when given
    (evaluated in the same batch).
  """
  identity = jnp.arange(site.num_heads, dtype=jnp.int32)
  eye = jnp.broadcast_to(jnp.eye(site.head_dim, dtype=g.q.dtype),
                         (site.kv_heads, site.head_dim, site.head_dim))
  naive = _stage2.pair_problems(g, identity)
  if isinstance(method, str) and method == "naive":
    element = group_action.AttentionElement(identity, eye, eye)
    return element, {"objective": {"naive": _values([(eye, eye)], [naive])[0]}}
  cost = _features.head_cost(g, site, distance)
  perm = _assignment.assign_heads(cost, site.kv_heads)
  element, stages, taken = stage2(g, perm, site, method, steps=steps,
                                  learning_rate=learning_rate, init=init, solver=solver)
  problems = _stage2.pair_problems(g, perm)
  names, matrices = ["naive", *stages], [(eye, eye), *stages.values()]
  batch = [naive, *[problems] * len(stages)]
  if current is not None:
    names.append("current")
    matrices.append((current.qk, current.vo))
    batch.append(_stage2.pair_problems(g, current.perm))
  info = {"objective": dict(zip(names, _values(matrices, batch))),
          "assignment_cost": _assignment.assignment_cost(cost, perm)}
  if taken is not None:
    info["refinement_steps"] = jnp.max(taken)
  return element, info


def stage2(g: _features.Grams, perm: jax.Array, site: spec_lib.AttentionSite,
           method: str | jax.Array, *, steps: int, learning_rate: jax.Array,
           init: str = INITS[0], solver: str = SOLVERS[0]
           ) -> tuple[group_action.AttentionElement, dict[str, tuple[jax.Array, jax.Array]],
                      jax.Array | None]:
  """Stage 2 after the head assignment ``perm`` [N] of one layer.

  ``method`` names a stage of ``STAGES``, or is a traced int32 index into it:
  then one program serves all three methods (``align_model`` compiles once for
  them). Every stage's matrices are computed, the refinement under a
  ``lax.cond`` that runs it only when the index selects "full" (else "full"'s
  matrices are "ortho"'s and its iterations 0).

  Returns:
    (element, stages, taken): the element of ``method``; for every stage up
    to it ("perm", "ortho", "full"; all three for an index), its (qk, vo)
    matrices [K, H, H]; for "full" or an index the refinement's iterations
    [2K] of each problem (QK, then VO), else None.
  """
  problems = _stage2.pair_problems(g, perm)
  rope = site if site.group == "rope" else None
  eye = jnp.broadcast_to(jnp.eye(site.head_dim, dtype=g.q.dtype), problems[0].s1.shape)
  stages, taken = {"perm": (eye, eye)}, None
  if not isinstance(method, str) or method in ("ortho", "full"):
    stages["ortho"] = _stage2.procrustes(problems[0].c1 + problems[0].c2,
                                         problems[1].c1 + problems[1].c2, rope)
  refine = lambda: refine_matrices(problems, stages["ortho"], site, steps=steps,
                                   learning_rate=learning_rate, init=init, solver=solver)
  if isinstance(method, str):
    if method == "full":
      stages["full"], taken = refine()
    return group_action.AttentionElement(perm.astype(jnp.int32), *stages[method]), stages, taken
  untouched = jnp.zeros(2 * problems[0].s1.shape[0], jnp.int32)  # refine's taken: [2K] int32
  stages["full"], taken = jax.lax.cond(
      method == STAGES.index("full"), refine, lambda: (stages["ortho"], untouched))
  chosen = jax.tree.map(lambda *m: jax.lax.select_n(method, *m), *stages.values())
  return group_action.AttentionElement(perm.astype(jnp.int32), *chosen), stages, taken


def refine_matrices(problems: tuple[_stage2.Problem, _stage2.Problem],
                    start: tuple[jax.Array, jax.Array], site: spec_lib.AttentionSite, *,
                    steps: int | jax.Array, learning_rate: jax.Array, init: str | jax.Array,
                    solver: str = SOLVERS[0]) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
  """The "full" refinement of one layer's QK and VO matrices [K, H, H].

  Args:
    problems: the layer's QK and VO problems [K] (``_stage2.pair_problems``).
    start: (qk, vo) matrices [K, H, H] to start from (the Procrustes solution).
    site: the layer's attention site (the QK side stays in H(H) under RoPE).
    steps: the most Gauss-Newton iterations, or the Adam steps (an int, or traced).
    learning_rate: Adam's learning rate (unused by Gauss-Newton).
    init: "procrustes" starts from ``start``, "best" from the best of it and
      the two one-sided least-squares solutions; or a traced int32 index into
      ``INITS`` (one program for both: the choice is a ``lax.cond``, which
      stays one under ``vmap``, as the index is the same for every problem).
    solver: "gauss_newton" or "adam" (``_stage2``).

  Returns:
    ((qk, vo), taken): the matrices, each no worse on its problem than its
    start, and the iterations [2K] each problem took (``steps`` for Adam).
    QK and VO run as one batch of 2K problems, after the LAPACK calls that
    made ``start``.
  """
  rope = site if site.group == "rope" else None
  k = site.kv_heads
  both = jax.tree.map(lambda x, y: jnp.concatenate([x, y]), *problems)
  both = _stage2.sequenced(both, start)
  constrained = jnp.arange(2 * k) < k  # the QK half lies in H(H) under RoPE

  def solve(p, m, c):
    m = _start(init, lambda: _stage2.best_start(p, m, c, rope), m)
    if solver == "adam":
      return (_stage2.adam(m, p, c, rope, steps=steps, learning_rate=learning_rate),
              jnp.asarray(steps, jnp.int32))
    return _stage2.gauss_newton(m, p, c, rope, steps=steps)

  solved, taken = jax.vmap(solve)(both, jnp.concatenate(start), constrained)
  return (solved[:k], solved[k:]), taken


def _start(init: str | jax.Array, best, procrustes: jax.Array) -> jax.Array:
  """The refinement's start under ``init`` (a name of ``INITS`` or a traced index into it):
  ``best()`` for "best", else ``procrustes``."""
  if isinstance(init, str):
    return best() if init == "best" else procrustes
  return jax.lax.cond(init == INITS.index("best"), best, lambda: procrustes)


def _flatten_lead(params: Params, lead: tuple[int, ...]) -> Params:
  return jax.tree.map(lambda x: x.reshape(-1, *x.shape[len(lead):]), params)


def _restore_lead(tree: Any, lead: tuple[int, ...]) -> Any:
  return jax.tree.map(lambda x: x.reshape(*lead, *x.shape[1:]), tree)


def _grams(params_a: Params, params_b: Params) -> tuple[_features.Grams, tuple[int, ...]]:
  """Grams of every layer, leading axes flattened to one: ([L, ...], lead shape)."""
  lead = params_a["query"]["kernel"].shape[:-3]
  grams = jax.vmap(_features.layer_grams)(_flatten_lead(params_a, lead),
                                          _flatten_lead(params_b, lead))
  return grams, lead


def _match_core(params_a, params_b, learning_rate, *, site, method, distance, steps, init, solver):
  grams, lead = _grams(params_a, params_b)
  solve = lambda g: solve_layer(g, site, method, distance, steps=steps, learning_rate=learning_rate,
                                init=init, solver=solver)
  return _restore_lead(jax.vmap(solve)(grams), lead)


def _exhaustive_core(params_a, params_b, learning_rate, *, site, method, distance, steps, init,
                     solver):
  grams, lead = _grams(params_a, params_b)
  perms = jnp.asarray(_assignment.head_permutations(site.num_heads, site.kv_heads))

  def per_layer(g):
    def per_perm(perm):
      element, _, _ = stage2(g, perm, site, method, steps=steps, learning_rate=learning_rate,
                             init=init, solver=solver)
      return element, element_objective(g, element)
    elements, values = jax.vmap(per_perm)(perms)
    chosen = _assignment.assign_heads(_features.head_cost(g, site, distance), site.kv_heads)
    return elements, values, jnp.argmax(jnp.all(perms == chosen, axis=-1))

  elements, values, index = _restore_lead(jax.vmap(per_layer)(grams), lead)
  to_front = lambda x: jnp.moveaxis(x, len(lead), 0)
  return jax.tree.map(to_front, elements), {"objective": to_front(values), "perms": perms,
                                            "stage1_index": index}


_STATIC = ("site", "method", "distance", "steps", "init", "solver")
_match_jit = jax.jit(_match_core, static_argnames=_STATIC)
_exhaustive_jit = jax.jit(_exhaustive_core, static_argnames=_STATIC)


def _prepare(params_a, params_b, site, *, method, distance, steps, learning_rate, init, solver):
  """Checks everything, then ((A, B, learning rate) in the compute dtype, static jit options)."""
  spec_lib.check_site(site)
  check_options(method, distance, steps, init, solver=solver)
  if method == "learned":
    raise ValueError("method 'learned' trains the element on a task loss, which one layer does "
                     "not have: use matching.align_model(spec, params_a, params_b, "
                     "method='learned', loss_fn=..., batches=..., holdout_batches=...)")
  _check_pair(params_a, params_b, site)
  dtype = compute_dtype(params_a["query"]["kernel"].dtype)
  args = (upcast(canonical_layer(params_a)), upcast(canonical_layer(params_b)),
          jnp.asarray(learning_rate, dtype))
  # init and solver only change "full": one program for the other methods whatever they are.
  full = method == "full"
  static = dict(site=site, method=method, distance=distance, steps=int(steps),
                init=init if full else INITS[0], solver=solver if full else SOLVERS[0])
  return args, static


def canonical_layer(params: Params) -> Params:
  """The leaves that matching reads, with zero biases where absent (one trace with or without)."""
  out = {"out": {"kernel": params["out"]["kernel"]}}
  for name in ("query", "key", "value"):
    out[name] = {"kernel": params[name]["kernel"], "bias": attention.bias_or_zeros(params, name)}
  return out


def match_attention(params_a: Params, params_b: Params, site: spec_lib.AttentionSite, *,
                    method: str = "full", distance: str = "frobenius",
                    steps: int = DEFAULT_STEPS, learning_rate: float = DEFAULT_LEARNING_RATE,
                    init: str = INITS[0], solver: str = SOLVERS[0]
                    ) -> tuple[group_action.AttentionElement, dict[str, Any]]:
  """Aligns attention layer B to layer A (module docstring).

  Args:
    params_a, params_b: canonical attention parameters of the same shapes and
      floating dtype (``attention.py``; biases optional), one layer ([D, N, H]
      query kernel) or a stack with leading axes ([L, D, N, H]). bfloat16 and
      float16 parameters are matched in float32.
    site: the layers' ``spec.AttentionSite``: heads, head dim and kv heads
      (checked against the parameters) and group, "gl" (no or absolute
      position encoding) or "rope" (the QK matrix is restricted to H(H) of
      the site's RoPE layout, and Stage 1 compares per-frequency-pair
      circuits).
    method: "naive", "perm", "ortho" or "full".
    distance: Stage 1 distance, "frobenius" (default), "squared",
      "normalised" or "cosine", of the QK and VO circuits (summed).
    steps: the "full" refinement's most Gauss-Newton iterations (it stops
      earlier on its tolerance), or its Adam steps.
    learning_rate: Adam's learning rate (solver "adam" only).
    init: start of the "full" refinement: "procrustes" (default, the paper's)
      or "best" (the best of it and the least-squares starts).
    solver: the "full" refinement: "gauss_newton" (default) or "adam" (the
      paper's gradient descent).

  Returns:
    (element, info): an ``AttentionElement`` with the layers' leading shape
    such that ``group_action.apply(params_b, element)`` is close to
    ``params_a``; its matrices and the objectives are float32 for bfloat16
    and float16 parameters and in the parameters' dtype otherwise.
    info["objective"][stage] [...] the squared parameter distance after each
    stage run ("naive", then up to ``method``), info["assignment_cost"] [...]
    the optimal Stage 1 cost (not for "naive"), info["refinement_steps"]
    [...] (for "full") the most iterations the refinement took in a layer.

  Raises:
    TypeError: ``site`` is not an ``AttentionSite``.
    ValueError: before any computation, naming the leaf or option, if the
      layers differ in leaves, shapes or dtypes, are not canonical, have kv
      heads that do not divide the query heads, are not shaped as ``site``
      says, or hold NaN or Inf.
  """
  args, static = _prepare(params_a, params_b, site, method=method, distance=distance, steps=steps,
                          learning_rate=learning_rate, init=init, solver=solver)
  return _match_jit(*args, **static)


def match_attention_exhaustive(params_a: Params, params_b: Params,
                               site: spec_lib.AttentionSite, *, method: str = "full",
                               distance: str = "frobenius", steps: int = DEFAULT_STEPS,
                               learning_rate: float = DEFAULT_LEARNING_RATE, init: str = INITS[0],
                               solver: str = SOLVERS[0]
                               ) -> tuple[group_action.AttentionElement, dict[str, Any]]:
  """Stage 2 after every head permutation, for the paper's Stage 1 ablation.

  Enumerates the P head permutations that map kv groups onto kv groups (N!
  for multi-head attention; at most ``MAX_EXHAUSTIVE_HEADS`` heads) and runs
  Stage 2 of ``method`` ("perm", "ortho" or "full") after each. Arguments
  (half precision included) as ``match_attention``.

  Returns:
    (elements, info): elements with batch shape [P, ...] (permutation first,
    then the layers' leading shape; float32 matrices for bfloat16 and float16
    parameters); info["objective"] [P, ...] the squared parameter distance of
    each, info["perms"] [P, N] the permutations
    (``_assignment.head_permutations`` order), info["stage1_index"] [...]
    the row of the permutation that Stage 1 picks with ``distance``.
  """
  args, static = _prepare(params_a, params_b, site, method=method, distance=distance, steps=steps,
                          learning_rate=learning_rate, init=init, solver=solver)
  if method == "naive":
    raise ValueError("exhaustive matching needs a Stage 2 method: 'perm', 'ortho' or 'full'")
  if static["site"].num_heads > MAX_EXHAUSTIVE_HEADS:
    raise ValueError(f"exhaustive matching enumerates N! permutations; N = "
                     f"{static['site'].num_heads} > {MAX_EXHAUSTIVE_HEADS}")
  return _exhaustive_jit(*args, **static)
