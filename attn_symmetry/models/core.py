"""The shared Transformer core: NNX layers, the layer stack and its symmetry spec.

Parameter paths (the pure view, "/"-joined):

    layers_i/attention_norm/{scale, bias}        [D]   (no bias for RMSNorm)
    layers_i/attention/{query,key,value,out}/... canonical layout (attention.py)
    layers_i/mlp_norm/{scale, bias}              [D]
    layers_i/mlp/{wi,wo}/{kernel,bias}           [D, F], [F]; [F, D], [D]
    layers_i/mlp/{gate,up,down}/{kernel,bias}    gated FFN (SwiGLU)
    final_norm/{scale, bias}                     [D]   (pre-norm models only)

and, for the text families (``TextCore``), embed/embedding [V, D],
segment_embed/embedding [S, D], pos_embed/embedding [max_len, D] and
embed_norm (post-norm).

Pre-norm layer:  x <- x + attn(norm_a(x));  x <- x + mlp(norm_m(x)).
Parallel layer:  x <- x + attn(norm_a(x)) + mlp(norm_m(x))   (GPT-NeoX, pre-norm).
Post-norm layer: x <- norm_a(x + attn(x));  x <- norm_m(x + mlp(x)).
The attention layer calls ``attention.multi_head_attention`` on its own
parameters, so a group element of ``group_action`` acts on
``params["layers_i"]["attention"]`` with no conversion.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from attn_symmetry import attention
from attn_symmetry import spec as spec_lib
from attn_symmetry import tasks
from attn_symmetry.models.config import Config

Axes = dict[str, tuple[str | None, ...]]
RESIDUAL = "residual"  # the name of the residual stream's factor in every family's spec
EMBED = "embed"  # ``encode``'s intermediate: the stream entering the layers
# A layer's two parts: its submodules, its intermediates "layers_i/attention" (the attention
# output) and "layers_i/mlp" (the FFN hidden units), and the spec's attention site and FFN
# factor of those names.
ATTENTION, MLP = "attention", "mlp"

ACTIVATIONS = {
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "silu": jax.nn.silu,
    "relu": jax.nn.relu,
}


# The largest draw padded to a power of two (``_draw_size``): 2^22 float32 numbers, 16 MiB.
_MAX_PADDED_DRAW = 1 << 22


def _draw_size(size: int) -> int:
  """How many numbers ``normal_param`` draws for a parameter of ``size`` elements.

  The next power of two, of which the parameter takes the first ``size``: JAX's threefry is
  counter based (``jax_threefry_partitionable``, the default), so the first n numbers of a
  flat draw of m >= n are the draw of n, and the values are those of an exact draw. An eager
  draw compiles once per length (threefry and the normal transform, about 0.1 s on a CPU at
  -O0): padded, the sizes of a model, and of the next model, share a few lengths. Above
  ``_MAX_PADDED_DRAW``, or without the counter-based mode, the draw is exact.
  """
  if size > _MAX_PADDED_DRAW or not jax.config.jax_threefry_partitionable:
    return size
  return 1 << max(size - 1, 0).bit_length()


@functools.partial(jax.jit, static_argnames="shape")
def _scaled_head(draw: jax.Array, std: float, shape: tuple[int, ...]) -> jax.Array:
  """std * the first prod(shape) numbers of the flat ``draw``, in ``shape``."""
  return (std * draw[:math.prod(shape)]).reshape(shape)


def normal_param(rngs: nnx.Rngs, shape: tuple[int, ...], std: float) -> nnx.Param:
  """A parameter drawn from N(0, std^2).

  Drawn flat, of ``_draw_size`` numbers, then cut, scaled and reshaped in one small program:
  the values of ``std * jax.random.normal(key, (size,))`` reshaped, with one compiled draw for
  every parameter size up to the same power of two.
  """
  draw = jax.random.normal(rngs.params(), (_draw_size(math.prod(shape)),))
  return nnx.Param(_scaled_head(draw, std, tuple(shape)))


class Dense(nnx.Module):
  """y = x . kernel + bias, contracting the trailing axes of x with the kernel's leading ones.

  kernel [*in_shape, *out_shape], bias [*out_shape] (optional). E.g. a query
  projection is Dense((D,), (N, H)) and an output projection Dense((N, H), (D,)).
  """

  def __init__(self, in_shape: Sequence[int], out_shape: Sequence[int], *, use_bias: bool,
               init_std: float, rngs: nnx.Rngs):
    self.num_in = len(in_shape)
    self.kernel = normal_param(rngs, (*in_shape, *out_shape), init_std)
    self.bias = nnx.Param(jnp.zeros(tuple(out_shape))) if use_bias else None

  def tree(self) -> dict[str, jax.Array]:
    """The parameters as a plain dict {"kernel": ..., "bias": ...}."""
    out = {"kernel": self.kernel[...]}
    if self.bias is not None:
      out["bias"] = self.bias[...]
    return out

  def __call__(self, x: jax.Array) -> jax.Array:
    y = jnp.tensordot(x, self.kernel[...], axes=self.num_in)
    return y if self.bias is None else y + self.bias[...]


class Embedding(nnx.Module):
  """A lookup table ``embedding`` [V, D]; ``attend`` gives x E^T (a tied output head)."""

  def __init__(self, num: int, width: int, *, init_std: float, rngs: nnx.Rngs):
    self.embedding = normal_param(rngs, (num, width), init_std)

  def __call__(self, ids: jax.Array) -> jax.Array:
    return jnp.take(self.embedding[...], ids, axis=0)

  def attend(self, x: jax.Array) -> jax.Array:
    return x @ self.embedding[...].T


class Norm(nnx.Module):
  """LayerNorm (x - mu) / sqrt(var + eps) * scale + bias, or RMSNorm x / sqrt(mean x^2 + eps) * scale."""

  def __init__(self, width: int, *, kind: str, eps: float):
    self.kind, self.eps = kind, eps
    self.scale = nnx.Param(jnp.ones((width,)))
    self.bias = nnx.Param(jnp.zeros((width,))) if kind == "layer" else None

  def __call__(self, x: jax.Array) -> jax.Array:
    if self.kind == "rms":
      return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + self.eps) * self.scale[...]
    centred = x - jnp.mean(x, -1, keepdims=True)
    var = jnp.mean(centred * centred, -1, keepdims=True)
    return centred * jax.lax.rsqrt(var + self.eps) * self.scale[...] + self.bias[...]


def make_norm(cfg: Config) -> Norm:
  return Norm(cfg.width, kind=cfg.norm, eps=cfg.norm_eps)


class Attention(nnx.Module):
  """Self-attention on the canonical layout, computed by ``attention.multi_head_attention``."""

  def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
    self.cfg = cfg
    d, n, k, h = cfg.width, cfg.num_heads, cfg.kv_heads, cfg.head_dim
    dense = lambda i, o, bias: Dense(i, o, use_bias=bias, init_std=cfg.init_std, rngs=rngs)
    self.query, self.key, self.value = (dense((d,), (m, h), cfg.qkv_bias) for m in (n, k, k))
    self.out = dense((n, h), (d,), cfg.out_bias)

  def __call__(self, x: jax.Array, *, positions: jax.Array | None,
               mask: jax.Array | None) -> jax.Array:
    """x [B, T, D] -> [B, T, D]; positions as in ``multi_head_attention`` (RoPE only)."""
    return self.with_taps(x, positions=positions, mask=mask)[0]

  def with_taps(self, x: jax.Array, *, positions: jax.Array | None, mask: jax.Array | None
                ) -> tuple[jax.Array, attention.HeadActivations]:
    """(output [B, T, D], the per-head activations of ``attention.attention_heads``)."""
    cfg = self.cfg
    params = {name: getattr(self, name).tree() for name in ("query", "key", "value", "out")}
    taps = attention.attention_heads(
        params, x, pos_encoding="rope" if cfg.rotary else "none", rope_pairing=cfg.rope_pairing,
        rope_base=cfg.rope_base, rotary_fraction=cfg.rotary_fraction, causal=cfg.causal,
        positions=positions, mask=mask)
    return attention.output_projection(params, taps.heads), taps


class Mlp(nnx.Module):
  """act(x W_i + b_i) W_o + b_o, or gated act(x W_gate) * (x W_up) W_down."""

  def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
    self.cfg = cfg
    dense = lambda i, o: Dense((i,), (o,), use_bias=cfg.mlp_bias, init_std=cfg.init_std, rngs=rngs)
    d, f = cfg.width, cfg.mlp_dim
    if cfg.gated_mlp:
      self.gate, self.up, self.down = dense(d, f), dense(d, f), dense(f, d)
    else:
      self.wi, self.wo = dense(d, f), dense(f, d)

  def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., D] -> (output [..., D], hidden units [..., F])."""
    act = ACTIVATIONS[self.cfg.activation]
    if self.cfg.gated_mlp:
      hidden = act(self.gate(x)) * self.up(x)
      return self.down(hidden), hidden
    hidden = act(self.wi(x))
    return self.wo(hidden), hidden


class Block(nnx.Module):
  """One Transformer layer (pre-norm, parallel or post-norm, module docstring)."""

  def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
    self.post_norm, self.parallel = cfg.post_norm, cfg.parallel_residual
    self.attention_norm = make_norm(cfg)
    self.attention = Attention(cfg, rngs=rngs)
    self.mlp_norm = make_norm(cfg)
    self.mlp = Mlp(cfg, rngs=rngs)

  def __call__(self, x, *, positions, mask, taps: bool = False):
    """x [B, T, D] -> (x, parts): parts {ATTENTION: the attention output [B, T, D],
    MLP: the FFN hidden units [B, T, F]}, and with ``taps`` the attention's per-head
    activations (``Attention.with_taps``) under ``spec.tap(ATTENTION, t)`` for t in
    ``spec.SITE_TAPS`` ("attention:q", ...)."""
    attend = lambda y: self.attention.with_taps(y, positions=positions, mask=mask)
    if self.post_norm:
      attn, heads = attend(x)
      x = self.attention_norm(x + attn)
      out, hidden = self.mlp(x)
      x = self.mlp_norm(x + out)
    elif self.parallel:
      attn, heads = attend(self.attention_norm(x))
      out, hidden = self.mlp(self.mlp_norm(x))
      x = x + attn + out
    else:
      attn, heads = attend(self.attention_norm(x))
      x = x + attn
      out, hidden = self.mlp(self.mlp_norm(x))
      x = x + out
    parts = {ATTENTION: attn, MLP: hidden}
    if taps:
      parts |= {spec_lib.tap(ATTENTION, k): v for k, v in heads._asdict().items()}
    return x, parts


class TransformerCore(nnx.Module):
  """The layer stack ``layers_0 ... layers_{L-1}`` (+ ``final_norm`` when pre-norm).

  Families subclass it, add their embeddings and heads, and call ``encode``.
  """

  def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
    self.cfg = cfg
    for i in range(cfg.depth):
      setattr(self, f"layers_{i}", Block(cfg, rngs=rngs))
    self.final_norm = None if cfg.post_norm else make_norm(cfg)

  def encode(self, x: jax.Array, *, positions: jax.Array | None = None,
             mask: jax.Array | None = None, layers: Callable[..., jax.Array] | None = None
             ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Runs the layers on x [B, T, D].

    ``layers(x, positions=..., mask=...)``, when given, runs in place of this module's own
    layers (``Model.apply_streamed``, which reads them one at a time); the intermediates then
    hold only "embed".

    Returns:
      The final stream [B, T, D] (after ``final_norm`` when pre-norm) and the
      intermediates {"embed": input [B, T, D], "layers_i/attention": attention
      output [B, T, D], "layers_i/mlp": FFN hidden units [B, T, F],
      "layers_i": layer output [B, T, D]}. Their last axes are the ones that
      the spec's factors "residual" and "layers_i/mlp" act on.
    """
    inter = {EMBED: x}
    if layers is not None:
      x = layers(x, positions=positions, mask=mask)
    else:
      for i in range(self.cfg.depth):
        x, parts = getattr(self, f"layers_{i}")(x, positions=positions, mask=mask)
        inter |= {f"layers_{i}/{k}": v for k, v in parts.items()}
        inter[f"layers_{i}"] = x
    if self.final_norm is not None:
      x = self.final_norm(x)
    return x, inter


def check_tokens(cfg: Config, tokens: Any, name: str = "inputs") -> jax.Array:
  """Validates int tokens [B, T] against the config before any work."""
  tokens = jnp.asarray(tokens)
  if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise ValueError(f"{name} must be int tokens [B, T], got {tokens.dtype} {tokens.shape}")
  if cfg.pos_encoding in ("learned", "sinusoidal") and tokens.shape[1] > cfg.max_len:
    raise ValueError(f"{name} has {tokens.shape[1]} tokens, more than config.max_len {cfg.max_len}")
  return tokens


def absolute_positions(cfg: Config, pos_embed: Embedding | None, num: int,
                       dtype: Any) -> jax.Array | float:
  """The absolute encoding added to the first ``num`` tokens, [num, D], or 0.0."""
  if cfg.pos_encoding == "learned":
    return pos_embed.embedding[...][:num]
  if cfg.pos_encoding == "sinusoidal":
    return attention.sinusoidal_position_encoding(num, cfg.width, dtype=dtype)
  return 0.0


class TextCore(TransformerCore):
  """The core with token (+ segment, + position) embeddings in front.

  Parameters: ``embed/embedding`` [V, D], ``segment_embed/embedding`` [S, D]
  (num_segments > 0), ``pos_embed/embedding`` [max_len, D] ("learned"),
  ``embed_norm`` (post-norm models, as BERT).
  """

  def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
    super().__init__(cfg, rngs=rngs)
    d, std = cfg.width, cfg.init_std
    self.embed = Embedding(cfg.vocab_size, d, init_std=std, rngs=rngs)
    self.segment_embed = (Embedding(cfg.num_segments, d, init_std=std, rngs=rngs)
                          if cfg.num_segments else None)
    self.pos_embed = (Embedding(cfg.max_len, d, init_std=std, rngs=rngs)
                      if cfg.pos_encoding == "learned" else None)
    self.embed_norm = make_norm(cfg) if cfg.post_norm else None

  def encode_tokens(self, tokens, *, mask, segments, layers=None
                    ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """int tokens [B, T] -> (final stream [B, T, D], intermediates of ``encode``; ``layers``
    as there)."""
    cfg = self.cfg
    tokens = check_tokens(cfg, tokens)
    if mask is not None and jnp.shape(mask) != tokens.shape:
      raise ValueError(f"mask must be bool [B, T] = {tokens.shape}, got {jnp.shape(mask)}")
    if segments is not None:
      if self.segment_embed is None:
        raise ValueError("segments given but config.num_segments is 0")
      segments = check_tokens(cfg, segments, "segments")
      if segments.shape != tokens.shape:
        raise ValueError(f"segments must be [B, T] = {tokens.shape}, got {segments.shape}")
    x = self.embed(tokens)
    if self.segment_embed is not None:
      x = x + self.segment_embed(jnp.zeros_like(tokens) if segments is None else segments)
    x = x + absolute_positions(cfg, self.pos_embed, tokens.shape[1], x.dtype)
    if self.embed_norm is not None:
      x = self.embed_norm(x)
    return self.encode(x, mask=mask, layers=layers)


# ----------------------------------------------------------------------------- symmetry spec


def residual_factor(cfg: Config) -> spec_lib.Factor | None:
  """The group acting on the residual stream, or None if it has none.

  * Fixed sinusoidal encodings are added to the stream and cannot be permuted
    along with it: no residual symmetry.
  * A model without a task head (``tasks.FEATURES``: BERT's bare encoder)
    outputs its last hidden state, the stream itself: moving the stream would
    change what the model computes, so it has no residual symmetry either.
  * RMSNorm pre-norm models with an untied head: any orthogonal map (after
    ``group_action.fold_norm_scales``).
  * Otherwise (LayerNorm; post-norm, where the norm output is the stream
    itself; a tied head, where the embedding is both writer and reader of a
    scaled stream): permutations. A pre-LayerNorm model with an untied head
    has a larger group, O(d - 1) on the mean-zero subspace, which its spec
    offers through ``SymmetrySpec.with_residual`` (``SpecBuilder.build``).
  """
  if cfg.pos_encoding == "sinusoidal" or cfg.task == tasks.FEATURES:
    return None
  orthogonal = cfg.norm == "rms" and not cfg.post_norm and not cfg.tied_embeddings
  return spec_lib.Factor(cfg.width, "orthogonal" if orthogonal else "permutation")


def norm_axes(prefix: str, cfg: Config, r: str | None) -> Axes:
  axes = {f"{prefix}/scale": (r,)}
  if cfg.norm == "layer":
    axes[f"{prefix}/bias"] = (r,)
  return axes


def dense_leaves(prefix: str, use_bias: bool) -> tuple[str, str | None]:
  """The (kernel, bias or None) leaf paths of the ``Dense`` at path ``prefix``."""
  return f"{prefix}/kernel", f"{prefix}/bias" if use_bias else None


def dense_axes(prefix: str, kernel: tuple[str | None, ...], bias: tuple[str | None, ...] | None,
               use_bias: bool) -> Axes:
  """Spec axes of the ``Dense`` at ``prefix``: ``kernel``'s, and ``bias``'s when it has one."""
  kernel_path, bias_path = dense_leaves(prefix, use_bias)
  axes = {kernel_path: kernel}
  if bias_path is not None:
    axes[bias_path] = bias
  return axes


@dataclasses.dataclass
class SpecBuilder:
  """A model's ``SymmetrySpec`` being put together: the core's parts, which a family extends
  with its embeddings and head before ``build``.

  Attributes:
    cfg: model config.
    r: name of the residual factor ("residual"), or None when the stream has
      no symmetry (``residual_factor``): the axis name of every leaf's
      residual dimension.
    factors: the permutation factors besides the residual one ("layers_i/mlp", ...).
    axes: every leaf's axes (``spec.SymmetrySpec``).
    sites: the attention sites by parameter prefix.
    readers: each RMSNorm scale and the leaves that read its output (used for
      an orthogonal residual only).
    writers: each layer part's projection into the stream (``spec.SymmetrySpec``).
  """
  cfg: Config
  r: str | None
  factors: dict[str, spec_lib.Factor] = dataclasses.field(default_factory=dict)
  axes: Axes = dataclasses.field(default_factory=dict)
  sites: dict[str, spec_lib.AttentionSite] = dataclasses.field(default_factory=dict)
  readers: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
  writers: dict[str, tuple[str, str | None]] = dataclasses.field(default_factory=dict)

  def build(self) -> spec_lib.SymmetrySpec:
    """The spec; norm scales are listed only for an orthogonal residual (RMSNorm).

    A pre-LayerNorm model with an untied head (GPT-2 untied, ViT, GPT-NeoX) reads its stream
    through LayerNorms only: its spec carries the stream's ``LayerNormStream`` (streams), so
    that ``with_residual(RESIDUAL, "mean_zero_orthogonal")`` gives its O(d - 1) residual.
    The stream's writers are the leaves on the stream that are neither a norm's nor a
    norm's reader (every reader of a pre-norm model reads a norm's output).
    """
    cfg, r = self.cfg, self.r
    residual = residual_factor(cfg)
    factors = self.factors if residual is None else {r: residual, **self.factors}
    orthogonal = residual is not None and residual.kind == "orthogonal"
    streams = {}
    if (residual is not None and cfg.norm == "layer" and not cfg.post_norm
        and not cfg.tied_embeddings):
      norms = {s: (s[:-len("scale")] + "bias", readers) for s, readers in self.readers.items()}
      read = {p for s, (b, readers) in norms.items() for p in (s, b, *readers)}
      writers = tuple(p for p, axes in self.axes.items() if r in axes and p not in read)
      streams[r] = spec_lib.LayerNormStream(writers, norms)
    return spec_lib.SymmetrySpec(factors, self.axes, self.sites,
                                 self.readers if orthogonal else {}, self.writers, streams)


def core_spec(cfg: Config) -> SpecBuilder:
  """The spec of the layer stack, for a family to extend (``SpecBuilder``).

  Holds: the FFN permutation "layers_i/mlp" per layer, every layer leaf's
  axes, the attention site "layers_i/attention" per layer (group "rope" with
  its layout for rotary models, "gl" otherwise), the final norm (pre-norm),
  each norm scale with the leaves that read its output, and the output and down
  projections that write each layer's attention and FFN into the stream.
  """
  site = spec_lib.AttentionSite(cfg.num_heads, cfg.head_dim, num_kv_heads=cfg.num_kv_heads,
                                group="rope" if cfg.rotary else "gl",
                                rope_pairing=cfg.rope_pairing,
                                rotary_fraction=cfg.rotary_fraction, rope_axes=cfg.rope_axes)
  spec = SpecBuilder(cfg, RESIDUAL if residual_factor(cfg) is not None else None)
  r, axes = spec.r, spec.axes
  for i in range(cfg.depth):
    lp = f"layers_{i}"
    a, f = f"{lp}/{ATTENTION}", f"{lp}/{MLP}"
    spec.factors[f] = spec_lib.Factor(cfg.mlp_dim)
    spec.sites[a] = site
    axes |= norm_axes(f"{lp}/attention_norm", cfg, r) | norm_axes(f"{lp}/mlp_norm", cfg, r)
    for name in ("query", "key", "value"):
      axes |= dense_axes(f"{a}/{name}", (r, None, None), (None, None), cfg.qkv_bias)
    axes |= dense_axes(f"{a}/out", (None, None, r), (r,), cfg.out_bias)
    mlp_in = ("gate", "up") if cfg.gated_mlp else ("wi",)
    mlp_out = "down" if cfg.gated_mlp else "wo"
    for name in mlp_in:
      axes |= dense_axes(f"{f}/{name}", (r, f), (f,), cfg.mlp_bias)
    axes |= dense_axes(f"{f}/{mlp_out}", (f, r), (r,), cfg.mlp_bias)
    spec.writers[a] = dense_leaves(f"{a}/out", cfg.out_bias)
    spec.writers[f] = dense_leaves(f"{f}/{mlp_out}", cfg.mlp_bias)
    spec.readers[f"{lp}/attention_norm/scale"] = tuple(
        f"{a}/{n}/kernel" for n in ("query", "key", "value"))
    spec.readers[f"{lp}/mlp_norm/scale"] = tuple(f"{f}/{n}/kernel" for n in mlp_in)
  if not cfg.post_norm:
    axes |= norm_axes("final_norm", cfg, r)
  return spec


def text_embedding_axes(cfg: Config, r: str | None) -> Axes:
  """Spec axes of ``TextCore``'s embeddings: they all write the residual stream."""
  axes = {"embed/embedding": (None, r)}
  if cfg.num_segments:
    axes["segment_embed/embedding"] = (None, r)
  if cfg.pos_encoding == "learned":
    axes["pos_embed/embedding"] = (None, r)
  if cfg.post_norm:
    axes |= norm_axes("embed_norm", cfg, r)
  return axes
