"""The committed runs under ``results/``: where each lies and what it holds, read in one place.

``experiments/reproduction/runner.py`` writes a setting's run into ``results/<setting>/``:
each scope's ``<scope>/results.json`` (with its figures), the setting's ``summary.md``, and
last ``config.json`` (the config it ran) and ``run.json`` (the command, the commit, the wall
time, the machine). A folder holding both of the last two is a committed run; one without them
holds no finished run and is passed over. A setting's reduced rerun and its run on every core
are committed runs of their own, in ``<setting>/reduced`` and ``<setting>/every_core``
(``report.RERUN_FOLDERS``).

Every report (``results_table``, ``claims``, ``from_data``, ``learned_variants``, ``regime``)
and the scheduler's ordering by past wall time read the runs through ``runs`` and ``find``.
"""

from __future__ import annotations

import json
import os
from typing import Any, NamedTuple

from experiments.report import report
from experiments.workdir import atomic_io

RECORD, CONFIG = "run.json", "config.json"


def _read(path: str) -> Any:
  with open(path, encoding="utf-8") as f:
    return json.load(f)


class Run(NamedTuple):
  """One committed run.

  Attributes:
    setting: the setting of ``experiments/configs/cpu_paper.py`` it ran.
    folder: where it lies: ``<results>/<setting>``, or below it ``reduced`` / ``every_core``.
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
    return os.path.join(self.folder, scope, "results.json")

  def has(self, scope: str) -> bool:
    """Whether it holds ``scope``'s ``results.json``."""
    return os.path.isfile(self.results_path(scope))

  def results(self, scope: str) -> dict[str, Any]:
    """``scope``'s ``results.json``: "pairs", "methods", "differences", "lambdas", ..."""
    return _read(self.results_path(scope))


def _is_run(folder: str) -> bool:
  return all(os.path.isfile(os.path.join(folder, f)) for f in (RECORD, CONFIG))


def find(results_root: str, setting: str, rerun: str | None = None) -> Run | None:
  """``setting``'s committed run under ``results_root`` (``rerun``: its run in that folder of
  ``report.RERUN_FOLDERS`` instead), or None when there is none."""
  if rerun is not None and rerun not in report.RERUN_FOLDERS:
    raise ValueError(f"rerun {rerun!r} is none of {report.RERUN_FOLDERS}")
  folder = os.path.join(results_root, setting, *([rerun] if rerun else []))
  return Run(setting, folder) if _is_run(folder) else None


def runs(results_root: str, *, reruns: bool = False) -> list[Run]:
  """Every committed run under ``results_root``, by setting name; ``reruns``: each setting's
  reduced rerun and run on every core too, after its own, where committed."""
  out = []
  for setting in sorted(os.listdir(results_root)):
    for rerun in (None, *(report.RERUN_FOLDERS if reruns else ())):
      if (run := find(results_root, setting, rerun)) is not None:
        out.append(run)
  return out


def saved_record(results_root: str, setting: str) -> dict[str, Any] | None:
  """``setting``'s ``run.json`` under ``results_root`` even without its config, or None when it
  is missing or unreadable (one that does not parse warns, naming it): for those that only
  look (the scheduler's past wall times, the accelerator sweep's finished points)."""
  record = atomic_io.read_json_or_none(os.path.join(results_root, setting, RECORD),
                                       "run record")
  return record if isinstance(record, dict) else None
