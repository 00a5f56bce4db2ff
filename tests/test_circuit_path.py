"""The circuit path (``attn_symmetry.circuit_path``): its endpoints, the circuits of its
interior heads, what it quotients out, RoPE refused, jit; in float64."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn_symmetry import attention
from attn_symmetry import circuit_path
from attn_symmetry import group_action as ga
from attn_symmetry import lmc
from attn_symmetry import models
from attn_symmetry import spec as spec_lib

D, N, H, T, B = 12, 4, 3, 5, 2
TOL = 1e-9


def _layer(seed, kv):
  rng = np.random.default_rng(seed)
  layer = attention.init_attention(jax.random.key(seed), width=D, num_heads=N, head_dim=H,
                                   num_kv_heads=kv, dtype=jnp.float64)
  return jax.tree.map(lambda x: x + 0.3 * rng.normal(size=x.shape), layer)  # non-zero biases


def _augmented(node):
  """W~ = [W; b]: [D + 1, heads, H]."""
  return jnp.concatenate([node["kernel"], node["bias"][None]], axis=0)


def _circuits(layer, kv):
  """(M^QK [N, D+1, D+1], M^VO [N, D+1, D]) of a canonical layer with biases."""
  group = N // attention.kv_heads(N, kv)
  q, k, v = (_augmented(layer[name]) for name in ("query", "key", "value"))
  k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)  # kv head k(n) per head n
  return (jnp.einsum("anh,bnh->nab", q, k), jnp.einsum("anh,nhd->nad", v, layer["out"]["kernel"]))


def _scores(layer, x):
  """The pre-softmax logits of every head, [B, N, T, T], at the layer's own head width."""
  taps = attention.attention_heads(layer, x)
  group = taps.q.shape[2] // taps.k.shape[2]
  k = jnp.repeat(taps.k, group, axis=2)
  return jnp.einsum("btnh,bsnh->bnts", taps.q, k) / np.sqrt(taps.q.shape[-1])


@pytest.mark.parametrize("kv", [None, 2])
@pytest.mark.parametrize("lam", [0.3, 0.75])
def test_each_head_carries_the_interpolated_circuits(x64, kv, lam):
  """At an interior lambda the widened layer's scores are (1 - lam) A's + lam B's, and its
  circuits M^QK / sqrt(2H) and M^VO are the interpolated ones (GQA too); the layer's output
  is the attention written out from the interpolated circuits."""
  a, b = _layer(0, kv), _layer(1, kv)
  mixed = circuit_path.interpolate_site(a, b, lam)
  assert mixed["query"]["kernel"].shape == (D, N, 2 * H)
  assert mixed["out"]["kernel"].shape == (N, 2 * H, D)
  x = jax.random.normal(jax.random.key(2), (B, T, D), jnp.float64)
  want = (1 - lam) * _scores(a, x) + lam * _scores(b, x)
  np.testing.assert_allclose(_scores(mixed, x), want, atol=TOL, rtol=0)
  (qk_a, vo_a), (qk_b, vo_b), (qk, vo) = (_circuits(p, kv) for p in (a, b, mixed))
  np.testing.assert_allclose(qk / np.sqrt(2 * H), ((1 - lam) * qk_a + lam * qk_b) / np.sqrt(H),
                             atol=TOL, rtol=0)
  np.testing.assert_allclose(vo, (1 - lam) * vo_a + lam * vo_b, atol=TOL, rtol=0)
  # the layer from the circuits alone: softmax_t(x~ M^QK x~^T / sqrt(H)) x~ M^VO + b^O
  xt = jnp.concatenate([x, jnp.ones((B, T, 1))], axis=-1)
  circuit_qk = (1 - lam) * qk_a + lam * qk_b
  weights = jax.nn.softmax(jnp.einsum("bta,nac,bsc->bnts", xt, circuit_qk, xt) / np.sqrt(H))
  bias = (1 - lam) * a["out"]["bias"] + lam * b["out"]["bias"]
  reference = jnp.einsum("bnts,bsa,nad->btd", weights, xt, (1 - lam) * vo_a + lam * vo_b) + bias
  np.testing.assert_allclose(attention.multi_head_attention(mixed, x), reference, atol=TOL,
                             rtol=0)


def _params64(model, seed):
  """Float64 parameters with every leaf perturbed (non-zero biases, non-unit norm scales)."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda x: jnp.asarray(x, jnp.float64) + 0.3 * rng.normal(size=x.shape),
                      model.init(jax.random.key(seed)))


def _inputs(model, seed):
  rng = np.random.default_rng(seed)
  cfg = model.config
  if model.input_key == "image":
    return jnp.asarray(rng.normal(size=(B, cfg.image_size, cfg.image_size, cfg.num_channels)))
  return jnp.asarray(rng.integers(0, cfg.vocab_size, (B, T)), jnp.int32)


@pytest.mark.parametrize("family, overrides", [
    ("gpt2", {}), ("vit", {}), ("bert", {}),
    ("llama", dict(pos_encoding="learned")),  # grouped-query attention, no biases, RMSNorm
])
def test_the_path_ends_compute_a_and_b(x64, family, overrides):
  model = models.build(family, "tiny", **overrides)
  wide = models.circuit_model(model)
  assert wide.config.head_dim == 2 * model.config.head_dim
  a, b, x = _params64(model, 0), _params64(model, 1), _inputs(model, 2)
  apply, apply_wide = jax.jit(model.apply), jax.jit(wide.apply)
  point = jax.jit(lambda pa, pb, lam: circuit_path.interpolate(model.spec, pa, pb, lam))
  for lam, end in ((0.0, a), (1.0, b)):
    np.testing.assert_allclose(apply_wide(point(a, b, lam), x)[0], apply(end, x)[0],
                               atol=TOL, rtol=0)


def _act(params, elements):
  """g . params for an element that moves the attention sites alone: ``elements`` {site:
  ``group_action.AttentionElement``}, the identity on every other factor of the model."""
  flat = spec_lib.flatten(params)
  for site, element in elements.items():
    moved = ga.apply(spec_lib.subtree(params, site), element)
    flat |= {f"{site}/{path}": leaf for path, leaf in spec_lib.flatten(moved).items()}
  return spec_lib.unflatten(flat)


def _loss(apply):
  def metric(params, tokens):
    logits = apply(params, tokens)[0][:, :-1]
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1)
    return {"loss": jnp.sum(nll), "count": jnp.asarray(nll.size, nll.dtype)}
  return metric


def test_circuit_space_quotients_out_gl_but_not_the_head_order(x64):
  """g = (tau, A, B) on every attention site: the circuit path of (A, g.B) is that of
  (A, tau.B), point by point and barrier for barrier, while the straight line is not; with
  tau the identity it is the path of (A, B) itself."""
  model = models.build("gpt2", "tiny", depth=1)
  wide = models.circuit_model(model)
  a, b, tokens = _params64(model, 0), _params64(model, 1), _inputs(model, 2)
  g = {site: ga.random_element(jax.random.key(3), s, group="gl")
       for site, s in model.spec.attention.items()}
  eye = lambda e: jnp.broadcast_to(jnp.eye(e.head_dim), e.qk.shape)
  tau = {site: e._replace(qk=eye(e), vo=eye(e)) for site, e in g.items()}  # g's permutation
  moved, permuted = _act(b, g), _act(b, tau)
  lams = lmc.lambdas(3)
  circuit = circuit_path.path_evaluator(model.spec, _loss(wide.apply))
  straight = lmc.path_evaluator(_loss(model.apply))
  path = lambda evaluator, end: lmc.evaluate_path(evaluator, a, end, [tokens], lams)["loss"]
  np.testing.assert_allclose(path(circuit, moved), path(circuit, permuted), atol=TOL, rtol=0)
  assert lmc.barrier(lams, path(circuit, moved)) == pytest.approx(
      lmc.barrier(lams, path(circuit, permuted)), abs=TOL)
  assert np.max(np.abs(path(straight, moved) - path(straight, permuted))) > 1e-3
  assert np.max(np.abs(path(circuit, permuted) - path(circuit, b))) > 1e-3  # tau matters
  gl_only = _act(b, {site: e._replace(perm=jnp.arange(e.num_heads)) for site, e in g.items()})
  np.testing.assert_allclose(path(circuit, gl_only), path(circuit, b), atol=TOL, rtol=0)


def test_the_path_evaluator_compiles_once_and_gives_each_point():
  """One compilation for every chunk of lambdas; each point's sums are the widened model's
  on ``interpolate``'s parameters."""
  model = models.build("gpt2", "tiny")
  wide = models.circuit_model(model)
  a, b = model.init(jax.random.key(0)), model.init(jax.random.key(1))
  tokens = _inputs(model, 2)
  metric = chex.assert_max_traces(n=1)(_loss(wide.apply))
  lams = lmc.lambdas(5)
  sums = lmc.evaluate_path(circuit_path.path_evaluator(model.spec, metric), a, b, [tokens],
                           lams, chunk_size=2)
  chex.clear_trace_counter()
  for i, lam in enumerate(lams):
    want = _loss(wide.apply)(circuit_path.interpolate(model.spec, a, b, lam), tokens)["loss"]
    assert sums["loss"][i] == pytest.approx(float(want), rel=1e-5)


def test_rope_and_models_without_heads_are_refused_before_work():
  rope = models.build("gpt2", "tiny", pos_encoding="rope")
  params = rope.init(jax.random.key(0))
  with pytest.raises(ValueError, match=r"not defined for RoPE \(attention sites \['layers_0/"):
    circuit_path.interpolate(rope.spec, params, params, 0.5)
  with pytest.raises(ValueError, match="not defined for RoPE"):
    models.circuit_model(rope)
  with pytest.raises(ValueError, match="no attention site"):
    circuit_path.head_width(spec_lib.SymmetrySpec({}, {"w": (None,)}))
  model = models.build("gpt2", "tiny")
  a = model.init(jax.random.key(0))
  b = model.init(jax.random.key(1))
  b["layers_1"]["attention"]["out"]["kernel"] = b["layers_1"]["attention"]["out"]["kernel"][:, :2]
  with pytest.raises(ValueError, match=r"layers_1/attention/out/kernel has shape \(4, 8, 32\) "
                                       r"in A and \(4, 2, 32\) in B"):
    circuit_path.interpolate(model.spec, a, b, 0.5)
