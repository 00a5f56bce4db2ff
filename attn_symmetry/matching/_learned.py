"""Learned alignment: the attention matrices fitted to the loss of the interpolated model.

The full method minimises a distance between weights, which cannot tell the
part of theta_A - g . theta_B that a symmetry explains from the part it
cannot; the task loss can. Starting from an element g0 (the full method's:
head permutations of Stage 1, Weight Matching of the FFN and residual
factors, Stage 2 matrices A0_k, B0_k), the permutations and factors stay
fixed and the per-kv-head matrices of every attention site trained become

    A_k = A0_k (I + D^QK_k),    B_k = B0_k (I + D^VO_k),

with D trained by Adam (optax) from zero on the task loss of the interpolated
model,

    L(D; lambda, batch) = loss_fn((1 - lambda) theta_A + lambda (g . theta_B), batch),

lambda fixed (1/2 by default) or drawn from U(0, 1) at every step. As
A0 (I + D) is the composition of g0 with g_D = (identity, I + D^QK,
I + D^VO), g . theta_B = g_D . (g0 . theta_B): g0 . theta_B is computed
once, and each step applies g_D to its trained sites with
``group_action.apply``, through which the gradient reaches D. The correction
is relative, so that Adam's steps (about ``learning_rate`` per entry) change
every matrix by a similar fraction whatever its scale.

Under RoPE, D^QK is ``group_action.rope_commutant`` of trained (a_p, b_p), one
complex number per frequency pair (and a free block on the unrotated dims of
a partial rotary). The span of H(H) holds I and is closed under products, so
A0 (I + D^QK) lies in H(H) exactly whatever D is.

Guards. A step is skipped, the parameters and Adam state kept, when the loss
or its gradient is not finite, or when a proposed matrix M = M0 (I + D) has a
condition bound ||M||_F ||M^{-1}||_F above Stage 2's ``max_condition``; a
non-finite loss also returns the iterate to the one before it. The step size
then halves, and it doubles back (up to ``learning_rate``) with every step
taken.

Selection. At the start, every ``eval_every`` steps and at the end, the
interpolated loss is evaluated on ``holdout_batches``, a slice of the training
split that the steps never see, at lambda itself (for uniform lambda at 1/4,
1/2 and 3/4), averaged over the batches; at lambda = 0 and 1 once, at the start:
theta_A does not move, and g_D acts on the function of g0 . theta_B as the
identity (it is an element of the symmetry group), so the endpoints' losses
are the same for every iterate (up to rounding; the path evaluation of the
study computes them anew). The held-out
barrier is the largest gap between that loss and the chord
(1 - lambda) L(0) + lambda L(1), or 0 if the path lies below it. The iterate
with the lowest held-out barrier is returned; a later one replaces an earlier
one only if it is lower by more than sqrt(eps) times the endpoint loss
(rounding alone never moves the element).

Why the barrier and not the loss itself: the interpolated loss can fall
below the endpoints' (the midpoint of two models is a third model, which the
training batches can improve), and past the point where the path is flat that
is fine-tuning, not alignment. On a planted pair (g0 . theta_B = theta_A) the
held-out barrier of g0 is already 0, so g0 is returned exactly, although the
steps move away from it (the loss is invariant along the orbit of theta_A, so
D = 0 is a stationary point of L, but not a minimum unless theta_A minimises
the loss). The test split is never an argument.

Parameters in half precision are cast to float32 for all of it (the element
comes back in float32, as the full method's does); the loss is evaluated on
those float32 parameters. One compiled step and one compiled evaluation per
model, loss function and batch shape, reused across calls: the cache is keyed
by the loss function object, so pass the same function for every pair (not a
new lambda or ``functools.partial`` per call).

This module imports jax, numpy and optax only (and the standard library's
logging, for progress).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from attn_symmetry import group_action
from attn_symmetry import spec as spec_lib
from attn_symmetry.matching import _attention
from attn_symmetry.matching import _features
from attn_symmetry.matching import _stage2

UNIFORM = "uniform"  # ``lam`` value: lambda ~ U(0, 1) at every step
UNIFORM_HOLDOUT_LAMBDAS = (0.25, 0.5, 0.75)
EVALUATIONS = 10  # held-out evaluations per run when ``eval_every`` is not given
OPTIONS = {"lam": 0.5, "key": None, "eval_every": None, "progress": None}  # and their defaults

Params = dict[str, Any]
LossFn = Callable[[Params, Any], jax.Array]
log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- validation


def check_options(*, loss_fn: Any, batches: Any, holdout_batches: Any, steps: Any,
                  learning_rate: Any, lam: Any, key: Any, eval_every: Any, progress: Any) -> None:
  """ValueError naming the argument that cannot work (before any computation)."""
  if not callable(loss_fn):
    raise ValueError("method 'learned' needs loss_fn(params, batch) -> scalar, a pure JAX loss; "
                     f"got {loss_fn!r}")
  if not isinstance(steps, (int, np.integer)) or isinstance(steps, bool) or steps < 0:
    raise ValueError(f"steps must be a non-negative integer, got {steps!r}")
  if (batches is None or not isinstance(batches, Iterable)
      or isinstance(batches, Sequence) and not batches and steps):
    raise ValueError("method 'learned' needs batches, an iterable of training batches; got "
                     f"{batches!r}")
  if not isinstance(holdout_batches, Sequence) or not holdout_batches:
    raise ValueError("method 'learned' needs holdout_batches, a non-empty list of batches held out "
                     f"of the training split (never the test split); got {holdout_batches!r}")
  if not (isinstance(learning_rate, (int, float, np.floating)) and learning_rate > 0
          and math.isfinite(learning_rate)):
    raise ValueError(f"learning_rate must be a finite number > 0, got {learning_rate!r}")
  if lam == UNIFORM:
    if key is None:
      raise ValueError("lam='uniform' draws lambda at random: pass key, a jax.random key")
  elif not (isinstance(lam, (int, float, np.floating)) and 0 < lam <= 1):
    raise ValueError(f"lam must be a number in (0, 1] or {UNIFORM!r}, got {lam!r}")
  if eval_every is not None and (not isinstance(eval_every, (int, np.integer)) or eval_every < 1):
    raise ValueError(f"eval_every must be a positive integer or None, got {eval_every!r}")
  if progress is not None and not callable(progress):
    raise ValueError(f"progress must be callable(dict) or None, got {progress!r}")


def _signature(batch: Any) -> tuple[Any, ...]:
  """Tree structure, shapes and dtypes of a batch (what a compiled step depends on)."""
  leaves, tree = jax.tree.flatten(batch)
  return tree, tuple((tuple(jnp.shape(x)), jnp.result_type(x)) for x in leaves)


# ----------------------------------------------------------------------------- parametrisation


@dataclasses.dataclass(frozen=True)
class _Group:
  """Trained attention sites of one configuration, stacked along a leading axis [S]."""
  names: tuple[str, ...]
  site: spec_lib.AttentionSite

  @property
  def rope(self) -> spec_lib.AttentionSite | None:
    return self.site if self.site.group == "rope" else None


def _groups(spec: spec_lib.SymmetrySpec, sites: Sequence[str], flat: Params) -> tuple[_Group, ...]:
  groups: dict[Any, list[str]] = {}
  for s in sites:
    leaves = tuple((p[len(s):], flat[p].shape) for p in flat if p.startswith(s + "/"))
    groups.setdefault((spec.attention[s], leaves), []).append(s)
  return tuple(_Group(tuple(names), key[0]) for key, names in groups.items())


def _zero_delta(group: _Group, dtype: Any) -> dict[str, Any]:
  """D = 0: {"qk": group parameters [S, K, ...] of D^QK, "vo": [S, K, H, H]}."""
  s, k, h = len(group.names), group.site.kv_heads, group.site.head_dim
  zeros = jnp.zeros((s, k, h, h), dtype)
  qk = jax.vmap(jax.vmap(lambda m: _stage2.project(m, group.rope)))(zeros)
  return {"qk": qk, "vo": zeros}


def _corrections(delta: dict[str, Any], group: _Group) -> tuple[jax.Array, jax.Array]:
  """I + D^QK and I + D^VO [S, K, H, H] (D^QK in the span of H(H) under RoPE)."""
  d_qk = jax.vmap(jax.vmap(lambda p: _stage2.to_matrix(p, group.rope)))(delta["qk"])
  eye = jnp.eye(group.site.head_dim, dtype=d_qk.dtype)
  return eye + d_qk, eye + delta["vo"]


def _matrices(delta: dict[str, Any], start: tuple[jax.Array, jax.Array],
              group: _Group) -> tuple[jax.Array, jax.Array]:
  """The element's matrices A0 (I + D^QK), B0 (I + D^VO) [S, K, H, H]."""
  qk, vo = _corrections(delta, group)
  matmul = lambda x, y: jnp.matmul(x, y, precision=_features.HIGHEST)
  return matmul(start[0], qk), matmul(start[1], vo)


class _Data(NamedTuple):
  """What a step reads besides D and the batch, in the compute dtype."""
  a: Params  # flat theta_A
  b: Params  # flat g0 . theta_B, without the leaves of trained sites
  sites: tuple[Params, ...]  # per group, its sites of g0 . theta_B stacked [S, ...]
  start: tuple[tuple[jax.Array, jax.Array], ...]  # per group, (A0, B0) [S, K, H, H]


def _interpolate(delta: tuple[dict[str, Any], ...], data: _Data, lam: jax.Array,
                 groups: tuple[_Group, ...]) -> Params:
  """(1 - lam) theta_A + lam (g_D . g0 . theta_B), nested like the parameters."""
  flat = dict(data.b)
  after = None
  for group, sites, d in zip(groups, data.sites, delta):
    qk, vo = _corrections(d, group)
    if after is not None:  # one chain of LAPACK calls (``_stage2.sequenced``)
      qk, vo = _stage2.sequenced((qk, vo), after)
    identity = np.broadcast_to(np.arange(group.site.num_heads, dtype=np.int32),
                               (len(group.names), group.site.num_heads))
    after = group_action.apply(sites, group_action.AttentionElement(identity, qk, vo))
    for p, v in spec_lib.flatten(after).items():
      flat.update({f"{s}/{p}": v[i] for i, s in enumerate(group.names)})
  return spec_lib.unflatten({p: (1 - lam) * a + lam * flat[p] for p, a in data.a.items()})


def _condition(delta: tuple[dict[str, Any], ...], data: _Data,
               groups: tuple[_Group, ...]) -> jax.Array:
  """Largest condition bound ||M||_F ||M^{-1}||_F of the element's matrices (NaN if not finite)."""
  worst = jnp.zeros((), data.start[0][0].dtype)
  for group, start, d in zip(groups, data.start, delta):
    m = _stage2.sequenced(jnp.stack(_matrices(d, start, group)), worst)
    bound = jnp.linalg.norm(m, axis=(-2, -1)) * jnp.linalg.norm(jnp.linalg.inv(m), axis=(-2, -1))
    worst = jnp.maximum(worst, jnp.max(bound))
  return worst


# ----------------------------------------------------------------------------- compiled programs


class _State(NamedTuple):
  delta: Any
  opt_state: Any
  previous: Any  # (delta, opt_state) before the last step taken
  scale: jax.Array  # step size factor: halves on a skipped step, doubles back (to 1) on a taken one


def _step(state: _State, data: _Data, batch: Any, key: jax.Array, step: jax.Array,
          learning_rate: jax.Array, lam: jax.Array, limit: jax.Array, *, loss_fn: LossFn,
          groups: tuple[_Group, ...], uniform: bool) -> tuple[_State, jax.Array, jax.Array]:
  """One guarded Adam step on the interpolated loss (module docstring); (state, loss, skipped)."""
  if uniform:
    lam = jax.random.uniform(jax.random.fold_in(key, step), (), lam.dtype)
  objective = lambda d: loss_fn(_interpolate(d, data, lam, groups), batch)
  loss, grad = jax.value_and_grad(objective)(state.delta)
  updates, opt_state = optax.adam(learning_rate).update(grad, state.opt_state, state.delta)
  proposal = jax.tree.map(lambda d, u: d + state.scale * u, state.delta, updates)
  finite = jnp.isfinite(loss) & jnp.all(jnp.array([jnp.isfinite(g).all()
                                                   for g in jax.tree.leaves(grad)]))
  take = finite & (_condition(proposal, data, groups) <= limit)
  pick = lambda c, x, y: jax.tree.map(lambda u, v: jnp.where(c, u, v), x, y)
  current = (state.delta, state.opt_state)
  stay = pick(finite, current, state.previous)  # a non-finite loss here: back one iterate
  delta, opt_state = pick(take, (proposal, opt_state), stay)
  scale = jnp.where(take, jnp.minimum(1, 2 * state.scale), state.scale / 2)
  new = _State(delta, opt_state, pick(take, current, state.previous), scale)
  return new, loss.astype(limit.dtype), ~take


def _holdout(delta: tuple[dict[str, Any], ...], data: _Data, batch: Any, lam: jax.Array, *,
             loss_fn: LossFn, groups: tuple[_Group, ...]) -> jax.Array:
  """The interpolated loss on one batch at ``lam`` (a scalar of its dtype)."""
  return loss_fn(_interpolate(delta, data, lam, groups), batch).astype(lam.dtype)


_step_jit = jax.jit(_step, static_argnames=("loss_fn", "groups", "uniform"))
_holdout_jit = jax.jit(_holdout, static_argnames=("loss_fn", "groups"))


# ----------------------------------------------------------------------------- the loop


def _apply_moving(spec: spec_lib.SymmetrySpec, params: Params, element: dict[str, Any]) -> Params:
  """``group_action.apply_model`` with only the factors that ``element`` moves (the others
  act as the identity): an orthogonal residual left at identity then needs no folded scales."""
  def moves(name):
    if name in spec.attention:
      return True
    value, size = np.asarray(element[name]), spec.factors[name].size
    return not np.array_equal(value, np.arange(size) if value.ndim == 1 else np.eye(size))
  names = [n for n in element if moves(n)]
  return group_action.apply_model(spec.restrict(names), params, {n: element[n] for n in names})


def _training_batches(batches: Iterable[Any], steps: int):
  """``steps`` batches: a Sequence is cycled through, an iterator read until it ends."""
  if isinstance(batches, Sequence):
    for i in range(steps):
      yield batches[i % len(batches)]
    return
  it = iter(batches)
  for _ in range(steps):
    try:
      yield next(it)
    except StopIteration:
      return


def _prepare(spec: spec_lib.SymmetrySpec, params_a: Params, params_b: Params,
             element: dict[str, Any], sites: Sequence[str]) -> tuple[_Data, tuple[_Group, ...]]:
  """The step's constant inputs: A, g0 . B (its trained sites stacked per group) and g0's
  matrices, in the dtype of ``params_a`` (already cast and folded as the element needs)."""
  flat_a, moved = spec_lib.flatten(params_a), _apply_moving(spec, params_b, element)
  dtype = next(iter(flat_a.values())).dtype
  groups = _groups(spec, sites, flat_a)
  trained = {p for s in sites for p in flat_a if p.startswith(s + "/")}
  stack = lambda xs: jnp.stack([jnp.asarray(x, dtype) for x in xs])
  data = _Data(
      a=flat_a, b={p: v for p, v in spec_lib.flatten(moved).items() if p not in trained},
      sites=tuple(jax.tree.map(lambda *xs: jnp.stack(xs),
                               *[spec_lib.subtree(moved, s) for s in g.names]) for g in groups),
      start=tuple((stack([element[s].qk for s in g.names]), stack([element[s].vo for s in g.names]))
                  for g in groups))
  return data, groups


def _mean_holdout(delta: tuple[dict[str, Any], ...], data: _Data, batches: Sequence[Any],
                  lams: Sequence[float], dtype, *, loss_fn: LossFn,
                  groups: tuple[_Group, ...]) -> np.ndarray:
  """The interpolated loss at each of ``lams`` averaged over ``batches`` (each read once)."""
  lams = [jnp.asarray(x, dtype) for x in lams]
  return np.mean([[np.asarray(_holdout_jit(delta, data, b, x, loss_fn=loss_fn, groups=groups),
                              np.float64) for x in lams] for b in batches], axis=0)


def _held_out(inner: Sequence[float], ends: tuple[float, float], lams: Sequence[float]
              ) -> dict[str, Any]:
  """The held-out evaluation (module docstring) from the losses ``inner`` at the interior
  ``lams`` and ``ends`` at lambda 0 and 1: {"loss" (mean over the interior), "barrier",
  "endpoints"}."""
  curve = np.asarray((ends[0], *inner, ends[1]))
  if not np.isfinite(curve).all():
    return {"loss": math.inf, "barrier": math.inf, "endpoints": (math.inf, math.inf)}
  lams = np.asarray(lams)
  gap = curve[1:-1] - ((1 - lams) * curve[0] + lams * curve[-1])
  return {"loss": float(np.mean(curve[1:-1])), "barrier": float(max(0.0, np.max(gap))),
          "endpoints": (float(curve[0]), float(curve[-1]))}


def learn_alignment(spec: spec_lib.SymmetrySpec, params_a: Params, params_b: Params,
                    start: tuple[dict[str, Any], dict[str, Any]], *, sites: Sequence[str],
                    loss_fn: LossFn, batches: Iterable[Any], holdout_batches: Sequence[Any],
                    steps: int, learning_rate: float, lam: float | str = OPTIONS["lam"],
                    key: jax.Array | None = None, eval_every: int | None = None,
                    progress: Callable[[dict[str, Any]], None] | None = None
                    ) -> tuple[dict[str, Any], dict[str, Any]]:
  """Trains the QK and VO matrices of ``sites`` from ``start`` (module docstring).

  Args:
    spec: the models' symmetry spec.
    params_a, params_b: the two models (as given to ``align_model``).
    start: (element, info) of ``align_model`` for this pair, e.g. with method
      "full"; info["folded_norm_scales"] says whether the element acts on the
      folded parameters (both models are then folded here as well).
    sites: attention-site paths of ``spec`` to train (those in scope); the
      rest of the element is kept. With none, ``start`` comes back unchanged.
    loss_fn: loss_fn(params, batch) -> scalar, a pure JAX function of
      parameters nested like ``params_a`` (float32 for half precision).
    batches: training batches, all of one structure, shape and dtype; step i
      reads the i-th (a Sequence is cycled through; an iterator that ends
      early ends the training there). Exactly the batches used are read.
    holdout_batches: non-empty list of batches from the training split that
      ``batches`` does not hold, on which the returned iterate is chosen.
    steps: Adam steps.
    learning_rate: Adam learning rate, a relative change of the matrices per step.
    lam: the interpolation weight lambda of B in (0, 1], or "uniform" (drawn
      at every step from ``key``).
    key: jax.random key, needed for lam="uniform".
    eval_every: steps between held-out evaluations (default: steps / 10).
    progress: called at every held-out evaluation with {"step", "steps",
      "train_loss" (mean since the last call), "holdout_loss",
      "holdout_barrier", "best_holdout_barrier", "skipped", "seconds"}; the
      same line goes to ``logging`` (INFO).

  Returns:
    (element, info): the element for ``group_action.apply_model`` on
    ``params_b`` (folded if info["folded_norm_scales"]) and the start's info
    with info["distance"]["final"] recomputed for the element (the start's
    kept as info["distance"]["start"]), and info["learned"]: {"sites",
    "steps" (run), "skipped", "holdout": {"initial", "final", "best"}, each
    {"loss" (mean over the interior lambdas), "barrier", "endpoints" (the
    losses at lambda 0 and 1)}, "best_step" (0: the start), "lambda",
    "seconds"}; or info["learned"] = {"sites": [], "steps": 0, "note"} when
    there is no site to train (``start`` is returned, no batch is read).

  Raises:
    ValueError: before any computation, naming the argument or site.
  """
  check_options(loss_fn=loss_fn, batches=batches, holdout_batches=holdout_batches, steps=steps,
                learning_rate=learning_rate, lam=lam, key=key, eval_every=eval_every,
                progress=progress)
  element, info = start
  unknown = [s for s in sites if s not in spec.attention]
  if unknown:
    raise ValueError(f"sites {unknown} are not attention sites of the spec {sorted(spec.attention)}")
  info = dict(info)
  if not sites:
    info["learned"] = {"sites": [], "steps": 0,
                       "note": "no attention site in scope: the start element is returned"}
    return element, info

  begin = time.perf_counter()
  params_a, params_b = _attention.upcast(params_a), _attention.upcast(params_b)
  if info.get("folded_norm_scales"):
    params_a, params_b = (group_action.fold_norm_scales(spec, p) for p in (params_a, params_b))
  data, groups = _prepare(spec, params_a, params_b, element, sites)
  dtype = data.start[0][0].dtype
  delta = tuple(_zero_delta(g, dtype) for g in groups)
  opt_state = optax.adam(learning_rate).init(delta)
  state = _State(delta, opt_state, (delta, opt_state), jnp.ones((), dtype))
  uniform = lam == UNIFORM
  options = dict(learning_rate=jnp.asarray(learning_rate, dtype),
                 lam=jnp.asarray(0.0 if uniform else lam, dtype),
                 limit=jnp.asarray(_stage2.max_condition(dtype), dtype))
  key = jax.random.key(0) if key is None else key  # unused for a fixed lambda
  lams = UNIFORM_HOLDOUT_LAMBDAS if uniform else (lam,)
  losses_at = lambda d, xs: _mean_holdout(d, data, holdout_batches, xs, dtype, loss_fn=loss_fn,
                                          groups=groups)
  start_curve = losses_at(delta, (0.0, *lams, 1.0))
  ends = (start_curve[0], start_curve[-1])  # the same for every iterate (module docstring)
  held_out = lambda d: _held_out(losses_at(d, lams), ends, lams)

  initial = best_value = final = _held_out(start_curve[1:-1], ends, lams)
  best, best_step = delta, 0
  scale = max(abs(x) for x in initial["endpoints"])
  tolerance = math.sqrt(float(jnp.finfo(dtype).eps)) * scale if math.isfinite(scale) else 0.0
  eval_every = eval_every or max(1, -(-steps // EVALUATIONS))
  losses, skipped, taken, signature = [], jnp.zeros((), jnp.int32), 0, None

  def evaluate():
    nonlocal best, best_value, best_step, final
    final = held_out(state.delta)
    if final["barrier"] < best_value["barrier"] - tolerance:
      best, best_value, best_step = state.delta, final, taken
    train = float(jnp.mean(jnp.stack(losses))) if losses else math.nan
    losses.clear()
    line = dict(step=taken, steps=steps, train_loss=train, holdout_loss=final["loss"],
                holdout_barrier=final["barrier"], best_holdout_barrier=best_value["barrier"],
                skipped=int(skipped), seconds=time.perf_counter() - begin)
    log.info("learned alignment: step %d/%d, train loss %.5g, held-out loss %.5g barrier %.4g "
             "(best %.4g), %d skipped, %.1f s", taken, steps, train, final["loss"],
             final["barrier"], best_value["barrier"], line["skipped"], line["seconds"])
    if progress is not None:
      progress(line)

  for i, batch in enumerate(_training_batches(batches, steps)):
    signature = signature or _signature(batch)
    if _signature(batch) != signature:
      raise ValueError(f"training batch {i} has shapes and dtypes {_signature(batch)[1]}, the "
                       f"first had {signature[1]}: learned alignment compiles one step for one "
                       "batch shape (drop or pad the remainder)")
    state, loss, skip = _step_jit(state, data, batch, key, jnp.int32(i), loss_fn=loss_fn,
                                  groups=groups, uniform=uniform, **options)
    losses.append(loss)
    skipped, taken = skipped + skip, i + 1
    if taken % eval_every == 0 or taken == steps:
      evaluate()
  if taken < steps:
    log.warning("learned alignment: the batches ran out after %d of %d steps", taken, steps)
    if taken % eval_every:
      evaluate()

  element = dict(element)
  for group, d, m0 in zip(groups, best, data.start):
    qk, vo = _matrices(d, m0, group)
    element.update({s: element[s]._replace(qk=qk[i], vo=vo[i]) for i, s in enumerate(group.names)})
  moved = spec_lib.flatten(_apply_moving(spec, params_b, element))
  distance = dict(info.get("distance", {}))
  if "final" in distance:
    distance["start"] = distance["final"]
  distance["final"] = sum(jnp.sum((a - moved[p]) ** 2) for p, a in data.a.items())
  info["distance"] = distance
  info["learned"] = {"sites": list(sites), "steps": taken, "skipped": int(skipped),
                     "holdout": {"initial": initial, "final": final, "best": best_value},
                     "best_step": best_step, "lambda": lam,
                     "seconds": time.perf_counter() - begin}
  return element, info


def align(spec: spec_lib.SymmetrySpec, params_a: Params, params_b: Params,
          full: Callable[[], tuple[dict[str, Any], dict[str, Any]]], *, sites: Sequence[str],
          loss_fn: LossFn | None, batches: Iterable[Any] | None,
          holdout_batches: Sequence[Any] | None, steps: int, learning_rate: float,
          **options) -> tuple[dict[str, Any], dict[str, Any]]:
  """``align_model(method="learned")``: checks every option, then runs ``full()`` (the
  full method's (element, info)) and ``learn_alignment`` from it.

  ``options``: those of ``learn_alignment`` after ``learning_rate`` (``OPTIONS``).
  """
  unknown = sorted(set(options) - set(OPTIONS))
  if unknown:
    raise ValueError(f"unknown options {unknown} of method 'learned'; it takes loss_fn, batches, "
                     f"holdout_batches, steps, learning_rate and {list(OPTIONS)}")
  options = dict(OPTIONS, **options, loss_fn=loss_fn, batches=batches,
                 holdout_batches=holdout_batches, steps=steps, learning_rate=learning_rate)
  check_options(**options)
  return learn_alignment(spec, params_a, params_b, full(), sites=sites, **options)
