"""Reruns into a used workdir: a changed field recomputes exactly the stages that depend on
it, with the results of a fresh workdir; a SIGKILL at any point, then a rerun, gives the
results of an uninterrupted run.

One workdir (the quickstart at runlocal size, one fine-tuned scope, two seeds, three
methods) is trained and studied once per module, then copied for every case.
"""

import glob
import json
import logging
import os
import shutil
import signal
import subprocess
import sys

import pytest

from attn_symmetry import runtime
from experiments.configs import quickstart
from experiments.report import report
from experiments.setting import fingerprints
from experiments.study import study
from experiments.train import checkpoints
from experiments.train import runs
from experiments.train import trainer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCOPE = "all_attention"
RUNS = ("base", f"reinit/{SCOPE}/seed_1", f"reinit/{SCOPE}/seed_2")
STAGES = ("naive", "perm", "full", "robustness")


def make_config(**changes):
  """The workdir's config with ``changes`` ({"train.learning_rate": 1e-3, ...})."""
  config = quickstart.get_config("runlocal")
  config.reinit.scopes = [SCOPE]  # fine-tuned from the base model; no ablations
  config.reinit.seeds = [1, 2]
  config.study.methods = ["naive", "perm", "full"]
  config.study.noise_levels = [0.5]
  for field, value in changes.items():
    *parents, last = field.split(".")
    node = config
    for p in parents:
      node = node[p]
    node[last] = value
  return config


def run_all(config, workdir):
  trainer.train_and_evaluate(config, workdir)
  study.run_study(config, workdir)


@pytest.fixture(scope="module")
def used(trained_workdir, tmp_path_factory):
  """A workdir holding the finished run of ``make_config()`` (training and study)."""
  return trained_workdir(make_config(), tmp_path_factory.mktemp("used") / "w", study=True)[0]


def _copy(workdir, tmp_path, name="copy"):
  target = str(tmp_path / name)
  shutil.copytree(workdir, target)
  return target


def _run_fresh(config, tmp_path):
  workdir = str(tmp_path / "fresh")
  run_all(config, workdir)
  return workdir


def _without_seconds(tree):
  if isinstance(tree, dict):
    return {k: _without_seconds(v) for k, v in tree.items() if k != "seconds"}
  if isinstance(tree, list):
    return [_without_seconds(v) for v in tree]
  return tree


def outcome(workdir):
  """What a user reads from a finished workdir: every run's last step, the content hash of
  its parameters and its final evaluation, and the study's results without timings."""
  out = {}
  for name in RUNS:
    directory = os.path.join(workdir, name)
    ckpts = checkpoints.RunCheckpoints(directory, read_only=True)
    step = ckpts.latest_step()
    with open(os.path.join(directory, "final_metrics.json")) as f:
      out[name] = (step, ckpts.digest(step), json.load(f))
    ckpts.close()
  with open(os.path.join(workdir, "study", SCOPE, "results.json")) as f:
    out["results"] = _without_seconds(json.load(f))
  return out


def _stage_stamps(workdir):
  pairs = os.path.join(workdir, "study", SCOPE, "pairs", "seed_1-seed_2")
  return {s: os.stat(os.path.join(pairs, s + ".json")).st_mtime_ns for s in STAGES}


def recomputed(workdir, before):
  """(runs moved aside and retrained, study stages rewritten since ``before``)."""
  runs = {name for name in RUNS if glob.glob(os.path.join(workdir, name) + ".stale-*")}
  stamps = _stage_stamps(workdir)
  return runs, {s for s in STAGES if stamps[s] != before[s]}


def _messages(caplog):
  return [r.getMessage() for r in caplog.records]


ALL = (set(RUNS), set(STAGES))
# field, new value, (retrained runs, recomputed study stages), the change line. One field of
# the training runs' stands for all of them (which fields key the runs is checked field by
# field, without training, below).
CASES = [
    ("train.learning_rate", 1e-3, ALL,
     "base: config changed (train.learning_rate 0.003 -> 0.001); retraining"),
    ("study.match_steps", 5, (set(), {"full", "robustness"}),
     "study all_attention: config changed (study.match_steps 20 -> 5); recomputing"),
    ("study.eval_split", "train[:50%]", (set(), set(STAGES)),
     "study all_attention: config changed (study.eval_split (none) -> train[:50%], "
     "sha256 of evaluation data "),
]


@pytest.mark.slow
@pytest.mark.parametrize("field, value, expected, line", CASES, ids=[c[0] for c in CASES])
def test_changed_field_recomputes_what_depends_on_it(used, tmp_path, caplog, field, value,
                                                      expected, line):
  config = make_config(**{field: value})
  workdir = _copy(used, tmp_path)
  before = _stage_stamps(workdir)
  with caplog.at_level(logging.INFO):
    run_all(config, workdir)
  assert recomputed(workdir, before) == expected
  assert [m for m in _messages(caplog) if m.startswith(line)], _messages(caplog)
  if expected[0]:  # the retraining line names where the old state went, which still exists
    moved = [m for m in _messages(caplog) if "old state moved to" in m]
    assert len(moved) == len(expected[0])
    assert all(os.path.isdir(m.rsplit(" ", 1)[1]) for m in moved)
  assert outcome(workdir) == outcome(_run_fresh(config, tmp_path))
  assert outcome(workdir) != outcome(used)


@pytest.mark.parametrize("field, value, line", [
    ("seed", 1, "config changed (seed 0 -> 1)"),
    ("dataset.augment", True, "config changed (dataset.augment False -> True)"),
    ("train.learning_rate", 1e-3, "config changed (train.learning_rate 0.003 -> 0.001)"),
])
def test_a_training_field_keys_the_base_run(field, value, line):
  """The change that makes the base run retrain (above, end to end), for fields whose path to
  the run's fingerprint differs: the top-level seed is the base run's own."""
  old, new = make_config(), make_config(**{field: value})
  base_fields = lambda config: runs.run_fields(config, runs.runs(config)[0])
  assert fingerprints.change_line(base_fields(old), base_fields(new)) == line


@pytest.mark.slow
def test_steps_up_then_down(used, tmp_path, caplog):
  """12 steps into the 8-step workdir retrains (not resumes) everything; 8 steps again
  retrains it back, to exactly the first run's results."""
  workdir = _copy(used, tmp_path)
  longer = make_config(**{"train.num_steps": 12})
  with caplog.at_level(logging.INFO):
    run_all(longer, workdir)
  assert "base: config changed (train.num_steps 8 -> 12); retraining" in " ".join(
      _messages(caplog))
  assert not [m for m in _messages(caplog) if "resuming" in m]
  assert outcome(workdir) == outcome(_run_fresh(longer, tmp_path))
  caplog.clear()
  with caplog.at_level(logging.INFO):
    run_all(make_config(), workdir)
  assert "base: config changed (train.num_steps 12 -> 8); retraining" in " ".join(
      _messages(caplog))
  assert outcome(workdir) == outcome(used)


def _assert_close(a, b, rel=1e-6, path="outcome"):
  """Equal trees, floats to ``rel`` (sums split differently round differently), or to 1e-6
  absolute: a barrier is a difference of losses near 2, so its rounding is absolute (a
  runlocal barrier of 5e-4 moved by 9e-8 when eval_batch_size split the sums another way).
  A mismatch names its ``path`` in the tree."""
  if isinstance(a, dict):
    assert a.keys() == b.keys(), path
    for k in a:
      _assert_close(a[k], b[k], rel, f"{path}[{k!r}]")
  elif isinstance(a, (list, tuple)):
    assert len(a) == len(b), path
    for i, (x, y) in enumerate(zip(a, b)):
      _assert_close(x, y, rel, f"{path}[{i}]")
  elif isinstance(a, float):
    assert a == pytest.approx(b, rel=rel, abs=1e-6), path
  else:
    assert a == b, path


@pytest.mark.slow
def test_unkeyed_fields_recompute_nothing(used, tmp_path, caplog):
  config = make_config(**{"train.log_every": 1, "train.eval_every": 2,
                          "train.checkpoint_every": 2, "train.keep_checkpoints": 3,
                          "train.eval_batch_size": 96, "study.lambda_chunk": 5})
  workdir = _copy(used, tmp_path)
  before = _stage_stamps(workdir)
  with caplog.at_level(logging.INFO):
    run_all(config, workdir)
  assert recomputed(workdir, before) == (set(), set())
  assert sum("complete" in m and "skipped" in m for m in _messages(caplog)) == len(RUNS)
  assert outcome(workdir) == outcome(used)
  # Leaving them out is right: from scratch they give the same parameters, bit for bit, and
  # the same evaluations up to the rounding of sums split another way.
  fresh = outcome(_run_fresh(config, tmp_path))
  assert [fresh[name][:2] for name in RUNS] == [outcome(used)[name][:2] for name in RUNS]
  _assert_close(*(_measured(o) for o in (fresh, outcome(used))))


@pytest.mark.slow
def test_the_circuit_path_adds_its_stages_and_recomputes_none(used, tmp_path):
  """``study.circuit_path`` adds a stage per method (its aligned pair on the circuit path) and
  leaves every stored stage, and every number of results.json but the circuit path's, as it
  was; turned off again, results.json is the used workdir's."""
  workdir = _copy(used, tmp_path)
  before = _stage_stamps(workdir)
  run_all(make_config(**{"study.circuit_path": True}), workdir)
  assert recomputed(workdir, before) == (set(), set())
  pairs = os.path.join(workdir, "study", SCOPE, "pairs", "seed_1-seed_2")
  assert all(os.path.exists(os.path.join(pairs, f"{m}+circuit.json"))
             for m in ("naive", "perm", "full"))
  res, old = outcome(workdir)["results"], outcome(used)["results"]
  assert res.pop(report.CIRCUIT_PATH) == report.CIRCUIT_NOTE
  for method, row in res["methods"].items():
    assert row["circuit_loss_barrier_mean"] is not None
    assert {k: v for k, v in row.items() if not k.startswith("circuit_")} == (
        old["methods"][method])
  for pair, old_pair in zip(res["pairs"], old["pairs"]):
    for method, entry in pair["methods"].items():
      circuit = entry.pop(report.CIRCUIT)
      assert circuit["loss"][0] == entry["loss"][0] and circuit["loss"][-1] == entry["loss"][-1]
      assert entry == old_pair["methods"][method]
  run_all(make_config(), workdir)
  assert outcome(workdir) == outcome(used)


def _measured(out):
  """``outcome`` without what the report derives from the pairs ("methods", "differences"),
  once each is seen to be exactly ``report.pair_statistics`` of its own pairs. The measured
  values agree to rounding; their ratios to naive need not: a ratio divides a barrier's
  rounding by the naive barrier, which is near 0 at runlocal size (fresh and used differed by
  1.7e-4 relative in "full"'s loss_barrier_ratio_pct, 479.26 against 479.34 % of naive, on a
  2-core AMD EPYC, and agreed to 1e-6 on an Intel Xeon)."""
  results = dict(out["results"])
  derived = report.pair_statistics(results["pairs"])
  for key in derived:
    assert json.dumps(results.pop(key), sort_keys=True) == json.dumps(
        runtime.jsonable(derived[key]), sort_keys=True), key
  return {**out, "results": results}


@pytest.mark.slow
def test_study_refuses_a_damaged_endpoint_in_one_line(used, tmp_path):
  workdir = _copy(used, tmp_path)
  # the run's last checkpoint, the one the study reads
  step_dir = os.path.join(workdir, RUNS[2], "checkpoints", str(make_config().reinit.num_steps))
  meta = os.path.join(step_dir, "meta", "metadata")
  with open(meta, "r+") as f:
    f.truncate(os.path.getsize(meta) // 2)
  with pytest.raises(checkpoints.CorruptCheckpointError, match="cannot be read") as error:
    study.run_study(make_config(), workdir)
  assert "\n" not in str(error.value) and step_dir in str(error.value)


@pytest.mark.slow
def test_truncated_pair_file_is_a_cache_miss_with_a_warning(used, tmp_path, caplog):
  workdir = _copy(used, tmp_path)
  before = _stage_stamps(workdir)
  path = os.path.join(workdir, "study", SCOPE, "pairs", "seed_1-seed_2", "perm.json")
  with open(path, "r+") as f:
    f.truncate(os.path.getsize(path) // 2)
  with caplog.at_level(logging.INFO):
    study.run_study(make_config(), workdir)
  warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
  assert len(warnings) == 1 and path in warnings[0] and "does not parse" in warnings[0]
  assert recomputed(workdir, before) == (set(), {"perm"})
  assert outcome(workdir) == outcome(used)


# ----------------------------------------------------------------------------- SIGKILL

_KILLED = """
import os, signal, sys
import jax
jax.config.update("jax_compilation_cache_dir", sys.argv[3])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
from experiments.study import study
from experiments.train import inputs
from experiments.train import runs
from experiments.train import trainer
from tests.test_reruns import make_config

where, workdir = sys.argv[1], sys.argv[2]
die = lambda: os.kill(os.getpid(), signal.SIGKILL)
if where == "step":  # the base run, while step 6 may still be computing: before batch 7
  from experiments.train import checkpoints
  save = checkpoints.RunCheckpoints.save  # synchronous, so that step 4 is surely on disk
  checkpoints.RunCheckpoints.save = lambda self, *a: (save(self, *a), self.wait())
  real = inputs.train_batches
  class Dying:
    def __init__(self, it): self.it, self.n = it, 0
    def __next__(self):
      self.n += 1
      if self.n == 7: die()
      return next(self.it)
    def get_state(self): return self.it.get_state()
    def set_state(self, s): self.it.set_state(s)
  inputs.train_batches = lambda *a, **k: Dying(real(*a, **k))
elif where == "save":  # the base run's last checkpoint: written, not yet committed
  from orbax.checkpoint._src.path import async_path
  real = async_path.rename
  async def rename(src, dst, *a, **k):
    if str(dst).endswith(os.path.join("base", "checkpoints", "8")): die()
    return await real(src, dst, *a, **k)
  async_path.rename = rename
elif where == "study":  # the second stage file: computed, about to replace its name
  real = os.replace
  def replace(src, dst):
    if str(dst).endswith("perm.json"): die()
    return real(src, dst)
  os.replace = replace
config = make_config()
trainer.train_and_evaluate(config, workdir)
study.run_study(config, workdir)
print("not killed")
"""


def _run_killed(where, workdir, cache):
  proc = subprocess.run([sys.executable, "-c", _KILLED, where, workdir, cache], cwd=REPO,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == -signal.SIGKILL, proc.stdout[-2000:] + proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("where, resumed_from", [("step", 4), ("save", 4)])
def test_sigkill_during_training_then_rerun_is_bit_identical(used, tmp_path, tmp_path_factory,
                                                             caplog, where, resumed_from):
  workdir = str(tmp_path / "w")
  _run_killed(where, workdir, str(tmp_path_factory.getbasetemp() / "jax_cache"))
  ckpts = checkpoints.RunCheckpoints(os.path.join(workdir, "base"), read_only=True)
  assert ckpts.all_steps() == [4]
  assert not os.path.exists(os.path.join(workdir, "base", "final_metrics.json"))
  with caplog.at_level(logging.INFO):
    run_all(make_config(), workdir)
  assert f"base: resuming from step {resumed_from}" in " ".join(_messages(caplog))
  assert outcome(workdir) == outcome(used)


@pytest.mark.slow
def test_sigkill_during_study_then_rerun_gives_the_same_results(used, tmp_path,
                                                                tmp_path_factory, caplog):
  workdir = str(tmp_path / "w")
  shutil.copytree(used, workdir, ignore=shutil.ignore_patterns("study"))
  _run_killed("study", workdir, str(tmp_path_factory.getbasetemp() / "jax_cache"))
  pairs = os.path.join(workdir, "study", SCOPE, "pairs", "seed_1-seed_2")
  names = os.listdir(pairs)
  assert [n for n in names if not n.startswith(".")] == ["naive.json"]
  assert [n for n in names if n.startswith(".perm.json.tmp-")]  # killed before its rename
  with caplog.at_level(logging.INFO):
    run_all(make_config(), workdir)
  assert f"study of scope {SCOPE}: 3 stage(s) computed, 1 reused" in " ".join(
      _messages(caplog))
  assert outcome(workdir) == outcome(used)
