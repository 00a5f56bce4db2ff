"""Bad model folders generated at volume (hypothesis): safetensors headers, index files and
torch.save zip pickles. Every case either reads, tensor by tensor, or is refused with the
project's one-line ValueError naming the folder; never another exception, and no file outside
the case's own folder changes. ``benchmarks/fuzz_folders.py`` runs the same cases long.

Each case is a tiny Mistral folder (``tests.test_streamed_alignment.write_mistral``) with one
part replaced by what a strategy draws."""

import io
import json
import os
import pickle
import struct
import tempfile
import zipfile

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest
from safetensors import safe_open

from attn_symmetry.models import Model
from attn_symmetry.models import safetensors_io
from tests.test_align_folders import _snapshot as snapshot
from tests.test_streamed_alignment import write_mistral

TINY = dict(hidden_size=16, intermediate_size=24, num_attention_heads=2, num_key_value_heads=1,
            head_dim=8, vocab_size=32)
SHARD = "model-00001-of-00001.safetensors"
CODES = ("F32", "F16", "BF16", "F64", "I64", "I8", "U8", "BOOL", "F8_E4M3", "C64", "XX", "")
# Index entries: plain and sibling names, escapes, absolute paths, other kinds of file.
ENTRIES = (SHARD, "model.safetensors", "missing.safetensors", "../outside/model.safetensors",
           "../../outside/model.safetensors", "/etc/passwd", "sub/" + SHARD, ".", "..", "",
           "config.json", ".safetensors", "a\\b.safetensors", "x\u0000.safetensors")
GLOBALS = (("collections", "OrderedDict"), ("torch._utils", "_rebuild_tensor_v2"),
           ("torch._utils", "_rebuild_parameter"), ("torch", "FloatStorage"),
           ("torch", "BFloat16Storage"), ("torch", "ComplexFloatStorage"), ("os", "system"),
           ("builtins", "eval"), ("builtins", "getattr"), ("torch", "Tensor"), ("", ""))


def base_folder(root: str) -> str:
  """A tiny Mistral folder under ``root`` (its tensors' names and bytes are the material the
  strategies rearrange)."""
  folder = os.path.join(root, "base")
  write_mistral(folder, 1, seed=0, **TINY)
  return folder


def tensors_of(folder):
  """{name: array} of ``folder``'s model.safetensors."""
  with safe_open(os.path.join(folder, "model.safetensors"), framework="numpy") as f:
    return {k: f.get_tensor(k) for k in f.keys()}


def read_folder(folder: str) -> str:
  """Reads ``folder`` as the align command does (``Checkpoint``, the layout against the zoo
  model, every parameter in float32): "read", or the one-line ValueError's "refused". Any
  other exception, or a message of more than one line, fails the caller."""
  try:
    ckpt = safetensors_io.Checkpoint(folder)
    model = Model(ckpt.config)
    safetensors_io.check_layout(ckpt, model)
    safetensors_io.load_params(ckpt, model)
    return "read"
  except ValueError as e:
    assert str(e).isprintable(), repr(str(e))  # one line: no break of any kind
    assert str(e).startswith(folder) or str(e).startswith(os.path.basename(folder)), str(e)
    return "refused"


# ----------------------------------------------------------------------------- strategies


@st.composite
def headers(draw, tensors):
  """(header JSON bytes, the length the file's first 8 bytes claim, the payload): the base
  folder's own header and bytes with up to four changes drawn (a dtype, a shape, offsets, a
  tensor dropped, metadata, the JSON damaged, the claimed length, the payload cut)."""
  header, payload, offset = {}, b"", 0
  for name, x in tensors.items():
    raw = x.tobytes()
    header[name] = {"dtype": "BF16", "shape": list(x.shape),
                    "data_offsets": [offset, offset + len(raw)]}
    payload, offset = payload + raw, offset + len(raw)
  header["__metadata__"] = {"format": "pt"}
  claimed = None
  changes = draw(st.lists(st.sampled_from(["dtype", "shape", "offsets", "drop", "metadata",
                                           "json", "length", "payload"]), max_size=4))
  for change in changes:
    name = draw(st.sampled_from(sorted(tensors)))
    if change == "dtype" and name in header:
      header[name]["dtype"] = draw(st.sampled_from(CODES))
    elif change == "shape" and name in header:
      header[name]["shape"] = draw(st.lists(st.integers(-2, 40), max_size=3))
    elif change == "offsets" and name in header:
      header[name]["data_offsets"] = [o + draw(st.integers(-8, 8))
                                      for o in header[name]["data_offsets"]]
    elif change == "drop":
      header.pop(name, None)
    elif change == "metadata":
      header["__metadata__"] = draw(st.sampled_from([{"x": 1}, [], "pt", None, {"format": 3}]))
    elif change == "length":
      claimed = draw(st.sampled_from([0, 1, 2 ** 40, -1]))
    elif change == "payload":
      payload = payload[:draw(st.integers(0, len(payload)))]
  text = json.dumps(header).encode()
  text += b" " * (-len(text) % 8)
  if "json" in changes:  # damage the JSON itself
    cut = draw(st.integers(0, len(text)))
    text = text[:cut] + draw(st.binary(min_size=1, max_size=8)) + text[cut:]
  return text, len(text) if claimed is None else claimed, payload


def write_header_case(folder, case):
  text, claimed, payload = case
  with open(os.path.join(folder, "model.safetensors"), "wb") as f:
    f.write(struct.pack("<Q", claimed % 2 ** 64) + text + payload)


@st.composite
def indexes(draw, tensors):
  """The raw text of a model.safetensors.index.json for a folder whose tensors lie in SHARD."""
  names = sorted(tensors)
  kind = draw(st.sampled_from(["valid", "map", "map", "map", "duplicate keys", "not a map",
                               "no map"]))
  entry = st.one_of(st.sampled_from(ENTRIES), st.text(max_size=12), st.integers(),
                    st.none(), st.lists(st.sampled_from(ENTRIES), max_size=2))
  keys = st.one_of(st.sampled_from(names), st.text(max_size=8))
  weight_map = draw(st.dictionaries(keys, entry, max_size=len(names) + 2))
  if draw(st.booleans()):  # most tensors where they are
    weight_map = {n: SHARD for n in names} | weight_map
  if kind == "duplicate keys" and weight_map:
    first = json.dumps(next(iter(weight_map)))
    body = ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in weight_map.items())
    return f'{{"weight_map": {{{body}, {first}: "other.safetensors"}}}}'
  if kind == "valid":  # every tensor where it is, the metadata drawn
    return json.dumps({"metadata": draw(st.sampled_from([{}, {"total_size": -1}, [], None])),
                       "weight_map": {n: SHARD for n in names}})
  if kind == "not a map":
    return json.dumps({"weight_map": draw(st.sampled_from([[], "x", 3, None]))})
  if kind == "no map":
    return json.dumps(draw(st.sampled_from([{}, [], {"metadata": {}}])))
  return json.dumps({"metadata": {"total_size": 1}, "weight_map": weight_map})


def write_index_case(folder, text):
  os.replace(os.path.join(folder, "model.safetensors"), os.path.join(folder, SHARD))
  os.makedirs(os.path.join(folder, "sub"))
  with open(os.path.join(folder, SHARD), "rb") as src, \
       open(os.path.join(folder, "sub", SHARD), "wb") as dst:
    dst.write(src.read())
  with open(os.path.join(folder, safetensors_io.INDEX), "w") as f:
    f.write(text)


class _Global:
  """A pickled reference to ``module.name`` (GLOBAL), called with ``args`` (then REDUCE)
  unless they are None."""

  def __init__(self, module, name, args):
    self.module, self.name, self.args = module, name, args


class _Persistent:
  """A persistent id (torch's storages: ("storage", class, key, device, numel))."""

  def __init__(self, *pid):
    self.pid = pid


def _pickle(tree) -> bytes:
  """Protocol-2 pickle bytes of ``tree``: ``_Global`` nodes as a GLOBAL (and a call),
  ``_Persistent`` ones as persistent ids, the rest as pickle writes it."""
  out = io.BytesIO()

  def write(node):
    if isinstance(node, _Global):
      out.write(b"c" + f"{node.module}\n{node.name}\n".encode())
      if node.args is not None:
        write(tuple(node.args))
        out.write(b"R")
    elif isinstance(node, _Persistent):
      write(node.pid)
      out.write(b"Q")  # BINPERSID: the tuple above as a persistent id
    elif isinstance(node, dict):
      out.write(b"}(")
      for k, v in node.items():
        write(k)
        write(v)
      out.write(b"u")
    elif isinstance(node, tuple):
      out.write(b"(")
      for v in node:
        write(v)
      out.write(b"t")
    else:
      out.write(pickle.dumps(node, protocol=2)[2:-1])
  out.write(b"\x80\x02")
  write(tree)
  out.write(b".")
  return out.getvalue()


@st.composite
def zip_pickles(draw, tensors):
  """(data.pkl bytes, storages {key: bytes}, byteorder or None, archive prefix): the base
  folder's tensors as torch.save lays them out (float32 storages, one per tensor), with up to
  four changes drawn (a storage class or other global, an offset, shape or stride, a storage's
  device or bytes, a tensor dropped, the pickle's bytes, the byteorder, the archive's folder)."""
  names = sorted(tensors)
  entries = {}
  for key, name in enumerate(names):
    x = tensors[name]
    stride = tuple(int(np.prod(x.shape[i + 1:])) for i in range(x.ndim))
    entries[name] = [("torch", "FloatStorage"), str(key), "cpu", x.size, 0, x.shape, stride]
  storages = {str(k): tensors[n].astype(np.float32).tobytes() for k, n in enumerate(names)}
  wrapper, byteorder, prefix = ("torch._utils", "_rebuild_tensor_v2"), "little", "archive/"
  flips = 0
  ints = st.integers(-3, 64)
  for change in draw(st.lists(st.sampled_from(["global", "storage class", "offset", "shape",
                                               "stride", "device", "bytes", "drop", "flip",
                                               "byteorder", "prefix", "numel"]), max_size=4)):
    name = draw(st.sampled_from(names))
    entry = entries.get(name)
    if change == "global":
      wrapper = draw(st.sampled_from(GLOBALS))
    elif change == "storage class" and entry:
      entry[0] = draw(st.sampled_from(GLOBALS))
    elif change == "offset" and entry:
      entry[4] = draw(ints)
    elif change == "shape" and entry:
      entry[5] = tuple(draw(st.lists(ints, max_size=3)))
    elif change == "stride" and entry:
      entry[6] = tuple(draw(st.lists(ints, max_size=3)))
    elif change == "numel" and entry:
      entry[3] = draw(ints)
    elif change == "device" and entry:
      entry[2] = "meta"
    elif change == "bytes" and entry:
      storages[entry[1]] = draw(st.binary(max_size=64))
    elif change == "drop":
      entries.pop(name, None)
    elif change == "flip":
      flips += 1
    elif change == "byteorder":
      byteorder = draw(st.sampled_from([None, "big", "middle"]))
    elif change == "prefix":
      prefix = draw(st.sampled_from(["", "a/b/", "../"]))
  storage = lambda e: _Persistent("storage", _Global(*e[0], None), e[1], e[2], e[3])
  state = {name: _Global(*wrapper, (storage(e), e[4], e[5], e[6])) for name, e in entries.items()}
  data = bytearray(_pickle(state))
  for _ in range(flips):
    data[draw(st.integers(2, len(data) - 1))] = draw(st.integers(0, 255))
  return bytes(data), storages, byteorder, prefix


def write_zip_case(folder, case):
  data, storages, byteorder, prefix = case
  os.remove(os.path.join(folder, "model.safetensors"))
  with zipfile.ZipFile(os.path.join(folder, safetensors_io.BIN_WEIGHTS), "w") as zf:
    zf.writestr(prefix + "data.pkl", data)
    for key, raw in storages.items():
      zf.writestr(f"{prefix}data/{key}", raw)
    if byteorder is not None:
      zf.writestr(prefix + "byteorder", byteorder)


# ----------------------------------------------------------------------------- the property


def run_case(root: str, base: str, write, case) -> str:
  """Copies ``base`` to a new case folder under ``root`` beside an "outside" folder, applies
  ``write(folder, case)``, reads it (``read_folder``), and checks that nothing outside the
  case folder changed: "read" or "refused"."""
  with tempfile.TemporaryDirectory(dir=root) as tmp:
    folder = os.path.join(tmp, "case")
    os.makedirs(folder)
    for name in os.listdir(base):
      with open(os.path.join(base, name), "rb") as src, \
           open(os.path.join(folder, name), "wb") as dst:
        dst.write(src.read())
    outside = os.path.join(tmp, "outside")
    os.makedirs(outside)
    with open(os.path.join(base, "model.safetensors"), "rb") as src, \
         open(os.path.join(outside, "model.safetensors"), "wb") as dst:
      dst.write(src.read())
    before = snapshot(outside) | snapshot(base)
    write(folder, case)
    outcome = read_folder(folder)
    assert snapshot(outside) | snapshot(base) == before
    return outcome


STRATEGIES = {"header": (headers, write_header_case), "index": (indexes, write_index_case),
              "zip pickle": (zip_pickles, write_zip_case)}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
  root = str(tmp_path_factory.mktemp("fuzz"))
  folder = base_folder(root)
  return root, folder, tensors_of(folder)


@pytest.mark.parametrize("kind", sorted(STRATEGIES))
def test_a_generated_folder_reads_or_is_refused_in_one_line(kind, base):
  root, folder, tensors = base
  strategy, write = STRATEGIES[kind]
  outcomes = []

  @hypothesis.settings(max_examples=40, deadline=None, derandomize=True, database=None,
                       suppress_health_check=list(hypothesis.HealthCheck))
  @hypothesis.given(strategy(tensors))
  def check(case):
    outcomes.append(run_case(root, folder, write, case))

  check()
  assert {"read", "refused"} <= set(outcomes)  # the strategy reaches past the checks, and them


def test_the_untouched_base_folder_reads(base):
  root, folder, _ = base
  assert run_case(root, folder, lambda f, c: None, None) == "read"
