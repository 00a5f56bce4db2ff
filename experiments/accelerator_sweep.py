r"""The largest points of the GPT-2 width sweep on one GPU, in one call of a few minutes.

    python experiments/accelerator_sweep.py --prepare    # here, with a network: fills .accelerator/
    python experiments/accelerator_sweep.py --toy        # every stage at toy size on a CPU
    python experiments/accelerator_sweep.py --out=DIR    # on the GPU machine: the sweep

The points are the "accelerator only" settings of ``experiments/configs/cpu_paper.py``
(``cpu_paper.ACCELERATOR_ONLY``: width_gpt2_wiki_256, width_gpt2_wiki_512 and
theus_gpt2_wiki; its docstring describes them). The sweep

1. prints the plan: each point's predicted wall time from the stated throughput
   of ``experiments/reproduction/sweep_plan.py`` (assumptions, not measurements);
2. skips a point whose results are already under ``--results`` from an earlier GPU
   run (``results/<setting>/run.json`` with an ``accelerator`` record), unless ``--redo``;
3. runs the others side by side (``--jobs``), each in a process of its own that trains
   and studies it as ``experiments/reproduce.py`` would (same stages, workdir under
   ``--workdir_root``), at the "highest" float32 matmul precision (``--matmul_precision``)
   so that its numbers are float32's, as the CPU points' are, not TensorFloat-32's;
4. stops every point still running when ``--budget_s`` has passed (a clean stop:
   its workdir keeps its checkpoints and finished study stages, from which a rerun
   on the same machine resumes, compiled programs loaded from ``--workdir_root``'s
   cache);
5. writes into ``--results`` each finished point's reports, as reproduce.py does
   (``committed.write_run`` into ``results/<setting>/``: summary.md, full/results.json and
   figures, config.json and run.json, whose record, ``committed.run_record`` as
   reproduce.py's, also names the GPU: ``device``, and records the plan's prediction
   beside the wall time: ``accelerator``), and into ``--out``
   ``accelerator_sweep.tar.gz`` (``results/<setting>/`` of every finished point, and
   ``logs/<setting>.log``), rewritten as each point finishes, and ``sweep.json``
   (the plan, each point's state and wall time, what is left).

On the GPU machine (no network) the data and the Python packages that its image
lacks travel with the working tree in ``.accelerator/`` (``experiments/reproduction/carry.py``;
ignored by git): run ``--prepare`` once here first. It prints the folder's size
(13.5 MiB: 3.3 MB of data, 11 MB of wheels; the checkout beside it is about 16 MiB,
under the 64 MiB that travels). The device call (``run``; the command is one line):

    command:   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir
               --upgrade --target /tmp/site .accelerator/wheels/*.whl
               && export PYTHONPATH=/tmp/site:$PWD || exit;
               set -o pipefail; PYTHONUNBUFFERED=1 python3 experiments/accelerator_sweep.py
               --out=$OUT 2>&1 | tee $OUT/log.txt
    carry:     [".accelerator"]
    timeout_s: 340

The sweep stops itself ``--budget_s=280`` seconds after it started (the wheels'
installation takes about 15 s before that, stopping and packing about 15 s after),
so that two such calls (a machine's start takes one to two minutes) fit in the 15
minutes of device time that a session is lent. The plan predicts (stated
assumptions) that the two widths finish within the budget and theus_gpt2_wiki a
little after it. Then, here:

    tar xzf <files_at>/accelerator_sweep.tar.gz -C . results   # the finished points
    python experiments/reproduce.py --table                   # results/README.md

and commit ``results/<setting>/`` with the GPU named (``run.json``: ``device``). If
``sweep.json`` lists points left (``remaining``), make the same call again: within the
30 s that the machine stays warm it resumes them from their checkpoints and compiled
programs; on a fresh machine they start over, and the points unpacked into
``results/`` (they travel with the working tree) are skipped. Read each point's
``accelerator.predicted_s`` beside its ``wall_seconds`` and correct
``sweep_plan.Assumptions`` from them.

Nothing in CI needs a GPU: ``--toy`` (``tests/test_accelerator_sweep.py``) runs every
stage at toy size on the CPU: the data prepared into a temporary folder, the plan,
theus_gpt2_wiki's ``runlocal`` form (the points' runlocal forms are one model; about
50 s on a busy 2-core machine; ``--settings`` names more), its reports and the archive.
"""

from __future__ import annotations

import time

START = time.perf_counter()  # --budget_s counts from here, before the imports

import importlib.metadata
import importlib.util
import os
import signal
import subprocess
import sys
import tarfile
import tempfile

import jax
from absl import app
from absl import flags
from absl import logging

from attn_symmetry import data
from attn_symmetry import runtime

if not __package__:  # run by path: import the package this file is in, from its own folder
  runtime.import_script_package(__file__)

# pylint: disable=g-import-not-at-top,wrong-import-position  (after the package above)
from experiments.configs import cpu_paper
from experiments.report import committed
from experiments.reproduction import carry
from experiments.reproduction import runner
from experiments.reproduction import sweep_plan
from experiments.setting import config_checks
from experiments.workdir import atomic_io

FLAGS = flags.FLAGS
SCRIPT = os.path.abspath(__file__)
BUNDLE = "accelerator_sweep.tar.gz"
SUMMARY = "sweep.json"
STOP_GRACE_S = 10  # between SIGTERM and SIGKILL of a point still running at the deadline


def _config(setting: str, toy: bool):
  return cpu_paper.get_config(setting + (",runlocal" if toy else ""))


def _finished(results_root: str, setting: str) -> bool:
  """Whether ``results_root/<setting>`` holds a finished GPU run of this script."""
  record = committed.saved_record(results_root, setting)
  return record is not None and not record.get("accelerator", {}).get("toy", True)


# --- one point, in a process of its own -------------------------------------------------------

def run_point(setting: str, *, toy: bool, workdir: str, results_dir: str, budget_s: float,
              predicted_s: float, jobs: int) -> dict:
  """Trains and studies ``setting`` (its ``runlocal`` form with ``toy``) in ``workdir`` on
  this process's default device, and writes the run into ``results_dir``
  (``committed.write_run``: its reports, ``config.json`` and ``run.json``, whose record,
  ``committed.run_record``, adds "device" and "accelerator"); returns the record.

  Raises:
    ValueError: a bad config, or (without ``toy``) no GPU.
  """
  from experiments.study import study
  from experiments.train import trainer

  device = jax.devices()[0]
  if not toy and device.platform != "gpu":
    raise ValueError(f"{setting}: the accelerator sweep needs a GPU, found {device} "
                     "(--toy runs it at toy size on a CPU)")
  config = _config(setting, toy)
  config_checks.validate(config)
  with committed.recording() as recorded:
    trained = trainer.train_and_evaluate(config, workdir)
    study.run_study(config, workdir)
  record = committed.run_record(
      recorded, setting=setting, reduced=False,
      command="python experiments/accelerator_sweep.py" + (" --toy" if toy else ""), jobs=jobs,
      trained=trained,
      device={"kind": device.device_kind, "platform": device.platform,
              "count": jax.device_count()},
      accelerator={"toy": toy, "predicted_s": predicted_s, "budget_s": budget_s,
                   "matmul_precision": jax.config.jax_default_matmul_precision,
                   "assumptions": sweep_plan.Assumptions().__dict__})
  return committed.write_run(results_dir, config, study.reports_folder(workdir), record)


def _point_main(setting: str) -> None:
  jax.config.update("jax_default_matmul_precision", FLAGS.matmul_precision)
  jax.config.update("jax_compilation_cache_dir", os.path.join(FLAGS.workdir_root, "jax_cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # a rerun compiles nothing
  try:
    record = run_point(setting, toy=FLAGS.toy, workdir=os.path.join(FLAGS.workdir_root, setting),
                       results_dir=committed.folder(FLAGS.results, setting),
                       budget_s=FLAGS.budget_s, predicted_s=FLAGS.predicted_s, jobs=FLAGS.jobs)
  except ValueError as e:
    sys.exit(f"FATAL {e}")
  missing = carry.outside(carry.imported_distributions())
  print(f"{setting}: {record['wall_seconds']:.0f} s on {record['device']['kind']}; imports "
        f"outside the GPU image and the carried wheels: {', '.join(missing) or 'none'}",
        flush=True)


# --- the sweep: the plan, the points side by side, the deadline, the archive ------------------

VERSIONS = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "protobuf", "grain",
            "tensorflow-datasets")


def versions() -> dict[str, str | None]:
  """The installed versions of the packages the points' numbers depend on most."""
  out = {}
  for name in VERSIONS:
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      out[name] = None
  return out


def _plan(settings: list[str], toy: bool) -> list[sweep_plan.PointPlan]:
  return sweep_plan.longest_first([sweep_plan.predict(s, _config(s, toy)) for s in settings])


def _bundle(out: str, results_root: str, settings: list[str], log_dir: str) -> str:
  """Writes ``out/BUNDLE`` (atomically): ``results/<setting>/`` of each of ``settings`` and
  every log of ``log_dir`` as ``logs/<name>``."""
  path = os.path.join(out, BUNDLE)
  with tarfile.open(path + ".tmp", "w:gz") as tar:
    for setting in settings:
      tar.add(committed.folder(results_root, setting), arcname=f"results/{setting}")
    for name in sorted(os.listdir(log_dir)) if os.path.isdir(log_dir) else ():
      tar.add(os.path.join(log_dir, name), arcname=f"logs/{name}")
  os.replace(path + ".tmp", path)
  return path


def _stop(process: subprocess.Popen) -> None:
  """SIGTERM to the point's process group, SIGKILL after ``STOP_GRACE_S``."""
  for sig, wait in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, None)):
    try:
      os.killpg(process.pid, sig)
    except ProcessLookupError:
      return
    try:
      process.wait(wait)
      return
    except subprocess.TimeoutExpired:
      continue


def sweep(settings: list[str], *, toy: bool, budget_s: float, jobs: int, results_root: str,
          workdir_root: str, out: str, data_dir: str, redo: bool = False,
          matmul_precision: str = "highest", poll_s: float = 1.0) -> dict:
  """Runs ``settings`` as the module docstring says, stopping what still runs ``budget_s``
  after this script started; returns the summary (``SUMMARY``)."""
  start = START
  plan = _plan(settings, toy)
  done_before = [p.setting for p in plan if not redo and _finished(results_root, p.setting)]
  todo = [p for p in plan if p.setting not in done_before]
  jobs = max(1, min(jobs, len(todo) or 1))
  ends = sweep_plan.makespan(todo, jobs)
  print(f"plan ({'toy, ' if toy else ''}{jobs} at a time, budget {budget_s:.0f} s; "
        "sweep_plan.Assumptions, not measurements):", flush=True)
  for p in plan:
    state = ("done before: skipped" if p.setting in done_before else
             f"predicted {p.predicted_s:.0f} s alone, done at {ends[p.setting]:.0f} s"
             + ("" if ends[p.setting] <= budget_s else " (after the budget: a rerun resumes it)"))
    print(f"  {p.setting}: {p.seeds} seeds, {p.steps} steps of {p.gflop_per_step:.1f} GFLOP, "
          f"{p.pairs} pairs: {state}", flush=True)
  installed = versions()
  print("versions: " + ", ".join(f"{k} {v}" for k, v in installed.items()), flush=True)
  os.makedirs(out, exist_ok=True)
  log_dir = os.path.join(workdir_root, "logs")
  os.makedirs(log_dir, exist_ok=True)
  env = dict(os.environ, **{data.DATA_DIR_ENV: data_dir},
             PYTHONPATH=os.pathsep.join(filter(None, [runner.REPO, os.environ.get("PYTHONPATH")])),
             XLA_PYTHON_CLIENT_PREALLOCATE="false")  # the points share the GPU's memory
  shared = [f"--budget_s={budget_s}", f"--jobs={jobs}", f"--results={results_root}",
            f"--workdir_root={workdir_root}", f"--matmul_precision={matmul_precision}",
            *(["--toy"] if toy else [])]
  states = {s: "done before" for s in done_before}
  walls, pending, running = {}, list(todo), {}
  deadline = start + budget_s
  while pending or running:
    while pending and len(running) < jobs:
      p = pending.pop(0)
      with open(os.path.join(log_dir, p.setting + ".log"), "w") as log_file:
        running[p.setting] = (subprocess.Popen(
            [sys.executable, SCRIPT, f"--point={p.setting}", f"--predicted_s={p.predicted_s}",
             *shared], stdout=log_file, stderr=subprocess.STDOUT, cwd=runner.REPO, env=env,
            start_new_session=True), time.perf_counter())
      print(f"started {p.setting} at {time.perf_counter() - start:.0f} s", flush=True)
    time.sleep(poll_s)
    for setting, (process, began) in list(running.items()):
      if process.poll() is None:
        continue
      del running[setting]
      walls[setting] = round(time.perf_counter() - began, 1)
      states[setting] = "finished" if process.returncode == 0 else f"failed (exit {process.returncode})"
      print(f"{states[setting]}: {setting} after {walls[setting]:.0f} s", flush=True)
      if process.returncode:
        with open(os.path.join(log_dir, setting + ".log")) as f:
          print("".join(f.readlines()[-20:]), flush=True)
      _bundle(out, results_root, [s for s, v in states.items() if v in ("finished", "done before")],
              log_dir)
    if time.perf_counter() >= deadline and (running or pending):
      for setting, (process, began) in running.items():
        _stop(process)
        walls[setting] = round(time.perf_counter() - began, 1)
        states[setting] = "stopped at the budget"
        print(f"stopped {setting} at the budget, after {walls[setting]:.0f} s", flush=True)
      states.update({p.setting: "not started" for p in pending})
      running, pending = {}, []
  finished = [s for s, v in states.items() if v in ("finished", "done before")]
  summary = {"toy": toy, "budget_s": budget_s, "jobs": jobs, "versions": installed,
             "wall_s": round(time.perf_counter() - start, 1),
             "plan": {p.setting: {**p.as_dict(), "predicted_end_s": ends.get(p.setting)}
                      for p in plan},
             "assumptions": sweep_plan.Assumptions().__dict__,
             "points": {s: {"state": states[s], "wall_s": walls.get(s)} for s in settings},
             "remaining": [s for s in settings if s not in finished]}
  _bundle(out, results_root, finished, log_dir)
  atomic_io.write_json(os.path.join(out, SUMMARY), summary, indent=1)
  print(f"sweep: {len(finished)} of {len(settings)} points finished in {summary['wall_s']:.0f} s; "
        f"reports in {results_root}, archive {os.path.join(out, BUNDLE)}"
        + (f"; left: {', '.join(summary['remaining'])} (the same call again resumes them)"
           if summary["remaining"] else ""), flush=True)
  return summary


# --- preparing what travels -------------------------------------------------------------------

def prepare(wheels: bool = True) -> None:
  """Fills ``carry.CARRY_DIR`` with the data (and the wheels) and prints its size."""
  print(f"data: {carry.prepare_data()}", flush=True)
  if wheels:
    files = carry.prepare_wheels()
    print(f"wheels: {len(files)} in {carry.WHEEL_DIR}", flush=True)
  size = carry.folder_bytes(carry.CARRY_DIR)
  print(f"{os.path.relpath(carry.CARRY_DIR, runner.REPO)}: {size / 2 ** 20:.1f} MiB "
        "(name it in the device call's carry)", flush=True)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  if not FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  if FLAGS.point:
    _point_main(FLAGS.point)
    return
  # The sweep's own process checks configs on the CPU and leaves the GPU to the points.
  jax.config.update("jax_platforms", "cpu")
  if FLAGS.prepare:
    try:
      prepare()
    except (ValueError, subprocess.CalledProcessError) as e:
      sys.exit(f"FATAL --prepare: {e}")
    return
  settings = list(dict.fromkeys(FLAGS.settings or (
      [cpu_paper.THEUS] if FLAGS.toy else cpu_paper.ACCELERATOR_ONLY)))
  unknown = sorted(set(settings) - set(cpu_paper.SETTINGS))
  if unknown:
    sys.exit(f"FATAL unknown setting(s) {unknown}; the accelerator's are "
             f"{list(cpu_paper.ACCELERATOR_ONLY)}")
  if FLAGS.budget_s <= 0 or FLAGS.jobs < 1:
    sys.exit(f"FATAL --budget_s must be > 0 and --jobs >= 1, got {FLAGS.budget_s}, {FLAGS.jobs}")
  for setting in settings:
    try:
      config_checks.validate(_config(setting, FLAGS.toy))
    except ValueError as e:
      sys.exit(f"FATAL {setting}: {e}")
  if FLAGS.toy:  # every stage at toy size, in a temporary folder unless told where
    root = FLAGS.out or tempfile.mkdtemp(prefix="accelerator_sweep_toy_")
    data_dir = os.path.join(root, "carry", "data")
    print(f"toy: data in {carry.prepare_data(data_dir)}; wheels --prepare would carry: "
          f"{' '.join(carry.pinned())}", flush=True)
    sweep(settings, toy=True, budget_s=FLAGS.budget_s, jobs=FLAGS.jobs,
          results_root=os.path.join(root, "results"),
          workdir_root=os.path.join(root, "workdir"), out=root, data_dir=data_dir, redo=True,
          matmul_precision=FLAGS.matmul_precision)
    return
  if not os.path.isdir(os.path.join(carry.DATA_DIR, carry.DATASET)):
    sys.exit(f"FATAL {carry.DATA_DIR} holds no {carry.DATASET}: run "
             "python experiments/accelerator_sweep.py --prepare where there is a network, and "
             "name .accelerator in the device call's carry")
  if not FLAGS.out:
    sys.exit("FATAL --out=DIR is required (on the GPU machine: --out=$OUT)")
  sweep(settings, toy=False, budget_s=FLAGS.budget_s, jobs=FLAGS.jobs,
        results_root=FLAGS.results, workdir_root=FLAGS.workdir_root, out=FLAGS.out,
        data_dir=carry.DATA_DIR, redo=FLAGS.redo, matmul_precision=FLAGS.matmul_precision)


def _define_flags() -> None:
  """The command's flags (defined only when run as a script)."""
  flags.DEFINE_bool("prepare", False, "Fill .accelerator/ with the data and the wheels that "
                    "the GPU machine lacks (needs a network), print its size and exit.")
  flags.DEFINE_bool("toy", False, "Every stage at toy size on any device: the data prepared "
                    "into --out (default: a temporary folder), the runlocal forms of the points.")
  flags.DEFINE_list("settings", None, "The points to run (default: every accelerator setting; "
                    "with --toy theus_gpt2_wiki alone: the runlocal forms are one model).")
  flags.DEFINE_float("budget_s", 280.0, "Wall seconds after which the points still running "
                     "are stopped (they resume on a rerun on the same machine).")
  flags.DEFINE_integer("jobs", len(cpu_paper.ACCELERATOR_ONLY), "Points run side by side.")
  flags.DEFINE_string("out", None, "Where accelerator_sweep.tar.gz and sweep.json go.")
  flags.DEFINE_string("results", committed.RESULTS_ROOT,
                      "Where each point's reports go (results/<setting>/).")
  flags.DEFINE_string("workdir_root", os.path.join(tempfile.gettempdir(), "attn_symmetry",
                                                   "accelerator_sweep"),
                      "Each point's workdir, the logs and the compilation cache.")
  flags.DEFINE_bool("redo", False, "Rerun points whose GPU results are already in --results.")
  flags.DEFINE_enum("matmul_precision", "highest", ["default", "high", "highest"],
                    "jax_default_matmul_precision of the points ('default': TensorFloat-32 "
                    "on the GPU).")
  flags.DEFINE_string("point", None, "Internal: run this one point in this process.")
  flags.DEFINE_float("predicted_s", 0.0, "Internal: the plan's prediction of --point.")


if __name__ == "__main__":
  _define_flags()
  app.run(main)
