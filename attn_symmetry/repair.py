"""REPAIR for Transformers: the interpolated model's per-channel statistics reset, folded into
its weights (docs/lmc.md, 'REPAIR').

REPAIR (Jordan et al., 2022) corrects the variance collapse of an interpolated network: at
each repaired point, channel j of the interpolated model theta(lam) = (1 - lam) theta_A +
lam theta_B has mean mu_lam and standard deviation sigma_lam on a few batches, and is moved to
the interpolation of the endpoints' statistics,

    mu_t = (1 - lam) mu_A + lam mu_B,        sigma_t = (1 - lam) sigma_A + lam sigma_B,

by the affine map h -> a h + c with a = sigma_t / sigma_lam and c = mu_t - a mu_lam. The map is
folded into the weights that write the point, so the repaired model is a standard checkpoint
of the same architecture. The points (``POINTS``), in each layer ``layers_i``, and the
projections that take their corrections, the model spec's ``writers``:

* "attention": the attention output y [B, T, D] after W_O (``Model.apply``'s intermediate
  "layers_i/attention"). a scales W_O's output columns (``attention/out/kernel`` [N, H, D])
  and its bias; c is added to the bias: y' = z (W_O a) + (a b_O + c).
* "mlp": the FFN hidden units h [B, T, F] ("layers_i/mlp"). a scales the rows of the down
  projection (``mlp/wo/kernel`` [F, D], ``mlp/down/kernel`` for a gated FFN); c W_down is
  added to its bias: (a h + c) W + b = h (a W) + (c W + b). The fold sits after the point, so
  ``Model.apply`` reports the uncorrected h there and the down projection reads a h + c.

A shift folds only where the family has the bias that takes it (a writer with a bias:
``Config.out_bias`` for "attention", ``Config.mlp_bias`` for "mlp"): ViT, BERT, GPT-2 and
GPT-NeoX fold both parts of both points; Llama (no biases) folds the scales alone, c = 0.
What a scale alone matches there is ``no_bias`` (``NO_BIAS_RULES``):

* "std" (the default, REPAIR's own rule): a = sigma_t / sigma_lam, so the standard deviation
  meets its target and the mean ends at a mu_lam instead of mu_t;
* "second_moment": the uncentred second moment m2 = E[x^2] = sigma^2 + mu^2, whose target
  interpolates the endpoints', m2_t = (1 - lam) m2_A + lam m2_B, with a = sqrt(m2_t / m2_lam).
  Then a^2 m2_lam = m2_t exactly: the channel's RMS size, which is what the next RMSNorm reads
  (RMSNorm(x) = x / sqrt(mean_j x_j^2 + eps)), meets its target, and neither the mean nor the
  standard deviation does unless mu_lam / sigma_lam = mu_t / sigma_t.

No single scale can meet both mu_t and sigma_t unless that ratio holds; the info's gaps say
what remains, per point: "mean_gap" the RMS over the corrected channels of (a mu_lam + c -
mu_t) / sigma_t, "scale_gap" that of (a sigma_lam - sigma_t) / sigma_t. Both are computed from
the statistics the fold was solved on; the fold moves the point's statistics by exactly that
affine map, so they are the repaired model's gaps (up to rounding). Where the shift folds, both
vanish: "mean_gap" is reported as 0 and "scale_gap" is at the rounding level.
The points are repaired in forward order, each measured with the earlier ones already
repaired, as REPAIR re-estimates; a repair changes nothing upstream of its point, so the
repaired model meets every target.

Statistics stream: one jitted pass per batch returns, per point, the batch's count, a shift
(the first counted position's activation), the shifted mean and the centred sum of squares;
the host merges batches in float64 (Chan et al.'s pairwise update). A constant channel gives
exactly zero variance. No activations are kept beyond one batch.

Inside a trace (``repair_batch``, ``BatchRepair``): the same procedure on one batch, for a
caller that repairs as part of a jitted, differentiated function (the learned method's
objective with ``learn_repair``). The per-batch statistics (``_batch_moments``), the
correction (``_solve``, written once for numpy and jax.numpy arrays) and the fold
(``_fold``) are those of ``repair``; only the merge over batches (float64, on the host) and
the checks that need concrete values (finite activations, the gaps) are the host's alone.

This module imports jax and numpy only; the model (``models.Model``) is an argument.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from attn_symmetry import lmc
from attn_symmetry import spec as spec_lib

Params = Any
POINTS = ("attention", "mlp")
# What the scale alone matches where no bias takes the shift (module docstring).
NO_BIAS_RULES = ("std", "second_moment")
GAPS = ("mean_gap", "scale_gap")  # what a point's info says REPAIR left of its targets


@dataclasses.dataclass(frozen=True)
class Moments:
  """Per-channel statistics of one point over the counted positions of the batches.

  Attributes:
    count: the number of positions counted (mask True; every position without a mask).
    mean: [C] channel means: float64 numpy from ``statistics``, jax arrays of the
      activations' dtype inside ``repair_batch``.
    var: [C] population variances, likewise.
  """
  count: Any
  mean: Any
  var: Any

  @property
  def std(self) -> np.ndarray:
    return np.sqrt(self.var)


@dataclasses.dataclass(frozen=True)
class _Point:
  """One repaired point: its intermediate's name and the leaves the correction folds into.

  ``writes``: True when the kernel writes the point (its last axis holds the channels: the
  attention output projection), False when it reads it (its first axis: the FFN down
  projection). ``bias`` is None where the family has no bias there (only the scale folds).
  """
  name: str
  writes: bool
  kernel: str
  bias: str | None


def check_model(model: Any, points: Sequence[str] = POINTS) -> None:
  """Raises ValueError (one line) if ``repair`` cannot fold ``points`` into ``model``'s
  weights: an unknown point, or a family without the projection a point folds into. Reads the
  model's config and spec only, so a caller can check before any work."""
  _points(model, points)


def _points(model: Any, points: Sequence[str]) -> list[_Point]:
  """The repaired points in forward order, read from ``model.spec.writers``: "attention" the
  writers of attention sites (the output projection writes the point), "mlp" those of factors
  (the down projection reads it). ValueError for an unknown point name or a family whose spec
  has no writer for a point."""
  unknown = [p for p in points if p not in POINTS]
  if unknown or not points:
    raise ValueError(f"repair points must be a non-empty subset of {POINTS}, got {tuple(points)}")
  spec = model.spec
  kinds = {name: "attention" if name in spec.attention else "mlp" for name in spec.writers}
  for kind in points:
    if kind not in kinds.values():
      raise ValueError(f"REPAIR cannot fold into family {model.config.family!r}: its spec names "
                       f"no projection to take the {kind!r} point's correction")
  return [_Point(name, kind == "attention", *spec.writers[name])
          for name, kind in kinds.items() if kind in points]


def _batch_parts(model: Any, batch: Any) -> tuple[Any, Any, Any]:
  """(inputs, mask, segments) of one batch: an array of inputs, or a mapping with the inputs
  under "inputs" or the model's input key ("tokens", "image") and optional "mask" and
  "segments"."""
  if not isinstance(batch, Mapping):
    return batch, None, None
  key = "inputs" if "inputs" in batch else getattr(model, "input_key", "inputs")
  if key not in batch:
    raise ValueError(f"a repair batch needs its inputs under 'inputs' or {key!r}; it has "
                     f"{sorted(batch)}")
  return batch[key], batch.get("mask"), batch.get("segments")


def moments_fn(model: Any, names: Sequence[str]) -> Callable[..., dict[str, tuple]]:
  """``_moments_fn`` of (``model``, ``names``), built once per model and names: every lambda
  of a path, and its endpoints, run one compiled program."""
  return _moments_fn(model, tuple(names))


@functools.lru_cache(maxsize=8)
def _moments_fn(model: Any, names: tuple[str, ...]) -> Callable[..., dict[str, tuple]]:
  """``_batch_moments`` of (``model``, ``names``) jitted: ``(params, inputs, mask, segments)
  -> {name: (n, shift, mean, m2)}``. One compilation serves every model of the same shapes
  and dtypes."""
  return jax.jit(functools.partial(_batch_moments, model, names))


def _batch_moments(model: Any, names: Sequence[str], params: Params, inputs: jax.Array,
                   mask: jax.Array | None, segments: jax.Array | None
                   ) -> dict[str, tuple[jax.Array, jax.Array, jax.Array, jax.Array]]:
  """The statistics of one batch: ``{name: (n, shift [C], mean [C], m2 [C])}``.

  For the intermediate x [..., C] of each name of ``model.apply(params, inputs, mask=mask,
  segments=segments)``, over the positions with mask True (all when mask is None): n the
  count, shift the first counted position's x, mean the mean of x - shift and m2 the sum of
  squares of x - shift about it, in the activations' dtype. Pure and traceable: both
  ``statistics`` (jitted, merged over batches on the host) and ``repair_batch`` (inside a
  caller's trace) read it.
  """
  _, inter = model.apply(params, inputs, mask=mask, segments=segments)
  out = {}
  for name in names:
    x = inter[name]
    x = x.reshape(-1, x.shape[-1])
    w = (jnp.ones(x.shape[:1], x.dtype) if mask is None
         else jnp.reshape(mask, (-1,)).astype(x.dtype))
    shift = x[jnp.argmax(w > 0)]
    y = x - shift
    n = jnp.sum(w)
    mean = jnp.sum(w[:, None] * y, 0) / jnp.maximum(n, 1)
    m2 = jnp.sum(w[:, None] * jnp.square(y - mean), 0)
    out[name] = (n, shift, mean, m2)
  return out


def _accumulate(fn: Callable[..., dict[str, tuple]], model: Any, params: Params,
                batches: Iterable[Any], names: Sequence[str]) -> dict[str, Moments]:
  """The batches' ``Moments`` of ``names`` under ``params``, merged in float64 on the host."""
  totals: dict[str, tuple[float, np.ndarray, np.ndarray]] = {}
  for batch in batches:
    inputs, mask, segments = _batch_parts(model, batch)
    for name, (n, shift, mean, m2) in fn(params, inputs, mask, segments).items():
      n = float(n)
      if n == 0:
        continue
      mean = np.asarray(shift, np.float64) + np.asarray(mean, np.float64)
      m2 = np.asarray(m2, np.float64)
      if name not in totals:
        totals[name] = (n, mean, m2)
        continue
      count, total_mean, total_m2 = totals[name]
      merged, delta = count + n, mean - total_mean
      totals[name] = (merged, total_mean + delta * (n / merged),
                      total_m2 + m2 + delta ** 2 * (count * n / merged))
  if not totals:
    raise ValueError("repair got no batches (or no position with mask True)")
  return {name: Moments(n, mean, m2 / n) for name, (n, mean, m2) in totals.items()}


def statistics(model: Any, params: Params, batches: Iterable[Any],
               names: Sequence[str]) -> dict[str, Moments]:
  """Per-channel ``Moments`` of the intermediates ``names`` ("layers_0/mlp", ...) of
  ``model.apply(params, .)`` over ``batches``, streamed a batch at a time.

  Args:
    model: a ``models.Model``.
    params: its parameters.
    batches: model inputs (tokens [B, T], images [B, S, S, C]), or mappings holding them under
      "inputs" or the model's input key with an optional bool "mask" [B, T] (positions with
      False are not counted) and "segments"; iterated once.
    names: intermediates of ``Model.apply``.
  """
  return _accumulate(moments_fn(model, names), model, params, batches, names)


def _flat(m: Moments, eps: float, xp: Any = np) -> Any:
  """bool [C]: channels whose standard deviation is at the rounding level of the activations,
  eps (|mean| + the point's RMS standard deviation), zero included. ``xp``: numpy for host
  ``Moments``, jax.numpy inside a trace (a comparison: no gradient flows through it)."""
  return xp.sqrt(m.var) <= eps * (xp.abs(m.mean) + xp.sqrt(xp.mean(m.var)))


def _check_finite(stats: Mapping[str, Moments], names: Sequence[str], which: str) -> None:
  for name in names:
    m = stats[name]
    if not (np.isfinite(m.mean).all() and np.isfinite(m.var).all()):
      raise ValueError(f"REPAIR: the activations at {name} of {which} are not finite")


def _check_no_bias(no_bias: Any) -> None:
  if no_bias not in NO_BIAS_RULES:
    raise ValueError(f"repair no_bias must be one of {', '.join(NO_BIAS_RULES)}, got "
                     f"{no_bias!r}")


def _fold(params: Params, point: _Point, a: Any, c: Any | None) -> Params:
  """``params`` with h -> a h + c at ``point`` folded into its writer (module docstring); a
  and c [C] are numpy or jax arrays (traced, inside ``repair_batch``)."""
  flat = dict(spec_lib.flatten(params))
  kernel = flat[point.kernel]
  dtype = kernel.dtype
  a_ = jnp.asarray(a, dtype)
  if point.writes:  # [..., C]: the last axis holds the channels
    flat[point.kernel] = (kernel * a_).astype(dtype)
    if c is not None:
      flat[point.bias] = (flat[point.bias] * a_ + jnp.asarray(c, dtype)).astype(dtype)
  else:  # [C, D]: the rows are the channels
    flat[point.kernel] = (kernel * a_[:, None]).astype(dtype)
    if c is not None:
      shift = jnp.tensordot(jnp.asarray(c, dtype), kernel, 1, precision=jax.lax.Precision.HIGHEST)
      flat[point.bias] = (flat[point.bias] + shift).astype(dtype)
  return spec_lib.unflatten(flat)


class _Solved(NamedTuple):
  """One point's correction (``_solve``), each [C]: the map h -> a h + c (c None where no bias
  takes the shift), the channels left as they are, and the targets mu_t and sigma_t."""
  a: Any
  c: Any | None
  degenerate: Any
  mu_t: Any
  sigma_t: Any


def _solve(ma: Moments, mb: Moments, ml: Moments, lam: Any, eps: float, shift: bool,
           no_bias: str, xp: Any = np) -> _Solved:
  """The map h -> a h + c that moves the interpolated model's channels (``ml``) to the
  targets interpolated from A's (``ma``) and B's (``mb``) at ``lam`` (module docstring),
  identity (a = 1, c = 0) on the degenerate channels (``_flat`` at ``eps`` in A, B or the
  interpolated model). ``shift``: the family has the bias that takes c (else c is None and
  ``no_bias`` says what a matches).

  The one implementation of the maths, array-generic: ``xp`` numpy on the host's float64
  ``Moments`` (``repair``), jax.numpy inside a trace (``repair_batch``). A degenerate
  channel's variances are replaced by 1 before any square root or division, so that its
  value (a = 1, c = 0, as selected) and its gradient stay finite (no 0 x inf under
  ``jax.grad``); the other channels' values are unchanged by it, bit for bit.
  """
  degenerate = _flat(ma, eps, xp) | _flat(mb, eps, xp) | _flat(ml, eps, xp)
  safe = lambda x: xp.where(degenerate, 1.0, x)
  std = lambda m: xp.sqrt(safe(m.var))
  mu_t = (1 - lam) * ma.mean + lam * mb.mean
  sigma_t = (1 - lam) * std(ma) + lam * std(mb)
  if shift or no_bias == "std":
    a = xp.where(degenerate, 1.0, sigma_t / std(ml))
  else:
    second = lambda m: m.var + m.mean ** 2
    a = xp.where(degenerate, 1.0, xp.sqrt(safe(((1 - lam) * second(ma) + lam * second(mb))
                                                / safe(second(ml)))))
  c = xp.where(degenerate, 0.0, mu_t - a * ml.mean) if shift else None
  return _Solved(a, c, degenerate, mu_t, sigma_t)


def _gaps(solved: _Solved, ml: Moments) -> dict[str, float]:
  """{"mean_gap", "scale_gap"} of a point solved on the host (``_solve`` with numpy): the RMS
  over the moved channels of the repaired mean's and standard deviation's distance to the
  targets, relative to sigma_t (0.0 for no channel; "mean_gap" is 0 where the shift folds)."""
  a, c, degenerate, mu_t, sigma_t = solved
  moved = ~degenerate
  safe_sigma = np.where(degenerate, 1.0, sigma_t)
  rms = lambda x: float(np.sqrt(np.mean(x[moved] ** 2))) if moved.any() else 0.0
  return dict(zip(GAPS, (0.0 if c is not None else rms((a * ml.mean - mu_t) / safe_sigma),
                         rms((a * ml.std - sigma_t) / safe_sigma))))


def _eps(params: Params, point: _Point) -> float:
  """The epsilon of the dtype of ``point``'s writer in ``params`` (``_flat``'s rounding)."""
  return float(jnp.finfo(spec_lib.flatten(params)[point.kernel].dtype).eps)


@dataclasses.dataclass(frozen=True)
class Endpoints:
  """The endpoints' ``Moments`` at the repaired points (``endpoint_statistics``): the targets of
  every lambda of one pair, measured once.

  Attributes:
    points: the ``POINTS`` they were measured at.
    a, b: {"layers_i/<point>": Moments} of A and of B (aligned).
  """
  points: tuple[str, ...]
  a: dict[str, Moments]
  b: dict[str, Moments]


def endpoint_statistics(model: Any, params_a: Params, params_b: Params, batches: Sequence[Any],
                        *, points: Sequence[str] = POINTS) -> Endpoints:
  """A's and B's ``Moments`` at ``points`` of every layer over ``batches``, for ``repair`` at
  any lambda of the path between them (its ``endpoints``).

  Raises:
    ValueError: as ``repair``: an unknown point, a family with nothing to fold it into,
      parameters that do not fit the model, no batches, activations that are not finite.
  """
  names = [p.name for p in _points(model, points)]
  model.check_params(params_a)
  model.check_params(params_b)
  fn = moments_fn(model, names)
  stats = {}
  for which, params in (("model A", params_a), ("model B", params_b)):
    stats[which] = _accumulate(fn, model, params, batches, names)
    _check_finite(stats[which], names, which)
  return Endpoints(tuple(points), stats["model A"], stats["model B"])


def repair(model: Any, params_a: Params, params_b: Params, lam: float, batches: Iterable[Any],
           *, points: Sequence[str] = POINTS, endpoints: Endpoints | None = None,
           no_bias: str = NO_BIAS_RULES[0]) -> tuple[Params, dict[str, dict[str, Any]]]:
  """The REPAIRed interpolation (1 - lam) theta_A + lam theta_B (module docstring).

  Args:
    model: a ``models.Model`` (its ``apply``, ``config`` and ``spec`` are read).
    params_a, params_b: the endpoints, B already aligned to A (e.g. ``group_action.apply_model``).
    lam: the point of the path, in [0, 1].
    batches: as ``statistics`` takes them; a sequence (it is read 2 + len(points) x depth
      times: once per endpoint, once per repaired point; len(points) x depth times with
      ``endpoints``).
    points: which of ``POINTS`` to repair in every layer.
    endpoints: ``endpoint_statistics`` of these endpoints, batches and points, when several
      lambdas of one path are repaired (else measured here).
    no_bias: what the scale matches at a point with no bias to take the shift, one of
      ``NO_BIAS_RULES``: "std" (REPAIR's rule, the default) or "second_moment" (module
      docstring); a point whose shift folds matches mean and standard deviation either way.

  Returns:
    (params, info): the repaired parameters, a checkpoint of ``model`` with the pytree
    structure, shapes and dtypes of ``params_a``; info maps each repaired point
    ("layers_i/attention", "layers_i/mlp") to {"channels": C, "corrected": channels moved,
    "degenerate": channels left as they are (a = 1, c = 0) because their standard deviation
    vanishes in A, B or the interpolated model (``_flat``), "shift_folded": whether c folds
    (the family has the bias), "no_bias": the rule, "mean_gap": RMS over the corrected
    channels of (repaired mean - mu_t) / sigma_t, 0 where the shift folds, "scale_gap": RMS
    over them of (repaired standard deviation - sigma_t) / sigma_t, "scale": a [C] and
    "offset": c [C] (float64 arrays; c = 0 where the shift does not fold)}. The "mlp" fold sits after the point: the
    repaired model's ``Model.apply`` still reports h there, and its down projection reads
    a h + c, whose statistics are the targets.

  Raises:
    ValueError: lam outside [0, 1]; an unknown point or ``no_bias`` rule; a family with nothing to fold a point
      into (one line naming the family); parameters that do not fit the model; no batches;
      activations that are not finite (naming the point and the model); ``endpoints``
      measured at other points.
  """
  lam = float(lam)
  if not 0.0 <= lam <= 1.0:
    raise ValueError(f"repair lam must lie in [0, 1], got {lam}")
  _check_no_bias(no_bias)
  found = _points(model, points)
  names = [p.name for p in found]
  batches = list(batches)
  if endpoints is None:  # it checks the parameters
    endpoints = endpoint_statistics(model, params_a, params_b, batches, points=points)
  else:
    if tuple(endpoints.points) != tuple(points):
      raise ValueError(f"repair endpoints were measured at points {endpoints.points}, not at "
                       f"the repaired {tuple(points)}")
    model.check_params(params_a)
    model.check_params(params_b)
  stats_a, stats_b = endpoints.a, endpoints.b
  fn = moments_fn(model, names)
  params = lmc.interpolate(params_a, params_b, lam)
  info = {}
  for point in found:
    stats = _accumulate(fn, model, params, batches, names)
    _check_finite(stats, [point.name], f"the interpolated model at lam = {lam}")
    ma, mb, ml = stats_a[point.name], stats_b[point.name], stats[point.name]
    solved = _solve(ma, mb, ml, lam, _eps(params, point), point.bias is not None, no_bias)
    params = _fold(params, point, solved.a, solved.c)
    a, c, degenerate = solved.a, solved.c, solved.degenerate
    info[point.name] = {
        "channels": int(a.size), "corrected": int((~degenerate).sum()),
        "degenerate": int(degenerate.sum()), "shift_folded": c is not None,
        "no_bias": no_bias, **_gaps(solved, ml), "scale": a,
        "offset": np.zeros_like(a) if c is None else c}
  return params, info


# ----------------------------------------------------------------------------- inside a trace


def _batch_statistics(model: Any, params: Params, parts: tuple[Any, Any, Any],
                      names: Sequence[str]) -> dict[str, Moments]:
  """``Moments`` of ``names`` on one batch, (inputs, mask, segments) = ``parts``, as jax arrays
  of the activations' dtype: ``_batch_moments`` combined as ``statistics`` combines one batch
  (mean = shift + shifted mean, var = m2 / n). Traceable."""
  out = {}
  for name, (n, shift, mean, m2) in _batch_moments(model, names, params, *parts).items():
    out[name] = Moments(n, shift + mean, m2 / jnp.maximum(n, 1))
  return out


def repair_batch(model: Any, params_a: Params, params_b: Params, params: Params, lam: Any,
                 batch: Any, *, points: Sequence[str] = POINTS,
                 no_bias: str = NO_BIAS_RULES[0]) -> Params:
  """``params``, the interpolated model at ``lam``, REPAIRed on one batch: the procedure of
  ``repair`` (the same ``_batch_moments``, ``_solve`` and ``_fold``) with every statistic
  measured on ``batch`` alone, in the parameters' dtype, and no check that needs the host.

  Pure and traceable (under ``jax.jit`` and ``jax.grad``): it is the REPAIR inside the
  learned method's objective (``learn_repair``). Gradients flow through the statistics (of
  B and of the interpolated model; A's have none), as through a batch normalisation's in
  training: the value is the repaired model's, and so is its derivative. It runs
  ``model.apply`` 2 + len(points) x depth times: A, B, then the interpolated model once per
  point, each point measured with the earlier ones repaired. Activations that are not finite
  are not refused here (no host check): they give a non-finite result, which the caller
  sees (the learned method skips such a step). With ``batches=[batch]``, ``repair`` computes
  the same parameters up to rounding (bit for bit in float64 but for the order of sums).

  Args:
    model: a ``models.Model``.
    params_a, params_b: the endpoints (B aligned to A), nested like the model's parameters.
    params: the interpolated model (1 - lam) params_a + lam params_b, as the caller forms it.
    lam: the point of the path, a scalar (traced or not) in [0, 1].
    batch: as ``statistics`` reads one: the inputs, or a mapping with them under "inputs" or
      the model's input key, optional "mask" [B, T] and "segments".
    points, no_bias: as ``repair``'s.

  Returns:
    The repaired parameters: the tree, shapes and dtypes of ``params``.
  """
  found = _points(model, points)
  names = [p.name for p in found]
  parts = _batch_parts(model, batch)
  stats_a, stats_b = (_batch_statistics(model, p, parts, names) for p in (params_a, params_b))
  for point in found:
    ml = _batch_statistics(model, params, parts, [point.name])[point.name]
    solved = _solve(stats_a[point.name], stats_b[point.name], ml, lam, _eps(params, point),
                    point.bias is not None, no_bias, jnp)
    params = _fold(params, point, solved.a, solved.c)
  return params


@dataclasses.dataclass(frozen=True)
class BatchRepair:
  """``repair_batch`` with its settings bound, for a caller that repairs inside its own trace
  (the learned method: ``matching.learn_alignment``'s ``repair``). Hashable, so that it can
  be a static argument of a compiled function: two are equal when they hold the same model
  object, the same ``model_inputs`` object, rule and points.

  Attributes:
    model: a ``models.Model``.
    model_inputs: ``batch -> `` what ``repair_batch`` reads of a batch (the inputs under
      "inputs" or the model's input key, "mask", "segments"), traceable; None: the batch
      itself. A caller's training batch may hold more than the model reads (a language
      model's window of T + 1 tokens, of which it reads T).
    no_bias: one of ``NO_BIAS_RULES`` (``repair``'s).
    points: which of ``POINTS`` to repair in every layer.

  Raises:
    ValueError (on construction, before any work): an unknown rule or point, or a family with
    nothing to fold a point into (``check_model``'s line).
  """
  model: Any
  model_inputs: Callable[[Any], Any] | None = None
  no_bias: str = NO_BIAS_RULES[0]
  points: tuple[str, ...] = POINTS

  def __post_init__(self):
    _check_no_bias(self.no_bias)
    object.__setattr__(self, "points", tuple(self.points))
    if self.model_inputs is not None and not callable(self.model_inputs):
      raise ValueError(f"repair model_inputs must be callable(batch) or None, got "
                       f"{self.model_inputs!r}")
    _points(self.model, self.points)

  def __call__(self, params_a: Params, params_b: Params, params: Params, lam: Any,
               batch: Any) -> Params:
    """``repair_batch`` of ``params`` at ``lam`` on ``batch`` (read by ``model_inputs``)."""
    batch = batch if self.model_inputs is None else self.model_inputs(batch)
    return repair_batch(self.model, params_a, params_b, params, lam, batch,
                        points=self.points, no_bias=self.no_bias)
