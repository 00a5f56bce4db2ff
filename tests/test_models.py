"""Model zoo: invariance under each model's full symmetry group, training, scopes, bad input."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from attn_symmetry import attention
from attn_symmetry import group_action as ga
from attn_symmetry import models
from attn_symmetry import spec as spec_lib
from attn_symmetry.models import core

B, T = 2, 7

# case -> (family, config overrides): every registered family at its defaults (named by the
# family), and variants that reach every position encoding, norm, bias and head the zoo offers.
CASES = {family: (family, {}) for family in models.FAMILIES} | {
    "vit-sinusoidal": ("vit", dict(pos_encoding="sinusoidal")),
    "vit-none-mean": ("vit", dict(pos_encoding="none", pooling="mean")),
    "vit-rope": ("vit", dict(pos_encoding="rope", rope_pairing="interleaved")),
    "vit-rope2d": ("vit", dict(pos_encoding="rope2d")),
    "vit-rope2d-mean-rms": ("vit", dict(pos_encoding="rope2d", pooling="mean", norm="rms",
                                        gated_mlp=True, activation="silu", num_kv_heads=2)),
    "bert-sinusoidal": ("bert", dict(pos_encoding="sinusoidal")),
    "bert-rope": ("bert", dict(pos_encoding="rope")),
    "bert-mlm": ("bert", dict(head="mlm")),
    "bert-pretraining": ("bert", dict(head="pretraining")),
    "bert-encoder": ("bert", dict(head="encoder")),
    "bert-encoder-no-pooler": ("bert", dict(head="encoder_no_pooler")),
    "bert-mlm-untied-rope": ("bert", dict(head="mlm", tied_embeddings=False, pos_encoding="rope",
                                          rope_pairing="interleaved")),
    "gpt2-sinusoidal": ("gpt2", dict(pos_encoding="sinusoidal")),
    "gpt2-none": ("gpt2", dict(pos_encoding="none")),
    "gpt2-rope-partial": ("gpt2", dict(pos_encoding="rope", rotary_fraction=0.5)),
    "llama-rope-interleaved": ("llama", dict(rope_pairing="interleaved", num_kv_heads=None)),
    "llama-learned": ("llama", dict(pos_encoding="learned")),
    "llama-tied": ("llama", dict(tied_embeddings=True)),
    "llama-qkv-bias": ("llama", dict(qkv_bias=True)),  # Qwen2's biases: on q, k and v alone
}


def _build(case):
  family, overrides = CASES[case]
  return models.build(family, "tiny", **overrides)


def _params64(model, seed):
  """Float64 params with every leaf perturbed (non-zero biases, non-unit norm scales)."""
  rng = np.random.default_rng(seed)
  flat = spec_lib.flatten(model.init(jax.random.key(seed)))
  return spec_lib.unflatten({path: jnp.asarray(leaf, jnp.float64) + 0.3 * rng.normal(size=leaf.shape)
                             for path, leaf in sorted(flat.items())})


def _batch(model, seed):
  """(inputs, kwargs) for one float64 forward pass, with padding and segments where they exist."""
  cfg = model.config
  rng = np.random.default_rng(seed)
  if model.input_key == "image":
    return jnp.asarray(rng.normal(size=(B, cfg.image_size, cfg.image_size, cfg.num_channels))), {}
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, T)), jnp.int32)
  kwargs = {}
  if models.get_family(cfg.family).segments:  # BERT
    kwargs["mask"] = jnp.asarray(np.arange(T)[None, :] < np.array([[T], [T - 2]]))
    kwargs["segments"] = jnp.asarray(np.arange(T)[None, :] >= 3, jnp.int32).repeat(B, 0)
  return tokens, kwargs


def _transform(model, params, element):
  """g . params, folding RMSNorm scales first when the residual factor is orthogonal."""
  if model.spec.norm_scales:
    params = ga.fold_norm_scales(model.spec, params)
  return ga.apply_model(model.spec, params, element)


def _max_diff(a, b):
  return float(jnp.max(jnp.abs(a - b)))


@pytest.mark.parametrize("case", list(CASES))
def test_logits_invariant_under_full_group(x64, case):
  model = _build(case)
  params = _params64(model, 0)
  inputs, kwargs = _batch(model, 1)
  element = ga.random_model_element(jax.random.key(2), model.spec)
  moved = _transform(model, params, element)
  apply = jax.jit(model.apply)
  logits, inter = apply(params, inputs, **kwargs)
  moved_logits, moved_inter = apply(moved, inputs, **kwargs)
  assert logits.dtype == jnp.float64
  # The element really moves the parameters, and the function stays the same.
  assert _max_diff(spec_lib.flatten(params)["layers_0/attention/query/kernel"],
                   spec_lib.flatten(moved)["layers_0/attention/query/kernel"]) > 0.1
  assert _max_diff(logits, moved_logits) <= 1e-8
  for name in ("nsp_logits", "pooled"):  # BERT's next-sentence head, and a bare encoder's pooler
    if name in inter:
      assert _max_diff(inter[name], moved_inter[name]) <= 1e-8
  # Intermediates are named after the factors that act on their last axis.
  perm = element["layers_1/mlp"]
  np.testing.assert_allclose(moved_inter["layers_1/mlp"], inter["layers_1/mlp"][..., perm],
                             atol=1e-8)


@pytest.mark.parametrize("case", list(CASES))
def test_apply_streamed_is_apply_reading_one_layer_at_a_time(x64, case):
  """``apply_streamed`` gives ``apply``'s logits (float64, with BERT's mask and segments) while
  reading the parameters outside the layers once and then each layer once, in order."""
  model = _build(case)
  flat = spec_lib.flatten(_params64(model, 0))
  inputs, kwargs = _batch(model, 1)
  reads = []

  def read(paths):
    paths = list(paths)
    reads.append({p.split("/")[0] for p in paths if p.startswith("layers_")} or {"outside"})
    return {p: flat[p] for p in paths}

  logits = model.apply_streamed(read, inputs, **kwargs)
  assert logits.dtype == jnp.float64
  assert _max_diff(logits, model.apply(spec_lib.unflatten(flat), inputs, **kwargs)[0]) <= 1e-12
  assert reads == [{"outside"}] + [{f"layers_{i}"} for i in range(model.config.depth)]


def test_spec_factors_per_family():
  """Every registered family at its defaults: the residual stream is rotated (an RMSNorm model
  with an untied head: Llama) or permuted, with a site per attention layer and an FFN factor."""
  for family in models.FAMILIES:
    cfg, spec = models.make_config(family), models.build(family).spec
    orthogonal = cfg.norm == "rms" and not cfg.tied_embeddings
    assert spec.factors["residual"].kind == ("orthogonal" if orthogonal else "permutation")
    assert set(spec.attention) == {"layers_0/attention", "layers_1/attention"}
    assert spec.factors["layers_1/mlp"] == spec_lib.Factor(64)
  llama = models.build("llama").spec
  assert llama.factors["residual"].kind == "orthogonal"
  assert llama.attention["layers_0/attention"].group == "rope"
  assert llama.attention["layers_0/attention"].kv_heads == 2
  assert llama.axes["layers_0/mlp/gate/kernel"] == llama.axes["layers_0/mlp/up/kernel"]
  assert llama.norm_scales["layers_0/mlp_norm/scale"] == ("layers_0/mlp/gate/kernel",
                                                           "layers_0/mlp/up/kernel")
  assert models.build("vit", pos_encoding="rope2d").spec.attention["layers_0/attention"].rope_axes == 2
  # A fixed sinusoidal encoding cannot be permuted along with the stream.
  assert "residual" not in models.build("gpt2", pos_encoding="sinusoidal").spec.factors
  # A bare encoder outputs the stream, and the pooler's units: neither moves; the pooler is read
  # off the stream (its input rows would move with a residual factor).
  for head in ("encoder", "encoder_no_pooler"):
    spec = models.build("bert", head=head).spec
    assert set(spec.factors) == {"layers_0/mlp", "layers_1/mlp"}, spec.factors
    assert ("pooler/kernel" in spec.axes) == (head == "encoder")
  assert models.build("bert", head="encoder").spec.axes["pooler/kernel"] == (None, None)


# Pre-LayerNorm families with an untied head: their stream has the O(d - 1) residual.
LAYER_NORM_STREAMS = {
    "gpt2-untied": ("gpt2", dict(tied_embeddings=False)),
    "gpt2-rope-partial-untied": ("gpt2", dict(tied_embeddings=False, pos_encoding="rope",
                                              rotary_fraction=0.5)),
    "vit": ("vit", {}),
    "vit-none-mean": ("vit", dict(pos_encoding="none", pooling="mean")),
    "gpt_neox": ("gpt_neox", {}),
}


def _mean_zero_model(case):
  family, overrides = LAYER_NORM_STREAMS[case]
  model = models.build(family, "tiny", **overrides)
  return model, model.spec.with_residual("residual", "mean_zero_orthogonal")


@pytest.mark.parametrize("case", list(LAYER_NORM_STREAMS))
def test_logits_invariant_under_mean_zero_orthogonal_residual(x64, case):
  """The canonical form (writers projected onto 1-perp, LayerNorm gains in their readers) keeps
  the logits, and so does a random Q with Q 1 = 1 with head and FFN elements on top; the form
  is idempotent and the moved checkpoint is still in it."""
  model, spec = _mean_zero_model(case)
  params = _params64(model, 0)
  inputs, kwargs = _batch(model, 1)
  canonical = ga.canonical_form(spec, params)
  flat = spec_lib.flatten(canonical)
  for path in spec.streams["residual"].writers:
    axis = spec.axes[path].index("residual")
    assert float(jnp.max(jnp.abs(jnp.mean(flat[path], axis=axis)))) <= 1e-12, path
  for scale in spec.streams["residual"].norms:
    np.testing.assert_array_equal(flat[scale], 1.0)
  _assert_trees_close(ga.canonical_form(spec, canonical), canonical, 1e-12)
  element = ga.random_model_element(jax.random.key(2), spec)
  q = element["residual"]
  np.testing.assert_allclose(q @ jnp.ones(q.shape[0]), 1.0, atol=1e-12)
  assert _max_diff(q, jnp.eye(q.shape[0])) > 0.1
  moved = ga.apply_model(spec, canonical, element)
  apply = jax.jit(model.apply)
  logits = apply(params, inputs, **kwargs)[0]
  assert _max_diff(logits, apply(canonical, inputs, **kwargs)[0]) <= 1e-9
  assert _max_diff(logits, apply(moved, inputs, **kwargs)[0]) <= 1e-9
  assert _max_diff(flat["layers_0/mlp/wi/kernel"],
                   spec_lib.flatten(moved)["layers_0/mlp/wi/kernel"]) > 0.1
  _assert_trees_close(ga.canonical_form(spec, moved), moved, 1e-12)


def _assert_trees_close(a, b, atol):
  for (path, x), y in zip(spec_lib.flatten(a).items(), spec_lib.flatten(b).values()):
    np.testing.assert_allclose(x, y, atol=atol, err_msg=path)


@pytest.mark.parametrize("family, overrides", [
    ("gpt2", {}), ("bert", {}), ("llama", {}), ("gpt2", dict(pos_encoding="sinusoidal"))])
def test_mean_zero_orthogonal_residual_needs_a_layer_norm_stream(family, overrides):
  """A tied head, a post-LayerNorm stream (BERT), an RMSNorm one (Llama: already orthogonal) and
  a stream with no symmetry have no O(d - 1) residual: with_residual says why."""
  spec = models.build(family, "tiny", **overrides).spec
  assert "residual" not in spec.streams
  with pytest.raises(ValueError, match="LayerNorm|unknown factor"):
    spec.with_residual("residual", "mean_zero_orthogonal")


def test_with_residual_round_trip():
  spec = models.build("gpt2", "tiny", tied_embeddings=False).spec
  ortho = spec.with_residual("residual", "mean_zero_orthogonal")
  assert ortho.factors["residual"] == spec_lib.Factor(32, "mean_zero_orthogonal")
  assert ortho.norm_scales["final_norm/scale"] == ("head/kernel",)
  assert spec.norm_scales == {} and ortho.with_residual("residual", "permutation") == spec
  assert ortho.restrict(["residual"]).streams == ortho.streams


@pytest.mark.parametrize("case", ["vit-rope2d", "bert-rope", "gpt2-rope-partial", "llama"])
def test_gl_on_rope_qk_changes_logits(x64, case):
  model = _build(case)
  params = _params64(model, 0)
  inputs, kwargs = _batch(model, 1)
  element = ga.random_model_element(jax.random.key(2), model.spec, attention_group="gl")
  moved = _transform(model, params, element)
  logits, _ = model.apply(params, inputs, **kwargs)
  moved_logits, _ = model.apply(moved, inputs, **kwargs)
  assert _max_diff(logits, moved_logits) > 1e-3


def _loss(model, params, batch):
  if model.task == "lm":
    logits, _ = model.apply(params, batch["tokens"][:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).mean()
  inputs = batch[model.input_key]
  kwargs = {"mask": batch["mask"]} if "mask" in batch else {}
  logits, _ = model.apply(params, inputs, **kwargs)
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


def _train_batch(model, key):
  cfg = model.config
  if model.input_key == "image":
    return {"image": jax.random.normal(key, (4, cfg.image_size, cfg.image_size, cfg.num_channels)),
            "label": jnp.arange(4) % cfg.num_classes}
  tokens = jax.random.randint(key, (4, T + 1), 0, cfg.vocab_size)
  if model.task == "lm":
    return {"tokens": tokens}
  return {"tokens": tokens[:, :T], "mask": jnp.ones((4, T), bool), "label": jnp.arange(4) % 2}


@pytest.mark.slow  # trains (five steps, one program per family)
@pytest.mark.parametrize("family", models.FAMILIES)
def test_adamw_steps_reduce_loss(family):
  model = models.build(family)
  params = model.init(jax.random.key(0))
  batch = _train_batch(model, jax.random.key(1))
  opt = optax.adamw(3e-3)

  @jax.jit
  def step(params, state):
    loss, grads = jax.value_and_grad(lambda p: _loss(model, p, batch))(params)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  state = opt.init(params)
  losses = []
  for _ in range(5):
    params, state, loss = step(params, state)
    losses.append(float(loss))
  assert np.isfinite(losses).all()
  assert losses[-1] < losses[0]
  assert jax.tree.structure(params) == jax.tree.structure(model.init(jax.random.key(0)))


@pytest.mark.parametrize("family", models.FAMILIES)
def test_scope_paths_cover_existing_params(family):
  model = models.build(family)
  paths = list(model.param_shapes)
  covered = lambda scope: [p for p in paths if any(
      prefix == "" or p.startswith(prefix + "/") for prefix in model.scope_paths(scope))]
  assert covered("first_attention") == [p for p in paths if p.startswith("layers_0/attention/")]
  assert set(covered("all_attention")) == {p for p in paths if "/attention/" in p}
  assert set(covered("first_layer")) == {p for p in paths if p.startswith("layers_0/")}
  assert covered("full") == paths
  assert model.scope_paths("all_attention") == ["layers_0/attention", "layers_1/attention"]
  with pytest.raises(ValueError, match="unknown scope"):
    model.scope_paths("second_layer")


def test_canonical_attention_layout_and_names():
  model = models.build("llama")
  shapes = model.param_shapes
  d, n, k, h = 32, 4, 2, 8
  assert shapes["layers_0/attention/query/kernel"] == (d, n, h)
  assert shapes["layers_0/attention/key/kernel"] == (d, k, h)
  assert shapes["layers_0/attention/out/kernel"] == (n, h, d)
  assert "layers_0/attention/query/bias" not in shapes
  assert {p.split("/")[0] for p in shapes} == {"embed", "layers_0", "layers_1", "final_norm", "head"}
  vit = models.build("vit").param_shapes
  assert vit["patch_embed/kernel"] == (4, 4, 3, 32) and vit["cls_token"] == (32,)


def test_bias_switches_split_attention_output_and_ffn():
  """``use_bias`` is the default of ``qkv_bias``, ``out_bias`` and ``mlp_bias``; each puts
  biases on its own projections only."""
  assert [(c.qkv_bias, c.out_bias, c.mlp_bias) for c in (
      models.make_config("gpt2"), models.make_config("llama"),
      models.make_config("gpt2", use_bias=False, mlp_bias=True))] == [
          (True, True, True), (False, False, False), (False, False, True)]
  shapes = models.build("llama", qkv_bias=True).param_shapes
  biases = sorted(p for p in shapes if p.startswith("layers_0/") and p.endswith("/bias"))
  assert biases == [f"layers_0/attention/{n}/bias" for n in ("key", "query", "value")]
  shapes = models.build("gpt2", out_bias=False, mlp_bias=False).param_shapes
  biases = sorted(p for p in shapes if p.startswith("layers_0/") and p.endswith("/bias"))
  assert biases == [f"layers_0/{n}/bias" for n in (
      "attention/key", "attention/query", "attention/value", "attention_norm", "mlp_norm")]


def test_presets():
  for family in models.FAMILIES:
    small = models.make_config(family, "small")
    assert (small.depth, small.num_heads, small.width) == (6, 4, 256)
    assert models.make_config(family, "paper") == small
    base = models.build(family, "base")  # abstract shapes only, nothing allocated
    assert base.config.depth == 12
  assert models.make_config("vit", "small").num_patches == 64
  assert models.build("gpt2", "base").param_shapes["embed/embedding"] == (50257, 768)


def test_init_is_reproducible_and_key_dependent():
  model = models.build("gpt2")
  a, b, c = (model.init(jax.random.key(s)) for s in (0, 0, 1))
  leaf = lambda p: p["layers_0"]["mlp"]["wi"]["kernel"]
  np.testing.assert_array_equal(leaf(a), leaf(b))
  assert not np.allclose(leaf(a), leaf(c))


@pytest.mark.parametrize("shape", [(1,), (3, 5), (4, 2, 8), (1 << 22,), ((1 << 22) + 1,)])
def test_a_normal_parameter_is_the_exact_draw_of_its_size(shape):
  """``core.normal_param`` draws a padded length and cuts it: bit for bit the flat draw of the
  parameter's own size, scaled (padded up to 2^22 numbers, exact above)."""
  key = jax.random.key(7)
  got = core.normal_param(nnx.Rngs(params=key), shape, 0.02)[...]
  size = int(np.prod(shape))
  want = 0.02 * jax.random.normal(nnx.Rngs(params=key).params(), (size,)).reshape(shape)
  assert got.shape == shape and got.dtype == want.dtype
  np.testing.assert_array_equal(got, want)
  padded = core._draw_size(size)  # pylint: disable=protected-access
  assert padded == (size if size > 1 << 22 else 1 << (size - 1).bit_length()) >= size


def test_causal_models_ignore_the_future():
  model = models.build("gpt2")
  params = model.init(jax.random.key(0))
  tokens = jnp.arange(T)[None] % model.config.vocab_size
  changed = tokens.at[0, -1].set(5)
  apply = jax.jit(model.apply)
  a, _ = apply(params, tokens)
  b, _ = apply(params, changed)
  np.testing.assert_allclose(a[:, :-1], b[:, :-1], atol=1e-6)
  assert _max_diff(a[:, -1], b[:, -1]) > 1e-6


def test_bert_mask_hides_padding():
  model = models.build("bert")
  params = model.init(jax.random.key(0))
  tokens = jnp.array([[1, 2, 3, 4, 0, 0, 0]])
  mask = tokens > 0
  apply = jax.jit(model.apply)
  a, _ = apply(params, tokens, mask=mask)
  b, _ = apply(params, tokens.at[0, 5].set(9), mask=mask)
  c, _ = apply(params, tokens.at[0, 5].set(9), mask=jnp.ones_like(mask))
  np.testing.assert_allclose(a, b, atol=1e-6)
  assert _max_diff(a, c) > 1e-6


@pytest.mark.parametrize("family, overrides, match", [
    ("resnet", {}, "unknown model family"),
    ("vit", dict(preset="huge"), "unknown preset"),
    ("gpt2", dict(num_layers=3), "unknown config fields \\['num_layers'\\]"),
    ("bert", dict(width=30, num_heads=4), "num_heads 4 does not divide config.width 30"),
    ("llama", dict(width=12, num_heads=4, num_kv_heads=None), "odd head dim"),
    ("vit", dict(pos_encoding="rope2d", width=24, num_heads=4), "2 \\* rope_axes = 4"),
    ("gpt2", dict(pos_encoding="rope2d"), "for image models only"),
    ("llama", dict(num_kv_heads=3), "num_kv_heads 3 does not divide"),
    ("vit", dict(image_size=10), "patch_size 4 does not divide config.image_size 10"),
    ("gpt2", dict(head="classifier"), "not available for family 'gpt2'"),
    ("gpt2", dict(pos_encoding="alibi"), "config.pos_encoding must be one of"),
    ("gpt2", dict(head_width=0), "config.head_width must be positive or None, got 0"),
])
def test_bad_config_raises(family, overrides, match):
  overrides = dict(overrides)
  preset = overrides.pop("preset", "tiny")
  with pytest.raises(ValueError, match=match):
    models.build(family, preset, **overrides)


def test_head_width_decouples_the_heads_from_the_stream(x64):
  """``Config.head_width`` sets H whatever D / N (default: D / N, as before): the projections
  are [D, N, H] and [N, H, D], and the layer is ``attention.multi_head_attention``, whose
  softmax scale is 1 / sqrt(H)."""
  assert models.make_config("gpt2").head_dim == 8 and models.make_config("gpt2").head_width is None
  model = models.build("gpt2", "tiny", width=30, num_heads=4, head_width=5, depth=1)
  assert model.param_shapes["layers_0/attention/query/kernel"] == (30, 4, 5)
  assert model.param_shapes["layers_0/attention/out/kernel"] == (4, 5, 30)
  assert model.spec.attention["layers_0/attention"].head_dim == 5
  params = _params64(model, 0)
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 64, (B, T)), jnp.int32)
  _, inter = model.apply(params, tokens)
  layer = params["layers_0"]  # the layer reads the pre-LayerNorm of the embedded tokens
  normed = inter["embed"] - inter["embed"].mean(-1, keepdims=True)
  normed = normed / jnp.sqrt((normed ** 2).mean(-1, keepdims=True) + model.config.norm_eps)
  normed = normed * layer["attention_norm"]["scale"] + layer["attention_norm"]["bias"]
  want = attention.multi_head_attention(layer["attention"], normed, causal=True)
  np.testing.assert_allclose(inter["layers_0/attention"], want, atol=1e-10, rtol=0)


def test_bad_params_and_inputs_raise():
  model = models.build("vit")
  params = model.init(jax.random.key(0))
  images = jnp.zeros((B, 8, 8, 3))
  flat = spec_lib.flatten(params)
  bad = dict(flat)
  del bad["head/bias"]
  bad["head/extra"] = jnp.zeros(3)
  bad["layers_1/mlp/wi/kernel"] = jnp.zeros((32, 65))
  with pytest.raises(ValueError, match=r"missing \['head/bias'\].*extra \['head/extra'\].*"
                     r"layers_1/mlp/wi/kernel: \(32, 65\) instead of \(32, 64\)"):
    model.apply(spec_lib.unflatten(bad), images)
  with pytest.raises(ValueError, match="images"):
    model.apply(params, jnp.zeros((B, 9, 9, 3)))
  gpt2 = models.build("gpt2")
  gpt2_params = gpt2.init(jax.random.key(0))
  with pytest.raises(ValueError, match="more than config.max_len 16"):
    gpt2.apply(gpt2_params, jnp.zeros((1, 17), jnp.int32))
  with pytest.raises(ValueError, match="int tokens"):
    gpt2.apply(gpt2_params, jnp.zeros((1, 4)))
  with pytest.raises(ValueError, match="num_segments is 0"):
    gpt2.apply(gpt2_params, jnp.zeros((1, 4), jnp.int32), segments=jnp.zeros((1, 4), jnp.int32))


def test_config_is_frozen():
  cfg = models.make_config("vit")
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.width = 3
