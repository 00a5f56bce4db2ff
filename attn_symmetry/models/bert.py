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

Its Hugging Face mapping (``hf.HFMapping``: BertForSequenceClassification,
BertForMaskedLM, BertForPreTraining and BertModel) is registered with it at
the end of this module.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from attn_symmetry import spec as spec_lib
from attn_symmetry import tasks
from attn_symmetry.models import core
from attn_symmetry.models import hf
from attn_symmetry.models.config import Config, Family, make_config, register_family
from attn_symmetry.models.hf import Source

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


def head_activations(module: Bert, x: jax.Array) -> dict[str, jax.Array]:
  """The units of the head's factors (``symmetry_spec``) from the last hidden state x
  [B, T, D]: "pooler" [B, D] (the tanh units a classifier or next-sentence head reads) and
  "mlm" [B, T, D] (the untied MLM transform's units)."""
  cfg, out = module.cfg, {}
  if cfg.head in POOLED_HEADS and cfg.head != "encoder":
    out["pooler"] = jnp.tanh(module.pooler(x[:, 0]))
  if cfg.head in MLM_HEADS and not cfg.tied_embeddings:
    out["mlm"] = core.ACTIVATIONS[cfg.activation](module.mlm.transform(x))
  return out


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


def _from_hf(c, head: str) -> Config:
  hf.require(c, "position_embedding_type", lambda v: v in (None, "absolute"),
             "only absolute position embeddings")
  hf.require(c, "is_decoder", lambda v: not v, "BERT as a decoder")
  return make_config(
      "bert", width=c.hidden_size, depth=c.num_hidden_layers, num_heads=c.num_attention_heads,
      mlp_dim=c.intermediate_size, max_len=c.max_position_embeddings, vocab_size=c.vocab_size,
      num_segments=c.type_vocab_size, norm_eps=c.layer_norm_eps,
      activation=hf.activation(c.hidden_act), head=head, tied_embeddings=c.tie_word_embeddings,
      # next-sentence: 2 classes; a bare encoder has none, and takes the default
      num_classes=2 if head in ("pretraining", "encoder", "encoder_no_pooler") else c.num_labels)


def _to_hf(cfg: Config):
  import transformers  # pylint: disable=g-import-not-at-top
  return transformers.BertConfig(
      hidden_size=cfg.width, num_hidden_layers=cfg.depth, num_attention_heads=cfg.num_heads,
      intermediate_size=cfg.mlp_dim, max_position_embeddings=cfg.max_len,
      vocab_size=cfg.vocab_size, type_vocab_size=cfg.num_segments, layer_norm_eps=cfg.norm_eps,
      hidden_act=hf.ACT_TO_HF[cfg.activation], num_labels=cfg.num_classes,
      tie_word_embeddings=cfg.tied_embeddings)


def _mlm_table(cfg: Config, embedding: str) -> hf.Table:
  """The masked-LM head ``cls.predictions``; tied, its decoder repeats the ``embedding``."""
  p = "cls.predictions"
  t = hf.dense("mlm/transform", f"{p}.transform.dense", True)
  t |= hf.norm("mlm/norm", f"{p}.transform.LayerNorm", cfg)
  aliases = {f"{p}.decoder.bias": f"{p}.bias"}
  if cfg.tied_embeddings:
    t["mlm/bias"] = Source(f"{p}.bias")
    aliases[f"{p}.decoder.weight"] = embedding
  else:
    t |= {"mlm/decoder/kernel": Source(f"{p}.decoder.weight", "linear"),
          "mlm/decoder/bias": Source(f"{p}.bias")}
  return t, aliases


def _table(cfg: Config) -> hf.Table:
  e = "bert.embeddings"
  t = {"embed/embedding": Source(f"{e}.word_embeddings.weight"),
       "segment_embed/embedding": Source(f"{e}.token_type_embeddings.weight"),
       "pos_embed/embedding": Source(f"{e}.position_embeddings.weight")}
  t |= hf.norm("embed_norm", f"{e}.LayerNorm", cfg)
  for i in range(cfg.depth):
    h, lp = f"bert.encoder.layer.{i}", f"layers_{i}"
    for name in ("query", "key", "value"):
      t |= hf.dense(f"{lp}/attention/{name}", f"{h}.attention.self.{name}", True)
    t |= hf.dense(f"{lp}/attention/out", f"{h}.attention.output.dense", True)
    t |= hf.norm(f"{lp}/attention_norm", f"{h}.attention.output.LayerNorm", cfg)
    t |= hf.dense(f"{lp}/mlp/wi", f"{h}.intermediate.dense", True)
    t |= hf.dense(f"{lp}/mlp/wo", f"{h}.output.dense", True)
    t |= hf.norm(f"{lp}/mlp_norm", f"{h}.output.LayerNorm", cfg)
  aliases = {}
  if cfg.head in POOLED_HEADS:
    t |= hf.dense("pooler", "bert.pooler.dense", True)
  if cfg.head == "classifier":
    t |= hf.dense("head", "classifier", True)
  elif cfg.head == "pretraining":
    t |= hf.dense("nsp", "cls.seq_relationship", True)
  if cfg.head in MLM_HEADS:
    mlm, aliases = _mlm_table(cfg, f"{e}.word_embeddings.weight")
    t |= mlm
  return t, aliases


def _head_of(keys: set[str]) -> str:
  """The head of a BERT checkpoint with state-dict ``keys`` ("bert." prefixed).

  Raises:
    ValueError: tensors outside the encoder that are no head read here (named).
  """
  if "classifier.weight" in keys:
    return "classifier"
  if "cls.predictions.transform.dense.weight" in keys:
    return "pretraining" if "cls.seq_relationship.weight" in keys else "mlm"
  other = sorted(k for k in keys if not k.startswith("bert."))
  if not other:  # the encoder alone: BertModel
    return "encoder" if "bert.pooler.dense.weight" in keys else "encoder_no_pooler"
  shown = ", ".join(other[:3]) + (f" and {len(other) - 3} more" if len(other) > 3 else "")
  raise ValueError(f"BERT checkpoint has a head that is not read: {shown} (read: a classifier "
                   "'classifier.weight', an MLM head 'cls.predictions.*', or none, the bare "
                   "encoder of BertModel)")


register_family(Family(
    "bert", Bert, symmetry_spec, input_key="tokens",
    heads={"classifier": tasks.CLASSIFICATION, "mlm": tasks.MLM, "pretraining": tasks.MLM,
           "encoder": tasks.FEATURES, "encoder_no_pooler": tasks.FEATURES},
    defaults=dict(pos_encoding="learned", norm="layer", norm_eps=1e-12, post_norm=True,
                  activation="gelu", num_segments=2, tied_embeddings=True, num_classes=2),
    presets={"base": dict(vocab_size=30522, max_len=512, num_classes=2)}, segments=True,
    hf=hf.HFMapping(
        model_types=("bert",),
        classes={"classifier": "BertForSequenceClassification", "mlm": "BertForMaskedLM",
                 "pretraining": "BertForPreTraining", "encoder": "BertModel",
                 "encoder_no_pooler": "BertModel"},
        class_kwargs={"encoder_no_pooler": {"add_pooling_layer": False}},
        config_from_hf=_from_hf, hf_config=_to_hf, table=_table, prefix="bert.",
        head_of=_head_of,
        renames=((r"LayerNorm\.gamma$", "LayerNorm.weight"),
                 (r"LayerNorm\.beta$", "LayerNorm.bias")),  # old files' names
        defaults={"bert": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                               intermediate_size=3072, max_position_embeddings=512,
                               vocab_size=30522, type_vocab_size=2, layer_norm_eps=1e-12,
                               hidden_act="gelu", is_decoder=False, tie_word_embeddings=True)}),
    head_activations=head_activations))
