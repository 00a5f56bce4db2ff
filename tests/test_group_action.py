"""Group actions: invariance in float64, the RoPE group, group axioms, jit, bad input."""

import itertools

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn_symmetry import attention
from attn_symmetry import group_action as ga
from attn_symmetry import models
from attn_symmetry import spec as spec_lib
from attn_symmetry.spec import AttentionSite
from tests import tiny_transformer as tiny

D, N, H, T, B = 16, 4, 8, 7, 2

# (pos_encoding, rope_pairing, rotary_fraction) -> the group that must leave the layer invariant.
PE_KINDS = {
    "none": ("none", "half", 1.0),
    "sinusoidal": ("sinusoidal", "half", 1.0),
    "learned": ("learned", "half", 1.0),
    "rope_half": ("rope", "half", 1.0),
    "rope_interleaved": ("rope", "interleaved", 1.0),
    "rope_partial": ("rope", "half", 0.5),
}


def _layer(key, *, kv=None, bias=True, width=D, heads=N, head_dim=H):
  return attention.init_attention(key, width=width, num_heads=heads, head_dim=head_dim,
                                  num_kv_heads=kv, use_bias=bias, dtype=jnp.float64)


def _inputs(key, pe):
  x = jax.random.normal(key, (B, T, D), jnp.float64)
  if pe == "sinusoidal":
    x = x + attention.sinusoidal_position_encoding(T, D, dtype=jnp.float64)
  elif pe == "learned":
    x = x + jax.random.normal(jax.random.fold_in(key, 1), (T, D), jnp.float64)
  return x


def _max_diff(a, b):
  return float(jnp.max(jnp.abs(a - b)))


@pytest.mark.parametrize("kind", list(PE_KINDS))
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kv", [None, 2])
def test_output_invariant_under_group(x64, kind, bias, causal, kv):
  pe, pairing, fraction = PE_KINDS[kind]
  params = _layer(jax.random.key(0), kv=kv, bias=bias)
  x = _inputs(jax.random.key(1), pe)
  site = AttentionSite(N, H, num_kv_heads=kv, group="rope" if pe == "rope" else "gl",
                       rope_pairing=pairing, rotary_fraction=fraction)
  element = ga.random_element(jax.random.key(2), site)
  kw = dict(pos_encoding=pe, rope_pairing=pairing, rotary_fraction=fraction, causal=causal)
  moved = ga.apply(params, element)
  assert _max_diff(moved["query"]["kernel"], params["query"]["kernel"]) > 1e-2  # it really moved
  y, y_moved = (attention.multi_head_attention(p, x, **kw) for p in (params, moved))
  assert _max_diff(y, y_moved) <= 1e-9


@pytest.mark.parametrize("pairing", ["half", "interleaved"])
def test_gl_on_rope_qk_changes_output(x64, pairing):
  params = _layer(jax.random.key(0))
  x = _inputs(jax.random.key(1), "rope")
  e = ga.random_element(jax.random.key(2), AttentionSite(N, H, group="gl"))
  kw = dict(pos_encoding="rope", rope_pairing=pairing)
  y, y_moved = (attention.multi_head_attention(p, x, **kw) for p in (params, ga.apply(params, e)))
  assert _max_diff(y, y_moved) > 1e-3
  # ... while the same GL element is a symmetry of the position-free layer.
  y, y_moved = (attention.multi_head_attention(p, x) for p in (params, ga.apply(params, e)))
  assert _max_diff(y, y_moved) <= 1e-9


def _rotation(offset, head_dim, pairing, fraction=1.0, rope_axes=1):
  """R_offset as a matrix: e_i R for the basis rows e_i, via apply_rope."""
  eye = jnp.eye(head_dim, dtype=jnp.float64)[None, :, None, :]  # [1, T=H, N=1, H]
  shape = (1, head_dim, rope_axes) if rope_axes > 1 else (1, head_dim)
  positions = jnp.full(shape, offset, jnp.float64)
  return attention.apply_rope(eye, positions, pairing=pairing, rotary_fraction=fraction)[0, :, 0]


@pytest.mark.parametrize("pairing", ["half", "interleaved"])
@pytest.mark.parametrize("fraction,rope_axes", [(1.0, 1), (0.5, 1), (1.0, 2)])
def test_rope_element_commutes_with_rotations(x64, pairing, fraction, rope_axes):
  site = AttentionSite(N, H, group="rope", rope_pairing=pairing, rotary_fraction=fraction,
                       rope_axes=rope_axes)
  e = ga.random_element(jax.random.key(3), site)
  gl = ga.random_element(jax.random.key(3), site, group="gl")
  for offset in (1, 2, 5, 37):
    r = _rotation(offset, H, pairing, fraction, rope_axes)
    np.testing.assert_allclose(r @ r.T, np.eye(H), atol=1e-12)  # a rotation
    for c in e.qk:
      np.testing.assert_allclose(r @ c, c @ r, atol=1e-12)
    assert max(_max_diff(r @ c, c @ r) for c in gl.qk) > 1e-2


# ----------------------------------------------------------------------------- group axioms


def _element(seed, group, kv, batch_shape=()):
  return ga.random_element(jax.random.key(seed), AttentionSite(N, H, num_kv_heads=kv), group=group,
                           batch_shape=batch_shape)


def _assert_params_close(a, b, tol=1e-9):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(x, y, atol=tol, rtol=tol)


axiom_cases = dict(seed=st.integers(0, 2**31 - 1), group=st.sampled_from(ga.GROUPS),
                   kv=st.sampled_from([None, 1, 2]), stacked=st.booleans())


@hypothesis.settings(max_examples=15, deadline=None)
@hypothesis.given(**axiom_cases)
def test_group_axioms(seed, group, kv, stacked):
  with jax.enable_x64(True):
    batch = (3,) if stacked else ()
    params = jax.tree.map(lambda w: jnp.broadcast_to(w, (*batch, *w.shape)),
                          _layer(jax.random.key(seed), kv=kv))
    a, b, c = (_element(seed + i, group, kv, batch) for i in (1, 2, 3))
    e = ga.identity(N, H, kv, batch_shape=batch)
    _assert_params_close(ga.apply(params, e), params, 0)
    _assert_params_close(ga.apply(ga.apply(params, a), ga.inverse(a)), params)
    _assert_params_close(ga.apply(ga.apply(params, b), a), ga.apply(params, ga.compose(a, b)))
    # Associativity, and g o g^-1 = e as elements.
    for x, y in zip(ga.compose(ga.compose(a, b), c), ga.compose(a, ga.compose(b, c))):
      np.testing.assert_allclose(x, y, atol=1e-9)
    for x, y in zip(ga.compose(a, ga.inverse(a)), e):
      np.testing.assert_allclose(x, y, atol=1e-9)


def test_stacked_element_acts_layer_by_layer(x64):
  layers = [_layer(jax.random.key(i)) for i in range(3)]
  stacked = jax.tree.map(lambda *w: jnp.stack(w), *layers)
  e = _element(7, "gl", None, batch_shape=(3,))
  moved = ga.apply(stacked, e)
  for i, layer in enumerate(layers):
    one = ga.apply(layer, jax.tree.map(lambda v: v[i], e))
    _assert_params_close(jax.tree.map(lambda v: v[i], moved), one, 1e-12)


def test_jit_traces_once(x64):
  params = _layer(jax.random.key(0))

  @jax.jit
  @chex.assert_max_traces(n=1)
  def act(p, e):
    return ga.apply(p, ga.compose(e, ga.inverse(e)))

  for seed in range(3):
    out = act(params, _element(seed, "gl", None))
    _assert_params_close(out, params)


# ----------------------------------------------------------------------------- whole models


@pytest.mark.parametrize("rms", [False, True], ids=["layernorm_perm", "rmsnorm_orthogonal"])
def test_whole_model_invariance(x64, rms):
  spec = tiny.symmetry_spec(rms=rms)
  params = tiny.init(jax.random.key(0), rms=rms)
  tokens = jax.random.randint(jax.random.key(1), (B, tiny.MAX_LEN), 0, tiny.VOCAB)
  if rms:
    folded = ga.fold_norm_scales(spec, params)
    assert _max_diff(tiny.apply(folded, tokens, rms=True), tiny.apply(params, tokens, rms=True)) <= 1e-9
    params = folded
  g = ga.random_model_element(jax.random.key(2), spec)
  moved = ga.apply_model(spec, params, g)
  assert _max_diff(moved["embed"]["embedding"], params["embed"]["embedding"]) > 1e-2
  assert _max_diff(tiny.apply(moved, tokens, rms=rms), tiny.apply(params, tokens, rms=rms)) <= 1e-9
  # Axioms at the model level.
  h = ga.random_model_element(jax.random.key(3), spec)
  _assert_params_close(ga.apply_model(spec, ga.apply_model(spec, params, h), g),
                       ga.apply_model(spec, params, ga.compose_model(spec, g, h)))
  _assert_params_close(ga.apply_model(spec, moved, ga.inverse_model(spec, g)), params)
  _assert_params_close(ga.apply_model(spec, params, ga.identity_model(spec)), params, 0)


def _mean_zero_spec_and_params():
  """A tiny untied GPT-2 in float64 (every leaf perturbed) and its spec with the O(d - 1)
  residual."""
  model = models.build("gpt2", "tiny", tied_embeddings=False)
  rng = np.random.default_rng(0)
  flat = spec_lib.flatten(model.init(jax.random.key(0)))
  params = spec_lib.unflatten({p: jnp.asarray(x, jnp.float64) + 0.3 * rng.normal(size=x.shape)
                               for p, x in flat.items()})
  return model.spec.with_residual("residual", "mean_zero_orthogonal"), params


def test_mean_zero_orthogonal_axioms_and_jit(x64):
  """Identity, inverse, composition and associativity for U diag(1, R) U^T with head and FFN
  elements; the elements stay in the group; apply_model and canonical_form jit (one trace)."""
  spec, params = _mean_zero_spec_and_params()
  params = ga.canonical_form(spec, params)
  g, h, k = (ga.random_model_element(jax.random.key(i), spec) for i in (1, 2, 3))
  _assert_params_close(ga.apply_model(spec, params, ga.identity_model(spec)), params, 0)
  _assert_params_close(ga.apply_model(spec, ga.apply_model(spec, params, g),
                                      ga.inverse_model(spec, g)), params)
  _assert_params_close(ga.apply_model(spec, ga.apply_model(spec, params, h), g),
                       ga.apply_model(spec, params, ga.compose_model(spec, g, h)))
  gh_k = ga.compose_model(spec, ga.compose_model(spec, g, h), k)
  g_hk = ga.compose_model(spec, g, ga.compose_model(spec, h, k))
  np.testing.assert_allclose(gh_k["residual"], g_hk["residual"], atol=1e-12)
  for e in (gh_k, ga.inverse_model(spec, g)):
    ga.check_model_element(spec, e)  # orthogonal and fixes 1
  u = ga.mean_zero_basis(5, jnp.float64)
  np.testing.assert_allclose(u.T @ u, np.eye(5), atol=1e-14)
  np.testing.assert_allclose(u[:, 0], 1 / np.sqrt(5), atol=1e-15)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def act(p, e):
    return ga.apply_model(spec, ga.canonical_form(spec, p), e, check_element=False)

  for e in (g, h):
    _assert_params_close(act(params, e), ga.apply_model(spec, params, e), 1e-12)


def test_mean_zero_orthogonal_rejects_bad_elements_and_zero_gains(x64):
  spec, params = _mean_zero_spec_and_params()
  g = ga.random_model_element(jax.random.key(1), spec)
  rotation = ga._random_orthogonal(jax.random.key(2), (), 32, jnp.float64)  # moves 1
  with pytest.raises(ValueError, match="all-ones vector"):
    ga.check_model_element(spec, dict(g, residual=rotation))
  flat = spec_lib.flatten(params)
  flat["layers_1/mlp_norm/scale"] = flat["layers_1/mlp_norm/scale"].at[3].set(0.0)
  with pytest.raises(ValueError, match="layers_1/mlp_norm/scale has a zero gain"):
    ga.canonical_form(spec, spec_lib.unflatten(flat))
  with pytest.raises(ValueError, match="call fold_norm_scales first"):
    ga.apply_model(spec, params, g)  # unfolded gains do not commute with Q


def test_apply_leaf_is_the_factor_action_of_apply_model(x64):
  """apply_model maps every leaf outside the attention sites by apply_leaf; skip_axis leaves
  that axis alone."""
  spec, params = tiny.symmetry_spec(), tiny.init(jax.random.key(0))
  g = ga.random_model_element(jax.random.key(1), spec)
  moved = spec_lib.flatten(ga.apply_model(spec, params, g))
  flat = spec_lib.flatten(params)
  outside = [p for p in flat if not any(p.startswith(s + "/") for s in spec.attention)]
  for path in outside:
    np.testing.assert_array_equal(ga.apply_leaf(spec, path, flat[path], g), moved[path])
  wi = "layers_0/mlp/wi/kernel"  # residual rows, FFN columns
  np.testing.assert_array_equal(ga.apply_leaf(spec, wi, flat[wi], g, skip_axis=0),
                                jnp.take(flat[wi], g["layers_0/mlp"], axis=1))


def test_restricted_spec_acts_only_on_named_factors(x64):
  spec = tiny.symmetry_spec()
  part = spec.restrict(["layers_0/mlp", "layers_0/attention"])
  params = tiny.init(jax.random.key(0))
  moved = ga.apply_model(part, params, ga.random_model_element(jax.random.key(1), part))
  tokens = jax.random.randint(jax.random.key(1), (B, tiny.MAX_LEN), 0, tiny.VOCAB)
  assert _max_diff(tiny.apply(moved, tokens), tiny.apply(params, tokens)) <= 1e-9
  changed = {k for k, v in ga.spec_lib.flatten(moved).items()
             if not np.array_equal(v, ga.spec_lib.flatten(params)[k])}
  assert changed and all(k.startswith("layers_0/") for k in changed)


def test_gl_on_rope_model_breaks_it(x64):
  spec = tiny.symmetry_spec(rms=True)
  params = ga.fold_norm_scales(spec, tiny.init(jax.random.key(0), rms=True))
  tokens = jax.random.randint(jax.random.key(1), (B, tiny.MAX_LEN), 0, tiny.VOCAB)
  g = ga.random_model_element(jax.random.key(2), spec, attention_group="gl")
  moved = ga.apply_model(spec, params, g)
  assert _max_diff(tiny.apply(moved, tokens, rms=True), tiny.apply(params, tokens, rms=True)) > 1e-3


# ----------------------------------------------------------------------------- bad input


# name -> (a bad variant of a valid GQA element g, the error it must give). Built in the test,
# inside the float64 fixture, so that the matrices are float64 as the layer is.
BAD_ELEMENTS = {
    "not a permutation": (lambda g: g._replace(perm=jnp.array([0, 0, 2, 3])),
                          "perm is not a permutation"),
    "breaks kv groups": (lambda g: g._replace(perm=jnp.array([0, 2, 1, 3])), "breaks kv groups"),
    # [1, 0, 2, 3] swaps heads inside kv group 0 (allowed), but as floats.
    "float perm": (lambda g: g._replace(perm=jnp.array([1.0, 0.0, 2.0, 3.0])),
                   "perm must be an integer array, got dtype float64"),
    "singular qk": (lambda g: g._replace(qk=g.qk.at[0].set(jnp.zeros((H, H)))), "qk is singular"),
    "nan vo": (lambda g: g._replace(vo=g.vo.at[1, 0, 0].set(jnp.nan)), "vo has non-finite"),
    "wrong head dim": (lambda g: g._replace(qk=g.qk[:, :4, :4], vo=g.vo[:, :4, :4]),
                       r"query/kernel has shape \(16, 4, 8\), expected \(16, 4, 4\)"),
    "wrong head count": (lambda g: g._replace(perm=jnp.arange(3)),
                         "3 heads cannot be split into 2 kv groups"),
}


@pytest.mark.parametrize("name", list(BAD_ELEMENTS))
def test_bad_element_raises(x64, name):
  make_bad, message = BAD_ELEMENTS[name]
  layer, good = _layer(jax.random.key(0), kv=2), _element(0, "gl", 2)
  ga.apply(layer, good)  # the unbroken element is accepted
  bad = make_bad(good)
  assert {str(m.dtype) for m in (bad.qk, bad.vo)} == {"float64"}
  assert bad.perm.dtype == (jnp.float64 if name == "float perm" else jnp.int64)
  with pytest.raises(ValueError, match=message):
    ga.apply(layer, bad)


def test_bad_params_raise_naming_the_leaf(x64):
  params = _layer(jax.random.key(0))
  e = _element(0, "gl", None)
  bad = dict(params, key={"kernel": params["key"]["kernel"][:, :, :4]})
  with pytest.raises(ValueError, match="key/kernel has shape"):
    ga.apply(bad, e)
  with pytest.raises(ValueError, match="extra/kernel is not a leaf of a canonical attention layer"):
    ga.apply(dict(params, extra={"kernel": params["out"]["kernel"]}), e)
  with pytest.raises(ValueError, match="query/kernel has shape"):
    ga.apply(_layer(jax.random.key(0), heads=2), e)
  flat = spec_lib.flatten(params)  # {"query/kernel": ...}: the layout is nested dicts
  with pytest.raises(ValueError, match=r"^\w+/\w+: attention params are nested dicts .*not flat "
                                       r"paths \('query/kernel'\); spec.unflatten"):
    ga.apply(flat, e)
  np.testing.assert_array_equal(ga.apply(spec_lib.unflatten(flat), e)["query"]["kernel"],
                                ga.apply(params, e)["query"]["kernel"])


@pytest.mark.parametrize("head_dim,fraction", [(7, 1.0), (8, 0.125), (8, 0.0)])
def test_rope_with_bad_head_dim_raises(head_dim, fraction):
  with pytest.raises(ValueError, match="rotary_fraction|rotated dims"):
    AttentionSite(N, head_dim, group="rope", rotary_fraction=fraction)
  with pytest.raises(ValueError, match="rotary_fraction|rotated dims"):
    ga.random_element(jax.random.key(0), AttentionSite(N, head_dim, rotary_fraction=fraction),
                      group="rope")
  x = jnp.zeros((B, T, N, head_dim))
  with pytest.raises(ValueError, match="rotary_fraction|rotated dims"):
    attention.apply_rope(x, jnp.arange(T), rotary_fraction=fraction)


def test_bad_model_input_raises(x64):
  spec = tiny.symmetry_spec()
  params = tiny.init(jax.random.key(0))
  g = ga.identity_model(spec)
  with pytest.raises(ValueError, match="layers_1/mlp/wo/kernel"):
    bad = jax.tree.map(lambda x: x, params)
    bad["layers_1"]["mlp"]["wo"]["kernel"] = bad["layers_1"]["mlp"]["wo"]["kernel"][:5]
    ga.apply_model(spec, bad, g)
  with pytest.raises(ValueError, match="leaves not in the spec.*extra/w"):
    ga.apply_model(spec, dict(params, extra={"w": jnp.ones(3)}), g)
  not_a_permutation = dict(g, residual=jnp.zeros(tiny.WIDTH, int))
  with pytest.raises(ValueError, match="'residual'.*not a permutation"):
    ga.apply_model(spec, params, not_a_permutation)
  with pytest.raises(ValueError, match="'residual'.*not a permutation"):
    ga.check_model_element(spec, not_a_permutation)
  ga.check_model_element(spec, g)
  # Skipped where the caller checked the element itself (streamed alignment, part by part).
  ga.apply_model(spec, params, not_a_permutation, check_element=False)
  rms_spec = tiny.symmetry_spec(rms=True)
  with pytest.raises(ValueError, match="fold_norm_scales"):
    ga.apply_model(rms_spec, tiny.init(jax.random.key(0), rms=True), ga.identity_model(rms_spec))
  with pytest.raises(ValueError, match="unknown factor"):
    ga.spec_lib.SymmetrySpec({}, {"w": ("nope",)})


def test_random_permutations_cover_the_group():
  """All 4! head permutations (and only kv-preserving ones under GQA) are drawn."""
  seen = {tuple(np.asarray(_element(s, "permutation", None).perm)) for s in range(300)}
  assert seen == set(itertools.permutations(range(N)))
  seen_gqa = {tuple(np.asarray(_element(s, "permutation", 2).perm)) for s in range(200)}
  assert len(seen_gqa) == 8 and all({p[0] // 2, p[1] // 2} == {p[0] // 2} for p in seen_gqa)


@pytest.mark.slow
def test_float32_element_on_bfloat16_params_keeps_their_dtype():
  """What matching returns for half-precision models: a float32 element acts on bfloat16
  leaves in float32, rounded once (the result equals the float32 action rounded to bfloat16),
  and every leaf stays bfloat16."""
  spec = tiny.symmetry_spec(rms=True)  # an orthogonal residual factor and GQA RoPE sites
  params = ga.fold_norm_scales(spec, tiny.init(jax.random.key(0), rms=True, dtype=jnp.float32))
  half = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  g = ga.random_model_element(jax.random.key(1), spec, dtype=jnp.float32)
  moved = ga.apply_model(spec, half, g)
  assert {x.dtype for x in jax.tree.leaves(moved)} == {jnp.dtype(jnp.bfloat16)}
  upcast = jax.tree.map(lambda x: x.astype(jnp.float32), half)
  want = jax.tree.map(lambda x: x.astype(jnp.bfloat16), ga.apply_model(spec, upcast, g))
  jax.tree.map(np.testing.assert_array_equal, moved, want)
