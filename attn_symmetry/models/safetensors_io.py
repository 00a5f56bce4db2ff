"""Hugging Face model folders read with numpy and written as safetensors: no torch, no transformers.

    ckpt = safetensors_io.Checkpoint("gpt2-seed1")       # config.json and file headers only
    model = models.Model(ckpt.config)
    params = safetensors_io.load_params(ckpt, model)     # float32, read tensor by tensor
    safetensors_io.save_params("out/b", ckpt, model, params)  # ckpt's names, shards, dtypes

A model folder holds ``config.json`` and its weights in ``model.safetensors``,
or in the shards that ``model.safetensors.index.json`` lists (its
"weight_map": tensor name -> file); without either, in PyTorch's
``pytorch_model.bin`` or the shards of ``pytorch_model.bin.index.json``
(``torch.save``'s zip format, read by ``torch_pickle`` without torch and
without executing the pickle: MultiBERTs ships only these).
Each tensor is read on its own, with safetensors' numpy API through ``pread``
(no memory map) or from its ``.bin`` zip member, so reading a model holds one
stored tensor at a time besides the float32 parameters. bfloat16 tensors come
as ``ml_dtypes.bfloat16`` arrays; ``save_params`` writes every tensor back in
its stored dtype (or float32), always as safetensors: a ``.bin`` folder's
``pytorch_model[-0000i-of-0000n].bin`` become ``model[-0000i-of-0000n].safetensors``
(``safetensors_name``) with the same tensor names and shards.

Names. Files keep the tensor names of the checkpoint format on the Hub, which
can differ from the state dict of transformers' current classes, the names of
``convert.param_table``: ViT's ``vit.encoder.layer.{i}.attention.attention.query``
is ``vit.layers.{i}.attention.q_proj`` (``_RENAMES``), old BERT files name
LayerNorm parameters gamma and beta, and a base-model file (GPT-2 on the Hub)
has no ``transformer.`` prefix. ``Checkpoint.names`` maps state-dict names to
the file's, and files are written under the file's own names. Buffers that are
not parameters (GPT-2's ``attn.bias`` causal masks, ``position_ids``) are read
past and copied unchanged; tied copies (``lm_head.weight`` of a tied GPT-2)
must equal what they repeat and are written as it.

Every problem with a folder is a ValueError of one line that starts with the
folder's name and names the file, tensor or config field.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from attn_symmetry import spec as spec_lib
from attn_symmetry.models import convert
from attn_symmetry.models import torch_pickle
from attn_symmetry.models.model import Model

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
BIN_WEIGHTS = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"
DTYPES = {"F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
          "BF16": np.dtype(ml_dtypes.bfloat16)}
# numpy dtype -> safetensors' code, for the tensors of .bin files.
_CODES = {**{v: k for k, v in DTYPES.items()}, np.dtype(np.int64): "I64",
          np.dtype(np.int32): "I32", np.dtype(np.int16): "I16", np.dtype(np.int8): "I8",
          np.dtype(np.uint8): "U8", np.dtype(np.bool_): "BOOL"}
# File name (regex) -> state-dict name, as transformers renames Hub checkpoints on loading.
_RENAMES = {
    "bert": ((r"LayerNorm\.gamma$", "LayerNorm.weight"), (r"LayerNorm\.beta$", "LayerNorm.bias")),
    "vit": tuple((rf"\.encoder\.layer\.(\d+)\.{re.escape(old)}", rf".layers.\1.{new}") for old, new in (
        ("attention.attention.query.", "attention.q_proj."),
        ("attention.attention.key.", "attention.k_proj."),
        ("attention.attention.value.", "attention.v_proj."),
        ("attention.output.dense.", "attention.o_proj."),
        ("intermediate.dense.", "mlp.fc1."), ("output.dense.", "mlp.fc2."), ("", ""))),
    "gpt_neox": ((r"^embed_out\.", "lm_head."),),
}
_PREFIXES = {"gpt2": "transformer.", "llama": "model.", "mistral": "model.", "bert": "bert.",
             "vit": "vit.", "gpt_neox": "gpt_neox."}
_BUFFERS = re.compile(r"(^|\.)(attn\.bias|attn\.masked_bias|position_ids|attention\.bias|"
                      r"attention\.masked_bias|rotary_emb\.inv_freq)$")
# Files of a model folder copied next to rewritten weights (tokenizer, generation config, ...).
_SIDE_FILES = (".json", ".txt", ".model", ".jinja")
LeafFn = Callable[[str, Any], Any]  # (parameter path, leaf) -> the leaf to write


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  """A tensor of a checkpoint file, from its header."""
  file: str
  shape: tuple[int, ...]
  dtype: str  # safetensors' code: "F32", "BF16", ...

  @property
  def nbytes(self) -> int:
    return math.prod(self.shape) * DTYPES[self.dtype].itemsize if self.dtype in DTYPES else 0


def _listing(names: list[str], most: int = 4) -> str:
  shown = ", ".join(names[:most])
  return shown + (f" and {len(names) - most} more" if len(names) > most else "")


class Checkpoint:
  """A Hugging Face model folder: its config and tensor headers; tensors are read on demand.

  Attributes:
    path: the folder; name: how messages call it (default ``path``).
    hf_config: ``config.json`` as a dict.
    config: our ``models.Config`` of it.
    tensors: file tensor name -> ``TensorInfo``, in file order.
    files: weight file -> its tensor names; metadata: weight file -> its header metadata
      (``{"format": "pt"}`` for a ``.bin`` file, what transformers writes in safetensors).
    torch: whether the weights are ``.bin`` files (``torch_pickle``), not safetensors.
    index: the index file of sharded weights (``INDEX`` or ``BIN_INDEX``), else None.
    sharded: whether the weights are shards that ``index`` lists.
    names: state-dict name (``convert.param_table``'s) -> file tensor name.
    nbytes: size of all tensors as stored.
  """

  def __init__(self, path: str | os.PathLike, name: str | None = None):
    self.path = os.fspath(path)
    self.name = name or self.path
    if not os.path.isdir(self.path):
      raise self.error("no such folder" if not os.path.exists(self.path) else "not a folder")
    self.hf_config = self._read_json(CONFIG)
    model_type = self.hf_config.get("model_type")
    if model_type not in convert.MODEL_TYPES:
      raise self.error(f"unsupported HF model type {model_type!r} in {CONFIG}; supported: "
                 f"{', '.join(convert.MODEL_TYPES)}")
    self.index, self.torch = self._weights_kind()
    self.sharded = self.index is not None
    self.files = self._weight_files()
    self.tensors: dict[str, TensorInfo] = {}
    self.metadata: dict[str, dict[str, str] | None] = {}
    self._refs: dict[str, torch_pickle.TensorRef] = {}  # .bin tensors: where each lies
    for file, keys in self.files.items():
      self._read_header(file, keys)
    self.names = self._state_dict_names(model_type)
    try:
      self.config = convert.config_from_hf(self.hf_config,
                                           convert.head_of(model_type, set(self.names)))
    except ValueError as e:
      raise self.error(str(e))

  def __repr__(self) -> str:
    return f"Checkpoint({self.name!r}, {self.config.family}, {len(self.tensors)} tensors)"

  def error(self, message: str) -> ValueError:
    """The error to raise about this folder: one line that starts with its name."""
    return ValueError(f"{self.name}: {message}")

  def _read_json(self, file: str) -> dict[str, Any]:
    full = os.path.join(self.path, file)
    if not os.path.isfile(full):
      raise self.error(f"no {file}")
    try:
      with open(full, encoding="utf-8") as f:
        out = json.load(f)
    except (OSError, ValueError) as e:
      raise self.error(f"{file} is unreadable ({e})")
    if not isinstance(out, dict):
      raise self.error(f"{file} does not hold a JSON object")
    return out

  def _weights_kind(self) -> tuple[str | None, bool]:
    """(the index file or None, whether the weights are .bin files): safetensors first, then
    PyTorch's files."""
    for index, single, is_torch in ((INDEX, WEIGHTS, False), (BIN_INDEX, BIN_WEIGHTS, True)):
      if os.path.exists(os.path.join(self.path, index)):
        return index, is_torch
      if os.path.exists(os.path.join(self.path, single)):
        return None, is_torch
    other = sorted(f for f in os.listdir(self.path) if f.endswith((".bin", ".pt", ".pth", ".h5")))
    hint = f" ({_listing(other)} not read)" if other else ""
    raise self.error(f"no {WEIGHTS}, {INDEX}, {BIN_WEIGHTS} or {BIN_INDEX}{hint}")

  def _weight_files(self) -> dict[str, list[str] | None]:
    """Weight file -> the tensor names the index gives it (None: all of the file's)."""
    if self.index is None:
      return {BIN_WEIGHTS if self.torch else WEIGHTS: None}
    weight_map = self._read_json(self.index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
      raise self.error(f"{self.index} has no weight_map")
    files: dict[str, list[str] | None] = {}
    for key, file in weight_map.items():
      files.setdefault(file, []).append(key)
    return files

  def _read_header(self, file: str, keys: list[str] | None) -> None:
    full = os.path.join(self.path, file)
    if not os.path.isfile(full):
      raise self.error(f"weight file {file} is missing" +
                       (f" (listed in {self.index})" if keys else ""))
    if self.torch:
      infos = self._read_torch_header(file, full)
    else:
      infos = self._read_safetensors_header(file, full)
    present = list(infos)
    absent = sorted(set(keys or ()) - set(present))
    if absent:
      raise self.error(f"{file} lacks tensors that {self.index} puts there: {_listing(absent)}")
    self.files[file] = keys or present
    for k in keys or present:
      if k in self.tensors:
        raise self.error(f"tensor {k} is in both {self.tensors[k].file} and {file}")
      self.tensors[k] = infos[k]

  def _read_safetensors_header(self, file: str, full: str) -> dict[str, TensorInfo]:
    try:
      with safe_open(full, framework="numpy", backend="pread") as f:
        self.metadata[file] = f.metadata()
        slices = {k: f.get_slice(k) for k in f.keys()}
        return {k: TensorInfo(file, tuple(s.get_shape()), s.get_dtype()) for k, s in slices.items()}
    except Exception as e:  # pylint: disable=broad-except  # safetensors raises its own errors
      raise self.error(f"{file} is not a readable safetensors file ({e})")

  def _read_torch_header(self, file: str, full: str) -> dict[str, TensorInfo]:
    try:
      refs = torch_pickle.read_index(full)
    except (OSError, ValueError) as e:
      raise self.error(str(e))
    self.metadata[file] = {"format": "pt"}
    infos = {}
    for k, ref in refs.items():
      self._refs[k] = ref
      infos[k] = TensorInfo(file, ref.shape, _CODES.get(ref.dtype, ref.dtype.name))
    return infos

  def _state_dict_names(self, model_type: str) -> dict[str, str]:
    prefix = _PREFIXES[model_type]
    add_prefix = not any(k.startswith(prefix) for k in self.tensors)  # a base-model file
    names = {}
    for key in self.tensors:
      name = prefix + key if add_prefix else key
      for pattern, new in _RENAMES.get(model_type, ()):
        name = re.sub(pattern, new, name)
      names[name] = key
    return names

  @property
  def nbytes(self) -> int:
    return sum(t.nbytes for t in self.tensors.values())

  @property
  def dtypes(self) -> list[str]:
    """The numpy names of the stored dtypes of the parameters, most bytes first."""
    size: dict[str, int] = {}
    for t in self.tensors.values():
      size[t.dtype] = size.get(t.dtype, 0) + t.nbytes
    return [DTYPES[d].name for d in sorted(size, key=lambda d: -size[d]) if d in DTYPES]

  def is_buffer(self, key: str) -> bool:
    return bool(_BUFFERS.search(key))

  def read(self, key: str) -> np.ndarray:
    """The file tensor ``key`` in its stored dtype (the file is opened for it alone)."""
    if self.torch:
      return self._refs[key].read()
    info = self.tensors[key]
    with safe_open(os.path.join(self.path, info.file), framework="numpy", backend="pread") as f:
      return f.get_tensor(key)


def check_layout(ckpt: Checkpoint, model: Model) -> None:
  """ValueError unless ``ckpt`` holds exactly the tensors of ``model`` (its config), in a
  float dtype and the shapes that its config gives, besides tied copies and buffers."""
  table, aliases = convert.param_table(model.config)
  wanted: dict[str, tuple[int, ...]] = {}
  for path, src in table.items():
    wanted[src.key] = convert.hf_shape(path, model.param_shapes[path], src)
  missing = [k for k in wanted if k not in ckpt.names]
  extra = [ckpt.names[k] for k in ckpt.names
           if k not in wanted and k not in aliases and not ckpt.is_buffer(k)]
  misshapen = [f"{ckpt.names[k]} {ckpt.tensors[ckpt.names[k]].shape} instead of {s}"
               for k, s in wanted.items() if k in ckpt.names
               and ckpt.tensors[ckpt.names[k]].shape != s]
  if missing or extra or misshapen:
    problems = [f"{what} {_listing(names)}" for what, names in
                (("missing", missing), ("unexpected", extra), ("misshapen", misshapen)) if names]
    raise ckpt.error(f"the tensors do not fit {CONFIG}: {'; '.join(problems)}")
  for k in [*wanted, *(a for a in aliases if a in ckpt.names)]:
    info = ckpt.tensors[ckpt.names[k]]
    if info.dtype not in DTYPES:
      raise ckpt.error(f"tensor {ckpt.names[k]} has dtype {info.dtype}; only {', '.join(DTYPES)} "
                 "are read")
    if aliases.get(k) in wanted and ckpt.tensors[ckpt.names[k]].shape != wanted[aliases[k]]:
      raise ckpt.error(f"tied tensor {ckpt.names[k]} {info.shape} does not match "
                 f"{aliases[k]} {wanted[aliases[k]]}")


def safetensors_name(file: str) -> str:
  """The safetensors file that ``save_params`` writes for weight file ``file``:
  ``pytorch_model-00001-of-00002.bin`` -> ``model-00001-of-00002.safetensors``."""
  if not file.endswith(".bin"):
    return file
  stem = file[:-len(".bin")]
  if stem.startswith("pytorch_model"):
    stem = "model" + stem[len("pytorch_model"):]
  return stem + ".safetensors"


def _by_key(table: Mapping[str, convert.Source]) -> dict[str, list[tuple[str, convert.Source]]]:
  out: dict[str, list[tuple[str, convert.Source]]] = {}
  for path, src in table.items():
    out.setdefault(src.key, []).append((path, src))
  return out


def load_params(ckpt: Checkpoint, model: Model) -> dict[str, Any]:
  """``model``'s float32 parameters from ``ckpt``, one stored tensor in memory at a time.

  Raises:
    ValueError: (``check_layout``) the tensors do not fit the config; a tensor
      holds NaN or Inf; a tied copy differs from what it repeats (each named).
  """
  check_layout(ckpt, model)
  table, aliases = convert.param_table(model.config)
  flat = {}
  for key, entries in _by_key(table).items():
    x = np.asarray(ckpt.read(ckpt.names[key]), np.float32)
    if not np.isfinite(x).all():
      raise ckpt.error(f"tensor {ckpt.names[key]} holds NaN or Inf")
    for path, src in entries:
      flat[path] = jnp.asarray(convert.leaf_from_hf(x, src, model.param_shapes[path]))
  for alias, key in aliases.items():
    if alias in ckpt.names and not np.array_equal(ckpt.read(ckpt.names[alias]),
                                                  ckpt.read(ckpt.names[key])):
      raise ckpt.error(f"tied tensor {ckpt.names[alias]} differs from {ckpt.names[key]}, "
                 "which it repeats")
  return spec_lib.unflatten(flat)


def _hf_tensor(entries: list[tuple[str, convert.Source]], flat: Mapping[str, Any],
               shape: tuple[int, ...], leaf_fn: LeafFn | None) -> np.ndarray:
  leaf = (lambda path: flat[path]) if leaf_fn is None else lambda path: leaf_fn(path, flat[path])
  parts = {src.part: convert.leaf_to_hf(np.asarray(leaf(path), np.float32), src, shape)
           for path, src in entries}
  return convert.join_parts(parts, entries[0][1])


def save_params(path: str | os.PathLike, like: Checkpoint, model: Model, params: Mapping[str, Any],
                *, dtype: str = "keep", leaf_fn: LeafFn | None = None) -> None:
  """Writes ``params`` as a safetensors model folder laid out as ``like``: its tensor names and
  shards (a ``.bin`` shard's safetensors file is ``safetensors_name`` of it).

  With ``leaf_fn``, ``leaf_fn(path, leaf)`` is written for each leaf of
  ``params`` instead (its parameter path, e.g. "layers_0/attention/query/kernel"), computed
  right before its tensor: a model derived leaf by leaf, such as an
  interpolation with another model, is never held whole besides the file's
  tensors.

  Every tensor takes its stored dtype in ``like`` (``dtype="keep"``) or float32
  (``dtype="float32"``, which ``config.json`` then says too); buffers are copied
  from ``like`` and tied copies written as what they repeat. ``config.json`` is
  ``like``'s, and ``like``'s other small files (tokenizer, generation config:
  ``_SIDE_FILES``) are copied. The folder ``path`` must not exist yet.
  """
  if dtype not in ("keep", "float32"):
    raise ValueError(f"dtype must be 'keep' or 'float32', got {dtype!r}")
  model.check_params(params)
  table, aliases = convert.param_table(model.config)
  by_key, flat = _by_key(table), spec_lib.flatten(params)
  state_name = {file_key: name for name, file_key in like.names.items()}
  os.makedirs(path)
  total = 0
  for file, keys in like.files.items():
    tensors = {}
    for key in keys:
      name = state_name[key]
      source = aliases.get(name, name)
      if source in by_key:
        value = _hf_tensor(by_key[source], flat, like.tensors[key].shape, leaf_fn)
        target = DTYPES[like.tensors[key].dtype] if dtype == "keep" else np.dtype(np.float32)
        value = np.ascontiguousarray(value, dtype=target)
      else:
        value = like.read(key)
      tensors[key] = value
      total += value.nbytes
    save_file(tensors, os.path.join(path, safetensors_name(file)), metadata=like.metadata[file])
    del tensors
  if like.sharded:
    weight_map = {key: safetensors_name(like.tensors[key].file) for key in like.tensors}
    _write_json(os.path.join(path, INDEX), {"metadata": {"total_size": total},
                                            "weight_map": weight_map})
  hf_config = dict(like.hf_config)
  if dtype == "float32":
    hf_config.update({k: "float32" for k in ("dtype", "torch_dtype") if k in hf_config} or
                     {"dtype": "float32"})
  _write_json(os.path.join(path, CONFIG), hf_config)
  for file in sorted(os.listdir(like.path)):
    full = os.path.join(like.path, file)
    if (file.endswith(_SIDE_FILES) and file not in (CONFIG, INDEX, BIN_INDEX)
        and os.path.isfile(full)):
      shutil.copyfile(full, os.path.join(path, file))


def _write_json(path: str, value: Any) -> None:
  with open(path, "w", encoding="utf-8") as f:
    json.dump(value, f, indent=2, sort_keys=True)
    f.write("\n")
