"""The runs under ``results/``: where each lies, what it holds, written and read in one place.

The layout, spelled here alone:

    results/<setting>/                 a setting's run (``folder``)
      <scope>/results.json             each scope's pairs and statistics (``RESULTS``)
      <scope>/curves.png, ...          its figures (``CURVES``, ``PERMUTATION_CURVES``)
      summary.md                       the tables over scopes (``SUMMARY``)
      config.json                      the config it ran (``CONFIG``)
      run.json                         its record: command, commit, wall time, machine (``RECORD``)
      reduced/, every_core/            its reduced rerun and its run on every core, each a run
                                       of its own in the same layout (``RERUN_FOLDERS``)

The study writes a run's reports (``RESULTS``, the figures, ``SUMMARY``) in this layout into its
workdir (``experiments/study/study.py``); ``write_run`` copies them into the run's folder and
writes ``config.json`` and, last, ``run.json`` (``run_record``, timed by ``recording``), for
``experiments/reproduction/runner.py`` and ``experiments/accelerator_sweep.py`` alike. A folder
holding both ``config.json`` and ``run.json`` is a committed run; one without them holds no
finished run and is passed over. Every report (``results_table``, ``claims``, ``from_data``,
``variants``, ``regime``) and the scheduler's ordering by past wall time read the runs
through ``runs``, ``find`` and ``saved_record``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import platform
import shutil
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax

from attn_symmetry import runtime
from experiments.workdir import atomic_io

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS_ROOT = os.path.join(REPO, "results")  # the committed runs
RECORD, CONFIG, SUMMARY, RESULTS = "run.json", "config.json", "summary.md", "results.json"
CURVES, PERMUTATION_CURVES = "curves.png", "ablation_permutations.png"
# Folders a setting's folder may hold beside its scopes: its reduced rerun's reports, and those
# of its run on every core (another float32 trajectory than the one-core run; reproduce.py).
REDUCED, EVERY_CORE = "reduced", "every_core"
RERUN_FOLDERS = (REDUCED, EVERY_CORE)


# --- where ------------------------------------------------------------------------------------

def folder(results_root: str, setting: str, *, reduced: bool = False,
           one_core: bool = True) -> str:
  """Where a run of ``setting`` lies: ``<results_root>/<setting>``, then ``reduced/`` for its
  reduced form and ``every_core/`` for a run on every core. A run on every core follows
  another float32 trajectory than the committed one-core run, so its reports go beside that
  run's, never over them (results/README.md compares the two)."""
  return os.path.join(results_root, setting, *([REDUCED] if reduced else []),
                      *([] if one_core else [EVERY_CORE]))


def scope_file(scope: str, name: str = RESULTS) -> str:
  """The path of a scope's report ``name`` relative to its run's folder (or to the study's
  report folder, which has the same layout): ``<scope>/<name>``."""
  return f"{scope}/{name}"


# --- writing a run ----------------------------------------------------------------------------

def git_state() -> dict[str, Any]:
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


def machine() -> dict[str, Any]:
  """A record's "machine": the cores there are and those this process may use, the CPU's
  model, the platform, JAX's devices and JAX's version."""
  return {"cpus": os.cpu_count(), "cores_used": _cores_used(), "cpu": _cpu_model(),
          "platform": platform.platform(), "devices": [str(d) for d in jax.devices()],
          "jax": jax.__version__}


@dataclasses.dataclass
class Recording:
  """What ``recording`` noted of a run: when it started (UTC), the code it started from
  (``git_state``), the seconds JAX compiled (``clock``) and, once its block has ended, its wall
  seconds."""
  started: datetime.datetime
  code: dict[str, Any]
  clock: runtime.CompileClock
  seconds: float | None = None


@contextlib.contextmanager
def recording() -> Iterator[Recording]:
  """Times the run that its block holds, for ``run_record``::

      with committed.recording() as recorded:
        trained = trainer.train_and_evaluate(config, workdir)
        study.run_study(config, workdir)
      record = committed.run_record(recorded, setting=..., ...)
  """
  started, start = datetime.datetime.now(datetime.timezone.utc), time.perf_counter()
  recorded = Recording(started, git_state(), runtime.CompileClock())
  with recorded.clock:
    yield recorded
  recorded.seconds = time.perf_counter() - start


def run_record(recorded: Recording, *, setting: str, reduced: bool, command: str, jobs: int,
               trained: Mapping[str, Mapping[str, Any]], **more: Any) -> dict[str, Any]:
  """A run's ``run.json`` record, but for "files" (``write_run`` adds them).

  Args:
    recorded: the run's ``recording``, its block ended.
    setting, reduced: what ran (``reduced``: its reduced form).
    command: the command line that reruns it.
    jobs: how many settings its command ran at the same time (the wall time counts the
      cores they shared).
    trained: each trained run's final metrics, by name (``trainer.train_and_evaluate``).
    **more: further entries (the accelerator sweep's "device" and "accelerator"), after
      "machine".

  Returns:
    {"setting", "reduced", "command", "commit", "uncommitted" (``git_state``; neither outside
    git), "started", "wall_seconds", "jobs", "compile_seconds", "machine" (``machine``),
    **more, "training"}.
  """
  return {"setting": setting, "reduced": reduced, "command": command, **recorded.code,
          "started": recorded.started.isoformat(timespec="seconds"),
          "wall_seconds": round(recorded.seconds, 1), "jobs": jobs,
          "compile_seconds": {k: round(v, 1) for k, v in recorded.clock.seconds.items()},
          "machine": machine(), **more,
          "training": {name: dict(metrics) for name, metrics in trained.items()}}


def write_run(run_folder: str, config, reports: str, record: Mapping[str, Any]) -> dict[str, Any]:
  """Writes a finished run into ``run_folder`` (``folder``): its study's reports, copied from
  the study's report folder ``reports``, then ``config.json`` (``config``, an
  ``ml_collections.ConfigDict``) and last ``run.json``: ``record`` (``run_record``) with
  "files", every file written (relative to ``run_folder``). Files already there are replaced
  only by the run's new ones, each atomically. Returns the record as written."""
  copied = _copy_reports(config.reinit.scopes, reports, run_folder)
  atomic_io.write_text(os.path.join(run_folder, CONFIG), config.to_json(indent=1))
  record = {**record, "files": sorted(copied + [CONFIG, RECORD])}
  atomic_io.write_json(os.path.join(run_folder, RECORD), record, indent=1)
  return record


def _copy_reports(scopes: Sequence[str], source: str, target_folder: str) -> list[str]:
  """Copies every scope's JSON and PNG reports and ``summary.md`` from the study's report
  folder ``source`` to ``target_folder``, each file atomically; returns their relative paths."""
  copied = []
  for scope in scopes:
    for name in sorted(os.listdir(os.path.join(source, scope))):
      if name.endswith((".json", ".png")):
        copied.append(os.path.join(scope, name))
  copied.append(SUMMARY)
  for rel in copied:
    target = os.path.join(target_folder, rel)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    shutil.copyfile(os.path.join(source, rel), target + ".tmp")
    os.replace(target + ".tmp", target)
  return copied


# --- reading runs -----------------------------------------------------------------------------

def _read(path: str) -> Any:
  with open(path, encoding="utf-8") as f:
    return json.load(f)


class Run(NamedTuple):
  """One committed run.

  Attributes:
    setting: the setting of ``experiments/configs/cpu_paper.py`` it ran.
    folder: where it lies (``folder``): ``<results>/<setting>``, or below it ``reduced`` /
      ``every_core``.
  """
  setting: str
  folder: str

  def record(self) -> dict[str, Any]:
    """Its ``run.json``: "command", "commit", "started", "wall_seconds", "machine", ..."""
    return _read(os.path.join(self.folder, RECORD))

  def config(self) -> dict[str, Any]:
    """Its ``config.json``, the config it ran, as a nested dict."""
    return _read(os.path.join(self.folder, CONFIG))

  def scopes(self) -> list[str]:
    """The re-initialisation scopes it studied, in its config's order (``reinit.scopes``)."""
    return list(self.config()["reinit"]["scopes"])

  def results_path(self, scope: str) -> str:
    """Where ``scope``'s ``results.json`` lies."""
    return os.path.join(self.folder, scope_file(scope))

  def summary_path(self) -> str:
    """Where its ``summary.md`` lies."""
    return os.path.join(self.folder, SUMMARY)

  def has(self, scope: str) -> bool:
    """Whether it holds ``scope``'s ``results.json``."""
    return os.path.isfile(self.results_path(scope))

  def results(self, scope: str) -> dict[str, Any]:
    """``scope``'s ``results.json``: "pairs", "methods", "differences", "lambdas", ..."""
    return _read(self.results_path(scope))


def _is_run(run_folder: str) -> bool:
  return all(os.path.isfile(os.path.join(run_folder, f)) for f in (RECORD, CONFIG))


def find(results_root: str, setting: str, rerun: str | None = None) -> Run | None:
  """``setting``'s committed run under ``results_root`` (``rerun``: its run in that folder of
  ``RERUN_FOLDERS`` instead), or None when there is none."""
  if rerun is not None and rerun not in RERUN_FOLDERS:
    raise ValueError(f"rerun {rerun!r} is none of {RERUN_FOLDERS}")
  run_folder = folder(results_root, setting, reduced=rerun == REDUCED,
                      one_core=rerun != EVERY_CORE)
  return Run(setting, run_folder) if _is_run(run_folder) else None


def runs(results_root: str, *, reruns: bool = False) -> list[Run]:
  """Every committed run under ``results_root``, by setting name; ``reruns``: each setting's
  reduced rerun and run on every core too, after its own, where committed."""
  out = []
  for setting in sorted(os.listdir(results_root)):
    for rerun in (None, *(RERUN_FOLDERS if reruns else ())):
      if (run := find(results_root, setting, rerun)) is not None:
        out.append(run)
  return out


def saved_record(results_root: str, setting: str) -> dict[str, Any] | None:
  """``setting``'s ``run.json`` under ``results_root`` even without its config, or None when it
  is missing or unreadable (one that does not parse warns, naming it): for those that only
  look (the scheduler's past wall times, the accelerator sweep's finished points)."""
  record = atomic_io.read_json_or_none(os.path.join(folder(results_root, setting), RECORD),
                                       "run record")
  return record if isinstance(record, dict) else None
