"""Model configuration: one frozen dataclass for all four families, and presets.

``make_config(family, preset, **overrides)`` starts from the family's defaults
(its architecture: GPT-2 is pre-LayerNorm with learned positions and a tied
head, Llama is RMSNorm + SwiGLU + RoPE + GQA with no biases, ...), applies the
preset's sizes, then the overrides, and validates the result. Every field can
be overridden, so e.g. ``make_config("gpt2", pos_encoding="rope")`` is a GPT-2
with rotary positions.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from attn_symmetry import attention
from attn_symmetry import tasks

FAMILIES = ("vit", "bert", "gpt2", "llama")
POS_ENCODINGS = ("none", "sinusoidal", "learned", "rope", "rope2d")
NORMS = ("layer", "rms")
ACTIVATIONS = ("gelu", "gelu_tanh", "silu", "relu")
POOLINGS = ("cls", "mean")
# Each head and the task it is trained on (``attn_symmetry.tasks``).
HEAD_TASKS = {"classifier": tasks.CLASSIFICATION, "lm": tasks.LM, "mlm": tasks.MLM}
HEADS = tuple(HEAD_TASKS)


@dataclasses.dataclass(frozen=True)
class Config:
  """Architecture of one model.

  Attributes:
    family: "vit", "bert", "gpt2" or "llama" (chooses inputs and head).
    width: D, the residual stream width.
    depth: L, the number of Transformer layers.
    num_heads: N query heads; must divide ``width`` (head dim H = D / N).
    num_kv_heads: K key/value heads (grouped-query attention); None means N.
    mlp_dim: F, hidden units of each FFN.
    pos_encoding: "none", "sinusoidal" or "learned" (added to the input
      embeddings), "rope" (rotary, 1-D token positions) or "rope2d" (ViT only:
      axial rotary over the patch grid).
    rope_pairing, rope_base, rotary_fraction: RoPE layout (``attention.py``).
    norm: "layer" (LayerNorm) or "rms" (RMSNorm, no bias).
    norm_eps: epsilon of every norm.
    post_norm: True for BERT's post-LN (norm after each residual add, plus an
      embedding norm and no final norm); False for pre-norm.
    activation: FFN nonlinearity, "gelu" (exact), "gelu_tanh", "silu", "relu".
    gated_mlp: True for a gated FFN (SwiGLU with "silu"): act(x W_gate) * (x W_up).
    causal: causal self-attention (language models).
    use_bias: biases in attention, FFN and patch embedding.
    tied_embeddings: the LM/MLM head reads the token embedding (transposed).
    init_std: standard deviation of the normal initialisation of kernels and
      embeddings (biases start at zero, norm scales at one).
    vocab_size: V, text vocabulary.
    max_len: longest token sequence (size of the learned position table).
    num_segments: BERT segment (token type) vocabulary; 0 for none.
    image_size, patch_size, num_channels: ViT inputs [B, image_size,
      image_size, num_channels] cut into (image_size / patch_size)^2 patches.
    pooling: ViT pooling, "cls" (a learned CLS token) or "mean".
    num_classes: classifier outputs.
    head: "classifier" (ViT, BERT), "lm" (GPT-2, Llama: next-token logits) or
      "mlm" (BERT's masked-LM head: per-token logits).
  """
  family: str
  width: int = 32
  depth: int = 2
  num_heads: int = 4
  num_kv_heads: int | None = None
  mlp_dim: int = 64
  pos_encoding: str = "learned"
  rope_pairing: str = "half"
  rope_base: float = 10000.0
  rotary_fraction: float = 1.0
  norm: str = "layer"
  norm_eps: float = 1e-6
  post_norm: bool = False
  activation: str = "gelu"
  gated_mlp: bool = False
  causal: bool = False
  use_bias: bool = True
  tied_embeddings: bool = False
  init_std: float = 0.02
  vocab_size: int = 64
  max_len: int = 16
  num_segments: int = 0
  image_size: int = 8
  patch_size: int = 4
  num_channels: int = 3
  pooling: str = "cls"
  num_classes: int = 10
  head: str = "classifier"

  def __post_init__(self):
    choices = {"family": FAMILIES, "pos_encoding": POS_ENCODINGS, "norm": NORMS,
               "activation": ACTIVATIONS, "pooling": POOLINGS, "head": HEADS}
    for name, allowed in choices.items():
      if getattr(self, name) not in allowed:
        raise ValueError(f"config.{name} must be one of {allowed}, got {getattr(self, name)!r}")
    for name in ("width", "depth", "num_heads", "mlp_dim", "vocab_size", "max_len", "image_size",
                 "patch_size", "num_channels", "num_classes"):
      if getattr(self, name) < 1:
        raise ValueError(f"config.{name} must be positive, got {getattr(self, name)}")
    if self.width % self.num_heads:
      raise ValueError(f"config.num_heads {self.num_heads} does not divide config.width {self.width}")
    if self.num_heads % self.kv_heads:
      raise ValueError(f"config.num_kv_heads {self.kv_heads} does not divide config.num_heads "
                       f"{self.num_heads}")
    if self.rotary:
      attention.rotary_dims(self.head_dim, self.rotary_fraction, self.rope_axes)
    vision = self.family == "vit"
    if self.pos_encoding == "rope2d" and not vision:
      raise ValueError("config.pos_encoding 'rope2d' (axial RoPE over a patch grid) is for ViT only")
    if vision and self.image_size % self.patch_size:
      raise ValueError(f"config.patch_size {self.patch_size} does not divide config.image_size "
                       f"{self.image_size}")
    allowed_heads = {"vit": ("classifier",), "bert": ("classifier", "mlm"), "gpt2": ("lm",),
                     "llama": ("lm",)}[self.family]
    if self.head not in allowed_heads:
      raise ValueError(f"config.head {self.head!r} is not available for family {self.family!r}; "
                       f"choose from {allowed_heads}")
    if self.num_segments and self.family != "bert":
      raise ValueError("config.num_segments (segment embeddings) is for BERT only")

  @property
  def head_dim(self) -> int:
    return self.width // self.num_heads

  @property
  def kv_heads(self) -> int:
    return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

  @property
  def rotary(self) -> bool:
    return self.pos_encoding in ("rope", "rope2d")

  @property
  def rope_axes(self) -> int:
    return 2 if self.pos_encoding == "rope2d" else 1

  @property
  def num_patches(self) -> int:
    return (self.image_size // self.patch_size) ** 2

  @property
  def task(self) -> str:
    """The head's task: one of ``attn_symmetry.tasks.TASKS``."""
    return HEAD_TASKS[self.head]


# Architecture of each family (overridable field by field).
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "vit": dict(pos_encoding="learned", norm="layer", norm_eps=1e-12, activation="gelu",
                pooling="cls", head="classifier"),
    "bert": dict(pos_encoding="learned", norm="layer", norm_eps=1e-12, post_norm=True,
                 activation="gelu", num_segments=2, tied_embeddings=True, head="classifier",
                 num_classes=2),
    "gpt2": dict(pos_encoding="learned", norm="layer", norm_eps=1e-5, activation="gelu_tanh",
                 causal=True, tied_embeddings=True, head="lm"),
    "llama": dict(pos_encoding="rope", rope_pairing="half", norm="rms", norm_eps=1e-6,
                  activation="silu", gated_mlp=True, causal=True, use_bias=False,
                  tied_embeddings=False, head="lm"),
}

_SMALL = dict(width=256, depth=6, num_heads=4, mlp_dim=1024, max_len=256, vocab_size=256,
              image_size=32, patch_size=4)
# Sizes per preset; family-specific entries override the shared ones.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(width=32, depth=2, num_heads=4, mlp_dim=64, max_len=16, vocab_size=64,
                 image_size=8, patch_size=4, num_channels=3),
    # The paper's small settings: 6 layers, 4 heads.
    "small": _SMALL,
    "paper": _SMALL,
    "base": dict(width=768, depth=12, num_heads=12, mlp_dim=3072, max_len=1024,
                 image_size=224, patch_size=16, num_classes=1000),
}
FAMILY_PRESETS: dict[tuple[str, str], dict[str, Any]] = {
    ("llama", "tiny"): dict(num_kv_heads=2),
    ("llama", "small"): dict(mlp_dim=704),
    ("llama", "paper"): dict(mlp_dim=704),
    ("llama", "base"): dict(num_kv_heads=4, mlp_dim=2048, vocab_size=32000, max_len=2048),
    ("gpt2", "base"): dict(vocab_size=50257),
    ("bert", "base"): dict(vocab_size=30522, max_len=512, num_classes=2),
}


def make_config(family: str, preset: str = "tiny", **overrides: Any) -> Config:
  """The config of ``family`` at size ``preset`` with ``overrides`` applied.

  Raises:
    ValueError: unknown family, preset or field, or an invalid combination
      (e.g. heads not dividing the width, RoPE with an odd head dim).
  """
  if family not in FAMILIES:
    raise ValueError(f"unknown model family {family!r}; choose from {FAMILIES}")
  if preset not in PRESETS:
    raise ValueError(f"unknown preset {preset!r}; choose from {tuple(PRESETS)}")
  fields = {f.name for f in dataclasses.fields(Config)} - {"family"}
  unknown = sorted(set(overrides) - fields)
  if unknown:
    raise ValueError(f"unknown config fields {unknown}; valid fields are {sorted(fields)}")
  values = {**FAMILY_DEFAULTS[family], **PRESETS[preset], **FAMILY_PRESETS.get((family, preset), {}),
            **overrides}
  return Config(family=family, **values)
