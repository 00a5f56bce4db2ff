"""Learned alignment of every factor (``factors`` of method "learned"): exactness of the
result and of the straight-through forward pass on every model family, the permutation
estimator on a planted pair, and the option checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn_symmetry import group_action as ga
from attn_symmetry import matching
from attn_symmetry import models
from attn_symmetry import spec as spec_lib
from attn_symmetry.matching import _correction
from tests import test_learned as learned_tests
from tests import tiny_transformer as tiny

FAMILIES = {"vit": {}, "bert": {}, "gpt2": {}, "llama-gqa": dict(num_kv_heads=2),
            "gpt_neox-parallel": dict(parallel_residual=True),
            "gpt2-orthogonal": dict(tied_embeddings=False)}  # the O(d - 1) residual


def _spec(case, model):
  """The spec whose factors the case trains: "-orthogonal" with the O(d - 1) residual."""
  residual = "orthogonal" if case.endswith("-orthogonal") else "permutation"
  return matching.residual_spec(model.spec, residual)


def _model(case):
  return models.build(case.rsplit("-", 1)[0] if "-" in case else case, "tiny", **FAMILIES[case])


def _inputs(model):
  cfg, rng = model.config, np.random.default_rng(0)
  if cfg.family == "vit":
    return jnp.asarray(rng.normal(size=(2, cfg.image_size, cfg.image_size, cfg.num_channels)),
                       jnp.float32)
  return jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 8)), jnp.int32)


def _random_correction(plan, dtype, key):
  """Correction parameters far from the identity: random scores, skew parameters and D."""
  params = _correction.init(plan, dtype)
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(key, len(leaves))
  noisy = [x + (1.0 if x.shape[-1] == x.shape[-2] else 0.3) * jax.random.normal(k, x.shape, dtype)
           for x, k in zip(leaves, keys)]
  return jax.tree.unflatten(tree, noisy)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(FAMILIES))
def test_every_factor_keeps_the_function_and_the_forward_is_the_hard_element(case, x64):
  """Random correction parameters of every factor, in float64: the composed element (hard
  permutations, Cayley matrix, on 1-perp for the O(d - 1) residual, I + D) keeps B's outputs
  to 1e-9, it moved every factor away
  from the start, and the straight-through forward pass of training computes exactly its
  action on g0 . B (no soft matrix in the forward pass), to 1e-9. (In float32 the two
  differ by rounding alone, up to 6e-5 relative on GPT-NeoX's keys, whose far-from-identity
  random matrices compound it.)"""
  model = _model(case)
  spec = _spec(case, model)
  b = jax.tree.map(lambda x: x.astype(jnp.float64), model.init(jax.random.key(1)))
  b = ga.canonical_form(spec, b)  # an orthogonal residual needs folded scales (and its gauge)
  names = matching.active_names(spec, None)
  factors = _correction.resolve(spec, names, None)
  assert set(factors) == set(_correction.FACTORS)
  plan = _correction.plan(spec, names, factors, spec_lib.flatten(b))
  start = ga.random_model_element(jax.random.key(2), spec, dtype=jnp.float64)
  moved_b = ga.apply_model(spec, b, start)
  params = _random_correction(plan, jnp.float64, jax.random.key(3))
  element = _correction.compose(params, plan, start)
  for name in names:  # every factor and site moved
    assert any(not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(element[name]),
                                                          jax.tree.leaves(start[name]))), name
  residual = element.get("residual")
  if residual is not None and residual.ndim == 2:
    np.testing.assert_allclose(residual.T @ residual, np.eye(residual.shape[0]), atol=1e-12)
    if spec.factors["residual"].kind == "mean_zero_orthogonal":
      np.testing.assert_allclose(residual.sum(-1), 1.0, atol=1e-12)
  aligned = ga.apply_model(spec, b, element)
  apply = jax.jit(model.apply)
  inputs = _inputs(model)
  logits, aligned_logits = apply(b, inputs)[0], apply(aligned, inputs)[0]
  scale = float(jnp.max(jnp.abs(logits)))
  assert float(jnp.max(jnp.abs(aligned_logits - logits))) <= 1e-9 * max(scale, 1.0)
  forward = jax.jit(lambda flat, q: _correction.act(flat, q, plan))(spec_lib.flatten(moved_b),
                                                                     params)
  for path, leaf in spec_lib.flatten(aligned).items():
    np.testing.assert_allclose(forward[path], leaf, rtol=1e-9, atol=1e-12, err_msg=path)


# ----------------------------------------------------------------------------- planted pair


def _distil(params, batch):
  """Regression onto the outputs of model A: 0 exactly where the model computes A."""
  return jnp.mean((tiny.apply(params, batch["tokens"]) - batch["target"]) ** 2)


@pytest.mark.slow
def test_estimator_recovers_a_planted_ffn_permutation():
  """B = A with layer 0's FFN units permuted; the start is right but for a 3-cycle and a
  transposition of five units. Only the FFN scores are trained, on a loss that is 0 exactly at
  the planted permutation (the midpoint is A there): the returned permutation is the planted
  one, and the held-out barrier falls to 0."""
  spec, a, _ = learned_tests._trained_pair(False, dtype=jnp.float32)
  planted = np.random.default_rng(0).permutation(tiny.HIDDEN)
  element = ga.identity_model(spec, jnp.float32)
  b = ga.apply_model(spec, a, dict(element, **{"layers_0/mlp": jnp.asarray(planted)}))
  target = np.argsort(planted)  # (g . B)[j] = B[g[j]] = A[j]
  wrong = target.copy()
  wrong[[0, 1, 2]], wrong[[5, 9]] = target[[1, 2, 0]], target[[9, 5]]
  start = dict(element, **{"layers_0/mlp": jnp.asarray(wrong, jnp.int32)})
  batches = [dict(x, target=np.asarray(learned_tests._model_apply(a, x["tokens"], rms=False)))
             for x in learned_tests._batches(learned_tests.TRAIN)]
  holdout = [dict(x, target=np.asarray(learned_tests._model_apply(a, x["tokens"], rms=False)))
             for x in learned_tests._batches(learned_tests.HOLDOUT)]
  out, info = matching.learn_alignment(
      spec, a, b, (start, {"folded_norm_scales": False}), names=["layers_0/mlp"], factors="ffn",
      loss_fn=_distil, batches=batches, holdout_batches=holdout, steps=24, learning_rate=0.3,
      lam=0.1, eval_every=1)
  learned = info["learned"]
  assert learned["factors"] == ["ffn"] and learned["names"] == ["layers_0/mlp"]
  assert learned["holdout"]["initial"]["barrier"] > 1e-4
  np.testing.assert_array_equal(out["layers_0/mlp"], target)
  assert learned["holdout"]["best"]["barrier"] <= 1e-6
  for name in spec.attention:  # untouched names keep the start bit for bit
    jax.tree.map(np.testing.assert_array_equal, out[name], start[name])


@pytest.mark.slow
def test_loss_of_the_parameters_not_the_function_is_refused():
  """A loss_fn that reads a raw weight is not invariant under the group: the final check
  refuses the element and names the measured difference."""
  spec, a, b = learned_tests._pair(False, dtype=jnp.float32)

  def reads_a_weight(params, batch):
    return learned_tests._loss_gl(params, batch) + jnp.sum(params["layers_0"]["mlp"]["wi"]["bias"][:3])

  with pytest.raises(ValueError, match=r"changes model B's function: .*difference"):
    matching.align_model(spec, a, b, method="learned", factors=["ffn"], loss_fn=reads_a_weight,
                         batches=learned_tests._batches(learned_tests.TRAIN),
                         holdout_batches=learned_tests._batches(learned_tests.HOLDOUT),
                         learn_steps=2, learn_learning_rate=1e-2)


# ----------------------------------------------------------------------------- options


@pytest.mark.parametrize("scope, factors, message", [
    (None, ["heads", "gates"], r"factors \['gates'\] unknown"),
    (None, [], "non-empty list"),
    (["layers_0/mlp"], ["attention"], r"no 'attention' symmetry in this scope; it has ffn$"),
    (["layers_0/attention"], "ffn", r"no 'ffn' symmetry in this scope; it has attention, heads"),
])
def test_factor_options_are_checked_before_any_work(scope, factors, message):
  spec, a, b = learned_tests._pair(False, dtype=jnp.float32)
  with pytest.raises(ValueError, match=message):
    matching.align_model(spec, a, b, method="learned", scope=scope, factors=factors,
                         loss_fn=learned_tests._loss_gl, batches=[{}], holdout_batches=[{}],
                         learn_steps=1, learn_learning_rate=1e-2)


def test_residual_factor_follows_the_model():
  """"residual" names the stream's factor whatever its kind, and fails where the stream has
  no symmetry (fixed sinusoidal positions)."""
  llama, gpt2 = models.build("llama").spec, models.build("gpt2", pos_encoding="sinusoidal").spec
  assert llama.factors[_correction.RESIDUAL].kind == "orthogonal"
  assert _correction.resolve(llama, matching.active_names(llama, None), "residual") == ("residual",)
  with pytest.raises(ValueError, match="no 'residual' symmetry in this scope; it has attention, "
                                       "heads, ffn$"):
    _correction.resolve(gpt2, matching.active_names(gpt2, None), ["residual"])


def test_factors_is_an_option_of_learned_only():
  assert "factors" in matching.METHODS["learned"].options
  assert "factors" not in matching.METHODS["full"].options
  spec, a, b = learned_tests._pair(False, dtype=jnp.float32)
  with pytest.raises(ValueError, match=r"\['factors'\] are options of method 'learned' only"):
    matching.align_model(spec, a, b, method="full", factors=["ffn"])
