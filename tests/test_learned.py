"""Learned alignment (``align_model(method="learned")``) on the two-layer Transformer of
``tiny_transformer``: LayerNorm with GL(H) attention, and RMSNorm with grouped-query RoPE
attention (H(H)) and an orthogonal residual stream.

The task is a regression of the logits onto those of a fixed random teacher on random tokens;
training, held-out and test batches come from disjoint seeds. Loss functions live at module level,
so that every test of one model and dtype shares the compiled step.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from attn_symmetry import group_action as ga
from attn_symmetry import matching
from attn_symmetry.matching import _learned as _learned_module
from attn_symmetry.matching import _stage2
from tests import tiny_transformer as tiny

BATCH = 8
TRAIN, HOLDOUT, TEST = range(100, 108), range(200, 202), range(300, 304)


def _loss(params, batch, rms):
  return jnp.mean((tiny.apply(params, batch["tokens"], rms=rms) - batch["target"]) ** 2)


def _loss_gl(params, batch):
  return _loss(params, batch, False)


def _loss_rope(params, batch):
  return _loss(params, batch, True)


LOSS = {False: _loss_gl, True: _loss_rope}
_jit_loss = {rms: jax.jit(f) for rms, f in LOSS.items()}


_model_apply = jax.jit(tiny.apply, static_argnames="rms")


def _batches(seeds, rms=False):
  """Random tokens [BATCH, T] and the teacher's logits, one batch per seed."""
  teacher = jax.tree.map(lambda x: x.astype(jnp.asarray(0.0).dtype),  # the same in float64
                         tiny.init(jax.random.key(99), rms=rms, dtype=jnp.float32))
  out = []
  for s in seeds:
    tokens = jax.random.randint(jax.random.key(s), (BATCH, tiny.MAX_LEN), 0, tiny.VOCAB)
    out.append({"tokens": np.asarray(tokens),
                "target": np.asarray(_model_apply(teacher, tokens, rms=rms))})
  return out


def _pair(rms, seeds=(0, 1), dtype=None):
  """The spec and two random models."""
  dtype = dtype or jnp.asarray(0.0).dtype
  spec = tiny.symmetry_spec(rms=rms)
  return (spec, *(tiny.init(jax.random.key(s), rms=rms, dtype=dtype) for s in seeds))


@functools.partial(jax.jit, static_argnames="rms")
def _train_step(params, state, batch, rms):
  grad = jax.grad(LOSS[rms])(params, batch)
  updates, state = optax.adam(3e-3).update(grad, state)
  return optax.apply_updates(params, updates), state


@functools.lru_cache(maxsize=None)
def _trained_numpy(rms, seed, steps=160):
  with jax.enable_x64(False):
    params = tiny.init(jax.random.key(seed), rms=rms, dtype=jnp.float32)
    state, batches = optax.adam(3e-3).init(params), _batches(TRAIN, rms)
    for i in range(steps):
      params, state = _train_step(params, state, batches[i % len(batches)], rms)
    return jax.tree.map(np.asarray, params)


def _trained_pair(rms, dtype=None):
  """The spec and two models trained on the training batches from different seeds (in
  float32, then cast), so that the path between them has a barrier."""
  dtype = dtype or jnp.asarray(0.0).dtype
  return (tiny.symmetry_spec(rms=rms),
          *(jax.tree.map(lambda x: jnp.asarray(x, dtype), _trained_numpy(rms, s)) for s in (0, 1)))


_APPLY = {rms: jax.jit(functools.partial(ga.apply_model, tiny.symmetry_spec(rms=rms)))
          for rms in (False, True)}  # jitted: unfolded norm scales next to an identity residual


def _apply(spec):
  return _APPLY[spec.factors["residual"].kind == "orthogonal"]


def _endpoints(spec, a, b, info):
  """(A, B) as the element acts on them: folded when the alignment folded norm scales."""
  if info["folded_norm_scales"]:
    return ga.fold_norm_scales(spec, a), ga.fold_norm_scales(spec, b)
  return a, b


def _mean_loss(rms, params, batches):
  return float(np.mean([float(_jit_loss[rms](params, batch)) for batch in batches]))


def _midpoint(a, b):
  return jax.tree.map(lambda x, y: (x + y) / 2, a, b)


def _uniform():
  """lambda ~ U(0, 1): the float32 tests' option, so that they share one compiled step."""
  return dict(lam="uniform", key=jax.random.key(3))


def _learned(spec, a, b, rms, **options):
  """``align_model``'s "learned" on the test's batches: 24 steps at 1e-2 (``lam="uniform"``,
  ``learn_alignment``'s spelling, is the option ``learn_uniform_lambda``)."""
  if options.pop("lam", None) == "uniform":
    options["learn_uniform_lambda"] = True
  options = dict(dict(batches=_batches(TRAIN, rms), holdout_batches=_batches(HOLDOUT, rms),
                      learn_steps=24, learn_learning_rate=1e-2, eval_every=6), **options)
  return matching.align_model(spec, a, b, method="learned", loss_fn=LOSS[rms], **options)


# ----------------------------------------------------------------------------- planted pairs


@pytest.mark.slow
@pytest.mark.parametrize("rms", [False, True], ids=["gl", "rope"])
def test_planted_pair_keeps_the_exact_solution(x64, rms):
  """B = g . A: the full method's exact element is returned, although the steps left it (the
  midpoint's loss can fall below the endpoints'), and the midpoint is A itself."""
  spec, a, _ = _pair(rms)
  if rms:
    a = ga.fold_norm_scales(spec, a)  # an orthogonal residual map needs folded scales
  b = ga.apply_model(spec, a, ga.random_model_element(jax.random.key(7), spec))
  element, info = _learned(spec, a, b, rms, init="best")
  full, _ = matching.align_model(spec, a, b, init="best")
  learned = info["learned"]
  assert learned["steps"] == 24 and learned["skipped"] == 0 and learned["best_step"] == 0
  assert learned["holdout"]["final"]["loss"] < learned["holdout"]["initial"]["loss"] - 1e-3
  assert learned["holdout"]["initial"]["barrier"] <= 1e-12 * learned["holdout"]["initial"]["loss"]
  for site in spec.attention:
    np.testing.assert_array_equal(element[site].qk, full[site].qk)
    np.testing.assert_array_equal(element[site].vo, full[site].vo)
  moved = _apply(spec)(b, element)
  scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(a))
  error = max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(moved),
                                                               jax.tree.leaves(a)))
  assert error <= 1e-7 * scale
  test = _batches(TEST, rms)
  np.testing.assert_allclose(_mean_loss(rms, _midpoint(a, moved), test), _mean_loss(rms, a, test),
                             rtol=1e-10)


def _planted(rms=False):
  """A float32 pair B = g . A and the learned options that share the float32 tests' step."""
  spec, a, _ = _pair(rms, dtype=jnp.float32)
  return spec, a, ga.apply_model(spec, a, ga.random_model_element(jax.random.key(7), spec))


def test_patience_stops_on_a_planted_plateau():
  """On a planted pair the start's held-out barrier is already 0, the plateau: with patience
  3 and an evaluation per step, the training stops after 3 steps of its 24, and the curve
  holds the start and those three evaluations."""
  spec, a, b = _planted()
  _, info = _learned(spec, a, b, False, init="best", learn_patience=3, eval_every=1,
                     **_uniform())
  learned = info["learned"]
  assert learned["steps"] == 3 and learned["stopped"] and learned["best_step"] == 0
  assert [step for step, _ in learned["curve"]] == [0, 1, 2, 3]
  assert learned["curve"][0][1] == learned["holdout"]["initial"]["barrier"]
  assert learned["patience"] == 3 and learned["schedule"] == "constant"


def test_defaults_run_every_step_at_a_constant_rate():
  """The defaults (constant rate, no patience) are a patience that never fires: the same
  element and evaluations as patience 10 over 2 evaluations, and every step of the budget."""
  spec, a, b = _planted()
  runs = [_learned(spec, a, b, False, learn_steps=6, eval_every=3, **_uniform(), **options)
          for options in ({}, dict(learn_schedule="constant", learn_patience=10))]
  (e0, i0), (e1, i1) = runs
  for x, y in zip(jax.tree.leaves(e0), jax.tree.leaves(e1)):
    np.testing.assert_array_equal(x, y)
  assert i0["learned"]["holdout"] == i1["learned"]["holdout"]
  assert i0["learned"]["curve"] == i1["learned"]["curve"] and len(i0["learned"]["curve"]) == 3
  assert i0["learned"]["steps"] == 6 and not i0["learned"]["stopped"]
  assert i0["learned"]["schedule"] == "constant" and i0["learned"]["patience"] == 0


def test_learning_rate_schedules():
  """constant: the rate itself at every step (the value today's steps ran at); warmup_cosine:
  a linear warm-up over the first tenth of the budget to the peak, then a cosine decay that
  stays above 0."""
  np.testing.assert_array_equal(_learned_module.learning_rates("constant", 1e-2, 5),
                                [1e-2] * 5)
  rates = _learned_module.learning_rates("warmup_cosine", 0.3, 20)
  np.testing.assert_allclose(rates[:3], [0.15, 0.3, 0.3], rtol=1e-15)
  i = np.arange(2, 20)
  np.testing.assert_allclose(rates[2:], 0.3 * (1 + np.cos(np.pi * (i - 2) / 18)) / 2,
                             rtol=1e-12)
  assert np.all(np.diff(rates[1:]) <= 0) and rates.min() > 0 and rates[-1] < 0.01
  assert _learned_module.learning_rates("warmup_cosine", 1.0, 1).tolist() == [1.0]
  with pytest.raises(ValueError, match="schedule must be one of constant, warmup_cosine"):
    _learned_module.learning_rates("linear", 1.0, 3)


# ----------------------------------------------------------------------------- unrelated pairs


@pytest.mark.slow
def test_learning_lowers_the_test_loss_of_the_midpoint():
  """Two models trained from different seeds: the learned element's midpoint has a lower
  loss on batches that learning never saw than the full method's (a lower barrier)."""
  spec, a, b = _trained_pair(False, dtype=jnp.float32)
  full, full_info = matching.align_model(spec, a, b)
  element, info = _learned(spec, a, b, False, **_uniform())
  learned = info["learned"]
  assert learned["best_step"] > 0
  assert learned["holdout"]["best"]["barrier"] < learned["holdout"]["initial"]["barrier"]
  assert float(info["distance"]["start"]) == float(full_info["distance"]["final"])
  test = _batches(TEST)
  apply = _apply(spec)
  ends = (_mean_loss(False, a, test) + _mean_loss(False, b, test)) / 2
  barrier_full = _mean_loss(False, _midpoint(a, apply(b, full)), test) - ends
  barrier_learned = _mean_loss(False, _midpoint(a, apply(b, element)), test) - ends
  assert barrier_learned < 0.9 * barrier_full


@pytest.mark.slow
def test_rope_matrices_stay_in_the_commutant(x64):
  """Under RoPE the learned QK matrices lie in H(H) (to 1e-6), though they moved, and the
  learned element is still a symmetry of B."""
  spec, a, b = _trained_pair(True)
  full, _ = matching.align_model(spec, a, b)
  element, info = _learned(spec, a, b, True)
  assert info["folded_norm_scales"] and info["learned"]["best_step"] > 0
  for name, site in spec.attention.items():
    qk = np.asarray(element[name].qk)
    projected = np.stack([_stage2.project_matrix(m, site) for m in qk])
    assert np.max(np.abs(projected - qk)) <= 1e-6 * np.max(np.abs(qk))
    assert np.max(np.abs(qk - np.asarray(full[name].qk))) > 1e-3 * np.max(np.abs(qk))
  a, b = _endpoints(spec, a, b, info)
  test = _batches(TEST, True)
  np.testing.assert_allclose(_mean_loss(True, _apply(spec)(b, element), test),
                             _mean_loss(True, b, test), rtol=1e-9)


# ----------------------------------------------------------------------------- dtypes and guards


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_float32_and_bfloat16_parameters(dtype):
  """Half precision is learned in float32: the element is float32, acts on the parameters
  in their dtype, and lowers the held-out barrier (lambda uniform here)."""
  spec, a, b = _trained_pair(False, dtype=dtype)
  element, info = _learned(spec, a, b, False, **_uniform())
  learned = info["learned"]
  assert learned["lambda"] == "uniform" and learned["skipped"] == 0
  assert learned["holdout"]["best"]["barrier"] < learned["holdout"]["initial"]["barrier"]
  for name in spec.attention:
    assert element[name].qk.dtype == element[name].vo.dtype == jnp.float32
    assert np.isfinite(element[name].qk).all() and np.isfinite(element[name].vo).all()
  moved = _apply(spec)(b, element)
  assert all(x.dtype == dtype for x in jax.tree.leaves(moved))
  assert all(np.isfinite(np.asarray(x, np.float32)).all() for x in jax.tree.leaves(moved))


@pytest.mark.slow
def test_non_finite_steps_are_skipped():
  """Training batches with a NaN target: exactly those steps are skipped, the rest learns."""
  spec, a, b = _trained_pair(False, dtype=jnp.float32)
  batches = _batches(TRAIN)
  for i in (2, 5):
    batches[i] = dict(batches[i], target=np.full_like(batches[i]["target"], np.nan))
  element, info = _learned(spec, a, b, False, batches=batches, **_uniform())
  learned = info["learned"]
  assert learned["steps"] == 24 and learned["skipped"] == 6  # batches 2 and 5, three times each
  assert learned["holdout"]["best"]["barrier"] < learned["holdout"]["initial"]["barrier"]
  assert all(np.isfinite(element[n].qk).all() for n in spec.attention)


@pytest.mark.slow
def test_steps_past_the_condition_bound_are_skipped(monkeypatch):
  """With a bound that no matrix meets (||M||_F ||M^-1||_F >= H), every step is skipped and
  the start comes back (``learn_alignment`` from the full method's result)."""
  spec, a, b = _trained_pair(False, dtype=jnp.float32)
  start = matching.align_model(spec, a, b)
  monkeypatch.setattr(_stage2, "max_condition", lambda dtype: 1.0)  # read outside jit
  element, info = matching.learn_alignment(
      spec, a, b, start, names=matching.active_names(spec, None), factors=("attention",),
      loss_fn=_loss_gl, batches=_batches(TRAIN),
      holdout_batches=_batches(HOLDOUT), steps=24, learning_rate=1e-2, **_uniform())
  assert info["learned"]["skipped"] == 24 and info["learned"]["best_step"] == 0
  jax.tree.map(np.testing.assert_array_equal, element, start[0])


# ----------------------------------------------------------------------------- data and compiles


class _Counting:
  """An iterator over ``items`` that records how many were read."""

  def __init__(self, items):
    self.items, self.read = list(items), 0

  def __iter__(self):
    return self

  def __next__(self):
    if self.read == len(self.items):
      raise StopIteration
    self.read += 1
    return self.items[self.read - 1]


class _Recording(list):
  """A list that records the ids of the items iterated over."""

  def __init__(self, items):
    super().__init__(items)
    self.given, self.seen = [id(x) for x in items], []

  def __iter__(self):
    for item in super().__iter__():
      self.seen.append(id(item))
      yield item


@pytest.mark.slow
def test_reads_only_the_batches_given_and_compiles_one_step():
  """Exactly ``steps`` training batches are read, the held-out ones only for evaluation (the
  test split is no argument), progress is reported, and the step compiles once for all."""
  from attn_symmetry.matching import _learned as learned_lib  # pylint: disable=import-outside-toplevel
  spec, a, b = _pair(False, dtype=jnp.float32)
  train, holdout = _batches(TRAIN) * 4, _Recording(_batches(HOLDOUT))
  options = _uniform()
  sizes = [learned_lib._step_jit._cache_size()]  # pylint: disable=protected-access
  for seeds in ((0, 1), (2, 3)):
    _, a, b = _pair(False, seeds, dtype=jnp.float32)
    batches, lines, holdout.seen = _Counting(train), [], []
    _, info = _learned(spec, a, b, False, batches=batches, holdout_batches=holdout,
                       progress=lines.append, **options)
    sizes.append(learned_lib._step_jit._cache_size())  # pylint: disable=protected-access
    assert batches.read == info["learned"]["steps"] == 24
    assert [line["step"] for line in lines] == [6, 12, 18, 24]
    assert holdout.seen == holdout.given * 5  # the start and 4 evaluations
  assert sizes[1] - sizes[0] <= 1 and sizes[2] == sizes[1]
  batches = _Counting(train[:10])  # an iterator that ends early ends the training
  _, info = _learned(spec, a, b, False, batches=batches, **options)
  assert batches.read == info["learned"]["steps"] == 10


@pytest.mark.slow
def test_scope_without_a_symmetry_returns_the_full_element():
  """A scope that holds no factor and no site (the head alone: the residual stream also acts
  elsewhere): the start comes back and no batch is read."""
  spec, a, b = _pair(False, dtype=jnp.float32)
  batches = _Counting(_batches(TRAIN))
  element, info = _learned(spec, a, b, False, scope=["head"], batches=batches, **_uniform())
  full, _ = matching.align_model(spec, a, b, scope=["head"])
  assert info["learned"]["factors"] == [] and "no symmetry in scope" in info["learned"]["note"]
  assert batches.read == 0
  jax.tree.map(np.testing.assert_array_equal, element, full)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("options, message", [
    (dict(loss_fn=None), "needs loss_fn"),
    (dict(batches=None), "needs batches"),
    (dict(holdout_batches=[]), "needs holdout_batches"),
    (dict(learn_steps=-1), "learn_steps must be"),
    (dict(learn_learning_rate=0.0), "learn_learning_rate must be"),
    (dict(learn_uniform_lambda="yes"), "learn_uniform_lambda must be true or false"),
    (dict(learn_uniform_lambda=True), "pass key"),
    (dict(eval_every=0), "eval_every must be"),
    (dict(learn_schedule="cosine"), "learn_schedule must be one of constant, warmup_cosine"),
    (dict(learn_patience=-1), "learn_patience must be a non-negative integer"),
    (dict(lamda=0.5), r"unknown options \['lamda'\] of method 'learned'"),
])
def test_bad_options_name_the_argument(options, message):
  spec, a, b = _pair(False, dtype=jnp.float32)
  options = dict(dict(loss_fn=_loss_gl, batches=[{}], holdout_batches=[{}], learn_steps=1),
                 **options)
  with pytest.raises(ValueError, match=message):
    matching.align_model(spec, a, b, method="learned", **options)


def test_learned_needs_align_model():
  spec, a, b = _pair(False, dtype=jnp.float32)
  with pytest.raises(ValueError, match="align_model"):
    matching.match_attention(a["layers_0"]["attention"], b["layers_0"]["attention"],
                             spec.attention["layers_0/attention"], method="learned")
  with pytest.raises(ValueError, match="method 'learned'"):
    matching.align_model(spec, a, b, method="full", loss_fn=_loss_gl)
