"""Decoder-only language models: GPT-2, Llama and GPT-NeoX are configs of one module.

GPT-2: learned positions, pre-LayerNorm, GELU (tanh), biases, causal, head tied
to the token embedding. Llama: RoPE (half-split pairing), RMSNorm, SwiGLU,
grouped-query attention, no biases, untied head. GPT-NeoX (Pythia): partial
RoPE (the first quarter of each head's dims, half-split pairing), LayerNorm,
exact GELU, biases, parallel residual (attention and FFN read the same layer
input), untied head.

Parameters besides the core and embeddings (``core.py``):

    head/kernel [D, V]   untied head only (no bias); tied: logits = x E^T
"""

from __future__ import annotations

from flax import nnx

from attn_symmetry import spec as spec_lib
from attn_symmetry import tasks
from attn_symmetry.models import core
from attn_symmetry.models.config import Config, Family, register_family


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


register_family(Family(
    "gpt2", Decoder, symmetry_spec, input_key="tokens", heads={"lm": tasks.LM},
    defaults=dict(pos_encoding="learned", norm="layer", norm_eps=1e-5, activation="gelu_tanh",
                  causal=True, tied_embeddings=True),
    presets={"base": dict(vocab_size=50257)}))
register_family(Family(
    "llama", Decoder, symmetry_spec, input_key="tokens", heads={"lm": tasks.LM},
    defaults=dict(pos_encoding="rope", rope_pairing="half", norm="rms", norm_eps=1e-6,
                  activation="silu", gated_mlp=True, causal=True, use_bias=False,
                  tied_embeddings=False),
    presets={"tiny": dict(num_kv_heads=2), "small": dict(mlp_dim=704),
             "paper": dict(mlp_dim=704),
             "base": dict(num_kv_heads=4, mlp_dim=2048, vocab_size=32000, max_len=2048)}))
register_family(Family(
    "gpt_neox", Decoder, symmetry_spec, input_key="tokens", heads={"lm": tasks.LM},
    defaults=dict(pos_encoding="rope", rope_pairing="half", rotary_fraction=0.25, norm="layer",
                  norm_eps=1e-5, activation="gelu", parallel_residual=True, causal=True,
                  use_bias=True, tied_embeddings=False),
    presets={"base": dict(vocab_size=50304, max_len=2048)}))  # Pythia-160m's sizes
