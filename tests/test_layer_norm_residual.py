"""Weight Matching with the O(d - 1) residual of a pre-LayerNorm model (``residual="orthogonal"``):
a planted GPT-2 pair in another gauge is recovered, the permutation residual stays available."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn_symmetry import group_action as ga
from attn_symmetry import matching
from attn_symmetry import models
from attn_symmetry import spec as spec_lib
from attn_symmetry.matching import _correction

R = "residual"


def _regauged(spec, params, rng):
  """``params`` in another gauge, the same function: a random multiple of 1 added to every
  vector a writer adds to the stream, every LayerNorm's gain and bias scaled by e^N(0, 1/4)
  and its readers divided by it."""
  flat = spec_lib.flatten(params)
  stream = spec.streams[R]
  for path in stream.writers:
    shape = list(flat[path].shape)
    shape[spec.axes[path].index(R)] = 1
    flat[path] = flat[path] + rng.normal(size=shape)
  for scale, (bias, readers) in stream.norms.items():
    gain = jnp.asarray(np.exp(0.5 * rng.normal(size=flat[scale].shape)))
    flat[scale], flat[bias] = flat[scale] * gain, flat[bias] * gain
    for reader in readers:
      flat[reader] = flat[reader] / gain.reshape(-1, *[1] * (flat[reader].ndim - 1))
  return spec_lib.unflatten(flat)


def _planted_pair():
  """(model, A, B, tokens): a tiny untied GPT-2 A in float64 (every leaf perturbed) and B, A
  moved by a random Q with Q 1 = 1 and head and FFN permutations, then put in another gauge."""
  model = models.build("gpt2", "tiny", tied_embeddings=False)
  spec = model.spec.with_residual(R, "mean_zero_orthogonal")
  rng = np.random.default_rng(0)
  flat = spec_lib.flatten(model.init(jax.random.key(0)))
  a = spec_lib.unflatten({p: jnp.asarray(x, jnp.float64) + 0.3 * rng.normal(size=x.shape)
                          for p, x in flat.items()})
  g = ga.random_model_element(jax.random.key(5), spec, attention_group="permutation")
  b = _regauged(spec, ga.apply_model(spec, ga.canonical_form(spec, a), g), rng)
  tokens = jnp.asarray(rng.integers(0, model.config.vocab_size, (2, 7)), jnp.int32)
  return model, a, b, tokens


def _aligned(model, a, b, residual, method="perm", **arguments):
  """(A, B aligned, the element, the info), the models in the gauge-free form of the spec
  the element belongs to."""
  element, info = matching.align_model(model.spec, a, b, method=method, residual=residual,
                                       **arguments)
  spec = matching.residual_spec(model.spec, residual)
  form = (lambda p: ga.canonical_form(spec, p)) if info["folded_norm_scales"] else (lambda p: p)
  return form(a), ga.apply_model(spec, form(b), element), element, info


def _relative(a, b):
  fa, fb = spec_lib.flatten(a), spec_lib.flatten(b)
  num = sum(float(jnp.sum((fa[p] - fb[p]) ** 2)) for p in fa)
  return np.sqrt(num / sum(float(jnp.sum(x ** 2)) for x in fa.values()))


def test_planted_mean_zero_orthogonal_pair_is_recovered(x64):
  """The orthogonal residual recovers B to rounding in the gauge-free form and keeps B's
  logits; the permutation residual (the default) cannot."""
  model, a, b, tokens = _planted_pair()
  logits_b = model.apply(b, tokens)[0]
  assert float(jnp.max(jnp.abs(logits_b - model.apply(a, tokens)[0]))) <= 1e-9
  canonical_a, moved, element, info = _aligned(model, a, b, "orthogonal")
  assert info["folded_norm_scales"]
  q = element[R]
  np.testing.assert_allclose(q @ jnp.ones(q.shape[0]), 1.0, atol=1e-12)
  assert _relative(canonical_a, moved) <= 1e-4
  assert float(jnp.max(jnp.abs(model.apply(moved, tokens)[0] - logits_b))) <= 1e-9
  _, permuted, element, info = _aligned(model, a, b, "permutation")
  assert not info["folded_norm_scales"] and element[R].ndim == 1
  assert _relative(a, permuted) > 0.1


def test_planted_pair_is_recovered_from_activations(x64):
  """Method "activation" with the orthogonal residual: Q from the stream's activations
  (Procrustes on the 1-perp block), heads and FFN units from theirs; B comes back to A in the
  gauge-free form and keeps its logits."""
  model, a, b, tokens = _planted_pair()
  rng = np.random.default_rng(1)
  batches = [jnp.asarray(rng.integers(0, model.config.vocab_size, (4, 16)), jnp.int32)
             for _ in range(2)]
  canonical_a, moved, element, info = _aligned(
      model, a, b, "orthogonal", method="activation", activations=model.activations,
      match_batches=batches)
  assert info["folded_norm_scales"]
  q = element[R]
  np.testing.assert_allclose(q @ jnp.ones(q.shape[0]), 1.0, atol=1e-12)
  np.testing.assert_allclose(q.T @ q, np.eye(q.shape[0]), atol=1e-12)
  assert _relative(canonical_a, moved) <= 1e-4
  logits_b = model.apply(b, tokens)[0]
  assert float(jnp.max(jnp.abs(model.apply(moved, tokens)[0] - logits_b))) <= 1e-9


def test_learned_parametrisation_is_a_group_element(x64):
  """The learned correction of the O(d - 1) residual, U diag(1, cayley(S)) U^T on 1-perp:
  for any W an orthogonal map that fixes 1 (to rounding), and the identity exactly at the
  start (W = 0)."""
  w = jax.random.normal(jax.random.key(0), (3, 31, 31), jnp.float64)
  q = _correction.orthogonal(w, "mean_zero_orthogonal")
  assert q.shape == (3, 32, 32)
  np.testing.assert_allclose(q @ jnp.ones(32), 1.0, atol=1e-12)
  np.testing.assert_allclose(jnp.swapaxes(q, -1, -2) @ q, np.broadcast_to(np.eye(32), q.shape),
                             atol=1e-12)
  assert float(jnp.min(jnp.linalg.norm(q - jnp.eye(32), axis=(-2, -1)))) > 0.5
  start = _correction.orthogonal(jnp.zeros((1, 31, 31), jnp.float64), "mean_zero_orthogonal")
  np.testing.assert_array_equal(start[0], np.eye(32))


def test_learned_returns_the_exact_start_on_a_planted_pair(x64):
  """Method "learned" with the orthogonal residual, started from "activation" and training
  every factor (the residual by Cayley on 1-perp): on the planted pair its start's held-out
  barrier is already 0, so the start comes back bit for bit."""
  model, a, b, tokens = _planted_pair()
  rng = np.random.default_rng(1)
  batches = [jnp.asarray(rng.integers(0, model.config.vocab_size, (4, 16)), jnp.int32)
             for _ in range(3)]

  def loss_fn(params, batch):
    logits = model.apply(params, batch)[0][:, :-1]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), batch[:, 1:, None], -1))

  inputs = dict(activations=model.activations, match_batches=batches[:2])
  start, _ = matching.align_model(model.spec, a, b, method="activation", residual="orthogonal",
                                  **inputs)
  element, info = matching.align_model(
      model.spec, a, b, method="learned", residual="orthogonal", learn_init="activation",
      learn_steps=2, loss_fn=loss_fn, batches=batches[:2], holdout_batches=batches[2:], **inputs)
  learned = info["learned"]
  assert learned["factors"] == list(_correction.FACTORS) and R in learned["names"]
  assert learned["best_step"] == 0 and learned["holdout"]["best"]["barrier"] <= 1e-9
  for x, y in zip(jax.tree.leaves(start), jax.tree.leaves(element)):
    np.testing.assert_array_equal(x, y)


def test_streamed_descent_is_the_in_memory_one(x64):
  """``align_model_streamed`` with the orthogonal residual brings each group of leaves to
  canonical form on its own (every LayerNorm's scale, bias and readers in one group) and gives
  ``align_model``'s element on the planted pair, to rounding."""
  model, a, b, _ = _planted_pair()
  flat_a, flat_b = spec_lib.flatten(a), spec_lib.flatten(b)
  read = lambda paths: ({p: flat_a[p] for p in paths}, {p: flat_b[p] for p in paths})
  shapes = {p: (x.shape, x.dtype) for p, x in flat_a.items()}
  want, _ = matching.align_model(model.spec, a, b, method="perm", residual="orthogonal")
  got, info = matching.align_model_streamed(model.spec, read, shapes, method="perm",
                                            residual="orthogonal")
  assert info["folded_norm_scales"] and set(got) == set(want)
  for x, y in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    np.testing.assert_allclose(x, y, atol=1e-10, rtol=0)


def test_orthogonal_residual_needs_a_layer_norm_stream(x64):
  """A tied head has no O(d - 1) residual; an RMSNorm stream keeps its own factor."""
  tied = models.build("gpt2", "tiny")
  params = tied.init(jax.random.key(0))
  with pytest.raises(ValueError, match="untied"):
    matching.align_model(tied.spec, params, params, method="perm", residual="orthogonal")
  llama = models.build("llama", "tiny").spec
  assert matching.residual_spec(llama, "orthogonal") == llama
  with pytest.raises(ValueError, match="residual must be one of"):
    matching.residual_spec(llama, "rotation")


@pytest.mark.slow
def test_the_study_aligns_with_the_orthogonal_residual(trained_workdir, tmp_path):
  """study.match_residual "orthogonal" on the quickstart ViT's full-model scope: the full
  method's element holds the O(d - 1) residual (a matrix that fixes 1), the endpoints it
  joins are the seeds' models in canonical form and aligned B computes B's function, and the
  study runs to its results; in a scope without the stream (first attention) it is the
  permutation residual's study."""
  from experiments.configs import quickstart  # pylint: disable=import-outside-toplevel
  from experiments.study import path_evaluation  # pylint: disable=import-outside-toplevel
  from experiments.study import scope_study  # pylint: disable=import-outside-toplevel
  from experiments.study import study  # pylint: disable=import-outside-toplevel
  from experiments.train import inputs, saved_runs  # pylint: disable=import-outside-toplevel
  config = quickstart.get_config("runlocal")
  config.reinit.scopes, config.reinit.seeds = ("full", "first_attention"), (1, 2)
  config.study.methods = ("naive", "full")
  config.study.permutation_ablation, config.study.distances = False, ()
  config.study.noise_levels = ()
  config.study.match_residual = "orthogonal"
  workdir, _ = trained_workdir(config, tmp_path / "w")
  paths = study.run_study(config, workdir)
  assert set(study.results_by_scope(paths)) == {"full", "first_attention"}
  model = inputs.create_model(config)
  checkpoints = saved_runs.load_checkpoints(config, workdir, require_complete=True)
  batches = path_evaluation.evaluation_examples(config, config.dataset.name)
  evaluator = path_evaluation.PathEvaluator(model, batches, chunk_size=1, bits_per_byte=False)
  scope = scope_study.ScopeStudy(config, model, "full", checkpoints, evaluator, workdir, "")
  assert scope.element_spec.factors["residual"].kind == "mean_zero_orthogonal"
  pa, aligned, info = scope.align(1, 2, "full")
  q = np.asarray(scope._element(1, 2, "full", scope._matching_options("full"))[0]["residual"])  # pylint: disable=protected-access
  np.testing.assert_allclose(q @ np.ones(len(q)), np.ones(len(q)), atol=1e-5)
  loss = lambda p: evaluator(p, p, np.zeros(1))["loss"][0]
  a, b = scope.params[1], scope.params[2]
  assert loss(pa) == pytest.approx(loss(a), rel=1e-4)
  assert loss(aligned) == pytest.approx(loss(b), rel=1e-4)
  first = scope_study.ScopeStudy(config, model, "first_attention", checkpoints, evaluator,
                                 workdir, "")
  assert first.element_spec is model.spec
