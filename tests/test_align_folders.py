"""The align command reads only from the folders it is given and writes only new files under
--out: crafted index entries, a Hub cache's linked snapshot, an output folder that holds a file
an input reads. Tiny bfloat16 Mistral folders written with numpy alone (no torch)."""

import hashlib
import io
import json
import os
import re
import shutil
import tomllib

import pytest
from safetensors import safe_open

import attn_symmetry
from attn_symmetry import align
from attn_symmetry.align import _clock
from attn_symmetry.models import safetensors_io
from tests.test_streamed_alignment import _write_tensors, differing_tensors, plant, write_mistral

TINY = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, vocab_size=64)
SHARD = "model-00001-of-00001.safetensors"


def _pair(root):
  """(A, B): a tiny Mistral and B planted from it (heads and FFN units permuted)."""
  a, b = str(root / "a"), str(root / "b")
  write_mistral(a, 1, seed=0, **TINY)
  plant(a, b, seed=1)
  return a, b


def _snapshot(root):
  """{path: sha256} of every file under ``root``, links followed."""
  out = {}
  for folder, _, names in os.walk(root):
    for name in names:
      with open(os.path.join(folder, name), "rb") as f:
        out[os.path.join(folder, name)] = hashlib.sha256(f.read()).hexdigest()
  return out


def _refusal(capsys, *args):
  """The one error line of ``attn-symmetry align ARGS``, which must refuse (exit status 2)."""
  capsys.readouterr()
  status = align.cli(["align", *args])
  lines = [l for l in capsys.readouterr().err.strip().splitlines() if not l.startswith("[align]")]
  assert status == 2 and len(lines) == 1, lines
  assert lines[0].startswith("attn-symmetry align: error: ")
  return lines[0]


def _index(folder, entry, *, every):
  """Makes ``folder`` sharded: its weights in SHARD, and an index that puts every tensor
  (``every``) or the first in ``entry``, the others in SHARD."""
  os.replace(os.path.join(folder, "model.safetensors"), os.path.join(folder, SHARD))
  with safe_open(os.path.join(folder, SHARD), framework="numpy") as f:
    names = list(f.keys())
  weight_map = {name: SHARD for name in names} | {n: entry for n in names[:None if every else 1]}
  with open(os.path.join(folder, safetensors_io.INDEX), "w") as f:
    json.dump({"metadata": {}, "weight_map": weight_map}, f)


@pytest.mark.parametrize("entry", [
    "VICTIM", "../victim/model.safetensors", "../b/" + SHARD, "../../../../../../../etc/passwd",
    "sub/" + SHARD, "..", "config.json", ".safetensors", 7, "model\u0000.safetensors"])
def test_an_index_entry_that_leaves_the_folder_is_refused_before_any_work(entry, tmp_path,
                                                                          capsys):
  """The index's entry for a tensor must be the plain name of a weight file inside the folder.
  Before this was checked, an index that put every tensor in an absolute name (or one with
  enough ``../``) made the command read B from a file outside B and write aligned B through
  the same name, over that file."""
  a, b = _pair(tmp_path)
  victim = tmp_path / "victim"
  victim.mkdir()
  shutil.copy(os.path.join(b, "model.safetensors"), victim / "model.safetensors")
  os.makedirs(os.path.join(b, "sub"))
  shutil.copy(os.path.join(b, "model.safetensors"), os.path.join(b, "sub", SHARD))
  every = entry in ("VICTIM", "../victim/model.safetensors")  # the whole of B read from there
  if entry == "VICTIM":
    entry = str(victim / "model.safetensors")
  _index(b, entry, every=every)
  before = _snapshot(tmp_path)
  line = _refusal(capsys, a, b, "--out", str(tmp_path / "out"), "--method", "perm")
  changed = {p for p, digest in _snapshot(tmp_path).items() if before.get(p) != digest}
  assert not changed and not (tmp_path / "out").exists(), changed
  assert f"MODEL_B {b}: model.safetensors.index.json puts tensor " in line, line
  assert f"in {entry!r}: an index entry must be the plain name of a .safetensors file" in line


def _hub_snapshot(cache, folder, revision="0123abcd"):
  """``folder`` moved into a Hub cache's layout: each file a blob named by its hash, and
  snapshots/REVISION/NAME a relative link to it. Returns the snapshot folder."""
  repo = cache / f"models--test--{os.path.basename(folder)}"
  (repo / "blobs").mkdir(parents=True)
  snapshot = repo / "snapshots" / revision
  snapshot.mkdir(parents=True)
  for name in os.listdir(folder):
    with open(os.path.join(folder, name), "rb") as f:
      blob = hashlib.sha256(f.read()).hexdigest()
    os.replace(os.path.join(folder, name), repo / "blobs" / blob)
    os.symlink(os.path.join("..", "..", "blobs", blob), snapshot / name)
  return str(snapshot)


@pytest.mark.slow
def test_a_hub_cache_snapshot_aligns_and_its_blobs_stay_as_they_were(tmp_path):
  """Weight files that are links (a Hub cache's snapshot) are read through them; the outputs
  are new regular files, and the cache is byte for byte what it was."""
  a, b = _pair(tmp_path)
  cache = tmp_path / "hub"
  a, b = _hub_snapshot(cache, a), _hub_snapshot(cache, b)
  before = _snapshot(cache)
  out = tmp_path / "out"
  assert align.cli(["align", a, b, "--out", str(out), "--method", "perm", "--max-rounds", "1",
                    "--quiet"]) == 0
  assert differing_tensors(a, str(out / "aligned_a")) == []  # planted: A comes back
  written = [os.path.join(d, n) for d, _, names in os.walk(out) for n in names]
  assert written and not any(os.path.islink(p) for p in written)
  assert _snapshot(cache) == before


def test_an_output_folder_that_holds_a_file_an_input_reads_is_refused(tmp_path, capsys):
  """B's weights linked to a file inside --out (an earlier output): with --overwrite the
  command would replace the file it reads; it is refused, naming the file."""
  a, b = _pair(tmp_path)
  out = tmp_path / "out"
  (out / "aligned_b").mkdir(parents=True)
  os.replace(os.path.join(b, "model.safetensors"), out / "aligned_b" / "model.safetensors")
  os.symlink(out / "aligned_b" / "model.safetensors", os.path.join(b, "model.safetensors"))
  before = _snapshot(tmp_path)
  line = _refusal(capsys, a, b, "--out", str(out), "--overwrite")
  assert line.endswith(f"--out {out} holds {out / 'aligned_b' / 'model.safetensors'}, which "
                       f"MODEL_B {b} reads: nothing is written where an input file lies"), line
  assert _snapshot(tmp_path) == before


def test_a_writer_creates_new_files_only_and_never_writes_through_a_link(tmp_path):
  """``FolderWriter`` names its files itself (``output_files``) and creates each anew: a link
  or a file already at a name it writes is refused and left as it was."""
  a, _ = _pair(tmp_path)
  ckpt = safetensors_io.Checkpoint(a)
  assert safetensors_io.output_files(ckpt) == {"model.safetensors": "model.safetensors"}
  victim = tmp_path / "victim.txt"
  victim.write_text("mine")
  os.symlink(victim, tmp_path / "link")
  for name in ("link", "victim.txt"):
    with pytest.raises(FileExistsError):
      safetensors_io._create(str(tmp_path / name))
  assert victim.read_text() == "mine"


def test_version_of_both_entry_points(capsys):
  with open(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml"), "rb") as f:
    assert tomllib.load(f)["project"]["version"] == attn_symmetry.__version__
  for run, argv, prog in ((align.cli, ["--version"], "attn-symmetry"),
                          (align.cli, ["align", "--version"], "attn-symmetry align"),
                          (align.main, ["--version"], "python -m attn_symmetry.align")):
    with pytest.raises(SystemExit) as done:
      run(argv)
    assert done.value.code == 0
    assert capsys.readouterr().out == f"{prog} {attn_symmetry.__version__}\n"


@pytest.mark.slow
def test_the_report_records_every_option_and_the_code_and_the_command_ends_with_a_summary(
    tmp_path, capsys):
  """report.json holds the value of every matching option the method read, defaults included,
  the package's version and commit; the command's last lines say what it wrote where, which two
  folders to compare, the distances and the function check. MODEL_A given as MODEL_B too is
  aligned, after a warning line."""
  a, b = _pair(tmp_path)
  out = tmp_path / "out"
  capsys.readouterr()
  assert align.cli(["align", a, b, "--out", str(out), "--max-rounds", "2", "--quiet"]) == 0
  lines = capsys.readouterr().out.splitlines()
  report = json.loads((out / "report.json").read_text())
  assert report["options"] == {"distance": "frobenius", "steps": 200, "max_rounds": 2,
                               "init": "procrustes", "refine": "every_round",
                               "solver": "gauss_newton", "residual": "permutation"}
  assert report["attn_symmetry"]["version"] == attn_symmetry.__version__
  assert re.fullmatch(r"[0-9a-f]{40}", report["attn_symmetry"]["commit"])  # run from a checkout
  after = report["distance"]["after"]
  assert lines == [
      f"written to {out}: aligned_a, aligned_b, report.json",
      f"compare or merge: {out / 'aligned_a'} and {out / 'aligned_b'}",
      f"distance to A: {report['distance']['before']['total']:.6g} before, "
      f"{after['total']:.6g} after (relative {report['distance']['before']['relative']:.4g} -> "
      f"{after['relative']:.4g})",
      f"function check: aligned B's logits within "
      f"{report['function_check']['aligned_b']['relative']:.2g} of B's (tolerance 0.088)"]
  assert align.cli(["align", a, a, "--out", str(tmp_path / "self"), "--method", "naive",
                    "--quiet"]) == 0
  err = capsys.readouterr().err.splitlines()
  assert err == [f"attn-symmetry align: warning: MODEL_A and MODEL_B are the same folder "
                 f"({os.path.realpath(a)}): B is aligned to itself"]


class _Stream(io.StringIO):
  def __init__(self, terminal):
    super().__init__()
    self.terminal = terminal

  def isatty(self):
    return self.terminal


def test_progress_bar_redraws_on_a_terminal_and_writes_sparse_lines_to_a_log():
  terminal = _Stream(True)
  bar = _clock.ProgressBar(terminal, prefix="")
  for done in (1, 2, 3):
    bar("round 1", done, 3)
  assert terminal.getvalue() == ("\rround 1: 1/3 groups\rround 1: 2/3 groups"
                                 "\rround 1: 3/3 groups\r" + " " * 19 + "\r")
  log, quiet = _Stream(False), _Stream(False)
  every, sparse = _clock.ProgressBar(log, prefix="", interval=0.0), _clock.ProgressBar(quiet)
  for done in (1, 2, 3):
    every("apply", done, 3)
    sparse("apply", done, 3)
  assert log.getvalue() == "apply: 1/3 groups\napply: 2/3 groups\n"  # the pass's end: its line
  assert quiet.getvalue() == ""  # a pass shorter than the interval: nothing


@pytest.mark.slow
def test_every_streamed_pass_ticks_each_group_in_order(tmp_path):
  a, b = _pair(tmp_path)
  ticks = []
  align.align_checkpoints(a, b, out=tmp_path / "out", method="perm", max_rounds=1,
                          progress_bar=lambda *tick: ticks.append(tick))
  passes = list(dict.fromkeys(what for what, _, _ in ticks))
  assert passes[0] == "first pass, the distance before and the fixed scores"
  assert passes[-2:] == ["the distance", "apply, B' = g . B"] and len(passes) > 3
  groups = ticks[0][2]
  assert ticks == [(what, done, groups) for what in passes for done in range(1, groups + 1)]


def test_a_refusal_naming_what_a_file_holds_stays_one_line(tmp_path, capsys):
  """A tensor name with a line break (found by benchmarks/fuzz_folders.py) is named escaped."""
  a, b = _pair(tmp_path)
  with safe_open(os.path.join(b, "model.safetensors"), framework="numpy") as f:
    tensors = {k: f.get_tensor(k) for k in f.keys()}
  tensors["model.norm\nweight"] = tensors.pop("model.norm.weight")
  with open(os.path.join(b, "config.json")) as f:
    config = json.load(f)
  renamed = str(tmp_path / "renamed")
  _write_tensors(renamed, {k: v.shape for k, v in tensors.items()}, tensors.get, config)
  line = _refusal(capsys, a, renamed, "--out", str(tmp_path / "out"))
  assert "model.norm\\nweight" in line, line
