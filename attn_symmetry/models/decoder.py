"""Decoder-only language models: GPT-2 and Llama are configs of one module.

GPT-2: learned positions, pre-LayerNorm, GELU (tanh), biases, causal, head tied
to the token embedding. Llama: RoPE (half-split pairing), RMSNorm, SwiGLU,
grouped-query attention, no biases, untied head.

Parameters besides the core and embeddings (``core.py``):

    head/kernel [D, V]   untied head only (no bias); tied: logits = x E^T
"""

from __future__ import annotations

from flax import nnx

from attn_symmetry import spec as spec_lib
from attn_symmetry.models import core
from attn_symmetry.models.config import Config


class Decoder(core.TextCore):
  """int tokens [B, T] -> next-token logits [B, T, V]."""

  def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
    super().__init__(cfg, rngs=rngs)
    self.head = (None if cfg.tied_embeddings else
                 core.Dense((cfg.width,), (cfg.vocab_size,), use_bias=False,
                            init_std=cfg.init_std, rngs=rngs))

  def __call__(self, tokens, *, mask=None, segments=None):
    x, inter = self.encode_tokens(tokens, mask=mask, segments=segments)
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
