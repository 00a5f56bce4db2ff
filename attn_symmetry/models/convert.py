"""Hugging Face ``transformers`` checkpoints <-> the model zoo.

    apply_fn, params = convert.from_hf(hf_model)            # a PyTorch HF model
    apply_fn, params = convert.from_hf(state_dict, hf_config)
    cfg = convert.config_from_hf(json.load(open("config.json")), head)  # torch-free
    model, params = convert.load_hf(hf_model)                # with the Model
    hf_model = convert.to_hf(model, params)                  # back to PyTorch

Supported: ``GPT2LMHeadModel``, ``LlamaForCausalLM`` (grouped-query attention,
half-split RoPE with the default rope type), ``GPTNeoXForCausalLM`` (Pythia:
partial half-split RoPE, parallel or sequential residual),
``BertForSequenceClassification``, ``BertForMaskedLM``, ``BertForPreTraining``
(head "pretraining": the MLM head, the pooler and the next-sentence head
``cls.seq_relationship``), ``BertModel`` (no task head: sentence-transformers and
embedding models; head "encoder" with its pooler, "encoder_no_pooler" without) and
``ViTForImageClassification``; ``config_from_hf``
also reads Mistral configs (``MistralForCausalLM``: Llama's tensors, no sliding
window), for checkpoint files (``safetensors_io``).

Each family has a table from our parameter paths to HF state-dict keys and
the layout of the HF tensor (keys as the task classes name them: a ``BertModel``'s state dict, which
is the encoder's alone, has them without the "bert." prefix, ``_bare_prefix``):

* "same": the same numbers, reshaped (biases [N * H] -> [N, H], embeddings,
  norms, GPT-2's ``Conv1D`` weights, which are already [in, out]);
* "linear": a ``torch.nn.Linear`` weight [out, in], transposed, then reshaped
  (q_proj [N * H, D] -> query/kernel [D, N, H]; o_proj [D, N * H] ->
  out/kernel [N, H, D]); HF splits heads head-major, like the canonical layout;
* "conv": ViT's patch convolution [D, C, p, p] -> patch_embed/kernel [p, p, C, D];
* ``part`` i of 3 of a fused query-key-value tensor, along its output axis
  (the first of a "linear" weight, the last otherwise): GPT-2's ``c_attn``
  [D, 3D] holds query, key, value side by side; with ``heads`` = N they
  alternate head by head, as in GPT-NeoX's ``query_key_value`` [3D, D], whose
  output axis is [N, 3, H] (head n's query, key and value rows together);
* ``lead``: the HF tensor has that many leading axes of size 1 more (ViT's
  ``cls_token`` [1, 1, D]).

``hf_shape`` gives the HF tensor's shape from our leaf's without building the
HF model, for readers of checkpoint files (``safetensors_io``).

The checkpoint is compared key by key and shape by shape with an HF model
built (on PyTorch's meta device, so nothing is allocated) from the same
config, so a missing, extra or misshapen parameter is reported by name before
anything is converted. HF config options that the zoo cannot express (rope
scaling, GPT-2's per-layer attention scaling, a ViT without qkv biases, ...)
are refused with a ValueError naming the option. ``torch`` and
``transformers`` are imported only when a converter is called; ``config_from_hf``
also takes a ``config.json`` dict (absent fields take the HF class defaults),
and it, ``param_table`` and ``hf_shape`` never import them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from attn_symmetry import spec as spec_lib
from attn_symmetry import tasks
from attn_symmetry.models import bert
from attn_symmetry.models import config as config_lib
from attn_symmetry.models.model import Model

# The HF ``model_type`` values read.
MODEL_TYPES = ("gpt2", "llama", "mistral", "gpt_neox", "bert", "vit")
LLAMA_TYPES = ("llama", "mistral")  # Llama's architecture (Mistral's: the same, no biases)
_ACT_FROM_HF = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                "relu": "relu", "silu": "silu", "swish": "silu"}
_ACT_TO_HF = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu", "silu": "silu"}
_HF_CLASSES = {("gpt2", "lm"): "GPT2LMHeadModel", ("llama", "lm"): "LlamaForCausalLM",
               ("gpt_neox", "lm"): "GPTNeoXForCausalLM",
               ("bert", "classifier"): "BertForSequenceClassification",
               ("bert", "mlm"): "BertForMaskedLM", ("bert", "pretraining"): "BertForPreTraining",
               ("bert", "encoder"): "BertModel", ("bert", "encoder_no_pooler"): "BertModel",
               ("vit", "classifier"): "ViTForImageClassification"}


@dataclasses.dataclass(frozen=True)
class Source:
  """Where one of our leaves lives in an HF state dict (module docstring)."""
  key: str
  layout: str = "same"
  part: int | None = None
  heads: int | None = None
  lead: int = 0


# ----------------------------------------------------------------------------- configs

# The HF config classes' defaults of the fields read below: a config.json may leave out any field
# that has its class default (tests/test_align_checkpoints.py compares them with transformers).
_HF_DEFAULTS = {
    "gpt2": dict(n_embd=768, n_layer=12, n_head=12, n_inner=None, n_positions=1024,
                 vocab_size=50257, layer_norm_epsilon=1e-5, activation_function="gelu_new",
                 scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False,
                 tie_word_embeddings=True),
    "llama": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                  intermediate_size=11008, max_position_embeddings=2048, vocab_size=32000,
                  rms_norm_eps=1e-6, hidden_act="silu", attention_bias=False, mlp_bias=False,
                  tie_word_embeddings=False, rope_theta=10000.0),
    "mistral": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8, intermediate_size=14336,
                    max_position_embeddings=131072, vocab_size=32000, rms_norm_eps=1e-6,
                    hidden_act="silu", tie_word_embeddings=False, rope_theta=10000.0,
                    sliding_window=4096),
    "gpt_neox": dict(hidden_size=6144, num_hidden_layers=44, num_attention_heads=64,
                     intermediate_size=24576, max_position_embeddings=2048, vocab_size=50432,
                     layer_norm_eps=1e-5, hidden_act="gelu", use_parallel_residual=True,
                     attention_bias=True, tie_word_embeddings=False, rotary_pct=0.25,
                     rotary_emb_base=10000.0),
    "bert": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                 intermediate_size=3072, max_position_embeddings=512, vocab_size=30522,
                 type_vocab_size=2, layer_norm_eps=1e-12, hidden_act="gelu", is_decoder=False,
                 tie_word_embeddings=True),
    "vit": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                intermediate_size=3072, image_size=224, patch_size=16, num_channels=3,
                layer_norm_eps=1e-12, hidden_act="gelu", qkv_bias=True),
}


class _ConfigDict:
  """Attribute view of a ``config.json`` dict: absent fields take the HF class default (None
  where the class computes one), ``num_labels`` counts ``id2label`` as HF does."""

  def __init__(self, fields: Mapping[str, Any]):
    self._fields = {**_HF_DEFAULTS.get(fields.get("model_type"), {}), **fields}
    if "num_labels" not in fields:
      self._fields["num_labels"] = len(fields.get("id2label") or {}) or 2

  def __getattr__(self, name: str) -> Any:
    return self._fields.get(name)


def _require(hf_config: Any, name: str, ok: Callable[[Any], bool], what: str) -> None:
  value = getattr(hf_config, name, None)
  if not ok(value):
    raise ValueError(f"unsupported HF config: {name}={value!r} ({what})")


def _activation(hf_name: str) -> str:
  if hf_name not in _ACT_FROM_HF:
    raise ValueError(f"unsupported HF activation {hf_name!r}; supported {sorted(_ACT_FROM_HF)}")
  return _ACT_FROM_HF[hf_name]


def _plain_rope(hf_config: Any) -> dict[str, Any]:
  """The config's ``rope_parameters`` ({} if none); ValueError for a rope type other than plain
  RoPE ("default")."""
  params = getattr(hf_config, "rope_parameters", None) or {}
  scaling = getattr(hf_config, "rope_scaling", None) or {}
  rope_type = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
  if rope_type != "default":
    raise ValueError(f"unsupported HF config: rope type {rope_type!r} (only plain RoPE, 'default')")
  return params


def _rope_theta(hf_config: Any) -> float:
  return float(_plain_rope(hf_config).get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))


def _neox_rope(c: Any) -> tuple[float, float]:
  """(rope base, rotary fraction) of a GPT-NeoX config: ``rope_parameters`` (transformers 5)
  or the legacy ``rotary_emb_base`` and ``rotary_pct`` of Pythia's config.json.

  Raises:
    ValueError: naming the field, unless head_dim * fraction is a positive even integer
      (the rotated dims, which RoPE pairs up).
  """
  params = _plain_rope(c)
  base = params.get("rope_theta", getattr(c, "rotary_emb_base", None))
  if "partial_rotary_factor" in params:
    field, fraction = "rope_parameters['partial_rotary_factor']", params["partial_rotary_factor"]
  else:
    field, fraction = "rotary_pct", getattr(c, "rotary_pct", None)
  head_dim = c.hidden_size // c.num_attention_heads
  if not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
    raise ValueError(f"unsupported HF config: {field}={fraction!r} (a fraction in (0, 1] of "
                     "each head's dims is rotated)")
  dims = head_dim * fraction
  if abs(dims - round(dims)) > 1e-9 * head_dim or round(dims) % 2:
    raise ValueError(f"unsupported HF config: {field}={fraction!r} (head_dim {head_dim} * "
                     f"{field} = {dims:g} rotated dims; RoPE needs a positive even number of them)")
  return float(base if base is not None else 10000.0), float(fraction)


def config_from_hf(hf_config: Any, head: str) -> config_lib.Config:
  """Our ``Config`` for an HF config object or ``config.json`` dict (``head`` as in ``Config.head``).

  Raises:
    ValueError: the model type or an option that the zoo cannot express.
  """
  if isinstance(hf_config, Mapping):
    hf_config = _ConfigDict(hf_config)
  kind = getattr(hf_config, "model_type", None)
  c = hf_config
  if kind == "gpt2":
    _require(c, "scale_attn_weights", lambda v: v is not False, "attention must be scaled")
    _require(c, "scale_attn_by_inverse_layer_idx", lambda v: not v, "per-layer scaling")
    return config_lib.make_config(
        "gpt2", width=c.n_embd, depth=c.n_layer, num_heads=c.n_head,
        mlp_dim=c.n_inner or 4 * c.n_embd, max_len=c.n_positions, vocab_size=c.vocab_size,
        norm_eps=c.layer_norm_epsilon, activation=_activation(c.activation_function),
        tied_embeddings=c.tie_word_embeddings)
  if kind in LLAMA_TYPES:
    bias = bool(getattr(c, "attention_bias", False))  # Mistral has no such field
    _require(c, "mlp_bias", lambda v: bool(v) == bias, "attention_bias and mlp_bias must agree")
    _require(c, "sliding_window", lambda v: v is None or v >= c.max_position_embeddings,
             "the zoo's attention has no sliding window")
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    _require(c, "head_dim", lambda v: head_dim * c.num_attention_heads == c.hidden_size,
             "head_dim must be hidden_size / num_attention_heads")
    return config_lib.make_config(
        "llama", width=c.hidden_size, depth=c.num_hidden_layers, num_heads=c.num_attention_heads,
        num_kv_heads=c.num_key_value_heads or c.num_attention_heads,
        mlp_dim=c.intermediate_size, max_len=c.max_position_embeddings, vocab_size=c.vocab_size,
        norm_eps=c.rms_norm_eps, rope_base=_rope_theta(c), activation=_activation(c.hidden_act),
        use_bias=bias, tied_embeddings=c.tie_word_embeddings)
  if kind == "gpt_neox":
    _require(c, "attention_bias", lambda v: v is not False,
             "the zoo's GPT-NeoX has attention biases, as its FFN does")
    base, fraction = _neox_rope(c)
    return config_lib.make_config(
        "gpt_neox", width=c.hidden_size, depth=c.num_hidden_layers,
        num_heads=c.num_attention_heads, mlp_dim=c.intermediate_size,
        max_len=c.max_position_embeddings, vocab_size=c.vocab_size, norm_eps=c.layer_norm_eps,
        rope_base=base, rotary_fraction=fraction, activation=_activation(c.hidden_act),
        parallel_residual=bool(c.use_parallel_residual), tied_embeddings=c.tie_word_embeddings)
  if kind == "bert":
    _require(c, "position_embedding_type", lambda v: v in (None, "absolute"),
             "only absolute position embeddings")
    _require(c, "is_decoder", lambda v: not v, "BERT as a decoder")
    return config_lib.make_config(
        "bert", width=c.hidden_size, depth=c.num_hidden_layers, num_heads=c.num_attention_heads,
        mlp_dim=c.intermediate_size, max_len=c.max_position_embeddings, vocab_size=c.vocab_size,
        num_segments=c.type_vocab_size, norm_eps=c.layer_norm_eps,
        activation=_activation(c.hidden_act), head=head, tied_embeddings=c.tie_word_embeddings,
        # next-sentence: 2 classes; a bare encoder has none, and takes the default
        num_classes=2 if head in ("pretraining", "encoder", "encoder_no_pooler") else c.num_labels)
  if kind == "vit":
    _require(c, "qkv_bias", lambda v: v is not False, "the zoo's ViT has qkv biases")
    return config_lib.make_config(
        "vit", width=c.hidden_size, depth=c.num_hidden_layers, num_heads=c.num_attention_heads,
        mlp_dim=c.intermediate_size, image_size=c.image_size, patch_size=c.patch_size,
        num_channels=c.num_channels, norm_eps=c.layer_norm_eps,
        activation=_activation(c.hidden_act), num_classes=c.num_labels)
  raise ValueError(f"unsupported HF model type {kind!r}; supported: {', '.join(MODEL_TYPES)}")


def hf_config(cfg: config_lib.Config) -> Any:
  """The HF config of our ``cfg``.

  Raises:
    ValueError: naming the config fields that HF's model of the family cannot
      express (e.g. ``pos_encoding`` for a GPT-2 with RoPE).
  """
  import transformers  # pylint: disable=g-import-not-at-top

  act = _ACT_TO_HF[cfg.activation]
  if cfg.family == "gpt2":
    out = transformers.GPT2Config(
        n_embd=cfg.width, n_layer=cfg.depth, n_head=cfg.num_heads, n_inner=cfg.mlp_dim,
        n_positions=cfg.max_len, vocab_size=cfg.vocab_size, layer_norm_epsilon=cfg.norm_eps,
        activation_function=act, tie_word_embeddings=cfg.tied_embeddings)
  elif cfg.family == "llama":
    out = transformers.LlamaConfig(
        hidden_size=cfg.width, num_hidden_layers=cfg.depth, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.kv_heads, intermediate_size=cfg.mlp_dim,
        max_position_embeddings=cfg.max_len, vocab_size=cfg.vocab_size, rms_norm_eps=cfg.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_base}, hidden_act=act,
        attention_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias, tie_word_embeddings=cfg.tied_embeddings,
        head_dim=cfg.head_dim)
  elif cfg.family == "gpt_neox":
    out = transformers.GPTNeoXConfig(
        hidden_size=cfg.width, num_hidden_layers=cfg.depth, num_attention_heads=cfg.num_heads,
        intermediate_size=cfg.mlp_dim, max_position_embeddings=cfg.max_len,
        vocab_size=cfg.vocab_size, layer_norm_eps=cfg.norm_eps, hidden_act=act,
        use_parallel_residual=cfg.parallel_residual, attention_bias=cfg.qkv_bias,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_base,
                         "partial_rotary_factor": cfg.rotary_fraction},
        tie_word_embeddings=cfg.tied_embeddings)
  elif cfg.family == "bert":
    out = transformers.BertConfig(
        hidden_size=cfg.width, num_hidden_layers=cfg.depth, num_attention_heads=cfg.num_heads,
        intermediate_size=cfg.mlp_dim, max_position_embeddings=cfg.max_len,
        vocab_size=cfg.vocab_size, type_vocab_size=cfg.num_segments, layer_norm_eps=cfg.norm_eps,
        hidden_act=act, num_labels=cfg.num_classes, tie_word_embeddings=cfg.tied_embeddings)
  else:
    out = transformers.ViTConfig(
        hidden_size=cfg.width, num_hidden_layers=cfg.depth, num_attention_heads=cfg.num_heads,
        intermediate_size=cfg.mlp_dim, image_size=cfg.image_size, patch_size=cfg.patch_size,
        num_channels=cfg.num_channels, layer_norm_eps=cfg.norm_eps, hidden_act=act,
        num_labels=cfg.num_classes, qkv_bias=True)
  back = config_from_hf(out, cfg.head)
  differ = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
            if getattr(cfg, f.name) != getattr(back, f.name) and f.name != "init_std"}
  if differ:
    raise ValueError(f"HF {_HF_CLASSES[cfg.family, cfg.head]} cannot express config fields "
                     f"{differ} (it would use {[getattr(back, k) for k in differ]})")
  return out


# ----------------------------------------------------------------------------- tables


def _dense(ours: str, hf: str, bias: bool, layout: str = "linear") -> dict[str, Source]:
  table = {f"{ours}/kernel": Source(f"{hf}.weight", layout)}
  if bias:
    table[f"{ours}/bias"] = Source(f"{hf}.bias")
  return table


def _norm(ours: str, hf: str, cfg: config_lib.Config) -> dict[str, Source]:
  table = {f"{ours}/scale": Source(f"{hf}.weight")}
  if cfg.norm == "layer":
    table[f"{ours}/bias"] = Source(f"{hf}.bias")
  return table


def _lm_head(cfg: config_lib.Config, embed_key: str
             ) -> tuple[dict[str, Source], dict[str, str]]:
  """A decoder's head: ``lm_head`` [V, D], or (tied) an alias of the token embedding."""
  if cfg.tied_embeddings:
    return {}, {"lm_head.weight": embed_key}
  return _dense("head", "lm_head", False), {}


def _gpt2_table(cfg):
  t = {"embed/embedding": Source("transformer.wte.weight"),
       "pos_embed/embedding": Source("transformer.wpe.weight")}
  for i in range(cfg.depth):
    hf, lp = f"transformer.h.{i}", f"layers_{i}"
    t |= _norm(f"{lp}/attention_norm", f"{hf}.ln_1", cfg) | _norm(f"{lp}/mlp_norm", f"{hf}.ln_2", cfg)
    for part, name in enumerate(("query", "key", "value")):
      t[f"{lp}/attention/{name}/kernel"] = Source(f"{hf}.attn.c_attn.weight", part=part)
      t[f"{lp}/attention/{name}/bias"] = Source(f"{hf}.attn.c_attn.bias", part=part)
    t |= _dense(f"{lp}/attention/out", f"{hf}.attn.c_proj", True, "same")
    t |= _dense(f"{lp}/mlp/wi", f"{hf}.mlp.c_fc", True, "same")
    t |= _dense(f"{lp}/mlp/wo", f"{hf}.mlp.c_proj", True, "same")
  t |= _norm("final_norm", "transformer.ln_f", cfg)
  head, aliases = _lm_head(cfg, "transformer.wte.weight")
  return t | head, aliases


def _llama_table(cfg):
  t = {"embed/embedding": Source("model.embed_tokens.weight")}
  for i in range(cfg.depth):
    hf, lp = f"model.layers.{i}", f"layers_{i}"
    t |= _norm(f"{lp}/attention_norm", f"{hf}.input_layernorm", cfg)
    t |= _norm(f"{lp}/mlp_norm", f"{hf}.post_attention_layernorm", cfg)
    for name, proj in (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj")):
      t |= _dense(f"{lp}/attention/{name}", f"{hf}.self_attn.{proj}", cfg.qkv_bias)
    t |= _dense(f"{lp}/attention/out", f"{hf}.self_attn.o_proj", cfg.out_bias)
    for name in ("gate", "up", "down"):
      t |= _dense(f"{lp}/mlp/{name}", f"{hf}.mlp.{name}_proj", cfg.mlp_bias)
  t |= _norm("final_norm", "model.norm", cfg)
  head, aliases = _lm_head(cfg, "model.embed_tokens.weight")
  return t | head, aliases


def _gpt_neox_table(cfg):
  m = "gpt_neox"
  t = {"embed/embedding": Source(f"{m}.embed_in.weight")}
  for i in range(cfg.depth):
    hf, lp = f"{m}.layers.{i}", f"layers_{i}"
    t |= _norm(f"{lp}/attention_norm", f"{hf}.input_layernorm", cfg)
    t |= _norm(f"{lp}/mlp_norm", f"{hf}.post_attention_layernorm", cfg)
    qkv = f"{hf}.attention.query_key_value"
    for part, name in enumerate(("query", "key", "value")):
      t[f"{lp}/attention/{name}/kernel"] = Source(f"{qkv}.weight", "linear", part, cfg.num_heads)
      if cfg.qkv_bias:
        t[f"{lp}/attention/{name}/bias"] = Source(f"{qkv}.bias", part=part, heads=cfg.num_heads)
    t |= _dense(f"{lp}/attention/out", f"{hf}.attention.dense", cfg.out_bias)
    t |= _dense(f"{lp}/mlp/wi", f"{hf}.mlp.dense_h_to_4h", cfg.mlp_bias)
    t |= _dense(f"{lp}/mlp/wo", f"{hf}.mlp.dense_4h_to_h", cfg.mlp_bias)
  t |= _norm("final_norm", f"{m}.final_layer_norm", cfg)
  head, aliases = _lm_head(cfg, f"{m}.embed_in.weight")
  return t | head, aliases


def _bert_table(cfg):
  e = "bert.embeddings"
  t = {"embed/embedding": Source(f"{e}.word_embeddings.weight"),
       "segment_embed/embedding": Source(f"{e}.token_type_embeddings.weight"),
       "pos_embed/embedding": Source(f"{e}.position_embeddings.weight")}
  t |= _norm("embed_norm", f"{e}.LayerNorm", cfg)
  for i in range(cfg.depth):
    hf, lp = f"bert.encoder.layer.{i}", f"layers_{i}"
    for name in ("query", "key", "value"):
      t |= _dense(f"{lp}/attention/{name}", f"{hf}.attention.self.{name}", True)
    t |= _dense(f"{lp}/attention/out", f"{hf}.attention.output.dense", True)
    t |= _norm(f"{lp}/attention_norm", f"{hf}.attention.output.LayerNorm", cfg)
    t |= _dense(f"{lp}/mlp/wi", f"{hf}.intermediate.dense", True)
    t |= _dense(f"{lp}/mlp/wo", f"{hf}.output.dense", True)
    t |= _norm(f"{lp}/mlp_norm", f"{hf}.output.LayerNorm", cfg)
  aliases = {}
  if cfg.head in bert.POOLED_HEADS:
    t |= _dense("pooler", "bert.pooler.dense", True)
  if cfg.head == "classifier":
    t |= _dense("head", "classifier", True)
  elif cfg.head in bert.MLM_HEADS:
    if cfg.head == "pretraining":
      t |= _dense("nsp", "cls.seq_relationship", True)
    p = "cls.predictions"
    t |= _dense("mlm/transform", f"{p}.transform.dense", True)
    t |= _norm("mlm/norm", f"{p}.transform.LayerNorm", cfg)
    aliases[f"{p}.decoder.bias"] = f"{p}.bias"
    if cfg.tied_embeddings:
      t["mlm/bias"] = Source(f"{p}.bias")
      aliases[f"{p}.decoder.weight"] = f"{e}.word_embeddings.weight"
    else:
      t |= {"mlm/decoder/kernel": Source(f"{p}.decoder.weight", "linear"),
            "mlm/decoder/bias": Source(f"{p}.bias")}
  return t, aliases


def _vit_table(cfg):
  e = "vit.embeddings"
  t = {"cls_token": Source(f"{e}.cls_token", lead=2),
       "pos_embed/embedding": Source(f"{e}.position_embeddings", lead=1)}
  t |= _dense("patch_embed", f"{e}.patch_embeddings.projection", True, "conv")
  for i in range(cfg.depth):
    hf, lp = f"vit.layers.{i}", f"layers_{i}"
    t |= _norm(f"{lp}/attention_norm", f"{hf}.layernorm_before", cfg)
    for name, proj in (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj"), ("out", "o_proj")):
      t |= _dense(f"{lp}/attention/{name}", f"{hf}.attention.{proj}", True)
    t |= _norm(f"{lp}/mlp_norm", f"{hf}.layernorm_after", cfg)
    t |= _dense(f"{lp}/mlp/wi", f"{hf}.mlp.fc1", True) | _dense(f"{lp}/mlp/wo", f"{hf}.mlp.fc2", True)
  t |= _norm("final_norm", "vit.layernorm", cfg) | _dense("head", "classifier", True)
  return t, {}


_TABLES = {"gpt2": _gpt2_table, "llama": _llama_table, "gpt_neox": _gpt_neox_table,
           "bert": _bert_table, "vit": _vit_table}


def param_table(cfg: config_lib.Config) -> tuple[dict[str, Source], dict[str, str]]:
  """({our path: Source}, {tied HF alias key: the HF key it repeats}) for ``cfg``."""
  return _TABLES[cfg.family](cfg)


def hf_shape(path: str, shape: tuple[int, ...], src: Source) -> tuple[int, ...]:
  """The shape of the HF tensor ``src.key`` that holds our leaf ``path`` of ``shape``.

  HF keeps the heads of an attention projection in one axis: query/key/value
  [D, N, H] -> [D, N * H], their biases [N, H] -> [N * H], out [N, H, D] ->
  [N * H, D]; then the layout's transposition, the three parts of a fused
  tensor (along its output axis, ``_part_axis``) and ``lead`` leading ones.
  """
  *parents, name, kind = ["", *path.split("/")]  # "cls_token" has no parent
  if "attention" in parents and name in ("query", "key", "value"):
    shape = (*shape[:-2], math.prod(shape[-2:]))
  elif "attention" in parents and (name, kind) == ("out", "kernel"):
    shape = (math.prod(shape[:2]), *shape[2:])
  if src.layout == "linear":
    shape = shape[::-1]
  elif src.layout == "conv":
    shape = (shape[3], shape[2], shape[0], shape[1])
  if src.part is not None:
    shape = list(shape)
    shape[_part_axis(src)] *= 3
  return (1,) * src.lead + tuple(shape)


# ----------------------------------------------------------------------------- conversion


def _to_numpy(x: Any) -> np.ndarray:
  if hasattr(x, "detach"):  # a torch tensor
    import torch  # pylint: disable=g-import-not-at-top
    return x.detach().to(device="cpu", dtype=torch.float32).numpy()
  return np.asarray(x, np.float32)


def _part_axis(src: Source) -> int:
  """The output axis of a fused HF tensor, along which its three parts lie (``Source``)."""
  return 0 if src.layout == "linear" else -1


def leaf_from_hf(x: np.ndarray, src: Source, shape: tuple[int, ...]) -> np.ndarray:
  """Our leaf of ``shape`` from the HF tensor ``x`` that ``src`` names (a view where it can)."""
  if src.part is not None:
    axis = _part_axis(src)
    x = np.moveaxis(x, axis, 0)
    if src.heads is None:  # [3 * N * H, ...]: the parts one after the other
      x = np.split(x, 3)[src.part]
    else:  # [N * 3 * H, ...]: the parts alternate head by head
      x = x.reshape(src.heads, 3, -1, *x.shape[1:])[:, src.part].reshape(-1, *x.shape[1:])
    x = np.moveaxis(x, 0, axis)
  if src.layout == "linear":
    x = x.T
  elif src.layout == "conv":
    x = x.transpose(2, 3, 1, 0)
  return x.reshape(shape)


def leaf_to_hf(x: np.ndarray, src: Source, hf_shape: tuple[int, ...]) -> np.ndarray:
  """Inverse of ``leaf_from_hf``: our leaf -> the HF tensor (or its part, which ``join_parts``
  joins), shape ``hf_shape``."""
  if src.part is not None:
    hf_shape = list(hf_shape)
    hf_shape[_part_axis(src)] //= 3
    hf_shape = tuple(hf_shape)
  if src.layout == "linear":
    return x.reshape(hf_shape[::-1]).T
  if src.layout == "conv":
    return x.transpose(3, 2, 0, 1)
  return x.reshape(hf_shape)


def join_parts(parts: Mapping[int | None, np.ndarray], src: Source) -> np.ndarray:
  """The HF tensor of ``leaf_to_hf``'s outputs for one key: {None: tensor} for a plain one, or
  {0: query, 1: key, 2: value} parts of a fused one, laid out as ``src`` (any part's) says."""
  if None in parts:
    return parts[None]
  axis = _part_axis(src)
  xs = [np.moveaxis(parts[i], axis, 0) for i in range(3)]
  if src.heads is None:
    joined = np.concatenate(xs)
  else:
    joined = np.stack([x.reshape(src.heads, -1, *x.shape[1:]) for x in xs], 1)
    joined = joined.reshape(-1, *xs[0].shape[1:])
  return np.moveaxis(joined, 0, axis)


def head_of(family: str, keys: set[str]) -> str:
  """``Config.head`` of a checkpoint of ``family`` with HF state-dict ``keys`` (a BERT's with the
  "bert." prefix, as the task classes name them: ``with_bert_prefix``).

  Raises:
    ValueError: a BERT checkpoint with tensors outside the encoder that are no head read here
      (named).
  """
  if family in ("gpt2", "gpt_neox", *LLAMA_TYPES):
    return "lm"
  if family == "vit" or "classifier.weight" in keys:
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


def with_bert_prefix(keys: Iterable[str]) -> dict[str, str]:
  """{state-dict name as the task classes give it: original} for a BERT's ``keys``: a
  ``BertModel``'s (none starts with "bert.") get the prefix, other keys stay as they are."""
  keys = list(keys)
  prefix = "" if any(k.startswith("bert.") for k in keys) else "bert."
  return {prefix + k: k for k in keys}


def _bare_prefix(cfg: config_lib.Config) -> str:
  """The prefix of the tables' keys that the HF class's state dict lacks: "bert." for a
  ``BertModel`` (a bare encoder, ``tasks.FEATURES``), whose state dict is the encoder's alone;
  else none."""
  return "bert." if cfg.family == "bert" and cfg.task == tasks.FEATURES else ""


def _hf_model(cfg: config_lib.Config, hf_cfg: Any) -> Any:
  """The HF PyTorch model of ``cfg``'s family and head, built from ``hf_cfg``."""
  import transformers  # pylint: disable=g-import-not-at-top

  kwargs = {"add_pooling_layer": False} if cfg.head == "encoder_no_pooler" else {}
  return getattr(transformers, _HF_CLASSES[cfg.family, cfg.head])(hf_cfg, **kwargs)


def _template(cfg: config_lib.Config, hf_cfg: Any) -> dict[str, tuple[int, ...]]:
  """Key (as the tables name it, ``_bare_prefix``) -> shape of the state dict of an HF model of
  this config (built on the meta device)."""
  import torch  # pylint: disable=g-import-not-at-top

  with torch.device("meta"):
    hf_model = _hf_model(cfg, hf_cfg)
  return {_bare_prefix(cfg) + k: tuple(v.shape) for k, v in hf_model.state_dict().items()}


def _check_checkpoint(state: Mapping[str, np.ndarray], template: dict[str, tuple[int, ...]],
                      aliases: dict[str, str]) -> None:
  missing = sorted(set(template) - set(state) - set(aliases))
  extra = sorted(set(state) - set(template))
  misshapen = [f"{k}: {tuple(state[k].shape)} instead of {s}" for k, s in sorted(template.items())
               if k in state and tuple(state[k].shape) != s]
  if missing or extra or misshapen:
    raise ValueError(f"HF checkpoint does not fit its config: missing {missing}; extra {extra}; "
                     f"misshapen {misshapen}")
  untied = [a for a, src in sorted(aliases.items()) if a in state
            and not np.array_equal(state[a], state[src])]
  if untied:
    raise ValueError(f"HF checkpoint: tied parameters {untied} differ from the ones they repeat")


def load_hf(hf_model: Any, hf_config: Any = None) -> tuple[Model, dict[str, Any]]:
  """Converts an HF model (or a state dict and its config) to (``Model``, params).

  Args:
    hf_model: a PyTorch HF model of a supported class, or its state dict
      (key -> tensor or array).
    hf_config: the HF config; required with a state dict.

  Returns:
    The zoo model of the same architecture and its float32 parameters.

  Raises:
    ValueError: unsupported architecture or option; a checkpoint with
      missing, extra or misshapen parameters (named).
  """
  if hasattr(hf_model, "state_dict"):
    hf_config = hf_model.config if hf_config is None else hf_config
    hf_model = hf_model.state_dict()
  if hf_config is None:
    raise ValueError("load_hf needs hf_config when given a state dict")
  family = getattr(hf_config, "model_type", None)
  if family not in _TABLES:
    raise ValueError(f"unsupported HF model type {family!r}; supported: {sorted(_TABLES)}")
  names = with_bert_prefix(hf_model) if family == "bert" else {k: k for k in hf_model}
  state = {name: _to_numpy(hf_model[key]) for name, key in names.items()}
  cfg = config_from_hf(hf_config, head_of(family, set(state)))
  model = Model(cfg)
  table, aliases = param_table(cfg)
  template = _template(cfg, hf_config)
  _check_checkpoint(state, template, aliases)
  unused = sorted(set(template) - {s.key for s in table.values()} - set(aliases))
  if unused:
    raise ValueError(f"HF parameters {unused} have no counterpart in the zoo's {family} model")
  flat = {path: jnp.asarray(leaf_from_hf(state[src.key], src, model.param_shapes[path]))
          for path, src in table.items()}
  params = spec_lib.unflatten(flat)
  model.check_params(params)
  return model, params


def from_hf(hf_model: Any, hf_config: Any = None) -> tuple[Callable[..., Any], dict[str, Any]]:
  """(apply_fn, params) for an HF model or state dict; ``load_hf`` has the details.

  ``apply_fn(params, inputs, *, mask=None, segments=None)`` is ``Model.apply``:
  ViT takes images [B, S, S, C] (channels last, unlike HF's pixel_values).
  """
  model, params = load_hf(hf_model, hf_config)
  return model.apply, params


def to_hf(model: Model, params: Mapping[str, Any]) -> Any:
  """An HF PyTorch model (eval mode) with ``params``; the inverse of ``load_hf``.

  Raises:
    ValueError: if HF's model of the family cannot express ``model.config``
      (naming the fields), or ``params`` do not fit the model.
  """
  import torch  # pylint: disable=g-import-not-at-top

  cfg = model.config
  model.check_params(params)
  hf_model = _hf_model(cfg, hf_config(cfg))
  prefix = _bare_prefix(cfg)
  template = {prefix + k: tuple(v.shape) for k, v in hf_model.state_dict().items()}
  table, aliases = param_table(cfg)
  flat = spec_lib.flatten(params)
  parts: dict[str, dict[int | None, np.ndarray]] = {}
  sources: dict[str, Source] = {}
  for path, src in table.items():
    value = leaf_to_hf(np.asarray(flat[path], np.float32), src, template[src.key])
    parts.setdefault(src.key, {})[src.part] = value
    sources[src.key] = src
  state = {key: torch.from_numpy(np.array(join_parts(p, sources[key])))
           for key, p in parts.items()}
  for alias, src in aliases.items():
    if alias in template:
      state[alias] = state[src]
  hf_model.load_state_dict({k.removeprefix(prefix): v for k, v in state.items()}, strict=True)
  return hf_model.eval()
