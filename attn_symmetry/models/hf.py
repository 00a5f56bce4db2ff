"""A family's Hugging Face mapping (``HFMapping``) and the pieces families build it from.

A family that reads and writes Hugging Face checkpoints gives its ``Family`` an
``HFMapping`` (``hf=``), next to its model code: which ``config.json``
``model_type`` values it reads, the ``transformers`` class of each head, the
config both ways, and the table from our parameter paths to the HF state-dict
keys. ``convert`` (PyTorch models and state dicts) and ``safetensors_io``
(model folders, no torch) read only these mappings, so a family registered by
any module (``attn-symmetry align --import MODULE``) converts and aligns like a
built-in one.

A table maps each of our leaves to a ``Source``: the HF key and the layout of
the HF tensor (``convert`` has the layouts). ``dense``, ``norm`` and
``lm_head`` give the entries of the usual modules; ``require``,
``activation``, ``ACT_TO_HF`` and ``rope_theta`` read and write HF config fields.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

# HF activation names -> ``Config.activation``, and back.
ACT_FROM_HF = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
               "relu": "relu", "silu": "silu", "swish": "silu"}
ACT_TO_HF = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu", "silu": "silu"}
Table = tuple[dict[str, "Source"], dict[str, str]]  # ({our path: Source}, {tied alias: its key})


@dataclasses.dataclass(frozen=True)
class Source:
  """Where one of our leaves lives in an HF state dict: its key and layout (``convert``)."""
  key: str
  layout: str = "same"
  part: int | None = None
  heads: int | None = None
  lead: int = 0


@dataclasses.dataclass(frozen=True)
class HFMapping:
  """How a family's models are Hugging Face checkpoints.

  Attributes:
    model_types: the ``config.json`` ``model_type`` values read as this family
      (Llama's: "llama" and "mistral"); no two families share one.
    classes: each head (``Config.head``) that HF has, and the name of its
      ``transformers`` class ("LlamaForCausalLM").
    config_from_hf: (hf_config, head) -> our ``Config``, ValueError (``require``)
      for an option the family cannot express. ``hf_config`` is a
      ``transformers`` config or a ``config.json`` read by attribute, where an
      absent field takes its ``defaults`` value, else None.
    hf_config: our ``Config`` -> the ``transformers`` config (it imports
      ``transformers``); ``convert.hf_config`` refuses a config that does not
      come back from it unchanged.
    table: cfg -> ({our path: ``Source``}, {HF key of a tied copy: the key it
      repeats}), every key as the head's class names it with ``prefix``.
    prefix: the base model's prefix of the state-dict keys ("model."). A file
      of the base model alone (GPT-2 on the Hub, ``BertModel``) lacks it;
      ``convert.state_dict_names`` adds it.
    defaults: per model type, the HF config class's defaults of the fields
      that ``config_from_hf`` reads (a ``config.json`` may leave them out).
    renames: (regex, replacement) pairs that turn a file's tensor names into
      the state-dict names of ``table``, as ``transformers`` renames Hub
      checkpoints on loading (old BERT files' LayerNorm gamma and beta).
    head_of: the HF state-dict keys (with ``prefix``) -> ``Config.head``,
      ValueError for a head not read; None: the family's first head.
    class_kwargs: per head, keyword arguments of its class besides the config
      (``BertModel``'s ``add_pooling_layer=False``).
  """
  model_types: tuple[str, ...]
  classes: Mapping[str, str]
  config_from_hf: Callable[[Any, str], Any]
  hf_config: Callable[[Any], Any]
  table: Callable[[Any], Table]
  prefix: str
  defaults: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
  renames: tuple[tuple[str, str], ...] = ()
  head_of: Callable[[set[str]], str] | None = None
  class_kwargs: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)


# ----------------------------------------------------------------------------- configs


def require(hf_config: Any, name: str, ok: Callable[[Any], bool], what: str) -> None:
  """ValueError naming HF config field ``name`` and ``what`` the zoo needs, unless ``ok``."""
  value = getattr(hf_config, name, None)
  if not ok(value):
    raise ValueError(f"unsupported HF config: {name}={value!r} ({what})")


def activation(hf_name: str) -> str:
  """``Config.activation`` of an HF activation name; ValueError for one the zoo lacks."""
  if hf_name not in ACT_FROM_HF:
    raise ValueError(f"unsupported HF activation {hf_name!r}; supported {sorted(ACT_FROM_HF)}")
  return ACT_FROM_HF[hf_name]


def plain_rope(hf_config: Any) -> dict[str, Any]:
  """The config's ``rope_parameters`` ({} if none); ValueError for a rope type other than plain
  RoPE ("default")."""
  params = getattr(hf_config, "rope_parameters", None) or {}
  scaling = getattr(hf_config, "rope_scaling", None) or {}
  rope_type = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
  if rope_type != "default":
    raise ValueError(f"unsupported HF config: rope type {rope_type!r} (only plain RoPE, 'default')")
  return params


def rope_theta(hf_config: Any) -> float:
  """The RoPE base of plain RoPE (``plain_rope``): ``rope_parameters``' or the legacy field's."""
  return float(plain_rope(hf_config).get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))


# ----------------------------------------------------------------------------- tables


def dense(ours: str, hf: str, bias: bool, layout: str = "linear") -> dict[str, Source]:
  """A linear layer: our ``ours/kernel`` (and ``ours/bias``) from ``hf.weight`` (``hf.bias``)."""
  table = {f"{ours}/kernel": Source(f"{hf}.weight", layout)}
  if bias:
    table[f"{ours}/bias"] = Source(f"{hf}.bias")
  return table


def norm(ours: str, hf: str, cfg: Any) -> dict[str, Source]:
  """A norm: its scale, and its bias for a LayerNorm (``cfg.norm``)."""
  table = {f"{ours}/scale": Source(f"{hf}.weight")}
  if cfg.norm == "layer":
    table[f"{ours}/bias"] = Source(f"{hf}.bias")
  return table


def lm_head(cfg: Any, embed_key: str) -> Table:
  """A decoder's head: ``lm_head`` [V, D], or (tied) an alias of the token embedding."""
  if cfg.tied_embeddings:
    return {}, {"lm_head.weight": embed_key}
  return dense("head", "lm_head", False), {}
