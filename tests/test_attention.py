"""Reference attention and RoPE: relative-position property, pairings, GQA, masks, bad input."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn_symmetry import attention

D, N, H, T, B = 16, 4, 8, 6, 2


@pytest.mark.parametrize("pairing", ["half", "interleaved"])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_rope_scores_depend_only_on_offset(x64, pairing, fraction):
  q, k = jax.random.normal(jax.random.key(0), (2, 1, 1, 1, H), jnp.float64)
  def score(m, t):
    rq = attention.apply_rope(q, jnp.array([m]), pairing=pairing, rotary_fraction=fraction)
    rk = attention.apply_rope(k, jnp.array([t]), pairing=pairing, rotary_fraction=fraction)
    return float(jnp.sum(rq * rk))
  assert score(5, 2) == pytest.approx(score(13, 10), abs=1e-12)
  assert score(5, 2) != pytest.approx(score(5, 3), abs=1e-3)
  # Rotations preserve norms, and position 0 is the identity.
  rq = attention.apply_rope(q, jnp.array([7]), pairing=pairing, rotary_fraction=fraction)
  assert float(jnp.linalg.norm(rq)) == pytest.approx(float(jnp.linalg.norm(q)), rel=1e-12)
  np.testing.assert_allclose(
      attention.apply_rope(q, jnp.array([0]), pairing=pairing, rotary_fraction=fraction), q,
      atol=1e-15)


def test_rope_pairings_and_partial_rotary(x64):
  np.testing.assert_array_equal(attention.rope_pairs(8, pairing="half"), [[0, 4], [1, 5], [2, 6], [3, 7]])
  np.testing.assert_array_equal(attention.rope_pairs(8, pairing="interleaved"), [[0, 1], [2, 3], [4, 5], [6, 7]])
  np.testing.assert_array_equal(attention.rope_pairs(8, pairing="half", rotary_fraction=0.5), [[0, 2], [1, 3]])
  np.testing.assert_array_equal(attention.rope_pairs(8, rope_axes=2), [[0, 2], [1, 3], [4, 6], [5, 7]])
  x = jax.random.normal(jax.random.key(0), (1, 3, 1, H), jnp.float64)
  y = attention.apply_rope(x, jnp.arange(3), rotary_fraction=0.5)
  np.testing.assert_array_equal(y[..., 4:], x[..., 4:])  # unrotated tail untouched
  # Half pairing, pair 0 = (0, 4) at frequency 1: position 1 rotates by 1 radian.
  e0 = jnp.zeros((1, 1, 1, H), jnp.float64).at[..., 0].set(1.0)
  y = attention.apply_rope(e0, jnp.array([1]))
  np.testing.assert_allclose(y[0, 0, 0, [0, 4]], [math.cos(1.0), math.sin(1.0)], atol=1e-15)


def test_axial_rope_uses_each_coordinate(x64):
  x = jax.random.normal(jax.random.key(0), (1, 1, 1, H), jnp.float64)
  rot = lambda pos: attention.apply_rope(x, jnp.array([[pos]], jnp.float64))
  a, b = rot([3.0, 0.0]), rot([0.0, 3.0])
  np.testing.assert_array_equal(a[..., 4:], x[..., 4:])  # second section only moves with y
  np.testing.assert_array_equal(b[..., :4], x[..., :4])


def _rope_reference(x, positions, *, pairing, fraction, base):
  """x [..., T, N, Hd] rotated by positions [..., T, A], written out pair by pair in numpy.

  The first r = Hd * fraction dims are split into A sections of s = r / A dims; section a is
  a 1-D RoPE of s dims driven by coordinate a: its pair j, (j, j + s/2) ("half") or
  (2j, 2j + 1) ("interleaved") inside the section, turns by positions[..., a] * base^(-2j/s).
  """
  x, positions = np.asarray(x, np.float64), np.asarray(positions, np.float64)
  num_axes = positions.shape[-1]
  section = round(x.shape[-1] * fraction) // num_axes
  out = x.copy()
  for a in range(num_axes):
    for j in range(section // 2):
      if pairing == "half":
        i, k = a * section + j, a * section + j + section // 2
      else:
        i, k = a * section + 2 * j, a * section + 2 * j + 1
      angle = positions[..., a, None] * base ** (-2.0 * j / section)  # [..., T, 1]: all heads
      cos, sin = np.cos(angle), np.sin(angle)
      out[..., i] = x[..., i] * cos - x[..., k] * sin
      out[..., k] = x[..., i] * sin + x[..., k] * cos
  return out


@pytest.mark.parametrize("pairing", ["half", "interleaved"])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("num_axes", [1, 2])
def test_rope_matches_a_pair_by_pair_reference(x64, pairing, fraction, num_axes, base=500.0):
  head_dim = 16  # 0.5 * 16 = 8 rotated dims: two sections of two pairs each when axial
  x = jax.random.normal(jax.random.key(0), (B, T, N, head_dim), jnp.float64)
  # Distinct real coordinates per axis, so that swapping or ignoring one shows.
  positions = np.random.default_rng(1).uniform(-20, 20, size=(B, T, num_axes))
  want = _rope_reference(x, positions, pairing=pairing, fraction=fraction, base=base)
  rope = dict(pairing=pairing, rotary_fraction=fraction, base=base)
  axial = positions if num_axes > 1 else positions[..., 0]  # [B, T, A] or plain [B, T]
  got = attention.apply_rope(x, jnp.asarray(axial), **rope)
  np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
  if num_axes == 2:  # an unbatched grid [T, A] for an unbatched x [T, N, Hd]
    got = attention.apply_rope(x[0], jnp.asarray(positions[0]), **rope)
    np.testing.assert_allclose(got, want[0], rtol=1e-12, atol=1e-12)


@pytest.mark.slow
def test_gqa_equals_mha_with_repeated_kv_heads(x64):
  gqa = attention.init_attention(jax.random.key(0), width=D, num_heads=N, head_dim=H,
                                 num_kv_heads=2, dtype=jnp.float64)
  rep = lambda w, axis: jnp.repeat(w, N // 2, axis=axis)
  mha = dict(gqa, key={"kernel": rep(gqa["key"]["kernel"], 1), "bias": rep(gqa["key"]["bias"], 0)},
             value={"kernel": rep(gqa["value"]["kernel"], 1), "bias": rep(gqa["value"]["bias"], 0)})
  x = jax.random.normal(jax.random.key(1), (B, T, D), jnp.float64)
  for pe in ("none", "rope"):
    np.testing.assert_allclose(attention.multi_head_attention(gqa, x, pos_encoding=pe, causal=True),
                               attention.multi_head_attention(mha, x, pos_encoding=pe, causal=True),
                               atol=1e-12)


def test_matches_explicit_per_head_formula(x64):
  p = attention.init_attention(jax.random.key(0), width=D, num_heads=N, head_dim=H, dtype=jnp.float64)
  x = jax.random.normal(jax.random.key(1), (1, T, D), jnp.float64)[0]
  y = jnp.zeros((T, D), jnp.float64) + p["out"]["bias"]
  for n in range(N):
    q = x @ p["query"]["kernel"][:, n] + p["query"]["bias"][n]
    k = x @ p["key"]["kernel"][:, n] + p["key"]["bias"][n]
    v = x @ p["value"]["kernel"][:, n] + p["value"]["bias"][n]
    y = y + jax.nn.softmax(q @ k.T / math.sqrt(H), axis=-1) @ v @ p["out"]["kernel"][n]
  np.testing.assert_allclose(attention.multi_head_attention(p, x[None])[0], y, atol=1e-12)


def test_causal_and_padding_masks(x64):
  p = attention.init_attention(jax.random.key(0), width=D, num_heads=N, head_dim=H, dtype=jnp.float64)
  x = jax.random.normal(jax.random.key(1), (B, T, D), jnp.float64)
  x2 = x.at[:, -1].set(0.0)  # change only the last token
  y, y2 = (attention.multi_head_attention(p, v, causal=True) for v in (x, x2))
  np.testing.assert_allclose(y[:, :-1], y2[:, :-1], atol=1e-14)  # the past does not see the future
  mask = jnp.ones((B, T), bool).at[:, -1].set(False)
  y, y2 = (attention.multi_head_attention(p, v, mask=mask) for v in (x, x2))
  np.testing.assert_allclose(y[:, :-1], y2[:, :-1], atol=1e-14)  # padding is never attended
  assert float(jnp.abs(attention.multi_head_attention(p, x) - attention.multi_head_attention(p, x2))[:, 0].max()) > 1e-6


@pytest.mark.slow
def test_bad_arguments_raise():
  p = attention.init_attention(jax.random.key(0), width=D, num_heads=N, head_dim=H)
  x = jnp.zeros((B, T, D))
  with pytest.raises(ValueError, match="pos_encoding"):
    attention.multi_head_attention(p, x, pos_encoding="alibi")
  with pytest.raises(ValueError, match="rope_pairing"):
    attention.multi_head_attention(p, x, pos_encoding="rope", rope_pairing="zigzag")
  bad = attention.init_attention(jax.random.key(0), width=D, num_heads=N, head_dim=H, num_kv_heads=3)
  with pytest.raises(ValueError, match="not a multiple of num_kv_heads"):
    attention.multi_head_attention(bad, x)


@pytest.mark.slow
def test_layout_helpers_describe_init_attention():
  """leaf_shapes is the layout init_attention builds; layer_shapes reads it back, stacked too;
  a missing bias reads as zeros; K defaults to N."""
  params = attention.init_attention(jax.random.key(0), width=D, num_heads=N, head_dim=H,
                                    num_kv_heads=2)
  expected = attention.leaf_shapes(D, N, 2, H)
  assert set(expected) == set(attention.LEAVES)
  assert {f"{n}/{l}": v.shape for n, node in params.items() for l, v in node.items()} == expected
  assert attention.layer_shapes(params) == ((), D, N, 2, H)
  stacked = jax.tree.map(lambda x: jnp.stack([x] * 3), params)
  assert attention.layer_shapes(stacked, "layers/") == ((3,), D, N, 2, H)
  no_bias = dict(params, key={"kernel": params["key"]["kernel"]})
  np.testing.assert_array_equal(attention.bias_or_zeros(no_bias, "key"), np.zeros((2, H)))
  assert attention.bias_or_zeros(params, "key") is params["key"]["bias"]
  assert attention.kv_heads(N) == N and attention.kv_heads(N, 2) == 2
  with pytest.raises(ValueError, match="layers/out/kernel has shape"):
    attention.layer_shapes(dict(stacked, out={"kernel": stacked["out"]["kernel"][..., :3]}),
                           "layers/")
