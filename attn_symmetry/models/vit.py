"""Vision Transformer: patch embedding, optional CLS token, the core, a linear head.

Parameters besides the core (``core.py``):

    patch_embed/{kernel [p, p, C, D], bias [D]}   linear map of each p x p patch
    cls_token [D]                                 pooling "cls" only
    pos_embed/embedding [T, D]                    "learned" only; T = patches (+ 1)
    head/{kernel [D, classes], bias [classes]}

Tokens are the CLS token (if any) followed by the patches in row-major order.
With "rope" token t has position t; with "rope2d" (axial RoPE, half of each
head's rotated dims per grid axis) the patch in grid row i, column j has
position (i + 1, j + 1) and the CLS token (0, 0), i.e. it is not rotated.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attn_symmetry import spec as spec_lib
from attn_symmetry import tasks
from attn_symmetry.models import core
from attn_symmetry.models.config import Config, Family, register_family


def num_tokens(cfg: Config) -> int:
  return cfg.num_patches + (cfg.pooling == "cls")


def patchify(images: jax.Array, patch: int) -> jax.Array:
  """[B, S, S, C] -> [B, (S / p)^2, p, p, C], patches in row-major grid order."""
  b, s, _, c = images.shape
  g = s // patch
  x = images.reshape(b, g, patch, g, patch, c).transpose(0, 1, 3, 2, 4, 5)
  return x.reshape(b, g * g, patch, patch, c)


def rope_positions(cfg: Config) -> np.ndarray:
  """RoPE positions of the tokens: [T] for "rope", [1, T, 2] grid coordinates for "rope2d"."""
  t = num_tokens(cfg)
  if cfg.pos_encoding == "rope":
    return np.arange(t)
  g = cfg.image_size // cfg.patch_size
  grid = np.stack(np.meshgrid(np.arange(g), np.arange(g), indexing="ij"), -1).reshape(-1, 2) + 1
  if cfg.pooling == "cls":
    grid = np.concatenate([np.zeros((1, 2), grid.dtype), grid])
  return grid[None]


class VisionTransformer(core.TransformerCore):
  """images [B, S, S, C] -> class logits [B, classes]."""

  def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
    super().__init__(cfg, rngs=rngs)
    p, d = cfg.patch_size, cfg.width
    self.patch_embed = core.Dense((p, p, cfg.num_channels), (d,), use_bias=cfg.use_bias,
                                  init_std=cfg.init_std, rngs=rngs)
    self.cls_token = core.normal_param(rngs, (d,), cfg.init_std) if cfg.pooling == "cls" else None
    self.pos_embed = (core.Embedding(num_tokens(cfg), d, init_std=cfg.init_std, rngs=rngs)
                      if cfg.pos_encoding == "learned" else None)
    self.head = core.Dense((d,), (cfg.num_classes,), use_bias=True, init_std=cfg.init_std,
                           rngs=rngs)

  def __call__(self, images, *, mask=None, segments=None, layers=None):
    cfg = self.cfg
    images = jnp.asarray(images)
    want = (cfg.image_size, cfg.image_size, cfg.num_channels)
    if images.ndim != 4 or images.shape[1:] != want:
      raise ValueError(f"ViT inputs must be images [B, {want[0]}, {want[1]}, {want[2]}] "
                       f"(config.image_size, num_channels), got {images.shape}")
    if mask is not None or segments is not None:
      raise ValueError("ViT takes no mask or segments")
    dtype = self.patch_embed.kernel[...].dtype
    x = self.patch_embed(patchify(images.astype(dtype), cfg.patch_size))  # [B, P, D]
    if self.cls_token is not None:
      cls = jnp.broadcast_to(self.cls_token[...], (x.shape[0], 1, cfg.width))
      x = jnp.concatenate([cls, x], axis=1)
    x = x + core.absolute_positions(cfg, self.pos_embed, x.shape[1], dtype)
    positions = rope_positions(cfg) if cfg.rotary else None
    x, inter = self.encode(x, positions=positions, layers=layers)
    features = x[:, 0] if cfg.pooling == "cls" else jnp.mean(x, axis=1)
    inter["features"] = features
    return self.head(features), inter


def symmetry_spec(cfg: Config) -> spec_lib.SymmetrySpec:
  """Core spec plus: patch embedding and CLS token write the stream, the head reads it."""
  spec = core.core_spec(cfg)
  r = spec.r
  spec.axes |= core.dense_axes("patch_embed", (None, None, None, r), (r,), cfg.use_bias)
  if cfg.pooling == "cls":
    spec.axes["cls_token"] = (r,)
  if cfg.pos_encoding == "learned":
    spec.axes["pos_embed/embedding"] = (None, r)
  spec.axes |= core.dense_axes("head", (r, None), (None,), True)
  spec.readers["final_norm/scale"] = ("head/kernel",)
  return spec.build()


def _check(cfg: Config) -> None:
  if cfg.image_size % cfg.patch_size:
    raise ValueError(f"config.patch_size {cfg.patch_size} does not divide config.image_size "
                     f"{cfg.image_size}")


register_family(Family(
    "vit", VisionTransformer, symmetry_spec, input_key="image",
    heads={"classifier": tasks.CLASSIFICATION},
    defaults=dict(pos_encoding="learned", norm="layer", norm_eps=1e-12, activation="gelu",
                  pooling="cls"),
    check=_check))
