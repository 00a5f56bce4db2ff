"""BERT: token, segment and position embeddings, a post-LN encoder, and a head.

Parameters besides the core and embeddings (``core.py``):

    head "classifier" (the pooled CLS token):
      pooler/{kernel [D, D], bias [D]}           p = tanh(x_0 W_p + b_p)
      head/{kernel [D, classes], bias [classes]} logits = p W + b
    head "mlm" (per-token masked-LM logits):
      mlm/transform/{kernel [D, D], bias [D]}    y = norm(act(x W_t + b_t))
      mlm/norm/{scale, bias} [D]
      mlm/bias [V]                               tied: logits = y E^T + b
      mlm/decoder/{kernel [D, V], bias [V]}      untied: logits = y W + b
    head "pretraining" (BertForPreTraining: MLM logits as "mlm", and next-sentence logits
    [B, 2] in intermediates["nsp_logits"]):
      the "mlm" parameters, the pooler, and
      nsp/{kernel [D, 2], bias [2]}              nsp_logits = p W_nsp + b_nsp
    head "encoder" (BertModel: no task head; sentence-transformers and embedding models):
      the pooler                                 output: the last hidden state [B, T, D];
                                                 intermediates["pooled"] = p [B, D]
    head "encoder_no_pooler" (BertModel(add_pooling_layer=False)): no parameter besides the
      core and embeddings; output: the last hidden state [B, T, D]
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from attn_symmetry import spec as spec_lib
from attn_symmetry import tasks
from attn_symmetry.models import core
from attn_symmetry.models.config import Config, Family, register_family

# The heads with a masked-LM head, and those with a pooler (a classifier and the next-sentence
# head read it; a bare encoder "encoder" outputs it beside its last hidden state).
MLM_HEADS = ("mlm", "pretraining")
POOLED_HEADS = ("classifier", "pretraining", "encoder")


class MlmHead(nnx.Module):
  """BERT's masked-LM head (module docstring)."""

  def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
    self.cfg = cfg
    d, v, std = cfg.width, cfg.vocab_size, cfg.init_std
    self.transform = core.Dense((d,), (d,), use_bias=True, init_std=std, rngs=rngs)
    self.norm = core.make_norm(cfg)
    if cfg.tied_embeddings:
      self.bias, self.decoder = nnx.Param(jnp.zeros((v,))), None
    else:
      self.bias, self.decoder = None, core.Dense((d,), (v,), use_bias=True, init_std=std, rngs=rngs)

  def __call__(self, x, embed: core.Embedding):
    y = self.norm(core.ACTIVATIONS[self.cfg.activation](self.transform(x)))
    return embed.attend(y) + self.bias[...] if self.decoder is None else self.decoder(y)


class Bert(core.TextCore):
  """int tokens [B, T] (+ mask, segments) -> class logits [B, classes], MLM logits [B, T, V], or
  (a bare encoder) the last hidden state [B, T, D]."""

  def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
    super().__init__(cfg, rngs=rngs)
    d, std = cfg.width, cfg.init_std
    if cfg.head in MLM_HEADS:
      self.mlm = MlmHead(cfg, rngs=rngs)
    if cfg.head in POOLED_HEADS:
      self.pooler = core.Dense((d,), (d,), use_bias=True, init_std=std, rngs=rngs)
    if cfg.head == "classifier":
      self.head = core.Dense((d,), (cfg.num_classes,), use_bias=True, init_std=std, rngs=rngs)
    if cfg.head == "pretraining":
      self.nsp = core.Dense((d,), (2,), use_bias=True, init_std=std, rngs=rngs)

  def __call__(self, tokens, *, mask=None, segments=None, layers=None):
    x, inter = self.encode_tokens(tokens, mask=mask, segments=segments, layers=layers)
    head = self.cfg.head
    pooled = jnp.tanh(self.pooler(x[:, 0])) if head in POOLED_HEADS else None
    if head == "classifier":
      inter["features"] = pooled
      return self.head(pooled), inter
    inter["features"] = x
    if head == "pretraining":
      inter["nsp_logits"] = self.nsp(pooled)
    if head in MLM_HEADS:
      return self.mlm(x, self.embed), inter
    if pooled is not None:
      inter["pooled"] = pooled
    return x, inter  # a bare encoder: its output is its last hidden state


def symmetry_spec(cfg: Config) -> spec_lib.SymmetrySpec:
  """Core and embedding spec plus the head.

  The pooler reads the residual stream (its input rows move with the residual
  factor). Where the classifier (or the next-sentence head) reads it, its D
  tanh units get their own permutation factor "pooler"; a bare encoder
  outputs them, so they stay as they are, and so does its residual stream,
  which is its output (``core.residual_factor``). The MLM transform writes
  into the space that the decoder reads: with a tied decoder that is the
  residual stream (the embedding), untied it is a space of its own with a
  permutation factor "mlm".
  """
  spec = core.core_spec(cfg)
  r, axes = spec.r, spec.axes
  axes |= core.text_embedding_axes(cfg, r)
  if cfg.head in MLM_HEADS:
    m = r if cfg.tied_embeddings else "mlm"
    if not cfg.tied_embeddings:
      spec.factors["mlm"] = spec_lib.Factor(cfg.width)
    axes |= core.dense_axes("mlm/transform", (r, m), (m,), True) | core.norm_axes("mlm/norm", cfg, m)
    if cfg.tied_embeddings:
      axes["mlm/bias"] = (None,)
    else:
      axes |= core.dense_axes("mlm/decoder", (m, None), (None,), True)
  if cfg.head == "encoder":
    axes |= core.dense_axes("pooler", (r, None), (None,), True)
  elif cfg.head in POOLED_HEADS:
    spec.factors["pooler"] = spec_lib.Factor(cfg.width)
    axes |= core.dense_axes("pooler", (r, "pooler"), ("pooler",), True)
    reader = "head" if cfg.head == "classifier" else "nsp"
    axes |= core.dense_axes(reader, ("pooler", None), (None,), True)
  return spec.build()


register_family(Family(
    "bert", Bert, symmetry_spec, input_key="tokens",
    heads={"classifier": tasks.CLASSIFICATION, "mlm": tasks.MLM, "pretraining": tasks.MLM,
           "encoder": tasks.FEATURES, "encoder_no_pooler": tasks.FEATURES},
    defaults=dict(pos_encoding="learned", norm="layer", norm_eps=1e-12, post_norm=True,
                  activation="gelu", num_segments=2, tied_embeddings=True, num_classes=2),
    presets={"base": dict(vocab_size=30522, max_len=512, num_classes=2)}, segments=True))
