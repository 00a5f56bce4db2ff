"""One setting of ``experiments/reproduce.py``: train and study it, record ``run.json``,
copy its reports into ``results/``.

``run_setting`` trains and studies a variant of ``experiments/configs/cpu_paper.py``
exactly as ``experiments/main.py`` would (same stages, same workdir reuse), then
copies ``summary.md``, every scope's ``results.json`` and figures, the config and
a ``run.json`` (the command, the git commit, wall time, the machine) into the
setting's results folder. ``use_one_core`` pins the process to one core before
JAX starts (``reproduce.py`` says why).
"""

from __future__ import annotations

import datetime
import os
import platform
import shutil
import subprocess
import time
from typing import Any

import jax

from attn_symmetry import runtime
from experiments.configs import cpu_paper
from experiments.report import report
from experiments.setting import config_checks
from experiments.study import study
from experiments.train import trainer
from experiments.workdir import atomic_io

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _git_state() -> dict[str, Any]:
  """{"commit": HEAD, "uncommitted": tracked files that differ from it}, or {} outside git."""
  try:
    run = lambda *args: subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                                       check=True).stdout
    return {"commit": run("rev-parse", "HEAD").strip(),
            "uncommitted": sorted(line[3:] for line in run(
                "status", "--porcelain", "--untracked-files=no").splitlines())}
  except (OSError, subprocess.CalledProcessError):
    return {}


def _cpu_model() -> str:
  """The CPU's model name (Linux's /proc/cpuinfo), else ``platform.processor()``: float32
  training follows another trajectory on another CPU's kernels (results/README.md)."""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor()


def _cores_used() -> int:
  """How many cores this process may run on (its thread pool's size)."""
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def command(setting: str, reduced: bool, one_core: bool = True) -> str:
  """The command line that reruns ``setting``."""
  return (f"python experiments/reproduce.py --setting={setting}"
          + (" --reduced" if reduced else "") + ("" if one_core else " --noone_core"))


def results_dir(results_root: str, setting: str, *, reduced: bool, one_core: bool) -> str:
  """Where a run's reports go: ``<results_root>/<setting>``, then ``reduced/`` for the
  reduced form and ``every_core/`` for a run on every core. A run on every core follows
  another float32 trajectory than the committed one-core run, so its reports go beside
  that run's, never over them (results/README.md compares the two)."""
  return os.path.join(results_root, setting, *([report.REDUCED] if reduced else []),
                      *([] if one_core else [report.EVERY_CORE]))


def workdir(root: str, setting: str, *, reduced: bool) -> str:
  """A setting's workdir under ``root``: ``<root>/<setting>``, ``<setting>_reduced`` for its
  reduced form."""
  return os.path.join(root, setting + ("_reduced" if reduced else ""))


def seed_workdir(root: str, setting: str, *, reduced: bool) -> str | None:
  """Starts a variant of ``cpu_paper.LEARN_VARIANTS`` from its base setting's workdir.

  A variant's training config is its base's, so the fingerprints of a copy of the base's
  workdir reuse every trained run and every study stage whose fields are unchanged (naive's)
  and recompute the rest (the learned method's). When the variant's workdir under ``root``
  is absent and its base's is there, the base's is copied to it (into a temporary folder
  first, renamed when whole). Run the variant after its base has finished: a copy of a
  workdir being written holds its runs as they were.

  Returns:
    The base's workdir when it was copied; None for a setting that is no variant, a variant
    whose workdir exists, or one whose base's workdir does not (it then trains its runs).
  """
  if setting not in cpu_paper.LEARN_VARIANTS:
    return None
  target = workdir(root, setting, reduced=reduced)
  source = workdir(root, cpu_paper.LEARN_VARIANTS[setting][0], reduced=reduced)
  if os.path.exists(target) or not os.path.isdir(source):
    return None
  partial = target + ".copying"
  if os.path.exists(partial):  # an earlier copy that did not finish
    shutil.rmtree(partial)
  shutil.copytree(source, partial)
  os.rename(partial, target)
  return source


def use_one_core(core: int | None = None) -> int | None:
  """Restricts this process to ``core`` (default: the lowest-numbered core it may use) and
  returns it; None where the platform cannot, and this process keeps every core.

  Call it before JAX creates its CPU client (the first ``jax.devices()`` or
  computation), whose thread pool then holds one thread.

  Raises:
    ValueError: ``core`` is not one this process may use.
  """
  if not hasattr(os, "sched_setaffinity"):
    return None
  allowed = os.sched_getaffinity(0)
  if core is None:
    core = min(allowed)
  elif core not in allowed:
    raise ValueError(f"--core={core}: this process may use cores {sorted(allowed)}")
  os.sched_setaffinity(0, {core})
  return core


def run_setting(setting: str, *, reduced: bool, workdir: str, results_dir: str, jobs: int = 1,
                one_core: bool = True) -> dict[str, Any]:
  """Trains and studies ``setting`` in ``workdir`` and copies its reports to ``results_dir``.

  Files already in ``results_dir`` are replaced only by this setting's new reports.

  Args:
    jobs: how many settings the command that started this one ran at the same
      time (recorded: the wall time counts the cores it shared).
    one_core: whether the command pinned this process to one core (recorded in the
      command; ``machine.cores_used`` says how many it used).

  Returns:
    The ``run.json`` record: setting, command, commit, start time, wall
    seconds, the settings run at once, machine, and the copied files
    (relative to ``results_dir``).

  Raises:
    ValueError: an unknown setting or a bad config, before any work.
  """
  if setting not in cpu_paper.SETTINGS:
    raise ValueError(f"unknown setting {setting!r}; choose from {sorted(cpu_paper.SETTINGS)}")
  config = cpu_paper.get_config(setting + (",reduced" if reduced else ""))
  config_checks.validate(config)  # once: the stages see that it was (config_checks.validated)
  started, start = datetime.datetime.now(datetime.timezone.utc), time.perf_counter()
  code = _git_state()  # the code the run starts from
  trainer.log.info("%s: workdir %s", setting, workdir)
  with runtime.CompileClock() as clock:
    trained = trainer.train_and_evaluate(config, workdir)
    study.run_study(config, workdir)
  seconds = time.perf_counter() - start
  trainer.log.info("%s: %s", setting, clock.summary(seconds))
  copied = _copy_reports(config, os.path.join(workdir, "study"), results_dir)
  atomic_io.write_text(os.path.join(results_dir, "config.json"), config.to_json(indent=1))
  record = {"setting": setting, "reduced": reduced, "command": command(setting, reduced, one_core),
            **code, "started": started.isoformat(timespec="seconds"),
            "wall_seconds": round(seconds, 1), "jobs": jobs,
            "compile_seconds": {k: round(v, 1) for k, v in clock.seconds.items()},
            "machine": {"cpus": os.cpu_count(), "cores_used": _cores_used(), "cpu": _cpu_model(),
                        "platform": platform.platform(),
                        "devices": [str(d) for d in jax.devices()], "jax": jax.__version__},
            "training": {name: {k: v for k, v in m.items()} for name, m in trained.items()},
            "files": sorted(copied + ["config.json", "run.json"])}
  atomic_io.write_json(os.path.join(results_dir, "run.json"), record, indent=1)
  return record


def _copy_reports(config, source: str, results_dir: str) -> list[str]:
  """Copies every scope's JSON and PNG reports and ``summary.md`` from the study folder
  ``source`` to ``results_dir``, each file atomically; returns their relative paths."""
  copied = []
  for scope in config.reinit.scopes:
    for name in sorted(os.listdir(os.path.join(source, scope))):
      if name.endswith((".json", ".png")):
        copied.append(os.path.join(scope, name))
  copied.append("summary.md")
  for rel in copied:
    target = os.path.join(results_dir, rel)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    shutil.copyfile(os.path.join(source, rel), target + ".tmp")
    os.replace(target + ".tmp", target)
  return copied
