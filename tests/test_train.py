"""Training on real offline data with the real models: runlocal runs, re-initialisation,
resume, the NaN guard, bad configs and data parallelism.

The quickstart at runlocal size (ViT on digits, every scope, two seeds) is
trained once per module; tests with the same model and schedule reuse its
compiled steps.
"""

import hashlib
import json
import math
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from absl.testing import flagsaver

from attn_symmetry import spec as spec_lib
from experiments import main
from experiments.configs import bert_mlm_wiki_bytes
from experiments.configs import bert_offline
from experiments.configs import gpt2_wiki_bytes
from experiments.configs import llama_wiki_bytes
from experiments.configs import quickstart
from experiments.configs import vit_mnist_to_fashion
from experiments.train import checkpoints
from experiments.train import inputs
from experiments.train import metric_writers
from experiments.train import optimizer as optimizer_lib
from experiments.train import runs
from experiments.train import saved_runs
from experiments.train import schedules
from experiments.train import trainer
from tests import conftest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _base_only(config):
  config.reinit.scopes = ()
  return config


@pytest.fixture(scope="module")
def quickstart_run(trained_workdir, tmp_path_factory):
  """(config, a copy of its finished workdir, results) of the quickstart at runlocal size."""
  config = quickstart.get_config("runlocal")
  return (config, *trained_workdir(config, tmp_path_factory.mktemp("quickstart") / "w"))


def _tree_digest(directory):
  """Hash of every file (path and bytes) under ``directory``."""
  digest = hashlib.sha256()
  for root, dirs, files in sorted(os.walk(directory)):
    dirs.sort()
    for name in sorted(files):
      path = os.path.join(root, name)
      digest.update(os.path.relpath(path, directory).encode())
      with open(path, "rb") as f:
        digest.update(f.read())
  return digest.hexdigest()


def _bits_equal(a, b):
  a, b = np.asarray(a), np.asarray(b)
  return a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.slow
def test_quickstart_trains_every_run(quickstart_run):
  config, workdir, results = quickstart_run
  assert list(results) == [run.name for run in runs.runs(config)]
  assert len(results) == 1 + len(config.reinit.scopes) * len(config.reinit.seeds)
  for run in runs.runs(config):
    directory = runs.run_dir(workdir, run)
    m = results[run.name]
    assert math.isfinite(m["loss"]) and 0.0 <= m["accuracy"] <= 1.0
    with open(os.path.join(directory, "final_metrics.json")) as f:
      assert json.load(f) == m
    num_steps = runs.schedule(config, run).num_steps
    ckpts = checkpoints.RunCheckpoints(directory, read_only=True)
    assert ckpts.latest_step() == num_steps
    assert len(ckpts.all_steps()) <= config.train.keep_checkpoints
    log = metric_writers.read_jsonl(os.path.join(directory, "metrics.jsonl"))
    assert [e["step"] for e in log if "train/loss" in e][-1] == num_steps
    assert [e for e in log if "eval/loss" in e][-1]["eval/loss"] == pytest.approx(m["loss"])
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(directory))


@pytest.mark.slow
def test_no_base_model_when_every_scope_trains_from_scratch(tmp_path):
  """Only "full" scopes: no run starts from the base model, so it is not trained (and the
  study loads the seeds alone); with no scope at all it is the only run."""
  config = quickstart.get_config("runlocal")
  assert [r.name for r in runs.runs(_base_only(quickstart.get_config("runlocal")))] == ["base"]
  config.reinit.scopes, config.reinit.seeds = ("full",), (1, 2)
  names = ["reinit/full/seed_1", "reinit/full/seed_2"]
  assert [r.name for r in runs.runs(config)] == names
  assert list(trainer.train_and_evaluate(config, str(tmp_path))) == names
  assert not os.path.exists(tmp_path / "base")
  assert list(saved_runs.load_checkpoints(config, str(tmp_path), require_complete=True)) == names
  config.reinit.scopes = ("full", "first_attention")
  assert runs.runs(config)[0].name == "base"


@pytest.mark.slow
def test_reinit_freezes_everything_outside_the_scope(quickstart_run):
  config, workdir, _ = quickstart_run
  model = inputs.create_model(config)
  params = saved_runs.load_checkpoints(config, workdir)
  base = spec_lib.flatten(params["base"])
  for scope in config.reinit.scopes:
    prefixes = model.scope_paths(scope)
    in_scope = lambda p: any(q == "" or p == q or p.startswith(q + "/") for q in prefixes)
    seeds = [spec_lib.flatten(params[f"reinit/{scope}/seed_{s}"]) for s in config.reinit.seeds]
    assert any(in_scope(p) for p in base) and (scope == "full" or not all(map(in_scope, base)))
    for leaves in seeds:
      for path, value in leaves.items():
        if in_scope(path):
          assert not _bits_equal(value, base[path]), (scope, path)
        else:
          assert _bits_equal(value, base[path]), (scope, path)
    # Different seeds re-initialise (and so end) differently.
    kernel = next(p for p in base if in_scope(p) and p.endswith("kernel"))
    assert not _bits_equal(seeds[0][kernel], seeds[1][kernel])


@pytest.mark.slow
def test_rerun_skips_finished_runs(quickstart_run):
  config, workdir, results = quickstart_run
  before = _tree_digest(workdir)
  assert trainer.train_and_evaluate(config, workdir) == results
  assert _tree_digest(workdir) == before


@pytest.mark.slow
def test_main_runs_the_same_training(quickstart_run, tmp_path, monkeypatch):
  """main.py's flags and training stage give what the library call gave, number for number."""
  _, _, results = quickstart_run
  assert main.STAGES[0] is trainer.train_and_evaluate
  monkeypatch.setattr(main, "STAGES", main.STAGES[:1])  # The study stages are tested elsewhere.
  argv = ["main.py", f"--config={REPO}/experiments/configs/quickstart.py:runlocal",
          f"--workdir={tmp_path}", "--compilation_cache="]
  with flagsaver.flagsaver():
    main.main(main.parse_flags(argv))
  for name, metrics in results.items():
    with open(tmp_path / name / "final_metrics.json") as f:
      assert json.load(f) == metrics


def test_main_turns_on_the_compilation_cache(tmp_path, monkeypatch, capsys):
  """... and prints each stage's wall time and the share of it that JAX spent compiling."""
  seen = []
  stage = lambda config, workdir: seen.append(jax.config.jax_compilation_cache_dir) or {}
  monkeypatch.setattr(main, "STAGES", (stage,))
  argv = ["main.py", f"--config={REPO}/experiments/configs/quickstart.py:runlocal",
          f"--workdir={tmp_path / 'w'}", f"--compilation_cache={tmp_path / 'cache'}"]
  try:
    with flagsaver.flagsaver():
      main.main(main.parse_flags(argv))
  finally:
    jax.config.update("jax_compilation_cache_dir", None)
  assert seen == [str(tmp_path / "cache")]
  lines = capsys.readouterr().out.splitlines()
  assert lines[-2].startswith("wall time: <lambda> ") and lines[-2].endswith(" s")
  assert lines[-1].startswith("JAX compilation: ")


def test_main_reports_a_corrupt_checkpoint_in_one_line(tmp_path, monkeypatch):
  def stage(config, workdir):
    raise checkpoints.CorruptCheckpointError(f"{workdir}/base/checkpoints/8: params do not match")
  monkeypatch.setattr(main, "STAGES", (stage,))
  argv = ["main.py", f"--config={REPO}/experiments/configs/quickstart.py:runlocal",
          f"--workdir={tmp_path / 'w'}", "--compilation_cache="]
  with flagsaver.flagsaver(), pytest.raises(SystemExit) as exit_:
    main.main(main.parse_flags(argv))
  assert str(exit_.value.code) == f"FATAL {tmp_path / 'w'}/base/checkpoints/8: params do not match"


class _Crash(Exception):
  pass


class _Batches:
  """Wraps a training iterator: crashes before batch ``crash_at`` or poisons batch ``nan_at``."""

  def __init__(self, batches, *, crash_at=None, nan_at=None):
    self._batches, self._crash_at, self._nan_at, self._n = batches, crash_at, nan_at, 0

  def __next__(self):
    self._n += 1
    if self._n == self._crash_at:
      raise _Crash(f"killed before batch {self._n}")
    batch = next(self._batches)
    if self._n == self._nan_at:
      batch = {**batch, "image": np.full_like(batch["image"], np.nan)}
    return batch

  def get_state(self):
    return self._batches.get_state()

  def set_state(self, state):
    self._batches.set_state(state)


def _patch_batches(monkeypatch, **kwargs):
  real = inputs.train_batches
  monkeypatch.setattr(inputs, "train_batches",
                      lambda *a, **k: _Batches(real(*a, **k), **kwargs))


@pytest.mark.slow
def test_resume_after_crash_ends_identical(quickstart_run, tmp_path, monkeypatch):
  reference_config, reference_dir, _ = quickstart_run
  config = _base_only(quickstart.get_config("runlocal"))
  config.train.log_every = 1
  assert config.train.checkpoint_every == 4 and config.train.num_steps == 8
  workdir = str(tmp_path)
  with monkeypatch.context() as m:
    _patch_batches(m, crash_at=7)  # Steps 5 and 6 are done and logged, not checkpointed.
    with pytest.raises(_Crash):
      trainer.train_and_evaluate(config, workdir)
  base_dir = runs.run_dir(workdir, runs.runs(config)[0])
  assert checkpoints.RunCheckpoints(base_dir, read_only=True).latest_step() == 4
  trainer.train_and_evaluate(config, workdir)
  resumed = saved_runs.load_checkpoints(config, workdir)["base"]
  uninterrupted = saved_runs.load_checkpoints(reference_config, reference_dir)["base"]
  for path, value in spec_lib.flatten(uninterrupted).items():
    assert _bits_equal(spec_lib.flatten(resumed)[path], value), path
  log = metric_writers.read_jsonl(os.path.join(base_dir, "metrics.jsonl"))
  assert [e["step"] for e in log if "train/loss" in e] == list(range(1, 9))


@pytest.mark.slow
def test_nonfinite_loss_stops_and_keeps_last_good_checkpoint(tmp_path, monkeypatch):
  config = _base_only(quickstart.get_config("runlocal"))
  _patch_batches(monkeypatch, nan_at=6)
  with pytest.raises(FloatingPointError, match=r"nan at step 6.*last good checkpoint \(step 4\)"):
    trainer.train_and_evaluate(config, str(tmp_path))
  ckpts = checkpoints.RunCheckpoints(runs.run_dir(str(tmp_path), runs.runs(config)[0]),
                                     read_only=True)
  assert ckpts.all_steps() == [4]
  params = saved_runs.load_checkpoints(config, str(tmp_path))["base"]
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))


@pytest.mark.slow
@pytest.mark.parametrize("setting", [gpt2_wiki_bytes, llama_wiki_bytes, bert_offline,
                                     bert_mlm_wiki_bytes], ids=["gpt2", "llama", "bert", "bert_mlm"])
def test_runlocal_family(setting, tmp_path):
  config = _base_only(setting.get_config("runlocal"))
  results = trainer.train_and_evaluate(config, str(tmp_path))
  model = inputs.create_model(config)
  trained = spec_lib.flatten(saved_runs.load_checkpoints(config, str(tmp_path))["base"])
  init = spec_lib.flatten(model.init(jax.random.key(config.seed)))
  assert all(not _bits_equal(trained[p], init[p]) for p in init if p.endswith("kernel"))
  loss = results["base"]["loss"]
  assert math.isfinite(loss)
  if model.task in ("lm", "mlm"):  # Better than the uniform guess over bytes after a few steps.
    assert loss < math.log(model.config.vocab_size)


def _record_reads(monkeypatch, reader, read):
  """Makes ``inputs.<reader>`` append (reader, data set) to ``read`` on every call."""
  real = getattr(inputs, reader)

  def recording(config, dataset, **kwargs):
    read.append((reader, dataset))
    return real(config, dataset, **kwargs)

  monkeypatch.setattr(inputs, reader, recording)


@pytest.mark.slow
def test_transfer_fine_tunes_on_the_second_data_set(tmp_path, monkeypatch):
  """A->B: the base model learns MNIST digits, the re-initialised scope Fashion-MNIST."""
  config = vit_mnist_to_fashion.get_config("runlocal")
  config.reinit.scopes, config.reinit.seeds = ("first_attention",), (1, 2)
  config.dataset.validation_examples = 256  # the stopping rule's checks: not under test here
  read = []
  for reader in ("train_batches", "eval_batches"):
    _record_reads(monkeypatch, reader, read)
  trainer.train_and_evaluate(config, str(tmp_path))
  assert read == [("train_batches", "mnist5k"), ("eval_batches", "mnist5k"),
                  *[("train_batches", "fashion_mnist_deb"), ("eval_batches", "fashion_mnist_deb")] * 2]
  params = saved_runs.load_checkpoints(config, str(tmp_path))
  base, tuned = (spec_lib.flatten(params[k]) for k in ("base", "reinit/first_attention/seed_1"))
  frozen = [p for p in base if not p.startswith("layers_0/attention/")]
  assert frozen and all(_bits_equal(base[p], tuned[p]) for p in frozen)
  assert not _bits_equal(base["layers_0/attention/query/kernel"],
                         tuned["layers_0/attention/query/kernel"])


def _mutate(config, field, value):
  node = config
  *parents, last = field.split(".")
  for p in parents:
    node = node[p]
  node[last] = value


@pytest.mark.slow
@pytest.mark.parametrize("field, value, error", [
    ("model.family", "resnet", "unknown model family"),
    ("model.overrides.num_heads", 5, "num_heads"),
    ("dataset.name", "no_such_data", "unknown data set"),
    ("reinit.scopes", ("first_attention", "second_layer"), "second_layer"),
    ("reinit.seeds", (1, 1), "distinct"),
    ("reinit.dataset", "wiki_bytes", "does not fit"),
    ("train.batch_size", 4096, "larger than the train split"),
    ("train.warmup_steps", 8, "warmup_steps"),
])
def test_bad_config_fails_before_training(field, value, error, tmp_path):
  config = quickstart.get_config("runlocal")
  _mutate(config, field, value)
  workdir = str(tmp_path / "workdir")
  with pytest.raises(ValueError, match=error):
    trainer.train_and_evaluate(config, workdir)
  assert not os.path.exists(workdir)


@pytest.mark.slow
def test_workdir_of_another_architecture_is_refused_untouched(quickstart_run):
  _, workdir, _ = quickstart_run
  config = quickstart.get_config("runlocal")
  config.model.overrides.mlp_dim = 96
  before = _tree_digest(workdir)
  for entry_point in (trainer.train_and_evaluate, saved_runs.load_checkpoints):
    with pytest.raises(ValueError, match=r"another architecture(.|\n)*layers_0/mlp"):
      entry_point(config, workdir)
  assert _tree_digest(workdir) == before


def test_load_checkpoints_of_untrained_run_names_it(tmp_path):
  config = quickstart.get_config("runlocal")
  with pytest.raises(ValueError, match="'base' has no checkpoint"):
    saved_runs.load_checkpoints(config, str(tmp_path))


@pytest.mark.slow
def test_main_rejects_override_of_missing_field(tmp_path):
  workdir = tmp_path / "w"
  proc = subprocess.run(
      [sys.executable, "experiments/main.py",
       "--config=experiments/configs/quickstart.py:runlocal", "--config.train.num_stepz=3",
       f"--workdir={workdir}"], cwd=REPO, capture_output=True, text=True, timeout=300)
  assert proc.returncode != 0
  assert "config.train.num_stepz" in proc.stderr
  assert not workdir.exists()


# Four CPU devices (their count is fixed when JAX starts): the base model trained with the
# parameters replicated ("four") and split ("fsdp"), the split run rerun, the replicated run
# resumed split from its middle checkpoint, the split run's checkpoint loaded, and one training
# step from the same state in each placement.
_MULTI_DEVICE = """
import json, os, shutil, sys
import jax
from experiments.configs import quickstart
from experiments.setting import fingerprints
from experiments.train import inputs
from experiments.train import optimizer as optimizer_lib
from experiments.train import runs
from experiments.train import saved_runs
from experiments.train import schedules
from experiments.train import trainer
work = sys.argv[1]
config = quickstart.get_config("runlocal")
config.reinit.scopes = ()
config.train.log_every = 1
trainer.train_and_evaluate(config, os.path.join(work, "four"))
config.train.param_sharding = "fsdp"
fsdp = os.path.join(work, "fsdp")
trainer.train_and_evaluate(config, fsdp)
stamps = lambda: {os.path.join(d, f): os.stat(os.path.join(d, f)).st_mtime_ns
                  for d, _, names in os.walk(fsdp) for f in names}
before = stamps()
trainer.train_and_evaluate(config, fsdp)
out = {"devices": jax.device_count(), "rerun_wrote": before != stamps()}
# The replicated run cut back to its step-4 checkpoint, resumed with split parameters.
resumed = os.path.join(work, "resumed")
shutil.copytree(os.path.join(work, "four"), resumed)
shutil.rmtree(os.path.join(resumed, "base", "checkpoints", "8"))
os.remove(os.path.join(resumed, "base", "final_metrics.json"))
out["resumed"] = trainer.train_and_evaluate(config, resumed)["base"]
# Verified against the split run's digest; a host copy, since each step donates its state.
params = inputs.to_host(saved_runs.load_checkpoints(config, fsdp)["base"])
model, mesh, run = inputs.create_model(config), inputs.create_mesh(), runs.runs(config)[0]
trainable = jax.tree.map(lambda _: True, params)
optimizer, _ = optimizer_lib.create_optimizer(config, runs.schedule(config, run), trainable)
batch = inputs.shard_batch(next(iter(inputs.train_batches(config, "digits", seed=0))), mesh)
for how in inputs.PARAM_SHARDINGS:
  state = {"params": params, "opt_state": optimizer.init(params)}
  state = jax.device_put(state, inputs.shardings(state, inputs.placement(mesh, how)))
  step = optimizer_lib.make_train_step(model, optimizer, trainable, mesh, how)
  state, metrics = step(state, batch)
  out[how] = {part: {"per_device": sum(x.addressable_shards[0].data.nbytes
                                       for x in jax.tree.leaves(state[part])),
                     "whole": sum(x.nbytes for x in jax.tree.leaves(state[part]))}
              for part in state}
  out[how].update(loss=float(metrics["loss"]), digest=fingerprints.tree_digest(state),
                  host_digest=fingerprints.tree_digest(inputs.to_host(state)))
print(json.dumps(out))
"""


@pytest.mark.slow
def test_data_parallel_and_split_parameters_match_single_device(tmp_path):
  """Four CPU devices, batch split four ways: the same losses as one device (within 1e-5),
  with the parameters and optimiser state replicated or split over the devices
  (``train.param_sharding="fsdp"``). Split, each device holds at most 0.3x of them (0.25x
  and the replicated scalars); a rerun writes nothing; a replicated run resumes split from
  its middle checkpoint to the same end; the checkpoint loads replicated and verified, its
  content hash being that of the whole arrays; a step's state hashes as its host copy does."""
  config = _base_only(quickstart.get_config("runlocal"))
  config.train.log_every = 1
  single = trainer.train_and_evaluate(config, str(tmp_path / "one"))
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": conftest.with_xla_flags(
      os.environ.get("XLA_FLAGS"), "--xla_force_host_platform_device_count=4")}
  proc = subprocess.run([sys.executable, "-c", _MULTI_DEVICE, str(tmp_path)], cwd=REPO,
                        env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  assert out["devices"] == 4 and not out["rerun_wrote"]
  logs = {d: metric_writers.read_jsonl(str(tmp_path / d / "base" / "metrics.jsonl"))
          for d in ("one", "four", "fsdp")}
  losses = {d: [e["train/loss"] for e in log if "train/loss" in e] for d, log in logs.items()}
  assert len(losses["one"]) == config.train.num_steps
  for d in ("four", "fsdp"):
    np.testing.assert_allclose(losses[d], losses["one"], rtol=1e-5, err_msg=d)
    final = json.load(open(tmp_path / d / "base" / "final_metrics.json"))
    assert final["loss"] == pytest.approx(single["base"]["loss"], rel=1e-5), d
  four = json.load(open(tmp_path / "four" / "base" / "final_metrics.json"))
  assert out["resumed"]["steps"] == four["steps"]
  assert out["resumed"]["loss"] == pytest.approx(four["loss"], rel=1e-5)
  replicated, split = out["replicated"], out["fsdp"]
  assert split["loss"] == pytest.approx(replicated["loss"], rel=1e-5)
  for part in ("params", "opt_state"):
    assert replicated[part]["per_device"] == replicated[part]["whole"] == split[part]["whole"]
    assert split[part]["per_device"] <= 0.3 * replicated[part]["per_device"], (part, split)
  for state in (replicated, split):
    assert state["digest"] == state["host_digest"]
