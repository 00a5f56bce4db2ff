"""PyTorch ``.bin`` checkpoints read without torch (``models.torch_pickle``) and through
``safetensors_io.Checkpoint``: every tensor as ``torch.load`` gives it, a pickle that would run
code refused by name, and the same alignment from a ``.bin`` folder as from its safetensors twin.

transformers 5 saves safetensors only, so the ``.bin`` folders are written here as transformers 4
wrote them (``_save_bin``): ``torch.save`` of the state dict, tied weights included, sharded
with ``pytorch_model.bin.index.json``.
"""

import io
import json
import os
import pickle
import sys
import zipfile

import numpy as np
import pytest
from safetensors import safe_open

from attn_symmetry import spec as spec_lib
from attn_symmetry.models import convert
from attn_symmetry.models import safetensors_io
from attn_symmetry.models import torch_pickle

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48)


def _bert_pretraining(seed):
  """A tiny random BertForPreTraining (MultiBERTs' class), every parameter perturbed."""
  torch.manual_seed(seed)
  model = transformers.BertForPreTraining(transformers.BertConfig(
      **SMALL, vocab_size=64, max_position_embeddings=16)).eval()
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.2 * torch.randn_like(p))
  return model


def _gpt2(seed):
  torch.manual_seed(seed)
  return transformers.GPT2LMHeadModel(transformers.GPT2Config(
      n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=16, bos_token_id=0,
      eos_token_id=0)).eval()


def _save_bin(model, folder, shard_bytes=None):
  """``model``'s config.json and its state dict as ``pytorch_model.bin`` or, with
  ``shard_bytes``, as shards of about that size listed by ``pytorch_model.bin.index.json``."""
  model.config.save_pretrained(folder)
  state = model.state_dict()
  if shard_bytes is None:
    torch.save(state, os.path.join(folder, "pytorch_model.bin"))
    return folder
  shards, size = [{}], 0
  for key, value in state.items():
    if shards[-1] and size + value.nbytes > shard_bytes:
      shards.append({})
      size = 0
    shards[-1][key] = value
    size += value.nbytes
  weight_map = {}
  for i, shard in enumerate(shards):
    file = f"pytorch_model-{i + 1:05d}-of-{len(shards):05d}.bin"
    torch.save(shard, os.path.join(folder, file))
    weight_map |= {key: file for key in shard}
  with open(os.path.join(folder, "pytorch_model.bin.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": sum(v.nbytes for v in state.values())},
               "weight_map": weight_map}, f)
  return folder


def _as_numpy(tensor):
  """A torch tensor in numpy, bfloat16 as ``ml_dtypes.bfloat16`` (through its bits)."""
  import ml_dtypes  # pylint: disable=g-import-not-at-top

  tensor = tensor.detach().contiguous()
  if tensor.dtype == torch.bfloat16:
    return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
  return tensor.numpy()


def _assert_same_tensors(got, want):
  assert list(got) == list(want)
  for key, value in want.items():
    expected = _as_numpy(value)
    assert got[key].dtype == expected.dtype and got[key].shape == expected.shape, key
    np.testing.assert_array_equal(got[key], expected, err_msg=key)


# ----------------------------------------------------------------------------- the format


def test_tensors_equal_torch_load(tmp_path):
  """float32/16, bfloat16, integer and bool tensors; views with a storage offset, a transposed,
  a stepped and a broadcast (stride 0) stride; tied tensors on one storage; a Parameter and a
  scalar: each as torch.load gives it, and each reading only its own bytes."""
  base = torch.arange(60, dtype=torch.float32).reshape(6, 10) / 7
  state = {
      "float32": base,
      "transposed": base.t(),
      "offset": base[2:5, 3:],
      "stepped": base[1::2, ::3],
      "broadcast": torch.arange(3.0).expand(4, 3),
      "tied": base,
      "float16": (base / 3).half()[:, 1:4],
      "bfloat16": (base * 1e30).bfloat16().t(),
      "int64": torch.arange(-5, 7).reshape(3, 4)[1:],
      "bool": torch.tensor([True, False, True]),
      "parameter": torch.nn.Parameter(torch.linspace(-1, 1, 5)),
      "scalar": torch.tensor(2.5),
      "empty": torch.zeros(0, 3),
  }
  path = tmp_path / "state.bin"
  torch.save(state, path)
  _assert_same_tensors(torch_pickle.load(path), torch.load(path))
  refs = torch_pickle.read_index(path)
  assert refs["tied"].member == refs["float32"].member == refs["offset"].member
  assert (refs["offset"].offset, refs["offset"].stride) == (23, (10, 1))
  assert refs["offset"].span == 2 * 10 + 6 + 1  # from element [2, 3] to element [4, 9]
  assert refs["broadcast"].span == 3


def test_big_endian_archives_are_swapped(tmp_path):
  """An archive whose ``byteorder`` says big stores each element big-endian."""
  path = tmp_path / "state.bin"
  torch.save({"x": torch.tensor([1.5, -2.0, 3.25]), "y": torch.tensor([1, 256], dtype=torch.int64)},
             path)
  swapped = tmp_path / "big.bin"
  with zipfile.ZipFile(path) as src, zipfile.ZipFile(swapped, "w") as dst:
    for item in src.infolist():
      data = src.read(item)
      if item.filename.endswith("/byteorder"):
        data = b"big"
      elif "/data/" in item.filename:
        itemsize = 4 if item.filename.endswith("/0") else 8
        data = np.frombuffer(data, f"<u{itemsize}").astype(f">u{itemsize}").tobytes()
      dst.writestr(item, data)
  got = torch_pickle.load(swapped)
  np.testing.assert_array_equal(got["x"], [1.5, -2.0, 3.25])
  np.testing.assert_array_equal(got["y"], [1, 256])
  assert got["x"].dtype.isnative and got["y"].dtype == np.int64


class _System:
  """Unpickles as ``os.system(command)``: what a malicious checkpoint holds."""

  def __init__(self, command):
    self.command = command

  def __reduce__(self):
    return os.system, (self.command,)


def _zip_pickle(path, payload):
  """A zip laid out as torch.save's, whose data.pkl is ``payload`` pickled."""
  with zipfile.ZipFile(path, "w") as zf:
    zf.writestr("archive/data.pkl", pickle.dumps(payload, protocol=2))
    zf.writestr("archive/byteorder", "little")
    zf.writestr("archive/version", "3\n")
  return path


@pytest.mark.parametrize("where", ["top", "inside a state dict"])
def test_a_pickle_that_runs_code_is_refused(tmp_path, where):
  """``os.system`` is refused by name before it runs, at the top or as a state dict's value, by
  torch_pickle and by Checkpoint (one line naming the folder); the command never ran."""
  marker = tmp_path / "ran"
  evil = _System(f"touch {marker}")
  folder = tmp_path / "model"
  os.makedirs(folder)
  _bert_pretraining(0).config.save_pretrained(folder)
  payload = evil if where == "top" else {"bert.embeddings.word_embeddings.weight": evil}
  path = _zip_pickle(folder / "pytorch_model.bin", payload)
  with pytest.raises(ValueError) as refused:
    torch_pickle.read_index(path)
  message = str(refused.value)
  assert "\n" not in message and f"refused to load {os.system.__module__}.system" in message
  assert message.startswith("pytorch_model.bin: archive/data.pkl:")
  with pytest.raises(ValueError, match=rf"^{folder}: pytorch_model.bin: .*refused to load "
                                       rf"{os.system.__module__}\.system") as refused:
    safetensors_io.Checkpoint(folder)
  assert "\n" not in str(refused.value)
  assert not marker.exists()


def test_other_globals_are_refused(tmp_path):
  """Only a state dict's names are looked up: not builtins.eval, nor torch's other functions."""
  path = _zip_pickle(tmp_path / "eval.bin", {"x": eval})
  with pytest.raises(ValueError, match=r"refused to load __builtin__\.eval"):  # protocol 2
    torch_pickle.read_index(path)
  data = io.BytesIO()
  torch.save({"x": torch.zeros(2)}, data)
  text = zipfile.ZipFile(data).read("archive/data.pkl")
  assert b"torch._utils\n_rebuild_tensor_v2" in text  # protocol 2: GLOBAL 'module\nname'
  path = tmp_path / "load.bin"
  with zipfile.ZipFile(data) as src, zipfile.ZipFile(path, "w") as dst:
    for item in src.infolist():
      body = src.read(item)
      if item.filename.endswith("data.pkl"):
        body = body.replace(b"torch._utils\n_rebuild_tensor_v2", b"torch._utils\n_load_from_bytes")
      dst.writestr(item, body)
  with pytest.raises(ValueError, match=r"refused to load torch\._utils\._load_from_bytes"):
    torch_pickle.read_index(path)


def test_a_tensor_past_its_storage_is_refused(tmp_path):
  """A storage member cut short (or a pickle claiming more elements than it holds) is refused
  before any tensor is read: no view ever reaches past the bytes of its storage."""
  path = tmp_path / "state.bin"
  torch.save({"x": torch.zeros(4, 6)[1:, ::2]}, path)
  cut = tmp_path / "cut.bin"
  with zipfile.ZipFile(path) as src, zipfile.ZipFile(cut, "w") as dst:
    for item in src.infolist():
      data = src.read(item)
      dst.writestr(item, data[:-8] if item.filename.endswith("/data/0") else data)
  with pytest.raises(ValueError, match=r"^cut.bin: tensor x \(3, 3\) \(offset 6, stride \(6, 2\)\) "
                                       r"runs past its storage of 22 elements$"):
    torch_pickle.read_index(cut)


def test_legacy_and_non_state_dict_files_are_refused(tmp_path):
  legacy = tmp_path / "legacy.bin"
  torch.save({"x": torch.zeros(2)}, legacy, _use_new_zipfile_serialization=False)
  with pytest.raises(ValueError, match=r"^legacy.bin is not a zip archive: the legacy torch.save "
                                       r"format of torch < 1.6 is not read; loading it with torch "
                                       r"runs the pickle, which can run any code, so only if you "
                                       r"trust its source: torch.load\(path, weights_only=True\)"):
    torch_pickle.read_index(legacy)
  assert torch.load(legacy, weights_only=True)["x"].shape == (2,)  # the advice works
  listed = _zip_pickle(tmp_path / "list.bin", [1, 2])
  with pytest.raises(ValueError, match=r"^list.bin holds a list, not a state dict$"):
    torch_pickle.read_index(listed)
  numbers = _zip_pickle(tmp_path / "numbers.bin", {"step": 3})
  with pytest.raises(ValueError, match=r"^numbers.bin: step holds a int, not a tensor$"):
    torch_pickle.read_index(numbers)
  script = _zip_pickle(tmp_path / "script.bin", {})
  with zipfile.ZipFile(script, "a") as zf:
    zf.writestr("archive/constants.pkl", pickle.dumps(()))  # what torch.jit.save adds
  with pytest.raises(ValueError, match=r"^script.bin is not a torch.save state dict \(a "
                                       r"TorchScript archive\)$"):
    torch_pickle.read_index(script)
  with zipfile.ZipFile(tmp_path / "other.zip", "w") as zf:
    zf.writestr("readme.txt", "no pickle")
  with pytest.raises(ValueError, match=r"no <archive>/data.pkl"):
    torch_pickle.read_index(tmp_path / "other.zip")


# ----------------------------------------------------------------------------- model folders


def test_bert_pretraining_bin_folder(tmp_path):
  """A BertForPreTraining .bin (tied decoder weight and bias stored too, as in MultiBERTs):
  Checkpoint's headers and tensors as torch.load's; the zoo model of head "pretraining" computes
  transformers' MLM and next-sentence logits from it, and converts back to the same state dict."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from attn_symmetry.models import Model  # pylint: disable=g-import-not-at-top

  hf = _bert_pretraining(0)
  folder = _save_bin(hf, str(tmp_path / "bert"))
  want = torch.load(os.path.join(folder, "pytorch_model.bin"))
  assert "cls.predictions.decoder.weight" in want and "cls.seq_relationship.weight" in want
  ckpt = safetensors_io.Checkpoint(folder)
  assert ckpt.torch and not ckpt.sharded and ckpt.config.head == "pretraining"
  assert {k: (t.shape, t.dtype) for k, t in ckpt.tensors.items()} == {
      k: (tuple(v.shape), "F32") for k, v in want.items()}
  _assert_same_tensors({k: ckpt.read(k) for k in ckpt.tensors}, want)

  model = Model(ckpt.config)
  params = safetensors_io.load_params(ckpt, model)
  tokens = np.random.default_rng(0).integers(0, 64, (2, 7))
  segments = np.tile([0, 0, 0, 1, 1, 1, 1], (2, 1))
  with torch.no_grad():
    out = hf(torch.from_numpy(tokens), token_type_ids=torch.from_numpy(segments))
  logits, inter = model.apply(params, jnp.asarray(tokens), segments=jnp.asarray(segments))
  np.testing.assert_allclose(logits, out.prediction_logits.numpy(), atol=1e-5, rtol=0)
  np.testing.assert_allclose(inter["nsp_logits"], out.seq_relationship_logits.numpy(), atol=1e-5,
                             rtol=0)
  back = convert.to_hf(model, params).state_dict()  # a BertForPreTraining again
  assert set(back) == set(want)
  for key, value in want.items():
    torch.testing.assert_close(back[key], value, rtol=0, atol=0)


def test_sharded_bin_folder_reads_and_saves_as_safetensors(tmp_path):
  """A GPT-2 in .bin shards (and one in bfloat16): the same parameters as its safetensors
  folder, and save_params writes safetensors shards of the same tensors, named
  model-0000i-of-0000n.safetensors, with their index; transformers loads them."""
  from attn_symmetry.models import Model  # pylint: disable=g-import-not-at-top

  hf = _gpt2(0)
  st = str(tmp_path / "st")
  hf.save_pretrained(st)
  folder = _save_bin(hf, str(tmp_path / "bin"), shard_bytes=40_000)
  ckpt, twin = safetensors_io.Checkpoint(folder), safetensors_io.Checkpoint(st)
  bins = sorted(f for f in os.listdir(folder) if f.endswith(".bin"))
  n = len(bins)
  assert ckpt.sharded and ckpt.index == "pytorch_model.bin.index.json" and n > 1
  assert list(ckpt.files) == bins == [f"pytorch_model-{i:05d}-of-{n:05d}.bin"
                                      for i in range(1, n + 1)]
  want = {}
  for file in bins:
    want |= torch.load(os.path.join(folder, file))
  _assert_same_tensors({k: ckpt.read(k) for k in ckpt.tensors}, want)
  model = Model(ckpt.config)
  assert ckpt.config == twin.config
  params = safetensors_io.load_params(ckpt, model)
  flat = spec_lib.flatten(params)
  for path, leaf in spec_lib.flatten(safetensors_io.load_params(twin, model)).items():
    np.testing.assert_array_equal(flat[path], leaf)

  out = str(tmp_path / "out")
  safetensors_io.save_params(out, ckpt, model, params)
  written = sorted(os.listdir(out))
  assert written == ["config.json", *(f"model-{i:05d}-of-{n:05d}.safetensors"
                                      for i in range(1, n + 1)), "model.safetensors.index.json"]
  index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
  assert index["weight_map"] == {k: safetensors_io.output_files(ckpt)[t.file]
                                 for k, t in ckpt.tensors.items()}
  for file in written[1:-1]:
    with safe_open(os.path.join(out, file), framework="numpy") as f:
      assert f.metadata() == {"format": "pt"}
      for k in f.keys():
        assert index["weight_map"][k] == file
        np.testing.assert_array_equal(f.get_tensor(k), _as_numpy(want[k]))
  loaded = transformers.GPT2LMHeadModel.from_pretrained(out)
  for k, v in loaded.state_dict().items():
    torch.testing.assert_close(v, want[k], rtol=0, atol=0)

  half = _save_bin(hf.to(torch.bfloat16), str(tmp_path / "bf16"))
  ckpt = safetensors_io.Checkpoint(half)
  assert ckpt.dtypes == ["bfloat16"]
  params = safetensors_io.load_params(ckpt, model)
  wte = np.asarray(params["embed"]["embedding"])
  np.testing.assert_array_equal(wte, hf.transformer.wte.weight.float().detach().numpy())


def test_folder_without_weights_names_both_formats(tmp_path):
  folder = tmp_path / "empty"
  os.makedirs(folder)
  _gpt2(0).config.save_pretrained(folder)
  (folder / "tf_model.h5").write_bytes(b"")
  with pytest.raises(ValueError, match=r"no model.safetensors, model.safetensors.index.json, "
                                       r"pytorch_model.bin or pytorch_model.bin.index.json "
                                       r"\(tf_model.h5 not read\)$"):
    safetensors_io.Checkpoint(folder)


@pytest.mark.slow
def test_alignment_of_bin_folders_without_torch(tmp_path, monkeypatch):
  """MultiBERTs-like BertForPreTraining pairs: aligning the .bin folders (B sharded) in a process
  where torch and transformers cannot be imported gives the alignment of their safetensors twins;
  aligned_b is safetensors in B's tensor names and shards, and transformers computes B's MLM and
  next-sentence logits from it (its pooler moved with the residual stream)."""
  from attn_symmetry import align  # pylint: disable=g-import-not-at-top

  hf_a, hf_b = _bert_pretraining(0), _bert_pretraining(1)
  bin_a = _save_bin(hf_a, str(tmp_path / "bin_a"))
  bin_b = _save_bin(hf_b, str(tmp_path / "bin_b"), shard_bytes=40_000)
  st_a, st_b = str(tmp_path / "st_a"), str(tmp_path / "st_b")
  hf_a.save_pretrained(st_a)
  hf_b.save_pretrained(st_b)
  with monkeypatch.context() as blocked:
    for name in ("torch", "transformers"):
      blocked.setitem(sys.modules, name, None)
    from_bin = align.align_checkpoints(bin_a, bin_b, out=tmp_path / "out_bin")
    from_st = align.align_checkpoints(st_a, st_b, out=tmp_path / "out_st")
  assert from_bin.report["distance"] == from_st.report["distance"]
  residual = np.asarray(from_bin.element["residual"])
  assert not np.array_equal(residual, np.arange(residual.size))  # the pooler's input moved
  np.testing.assert_array_equal(residual, from_st.element["residual"])

  aligned = str(tmp_path / "out_bin" / "aligned_b")
  files = sorted(f for f in os.listdir(aligned) if f.endswith(".safetensors"))
  bins = sorted(f for f in os.listdir(bin_b) if f.endswith(".bin"))
  assert files == [f"model-{i:05d}-of-{len(bins):05d}.safetensors"
                   for i in range(1, len(bins) + 1)] and len(files) > 1
  assert not any(f.endswith(".bin") or f.startswith("pytorch_model") for f in os.listdir(aligned))
  tensors = {}
  for file in files:
    with safe_open(os.path.join(aligned, file), framework="numpy") as f:
      tensors |= {k: f.get_tensor(k) for k in f.keys()}
  stored = {}
  for file in os.listdir(bin_b):
    if file.endswith(".bin"):
      stored |= {k: tuple(v.shape) for k, v in torch.load(os.path.join(bin_b, file)).items()}
  assert {k: v.shape for k, v in tensors.items()} == stored  # tied copies included
  tokens = torch.from_numpy(np.random.default_rng(0).integers(0, 64, (2, 7)))
  moved = transformers.BertForPreTraining.from_pretrained(aligned).eval()
  with torch.no_grad():
    want, got = hf_b(tokens), moved(tokens)
  torch.testing.assert_close(got.prediction_logits, want.prediction_logits, atol=1e-4, rtol=0)
  torch.testing.assert_close(got.seq_relationship_logits, want.seq_relationship_logits,
                             atol=1e-4, rtol=0)
