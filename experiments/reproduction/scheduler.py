"""Several settings of ``experiments/reproduce.py`` at a time (``--jobs``).

``run_settings`` runs each setting in a process of its own, at most ``jobs`` at
once, the longest first (``longest_first``: by the wall time of its committed
run, so that the lanes end together), and gives each running process a core of
its own: on a 2-core machine two settings at a time finish more settings per
hour than one on both cores (``benchmarks/bench_settings_at_once.py``).
``run_concurrently`` is the queue under it.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable

from experiments.report import committed
from experiments.reproduction import runner


def longest_first(settings: list[str], results_root: str) -> list[str]:
  """``settings`` by the wall time of their runs under ``results_root``, longest first; those
  with no run first, in the order given (so that a queue of ``jobs`` lanes ends together)."""
  def seconds(setting: str) -> float:
    record = committed.saved_record(results_root, setting)
    return float("inf") if record is None else record["wall_seconds"]
  return sorted(settings, key=lambda s: -seconds(s))


def run_concurrently(commands: list[tuple[str, list[str]]], *, jobs: int, log_dir: str,
                     env: dict[str, str] | None = None,
                     slot_args: Callable[[int], list[str]] = lambda slot: [],
                     poll_seconds: float = 1.0) -> dict[str, int]:
  """Runs each ``(name, argv)`` in a process of its own, at most ``jobs`` at a time, in the
  order given; a process's output goes to ``log_dir/<name>.log``. One that fails does not
  stop the others.

  Each running process holds one of ``jobs`` slots (0 .. jobs - 1; no two running processes
  hold the same), and ``slot_args(slot)`` is appended to its ``argv``: where it runs (its
  core).

  Returns:
    {name: exit status}, in the order the processes ended.
  """
  os.makedirs(log_dir, exist_ok=True)
  pending, running, status = list(commands), {}, {}
  while pending or running:
    free = sorted(set(range(jobs)) - {slot for _, _, slot in running.values()})
    while pending and free:
      (name, argv), slot = pending.pop(0), free.pop(0)
      log_path = os.path.join(log_dir, name + ".log")
      with open(log_path, "w") as log_file:  # the child holds its own descriptor
        running[name] = (subprocess.Popen([*argv, *slot_args(slot)], stdout=log_file,
                                          stderr=subprocess.STDOUT, cwd=runner.REPO, env=env),
                         time.perf_counter(), slot)
      print(f"started {name} ({len(status) + len(running)} of {len(commands)}; log {log_path})",
            flush=True)
    time.sleep(poll_seconds)
    for name, (process, start, _) in list(running.items()):
      if process.poll() is not None:
        del running[name]
        status[name] = process.returncode
        print(f"{'finished' if process.returncode == 0 else 'FAILED'} {name} after "
              f"{(time.perf_counter() - start) / 60:.0f} min (exit {process.returncode}); "
              f"{len(running)} running, {len(pending)} waiting", flush=True)
  return status


def run_settings(settings: list[str], argv: Callable[[str], list[str]], *, jobs: int,
                 one_core: bool, results_root: str, log_dir: str) -> dict[str, int]:
  """Runs every setting by the command ``argv(setting)`` (a ``reproduce.py`` command line)
  in a process of its own, ``jobs`` at a time, longest first (``longest_first`` over
  ``results_root``); with ``one_core``, each on a core of its own (``--core``).

  The processes import this checkout's code, wherever the package is installed from.

  Returns:
    {setting: exit status}, in the order the processes ended (``run_concurrently``;
    their logs are ``log_dir/<setting>.log``).
  """
  commands = [(setting, argv(setting)) for setting in longest_first(settings, results_root)]
  path = os.pathsep.join(filter(None, [runner.REPO, os.environ.get("PYTHONPATH")]))
  cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
  core_of = ((lambda slot: [f"--core={cores[slot % len(cores)]}"]) if one_core and cores
             else (lambda slot: []))
  return run_concurrently(commands, jobs=jobs, log_dir=log_dir,
                          env=dict(os.environ, PYTHONPATH=path), slot_args=core_of)
