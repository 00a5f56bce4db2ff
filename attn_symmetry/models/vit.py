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

Its Hugging Face mapping (``hf.HFMapping``: ViTForImageClassification) is
registered with it at the end of this module.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attn_symmetry import spec as spec_lib
from attn_symmetry import tasks
from attn_symmetry.models import core
from attn_symmetry.models import hf
from attn_symmetry.models.config import Config, Family, make_config, register_family
from attn_symmetry.models.hf import Source


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


def _from_hf(c, head: str) -> Config:
  del head  # "classifier", its only head
  hf.require(c, "qkv_bias", lambda v: v is not False, "the zoo's ViT has qkv biases")
  return make_config(
      "vit", width=c.hidden_size, depth=c.num_hidden_layers, num_heads=c.num_attention_heads,
      mlp_dim=c.intermediate_size, image_size=c.image_size, patch_size=c.patch_size,
      num_channels=c.num_channels, norm_eps=c.layer_norm_eps,
      activation=hf.activation(c.hidden_act), num_classes=c.num_labels)


def _to_hf(cfg: Config):
  import transformers  # pylint: disable=g-import-not-at-top
  return transformers.ViTConfig(
      hidden_size=cfg.width, num_hidden_layers=cfg.depth, num_attention_heads=cfg.num_heads,
      intermediate_size=cfg.mlp_dim, image_size=cfg.image_size, patch_size=cfg.patch_size,
      num_channels=cfg.num_channels, layer_norm_eps=cfg.norm_eps,
      hidden_act=hf.ACT_TO_HF[cfg.activation], num_labels=cfg.num_classes, qkv_bias=True)


def _table(cfg: Config) -> hf.Table:
  e = "vit.embeddings"
  t = {"cls_token": Source(f"{e}.cls_token", lead=2),
       "pos_embed/embedding": Source(f"{e}.position_embeddings", lead=1)}
  t |= hf.dense("patch_embed", f"{e}.patch_embeddings.projection", True, "conv")
  for i in range(cfg.depth):
    h, lp = f"vit.layers.{i}", f"layers_{i}"
    t |= hf.norm(f"{lp}/attention_norm", f"{h}.layernorm_before", cfg)
    for name, proj in (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj"), ("out", "o_proj")):
      t |= hf.dense(f"{lp}/attention/{name}", f"{h}.attention.{proj}", True)
    t |= hf.norm(f"{lp}/mlp_norm", f"{h}.layernorm_after", cfg)
    t |= hf.dense(f"{lp}/mlp/wi", f"{h}.mlp.fc1", True) | hf.dense(f"{lp}/mlp/wo", f"{h}.mlp.fc2", True)
  t |= hf.norm("final_norm", "vit.layernorm", cfg) | hf.dense("head", "classifier", True)
  return t, {}


# Hub files name the layers as transformers 4 did: vit.encoder.layer.{i}.attention.attention.query
_RENAMES = tuple((rf"\.encoder\.layer\.(\d+)\.{re.escape(old)}", rf".layers.\1.{new}")
                 for old, new in (("attention.attention.query.", "attention.q_proj."),
                                  ("attention.attention.key.", "attention.k_proj."),
                                  ("attention.attention.value.", "attention.v_proj."),
                                  ("attention.output.dense.", "attention.o_proj."),
                                  ("intermediate.dense.", "mlp.fc1."),
                                  ("output.dense.", "mlp.fc2."), ("", "")))

register_family(Family(
    "vit", VisionTransformer, symmetry_spec, input_key="image",
    heads={"classifier": tasks.CLASSIFICATION},
    defaults=dict(pos_encoding="learned", norm="layer", norm_eps=1e-12, activation="gelu",
                  pooling="cls"),
    check=_check,
    hf=hf.HFMapping(
        model_types=("vit",), classes={"classifier": "ViTForImageClassification"},
        config_from_hf=_from_hf, hf_config=_to_hf, table=_table, prefix="vit.", renames=_RENAMES,
        defaults={"vit": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                              intermediate_size=3072, image_size=224, patch_size=16,
                              num_channels=3, layer_norm_eps=1e-12, hidden_act="gelu",
                              qkv_bias=True)})))
