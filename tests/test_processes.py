"""One setting run by several processes (``jax.distributed`` on localhost, CPU collectives
over gloo) or by one process with several devices: the same results, the same reruns.

The slow tests start ``experiments/main.py`` as subprocesses: the quickstart at runlocal
size with the "first_attention" scope and a smaller study (``STUDY``), as two processes and
as one process with two CPU devices (``--xla_force_host_platform_device_count=2``).
"""

import json
import os
import socket
import subprocess
import sys

from absl.testing import flagsaver
import numpy as np
import pytest

from attn_symmetry import data
from experiments import main
from experiments.configs import quickstart
from experiments.train import inputs
from experiments.train import runs
from experiments.train import saved_runs
from tests import conftest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETTING = ["--config=experiments/configs/quickstart.py:runlocal",
           "--config.reinit.scopes=('first_attention',)"]
# The study that the process counts must agree on: the paper's full method and the learned one
# (which trains on global batches), without the head-order ablation, the Stage 1 distance
# ablation and the noise check, whose stages add programs to compile but no new way for
# processes to differ (the ablation on two devices has a test of its own, below).
STUDY = ["--config.study.methods=('naive','full','learned')",
         "--config.study.permutation_ablation=False", "--config.study.distances=()",
         "--config.study.noise_levels=()"]
TWO_DEVICES = "--xla_force_host_platform_device_count=2"


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env(xla_flags: str = "") -> dict[str, str]:
  """The test's environment with ``xla_flags`` added to its ``XLA_FLAGS`` (the test run's
  compile options, tests/conftest.py)."""
  return dict(os.environ, PYTHONPATH=REPO,
              XLA_FLAGS=conftest.with_xla_flags(os.environ.get("XLA_FLAGS"), *xla_flags.split()))


def _main(*args: str, xla_flags: str = "", timeout: int = 60) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "experiments/main.py", *args], cwd=REPO,
                        env=_env(xla_flags), capture_output=True, text=True, timeout=timeout)


def _run_processes(workdir: str, cache: str, count: int = 2, timeout: int = 900,
                   extra: tuple[str, ...] = ()) -> list[str]:
  """``main.py`` as ``count`` processes on localhost, with the flags ``extra`` too; returns
  each one's output."""
  port = _free_port()
  logs = [f"{workdir}.process_{i}.log" for i in range(count)]
  procs = []
  for i, log in enumerate(logs):
    with open(log, "w") as out:  # a file, not a pipe: no process waits on a full pipe
      procs.append(subprocess.Popen(
          [sys.executable, "experiments/main.py", *SETTING, *STUDY, *extra, f"--workdir={workdir}",
           f"--compilation_cache={cache}", f"--coordinator_address=127.0.0.1:{port}",
           f"--num_processes={count}", f"--process_id={i}"],
          cwd=REPO, env=_env(), stdout=out, stderr=subprocess.STDOUT))
  try:
    for p in procs:
      p.wait(timeout=timeout)
  finally:
    for p in procs:
      p.kill()
  outputs = []
  for i, (p, log) in enumerate(zip(procs, logs)):
    with open(log) as f:
      outputs.append(f.read())
    assert p.returncode == 0, f"process {i}:\n{outputs[-1][-4000:]}"
  return outputs


def _numbers(tree, path=""):
  """{path: value} of every leaf of a JSON tree but timings ("seconds")."""
  if isinstance(tree, dict):
    return {k: v for key, value in tree.items() if key != "seconds"
            for k, v in _numbers(value, f"{path}.{key}").items()}
  if isinstance(tree, list):
    return {k: v for i, value in enumerate(tree) for k, v in _numbers(value, f"{path}[{i}]").items()}
  return {path: tree}


def _outcome(workdir: str) -> dict:
  """Every leaf of the study's results and of every run's final evaluation."""
  out = {}
  files = ["study/first_attention/results.json"] + [
      f"{run}/final_metrics.json" for run in ("base", "reinit/first_attention/seed_1",
                                              "reinit/first_attention/seed_2")]
  for name in files:
    with open(os.path.join(workdir, name)) as f:
      out.update(_numbers(json.load(f), name))
  return out


def _largest_difference(a: dict, b: dict) -> float:
  assert a.keys() == b.keys()
  exact = {k for k in a if not isinstance(a[k], float)}
  assert {k: a[k] for k in exact} == {k: b[k] for k in exact}
  return max(abs(a[k] - b[k]) for k in a if k not in exact)


def _stamps(workdir: str) -> dict[str, int]:
  """Modification time of every file under ``workdir``."""
  return {os.path.join(d, f): os.stat(os.path.join(d, f)).st_mtime_ns
          for d, _, names in os.walk(workdir) for f in names}


@pytest.mark.parametrize("processes", [2, 4])
def test_first_examples_are_the_same_examples_in_every_process_count(processes):
  """The first 21 examples of the digits test split, read as shares of 8-example batches by
  several processes, are the first 21 that one process reads, whatever the count."""
  def kept(count):
    rows = {}
    for p in range(count):
      shares = data.eval_iterator("digits", batch_size=8, split="test", process_index=p,
                                  process_count=count)
      for k, batch in enumerate(inputs.first_examples(shares, 21, process_index=p,
                                                      process_count=count)):
        rows[k, p] = batch["image"][batch["valid"]]
    return np.concatenate([rows[key] for key in sorted(rows)])  # batch by batch, in order
  one = kept(1)
  assert len(one) == 21
  np.testing.assert_array_equal(kept(processes), one)


def test_a_process_count_that_does_not_split_the_batch_is_refused_in_one_line():
  config = quickstart.get_config("runlocal")
  inputs.check_processes(config, 4)  # 8 examples a batch, 2 for each process
  with pytest.raises(ValueError, match=r"^config.train.batch_size 8 is not divisible by the "
                                       r"3 processes: each reads an equal share"):
    inputs.check_processes(config, 3)


BAD_PROCESS_FLAGS = [
    (["--num_processes=2", "--process_id=2"], "FATAL --process_id must be in [0, 2), got 2"),
    (["--num_processes=0"], "FATAL --num_processes must be at least 1, got 0"),
    (["--coordinator_address=localhost", "--num_processes=2", "--process_id=0"],
     "FATAL --coordinator_address must be HOST:PORT, got 'localhost'"),
    (["--num_processes=3", "--process_id=0"],
     "FATAL config.train.batch_size 8 is not divisible by the 3 processes: each reads an "
     "equal share of every batch"),
]


@pytest.mark.parametrize("flags, message", BAD_PROCESS_FLAGS)
def test_bad_process_flags_are_refused_in_one_line_before_joining(flags, message, tmp_path,
                                                                  monkeypatch):
  """``join_processes`` exits with one line, before ``jax.distributed.initialize`` waits
  for processes that will never come."""
  monkeypatch.setattr(main.jax.distributed, "initialize",
                      lambda **kw: pytest.fail(f"initialize({kw}) called"))
  argv = ["main.py", f"--config={REPO}/{SETTING[0].split('=', 1)[1]}", *SETTING[1:],
          f"--workdir={tmp_path}", *flags]
  monkeypatch.setattr(sys, "argv", argv)  # ml_collections reads --config.* overrides there
  with flagsaver.flagsaver():
    main.parse_flags(argv)
    with pytest.raises(SystemExit) as stop:
      main.join_processes()
  assert str(stop.value) == message


@pytest.mark.slow
def test_main_exits_on_bad_process_flags_with_one_line_and_writes_nothing(tmp_path):
  """The same refusal end to end, for one of the cases: ``main.py`` as a process."""
  flags, message = BAD_PROCESS_FLAGS[-1]
  proc = _main(*SETTING, f"--workdir={tmp_path}", *flags)
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines()[-1] == message
  assert not os.listdir(tmp_path)


_ABLATION_ON_TWO_DEVICES = r"""
import json, sys
import jax
from experiments.configs import quickstart
from experiments.study import study
from experiments.train import inputs
from experiments.train import runs
from experiments.train import saved_runs

assert jax.device_count() == 2
config = quickstart.get_config("runlocal")
config.reinit.scopes = ("first_attention",)
config.study.methods, config.study.distances, config.study.noise_levels = ("naive",), (), ()
model = inputs.create_model(config)
mesh = inputs.create_mesh()
# Untrained endpoints, placed as saved_runs.load_checkpoints places trained ones: replicated on
# both devices, or host copies of them where the study asks (on_host). The study's Stage 1
# ablation (24 head permutations, each with Stage 2's batched LAPACK calls) deadlocked on
# replicated endpoints before it matched host copies on one device.
params = {run.name: jax.device_put(model.init(jax.random.key(run.seed)), inputs.replicated(mesh))
          for run in runs.runs(config)}
saved_runs.load_checkpoints = lambda config, workdir, *, require_complete, on_host: (
    inputs.to_host(params) if on_host else params)
paths = study.run_study(config, sys.argv[1])
with open(paths["first_attention/results.json"]) as f:
  ablation = json.load(f)["ablation"]["permutations"]
print(json.dumps([ablation["num_permutations"], ablation["per_pair"][0]["loss_barriers"]]))
"""


@pytest.mark.slow
def test_the_study_ablation_finishes_on_two_devices(tmp_path):
  """Two CPU devices in one process (on any number of cores): the study's permutation
  ablation finishes, with a barrier for each of the 24 head permutations."""
  proc = subprocess.run([sys.executable, "-c", _ABLATION_ON_TWO_DEVICES, str(tmp_path)],
                        cwd=REPO, env=_env(TWO_DEVICES), capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  count, barriers = json.loads(proc.stdout.strip().splitlines()[-1])
  assert count == 24 and len(barriers) == 24 and all(np.isfinite(barriers))


@pytest.mark.slow
def test_two_processes_equal_two_devices_and_rerun_nothing(tmp_path, request):
  """The quickstart as two processes on localhost gives every barrier, curve and final
  evaluation of one process with two devices (within 1e-5), each run's parameters and
  optimiser state split over the two in both (``train.param_sharding="fsdp"``; split
  against replicated parameters is tests/test_train.py's test); run again, the two
  processes skip every training run and reuse every study stage, writing no file; only
  process 0 logs its progress. One process reads every checkpoint verified: the content
  hashes that two processes recorded of their split arrays are those of the whole arrays."""
  cache = os.path.join(request.config.run_cache, "jax_cache")
  procs = str(tmp_path / "processes")
  split = ("--config.train.param_sharding=fsdp",)
  outputs = _run_processes(procs, cache, extra=split)
  devices = str(tmp_path / "devices")
  single = _main(*SETTING, *STUDY, *split, f"--workdir={devices}",
                 f"--compilation_cache={cache}", xla_flags=TWO_DEVICES, timeout=900)
  assert single.returncode == 0, single.stderr[-4000:]
  headline = single.stdout.split("loss barrier as % of naive, mean over pairs", 1)[1].splitlines()
  assert headline[1].split() == ["scope", "full", "learned"]  # main.py's last lines
  assert headline[2].split()[0] == "first_attention"
  assert _largest_difference(_outcome(procs), _outcome(devices)) <= 1e-5
  assert "study of scope first_attention" in outputs[0]
  assert "study of scope" not in outputs[1] and "trainer.py" not in outputs[1] and (
      "loop.py" not in outputs[1])

  config = quickstart.get_config("runlocal")
  config.reinit.scopes = ("first_attention",)
  assert set(saved_runs.load_checkpoints(config, procs)) == {
      "base", "reinit/first_attention/seed_1", "reinit/first_attention/seed_2"}

  before = _stamps(procs)
  outputs = _run_processes(procs, cache, extra=split)
  assert outputs[0].count("complete (step") == 3
  # Reused: the 3 methods' paths.
  assert "study of scope first_attention: 0 stage(s) computed, 3 reused" in outputs[0]
  assert _stamps(procs) == before
