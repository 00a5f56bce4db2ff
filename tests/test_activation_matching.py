"""Activation matching (``align_model(method="activation")``) on every model family, and the
learned method's start (``learn_init``) and band of lambda (``learn_lam_band``).

Planted pairs: B = g . A for a random element g of the family's group (norm scales folded
where the residual is orthogonal); the element found from the two models' activations
(``Model.activations``) brings B back to A to rounding in float64 and keeps B's function.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from attn_symmetry import group_action as ga
from attn_symmetry import matching
from attn_symmetry import models
from attn_symmetry import spec as spec_lib
from attn_symmetry.matching import _activation

# Overrides that exercise a family's whole group: grouped-query attention for Llama.
OVERRIDES = {"llama": dict(num_kv_heads=2)}


@functools.lru_cache(maxsize=None)
def _model(family: str) -> models.Model:
  return models.build(family, "tiny", **OVERRIDES.get(family, {}))


def _inputs(model, seed, batch=4):
  rng = np.random.default_rng(seed)
  if model.input_key == "image":
    c = model.config
    return rng.normal(size=(batch, c.image_size, c.image_size, c.num_channels))
  return rng.integers(0, model.config.vocab_size, size=(batch, model.config.max_len))


@functools.lru_cache(maxsize=None)
def _apply(family):
  return jax.jit(lambda params, x: _model(family).apply(params, x)[0])


@functools.lru_cache(maxsize=None)
def _act(family):
  return jax.jit(functools.partial(ga.apply_model, _model(family).spec))


def _float64(params):
  return jax.tree.map(lambda x: np.asarray(x, np.float64), params)


def _planted(family, seed=0):
  """(A, B = g . fold(A), g) in float64."""
  model = _model(family)
  a = _float64(model.init(jax.random.key(seed)))
  g = ga.random_model_element(jax.random.key(seed + 100), model.spec, dtype=jnp.float64)
  folded = ga.fold_norm_scales(model.spec, a) if model.spec.norm_scales else a
  return a, jax.tree.map(np.asarray, _act(family)(folded, g)), g


def _max_relative_error(x, y):
  x, y = spec_lib.flatten(x), spec_lib.flatten(y)
  return max(np.linalg.norm(np.asarray(y[p]) - v) / max(np.linalg.norm(v), 1e-300)
             for p, v in x.items())


@pytest.mark.parametrize("family", list(models.FAMILIES))
def test_planted_recovery_by_activations(x64, family):
  """Every factor and site recovered: the permutations exactly, the matrices to rounding;
  aligned B equals (folded) A and computes B's function."""
  model = _model(family)
  spec = model.spec
  a, b, g = _planted(family)
  batches = [_inputs(model, 1), _inputs(model, 2)]
  element, info = matching.align_model(spec, a, b, method="activation",
                                       activations=model.activations, match_batches=batches)
  assert info["folded_norm_scales"] == bool(spec.norm_scales)
  assert info["batches"] == 2
  ga.check_model_element(spec, element)  # an exact group element
  aligned = jax.tree.map(np.asarray, _act(family)(b, element))
  target = ga.fold_norm_scales(spec, a) if info["folded_norm_scales"] else a
  assert _max_relative_error(target, aligned) <= 1e-9
  assert float(info["distance"]["final"]) <= 1e-18 * float(info["distance"]["initial"])
  for name, factor in spec.factors.items():
    if factor.kind == "permutation":
      np.testing.assert_array_equal(element[name], np.argsort(g[name]), err_msg=name)
  for name in spec.attention:
    np.testing.assert_array_equal(element[name].perm, np.argsort(g[name].perm), err_msg=name)
  x = _inputs(model, 3)
  np.testing.assert_allclose(_apply(family)(aligned, x), _apply(family)(b, x), rtol=0,
                             atol=1e-9)


def test_independent_pair_keeps_b_function(x64):
  """Two independent models (no planted element): the element is exact, aligned B computes
  B's function, and a scope leaves the rest identity."""
  family = "llama"
  model = _model(family)
  a, b = (_float64(model.init(jax.random.key(s))) for s in (5, 6))
  batches = [_inputs(model, 7)]
  element, info = matching.align_model(model.spec, a, b, method="activation",
                                       activations=model.activations, match_batches=batches,
                                       scope="layers_0")
  ga.check_model_element(model.spec, element)
  folded = ga.fold_norm_scales(model.spec, b) if info["folded_norm_scales"] else b
  aligned = _act(family)(folded, element)
  x = _inputs(model, 8)
  np.testing.assert_allclose(_apply(family)(aligned, x), _apply(family)(b, x), rtol=0,
                             atol=1e-9)
  np.testing.assert_array_equal(element["layers_1/mlp"], np.arange(model.config.mlp_dim))
  np.testing.assert_array_equal(element["layers_1/attention"].qk,
                                np.broadcast_to(np.eye(model.config.head_dim),
                                                element["layers_1/attention"].qk.shape))


def _poisoned(model, key, which):
  """``model.activations`` with NaN in entry ``key`` of the model whose first leaf is
  ``which``'s."""
  first = lambda params: next(iter(spec_lib.flatten(params).values()))

  def activations(params, batch):
    out = dict(model.activations(params, batch))
    hit = jnp.all(first(params) == first(which))
    out[key] = jnp.where(hit, jnp.nan, out[key])
    return out
  return activations


@pytest.mark.parametrize("key", ["layers_1/attention:q", "layers_0/mlp", "residual:layers_1"])
def test_non_finite_activations_are_refused_naming_the_tap(x64, key):
  model = _model("gpt2")
  a, b, _ = _planted("gpt2")
  with pytest.raises(ValueError, match=f"^activations of model B on match batch 0: '{key}' "
                                       "has NaN or Inf entries$"):
    matching.align_model(model.spec, a, b, method="activation",
                         activations=_poisoned(model, key, b), match_batches=[_inputs(model, 1)])


def _dropping(model, key):
  def activations(params, batch):
    return {k: v for k, v in model.activations(params, batch).items() if k != key}
  return activations


@pytest.mark.parametrize("kwargs,message", [
    (dict(activations=None, match_batches=[0]), "method 'activation' needs activations"),
    (dict(activations=len, match_batches=[]), "needs match_batches, a non-empty list"),
    (dict(activations=len, match_batches="tokens"), "needs match_batches"),
    (dict(method="full", activations=len, match_batches=[0]),
     "activations and match_batches are read by method 'activation'"),
    (dict(method="learned", activations=len, match_batches=[0]),
     "not by 'learned' with learn_init='full'"),
    (dict(learn_init="activation"), r"\['learn_init'\] are options of method 'learned' only"),
    (dict(method="full", learn_lam_band=10), r"\['learn_lam_band'\] are options of method"),
    (dict(method="learned", learn_init="bogus"), "learn_init must be one of full, activation"),
    (dict(method="learned", learn_lam_band=-1), "learn_lam_band must be a non-negative integer"),
    (dict(method="learned", learn_lam_band=0.1), "learn_lam_band must be a non-negative integer"),
])
def test_bad_options_are_refused_before_any_work(kwargs, message):
  model = _model("gpt2")
  params = model.init(jax.random.key(0))
  kwargs = dict(dict(method="activation"), **kwargs)
  with pytest.raises(ValueError, match=message):
    matching.align_model(model.spec, params, params, **kwargs)


@pytest.mark.parametrize("key,message", [
    ("layers_1/attention:heads", r"no entry 'layers_1/attention:heads' for attention site"),
    ("layers_0/mlp", r"no entry for factor 'layers_0/mlp'"),
])
def test_missing_activations_are_refused_naming_the_key(key, message):
  model = _model("gpt2")
  params = model.init(jax.random.key(0))
  with pytest.raises(ValueError, match=f"^activations: {message}"):
    matching.align_model(model.spec, params, params, method="activation",
                         activations=_dropping(model, key), match_batches=[_inputs(model, 1)])


def test_wrong_activation_shape_is_refused_naming_the_key():
  model = _model("gpt2")
  params = model.init(jax.random.key(0))

  def activations(params, batch):
    out = dict(model.activations(params, batch))
    out["layers_0/mlp"] = out["layers_0/mlp"][..., :3]
    return out
  with pytest.raises(ValueError, match=r"^activations\['layers_0/mlp'\] has shape \(4, 16, 3\)"):
    matching.align_model(model.spec, params, params, method="activation",
                         activations=activations, match_batches=[_inputs(model, 1)])


def test_one_program_for_equal_specs_and_batches(x64, monkeypatch):
  """The sums and the solves are compiled once per shape, not per layer or pair: an entry's
  sums per (kind, entry shape), first or added (the residual's and the FFNs'), a site's per
  first or added, a factor's solve per size, the sites' once for the layers of one shape."""
  model = _model("gpt2")
  for name, static, most in (("_add_factor", ("kind",), 4), ("_add_site", (), 2),
                             ("_solve_factor", ("kind",), 2),
                             ("_solve_sites", ("site", "steps"), 1)):
    counted = jax.jit(chex.assert_max_traces(getattr(_activation, name).__wrapped__, n=most),
                      static_argnames=static)
    monkeypatch.setattr(_activation, name, counted)
  for seed in (0, 1):
    a, b, _ = _planted("gpt2", seed)
    matching.align_model(model.spec, a, b, method="activation", activations=model.activations,
                         match_batches=[_inputs(model, 1), _inputs(model, 2)])


def test_model_activations_keep_apply_unchanged():
  """``Model.activations``'s stream and FFN entries are ``apply``'s intermediates; ``apply``
  returns no taps."""
  model = _model("gpt2")
  params = model.init(jax.random.key(0))
  x = _inputs(model, 1)
  _, inter = model.apply(params, x)
  acts = model.activations(params, x)
  assert not any(":" in k for k in inter)
  for i in range(model.config.depth):
    np.testing.assert_array_equal(acts[f"layers_{i}/mlp"], inter[f"layers_{i}/mlp"])
    np.testing.assert_array_equal(acts[f"residual:layers_{i}/attention"],
                                  inter[f"layers_{i}/attention"])
    np.testing.assert_array_equal(acts[f"residual:layers_{i}"], inter[f"layers_{i}"])
  np.testing.assert_array_equal(acts["residual:embed"], inter["embed"])


# ----------------------------------------------------------------------------- learned


def _lm_loss(params, batch):
  logits = _model("gpt2").apply(params, batch[:, :-1])[0]
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def _learned(a, b, **options):
  model = _model("gpt2")
  return matching.align_model(model.spec, a, b, method="learned", loss_fn=_lm_loss,
                              batches=[_inputs(model, s) for s in (10, 11)],
                              holdout_batches=[_inputs(model, 12)], learn_steps=2, **options)


def test_learned_defaults_are_the_full_start_with_fixed_lambda(x64):
  """learn_init "full" and learn_lam_band 0 (the defaults) are the learned method as it was:
  the same element as without them; the band draws lambda and says so."""
  a, b = (_float64(_model("gpt2").init(jax.random.key(s))) for s in (0, 1))
  default, info = _learned(a, b)
  same, _ = _learned(a, b, learn_init="full", learn_lam_band=0)
  chex.assert_trees_all_equal(default, same)
  assert "lambda_band" not in info["learned"]
  _, banded = _learned(a, b, learn_lam_band=10, key=jax.random.key(0))
  assert banded["learned"]["lambda_band"] == pytest.approx(0.1)


def test_learned_from_activations_on_a_planted_pair(x64):
  """learn_init "activation": the start is the activation method's element, which on a
  planted pair has held-out barrier 0, so it comes back as it is."""
  model = _model("gpt2")
  a, b, _ = _planted("gpt2")
  batches = [_inputs(model, 1)]
  start, _ = matching.align_model(model.spec, a, b, method="activation",
                                  activations=model.activations, match_batches=batches)
  element, info = _learned(a, b, learn_init="activation", activations=model.activations,
                           match_batches=batches)
  assert info["learned"]["best_step"] == 0
  chex.assert_trees_all_close(element, start, atol=1e-12)


@pytest.mark.parametrize("options,message", [
    (dict(learn_lam_band=10), "lam_band > 0 draws lambda at random: pass key"),
    (dict(learn_lam_band=50, key=jax.random.key(0)), r"must lie in \(0, 1\]"),
    (dict(learn_lam_band=10, learn_uniform_lambda=True, key=jax.random.key(0)),
     "pass one of them"),
    (dict(lam_band=0.1), "is the matching option learn_lam_band"),
    (dict(learn_init="activation"), "method 'activation' needs activations"),
])
def test_learned_start_and_band_checks(options, message):
  params = _model("gpt2").init(jax.random.key(0))
  with pytest.raises(ValueError, match=message):
    _learned(params, params, **options)


def test_batch_activations_read_the_batch_entry_and_its_mask():
  model = _model("bert")
  params = model.init(jax.random.key(0))
  tokens = _inputs(model, 1)
  mask = np.arange(tokens.shape[1]) < 5
  mask = np.broadcast_to(mask, tokens.shape)
  got = model.batch_activations(params, {"tokens": tokens, "mask": mask, "label": 0})
  want = model.activations(params, tokens, mask=mask)
  chex.assert_trees_all_equal(got, want)
