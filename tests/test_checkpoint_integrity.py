"""Damaged files: flipped bits and truncation in a checkpoint, a truncated metadata file, an
empty final_metrics.json, a cut metrics log, a workdir from before fingerprints; and the
atomic writes that keep the runner's own files whole.

Each damage gives one clear error line naming the checkpoint, a fall back to the newest
intact checkpoint (training), or a recomputation with a warning naming the file.
"""

import glob
import json
import logging
import os
import shutil

import jax
import numpy as np
import pytest

from experiments.configs import quickstart
from experiments.setting import fingerprints
from experiments.train import checkpoints
from experiments.train import metric_writers
from experiments.train import saved_runs
from experiments.train import trainer
from experiments.workdir import atomic_io


def _config():
  config = quickstart.get_config("runlocal")
  config.reinit.scopes = ()  # the base model: 8 steps, checkpoints at 4 and 8
  return config


@pytest.fixture(scope="module")
def trained(trained_workdir, tmp_path_factory):
  """(workdir, final metrics, params) of the base run, never modified."""
  workdir, results = trained_workdir(_config(), tmp_path_factory.mktemp("trained") / "w")
  params = jax.tree.map(np.asarray, saved_runs.load_checkpoints(_config(), workdir)["base"])
  return workdir, results["base"], params


@pytest.fixture
def workdir(trained, tmp_path):
  """A copy of the trained workdir, to damage."""
  target = str(tmp_path / "w")
  shutil.copytree(trained[0], target)
  return target


def _step_dir(workdir, step=8):
  return os.path.join(workdir, "base", "checkpoints", str(step))


def _params_data_file(workdir, step=8):
  """The largest array data file of the params of ``step``."""
  files = glob.glob(os.path.join(_step_dir(workdir, step), "params", "**", "d", "*"),
                    recursive=True)
  return max(files, key=os.path.getsize)


def _flip(path, offset, mask=0x10):
  with open(path, "r+b") as f:
    f.seek(offset)
    byte = f.read(1)[0]
    f.seek(offset)
    f.write(bytes([byte ^ mask]))


def _truncate(path, fraction=0.5):
  with open(path, "r+b") as f:
    f.truncate(int(os.path.getsize(path) * fraction))


def _bits_equal(a, b):
  return all(np.asarray(x).tobytes() == np.asarray(y).tobytes()
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _one_line_naming(error, path):
  text = str(error.value)
  assert "\n" not in text and path in text, text


@pytest.mark.slow
def test_flipped_bits_never_restore_other_values(trained, workdir):
  """Each of 12 single-bit flips across the params data is refused in one line naming the
  checkpoint, or (bytes that no value is read from) restores exactly the saved values."""
  path = _params_data_file(workdir)
  size = os.path.getsize(path)
  refused = 0
  for offset in np.linspace(0, size - 1, 12).astype(int):
    _flip(path, offset)
    try:
      params = saved_runs.load_checkpoints(_config(), workdir)["base"]
    except checkpoints.CorruptCheckpointError as e:
      text = str(e)
      assert "\n" not in text and _step_dir(workdir) in text, text
      refused += 1
    else:
      assert _bits_equal(params, trained[2]), offset
    _flip(path, offset)  # undone, for the next offset
  assert refused >= 8


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncated params", "truncated metadata",
                                    "truncated array metadata", "no hash"])
def test_damaged_checkpoint_is_refused_in_one_line(workdir, damage):
  step_dir = _step_dir(workdir)
  if damage == "truncated params":
    _truncate(_params_data_file(workdir))
    match = "cannot be read"
  elif damage == "truncated metadata":
    _truncate(os.path.join(step_dir, "meta", "metadata"))
    match = "cannot be read .JSONDecodeError"
  elif damage == "truncated array metadata":
    _truncate(os.path.join(step_dir, "params", "_METADATA"))
    match = "cannot be read"
  else:  # a checkpoint written before hashes were recorded
    path = os.path.join(step_dir, "meta", "metadata")
    with open(path) as f:
      meta = json.load(f)
    del meta["sha256"]
    with open(path, "w") as f:
      json.dump(meta, f)
    match = "records no content hash .* train it again"
  with pytest.raises(checkpoints.CorruptCheckpointError, match=match) as error:
    saved_runs.load_checkpoints(_config(), workdir)
  _one_line_naming(error, step_dir)


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["flipped bit", "truncated params", "truncated metadata"])
def test_training_falls_back_to_the_newest_intact_checkpoint(trained, workdir, caplog, damage):
  if damage == "flipped bit":
    _flip(_params_data_file(workdir), os.path.getsize(_params_data_file(workdir)) // 2)
  elif damage == "truncated params":
    _truncate(_params_data_file(workdir))
  else:
    _truncate(os.path.join(_step_dir(workdir), "meta", "metadata"))
  with caplog.at_level(logging.INFO):
    results = trainer.train_and_evaluate(_config(), workdir)
  messages = [r.getMessage() for r in caplog.records]
  moved = glob.glob(os.path.join(workdir, "base", "corrupt_checkpoints", "8.corrupt-*"))
  assert len(moved) == 1
  fallback = [m for m in messages if "falling back to the previous checkpoint" in m]
  assert len(fallback) == 1 and _step_dir(workdir) in fallback[0] and moved[0] in fallback[0]
  assert "base: resuming from step 4" in " ".join(messages)
  assert results["base"] == trained[1]
  assert _bits_equal(saved_runs.load_checkpoints(_config(), workdir)["base"], trained[2])


@pytest.mark.slow
def test_empty_final_metrics_is_reevaluated_with_a_warning(trained, workdir, caplog):
  path = os.path.join(workdir, "base", "final_metrics.json")
  open(path, "w").close()  # a kill between open and write, before writes were atomic
  with caplog.at_level(logging.INFO):
    results = trainer.train_and_evaluate(_config(), workdir)
  warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
  assert len(warnings) == 1 and path in warnings[0] and "does not parse" in warnings[0]
  assert not [r for r in caplog.records if "resuming" in r.getMessage()]
  assert results["base"] == trained[1]
  with open(path) as f:
    assert json.load(f) == trained[1]
  assert not glob.glob(os.path.join(workdir, "base", "corrupt_checkpoints"))


@pytest.mark.slow
def test_run_without_fingerprint_is_moved_aside_and_retrained(trained, workdir, caplog):
  """A run directory from before fingerprints cannot be trusted to match the config."""
  os.remove(os.path.join(workdir, "base", fingerprints.RECORD))
  with pytest.raises(ValueError, match="no readable fingerprint.json.*rerun training"):
    saved_runs.load_checkpoints(_config(), workdir)
  with caplog.at_level(logging.INFO):
    results = trainer.train_and_evaluate(_config(), workdir)
  line = [r.getMessage() for r in caplog.records if "old state moved to" in r.getMessage()]
  assert len(line) == 1 and line[0].startswith("base: no readable fingerprint.json")
  stale = glob.glob(os.path.join(workdir, "base.stale-*"))
  assert len(stale) == 1 and os.path.isdir(os.path.join(stale[0], "checkpoints", "8"))
  assert results["base"] == trained[1]


@pytest.mark.slow
def test_load_checkpoints_refuses_a_run_of_other_fields(workdir):
  config = _config()
  config.train.learning_rate = 1e-3
  with pytest.raises(ValueError, match=r"train.learning_rate 0.003 -> 0.001.*rerun training"):
    saved_runs.load_checkpoints(config, workdir)


def test_cut_last_line_of_the_metrics_log_is_dropped(tmp_path, caplog):
  path = str(tmp_path / "metrics.jsonl")
  with open(path, "w") as f:
    f.write('{"step": 1, "train/loss": 2.5}\n{"step": 2, "train/loss": 2.4}\n{"step": 3, "tr')
  with caplog.at_level(logging.WARNING):
    assert metric_writers.read_jsonl(path) == [{"step": 1, "train/loss": 2.5},
                                               {"step": 2, "train/loss": 2.4}]
  assert path in caplog.records[0].getMessage()
  writer = metric_writers.MetricWriter(str(tmp_path), resume_step=2)
  writer.write_scalars(3, {"train/loss": 2.3})
  writer.close()
  assert [e["step"] for e in metric_writers.read_jsonl(path)] == [1, 2, 3]
  with open(path, "a") as f:
    f.write("not json\n")
  with pytest.raises(ValueError, match=r"metrics.jsonl, line 4, does not parse"):
    metric_writers.read_jsonl(path)


def test_atomic_write_keeps_the_old_file_when_interrupted(tmp_path):
  path = str(tmp_path / "sub" / "results.json")
  atomic_io.write_json(path, {"a": 1})
  with pytest.raises(RuntimeError):
    with atomic_io.atomic_write(path) as f:
      f.write('{"a": ')
      raise RuntimeError("killed")
  with open(path) as f:
    assert json.load(f) == {"a": 1}
  assert os.listdir(tmp_path / "sub") == ["results.json"]  # no temporary file left


def test_read_json_or_none_warns_naming_the_file(tmp_path, caplog):
  path = str(tmp_path / "cache.json")
  assert atomic_io.read_json_or_none(path) is None  # missing: no warning
  with open(path, "w") as f:
    f.write('{"fingerprint": "ab", "res')
  with caplog.at_level(logging.WARNING):
    assert atomic_io.read_json_or_none(path, "study cache") is None
  assert len(caplog.records) == 1
  assert caplog.records[0].getMessage().startswith(f"study cache {path} does not parse")


def test_tree_digest_sees_every_bit_path_dtype_and_shape():
  tree = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": {"c": np.ones(2, np.int32)}}
  digest = fingerprints.tree_digest(tree)
  flipped = jax.tree.map(np.copy, tree)
  flipped["a"].view(np.uint32)[1, 2] ^= 1
  variants = [flipped, {"a": tree["a"].reshape(3, 2), "b": tree["b"]},
              {"a": tree["a"].astype(np.float64), "b": tree["b"]},
              {"x": tree["a"], "b": tree["b"]}]
  assert len({digest, *map(fingerprints.tree_digest, variants)}) == 5
  assert fingerprints.tree_digest(jax.device_put(tree)) == digest
