"""One setting of ``experiments/reproduce.py``: train and study it, and write the run into
``results/``.

``run_setting`` trains and studies a variant of ``experiments/configs/cpu_paper.py``
exactly as ``experiments/main.py`` would (same stages, same workdir reuse), then writes
the run into the setting's results folder (``committed.folder``) through
``committed.write_run``: ``summary.md``, every scope's ``results.json`` and figures, the
config and a ``run.json`` (``committed.run_record``: the command, the git commit, wall time,
the machine). ``use_one_core`` pins the process to one core before JAX starts
(``reproduce.py`` says why).
"""

from __future__ import annotations

import os
import shutil
from typing import Any

from experiments.configs import cpu_paper
from experiments.report import committed
from experiments.setting import config_checks
from experiments.study import study
from experiments.train import trainer

REPO = committed.REPO  # the checkout this runs from


def command(setting: str, reduced: bool, one_core: bool = True) -> str:
  """The command line that reruns ``setting``."""
  return (f"python experiments/reproduce.py --setting={setting}"
          + (" --reduced" if reduced else "") + ("" if one_core else " --noone_core"))


def workdir(root: str, setting: str, *, reduced: bool) -> str:
  """A setting's workdir under ``root``: ``<root>/<setting>``, ``<setting>_reduced`` for its
  reduced form."""
  return os.path.join(root, setting + ("_reduced" if reduced else ""))


def seed_workdir(root: str, setting: str, *, reduced: bool) -> str | None:
  """Starts a variant of ``cpu_paper.STUDY_VARIANTS`` from its base setting's workdir.

  A variant's training config is its base's, so the fingerprints of a copy of the base's
  workdir reuse every trained run and every study stage whose fields are unchanged (naive's)
  and recompute the rest (those the variant's fields key). When the variant's workdir under ``root``
  is absent and its base's is there, the base's is copied to it (into a temporary folder
  first, renamed when whole). Run the variant after its base has finished: a copy of a
  workdir being written holds its runs as they were.

  Returns:
    The base's workdir when it was copied; None for a setting that is no variant, a variant
    whose workdir exists, or one whose base's workdir does not (it then trains its runs).
  """
  if setting not in cpu_paper.STUDY_VARIANTS:
    return None
  target = workdir(root, setting, reduced=reduced)
  source = workdir(root, cpu_paper.STUDY_VARIANTS[setting][0], reduced=reduced)
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
  """Trains and studies ``setting`` in ``workdir`` and writes the run into ``results_dir``
  (``committed.folder``; ``committed.write_run``).

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
  trainer.log.info("%s: workdir %s", setting, workdir)
  with committed.recording() as recorded:
    trained = trainer.train_and_evaluate(config, workdir)
    study.run_study(config, workdir)
  trainer.log.info("%s: %s", setting, recorded.clock.summary(recorded.seconds))
  record = committed.run_record(recorded, setting=setting, reduced=reduced,
                                command=command(setting, reduced, one_core), jobs=jobs,
                                trained=trained)
  return committed.write_run(results_dir, config, study.reports_folder(workdir), record)
