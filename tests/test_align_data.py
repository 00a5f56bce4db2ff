"""``attn-symmetry align`` with data: ``--match-data``, ``--method activation`` and ``--merge
LAMBDA --repair``, end to end on tiny GPT-2 and ViT checkpoints (saved with transformers, as
``test_align_checkpoints`` makes them).

A planted pair is B = g . A for g drawn from the whole group of the zoo model's spec
(``group_action.random_model_element``: heads, per-head matrices, FFN units and the residual
stream), written in A's layout; an independent pair is B drawn afresh (``Model.init``).
"""

import json
import os
import shutil
import types

import jax
import numpy as np
import pytest

from attn_symmetry import align
from attn_symmetry import group_action
from attn_symmetry import models
from attn_symmetry import repair
from attn_symmetry import spec as spec_lib
from attn_symmetry.align import _check, _eval_files
from attn_symmetry.models import safetensors_io
from tests.test_align_checkpoints import WORDS, _images, _read_folder, _save_model, _tokenizer

pytest.importorskip("transformers")
# float32 rounding of a planted pair recovered by activations (measured: 3e-6 of a tensor's
# largest entry on the GPT-2 pair).
RECOVERED = 2e-5


def _load(folder):
  """(model, float32 params) of the checkpoint folder ``folder``."""
  ckpt = safetensors_io.Checkpoint(folder, folder)
  model = models.Model(ckpt.config)
  return model, safetensors_io.load_params(ckpt, model)


def _write_b(folder_a, folder_b, make):
  """Writes ``make(model, A's params)`` to ``folder_b`` in A's layout (tokenizer included)."""
  model, params = _load(folder_a)
  like = safetensors_io.Checkpoint(folder_a, folder_a)
  safetensors_io.save_params(folder_b, like, model, make(model, params))
  return folder_b


def _planted(model, params):
  g = group_action.random_model_element(jax.random.key(3), model.spec)
  return group_action.apply_model(model.spec, params, g)


def _independent(model, params):
  return model.init(jax.random.key(5))


def _text(path, words):
  rng = np.random.default_rng(0)
  with open(path, "w", encoding="utf-8") as f:
    f.writelines(" ".join(rng.choice(WORDS, 12)) + "\n" for _ in range(words // 12))
  return str(path)


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
  """{"a", "planted", "independent": GPT-2 folders; "text": ~380 words (3 batches of 8 x 16
  tokens); "empty", "short": a text of blank lines, one of 20 words}."""
  root = tmp_path_factory.mktemp("gpt2")
  a = _save_model("gpt2", str(root / "a"))
  _tokenizer(a, WORDS)
  (root / "empty.txt").write_text("\n \n")
  return {"a": a, "planted": _write_b(a, str(root / "planted"), _planted),
          "independent": _write_b(a, str(root / "independent"), _independent),
          "text": _text(root / "text.txt", 384), "short": _text(root / "short.txt", 24),
          "empty": str(root / "empty.txt")}


def _run(capsys, *args):
  """``attn-symmetry align ARGS --quiet``, which must succeed: its report and summary lines."""
  capsys.readouterr()
  assert align.cli(["align", *args, "--quiet", "--compilation-cache", ""]) == 0
  out = args[args.index("--out") + 1]
  with open(os.path.join(out, "report.json"), encoding="utf-8") as f:
    return json.load(f), capsys.readouterr().out.splitlines()


def _refusal(capsys, *args):
  """The one line of ``attn-symmetry align ARGS``, which must refuse (exit status 2)."""
  capsys.readouterr()
  status = align.cli(["align", *args, "--quiet", "--compilation-cache", ""])
  lines = capsys.readouterr().err.strip().splitlines()
  assert status == 2 and len(lines) == 1, lines
  assert lines[0].startswith("attn-symmetry align: error: ")
  return lines[0].removeprefix("attn-symmetry align: error: ")


def _check_recovered(folder_a, folder):
  want, got = _read_folder(folder_a)[0], _read_folder(folder)[0]
  assert set(got) == set(want)
  for name, x in want.items():
    assert np.abs(got[name] - x).max() <= RECOVERED * np.abs(x).max(), name


def test_activation_method_recovers_a_planted_pair(gpt2, tmp_path, capsys):
  """Every factor of g (heads, their matrices, FFN units, the residual) from the activations on
  the text: aligned B is A tensor for tensor, to float32 rounding; the report records the
  method's options and the match data."""
  out = str(tmp_path / "out")
  report, lines = _run(capsys, gpt2["a"], gpt2["planted"], "--out", out, "--method",
                       "activation", "--match-data", gpt2["text"], "--match-batches", "2")
  _check_recovered(gpt2["a"], os.path.join(out, "aligned_b"))
  assert report["method"] == "activation"
  assert report["options"] == {"steps": 200, "residual": "permutation"}
  assert report["match_data"] == {"path": gpt2["text"], "batches": 2, "batch_shape": [8, 16]}
  assert report["repair"] is False and "merged" not in report
  assert report["function_check"]["aligned_b"]["relative"] <= 1e-5
  assert any(line.startswith("function check: aligned B's logits") for line in lines)


def test_repaired_merge_is_written_and_evaluated(gpt2, tmp_path, capsys):
  """An independent pair, merged at 1/2 and REPAIRed: DIR/merged is a checkpoint of A's
  architecture holding ``repair.repair`` of A and aligned B on the match batches; the report
  holds the repaired loss beside the plain merge's, A's and B's, and REPAIR's info per point
  without its arrays; the summary line reports the repaired merge."""
  out = str(tmp_path / "out")
  report, lines = _run(capsys, gpt2["a"], gpt2["independent"], "--out", out, "--method",
                       "naive", "--merge", "0.5", "--repair", "--match-data", gpt2["text"],
                       "--match-batches", "2", "--eval-text", gpt2["text"], "--lambdas", "3",
                       "--dtype", "float32")
  merged = report["merged"]
  assert merged["lambda"] == 0.5 and set(merged["repaired"]) == {"loss", "accuracy"}
  assert merged["repaired"]["loss"] != merged["loss"]
  assert set(merged["repair"]) == {f"layers_{i}/{p}" for i in range(2)
                                   for p in ("attention", "mlp")}
  for point in merged["repair"].values():
    assert set(point) == {"channels", "corrected", "degenerate", "shift_folded", "mean_gap",
                          "scale_gap"}
    assert point["shift_folded"] and point["corrected"] == point["channels"]
  assert report["repair"] is True
  assert f"REPAIRed merged model (lambda 0.5): loss {merged['repaired']['loss']:.4g} (plain " \
         f"merge {merged['loss']:.4g}, naive merge {merged['naive']['loss']:.4g}, A " \
         f"{merged['a']['loss']:.4g}, B {merged['b']['loss']:.4g})" in lines
  assert merged["naive"] == {k: merged[k] for k in ("loss", "accuracy")}  # naive: B' is B
  beat = "beat" if merged["repaired"]["loss"] < merged["naive"]["loss"] else "did not beat"
  assert any(line.startswith(f"the REPAIRed aligned merge {beat} the naive merge")
             for line in lines)
  model, params = _load(os.path.join(out, "merged"))
  assert model.config == _load(gpt2["a"])[0].config
  _, a = _load(gpt2["a"])
  _, b = _load(gpt2["independent"])  # naive: aligned B is B
  batches = _eval_files.match_batches(gpt2["text"], gpt2["a"], model, {}, batch_size=8,
                                      seq_len=128, max_batches=2)
  want, _ = repair.repair(model, a, b, 0.5, batches)
  got = spec_lib.flatten(params)
  for path, x in spec_lib.flatten(want).items():
    np.testing.assert_allclose(got[path], x, rtol=1e-5, atol=1e-6, err_msg=path)


def test_repair_at_lambda_0_is_a(gpt2, tmp_path, capsys):
  """``--merge 0 --repair``, without an evaluation: the merged model computes A's function
  (REPAIR moves A's own channels onto A's statistics: nothing), and the summary says what
  was corrected."""
  out = str(tmp_path / "out")
  report, lines = _run(capsys, gpt2["a"], gpt2["independent"], "--out", out, "--method",
                       "naive", "--merge", "0", "--repair", "--match-data", gpt2["text"],
                       "--match-batches", "1")
  assert "loss" not in report["merged"] and set(report["merged"]) == {"lambda", "repair"}
  assert any(line.startswith("REPAIRed merged model (lambda 0): 320 of 320 channels corrected")
             for line in lines)
  model, merged = _load(os.path.join(out, "merged"))
  _, a = _load(gpt2["a"])
  tokens = np.random.default_rng(1).integers(0, 64, (2, 16))
  want = model.apply(a, tokens)[0]
  np.testing.assert_allclose(model.apply(merged, tokens)[0], want, rtol=0,
                             atol=1e-5 * np.abs(want).max())


@pytest.mark.slow
def test_repair_with_the_orthogonal_residual_keeps_a_at_lambda_0(gpt2, tmp_path, capsys):
  """``--residual orthogonal --merge 0 --repair``: REPAIR reads the canonical, untied models
  that the O(d - 1) residual aligns (the writers' means projected out, the gains folded), and
  the merged model at lambda 0 still computes A's logits, written as an untied checkpoint."""
  out = str(tmp_path / "out")
  report, lines = _run(capsys, gpt2["a"], gpt2["independent"], "--out", out, "--method",
                       "perm", "--residual", "orthogonal", "--merge", "0", "--repair",
                       "--match-data", gpt2["text"], "--match-batches", "1")
  assert report["untied_head"] and report["repair"] is True
  assert set(report["merged"]) == {"lambda", "repair"}
  assert any(line.startswith("REPAIRed merged model (lambda 0):") for line in lines)
  model, merged = _load(os.path.join(out, "merged"))
  a_model, a = _load(gpt2["a"])
  assert not model.config.tied_embeddings and a_model.config.tied_embeddings
  tokens = np.random.default_rng(1).integers(0, 64, (2, 16))
  want = a_model.apply(a, tokens)[0]
  np.testing.assert_allclose(model.apply(merged, tokens)[0], want, rtol=0,
                             atol=1e-4 * np.abs(want).max())


def test_vit_matches_and_repairs_on_an_image_folder(tmp_path, capsys):
  """A planted ViT pair: the image folder's images, in whole batches of 3, recover A; the
  REPAIRed merge of A with itself is A's merge (every channel's statistics already the
  target)."""
  a = _save_model("vit", str(tmp_path / "a"))
  b = _write_b(a, str(tmp_path / "b"), _planted)
  images = str(_images(tmp_path / "images", count=7))
  out = str(tmp_path / "out")
  report, _ = _run(capsys, a, b, "--out", out, "--method", "activation", "--match-data", images,
                   "--batch-size", "3", "--merge", "0.5", "--repair")
  _check_recovered(a, os.path.join(out, "aligned_b"))
  assert report["match_data"]["batches"] == 2  # the 7th image makes no whole batch
  assert report["match_data"]["batch_shape"] == [3, 8, 8, 3]
  _check_recovered(a, os.path.join(out, "merged"))


def test_bad_match_data_is_refused_in_one_line_naming_the_file(gpt2, tmp_path, capsys):
  """Missing, empty and too short for one batch: one line naming the file, before any work
  (nothing written)."""
  out = str(tmp_path / "out")
  pair = (gpt2["a"], gpt2["planted"], "--out", out, "--method", "activation", "--match-data")
  missing = str(tmp_path / "missing.txt")
  assert _refusal(capsys, *pair, missing) == f"--match-data {missing}: no such file"
  assert _refusal(capsys, *pair, gpt2["empty"]) == f"--match-data {gpt2['empty']}: no text"
  assert _refusal(capsys, *pair, gpt2["short"]) == (
      f"--match-data {gpt2['short']}: 1 of the 8 sequences of 16 tokens that one batch needs "
      "(--batch-size)")
  folder = str(tmp_path / "no_images")
  os.makedirs(os.path.join(folder, "0"))
  assert _refusal(capsys, *pair, folder) == f"--match-data {folder}: no such file"
  assert not os.path.exists(out)


def test_bad_match_images_are_refused_in_one_line(tmp_path, capsys):
  a = _save_model("vit", str(tmp_path / "a"))
  b = _write_b(a, str(tmp_path / "b"), _planted)
  pair = (a, b, "--out", str(tmp_path / "out"), "--method", "activation", "--match-data")
  missing, empty = str(tmp_path / "missing"), str(tmp_path / "empty")
  os.makedirs(os.path.join(empty, "0"))
  images = str(_images(tmp_path / "images", count=2))
  assert _refusal(capsys, *pair, missing) == f"--match-data {missing}: no such folder"
  assert _refusal(capsys, *pair, empty) == (
      f"--match-data {empty}: no images in label folders ({empty}/LABEL/*.png)")
  assert _refusal(capsys, *pair, images) == (
      f"--match-data {images}: 2 of the 8 images that one batch needs (--batch-size)")


@pytest.mark.parametrize("args, message", [
    (("--method", "activation"),
     "--method activation reads the models' activations on data: give --match-data FILE"),
    (("--method", "learned", "--learn-init", "activation", "--eval-text", "T"),
     "--method learned with --learn-init activation reads the models' activations on data: "
     "give --match-data FILE"),
    (("--repair", "--match-data", "T"),
     "--repair repairs the merged model: give --merge LAMBDA"),
    (("--repair", "--merge", "0.5"),
     "--repair resets the merged model's channel statistics measured on data: give "
     "--match-data FILE"),
    (("--match-data", "T"),
     "--match-data is read by --method learned, --method activation and --repair only; "
     "--method is 'full' without --repair"),
    (("--method", "activation", "--match-data", "T", "--match-batches", "0"),
     "--match-batches must be an integer >= 1, got 0"),
], ids=repr)
def test_bad_data_options_are_refused_in_one_line(gpt2, tmp_path, capsys, args, message):
  args = [gpt2["text"] if x == "T" else x for x in args]
  out = str(tmp_path / "out")
  assert _refusal(capsys, gpt2["a"], gpt2["planted"], "--out", out, *args) == message


@pytest.mark.parametrize("args, why", [
    (("--method", "full", "--merge", "0.5", "--repair", "--match-data", "T"), "--repair"),
    (("--method", "activation", "--match-data", "T", "--eval-text", "T"), "the evaluation"),
], ids=repr)
def test_whole_models_over_the_budget_are_refused_saying_why(gpt2, tmp_path, capsys, args, why):
  """REPAIR and an evaluation hold both whole models (``_memory.streams``): over the budget,
  one line says which of them does, before any work."""
  args = [gpt2["text"] if x == "T" else x for x in args]
  line = _refusal(capsys, gpt2["a"], gpt2["planted"], "--out", str(tmp_path / "out"),
                  "--memory-budget", "0.0001", *args)
  assert line.startswith(f"{why} holds both whole models in float32, read and aligned: "), line


def test_a_family_with_nothing_to_fold_is_refused_naming_it():
  """REPAIR's own check of the family, run by the check stage before any work."""
  toy = types.SimpleNamespace(config=types.SimpleNamespace(family="toy", depth=1),
                              spec=types.SimpleNamespace(attention={}, writers={}))
  with pytest.raises(ValueError, match=r"^REPAIR cannot fold into family 'toy': its spec names "
                                       r"no projection to take the 'attention' point's"):
    _check._check_repair(toy)


def test_bert_match_data_is_one_sequence_per_line_with_its_mask(tmp_path):
  """A BERT reads each line as one sequence (cut to --seq-len, its real tokens masked in), in
  whole batches keyed by the model's input key, as ``Model.batch_activations`` reads them."""
  _tokenizer(str(tmp_path), WORDS)
  text = tmp_path / "lines.txt"
  text.write_text("the cat sat\n\nthe dog ran far away while birds sang\na mat\n")
  model = models.build("bert")
  batches = _eval_files.match_batches(str(text), str(tmp_path), model, {}, batch_size=2,
                                      seq_len=5, max_batches=8)
  assert len(batches) == 1 and set(batches[0]) == {model.input_key, "mask"}
  np.testing.assert_array_equal(batches[0]["mask"], [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
  assert batches[0][model.input_key].shape == (2, 5)
  assert model.batch_activations(model.init(jax.random.key(0)), batches[0])


def test_bert_classifier_match_data_drops_the_label_column(tmp_path):
  """An evaluation file (LABEL<TAB>text) serves a classifier as match data: the labels are not
  read as text, and lines without a label are read as they are."""
  _tokenizer(str(tmp_path), WORDS)
  model = models.build("bert")
  read = []
  for name, text in (("labelled.txt", "0\tthe cat sat\n1\ta mat\n"),
                     ("plain.txt", "the cat sat\na mat\n")):
    (tmp_path / name).write_text(text)
    read.append(_eval_files.match_batches(str(tmp_path / name), str(tmp_path), model, {},
                                          batch_size=2, seq_len=5, max_batches=1)[0])
  for key in (model.input_key, "mask"):
    np.testing.assert_array_equal(read[0][key], read[1][key])


@pytest.mark.slow
def test_learned_trains_on_match_data_and_is_judged_on_the_evaluation_file(gpt2, tmp_path,
                                                                           capsys):
  """--method learned with --match-data TRAIN --eval-text HELDOUT: its steps read TRAIN's
  batches but the last, on which it picks its iterate; the curve is HELDOUT's. The lambda band
  draws with the key of --seed; report.json names both files and the seed."""
  out = str(tmp_path / "out")
  heldout = _text(tmp_path / "heldout.txt", 192)
  report, lines = _run(capsys, gpt2["a"], gpt2["independent"], "--out", out, "--method",
                       "learned", "--match-data", gpt2["text"], "--eval-text", heldout,
                       "--learn-lam-band", "10", "--seed", "3", "--learn-steps", "4")
  assert report["seed"] == 3 and report["options"]["learn_lam_band"] == 10
  assert report["learned"]["steps"] == 4 and report["learned"]["lambda_band"] == pytest.approx(0.1)
  assert report["match_data"]["path"] == gpt2["text"] and report["eval"]["text"] == heldout
  assert report["eval"]["training_data"] == gpt2["text"]
  assert [report["eval"][k] for k in ("training_batches", "holdout_batches")] == [2, 1]
  assert any(line.startswith("loss barrier:") for line in lines)


def _tokenizer_variant(gpt2, tmp_path, name, change):
  """A copy of the planted folder whose tokenizer.json is rewritten by ``change`` (of its
  parsed JSON), indented otherwise than A's."""
  folder = tmp_path / name
  shutil.copytree(gpt2["planted"], folder)
  path = folder / "tokenizer.json"
  tokenizer = json.loads(path.read_text(encoding="utf-8"))
  change(tokenizer)
  path.write_text(json.dumps(tokenizer, indent=7, sort_keys=True), encoding="utf-8")
  return str(folder)


def test_tokenizers_are_compared_by_what_they_do(gpt2, tmp_path, capsys):
  """A tokenizer.json re-indented, its keys re-ordered, its merges written as pairs: accepted.
  A changed vocabulary: refused, naming the part that differs."""
  def as_pairs(tokenizer):
    if "merges" in tokenizer["model"]:  # a BPE model's; this word-level one has none
      tokenizer["model"]["merges"] = [m.split(" ", 1) if isinstance(m, str) else m
                                      for m in tokenizer["model"]["merges"]]

  same = _tokenizer_variant(gpt2, tmp_path, "same", as_pairs)
  _run(capsys, gpt2["a"], same, "--out", str(tmp_path / "out"), "--eval-text", gpt2["text"])

  def new_word(tokenizer):
    vocab = tokenizer["model"]["vocab"]
    vocab[next(iter(vocab))] = max(vocab.values()) + 1

  other = _tokenizer_variant(gpt2, tmp_path, "other", new_word)
  line = _refusal(capsys, gpt2["a"], other, "--out", str(tmp_path / "out2"), "--eval-text",
                  gpt2["text"])
  assert line == (f"MODEL_A {gpt2['a']} and MODEL_B {other} have tokenizers that differ in "
                  "their vocabulary (tokenizer.json)")


def test_merges_in_either_form_are_one_tokenizer():
  """BPE merges written as "a b" (older files) or as ["a", "b"] (newer ones) are the same
  merges; absent and empty merges too."""
  part = lambda merges: _check._tokenizer_part({"model": {"merges": merges}}, ("model", "merges"))
  assert part(["a b", "ab c"]) == part([["a", "b"], ["ab", "c"]])
  assert part(["a b"]) != part([["a", "c"]])


@pytest.mark.slow
def test_an_interrupted_run_ends_in_one_line_and_leaves_nothing(gpt2, tmp_path):
  """SIGINT (Ctrl-C) mid-run: one line saying nothing was written, exit status 130, no
  traceback, and no folder left at --out."""
  import signal  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  out = tmp_path / "out"
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.Popen(
      [sys.executable, "-m", "attn_symmetry.align", gpt2["a"], gpt2["independent"], "--out",
       str(out), "--method", "learned", "--eval-text", gpt2["text"], "--learn-steps", "1000000",
       "--compilation-cache", ""],
      cwd=root, env=dict(os.environ, PYTHONPATH=root), stderr=subprocess.PIPE, text=True)
  lines = []
  for line in proc.stderr:  # the check stage's line: the run is under way
    lines.append(line)
    if line.startswith("[align] load:"):
      break
  proc.send_signal(signal.SIGINT)
  lines += proc.stderr.readlines()
  assert proc.wait(timeout=120) == 130, lines
  assert lines[-1] == f"attn-symmetry align: interrupted: nothing written to {out}\n", lines
  assert not any("Traceback" in line for line in lines) and not out.exists()


@pytest.mark.slow
def test_every_option_of_the_learned_method_runs_through_the_command(gpt2, tmp_path, capsys):
  """One run of the command with every matching option that "learned" reads at a value other
  than its default (but learn_uniform_lambda, which excludes the band, and residual, which
  unties GPT-2's head: tests/test_align_checkpoints.py runs it): report.json records each."""
  values = {"distance": "cosine", "steps": 3, "learning_rate": 0.02, "max_rounds": 2,
            "init": "best", "refine": "final", "solver": "adam", "learn_init": "activation",
            "learn_lam_band": 10, "learn_schedule": "warmup_cosine", "learn_patience": 2,
            "factors": ["attention", "heads"], "learn_steps": 4, "learn_learning_rate": 0.02,
            "learn_holdout_batches": 2, "learn_repair": True}
  flags = [a for name, v in values.items()
           for a in (_check.flag(name), ",".join(v) if isinstance(v, list) else str(v))]
  heldout = _text(tmp_path / "heldout.txt", 192)
  report, _ = _run(capsys, gpt2["a"], gpt2["independent"], "--out", str(tmp_path / "out"),
                   "--method", "learned", "--match-data", gpt2["text"], "--match-batches", "3",
                   "--eval-text", heldout, *flags)
  assert {k: report["options"][k] for k in values} == values
  assert report["learned"]["steps"] <= 4 and report["learned"]["schedule"] == "warmup_cosine"
  # --learn-repair true: the objective REPAIRed with the rule of --repair
  assert report["learned"]["repair"] == {"no_bias": "std", "points": ["attention", "mlp"]}


def test_spearman_is_scipys_with_ties():
  """The bare-encoder agreement's rank correlation (numpy only) against scipy's."""
  from scipy import stats  # pylint: disable=g-import-not-at-top
  from attn_symmetry.align import _agreement  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  x, y = rng.integers(0, 6, 40).astype(float), rng.normal(size=40)
  assert _agreement.spearman(x, y) == pytest.approx(stats.spearmanr(x, y).statistic, abs=1e-12)
  np.testing.assert_array_equal(_agreement.ranks(np.array([3.0, 1.0, 3.0])), [1.5, 0.0, 1.5])
