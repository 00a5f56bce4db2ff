"""The canonical attention layer: its parameter layout, and reference attention on it.

This module is the one home of the layout (docs/symmetries.md, 'The canonical
attention layer'): ``LEAVES`` and ``leaf_shapes`` say what a canonical layer
is, ``layer_shapes`` checks one leaf by leaf, ``bias_or_zeros`` reads an
optional bias and ``kv_heads`` the number of kv heads; group actions, matching
and the models use these. The layout is a nested dict, head-major as in
Flax's ``DenseGeneral`` attention, MaxText and Gemma::

    query/kernel [D, N, H]   query/bias [N, H]   (biases optional)
    key/kernel   [D, K, H]   key/bias   [K, H]
    value/kernel [D, K, H]   value/bias [K, H]
    out/kernel   [N, H, D]   out/bias   [D]

D is the width, N the number of query heads, K the number of key/value heads
(K divides N; G = N // K query heads share kv head k, query head n = k * G + i),
H the head dimension. Tokens are rows: x is [B, T, D].

Rotary position encoding (RoPE) rotates every query and key at position m by
R_m, block diagonal with planar rotations by angles m * w_j on coordinate pairs
j, w_j = base^(-2j / r) where r is the number of rotated dims. Two pairings
exist and are a parameter everywhere: "half" (pair j = (j, j + r/2), GPT-NeoX,
Llama in Hugging Face) and "interleaved" (pair j = (2j, 2j + 1), GPT-J and the
RoPE paper). ``rotary_fraction < 1`` rotates only the first r dims (GPT-NeoX's
partial rotary). ``rope_axes = A > 1`` splits the rotated dims into A equal
sections, section a rotated by the a-th coordinate of a position (axial RoPE,
e.g. the 2-D patch grid of a ViT).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

Params = dict[str, Any]

POS_ENCODINGS = ("none", "sinusoidal", "learned", "rope")
ROPE_PAIRINGS = ("half", "interleaved")


def rotary_dims(head_dim: int, rotary_fraction: float = 1.0, rope_axes: int = 1) -> int:
  """Number r of rotated coordinates of a head; a multiple of 2 * rope_axes.

  Raises:
    ValueError: if r is zero or cannot be split into rope_axes sections of
      coordinate pairs (e.g. an odd head dim).
  """
  if not 0.0 < rotary_fraction <= 1.0:
    raise ValueError(f"rotary_fraction must lie in (0, 1], got {rotary_fraction}")
  if rope_axes < 1:
    raise ValueError(f"rope_axes must be >= 1, got {rope_axes}")
  r = int(round(head_dim * rotary_fraction))
  if r == 0 or r % (2 * rope_axes):
    raise ValueError(
        f"RoPE needs the rotated dims ({r} = head_dim {head_dim} * rotary_fraction "
        f"{rotary_fraction}) to be a positive multiple of 2 * rope_axes = "
        f"{2 * rope_axes}; an odd head dim cannot be split into coordinate pairs")
  return r


def rope_pairs(head_dim: int, *, pairing: str = "half", rotary_fraction: float = 1.0,
               rope_axes: int = 1) -> np.ndarray:
  """Coordinate pairs that RoPE rotates together.

  The single source of truth for the pairing, shared by ``apply_rope`` and by
  the rotary commutant H(H) in ``group_action``.

  Returns:
    int array [P, 2], P = r / 2: pair p rotates coordinates (pairs[p, 0],
    pairs[p, 1]). Pairs are listed section by section (axial RoPE), then by
    frequency index j within the section.
  """
  if pairing not in ROPE_PAIRINGS:
    raise ValueError(f"rope_pairing must be one of {ROPE_PAIRINGS}, got {pairing!r}")
  r = rotary_dims(head_dim, rotary_fraction, rope_axes)
  section = r // rope_axes
  j = np.arange(section // 2)
  if pairing == "half":
    local = np.stack([j, j + section // 2], axis=1)
  else:
    local = np.stack([2 * j, 2 * j + 1], axis=1)
  return np.concatenate([local + a * section for a in range(rope_axes)], axis=0)


def rope_frequencies(head_dim: int, *, base: float = 10000.0, rotary_fraction: float = 1.0,
                     rope_axes: int = 1) -> np.ndarray:
  """Angular frequency w_p = base^(-2j / section) of every pair of ``rope_pairs``; [P]."""
  r = rotary_dims(head_dim, rotary_fraction, rope_axes)
  section = r // rope_axes
  j = np.arange(section // 2)
  return np.tile(base ** (-2.0 * j / section), rope_axes)


def unrotated_dims(head_dim: int, pairs: np.ndarray) -> np.ndarray:
  """[H - r] int32: the coordinates of a head that no pair of ``pairs`` ([r / 2, 2],
  ``rope_pairs``) rotates, in order (none under full rotary)."""
  return np.setdiff1d(np.arange(head_dim, dtype=np.int32), pairs.reshape(-1).astype(np.int32))


def apply_rope(x: jax.Array, positions: jax.Array, *, pairing: str = "half",
               base: float = 10000.0, rotary_fraction: float = 1.0) -> jax.Array:
  """Rotates queries or keys by their positions.

  Args:
    x: [..., T, N, H] queries or keys.
    positions: [..., T] integer or real positions, or [..., T, A] for axial
      RoPE over A position coordinates.
    pairing: "half" or "interleaved" (see the module docstring).
    base: frequency base.
    rotary_fraction: fraction of the head dims that is rotated (from the front).

  Returns:
    [..., T, N, H] array x R_m, same dtype as x.
  """
  head_dim = x.shape[-1]
  positions = jnp.asarray(positions)
  axial = positions.ndim == x.ndim - 1
  rope_axes = positions.shape[-1] if axial else 1
  pairs = rope_pairs(head_dim, pairing=pairing, rotary_fraction=rotary_fraction,
                     rope_axes=rope_axes)
  freqs = rope_frequencies(head_dim, base=base, rotary_fraction=rotary_fraction,
                           rope_axes=rope_axes)
  if not axial:
    positions = positions[..., None]
  # Position coordinate a drives the pairs of section a: [..., T, P].
  section_of_pair = np.repeat(np.arange(rope_axes), len(pairs) // rope_axes)
  angles = positions[..., section_of_pair].astype(x.dtype) * freqs.astype(x.dtype)
  cos = jnp.cos(angles)[..., None, :]  # [..., T, 1, P]
  sin = jnp.sin(angles)[..., None, :]
  x1, x2 = x[..., pairs[:, 0]], x[..., pairs[:, 1]]
  rest = unrotated_dims(head_dim, pairs)
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos, x[..., rest]], axis=-1)
  order = np.concatenate([pairs[:, 0], pairs[:, 1], rest])
  return rotated[..., np.argsort(order)]


def sinusoidal_position_encoding(num_positions: int, dim: int, *, base: float = 10000.0,
                                 dtype: Any = jnp.float32) -> jax.Array:
  """The Transformer's fixed absolute encoding, [T, D]: sin on even, cos on odd dims."""
  pos = np.arange(num_positions)[:, None]
  inv = base ** (-np.arange(0, dim, 2) / dim)
  table = np.zeros((num_positions, dim))
  table[:, 0::2] = np.sin(pos * inv)
  table[:, 1::2] = np.cos(pos * inv)[:, : dim // 2]
  return jnp.asarray(table, dtype)


PROJECTIONS = ("query", "key", "value", "out")
LEAVES = ("query/kernel", "key/kernel", "value/kernel", "out/kernel", "query/bias", "key/bias",
          "value/bias", "out/bias")


def kv_heads(num_heads: int, num_kv_heads: int | None = None) -> int:
  """K: ``num_kv_heads``, or N (plain multi-head attention) when it is None."""
  return num_heads if num_kv_heads is None else num_kv_heads


def leaf_shapes(width: int, num_heads: int, num_kv_heads: int, head_dim: int,
                lead: tuple[int, ...] = ()) -> dict[str, tuple[int, ...]]:
  """The shape of every leaf of ``LEAVES`` (module docstring's table), after ``lead`` axes."""
  d, n, k, h = width, num_heads, num_kv_heads, head_dim
  return {"query/kernel": (*lead, d, n, h), "key/kernel": (*lead, d, k, h),
          "value/kernel": (*lead, d, k, h), "out/kernel": (*lead, n, h, d),
          "query/bias": (*lead, n, h), "key/bias": (*lead, k, h), "value/bias": (*lead, k, h),
          "out/bias": (*lead, d)}


def layer_shapes(params: Params, prefix: str = "") -> tuple[tuple[int, ...], int, int, int, int]:
  """(lead, D, N, K, H) of a canonical layer or a stack with leading axes ``lead``.

  Every leaf is checked against ``leaf_shapes``; ``prefix`` (the layer's path)
  goes in front of the leaf paths in errors.

  Raises:
    ValueError: naming the leaf, for flat paths ("query/kernel") as keys, a leaf outside
      ``LEAVES``, a missing
      kernel, kv heads that do not divide the query heads, or a shape that
      disagrees with the query and key kernels.
  """
  slashed = [name for name in params if "/" in str(name)]
  if slashed:
    raise ValueError(f"{prefix}{slashed[0]}: attention params are nested dicts "
                     "({'query': {'kernel': ...}, ...}), not flat paths ('query/kernel'); "
                     "spec.unflatten turns flat paths into nested dicts")
  flat = {}
  for name, node in params.items():
    for leaf, v in (node.items() if isinstance(node, Mapping) else [("", node)]):
      flat[f"{name}/{leaf}"] = v
  for path, leaf in flat.items():
    if path not in LEAVES or isinstance(leaf, Mapping):
      raise ValueError(f"{prefix}{path} is not a leaf of a canonical attention layer {LEAVES}")
  for name in PROJECTIONS:
    if f"{name}/kernel" not in flat:
      raise ValueError(f"attention params lack {prefix}{name}/kernel")
  query = flat["query/kernel"]
  if query.ndim < 3:
    raise ValueError(f"{prefix}query/kernel must be [..., D, N, H], got shape {tuple(query.shape)}")
  *lead, d, n, h = query.shape
  lead = tuple(lead)
  k = flat["key/kernel"].shape[-2] if flat["key/kernel"].ndim == query.ndim else -1
  if k <= 0 or n % k:
    raise ValueError(f"{prefix}key/kernel has shape {tuple(flat['key/kernel'].shape)}: its kv heads "
                     f"must divide the {n} query heads of {prefix}query/kernel {tuple(query.shape)}")
  expected = leaf_shapes(d, n, k, h, lead)
  for path, leaf in flat.items():
    if tuple(leaf.shape) != expected[path]:
      raise ValueError(f"{prefix}{path} has shape {tuple(leaf.shape)}, expected {expected[path]} "
                       f"(D={d}, N={n}, K={k}, H={h} from {prefix}query/kernel and key/kernel)")
  return lead, d, n, k, h


def bias_or_zeros(params: Params, name: str) -> jax.Array:
  """The bias of projection ``name`` ("query", "key", "value"): [..., N|K, H], zeros if absent."""
  kernel = params[name]["kernel"]
  bias = params[name].get("bias")
  if bias is None:
    bias = jnp.zeros(kernel.shape[:-3] + kernel.shape[-2:], kernel.dtype)
  return bias


def attention_shapes(params: Params) -> tuple[int, int, int, int]:
  """(D, N, K, H) of one canonical attention layer, read from its kernels (unchecked;
  ``layer_shapes`` checks every leaf)."""
  d, n, h = params["query"]["kernel"].shape[-3:]
  k = params["key"]["kernel"].shape[-2]
  return d, n, k, h


def _dense(params: Params, x: jax.Array, spec: str) -> jax.Array:
  y = jnp.einsum(spec, x, params["kernel"])
  if "bias" in params:
    y = y + params["bias"]
  return y


class HeadActivations(NamedTuple):
  """One layer's per-head activations, the taps of an attention site (its field names are the
  tap names, ``spec.SITE_TAPS``).

  Attributes:
    q: queries [B, T, N, H], after RoPE (as the logits read them).
    k: keys [B, T, K, H], after RoPE.
    v: values [B, T, K, H].
    heads: the heads' outputs before the output projection
      z_{m,n} = sum_t softmax_t(q_{m,n} k_{t,k(n)}^T / sqrt(H)) v_{t,k(n)}, [B, T, N, H].
  """
  q: jax.Array
  k: jax.Array
  v: jax.Array
  heads: jax.Array


def attention_heads(params: Params, x: jax.Array, *, pos_encoding: str = "none",
                    rope_pairing: str = "half", rope_base: float = 10000.0,
                    rotary_fraction: float = 1.0, causal: bool = False,
                    positions: jax.Array | None = None, mask: jax.Array | None = None
                    ) -> HeadActivations:
  """Self-attention up to the output projection, per head (``multi_head_attention``'s
  arguments).

  Returns:
    The queries, keys, values and heads' outputs (``HeadActivations``).
  """
  if pos_encoding not in POS_ENCODINGS:
    raise ValueError(f"pos_encoding must be one of {POS_ENCODINGS}, got {pos_encoding!r}")
  _, n, k, h = attention_shapes(params)
  if n % k:
    raise ValueError(f"num_heads {n} is not a multiple of num_kv_heads {k}")
  g = n // k
  b, t, _ = x.shape
  q = _dense(params["query"], x, "btd,dnh->btnh")
  key = _dense(params["key"], x, "btd,dkh->btkh")
  v = _dense(params["value"], x, "btd,dkh->btkh")
  if pos_encoding == "rope":
    if positions is None:
      positions = jnp.arange(t)
    positions = jnp.asarray(positions)
    rope = dict(pairing=rope_pairing, base=rope_base, rotary_fraction=rotary_fraction)
    q = apply_rope(q, positions, **rope)
    key = apply_rope(key, positions, **rope)
  logits = jnp.einsum("btkgh,bskh->bkgts", q.reshape(b, t, k, g, h), key) / math.sqrt(h)
  allowed = jnp.ones((t, t), bool)
  if causal:
    allowed = jnp.tril(allowed)
  allowed = jnp.broadcast_to(allowed, (b, 1, 1, t, t))
  if mask is not None:
    allowed = allowed & jnp.asarray(mask, bool)[:, None, None, None, :]
  logits = jnp.where(allowed, logits, jnp.finfo(logits.dtype).min)
  weights = jax.nn.softmax(logits, axis=-1)
  heads = jnp.einsum("bkgts,bskh->btkgh", weights, v).reshape(b, t, n, h)
  return HeadActivations(q, key, v, heads)


def output_projection(params: Params, heads: jax.Array) -> jax.Array:
  """The heads' outputs [B, T, N, H] through the output projection: [B, T, D]."""
  return _dense(params["out"], heads, "btnh,nhd->btd")


def multi_head_attention(params: Params, x: jax.Array, *, pos_encoding: str = "none",
                         rope_pairing: str = "half", rope_base: float = 10000.0,
                         rotary_fraction: float = 1.0, causal: bool = False,
                         positions: jax.Array | None = None,
                         mask: jax.Array | None = None) -> jax.Array:
  """Multi-head (or grouped-query) self-attention.

  y_m = sum_n sum_t softmax_t(q_{m,n} k_{t,n}^T / sqrt(H)) v_{t,n} W^O_n + b^O,
  with q, k rotated by RoPE when ``pos_encoding == "rope"``. Absolute encodings
  ("sinusoidal", "learned") are added to x by the caller, so for them (and
  "none") the layer is the plain, position-free one.

  Args:
    params: canonical layer parameters (module docstring).
    x: [B, T, D] input.
    pos_encoding: one of "none", "sinusoidal", "learned", "rope".
    rope_pairing, rope_base, rotary_fraction: RoPE settings (``apply_rope``).
    causal: mask out keys after the query.
    positions: [B, T] or [T] positions for RoPE (default 0..T-1), or
      [..., T, A] for axial RoPE.
    mask: optional [B, T] boolean key mask (True = attend), e.g. padding.

  Returns:
    [B, T, D] output, dtype of x.
  """
  taps = attention_heads(params, x, pos_encoding=pos_encoding, rope_pairing=rope_pairing,
                         rope_base=rope_base, rotary_fraction=rotary_fraction, causal=causal,
                         positions=positions, mask=mask)
  return output_projection(params, taps.heads)


def init_attention(key: jax.Array, *, width: int, num_heads: int, head_dim: int,
                   num_kv_heads: int | None = None, use_bias: bool = True,
                   dtype: Any = jnp.float32) -> Params:
  """Random canonical attention parameters (LeCun-normal kernels, small random biases)."""
  shapes = leaf_shapes(width, num_heads, kv_heads(num_heads, num_kv_heads), head_dim)
  params = {}
  for i, name in enumerate(PROJECTIONS):
    kk, kb = jax.random.split(jax.random.fold_in(key, i))
    fan_in = width if name != "out" else num_heads * head_dim
    params[name] = {"kernel": jax.random.normal(kk, shapes[f"{name}/kernel"], dtype)
                              / math.sqrt(fan_in)}
    if use_bias:
      params[name]["bias"] = 0.1 * jax.random.normal(kb, shapes[f"{name}/bias"], dtype)
  return params
