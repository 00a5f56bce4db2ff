r"""Reruns the CPU-sized settings of the paper's Section 6 and copies their reports to results/.

    python experiments/reproduce.py --setting=table1_vit_mnist_ape      # one setting
    python experiments/reproduce.py --setting=table1_vit_mnist_ape --reduced
    python experiments/reproduce.py --all                               # every setting, in turn
    python experiments/reproduce.py --all --jobs=2                      # two at a time
    python experiments/reproduce.py --setting=lm_gpt2_wiki_full,lm_llama_wiki_full --jobs=2
    python experiments/reproduce.py --list
    python experiments/reproduce.py --table                             # results/README.md's table

A setting is a variant of ``experiments/configs/cpu_paper.py`` (its docstring
describes each); this script trains and studies it exactly as
``experiments/main.py --config=experiments/configs/cpu_paper.py:<setting>``
would (same stages, same workdir reuse), then copies ``summary.md``, every
scope's ``results.json`` and figures, the config and a ``run.json`` (the
command, the git commit, wall time, the machine) into
``results/<setting>/`` (``results/<setting>/reduced/`` with ``--reduced``).
Files already in the target folder are replaced only by this setting's new
reports.

Each setting runs on one CPU core (``use_one_core``), so that its numbers do
not depend on the machine's core count or on what runs beside it: XLA splits
a computation over its process's thread pool, which has one thread per core
the process may use, and another split rounds float32 sums differently
(measured: the reduced ``table1_vit_fashion_ape`` on one core and on two
differ from the base model's first loss on). ``--noone_core`` runs on every
core instead (faster alone, other last digits). ``--jobs=N`` runs N settings
at a time, each in a process of its own on a core of its own, the longest
first (by the wall time of its committed run): on a 2-core machine two
settings at a time finish more settings per hour than one on both cores,
because XLA's CPU code for models this small gains little from a second
thread (``benchmarks/bench_settings_at_once.py``).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
from absl import app
from absl import flags
from absl import logging

from attn_symmetry import runtime
from experiments import atomic_io
from experiments import config_checks
from experiments import report
from experiments import study
from experiments import train
from experiments.configs import cpu_paper

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = flags.FLAGS


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


def command(setting: str, reduced: bool) -> str:
  """The command line that reruns ``setting``."""
  return (f"python experiments/reproduce.py --setting={setting}"
          + (" --reduced" if reduced else ""))


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


def run_setting(setting: str, *, reduced: bool, workdir: str, results_dir: str, jobs: int = 1
                ) -> dict[str, Any]:
  """Trains and studies ``setting`` in ``workdir`` and copies its reports to ``results_dir``.

  Args:
    jobs: how many settings the command that started this one ran at the same
      time (recorded: the wall time counts the cores it shared).

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
  config_checks.validate(config)
  started, start = datetime.datetime.now(datetime.timezone.utc), time.perf_counter()
  code = _git_state()  # the code the run starts from
  train.log.info("%s: workdir %s", setting, workdir)
  with runtime.CompileClock() as clock:
    trained = train.train_and_evaluate(config, workdir)
    study.run_study(config, workdir)
  seconds = time.perf_counter() - start
  train.log.info("%s: %s", setting, clock.summary(seconds))
  copied = []
  source = os.path.join(workdir, "study")
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
  atomic_io.write_text(os.path.join(results_dir, "config.json"), config.to_json(indent=1))
  record = {"setting": setting, "reduced": reduced, "command": command(setting, reduced),
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


def longest_first(settings: list[str], results_root: str) -> list[str]:
  """``settings`` by the wall time of their runs under ``results_root``, longest first; those
  with no run first, in the order given (so that a queue of ``jobs`` lanes ends together)."""
  def seconds(setting: str) -> float:
    record = atomic_io.read_json_or_none(os.path.join(results_root, setting, "run.json"),
                                         "run record")
    return record["wall_seconds"] if isinstance(record, dict) else float("inf")
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
                                          stderr=subprocess.STDOUT, cwd=REPO, env=env),
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


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
  """The length of the union of the ``(start, end)`` intervals: how long at least one ran."""
  total, reach = 0.0, float("-inf")
  for start, end in sorted(intervals):
    if end > reach:
      total += end - max(start, reach)
      reach = end
  return total


_MARK_BEGIN = "<!-- table: written by experiments/reproduce.py --table; do not edit -->"
_MARK_END = "<!-- end of table -->"


def _cell(row: dict[str, Any] | None, key: str) -> str:
  if not row or row.get(key) is None:
    return "n/a"
  ci = row.get(key + "_ci95")
  return f"{row[key]:.1f} ± {row[key + '_std']:.1f}" + ("" if ci is None else f" [±{ci:.1f}]")


def results_table(results_root: str) -> str:
  """Markdown table of every committed setting under ``results_root``: per setting and
  scope, the pairs (and how many have a ratio, when a naive barrier is zero), the naive loss
  barrier, each method's loss barrier as % of naive (mean ± std over pairs [95 % CI
  half-width]), Stage 1's rank and L-hat, the wall time, the commit the run
  started from and its command; then the settings' total and longest wall time."""
  methods = ("perm", "ortho", "full", "learned")
  lines = ["| setting | scope | pairs | naive loss barrier | Variant 1 (%) | Variant 2 (%) | "
           "full (%) | learned (%) | rank of Stage 1 (of 24) | L̂ (%) | wall time | commit | "
           "command |",
           "|" + "---|" * 13]
  minutes, intervals = {}, []
  for setting in sorted(os.listdir(results_root)):
    run_path = os.path.join(results_root, setting, "run.json")
    if not os.path.exists(run_path):
      continue
    with open(run_path) as f:
      run = json.load(f)
    minutes[setting] = run["wall_seconds"] / 60
    start = datetime.datetime.fromisoformat(run["started"]).timestamp()
    intervals.append((start, start + run["wall_seconds"]))
    with open(os.path.join(results_root, setting, "config.json")) as f:
      scopes = json.load(f)["reinit"]["scopes"]
    for scope in scopes:
      with open(os.path.join(results_root, setting, scope, "results.json")) as f:
        res = json.load(f)
      rows = res["methods"]
      naive = rows["naive"]
      abl = res.get("ablation", {}).get("permutations", {}).get("summary")
      rank = "n/a" if not abl else f"{abl['loss_rank_mean']:.2f} ± {abl['loss_rank_std']:.2f}"
      lhat = ("n/a" if not abl or abl["loss_lhat_mean"] is None
              else f"{abl['loss_lhat_mean']:.1f} ± {abl['loss_lhat_std']:.1f}")
      # Pairs whose naive barrier is zero have no ratio (report.ratio_pct): say so.
      with_ratio = sum(report.ratio_pct(1.0, p["methods"]["naive"]["loss_barrier"]) is not None
                       for p in res["pairs"])
      pairs = naive["num_pairs"]
      if with_ratio < pairs:
        pairs = f"{pairs} (ratios over {with_ratio})"
      lines.append(
          f"| {setting} | {scope} | {pairs} | "
          f"{naive['loss_barrier_mean']:.4f} ± {naive['loss_barrier_std']:.4f} | "
          + " | ".join(_cell(rows.get(m), "loss_barrier_ratio_pct") for m in methods)
          + f" | {rank} | {lhat} | {run['wall_seconds'] / 60:.0f} min | {_commit(run)} | "
          f"`{run['command']}` |")
  if minutes:
    longest = max(minutes, key=minutes.get)
    total = round(sum(minutes.values()))
    busy = round(busy_seconds(intervals) / 60)
    lines += ["", f"Wall time of the {len(minutes)} settings above, added up: "
                  f"{total // 60} h {total % 60:02d} min; the longest, {longest}, "
                  f"{minutes[longest]:.0f} min."
                  + ("" if busy >= total else
                     f" Settings that ran at the same time (`run.json`: `jobs`) overlap: the "
                     f"runs above took {busy // 60} h {busy % 60:02d} min of the machines' time.")]
  return "\n".join(lines)


def _commit(run: dict[str, Any]) -> str:
  """The short commit a run started from, marked when tracked files outside ``results/``
  differed from it. Reports under ``results/`` are what runs write, never what they read:
  a setting run after another in the same tree (``--all``) finds the first one's reports
  changed, and its own code is still the commit's."""
  commit, _, edited = run.get("commit", "unknown").partition("+")  # older records: "<sha>+..."
  edited = edited or [path for path in run.get("uncommitted", ())
                      if not path.startswith("results/")]
  return commit[:7] + (" (with edits)" if edited else "")


def write_table(results_root: str) -> str:
  """Replaces the generated table in ``results_root/README.md`` (between its markers)."""
  path = os.path.join(results_root, "README.md")
  with open(path) as f:
    text = f.read()
  if _MARK_BEGIN not in text or _MARK_END not in text:
    raise ValueError(f"{path} has no table markers {_MARK_BEGIN!r} ... {_MARK_END!r}")
  head, rest = text.split(_MARK_BEGIN, 1)
  tail = rest.split(_MARK_END, 1)[1]
  atomic_io.write_text(path, f"{head}{_MARK_BEGIN}\n{results_table(results_root)}\n"
                             f"{_MARK_END}{tail}")
  return path


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  if FLAGS.list:
    print("\n".join(sorted(cpu_paper.SETTINGS)))
    return
  if FLAGS.table:
    print(write_table(FLAGS.results))
    return
  if FLAGS.all == bool(FLAGS.setting):
    sys.exit("FATAL give exactly one of --setting=NAME and --all (--list lists the settings)")
  if not FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  if FLAGS.compilation_cache:
    jax.config.update("jax_compilation_cache_dir", FLAGS.compilation_cache)
  if FLAGS.jobs < 1:
    sys.exit(f"FATAL --jobs must be at least 1, got {FLAGS.jobs}")
  settings = sorted(cpu_paper.SETTINGS) if FLAGS.all else list(dict.fromkeys(FLAGS.setting))
  unknown = sorted(set(settings) - set(cpu_paper.SETTINGS))
  if unknown:
    sys.exit(f"FATAL unknown setting(s) {unknown}; choose from {sorted(cpu_paper.SETTINGS)}")
  if FLAGS.jobs > 1 and len(settings) > 1:
    _run_in_processes(settings)
    return
  try:
    core = use_one_core(FLAGS.core) if FLAGS.one_core else None  # before JAX's CPU client
  except ValueError as e:
    sys.exit(f"FATAL {e}")
  if core is not None:
    print(f"running on core {core} of {os.cpu_count()} (to run on every core: --noone_core)",
          flush=True)
  for setting in settings:
    name = setting + ("_reduced" if FLAGS.reduced else "")
    out = os.path.join(FLAGS.results, setting, *(["reduced"] if FLAGS.reduced else []))
    try:
      record = run_setting(setting, reduced=FLAGS.reduced,
                           workdir=os.path.join(FLAGS.workdir_root, name), results_dir=out,
                           jobs=FLAGS.jobs)
    except ValueError as e:
      sys.exit(f"FATAL {e}")
    print(f"{setting}: {record['wall_seconds']:.0f} s, reports in {out}")
    # Each compiled program holds ~14 memory mappings while JAX caches it; one setting leaves
    # ~10,000, and a process may hold 65,530 (vm.max_map_count): --all would reach it.
    jax.clear_caches()


def _run_in_processes(settings: list[str]) -> None:
  """``settings``, ``FLAGS.jobs`` at a time, each by this script in a process of its own
  (``run_concurrently``), longest first; every config is checked before any starts."""
  variant = ",reduced" if FLAGS.reduced else ""
  for setting in settings:
    try:
      config_checks.validate(cpu_paper.get_config(setting + variant))
    except ValueError as e:
      sys.exit(f"FATAL {setting}: {e}")
  shared = [f"--jobs={FLAGS.jobs}", f"--one_core={FLAGS.one_core}",
            f"--workdir_root={FLAGS.workdir_root}",
            f"--results={FLAGS.results}", f"--compilation_cache={FLAGS.compilation_cache}",
            *(["--reduced"] if FLAGS.reduced else [])]
  commands = [(setting, [sys.executable, os.path.abspath(__file__), f"--setting={setting}",
                         *shared])
              for setting in longest_first(settings, FLAGS.results)]
  start = time.perf_counter()
  # The children import this checkout's code, wherever the package is installed from.
  path = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
  cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
  core_of = ((lambda slot: [f"--core={cores[slot % len(cores)]}"]) if FLAGS.one_core and cores
             else (lambda slot: []))
  status = run_concurrently(commands, jobs=FLAGS.jobs, log_dir=FLAGS.workdir_root,
                            env=dict(os.environ, PYTHONPATH=path), slot_args=core_of)
  failed = sorted(name for name, code in status.items() if code)
  print(f"{len(settings)} settings, {FLAGS.jobs} at a time: "
        f"{(time.perf_counter() - start) / 60:.0f} min")
  if failed:
    sys.exit(f"FATAL {len(failed)} setting(s) failed: {failed}; their logs are in "
             f"{FLAGS.workdir_root}")


def _define_flags() -> None:
  """The command's flags (defined only when run as a script, so that importing this module
  next to ``experiments.main``, as the tests do, defines no flag twice)."""
  flags.DEFINE_list("setting", None, f"One of {sorted(cpu_paper.SETTINGS)}, or several, "
                    "separated by commas (run one after another, or --jobs at a time).")
  flags.DEFINE_bool("all", False, "Run every setting, one after another (see --jobs).")
  flags.DEFINE_bool("one_core", True, "Run each setting on one core, so that its numbers do "
                    "not depend on the core count (--noone_core: on every core, faster alone).")
  flags.DEFINE_integer("core", None, "The core of --one_core (default: the lowest this "
                       "process may use; --jobs gives each setting its own).")
  flags.DEFINE_integer("jobs", 1, "Settings run at the same time (--all, or several "
                       "--setting), each in a process of its own; with --setting, recorded in "
                       "run.json as the number of settings that shared the machine.")
  flags.DEFINE_bool("list", False, "List the settings and exit.")
  flags.DEFINE_bool("table", False, "Rewrite the table of results/README.md from the committed "
                    "results and exit.")
  flags.DEFINE_bool("reduced", False, "The reduced form of the setting (about a minute).")
  flags.DEFINE_string("workdir_root", os.path.join(tempfile.gettempdir(), "attn_symmetry",
                                                   "reproduce"),
                      "Where each setting's workdir (checkpoints, study stages) lives.")
  flags.DEFINE_string("results", os.path.join(REPO, "results"), "Where the reports are copied.")
  flags.DEFINE_string("compilation_cache", os.path.join(tempfile.gettempdir(), "attn_symmetry",
                                                        "jax_cache"),
                      "JAX's persistent compilation cache ('' turns it off).")


if __name__ == "__main__":
  _define_flags()
  app.run(main)
