"""Learned alignment: the element's factors fitted to the loss of the interpolated model.

The full method minimises a distance between weights, which cannot tell the
part of theta_A - g . theta_B that a symmetry explains from the part it
cannot; the task loss can. Starting from an element g0 (the full method's:
head permutations of Stage 1, Weight Matching of the FFN and residual
factors, Stage 2 matrices A0_k, B0_k), the returned element is

    g = g_c o g0,

with a correction g_c (``_correction``) that starts at the identity and is
trained on the task loss of the interpolated model,

    L(g_c; lambda, batch) = loss_fn((1 - lambda) theta_A + lambda (g_c . g0 . theta_B), batch),

lambda fixed (1/2 by default), drawn from a band U(lambda - w, lambda + w) around it
(``lam_band`` w; Theus et al. draw U(0.4, 0.6)) or from U(0, 1) at every step.
g0 . theta_B is computed once. ``factors`` (``_correction.FACTORS``, all that
the scope has by default) chooses what g_c trains: "attention" (per kv group
A_k = A0_k (I + D^QK_k), B_k = B0_k (I + D^VO_k), D by Adam from zero; the
correction is relative, so that Adam's steps of about ``learning_rate`` per
entry change every matrix by a similar fraction whatever its scale; under
RoPE D^QK lies in the span of H(H), which holds I and is closed under
products, so A_k stays in H(H) exactly), "heads" (each site's head
permutation), "ffn" (every FFN's hidden units) and "residual" (the residual
stream: O = O0 cayley(S) for an orthogonal one (RMSNorm), O = O0 U diag(1, cayley(S)) U^T
with S on 1-perp for a pre-LayerNorm one with ``residual="orthogonal"``, a permutation for
a LayerNorm one otherwise). Permutations are trained with a straight-through estimator:
the forward pass uses the hard permutation that maximises a score matrix,
the gradient reaches the scores as if they were the permutation matrix
(``_correction`` gives the maths and the choice). Names that ``factors``
leaves out keep g0's values.

Exactness. No relaxed matrix reaches the result: the element is composed from
the hard permutations, the Cayley matrix and I + D (``_correction.compose``),
an exact group element. Before returning, the aligned model g . theta_B is
checked to compute theta_B's function: their losses on the first held-out
batch must agree to sqrt(eps) of the compute dtype, relative to the loss (or
absolute below 1), else ValueError with the measured difference (a loss_fn
that reads the parameters, not the function they compute, fails it).

Guards. A step is skipped, the parameters and optimiser state kept, when the
loss or its gradient is not finite, or when a proposed matrix M = M0 (I + D)
has a condition bound ||M||_F ||M^{-1}||_F above Stage 2's ``max_condition``;
a non-finite loss also returns the iterate to the one before it. The step
size then halves, and it doubles back (up to ``learning_rate``) with every
step taken.

Schedule. Step i (from 0) of a budget of n steps runs at learning rate r_i: "constant",
r_i = r; "warmup_cosine" (``learning_rates``), a linear warm-up over the first w =
ceil(n / 10) steps, r_i = r (i + 1) / w, then a cosine decay, r_i = r (1 + cos(pi (i - w) /
(n - w))) / 2 for i >= w, from r towards 0 at the budget. The step-size factor of the guards
multiplies r_i.

Selection. At the start, every ``eval_every`` steps and at the end, the
interpolated loss is evaluated on ``holdout_batches``, a slice of the training
split that the steps never see, at lambda itself (for uniform lambda at 1/4,
1/2 and 3/4), averaged over the batches; at lambda = 0 and 1 once, at the start:
theta_A does not move, and g_c acts on the function of g0 . theta_B as the
identity (it is an element of the symmetry group), so the endpoints' losses
are the same for every iterate (up to rounding; the path evaluation of the
study computes them anew). The held-out
barrier is the largest gap between that loss and the chord
(1 - lambda) L(0) + lambda L(1), or 0 if the path lies below it. The iterate
with the lowest held-out barrier is returned; a later one replaces an earlier
one only if it is lower by more than sqrt(eps) times the endpoint loss
(rounding alone never moves the element). With ``patience`` p > 0 the
training stops after p evaluations in a row that did not set a new best (the
step budget the ceiling): the barrier has reached its plateau. Every
evaluation's (step, barrier) is kept (info["learned"]["curve"]), so a reader
sees it flatten.

Why the barrier and not the loss itself: the interpolated loss can fall
below the endpoints' (the midpoint of two models is a third model, which the
training batches can improve), and past the point where the path is flat that
is fine-tuning, not alignment. On a planted pair (g0 . theta_B = theta_A) the
held-out barrier of g0 is already 0, so g0 is returned exactly, although the
steps move away from it (the loss is invariant along the orbit of theta_A, so
the identity correction is a stationary point of L, but not a minimum unless
theta_A minimises the loss). The test split is never an argument.

REPAIR in the objective. With ``repair`` (option ``learn_repair``, a
``repair.BatchRepair`` of the model), every model on the path is REPAIRed on the batch
it is evaluated on before its loss is taken, at every step and every held-out evaluation:

    L(g_c; lambda, batch) = loss_fn(R_batch(theta(lambda)), batch),
    theta(lambda) = (1 - lambda) theta_A + lambda (g_c . g0 . theta_B),

R_batch the REPAIR of ``repair.repair_batch``: on the batch itself, the statistics of
theta_A, of g_c . g0 . theta_B and of the interpolated model at every repair point (each
point measured with the earlier ones repaired), the correction that ``repair.repair``
computes (the same code, ``repair._solve``, and REPAIR's ``no_bias`` rule) folded into the
writers. The element is then fitted to the path that is evaluated with REPAIR after
learning (the study's ``<method>+repair``), not to the plain path. The held-out barrier that
picks the iterate is the REPAIRed path's too, each held-out batch repaired on its own
statistics (at lambda 0 and 1 REPAIR is the identity: the endpoints are unchanged).
Gradients flow through the statistics (of g . theta_B and of the interpolated model;
theta_A's have none), as through a batch normalisation's in training: the step descends
the function whose value it reports and whose held-out barrier picks the iterate. Held
fixed (stop_gradient), the step would descend the loss of the model with the correction
frozen, which credits a change of a channel's scale or offset that the next REPAIR undoes
and misses how a change of g moves the targets. Each loss then costs 2 + P forward passes
more (P = 2 x depth points; A, B, then the interpolated model once per point), and the
step their backward passes. The statistics are one batch's, not those of the batches that
REPAIR reads after learning (``study.activation_batches``), as a batch normalisation's in
training are.

Parameters in half precision are cast to float32 for all of it (the element
comes back in float32, as the full method's does); the loss is evaluated on
those float32 parameters. One compiled step and one compiled evaluation per
model, factors, loss function and batch shape, reused across calls: the cache
is keyed by the loss function object, so pass the same function for every
pair (not a new lambda or ``functools.partial`` per call).

This module imports jax, numpy and optax only (and the standard library's
logging, for progress; ``repair``, which takes the model as an argument).
"""

from __future__ import annotations

import itertools
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
from attn_symmetry import repair as repair_lib
from attn_symmetry import spec as spec_lib
from attn_symmetry.matching import _attention
from attn_symmetry.matching import _correction
from attn_symmetry.matching import _methods
from attn_symmetry.matching import _model
from attn_symmetry.matching import _options
from attn_symmetry.matching import _stage2

UNIFORM = "uniform"  # ``lam`` value: lambda ~ U(0, 1) at every step
UNIFORM_HOLDOUT_LAMBDAS = (0.25, 0.5, 0.75)
EVALUATIONS = 10  # held-out evaluations per run when ``eval_every`` is not given
# and their defaults; factors None: every factor of ``_correction.FACTORS`` that the scope has
OPTIONS = {"factors": None, "lam": 0.5, "lam_band": 0.0, "key": None, "eval_every": None,
           "progress": None, "schedule": _options.LEARN_SCHEDULES[0], "patience": 0}
WARMUP_FRACTION = 0.1  # of the step budget: the warm-up of "warmup_cosine"

Params = dict[str, Any]
LossFn = Callable[[Params, Any], jax.Array]
Repair = repair_lib.BatchRepair  # REPAIR inside the objective (module docstring)
log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- validation


def check_options(*, loss_fn: Any, batches: Any, holdout_batches: Any, steps: Any,
                  learning_rate: Any, lam: Any, key: Any, eval_every: Any, progress: Any,
                  lam_band: Any = 0.0, schedule: Any = OPTIONS["schedule"],
                  patience: Any = OPTIONS["patience"], repair: Any = None) -> None:
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
  if not (isinstance(lam_band, (int, float, np.integer, np.floating))
          and not isinstance(lam_band, bool) and lam_band >= 0):
    raise ValueError(f"lam_band must be a number >= 0, got {lam_band!r}")
  if lam_band:
    if lam == UNIFORM:
      raise ValueError("lam_band draws lambda around a fixed lam; lam='uniform' draws it from "
                       "U(0, 1) already: pass one of them")
    if not 0 < lam - lam_band < lam + lam_band <= 1:
      raise ValueError(f"the band of lambda [lam - lam_band, lam + lam_band] = "
                       f"[{lam - lam_band:g}, {lam + lam_band:g}] must lie in (0, 1]: "
                       "(learn_lam_band below 50 for lam 1/2)")
    if key is None:
      raise ValueError("lam_band > 0 draws lambda at random: pass key, a jax.random key")
  if eval_every is not None and (not isinstance(eval_every, (int, np.integer)) or eval_every < 1):
    raise ValueError(f"eval_every must be a positive integer or None, got {eval_every!r}")
  if progress is not None and not callable(progress):
    raise ValueError(f"progress must be callable(dict) or None, got {progress!r}")
  if schedule not in _options.LEARN_SCHEDULES:
    raise ValueError(f"schedule must be one of {', '.join(_options.LEARN_SCHEDULES)}, got "
                     f"{schedule!r}")
  if not isinstance(patience, (int, np.integer)) or isinstance(patience, bool) or patience < 0:
    raise ValueError(f"patience must be a non-negative integer, got {patience!r}")
  if repair is not None and not isinstance(repair, Repair):
    raise ValueError("repair must be a repair.BatchRepair (the model and REPAIR's rule) or None, "
                     f"got {repair!r}")


def learning_rates(schedule: str, learning_rate: float, steps: int) -> np.ndarray:
  """[steps] float64: the learning rate r_i of each step i of a budget of ``steps``
  (module docstring, 'Schedule'): ``learning_rate`` at every step for "constant"; for
  "warmup_cosine", r (i + 1) / w over the first w = ceil(WARMUP_FRACTION steps) steps, then
  r (1 + cos(pi (i - w) / (steps - w))) / 2, so the peak r is reached at step w - 1 and w
  and every rate is > 0."""
  if schedule not in _options.LEARN_SCHEDULES:
    raise ValueError(f"schedule must be one of {', '.join(_options.LEARN_SCHEDULES)}, got "
                     f"{schedule!r}")
  i = np.arange(steps, dtype=np.float64)
  if schedule == "constant":
    return np.full(steps, float(learning_rate))
  warmup = max(1, math.ceil(WARMUP_FRACTION * steps))
  decay = np.maximum(i - warmup, 0) / max(steps - warmup, 1)
  return learning_rate * np.where(i < warmup, (i + 1) / warmup,
                                  (1 + np.cos(np.pi * decay)) / 2)


def _signature(batch: Any) -> tuple[Any, ...]:
  """Tree structure, shapes and dtypes of a batch (what a compiled step depends on)."""
  leaves, tree = jax.tree.flatten(batch)
  return tree, tuple((tuple(jnp.shape(x)), jnp.result_type(x)) for x in leaves)


# ----------------------------------------------------------------------------- compiled programs


class _Data(NamedTuple):
  """What a step reads besides the correction and the batch, in the compute dtype."""
  a: Params  # flat theta_A
  b: Params  # flat g0 . theta_B
  start: tuple[tuple[jax.Array, jax.Array], ...]  # per site group, g0's (A0, B0) [S, K, H, H]


def _interpolate(params: Params, data: _Data, lam: jax.Array, plan: _correction.Plan,
                 batch: Any = None, repair: Repair | None = None) -> Params:
  """(1 - lam) theta_A + lam (g_c . g0 . theta_B), nested like the parameters; with
  ``repair``, that model REPAIRed on ``batch`` (module docstring, 'REPAIR in the
  objective')."""
  moved = _correction.act(data.b, params, plan)
  mixed = spec_lib.unflatten({p: (1 - lam) * a + lam * moved[p] for p, a in data.a.items()})
  if repair is None:
    return mixed
  return repair(spec_lib.unflatten(data.a), spec_lib.unflatten(moved), mixed, lam, batch)


class _State(NamedTuple):
  params: Any  # the correction's parameters (``_correction.init``)
  opt_state: Any
  previous: Any  # (params, opt_state) before the last step taken
  scale: jax.Array  # step size factor: halves on a skipped step, doubles back (to 1) on a taken one


def _step(state: _State, data: _Data, batch: Any, key: jax.Array, step: jax.Array,
          learning_rate: jax.Array, lam: jax.Array, limit: jax.Array, *, loss_fn: LossFn,
          plan: _correction.Plan, uniform: bool, band: float, repair: Repair | None
          ) -> tuple[_State, jax.Array, jax.Array]:
  """One guarded optimiser step on the interpolated loss, REPAIRed on the batch with
  ``repair`` (module docstring); (state, loss, skipped)."""
  if uniform:
    lam = jax.random.uniform(jax.random.fold_in(key, step), (), lam.dtype)
  elif band:
    lam = jax.random.uniform(jax.random.fold_in(key, step), (), lam.dtype, lam - band,
                             lam + band)
  objective = lambda q: loss_fn(_interpolate(q, data, lam, plan, batch, repair), batch)
  loss, grad = jax.value_and_grad(objective)(state.params)
  updates, opt_state = _correction.optimizer(learning_rate).update(grad, state.opt_state,
                                                                   state.params)
  proposal = jax.tree.map(lambda q, u: q + state.scale * u, state.params, updates)
  finite = jnp.isfinite(loss) & jnp.all(jnp.array([jnp.isfinite(g).all()
                                                   for g in jax.tree.leaves(grad)]))
  take = finite & (_correction.condition(proposal, data.start, plan) <= limit)
  pick = lambda c, x, y: jax.tree.map(lambda u, v: jnp.where(c, u, v), x, y)
  current = (state.params, state.opt_state)
  stay = pick(finite, current, state.previous)  # a non-finite loss here: back one iterate
  params, opt_state = pick(take, (proposal, opt_state), stay)
  scale = jnp.where(take, jnp.minimum(1, 2 * state.scale), state.scale / 2)
  new = _State(params, opt_state, pick(take, current, state.previous), scale)
  return new, loss.astype(limit.dtype), ~take


def _holdout(params: Params, data: _Data, batch: Any, lam: jax.Array, *, loss_fn: LossFn,
             plan: _correction.Plan, repair: Repair | None) -> jax.Array:
  """The interpolated loss on one batch at ``lam`` (a scalar of its dtype), REPAIRed on that
  batch with ``repair``."""
  return loss_fn(_interpolate(params, data, lam, plan, batch, repair), batch).astype(lam.dtype)


def _loss(params: Params, batch: Any, *, loss_fn: LossFn) -> jax.Array:
  return loss_fn(params, batch)


_step_jit = jax.jit(_step, static_argnames=("loss_fn", "plan", "uniform", "band", "repair"))
_holdout_jit = jax.jit(_holdout, static_argnames=("loss_fn", "plan", "repair"))
_loss_jit = jax.jit(_loss, static_argnames="loss_fn")


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
             element: dict[str, Any], plan: _correction.Plan) -> _Data:
  """The step's constant inputs: A, g0 . B and g0's matrices of the trained sites, in the
  dtype of ``params_a`` (already cast and folded as the element needs)."""
  flat_a = spec_lib.flatten(params_a)
  dtype = next(iter(flat_a.values())).dtype
  stack = lambda xs: jnp.stack([jnp.asarray(x, dtype) for x in xs])
  return _Data(a=flat_a, b=spec_lib.flatten(_apply_moving(spec, params_b, element)),
               start=tuple((stack([element[s].qk for s in g.names]),
                            stack([element[s].vo for s in g.names])) for g in plan.sites))


def _mean_holdout(params: Params, data: _Data, batches: Sequence[Any], lams: Sequence[float],
                  dtype, *, loss_fn: LossFn, plan: _correction.Plan,
                  repair: Repair | None) -> np.ndarray:
  """The interpolated loss at each of ``lams`` averaged over ``batches`` (each read once),
  each point REPAIRed on the batch it is evaluated on with ``repair``."""
  lams = [jnp.asarray(x, dtype) for x in lams]
  return np.mean([[np.asarray(_holdout_jit(params, data, b, x, loss_fn=loss_fn, plan=plan,
                                           repair=repair), np.float64)
                   for x in lams] for b in batches], axis=0)


def _check_function(aligned: Params, params_b: Params, batch: Any, dtype: Any, *,
                    loss_fn: LossFn) -> dict[str, float]:
  """{"loss_b", "loss_aligned", "tolerance"} on ``batch``; ValueError when the aligned model's
  loss differs from B's by more than the tolerance (module docstring, 'Exactness')."""
  loss_b, loss_aligned = (float(_loss_jit(p, batch, loss_fn=loss_fn)) for p in (params_b, aligned))
  tolerance = math.sqrt(float(jnp.finfo(dtype).eps)) * max(1.0, abs(loss_b))
  if not abs(loss_aligned - loss_b) <= tolerance:
    raise ValueError(f"learned alignment: the learned element changes model B's function: loss "
                     f"{loss_aligned:.9g} of g . theta_B against {loss_b:.9g} of theta_B on the "
                     f"first held-out batch (difference {abs(loss_aligned - loss_b):.3g} > "
                     f"tolerance {tolerance:.3g}); is loss_fn a function of what the model "
                     "computes?")
  return {"loss_b": loss_b, "loss_aligned": loss_aligned, "tolerance": tolerance}


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
                    start: tuple[dict[str, Any], dict[str, Any]], *, names: Sequence[str],
                    loss_fn: LossFn, batches: Iterable[Any], holdout_batches: Sequence[Any],
                    steps: int, learning_rate: float,
                    factors: str | Sequence[str] | None = OPTIONS["factors"],
                    lam: float | str = OPTIONS["lam"], lam_band: float = OPTIONS["lam_band"],
                    key: jax.Array | None = None,
                    eval_every: int | None = None,
                    progress: Callable[[dict[str, Any]], None] | None = None,
                    schedule: str = OPTIONS["schedule"], patience: int = OPTIONS["patience"],
                    repair: Repair | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
  """Trains the ``factors`` of ``names`` from ``start`` (module docstring).

  Args:
    spec: the symmetry spec that the start's element belongs to (for
      ``residual="orthogonal"``, ``matching.residual_spec(model_spec, "orthogonal",
      names)``).
    params_a, params_b: the two models (as given to ``align_model``).
    start: (element, info) of ``align_model`` for this pair, e.g. with method
      "full"; info["folded_norm_scales"] says whether the element acts on the
      parameters in ``group_action.canonical_form`` (both models are then brought to it
      here as well).
    names: the factors and attention sites of ``spec`` in scope
      (``matching.active_names(spec, scope)``); the rest of the element is kept. With none,
      ``start`` comes back unchanged.
    loss_fn: loss_fn(params, batch) -> scalar, a pure JAX function of parameters nested like
      ``params_a`` (float32 for half precision).
    batches: training batches, all of one structure, shape and dtype; step i reads the i-th
      (a Sequence is cycled through; an iterator that ends early ends the training there).
      Exactly the batches used are read.
    holdout_batches: non-empty list of batches from the training split that ``batches`` does
      not hold, on which the returned iterate is chosen; the first also checks that the
      result keeps B's function.
    steps: optimiser steps (the budget: with ``patience``, a ceiling).
    learning_rate: Adam's learning rate (a relative change of the attention matrices per
      step) and that of the permutation scores (``_correction``: a transposition needs about
      1 / learning_rate steps); the peak of ``schedule``.
    factors: which factors are trained, some of ``_correction.FACTORS`` ("attention",
      "heads", "ffn", "residual"), or one of them as a string; None: every one of ``names``.
    lam: the interpolation weight lambda of B in (0, 1], or "uniform" (drawn at every step
      from ``key``).
    lam_band: w > 0 draws lambda at every step from U(lam - w, lam + w) (from ``key``),
      within (0, 1], the held-out evaluation staying at ``lam``; 0: lambda = lam.
    key: jax.random key, needed for lam="uniform" and lam_band > 0.
    eval_every: steps between held-out evaluations (default: steps / 10).
    schedule: "constant" or "warmup_cosine" (``learning_rates``).
    patience: p > 0 ends it after p held-out evaluations without a new best; 0: never.
    progress: called at every held-out evaluation with {"step", "steps", "train_loss" (mean
      since the last call), "holdout_loss", "holdout_barrier", "best_holdout_barrier",
      "skipped", "seconds"}; the same line goes to ``logging`` (INFO).
    repair: a ``repair.BatchRepair`` of the model that ``params_a`` belongs to: every loss,
      of the steps and of the held-out evaluations, is that of the interpolated model
      REPAIRed on its own batch (module docstring, 'REPAIR in the objective'); None: not.

  Returns:
    (element, info): the element for ``group_action.apply_model`` on ``params_b`` (folded if
    info["folded_norm_scales"]) and the start's info with info["distance"]["final"]
    recomputed for the element (the start's kept as info["distance"]["start"]), and
    info["learned"]: {"factors" (trained), "sites" (attention sites trained), "names" (every
    name trained), "steps" (run), "skipped", "holdout": {"initial", "final", "best"}, each
    {"loss" (mean over the interior lambdas), "barrier", "endpoints" (the losses at lambda 0
    and 1)}, "best_step" (0: the start), "curve" ([(step, held-out barrier)] of every
    evaluation, the start's first), "stopped" (by patience before the budget), "schedule",
    "patience", "lambda", "function_check" (``_check_function``), "seconds", and with
    ``repair`` "repair": {"no_bias", "points"}}; or
    info["learned"] = {"factors": [], "sites": [], "steps": 0, "note"} when ``names`` is
    empty (``start`` is returned, no batch is read).

  Raises:
    ValueError: before any computation, naming the argument, name or factor;
      after training, if the element does not keep B's function on the first
      held-out batch (naming the measured difference).
  """
  check_options(loss_fn=loss_fn, batches=batches, holdout_batches=holdout_batches, steps=steps,
                learning_rate=learning_rate, lam=lam, key=key, eval_every=eval_every,
                progress=progress, lam_band=lam_band, schedule=schedule, patience=patience,
                repair=repair)
  element, info = start
  _check_names(spec, names)
  trained, info = _correction.resolve(spec, names, factors), dict(info)
  if not trained:
    info["learned"] = {"factors": [], "sites": [], "steps": 0,
                       "note": "no symmetry in scope: the start element is returned"}
    return element, info
  element, info = _fit(spec, params_a, params_b, element, info, names=names, trained=trained,
                       loss_fn=loss_fn, batches=batches, holdout_batches=holdout_batches,
                       rates=learning_rates(schedule, learning_rate, steps), lam=lam,
                       lam_band=lam_band, key=key, eval_every=eval_every, progress=progress,
                       patience=patience, repair=repair)
  info["learned"] |= {"schedule": schedule, "patience": patience}
  return element, info


def _fit(spec: spec_lib.SymmetrySpec, params_a: Params, params_b: Params,
         element: dict[str, Any], info: dict[str, Any], *, names: Sequence[str],
         trained: Sequence[str], loss_fn: LossFn, batches: Iterable[Any],
         holdout_batches: Sequence[Any], rates: np.ndarray, lam: float | str, lam_band: float,
         key: jax.Array | None, eval_every: int | None,
         progress: Callable[[dict[str, Any]], None] | None, patience: int,
         repair: Repair | None) -> tuple[dict[str, Any], dict[str, Any]]:
  """``learn_alignment`` once its options are checked and the ``trained`` factors resolved
  (non-empty): the models cast (and folded), the steps at ``rates`` from the identity
  correction, the best iterate composed with ``element``, B's function checked. Returns
  (element, info), info["learned"] from ``_summary``."""
  begin = time.perf_counter()
  params_a, params_b = _upcast(spec, params_a, params_b, bool(info.get("folded_norm_scales")))
  plan = _correction.plan(spec, names, trained, spec_lib.flatten(params_a))
  data = _prepare(spec, params_a, params_b, element, plan)
  dtype = next(iter(data.a.values())).dtype
  params = _correction.init(plan, dtype)
  tracker = _Tracker(params, data, holdout_batches,
                     UNIFORM_HOLDOUT_LAMBDAS if lam == UNIFORM else (lam,), dtype, loss_fn, plan,
                     len(rates), begin, progress, repair)
  run = _train(params, data, plan, tracker, batches, dtype, rates=rates, patience=patience,
               lam=lam, lam_band=lam_band, key=key, eval_every=eval_every, loss_fn=loss_fn,
               repair=repair)
  element = _correction.compose(tracker.best, plan, element)
  moved = _apply_moving(spec, params_b, element)
  check = _check_function(moved, params_b, holdout_batches[0], dtype, loss_fn=loss_fn)
  info["distance"] = _distances(info.get("distance", {}), data, moved)
  info["learned"] = _summary(names, trained, plan, tracker, run, lam=lam, lam_band=lam_band,
                             check=check, begin=begin, repair=repair)
  return element, info


def _check_names(spec: spec_lib.SymmetrySpec, names: Sequence[str]) -> None:
  """ValueError listing the ``names`` that are neither factors nor attention sites of ``spec``."""
  unknown = [n for n in names if n not in spec.factors and n not in spec.attention]
  if unknown:
    raise ValueError(f"names {unknown} are neither factors {sorted(spec.factors)} nor attention "
                     f"sites {sorted(spec.attention)} of the spec")


def _upcast(spec: spec_lib.SymmetrySpec, params_a: Params, params_b: Params, fold: bool
            ) -> tuple[Params, Params]:
  """Both models in the compute dtype (``_attention.upcast``), in
  ``group_action.canonical_form`` (norm scales folded, and the writers and LayerNorm biases
  of a mean-zero orthogonal stream in its gauge) when ``fold``."""
  params_a, params_b = _attention.upcast(params_a), _attention.upcast(params_b)
  if fold:
    params_a, params_b = (group_action.canonical_form(spec, p) for p in (params_a, params_b))
  return params_a, params_b


def _train(params: Params, data: _Data, plan: _correction.Plan, tracker: _Tracker,
           batches: Iterable[Any], dtype: Any, *, rates: np.ndarray, patience: int,
           lam: float | str, lam_band: float, key: jax.Array | None, eval_every: int | None,
           loss_fn: LossFn, repair: Repair | None) -> tuple[int, int, bool]:
  """The guarded Adam steps (``_step``) from the correction ``params`` on ``batches``
  (``learn_alignment``'s arguments, ``repair`` among them), step i at learning rate
  ``rates[i]`` (the budget is len(rates) steps), ``tracker`` evaluating the iterate every
  ``eval_every`` steps and after the last; with ``patience`` > 0, the steps end once that
  many evaluations in a row set no new best (``_Tracker.stale``).

  Returns:
    (the steps taken: the budget, or fewer if the batches run out or patience ends it; the
    steps skipped; whether patience ended it before the budget).

  Raises:
    ValueError: when a training batch's shapes or dtypes differ from the first's.
  """
  steps = len(rates)
  # the optimiser's state does not depend on the rate, which each step passes
  opt_state = _correction.optimizer(jnp.ones((), dtype)).init(params)
  state = _State(params, opt_state, (params, opt_state), jnp.ones((), dtype))
  uniform = lam == UNIFORM
  options = dict(lam=jnp.asarray(0.0 if uniform else lam, dtype),
                 limit=jnp.asarray(_stage2.max_condition(dtype), dtype))
  key = jax.random.key(0) if key is None else key  # unused for a fixed lambda
  eval_every = eval_every or max(1, -(-steps // EVALUATIONS))
  skipped, taken, signature = jnp.zeros((), jnp.int32), 0, None
  for i, batch in enumerate(_training_batches(batches, steps)):
    signature = signature or _signature(batch)
    if _signature(batch) != signature:
      raise ValueError(f"training batch {i} has shapes and dtypes {_signature(batch)[1]}, the "
                       f"first had {signature[1]}: learned alignment compiles one step for one "
                       "batch shape (drop or pad the remainder)")
    state, loss, skip = _step_jit(state, data, batch, key, jnp.int32(i),
                                  jnp.asarray(rates[i], dtype), loss_fn=loss_fn, plan=plan,
                                  uniform=uniform, band=float(lam_band), repair=repair,
                                  **options)
    tracker.losses.append(loss)
    skipped, taken = skipped + skip, i + 1
    if taken % eval_every == 0 or taken == steps:
      tracker.evaluate(state.params, taken, int(skipped))
      if patience and tracker.stale >= patience:
        log.info("learned alignment: no lower held-out barrier in %d evaluations, stopped "
                 "after %d of %d steps", patience, taken, steps)
        return taken, int(skipped), taken < steps
  if taken < steps:
    log.warning("learned alignment: the batches ran out after %d of %d steps", taken, steps)
    if taken % eval_every:
      tracker.evaluate(state.params, taken, int(skipped))
  return taken, int(skipped), False


def _summary(names: Sequence[str], trained: Sequence[str], plan: _correction.Plan,
             tracker: _Tracker, run: tuple[int, int, bool], *, lam: float | str,
             lam_band: float, check: dict[str, float], begin: float,
             repair: Repair | None) -> dict[str, Any]:
  """info["learned"] of a training (``learn_alignment``'s Returns): the ``trained`` factors,
  the sites and ``names`` trained (``plan``'s), the ``run`` of ``_train`` (steps taken,
  skipped, stopped by patience), the
  ``tracker``'s held-out results, ``lam`` (and ``lam_band`` when not 0), the function
  ``check``, the seconds since ``begin`` and, with ``repair``, its rule and points."""
  trained_names = [*plan.site_names, *(n for g in plan.factors for n in g.names)]
  taken, skipped, stopped = run
  learned = {"factors": list(trained), "sites": list(plan.site_names),
             "names": [n for n in names if n in trained_names], "steps": taken,
             "skipped": skipped,
             "holdout": {"initial": tracker.initial, "final": tracker.final,
                         "best": tracker.best_value},
             "best_step": tracker.best_step, "curve": tracker.curve, "stopped": stopped,
             "lambda": lam, "function_check": check,
             "seconds": time.perf_counter() - begin}
  if lam_band:
    learned["lambda_band"] = lam_band
  if repair is not None:
    learned["repair"] = {"no_bias": repair.no_bias, "points": list(repair.points)}
  return learned


class _Tracker:
  """The held-out evaluations of one learned alignment and its best iterate so far.

  The endpoints' held-out losses are measured once, with the start (``params``): they are the
  same for every iterate (module docstring). An iterate becomes the best when its held-out
  barrier is below the best one by more than sqrt(eps) of the endpoints' losses. With
  ``repair``, every held-out loss is the REPAIRed model's, each batch repaired on its own
  statistics (at lambda 0 and 1 REPAIR is the identity, so the endpoints are the same).
  """

  def __init__(self, params: Params, data: _Data, holdout_batches: Sequence[Any],
               lams: Sequence[float], dtype: Any, loss_fn: LossFn, plan: _correction.Plan,
               steps: int, begin: float, progress: Callable[[dict[str, Any]], None] | None,
               repair: Repair | None):
    self._losses_at = lambda q, xs: _mean_holdout(q, data, holdout_batches, xs, dtype,
                                                  loss_fn=loss_fn, plan=plan, repair=repair)
    self._lams, self._steps, self._begin, self._progress = lams, steps, begin, progress
    curve = self._losses_at(params, (0.0, *lams, 1.0))
    self._ends = (curve[0], curve[-1])
    self.initial = self.best_value = self.final = _held_out(curve[1:-1], self._ends, lams)
    self.best, self.best_step = params, 0
    self.curve = [(0, self.initial["barrier"])]  # (step, held-out barrier) of every evaluation
    self.stale = 0  # evaluations since the last new best
    scale = max(abs(x) for x in self.initial["endpoints"])
    self._tolerance = (math.sqrt(float(jnp.finfo(dtype).eps)) * scale if math.isfinite(scale)
                       else 0.0)
    self.losses: list[jax.Array] = []  # training losses since the last evaluation

  def evaluate(self, params: Params, taken: int, skipped: int) -> None:
    """Evaluates ``params`` (after ``taken`` steps) on the held-out batches, keeps it if it is
    the best, and reports the line to ``logging`` and ``progress``."""
    self.final = _held_out(self._losses_at(params, self._lams), self._ends, self._lams)
    self.curve.append((taken, self.final["barrier"]))
    self.stale += 1
    if self.final["barrier"] < self.best_value["barrier"] - self._tolerance:
      self.best, self.best_value, self.best_step, self.stale = params, self.final, taken, 0
    train = float(jnp.mean(jnp.stack(self.losses))) if self.losses else math.nan
    self.losses.clear()
    line = dict(step=taken, steps=self._steps, train_loss=train,
                holdout_loss=self.final["loss"], holdout_barrier=self.final["barrier"],
                best_holdout_barrier=self.best_value["barrier"], skipped=skipped,
                seconds=time.perf_counter() - self._begin)
    log.info("learned alignment: step %d/%d, train loss %.5g, held-out loss %.5g barrier %.4g "
             "(best %.4g), %d skipped, %.1f s", taken, self._steps, train, self.final["loss"],
             self.final["barrier"], self.best_value["barrier"], skipped, line["seconds"])
    if self._progress is not None:
      self._progress(line)


def _distances(distance: dict[str, Any], data: _Data, moved: Params) -> dict[str, Any]:
  """The start's distances with "final" recomputed for the learned element (squared distance
  of A to B moved by it), the start's kept as "start"."""
  distance, moved = dict(distance), spec_lib.flatten(moved)
  if "final" in distance:
    distance["start"] = distance["final"]
  distance["final"] = sum(jnp.sum((a - moved[p]) ** 2) for p, a in data.a.items())
  return distance


def align(spec: spec_lib.SymmetrySpec, params_a: Params, params_b: Params, *,
          scope: str | Sequence[str] | None, loss_fn: LossFn | None = None,
          batches: Iterable[Any] | None = None, holdout_batches: Iterable[Any] | None = None,
          activations: Any = None, match_batches: Sequence[Any] | None = None,
          key: jax.Array | None = None, eval_every: int | None = None,
          progress: Callable[[dict[str, Any]], None] | None = None, model: Any = None,
          model_inputs: Callable[[Any], Any] | None = None, repair_no_bias: str | None = None,
          **matching) -> tuple[dict[str, Any], dict[str, Any]]:
  """Method "learned" (``align_model(method="learned")``): checks every option, then runs
  its start, the method that ``learn_init`` names ("full" or "activation", with every option
  as given, and ``activations`` and ``match_batches`` for "activation"), and
  ``learn_alignment`` from it: ``learn_steps`` steps at ``learn_learning_rate``, lambda 1/2
  (from U(0, 1) with ``learn_uniform_lambda``; a band of ``learn_lam_band`` hundredths around
  1/2), the best iterate chosen on the first ``learn_holdout_batches`` of
  ``holdout_batches``, the rate following ``learn_schedule``, stopped by ``learn_patience``;
  with ``learn_repair``, every loss on the path REPAIRed (``_path_repair``: ``model``,
  ``model_inputs`` and ``repair_no_bias``, the input ``_methods.REPAIR``).

  ``matching``: every matching option (``MatchOptions``); the rest as ``learn_alignment``,
  whose spec is ``_model.residual_spec`` under ``residual`` (the start's element's group).
  """
  o = _options.MatchOptions(**matching)
  holdout, most = holdout_batches, o.learn_holdout_batches
  if isinstance(holdout, Sequence):
    holdout = holdout if len(holdout) <= most else holdout[:most]
  elif isinstance(holdout, Iterable):
    holdout = list(itertools.islice(holdout, most))
  options = dict(loss_fn=loss_fn, batches=batches, holdout_batches=holdout,
                 steps=o.learn_steps, learning_rate=o.learn_learning_rate,
                 lam=UNIFORM if o.learn_uniform_lambda else OPTIONS["lam"],
                 lam_band=o.learn_lam_band / 100, key=key, eval_every=eval_every,
                 progress=progress, schedule=o.learn_schedule, patience=o.learn_patience,
                 repair=_path_repair(o.learn_repair, model, model_inputs, repair_no_bias,
                                     params_a))
  check_options(**options)
  names = _model.active_names(spec, scope)
  _correction.resolve(spec, names, o.factors)
  learned_spec = _model.residual_spec(spec, o.residual, names)
  element = _methods.METHODS[o.learn_init].call(
      spec, params_a, params_b, scope=scope, options=o,
      arguments=dict(activations=activations, match_batches=match_batches))
  return learn_alignment(learned_spec, params_a, params_b, element, names=names,
                         factors=o.factors, **options)


def _path_repair(learn_repair: bool, model: Any, model_inputs: Callable[[Any], Any] | None,
                 no_bias: str | None, params_a: Params) -> Repair | None:
  """The ``repair.BatchRepair`` of option ``learn_repair`` (None when it is False): ``model``,
  the ``models.Model`` of the parameters, its ``model_inputs`` and REPAIR's rule ``no_bias``
  (None: ``repair.repair``'s default).

  Raises:
    ValueError: before any work: no ``model``; an unknown rule; a family with nothing to fold
      REPAIR into (``repair.check_model``'s line); parameters that do not fit the model.
  """
  if not learn_repair:
    return None
  if model is None:
    raise ValueError("learn_repair=True fits the element on the REPAIRed path: pass model, the "
                     "models.Model that the parameters belong to (and model_inputs, "
                     "repair_no_bias: the input 'repair')")
  repair = Repair(model, model_inputs, repair_lib.NO_BIAS_RULES[0] if no_bias is None else no_bias)
  model.check_params(params_a)
  return repair


_methods.register_built_in(
    "learned", align, inputs=(_methods.LOSS,), arguments=("eval_every",),
    when=(_methods.When("learn_init", "activation", (_methods.ACTIVATIONS,)),
          _methods.When("learn_repair", True, (_methods.REPAIR,))),
    doc="its start's element trained on the loss of the interpolated model")
