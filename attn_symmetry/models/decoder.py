"""Decoder-only language models: GPT-2, Llama and GPT-NeoX are configs of one module.

GPT-2: learned positions, pre-LayerNorm, GELU (tanh), biases, causal, head tied
to the token embedding. Llama: RoPE (half-split pairing), RMSNorm, SwiGLU,
grouped-query attention, no biases, untied head. GPT-NeoX (Pythia): partial
RoPE (the first quarter of each head's dims, half-split pairing), LayerNorm,
exact GELU, biases, parallel residual (attention and FFN read the same layer
input), untied head.

Parameters besides the core and embeddings (``core.py``):

    head/kernel [D, V]   untied head only (no bias); tied: logits = x E^T

Each family's Hugging Face mapping (``hf.HFMapping``: GPT2LMHeadModel,
LlamaForCausalLM, which also reads Mistral's configs, GPTNeoXForCausalLM) is
registered with it at the end of this module.
"""

from __future__ import annotations

from flax import nnx

from attn_symmetry import spec as spec_lib
from attn_symmetry import tasks
from attn_symmetry.models import core
from attn_symmetry.models import hf
from attn_symmetry.models.config import Config, Family, make_config, register_family
from attn_symmetry.models.hf import Source


class Decoder(core.TextCore):
  """int tokens [B, T] -> next-token logits [B, T, V]."""

  def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
    super().__init__(cfg, rngs=rngs)
    self.head = (None if cfg.tied_embeddings else
                 core.Dense((cfg.width,), (cfg.vocab_size,), use_bias=False,
                            init_std=cfg.init_std, rngs=rngs))

  def __call__(self, tokens, *, mask=None, segments=None, layers=None):
    x, inter = self.encode_tokens(tokens, mask=mask, segments=segments, layers=layers)
    inter["features"] = x
    logits = self.embed.attend(x) if self.head is None else self.head(x)
    return logits, inter


def symmetry_spec(cfg: Config) -> spec_lib.SymmetrySpec:
  """Core and embedding spec plus the untied head, which reads the stream."""
  spec = core.core_spec(cfg)
  spec.axes |= core.text_embedding_axes(cfg, spec.r)
  if not cfg.tied_embeddings:
    spec.axes["head/kernel"] = (spec.r, None)
    spec.readers["final_norm/scale"] = ("head/kernel",)
  return spec.build()


# ----------------------------------------------------------------------------- GPT-2


def _gpt2_from_hf(c, head: str) -> Config:
  del head  # "lm", its only head
  hf.require(c, "scale_attn_weights", lambda v: v is not False, "attention must be scaled")
  hf.require(c, "scale_attn_by_inverse_layer_idx", lambda v: not v, "per-layer scaling")
  return make_config(
      "gpt2", width=c.n_embd, depth=c.n_layer, num_heads=c.n_head,
      mlp_dim=c.n_inner or 4 * c.n_embd, max_len=c.n_positions, vocab_size=c.vocab_size,
      norm_eps=c.layer_norm_epsilon, activation=hf.activation(c.activation_function),
      tied_embeddings=c.tie_word_embeddings)


def _gpt2_to_hf(cfg: Config):
  import transformers  # pylint: disable=g-import-not-at-top
  return transformers.GPT2Config(
      n_embd=cfg.width, n_layer=cfg.depth, n_head=cfg.num_heads, n_inner=cfg.mlp_dim,
      n_positions=cfg.max_len, vocab_size=cfg.vocab_size, layer_norm_epsilon=cfg.norm_eps,
      activation_function=hf.ACT_TO_HF[cfg.activation], tie_word_embeddings=cfg.tied_embeddings)


def _gpt2_table(cfg: Config) -> hf.Table:
  t = {"embed/embedding": Source("transformer.wte.weight"),
       "pos_embed/embedding": Source("transformer.wpe.weight")}
  for i in range(cfg.depth):
    h, lp = f"transformer.h.{i}", f"layers_{i}"
    t |= hf.norm(f"{lp}/attention_norm", f"{h}.ln_1", cfg)
    t |= hf.norm(f"{lp}/mlp_norm", f"{h}.ln_2", cfg)
    for part, name in enumerate(("query", "key", "value")):
      t[f"{lp}/attention/{name}/kernel"] = Source(f"{h}.attn.c_attn.weight", part=part)
      t[f"{lp}/attention/{name}/bias"] = Source(f"{h}.attn.c_attn.bias", part=part)
    t |= hf.dense(f"{lp}/attention/out", f"{h}.attn.c_proj", True, "same")
    t |= hf.dense(f"{lp}/mlp/wi", f"{h}.mlp.c_fc", True, "same")
    t |= hf.dense(f"{lp}/mlp/wo", f"{h}.mlp.c_proj", True, "same")
  t |= hf.norm("final_norm", "transformer.ln_f", cfg)
  head, aliases = hf.lm_head(cfg, "transformer.wte.weight")
  return t | head, aliases


register_family(Family(
    "gpt2", Decoder, symmetry_spec, input_key="tokens", heads={"lm": tasks.LM},
    defaults=dict(pos_encoding="learned", norm="layer", norm_eps=1e-5, activation="gelu_tanh",
                  causal=True, tied_embeddings=True),
    presets={"base": dict(vocab_size=50257)},
    hf=hf.HFMapping(
        model_types=("gpt2",), classes={"lm": "GPT2LMHeadModel"}, config_from_hf=_gpt2_from_hf,
        hf_config=_gpt2_to_hf, table=_gpt2_table, prefix="transformer.",
        defaults={"gpt2": dict(n_embd=768, n_layer=12, n_head=12, n_inner=None,
                               n_positions=1024, vocab_size=50257, layer_norm_epsilon=1e-5,
                               activation_function="gelu_new", scale_attn_weights=True,
                               scale_attn_by_inverse_layer_idx=False, tie_word_embeddings=True)})))


# ----------------------------------------------------------------------------- Llama, Mistral


def _llama_from_hf(c, head: str) -> Config:
  del head  # "lm", its only head
  bias = bool(getattr(c, "attention_bias", False))  # Mistral has no such field
  hf.require(c, "mlp_bias", lambda v: bool(v) == bias, "attention_bias and mlp_bias must agree")
  hf.require(c, "sliding_window", lambda v: v is None or v >= c.max_position_embeddings,
             "the zoo's attention has no sliding window")
  head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
  hf.require(c, "head_dim", lambda v: head_dim * c.num_attention_heads == c.hidden_size,
             "head_dim must be hidden_size / num_attention_heads")
  return make_config(
      "llama", width=c.hidden_size, depth=c.num_hidden_layers, num_heads=c.num_attention_heads,
      num_kv_heads=c.num_key_value_heads or c.num_attention_heads,
      mlp_dim=c.intermediate_size, max_len=c.max_position_embeddings, vocab_size=c.vocab_size,
      norm_eps=c.rms_norm_eps, rope_base=hf.rope_theta(c), activation=hf.activation(c.hidden_act),
      use_bias=bias, tied_embeddings=c.tie_word_embeddings)


def _llama_to_hf(cfg: Config):
  import transformers  # pylint: disable=g-import-not-at-top
  return transformers.LlamaConfig(
      hidden_size=cfg.width, num_hidden_layers=cfg.depth, num_attention_heads=cfg.num_heads,
      num_key_value_heads=cfg.kv_heads, intermediate_size=cfg.mlp_dim,
      max_position_embeddings=cfg.max_len, vocab_size=cfg.vocab_size, rms_norm_eps=cfg.norm_eps,
      rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_base},
      hidden_act=hf.ACT_TO_HF[cfg.activation], attention_bias=cfg.qkv_bias,
      mlp_bias=cfg.mlp_bias, tie_word_embeddings=cfg.tied_embeddings, head_dim=cfg.head_dim)


def llama_table(cfg: Config) -> hf.Table:
  """The tensors of ``LlamaForCausalLM`` (``model.layers.{i}.self_attn.q_proj``, ...), each bias
  where ``cfg`` has it: the table of Llama-style families (Mistral, Qwen2)."""
  t = {"embed/embedding": Source("model.embed_tokens.weight")}
  for i in range(cfg.depth):
    h, lp = f"model.layers.{i}", f"layers_{i}"
    t |= hf.norm(f"{lp}/attention_norm", f"{h}.input_layernorm", cfg)
    t |= hf.norm(f"{lp}/mlp_norm", f"{h}.post_attention_layernorm", cfg)
    for name, proj in (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj")):
      t |= hf.dense(f"{lp}/attention/{name}", f"{h}.self_attn.{proj}", cfg.qkv_bias)
    t |= hf.dense(f"{lp}/attention/out", f"{h}.self_attn.o_proj", cfg.out_bias)
    for name in ("gate", "up", "down"):
      t |= hf.dense(f"{lp}/mlp/{name}", f"{h}.mlp.{name}_proj", cfg.mlp_bias)
  t |= hf.norm("final_norm", "model.norm", cfg)
  head, aliases = hf.lm_head(cfg, "model.embed_tokens.weight")
  return t | head, aliases


register_family(Family(
    "llama", Decoder, symmetry_spec, input_key="tokens", heads={"lm": tasks.LM},
    defaults=dict(pos_encoding="rope", rope_pairing="half", norm="rms", norm_eps=1e-6,
                  activation="silu", gated_mlp=True, causal=True, use_bias=False,
                  tied_embeddings=False),
    presets={"tiny": dict(num_kv_heads=2), "small": dict(mlp_dim=704),
             "paper": dict(mlp_dim=704),
             "base": dict(num_kv_heads=4, mlp_dim=2048, vocab_size=32000, max_len=2048)},
    hf=hf.HFMapping(
        # Mistral's architecture is Llama's without biases; its sliding window is refused.
        model_types=("llama", "mistral"), classes={"lm": "LlamaForCausalLM"},
        config_from_hf=_llama_from_hf, hf_config=_llama_to_hf, table=llama_table,
        prefix="model.",
        defaults={
            "llama": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                          intermediate_size=11008, max_position_embeddings=2048,
                          vocab_size=32000, rms_norm_eps=1e-6, hidden_act="silu",
                          attention_bias=False, mlp_bias=False, tie_word_embeddings=False,
                          rope_theta=10000.0),
            "mistral": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                            num_key_value_heads=8, intermediate_size=14336,
                            max_position_embeddings=131072, vocab_size=32000, rms_norm_eps=1e-6,
                            hidden_act="silu", tie_word_embeddings=False, rope_theta=10000.0,
                            sliding_window=4096)})))


# ----------------------------------------------------------------------------- GPT-NeoX


def _neox_rope(c) -> tuple[float, float]:
  """(rope base, rotary fraction) of a GPT-NeoX config: ``rope_parameters`` (transformers 5)
  or the legacy ``rotary_emb_base`` and ``rotary_pct`` of Pythia's config.json.

  Raises:
    ValueError: naming the field, unless head_dim * fraction is a positive even integer
      (the rotated dims, which RoPE pairs up).
  """
  params = hf.plain_rope(c)
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


def _neox_from_hf(c, head: str) -> Config:
  del head  # "lm", its only head
  hf.require(c, "attention_bias", lambda v: v is not False,
             "the zoo's GPT-NeoX has attention biases, as its FFN does")
  base, fraction = _neox_rope(c)
  return make_config(
      "gpt_neox", width=c.hidden_size, depth=c.num_hidden_layers,
      num_heads=c.num_attention_heads, mlp_dim=c.intermediate_size,
      max_len=c.max_position_embeddings, vocab_size=c.vocab_size, norm_eps=c.layer_norm_eps,
      rope_base=base, rotary_fraction=fraction, activation=hf.activation(c.hidden_act),
      parallel_residual=bool(c.use_parallel_residual), tied_embeddings=c.tie_word_embeddings)


def _neox_to_hf(cfg: Config):
  import transformers  # pylint: disable=g-import-not-at-top
  return transformers.GPTNeoXConfig(
      hidden_size=cfg.width, num_hidden_layers=cfg.depth, num_attention_heads=cfg.num_heads,
      intermediate_size=cfg.mlp_dim, max_position_embeddings=cfg.max_len,
      vocab_size=cfg.vocab_size, layer_norm_eps=cfg.norm_eps,
      hidden_act=hf.ACT_TO_HF[cfg.activation], use_parallel_residual=cfg.parallel_residual,
      attention_bias=cfg.qkv_bias,
      rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_base,
                       "partial_rotary_factor": cfg.rotary_fraction},
      tie_word_embeddings=cfg.tied_embeddings)


def _neox_table(cfg: Config) -> hf.Table:
  m = "gpt_neox"
  t = {"embed/embedding": Source(f"{m}.embed_in.weight")}
  for i in range(cfg.depth):
    h, lp = f"{m}.layers.{i}", f"layers_{i}"
    t |= hf.norm(f"{lp}/attention_norm", f"{h}.input_layernorm", cfg)
    t |= hf.norm(f"{lp}/mlp_norm", f"{h}.post_attention_layernorm", cfg)
    qkv = f"{h}.attention.query_key_value"
    for part, name in enumerate(("query", "key", "value")):
      t[f"{lp}/attention/{name}/kernel"] = Source(f"{qkv}.weight", "linear", part, cfg.num_heads)
      if cfg.qkv_bias:
        t[f"{lp}/attention/{name}/bias"] = Source(f"{qkv}.bias", part=part, heads=cfg.num_heads)
    t |= hf.dense(f"{lp}/attention/out", f"{h}.attention.dense", cfg.out_bias)
    t |= hf.dense(f"{lp}/mlp/wi", f"{h}.mlp.dense_h_to_4h", cfg.mlp_bias)
    t |= hf.dense(f"{lp}/mlp/wo", f"{h}.mlp.dense_4h_to_h", cfg.mlp_bias)
  t |= hf.norm("final_norm", f"{m}.final_layer_norm", cfg)
  head, aliases = hf.lm_head(cfg, f"{m}.embed_in.weight")
  return t | head, aliases


register_family(Family(
    "gpt_neox", Decoder, symmetry_spec, input_key="tokens", heads={"lm": tasks.LM},
    defaults=dict(pos_encoding="rope", rope_pairing="half", rotary_fraction=0.25, norm="layer",
                  norm_eps=1e-5, activation="gelu", parallel_residual=True, causal=True,
                  use_bias=True, tied_embeddings=False),
    presets={"base": dict(vocab_size=50304, max_len=2048)},  # Pythia-160m's sizes
    hf=hf.HFMapping(
        model_types=("gpt_neox",), classes={"lm": "GPTNeoXForCausalLM"},
        config_from_hf=_neox_from_hf, hf_config=_neox_to_hf, table=_neox_table,
        prefix="gpt_neox.", renames=((r"^embed_out\.", "lm_head."),),  # Pythia's files
        defaults={"gpt_neox": dict(hidden_size=6144, num_hidden_layers=44,
                                   num_attention_heads=64, intermediate_size=24576,
                                   max_position_embeddings=2048, vocab_size=50432,
                                   layer_norm_eps=1e-5, hidden_act="gelu",
                                   use_parallel_residual=True, attention_bias=True,
                                   tie_word_embeddings=False, rotary_pct=0.25,
                                   rotary_emb_base=10000.0)})))
