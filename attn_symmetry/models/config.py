"""Model configuration: one frozen dataclass for every family, the family registry, presets.

A model family registers itself once, next to its code (``register_family``
at the end of ``vit.py``, ``bert.py``, ``decoder.py``): its NNX module, its
symmetry spec, the batch entry it reads, its heads and their tasks, its
architecture defaults, its sizes per preset and its Hugging Face mapping
(``hf.HFMapping``). ``FAMILIES`` lists the
registered names; everything else (``make_config``, ``Config`` validation,
``Model``, the experiment configs' checks) reads the registry.

``make_config(family, preset, **overrides)`` starts from the family's defaults
(its architecture: GPT-2 is pre-LayerNorm with learned positions and a tied
head, Llama is RMSNorm + SwiGLU + RoPE + GQA with no biases, GPT-NeoX is
LayerNorm + partial RoPE + parallel residual, ...), applies the
preset's sizes, then the overrides, and validates the result. Every field can
be overridden, so e.g. ``make_config("gpt2", pos_encoding="rope")`` is a GPT-2
with rotary positions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from attn_symmetry import attention
from attn_symmetry import registry
from attn_symmetry import tasks
from attn_symmetry.models.hf import HFMapping

POS_ENCODINGS = ("none", "sinusoidal", "learned", "rope", "rope2d")
NORMS = ("layer", "rms")
ACTIVATIONS = ("gelu", "gelu_tanh", "silu", "relu")
POOLINGS = ("cls", "mean")
INPUT_KEYS = ("image", "tokens")
# The biases of the layer stack, each None (``Config.use_bias``) or a bool.
BIAS_FIELDS = ("qkv_bias", "out_bias", "mlp_bias")


@dataclasses.dataclass(frozen=True)
class Family:
  """Everything the package needs to know about one model family.

  Attributes:
    name: the family's name (``Config.family``).
    module: the NNX module class: ``module(cfg, rngs=nnx.Rngs(...))`` builds it,
      and calling it on (inputs, mask=None, segments=None) returns (logits,
      intermediates) as ``Model.apply`` documents.
    symmetry_spec: cfg -> the ``spec.SymmetrySpec`` of the module's parameters
      (e.g. ``core.core_spec(cfg)`` extended, then ``build()``).
    input_key: the batch entry its inputs are read from: "image" (float
      [B, S, S, C]) or "tokens" (int [B, T]).
    heads: each ``Config.head`` value the family accepts and its task
      (``attn_symmetry.tasks``); the first is the default head.
    defaults: the family's architecture, as ``Config`` fields.
    presets: per size preset, the fields that differ from ``PRESETS``.
    segments: whether it reads segment ids (``Config.num_segments`` > 0).
    check: cfg -> None, raising ValueError for a config the family cannot
      build (on top of the shared checks of ``Config``); None for none.
    hf: its Hugging Face mapping (``hf.HFMapping``: model types, classes,
      config both ways, tensor table), which ``convert`` and ``safetensors_io``
      read; None for a family with no HF counterpart.
    head_activations: (module, x) -> {factor: units [..., size]}, the activations of the
      spec's factors that live in the head (BERT's "pooler" and "mlm"), from the module and
      its final stream x [B, T, D] (``Model.activations``); None for a head with none.
  """
  name: str
  module: Callable[..., Any]
  symmetry_spec: Callable[[Any], Any]
  input_key: str
  heads: Mapping[str, str]
  defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  presets: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
  segments: bool = False
  check: Callable[[Any], None] | None = None
  hf: HFMapping | None = None
  head_activations: Callable[[Any, Any], Mapping[str, Any]] | None = None


# The registered families by name (``register_family``); FAMILIES is a live view of its names.
# The built-in ones register on import of ``attn_symmetry.models`` (which marks them built in).
_REGISTRY: registry.Registry = registry.Registry()
FAMILIES = _REGISTRY.keys()


def register_family(family: Family) -> Family:
  """Adds ``family`` to the registry, after checking what it declares; returns it.

  Raises:
    ValueError: the name is taken, or an input key, head, task, preset or
      default field that the package does not know.
  """
  if family.name in _REGISTRY:
    raise ValueError(f"model family {family.name!r} is already registered")
  if family.input_key not in INPUT_KEYS:
    raise ValueError(f"family {family.name!r}: input_key must be one of {INPUT_KEYS}, "
                     f"got {family.input_key!r}")
  if not family.heads:
    raise ValueError(f"family {family.name!r} declares no head")
  for head, task in family.heads.items():
    if task not in tasks.TASKS:
      raise ValueError(f"family {family.name!r}: head {head!r} has task {task!r}; tasks are "
                       f"{tasks.TASKS}")
  unknown = sorted(set(family.presets) - set(PRESETS))
  if unknown:
    raise ValueError(f"family {family.name!r}: unknown presets {unknown}; presets are "
                     f"{tuple(PRESETS)}")
  fields = {f.name for f in dataclasses.fields(Config)} - {"family"}
  for where, values in [("defaults", family.defaults), *((f"presets[{p!r}]", v)
                                                         for p, v in family.presets.items())]:
    unknown = sorted(set(values) - fields)
    if unknown:
      raise ValueError(f"family {family.name!r}: {where} sets unknown config fields {unknown}")
  if family.hf is not None:
    _check_hf(family)
  _REGISTRY[family.name] = family
  return family


def _check_hf(family: Family) -> None:
  """ValueError unless ``family.hf`` names HF classes of the family's heads only, and model types
  that no registered family reads with another mapping (a copy of a family under a new name
  shares its mapping; ``convert.family_of`` gives the first family registered)."""
  unknown = sorted(set(family.hf.classes) - set(family.heads))
  if unknown:
    raise ValueError(f"family {family.name!r}: hf.classes names heads {unknown} that it lacks")
  if not family.hf.model_types:
    raise ValueError(f"family {family.name!r}: hf.model_types is empty")
  for other in _REGISTRY.values():
    if other.hf is None or other.hf == family.hf:
      continue
    taken = sorted(set(family.hf.model_types) & set(other.hf.model_types))
    if taken:
      raise ValueError(f"family {family.name!r}: HF model types {taken} are read by family "
                       f"{other.name!r}")


def get_family(name: str) -> Family:
  """The registered family ``name``; ValueError naming the registered ones otherwise."""
  if name not in _REGISTRY:
    raise ValueError(f"unknown model family {name!r}; choose from {tuple(FAMILIES)}")
  return _REGISTRY[name]


@dataclasses.dataclass(frozen=True)
class Config:
  """Architecture of one model.

  Attributes:
    family: a registered family (``FAMILIES``: "vit", "bert", "gpt2",
      "llama", "gpt_neox", ...), which chooses the module, inputs and heads.
    width: D, the residual stream width.
    depth: L, the number of Transformer layers.
    num_heads: N query heads; must divide ``width`` (head dim H = D / N) unless
      ``head_width`` sets H.
    num_kv_heads: K key/value heads (grouped-query attention); None means N.
    head_width: H, the width of every attention head; None (the default) is
      D / N. Another value decouples the heads from the stream: the query, key and
      value projections map D to N x H (K x H) and the output projection N x H back
      to D, and the softmax scale is 1 / sqrt(H). The circuit path evaluates its
      points on a model whose heads are twice as wide (``models.circuit_model``,
      docs/lmc.md, 'The circuit path'). ``head_dim`` reads H either way.
    mlp_dim: F, hidden units of each FFN.
    pos_encoding: "none", "sinusoidal" or "learned" (added to the input
      embeddings), "rope" (rotary, 1-D token positions) or "rope2d" (ViT only:
      axial rotary over the patch grid).
    rope_pairing, rope_base, rotary_fraction: RoPE layout (``attention.py``).
    norm: "layer" (LayerNorm) or "rms" (RMSNorm, no bias).
    norm_eps: epsilon of every norm.
    post_norm: True for BERT's post-LN (norm after each residual add, plus an
      embedding norm and no final norm); False for pre-norm.
    parallel_residual: True for GPT-NeoX's parallel layer, where attention and
      FFN both read the layer's input: x + attn(norm_a(x)) + mlp(norm_m(x));
      False for the sequential pre-norm layer (pre-norm models only).
    activation: FFN nonlinearity, "gelu" (exact), "gelu_tanh", "silu", "relu".
    gated_mlp: True for a gated FFN (SwiGLU with "silu"): act(x W_gate) * (x W_up).
    causal: causal self-attention (language models).
    use_bias: biases in attention, FFN and patch embedding: the patch
      embedding's, and the default of the three that follow.
    qkv_bias, out_bias, mlp_bias: biases on the query, key and value
      projections, on the attention output projection, and in the FFN; None
      (the default) takes ``use_bias``, so that e.g. Qwen2's biases on q, k
      and v alone are ``use_bias=False, qkv_bias=True``. A built config holds
      each as a bool.
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
    head: "classifier" (ViT, BERT), "lm" (GPT-2, Llama, GPT-NeoX: next-token logits),
      "mlm" (BERT's masked-LM head: per-token logits), "pretraining" (BERT's
      masked-LM head and next-sentence head, as BertForPreTraining), or no task
      head: "encoder" (BERT's bare encoder, BertModel, with its pooler) or
      "encoder_no_pooler" (without), whose output is the last hidden state.
  """
  family: str
  width: int = 32
  depth: int = 2
  num_heads: int = 4
  num_kv_heads: int | None = None
  head_width: int | None = None
  mlp_dim: int = 64
  pos_encoding: str = "learned"
  rope_pairing: str = "half"
  rope_base: float = 10000.0
  rotary_fraction: float = 1.0
  norm: str = "layer"
  norm_eps: float = 1e-6
  post_norm: bool = False
  parallel_residual: bool = False
  activation: str = "gelu"
  gated_mlp: bool = False
  causal: bool = False
  use_bias: bool = True
  qkv_bias: bool | None = None
  out_bias: bool | None = None
  mlp_bias: bool | None = None
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
    fam = get_family(self.family)
    for name in BIAS_FIELDS:
      if getattr(self, name) is None:
        object.__setattr__(self, name, self.use_bias)
    choices = {"pos_encoding": POS_ENCODINGS, "norm": NORMS, "activation": ACTIVATIONS,
               "pooling": POOLINGS}
    for name, allowed in choices.items():
      if getattr(self, name) not in allowed:
        raise ValueError(f"config.{name} must be one of {allowed}, got {getattr(self, name)!r}")
    for name in ("width", "depth", "num_heads", "mlp_dim", "vocab_size", "max_len", "image_size",
                 "patch_size", "num_channels", "num_classes"):
      if getattr(self, name) < 1:
        raise ValueError(f"config.{name} must be positive, got {getattr(self, name)}")
    if self.head_width is not None and self.head_width < 1:
      raise ValueError(f"config.head_width must be positive or None, got {self.head_width}")
    if self.head_width is None and self.width % self.num_heads:
      raise ValueError(f"config.num_heads {self.num_heads} does not divide config.width "
                       f"{self.width} (or set config.head_width)")
    if self.num_heads % self.kv_heads:
      raise ValueError(f"config.num_kv_heads {self.kv_heads} does not divide config.num_heads "
                       f"{self.num_heads}")
    if self.parallel_residual and self.post_norm:
      raise ValueError("config.parallel_residual is for pre-norm models; config.post_norm is True")
    if self.rotary:
      attention.rotary_dims(self.head_dim, self.rotary_fraction, self.rope_axes)
    if self.pos_encoding == "rope2d" and fam.input_key != "image":
      raise ValueError("config.pos_encoding 'rope2d' (axial RoPE over a patch grid) is for image "
                       f"models only; family {self.family!r} reads {fam.input_key}")
    if self.head not in fam.heads:
      raise ValueError(f"config.head {self.head!r} is not available for family {self.family!r}; "
                       f"choose from {tuple(fam.heads)}")
    if self.num_segments and not fam.segments:
      raise ValueError(f"config.num_segments (segment embeddings) is for families that read "
                       f"segments (BERT); family {self.family!r} does not")
    if fam.check is not None:
      fam.check(self)

  @property
  def head_dim(self) -> int:
    """H: ``head_width``, or D / N when it is None."""
    return self.width // self.num_heads if self.head_width is None else self.head_width

  @property
  def kv_heads(self) -> int:
    return attention.kv_heads(self.num_heads, self.num_kv_heads)

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
    """The head's task (its family's ``heads``): one of ``attn_symmetry.tasks.TASKS``."""
    return _REGISTRY[self.family].heads[self.head]


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


def make_config(family: str, preset: str = "tiny", **overrides: Any) -> Config:
  """The config of ``family`` at size ``preset`` with ``overrides`` applied.

  Raises:
    ValueError: unknown family, preset or field, or an invalid combination
      (e.g. heads not dividing the width, RoPE with an odd head dim).
  """
  fam = get_family(family)
  if preset not in PRESETS:
    raise ValueError(f"unknown preset {preset!r}; choose from {tuple(PRESETS)}")
  fields = {f.name for f in dataclasses.fields(Config)} - {"family"}
  unknown = sorted(set(overrides) - fields)
  if unknown:
    raise ValueError(f"unknown config fields {unknown}; valid fields are {sorted(fields)}")
  values = {"head": next(iter(fam.heads)), **fam.defaults, **PRESETS[preset],
            **fam.presets.get(preset, {}), **overrides}
  return Config(family=family, **values)
