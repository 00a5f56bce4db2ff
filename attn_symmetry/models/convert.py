"""Hugging Face ``transformers`` checkpoints <-> the model zoo: the generic machinery.

    apply_fn, params = convert.from_hf(hf_model)            # a PyTorch HF model
    apply_fn, params = convert.from_hf(state_dict, hf_config)
    cfg = convert.config_from_hf(json.load(open("config.json")), head)  # torch-free
    model, params = convert.load_hf(hf_model)                # with the Model
    hf_model = convert.to_hf(model, params)                  # back to PyTorch

What a family's checkpoints are is its ``Family.hf`` (``hf.HFMapping``),
registered beside its model code: the built-in ``GPT2LMHeadModel``,
``LlamaForCausalLM`` (which also reads Mistral's configs) and
``GPTNeoXForCausalLM`` in ``decoder.py``, ``BertForSequenceClassification``,
``BertForMaskedLM``, ``BertForPreTraining`` and ``BertModel`` in ``bert.py``,
``ViTForImageClassification`` in ``vit.py``. This module reads the mappings of
whichever families are registered (``family_of``, ``model_types``).

A family's table maps our parameter paths to HF state-dict keys and the layout
of the HF tensor (``hf.Source``; keys as the task classes name them, with the
mapping's ``prefix``, which a base-model state dict such as a ``BertModel``'s
lacks: ``state_dict_names``):

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
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from attn_symmetry import spec as spec_lib
from attn_symmetry.models import config as config_lib
from attn_symmetry.models.hf import HFMapping, Source
from attn_symmetry.models.model import Model


# ----------------------------------------------------------------------------- families


def model_types() -> tuple[str, ...]:
  """The HF ``model_type`` values that the registered families read, in registration order."""
  families = [config_lib.get_family(name) for name in config_lib.FAMILIES]
  types = [t for family in families if family.hf is not None for t in family.hf.model_types]
  return tuple(dict.fromkeys(types))  # a family's copy under another name reads its types too


def family_of(model_type: Any) -> config_lib.Family:
  """The registered family whose ``hf`` mapping reads HF ``model_type``.

  Raises:
    ValueError: no family reads it (naming the model types read).
  """
  for name in config_lib.FAMILIES:
    family = config_lib.get_family(name)
    if family.hf is not None and model_type in family.hf.model_types:
      return family
  raise ValueError(f"unsupported HF model type {model_type!r}; supported: "
                   f"{', '.join(model_types())}")


def _mapping(cfg: config_lib.Config) -> HFMapping:
  """The HF mapping of ``cfg``'s family; ValueError for a family that has none."""
  family = config_lib.get_family(cfg.family)
  if family.hf is None:
    raise ValueError(f"model family {family.name!r} has no Hugging Face mapping (Family.hf)")
  return family.hf


def state_dict_names(keys: Iterable[str], mapping: HFMapping) -> dict[str, str]:
  """{state-dict name, as the family's table gives it: key} for the tensor ``keys`` of a file
  or state dict: the mapping's prefix added where no key has it (a base model's file: GPT-2 on
  the Hub, a ``BertModel``), then its renames applied."""
  keys = list(keys)
  add_prefix = not any(k.startswith(mapping.prefix) for k in keys)
  names = {}
  for key in keys:
    name = mapping.prefix + key if add_prefix else key
    for pattern, new in mapping.renames:
      name = re.sub(pattern, new, name)
    names[name] = key
  return names


def head_of(model_type: str, keys: set[str]) -> str:
  """``Config.head`` of a checkpoint of HF ``model_type`` with state-dict ``keys``
  (``state_dict_names``): the family's ``hf.head_of``, or else its first head.

  Raises:
    ValueError: the model type, or a head that the family does not read (named).
  """
  family = family_of(model_type)
  if family.hf.head_of is None:
    return next(iter(family.heads))
  return family.hf.head_of(keys)


# ----------------------------------------------------------------------------- configs


class _ConfigDict:
  """Attribute view of a ``config.json`` dict: absent fields take the HF class default of its
  family's mapping (``hf.HFMapping.defaults``; None where the class computes one),
  ``num_labels`` counts ``id2label`` as HF does."""

  def __init__(self, fields: Mapping[str, Any], defaults: Mapping[str, Any]):
    self._fields = {**defaults, **fields}
    if "num_labels" not in fields:
      self._fields["num_labels"] = len(fields.get("id2label") or {}) or 2

  def __getattr__(self, name: str) -> Any:
    return self._fields.get(name)


def config_from_hf(hf_config: Any, head: str) -> config_lib.Config:
  """Our ``Config`` for an HF config object or ``config.json`` dict (``head`` as in ``Config.head``).

  Raises:
    ValueError: the model type or an option that the zoo cannot express.
  """
  if isinstance(hf_config, Mapping):
    model_type = hf_config.get("model_type")
    mapping = family_of(model_type).hf
    hf_config = _ConfigDict(hf_config, mapping.defaults.get(model_type, {}))
  else:
    mapping = family_of(getattr(hf_config, "model_type", None)).hf
  return mapping.config_from_hf(hf_config, head)


def hf_config(cfg: config_lib.Config) -> Any:
  """The HF config of our ``cfg`` (its family's ``hf.hf_config``).

  Raises:
    ValueError: naming the config fields that HF's model of the family cannot
      express (e.g. ``pos_encoding`` for a GPT-2 with RoPE).
  """
  mapping = _mapping(cfg)
  out = mapping.hf_config(cfg)
  back = mapping.config_from_hf(out, cfg.head)
  differ = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
            if getattr(cfg, f.name) != getattr(back, f.name) and f.name != "init_std"}
  if differ:
    raise ValueError(f"HF {mapping.classes[cfg.head]} cannot express config fields "
                     f"{differ} (it would use {[getattr(back, k) for k in differ]})")
  return out


# ----------------------------------------------------------------------------- tables


def param_table(cfg: config_lib.Config) -> tuple[dict[str, Source], dict[str, str]]:
  """({our path: Source}, {tied HF alias key: the HF key it repeats}) for ``cfg``."""
  return _mapping(cfg).table(cfg)


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


def _hf_model(cfg: config_lib.Config, hf_cfg: Any) -> Any:
  """The HF PyTorch model of ``cfg``'s family and head, built from ``hf_cfg``."""
  import transformers  # pylint: disable=g-import-not-at-top

  mapping = _mapping(cfg)
  hf_class = getattr(transformers, mapping.classes[cfg.head])
  return hf_class(hf_cfg, **mapping.class_kwargs.get(cfg.head, {}))


def _template(cfg: config_lib.Config, hf_cfg: Any) -> dict[str, tuple[int, ...]]:
  """Key (as the tables name it, ``state_dict_names``) -> shape of the state dict of an HF model
  of this config (built on the meta device)."""
  import torch  # pylint: disable=g-import-not-at-top

  with torch.device("meta"):
    state = _hf_model(cfg, hf_cfg).state_dict()
  return {name: tuple(state[k].shape) for name, k in state_dict_names(state, _mapping(cfg)).items()}


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
  model_type = getattr(hf_config, "model_type", None)
  family = family_of(model_type)
  names = state_dict_names(hf_model, family.hf)
  state = {name: _to_numpy(hf_model[key]) for name, key in names.items()}
  cfg = config_from_hf(hf_config, head_of(model_type, set(state)))
  model = Model(cfg)
  table, aliases = param_table(cfg)
  template = _template(cfg, hf_config)
  _check_checkpoint(state, template, aliases)
  unused = sorted(set(template) - {s.key for s in table.values()} - set(aliases))
  if unused:
    raise ValueError(f"HF parameters {unused} have no counterpart in the zoo's {family.name} "
                     "model")
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
  hf_state = hf_model.state_dict()
  keys = state_dict_names(hf_state, _mapping(cfg))  # table's name -> the HF model's key
  template = {name: tuple(hf_state[k].shape) for name, k in keys.items()}
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
  hf_model.load_state_dict({keys[k]: v for k, v in state.items()}, strict=True)
  return hf_model.eval()
