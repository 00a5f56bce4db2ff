"""PyTorch ``.bin`` checkpoints (``torch.save``'s zip format) read with numpy, never executing them.

    tensors = torch_pickle.read_index("pytorch_model.bin")   # name -> TensorRef; no data read
    w = tensors["bert.pooler.dense.weight"].read()            # numpy, its stored dtype

The format (``torch.save`` since torch 1.6) is a zip archive with one top folder
``<archive>/`` holding

* ``data.pkl``: a pickle of the state dict, in which each tensor is a call
  ``torch._utils._rebuild_tensor_v2(storage, offset, shape, stride, ...)``
  (``_rebuild_parameter(tensor, ...)`` around it for a ``nn.Parameter``) and each
  storage a persistent id ``("storage", torch.FloatStorage, key, device, numel)``;
* ``data/<key>``: the raw bytes of storage ``key`` (stored, not compressed);
* ``byteorder`` ("little" or "big"; absent in old files: little) and ``version``.

Element (i_0, ..., i_k) of a tensor is storage element
``offset + sum_j i_j * stride_j``: views (a transpose, a slice, tied weights
sharing one storage) read as torch reads them.

Safety. A pickle is a program: loading one with ``pickle.load`` can call any
function (``os.system``). ``data.pkl`` is read by an unpickler whose
``find_class`` knows only the names that a state dict uses (``_ALLOWED``:
``collections.OrderedDict``, the two rebuild functions, the typed storage
classes) and gives for them functions of this module that record where each
tensor lies; any other name is refused with a ValueError naming it
(``module.name``), before anything of the pickle runs. Storages are never read
while unpickling, so ``read_index`` reads the small ``data.pkl`` only and each
tensor is read on its own (``TensorRef.read``, the bytes it spans).

Not read, each with a one-line ValueError: the legacy format of torch < 1.6
(not a zip), TorchScript archives, tensors of other dtypes (complex,
quantized, float8) or on the meta device, and pickles holding anything but
a flat mapping of names to tensors.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import pickle
import sys
import zipfile
from collections import OrderedDict
from typing import Any

import ml_dtypes
import numpy as np

# torch's typed storage classes (as ``torch.save`` names them) -> the element dtype.
STORAGE_DTYPES = {
    "DoubleStorage": np.dtype(np.float64), "FloatStorage": np.dtype(np.float32),
    "HalfStorage": np.dtype(np.float16), "BFloat16Storage": np.dtype(ml_dtypes.bfloat16),
    "LongStorage": np.dtype(np.int64), "IntStorage": np.dtype(np.int32),
    "ShortStorage": np.dtype(np.int16), "CharStorage": np.dtype(np.int8),
    "ByteStorage": np.dtype(np.uint8), "BoolStorage": np.dtype(np.bool_),
}


@dataclasses.dataclass(frozen=True)
class _StorageType:
  """A storage class named in the pickle (``torch.FloatStorage``, ...)."""
  name: str

  @property
  def dtype(self) -> np.dtype:
    return STORAGE_DTYPES[self.name]


@dataclasses.dataclass(frozen=True)
class _Storage:
  """A persistent id of the pickle: storage ``key`` of the archive, ``numel`` elements."""
  key: str
  dtype: np.dtype
  numel: int


@dataclasses.dataclass(frozen=True)
class TensorRef:
  """Where a tensor lies in a ``.bin`` file; ``read`` reads it.

  Attributes:
    path: the ``.bin`` file.
    member: the zip member of its storage (``<archive>/data/<key>``).
    dtype: the numpy element dtype (bfloat16 as ``ml_dtypes.bfloat16``).
    shape, stride: in elements, as torch's ``size()`` and ``stride()``.
    offset: the storage offset of element (0, ..., 0), in elements.
    byteorder: "little" or "big", the archive's.
  """
  path: str
  member: str
  dtype: np.dtype
  shape: tuple[int, ...]
  stride: tuple[int, ...]
  offset: int
  byteorder: str = "little"

  @property
  def span(self) -> int:
    """Storage elements from ``offset`` to the tensor's last element, inclusive (0 if empty)."""
    if math.prod(self.shape) == 0:
      return 0
    return 1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride))

  def read(self, archive: zipfile.ZipFile | None = None) -> np.ndarray:
    """The tensor as a C-contiguous array of ``dtype`` (native byte order).

    Reads only the bytes from ``offset`` to the last element. ``archive``: the
    file already open as a zip (else it is opened for this tensor alone).
    """
    if archive is None:
      with zipfile.ZipFile(self.path) as zf:
        return self.read(zf)
    item = self.dtype.itemsize
    with archive.open(self.member) as f:
      f.seek(self.offset * item)
      raw = f.read(self.span * item)
    if len(raw) != self.span * item:  # as_strided must never reach past the bytes read
      raise ValueError(f"{os.path.basename(self.path)}: {self.member} is shorter than its tensor")
    flat = np.frombuffer(raw, self.dtype)
    strides = tuple(s * item for s in self.stride)
    out = np.array(np.lib.stride_tricks.as_strided(flat, self.shape, strides, writeable=False),
                   order="C")
    return out if self.byteorder == sys.byteorder else out.byteswap()


def _rebuild_tensor_v2(storage: Any, offset: Any, shape: Any, stride: Any, *_: Any) -> dict:
  """``torch._utils._rebuild_tensor_v2``'s stand-in: the tensor's place (requires_grad, hooks
  and metadata are dropped)."""
  return {"storage": storage, "offset": offset, "shape": shape, "stride": stride}


def _rebuild_parameter(tensor: Any, *_: Any) -> Any:
  """``torch._utils._rebuild_parameter``'s stand-in: the tensor itself."""
  return tensor


# module -> name -> what ``find_class`` returns for it. Nothing else is ever looked up.
_ALLOWED = {
    "collections": {"OrderedDict": OrderedDict},
    "torch._utils": {"_rebuild_tensor_v2": _rebuild_tensor_v2,
                     "_rebuild_parameter": _rebuild_parameter},
    "torch": {name: _StorageType(name) for name in STORAGE_DTYPES},
}


class _Unpickler(pickle.Unpickler):
  """Unpickles a state dict's ``data.pkl`` into dicts (``_rebuild_tensor_v2``) and ``_Storage``s,
  calling nothing but ``_ALLOWED``."""

  def find_class(self, module: str, name: str) -> Any:
    found = _ALLOWED.get(module, {}).get(name)
    if found is None:
      raise pickle.UnpicklingError(f"refused to load {module}.{name}: a state dict holds only "
                                   "tensors (the pickle could run code)")
    return found

  def persistent_load(self, pid: Any) -> _Storage:
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
      raise pickle.UnpicklingError(f"unknown persistent id {str(pid)[:80]}")
    _, kind, key, device, numel = pid
    if not isinstance(kind, _StorageType) or not isinstance(key, str) or not isinstance(numel, int):
      raise pickle.UnpicklingError(f"malformed storage id {str(pid)[:80]}")
    if str(device).startswith("meta"):
      raise pickle.UnpicklingError(f"storage {key} is on the meta device (it holds no data)")
    return _Storage(key, kind.dtype, numel)


def _archive_prefix(zf: zipfile.ZipFile, where: str) -> str:
  """The archive's top folder with its slash (``"archive/"``)."""
  if any(n.endswith("/constants.pkl") for n in zf.namelist()):
    raise ValueError(f"{where} is not a torch.save state dict (a TorchScript archive)")
  pickles = [n for n in zf.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
  if len(pickles) != 1:
    raise ValueError(f"{where} is not a torch.save state dict (no <archive>/data.pkl)")
  return pickles[0][:-len("data.pkl")]


def _tensor_ref(path: str, prefix: str, byteorder: str, members: dict[str, int], name: str,
                value: Any, where: str) -> TensorRef:
  """The place of tensor ``name`` (``value``: what ``_rebuild_tensor_v2`` gave), checked to lie
  inside its storage and its storage's zip member (``members``: name -> bytes)."""
  if not (isinstance(value, dict) and isinstance(value.get("storage"), _Storage)):
    raise ValueError(f"{where}: {name} holds a {type(value).__name__}, not a tensor")
  storage = value["storage"]
  shape, stride, offset = value["shape"], value["stride"], value["offset"]
  if not (isinstance(shape, tuple) and isinstance(stride, tuple) and len(shape) == len(stride)
          and all(isinstance(v, int) and v >= 0 for v in (*shape, *stride, offset))):
    raise ValueError(f"{where}: tensor {name} has a malformed shape {shape}, stride {stride} or "
                     f"offset {offset}")
  ref = TensorRef(path, f"{prefix}data/{storage.key}", storage.dtype, shape, stride, offset,
                  byteorder)
  if ref.member not in members:
    raise ValueError(f"{where}: tensor {name}'s storage {ref.member} is missing")
  stored = min(storage.numel, members[ref.member] // storage.dtype.itemsize)
  if offset + ref.span > stored:
    raise ValueError(f"{where}: tensor {name} {shape} (offset {offset}, stride {stride}) runs past "
                     f"its storage of {stored} elements")
  return ref


def read_index(path: str | os.PathLike) -> dict[str, TensorRef]:
  """Name -> ``TensorRef`` of every tensor of the state dict in ``path``, in the pickle's order.

  Only ``data.pkl`` is read, through the restricted unpickler (module docstring).

  Raises:
    ValueError: (one line naming ``path``) not a zip-format ``torch.save``
      file; a refused global (``module.name``); an unknown storage type; a
      value that is not a tensor; a tensor that runs past its storage.
  """
  path = os.fspath(path)
  where = os.path.basename(path)
  if not zipfile.is_zipfile(path):
    raise ValueError(f"{where} is not a zip archive: the legacy torch.save format of torch < 1.6 "
                     "is not read; loading it with torch runs the pickle, which can run any "
                     "code, so only if you trust its source: torch.load(path, weights_only=True) "
                     "refuses what a state dict does not hold, then save it with torch >= 1.6 "
                     "or as safetensors")
  with zipfile.ZipFile(path) as zf:
    prefix = _archive_prefix(zf, where)
    members = {info.filename: info.file_size for info in zf.infolist()}
    byteorder = "little"
    if prefix + "byteorder" in members:
      byteorder = zf.read(prefix + "byteorder").decode("ascii", "replace").strip()
    if byteorder not in ("little", "big"):
      raise ValueError(f"{where}: unknown byteorder {byteorder!r}")
    try:
      state = _Unpickler(io.BytesIO(zf.read(prefix + "data.pkl"))).load()
    except Exception as e:  # pylint: disable=broad-except  # any malformed pickle
      raise ValueError(f"{where}: {prefix}data.pkl: {e}".splitlines()[0]) from None
  if not isinstance(state, dict):
    raise ValueError(f"{where} holds a {type(state).__name__}, not a state dict")
  out = {}
  for name, value in state.items():
    if not isinstance(name, str):
      raise ValueError(f"{where}: a state dict key is a {type(name).__name__}, not a name")
    out[name] = _tensor_ref(path, prefix, byteorder, members, name, value, where)
  return out


def load(path: str | os.PathLike) -> dict[str, np.ndarray]:
  """Every tensor of the state dict in ``path`` (``read_index``, then each read)."""
  refs = read_index(path)
  with zipfile.ZipFile(os.fspath(path)) as zf:
    return {name: ref.read(zf) for name, ref in refs.items()}
