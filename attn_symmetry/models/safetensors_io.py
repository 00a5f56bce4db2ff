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
(``output_files``) with the same tensor names and shards.

A folder is read as the registered family whose Hugging Face mapping
(``Family.hf``, ``hf.HFMapping``) reads its ``config.json``'s ``model_type``:
the built-in ones, or one that a module registers (``attn-symmetry align
--import MODULE``).

Names. Files keep the tensor names of the checkpoint format on the Hub, which
can differ from the state dict of transformers' current classes, the names of
``convert.param_table``: ViT's ``vit.encoder.layer.{i}.attention.attention.query``
is ``vit.layers.{i}.attention.q_proj`` (the mapping's ``renames``), old BERT files
name LayerNorm parameters gamma and beta, and a base-model file (GPT-2 on the Hub)
has no ``transformer.`` prefix (nor has a bare BERT encoder, ``BertModel``, its
``bert.`` one: the mapping's ``prefix``). ``Checkpoint.names`` maps state-dict
names to the file's (``convert.state_dict_names``), and files are written under
the file's own names. Buffers that are
not parameters (GPT-2's ``attn.bias`` causal masks, ``position_ids``) are read
past and copied unchanged; tied copies (``lm_head.weight`` of a tied GPT-2)
must equal what they repeat and are written as it.

Every problem with a folder is a ValueError of one line that starts with the
folder's name and names the file, tensor or config field.

Side files. Every other file of the folder and its subfolders (the tokenizer, a
sentence-transformers model's ``modules.json`` and ``1_Pooling/config.json``,
the model card, ...) is copied byte for byte by the writers, but weights in
other formats (``pytorch_model.bin`` beside ``model.safetensors``, ``onnx/``'s
files: they would hold the weights as they were), a subfolder that is a link,
and hidden subfolders (``.git``, ``.cache``).

Paths. Every file read comes from its folder: an index entry must be the plain
name of a weight file inside the folder (no folder part, absolute path or
``..``), or the folder is refused before any tensor is read. A weight or side file
may be a symbolic link (a Hub cache's snapshot links to its blobs), and is read
through it; a subfolder that is a link is not entered. Writers create new files
and folders only, by names they compose (``output_files``; the side files keep
the names ``os.listdir`` gives), and never write through a symbolic link.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import re
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open

from attn_symmetry import spec as spec_lib
from attn_symmetry.models import convert
from attn_symmetry.models import torch_pickle
from attn_symmetry.models.hf import Source
from attn_symmetry.models.model import Model
from attn_symmetry.models.model import untie_head as untie_model

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
_BUFFERS = re.compile(r"(^|\.)(attn\.bias|attn\.masked_bias|position_ids|attention\.bias|"
                      r"attention\.masked_bias|rotary_emb\.inv_freq)$")
# Weights in the formats of other frameworks and tools (and their indexes, ``*.index.json``),
# which a writer does not copy: they would hold the weights as they were. ".xml": OpenVINO's graph,
# whose weights are its ".bin".
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx",
                    ".onnx_data", ".gguf", ".tflite", ".ot", ".npz", ".xml")
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
    side_files: the folder's other files, which a writer laid out as it copies unchanged
      (``_side_files``): paths relative to the folder, "1_Pooling/config.json".
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
    if model_type not in convert.model_types():
      raise self.error(f"unsupported HF model type {model_type!r} in {CONFIG}; supported: "
                       f"{', '.join(convert.model_types())}")
    self.index, self.torch = self._weights_kind()
    self.sharded = self.index is not None
    self.files = self._weight_files()
    self.tensors: dict[str, TensorInfo] = {}
    self.metadata: dict[str, dict[str, str] | None] = {}
    self._refs: dict[str, torch_pickle.TensorRef] = {}  # .bin tensors: where each lies
    self._copies: dict[str, str] = {}  # a tensor that ``untie_head`` added: the one it copies
    for file, keys in self.files.items():
      self._read_header(file, keys)
    self.names = convert.state_dict_names(self.tensors, convert.family_of(model_type).hf)
    self.side_files = self._side_files()
    try:
      self.config = convert.config_from_hf(self.hf_config,
                                           convert.head_of(model_type, set(self.names)))
    except ValueError as e:
      raise self.error(str(e))

  def __repr__(self) -> str:
    return f"Checkpoint({self.name!r}, {self.config.family}, {len(self.tensors)} tensors)"

  def error(self, message: str) -> ValueError:
    """The error to raise about this folder: one line that starts with its name (a character
    that would not print, such as a line break inside a name that a file holds, is written
    escaped: ``\\n``)."""
    text = f"{self.name}: {message}"
    return ValueError("".join(c if c.isprintable() else repr(c)[1:-1] for c in text))

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
      files.setdefault(self._weight_file_name(key, file), []).append(key)
    return files

  def _weight_file_name(self, key: str, file: Any) -> str:
    """``file``, the index's entry for tensor ``key``, if it is a plain file name of this folder
    with the weights' extension: no folder part, absolute path or ``..``, so that nothing
    outside the folder is read (or, by a writer laid out as this folder, written)."""
    suffix = ".bin" if self.torch else ".safetensors"
    if (not isinstance(file, str) or os.path.basename(file) != file or file in (".", "..")
        or "\\" in file or "\0" in file or not file.endswith(suffix) or file == suffix):
      raise self.error(f"{self.index} puts tensor {key!r} in {file!r}: an index entry must be "
                       f"the plain name of a {suffix} file inside the folder")
    return file

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
    unlisted = [k for k in present if keys is not None and k not in keys]
    if unlisted:
      raise self.error(f"{file} holds tensors that {self.index} does not list: "
                       f"{_listing(unlisted)}")
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

  @property
  def nbytes(self) -> int:
    return sum(t.nbytes for t in self.tensors.values())

  def _side_files(self, sub: str = "") -> list[str]:
    """The files under the folder (``sub``, a subfolder's relative path) that a writer laid out
    as it copies: every regular file (or link to one: a Hub cache's snapshot links to its blobs)
    but ``config.json`` and weights (``_is_weight_file``), in the folder and its subfolders,
    by the names ``os.listdir`` gives. A subfolder that is a link, or whose name starts with "."
    (``.git``, ``.cache``), is not entered.

    Raises:
      ValueError: a file that cannot be read, or a subfolder that cannot be listed (named).
    """
    try:
      names = sorted(os.listdir(os.path.join(self.path, sub)))
    except OSError as e:
      raise self.error(f"subfolder {sub} cannot be listed ({e.strerror}), and a copy of the "
                       "folder holds its files") from None
    out = []
    for name in names:
      relative = os.path.join(sub, name)
      full = os.path.join(self.path, relative)
      if os.path.isdir(full):
        if not os.path.islink(full) and not name.startswith("."):
          out += self._side_files(relative)
      elif os.path.isfile(full) and relative != CONFIG and not _is_weight_file(name):
        if not os.access(full, os.R_OK):
          raise self.error(f"{relative} cannot be read, and a copy of the folder holds it")
        out.append(relative)
    return out

  @property
  def files_read(self) -> list[str]:
    """The real path (symbolic links resolved: a Hub cache's snapshot links to its blobs) of
    every file that reading this folder and writing a copy of it reads."""
    names = [CONFIG, *([self.index] if self.index else []), *self.files, *self.side_files]
    return [os.path.realpath(os.path.join(self.path, name)) for name in names]

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
    key = self._copies.get(key, key)
    if self.torch:
      return self._refs[key].read()
    info = self.tensors[key]
    with safe_open(os.path.join(self.path, info.file), framework="numpy", backend="pread") as f:
      return f.get_tensor(key)


def untie_head(ckpt: Checkpoint) -> Checkpoint:
  """``ckpt`` seen with its tied output head untied (``models.untie_head``): the same folder,
  whose ``config.json`` says ``tie_word_embeddings: false`` and whose head (``lm_head.weight``
  for a decoder) is a tensor of its own, read as a copy of the token embedding where the files
  hold none; a ``FolderWriter`` laid out as it writes that head beside the embedding, in the
  embedding's file. A checkpoint whose head is not tied is returned as it is.

  Raises:
    ValueError: the stored tied copy differs from the embedding (``check_tied``), or the
      family's tied head cannot be untied (``models.untie_head``), named.
  """
  if not ckpt.config.tied_embeddings:
    return ckpt
  model = Model(ckpt.config)
  check_tied(ckpt, model)
  try:
    untied = untie_model(model)[0]
  except ValueError as e:
    raise ckpt.error(str(e)) from None
  head = convert.param_table(untied.config)[0]["head/kernel"].key
  embedding = convert.param_table(model.config)[1][head]
  out = copy.copy(ckpt)
  out.hf_config = dict(ckpt.hf_config, tie_word_embeddings=False)
  out.config = untied.config
  out.names, out.tensors = dict(ckpt.names), dict(ckpt.tensors)
  out.files = {file: list(keys) for file, keys in ckpt.files.items()}
  out._copies = dict(ckpt._copies)  # pylint: disable=protected-access
  if head not in out.names:
    source = ckpt.names[embedding]
    if head in out.tensors:
      raise ckpt.error(f"tensor {head} is stored under another name than the head's")
    out.tensors[head] = ckpt.tensors[source]
    out.files[ckpt.tensors[source].file].append(head)
    out.names[head] = head
    out._copies[head] = source  # pylint: disable=protected-access
  return out


def _is_weight_file(name: str) -> bool:
  """Whether the file ``name`` holds weights, or is an index of them (``_WEIGHT_SUFFIXES``)."""
  return name.removesuffix(".index.json").endswith(_WEIGHT_SUFFIXES)


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


def output_files(like: Checkpoint) -> dict[str, str]:
  """The safetensors file that a writer laid out as ``like`` writes for each of its weight
  files, by a name composed here, never taken from ``like``: ``model.safetensors``, or
  ``model-0000i-of-0000n.safetensors`` for the i-th of n shards in name order (the names that
  transformers gives shards, so that ``pytorch_model-00001-of-00002.bin`` becomes
  ``model-00001-of-00002.safetensors``)."""
  files = sorted(like.files)
  if not like.sharded:
    return {files[0]: WEIGHTS}
  return {file: f"model-{i:05d}-of-{len(files):05d}.safetensors"
          for i, file in enumerate(files, 1)}


def _create(path: str) -> int:
  """A file descriptor of ``path``, a new file opened for writing: refused (FileExistsError)
  where anything is there already, a symbolic link included."""
  return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)


def _by_key(table: Mapping[str, Source]) -> dict[str, list[tuple[str, Source]]]:
  out: dict[str, list[tuple[str, Source]]] = {}
  for path, src in table.items():
    out.setdefault(src.key, []).append((path, src))
  return out


def read_leaves(ckpt: Checkpoint, model: Model, paths: Iterable[str]) -> Iterator[tuple[str, np.ndarray]]:
  """(path, leaf) for the parameter ``paths`` of ``model``, in their stored dtype (bfloat16
  as ``ml_dtypes.bfloat16``), reading each stored tensor that holds one of them once.

  Raises:
    ValueError: a tensor holds NaN or Inf (named).
  """
  table, _ = convert.param_table(model.config)
  paths = set(paths)
  for key, entries in _by_key(table).items():
    entries = [(path, src) for path, src in entries if path in paths]
    if not entries:
      continue
    x = ckpt.read(ckpt.names[key])
    if not np.isfinite(x).all():
      raise ckpt.error(f"tensor {ckpt.names[key]} holds NaN or Inf")
    for path, src in entries:
      yield path, convert.leaf_from_hf(x, src, model.param_shapes[path])


def check_tied(ckpt: Checkpoint, model: Model) -> None:
  """ValueError unless every tied copy in ``ckpt`` equals the tensor it repeats."""
  _, aliases = convert.param_table(model.config)
  for alias, key in aliases.items():
    if alias in ckpt.names and not np.array_equal(ckpt.read(ckpt.names[alias]),
                                                  ckpt.read(ckpt.names[key])):
      raise ckpt.error(f"tied tensor {ckpt.names[alias]} differs from {ckpt.names[key]}, "
                 "which it repeats")


def load_params(ckpt: Checkpoint, model: Model) -> dict[str, Any]:
  """``model``'s float32 parameters from ``ckpt``, one stored tensor in memory at a time.

  Raises:
    ValueError: (``check_layout``) the tensors do not fit the config; a tensor
      holds NaN or Inf; a tied copy differs from what it repeats (each named).
  """
  check_layout(ckpt, model)
  flat = {path: jnp.asarray(np.asarray(leaf, np.float32))
          for path, leaf in read_leaves(ckpt, model, model.param_shapes)}
  check_tied(ckpt, model)
  return spec_lib.unflatten({p: flat[p] for p in model.param_shapes})


def _hf_tensor(entries: list[tuple[str, Source]], flat: Mapping[str, Any],
               shape: tuple[int, ...]) -> np.ndarray:
  parts = {src.part: convert.leaf_to_hf(np.asarray(flat[path], np.float32), src, shape)
           for path, src in entries}
  return convert.join_parts(parts, entries[0][1])


class FolderWriter:
  """A safetensors model folder laid out as ``like``, written tensor by tensor as its
  parameters come (``put``), so that a model derived group by group is never held whole.

  Every file's header is written first (its tensors' names, dtypes, shapes and offsets are
  known from ``like``); each tensor is written at its offset once all the leaves it holds
  have come. Tensor dtypes, buffers, tied copies, the index, ``config.json`` and side files as
  ``save_params`` describes; ``close`` checks that every tensor was written.
  """

  def __init__(self, path: str | os.PathLike, like: Checkpoint, model: Model, *,
               dtype: str = "keep"):
    if dtype not in ("keep", "float32"):
      raise ValueError(f"dtype must be 'keep' or 'float32', got {dtype!r}")
    self.path, self.like, self.model, self.dtype = os.fspath(path), like, model, dtype
    table, aliases = convert.param_table(model.config)
    self._by_key = _by_key(table)
    state_name = {file_key: name for name, file_key in like.names.items()}
    # file tensor name -> the state-dict name whose value it holds (a tied copy: what it repeats)
    self._source = {key: aliases.get(state_name[key], state_name[key]) for key in like.tensors}
    # state-dict name -> the parameter paths its tensor is made of, until it is written
    self._waiting = {source: {path for path, _ in entries} for source, entries in
                     self._by_key.items()}
    self._leaves: dict[str, Any] = {}
    self._names = output_files(like)
    os.makedirs(self.path)
    self._layout = {file: self._write_header(file, keys) for file, keys in like.files.items()}
    for key in like.tensors:
      if self._source[key] not in self._by_key:  # a buffer: copied as it is
        self._write(key, like.read(key))

  def _target(self, key: str) -> np.dtype:
    info = self.like.tensors[key]
    if self._source[key] not in self._by_key or self.dtype == "keep":
      return DTYPES.get(info.dtype) or _numpy_dtype(info.dtype)
    return np.dtype(np.float32)

  def _write_header(self, file: str, keys: list[str]) -> dict[str, int]:
    """Writes ``file``'s header; {tensor: its byte offset in the file}."""
    header: dict[str, Any] = {}
    if self.like.metadata[file] is not None:
      header["__metadata__"] = self.like.metadata[file]
    offset, starts = 0, {}
    for key in keys:
      shape = self.like.tensors[key].shape
      nbytes = math.prod(shape) * self._target(key).itemsize
      header[key] = {"dtype": _CODES[self._target(key)], "shape": list(shape),
                     "data_offsets": [offset, offset + nbytes]}
      starts[key], offset = offset, offset + nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(_create(os.path.join(self.path, self._names[file])), "wb") as f:
      f.write(len(text).to_bytes(8, "little") + text)
      f.truncate(8 + len(text) + offset)
    return {key: 8 + len(text) + start for key, start in starts.items()}

  def _write(self, key: str, value: np.ndarray) -> None:
    file = self.like.tensors[key].file
    value = np.ascontiguousarray(value, dtype=self._target(key))
    path = os.path.join(self.path, self._names[file])
    with open(os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0)), "r+b") as f:
      f.seek(self._layout[file][key])
      f.write(value.tobytes())
    self._layout[file].pop(key)

  def put(self, flat: Mapping[str, Any]) -> None:
    """Takes parameter leaves {path: value}; writes every tensor whose leaves have all come."""
    self._leaves.update(flat)
    for source, entries in self._by_key.items():
      if source in self._waiting and self._waiting[source] <= set(self._leaves):
        keys = [k for k, s in self._source.items() if s == source]
        value = _hf_tensor(entries, self._leaves, self.like.tensors[keys[0]].shape)
        for key in keys:
          self._write(key, value)
        for path, _ in entries:
          del self._leaves[path]
        del self._waiting[source]

  def close(self) -> None:
    """Writes the index, ``config.json`` and side files; ValueError if a tensor is missing."""
    left = sorted(k for layout in self._layout.values() for k in layout)
    if left:
      raise ValueError(f"{self.path}: tensors not written: {_listing(left)}")
    like = self.like
    if like.sharded:
      total = sum(math.prod(like.tensors[k].shape) * self._target(k).itemsize for k in like.tensors)
      weight_map = {key: self._names[like.tensors[key].file] for key in like.tensors}
      _write_json(os.path.join(self.path, INDEX), {"metadata": {"total_size": total},
                                                   "weight_map": weight_map})
    hf_config = dict(like.hf_config)
    if self.dtype == "float32":
      hf_config.update({k: "float32" for k in ("dtype", "torch_dtype") if k in hf_config} or
                       {"dtype": "float32"})
    _write_json(os.path.join(self.path, CONFIG), hf_config)
    for file in like.side_files:
      _copy_new(os.path.join(like.path, file), self.path, file)


def _copy_new(source: str, folder: str, relative: str) -> None:
  """Copies the file ``source`` to ``folder/relative`` byte for byte, as a new file in new
  subfolders (``relative``'s folder parts, made here): nothing is written through a link or
  over anything that is there already (FileExistsError)."""
  *parts, name = relative.split(os.sep)
  for part in parts:
    folder = os.path.join(folder, part)
    if os.path.islink(folder) or not os.path.isdir(folder):
      os.mkdir(folder)
  with open(source, "rb") as src, open(_create(os.path.join(folder, name)), "wb") as dst:
    shutil.copyfileobj(src, dst)


def _numpy_dtype(code: str) -> np.dtype:
  return next(d for d, c in _CODES.items() if c == code)


def save_params(path: str | os.PathLike, like: Checkpoint, model: Model, params: Mapping[str, Any],
                *, dtype: str = "keep", leaf_fn: LeafFn | None = None) -> None:
  """Writes ``params`` as a safetensors model folder laid out as ``like``: its tensor names and
  shards, in files named by ``output_files``.

  With ``leaf_fn``, ``leaf_fn(path, leaf)`` is written for each leaf of
  ``params`` instead (its parameter path, e.g. "layers_0/attention/query/kernel"), computed
  right before its tensor: a model derived leaf by leaf, such as an
  interpolation with another model, is never held whole besides one tensor.

  Every tensor takes its stored dtype in ``like`` (``dtype="keep"``) or float32
  (``dtype="float32"``, which ``config.json`` then says too); buffers are copied
  from ``like`` and tied copies written as what they repeat. ``config.json`` is
  ``like``'s, and ``like``'s other files (``Checkpoint.side_files``: the tokenizer, the
  generation config, a sentence-transformers model's ``modules.json`` and ``1_Pooling/``, ...)
  are copied byte for byte. The folder ``path`` must not exist yet. ``FolderWriter``
  writes the same folder from parameters that come group by group.
  """
  if dtype not in ("keep", "float32"):
    raise ValueError(f"dtype must be 'keep' or 'float32', got {dtype!r}")
  model.check_params(params)
  writer = FolderWriter(path, like, model, dtype=dtype)
  for entries in _by_key(convert.param_table(model.config)[0]).values():
    writer.put({p: leaf if leaf_fn is None else leaf_fn(p, leaf)
                for p, leaf in ((p, spec_lib.subtree(params, p)) for p, _ in entries)})
  writer.close()


def _write_json(path: str, value: Any) -> None:
  with open(_create(path), "w", encoding="utf-8") as f:
    json.dump(value, f, indent=2, sort_keys=True)
    f.write("\n")
